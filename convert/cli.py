"""Command line: `qspec-convert SRC OUT [options]` (also `python -m convert SRC OUT`).

Exit status: 0 written; 2 bad input (one `qspec-convert: error: <message>` line on stderr, no
traceback, no OUT); 130 on SIGINT, 143 on SIGTERM, 129 on SIGHUP (one line, no OUT, no partial
directory); 1 when the conversion process died otherwise.

How an interrupt stays safe. This process only checks OUT (`convert.output`, no jax: a bad OUT
is refused in milliseconds), creates the hidden staging directory next to it, starts the
conversion in a child process (`convert.worker`: reading, draft quantization, orbax write),
relays the child's output, and renames the staging directory to OUT when the child succeeded.
SIGINT, SIGTERM and SIGHUP here are only recorded (a handler that appends to a list and wakes a
select through a pipe), so they never interrupt this process's own code; the loop then kills
the child with SIGKILL, which stops all its threads at once, waits for it, removes the staging
directory with everything in it (orbax's *.orbax-checkpoint-tmp* directories included) and
prints one line. The child runs in its own process group, ignores those signals too (so a kill
of the whole group cannot reach it first) and dies with this process (PR_SET_PDEATHSIG on
Linux). A signal the caller already ignores (nohup) stays ignored.

Why not catch KeyboardInterrupt around the work in one process: JAX compiles and orbax commits
on their own threads while the main thread waits, and a KeyboardInterrupt stops only the main
thread. Interpreter shutdown then destroyed the XLA CPU client under a compile that was still
running (the segfault, exit 139: the compile thread crashed in SingleDeviceSharding::Create on
a freed device), and orbax's commit thread kept writing into the directory being removed (the
leftover .OUT.partial-*/params.orbax-checkpoint-tmp) or scheduled work on an executor that exit
had shut down (its tracebacks).
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from convert import hub
from convert.errors import ConversionError
from convert.output import (MANIFEST_NAME, Staging, check_output, commit, create_staging, discard,
                            remove_stale_partials)
from qspec_jax.cli import HelpFormatter, Parser, format_default

PROG = "qspec-convert"
EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
WORKER_FAILED = 3  # convert.worker: failed after printing its error line
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal went away
# Fields of qspec_jax.weight_quant.DraftWeightsConfig set by the draft flags (argparse dest -> field).
DRAFT_DESTS = {"draft_group": "group_size", "draft_scope": "scope", "draft_method": "method",
               "draft_lm_head": "lm_head", "draft_fold_norms": "fold_norms"}


def _draft_facts() -> dict[str, str]:
    """Defaults and choices of the draft format, for --help only: they live in
    qspec_jax.weight_quant (DraftWeightsConfig), which imports jax, and a run checks OUT first."""
    from qspec_jax.weight_quant import CALIBRATED_METHODS, DRAFT_METHODS, DRAFT_SCOPES, WEIGHT_GROUPS
    from qspec_jax.weight_quant import DraftWeightsConfig as D

    return {"group": str(D.group_size), "groups": ", ".join(map(str, WEIGHT_GROUPS)), "scope": D.scope,
            "scopes": ", ".join(DRAFT_SCOPES), "method": D.method, "methods": ", ".join(DRAFT_METHODS),
            "calibrated": ", ".join(CALIBRATED_METHODS) or "none", "lm_head": "yes" if D.lm_head else "no",
            "fold_norms": "yes" if D.fold_norms else "no"}


class _HelpFormatter(HelpFormatter):
    """Every option's help ends with its default (on/off flags: off; a None default is stated in
    the help); the draft format's defaults and choices ({group}, {methods}, ...) are filled in
    from DraftWeightsConfig. Lines wrap at spaces only (qspec_jax.cli.HelpFormatter)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "{" in text:
            text = text.format(**_draft_facts())
        if ("default" in text or action.required or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return text + " (default: " + format_default(action.default).replace("%", "%%") + ")"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog=PROG, formatter_class=_HelpFormatter,
        description="Convert a Hugging Face Llama/Mistral model directory (config.json + *.safetensors) or a "
                    "Llama-architecture .gguf file into a qspec-jax checkpoint directory: the target weights, "
                    "the INT4 draft weights speculative decoding uses, and the tokenizer.",
        epilog="OUT is checked before anything is read, and written atomically: after a failure or an interrupt "
               "(Ctrl-C, SIGTERM) it does not exist and no partial directory is left. Exit status: 0 written, "
               "2 bad input, 130/143 interrupted, 1 otherwise.")
    p.add_argument("src", metavar="SRC",
                   help="Hugging Face model directory (config.json + *.safetensors, single or sharded, plus "
                        "tokenizer files), a Llama .gguf file, or a Hugging Face Hub repository id ORG/NAME[@REVISION] "
                        "(the local Hugging Face cache first, else only the files conversion reads are downloaded; "
                        "HF_HUB_OFFLINE=1 never downloads)")
    p.add_argument("out", metavar="OUT",
                   help="checkpoint directory to create; it must not exist (missing parent directories are made)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="stored dtype of the target weights")
    p.add_argument("--draft-weights", choices=("int4", "none"), default="int4",
                   help="int4: also store the INT4 draft weights, which qspec-generate and the Python API use as "
                        "they are; none: store only the target (the draft is then quantized at every load)")
    g = p.add_argument_group("INT4 draft format (defaults: qspec_jax.weight_quant.DraftWeightsConfig)")
    g.add_argument("--draft-group", type=int, default=None, metavar="G",
                   help="input rows per quantization group, one of {groups} (default: {group})")
    g.add_argument("--draft-scope", default=None, metavar="SCOPE",
                   help="which linear layers are quantized: {scopes} (default: {scope})")
    g.add_argument("--draft-method", default=None, metavar="METHOD",
                   help="how the INT4 codes are chosen: {methods}; {calibrated} calibrate on text (--calibration-text, "
                        "else the built-in text), clip is the fast data-free one (default: {method})")
    g.add_argument("--draft-lm-head", action=argparse.BooleanOptionalAction, default=None,
                   help="quantize the lm_head to INT4 as well (default: {lm_head})")
    g.add_argument("--draft-fold-norms", action=argparse.BooleanOptionalAction, default=None,
                   help="fold the RMSNorm weights into the INT4 weights that read them, so the fused draft kernels "
                        "skip them (default: {fold_norms})")
    g.add_argument("--calibration-text", action="append", type=Path, metavar="FILE", default=None,
                   help="UTF-8 text the calibrated methods ({calibrated}) collect input statistics on; "
                        "repeat for several files (default: the built-in text, qspec_jax/data/botchan.txt, a public "
                        "domain novel; random token ids for a source without a tokenizer)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return p


def worker_job(args: argparse.Namespace, staging: Staging) -> dict[str, Any]:
    """What the worker needs: plain JSON (paths as strings)."""
    draft = None
    if args.draft_weights == "int4":
        draft = {field: getattr(args, dest) for dest, field in DRAFT_DESTS.items() if getattr(args, dest) is not None}
    from convert.hub import looks_like_repo_id

    src = args.src if looks_like_repo_id(args.src) else str(Path(args.src).absolute())
    return {"src": src, "out": str(staging.out), "staging": str(staging.dir),
            "created": [str(p) for p in staging.created], "dtype": args.dtype, "draft": draft,
            "calibration_text": [str(p) for p in args.calibration_text or []], "progress": not args.no_progress,
            "parent_pid": os.getpid()}


class _Signals:
    """SIGINT/SIGTERM/SIGHUP recorded (never raised) while installed; `wake` becomes readable on each.

    Only the main thread can install signal handlers; elsewhere (main() called from a thread)
    nothing is installed and the default handlers stay."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.wake, self._w = os.pipe()
        os.set_blocking(self.wake, False)
        os.set_blocking(self._w, False)
        self._old: dict[int, Any] = {}
        self._old_wakeup = -1
        if threading.current_thread() is threading.main_thread():
            # A signal the caller ignores stays ignored (nohup, a shell's background job).
            self._old = {s: signal.signal(s, self._record) for s in SIGNALS if signal.getsignal(s) != signal.SIG_IGN}
            self._old_wakeup = signal.set_wakeup_fd(self._w)

    def _record(self, signum: int, frame: Any) -> None:
        self.received.append(signum)

    def drain(self) -> None:
        try:
            while os.read(self.wake, 512):
                pass
        except BlockingIOError:
            pass

    def restore(self) -> None:
        if self._old:
            signal.set_wakeup_fd(self._old_wakeup)
            for s, handler in self._old.items():
                signal.signal(s, handler)
        os.close(self.wake)
        os.close(self._w)


def _worker_env() -> dict[str, str]:
    """Our environment, with this package importable in the child wherever it was started."""
    root = str(Path(__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _interrupted(signum: int, partial_line: bool) -> int:
    if partial_line:  # a progress bar the killed child left without a newline
        sys.stderr.write("\r\x1b[K" if sys.stderr.isatty() else "\n")
    print(f"{PROG}: interrupted by {signal.Signals(signum).name}; nothing was written", file=sys.stderr, flush=True)
    return 128 + signum


def _relay(proc: subprocess.Popen, out_fd: int, signals: _Signals) -> tuple[int | None, bool]:
    """Copies the child's output to our stderr until it exits or a signal arrives.

    Returns (child's exit status, or None when interrupted; whether a line is left open)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    partial = False
    while not signals.received:
        ready, _, _ = select.select([out_fd, signals.wake], [], [])
        if signals.wake in ready:
            signals.drain()
            continue
        chunk = os.read(out_fd, 1 << 16)
        if not chunk:  # the child closed its output: it is exiting
            return proc.wait(), partial
        text = decoder.decode(chunk)
        if text:
            sys.stderr.write(text)
            sys.stderr.flush()
            partial = not text.endswith("\n")
    return None, partial


def _convert(args: argparse.Namespace, signals: _Signals, t0: float) -> int:
    try:
        check_output(args.out)  # OUT first, as always; then the cheap check of SRC, before any progress line
        if not os.path.exists(args.src) and not hub.looks_like_repo_id(args.src):  # ORG/NAME: resolved by the worker
            raise ConversionError(f"{args.src}: no such file or directory")
        removed, unknown = remove_stale_partials(args.out)
        staging = create_staging(args.out)  # before anything is read: fails in milliseconds
    except ConversionError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for path in removed:
        print(f"{PROG}: removed {path}, left by an earlier conversion to this OUT that was killed", file=sys.stderr)
    for path in unknown:
        print(f"{PROG}: note: {path} looks left by an earlier, killed conversion; remove it unless one is running",
              file=sys.stderr)
    if not args.no_progress:  # the child's first bar appears after seconds of imports and metadata
        print(f"{PROG}: converting {args.src} into {staging.out}", file=sys.stderr, flush=True)
    committed = False
    proc = None
    try:
        if signals.received:
            return _interrupted(signals.received[0], False)
        out_r, out_w = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-m", "convert.worker", json.dumps(worker_job(args, staging))],
                                    stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w, env=_worker_env(),
                                    process_group=0)
        finally:
            os.close(out_w)
        try:
            rc, partial = _relay(proc, out_r, signals)
        finally:
            os.close(out_r)
        if rc is None or signals.received:
            return _interrupted(signals.received[0], partial)
        if rc in (EXIT_BAD_INPUT, WORKER_FAILED):
            return EXIT_BAD_INPUT if rc == EXIT_BAD_INPUT else EXIT_FAILED  # the worker printed the error line
        if rc != 0:
            why = (f"was killed by {signal.Signals(-rc).name}" + (" (out of memory?)" if rc == -signal.SIGKILL else "")
                   if rc < 0 else f"failed with exit status {rc}")
            print(f"{PROG}: error: the conversion process {why}; nothing was written", file=sys.stderr)
            return EXIT_FAILED
        manifest = json.loads((staging.dir / MANIFEST_NAME).read_text())
        if signals.received:  # the commit below is the point after which a signal changes nothing
            return _interrupted(signals.received[0], False)
        try:
            commit(staging)
        except ConversionError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        committed = True
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()  # SIGKILL: every thread of the child stops before its directory is removed
            proc.wait()
        if not committed:
            discard(staging)
    draft, calibration = manifest.get("draft_weights"), manifest.get("draft_calibration")
    what = args.dtype + (f" + INT4 draft weights ({draft['method']}, group {draft['group_size']}, "
                         f"{draft['scope']} linears{' + lm_head' if draft['lm_head'] else ''}"
                         + (f"; calibrated on {calibration['tokens']} tokens of {calibration['text']}" if calibration
                            else "") + ")" if draft else "")
    print(f"{PROG}: wrote {staging.out} ({what}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs qspec-convert. With argv=None (the program itself) SIGINT/SIGTERM stay recorded-only
    until the process exits, so a signal after the commit cannot print a traceback; called
    with an argv (in-process) the previous handlers are restored."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.draft_weights == "none" and any(getattr(args, d) is not None for d in DRAFT_DESTS):
        parser.error("--draft-group/--draft-scope/--draft-method/--draft-lm-head set the format of the INT4 draft; "
                     "they do not apply with --draft-weights none")
    if args.calibration_text and args.draft_weights == "none":
        parser.error("--calibration-text is for the INT4 draft; it does not apply with --draft-weights none")
    t0 = time.perf_counter()
    signals = _Signals()
    try:
        return _convert(args, signals, t0)
    finally:
        if argv is not None:
            signals.restore()


if __name__ == "__main__":
    sys.exit(main())
