"""Recommended engine command lines for a plan, built by the engine launchers themselves (never formatted here)."""

from __future__ import annotations

import shlex

from deepserve.config import changed_flags
from deepserve.engines.config import EngineConfig, serve_command
from deepserve.engines.registry import ENGINES
from deepserve.models.resolve import ResolvedModel
from deepserve.plan.types import Deployment, PlanConfig

HEAD_NODE_ADDRESS = "HEAD_NODE_IP"  # a placeholder the user replaces with node 0's address


def engine_config(deployment: Deployment, config: PlanConfig, engine: str) -> EngineConfig:
    """The plan as an EngineConfig for ENGINE (each engine's launcher maps the layout to its own flags)."""
    layout = deployment.layout
    memory = deployment.memory
    seqs = deployment.max_num_seqs_per_rank if deployment.running_cap else None  # each DP rank applies its own
    return EngineConfig.model_validate(
        {
            "engine": engine,
            "model": config.model,
            "tensor_parallel_size": layout.tp,
            "pipeline_parallel_size": layout.pp,
            "data_parallel_size": layout.dp,
            "enable_expert_parallel": layout.ep,
            "max_model_len": memory.max_model_len,
            "max_num_seqs": max(seqs, 1) if seqs is not None else None,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "quantization": deployment.fmt.vllm_quantization,
            "kv_cache_dtype": "fp8" if deployment.kv_dtype == "fp8" else None,
            "trust_remote_code": True,
            "nnodes": deployment.nodes,
            "master_addr": HEAD_NODE_ADDRESS if deployment.nodes > 1 else None,
        }
    )


def engine_commands(deployment: Deployment, config: PlanConfig) -> dict[str, str]:
    model = ResolvedModel(source=config.model, served_name=config.model, on_cpu=False)
    lines = {}
    for name, engine in ENGINES.items():
        launch = engine.launch_spec(engine_config(deployment, config, name), model, None)
        lines[name] = launch.shell_line()
    return lines


def serve_commands(deployment: Deployment, config: PlanConfig) -> tuple[str, ...]:
    """The `deepserve serve` line for each node of the plan (vLLM), node 0 first: the same lines `serve --dry-run`
    prints, so a plan can be pasted onto the nodes as it is."""
    engine = engine_config(deployment, config, "vllm").model_copy(
        update={"gpu_type": deployment.accelerator.name, "host": "0.0.0.0" if deployment.nodes > 1 else "127.0.0.1"}
    )
    return tuple(serve_command(engine.for_node(rank)) for rank in range(deployment.nodes))


DEPLOY_SKIP = ("extra_args", "node_rank", "master_addr", "host", "trust_remote_code")


def deploy_render_command(deployment: Deployment, config: PlanConfig, target: str = "kubernetes") -> str:
    """The `deepserve deploy render` line that deploys the plan (engine flags as `serve` takes them)."""
    engine = engine_config(deployment, config, config.engine)
    engine = engine.model_copy(update={"gpu_type": deployment.accelerator.name})
    argv = ["deepserve", "deploy", "render", "--target", target, "--out", f"deploy-{target}"]
    return shlex.join([*argv, *changed_flags(engine, skip=DEPLOY_SKIP)])
