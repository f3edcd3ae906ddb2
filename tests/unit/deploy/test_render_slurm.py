"""The Slurm batch script for one node and two: its #SBATCH lines match the layout, bash accepts it, and run with
fake srun/scontrol/getent it starts on every node exactly the `deepserve serve` line that serve itself prints for
that node, with node 0's address taken from the allocation."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deepserve.deploy import slurm
from deepserve.deploy.render import render
from deepserve.deploy.source import DeploySpec
from deepserve.engines.config import serve_command
from deepserve.errors import ConfigError
from deepserve.gateway.config import GatewayConfig

HEAD_IP = "10.20.30.40"
# srun as a one-host stand-in: runs the task once per node of --nodes, with SLURM_NODEID set.
FAKE_SRUN = """nodes=1
for arg in "$@"; do case "$arg" in --nodes=*) nodes="${arg#--nodes=}" ;; esac; done
while [ "$1" != bash ]; do shift; done
i=0
while [ "$i" -lt "$nodes" ]; do SLURM_NODEID="$i" "$@" || exit $?; i=$((i + 1)); done
"""


def script_path(spec: DeploySpec, tmp_path: Path) -> Path:
    written = render(spec, "slurm", tmp_path / "job", "job")
    return next(path for path in written if path.suffix == ".sbatch")


def sbatch_options(text: str) -> dict[str, str]:
    options = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH --"):
            name, _, value = line.removeprefix("#SBATCH --").partition("=")
            options[name] = value
    return options


@pytest.mark.parametrize("name", ["one-node", "two-nodes-pp", "two-nodes-dp"])
def test_every_node_runs_its_serve_line(name: str, make: Any, recorder: Any, tmp_path: Path) -> None:
    spec = make(name)
    path = script_path(spec, tmp_path)
    assert subprocess.run(["bash", "-n", str(path)], check=False).returncode == 0
    recorder.programs("deepserve").script("srun", FAKE_SRUN)
    recorder.script("scontrol", 'printf "gpu-node-a\\ngpu-node-b\\n"\n')
    recorder.script("getent", f'echo "{HEAD_IP}      STREAM $2"\n')
    ran = recorder.run(["bash", str(path)], SLURM_JOB_NODELIST="gpu-node-[a-b]", SLURM_SUBMIT_DIR=str(path.parent))
    assert [run["node"] for run in ran] == [str(rank) for rank in range(spec.nodes)]
    for rank, run in enumerate(ran):
        config = slurm.serve_config(spec, rank)
        if config.is_multi_node:
            config = config.model_copy(update={"master_addr": HEAD_IP})
        assert ["deepserve", *run["argv"]] == shlex.split(serve_command(config))
    head = ran[0]["argv"]
    assert head[head.index("--host") + 1] == "0.0.0.0"  # node 0's API is called from other machines
    assert "--no-gateway" not in head  # node 0 runs the gateway, as serve does
    if spec.nodes > 1:
        assert ran[1]["argv"][ran[1]["argv"].index("--node-rank") + 1] == "1"


def test_sbatch_asks_for_the_layouts_nodes_and_gpus(make: Any, tmp_path: Path) -> None:
    spec = make("two-nodes-pp")
    text = script_path(spec, tmp_path).read_text()
    options = sbatch_options(text)
    assert options["nodes"] == "2" and options["gpus-per-node"] == "8" and options["ntasks-per-node"] == "1"
    assert "exclusive" in options
    assert text.startswith(f"#!/bin/bash\n# Made by deepserve 0.1.0: {spec.command}\n")
    assert "#   cd job && sbatch deepserve.sbatch" in text
    assert 'scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1' in text
    assert "--kill-on-bad-exit=1" in text


def test_gateway_settings_travel_in_a_config_file(make: Any, recorder: Any, tmp_path: Path) -> None:
    spec = make("one-node", gateway=GatewayConfig(max_concurrency=32, insecure_open=True))
    path = script_path(spec, tmp_path)
    config = path.parent / slurm.GATEWAY_CONFIG
    assert yaml.safe_load(config.read_text()) == {"gateway": {"insecure_open": True, "max_concurrency": 32}}
    recorder.script("srun", 'while [ "$1" != bash ]; do shift; done\n"$@"\n')
    recorder.script("scontrol", "echo node-a\n").script("getent", f"echo {HEAD_IP} STREAM node-a\n")
    recorder.script("deepserve", 'echo "$DEEPSERVE_CONFIG" > "$RECORD_TO.config"\n')
    recorder.run(["bash", str(path)], SLURM_JOB_NODELIST="node-a", SLURM_SUBMIT_DIR=str(path.parent), SLURM_NODEID="0")
    assert Path(str(recorder.record) + ".config").read_text().strip() == str(config)


def test_default_gateway_writes_no_config_file(make: Any, tmp_path: Path) -> None:
    path = script_path(make("one-node"), tmp_path)
    assert not (path.parent / slurm.GATEWAY_CONFIG).exists()
    assert "DEEPSERVE_CONFIG" not in path.read_text()


def test_one_job_serves_one_replica(make: Any) -> None:
    with pytest.raises(ConfigError, match="submit deepserve.sbatch 2 times"):
        slurm.batch_script(make("one-node", replicas=2))


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_an_unknown_node_id_fails_instead_of_running_something(make: Any, recorder: Any, tmp_path: Path) -> None:
    path = script_path(make("two-nodes-pp"), tmp_path)
    recorder.programs("deepserve").script("srun", 'while [ "$1" != bash ]; do shift; done\nSLURM_NODEID=5 "$@"\n')
    recorder.script("scontrol", "echo a\n").script("getent", "echo 10.0.0.1 STREAM a\n")
    with pytest.raises(AssertionError, match="no command for node 5"):
        recorder.run(["bash", str(path)], SLURM_JOB_NODELIST="a")


def test_partition_time_account_and_a_container_image(make: Any, recorder: Any, tmp_path: Path) -> None:
    image, mount = "nvcr.io#myteam/deepserve-vllm:0.32", "/lustre/hf:/root/.cache/huggingface"
    spec = make("two-nodes-pp", slurm_partition="gpu", slurm_time="2-00:00:00", slurm_account="llm",
                container_image=image, container_mounts=[mount])  # fmt: skip
    path = script_path(spec, tmp_path)
    text = path.read_text()
    options = sbatch_options(text)
    assert (options["partition"], options["time"], options["account"]) == ("gpu", "2-00:00:00", "llm")
    assert subprocess.run(["bash", "-n", str(path)], check=False).returncode == 0
    recorder.programs("deepserve").script("srun", 'echo "$@" > "$RECORD_TO.srun"\n' + FAKE_SRUN)
    recorder.script("scontrol", 'printf "a\\nb\\n"\n').script("getent", f"echo {HEAD_IP} STREAM a\n")
    ran = recorder.run(["bash", str(path)], SLURM_JOB_NODELIST="a,b", SLURM_SUBMIT_DIR=str(path.parent))
    assert len(ran) == 2
    srun = Path(str(recorder.record) + ".srun").read_text()
    assert "--container-image=nvcr.io#myteam/deepserve-vllm:0.32" in srun
    assert "--container-mounts=/lustre/hf:/root/.cache/huggingface" in srun
    assert f"--container-workdir={path.parent}" in srun
    assert "partition" not in sbatch_options(script_path(make("one-node"), tmp_path / "plain").read_text())


def test_every_node_gets_the_network_profile(make: Any, tmp_path: Path) -> None:
    text = script_path(make("two-nodes-pp", network={"network": "roce", "ib_hca": "mlx5"}), tmp_path).read_text()
    assert "export NCCL_IB_HCA=mlx5" in text and "export NCCL_IB_GID_INDEX=3" in text
    assert "NCCL_IB_HCA" not in script_path(make("one-node"), tmp_path / "one").read_text()


def test_prefill_and_decode_pools_are_not_one_job(make: Any) -> None:
    with pytest.raises(ConfigError, match="--role prefill"):
        slurm.batch_script(make("one-node", prefill_replicas=1))
