"""qspec-bench {kernel,e2e,quality,w4a16}: GPU benchmarks that write JSON, docs/BENCHMARKS.md and plots."""

from __future__ import annotations

import sys
from typing import Sequence

USAGE = "usage: qspec-bench {kernel,e2e,quality,w4a16} [options]   (qspec-bench NAME --help for options)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "kernel":
        from qspec_jax.bench.kernel import main as run
    elif name == "e2e":
        from qspec_jax.bench.e2e import main as run
    elif name == "quality":
        from qspec_jax.bench.quality import main as run
    elif name == "w4a16":
        from qspec_jax.bench.w4a16 import main as run
    else:
        print(f"qspec-bench: error: unknown benchmark {name!r}\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
