"""Run a child (the engine, or the gateway in front of it) under supervision: its own process group, a log file,
start-up phases, readiness, and a stop that leaves nothing running (vLLM forks an engine-core and worker
processes; all of them go)."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from deepserve._compat import own_process_group
from deepserve.engines.base import LaunchSpec
from deepserve.errors import EngineError

LOG_TAIL_LINES = 40


PhaseReader = Callable[[str], "str | None"]


class ProcessDied(EngineError):
    """A supervised child exited on its own. Carries the last lines of its log."""

    def __init__(self, name: str, returncode: int | None, log_tail: list[str], log_path: Path, hint: str) -> None:
        self.returncode = returncode
        self.log_tail = log_tail
        self.log_path = log_path
        tail = "\n".join("  | " + line for line in log_tail)
        super().__init__(f"the {name} exited with code {returncode}. Last lines of {log_path}:\n{tail}\nhint: {hint}")


class SupervisedProcess:
    """One child process. Use as a context manager so that it is always stopped."""

    def __init__(self, name: str, spec: LaunchSpec, phase_of: PhaseReader, log_path: Path) -> None:
        self.name = name
        self.spec = spec
        self.phase_of = phase_of
        self.log_path = log_path
        self.phase = "launching"
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.spec.write_files()  # e.g. TensorRT-LLM's options file, which its command line names
        self._proc = subprocess.Popen(
            self.spec.argv,
            env={**os.environ, **self.spec.env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            **own_process_group(),  # a terminal's Ctrl-C reaches us, and we stop it
        )
        self._reader = threading.Thread(target=self._pump_log, name=f"{self.name}-log", daemon=True)
        self._reader.start()

    def wait_ready(
        self,
        timeout_s: float,
        on_progress: Callable[[str, float], None] | None = None,
        check: Callable[[float], None] | None = None,
    ) -> float:
        """Block until the child answers its ready path; return the seconds it took. CHECK(elapsed_s) runs on every
        poll and may raise to give up early (e.g. a node that never joined)."""
        url = self.spec.base_url.removesuffix("/v1") + self.spec.ready_path
        with httpx.Client(timeout=2.0) as client:
            return self.wait_until(lambda: _answers(client, url), timeout_s, on_progress, check)

    def wait_until(
        self,
        is_ready: Callable[[], bool],
        timeout_s: float,
        on_progress: Callable[[str, float], None] | None = None,
        check: Callable[[float], None] | None = None,
    ) -> float:
        """Block until IS_READY() holds, showing the start-up phase; raise if the child dies or TIMEOUT_S passes."""
        started = time.monotonic()
        while True:
            elapsed = time.monotonic() - started
            self.raise_if_died()
            if check:
                check(elapsed)
            if on_progress:
                on_progress(self.phase, elapsed)
            if is_ready():
                return elapsed
            if elapsed > timeout_s:
                raise EngineError(
                    f"the {self.name} was not ready after {timeout_s:.0f} s (last phase: {self.phase}); "
                    f"see {self.log_path}, or raise --startup-timeout-s"
                )
            time.sleep(0.5)

    def raise_if_died(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            if self._reader:
                self._reader.join(timeout=2)
            raise ProcessDied(self.name, self._proc.returncode, list(self._tail), self.log_path, self._hint())

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the whole tree, wait up to GRACE_S, then SIGKILL whatever is left."""
        if self._proc is None:
            return
        tree = self._process_tree()
        _signal_group(self._proc.pid, signal.SIGTERM)
        for proc in tree:
            _signal_process(proc, signal.SIGTERM)
        _, alive = psutil.wait_procs(tree, timeout=grace_s)
        for proc in alive:
            _signal_process(proc, signal.SIGKILL)
        _signal_group(self._proc.pid, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
        self._proc.wait(timeout=5)
        if self._reader:
            self._reader.join(timeout=2)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def log_tail(self) -> list[str]:
        return list(self._tail)

    def __enter__(self) -> SupervisedProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- internals --------------------------------------------------------------------------------------------------

    def _process_tree(self) -> list[psutil.Process]:
        assert self._proc is not None
        try:
            root = psutil.Process(self._proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _pump_log(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        with self.log_path.open("ab") as log:
            for raw in self._proc.stdout:
                log.write(raw)
                log.flush()
                line = raw.decode(errors="replace").rstrip()
                self._tail.append(line)
                self.phase = self.phase_of(line) or self.phase

    def _hint(self) -> str:
        text = "\n".join(self._tail)
        for needle, hint in _FAILURE_HINTS:
            if needle in text:
                return hint
        return f"read the full log at {self.log_path}; `deepserve serve --dry-run` prints the command to rerun by hand"


_FAILURE_HINTS = (
    ("Address already in use", "another process holds the port: pick another with --port"),
    ("out of memory", "lower --max-model-len or --max-num-seqs, or use more GPUs (--tensor-parallel-size)"),
    ("OutOfMemory", "lower --max-model-len or --max-num-seqs, or use more GPUs (--tensor-parallel-size)"),
    ("less than desired CPU memory", "lower --kv-cache-memory-gib: this machine has less free memory"),
    ("larger than the maximum number of tokens", "lower --max-model-len or raise --kv-cache-memory-gib"),
    ("No module named", "the engine's Python environment is incomplete: reinstall it (see the README)"),
    ("trust_remote_code", "add --trust-remote-code if you trust the model repository's code"),
)


def _answers(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _signal_process(proc: psutil.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        proc.send_signal(sig)
