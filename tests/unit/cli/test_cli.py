"""The CLI surface: help, dry run, model facts, and errors printed as one line with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.cli.main import COMMANDS, main
from deepserve.serve import service_plan as service


def test_help_lists_every_subcommand_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"\n    {name} " in out or f"\n    {name}\n" in out, name


def test_serve_dry_run_prints_command_and_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(service, "has_gpu", lambda: False)
    assert main(["serve", "--dry-run", "--port", "8765", "--max-num-seqs", "16", "--", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert "VLLM_CPU_OMP_THREADS_BIND=auto" in out
    assert "-m deepserve.engines.vllm_cli serve " in out  # `vllm serve` through the CPU build's shim
    engine_line = next(line for line in out.splitlines() if "vllm_cli serve" in line)
    gateway_line = out.rstrip().splitlines()[-1]
    assert "--max-num-seqs 16" in engine_line and engine_line.endswith("--seed 7")
    assert "--port 8765" not in engine_line  # the engine hides behind the gateway on an internal port
    assert "deepserve.cli.main gateway" in gateway_line and "--port 8765" in gateway_line


def test_errors_are_one_line_with_exit_code_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(service, "has_gpu", lambda: False)
    assert main(["serve", "--dry-run", "--data-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepserve: error: these flags need a GPU")
    assert "Traceback" not in err


def test_model_show_json_for_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "show", "deepseek-ai/DeepSeek-R1", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["num_layers"] == 61
    assert facts["n_routed_experts"] == 256 and facts["num_experts_per_tok"] == 8
    assert facts["kv_bytes_per_token_bf16"] == 70_272
    assert 670e9 < facts["total_params"] < 672e9


def test_model_show_table_and_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "show", "tiny"]) == 0
    table = capsys.readouterr().out
    assert "deepserve/tiny-deepseek-v3" in table and "KV cache / token" in table
    assert main(["model", "list"]) == 0
    assert "cognitivecomputations/DeepSeek-V3-0324-AWQ" in capsys.readouterr().out


def test_model_tiny_writes_a_checkpoint_that_model_show_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny"
    assert main(["model", "tiny", "--out", str(out)]) == 0
    assert main(["model", "show", str(out), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert facts["model_type"] == "deepseek_v3" and facts["kv_lora_rank"] == 512
