"""The layer order of docs/ARCHITECTURE.md holds in the code: no package imports one above it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "deepserve"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def documented_layers() -> dict[str, int]:
    """Package -> layer number, from the table of docs/ARCHITECTURE.md."""
    layers: dict[str, int] = {}
    for line in ARCHITECTURE.read_text().splitlines():
        match = re.match(r"\|\s*(\d+)\s*\|([^|]+)\|", line)
        if match:
            for name in re.findall(r"`(\w+)`", match.group(2)):
                layers[name] = int(match.group(1))
    return layers


def layer_of_module(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    if relative.name == "__main__.py":
        return "cli"  # an entry point: `python -m deepserve.X` runs the CLI
    return relative.parts[0].removesuffix(".py")


def is_module(name: str) -> bool:
    """`from deepserve import X`: X is a module or package (else a name such as __version__)."""
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deepserve."):
            modules = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.module == "deepserve":
            modules = [f"deepserve.{alias.name}" for alias in node.names if is_module(alias.name)]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names if alias.name.startswith("deepserve.")]
        else:
            continue
        found |= {module.split(".")[1] for module in modules}
    return found


def test_every_package_has_a_documented_layer() -> None:
    layers = documented_layers()
    packages = {layer_of_module(path) for path in PACKAGE.rglob("*.py")} - {"__init__"}
    assert packages - set(layers) == set(), "add these packages to the table in docs/ARCHITECTURE.md"
    assert set(layers) - packages == set(), "the table in docs/ARCHITECTURE.md names packages that do not exist"


def test_no_package_imports_a_layer_above_it() -> None:
    layers = documented_layers()
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = layer_of_module(path)
        if source == "__init__":
            continue
        for target in imported_packages(path) - {source}:
            if layers[target] > layers[source] or (layers[target] == layers[source] and layers[source] != 0):
                upward.append(
                    f"{path.relative_to(PACKAGE)} ({source}, layer {layers[source]}) imports {target} "
                    f"(layer {layers[target]})"
                )
    assert upward == [], "imports against docs/ARCHITECTURE.md's layer order:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from deepserve.cli.main import main\n    from deepserve import report\n")
    assert imported_packages(module) == {"cli", "report"}
