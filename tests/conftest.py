"""Shared test configuration: every test gets its own DEEPSERVE_HOME, so nothing touches the user's state."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    home = tmp_path / "deepserve-home"
    monkeypatch.setenv("DEEPSERVE_HOME", str(home))
    for key in list(os.environ):
        if key.startswith("DEEPSERVE_") and key != "DEEPSERVE_HOME":
            monkeypatch.delenv(key)
    yield home


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tier markers follow the directory: tests/e2e → e2e, tests/integration → integration."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "e2e" in parts:
            item.add_marker(pytest.mark.e2e)
        elif "integration" in parts:
            item.add_marker(pytest.mark.integration)
