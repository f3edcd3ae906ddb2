"""The gateway's own process freezes its start-up heap, so that full garbage collections under load stay short."""

from __future__ import annotations

import subprocess
import sys

from deepserve.net import free_port

# Runs `serve` as `deepserve gateway` does; when it is listening, report the freeze count and stop it with SIGTERM.
_SERVE_AND_REPORT = """
import asyncio, gc, os, signal, sys
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.server import serve

def ready(url):
    print("FROZEN", gc.get_freeze_count(), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

asyncio.run(serve(GatewayConfig.model_validate({"upstream": [sys.argv[1]], "port": 0}), ready))
print("STOPPED", flush=True)
"""


def test_the_gateway_process_freezes_its_heap_once_listening() -> None:
    nothing_listens = f"http://127.0.0.1:{free_port()}/v1"  # the gateway starts without a healthy upstream
    done = subprocess.run(
        [sys.executable, "-c", _SERVE_AND_REPORT, nothing_listens], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.split()
    frozen = int(lines[lines.index("FROZEN") + 1])
    assert frozen > 10_000  # modules, the app, its server: the whole start-up heap, not a handful of objects
    assert "STOPPED" in lines
