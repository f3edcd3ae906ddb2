"""`deepserve simulate` under the command line deepserve's vLLM launcher writes for the CPU build (`python -m
deepserve.engines.vllm_cli serve MODEL --flags`), for tune tests without vLLM: the tests put this file behind a small
executable that the launcher takes as its Python interpreter. It only translates vLLM's flags and runs the simulator
in this process: engine steps of a fixed STEP_MS with vLLM's scheduler (--max-num-seqs caps the running batch, the
rest wait), and chunked prefill off, as vLLM's CPU build runs MLA models, so that a --max-num-batched-tokens below
--max-model-len is refused at start as vLLM refuses it."""

from __future__ import annotations

import sys

from deepserve.cli.main import main

STEP_MS = 5.0  # a request of 16 prompt and 16 output tokens: one prefill step and 15 decode steps, 80 ms
LAUNCHER_PROGRAM = ["-m", "deepserve.engines.vllm_cli", "serve"]
GIB = 1024**3


def simulate_args(argv: list[str]) -> list[str]:
    """`deepserve simulate` arguments for vLLM's ARGV (after the interpreter)."""
    if argv[:3] != LAUNCHER_PROGRAM or len(argv) < 4 or argv[3].startswith("-"):
        sys.exit(f"vllm_serve_as_simulator: expected -m deepserve.engines.vllm_cli serve MODEL …, got {argv}")
    flags = argv[4:]
    if "--kv-cache-memory-bytes" in flags:  # vLLM's flag; the engine section's is in GiB
        at = flags.index("--kv-cache-memory-bytes")
        flags[at : at + 2] = ["--kv-cache-memory-gib", str(int(flags[at + 1]) / GIB)]
    return ["simulate", "--model", argv[3], *flags, "--fixed-step-ms", str(STEP_MS), "--no-enable-chunked-prefill"]


if __name__ == "__main__":
    sys.exit(main(simulate_args(sys.argv[1:]), commands=("simulate",)))
