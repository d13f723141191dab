"""Would one persistent kernel stream a draft layer's INT4 linears faster than one kernel each? (issue 32;
kernel_notes "Nineteenth session"). A probe with no math: the W4A16 kernel's TMA ring (wide view, k tile 256, two row
tiles per CTA, the producer warpgroup and two consumer warpgroups that only wait and release, as in
`MgpuConfig(diag="stream")`) run as ONE persistent grid of `ctas` CTAs over the weights of several linears in turn
(o -> gate_up -> down). Work units are (row-tile pair, K chunk) (`balanced_chunks`: at least one unit per CTA, or
whole pairs with --balance 0), dealt round robin from the CTA where the previous linear's deal ended; a CTA's
producer runs on into the next linear's tiles while its consumers finish the previous one, so the ring never drains.

--flags 1 adds what the real kernel needs between the linears (gate_up's x is o's whole output): a grid-wide flag
the consumers wait on before each linear after the first. --flag-kind poll: every consumer warpgroup adds 1 to a
uint32 counter in global memory (`red.release.gpu`) and polls it (`ld.acquire.gpu`; --spin: by every thread, by
lane 0 of each warp, or by thread 0 of the warpgroup) until it holds 2 x ctas (--no-wait: arrive, poll once, go
on: the flag's own cost without the wait for the slowest CTA); semaphore: CTA 0 waits on a Pallas semaphore for every count, then
releases each CTA's own semaphore in turn. Every CTA must be resident at once (ctas <= 2 per SM at <= 100 KB of
shared memory each), or a flag deadlocks (the commands below run under `timeout`).

Timed in the sweep's harness (a chain of calls over weight copies that defeat the L2), against the same weights
through the model's dispatched kernels one after another, stream-only (`diag="stream"`) and full. Not in CI;
`--lower-only` lowers every variant for CUDA on a CPU machine.

    PYTHONPATH=. timeout 170 python3 tools/device/w4a16_persistent_probe.py --stages 4 --flags 0,1 --balance 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tools", "device"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from pallas_kernels import _common  # noqa: E402
from pallas_kernels.linear import layout as lay  # noqa: E402
from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402
from qspec_jax.bench.timing import read_ceiling_bps  # noqa: E402
from qspec_jax.bench.w4a16 import BENCH_SHAPES  # noqa: E402

KT = 256  # k tile: 4 blocks of 64
WGS = 2  # row tiles (consumer warpgroups) per CTA
VIEW = mg.TMA_VIEWS["wide"]


def _mlir():
    """The MLIR modules the inline PTX is built with (imported late: they need jaxlib's MLIR)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic.gpu import utils as mu
    return ir, arith, llvm, mu


def _arrive(counter: Any) -> None:
    """Thread 0 of the calling warpgroup adds 1 to the uint32 `counter` (a global ref of one word)
    with release semantics at gpu scope."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def fn(ctx, ref):
        del ctx
        ir, _, llvm, mu = _mlir()
        ptr = llvm.ptrtoint(ir.IntegerType.get_signless(64), mu.memref_ptr(ref))
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [ptr],
                        "{\n.reg .pred p;\n.reg .u32 t;\nmov.u32 t, %tid.x;\nand.b32 t, t, 127;\n"
                        "setp.eq.u32 p, t, 0;\n@p red.release.gpu.global.add.u32 [$0], 1;\n}",
                        "l", has_side_effects=True)

    fn(counter)


SPIN_ASM = {
    # every thread polls (measured on the H200: ~4.7 us a flag with 2 x 264 warpgroups on one word)
    "all": "{\n.reg .pred p;\n.reg .u32 v;\nSPIN:\nld.acquire.gpu.global.u32 v, [$0];\n"
           "setp.lt.u32 p, v, $1;\n@p bra SPIN;\n}",
    # lane 0 of each warp polls, the warp's other lanes wait for it (32x fewer pollers; not yet run on a GPU)
    "warp": "{\n.reg .pred p, q;\n.reg .u32 v, t;\nmov.u32 t, %laneid;\nsetp.ne.u32 q, t, 0;\n"
            "@q bra DONE;\nSPIN:\nld.acquire.gpu.global.u32 v, [$0];\n"
            "setp.lt.u32 p, v, $1;\n@p bra SPIN;\nDONE:\nbar.warp.sync -1;\n}",
    # thread 0 of the warpgroup polls, the others wait at the warpgroup barrier after it (`_spin`; 128x fewer
    # pollers; not yet run on a GPU)
    "wg": "{\n.reg .pred p, q;\n.reg .u32 v, t;\nmov.u32 t, %tid.x;\nand.b32 t, t, 127;\nsetp.ne.u32 q, t, 0;\n"
          "@q bra DONE;\nSPIN:\nld.acquire.gpu.global.u32 v, [$0];\n"
          "setp.lt.u32 p, v, $1;\n@p bra SPIN;\nDONE:\n}",
}


def _spin(counter: Any, target: int, spin: str) -> None:
    """The calling warpgroup waits until the uint32 `counter` (acquire, gpu scope) reaches `target`,
    polled as SPIN_ASM[spin] says."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def fn(ctx, ref):
        del ctx
        ir, arith, llvm, mu = _mlir()
        i32 = ir.IntegerType.get_signless(32)
        ptr = llvm.ptrtoint(ir.IntegerType.get_signless(64), mu.memref_ptr(ref))
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [ptr, arith.constant(i32, target)],
                        SPIN_ASM[spin], "l,r", has_side_effects=True)

    fn(counter)
    if spin == "wg":  # the warpgroup waits for its poller (a warpgroup barrier)
        plgpu.commit_smem()


def balanced_chunks(k: int, n: int, ctas: int) -> int:
    """K chunks per row-tile pair so that a linear has at least `ctas` (pair, chunk) units (the
    fewest that do, among the divisors of its k steps)."""
    steps, pairs = k // KT, n // (64 * WGS)
    return next((ch for ch in range(1, steps + 1) if steps % ch == 0 and pairs * ch >= ctas), steps)


def persistent_stream(shapes: list[tuple[int, int]], g: int, ctas: int, stages: int, barrier: bool,
                      balance: bool = True, flag: str = "poll", spin: str = "all", wait: bool = True):
    """fn(dep, counters, *[qw_wide, sz] per linear) -> a dummy [ctas, 128] float32: the ring over
    every linear's weight tiles in one launch (module docstring); `dep` [8, 128] float32 is not
    read (it orders the call after the previous one in the timing chain). The grid-wide flag:
    `flag="poll"`, every consumer warpgroup adds 1 to counters[p] (uint32 [n_lin], zero on entry:
    the caller makes a fresh zero buffer per call; the kernel writes it in place) and polls it
    until it holds 2 x ctas (`wait=False`: until it holds 0, i.e. the arrival and one poll without
    the wait for the other CTAs); `flag="semaphore"`, CTA 0 releases one Pallas semaphore per CTA."""
    c = lay.chunk_cols(g)
    n_lin = len(shapes)
    # work units (row-tile pair, K chunk) of linear p, dealt round robin from CTA base[p], where the
    # previous linear's deal ended, so that every CTA streams about the same bytes in all
    chunks = [balanced_chunks(k, n, ctas) if balance else 1 for k, n in shapes]
    units = [n // (64 * WGS) * ch for (k, n), ch in zip(shapes, chunks)]
    base = [sum(units[:p]) % ctas for p in range(n_lin)]

    def kernel(*refs):
        counters = refs[1]
        w_refs = [(refs[2 + 2 * i], refs[3 + 2 * i]) for i in range(n_lin)]
        _out, w_smem, sz_smem, full, empty = refs[2 + 2 * n_lin:]
        cta, wg = lax.axis_index("c"), lax.axis_index("wg")
        go = root = None
        if barrier and flag == "semaphore":  # zeroed by Pallas per call; each wait takes its counts back to 0
            root = pl.get_global(plgpu.SemaphoreType.REGULAR((n_lin,)))
            go = pl.get_global(plgpu.SemaphoreType.REGULAR((n_lin, ctas)))

        def my_units(p):  # (first unit, count) of linear p dealt to this CTA
            first = lax.rem(cta - base[p] + ctas, ctas)
            return first, jnp.maximum(units[p] - first + ctas - 1, 0) // ctas

        @pl.when(wg == WGS)
        def _producer():
            cnt = jnp.int32(0)
            for p, ((k, n), (w_ref, sz_ref)) in enumerate(zip(shapes, w_refs)):
                per = k // KT // chunks[p]  # k steps per unit
                first, count = my_units(p)

                def unit(j, cnt, w_ref=w_ref, sz_ref=sz_ref, per=per, p=p, first=first):
                    u = first + j * ctas
                    nt, i0 = u // chunks[p], lax.rem(u, chunks[p]) * per

                    def step(i, cnt):
                        slot = lax.rem(cnt, stages)

                        @pl.when(cnt >= stages)
                        def _():
                            plgpu.barrier_wait(empty.at[slot])

                        rows, ki = pl.ds(nt * WGS, WGS), i0 + i
                        plgpu.copy_gmem_to_smem(w_ref.at[rows, pl.ds(ki * (KT // lay.KB), KT // lay.KB)],
                                                w_smem.at[slot], full.at[slot])
                        plgpu.copy_gmem_to_smem(sz_ref.at[rows, pl.ds(ki * (KT // c), KT // c)],
                                                sz_smem.at[slot], full.at[slot])
                        return cnt + 1

                    return lax.fori_loop(0, per, step, cnt)

                cnt = lax.fori_loop(0, count, unit, cnt)

        @pl.when(wg < WGS)
        def _consumers():
            cnt = jnp.int32(0)
            for p, (k, n) in enumerate(shapes):
                if barrier and p > 0 and flag == "poll":  # the previous linear done in every CTA
                    _arrive(counters.at[pl.ds(p - 1, 1)])
                    _spin(counters.at[pl.ds(p - 1, 1)], WGS * ctas if wait else 0, spin)
                elif barrier and p > 0:
                    plgpu.semaphore_signal(root.at[p - 1], memory_scope="gpu")

                    @pl.when((cta == 0) & (wg == 0))
                    def _(p=p):
                        plgpu.semaphore_wait(root.at[p - 1], WGS * ctas, memory_scope="gpu")

                        def release(cc, carry):
                            plgpu.semaphore_signal(go.at[p - 1, cc], WGS, memory_scope="gpu")
                            return carry

                        lax.fori_loop(0, ctas, release, 0)

                    plgpu.semaphore_wait(go.at[p - 1, cta], 1, memory_scope="gpu")
                per = k // KT // chunks[p]
                _, count = my_units(p)

                def unit(j, cnt, per=per):
                    def step(i, cnt):
                        slot = lax.rem(cnt, stages)
                        plgpu.barrier_wait(full.at[slot])
                        plgpu.barrier_arrive(empty.at[slot])
                        return cnt + 1

                    return lax.fori_loop(0, per, step, cnt)

                cnt = lax.fori_loop(0, count, unit, cnt)

    scratch = [plgpu.SMEM((stages, WGS, KT // lay.KB, *VIEW), jnp.uint32),
               plgpu.SMEM((stages, WGS, KT // c, 64 * c // g), jnp.uint32),
               plgpu.Barrier(num_barriers=stages, num_arrivals=2),
               plgpu.Barrier(num_barriers=stages, num_arrivals=WGS)]
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((ctas, 128), jnp.float32), num_threads=WGS + 1,
                        thread_name="wg", grid=(ctas,), grid_names=("c",), scratch_types=scratch,
                        compiler_params=params,
                        kernel_name=f"persistent_stream_{n_lin}_b{int(barrier)}_bal{int(balance)}_{flag}")


def chained_us(fns_of_copy, copies: int, iters: int, trials: int = 5, label: str = "") -> float:
    """Median microseconds per pass of fns_of_copy(copy) (a list of acc -> array calls: every linear once),
    chained by optimization barriers over `copies` weight copies, in an in-device loop (the sweep's harness;
    tools/device/check_tail.py times through it too). `label`: see `median_us`."""
    def f(_):
        def body(i, acc):
            _, acc = lax.optimization_barrier((i, acc))
            for cpy in range(copies):
                for fn in fns_of_copy(cpy):
                    _, acc = lax.optimization_barrier((acc, acc))
                    acc = acc + jnp.sum(fn(acc).astype(jnp.float32)[:1, :1])
            return acc
        return lax.fori_loop(0, iters, body, jnp.zeros((), jnp.float32))

    return median_us(f, iters * copies, trials, label)


def median_us(f, calls: int, trials: int = 5, label: str = "") -> float:
    """Median microseconds per call of `f(0)` (a function of a dummy int that runs `calls` calls), compiled and
    warmed first (tools/device/check_tail.py times its shared-ref loop through it too). A `label` prints the
    lowering, compile and first-run seconds under it (where a run that runs out of time spent it)."""
    t0 = time.perf_counter()
    lowered = jax.jit(f).lower(0)
    t1 = time.perf_counter()
    exe = lowered.compile()
    t2 = time.perf_counter()
    if label:  # before the first run: a run that hangs on the GPU still says it compiled
        print(f"  {label}: lowered in {t1 - t0:.1f} s, compiled in {t2 - t1:.1f} s", flush=True)
    jax.block_until_ready(exe(0))
    if label:
        print(f"  {label}: first run {time.perf_counter() - t2:.1f} s", flush=True)
    ts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(exe(0))
        ts.append((time.perf_counter() - t0) / calls)
    return statistics.median(ts) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="o,gate_up,down", help="qspec-bench w4a16 shape names, in layer order")
    ap.add_argument("--stages", default="4")
    ap.add_argument("--ctas-per-sm", type=int, default=2)
    ap.add_argument("--flags", default="0,1", help="grid-wide flag off / on (comma-separated 0 / 1)")
    ap.add_argument("--flag-kind", default="poll", choices=("poll", "semaphore"))
    ap.add_argument("--spin", default="all", choices=tuple(SPIN_ASM), help="who polls the flag (SPIN_ASM)")
    ap.add_argument("--no-wait", action="store_true",
                    help="poll flag: arrive and poll once, do not wait for the other CTAs (the flag's own cost)")
    ap.add_argument("--balance", default="0,1", help="balanced work units off / on (comma-separated 0 / 1)")
    ap.add_argument("--lower-only", action="store_true", help="lower for CUDA and stop (CPU check)")
    args = ap.parse_args()
    g = 32
    shapes = [BENCH_SHAPES[s] for s in args.shapes.split(",")]
    ctas = args.ctas_per_sm * _common.num_sms()
    key = jax.random.PRNGKey(0)
    nbytes = sum(lay.packed_bytes(k, n, g) for k, n in shapes)
    copies = max(2, -(-(240 << 20) // nbytes))
    ws = [[lay.pack_fields(jax.random.bits(jax.random.fold_in(key, 10 * cp + i), (k // 2, n), jnp.uint8),
                              jnp.full((k // g, n), 0.01, jnp.float16), jnp.zeros((k // g, n), jnp.float16))
           for i, (k, n) in enumerate(shapes)] for cp in range(copies)]
    wide = [[(w.qw.reshape(*w.qw.shape[:-2], *VIEW), w.sz) for w in per] for per in ws]
    if args.lower_only:
        for st in (int(s) for s in args.stages.split(",")):
            for barrier, kind in ((False, "poll"), (True, "poll"), (True, "semaphore")):
                fn = persistent_stream(shapes, g, ctas, st, barrier, True, kind, args.spin)
                flat = ([jnp.zeros((8, 128), jnp.float32), jnp.zeros((len(shapes),), jnp.uint32)]
                        + [a for pair in wide[0] for a in pair])
                txt = jax.jit(fn).trace(*flat).lower(lowering_platforms=("cuda",)).as_text()
                assert "mosaic_gpu" in txt
                print(f"lowered: stages {st} flag {barrier and kind}, {ctas} CTAs; polled flag in the module: "
                      f"{'SPIN:' in txt}", flush=True)
        return 0
    floor = nbytes / read_ceiling_bps() * 1e6
    iters = max(2, int(4e-3 / (nbytes / 3e12) / copies))
    x = jax.random.normal(key, (1, shapes[0][0]), jnp.float32).astype(jnp.bfloat16)
    print(f"linears {args.shapes}: {nbytes / 1e6:.1f} MB, floor {floor:.2f} us; {ctas} CTAs; {copies} copies",
          flush=True)

    def kernels(diag):
        def of_copy(cp):
            out = []
            for (k, n), w in zip(shapes, ws[cp]):
                cfg = mg.default_config(k, n, g, reduce=mg.reduce_mode(1, False))
                cfg = cfg.replace(diag=diag) if diag else cfg
                xi = x if k == x.shape[1] else jnp.zeros((1, k), jnp.bfloat16)
                out.append(lambda acc, xi=xi, w=w, cfg=cfg: mg.int4_matmul_mgpu(
                    (xi.astype(jnp.float32) + acc).astype(jnp.bfloat16), w, config=cfg))
            return out
        return of_copy

    for label, diag in (("one kernel each, stream only", "stream"), ("one kernel each, full", "")):
        us = chained_us(kernels(diag), copies, iters)
        print(f"  {label:38s} {us:8.2f} us  {floor / us:4.0%} of the floor", flush=True)
    print(f"  K chunks per pair (balanced): {[balanced_chunks(k, n, ctas) for k, n in shapes]}", flush=True)
    for st in (int(s) for s in args.stages.split(",")):
        for barrier in (bool(int(f)) for f in args.flags.split(",")):
            for balance in (bool(int(b)) for b in args.balance.split(",")):
                fn = persistent_stream(shapes, g, ctas, st, barrier, balance, args.flag_kind, args.spin,
                                       not args.no_wait)

                def call(acc, cp, fn=fn):  # fresh zero counters per call (acc * 0: not a shared constant)
                    counters = jnp.zeros((len(shapes),), jnp.uint32) + (acc * 0).astype(jnp.uint32)
                    return fn(jnp.zeros((8, 128), jnp.float32) + acc, counters,
                              *[a for pair in wide[cp] for a in pair])

                us = chained_us(lambda cp, call=call: [lambda acc, cp=cp: call(acc, cp)], copies, iters)
                how = f" ({args.spin}{', no wait' if args.no_wait else ''})" if args.flag_kind == "poll" else ""
                label = (f"persistent, stages {st}, flag {barrier and args.flag_kind}{how if barrier else ''}"
                         f", balanced {balance}")
                print(f"  {label:50s} {us:8.2f} us  {floor / us:4.0%} of the floor", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
