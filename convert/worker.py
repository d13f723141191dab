"""The conversion process `qspec-convert` supervises (`convert.cli`); not a command of its own.

    python -m convert.worker JOB_JSON

Reads the source, makes the INT4 draft and writes the checkpoint into the staging directory the
parent created (`convert.api.convert_into`); the parent renames it to OUT, or removes it. This
process ignores SIGINT, SIGTERM and SIGHUP: the parent decides, and stops it with SIGKILL. It dies with
the parent (PR_SET_PDEATHSIG on Linux).

Exit status: 0 written; 2 bad input and 3 failure (one `qspec-convert: error:` line printed
either way); anything else is a crash, reported by the parent.

Test hook: QSPEC_CONVERT_TEST_PAUSE="STAGE:FILE" makes the process create FILE and then wait
forever when it reaches STAGE ("read": after the first tensor is read; "quantize": right after
the draft quantization was dispatched to XLA; "write": while orbax's commit is in flight), so a
test can interrupt the conversion at a known point.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

PROG = "qspec-convert"
EXIT_BAD_INPUT = 2
EXIT_FAILED = 3
PAUSE_ENV = "QSPEC_CONVERT_TEST_PAUSE"


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(EXIT_FAILED)


def _pause_hook() -> Any:
    """on_stage callback for the QSPEC_CONVERT_TEST_PAUSE test hook (None when unset)."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return None
    stage, marker = spec.split(":", 1)

    def on_stage(name: str) -> None:
        if name == stage:
            # Written whole, then renamed: the test polls for the file and must never read it empty.
            tmp = Path(f"{marker}.tmp")
            tmp.write_text(f"{os.getpid()}\n")
            os.replace(tmp, marker)
            while True:  # until the parent's SIGKILL
                time.sleep(3600)

    return on_stage


def draft_config(fields: dict[str, Any] | None, calibration_text: list[str]) -> Any:
    """The DraftWeightsConfig of the user's draft flags (DraftWeightsConfig's defaults for the
    rest), checked with messages that name the flags; None for --draft-weights none."""
    from qspec_jax.cli import draft_config as from_flags
    from qspec_jax.cli import fail
    from qspec_jax.weight_quant import CALIBRATED_METHODS, DraftWeightsConfig

    if fields is None:
        return None
    cfg = from_flags(PROG, fields, DraftWeightsConfig())
    if calibration_text and cfg.method not in CALIBRATED_METHODS:
        fail(PROG, f"--calibration-text is used by --draft-method {', '.join(CALIBRATED_METHODS)} only, "
                   f"not {cfg.method}")
    from qspec_jax.evaluation import read_text_file

    for path in calibration_text:  # a missing or binary file: now, not after minutes of reading weights
        try:
            read_text_file(path, "--calibration-text")
        except ValueError as e:
            fail(PROG, str(e))
    return cfg


def run(job: dict[str, Any]) -> int:
    if job["progress"]:  # before the imports below (jax, transformers: seconds)
        print("loading the libraries, then the model's metadata and tokenizer", file=sys.stderr, flush=True)
    from convert.api import convert_into
    from convert.errors import ConversionError
    from convert.output import Staging

    def warn(message: str) -> None:
        print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)

    staging = Staging(out=Path(job["out"]), dir=Path(job["staging"]), created=tuple(map(Path, job["created"])))
    try:
        draft = draft_config(job["draft"], job["calibration_text"])
        convert_into(staging.dir, job["src"], job["dtype"], draft_weights=draft,
                     calibration_text=job["calibration_text"], progress=job["progress"], staging=staging,
                     warn=warn, on_stage=_pause_hook())
    except ConversionError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # e.g. the disk filled up while writing
        where = f"{e.filename}: " if e.filename else ""
        print(f"{PROG}: error: {where}{e.strerror or e}; nothing was written", file=sys.stderr)
        return EXIT_FAILED
    return 0


def main(argv: list[str] | None = None) -> int:
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    job = json.loads((sys.argv[1:] if argv is None else argv)[0])
    _die_with_parent(job["parent_pid"])
    return run(job)


if __name__ == "__main__":
    sys.exit(main())
