"""Where the warp-specialized decode attention's time goes inside one call, from Mosaic GPU's on-device profiler.

    PYTHONPATH=. python3 tools/device/attention_timeline.py [--shape smollm2] [--batch 32] [--ctx 8192]
        [--view draft|target] [--t 1] [--layout uniform|ragged] [--tokens flat,flat~3%6] [--keep DIR]

Runs the kernel (`MgpuConfig.ws_profile_dir`: each warpgroup records the regions of
`mosaic_gpu_ws.PROFILE_REGIONS` with the global timer) on a random cache, takes the last call's trace and prints,
per config token (`ragged_attention.config_of`):

* the call's span (first warpgroup start to last warpgroup end) and how the CTAs' starts and ends spread
  (launch skew and load imbalance: percentiles over the CTAs);
* per role, the mean per CTA of each region's total (consumers: c_all, c_blk, c_wait, c_ring, c_end, and c_all
  outside every other region, i.e. segment set-up and query waits; prep: p_all, p_blk, p_wait), with the
  region counts; the median c_blk / c_wait / p_blk per block;
* the CTA that ends last: its consumers' and prep's regions in order (first and last few).

The profiler's own cost (a timer read and a shared-memory store per event, ~12 cycles) is in the numbers. A
timing diagnostic for the GPU; its results are the kernel's (the regions change no arithmetic).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import qspec_jax  # noqa: E402,F401  (XLA flags)
from qspec_jax.bench import kernel as K  # noqa: E402
from qspec_jax.bench.e2e import batch_lengths  # noqa: E402
from qspec_jax.bench.synthetic import attention_config, random_quant_cache  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from ragged_attention import config_of  # noqa: E402


def regions(trace: dict) -> dict:
    """{(cta, warpgroup): [(name, start_us, end_us)]} from a Mosaic GPU profiler trace (B/E events per tid)."""
    out = collections.defaultdict(list)
    stacks = collections.defaultdict(list)
    for ev in trace["traceEvents"]:
        key = ev["tid"]
        if ev["ph"] == "B":
            stacks[key].append((ev["name"], ev["ts"]))
        else:
            name, t0 = stacks[key].pop()
            out[key].append((name, t0, ev["ts"]))
    return out


def summarize(trace: dict, n_wg: int, consumers: int) -> None:
    by_tid = regions(trace)
    ctas = collections.defaultdict(dict)  # cta -> wg -> regions
    for tid, regs in by_tid.items():
        cta, wg = divmod(tid - 1, n_wg)
        ctas[cta][wg] = sorted(regs, key=lambda r: r[1])
    starts = {c: min(r[1] for regs in wgs.values() for r in regs) for c, wgs in ctas.items()}
    ends = {c: max(r[2] for regs in wgs.values() for r in regs) for c, wgs in ctas.items()}
    t0 = min(starts.values())
    span = max(ends.values()) - t0
    pct = lambda xs: " / ".join(f"{np.percentile(xs, q):.1f}" for q in (0, 10, 50, 90, 100))  # noqa: E731
    print(f"  span {span:.1f} us over {len(ctas)} CTAs; CTA start after the first (p0/p10/p50/p90/p100): "
          f"{pct([s - t0 for s in starts.values()])} us; CTA end: {pct([e - t0 for e in ends.values()])} us")
    roles = {"consumer": range(consumers), "prep": range(consumers, n_wg)}
    for role, wgs in roles.items():
        tot = collections.defaultdict(float)
        cnt = collections.defaultdict(int)
        per = collections.defaultdict(list)
        n = 0
        for c, by_wg in ctas.items():
            for wg in wgs:
                regs = by_wg.get(wg, [])
                if not regs:
                    continue
                n += 1
                for name, a, b in regs:
                    tot[name] += b - a
                    cnt[name] += 1
                    per[name].append(b - a)
                if role == "consumer":
                    inner = sum(b - a for name, a, b in regs if name in ("c_blk", "c_ring", "c_end"))
                    tot["c_all - (blk + ring + end)"] += sum(b - a for name, a, b in regs if name == "c_all") - inner
        if not n:
            continue
        line = ", ".join(f"{k} {v / n:.1f} us ({cnt[k] / n:.1f})" if k in cnt else f"{k} {v / n:.1f} us"
                         for k, v in sorted(tot.items()))
        print(f"  {role} (mean per warpgroup of {n}): {line}")
        med = ", ".join(f"{k} {np.median(v):.3f}" for k, v in sorted(per.items()) if k not in ("c_all", "p_all"))
        print(f"  {role} median per region (us): {med}")
    last = max(ends, key=ends.get)
    print(f"  last CTA {last} (ends at {ends[last] - t0:.1f} us):")
    for wg, regs in sorted(ctas[last].items()):
        top = [r for r in regs if r[0] in ("c_blk", "c_ring", "c_end", "c_arr", "c_km", "p_blk")]
        show = top[:4] + ([("...", 0, 0)] if len(top) > 8 else []) + top[-4:] if len(top) > 8 else top
        seq = " ".join(f"{nm}@{a - t0:.1f}+{b - a:.2f}" if nm != "..." else "..." for nm, a, b in show)
        print(f"    wg {wg}: {len(top)} regions: {seq}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2", choices=sorted(K.SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--view", default="draft", choices=("draft", "target"))
    ap.add_argument("--t", type=int, default=1)
    ap.add_argument("--layout", default="uniform", choices=("uniform", "ragged"))
    ap.add_argument("--tokens", default="flat", help="','-separated ragged_attention config tokens")
    ap.add_argument("--keep", default=None, help="copy each token's trace here")
    args = ap.parse_args(argv)

    from pallas_kernels.decode_attention import mosaic_gpu as mg
    from pallas_kernels.decode_attention import mosaic_gpu_ws as ws

    hq, hkv, d = K.SHAPES[args.shape]
    cfg = attention_config(hq, hkv, d)
    lengths = batch_lengths(args.batch, args.ctx) if args.layout == "ragged" else None
    key = jax.random.PRNGKey(0)
    cache = random_quant_cache(cfg, args.batch, args.ctx, key, layers=1, fp_start=3, lengths=lengths)
    q = jax.random.normal(jax.random.fold_in(key, 1), (args.batch, args.t, hq, d), jnp.float32).astype(jnp.bfloat16)
    q_pos = (cache.q_len + cache.fp_len)[:, None] - args.t + jnp.arange(args.t, dtype=jnp.int32)[None, :]
    for tok in args.tokens.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            conf = dataclasses.replace(config_of(tok), ws_profile_dir=tmp)  # (the target view's "flat": `geo_work`)
            call = jax.jit(lambda q, p, c: mg.quantized_decode_attention_mgpu(q, p, c, jnp.int32(0), view=args.view,
                                                                              config=conf))
            for i in range(3):  # the third call's trace: Pallas keeps a trace file rather than overwrite it ("profile
                # already exists"), so the earlier calls' are removed (before the twenty-ninth session every summary was
                # of the first, cold call)
                if i:
                    for f in glob.glob(os.path.join(tmp, "*-trace.json")):
                        os.remove(f)
                jax.block_until_ready(call(q, q_pos, cache))
            files = sorted(glob.glob(os.path.join(tmp, "*-trace.json")))
            if not files:
                print(f"== {tok}: no trace written", flush=True)
                continue
            with open(files[-1]) as f:
                trace = json.load(f)
            if args.keep:
                os.makedirs(args.keep, exist_ok=True)
                os.replace(files[-1], os.path.join(args.keep, f"{args.view}_{tok.replace('%', 'st')}.json"))
        nc = conf.ws_consumers or ws.CONSUMERS
        npr = conf.ws_preps or 1
        print(f"== {args.shape} batch {args.batch} ctx {args.ctx} ({args.layout}) {args.view} T {args.t} {tok}: "
              f"{len(trace['traceEvents'])} events", flush=True)
        summarize(trace, nc + npr + 1, nc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
