"""A stand-in for vLLM's server as deepserve's launcher starts it (`python -m deepserve.engines.vllm_cli serve MODEL
…`, the CPU build's `vllm serve`), for tune tests without vLLM: it reads the flags
deepserve's vLLM launcher writes, logs vLLM's start-up markers, then serves the benchmark's fake OpenAI server with
--max-num-seqs as its running-batch cap (requests beyond it wait, as in vLLM's waiting queue). Like vLLM with
chunked prefill off (its CPU build for MLA models), it refuses to start when --max-num-batched-tokens is below
--max-model-len.

The tests put it behind a small executable that the launcher takes as its Python interpreter."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from deepserve.bench.fake_server import FakeScript, serve_raw

TTFT_S = 0.02
ITL_S = 0.004


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", dest="module", required=True)
    parser.add_argument("words", nargs="*")  # serve MODEL
    parser.add_argument("--model", default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    args, _ = parser.parse_known_args()
    if args.module != "deepserve.engines.vllm_cli" or args.words[:1] != ["serve"] or len(args.words) != 2:
        sys.exit(f"fake_vllm: expected -m deepserve.engines.vllm_cli serve MODEL, got {sys.argv[1:]}")
    args.model = args.words[1]
    print(f"INFO Resolved architecture: DeepseekV3ForCausalLM ({args.model})", flush=True)
    print("INFO Loading weights took 0.01 seconds", flush=True)
    tokens, context = args.max_num_batched_tokens, args.max_model_len
    if tokens is not None and context is not None and tokens < context:
        print(
            f"ValueError: max_num_batched_tokens ({tokens}) is smaller than max_model_len ({context}). This "
            "effectively limits the maximum sequence length to max_num_batched_tokens and makes vLLM reject longer "
            "sequences. Please increase max_num_batched_tokens or decrease max_model_len.",
            flush=True,
        )
        sys.exit(1)
    time.sleep(0.2)
    script = FakeScript(
        model=args.served_model_name or args.model, ttft_s=TTFT_S, itl_s=ITL_S, max_running=args.max_num_seqs or 256
    )

    async def run() -> None:
        listener = await serve_raw(script, args.host, args.port)
        print("INFO:     Application startup complete.", flush=True)
        try:
            await asyncio.sleep(600)
        finally:
            listener.close()

    asyncio.run(run())


if __name__ == "__main__":
    main()
