"""Child interpreters for tests: the jax 0.11 interpreter the device runs (QSPEC_JAX011_PYTHON or
/tmp/j11/bin/python), scripts under an interpreter, and test functions in a child with several
host devices, and the XLA flags a child inherits."""

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]


def jax011_python() -> str | None:
    """An interpreter whose jax is 0.11.x, else None: a path that exists but cannot import jax
    0.11 (a half-made venv) is no such interpreter."""
    for cand in (os.environ.get("QSPEC_JAX011_PYTHON"), "/tmp/j11/bin/python"):
        if not cand or not Path(cand).exists():
            continue
        try:
            r = subprocess.run([cand, "-c", "import jax; print(jax.__version__)"], capture_output=True, text=True,
                               timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and r.stdout.strip().startswith("0.11."):
            return cand
    return None


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def child_xla_flags(extra: str = "") -> str:
    """XLA_FLAGS for a child process: the parent's, less a forced host device count (each child
    says its own), plus `extra`. So `make test`'s optimization level (FAST_XLA_FLAGS,
    --xla_backend_optimization_level=0) reaches the children too, whose time is mostly compiling."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join([*kept, *extra.split()])


def run_script(interpreter: str, script: str, host_devices: int | None = None,
               xla_flags: str = "") -> subprocess.CompletedProcess:
    """`script` under `interpreter` with the repository importable, on the CPU (with
    `host_devices` simulated devices when given, and `xla_flags` added to the parent's XLA_FLAGS less
    a forced device count: `child_xla_flags`)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    if host_devices:
        xla_flags = f"{xla_flags} {DEVICE_COUNT_FLAG}={host_devices}"
    if xla_flags:
        env["XLA_FLAGS"] = child_xla_flags(xla_flags)
    return subprocess.run([interpreter, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)


def reuse_interpreter_programs() -> Callable[[], None]:
    """GPU interpret mode compiles the kernel's whole program once per simulated warpgroup and call
    (`thread_map._run_jaxpr`: 4-6 compiles of ~1.5 s a kernel call, the most of a call's time on a
    2-core CPU). From now on in this process, compile it once per jaxpr and argument types; the other
    warpgroups (and later calls of the same traced kernel: a layer loop's, a jitted function's) reuse
    it, with a lock per program so that the warpgroups of one call compile it once. Returns the
    function that restores the original. Used by tests/conftest.py's fixture of the same name (the
    pytest process) and by `run_in_child` (in the child, which the fixture's hook does
    not reach). Pure caching: a missing hook (another jax version) only makes the tests slower."""
    import threading

    import jax
    import numpy as np

    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:  # pragma: no cover
        return lambda: None
    original = thread_map._run_jaxpr
    cache: dict = {}
    lock = threading.Lock()

    def body(jaxpr, consts, *args):
        jax.core.eval_jaxpr(jaxpr, consts, *args)

    def run(jaxpr, consts, *args):
        key = (id(jaxpr), tuple((np.shape(a), np.asarray(a).dtype.str)
                                for a in (*jax.tree.leaves(consts), *args)))
        with lock:  # the jaxpr is kept alive in its entry so that its id stays unique
            entry = cache.setdefault(key, [jaxpr, threading.Lock(), None])
        with entry[1]:
            if entry[2] is None:
                entry[2] = jax.jit(body, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
        entry[2](consts, *args)

    thread_map._run_jaxpr = run

    def restore() -> None:
        thread_map._run_jaxpr = original

    return restore


def run_in_child(test_file: str, fn: str, *args, host_devices: int = 8) -> None:
    """Calls `fn(*args)` of the test module at `test_file` in a child interpreter with
    `host_devices` host devices and asserts that it returned. The child compiles each interpreted
    kernel's program once (`reuse_interpreter_programs`: a layer tail or fused-kernel test ~2-3x faster).

    Why (GPU interpret mode): the interpreter runs each simulated warpgroup's program on XLA:CPU
    and blocks in barrier callbacks, whose thread pool grows with the host device count. With one
    device on a 2-core machine, two blocked warpgroups can hold the whole pool while the third
    needs it to arrive: the simulation, not the kernel, deadlocks (seen with three warpgroups).

    The child's LLVM runs at -O0 (`--xla_backend_optimization_level=0`): an interpreted kernel is a
    large XLA program run once, whose compile dominates (~25% less test time measured); the test
    compares results computed in the same child, so the optimization level is the same on both sides."""
    script = (f"import importlib.util\n"
              f"spec = importlib.util.spec_from_file_location('subproc', {str(Path(__file__).resolve())!r})\n"
              f"sp = importlib.util.module_from_spec(spec); spec.loader.exec_module(sp)\n"
              f"sp.reuse_interpreter_programs()\n"
              f"spec = importlib.util.spec_from_file_location('child_tests', {str(Path(test_file).resolve())!r})\n"
              f"mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
              f"mod.{fn}(*{args!r})\nprint('CHILD OK')\n")
    r = run_script(sys.executable, script, host_devices, xla_flags="--xla_backend_optimization_level=0")
    assert r.returncode == 0 and "CHILD OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
