"""The CLI of `deepserve deploy` and `deepserve cluster`: thin wrappers whose output and errors a user sees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from deepserve.cli.main import main


def test_render_writes_the_targets_files_and_records_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "k8s"
    argv = ["deploy", "render", "--target", "kubernetes", "--out", str(out), "--model", "v3", "--gpu", "h100",
            "--gpus", "16", "--replicas", "2", "--", "--enable-eplb"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "2 node(s) x 8 GPU(s) (TP 8 x PP 2 x DP 1), 2 replica(s)" in printed
    engine = (out / "engine.yaml").read_text()
    assert engine.startswith("# Made by deepserve 0.1.0: deepserve " + " ".join(argv) + "\n")
    lws = next(doc for doc in yaml.safe_load_all(engine) if doc["kind"] == "LeaderWorkerSet")
    script = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["command"][2]
    assert "--node-rank 1" in script and script.rstrip().splitlines()[1].endswith("--enable-eplb ;;")


def test_render_takes_the_gateway_section_of_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "deepserve.yaml"
    config.write_text("engine:\n  model: deepseek-ai/DeepSeek-V3-0324\n  tensor_parallel_size: 8\n"
                      "gateway:\n  max_concurrency: 48\n")  # fmt: skip
    assert main(["deploy", "render", "--target", "compose", "--out", str(tmp_path / "c"), "--config", str(config)]) == 0
    gateway = yaml.safe_load((tmp_path / "c" / "docker-compose.yaml").read_text())["services"]["gateway"]
    words = gateway["entrypoint"]
    assert words[words.index("--max-concurrency") + 1] == "48"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "v3", "--gpu", "h100"], "--gpu and --gpus go together"),
        (["--model", "tiny"], "tiny model"),
        (["--model", "v3", "--gpu", "h100", "--gpus", "8"], "does not fit"),
        (["--model", "v3", "--replicas", "0"], "--replicas 0"),
        (["--model", "v3", "--weights", "fp8"], "--weights chooses the plan's weight format"),
        (["--model", "v3", "--gpu", "h100", "--gpus", "0"], "--gpus 0: give the total number of GPUs"),
        (["--model", "v3", "--gpu", "h100", "--gpus", "16", "--gpu-type", "h200"], "--gpu h100 disagree"),
        (["--model", "v3", "--gpu", "h100", "--gpus", "16", "--nnodes", "3"], "does not split evenly over --nnodes"),
    ],
)
def test_render_errors_are_one_line_with_the_fix(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["deploy", "render", "--target", "slurm", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_render_into_a_directory_it_cannot_write_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    assert main(["deploy", "render", "--target", "slurm", "--out", str(not_a_directory / "x"), "--model", "v3"]) == 2
    assert "choose a writable directory with --out" in capsys.readouterr().err


def test_unknown_target_lists_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["deploy", "render", "--target", "helm", "--out", "x", "--model", "v3"])
    assert "'compose', 'kubernetes', 'slurm'" in capsys.readouterr().err


def test_check_json_lists_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    main(["deploy", "check", "--json"])
    checks = json.loads(capsys.readouterr().out)
    assert len(checks) == 11 and all(set(c) == {"name", "verdict", "detail", "fix"} for c in checks)


def test_cluster_status_fails_fast_when_nothing_listens(capsys: pytest.CaptureFixture[str]) -> None:
    from deepserve.net import free_port

    assert main(["cluster", "status", "--address", f"127.0.0.1:{free_port()}"]) == 2
    assert "nothing answers at 127.0.0.1:" in capsys.readouterr().err


def test_cluster_stop_without_a_node_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "stop"]) == 0
    assert "no Ray node started by deepserve runs here" in capsys.readouterr().out


def test_cluster_start_needs_a_role(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["cluster", "start"])
    assert "one of the arguments --head --address is required" in capsys.readouterr().err
