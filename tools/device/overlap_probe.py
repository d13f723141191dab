"""Can XLA run two independent kernel chains of one program at the same time on the GPU? (46th session)

Issue 31's SmolLM2 batch-32 draft call pays a fixed part of ~10-13 us per layer (kernel_notes, "Forty-sixth
session"), and PDL cannot hide it inside XLA's command buffers. The rows of a batch are independent sequences, so a
draft step over two half-batches could overlap one half's attention (memory-bound, many SMs) with the other half's
small linears (latency-bound, few SMs) — if XLA runs independent chains concurrently. This probe asks that question
with stand-ins, inside a `fori_loop` as in the model:

  chain L: `--small` back-to-back INT4 linears at M rows (SmolLM2's o shape, 576 x 576; each feeds the next);
  chain M: a memory-bound XLA reduction over a `--mbytes` bf16 array (all SMs, little shared memory).

It times L alone, M alone and both in one loop body, and reports how much of the shorter chain the pair hid:
overlap = (t_L + t_M - t_both) / min(t_L, t_M) (0: serial, 1: fully hidden). Run it once per XLA setting (flags are
read when the backend starts), e.g.

    PYTHONPATH=. python3 tools/device/overlap_probe.py                      # default command buffers
    XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT PYTHONPATH=. python3 tools/device/overlap_probe.py
    XLA_FLAGS=--xla_gpu_graph_enable_concurrent_region=true PYTHONPATH=. python3 tools/device/overlap_probe.py
    XLA_FLAGS=--xla_gpu_experimental_stream_annotation=true PYTHONPATH=. python3 tools/device/overlap_probe.py \\
        --annotate                                                          # chain M on `compute_on('gpu_stream:1')`

On the CPU (`--backend xla`) it only checks that the programs build and agree; the times mean nothing there.
Not in CI.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import qspec_jax  # noqa: E402,F401  (XLA flags)
from pallas_kernels.linear import int4_linear  # noqa: E402
from qspec_jax.bench.e2e import median_seconds  # noqa: E402
from w4a16_config_sweep import weights  # noqa: E402

K = N = 576  # SmolLM2's o projection: the small, latency-bound kernel of its draft layer
GROUP = 32


def chain_l(x: jax.Array, ws: list, backend: str) -> jax.Array:
    """`len(ws)` dependent INT4 linears: x [M, K] -> [M, N], each output the next input."""
    for w in ws:
        x = int4_linear(x, w, backend=backend)
    return x


def chain_m(a: jax.Array) -> jax.Array:
    """A memory-bound reduction over a [R, 4096] bf16 array -> float32 [4096]."""
    return jnp.max(a, axis=0).astype(jnp.float32)


def build(mode: str, ws: list, backend: str, iters: int, annotate: bool):
    """The jitted loop for `mode` in ("L", "M", "both"): `iters` trips, each running the chain(s) once."""
    m_fn = chain_m
    if annotate:
        from jax.experimental.compute_on import compute_on

        try:  # jax >= 0.11: a function transform that names its outputs' memory space
            m_fn = compute_on(jax.jit(chain_m), compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)
        except TypeError:  # jax 0.10: compute_on(compute_type) as a decorator
            m_fn = compute_on("gpu_stream:1")(jax.jit(chain_m))

    def f(x, a):
        def body(i, carry):
            xc, mc = carry
            ws_i, a_i, _ = lax.optimization_barrier((ws, a, i))  # a fresh read every trip
            if mode in ("L", "both"):
                xc = chain_l(xc, ws_i, backend)
            if mode in ("M", "both"):
                mc = mc + m_fn(a_i)
            return xc, mc
        return lax.fori_loop(0, iters, body, (x, jnp.zeros((a.shape[1],), jnp.float32)))

    return jax.jit(f)


def timed(fn, x, a, trials: int) -> tuple[float, tuple]:
    """(median seconds of a call after a warm-up call, the warm-up's result)."""
    out = jax.block_until_ready(fn(x, a))
    return median_seconds(lambda: fn(x, a), trials), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16, help="M of chain L's linears (a half-batch of 32)")
    ap.add_argument("--small", type=int, default=4, help="linears in chain L (a draft layer has four)")
    ap.add_argument("--mbytes", type=float, default=28.0, help="MB chain M reads (half of SmolLM2's batch-32 draft "
                                                                "call at 8k: ~28 MB)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--annotate", action="store_true", help="chain M under compute_on('gpu_stream:1') (needs "
                                                           "--xla_gpu_experimental_stream_annotation=true)")
    ap.add_argument("--backend", default="auto", help="int4_linear backend (xla on the CPU: a smoke test)")
    args = ap.parse_args(argv)
    key = jax.random.PRNGKey(0)
    ws = weights(key, K, N, GROUP, args.small)  # distinct weights, as a layer's four are
    x = jax.random.normal(jax.random.fold_in(key, 7), (args.rows, K), jnp.float32).astype(jnp.bfloat16) * 0.1
    r = max(1, int(args.mbytes * 1e6 / (4096 * 2)))
    a = jax.random.normal(jax.random.fold_in(key, 8), (r, 4096), jnp.float32).astype(jnp.bfloat16)
    print(f"device {jax.devices()[0].device_kind}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
          f"annotate={args.annotate}; chain L {args.small} x INT4 {K}x{N} at M {args.rows}; chain M {r}x4096 bf16 "
          f"({r * 4096 * 2 / 1e6:.1f} MB); {args.iters} trips", flush=True)
    times, outs = {}, {}
    for mode in ("L", "M", "both"):
        try:
            t, outs[mode] = timed(build(mode, ws, args.backend, args.iters, args.annotate and mode != "L"),
                                  x, a, args.trials)
        except Exception as e:  # noqa: BLE001 - a setting XLA refuses is a result of the probe
            print(f"  {mode}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            return 1
        times[mode] = t / args.iters * 1e6
        print(f"  {mode:4s} {times[mode]:8.2f} us a trip", flush=True)
    # bit for bit: 800 chained linears of unnormalized activations overflow to inf / NaN, where array_equal says
    # False for equal NaNs (50th session: "L False" under every setting, the serial one too)
    same_l = bool(np.array_equal(np.asarray(outs["both"][0]).view(np.uint16), np.asarray(outs["L"][0]).view(np.uint16)))
    same_m = bool(np.array_equal(np.asarray(outs["both"][1]).view(np.uint32), np.asarray(outs["M"][1]).view(np.uint32)))
    tl, tm, tb = times["L"], times["M"], times["both"]
    overlap = (tl + tm - tb) / min(tl, tm)
    print(f"== serial sum {tl + tm:.2f} us, both {tb:.2f} us: overlap {overlap:.2f} of the shorter chain; "
          f"results equal to the chains alone: L {same_l}, M {same_m}", flush=True)
    return 0 if same_l and same_m else 1


if __name__ == "__main__":
    sys.exit(main())
