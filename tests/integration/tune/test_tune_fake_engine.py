"""`deepserve tune` end to end without vLLM: the real launcher, supervisor, benchmark client and tune loop, with the
simulator standing in for vLLM's server behind --engine-python (vllm_serve_as_simulator.py). It honours
--max-num-seqs as a batch cap and refuses --max-num-batched-tokens below --max-model-len, as vLLM's CPU build does."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from deepserve.bench.config import BenchConfig
from deepserve.cli.main import main
from deepserve.config import load_section
from deepserve.engines.config import EngineConfig
from deepserve.results.slo import parse_slo
from deepserve.results.store import ResultsStore
from deepserve.results.sweepdir import load_result_set, read_index
from deepserve.tune.engine import EngineFailed, EnginePointRunner
from deepserve.tune.grid import TunePoint
from tests.helpers import tiny_config_dir

# `serve`'s preflight, which tune runs before each point, checks that vLLM is installed in deepserve's environment
# (the Python 3.10 stage's light virtualenv has none)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed in this environment"
)

FAKE_VLLM = Path(__file__).with_name("vllm_serve_as_simulator.py")


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """An 'interpreter' for the launcher: it runs the simulator with the launcher's arguments."""
    shim = tmp_path / "bin" / "python-fake-vllm"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_VLLM} "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    return shim


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """The tiny model's config.json alone: the launcher and the planner read it; the simulator loads nothing."""
    return tiny_config_dir(tmp_path / "model")


def engines_running(model_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if str(FAKE_VLLM) in cmdline and str(model_dir) in cmdline:
            found.append(proc)
    return found


def tune_args(fake_python: Path, model_dir: Path, out: Path, db: Path) -> list[str]:
    return [
        "tune",
        "--engine-python", str(fake_python),
        "--set", f"model={model_dir}",
        "--set", "served_model_name=fake",
        "--set", "device=cpu",
        "--set", "max_model_len=256",
        "--grid", "max_num_seqs=2,16",
        "--grid", "max_num_batched_tokens=128,512",
        "--max-concurrency", "16",
        "--num-prompts", "32",
        "--random-input-len", "16",
        "--random-output-len", "16",
        "--ignore-eos",
        "--slo", "p99_ttft_ms=400",
        "--out", str(out),
        "--db", str(db),
        "--no-planner",  # the planner knows the tiny model on this CPU, not the simulator's fixed steps
    ]  # fmt: skip


def test_tune_picks_the_larger_batch_records_failures_and_resumes(
    tmp_path: Path, fake_python: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, db = tmp_path / "tune", tmp_path / "results.db"
    assert main(tune_args(fake_python, model_dir, out, db)) == 0
    first = capsys.readouterr().err

    index = read_index(out)
    assert index is not None and index.suite == "tune"
    status = {entry.params["variant"]: entry.status for entry in index.points}
    assert status == {
        "max_num_seqs=2 max_num_batched_tokens=128": "failed",
        "max_num_seqs=2 max_num_batched_tokens=512": "done",
        "max_num_seqs=16 max_num_batched_tokens=128": "failed",
        "max_num_seqs=16 max_num_batched_tokens=512": "done",
    }
    failed = next(entry for entry in index.points if entry.status == "failed")
    assert "exited with code 2" in failed.note  # deepserve's exit code for a configuration it refuses
    assert any("is smaller than max_model_len" in line for line in (failed.model_extra or {})["log_tail"])
    assert index.metadata["best"]["engine"] == "max_num_seqs=16 max_num_batched_tokens=512"
    assert not engines_running(model_dir)

    best = out / "best.yaml"
    config = load_section(EngineConfig, "engine", best)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) == (16, 512, 256)
    assert yaml.safe_load(best.read_text())["engine"]["model"] == str(model_dir)
    assert main(["serve", "--config", str(best), "--dry-run"]) == 0
    assert "--max-num-seqs 16 --max-num-batched-tokens 512" in capsys.readouterr().out

    runs = ResultsStore(db).list_runs(suite="tune")
    assert len(runs) == 2
    result_set = load_result_set(out)
    assert sorted(point.params.variant or "" for point in result_set.points) == [
        "max_num_seqs=16 max_num_batched_tokens=512",
        "max_num_seqs=2 max_num_batched_tokens=512",
    ]
    assert (out / "report" / "report.html").is_file()
    assert "Best:" in first

    # The same command again: every point is kept (the failed ones too), no engine starts.
    assert main(tune_args(fake_python, model_dir, out, db)) == 0
    again = capsys.readouterr().err
    assert again.count("kept (") == 4
    assert "starting the engine" not in again
    assert len(ResultsStore(db).list_runs(suite="tune")) == 2


def test_ctrl_c_during_the_benchmark_stops_the_engine(tmp_path: Path, fake_python: Path, model_dir: Path) -> None:
    def interrupted_bench(config: BenchConfig) -> dict:
        assert engines_running(model_dir), "the engine runs while the benchmark does"
        raise KeyboardInterrupt

    runner = EnginePointRunner(
        [parse_slo("p99_ttft_ms=400")], tmp_path / "logs", python=str(fake_python), bench=interrupted_bench
    )
    config = EngineConfig(model=str(model_dir), served_model_name="fake", device="cpu")
    with pytest.raises(KeyboardInterrupt):
        runner(TunePoint("p", {}, config), BenchConfig())
    assert not engines_running(model_dir)


def test_engine_dying_during_the_benchmark_is_a_failed_point_with_its_log(
    tmp_path: Path, fake_python: Path, model_dir: Path
) -> None:
    def killing_bench(config: BenchConfig) -> dict:
        for proc in engines_running(model_dir):
            os.kill(proc.pid, 9)
            # Dead and waitable, left for its parent (the supervisor, in this process) to reap: WNOWAIT does not
            # reap it. (A psutil status of zombie comes too early for a process with threads: its main thread is a
            # zombie while the others still exit, and until they have, waitpid reports nothing.)
            while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                time.sleep(0.05)
        return {"completed": 0, "failed": 1, "duration": 1.0}

    runner = EnginePointRunner([], tmp_path / "logs", python=str(fake_python), bench=killing_bench)
    config = EngineConfig(model=str(model_dir), served_model_name="fake", device="cpu")
    with pytest.raises(EngineFailed) as failed:
        runner(TunePoint("dies", {}, config), BenchConfig())
    assert "exited with code -9" in str(failed.value)
    assert any("Application startup complete" in line for line in failed.value.log_tail)
    assert failed.value.log_path == tmp_path / "logs" / "dies.log"


def test_the_concurrency_search_brackets_the_batch_cap(tmp_path: Path, fake_python: Path, model_dir: Path) -> None:
    """Batches of 2 requests of about 80 ms: the P99 TTFT at concurrency c is about (c/2 - 1) x 80 ms, so a 400 ms
    SLO holds up to about 10 (timing noise on a shared machine moves the edge, not the bracket's order)."""
    args = tune_args(fake_python, model_dir, tmp_path / "tune", tmp_path / "results.db")
    args[args.index("max_num_seqs=2,16")] = "max_num_seqs=2"
    args[args.index("max_num_batched_tokens=128,512")] = "max_num_batched_tokens=512"
    assert main([*args, "--find-max-concurrency", "--search-steps", "4", "--no-report"]) == 0
    index = read_index(tmp_path / "tune")
    assert index is not None
    result = json.loads((tmp_path / "tune" / (index.points[0].result_file or "")).read_text())
    search = result["tune"]["search"]
    loads = [probe["load"] for probe in search["probes"]]
    assert loads[0] == 16 and len(loads) <= 1 + 4  # the point's own run, then at most 4 more
    assert search["max_load"] is not None and 4 <= search["max_load"] < search["missed_above"] <= 16
    assert index.metadata["best"]["judged_at"].startswith(f"{search['max_load']:g} concurrent requests")
