"""The draft layer's tail in one persistent Mosaic GPU kernel (Hopper; issue 32):

    x1  = bf16(attn Wo) + x                                  (o projection, residual)
    act = silu(r bf16(x1 g) Wg) * (r bf16(x1 g) Wu),  r = rsqrt(mean(x1^2) + eps)   (RMSNorm, gate_up)
    out = bf16(act Wd) + x1                                  (down projection, residual)

with INT4 weights (`layout.W4A16Packed`), for M = B decode rows. `layer_tail_reference` is the
math: `mosaic_gpu.epilogue_reference` three times.

Why one kernel: per kernel the INT4 linears already read their bytes as fast as any kernel of
that size reads on the H200 (docs/kernel_notes.md, "Nineteenth session"); what they lose is the
fill and drain of each 10-60 MB read. A persistent grid of `ctas` CTAs streams the three weights
in turn through one TMA ring: a CTA's producer runs on into the next linear's weight tiles
(which no earlier work writes) while its consumers finish the previous linear, so the ring only
waits where the data does. Measured with a stream-only probe (tools/device/w4a16_persistent_probe.py,
H200): 39-43 us for o + gate_up + down against 54 us as three kernels. This kernel, measured (H200,
docs/kernel_notes.md "Twentieth session" and "Twenty-first session"): its ring alone streams at 74-76% of the read
ceiling; whole, with the finisher warpgroup, it takes 51.5 us per layer at M 1, the same as the three fused kernels
(59-60 us when the consumers did the epilogues themselves); without its two grid-wide flags' waits 45.3. In the
model (QSPEC_W4A16_TAIL=1, `qspec_jax.linear.tail_fusable`; H200, 2026-12-02, 8B batch 1 / 4k draft step) 47.5 us a
layer against 46.1 for the three fused kernels' sum, two launches fewer: the draft step ties (2.511 / 2.508 ms) or
trails (a second run: 2.509-2.523 / 2.450), so off by default (kernel_notes "Thirty-seventh session": each flag waits
~1 us of latency after 1.5-2.5 us of imbalance that is systematic by SM; "Thirty-eighth session": the consumers, not
the ring, pace it at M 1, and what would make it win).

Work. Each linear's output columns are cut in row-tile pairs (128 columns; gate_up: gate tile j
with up tile j, so the pair holds what SiLU·up needs; where D / 64 is odd, o's and down's last pair
is the last tile twice) and its K in `chunks` equal ranges; a work unit is (pair, chunk), units
dealt round robin over the CTAs, continuing where the previous linear's deal ended. A CTA has
2 x `k_groups` consumer warpgroups (a row tile of the pair and a k group each: the unit's steps
dealt round robin, partials added in group order) and a producer warpgroup (TMA: per k step the two
row tiles' code words and scale records and the x tile [M_pad, k_tile]: 256 columns, or 192 where
K needs it). The chunks of a tile are summed in a fixed order, p[0] + p[1] + ... + p[C-1], by
the unit of its last chunk, which waits on a global counter of the pair for the others' float32 partials
(as `mosaic_gpu`'s "sem" sum does on a semaphore); the unit order makes that wait deadlock-free (a unit waits only on
units of lower index, and every CTA takes its units in increasing order). So a row's bits depend
on (K, N, chunks, k_groups) and never on M, the CTA count or the deal. (Units taken from a global
counter instead, so that a CTA on a slow SM takes fewer, were built and measured slower three times on
the H200, last in the model with gate_up alone dealt so: +7 us a layer, a counter's round trip on the
producer's path per unit; removed 2026-12-02, docs/kernel_notes.md "Thirty-eighth session".)

The consumers only stream and multiply: at a unit's end each stores its float32 accumulator to a
shared hand-off buffer (`hand_bufs` deep) and goes on to the next unit. One more warpgroup, the
finisher, takes each unit's accumulators (k groups added in group order), stores or sums the
chunk partials and runs the epilogues, so the partial stores, the counters' waits and the global
loads' latency stay off the ring's path (measured: 8 us of a layer's 59 when the consumers did
it).

Between the linears: the o tiles' owners write x1 (float32 tiles [D/64, 64, M_pad], the down
residual), bf16(x1 g) (row-major [M_pad, D], gate_up's x operand) and each tile's row sums of
x1^2 ([D/64, M_pad], `_column_sums`); each CTA's finisher adds the tiles' row sums in tile order
once (the same bits in every CTA) for the norm's r, and gate_up's owners write act (row-major
[M_pad, F], down's x operand). A linear's x tiles can only be read once every CTA has finished
the previous linear: a grid-wide flag per boundary, a global counter each finisher adds 1 to
(release, gpu scope) and the producer and the finisher poll (acquire; thread 0 of the warpgroup,
`_spin`). With `TailConfig.chunk_ready` the producer waits per K chunk of the linear it streams instead: a
ready counter per chunk of gate_up's and down's x, which each o / gate_up pair's epilogue counts up once its
columns are written, so a CTA waits only for the pairs its units read (with 132 CTAs and 4 chunks, a quarter of the
previous linear's), and flag 1 goes; the finisher still waits at flag 0 for every o tile's row sums (the norm's r,
applied after gate_up's MMA). Every CTA must be resident at once (`ctas` <= the SMs x the CTAs
that fit on one: two per SM hang on the H200). The flags and the pairs' chunk counters are words of one
uint32 ref (`sync_words`) that are never reset: each call adds
the same amount to each, so call n of a ref waits for (n + 1) times it. A model's layer loop shares one
zeroed ref per pass, its layer index as the ordinal; a call of its own makes a fresh one. The output
takes x's place (x is read by the o epilogues, each before its CTA arrives at flag 0; out is written by down's
epilogues, after their finisher has waited at flag 0).

One cluster (`TailConfig.cluster`, off by default): for small layers (SmolLM2's ~2 MB of weights), the grid is one
thread-block cluster of up to 16
CTAs and its two phase ends are the hardware cluster barrier (`barrier.cluster` arrive / wait, every thread of the
cluster once per phase end: the finisher arrives with release semantics after its stores, the producer and the
consumers relaxed) instead of the flags, whose global-memory round trips and wait for the slowest of 132 CTAs
cost 7.8-10 us of a SmolLM2 layer's 13-17 (kernel_notes, "Forty-second session"). The chunk counters stay as they
are, and so do the bits: they depend on the chunks and k groups as above, not on how the grid is launched.
Measured (SmolLM2's layer at M 32, 16 CTAs; kernel_notes "Fiftieth session" and "Fifty-first session"): correct,
its barriers cost ~0.6 us each, but with balanced one-step chunks (3, 3, 8) it takes 43 us against 20.9 for the three
fused kernels on every SM (H200: the chunk partials' round trips), and with whole-K units (1, 1, 1), its best, 25.7
against 21.7 (H100; four other chunkings 27.0-28.0): on 16 SMs each phase's path is one SM's MMAs (6.5 us of the
25.7, halving at M 16) and a ~3-5 us start (first loads, epilogue round trips). Kept as a measured variant.

Interpret mode (CPU, CI): the grid runs one CTA (`ctas` = 1: the flags, counters and waits
are then program order and a shared-memory barrier; each wait checks that it found exactly its
ordinal's count, and a wrong one turns the output into NaN where the GPU would hang or race), the
register MMA is replaced by its jnp twin (`mosaic_gpu.twin_dequant` and a float32 dot), the stores
and the residual loads by whole-slice ref updates. tools/device/check_tail.py runs the GPU kernel against the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common
from pallas_kernels.linear import layout as lay
from pallas_kernels.linear import mosaic_gpu as mg

Array = jax.Array

KT = 256  # k columns per pipeline step by default (four 64-column k blocks; `TailConfig.k_tile`)
K_TILES = (256, 192, 128, 64)  # the k tiles `k_tile_for` tries, widest first (192: SmolLM2's 576 = 3 x 192)
WGS = 2  # consumer warpgroups per CTA: the two row tiles of a pair
# rows M per call: the hand-off buffers' [64, M_pad] float32 tiles go through shared memory untransformed up to 24
# rows and in swizzled tiles above (`mosaic_gpu.exchange_transforms`, the linear kernels' wide exchange); 32 is
# SmolLM2's batch 32 (lowered for CUDA at 32 rows, jax 0.10.2 and 0.11.2; not yet run on a GPU above 24)
MAX_ROWS = 32
TAIL_SMEM = 110 * 1024  # ring bytes per CTA: two CTAs of up to this fit on one SM (227 KB)
MAX_STAGES = 8
MAX_CLUSTER_CTAS = 16  # CTAs of `TailConfig.cluster`'s one cluster (sm_90's largest, non-portable above 8)
TAIL_DIAGNOSTICS = ("", "noflag", "noflag0", "noflag1", "nosync", "noepi", "stream", "raw", "conv")
# the consumers' stage diagnostic (`mosaic_gpu.mma_stage`) of the tail's "raw" / "conv" (the rest of the kernel as
# in real use)
_STAGE_DIAG = {"raw": "mma_raw", "conv": "convert"}
N_FULL = 2 * WGS + 1  # copies landing on a stage's barrier: codes + records per row tile, the x tile
# `TailConfig.timeline`'s columns: the CTA's SM, then the time at each mark (finisher: start, end of each linear's
# units; producer: start, past each grid-wide flag)
TIMELINE_COLUMNS = ("sm", "fin_start", "fin_o", "fin_gate_up", "fin_down", "prod_start", "prod_flag0", "prod_flag1")


@dataclasses.dataclass(frozen=True)
class TailConfig:
    """Launch shape. `chunks` (the K ranges of o, gate_up and down) sets the partial sums' order, so
    the math; `ctas` and `stages` only who does what and how far ahead (`default_tail_config`)."""

    chunks: tuple[int, int, int]
    ctas: int = 132  # the persistent grid (every CTA resident); interpret mode runs 1
    # k columns per pipeline step: a multiple of 64 and of the weights' record width (`layout.chunk_cols`) that
    # divides Kq, D and F (`k_tile_for`: 256 where it can, 192 for SmolLM2's 576); sets the units' k steps
    k_tile: int = KT
    stages: int = 4  # ring depth (a multiple of k_groups: each k group owns the slots of its residue)
    mma_chains: int = 2  # `MgpuConfig.mma_chains` of the register MMA stage
    # consumer warpgroups per row tile (`MgpuConfig.k_groups`): a unit's k steps dealt round robin,
    # the groups' float32 partials added in group order p_0 + p_1 (changes the summation order)
    k_groups: int = 2
    # units' accumulators in flight from the consumers to the finisher (shared [64, M_pad] float32
    # buffers per row tile and k group): how far the consumers may run ahead of the epilogues
    hand_bufs: int = 2
    # units of the next linear whose weights (both row tiles, the unit's whole K range: one contiguous range each)
    # the producer asks the L2 for before it waits at a grid-wide flag, after those its ring already holds. 0: off.
    # Measured (H200, 2026-11-30) with an earlier form (8 / 16 single k steps, 4 requests each): 4-5 us slower a
    # layer; this form (2 requests a row tile and unit) is for the start-phase experiments (kernel_notes)
    l2_prefetch: int = 0
    # the producer waits for the previous linear's outputs per K chunk of the linear it streams (gate_up's x tiles
    # of chunk c once the o pairs whose columns c holds are written; down's act tiles likewise) on the sync ref's
    # ready counters (`ready_offsets`), instead of at the grid-wide flags; only the finisher still waits for every
    # o tile (the norm's r, applied after gate_up's MMA). kernel_notes "Thirty-ninth session": the flags cost 7.2
    # of a layer's 47.4 us on the H200 (2026-12-03). Measured (H200, fortieth session, kernel alone, 8B, M 1): 52.06
    # us against the flags' 47.44 (both 40.1 without the waits): slower, so off; why, in kernel_notes "Fortieth"
    chunk_ready: bool = False
    # timing experiments only (wrong results): "noflag" drops the grid-wide flags' waits ("noflag0" /
    # "noflag1" only the first's / the second's: o -> gate_up, gate_up -> down), "nosync" also the
    # chunk counters' waits; "noepi" also everything the finisher does after taking a unit's
    # accumulators (k-group and chunk sums, epilogues); "stream" also the MMA (the ring alone); "raw" (the
    # MMAs on the raw code words: no dequantization) and "conv" (dequantization without the MMAs) change only the
    # consumers' stage (`mosaic_gpu.mma_stage`'s "mma_raw" / "convert"): what the dequantization costs the tail
    diag: str = ""
    # GPU only: also return a per-CTA timeline (`TIMELINE_COLUMNS`: the SM, then %globaltimer's low 32 bits in
    # ns at each mark) to see which CTAs arrive late at the flags and whether the same ones in every phase
    timeline: bool = False
    # The grid as one thread-block cluster of `ctas` CTAs (at most MAX_CLUSTER_CTAS; above 8 the launch needs the
    # device's non-portable cluster sizes), whose two phase ends are the hardware cluster barrier instead of the
    # grid-wide flags: every thread of every CTA arrives once per phase end (the finisher with release semantics
    # after its stores, the others relaxed) and waits (acquire) before it goes on. For layers small enough that a
    # cluster's SMs stream them (SmolLM2's: ~2 MB), where the flags cost more than the work (kernel_notes
    # "Forty-second session": 7.8-10 us of a 13-17 us layer) and a cluster barrier is a few hundred cycles.
    # GPU only (interpret mode runs one CTA: the flags' program-order twin, the same math); the chunk counters stay.
    # Measured slower than the three fused kernels at SmolLM2's M 16 and 32 at every chunking tried (kernel_notes,
    # "Fifty-first session": 25.7 against 21.7 us a layer at best, H100): off by default, a measured variant.
    cluster: bool = False

    def replace(self, **kw: Any) -> "TailConfig":
        return dataclasses.replace(self, **kw)


# ------------------------------------------------------------------------------ the sync words
SYNC_FLAGS = 0  # word offset of the two grid-wide flags (o -> gate_up, gate_up -> down)


def linear_pairs(d: int, f: int) -> tuple[int, int, int]:
    """Row-tile pairs of o, gate_up and down (128 output columns; gate_up's pair j is gate tile j with up
    tile j): ceil(D / 128), F / 64, ceil(D / 128). Where D / 64 is odd (SmolLM2's 576: 9 tiles) the last
    pair of o and down is its last tile twice (`pair_tiles`): both consumers compute it, the finisher
    stores the same bits twice."""
    return -(-d // 128), f // 64, -(-d // 128)


def pair_tiles(p: int, pair: Any, d: int, f: int) -> list[Any]:
    """The row tiles (64 output columns each) of linear p's pair: gate_up's gate tile j and up tile j,
    else tiles 2 pair and 2 pair + 1 (the last one twice where D / 64 is odd, `linear_pairs`)."""
    if p == 1:
        return [pair + t * (f // 64) for t in range(WGS)]
    return [pair * WGS + t if t == 0 or d % 128 == 0 else jnp.minimum(pair * WGS + t, d // 64 - 1)
            for t in range(WGS)]


def sync_offsets(d: int, f: int) -> tuple[int, int, int]:
    """Word offsets in the sync ref of the three linears' chunk counters, one per row-tile pair
    (`linear_pairs`)."""
    pairs = linear_pairs(d, f)
    o = SYNC_FLAGS + 2
    return o, o + pairs[0], o + pairs[0] + pairs[1]


def ready_offsets(d: int, f: int) -> tuple[int, int]:
    """Word offsets in the sync ref of the ready counters (`TailConfig.chunk_ready`) of gate_up's and down's K
    chunks: room for one per k step of each at the narrowest k tile (D / 64 and F / 64 words), so the ref's size
    depends on neither the chunks nor the k tile; chunk c of gate_up counts the o pairs written whose columns it
    holds, chunk c of down the gate_up pairs."""
    o = sync_offsets(d, f)[2] + linear_pairs(d, f)[2]
    return o, o + d // lay.KB


def ready_pairs(cfg: TailConfig, d: int, f: int) -> tuple[int, int]:
    """What one call adds to each ready counter: o pairs per K chunk of gate_up (128 columns a pair), gate_up
    pairs per K chunk of down (64 act columns a pair)."""
    return d // cfg.chunks[1] // 128, f // cfg.chunks[2] // 64


def sync_words(d: int, f: int) -> int:
    """uint32 words of the sync ref of a tail with hidden size d and MLP width f: the flags, the chunk
    counters, the ready counters (`ready_offsets`), and last two words that only the interpret twin writes
    (the producer's and the finisher's waits that found a count other than their target: 0 when the
    ordinals are right).

    Every call adds the same amount to each word (ctas to a flag, chunks - 1 to a pair's counter, the pairs
    of its chunk to a ready counter: `ready_pairs`), so
    call n of a ref (n = the calls made on it before, `ordinal`) waits for (n + 1) times that. The words
    are never reset: one zeroed ref serves every layer of a decode pass, with the layer loop's index as
    the ordinal, and no call needs a zero-init launch."""
    return ready_offsets(d, f)[1] + f // lay.KB + 2


def sync_zeros(d: int, f: int) -> Array:
    """A fresh sync ref's contents (`sync_words`)."""
    return jnp.zeros((sync_words(d, f),), jnp.uint32)


def ring_stage_bytes(mp: int, group_size: int, kt: int = KT) -> int:
    """Shared-memory bytes of one ring stage of `kt` k columns: two row tiles' code words and records, the x
    tile."""
    return WGS * (kt * lay.ROWS // 2 + lay.ROWS * (kt // group_size) * 4) + mp * kt * 2


def hand_bytes(mp: int, k_groups: int, bufs: int) -> int:
    """Shared-memory bytes of the consumers' hand-off buffers: a float32 [64, M_pad] tile per
    buffer, row tile and k group."""
    return bufs * WGS * k_groups * lay.ROWS * mp * 4


def balanced_chunks(k: int, pairs: int, ctas: int, k_groups: int = 1, kt: int = KT) -> int:
    """K chunks per pair of a linear with `pairs` row-tile pairs and K = k in steps of `kt`: among the
    divisors of its k steps that leave each unit a multiple of `k_groups` steps, the one that minimises
    the most steps one CTA streams (units dealt round robin), the fewest chunks among equals (each
    chunk above one costs a float32 partial round trip)."""
    steps = k // kt
    if steps % k_groups:
        raise ValueError(f"K={k}: its {steps} k steps of {kt} must be a multiple of k_groups={k_groups}")

    def most(ch: int) -> int:
        return -(-(pairs * ch) // ctas) * (steps // ch)

    return min((ch for ch in range(1, steps + 1) if steps % ch == 0 and (steps // ch) % k_groups == 0),
               key=lambda ch: (most(ch), ch))


def linear_units(cfg: TailConfig, d: int, f: int) -> tuple[int, int, int]:
    """Work units (row-tile pairs x K chunks) of o, gate_up and down."""
    return tuple(pairs * ch for pairs, ch in zip(linear_pairs(d, f), cfg.chunks))


def k_tile_for(kq: int, d: int, f: int, group_size: int) -> int | None:
    """The widest of K_TILES that divides Kq, D and F and is a multiple of the weights' record width
    (`layout.chunk_cols`), or None."""
    c = lay.chunk_cols(group_size)
    return next((kt for kt in K_TILES if kt % c == 0 and all(k % kt == 0 for k in (kq, d, f))), None)


def default_tail_config(kq: int, d: int, f: int, group_size: int, m: int, *, num_sms: int | None = None,
                        ctas_per_sm: int = 1, k_groups: int | None = None) -> TailConfig:
    """The launch shape for attention width kq, hidden size d and MLP width f at M = m rows:
    `ctas_per_sm` CTAs per SM (1: always resident whatever the registers), the widest k tile
    (`k_tile_for`), the deepest ring that fits (at most MAX_STAGES, TAIL_SMEM per CTA at two per SM),
    and the chunks balanced over the CTAs; `k_groups` None: 2 where each linear's K is an even number
    of k steps, else 1. The chunks depend on the SM count, never on M."""
    kt = k_tile_for(kq, d, f, group_size)
    if kt is None:
        raise ValueError(f"Kq={kq}, D={d}, F={f}: no k tile of {K_TILES} divides all three (group {group_size})")
    if k_groups is None:
        k_groups = 2 if all((k // kt) % 2 == 0 for k in (kq, d, f)) else 1
    sms = num_sms or _common.num_sms()
    ctas = ctas_per_sm * sms
    mp = mg.rows_for(m)
    # the ring and the hand-off buffers within the pipeline budget (8B, M 1: 6 stages; filling the CTA's
    # shared memory with 8 measured ~2 us slower, 53.4 against 51.5 us on the H200, 2026-11-30)
    budget = (TAIL_SMEM if ctas_per_sm > 1 else mg.SMEM_BUDGET) - hand_bytes(mp, k_groups, TailConfig.hand_bufs)
    stages = max(2, min(MAX_STAGES, budget // ring_stage_bytes(mp, group_size, kt)))
    chunks = tuple(balanced_chunks(k, pairs, ctas, k_groups, kt)
                   for k, pairs in zip((kq, d, f), linear_pairs(d, f)))
    return TailConfig(chunks=chunks, ctas=ctas, stages=stages - stages % k_groups, k_groups=k_groups, k_tile=kt)


def takes(kq: int, d: int, f: int, m: int, group_size: int = 32) -> bool:
    """Whether the kernel takes attention width kq, hidden size d, MLP width f at M = m rows with weights
    of `group_size`: D a multiple of 64, a k tile for all three K (`k_tile_for`), 1..MAX_ROWS rows."""
    return d % lay.KB == 0 and k_tile_for(kq, d, f, group_size) is not None and 1 <= m <= MAX_ROWS


def layer_tail_reference(attn: Array, x: Array, wo: Array, norm_weight: Array, w_gate_up: Array, w_down: Array,
                         *, norm_eps: float = 1e-5) -> Array:
    """jnp: what `int4_layer_tail_mgpu` computes, for the weights as its MMA sees them (float32
    [K, N], `lay.dequantize_bf16`): the fused epilogues' math (`mg.epilogue_reference`)."""
    x1 = mg.epilogue_reference(attn, wo, mg.Epilogue(residual=True), residual=x)
    act = mg.epilogue_reference(x1, w_gate_up, mg.Epilogue(norm=True, eps=norm_eps, swiglu=True),
                                norm_weight=norm_weight)
    return mg.epilogue_reference(act, w_down, mg.Epilogue(residual=True), residual=x1)


# ------------------------------------------------------------------------------ inline PTX pieces
_ARRIVE_ASM = _common.thread0_asm("@p fence.acq_rel.gpu;\n@p red.release.gpu.global.add.u32 [$0], 1;\n")
# thread 0 of the warpgroup polls until the counter $0 reaches (ordinal + 1) x $2, the ordinal a one-word global
# int32 at $1 (`sync_words`: the call's target)
_SPIN_ASM = _common.thread0_asm("@!p bra DONE;\nld.global.u32 n, [$1];\nadd.u32 n, n, 1;\nmul.lo.u32 n, n, $2;\n"
                                "SPIN:\nld.acquire.gpu.global.u32 v, [$0];\nsetp.lt.u32 q, v, n;\n@q bra SPIN;\n"
                                "DONE:\n", regs=".reg .pred q;\n.reg .u32 v;\n.reg .u32 n;\n")
_PROXY_FENCE_ASM = "fence.proxy.async.global;"
# `TailConfig.cluster`'s phase end, by every thread of the CTA (warp-uniform: .aligned): arrive (release where the
# thread's own global stores must be seen by the cluster's other CTAs), then wait (acquire)
_CLUSTER_ARRIVE_ASM = {True: "barrier.cluster.arrive.release.aligned;",
                       False: "barrier.cluster.arrive.relaxed.aligned;"}
_CLUSTER_WAIT_ASM = "barrier.cluster.wait.acquire.aligned;"
# thread 0 of the warpgroup stores a special register's (low) 32 bits at $0 (t reused once p is set)
_STAMP_READ = {"time": "mov.u64 v, %globaltimer;\ncvt.u32.u64 t, v;", "sm": "mov.u32 t, %smid;"}
_STAMP_ASM = {what: _common.thread0_asm(read + "\n@p st.global.u32 [$0], t;\n", regs=".reg .u64 v;\n")
              for what, read in _STAMP_READ.items()}
# thread 0 of the warpgroup: bulk prefetch of $1 bytes at $0 (global, 16-byte aligned) into the L2
_PREFETCH_ASM = _common.thread0_asm("@p cp.async.bulk.prefetch.L2.global [$0], $1;\n")


def _arrive(counter: Any) -> None:
    """The calling warpgroup's stores done (a warpgroup barrier), thread 0 adds 1 to the uint32
    `counter` (one-word global ref) with release semantics at gpu scope."""
    plgpu.commit_smem()
    _common.ptx(_ARRIVE_ASM, counter)


def _spin(counter: Any, ordinal: Any, step: int, async_proxy: bool = True) -> None:
    """The calling warpgroup waits until the uint32 `counter` reaches (ordinal + 1) x `step` (`sync_words`;
    `ordinal` a one-word global int32 ref): thread 0 polls with acquire loads at gpu scope, the others wait at
    a warpgroup barrier; then, with `async_proxy` (a TMA will read what other CTAs' generic stores wrote),
    every thread fences the async proxy."""
    _common.ptx(_SPIN_ASM, counter, ordinal, ints=(step,))
    plgpu.commit_smem()  # warpgroup barrier: the others wait for the poller
    if async_proxy:
        _common.ptx(_PROXY_FENCE_ASM)


def _cluster_phase(release: bool, async_proxy: bool = False) -> None:
    """`TailConfig.cluster`'s phase end for the calling warpgroup: each thread arrives at the cluster
    barrier (`release`: its global stores before it are then visible to the threads of the cluster that
    pass the wait) and waits until every thread of every CTA of the cluster has arrived; then, with
    `async_proxy` (a TMA will read what other CTAs' generic stores wrote), every thread fences the async
    proxy. Every thread of the cluster must pass each phase end once, in the same order."""
    _common.ptx(_CLUSTER_ARRIVE_ASM[release])
    _common.ptx(_CLUSTER_WAIT_ASM)
    if async_proxy:
        _common.ptx(_PROXY_FENCE_ASM)


def _prefetch_l2(ref: Any) -> None:
    """Thread 0 of the calling warpgroup asks the L2 to fetch the contiguous global slice `ref`
    (no wait, no shared memory; a later TMA load of it then reads the L2)."""
    _common.ptx(_PREFETCH_ASM, ref, ints=(int(np.prod(ref.shape)) * jnp.dtype(ref.dtype).itemsize,))


def _stamp(ref: Any, what: str) -> None:
    """Thread 0 of the calling warpgroup writes %globaltimer's low 32 bits (ns; `what="time"`) or its
    SM (`"sm"`) into the one-word uint32 global ref (TailConfig.timeline)."""
    _common.ptx(_STAMP_ASM[what], ref)


def _column_sums(mp: int):
    """inline_mgpu function of one warpgroup: (v float32 [64, M_pad] WGMMA, buf shared float32 [4, M_pad]
    (this warpgroup's own), dst global float32 [M_pad]) -> dst[c] = sum over the 64 rows of v[:, c].
    Per thread its two rows of each column it holds, a butterfly over the 8 lanes that share the
    columns (every lane ends with the same bits: float addition is commutative), then warps 0 + 1 +
    2 + 3 in that order through `buf`. Not Mosaic's reduction: that one uses a scratch region shared
    by every warpgroup of the CTA (two consumers reducing at once raced on it: H200, 2026-11-29)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType()))
    def fn(ctx, v, buf, dst):
        del ctx
        ir, arith, _, memref, _, mu = _common.mlir_modules()
        from jax._src.lib.mlir.dialects import scf
        index = ir.IndexType.get()
        c, tid, warp, lane = mg.thread_coords()
        quad = arith.remui(lane, c(4))  # the thread's columns: 8 ct + 2 quad + e
        mu.warpgroup_barrier()  # the previous call's reads of buf are done
        for ct in range(mp // 8):
            for e in range(2):
                vals = [mg.wgmma_element(v, ct, h, e) for h in range(2)]  # rows g and g + 8 of the warp's 16
                tot = mg.butterfly_sum(arith.addf(vals[0], vals[1]), (4, 8, 16))
                col = arith.addi(c(8 * ct + e), arith.muli(quad, c(2)))
                branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, lane, c(4)))
                with ir.InsertionPoint(branch.then_block):
                    memref.store(tot, buf, [arith.index_cast(index, warp), arith.index_cast(index, col)])
                    scf.yield_([])
        mu.warpgroup_barrier()
        branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, tid, c(mp)))
        with ir.InsertionPoint(branch.then_block):
            col = arith.index_cast(index, tid)
            tot = memref.load(buf, [arith.constant(index, 0), col])
            for w in range(1, 4):
                tot = arith.addf(tot, memref.load(buf, [arith.constant(index, w), col]))
            memref.store(tot, dst, [col])
            scf.yield_([])

    return fn


# ------------------------------------------------------------------------------------- kernel
def _tail_kernel(*refs, names: tuple[str, ...], m: int, mp: int, g: int, d: int, f: int, kq: int,
                 cfg: TailConfig, interpret: bool, stacked: bool, g_stacked: bool, n_layers: int, eps: float):
    """One CTA of the persistent grid (module docstring). Warpgroups wg = q WGS + rt (q < k_groups):
    consumers of row tile rt of each pair, k group q (the unit's steps q, q + k_groups, ...), which
    hand each unit's accumulator to the finisher through shared memory and go on; then the
    producer; then the finisher (k-group and chunk sums, epilogues, the flags' arrivals)."""
    r = dict(zip(names, refs))
    ctas, stages, chunks, kg, kt = cfg.ctas, cfg.stages, cfg.chunks, cfg.k_groups, cfg.k_tile
    c = lay.chunk_cols(g)
    cta, wg = lax.axis_index("c"), lax.axis_index("wg")
    layer_idx = jnp.clip(r["layer"][0], 0, n_layers - 1)
    lead = (layer_idx,) if stacked else ()
    g_row = layer_idx if g_stacked else 0
    x_smem, w_smem, sz_smem = r["x_smem"], r["w_smem"], r["sz_smem"]
    full, empty = r["full"], r["empty"]
    # per linear p: (K, code words, records, x source, row-tile pairs)
    lin = [(k, r[f"{w}_w"], r[f"{w}_s"], r[src], pairs) for k, w, src, pairs in
           zip((kq, d, f), ("wo", "wgu", "wd"), ("attn", "xg", "act"), linear_pairs(d, f))]
    units = linear_units(cfg, d, f)
    base = [sum(units[:p]) % ctas for p in range(3)]
    per = [k // kt // ch for (k, *_), ch in zip(lin, chunks)]  # k steps per unit
    n_cons = WGS * kg  # consumer warpgroups; then the producer, then the finisher
    # the sync words (`sync_words`): this call is call `n` of the ref, so it waits for (n + 1) x what a call adds
    sync_ref, ordinal = r["sync"], r["ordinal"]
    call = ordinal[0]
    ctr0 = sync_offsets(d, f)
    err = sync_words(d, f) - 2  # + 0 the producer's, + 1 the finisher's (each word has one writer)
    # TailConfig.diag: the chunk counters, the grid-wide flags' arrivals and each flag's waits
    chunk_sync = cfg.diag in ("", "noflag", "noflag0", "noflag1", *_STAGE_DIAG)
    flags = cfg.diag in ("", "noflag0", "noflag1", *_STAGE_DIAG)
    waits = (flags and cfg.diag != "noflag0", flags and cfg.diag != "noflag1")
    ready = cfg.chunk_ready  # TailConfig.chunk_ready: the producer's waits per K chunk; flag 1 unused
    # TailConfig.cluster (GPU): the phase ends are the cluster barrier, which every warpgroup passes once each
    # (`_cluster_phase`) in place of the flags' arrivals and waits; none under the diagnostics that drop the flags
    cl_sync = cfg.cluster and not interpret and flags
    ready0, ready_step = ready_offsets(d, f), ready_pairs(cfg, d, f)

    def arrive_twin(i):  # interpret: an arrival at word i (program order: one CTA, one warpgroup writes each word)
        sync_ref[i] = sync_ref[i] + jnp.uint32(1)

    def expect(i, step, who):  # interpret: a wait at word i, whose count is then exactly its target (one CTA, in
        target = ((call + 1) * step).astype(jnp.uint32)  # order); who 0 the producer, 1 the finisher
        sync_ref[err + who] = sync_ref[err + who] + (sync_ref[i] != target).astype(jnp.uint32)

    def mark(col: str) -> None:  # TailConfig.timeline: this warpgroup's thread 0 stamps the column
        if cfg.timeline:
            _stamp(r["tl"].at[cta, pl.ds(TIMELINE_COLUMNS.index(col), 1)], "time")

    def my_units(p):  # (first unit, count) of linear p dealt to this CTA
        first = lax.rem(cta - base[p] + ctas, ctas)
        return first, jnp.maximum(units[p] - first + ctas - 1, 0) // ctas

    def unit_of(p, first, t):  # this CTA's step t of linear p -> (pair, chunk, k step of the unit)
        j, i = t // per[p], lax.rem(t, per[p])
        u = first + j * ctas
        return u // chunks[p], lax.rem(u, chunks[p]), i

    def tiles_of(p, pair):  # the pair's two row tiles (gate_up: gate j, up j; an odd D's last tile twice)
        return pair_tiles(p, pair, d, f)

    def weight_refs(p, row, k0, steps):  # row tile `row`'s code words and records of k columns k0 .. + steps kt
        _, w_ref, s_ref, _, _ = lin[p]
        return (w_ref.at[(*lead, pl.ds(row, 1), pl.ds(k0 // lay.KB, steps * kt // lay.KB))],
                s_ref.at[(*lead, pl.ds(row, 1), pl.ds(k0 // c, steps * kt // c))])

    def run_units(p, first, count, body, carry):
        """body(pair, chunk, carry) -> carry over this CTA's units of linear p (the round-robin deal), in order."""
        return lax.fori_loop(0, count, lambda j, cr: body(*unit_of(p, first, j * per[p])[:2], cr), carry)

    # ------------------------------------------------------------------ producer
    @pl.when(wg == n_cons)
    def _producer():
        def issue_w(p, first, t, slot):  # this CTA's step t of linear p: both row tiles' codes and records
            pair, ch, i = unit_of(p, first, t)
            for cw, row in enumerate(tiles_of(p, pair)):
                codes, records = weight_refs(p, row, (ch * per[p] + i) * kt, 1)
                plgpu.copy_gmem_to_smem(codes, w_smem.at[slot, pl.ds(cw, 1)], full.at[slot])
                plgpu.copy_gmem_to_smem(records, sz_smem.at[slot, pl.ds(cw, 1)], full.at[slot])

        def prefetch_unit(j, carry, p, first):  # TailConfig.l2_prefetch: unit j's weights into the L2
            pair, ch, _ = unit_of(p, first, j * per[p])
            for row in tiles_of(p, pair):
                for ref in weight_refs(p, row, ch * per[p] * kt, per[p]):
                    _prefetch_l2(ref)
            return carry

        def issue_x(p, first, t, slot):  # this CTA's step t of linear p: the x tile
            _, ch, i = unit_of(p, first, t)
            x_ref = lin[p][3]
            k0 = (ch * per[p] + i) * kt
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, mp), pl.ds(k0, kt)], x_smem.at[slot], full.at[slot])

        def reuse(cnt):
            slot = lax.rem(cnt, stages)

            @pl.when(cnt >= stages)
            def _():
                plgpu.barrier_wait(empty.at[slot])

            return slot

        def pass_flag(p, before_spin=lambda: None):
            """Wait until every CTA has finished linear p - 1 (its x for linear p written); with ready
            counters (GPU) the waits are per unit instead (`wait_ready`)."""
            if interpret:
                plgpu.barrier_wait(r["phase_bar"].at[0])
                if not ready or p == 1:  # (flag 1 has no arrivals with ready counters)
                    expect(SYNC_FLAGS + p - 1, ctas, 0)
                if ready:  # every chunk's count whole: program order, one CTA
                    for ch in range(chunks[p]):
                        expect(ready0[p - 1] + ch, ready_step[p - 1], 0)
            elif cfg.cluster:
                if cl_sync:  # the producer publishes nothing: a relaxed arrival; its TMA reads what others wrote
                    before_spin()
                    _cluster_phase(False, async_proxy=True)
            elif waits[p - 1] and not ready:
                before_spin()
                _spin(sync_ref.at[pl.ds(SYNC_FLAGS + p - 1, 1)], ordinal, ctas)
            mark(f"prod_flag{p - 1}")

        def wait_ready(p, first, t, last):
            """TailConfig.chunk_ready (GPU): before step t's x tile, if it starts a unit whose K chunk is not
            the last one waited for, wait until that chunk of linear p's x is written (its ready counter);
            returns the chunk waited for last."""
            if interpret or not ready or p == 0 or not waits[p - 1]:
                return last
            _, ch, i = unit_of(p, first, t)
            need = jnp.logical_and(i == 0, ch != last)

            @pl.when(need)
            def _():
                _spin(sync_ref.at[pl.ds(ready0[p - 1] + ch, 1)], ordinal, ready_step[p - 1])

            return jnp.where(need, ch, last)

        cnt = jnp.int32(0)  # ring steps issued so far (slot cnt % stages)
        mark("prod_start")
        for p in range(3):
            first, count = my_units(p)
            total = count * per[p]
            ahead = jnp.minimum(total, stages)

            # the weights of the first `stages` steps go out before the x they need exists
            def pre_w(t, cnt, p=p, first=first):
                issue_w(p, first, t, reuse(cnt))
                return cnt + 1

            cnt_pre = cnt
            cnt = lax.fori_loop(0, ahead, pre_w, cnt)
            if p > 0:  # x of linear p: written by every CTA's finisher in linear p - 1
                def prefetch(p=p, first=first, count=count, ahead=ahead):  # the units after those the ring holds
                    if cfg.l2_prefetch:
                        j0 = ahead // per[p]
                        lax.fori_loop(j0, jnp.minimum(count, j0 + cfg.l2_prefetch),
                                      functools.partial(prefetch_unit, p=p, first=first), 0)

                pass_flag(p, prefetch)

            def pre_x(t, last, p=p, first=first, cnt_pre=cnt_pre):
                last = wait_ready(p, first, t, last)
                issue_x(p, first, t, lax.rem(cnt_pre + t, stages))
                return last

            last = lax.fori_loop(0, ahead, pre_x, jnp.int32(-1))

            def step(t, carry, p=p, first=first):
                cnt, last = carry
                slot = reuse(cnt)
                issue_w(p, first, t, slot)
                last = wait_ready(p, first, t, last)
                issue_x(p, first, t, slot)
                return cnt + 1, last

            cnt, _ = lax.fori_loop(ahead, total, step, (cnt, last))
        if interpret:  # the interpreter checks that a waiter sees every phase of the barriers it waited on
            @pl.when(cnt > stages)
            def _():
                for slot in range(stages):
                    plgpu.barrier_wait(empty.at[slot])

    # ------------------------------------------------------------------ consumers
    rt, q = lax.rem(wg, WGS), wg // WGS  # row tile of each pair, k group
    hand, hand_full, hand_free = r["hand"], r["hand_full"], r["hand_free"]
    nbuf = cfg.hand_bufs

    def mma(slot, acc):
        if not interpret:
            stage = mg.mma_stage(g, kt, mp, _STAGE_DIAG.get(cfg.diag, ""), cfg.mma_chains)
            return stage(w_smem.at[slot, rt], sz_smem.at[slot, rt], x_smem.at[slot], acc)
        for kb in range(kt // lay.KB):  # the twin: dequantize with the register kernel's arithmetic, f32 dot
            a = mg.twin_dequant(w_smem.at[slot, rt, kb][...].reshape(lay.THREADS, lay.WORDS),
                                sz_smem.at[slot, rt, kb // (c // lay.KB)][...], g, kb)
            xk = x_smem.at[slot, :, pl.ds(kb * lay.KB, lay.KB)][...]
            acc = acc + jnp.dot(a.astype(jnp.float32), xk.astype(jnp.float32).T, precision=lax.Precision.HIGHEST)
        return acc

    @pl.when(wg < n_cons)
    def _consumers():
        cnt = jnp.int32(0)  # the CTA's ring steps before this unit (group q takes steps q, q + kg, ...)
        n_units = jnp.int32(0)  # units handed to the finisher (hand buffer n_units % nbuf)
        for p in range(3):
            first, count = my_units(p)

            def unit(pair, ch, carry, p=p):
                del pair, ch  # the producer chose the unit's tiles; the consumers take its steps in ring order
                cnt, n_units = carry

                def step(i, acc):
                    slot = lax.rem(cnt + i * kg + q, stages)
                    plgpu.barrier_wait(full.at[slot])
                    if cfg.diag != "stream":
                        acc = mma(slot, acc)
                    plgpu.barrier_arrive(empty.at[slot])
                    return acc

                acc0 = jnp.zeros((lay.ROWS, mp), jnp.float32)
                if not interpret:
                    acc0 = plgpu.layout_cast(acc0, plgpu.Layout.WGMMA)
                acc = lax.fori_loop(0, per[p] // kg, step, acc0)
                if cfg.diag != "stream":  # the partial to the finisher; on at once to the next unit
                    hb = lax.rem(n_units, nbuf)

                    @pl.when(n_units >= nbuf)
                    def _():
                        plgpu.barrier_wait(hand_free.at[hb * WGS + rt])

                    hand.at[hb, rt, q][...] = acc
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(hand_full.at[hb * WGS + rt])
                return cnt + per[p], n_units + 1

            cnt, n_units = run_units(p, first, count, unit, (cnt, n_units))
            if cl_sync and p < 2:  # every unit of linear p handed off: nothing the finisher still needs from here
                _cluster_phase(False)
        if interpret and cfg.diag != "stream":  # the writers see the finisher's last releases (the interpreter's check)
            for hb in range(nbuf):
                @pl.when(n_units > hb)
                def _():
                    plgpu.barrier_wait(hand_free.at[hb * WGS + rt])

    # ------------------------------------------------------------------ finisher
    batch_row = mg.wgmma_iota((lay.ROWS, mp), 1, interpret)  # [64, M_pad]: the batch row of each element
    tile_row = mg.wgmma_iota((lay.ROWS, mp), 0, interpret)  # the column within the 64-column tile
    valid = batch_row < m

    def load_f32(ref):  # a [64, M_pad] float32 tile in the accumulator's layout from global memory
        return ref[...] if interpret else mg.load_wgmma(ref, optimized=False)

    def load_hand(ref):  # a consumer's accumulator from its hand-off buffer (swizzled above PLAIN_EXCHANGE_MP rows)
        return ref[...] if interpret else mg.load_wgmma(ref, optimized=mp > mg.PLAIN_EXCHANGE_MP)

    def store_f32(ref, v):
        ref[...] = v if interpret else plgpu.layout_cast(v, plgpu.Layout.WGMMA)

    def store_rows(ref, v, col0, rows):  # ref [R, C] rows 0..rows-1, columns col0..col0+63 = v^T
        if interpret:
            ref.at[pl.ds(0, rows), pl.ds(col0, lay.ROWS)][...] = v.T[:rows].astype(ref.dtype)
        else:
            _common.tile_access(mp, True)(v, batch_row, tile_row + col0, (batch_row < rows).astype(jnp.int32), ref)

    def load_rows(ref, col0):  # ref [M, C] -> [64, M_pad] float32 of columns col0.., rows >= M zero
        if interpret:
            v = ref.at[:, pl.ds(col0, lay.ROWS)][...].astype(jnp.float32).T
            return jnp.pad(v, ((0, 0), (0, mp - m)))
        return _common.tile_access(mp, False)(batch_row, tile_row + col0, valid.astype(jnp.int32), ref)

    def bf16(v):
        return v.astype(jnp.bfloat16).astype(jnp.float32)

    def epilogue_loads(p, pair):
        """What the pair's epilogue reads that no other unit of this linear writes: issued before the
        chunk counter's wait, so their latency overlaps it."""
        if p == 0:  # the residual x and the norm weight of each tile's 64 columns
            cols = [tile * lay.ROWS for tile in tiles_of(p, pair)]
            gvs = [r["g"].at[g_row, pl.ds(col0, lay.ROWS)] for col0 in cols]
            return ([load_rows(r["xo"], col0) for col0 in cols],
                    [(gv[...] if interpret else _common.load_with_layout(
                        gv, plgpu.Layout.WGMMA.reduce(1), optimized=False)).astype(jnp.float32) for gv in gvs])
        if p == 2:  # x1 (written in linear 0, before the flag this warpgroup passed)
            return [load_f32(r["x1t"].at[tile]) for tile in tiles_of(p, pair)]
        return None

    def tile_sums(v, dst):  # dst float32 [M_pad] = the rows' sums of v^2 over the tile's 64 columns (rows >= M: 0)
        sq = jnp.where(valid, v * v, 0.0)
        if interpret:
            dst[...] = jnp.sum(sq, axis=0)
        else:
            _column_sums(mp)(sq, r["colsum"], dst)

    def arrive_ready(p, ch):  # TailConfig.chunk_ready: linear p's pair written, a count on chunk ch of p + 1's x
        if not ready:
            return
        if interpret:
            arrive_twin(ready0[p] + ch)
        elif flags:
            _arrive(sync_ref.at[pl.ds(ready0[p] + ch, 1)])  # after every thread's stores (a warpgroup barrier)

    def epilogue(p, tots, pair, pre, rr):
        if p == 0:  # x1 = bf16(acc) + x; its tile, its rows' sums of x1^2, bf16(x1 g)
            xs, gcols = pre
            for t, tile in enumerate(tiles_of(p, pair)):
                col0 = tile * lay.ROWS
                x1 = bf16(bf16(tots[t]) + xs[t])
                store_f32(r["x1t"].at[tile], x1)
                tile_sums(x1, r["ssp"].at[tile])
                gcol = lax.broadcast_in_dim(gcols[t], (lay.ROWS, mp), (0,))
                store_rows(r["xg"], jnp.where(valid, x1 * gcol, 0.0), col0, mp)
            arrive_ready(0, pair // ready_step[0])  # the pair's 128 columns are in this chunk of gate_up's x
        elif p == 1:  # act = silu(gate rr) (up rr), rr = rsqrt(mean x1^2 + eps), into act columns 64 pair ..
            gate, up = tots[0] * rr, tots[1] * rr
            store_rows(r["act"], jnp.where(valid, gate / (1.0 + jnp.exp(-gate)) * up, 0.0), pair * lay.ROWS, mp)
            arrive_ready(1, pair // ready_step[1])  # the pair's 64 columns are in this chunk of down's x
        else:  # out = bf16(acc) + x1; with row sums, its tile's rows' sums of out^2 (the next layer's norm)
            for t, tile in enumerate(tiles_of(p, pair)):
                out = bf16(bf16(tots[t]) + pre[t])
                if interpret:  # a wait that found another count than its target (the GPU would hang or race): NaN
                    out = jnp.where(sync_ref[err + 1] == 0, out, jnp.nan)
                store_rows(r["xo"], out, tile * lay.ROWS, m)  # in place of x: every o epilogue read it before flag 0
                if "osum" in r:
                    tile_sums(out, r["osum"].at[tile])

    def finish(p, tots, pair, ch, rr):
        """The pair's unit sums: chunk < C-1 leaves them in the workspace and counts up the pair's
        counter; the last chunk waits for C-1 counts (this call's: `sync_words`) and sums p[0] + ... +
        p[C-1] per tile."""
        if chunks[p] == 1:
            epilogue(p, tots, pair, epilogue_loads(p, pair), rr)
            return
        ws, tiles = r[f"ws{p}"], tiles_of(p, pair)
        word = ctr0[p] + pair

        @pl.when(ch < chunks[p] - 1)
        def _():
            for t, tile in enumerate(tiles):
                store_f32(ws.at[ch, tile], tots[t])
            if interpret:
                arrive_twin(word)
            elif chunk_sync:
                _arrive(sync_ref.at[pl.ds(word, 1)])  # after every thread's stores (a warpgroup barrier)

        @pl.when(ch == chunks[p] - 1)
        def _():
            pre = epilogue_loads(p, pair)
            if interpret:
                expect(word, chunks[p] - 1, 1)
            elif chunk_sync:
                _spin(sync_ref.at[pl.ds(word, 1)], ordinal, chunks[p] - 1, async_proxy=False)
            sums = []
            for t, tile in enumerate(tiles):
                tot = load_f32(ws.at[0, tile])
                for i in range(1, chunks[p] - 1):
                    tot = tot + load_f32(ws.at[i, tile])
                sums.append(tot + tots[t])
            epilogue(p, sums, pair, pre, rr)

    @pl.when(wg == n_cons + 1)
    def _finisher():
        n_units = jnp.int32(0)  # units taken from the consumers (hand buffer n_units % nbuf)
        rr = None
        if cfg.timeline:
            _stamp(r["tl"].at[cta, pl.ds(0, 1)], "sm")
        mark("fin_start")
        for p in range(3):
            if p == 1 and cfg.diag not in ("noepi", "stream"):  # the norm's r from every o tile's row sums
                if interpret:
                    expect(SYNC_FLAGS, ctas, 1)
                elif waits[0] and not cfg.cluster:  # (the cluster's phase end was passed after linear 0)
                    _spin(sync_ref.at[pl.ds(SYNC_FLAGS, 1)], ordinal, ctas)
                ssp = r["ssp"]
                vec = (lambda t: ssp.at[t][...]) if interpret else (
                    lambda t: _common.load_with_layout(ssp.at[t], plgpu.Layout.WGMMA.reduce(0), optimized=False))
                ss = vec(0)
                for t in range(1, d // lay.ROWS):  # tile order: the same bits in every CTA
                    ss = ss + vec(t)
                rr = lax.rsqrt(lax.broadcast_in_dim(ss, (lay.ROWS, mp), (1,)) * (1.0 / d) + eps)
            first, count = my_units(p)

            def unit(pair, ch, carry, p=p, rr=rr):
                n_units = carry
                hb = lax.rem(n_units, nbuf)
                tots = []
                for t in range(WGS):  # k groups added in group order: p_0 + p_1
                    plgpu.barrier_wait(hand_full.at[hb * WGS + t])
                    if cfg.diag != "noepi":
                        tot = load_hand(hand.at[hb, t, 0])
                        for qq in range(1, kg):
                            tot = tot + load_hand(hand.at[hb, t, qq])
                        tots.append(tot)
                    plgpu.barrier_arrive(hand_free.at[hb * WGS + t])
                if cfg.diag != "noepi":
                    finish(p, tots, pair, ch, rr)
                return n_units + 1

            if cfg.diag != "stream":
                n_units = run_units(p, first, count, unit, n_units)
            mark(("fin_o", "fin_gate_up", "fin_down")[p])
            if p < 2:
                flag_used = not ready or p == 0  # flag 1 only for the producer's wait without ready counters
                if interpret:
                    if flag_used:
                        arrive_twin(SYNC_FLAGS + p)
                    plgpu.barrier_arrive(r["phase_bar"].at[0])
                elif cfg.cluster:
                    if cl_sync:  # each thread's stores of linear p's outputs, released to the cluster
                        _cluster_phase(True)
                elif flags and flag_used:
                    _arrive(sync_ref.at[pl.ds(SYNC_FLAGS + p, 1)])
        if cfg.diag in ("noepi", "stream"):
            # x back into its own place (CTA 0, one tile): a kernel that never stores to xo traces as reading it
            # only, so the call's output is x and XLA drops the call (1.4-us "calls" in the timing harness, H200,
            # 2026-12-03); the store keeps the diagnostic kernel in the program
            @pl.when(cta == 0)
            def _():
                store_rows(r["xo"], load_rows(r["xo"], 0), 0, m)


def _check(attn: Array, x: Array, wo: lay.W4A16Packed, norm_weight: Array, wgu: lay.W4A16Packed,
           wd: lay.W4A16Packed, layer: Any) -> tuple[int, int, int, int, int]:
    for name, w in (("wo", wo), ("w_gate_up", wgu), ("w_down", wd)):
        if not isinstance(w, lay.W4A16Packed):
            raise TypeError(f"{name} must be a W4A16Packed (pallas_kernels.linear.layout.pack_*), got {type(w).__name__}")
    if len({w.group_size for w in (wo, wgu, wd)}) != 1 or len({w.lead for w in (wo, wgu, wd)}) != 1:
        raise ValueError(f"wo, w_gate_up, w_down must share group size and leading dims; got "
                         f"{[(w.group_size, w.lead) for w in (wo, wgu, wd)]}")
    if len(wo.lead) > 1 or (layer is None) != (not wo.lead):
        raise ValueError(f"weight leading dims {wo.lead} need layer= exactly when stacked ([L, ...]); got layer={layer!r}")
    kq, d, f2 = wo.k, wo.n, wgu.n
    if wgu.k != d or f2 % 128 or wd.k != f2 // 2 or wd.n != d:
        raise ValueError(f"shapes: wo [Kq, D] = [{kq}, {d}], w_gate_up must be [D, 2F] and w_down [F, D]; got "
                         f"[{wgu.k}, {wgu.n}] and [{wd.k}, {wd.n}]")
    if d % lay.KB or k_tile_for(kq, d, f2 // 2, wo.group_size) is None:
        raise ValueError(f"Kq={kq}, D={d}, F={f2 // 2}: D must be a multiple of {lay.KB} and Kq, D, F of one k tile "
                         f"of {K_TILES} (a multiple of the group's record width {lay.chunk_cols(wo.group_size)})")
    for name, a, cols in (("attn", attn, kq), ("x", x, d)):
        if a.ndim != 2 or a.shape[1] != cols or a.dtype != jnp.bfloat16:
            raise ValueError(f"{name} must be bfloat16 [M, {cols}], got {a.dtype} {a.shape}")
    m = attn.shape[0]
    if x.shape[0] != m or not 1 <= m <= MAX_ROWS:
        raise ValueError(f"attn and x must have the same M in 1..{MAX_ROWS} rows; got {attn.shape[0]} and {x.shape[0]}")
    if norm_weight.dtype != jnp.bfloat16 or norm_weight.ndim not in (1, 2) or norm_weight.shape[-1] != d:
        raise ValueError(f"norm_weight must be bfloat16 [D={d}] or a stack [L, D]; got {norm_weight.dtype} "
                         f"{norm_weight.shape}")
    return m, kq, d, f2 // 2, wo.group_size


def int4_layer_tail_mgpu(attn: Array, x: Array, wo: lay.W4A16Packed, norm_weight: Array, w_gate_up: lay.W4A16Packed,
                         w_down: lay.W4A16Packed, *, layer: Any = None, norm_eps: float = 1e-5,
                         row_sums: bool = False, sync: Any = None, ordinal: Any = 0,
                         config: TailConfig | None = None,
                         interpret: bool | None = None) -> Array | tuple[Array, ...]:
    """out [M, D] bf16 = x1 + down(silu(gate) up), x1 = bf16(attn Wo) + x, gate | up = RMSNorm(x1) Wgu
    (module docstring; `layer_tail_reference` is the math), in one persistent kernel.

    attn [M, Kq] bf16 (the attention's output), x [M, D] bf16 (the layer's input, the residual),
    M in 1..MAX_ROWS; wo [Kq, D], w_gate_up [D, 2F] (gate | up halves), w_down [F, D]: INT4 in
    the Hopper layout, one layer each or stacks [L, ...] read in place at `layer` (int or traced
    int32 scalar, clamped); norm_weight bf16 [D] or a stack [L, D] (the MLP norm).
    `row_sums`: also return out's rows' sums of squares per 64-column tile, float32 [D / 64, M_pad]
    (`mosaic_gpu.chunk_row_sums` up to float32 rounding: the next layer's norm's `norm_sums`).
    `sync`: the grid-wide flags' and counters' ref (uint32 [`sync_words`], zeros when made:
    `jax.new_ref(sync_zeros(D, F), memory_space=plgpu.GMEM)` under jit) that this call shares with
    the calls before it, `ordinal` (int or traced int32 scalar) of them; a loop over layers passes one
    ref and its index. None: a fresh ref of zeros (one more launch; `ordinal` must be 0).
    `interpret=None` interprets unless the default backend is a GPU (then one CTA, `config.ctas`
    ignored). Returns out, then the row sums (`row_sums`), then with `config.timeline` (GPU only) the
    timeline uint32 [ctas, TIMELINE_COLUMNS]; a tuple where more than out."""
    m, kq, d, f, g = _check(attn, x, wo, norm_weight, w_gate_up, w_down, layer)
    if sync is None and not (isinstance(ordinal, int) and ordinal == 0):
        raise ValueError(f"ordinal={ordinal!r} counts the earlier calls on a shared sync ref: pass sync= (a fresh "
                         "ref is call 0)")
    if sync is not None and (tuple(sync.shape) != (sync_words(d, f),) or sync.dtype != jnp.uint32):
        raise ValueError(f"sync must be a uint32 [{sync_words(d, f)}] ref (sync_words(D={d}, F={f})), got "
                         f"{sync.dtype} {tuple(sync.shape)}")
    interp = _common.interpret_default(interpret)
    cfg = config or default_tail_config(kq, d, f, g, m)
    if cfg.diag not in TAIL_DIAGNOSTICS or ((cfg.diag or cfg.timeline) and interp):
        raise ValueError(f"diag={cfg.diag!r}, timeline={cfg.timeline}: diag one of {TAIL_DIAGNOSTICS}, and both only "
                         "on the GPU (timing)")
    if cfg.k_groups not in (1, 2) or cfg.stages % cfg.k_groups or cfg.stages < 2:
        raise ValueError(f"{cfg}: k_groups must be 1 or 2 and stages (>= 2) a multiple of it")
    if cfg.hand_bufs < 1 or cfg.l2_prefetch < 0:
        raise ValueError(f"{cfg}: hand_bufs must be >= 1 and l2_prefetch >= 0")
    kt = cfg.k_tile
    if kt % lay.chunk_cols(g) or any(k % kt for k in (kq, d, f)):
        raise ValueError(f"k_tile={kt}: must be a multiple of {lay.chunk_cols(g)} (group {g}) dividing Kq={kq}, D={d} "
                         f"and F={f}")
    if cfg.chunk_ready and d % 128:
        raise ValueError(f"chunk_ready: D={d} must be a multiple of 128 (the ready counters count whole o pairs)")
    if cfg.cluster and (not 1 <= cfg.ctas <= MAX_CLUSTER_CTAS or cfg.chunk_ready
                        or cfg.diag in ("noflag0", "noflag1")):
        raise ValueError(f"{cfg}: a cluster holds 1..{MAX_CLUSTER_CTAS} CTAs (ctas), and its phase ends are passed "
                         "by every thread: no chunk_ready, no diag noflag0 / noflag1 (noflag drops both)")
    for p, k in enumerate((kq, d, f)):
        if (k // kt) % cfg.chunks[p] or (k // kt // cfg.chunks[p]) % cfg.k_groups:
            raise ValueError(f"chunks={cfg.chunks}: chunk count {p} must divide the linear's {k // kt} k steps "
                             f"into units of a multiple of k_groups={cfg.k_groups} steps")
    if interp:
        cfg = cfg.replace(ctas=1)
    mp = mg.rows_for(m)
    n_layers = wo.lead[0] if wo.lead else (norm_weight.shape[0] if norm_weight.ndim == 2 else 1)
    g2 = norm_weight if norm_weight.ndim == 2 else norm_weight[None]
    if norm_weight.ndim == 2 and norm_weight.shape[0] != n_layers:
        raise ValueError(f"norm_weight has {norm_weight.shape[0]} layers, the weights {n_layers}")
    if m > 8 and m % 8:  # the x tiles' TMA view rows by 8: above 8 rows, M a multiple (zero rows, never stored)
        attn = jnp.pad(attn, ((0, mp - m), (0, 0)))
    view = mg.TMA_VIEWS["wide"]
    f32 = jnp.float32
    x_tf = (plgpu.TilingTransform((8, mg.SWIZZLE // 2)), plgpu.SwizzleTransform(mg.SWIZZLE))
    inputs = {"attn": attn, "g": g2,
              "layer": jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1),
              "ordinal": jnp.asarray(ordinal, jnp.int32).reshape(1)}
    for name, w in (("wo", wo), ("wgu", w_gate_up), ("wd", w_down)):
        inputs[f"{name}_w"] = w.qw.reshape(*w.qw.shape[:-2], *view)
        inputs[f"{name}_s"] = w.sz
    outs = {"xg": jax.ShapeDtypeStruct((mp, d), jnp.bfloat16),
            "act": jax.ShapeDtypeStruct((mp, f), jnp.bfloat16),
            "x1t": jax.ShapeDtypeStruct((d // lay.ROWS, lay.ROWS, mp), f32),
            "ssp": jax.ShapeDtypeStruct((d // lay.ROWS, mp), f32)}
    if row_sums:
        outs["osum"] = jax.ShapeDtypeStruct((d // lay.ROWS, mp), f32)
    for p, n_tiles in enumerate((d // lay.ROWS, 2 * f // lay.ROWS, d // lay.ROWS)):
        outs[f"ws{p}"] = jax.ShapeDtypeStruct((max(cfg.chunks[p] - 1, 1), n_tiles, lay.ROWS, mp), f32)
    if cfg.timeline:
        outs["tl"] = jax.ShapeDtypeStruct((cfg.ctas, len(TIMELINE_COLUMNS)), jnp.uint32)
    c = lay.chunk_cols(g)
    st = cfg.stages
    scratch = {"x_smem": plgpu.SMEM((st, mp, kt), jnp.bfloat16, transforms=x_tf),
               "w_smem": plgpu.SMEM((st, WGS, kt // lay.KB, *view), jnp.uint32),
               "sz_smem": plgpu.SMEM((st, WGS, kt // c, lay.ROWS * c // g), jnp.uint32),
               # [buffer, row tile, k group]: a unit's accumulators, consumers -> finisher
               "hand": plgpu.SMEM((cfg.hand_bufs, WGS, cfg.k_groups, lay.ROWS, mp), f32,
                                  transforms=() if interp else mg.exchange_transforms(mp)),
               "full": plgpu.Barrier(num_barriers=st, num_arrivals=N_FULL),
               "empty": plgpu.Barrier(num_barriers=st, num_arrivals=WGS),
               # per (buffer, row tile): every k group's accumulator stored / the finisher's read done
               "hand_full": plgpu.Barrier(num_barriers=cfg.hand_bufs * WGS, num_arrivals=cfg.k_groups),
               "hand_free": plgpu.Barrier(num_barriers=cfg.hand_bufs * WGS, num_arrivals=1)}
    if interp:
        scratch["phase_bar"] = plgpu.Barrier(num_barriers=1, num_arrivals=1)
    else:  # the finisher's buffer for the column sums (`_column_sums`)
        scratch["colsum"] = plgpu.SMEM((4, mp), f32)
    in_names = tuple(inputs)
    names = (*in_names, "xo", "sync", *outs, *scratch)
    kernel = functools.partial(_tail_kernel, names=names, m=m, mp=mp, g=g, d=d, f=f, kq=kq, cfg=cfg,
                               interpret=interp, stacked=bool(wo.lead), g_stacked=norm_weight.ndim == 2,
                               n_layers=n_layers, eps=float(norm_eps))
    name = f"int4_layer_tail_kq{kq}_d{d}_f{f}_g{g}_c{'x'.join(map(str, cfg.chunks))}"
    grid = dict(grid=(cfg.ctas,), grid_names=("c",))
    if cfg.cluster and not interp:  # one cluster: "c" is the CTA's rank in it
        grid = dict(grid=(1,), grid_names=("cg",), cluster=(cfg.ctas,), cluster_names=("c",))
        name += f"_cl{cfg.ctas}"
    mesh = plgpu.Mesh(num_threads=WGS * cfg.k_groups + 2, thread_name="wg", kernel_name=name, **grid)
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)

    def run(inputs, x, sync):
        def body(*refs):
            pl.run_scoped(functools.partial(kernel, *refs), *scratch.values(), collective_axes="wg")

        # x in, out back in its place (the down epilogues store after their finisher's flag-0 wait, when every o
        # epilogue has read x):
        # a layer loop's carry then takes the kernel's aliased output as it is, where a separate output cost a
        # copy per layer into the carry (H200, 2026-12-02: a 1.3-us memcpy, x being live while out was written)
        xo = jax.new_ref(x, memory_space=plgpu.GMEM)
        res = pl.kernel(body, out_type=tuple(outs.values()), mesh=mesh, compiler_params=params,
                        interpret=_common.interpret_params() if interp else False,
                        name=name)(*(inputs[k] for k in in_names), xo, sync)  # (jit re-sorts a dict's keys)
        res = {"out": xo[...], **dict(zip(outs, res))}
        picked = tuple(res[k] for k in ("out", "osum", "tl") if k in res)
        return picked if len(picked) > 1 else picked[0]

    if sync is not None:  # the caller's ref, written in place (refs stay out of a jit's arguments)
        return run(inputs, x, sync)
    # a call of its own: fresh zeros (refs in global memory exist only under jit)
    return jax.jit(lambda inputs, x, z: run(inputs, x, jax.new_ref(z, memory_space=plgpu.GMEM)))(
        inputs, x, sync_zeros(d, f))
