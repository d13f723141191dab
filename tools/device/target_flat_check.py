"""The target view's balanced schedule on the GPU (`MgpuConfig.ws_flat` in the verify's INT8 view: shares
fixed by the cache's geometry, `mosaic_gpu_ws.geo_work`), on fresh random caches of rows of different lengths.

    PYTHONPATH=. python3 tools/device/target_flat_check.py [--shape smollm2] [--batch 32] [--ctx 8192] [--ts 1,3,5]

For each T of --ts: the balanced schedule and the row split against the jnp reference (relative error; the two
schedules sum in different orders), then bit-for-bit properties the verify's exactness rests on:
  tinv   each row's last query column of the T call equals the T = 1 call's;
  local  a row's output equals its output beside rows of other lengths (the verify's batch and the
         autoregressive batch it is compared with differ in every other row), whose shares, segments and
         per-consumer slot rings are laid out from the geometry (interpret mode cannot check the slot rings:
         it gives every block its own slot).
Prints one line per check ("ok" / "FAIL"); exit status 1 if any failed. `--interpret` runs the kernels in GPU
interpret mode (a CPU smoke test of the script at small sizes; tests/test_attention_mgpu.py runs it).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import qspec_jax  # noqa: E402,F401  (XLA flags)
from pallas_kernels.decode_attention import mosaic_gpu as mg  # noqa: E402
from qspec_jax import attention as A  # noqa: E402
from qspec_jax.bench import kernel as K  # noqa: E402
from qspec_jax.bench.e2e import batch_lengths  # noqa: E402
from qspec_jax.bench.synthetic import attention_config, random_quant_cache  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2", choices=sorted(K.SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--ts", default="1,3,5")
    ap.add_argument("--seed", type=int, default=300)
    ap.add_argument("--consumers", type=int, default=None, help="MgpuConfig.ws_consumers of the balanced schedule")
    ap.add_argument("--group", type=int, default=128, help="the cache's quantization group (tokens per block)")
    ap.add_argument("--interpret", action="store_true", help="GPU interpret mode (CPU; the SMEM-operand twin)")
    args = ap.parse_args(argv)
    hq, hkv, d = K.SHAPES[args.shape][:3]
    cfg = attention_config(hq, hkv, d)
    b = args.batch
    lens_a = batch_lengths(b, args.ctx)
    r = b // 2  # the row the locality check keeps; every other row gets another length
    lens_b = lens_a[::-1].copy()
    lens_b[r] = lens_a[r]
    if b > 1 and lens_b[(r + 1) % b] == lens_a[(r + 1) % b]:
        lens_b[(r + 1) % b] = args.ctx // 3
    key = jax.random.PRNGKey(args.seed)
    caches = [random_quant_cache(cfg, b, args.ctx, key, layers=1, fp_start=3, group=args.group,
                                 lengths=jnp.asarray(x)) for x in (lens_a, lens_b)]
    call = jax.jit(lambda q, p, c, conf: mg.quantized_decode_attention_mgpu(
        q, p, c, jnp.int32(0), view="target", config=conf, interpret=args.interpret), static_argnums=3)
    ref_call = jax.jit(lambda q, p, c: A.quantized_cache_attention(q, p, c, jnp.int32(0), "target", None))
    twin = {"register_a": False, "schedule": "ws"} if args.interpret else {}  # interpret mode: the SMEM-operand twin
    geo = mg.MgpuConfig(ws_flat=True, ws_consumers=args.consumers, **twin)
    row = mg.MgpuConfig(ws_flat=False, **twin)
    ts = sorted(int(x) for x in args.ts.split(","))
    t_max = ts[-1]
    q = jax.random.normal(jax.random.fold_in(key, 7), (b, t_max, hq, d), jnp.float32).astype(jnp.bfloat16)
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    failed = 0

    def expect(ok: bool, what: str) -> None:
        nonlocal failed
        failed += not ok
        print(f"{what} {'ok' if ok else 'FAIL'}", flush=True)

    last = {}
    for t in ts:
        outs = {}
        for name, cache in zip("ab", caches):
            pos = (cache.q_len + cache.fp_len)[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
            outs[name] = f64(call(q[:, -t:], pos, cache, geo))
            if name == "a":
                ref = np.asarray(ref_call(q[:, -t:], pos, cache), np.float64)
                o_row = f64(call(q[:, -t:], pos, cache, row))
                for label, o in (("geo", outs[name]), ("row", o_row)):
                    err = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
                    expect(bool(np.isfinite(o).all()) and err <= 2e-2,
                           f"check {args.shape} B{b} {args.ctx} T{t} {label}: relerr {err:.2e} vs the jnp reference")
        if 1 in last:
            expect(np.array_equal(outs["a"][:, -1], last[1][:, 0]),
                   f"tinv  {args.shape} B{b} {args.ctx} T{t}: every row's last column == its T 1 call's, bitwise")
        expect(np.array_equal(outs["a"][r], outs["b"][r]),
               f"local {args.shape} B{b} {args.ctx} T{t}: row {r} ({lens_a[r]} tokens) beside rows of other lengths, "
               "bitwise")
        last[t] = outs["a"]
    print(f"{failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
