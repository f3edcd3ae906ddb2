"""`python -m deepserve`: the same CLI as the installed `deepserve` script (useful where the venv's script points at
another checkout, e.g. a worktree run with PYTHONPATH)."""

from deepserve.cli.main import main

raise SystemExit(main())
