"""Shared test configuration: every test gets its own DEEPSERVE_HOME, so nothing touches the user's state."""

from __future__ import annotations

import os
import signal
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


def pytest_configure(config: pytest.Config) -> None:
    """A test run started in the background (`./run-tests &`, nohup) inherits SIGINT ignored, and so would every
    `deepserve serve` the tests start: Ctrl-C tests and the services' clean stop on SIGINT would then fail for the
    harness's sake. Take Ctrl-C back as a terminal gives it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tier markers follow the directory: tests/e2e → e2e, tests/integration → integration."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "e2e" in parts:
            item.add_marker(pytest.mark.e2e)
        elif "integration" in parts:
            item.add_marker(pytest.mark.integration)
