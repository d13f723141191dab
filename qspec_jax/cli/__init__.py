"""Command-line tools: qspec-generate, qspec-eval-ppl, qspec-eval-accept, qspec-bench."""

from __future__ import annotations

import sys
from typing import Callable, NoReturn, Sequence


def fail(prog: str, message: str, code: int = 2) -> NoReturn:
    """One clear line on stderr and a non-zero exit, for errors the user can fix."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def tp_mesh(n: int):
    """The mesh for `--tp N` (None for one device)."""
    if n < 1:
        raise ValueError(f"--tp {n}: must be >= 1")
    if n == 1:
        return None
    from qspec_jax.sharding import make_mesh

    return make_mesh(n)


def run_cli(prog: str, body: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None) -> int:
    """Runs `body(argv)`, turning expected user errors into `fail` instead of tracebacks."""
    from qspec_jax.checkpoint import CheckpointError
    from qspec_jax.config import ConfigError

    try:
        return body(argv) or 0
    except (CheckpointError, ConfigError, FileNotFoundError, ValueError) as e:
        fail(prog, str(e))
