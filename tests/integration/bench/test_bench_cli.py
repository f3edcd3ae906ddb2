"""`deepserve bench` as users run it: vLLM's flags, the simulator in its own process, Ctrl-C mid-run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deepserve.cli.main import main
from tests.helpers import start_simulator

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def simulator_url() -> Iterator[str]:
    """`deepserve simulate` with fixed timings (slow stream: 40 ms per token, each write logged) in its own process;
    yields its root URL."""
    server = start_simulator("--fixed-itl-ms", "40", "--log-sends", "--max-seconds", "170")
    yield server.root_url
    server.stop()


def vllm_flags(base_url: str, result_dir: Path, num_prompts: int, output_len: int) -> list[str]:
    return [
        "--base-url", base_url, "--endpoint", "/v1/completions", "--dataset-name", "random",
        "--random-input-len", "16", "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
        "--max-concurrency", "2", "--ignore-eos", "--seed", "1", "--result-dir", str(result_dir),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
    ]  # fmt: skip


def test_vllm_command_line_runs_and_saves_vllm_keys(simulator_url, tmp_path, capsys):
    flags = vllm_flags(simulator_url, tmp_path, num_prompts=4, output_len=3)
    code = main(["bench", *flags, "--save-result", "--result-filename", "r.json", "--save-records", "csv"])
    out = capsys.readouterr().out
    assert code == 0
    assert "============ Serving Benchmark Result ============" in out
    assert "P50 TTFT (ms):" in out and "P75 ITL (ms):" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert (data["completed"], data["total_output_tokens"]) == (4, 12)
    assert data["p50_ttft_ms"] > 0 and data["workload"]["dataset"] == "random"
    assert data["tokenizer_source"].startswith("server:")  # the simulator's /tokenize
    assert data["command_line"][0] == "deepserve"
    assert (tmp_path / "r.records.csv").read_text().count("\n") == 5


def test_bad_flags_fail_before_the_run(simulator_url, tmp_path, capsys):
    assert main(["bench", "--base-url", simulator_url, "--goodput", "latency:5"]) == 2
    assert "goodput SLO" in capsys.readouterr().err
    assert main(["bench", "--base-url", simulator_url, "--model", "other"]) == 2
    assert "unknown model 'other'" in capsys.readouterr().err


def test_ctrl_c_writes_partial_results_marked_incomplete(simulator_url, tmp_path):
    flags = vllm_flags(simulator_url, tmp_path, num_prompts=20, output_len=100)  # 20 x 4 s at concurrency 2: 40 s
    command = [sys.executable, "-m", "deepserve.cli.main", "bench", *flags, "--result-filename", "partial.json"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # wait until the measured run has finished a couple of requests
            log = httpx.get(simulator_url + "/simulate/sends", timeout=5).json()
            if sum(len(entry["sends_s"]) >= 100 for entry in log.values()) >= 2:
                break
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err
    assert "INCOMPLETE" in out
    data = json.loads((tmp_path / "partial.json").read_text())
    assert data["incomplete"] is True
    assert 2 <= data["completed"] < 20
    assert data["failed"] == 0  # in-flight requests were dropped, not counted as failures
