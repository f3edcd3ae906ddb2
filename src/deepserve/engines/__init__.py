"""Engine launchers (vLLM, SGLang) behind one interface, and the supervisor that runs them."""
