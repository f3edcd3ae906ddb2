"""A stand-in engine process for supervisor tests: logs start-up phases like vLLM, forks a child of its own (as
vLLM forks its engine core), then answers GET /v1/models on loopback, or dies with an error, as told."""

from __future__ import annotations

import argparse
import http.server
import signal
import subprocess
import sys
import threading
import time


class _Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
        self.wfile.write(b'{"data": [{"id": "fake"}]}')

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--startup-s", type=float, default=0.5)
    parser.add_argument("--die-with", default=None, help="print this and exit 1 instead of serving")
    parser.add_argument("--ignore-sigterm", action="store_true")
    args = parser.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"CHILD {child.pid}", flush=True)
    print("INFO Loading weights took 0.01 seconds", flush=True)
    time.sleep(args.startup_s)
    if args.die_with:
        print(args.die_with, flush=True)
        sys.exit(1)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), _Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print("INFO:     Application startup complete.", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
