"""`deepserve tune` on real vLLM (CPU build) with the tiny model: two values of max_num_seqs at concurrency 16. It
starts vLLM twice (about 80 s each here), so the workload is small: 48 prompts, 32 tokens in and out."""

from __future__ import annotations

import json
from pathlib import Path

import psutil

from deepserve.cli.main import main
from deepserve.config import load_section
from deepserve.engines.config import EngineConfig
from deepserve.results.store import ResultsStore


def engines_under(home: Path) -> list[psutil.Process]:
    """vLLM processes serving a model from HOME (this test's own DEEPSERVE_HOME)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(home) in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_tune_over_max_num_seqs_picks_16(tmp_path: Path, isolated_home: Path, capsys) -> None:
    out = tmp_path / "tune"
    command = [
        "tune",
        "--set", "max_model_len=512",
        "--grid", "max_num_seqs=2,16",
        "--max-concurrency", "16",
        "--num-prompts", "48",
        "--random-input-len", "32",
        "--random-output-len", "32",
        "--ignore-eos",
        "--slo", "p99_e2el_ms=120000",  # both hold: the choice is by goodput, and 8x the batch must serve more
        "--out", str(out),
    ]  # fmt: skip
    assert main(command) == 0
    err = capsys.readouterr().err
    assert not engines_under(isolated_home), "every engine the tune started is stopped"

    index = json.loads((out / "index.json").read_text())
    assert [point["status"] for point in index["points"]] == ["done", "done"]
    goodput = {item["engine"]: item["goodput_output_tok_s"] for item in index["metadata"]["scored"]}
    assert goodput["max_num_seqs=16"] > goodput["max_num_seqs=2"]  # by how much depends on the machine's load
    assert index["metadata"]["best"]["engine"] == "max_num_seqs=16"
    for point in index["points"]:
        result = json.loads((out / point["result_file"]).read_text())
        assert result["completed"] == 48 and result["failed"] == 0
        assert result["tune"]["startup_s"] > 0 and Path(result["tune"]["engine_log"]).is_file()
        assert result["tune"]["predicted"]["output_tok_s"] > 0  # the planner's forecast for this host, beside it
        server = result["server_metrics"]
        if server.get("peak_running") is not None:  # vLLM's own count of the running batch
            assert server["peak_running"] <= int(point["params"]["variant"].split("=")[1])

    config = load_section(EngineConfig, "engine", out / "best.yaml")
    assert (config.max_num_seqs, config.max_model_len) == (16, 512)
    assert main(["serve", "--config", str(out / "best.yaml"), "--dry-run"]) == 0
    assert "--max-num-seqs 16" in capsys.readouterr().out
    assert len(ResultsStore().list_runs(suite="tune")) == 2
    html = (out / "report" / "report.html").read_text()
    assert "Tuned points: predicted against measured" in html
    assert "Best: max_num_seqs=16" in err
