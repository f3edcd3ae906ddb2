"""Slurm: one batch job for one replica. `#SBATCH --nodes` holds the layout's nodes; `srun` starts one task per node,
and each task runs `deepserve serve` with its node rank ($SLURM_NODEID), node 0's address taken from the allocation
(the first host of $SLURM_JOB_NODELIST). Node 0's serve also runs the gateway, as `deepserve serve` always does;
deepserve's roll call between the nodes, and Slurm's --kill-on-bad-exit, end the job when any node goes."""

from __future__ import annotations

import shlex

import yaml

from deepserve.config import changed_fields
from deepserve.deploy.source import MASTER_PLACEHOLDER, DeploySpec, shell_line
from deepserve.engines.config import EngineConfig, serve_command
from deepserve.errors import ConfigError
from deepserve.gateway.config import GatewayConfig, is_loopback

MASTER_VARIABLE = "DEEPSERVE_MASTER_ADDR"
SCRIPT = "deepserve.sbatch"
GATEWAY_CONFIG = "deepserve.yaml"  # the gateway section (limits, keys policy) that node 0's serve reads


def check(spec: DeploySpec) -> None:
    if spec.deploy.disaggregated:
        raise ConfigError(
            "a Slurm job serves one replica of one pool; for prefill and decode pools run one job per pool with "
            "`deepserve serve --role prefill|decode --kv-connector NAME` and a gateway in front of both, or use "
            "--target kubernetes"
        )
    if spec.replicas > 1:
        raise ConfigError(
            f"a Slurm job serves one replica; submit {SCRIPT} {spec.replicas} times (each job's node 0 runs its "
            "own gateway), or use --target kubernetes for replicas behind one gateway"
        )


def serve_config(spec: DeploySpec, rank: int) -> EngineConfig:
    """Node RANK's engine config as its `deepserve serve` takes it: the public API on every interface of node 0 (other
    machines call it), node 0's address from the allocation."""
    config = spec.config
    if is_loopback(config.host):  # other machines call node 0's API
        config = config.model_copy(update={"host": "0.0.0.0"})
    update: dict[str, object] = {}
    if config.is_multi_node:
        update["master_addr"] = MASTER_PLACEHOLDER
    return config.for_node(rank).model_copy(update=update)


def node_lines(spec: DeploySpec) -> list[str]:
    """`deepserve serve` per node rank, as `serve` itself prints them (service.serve_command), node 0's address as
    the shell variable the batch script sets."""
    lines = []
    for rank in range(spec.nodes):
        config = serve_config(spec, rank)
        argv = shlex.split(serve_command(config))
        lines.append(shell_line(argv, {MASTER_PLACEHOLDER: MASTER_VARIABLE}))
    return lines


def gateway_file(gateway: GatewayConfig) -> str | None:
    """The gateway's settings that differ from the defaults, as a config file's `gateway` section (None: none)."""
    changed = changed_fields(gateway, skip=("upstream", "host", "port"))
    return yaml.safe_dump({"gateway": changed}, sort_keys=False) if changed else None


def batch_script(spec: DeploySpec) -> str:
    check(spec)
    case = ['case "${SLURM_NODEID}" in']
    case += [f"  {rank}) exec {line} ;;" for rank, line in enumerate(node_lines(spec))]
    case += ['  *) echo "deepserve: no command for node ${SLURM_NODEID}" >&2; exit 1 ;;', "esac"]
    config_line = (
        f'export DEEPSERVE_CONFIG="${{SLURM_SUBMIT_DIR}}/{GATEWAY_CONFIG}"  # the gateway\'s limits and keys policy\n'
        if gateway_file(spec.gateway)
        else ""
    )
    port = spec.config.port
    return f"""{sbatch_header(spec)}
set -euo pipefail

{environment_lines(spec)}# Node 0 is the first host of the allocation; every node reaches it by address.
head_host="$(scontrol show hostnames "${{SLURM_JOB_NODELIST}}" | head -n 1)"
{MASTER_VARIABLE}="$(getent ahostsv4 "${{head_host}}" | awk 'NR == 1 {{print $1}}')"
export {MASTER_VARIABLE}="${{{MASTER_VARIABLE}:-${{head_host}}}}"
{config_line}echo "deepserve: node 0 is ${{head_host}} (${{{MASTER_VARIABLE}}}); the API will be http://${{{MASTER_VARIABLE}}}:{port}/v1"

# One task per node, each running its node rank's line (SLURM_NODEID is the node's index in the allocation).
read -r -d '' node_script <<'NODE' || true
{chr(10).join(case)}
NODE
{srun_line(spec)} bash -c "${{node_script}}"
"""


def sbatch_header(spec: DeploySpec) -> str:
    options = {
        "job-name": spec.name,
        "nodes": str(spec.nodes),
        "ntasks-per-node": "1",
        "gpus-per-node": str(spec.gpus_per_node),
        "partition": spec.deploy.slurm_partition,
        "time": spec.deploy.slurm_time,
        "account": spec.deploy.slurm_account,
    }
    lines = [f"#SBATCH --{key}={value}" for key, value in options.items() if value]
    return "\n".join([*lines, "#SBATCH --exclusive", f"#SBATCH --output={spec.name}-%j.log"])


def environment_lines(spec: DeploySpec) -> str:
    """The network profile's settings for every node (srun passes the environment on, into containers too)."""
    lines = ["# The network between the nodes: " + spec.network.name]
    if spec.nodes > 1:
        lines += [f"export {key}={shlex.quote(value)}" for key, value in sorted(spec.network.env().items())]
    container = (
        "# deepserve and vLLM's GPU build come with the container image (srun --container-image)."
        if spec.deploy.container_image
        else "# deepserve (with vLLM's GPU build) must be on PATH on every node, e.g.:\n"
        "#   source /shared/deepserve/.venv/bin/activate"
    )
    return "\n".join([*lines, container]) + "\n"


def srun_line(spec: DeploySpec) -> str:
    """One task per node, ending the job when any fails; with --container-image, each in that image (pyxis)."""
    words = [
        "srun",
        f"--nodes={spec.nodes}",
        f"--ntasks={spec.nodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
    if spec.deploy.container_image:
        words.append(f"--container-image={spec.deploy.container_image}")
        if spec.deploy.container_mounts:
            words.append("--container-mounts=" + ",".join(spec.deploy.container_mounts))
        words.append("--container-workdir=${SLURM_SUBMIT_DIR}")
    return " ".join(shlex.quote(word) if "$" not in word else f'"{word}"' for word in words)
