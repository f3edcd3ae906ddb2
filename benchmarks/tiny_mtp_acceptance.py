"""MTP acceptance on real vLLM (CPU build) for the tiny V3s with an MTP layer, against what the model predicts
(models/tiny/markov.py: simulate_greedy_speculation), for 1, 2 and 3 speculative tokens.

    .venv/bin/python benchmarks/tiny_mtp_acceptance.py [--model tiny-mtp-partial] [--k 1 2 3] [--requests 3]

For each K: one `deepserve serve --model M --no-gateway -- --speculative-config {"method":"mtp",...}`, greedy chat
requests of 48 tokens one after another, vLLM's spec-decode counters differenced over them; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from deepserve.models.tiny import tiny_model
from deepserve.models.tiny.markov import simulate_greedy_speculation
from deepserve.models.tiny.tokenizer import special_token_id
from deepserve.net import free_port

OUTPUT_TOKENS = 48
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def serve(home: Path, model: str, k: int) -> tuple[subprocess.Popen[str], str]:
    speculation = json.dumps({"method": "mtp", "num_speculative_tokens": k})
    command = [sys.executable, "-m", "deepserve.cli.main", "serve", "--model", model, "--no-gateway",
               "--port", str(free_port()), "--", "--speculative-config", speculation]  # fmt: skip
    env = {**os.environ, "DEEPSERVE_HOME": str(home)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("READY "):
            return process, line.split()[1]
    raise SystemExit(f"deepserve serve exited with {process.wait()} before it was ready")


def counters(base_url: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0].removeprefix("vllm:spec_decode_").removesuffix("_total")
        if line.startswith("vllm:spec_decode_") and name in COUNTERS:
            found[name] = found.get(name, 0) + float(line.rsplit(" ", 1)[1])
    return found


def measure(base_url: str, model: str, requests: int) -> dict[str, float]:
    before = counters(base_url)
    for _ in range(requests):
        body = {"model": model, "messages": [{"role": "user", "content": "Count."}], "max_tokens": OUTPUT_TOKENS,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        httpx.post(base_url + "/chat/completions", json=body, timeout=300).raise_for_status()
    after = counters(base_url)
    return {name: after[name] - before.get(name, 0) for name in COUNTERS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-mtp-partial")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--requests", type=int, default=3)
    args = parser.parse_args()
    name = tiny_model(args.model).name
    variant = tiny_model(args.model).mtp
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.k:
            process, base_url = serve(Path(tmp) / "home", args.model, k)
            try:
                measured = measure(base_url, name, args.requests)
            finally:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=120)
            predicted = simulate_greedy_speculation(special_token_id("<｜Assistant｜>"), OUTPUT_TOKENS, k, variant)
            rate = measured["num_accepted_tokens"] / measured["num_draft_tokens"]
            rows.append((k, predicted.acceptance_rate, rate, measured, predicted.drafts * args.requests))
    print(f"{name}: greedy chat, {args.requests} requests of {OUTPUT_TOKENS} tokens per K\n")
    print("| K | predicted acceptance | measured acceptance | drafts (measured / predicted) | accepted tokens |")
    print("|---:|---:|---:|---:|---:|")
    for k, predicted_rate, rate, measured, drafts in rows:
        print(
            f"| {k} | {predicted_rate:.3f} | {rate:.3f} | {measured['num_drafts']:.0f} / {drafts} "
            f"| {measured['num_accepted_tokens']:.0f} |"
        )


if __name__ == "__main__":
    main()
