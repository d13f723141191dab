"""Compiled programs: a bounded set of live executables in memory, JAX's persistent
compilation cache on disk.

Why a bound. On the CPU every XLA executable maps the machine code of each of its kernels
separately (about three memory mappings per kernel: code, read-only data, data; measured 450
mappings for the autoregressive loop and 590 for the speculative one, whatever the model size,
since the layers are scanned). JAX keeps every program a jitted function has compiled alive in
its caches for as long as that function lives, which for a module-level `jax.jit` is the life
of the process. A process that generates at many shapes (a notebook, a server, the test suite)
therefore collects mappings until it reaches the kernel's `vm.max_map_count` (65530 by
default) and dies with SIGSEGV inside XLA. `Programs` compiles each program from a fresh
wrapper of the function: JAX's caches key on that wrapper weakly, so the executable lives
exactly as long as the `Programs` entry, a least-recently-used table of at most
`max_programs` entries.

Why a disk cache. A program compiles in seconds (SmolLM2's speculative loop: ~7 s on a CPU;
the 8B one: 15 s on an H200), and a command-line run compiles the same programs every time.
`enable_persistent_cache()` turns on JAX's persistent compilation cache (the CLIs do, unless
`--no-compile-cache`); the second run then only traces and lowers (docs/BENCHMARKS.md,
"Compile time, length buckets, streaming"). Programs with host callbacks are never written to
it (a JAX rule); ours have none.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax

DEFAULT_MAX_PROGRAMS = 16  # ~10k mappings for speculative loops on a CPU: 15% of vm.max_map_count
# Programs that compile faster than this are not written to the disk cache (reading one back
# costs about as much as compiling it).
PERSISTENT_MIN_COMPILE_S = 0.2


# ---------------------------------------------------------------------------- disk cache
def user_cache_dir() -> Path:
    """~/.cache/qspec-jax ($XDG_CACHE_HOME/qspec-jax when set): the tools' cached state."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qspec-jax"


def default_compile_cache_dir() -> Path:
    """Where the CLIs keep compiled programs: user_cache_dir() / "xla"."""
    return user_cache_dir() / "xla"


def enable_persistent_cache(path: str | Path | None = None) -> Path:
    """Turns on JAX's persistent compilation cache in `path` (default: default_compile_cache_dir())
    for the rest of the process, and returns the directory.

    Compiled programs are written there and read back by later processes with the same program,
    jax/jaxlib version, device kind and XLA flags. Call it before generating. The cache is
    trusted input (it holds machine code): keep it private to your user.
    """
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = Path(path) if path is not None else default_compile_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", PERSISTENT_MIN_COMPILE_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size limit: write small ones too
    cc.reset_cache()  # a cache JAX already set up (or found disabled) is set up again at the first compile
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path


def disable_persistent_cache() -> None:
    """Turns the persistent compilation cache off again (for the rest of the process)."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    jax.config.update("jax_compilation_cache_dir", None)
    cc.reset_cache()


# ------------------------------------------------------------------------ live programs
def _leaf_key(x: Any) -> Any:
    """What of an argument leaf a compiled program depends on: shape, dtype, weak type and
    sharding for arrays; the value for Python scalars."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)), getattr(x, "sharding", None))
    return (type(x), x)


def signature(args: tuple) -> tuple:
    """A hashable key of `args` for compiled-program lookup: tree structure and leaf keys."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple(_leaf_key(x) for x in leaves), jax.config.jax_enable_x64


class Programs:
    """A least-recently-used table of at most `max_programs` compiled programs.

    `compiled(fn, args, static)` returns the program for `fn(*args, **static)` at these argument
    shapes, compiling it on a miss; evicting one releases its executable (and its memory
    mappings) as soon as no caller holds it. `compiles` counts the misses (the distinct
    programs compiled since the table was made). Thread-safe.
    """

    def __init__(self, max_programs: int = DEFAULT_MAX_PROGRAMS) -> None:
        if max_programs < 1:
            raise ValueError(f"max_programs={max_programs} must be >= 1")
        self.max_programs = max_programs
        self.compiles = 0
        self._table: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._table)

    def clear(self) -> None:
        """Drops every program."""
        with self._lock:
            self._table.clear()

    def compiled(self, fn: Callable, args: tuple, static: dict[str, Any],
                 donate_argnums: tuple[int, ...] = ()) -> tuple[Any, bool]:
        """(the compiled program of `fn(*args, **static)`, whether it was compiled now).

        `fn` is a plain function or a `jax.jit`-wrapped one (its Python function is compiled
        here, never through its own cache). Call the program with `args` alone.
        """
        raw = getattr(fn, "__wrapped__", fn)
        key = (raw, tuple(sorted(static.items())), donate_argnums, signature(args))
        with self._lock:
            hit = self._table.get(key)
            if hit is not None:
                self._table.move_to_end(key)
                return hit, False
        # A fresh callable per program: JAX's tracing and compilation caches hold it (and through
        # it the executable) only weakly, so the table's entry is the program's only owner.
        fresh = functools.partial(raw)
        program = jax.jit(fresh, static_argnames=tuple(static), donate_argnums=donate_argnums).lower(
            *args, **static).compile()
        with self._lock:
            self.compiles += 1
            self._table[key] = program
            self._table.move_to_end(key)
            while len(self._table) > self.max_programs:
                self._table.popitem(last=False)
        return program, True


_PROGRAMS = Programs()


def programs() -> Programs:
    """The process's table of live programs, which generation, evaluation and the planner use.
    Set `programs().max_programs` to keep more or fewer alive (each holds device code; on a CPU
    ~500 memory mappings)."""
    return _PROGRAMS


def run_program(fn: Callable, args: tuple, static: dict[str, Any], timings: dict[str, float] | None = None,
                donate_argnums: tuple[int, ...] = ()) -> Any:
    """Runs `fn(*args, **static)` through `programs()`. With a `timings` dict, waits for the
    result and records "compile_s" (tracing, lowering and compiling; 0 when the program was
    live) and "run_s" (the run alone, on device-ready outputs)."""
    t0 = time.perf_counter()
    program, _ = _PROGRAMS.compiled(fn, args, static, donate_argnums)
    if timings is None:
        return program(*args)
    t1 = time.perf_counter()
    out = jax.block_until_ready(program(*args))
    timings.update(compile_s=t1 - t0, run_s=time.perf_counter() - t1)
    return out
