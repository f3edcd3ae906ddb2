"""The CLI of `deepserve deploy` and `deepserve cluster`: thin wrappers whose output and errors a user sees."""

from __future__ import annotations

import json
import shlex
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


def test_options_of_another_target_are_refused_not_ignored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["deploy", "render", "--target", "compose", "--out", str(tmp_path / "c"), "--model", "v3"]
    assert main([*argv, "--slurm-partition", "gpu"]) == 2
    assert "--target compose has no use for --slurm-partition (slurm)" in capsys.readouterr().err
    slurm = ["deploy", "render", "--target", "slurm", "--out", str(tmp_path / "s"), "--model", "v3"]
    assert main([*slurm, "--engine-api-key"]) == 2
    assert "--engine-api-key (kubernetes or compose)" in capsys.readouterr().err
    assert main([*slurm, "--slurm-partition", "gpu"]) == 0


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
        (["--model", "v3", "--replicas", "0"], "deploy.replicas: Input should be greater than or equal to 1"),
        (["--model", "v3", "--weights", "fp8"], "--weights shape the plan's layout: give them with --gpu and --gpus"),
        (["--model", "v3", "--gpu", "h200", "--gpus", "8", "--weights", "awq-int4"], "stored in fp8"),
        (["--model", "v3", "--gpu-type", "h100"], "the memory plan says this cannot run"),
        (["--model", "v3", "--network", "myrinet"], "unknown network 'myrinet'"),
        (["--model", "v3", "--network", "tcp", "--ib-hca", "mlx5"], "--network tcp does not use"),
        (["--model", "v3", "--name", "Deep_Serve"], "must be a DNS label"),
        (["--model", "v3", "--max-replicas", "4", "--storage-class", "x"], "no use for --storage-class (kubernetes)"),
        (["--model", "v3", "--gpu", "h100", "--gpus", "0"], "--gpus 0: give the total number of GPUs"),
        (["--model", "v3", "--gpu", "h100", "--gpus", "16", "--gpu-type", "h200"], "--gpu h100 disagree"),
        (["--model", "v3", "--gpu", "h100", "--gpus", "16", "--nnodes", "3"], "does not split evenly over --nnodes"),
        (["--model", "v3", "--gpu", "h100", "--gpus", "9"], "--gpus 9 needs 2 nodes of 8 h100-sxm GPUs"),  # no --nnodes
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
    assert len(checks) == 12 and all(set(c) == {"name", "verdict", "detail", "fix"} for c in checks)


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


def test_render_plans_with_the_config_files_workload_and_kv_dtype(tmp_path: Path) -> None:
    """The render line plans exactly what `plan` plans: the `plan` section's lengths, --kv-cache-dtype as the
    plan's KV dtype, the network profile."""
    from deepserve.plan.planner import make_plan
    from deepserve.plan.types import PlanConfig

    config = tmp_path / "deepserve.yaml"
    config.write_text("plan:\n  input_len: 8000\n  output_len: 2000\n")
    out = tmp_path / "k8s"
    argv = ["deploy", "render", "--target", "kubernetes", "--out", str(out), "--config", str(config), "--model", "v3",
            "--gpu", "h200", "--gpus", "8", "--kv-cache-dtype", "fp8", "--network", "roce"]  # fmt: skip
    assert main(argv) == 0
    engine = next(doc for doc in yaml.safe_load_all((out / "engine.yaml").read_text()) if doc["kind"] == "Deployment")
    words = engine["spec"]["template"]["spec"]["containers"][0]["command"]
    plan = make_plan(PlanConfig(model="v3", gpu="h200", gpus=8, input_len=8000, output_len=2000, kv_dtype="fp8",
                                network="roce"))  # fmt: skip
    assert words[words.index("--max-num-seqs") + 1] == str(plan.deployment.max_num_seqs_per_rank)
    assert words[words.index("--kv-cache-dtype") + 1] == "fp8"
    default = make_plan(PlanConfig(model="v3", gpu="h200", gpus=8)).deployment.max_num_seqs_per_rank
    assert default != plan.deployment.max_num_seqs_per_rank  # the lengths and dtype changed the answer


def test_plan_prints_the_render_line_that_renders_the_same_deployment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--model", "v3", "--gpu", "h100", "--gpus", "16", "--tp", "1", "--dp", "16", "--ep",
                 "--input-len", "2000", "--network", "roce", "--concurrency", "1"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    line = next(row for row in printed.splitlines() if "deepserve deploy render" in row)
    words = shlex.split(line[line.index("deepserve deploy render") :])
    out = words.index("--out")
    words[out + 1] = str(tmp_path / "k8s")
    assert main(words[1:]) == 0
    lws = next(
        d for d in yaml.safe_load_all((tmp_path / "k8s" / "engine.yaml").read_text()) if d["kind"] == "LeaderWorkerSet"
    )
    script = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["command"][2]
    assert "--data-parallel-size 16" in script and "--enable-expert-parallel" in script
    assert "NCCL_IB_GID_INDEX" in str(lws)  # the roce profile
