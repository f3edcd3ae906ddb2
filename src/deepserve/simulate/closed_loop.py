"""A benchmark of the simulated engine in virtual time: CONCURRENCY clients, each sending its next request the
moment the last one ended (what `deepserve bench --max-concurrency C` does), measured the way the benchmark
measures (TTFT, TPOT = (E2E - TTFT) / (output - 1), output tokens per second of the whole run).

It runs the same engine as `deepserve simulate` (SteppedEngine) on a ManualClock, so thousands of requests take
a second of CPU and no wall-clock time: the tests and benchmarks/simulate_vs_plan.py compare it with the planner.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from deepserve.engines.config import EngineConfig
from deepserve.simulate.clock import ManualClock
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.core import EngineCore
from deepserve.simulate.engine import SteppedEngine
from deepserve.simulate.scheduler import SimRequest
from deepserve.simulate.setup import build_core, resolve
from deepserve.simulate.tokenizer import BYTE_TOKEN_OFFSET

CLIENT_TURNAROUND_S = 0.001  # from a reply's last token to the next request's arrival: loopback HTTP, client work
PROMPT_TOKENS = range(BYTE_TOKEN_OFFSET + ord("a"), BYTE_TOKEN_OFFSET + ord("z") + 1)


@dataclass(frozen=True)
class ClosedLoopResult:
    concurrency: int
    requests: int
    duration_s: float
    output_throughput_tok_s: float
    mean_ttft_ms: float
    mean_tpot_ms: float
    mean_e2el_ms: float
    steady_ttft_ms: float  # mean TTFT of the requests after each client's first (the opening burst left out)
    mean_running: float  # requests in the running batch, averaged over steps
    preemptions: int

    def to_json(self) -> dict[str, float | int]:
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "duration_s": round(self.duration_s, 3),
            "output_throughput_tok_s": round(self.output_throughput_tok_s, 1),
            "mean_ttft_ms": round(self.mean_ttft_ms, 1),
            "mean_tpot_ms": round(self.mean_tpot_ms, 2),
            "mean_e2el_ms": round(self.mean_e2el_ms, 1),
            "steady_ttft_ms": round(self.steady_ttft_ms, 1),
            "mean_running": round(self.mean_running, 1),
            "preemptions": self.preemptions,
        }


class _Client:
    """Sends its next request when the last one finished, until the run has sent them all."""

    def __init__(self, run: _Run) -> None:
        self.run = run

    def on_tokens(self, request: SimRequest, token_ids: list[int], finish_reason: str | None, now_s: float) -> None:
        if finish_reason is not None:
            self.run.finished(request, now_s)
            run = self.run
            run.clock.call_at(now_s + run.turnaround_s, lambda: run.send(self))


class _Run:
    def __init__(
        self,
        core: EngineCore,
        input_len: int,
        output_len: int,
        num_requests: int,
        seed: int,
        turnaround_s: float,
        output_spread: float,
        input_spread: float = 0.0,
    ) -> None:
        self.clock = ManualClock()
        self.turnaround_s = turnaround_s
        self.output_spread = output_spread
        self.input_spread = input_spread
        self.engine = SteppedEngine(core, self.clock)
        self.input_len = input_len
        self.output_len = output_len
        self.num_requests = num_requests
        self.random = random.Random(seed)
        self.sent = 0
        self.done: list[SimRequest] = []
        self.end_s = 0.0

    def send(self, client: _Client) -> None:
        if self.sent >= self.num_requests:
            return
        prompt_len = self._draw(self.input_len, self.input_spread) if self.input_spread else self.input_len
        prompt = self.random.choices(PROMPT_TOKENS, k=prompt_len)
        output_len = self._draw(self.output_len, self.output_spread)
        request = SimRequest(f"req-{self.sent}", prompt, output_len, ignore_eos=True, sink=client)
        self.sent += 1
        self.engine.submit(request)

    def _draw(self, mean: int, spread: float) -> int:
        """MEAN, or uniformly within MEAN x (1 ± SPREAD)."""
        width = round(mean * spread)
        return self.random.randint(mean - width, mean + width)

    def finished(self, request: SimRequest, now_s: float) -> None:
        self.done.append(request)
        self.end_s = now_s


def run_closed_loop(
    core: EngineCore,
    concurrency: int,
    input_len: int,
    output_len: int,
    num_requests: int,
    seed: int = 0,
    turnaround_s: float = CLIENT_TURNAROUND_S,
    output_spread: float = 0.0,
    input_spread: float = 0.0,
) -> ClosedLoopResult:
    """Random prompts of INPUT_LEN tokens (no shared prefixes); OUTPUT_LEN tokens each (ignore_eos), or uniformly
    within OUTPUT_LEN x (1 ± OUTPUT_SPREAD) (vLLM's --random-range-ratio), and prompts likewise within INPUT_LEN x
    (1 ± INPUT_SPREAD). A client sends its next request
    TURNAROUND_S after its last one ended: a step that starts at that instant does not include it, as in a real
    server, where the engine schedules its next step the moment the last one ends."""
    if output_len * (1 - output_spread) < 2:
        raise ValueError("TPOT needs at least two output tokens per request")
    run = _Run(core, input_len, output_len, num_requests, seed, turnaround_s, output_spread, input_spread)
    for _ in range(min(concurrency, num_requests)):
        run.send(_Client(run))
    run.clock.run_until_idle()
    done = run.done
    if len(done) < num_requests:
        raise RuntimeError(f"only {len(done)} of {num_requests} requests finished")
    ttfts = [(r.first_token_s or 0.0) - r.arrival_s for r in done]
    later = [ttft for r, ttft in zip(done, ttfts, strict=True) if int(r.request_id.split("-")[1]) >= concurrency]
    tpots = [((r.last_token_s or 0.0) - (r.first_token_s or 0.0)) / (len(r.output_token_ids) - 1) for r in done]
    e2els = [(r.last_token_s or 0.0) - r.arrival_s for r in done]
    tokens = sum(len(r.output_token_ids) for r in done)
    return ClosedLoopResult(
        concurrency=concurrency,
        requests=len(done),
        duration_s=run.end_s,
        output_throughput_tok_s=tokens / run.end_s,
        mean_ttft_ms=statistics.fmean(ttfts) * 1e3,
        mean_tpot_ms=statistics.fmean(tpots) * 1e3,
        mean_e2el_ms=statistics.fmean(e2els) * 1e3,
        steady_ttft_ms=statistics.fmean(later or ttfts) * 1e3,
        mean_running=core.scheduled_entries / max(core.steps_started, 1),
        preemptions=core.scheduler.counters.preemptions,
    )


def simulate_closed_loop(
    engine: EngineConfig,
    sim: SimulateConfig,
    concurrency: int,
    input_len: int,
    output_len: int,
    num_requests: int | None = None,
    output_spread: float = 0.0,
) -> ClosedLoopResult:
    """What `deepserve bench --max-concurrency CONCURRENCY` would measure against `deepserve simulate` started with
    ENGINE and SIM, computed in virtual time (about a second of CPU): a guide for engine flags that the analytic
    planner does not see (max_num_batched_tokens, chunked prefill, block size, prefix caching, max_num_seqs)."""
    core = build_core(resolve(engine, sim), sim)
    requests = num_requests or max(4 * concurrency, 8)
    return run_closed_loop(core, concurrency, input_len, output_len, requests, output_spread=output_spread)
