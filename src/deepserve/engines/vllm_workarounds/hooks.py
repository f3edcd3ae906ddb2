"""Two mechanisms the workarounds share: a fingerprint of vLLM source code read from its files (without importing
vLLM, so `deepserve serve` can check it before starting anything), and a patch applied when a vLLM module is
imported (so a process that never imports the module, e.g. one serving DeepSeek-V3, never pays for importing it)."""

from __future__ import annotations

import ast
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

Patch = Callable[[ModuleType], None]


def vllm_root() -> Path | None:
    """The installed vllm package's directory, found without importing it; None when vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def source_of(root: Path, module: str, qualname: str) -> str:
    """The source text of QUALNAME ("function" or "Class.method") in MODULE ("vllm.a.b"), read from ROOT."""
    path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    text = path.read_text(encoding="utf-8")
    node = _find_definition(ast.parse(text), qualname.split("."))
    if node is None:
        raise LookupError(f"{qualname} not found in {path}")
    return ast.get_source_segment(text, node) or ""


def _find_definition(tree: ast.AST, names: list[str]) -> ast.AST | None:
    body = getattr(tree, "body", [])
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == names[0]:
            return node if len(names) == 1 else _find_definition(node, names[1:])
    return None


def fingerprint(root: Path, sources: Sequence[tuple[str, str]]) -> str:
    """A short hash of the source of every (module, qualname) in SOURCES, in order."""
    digest = hashlib.sha256()
    for module, qualname in sources:
        digest.update(f"{module}:{qualname}\n".encode())
        digest.update(source_of(root, module, qualname).encode())
    return digest.hexdigest()[:16]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs the patches registered for a module right after the module's own code, before anyone imports from it
    (so `from module import name` elsewhere binds the patched name)."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Patch]] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        original = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            for patch in self.pending.pop(fullname, []):
                patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_FINDER = _PatchOnImport()


def patch_when_imported(module: str, patch: Patch) -> None:
    """Apply PATCH to MODULE now if it is imported already, else as soon as it is."""
    if module in sys.modules:
        patch(sys.modules[module])
        return
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _FINDER.pending.setdefault(module, []).append(patch)


def set_attributes(module: ModuleType, **values: object) -> None:
    """Rebind names in a vLLM module (typed code cannot name attributes mypy does not know of)."""
    for name, value in values.items():
        setattr(module, name, value)
