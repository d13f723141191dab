"""Child interpreters for tests: the jax 0.11 interpreter the device runs (QSPEC_JAX011_PYTHON or
/tmp/j11/bin/python), scripts under an interpreter, and test functions in a child with several
host devices, and the XLA flags a child inherits."""

import os
import subprocess
import sys
from pathlib import Path

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


def run_in_child(test_file: str, fn: str, *args, host_devices: int = 8) -> None:
    """Calls `fn(*args)` of the test module at `test_file` in a child interpreter with
    `host_devices` host devices and asserts that it returned.

    Why (GPU interpret mode): the interpreter runs each simulated warpgroup's program on XLA:CPU
    and blocks in barrier callbacks, whose thread pool grows with the host device count. With one
    device on a 2-core machine, two blocked warpgroups can hold the whole pool while the third
    needs it to arrive: the simulation, not the kernel, deadlocks (seen with three warpgroups).

    The child's LLVM runs at -O0 (`--xla_backend_optimization_level=0`): an interpreted kernel is a
    large XLA program run once, whose compile dominates (~25% less test time measured); the test
    compares results computed in the same child, so the optimization level is the same on both sides."""
    script = (f"import importlib.util\n"
              f"spec = importlib.util.spec_from_file_location('child_tests', {str(Path(test_file).resolve())!r})\n"
              f"mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
              f"mod.{fn}(*{args!r})\nprint('CHILD OK')\n")
    r = run_script(sys.executable, script, host_devices, xla_flags="--xla_backend_optimization_level=0")
    assert r.returncode == 0 and "CHILD OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
