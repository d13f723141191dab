"""Tensor parallelism on 4 simulated CPU devices (in a subprocess: the device count is fixed
when JAX initializes). See tests/helpers/tp_check.py for the checks."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("subproc", Path(__file__).parent / "helpers" / "subproc.py")
subproc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(subproc)

pytestmark = pytest.mark.slow


def test_sharded_generation_matches_single_device():
    env = dict(os.environ, XLA_FLAGS=subproc.child_xla_flags("--xla_force_host_platform_device_count=4"),
               JAX_PLATFORMS="cpu")
    script = Path(__file__).parent / "helpers" / "tp_check.py"
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0 and "TP-CHECKS-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_process_mesh_on_localhost():
    """jax.distributed with two CPU processes (one device each, gloo collectives): the sharded
    greedy tokens (AR and speculative) equal each process's own single-device tokens."""
    import json

    port = str(_free_port())
    script = Path(__file__).parent / "helpers" / "multihost_worker.py"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=subproc.child_xla_flags())  # one device each
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
        lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("TOKENS ", "REF ")))
        assert json.loads(lines["TOKENS"]) == json.loads(lines["REF"])


def test_tp_bench_times_the_allreduce_and_reports_the_floor(tmp_path: Path) -> None:
    """`qspec-bench e2e --quick --parts tp --tp-sizes 1,2` on two simulated CPU devices: AR and
    QuantSpec loops on 1 and 2 devices, the per-layer all-reduce timed at one row and at the
    verify width (its psum checked against the devices' sum), each row's bytes per device, and
    a report whose AR floor follows `collectives.step_floor_s`."""
    import json

    env = dict(os.environ, XLA_FLAGS=subproc.child_xla_flags("--xla_force_host_platform_device_count=2"),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "qspec_jax.cli.bench", "e2e", "--quick", "--parts", "tp",
                           "--tp-sizes", "1,2", "--trials", "1", "--out", str(tmp_path / "o")],
                          env=env, capture_output=True, text=True, timeout=1200, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    tp = json.loads((tmp_path / "o" / "e2e.json").read_text())["tp"]
    # rows: one token, and the verify width of the loop's QuantSpec (--loop-gamma 4: gamma + 1 = 5, `loop_spec`)
    assert [(c["devices"], c["rows"]) for c in tp["collectives"]] == [(2, 1), (2, 5)]
    for c in tp["collectives"]:
        assert c["allreduce_s"] > 0 and c["elementwise_s"] > 0 and c["collective_s"] >= 0
        assert c["bytes"] == c["rows"] * c["hidden"] * 2
    by_n = {r["devices"]: r for r in tp["rows"]}
    assert set(by_n) == {1, 2} and all("error" not in r for r in tp["rows"])
    assert by_n[2]["ar_bf16_bytes_per_device"] == by_n[1]["ar_bf16_bytes_per_device"] / 2
    assert by_n[1]["ar_bf16_tok_s"] > 0 and by_n[2]["spec_tok_s"] > 0
