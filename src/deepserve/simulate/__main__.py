"""`python -m deepserve.simulate ARGS` is `deepserve simulate ARGS` with only that command loaded: a simulated engine
that tests, benchmarks and supervisors start again and again is up sooner without the imports of deepserve's other
commands."""

from __future__ import annotations

import sys

from deepserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["simulate", *sys.argv[1:]], commands=("simulate",)))
