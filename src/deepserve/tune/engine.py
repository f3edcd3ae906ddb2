"""One tune point on the real engine: start it with the point's flags through the same launcher as `deepserve
serve` (engine only, on a free loopback port), run the benchmark against it (and the load search, if asked),
stop it. An engine that fails to start or dies is reported with the tail of its log, for the tune to record."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepserve.bench.config import BenchConfig
from deepserve.bench.runner import run_benchmark
from deepserve.engines.config import EngineConfig
from deepserve.engines.supervisor import ProcessDied, SupervisedProcess
from deepserve.errors import DeepserveError, EngineError
from deepserve.net import free_port
from deepserve.results.slo import Slo
from deepserve.serve.config import ServeConfig
from deepserve.serve.run import started_service
from deepserve.serve.service_plan import ServicePlan, check_can_run, plan_service
from deepserve.sweep.grid import apply_overrides
from deepserve.tune.goodput import check_slos, output_goodput_tok_s
from deepserve.tune.grid import TunePoint
from deepserve.tune.search import Probe, SearchOptions, SearchOutcome, search_max_load

BenchRunner = Callable[[BenchConfig], dict[str, Any]]  # a benchmark config → its result JSON
Progress = Callable[[str], None]
PROBE_SUMMARY_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput")


class EngineFailed(DeepserveError):
    """The engine of a point did not start, or died: recorded as a failed point, and the tune goes on."""

    def __init__(self, message: str, log_tail: Sequence[str] = (), log_path: Path | None = None) -> None:
        super().__init__(message)
        self.log_tail = list(log_tail)
        self.log_path = log_path


@dataclass
class PointRun:
    """What running one point gave."""

    result: dict[str, Any]  # the benchmark's result JSON at the user's load (per-request lists included)
    search: SearchOutcome | None = None
    startup_s: float | None = None
    engine_log: str | None = None
    interrupted: bool = False  # Ctrl-C during the benchmark: the result is partial
    extra: dict[str, Any] = field(default_factory=dict)


PointRunner = Callable[[TunePoint, BenchConfig], PointRun]


def service_plan(config: EngineConfig, python: str = sys.executable) -> ServicePlan:
    """The engine alone (no gateway) on a free loopback port: what each point starts."""
    engine_config = config.model_copy(update={"host": "127.0.0.1", "port": free_port()})
    return plan_service(engine_config, ServeConfig(gateway=False), python=python)


def run_bench_json(config: BenchConfig) -> dict[str, Any]:
    return run_benchmark(config, display=False).to_json()


def probe_from_result(load: float, result: dict[str, Any], slos: Sequence[Slo]) -> Probe:
    checks = check_slos(result, slos)
    summary = {key: result.get(key) for key in PROBE_SUMMARY_KEYS}
    summary.update({check.slo.metric: check.value_ms for check in checks})
    return Probe(
        load=load,
        holds=all(check.holds for check in checks),
        goodput_output_tok_s=output_goodput_tok_s(result, slos),
        output_tok_s=float(result.get("output_throughput") or 0.0),
        summary=summary,
    )


class EnginePointRunner:
    """Runs points on the real engine. PYTHON is the interpreter the launcher starts the engine with (tests give
    one that starts a fake engine); BENCH runs one benchmark (the in-process runner of `deepserve bench`)."""

    def __init__(
        self,
        slos: Sequence[Slo],
        logs_dir: Path,
        search: SearchOptions | None = None,
        python: str = sys.executable,
        progress: Progress = print,
        bench: BenchRunner = run_bench_json,
    ) -> None:
        self.slos = list(slos)
        self.logs_dir = logs_dir
        self.search = search
        self.python = python
        self.progress = progress
        self.bench = bench

    def __call__(self, point: TunePoint, bench: BenchConfig) -> PointRun:
        plan = service_plan(point.config, self.python)
        check_can_run(plan)
        log_file = self.logs_dir / f"{point.point_id}.log"
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log_file.write_text("")  # this start's log only: a retried point's earlier log goes
        began = time.monotonic()
        try:
            with started_service(plan, _PhaseLines(self.progress), log_file) as running:
                ready = time.monotonic()
                self.progress(f"    engine ready after {ready - began:.0f} s ({plan.launch.base_url}); benchmarking")
                run = self._measure(running[0], _aimed_at(bench, plan))
                measured = time.monotonic()
        except ProcessDied as exc:
            raise EngineFailed(_died_words(exc), exc.log_tail, log_file) from exc
        except EngineError as exc:  # not ready in time
            raise EngineFailed(str(exc), _tail(log_file), log_file) from exc
        stopped = time.monotonic()
        run.startup_s, run.engine_log = round(ready - began, 1), str(log_file)
        run.extra["timings_s"] = {
            "startup": round(ready - began, 1),
            "benchmark": round(measured - ready, 1),
            "stop": round(stopped - measured, 1),
        }
        return run

    def _measure(self, engine: SupervisedProcess, bench: BenchConfig) -> PointRun:
        result = self.bench(bench)
        engine.raise_if_died()
        if result.get("incomplete") or self.search is None:
            return PointRun(result, interrupted=bool(result.get("incomplete")))
        outcome = self._search(bench, result)
        engine.raise_if_died()
        return PointRun(result, outcome)

    def _search(self, bench: BenchConfig, result: dict[str, Any]) -> SearchOutcome:
        assert self.search is not None
        options = self.search

        def measure(load: float) -> Probe:
            if options.axis == "request_rate":  # open loop: a client-side limit would hide the queueing
                overrides: dict[str, Any] = {"request_rate": load, "max_concurrency": None}
            else:
                overrides = {"max_concurrency": int(load)}
            probed = self.bench(apply_overrides(bench, overrides))
            if probed.get("incomplete"):
                raise KeyboardInterrupt  # Ctrl-C inside the benchmark: stop the engine, keep the point unfinished
            probe = probe_from_result(load, probed, self.slos)
            self.progress(f"    search: {_load_words(options, load)}: {_probe_words(probe)}")
            return probe

        load = bench.load
        if options.axis == "request_rate":
            start = float(f"{float(result.get('request_throughput') or 0.0):.3g}")
            known = [probe_from_result(load.request_rate, result, self.slos)] if load.max_concurrency is None else []
            return search_max_load(measure, options, max(start, 1e-3), known)
        concurrency = float(load.max_concurrency or result.get("max_concurrency") or 1)
        known = [probe_from_result(concurrency, result, self.slos)]
        ceiling = float(result.get("num_prompts") or concurrency)
        return search_max_load(measure, options, concurrency, known, ceiling)


class _PhaseLines:
    """Engine start-up progress as one line per new phase (a tune runs unattended; its log is read later)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.last = ""

    def __call__(self, phase: str, elapsed_s: float) -> None:
        if phase != self.last:
            self.progress(f"    [{elapsed_s:5.0f} s] {phase}")
            self.last = phase


def _aimed_at(bench: BenchConfig, plan: ServicePlan) -> BenchConfig:
    """BENCH pointed at the point's engine, keeping per-request lists (goodput is counted from them)."""
    target = bench.target.model_copy(update={"base_url": plan.launch.base_url, "model": None})
    output = bench.output.model_copy(update={"save_detailed": True, "disable_tqdm": True})
    return bench.model_copy(update={"target": target, "output": output})


def _died_words(exc: ProcessDied) -> str:
    return f"the engine exited with code {exc.returncode} (log: {exc.log_path})"


def _tail(path: Path, lines: int = 40) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _load_words(options: SearchOptions, load: float) -> str:
    return f"rate {load:g}/s" if options.axis == "request_rate" else f"concurrency {load:g}"


def _probe_words(probe: Probe) -> str:
    verdict = "SLOs hold" if probe.holds else "SLOs missed"
    return f"{verdict}, goodput {probe.goodput_output_tok_s:,.0f} of {probe.output_tok_s:,.0f} output tok/s"
