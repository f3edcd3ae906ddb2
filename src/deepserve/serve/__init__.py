"""`deepserve serve`: decide (service_plan), then run (run) the engine and the gateway in front of it."""
