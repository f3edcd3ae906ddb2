"""The engine interface: turn an EngineConfig into the exact command line and environment to run."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from deepserve.engines.config import EngineConfig
from deepserve.engines.metrics import MetricNames
from deepserve.models.resolve import ResolvedModel


@dataclass(frozen=True)
class LaunchSpec:
    """A fully resolved engine launch: what `--dry-run` prints and the supervisor runs."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # only the variables we set, on top of the caller's
    ready_path: str = "/v1/models"
    health_path: str = "/health"  # 200 while the engine is alive (/v1/models keeps answering after it died)
    served_model_name: str = ""
    base_url: str = ""
    # Files the command reads, path → text, written before it starts (TensorRT-LLM's extra LLM-API options YAML).
    files: dict[str, str] = field(default_factory=dict)

    def shell_line(self) -> str:
        env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)

    def write_files(self) -> None:
        for path, text in self.files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)

    def file_writing_lines(self) -> list[str]:
        """Shell lines that write the command's files (a here-document each): what a container or a user on
        another machine runs before the command."""
        lines = []
        for path, text in self.files.items():
            if FILE_MARKER in text.splitlines():
                raise ValueError(f"{path}'s text holds the here-document marker {FILE_MARKER}")
            body = text if text.endswith("\n") else text + "\n"
            parent = shlex.quote(str(Path(path).parent))
            lines.append(f"mkdir -p {parent} && cat > {shlex.quote(path)} <<'{FILE_MARKER}'\n{body}{FILE_MARKER}")
        return lines

    def shell_script(self) -> str:
        """The command as one self-contained script: its files written, then the command (exec'd)."""
        return "\n".join([*self.file_writing_lines(), "exec " + self.shell_line()])


FILE_MARKER = "DEEPSERVE_FILE_END"


# What an engine's memory fraction is a share of: "device", the whole GPU (vLLM, SGLang); "free", what is left once
# the weights are loaded (TensorRT-LLM).
MemoryFractionOf = Literal["device", "free"]


class Engine(Protocol):
    name: str
    package: str  # the Python module whose presence means the engine is installed
    install_hint: str
    image: str  # the engine's official container image, for rendered deployments (`deepserve deploy render`)
    rocm_image: str | None  # its image for AMD GPUs (ROCm); None when the engine has no ROCm build
    metric_names: MetricNames  # its metric names (engines/metrics.py): load, prefix cache, speculative decoding
    memory_fraction_of: MemoryFractionOf  # what EngineConfig.gpu_memory_utilization, passed as its flag, is a share of

    def launch_spec(self, config: EngineConfig, model: ResolvedModel, python: str | None) -> LaunchSpec:
        """The command that runs CONFIG on this node (CONFIG.node_rank of CONFIG.nnodes) under PYTHON; with PYTHON
        None, the command as users type it on a machine where the engine is installed (for printed plans and
        rendered deployment files)."""
        ...

    def phase_of(self, log_line: str) -> str | None:
        """The start-up phase a log line announces, if any (shown as progress while the engine starts)."""
        ...

    def cpu_refusals(self, config: EngineConfig) -> list[str]:
        """The flags of CONFIG this engine cannot run without a GPU, each with why; empty when it can run it."""
        ...


GPU_ONLY_QUANTIZATIONS = {"fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "marlin", "compressed-tensors"}


def gpu_only_flags(config: EngineConfig) -> list[str]:
    """Flags that need a GPU whatever the engine: expert parallelism, GPU memory, quantization kernels."""
    given = []
    if config.enable_expert_parallel:
        given.append("--enable-expert-parallel")
    if config.gpu_memory_utilization is not None:
        given.append(f"--gpu-memory-utilization {config.gpu_memory_utilization} (on CPU use --kv-cache-memory-gib)")
    if config.quantization and config.quantization.lower() in GPU_ONLY_QUANTIZATIONS:
        given.append(f"--quantization {config.quantization}")
    return given


def flag_args(pairs: list[tuple[str, object]]) -> list[str]:
    """Turn (flag, value) pairs into argv: None is omitted, True is a bare flag, False is `--no-flag`."""
    argv: list[str] = []
    for flag, value in pairs:
        if value is None:
            continue
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def unless_one(value: int) -> int | None:
    """Parallel sizes of 1 are the engines' defaults: leave them off the command line."""
    return None if value == 1 else value


def url_host(host: str) -> str:
    """The address a client on this machine uses to reach a server bound to HOST."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
