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
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Sequence

# Hierarchical KV cache group sizes the CLIs accept: powers of two >= 16 (what the Pallas decode
# kernels take), all larger than gamma_max (the FP ring holds 2G + gamma_max tokens, SPEC §4).
KV_GROUP_SIZES = (16, 32, 64, 128, 256)
# argparse attribute of each DraftWeightsConfig field, and the flag that sets it.
DRAFT_FLAGS = {"group_size": ("draft_group", "--draft-group"), "scope": ("draft_scope", "--draft-scope"),
               "method": ("draft_method", "--draft-method"), "lm_head": ("draft_lm_head", "--draft-lm-head")}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, except required options, on/off flags (off
    unless given) and help texts that state the default themselves (a None default must)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.required or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


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


def tp_mesh(n: int) -> Any:
    """The mesh for `--tp N` (None for one device)."""
    if n < 1:
        raise ValueError(f"--tp must be >= 1, got {n}")
    if n == 1:
        return None
    from qspec_jax.sharding import make_mesh

    return make_mesh(n)


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


def require_tokenizer(model: Any) -> None:
    """CheckpointError naming the checkpoint when it has no tokenizer (before any compiling)."""
    model.require_tokenizer()


# ------------------------------------------------------------------------------ draft format
def add_draft_format_args(p: argparse.ArgumentParser) -> None:
    """--draft-group/--draft-scope/--draft-method/--[no-]draft-lm-head; None when not given."""
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
    on_the_fly = [m for m in DRAFT_METHODS if m not in CALIBRATED_METHODS]
    g.add_argument("--draft-method", choices=DRAFT_METHODS, default=None,
                   help=f"how the INT4 codes are chosen; {', '.join(on_the_fly)} can be made here, "
                        f"{', '.join(CALIBRATED_METHODS)} only at conversion (qspec-convert --calibration-text) "
                        f"(default: the checkpoint's, else {D.method})")
    g.add_argument("--draft-lm-head", action=argparse.BooleanOptionalAction, default=None,
                   help="quantize the lm_head to INT4 as well (default: the checkpoint's, else "
                        f"{'yes' if D.lm_head else 'no'})")


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
            + (" + lm_head" if cfg.lm_head else ", lm_head not quantized"))


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
    now, which the line says, with the flags that caused it. Calibrated methods cannot be made
    here (they need calibration text at conversion).
    """
    from qspec_jax.checkpoint import draft_group_problems
    from qspec_jax.weight_quant import CALIBRATED_METHODS, DraftWeightsConfig

    stored = model.draft_weights_config if model.draft_params is not None else None
    want = draft_config(prog, fields, stored or DraftWeightsConfig())
    if stored is not None and want == stored:
        return want, f"draft: the checkpoint's stored INT4 weights ({describe_draft(want)})"
    if want.method in CALIBRATED_METHODS:
        fail(prog, f"--draft-method {want.method} needs calibration text, so it is made at conversion: "
                   f"qspec-convert SRC OUT --draft-method {want.method} --calibration-text FILE (this checkpoint "
                   f"stores {'a ' + describe_draft(stored) + ' draft' if stored else 'no draft'})")
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
    return want, f"draft: quantizing INT4 weights now ({describe_draft(want)}): {why}"


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
    return model.with_draft_weights(cfg)


# ------------------------------------------------------------------------------------- run
def run_cli(prog: str, body: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None) -> int:
    """Runs `body(argv)`, turning expected user errors into `fail` instead of tracebacks.

    Ctrl-C prints one line and exits 130 at once (os._exit): these tools write nothing, and a
    normal interpreter exit while XLA compiles on its own threads can crash (see convert.cli).
    """
    from qspec_jax.checkpoint import CheckpointError
    from qspec_jax.config import ConfigError

    try:
        return body(argv) or 0
    except (CheckpointError, ConfigError, FileNotFoundError, ValueError) as e:
        fail(prog, str(e))
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        if argv is not None:  # called in-process (tests): leave the interpreter to the caller
            return 130
        os._exit(130)
