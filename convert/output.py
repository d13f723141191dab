"""Where a conversion writes: checks on OUT, a hidden staging directory next to it, the commit.

A checkpoint is written into `.<OUT name>.partial-<pid>-XXXXXXXX`, a sibling of OUT on the same
filesystem, and appears under its name only through one `os.replace` at the end (`commit`),
so OUT either does not exist or is complete. `discard` removes the staging directory with
everything in it (orbax's own `*.orbax-checkpoint-tmp*` directories included) and any parent
directories `create_staging` made. A conversion killed with SIGKILL cannot clean up; the pid in
the name lets the next conversion to the same OUT find its leftover and remove it
(`remove_stale_partials`).

Nothing here imports jax or numpy: `qspec-convert` runs these checks first and refuses an
unusable OUT in milliseconds, before any weights are read.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

from convert.errors import ConversionError

__all__ = ["FREE_SPACE_MARGIN", "MANIFEST_NAME", "Staging", "check_free_space", "check_output", "commit",
           "create_staging", "discard", "format_bytes", "remove_stale_partials"]

MANIFEST_NAME = "qspec_checkpoint.json"  # = qspec_jax.checkpoint.MANIFEST, written last (tests check they agree)
# The estimate counts tensor bytes; orbax's metadata and the tokenizer files come on top.
FREE_SPACE_MARGIN = 1.05
FREE_SPACE_SLACK = 64 << 20


def format_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units, as df -H prints)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class Staging:
    """A staging directory for `out` and the missing parents of `out` that were created for it."""

    out: Path  # absolute
    dir: Path  # hidden sibling of out
    created: tuple[Path, ...]  # parents of out made by create_staging, deepest first


def _nearest_existing(path: Path) -> Path:
    """`path` itself or its nearest ancestor that exists (as a file, directory or link)."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_output(out: str | Path) -> Path:
    """Absolute OUT if a checkpoint directory can be created there; else ConversionError naming
    the path and the problem (OUT is empty or exists; an existing parent is not a directory or
    not writable)."""
    if not str(out).strip():
        raise ConversionError(f"OUT is empty ({str(out)!r}): give the checkpoint directory to create")
    out = Path(os.path.abspath(out))
    if os.path.lexists(out):
        kind = "a directory" if out.is_dir() else "a file" if out.is_file() else "a link or special file"
        raise ConversionError(f"{out}: already exists ({kind}); remove it or choose another output directory")
    base = _nearest_existing(out.parent)
    if not base.is_dir():
        raise ConversionError(f"{out}: cannot create the output directory: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConversionError(f"{out}: cannot create the output directory: {base} is not writable")
    return out


def create_staging(out: str | Path) -> Staging:
    """Checks OUT (`check_output`), creates its missing parents and the staging directory.

    Creating them is the definitive writability test (a read-only filesystem, or a directory
    that only root may write when root squashing applies, passes `os.access`)."""
    out = check_output(out)
    created: list[Path] = []
    try:
        for parent in reversed(out.parents):
            if not os.path.lexists(parent):
                parent.mkdir()
                created.insert(0, parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    except OSError as e:
        _remove_empty(created)
        where = e.filename or out.parent
        raise ConversionError(f"{out}: cannot create the output directory: {where}: "
                              f"{e.strerror or e}") from None
    return Staging(out=out, dir=tmp, created=tuple(created))


def remove_stale_partials(out: str | Path) -> tuple[list[Path], list[Path]]:
    """Leftovers of earlier conversions to `out` that were killed (SIGKILL, a power cut): the
    staging directories `.OUT.partial-<pid>-*` whose process no longer exists are removed.

    Returns (removed, unknown): `unknown` are `.OUT.partial-*` directories without a pid in
    their name (made by an older qspec-convert), left alone since their owner cannot be told."""
    out = Path(os.path.abspath(out))
    removed: list[Path] = []
    unknown: list[Path] = []
    if not out.parent.is_dir():
        return removed, unknown
    for path in sorted(out.parent.glob(f".{out.name}.partial-*")):
        if not path.is_dir() or path.is_symlink():
            continue
        pid_text = path.name[len(f".{out.name}.partial-"):].split("-", 1)[0]
        if not pid_text.isdigit() or "-" not in path.name[len(f".{out.name}.partial-"):]:
            unknown.append(path)
            continue
        if _alive(int(pid_text)):
            continue  # a conversion to the same OUT is running
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed, unknown


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def check_free_space(staging: Staging, need_bytes: int) -> None:
    """ConversionError unless OUT's filesystem has room for about `need_bytes` of checkpoint."""
    free = shutil.disk_usage(staging.dir).free
    want = int(need_bytes * FREE_SPACE_MARGIN) + FREE_SPACE_SLACK
    if free < want:
        raise ConversionError(
            f"{staging.out}: not enough free space: the checkpoint needs about {format_bytes(want)}, "
            f"the filesystem of {staging.out.parent} has {format_bytes(free)} free")


def commit(staging: Staging) -> Path:
    """Renames the finished staging directory to OUT (one atomic rename) and returns OUT."""
    if os.path.lexists(staging.out):
        raise ConversionError(f"{staging.out}: was created by someone else during the conversion; "
                              f"the converted checkpoint was not moved there")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging.dir, 0o777 & ~umask)  # mkdtemp made it 0700
    os.replace(staging.dir, staging.out)
    return staging.out


def discard(staging: Staging) -> None:
    """Removes the staging directory and the parents `create_staging` made (if still empty).

    Whoever writes into the directory must have stopped first (see `convert.cli`)."""
    shutil.rmtree(staging.dir, ignore_errors=True)
    _remove_empty(list(staging.created))


def _remove_empty(dirs: list[Path]) -> None:
    for p in dirs:  # deepest first; stops at the first one that is no longer empty
        try:
            p.rmdir()
        except OSError:
            break
