"""Recommended engine command lines for a plan, built by the engine launchers themselves (never formatted here)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace

from deepserve.config import changed_fields
from deepserve.engines.config import DEFAULT_KV_CONNECTOR, EngineConfig, Role, serve_command
from deepserve.engines.registry import ENGINES
from deepserve.errors import ConfigError
from deepserve.models.presets import canonical_preset_name, preset_spec
from deepserve.models.resolve import ResolvedModel
from deepserve.models.spec import ModelSpec
from deepserve.plan.formats import checkpoint_format, loads_as, published_export
from deepserve.plan.types import Deployment, PlanConfig

HEAD_NODE_ADDRESS = "HEAD_NODE_IP"  # a placeholder the user replaces with node 0's address
# Model types whose config and model code ship with the engines (transformers/models/deepseek_v2, deepseek_v3,
# deepseek_v32, deepseek_v4; vllm/transformers_utils/config.py registers deepseek_v32, deepseek_v4, deepseek_v41;
# vllm/model_executor/models/deepseek_v2.py serves V2/V3): they load without the repository's own Python code.
NATIVE_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "deepseek_v41"})


@dataclass(frozen=True)
class CheckpointChoice:
    """The checkpoint the plan's commands load, and why when it is not the model named."""

    model: str | None  # None: no checkpoint known to deepserve holds the planned format
    why: str = ""  # empty when the named model loads as planned


@dataclass(frozen=True)
class LaunchLines:
    """The plan's command lines: each engine's, `deepserve serve` per node, `deepserve deploy render`."""

    engines: dict[str, str]
    serve: tuple[str, ...]
    render: str


def checkpoint_to_load(deployment: Deployment, config: PlanConfig) -> CheckpointChoice:
    """The named model where its checkpoint loads as the planned format (its own, or FP8 made from 16-bit while
    loading); else the published export of its weights in that format (an AWQ or NVFP4 repack); else none, since
    serving the named checkpoint would load weights the plan did not size."""
    try:
        stored = checkpoint_format(deployment.spec)
    except ConfigError:
        return CheckpointChoice(config.model)
    asked, name = deployment.fmt, deployment.spec.name
    if loads_as(stored, asked):
        return CheckpointChoice(config.model)
    export = published_export(config.model, asked)
    speculation = deployment.speculation
    method = speculation.method if speculation else None
    if export is not None and method in ("mtp", "dspark") and not preset_spec(export).mtp_params():
        return CheckpointChoice(
            None,
            f"{export}, the export of {name}'s weights in {asked.name}, has no draft module for {method}: plan it "
            "without --speculative-method, or name a checkpoint with --model",
        )
    if export is not None:
        why = f"the commands load {export}, the published export of {name}'s weights in {asked.name}"
        return CheckpointChoice(export, why)
    return CheckpointChoice(
        None,
        f"no checkpoint of {name} stored as {asked.name} is known to deepserve, and the engines would load it as "
        f"stored ({stored.name}): name one with --model, or drop --weights",
    )


def launch_lines(deployment: Deployment, config: PlanConfig, role: Role | None = None) -> LaunchLines:
    """The command lines for the plan, loading the checkpoint `checkpoint_to_load` chooses ("n/a: why" without
    one); with ROLE, the serve lines run one side of a prefill/decode pair."""
    choice = checkpoint_to_load(deployment, config)
    if choice.model is None:
        refused = f"n/a: {choice.why}"
        return LaunchLines(dict.fromkeys(ENGINES, refused), (refused,), refused)
    if choice.model != config.model:  # the export is stored in the planned format: --weights is its own
        config = config.model_copy(update={"model": choice.model, "weights": None})
    engines = engine_commands(deployment, config)
    refused = engines.get(deployment.engine, "")  # the plan's engine cannot run it (TensorRT-LLM across nodes)
    serve = (refused,) if refused.startswith("n/a") else serve_commands(deployment, config, role)
    return LaunchLines(engines, serve, render_command(config))


def needs_remote_code(spec: ModelSpec) -> bool:
    """--trust-remote-code only for a model the engines do not implement themselves: it runs the repository's code."""
    return spec.model_type not in NATIVE_MODEL_TYPES


def engine_config(deployment: Deployment, config: PlanConfig, engine: str) -> EngineConfig:
    """The plan as an EngineConfig for ENGINE (each engine's launcher maps the layout to its own flags)."""
    layout = deployment.layout
    memory = deployment.memory
    speculation = deployment.speculation
    return EngineConfig.model_validate(
        {
            "engine": engine,
            "model": config.model,
            "tensor_parallel_size": layout.tp,
            "pipeline_parallel_size": layout.pp,
            "data_parallel_size": layout.dp,
            "enable_expert_parallel": layout.ep,
            "max_model_len": memory.max_model_len,
            "max_num_seqs": _running_cap_on(deployment, engine),
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "quantization": deployment.fmt.vllm_quantization,
            "kv_cache_dtype": "fp8" if deployment.kv_dtype == "fp8" else None,
            "trust_remote_code": needs_remote_code(deployment.spec),
            "nnodes": deployment.hosts,
            "master_addr": HEAD_NODE_ADDRESS if deployment.hosts > 1 else None,
            # the GPU type picks the platform's settings (ROCm's environment on AMD, TensorRT-LLM's MoE backend)
            "gpu_type": deployment.accelerator.name if deployment.accelerator.vendor != "host" else None,
            "speculative_method": speculation.method if speculation else None,
            "num_speculative_tokens": speculation.num_tokens if speculation else None,
        }
    )


def _running_cap_on(deployment: Deployment, engine: str) -> int | None:
    """--max-num-seqs per rank for ENGINE: the plan's cap, where it comes from the KV cache or the user, is every
    engine's; one that comes from the plan engine's own default or pool (SGLang's for DeepSeek-V4) is that
    engine's only."""
    if engine != deployment.engine:
        deployment = replace(deployment, engine=engine, engine_version=None)
    return deployment.max_num_seqs_per_rank


def engine_commands(deployment: Deployment, config: PlanConfig) -> dict[str, str]:
    """Each engine's command for the plan (preceded by the files it reads, e.g. TensorRT-LLM's options), or why the
    engine cannot run it (TensorRT-LLM on AMD GPUs or across nodes)."""
    source = canonical_preset_name(config.model) or config.model  # the hub id an alias (v4-flash) stands for
    model = ResolvedModel(source=source, served_name=source, on_cpu=False)
    lines = {}
    for name, engine in ENGINES.items():
        try:
            launch = engine.launch_spec(engine_config(deployment, config, name), model, None)
        except ConfigError as exc:
            lines[name] = f"n/a: {exc}"
            continue
        lines[name] = "\n".join([*launch.file_writing_lines(), launch.shell_line()])
    return lines


def serve_commands(deployment: Deployment, config: PlanConfig, role: Role | None = None) -> tuple[str, ...]:
    """The `deepserve serve` line for each node of the plan, on the plan's engine (the one its figures are for),
    node 0 first: the same lines `serve --dry-run` prints, so a plan can be pasted onto the nodes as it is. With
    ROLE, a prefill or decode engine on vLLM's default connector, listening for the gateway in front of the pools."""
    reached = deployment.hosts > 1 or role is not None  # from other machines
    update: dict[str, object] = {"gpu_type": deployment.accelerator.name, "host": "0.0.0.0" if reached else "127.0.0.1"}
    if role is not None:
        update.update(role=role, kv_connector=DEFAULT_KV_CONNECTOR)
    engine = engine_config(deployment, config, deployment.engine).model_copy(update=update)
    return tuple(serve_command(engine.for_node(rank)) for rank in range(deployment.hosts))


# PlanConfig fields and the `deepserve deploy render` flags that carry them; the others (concurrency levels, the SLO,
# prices, calibration) shape only the forecast, not the deployment.
RENDER_FLAGS = {
    "model": "--model",
    "gpu": "--gpu",
    "gpus": "--gpus",
    "nodes": "--nnodes",
    "weights": "--weights",
    "kv_dtype": "--kv-cache-dtype",
    "max_model_len": "--max-model-len",
    "input_len": "--input-len",
    "output_len": "--output-len",
    "engine": "--engine",
    "tp": "--tensor-parallel-size",
    "pp": "--pipeline-parallel-size",
    "dp": "--data-parallel-size",
    "ep": "--enable-expert-parallel",
    "network": "--network",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "speculative_method": "--speculative-method",
    "num_speculative_tokens": "--num-speculative-tokens",
}


def render_command(config: PlanConfig, target: str = "kubernetes", out: str = "deploy") -> str:
    """The `deepserve deploy render` line that deploys what CONFIG plans (render plans it again, the same way)."""
    argv = ["deepserve", "deploy", "render", "--target", target, "--out", out]
    argv += ["--model", config.model, "--gpu", config.gpu, "--gpus", str(config.gpus)]
    for name, value in changed_fields(config, skip=("model", "gpu", "gpus")).items():
        flag = RENDER_FLAGS.get(name)
        if flag is None or value is None:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return shlex.join(argv)
