"""Recommended engine command lines for a plan, built by the engine launchers themselves (never formatted here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepserve.config import EngineConfig
from deepserve.engines.base import ResolvedModel
from deepserve.engines.registry import ENGINES

if TYPE_CHECKING:
    from deepserve.plan.planner import Deployment, PlanConfig

ENGINE_PYTHON = "python3"


def engine_config(deployment: Deployment, config: PlanConfig, engine: str) -> EngineConfig:
    """The plan as an EngineConfig. SGLang counts data-parallel attention ranks inside its TP size (tp = all
    GPUs of the stage, dp = attention replicas); vLLM counts TP per replica and DP separately."""
    layout = deployment.layout
    tp = layout.tp * layout.dp if engine == "sglang" and layout.ep else layout.tp
    memory = deployment.memory
    seqs = deployment.running_cap // layout.pp if deployment.running_cap else None
    return EngineConfig.model_validate(
        {
            "engine": "sglang" if engine == "sglang" else "vllm",
            "model": config.model,
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": layout.pp,
            "data_parallel_size": layout.dp,
            "enable_expert_parallel": layout.ep,
            "max_model_len": memory.max_model_len,
            "max_num_seqs": max(seqs, 1) if seqs is not None else None,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "quantization": deployment.fmt.vllm_quantization,
            "kv_cache_dtype": "fp8" if deployment.kv_dtype == "fp8" else None,
            "trust_remote_code": True,
            "extra_args": _multi_node_args(deployment, engine),
        }
    )


def _multi_node_args(deployment: Deployment, engine: str) -> list[str]:
    """SGLang starts one process per node and needs to know which; vLLM's head process finds the others through a
    Ray cluster started beforehand, so its command line is the same on one node or several."""
    if engine != "sglang" or deployment.nodes == 1:
        return []
    return ["--nnodes", str(deployment.nodes), "--node-rank", "0", "--dist-init-addr", "HEAD_NODE_IP:5000"]


def engine_commands(deployment: Deployment, config: PlanConfig) -> dict[str, str]:
    model = ResolvedModel(source=config.model, served_name=config.model, on_cpu=False)
    lines = {}
    for name, engine in ENGINES.items():
        launch = engine.launch_spec(engine_config(deployment, config, name), model, ENGINE_PYTHON)
        lines[name] = launch.shell_line()
    return lines
