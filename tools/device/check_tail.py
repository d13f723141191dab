"""GPU check and timing of the persistent layer-tail kernel (pallas_kernels/linear/tail_mgpu.py). Not in CI.

    PYTHONPATH=. timeout 300 python3 tools/device/check_tail.py --ms 1,8,16 --ctas-per-sm 1

On fresh random INT4 weights of the given shape (stacked [L, ...], read at a layer), per M:
1. the kernel against `layer_tail_reference` on the host CPU with the kernel's own bf16 weights
   (relative error <= TOL_BF16: only float32 summation orders and bf16 roundings of near-ties
   differ), against the model's three fused kernels (o + residual, gate_up + norm + SiLU·up,
   down + residual), and bit for bit against a second identical call (a race would differ);
2. row invariance at M = 5: row i of the call == the row alone, bit for bit;
3. (--loop) a layer loop of 2 L calls over one sync ref (`tail_mgpu.sync_words`), the loop index as the
   ordinal, with the down epilogue's row sums: each call's output == its layer's stand-alone call, bit for
   bit, the sums those of the output, and the ref's words what 2 L calls add (a wrong target hangs or races);
4. timing (in-device loop over the L layers, whose weights defeat the L2): the tail kernel (a fresh sync
   ref per call, and with --loop one ref for the whole loop, as the model runs it) against the three fused
   kernels, kernel time per layer and the weights' read floor.
A kernel that hangs (a grid-wide flag whose CTAs are not all resident) is cut by the outer timeout;
the last "..." line says which call.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax import lax  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from pallas_kernels.linear import layout as lay  # noqa: E402
from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402
from pallas_kernels.linear import tail_mgpu as tm  # noqa: E402
from qspec_jax.bench.timing import read_ceiling_bps, time_loop  # noqa: E402
from qspec_jax.bench.w4a16 import TOL_BF16  # noqa: E402
from sass_of_ptx import sass_of_ptx  # noqa: E402
from w4a16_persistent_probe import chained_us, median_us  # noqa: E402  (the probe's harness: same numbers, same way)

# (attention width, hidden size, MLP width). "smollm2": SmolLM2's own layer (since 2026-12-05 the tail takes its 576
# in 192-column k steps and 9 row tiles, the last pair the last tile twice); "smollm2-pad": padded to 256-column
# multiples, as the 42nd session measured it (kernel_notes "Forty-second session"); both with --k-groups 1 (their
# K are odd numbers of k steps)
SHAPES = {"8b": (4096, 4096, 14336), "smollm2": (576, 576, 1536), "smollm2-pad": (768, 768, 1536)}
# TailConfig fields with a comma-list option
CONFIG_LISTS = ("hand_bufs", "l2_prefetch", "stages", "mma_chains", "chunk_ready")


def weights(key, kq, d, f, layers, g=32):
    def one(k, n, key):
        k1, k2, k3 = jax.random.split(key, 3)
        return lay.pack_fields(jax.random.bits(k1, (layers, k // 2, n), jnp.uint8),
                               (0.02 * jax.random.uniform(k2, (layers, k // g, n), jnp.float32, 0.5, 1.5)
                                ).astype(jnp.float16),
                               (0.01 * jax.random.normal(k3, (layers, k // g, n))).astype(jnp.float16))
    ks = jax.random.split(key, 4)
    gw = (1.0 + 0.3 * jax.random.normal(ks[3], (layers, d))).astype(jnp.bfloat16)
    return one(kq, d, ks[0]), gw, one(d, 2 * f, ks[1]), one(f, d, ks[2])


def three_kernels(attn, x, wo, gw, wgu, wd, layer):
    """The model's fused draft tail today: three INT4 kernels with their epilogues."""
    x1 = mg.int4_matmul_mgpu(attn, wo, layer=layer, residual=x)
    act = mg.int4_matmul_mgpu(x1, wgu, layer=layer, norm_weight=gw, swiglu=True)
    return mg.int4_matmul_mgpu(act, wd, layer=layer, residual=x1)


def reference(attn, x, wo, gw, wgu, wd, layer):
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        a = jax.device_put((attn, x, gw[layer]), cpu)
        ws = [lay.dequantize_bf16(jax.device_put(jax.tree.map(lambda v: v[layer], w), cpu)).astype(jnp.float32)
              for w in (wo, wgu, wd)]
        return np.asarray(tm.layer_tail_reference(a[0], a[1], ws[0], a[2], ws[1], ws[2]), np.float32)


def rel(y, ref):
    y = np.asarray(y, np.float32)
    if not np.all(np.isfinite(y)):
        return float("inf")
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def print_ptxas(dump: str) -> None:
    """The ptxas report lines (function, registers, spills) of the kernels dumped so far."""
    for path in sorted(glob.glob(os.path.join(dump, "*.ptxas"))):
        if os.path.isfile(path):
            with open(path, errors="replace") as fh:
                for line in fh:
                    if "int4_layer_tail" in line or "registers" in line or "spill" in line:
                        print(f"ptxas {os.path.basename(path)}: {line.rstrip()[:200]}", flush=True)


def timeline_report(fn, attn, x, layers: int, calls: int) -> None:
    """Per-CTA phases from `calls` calls (layers in turn) of the kernel with TailConfig.timeline: o (finisher start
    -> its last o unit), gate_up (producer past flag 0 -> finisher's last gate_up unit), down (past flag 1 -> end);
    the spread of each over the CTAs, the slowest CTAs' SMs, and rank correlations of a CTA's phase times across
    phases and across calls (near 1: the same CTAs are slow every time, a systematic drift; near 0: random)."""
    cols = {c: i for i, c in enumerate(tm.TIMELINE_COLUMNS)}
    runs = []
    for i in range(calls + 1):
        _, tl = fn(attn, x, i % layers)
        tl = np.asarray(tl).astype(np.int64)
        if i == 0:
            continue  # the first call compiles and warms
        # ns since the first CTA started: signed offsets from CTA 0's start first (%globaltimer's low 32 bits wrap
        # every 4.3 s; a kernel spans microseconds)
        t = (tl - tl[0, cols["prod_start"]] + (1 << 31)) % (1 << 32) - (1 << 31)
        t = t - t[:, cols["prod_start"]].min()
        runs.append({"sm": tl[:, cols["sm"]],
                     "o": (t[:, cols["fin_o"]] - t[:, cols["fin_start"]]) / 1e3,
                     "gate_up": (t[:, cols["fin_gate_up"]] - t[:, cols["prod_flag0"]]) / 1e3,
                     "down": (t[:, cols["fin_down"]] - t[:, cols["prod_flag1"]]) / 1e3,
                     "end": t[:, cols["fin_down"]] / 1e3, "o_end": t[:, cols["fin_o"]] / 1e3,
                     "gu_end": t[:, cols["fin_gate_up"]] / 1e3,
                     "flag0": t[:, cols["prod_flag0"]] / 1e3, "flag1": t[:, cols["prod_flag1"]] / 1e3})

    def rank_corr(a, b):
        ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
        return float(np.corrcoef(ra, rb)[0, 1])

    for k, run in enumerate(runs):
        parts = " ".join(f"{ph} {run[ph].min():.1f}/{np.median(run[ph]):.1f}/{run[ph].max():.1f}"
                         for ph in ("o", "gate_up", "down", "flag0", "flag1", "end"))
        print(f"timeline call {k}: min/median/max us: {parts}", flush=True)
        for flag, done in (("flag0", "o_end"), ("flag1", "gu_end")):  # a flag's wait: the last arrival, then latency
            last = run[done].max()
            print(f"timeline call {k}: {flag}: finishers done median {np.median(run[done]):.2f} / last {last:.2f} us, "
                  f"producers past it first {run[flag].min():.2f} / median {np.median(run[flag]):.2f} / last "
                  f"{run[flag].max():.2f} us (first pass - last finisher {run[flag].min() - last:+.2f} us)", flush=True)
        for ph in ("gate_up", "down"):
            slow = np.argsort(run[ph])[-8:][::-1]
            print(f"timeline call {k}: slowest {ph}: CTA:SM " + " ".join(f"{c}:{run['sm'][c]}" for c in slow),
                  flush=True)
        print(f"timeline call {k}: rank corr gate_up~down {rank_corr(run['gate_up'], run['down']):+.2f} "
              f"o~gate_up {rank_corr(run['o'], run['gate_up']):+.2f}", flush=True)
    for ph in ("gate_up", "down"):  # by SM across calls (a CTA may land on another SM next call)
        by_sm = [dict(zip(run["sm"], run[ph])) for run in runs]
        sms = sorted(set.intersection(*(set(b) for b in by_sm)))
        if len(runs) > 1 and len(sms) > 2:
            cs = [rank_corr([by_sm[i][s] for s in sms], [by_sm[i + 1][s] for s in sms]) for i in range(len(runs) - 1)]
            print(f"timeline {ph}: rank corr by SM between consecutive calls " + " ".join(f"{c:+.2f}" for c in cs),
                  flush=True)


def loop_check(tail_fn, attn, x, layers: int, cfg, d: int, f: int) -> bool:
    """`tail_fn(a, x, layer, **kw)` called 2 L times in a jitted loop over one sync ref, ordinal = the loop
    index, layer = index mod L, with row sums: each output against the stand-alone call (bit for bit), the sums
    against the output's (float32 rounding), the ref's words against what 2 L calls add."""
    n = 2 * layers
    m = attn.shape[0]

    @jax.jit
    def loop(attn, x):
        sync = jax.new_ref(tm.sync_zeros(d, f), memory_space=plgpu.GMEM)

        def body(carry):  # a while loop, as the model's layer loop: jax 0.11's fori_loop of static bounds is a scan,
            i, ys, ss = carry  # whose carry loses a ref's memory space ("uint32<gmem>[...]" in, "uint32[...]" out)
            y, sums = tail_fn(attn, x, lax.rem(i, layers), row_sums=True, sync=sync, ordinal=i)
            return i + 1, ys.at[i].set(y), ss.at[i].set(sums)

        _, *outs = lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), jnp.zeros((n, m, d), jnp.bfloat16),
                                                             jnp.zeros((n, d // 64, mg.rows_for(m)), jnp.float32)))
        return outs, sync[...]

    (ys, sums), words = jax.block_until_ready(loop(attn, x))
    ys, sums, words = np.asarray(ys), np.asarray(sums), np.asarray(words).astype(np.int64)
    alone_fn = jax.jit(lambda layer: tail_fn(attn, x, layer))  # traced layer: one compile, not `layers`
    alone = [np.asarray(alone_fn(jnp.int32(layer))) for layer in range(layers)]
    bad = [i for i in range(n) if not np.array_equal(ys[i].view(np.uint16), alone[i % layers].view(np.uint16))]
    want_sums = np.stack([np.asarray(mg.chunk_row_sums(jnp.asarray(y), mg.rows_for(m))) for y in ys])
    e_sums = float(np.max(np.abs(sums - want_sums) / np.maximum(np.abs(want_sums), 1e-30)))
    o = tm.sync_offsets(d, f)
    pairs = tm.linear_pairs(d, f)
    want = np.zeros(tm.sync_words(d, f), np.int64)
    if not cfg.cluster:  # (a cluster's phase ends are its barrier: the flags stay 0)
        want[tm.SYNC_FLAGS:tm.SYNC_FLAGS + (1 if cfg.chunk_ready else 2)] = n * cfg.ctas  # flag 1 unused with ready
    if cfg.chunk_ready:  # each K chunk of gate_up / down: the previous linear's pairs whose columns it holds
        r0, step = tm.ready_offsets(d, f), tm.ready_pairs(cfg, d, f)
        for p in range(2):
            want[r0[p]:r0[p] + cfg.chunks[p + 1]] = n * step[p]
    for p in range(3):
        want[o[p]:o[p] + pairs[p]] = n * (cfg.chunks[p] - 1)
    words_ok = np.array_equal(words, want)
    ok = not bad and e_sums <= 1e-5 and words_ok
    print(f"loop M={m}: {n} calls over one sync ref: {len(bad)} differ from the stand-alone call {bad[:4]}, row sums "
          f"max relerr {e_sums:.1e}, ref words {'as counted' if words_ok else 'WRONG'} {'ok' if ok else 'FAIL'}",
          flush=True)
    return ok


def chained_sync_us(tail_fn, attn, x, layers: int, iters: int, d: int, f: int, trials: int = 5) -> float:
    """`chained_us`'s harness for the tail with one sync ref for the whole run (the model's layer loop: no
    zero-init launch per call), each call's ordinal the calls before it: `layers` calls unrolled per while
    iteration (one call a while iteration puts the loop's own overhead in every call's time: 60.6 us a call on the
    H100, 50th session, a number not used), each through
    one jitted function of traced layer, ordinal and ref, so the kernel is lowered once (49th: a Python-int layer
    per call site lowered it 32 times, ~4.5 s each, and ran out of its 240 s)."""
    one = jax.jit(lambda a, layer, ordinal, sync: tail_fn(a, x, layer, sync=sync, ordinal=ordinal))

    def run(_):
        sync = jax.new_ref(tm.sync_zeros(d, f), memory_space=plgpu.GMEM)

        def body(carry):  # a while loop (loop_check says why)
            i, acc = lax.optimization_barrier(carry)
            for cpy in range(layers):
                _, acc = lax.optimization_barrier((acc, acc))
                a = (attn.astype(jnp.float32) + acc).astype(jnp.bfloat16)
                y = one(a, jnp.int32(cpy), i * layers + cpy, sync)
                acc = acc + jnp.sum(y.astype(jnp.float32)[:1, :1])
            return i + 1, acc
        return lax.while_loop(lambda c: c[0] < iters, body, (jnp.int32(0), jnp.zeros((), jnp.float32)))[1]

    return median_us(run, iters * layers, trials, label="shared-ref chain")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b", choices=tuple(SHAPES))
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--ctas-per-sm", default="1", help="comma-separated, each checked and timed")
    ap.add_argument("--k-groups", default="2", help="comma-separated TailConfig.k_groups, each checked and timed")
    ap.add_argument("--sms", type=int, default=0, help="SMs the grid is sized for (ctas = ctas-per-sm x sms; 0: the "
                    "device's): fewer CTAs for tiny shapes, whose flags then wait for fewer finishers")
    ap.add_argument("--cluster", default="0", help="comma-separated 0 / 1, each checked and timed: 1 launches the grid "
                    "as one thread-block cluster (TailConfig.cluster: --sms CTAs, at most "
                    f"{tm.MAX_CLUSTER_CTAS}) whose phase ends are the cluster barrier instead of the grid-wide flags")
    ap.add_argument("--diags", default="", help="comma-separated TailConfig.diag values also timed (wrong results)")
    ap.add_argument("--no-three", action="store_true", help="do not time the three fused kernels")
    ap.add_argument("--no-full", action="store_true", help="time only the diagnostics (e.g. where the full kernel "
                    "would hang: more CTAs than can be resident)")
    for field in CONFIG_LISTS:
        ap.add_argument(f"--{field.replace('_', '-')}", default="", help=f"comma-separated TailConfig.{field} "
                        "values (integers), each checked and timed (default: the config's)")
    ap.add_argument("--parts", action="store_true", help="also time the three kernels' parts: o alone, gate_up + down "
                    "(the baseline of a persistent MLP-only kernel)")
    ap.add_argument("--timeline", type=int, default=0, help="calls of the kernel with TailConfig.timeline: per-CTA "
                    "phase times, the slowest CTAs' SMs, and whether the same CTAs are slow in every phase and call")
    ap.add_argument("--chunks", default="", help="o,gate_up,down K chunks instead of the default's (e.g. 4,2,4)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dump", default="", help="directory: Mosaic GPU's ptxas report and SASS of every kernel "
                    "compiled; their ptxas lines (registers, spills) printed at the end")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--trace", action="store_true", help="also each timed variant's kernels alone: a profiler trace "
                    "of a loop of calls (the output fed back as the next input; Kq == D), GPU time per call by "
                    "kernel name")
    ap.add_argument("--loop", action="store_true", help="also check a layer loop over one sync ref (3. above) and "
                    "time the tail with one ref for the whole run")
    args = ap.parse_args()
    if args.dump:  # read by Mosaic GPU when it compiles (nothing has compiled yet)
        os.makedirs(args.dump, exist_ok=True)
        # the PTX and ptxas' report; the SASS from the PTX at the end (the GPU machine has no nvdisasm, which
        # MOSAIC_GPU_DUMP_SASS needs: H200, 2026-12-03)
        os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=args.dump)
    ptx_of = {}  # timed label -> the PTX its first compile dumped (--dump)
    kq, d, f = SHAPES[args.shape]
    if args.parts and kq != d:
        ap.error(f"--parts feeds the chained input to o and to gate_up: needs Kq == D, got {kq} and {d}")
    L = args.layers
    key = jax.random.PRNGKey(int(time.time()))  # fresh inputs every run
    wo, gw, wgu, wd = weights(key, kq, d, f, L)
    part_bytes = [lay.packed_bytes(k, n, 32) for k, n in ((kq, d), (d, 2 * f), (f, d))]  # o, gate_up, down
    nbytes = sum(part_bytes)
    floor = nbytes / read_ceiling_bps() * 1e6
    print(f"shape {args.shape}: Kq {kq} D {d} F {f}, {nbytes / 1e6:.1f} MB of INT4 weights per layer, "
          f"floor {floor:.2f} us; {jax.devices()[0].device_kind}", flush=True)
    lists = [[int(v) for v in getattr(args, f).split(",")] if getattr(args, f) else [None] for f in CONFIG_LISTS]
    clusters = [bool(int(v)) for v in args.cluster.split(",")]
    if any(clusters) and not 1 <= args.sms <= tm.MAX_CLUSTER_CTAS:
        ap.error(f"--cluster 1 needs --sms 1..{tm.MAX_CLUSTER_CTAS} (the cluster's CTAs), got {args.sms}")
    combos = [(int(c), int(q), dict(zip(CONFIG_LISTS, vals), cluster=cl)) for c in args.ctas_per_sm.split(",")
              for q in args.k_groups.split(",") for vals in itertools.product(*lists) for cl in clusters]
    for cps, kgs, overrides in combos:
        for m in (int(v) for v in args.ms.split(",")):
            cfg = tm.default_tail_config(kq, d, f, 32, m, ctas_per_sm=cps, k_groups=kgs, num_sms=args.sms or None)
            cfg = cfg.replace(**{f: type(getattr(cfg, f))(v) for f, v in overrides.items() if v is not None})
            if args.chunks:
                cfg = cfg.replace(chunks=tuple(int(v) for v in args.chunks.split(",")))
            tag = ", cluster" if cfg.cluster else ""
            kx = jax.random.fold_in(key, 100 * m + cps)
            attn = jax.random.normal(kx, (m, kq)).astype(jnp.bfloat16)
            x = jax.random.normal(jax.random.fold_in(kx, 1), (m, d)).astype(jnp.bfloat16)
            def tail_fn(a, x, layer, cfg=cfg, **kw):  # unjitted (a sync ref stays out of a jit's arguments)
                return tm.int4_layer_tail_mgpu(a, x, wo, gw, wgu, wd, layer=layer, config=cfg, **kw)

            tail = jax.jit(tail_fn)
            three = jax.jit(lambda a, x, layer: three_kernels(a, x, wo, gw, wgu, wd, layer))
            print(f"... M={m} {cfg}", flush=True)
            if not args.skip_check:
                y = np.asarray(tail(attn, x, 1), np.float32)
                y2 = np.asarray(tail(attn, x, 1), np.float32)
                ref = reference(attn, x, wo, gw, wgu, wd, 1)
                e_ref, e_three = rel(y, ref), rel(y, np.asarray(three(attn, x, 1), np.float32))
                same = np.array_equal(y.view(np.uint32), y2.view(np.uint32))
                ok = e_ref <= TOL_BF16 and same
                print(f"check M={m} ctas/SM {cps}{tag}: rel_ref {e_ref:.2e} rel_three {e_three:.2e} "
                      f"deterministic {same} {'ok' if ok else 'FAIL'}", flush=True)
                if cfg.chunk_ready:  # another wait, the same sums: bit for bit the flags' output
                    yf = np.asarray(tail_fn(attn, x, 1, cfg=cfg.replace(chunk_ready=False)), np.float32)
                    eq = np.array_equal(y.view(np.uint32), yf.view(np.uint32))
                    print(f"check M={m} ctas/SM {cps}: ready counters bit for bit the flags' output {eq} "
                          f"{'ok' if eq else 'FAIL'}", flush=True)
                if args.loop:
                    loop_check(tail_fn, attn, x, L, cfg, d, f)
                if m == 8:  # row invariance on 5 of the rows
                    a5, x5 = attn[:5], x[:5]
                    y5 = np.asarray(tail(a5, x5, 1)).view(np.uint16)
                    bad = sum(int(not np.array_equal(y5[i], np.asarray(tail(a5[i:i + 1], x5[i:i + 1], 1)
                                                                       ).view(np.uint16)[0])) for i in range(5))
                    print(f"rows M=5 ctas/SM {cps}: {bad} of 5 differ {'ok' if bad == 0 else 'FAIL'}", flush=True)
            if args.timeline:
                timeline_report(jax.jit(lambda a, x, layer, cfg=cfg: tm.int4_layer_tail_mgpu(
                    a, x, wo, gw, wgu, wd, layer=layer, config=cfg.replace(timeline=True))), attn, x, L, args.timeline)
            iters = max(4, int(20e-3 / (nbytes / 3e12) / L))
            # the three kernels once per shape and M: with the non-cluster combination where --cluster has both
            three_here = not args.no_three and (not cfg.cluster or all(clusters))
            timed = (([] if args.no_full else [(f"tail kernel{tag}", tail)])
                     + ([("three fused kernels", three)] if three_here else []))
            floors = {}  # label -> its own bytes' floor where not the whole layer's
            if args.parts:
                timed.append(("o kernel alone", jax.jit(
                    lambda a, x, layer: mg.int4_matmul_mgpu(a, wo, layer=layer, residual=x))))
                timed.append(("gate_up + down", jax.jit(  # x1 = the chained input, x the residual's stand-in
                    lambda a, x, layer: mg.int4_matmul_mgpu(mg.int4_matmul_mgpu(
                        a, wgu, layer=layer, norm_weight=gw, swiglu=True), wd, layer=layer, residual=a))))
                floors = {label: b / read_ceiling_bps() * 1e6 for label, b in
                          (("o kernel alone", part_bytes[0]), ("gate_up + down", part_bytes[1] + part_bytes[2]))}
            for diag in filter(None, args.diags.split(",")):
                timed.append((f"tail, diag {diag}{tag}", jax.jit(
                    lambda a, x, layer, cfg=cfg.replace(diag=diag): tm.int4_layer_tail_mgpu(
                        a, x, wo, gw, wgu, wd, layer=layer, config=cfg))))
            if args.loop and not args.no_full:
                us = chained_sync_us(tail_fn, attn, x, L, iters, d, f)
                print(f"time M={m} ctas/SM {cps}: {'tail, one sync ref' + tag:20s} {us:8.2f} us  {floor / us:4.0%} "
                      "of the floor", flush=True)
            for label, fn in timed:
                before = set(glob.glob(os.path.join(args.dump, "*.ptx"))) if args.dump else set()
                # the probe's chain: per "copy" (here a layer of the stack) one call, acc threaded through
                us = chained_us(lambda layer, fn=fn: [lambda acc: fn((attn.astype(jnp.float32) + acc).astype(
                    jnp.bfloat16), x, layer)], L, iters, label=label)
                print(f"time M={m} ctas/SM {cps}: {label:20s} {us:8.2f} us  {floors.get(label, floor) / us:4.0%} of "
                      f"{'its' if label in floors else 'the'} floor",
                      flush=True)
                if args.dump:
                    new_ptx = sorted(set(glob.glob(os.path.join(args.dump, "*.ptx"))) - before, key=os.path.getmtime)
                    if new_ptx:
                        ptx_of[f"{len(ptx_of):02d}_m{m}_{label}"] = (new_ptx[0], cfg)
                if args.trace and kq == d:
                    with tempfile.TemporaryDirectory() as tdir:
                        got = time_loop(lambda q, _, fn=fn: fn(q, x, 1), attn, 50, 3, trace_dir=tdir)
                    print(f"trace M={m} ctas/SM {cps}: {label:20s} " + ", ".join(
                        f"{name[:48]} {t:.2f} us" for name, t in sorted(got["kernels"].items(), key=lambda kv: -kv[1])
                        [:4]), flush=True)
    if args.dump:
        print_ptxas(args.dump)
        for label, (ptx, cfg) in ptx_of.items():  # <dump>/<nn>_m<M>_<label>.sass: each timed variant's kernel
            sass, _ = sass_of_ptx(ptx)
            os.replace(sass, os.path.join(args.dump, label.replace(", ", "_").replace(" ", "_") + ".sass"))
            print(f"sass {label}: {os.path.basename(ptx)} {cfg}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
