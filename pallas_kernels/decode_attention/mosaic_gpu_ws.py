"""Warp-specialized Mosaic GPU decode attention over the QuantSpec cache (issue 31).

The same math, operands and cache layout as `decode_attention.mosaic_gpu` (its "legacy" schedule: one
warpgroup per program does everything), on a schedule in which memory, not one warpgroup's
dependency chain, is meant to bound the kernel. One CTA per SM; by default four warpgroups:

* wg 3, TMA: streams the program's quantized blocks through `stages` shared-memory slots (and
  the FP-ring tiles through their own buffers), refilling a slot when its consumer releases it;
  40 registers (`setmaxnreg`). One warp of it runs the stream (`plgpu.warp_map`), the other three
  leave after `setmaxnreg`.
* wg 2, prep: per block, the key scale folded into the query (the B operand ``qs`` of the score
  MMA, float16) and the per-column bias ``q.z' - sum_c off_c qs_c`` (one cross-warp sum), written
  into the block's slot before the consumer gets there. Done ahead, off the consumers' chain.
* wg 0 and 1, consumers: block i of the program goes to consumer i % 2 (its own slots, i % 2 ==
  slot % 2), each with its own online-softmax state and its own partial; per block: codes ->
  float16 operands in registers, score MMA, softmax, P, value MMA accumulated in place. The verify
  view and the balanced schedule run one block after the other. The draft view's row split (batch
  1) has three consumers by default (`consumers_of`, `MgpuConfig.ws_consumers`: block i to
  consumer i % 3, two slots each, unpipelined; the prep and TMA warpgroups are then wg 3 and 4).
  With two consumers there (`MgpuConfig.ws_pipeline`) they are software-pipelined, a block's
  value MMA issued together with the K conversion and score MMA of the consumer's next block
  (`values_then_scores`), with 3 slots per consumer (6 stages); the verify view's pipelined wgmmas
  serialize for lack of registers, and the balanced schedule is faster unpipelined.

Options measured and left off (H100 / H200, 2026-11-26; docs/kernel_notes.md): two prep warpgroups
(`ws_preps=2`), and loops unrolled over their slots (`ws_static_slots`). The register budgets of every variant are
checked against the CTA's pool (`register_pool`): setmaxnreg cannot hand out more than a CTA
launched with, and asking for more hangs.

The softmax keeps a *lazy* reference max per column (FA4-style): a block's probabilities are
exp2(s - m_ref) with the reference of the previous blocks, as long as no score of the block
exceeds m_ref + LAZY_TH (so p <= 2**LAZY_TH); the test is one `bar.red.or` over the warpgroup,
which is also the barrier the P stores need anyway. Only when some column exceeds it (always on a
consumer's first block) does the block take the exact per-column max (cross-warp) and rescale
(l, y, O). A column that does not exceed keeps m_ref and alpha = 1 exactly, so its bits do not
depend on the other columns (T-invariance, issue 11).

Exactness: the block partition, the consumer of each block, the ring-tile assignment and every
reduction order depend on (B, Hkv, n_rep, D, G, S_max, R, view, config), never on T; T only
changes the number of column tiles C, each computed by the same instructions, and (`live_cols`)
how many of a tile's 8-column register tiles the softmax runs on; a column's own
operations are the same at either width, and every reduction over a column's tokens runs over the
whole tile (Mosaic's warpgroup column sum orders differently at another width: H200, 2026-11-29).

Partials: one per consumer warpgroup of each CTA, merged by `mosaic_gpu.merge_heads`. Or, on the row split with
`MgpuConfig.ws_kernel_merge` ($QSPEC_MGPU_KERNEL_MERGE=1), inside the kernel: each CTA's last consumer stores the CTA's
partial, adds 1 to its (row, KV head)'s counter (a uint32 ref operand, zero between calls) and the CTA that arrives
last merges the pair's partials in `merge_heads`' pairwise tree (`mosaic_gpu.merge_tree`), writes the output and
resets the counter; a pass shares one counter ref across its layers (`mosaic_gpu.kernel_inputs`). Off by default:
on the H200 it ties the XLA merge in the 8B's draft step and loses ~40 us in its verify step (kernel_notes,
"Thirty-sixth session").

Balanced schedule (draft view, by default from two rows up; `MgpuConfig.ws_flat`, $QSPEC_MGPU_FLAT=0|1; `flat_work`): a
grid of one CTA per SM, each taking an equal share of the (row, KV head) pairs' work laid end to
end and walking the pairs its share overlaps ("segments") with one continuous TMA stream, so that
rows of different lengths cost the sum of their lengths (the default grid gives each pair NP CTAs
and, being bound by its consumers, lasts as long as the longest row's CTAs). Partials: one per
consumer and CTA share of a pair (cap + 1 slots, the unused ones neutral). Its summation order
depends on every row's length, which the draft may have and the target may not. Its ring buffers
are sized for the call's own C (the draft's calls all have T = 1), which may move the ring to
another consumer at another T; measured (H200 2026-11-29, check_attention.py tinv): bitwise
T-invariant as run by default (unpipelined), 8e-6 apart when pipelined with live columns.

Testing: as for the legacy schedule, ``register_a=False`` is the SMEM-operand twin GPU interpret
mode runs on the CPU; the GPU-only pieces (register operands, `bar.red.or`, the cross-warp
reductions on a per-consumer scratch, the value MMA accumulated in place) each have a jnp twin of
the same math there. Interpret mode runs the roles one after another in one thread (see
`_build_ws`), so the slot reuse and barrier protocol are checked on the GPU
(tools/device/check_attention.py, impl "mosaic-ws").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_attention import mosaic_gpu as mg
from pallas_kernels import _common
from pallas_kernels._common import num_sms

Array = jax.Array
MT, NT, RT, NEG = mg.MT, mg.NT, mg.RING_TILE, mg.NEG
COL, ROW = mg.COL, mg.ROW
bcast_col, bcast_row = mg.bcast_col, mg.bcast_row

CONSUMERS = 2  # consumer warpgroups per CTA by default (wg 0 .. NC - 1; then the prep ones, then TMA)
LAZY_TH = 4.0  # log2 units: p <= 16 with a stale reference; |p * s_v| stays far inside float16
RED_ELEMS = 256  # float32 scratch per consumer for its cross-warp reductions (4 warps x 32 lanes x 2)
SMEM_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90
SMEM_SLACK = 8 * 1024  # alignment, barriers, Mosaic's reduction scratch: 3.6-5.4 KB measured (lowering, jax 0.11.2)
# setmaxnreg per (consumer, prep) warpgroup counts: consumers, prep, TMA. A CTA's register pool is
# what it launched with, its warpgroups x the entry count (65536 / threads, rounded down to 8: 128 for
# 4 warpgroups, 96 for 5), so NC x consumers + NPREP x prep + TMA must not exceed it: a larger increase
# waits forever (the first 3-consumer try asked for 3 x 144 + 56 + 24 = 512 > 480 and hung on the
# H200). 24 is setmaxnreg's minimum (the TMA warp needs few).
REGS = {(2, 1): (208, 56, 40), (3, 1): (136, 48, 24), (2, 2): (176, 48, 32)}
STREAM_DIAGS = ("stream", "stream_planes", "stream_noring")  # the `diag`s that run the TMA stream and barriers only
# The in-kernel split merge's counter (`_WsStatic.kernel_merge`), by thread 0 of the merging warpgroup: after its
# partial's stores (and a warpgroup barrier), a release fence and an acq_rel add of 1 at $0 (global), the old value
# stored at $1 (shared); the last CTA's threads then fence before reading the other partials; it resets the counter.
_ARRIVE_OLD_ASM = _common.thread0_asm("@p fence.acq_rel.gpu;\n@p atom.acq_rel.gpu.global.add.u32 v, [$0], 1;\n"
                                     "@p st.shared.u32 [$1], v;\n", regs=".reg .u32 v;\n")
_ACQUIRE_ASM = "fence.acq_rel.gpu;"
_RESET_ASM = _common.thread0_asm("@p st.relaxed.gpu.global.u32 [$0], 0;\n")


# The on-device profiler's regions (`MgpuConfig.ws_profile_dir`), recorded by one thread per warpgroup:
# c_all / p_all a consumer's / the prep's whole role (its start is the warpgroup's); consumers c_blk (a
# quantized block, waits included), c_wait (its wait for the slot's data and prep), c_ring (an FP ring tile),
# c_end (the partial's sums and stores; with `kernel_merge` inside it c_arr, the arrival on the pair's counter,
# and c_km, the last CTA's merge and output store); prep p_blk (a block, or two with `prep_pairs`), p_wait (its
# wait for the slot's data). Each region costs 16 bytes of shared memory per warpgroup (`profile_space`).
PROFILE_REGIONS = ("c_all", "c_blk", "c_wait", "c_ring", "c_end", "c_arr", "c_km", "p_all", "p_blk", "p_wait")


def profile_space(blocks_per_cta: int, ring_tiles_per_cta: int, segments: int) -> int:
    """Regions one warpgroup of a CTA may record in a call (the prep's two per block bound them all)."""
    return 2 * blocks_per_cta + 2 * ring_tiles_per_cta + 8 * segments + 10


def red_rows(consumers: int, preps: int = 1) -> int:
    """Rows of RED_ELEMS float32 reduction scratch: one per consumer, and one per prep warpgroup
    when there are several (a single prep uses Pallas' built-in reduction scratch)."""
    return consumers + (preps if preps > 1 else 0)


def register_pool(consumers: int, preps: int = 1) -> int:
    """setmaxnreg budget per thread of one warpgroup, summed over the CTA's warpgroups."""
    n_wg = consumers + preps + 1
    return n_wg * (65536 // (128 * n_wg) // 8 * 8)


@dataclasses.dataclass(frozen=True)
class _WsStatic:
    view: str
    B: int
    H: int
    D: int
    G: int
    R: int
    C: int  # column tiles (the only T-dependent number)
    NP: int  # CTAs per (row, KV head)
    stages: int  # quantized slots (a multiple of NC: consumer w owns the slots s with s % NC == w)
    ring_bufs: int  # ring tile buffers (1, 2 or 4), see `ring_plan`; also decides who takes the ring
    seq_slots: int  # interpret mode: one slot per block of a CTA (a multiple of NC, >= 2 NC), see `_build_ws`
    seq_ring_slots: int  # interpret mode: one buffer per ring item (K or V of a tile) of a CTA
    window: int | None
    register_a: bool
    interpret: bool
    scale_dtype: Any
    fp_dtype: Any
    regs: tuple[int, int, int]
    # timing diagnostics: "stream" (TMA + barriers only), "stream_planes" (the same without the
    # four scale/zero copies per block), "stream_noring" (the stream without any pair's FP ring),
    # "noring" (the whole kernel without it), "noprep" (no q s_k / bias), "scores_only" (a consumer
    # converts K and runs the score MMA, then releases the block) and "no_values" (everything but the
    # value MMA and its V conversion), "noconv" (the code words as the MMA operands, no conversion),
    # "nobias" (the prep's q s_k without the bias sum), "nosoftmax" (P = the biased scores: no max,
    # exp2, l, y or rescale) and "noconv_nosoftmax", "nolazybar" (no lazy-max test: no `bar.red.or`, the
    # reference never moves), "nocommit" (no commit_smem after the P stores: their fence and barrier) and
    # "nobars" (neither) give wrong results; "and_or" (right results)
    # converts codes with and + or, two LOP3s per word where the default has one
    diag: str | None = None
    pipeline: bool = True  # software-pipelined consumers (`values_then_scores`)
    # consumer and prep loops unrolled over their slots (`unrolled`); off by default: H100
    # 2026-11-26, ptxas spills 196 / 420 bytes (draft / verify) and the kernels slow 17% / 65%
    static_slots: bool = False
    tma_warp: bool = True  # one warp of the TMA warpgroup issues the copies
    consumers: int = CONSUMERS  # consumer warpgroups (NC): block i goes to consumer i % NC
    preps: int = 1  # prep warpgroups (NPREP): block i is prepared by prep warpgroup i % NPREP
    # the last consumer merges the CTA's NC partials (pairwise, in consumer order) and stores one:
    # consumers 0 .. NC-2 leave theirs in exchange outputs (global memory, L2-resident), see `_build_ws`
    pair_merge: bool = False
    # The balanced ("flat") schedule of the draft view (see `flat_work`): a grid of `flat_ctas` CTAs,
    # each an equal share of the flattened (row, KV head, block) work, walking the (row, head)
    # segments of its share with one continuous TMA stream; `flat_cap` + 1 partial slots per (row,
    # head) and consumer. (`flat_split` derives these numbers and geo_blocks below; `work_of` uses them.)
    flat: bool = False
    flat_ctas: int = 0
    flat_cap: int = 0
    ring_w: int = 0  # a (row, head)'s FP ring in block units of the flattened work
    # The target view's balanced schedule ("geometric", `geo_work`): every pair is `geo_blocks` blocks
    # wide (S_max // G) whatever its length, so the shares, segments and partial slots follow from the
    # geometry alone; a pair's real blocks are a prefix of its width (the rest is not streamed), a block
    # goes to consumer (its index in the pair) % NC, and each consumer has its own ring of slots
    # (w, w + NC, ...): a row's bits do not depend on the other rows' lengths. 0: off.
    geo_blocks: int = 0
    seq_segs: int = 1  # interpret mode: query buffers, one per segment of a CTA
    prep_q_regs: bool = False  # the prep holds a segment's query in registers (`prep_q_regs_of`)
    # per column tile, its live columns (8 or NT, `live_cols`): the prep's q s_k and the
    # consumers' softmax run on these only (with T = 1 and n_rep <= 8, half of each tile). Empty: all.
    live: tuple[int, ...] = ()
    # the prep warpgroup prepares the segment's blocks two at a time (`prep_pairs_of`): the balanced schedule,
    # one prep warpgroup, one column tile whose live columns are at most half of it
    prep_pairs: bool = False
    profile_dir: str | None = None  # timing diagnostic: Perfetto traces of the named regions (PROFILE_REGIONS)
    profile_space: int = 0  # the regions each warpgroup may record (`profile_space`)
    # The split merge in the kernel (`kernel_merge_of`; row split, with `pair_merge`): each CTA stores its partial
    # [D, CN] (not transposed), counts itself on its pair's uint32 counter (an operand the call leaves at zero), and
    # the last one merges the NP partials (`mosaic_gpu.merge_tree`, pairwise) into the output rows (b T + t) Hq +
    # h n_rep + r, [B T Hq, D] in `out_dtype`. n_rep and tokens place the columns (a column's math is T's own).
    kernel_merge: bool = False
    # Programmatic dependent launch (`pdl_of`; GPU only): the row split's TMA warp issues its first `stages`
    # blocks (code planes and scales, which the kernels of the same layer never write) before
    # `griddepcontrol.wait`, every role waits before it reads what the kernel before it writes (the query, the
    # FP ring, the positions), and the TMA warp then lets the next kernel launch (`launch_dependents`). The
    # layer index, the rows' meta and the balanced schedule's work split are read before the wait: they are
    # made once per pass, never by the call's immediate predecessor.
    pdl: bool = False
    n_rep: int = 0
    tokens: int = 0
    out_dtype: Any = None


def qp_rows(D: int, G: int) -> int:
    """Rows of one slot's float16 B-operand buffer: qs [D, NT] for the score MMA, then P s_v [G, NT]
    for the value MMA of the same block (written once the score MMA is done), and for the ring the
    query [D, NT] and P [RT, NT]."""
    return max(D, G, RT)


def smem_bytes(view: str, D: int, G: int, C: int, stages: int, ring_bufs: int, scale_dtype: Any,
               fp_dtype: Any, consumers: int = CONSUMERS, preps: int = 1, flat: bool = False) -> int:
    """Shared memory of the kernel's scratch (without alignment padding). `flat`: the balanced
    schedule's second query buffer and each consumer's own ring operands (`flat_work`)."""
    n_planes = 2 if view == "target" else 1
    cn = C * NT
    sd, fd = jnp.dtype(scale_dtype).itemsize, jnp.dtype(fp_dtype).itemsize
    n = stages * n_planes * (G * D // 2 + D * G // 2)  # code planes
    n += stages * (2 * D + 2 * G) * sd  # key scale/zero, value scale/zero
    n += stages * C * qp_rows(D, G) * NT * 2  # qs / P operands
    n += stages * cn * 4  # bias
    n += D * cn * 2 + mg.pos_width(cn) * 4  # q (bfloat16), positions
    n += ring_bufs * RT * D * fd  # ring K / V tiles
    n += red_rows(consumers, preps) * RED_ELEMS * 4
    if flat:
        n += D * cn * 2 + mg.pos_width(cn) * 4  # the next segment's query and positions
        n += consumers * 2 * C * qp_rows(D, G) * NT * 2  # ring query / P operands per consumer
    return n


def ring_plan(view: str, D: int, G: int, C: int, stages: int, scale_dtype: Any, fp_dtype: Any,
              consumers: int = CONSUMERS, preps: int = 1, flat: bool = False) -> int | None:
    """Ring tile buffers that fit next to `stages` quantized slots: 4 (two consumers, each streaming
    its own ring tiles, K and V in flight together), 2 (one consumer, K and V together) or 1 (one
    consumer, V loaded after the score MMA released K). None: not even one fits."""
    for bufs in ((4, 2, 1) if consumers == 2 else (2, 1)):
        if smem_bytes(view, D, G, C, stages, bufs, scale_dtype, fp_dtype, consumers, preps, flat) + SMEM_SLACK \
                <= SMEM_BYTES:
            return bufs
    return None


def fits(view: str, D: int, G: int, c_max: int, scale_dtype: Any, fp_dtype: Any) -> bool:
    """The schedule fits calls of up to c_max column tiles in shared memory (4 stages)."""
    return ring_plan(view, D, G, c_max, 4, scale_dtype, fp_dtype) is not None


# A CTA's fixed time (pipeline fill, prologue, epilogue) in blocks of the same CTA's streaming time,
# per view: fitted to the SmolLM2-shape sweep of num_splits (H100, 2026-11-26, B = 32, 8k: time =
# waves x (blocks per CTA x t + f); draft t = 0.65 us, f = 4.4 us; verify t = 0.60 us, f = 9.5 us).
CTA_FIXED_BLOCKS = {"draft": 7, "target": 16}
# `pair_merge` by default from this many CTAs per (row, KV head) up. The in-kernel merge costs a CTA
# ~0.4 us (an exchange through L2 and one mbarrier wait); each partial it saves the XLA merge is ~0.11
# us (H100, 8B draft at 4k, 2026-11-27: batch 1, NP 12: merge 3.5 -> 2.2 us, kernel 8.8 -> 9.3 us per
# layer, step -32 us; batch 8, NP 2: merge 1.5 -> 1.45 us, kernel +0.45 us, step +13 us). Break-even
# by those numbers is NP ~4; 8 keeps it to the CTA counts where it was measured to pay.
PAIR_MERGE_MIN_CTAS = 8


SPLITS_ENV = "QSPEC_MGPU_SPLITS"  # CTAs per (row, KV head) for every call without config.num_splits (A/B runs)


def _env_count(name: str, what: str) -> int | None:
    """The positive integer in $`name` (None when unset or empty); another value is named."""
    import os

    v = os.environ.get(name)
    if not v:
        return None
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"${name}={v!r}: expected {what} >= 1")
    return int(v)


def env_splits() -> int | None:
    """$QSPEC_MGPU_SPLITS as a split count (None when unset): how a benchmark forces NP in the model,
    e.g. more CTAs than `default_ctas` picks so that rows of different lengths fill the SMs."""
    return _env_count(SPLITS_ENV, "a split count")


FLAT_CTAS_ENV = "QSPEC_MGPU_FLAT_CTAS"  # the balanced schedule's CTA count where a config does not say (A/B runs)


def env_flat_ctas() -> int | None:
    """$QSPEC_MGPU_FLAT_CTAS as the balanced schedule's CTA count (None when unset): how a benchmark
    leaves SMs free beside the attention in the model (e.g. for another sub-batch's linears to run
    concurrently), where no config reaches the call."""
    return _env_count(FLAT_CTAS_ENV, "a CTA count")


def default_ctas(batch: int, hkv: int, n_blocks: int, view: str) -> int:
    """CTAs per (row, KV head): one CTA per SM, so pick the count whose waves x (blocks per CTA +
    the CTA's fixed cost in blocks) is smallest. Depends on the geometry and view only, never on T."""
    pairs = batch * hkv
    sms = num_sms()
    fixed = CTA_FIXED_BLOCKS[view]
    best, best_cost = 1, None
    for np_ in range(1, max(1, 4 * sms // pairs) + 1):
        if np_ > max(1, n_blocks):
            break
        waves = -(-(np_ * pairs) // sms)
        cost = waves * (-(-n_blocks // np_) + fixed)
        if best_cost is None or cost < best_cost:
            best, best_cost = np_, cost
    return best


def env_flag(name: str) -> bool | None:
    """A "0" / "1" environment switch of a ws option (A/B runs): None when unset or empty."""
    import os

    v = os.environ.get(name, "")
    if v not in ("", "0", "1"):
        raise ValueError(f"${name}={v!r}: expected 0 or 1")
    return None if not v else v == "1"


FLAT_ENV = "QSPEC_MGPU_FLAT"  # "1" / "0": the draft view's balanced schedule on / off where a config does not say
# The balanced schedule is the draft view's default from this batch up (H200, 2026-11-28, kernel alone: 8B
# batch 8 / 32k 107.1 -> 92.6 us on rows of 16k-32k, 107.0 -> 116.1 with every row at 32k; SmolLM2 batch 32 /
# 8k 42.4 -> 38.3 us uniform, 38.6 -> 31.6 ragged). At batch 1 every pair is as long as the others.
FLAT_MIN_BATCH = 2


TARGET_FLAT_ENV = "QSPEC_MGPU_TARGET_FLAT"  # "1" / "0": the target view's (geometric) balanced schedule


def flat_of(config: Any, view: str, batch: int) -> bool:
    """Whether a call runs the balanced schedule: `config.ws_flat`, else $QSPEC_MGPU_FLAT (draft view)
    or $QSPEC_MGPU_TARGET_FLAT (target view), else on for the draft view from FLAT_MIN_BATCH rows up,
    unless the call asks for what the balanced schedule does not have (a split count, static slots,
    the in-kernel pair merge). The draft's shares follow every row's length (`flat_work`); the target
    view's bits must depend on the row's own (its verify and autoregressive rows see different
    batches), so its shares follow the geometry (`geo_work`)."""
    asked = getattr(config, "ws_flat", None)
    if asked is None:
        v = env_flag(FLAT_ENV if view == "draft" else TARGET_FLAT_ENV)
        if v is not None:
            asked = v
        else:
            other = any(getattr(config, f, None) for f in ("num_splits", "ws_static_slots", "ws_pair_merge"))
            asked = view == "draft" and batch >= FLAT_MIN_BATCH and not other and env_splits() is None
    return bool(asked)


CONSUMERS_ENV = "QSPEC_MGPU_CONSUMERS"  # "2" / "3": consumer warpgroups per CTA where a config does not say (A/B runs)
# "2" / "3": the same for the balanced schedule's calls only (the draft's; A/B runs in the model, where
# $QSPEC_MGPU_CONSUMERS would change the verify's too). Three measured with the prep's pairs: FLAT_WIDE_STAGES.
FLAT_CONSUMERS_ENV = "QSPEC_MGPU_FLAT_CONSUMERS"
# Stages of the balanced schedule with three consumers and the prep's pairs, where they fit (H200 2026-12-01,
# SmolLM2 batch 32 / 8k, kernel alone, uniform / ragged: 6 stages 34.6 / 29.0 us, 9 stages 32.0 / 27.2).
FLAT_WIDE_STAGES = 9
# Blocks per CTA from which the draft's row split runs three consumers (H200 2026-11-29, 8B batch 1: at
# 128k, 64 blocks per CTA, 49.3 us with two pipelined consumers, 47.1 with three; at 4k, 2 blocks per CTA,
# 8.8 us per layer with two, 9.1 with three, whose third consumer has no block).
THREE_CONSUMERS_MIN_BLOCKS = 8


def consumers_of(config: Any, view: str, flat: bool, blocks_per_cta: int) -> int:
    """Consumer warpgroups per CTA: `config.ws_consumers`, else $QSPEC_MGPU_CONSUMERS, else (the
    balanced schedule) $QSPEC_MGPU_FLAT_CONSUMERS, else 3 for the draft view's row split where a CTA
    has THREE_CONSUMERS_MIN_BLOCKS blocks or more (unpipelined, 136 registers and two slots each) and
    CONSUMERS (2) otherwise. From the view, the schedule and the cache's geometry only, never from T:
    every T of a cache runs the same consumers in the same order (T-invariance)."""
    import os

    nc = getattr(config, "ws_consumers", None)
    if nc is None:
        v = os.environ.get(CONSUMERS_ENV, "")
        if not v and flat:
            v = os.environ.get(FLAT_CONSUMERS_ENV, "")
            name = FLAT_CONSUMERS_ENV
        else:
            name = CONSUMERS_ENV
        if v not in ("", "2", "3"):
            raise ValueError(f"${name}={v!r}: expected 2 or 3")
        three = (view == "draft" and not flat and blocks_per_cta >= THREE_CONSUMERS_MIN_BLOCKS
                 and (getattr(config, "ws_preps", None) or 1) == 1)  # (three consumers take one prep)
        nc = int(v) if v else (3 if three else CONSUMERS)
    return int(nc)


def flat_cap(batch: int, hkv: int, ctas: int) -> int:
    """The most CTA shares one (row, KV head)'s work may be cut into (its partial slots are one
    more): a share is at least 1/cap of the longest row's work, so short batches still spread a
    long row over the SMs."""
    return max(2, -(-ctas // (batch * hkv)))


FLAT_RING_W_ENV = "QSPEC_MGPU_FLAT_RING_W"  # the balanced schedule's ring weight in blocks (A/B runs)
# The ring's weight relative to its bytes' worth of quantized blocks, per head dim (num, den): measured on the
# H200 (2026-12-01, kernel alone, $QSPEC_MGPU_FLAT_RING_W): SmolLM2's D 64 at batch 32 / 8k, weights 2 / 3 / 5 /
# 10 (bytes) / 20 / 40 -> 33.1 / 32.5 / 32.7 / 34.0 / 36.8 / 39.5 us on uniform rows, 27.4 / 27.4 / 27.0 / 28.4 /
# 31.1 / 36.1 on rows of 4k-8k: half its bytes (5); the 8B's D 128 at batch 8 / 32k, 3 / 5 / 10 (bytes) -> 96.4
# / 95.8 / 95.0 and 75.7 / 75.0 / 74.4 us: its bytes.
RING_COST = {64: (1, 2)}


def ring_weight(view: str, D: int, G: int, R: int, scale_dtype: Any, fp_dtype: Any) -> int:
    """A (row, KV head)'s FP ring (all its tiles, K and V) in units of the balanced schedule's work, i.e.
    quantized blocks: its bytes' worth of blocks, scaled by the measured RING_COST of its head dim
    ($QSPEC_MGPU_FLAT_RING_W overrides it, for timing runs)."""
    import os

    v = os.environ.get(FLAT_RING_W_ENV)
    if v:
        if not v.isdigit() or int(v) < 1:
            raise ValueError(f"${FLAT_RING_W_ENV}={v!r}: expected a weight in blocks >= 1")
        return int(v)
    planes = 2 if view == "target" else 1
    block = planes * G * D + (2 * D + 2 * G) * jnp.dtype(scale_dtype).itemsize
    ring = -(-R // RT) * RT * D * 2 * jnp.dtype(fp_dtype).itemsize
    num, den = RING_COST.get(D, (1, 1))
    return max(1, -(-ring * num // (block * den)))


def flat_split(B: int, H: int, D: int, G: int, R: int, S_max: int, view: str, scale_dtype: Any, fp_dtype: Any,
               ctas: int | None = None) -> dict[str, int]:
    """The balanced schedule's static numbers for a cache geometry: its CTA count (`ctas`, else
    $QSPEC_MGPU_FLAT_CTAS, else one per SM), `flat_cap`, the ring's weight and (target view: shares of
    the geometry) every pair's width in blocks, S_max // G, else 0 (`_WsStatic` fields, `work_of`'s
    arguments). The pass's work split (`flat_inputs`) and the kernel's static numbers both come from
    here, so they agree on the count."""
    ctas = ctas or env_flat_ctas() or num_sms()
    return dict(flat_ctas=ctas, flat_cap=flat_cap(B, H, ctas),
                ring_w=ring_weight(view, D, G, R, scale_dtype, fp_dtype),
                geo_blocks=max(1, S_max // G) if view == "target" else 0)


def flat_work(q_len: Array, hkv: int, G: int, ctas: int, cap: int, ring_w: int) -> tuple[Array, Array]:
    """The balanced schedule's work split (computed once per pass, outside the layer loop).

    The work of (row b, KV head h), x = b * hkv + h, is its q_len // G quantized blocks then its
    FP ring (ring_w units), laid end to end over x: pair x covers [start_x, start_x + w_x). CTA c
    takes [c share, (c + 1) share) with share = max(ceil(total / ctas), ceil(max w / cap)), so each
    pair spans at most cap + 1 CTAs; the CTA holding a pair's first ring unit attends its whole ring.
    Returns (pairs int32 [B * hkv, 3]: start_x, q_len // G, the first CTA of x;
             ctas int32 [ctas, 4]: first pair, segments (pairs overlapping the share), g0, g1)."""
    nb = (q_len.astype(jnp.int32) // G)
    w = jnp.repeat(nb + ring_w, hkv)  # [B * hkv]
    cum = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(w, dtype=jnp.int32)])
    total = cum[-1]
    share = jnp.maximum(-(-total // ctas), -(-jnp.max(w) // cap))
    c = jnp.arange(ctas, dtype=jnp.int32)
    g0 = jnp.minimum(c * share, total)
    g1 = jnp.minimum(g0 + share, total)
    # the pair holding g: how many pairs start at or before it (a [ctas, B * hkv] compare and sum, one
    # small fusion; jnp.searchsorted is a loop of launches on the GPU)
    x0 = jnp.sum(cum[None, 1:-1] <= g0[:, None], axis=1, dtype=jnp.int32)
    x1 = jnp.sum(cum[None, 1:-1] <= (g1 - 1)[:, None], axis=1, dtype=jnp.int32)
    nseg = jnp.where(g1 > g0, x1 - x0 + 1, 0)
    x0 = jnp.clip(x0, 0, w.shape[0] - 1)
    pairs = jnp.stack([cum[:-1], jnp.repeat(nb, hkv), cum[:-1] // share], axis=1)
    return pairs, jnp.stack([x0, nseg, g0, g1], axis=1)


def geo_work(q_len: Array, hkv: int, G: int, ctas: int, cap: int, ring_w: int, n_blocks: int
             ) -> tuple[Array, Array]:
    """The target view's balanced schedule's work split: `flat_work` of rows all n_blocks (S_max // G)
    long, so that every share, segment and partial slot of a pair follows from the cache's geometry and
    not from the other rows' lengths; pairs[:, 1] is the pair's real block count (q_len // G <=
    n_blocks): its blocks are a prefix of the pair's width, the rest is not streamed, and its ring sits
    at unit n_blocks (`_WsStatic.geo_blocks`)."""
    full = jnp.full(q_len.shape, n_blocks * G, jnp.int32)
    pairs, work = flat_work(full, hkv, G, ctas, cap, ring_w)
    return pairs.at[:, 1].set(jnp.repeat(q_len.astype(jnp.int32) // G, hkv)), work


def work_of(q_len: Array, hkv: int, G: int, flat_ctas: int, flat_cap: int, ring_w: int, geo_blocks: int
            ) -> tuple[Array, Array]:
    """The balanced schedule's work split (ws_pairs, ws_ctas) from `flat_split`'s numbers: `geo_work`
    where pairs have a geometric width (the target view), `flat_work` otherwise (the draft's)."""
    if geo_blocks:
        return geo_work(q_len, hkv, G, flat_ctas, flat_cap, ring_w, geo_blocks)
    return flat_work(q_len, hkv, G, flat_ctas, flat_cap, ring_w)


def flat_inputs(cache: Any, view: str) -> dict[str, Array]:
    """The work split of a QuantSpecCache for the calls of a pass that run the balanced schedule by
    default (`flat_of` without a config; a config's ws_flat_ctas other than one per SM recomputes per call),
    as `mosaic_gpu.kernel_inputs` entries "ws_pairs" / "ws_ctas"; {} where the schedule is off."""
    _, B, H, S, dh = cache.k_hi.shape
    if not flat_of(None, view, B):
        return {}
    G = cache.group_size
    f = flat_split(B, H, 2 * dh, G, cache.ring_size, S, view, cache.k_scale.dtype, cache.k_fp.dtype)
    pairs, work = work_of(cache.q_len, H, G, **f)
    return {"ws_pairs": pairs, "ws_ctas": work}


# --------------------------------------------------------------------- GPU-only warpgroup helpers
def _wg_any_positive(tiles: list) -> Array:
    """int32 scalar, the same on every thread of the warpgroup: 1 if any element of `tiles`
    (float32 [64k, n] WGMMA arrays) is > 0 on any thread, else 0. One `bar.red.or.pred` on the
    warpgroup's named barrier (the one Mosaic's warpgroup barrier uses): it is also a full
    warpgroup barrier."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector
    import jax.experimental.mosaic.gpu as mgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * len(tiles),
                       return_type=plgpu.ShapeDtypeStruct((), jnp.int32, layout=plgpu.Layout.WG_SPLAT))
    def any_positive(ctx, *arrays):
        del ctx
        f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
        m = None
        for a in arrays:
            for reg in a.registers.flat:
                for e in range(ir.VectorType(reg.type).shape[0]):
                    x = vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e]))
                    m = x if m is None else arith.maximumf(m, x)
        pos = arith.extui(i32, arith.cmpf(arith.CmpFPredicate.OGT, m, arith.constant(f32, 0.0)))
        bar = arith.addi(mgpu.utils.warpgroup_idx(sync=False), arith.constant(i32, 1))  # Mosaic's WG barrier id
        res = llvm.inline_asm(
            i32, [pos, bar],
            "{ .reg .pred p, q; setp.ne.u32 p, $1, 0; bar.red.or.pred q, $2, 128, p; selp.u32 $0, 1, 0, q; }",
            "=r,r,r", has_side_effects=True)
        return mgpu.FragmentedArray.splat(res, (), is_signed=True)

    return any_positive(*tiles)


def _wg_colreduce(x: Array, scratch, op: str) -> Array:
    """Reduce a float32 [64k, n] WGMMA array over its rows ("max" or "add") across the warpgroup's
    4 warps through `scratch` (a float32 [RED_ELEMS] SMEM ref owned by this warpgroup): Mosaic's
    own reduction, but on a scratch no other warpgroup uses (Pallas' built-in one sits at one
    offset per call site, which both consumers would share)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((x.shape[1],), jnp.float32, layout=COL))
    def colreduce(ctx, a, ref):
        del ctx
        return a.reduce(op, 0, scratch=ref)

    return colreduce(x, scratch)


def _wg_cat_cols(parts: list, layout: Any) -> Array:
    """Concatenate arrays of one `layout` (WGMMA [64k, n_i] or its column layout [n_i], each n_i a
    multiple of 8) along their last axis: the registers placed side by side, no instruction."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    shape = (*parts[0].shape[:-1], sum(x.shape[-1] for x in parts))

    @plgpu.inline_mgpu(arg_types=(layout,) * len(parts),
                       return_type=plgpu.ShapeDtypeStruct(shape, parts[0].dtype, layout=layout))
    def cat(ctx, *arrays):
        del ctx
        regs = np.concatenate([a.registers for a in arrays], axis=len(shape) - 1)  # one register axis per dim
        return fa.FragmentedArray(_registers=regs, _layout=arrays[0].layout, _is_signed=arrays[0].is_signed)

    return cat(*parts)


def _wg_keep(x: Array) -> Array:
    """x (a WGMMA array) unchanged, every one of its registers read by a side-effecting asm (one
    `mov` of a constant) here: a pipelined consumer's score accumulator whose dead columns
    (`live_cols`) are never read otherwise, so that all of its registers have the use pattern of
    a whole-tile read (ptxas serializes the wgmma pipeline otherwise, C7511)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm, vector

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=plgpu.Layout.WGMMA))
    def keep(ctx, a):
        del ctx
        vals = []
        for reg in a.registers.flat:
            for e in range(ir.VectorType(reg.type).shape[0]):
                vals.append(vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e])))
        llvm.inline_asm(ir.IntegerType.get_signless(32), vals, "mov.u32 $0, 0;",
                        "=r" + ",f" * len(vals), has_side_effects=True)
        return a

    return keep(x)


def live_cols(cols: int, C: int) -> tuple[int, ...]:
    """Per column tile, the columns computed past the MMAs (`_WsStatic.live`): the tile's real
    query columns (of `cols` = n_rep T) rounded up to the WGMMA layout's 8-column register tile.
    The rest of the tile is padding: its scores are never read and its P operand is zero."""
    return tuple(min(NT, max(8, -(-(cols - c * NT) // 8) * 8)) for c in range(C))


# ---------------------------------------------------------------------------------- kernel
def _build_ws(st: _WsStatic):
    target = st.view == "target"
    D, G, C, R, S = st.D, st.G, st.C, st.R, st.stages
    QSCALE = mg.LOG2E / math.sqrt(D)  # scores in log2 units
    Dh, Gh = D // 2, G // 2
    CN = C * NT
    MTK, MTV = G // MT, D // MT  # token M tiles per block, channel M tiles
    n_planes = 2 if target else 1
    off_lo, off_hi = mg.offsets(st.view)
    kfac = 1.0 / 16 if target else 1.0
    n_ring_tiles = -(-R // RT)
    NRB = st.ring_bufs
    # GPU interpret mode runs the roles one after another in one thread: every block gets its
    # own slot and every ring item its own buffer, each barrier completes once and has one
    # waiter. The math of each role is the same code as on the GPU; the slot reuse and barrier
    # protocol are checked on the GPU only. (As 4 interpreter threads, the warpgroups' blocking
    # barrier waits sit inside XLA:CPU callbacks, and on a 2-core machine the CPU runtime's
    # worker pool starves: the TMA warpgroup never ran, with or without async dispatch.)
    seq = st.interpret
    stream_only = st.diag in STREAM_DIAGS
    no_ring = st.diag in ("noring", "stream_noring")  # timing diagnostics: every pair's ring left out
    SLOTS = st.seq_slots if seq else S
    RSLOTS = st.seq_ring_slots if seq else NRB
    QP = qp_rows(D, G)
    f32, f16 = jnp.float32, jnp.float16
    reg_a = st.register_a
    interp = st.interpret
    cons_regs, prep_regs, tma_regs = st.regs
    NC, NPREP = st.consumers, st.preps
    FLAT = st.flat
    KM = st.kernel_merge
    GEO = st.geo_blocks > 0  # the target view's balanced schedule (shares and consumers by the geometry)
    S2 = S // NC  # slots per consumer (consumer w's: w, w + NC, ...)
    QB = st.seq_segs if (FLAT and seq) else (2 if FLAT else 1)  # query / position buffers
    RING_OWNER_FLAT = 0 if NRB == 4 else NC - 1  # balanced schedule: the ring's consumer (all segments)
    WG_PREP, WG_TMA = NC, NC + NPREP  # prep warpgroups WG_PREP .. WG_TMA - 1

    def _load(ref, layout):
        return ref[...] if interp else mg.load_with_layout(ref, layout)

    def scope(name):  # a profiled region (`PROFILE_REGIONS`) where the call records them
        return jax.named_scope(name) if st.profile_dir else contextlib.nullcontext()

    def _cast(x, layout):
        return x if interp else plgpu.layout_cast(x, layout)

    def _load_gmem(ref, layout):  # another warpgroup's partial, from global memory
        return ref[...] if interp else mg.load_with_layout(ref, layout, optimized=False)

    def _when(cond):  # pl.when, also for a Python bool (interpret mode runs the roles with static w)
        if isinstance(cond, bool):
            return (lambda f: f()) if cond else (lambda f: None)
        return pl.when(cond)

    def combine(x, y):
        """Two partials (m [NT], l [NT], O^T [MTV][64, NT]) as one (`mosaic_gpu.pairwise_weights`)."""
        mx, wx, wy = mg.pairwise_weights(x[0], y[0])
        bx, by = bcast_col(wx, (MT, NT)), bcast_col(wy, (MT, NT))
        return mx, wx * x[1] + wy * y[1], [ox * bx + oy * by for ox, oy in zip(x[2], y[2])]

    def _iota(shape, dim):
        if interp:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    LIVE = st.live or (NT,) * C

    def cols(x, a, b):  # columns [a, b) of x (lax.slice without strides: Mosaic GPU lowers no strides)
        return lax.slice(x, (0,) * (x.ndim - 1) + (a,), (*x.shape[:-1], b))

    def lv(x, c):
        """The live columns of column tile c's [rows, NT] array or [NT] column vector."""
        return x if LIVE[c] == NT else cols(x, 0, LIVE[c])

    def with_lv(full, part, c):
        """`full` (column tile c's) with its live columns replaced by `part` (registers only)."""
        if LIVE[c] == NT:
            return part
        rest = cols(full, LIVE[c], NT)
        if interp:
            return jnp.concatenate([part, rest], axis=-1)
        return _wg_cat_cols([part, rest], plgpu.Layout.WGMMA if full.ndim == 2 else COL)

    def any_positive(tiles):
        if interp:
            return (functools.reduce(jnp.maximum, [jnp.max(t) for t in tiles]) > 0.0).astype(jnp.int32)
        return _wg_any_positive(tiles)

    def colreduce(x, scratch, op):
        if interp:
            return jnp.max(x, axis=0) if op == "max" else jnp.sum(x, axis=0)
        return _wg_colreduce(x, scratch, op)

    def kernel(layer_ref, meta_ref, pos_ref, q_ref, *refs, q_s, pos_s, k_s, v_s, sk_s, zk_s, sv_s, zv_s, qp_s,
               bias_s, kr_s, rq_s, red_s, ak_s, av_s, at_s, qbar, qfree, full, prepped, consumed, rfull, rconsumed,
               pdone, km_s):
        planes = refs[: 2 * n_planes]
        ks_ref, kz_ref, vs_ref, vz_ref, kfp_ref, vfp_ref, *rest = refs[2 * n_planes:]
        pairs_ref, ctas_ref = rest[:2] if FLAT else (None, None)
        rest = rest[2:] if FLAT else rest
        ctr_ref, rest = (rest[0], rest[1:]) if KM else (None, rest)  # the pairs' merge counters (uint32 [B H])
        o_ref, ml_ref, *x_refs = rest
        out_ref = x_refs.pop() if KM else None  # the merged output [B T Hq, D]
        kp_refs, vp_refs = planes[:n_planes], planes[n_planes:]
        p = lax.axis_index("p")
        layer = layer_ref[0]
        i32 = jnp.int32

        def dep_wait():  # (pdl) the kernel before this one has finished and its writes are visible
            if st.pdl:
                plgpu.griddepcontrol_wait()

        def dep_wait_and_release():  # (pdl, TMA warp) then the kernel after this one may launch
            if st.pdl:
                plgpu.griddepcontrol_wait()
                plgpu.griddepcontrol_launch_dependents()

        # This CTA's work is `nseg` segments, each the work of one (row, KV head) (every warpgroup
        # derives the same numbers). Default schedule: one segment, pair (b, h) of the grid, quantized
        # blocks [blk0, blk0 + n) and ring tiles r0, r0 + NP, ... (spread over the CTAs from the last).
        # Balanced schedule (FLAT, `flat_work`): the pairs overlapping this CTA's share [g0, g1).
        if FLAT:
            nseg = ctas_ref[p, 1]
        else:
            nseg = i32(1)
            grid_b, grid_h = lax.axis_index("b"), lax.axis_index("h")  # (not inside the TMA warp's warp_map)

        def div(a, d):  # a // d for a >= 0 (floor division lowers through `sign`, which warp code cannot)
            return lax.div(a, i32(d))

        def segment(k):
            """Segment k of this CTA: a dict of its pair's (traced) numbers."""
            if FLAT:
                x0, g0, g1 = ctas_ref[p, 0], ctas_ref[p, 2], ctas_ref[p, 3]
                x = x0 + k
                b = div(x, st.H)
                h = x - b * st.H
                start, nb, c_first = pairs_ref[x, 0], pairs_ref[x, 1], pairs_ref[x, 2]
                # the pair's width in blocks: its real ones, or (geometric) S_max // G, of which the
                # real nb are a prefix (its blocks past nb are in no share's stream)
                width = i32(st.geo_blocks) if GEO else nb
                lo = jnp.maximum(g0 - start, 0)
                hi = jnp.minimum(g1 - start, width + st.ring_w)
                blk0 = lo
                n = jnp.maximum(jnp.minimum(hi, nb) - lo, 0)
                # the CTA holding the pair's first ring unit attends its whole ring; the partial slot
                # is this CTA's index among the pair's; the pair's last CTA neutralises the unused slots
                nrt = jnp.where((lo <= width) & (width < hi), n_ring_tiles, 0)
                r0, rstride, ring_owner = i32(0), 1, i32(RING_OWNER_FLAT)
                j_out, last = p - c_first, start + width + st.ring_w <= g1
            else:
                b, h = grid_b, grid_h
                n_blk_row = div(meta_ref[b, 0], G)
                per = div(n_blk_row + st.NP - 1, st.NP)
                blk0 = p * per
                n = jnp.maximum(jnp.minimum(per, n_blk_row - blk0), 0)
                r0, rstride = st.NP - 1 - p, st.NP
                nrt = div(n_ring_tiles - r0 + st.NP - 1, st.NP)  # (numerator >= 1)
                # A consumer with the fewest quantized blocks (the last one unless NC divides n)
                # takes the ring (< 4 buffers), or, with 2 consumers and 4 buffers, its even tiles
                # (tile k goes to consumer (k + ring_owner) % 2).
                ring_owner = jnp.where(lax.rem(n, NC) == 0, 0, NC - 1)
                j_out, last = p, False
            if no_ring:
                nrt = i32(0)
            min_pos = meta_ref[b, 2]
            if st.window is not None:  # blocks before every row's window: exact no-ops, skipped
                first = div(jnp.maximum(min_pos - st.window + 1, 0), G)
                skip = jnp.clip(first - blk0, 0, n)
                blk0, n = blk0 + skip, n - skip
            return dict(b=b, h=h, lbh=(layer * st.B + b) * st.H + h, blk0=blk0, n=n, nrt=nrt, r0=r0,
                        rstride=rstride, ring_owner=ring_owner, j_out=j_out, last=last,
                        q_len=meta_ref[b, 0], fp_start=meta_ref[b, 1],
                        qb=k if seq else (lax.rem(k, QB) if QB > 1 else 0))

        # Default schedule: the one segment's numbers, derived once here by every thread, as every role
        # reads them (the balanced schedule derives its segments' where they are read, see `Seg`).
        seg0 = None if FLAT else segment(i32(0))

        # The query / positions buffer qb. One buffer (the default schedule): the buffer itself, so that
        # every shared-memory address of the prep's per-block query loads is static (an index, even a
        # constant 0, gives the swizzled view a runtime offset: with it d515913's row split measured 2-3%
        # slower than 178f384's, which had no buffer index; without it ~1%, H200 2026-11-28).
        def q_buf(qb):
            return q_s if QB == 1 else q_s.at[qb]

        def pos_buf(qb):
            return pos_s if QB == 1 else pos_s.at[qb]

        def q_tile(qb, c):  # the raw query, float32 [D, NT] (exact: it is stored as bfloat16)
            return _load(q_buf(qb).at[:, pl.ds(c * NT, NT)], plgpu.Layout.WGMMA).astype(f32)

        def ring_start(t):  # the last tile is moved back to end at R; its overlap is masked
            return jnp.minimum(t * RT, R - RT)

        def ring_item_slot(m, ring_owner):  # item 2k: K of ring tile k, item 2k + 1: its V (k counted
            if seq:                         # over the CTA's segments)
                return m
            if NRB == 4:  # the pair of buffers of the tile's consumer
                # (lax.div, not //: floor division lowers through `sign`, which warp code cannot)
                return 2 * lax.rem(lax.div(m, 2) + ring_owner, 2) + lax.rem(m, 2)
            return lax.rem(m, NRB)

        def slot_of(gi):  # gi: the block's index over the CTA's segments
            return gi if seq else lax.rem(gi, S)

        class Seg:
            """Segment k's numbers, each derived where it is read (`segment`, a few scalar loads)
            rather than held across the segment's block loop (ptxas, H200 2026-11-28: spill stores
            220 -> 208 bytes, and the block loop's spills gone; default schedule: `seg0`)."""

            def __init__(self, k):
                self.k = k

            def __getitem__(self, field):
                return (segment(self.k) if FLAT else seg0)[field]

        def first_of(w, blk0, base):
            """The segment's first block i (< NC) of consumer w: block i goes to consumer (base + i) % NC,
            its place in the CTA's stream, or (GEO) (blk0 + i) % NC, its index in its pair."""
            return lax.rem(w - lax.rem(blk0 if GEO else base, NC) + NC, NC)

        def pick(xs, w):  # xs[w] for a traced w
            return functools.reduce(lambda acc, v: jnp.where(w == v, xs[v], acc), range(1, NC), xs[0])

        def geo_slot(cnts, w, j):
            """GEO: the slot of consumer w's j-th block of a segment and its turn (consumer w's blocks before
            it in this CTA): consumer w's own ring of S2 slots w, w + NC, ...; cnts: each consumer's blocks
            in the segments before."""
            turn = pick(cnts, w) + j
            return w + NC * lax.rem(turn, S2), turn

        def geo_block_slot(cnts, blk0, i):
            """GEO: `geo_slot` of the segment's block i in stream order (the TMA warp's and the prep's):
            its consumer (blk0 + i) % NC, of whose blocks it is the (i // NC)-th."""
            return geo_slot(cnts, lax.rem(blk0 + i, NC), lax.div(i, NC))

        def walk(body, carry):
            """carry after body(k, Seg(k), base, rbase, carry, cnts) over this CTA's segments, base and
            rbase the quantized blocks and ring tiles of the segments before k (the slot and ring
            buffer counters run on over segment boundaries: one continuous stream), cnts (GEO) each
            consumer's blocks of the segments before k (its slot ring's counter; () otherwise).
            Returns (base, rbase, cnts, carry) after the last segment."""
            def step(k, c):
                base, rbase, cnts, user = c
                user = body(k, Seg(k), base, rbase, user, cnts)
                sg = segment(k) if FLAT else seg0
                n = sg["n"]
                if GEO:  # (n - first + NC - 1 >= 0)
                    cnts = tuple(cnts[v] + div(n - first_of(v, sg["blk0"], base) + NC - 1, NC) for v in range(NC))
                return base + n, rbase + sg["nrt"], cnts, user
            init = (i32(0), i32(0), tuple(i32(0) for _ in range(NC)) if GEO else (), carry)
            if not FLAT:
                return step(i32(0), init)
            return lax.fori_loop(0, nseg, step, init)

        # ------------------------------------------------------------------------- TMA
        def role_tma():
            if seq:
                return tma_stream()
            plgpu.set_max_registers(tma_regs, action="decrease")  # warpgroup-wide (setmaxnreg)
            if st.pdl:  # the row split's first blocks, then the grid-dependency wait (warpgroup code: a warp cannot wait)
                if not FLAT:
                    prefetch = lambda: first_blocks(block_issuer(seg0["lbh"], seg0["blk0"]), seg0["n"])  # noqa: E731
                    if st.tma_warp:
                        plgpu.warp_map(lambda warp: pl.when(warp == 0)(prefetch))
                    else:
                        prefetch()
                dep_wait_and_release()
            if not st.tma_warp:
                return tma_stream()

            # One warp runs the loop and issues the copies; the warpgroup's other three leave (the
            # stream's waits, addresses and loop control cost 4x the issue slots when the whole
            # warpgroup runs them: ~400 per block of 3600, ncu 2026-11-26).
            # Balanced schedule: a second warp streams the rings, so that a segment's ring (its
            # buffers recycled tile by tile) never holds up the next segment's query and blocks.
            @plgpu.warp_map
            def _(warp):
                if FLAT:
                    pl.when(warp == 0)(lambda: tma_stream(ring=False))
                    pl.when(warp == 1)(lambda: tma_stream(blocks=False))
                else:
                    pl.when(warp == 0)(tma_stream)

        def tma_stream(blocks: bool = True, ring: bool = True):
            def seg_stream(k, sg, base, rbase, _, cnts):
                if blocks:
                    b, h, qb = sg["b"], sg["h"], sg["qb"]
                    prefetched = st.pdl and not FLAT  # (pdl) the row split's first blocks went out in `role_tma`
                    if FLAT and not seq:  # the query buffer of segment k - QB: read by every role
                        _when(k >= QB)(lambda: plgpu.barrier_wait(qfree.at[qb]))
                    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_buf(qb), qbar.at[qb])
                    plgpu.copy_gmem_to_smem(pos_ref.at[b], pos_buf(qb), qbar.at[qb])
                    blocks_stream(sg, base, cnts, prefetched=prefetched)
                if ring:
                    ring_stream(sg, rbase)
                return _

            base, rbase, cnts, _ = walk(seg_stream, i32(0))
            if seq:
                return
            owner = RING_OWNER_FLAT if FLAT else seg0["ring_owner"]

            # Drain: observe the releases not waited for above, so that this warp has seen every
            # completion of the barriers it waits on (GPU interpret mode checks it).
            if blocks and GEO:  # each consumer's last turns of its own slots
                for v in range(NC):
                    @pl.loop(jnp.maximum(cnts[v] - S2, 0), cnts[v])
                    def _(t):
                        plgpu.barrier_wait(consumed.at[v + NC * lax.rem(t, S2)])
            elif blocks:
                @pl.loop(jnp.maximum(base - S, 0), base)
                def _(i):
                    plgpu.barrier_wait(consumed.at[lax.rem(i, S)])

            if ring:
                @pl.loop(jnp.maximum(2 * rbase - NRB, 0), 2 * rbase)
                def _(m):
                    plgpu.barrier_wait(rconsumed.at[ring_item_slot(m, owner)])

        def block_issuer(lbh, blk0):
            def issue(i, slot):
                blk = blk0 + i
                for j, r in enumerate(kp_refs):
                    plgpu.copy_gmem_to_smem(r.at[lbh, pl.ds(blk * G, G)], k_s.at[slot, j], full.at[slot])
                for j, r in enumerate(vp_refs):
                    plgpu.copy_gmem_to_smem(r.at[lbh, pl.ds(blk * D, D)], v_s.at[slot, j], full.at[slot])
                if st.diag == "stream_planes":
                    return
                plgpu.copy_gmem_to_smem(ks_ref.at[lbh, blk], sk_s.at[slot], full.at[slot])
                plgpu.copy_gmem_to_smem(kz_ref.at[lbh, blk], zk_s.at[slot], full.at[slot])
                plgpu.copy_gmem_to_smem(vs_ref.at[lbh, pl.ds(blk * G, G)], sv_s.at[slot], full.at[slot])
                plgpu.copy_gmem_to_smem(vz_ref.at[lbh, pl.ds(blk * G, G)], zv_s.at[slot], full.at[slot])

            return issue

        def first_blocks(issue, n):  # the row split (base 0): the first S slots are free
            for s in range(S):
                @pl.when(s < n)
                def _():
                    issue(s, s)

        def blocks_stream(sg, base, cnts, prefetched: bool = False):
            lbh, blk0, n = sg["lbh"], sg["blk0"], sg["n"]
            issue = block_issuer(lbh, blk0)
            if seq:
                pl.loop(0, n)(lambda i: issue(i, base + i))
            elif not FLAT:  # (base 0) the first S slots are free: issued here or already (`first_blocks`)
                if not prefetched:
                    first_blocks(issue, n)

                @pl.loop(S, jnp.maximum(n, S))
                def _(i):
                    slot = lax.rem(i, S)
                    plgpu.barrier_wait(consumed.at[slot])  # block i - S released its slot
                    issue(i, slot)
            elif GEO:
                @pl.loop(0, n)
                def _(i):
                    slot, turn = geo_block_slot(cnts, blk0, i)
                    _when(turn >= S2)(lambda: plgpu.barrier_wait(consumed.at[slot]))  # turn - S2 released it
                    issue(i, slot)
            else:
                @pl.loop(0, n)
                def _(i):
                    gi = base + i
                    slot = lax.rem(gi, S)
                    _when(gi >= S)(lambda: plgpu.barrier_wait(consumed.at[slot]))  # block gi - S released it
                    issue(i, slot)

        def ring_stream(sg, rbase):
            lbh, r0, rstride, nrt, owner = sg["lbh"], sg["r0"], sg["rstride"], sg["nrt"], sg["ring_owner"]

            def issue_ring(m, slot):
                k = lax.div(m, 2)
                s0 = ring_start(r0 + k * rstride)

                @pl.when(lax.rem(m, 2) == 0)
                def _():
                    plgpu.copy_gmem_to_smem(kfp_ref.at[lbh, pl.ds(s0, RT)], kr_s.at[slot], rfull.at[slot])

                @pl.when(lax.rem(m, 2) == 1)
                def _():
                    plgpu.copy_gmem_to_smem(vfp_ref.at[lbh, pl.ds(s0, RT)], kr_s.at[slot], rfull.at[slot])

            if seq:
                pl.loop(0, 2 * nrt)(lambda m: issue_ring(m, 2 * rbase + m))
                return
            if not FLAT:  # (rbase 0) the first NRB buffers are free
                for m0 in range(NRB):
                    @pl.when(m0 < 2 * nrt)
                    def _():
                        issue_ring(m0, ring_item_slot(m0, owner))

                @pl.loop(NRB, jnp.maximum(2 * nrt, NRB))
                def _(m):
                    slot = ring_item_slot(m, owner)
                    plgpu.barrier_wait(rconsumed.at[slot])  # item m - NRB released its buffer
                    issue_ring(m, slot)
                return

            @pl.loop(0, 2 * nrt)
            def _(m):
                gm = 2 * rbase + m
                slot = ring_item_slot(gm, owner)
                _when(gm >= NRB)(lambda: plgpu.barrier_wait(rconsumed.at[slot]))  # item gm - NRB released it
                issue_ring(m, slot)

        # ------------------------------------------------------------------------ prep
        def role_prep(r):
            """Prep warpgroup r: blocks gi = r, r + NPREP, ... of the CTA's stream (their slots are
            r's alone: NPREP | S)."""
            dep_wait()
            with scope("p_all"):
                prep_role(r)

        def prep_role(r):
            if not seq:
                plgpu.set_max_registers(prep_regs, action="decrease")
            off_k = {}  # [D, width]: the code offset of each channel
            for width in set(LIVE):
                off_k[width] = jnp.where(_iota((D, width), 0) < Dh, off_lo, off_hi)
            def q_live(qb, c):  # the raw query's live columns, float32 [D, live]
                return lv(q_tile(qb, c), c)

            # the dead columns of q s_k and of the bias terms: zero (their scores are never read; None
            # where every tile is whole, and `with_lv` then never reads them)
            zeros_qs = _cast(jnp.zeros((D, NT), f16), plgpu.Layout.WGMMA) if min(LIVE) < NT else None
            zeros_w = _cast(jnp.zeros((D, NT), f32), plgpu.Layout.WGMMA) if min(LIVE) < NT else None

            def slot_scales(slot):
                """The slot's per-channel key scale and zero ([D] each), q's softmax scale folded in."""
                sk = _load(sk_s.at[slot], ROW).astype(f32)
                zk = _load(zk_s.at[slot], ROW).astype(f32)
                return sk * (kfac * QSCALE), (zk - sk * 0.5 if target else zk) * QSCALE

            def block_terms(qb, slot, c, q_regs, scales):
                """Column tile c of the block in `slot`: its q s_k stored as the slot's score-MMA B operand,
                and its live columns' bias terms q.z' - off qs [D, live] returned (to be summed over D)."""
                s_eff, z_eff = scales
                nl = LIVE[c]
                qt = q_live(qb, c) if q_regs is None else q_regs[c]
                qs = (qt * bcast_row(s_eff, (D, nl))).astype(f16)
                qp_s[slot, c, pl.ds(0, D)] = with_lv(zeros_qs, qs, c)
                return qt * bcast_row(z_eff, (D, nl)) - off_k[nl] * qs.astype(f32)

            def prep_block(qb, slot, q_regs):
                with scope("p_blk"):
                    prep_one(qb, slot, q_regs)

            def prep_one(qb, slot, q_regs):
                with scope("p_wait"):
                    plgpu.barrier_wait(full.at[slot])
                if stream_only or st.diag == "noprep":  # timing diagnostics: no qs / bias
                    plgpu.barrier_arrive(prepped.at[slot])
                    return
                scales = slot_scales(slot)
                for c in range(C):  # (the live columns of each tile, `live_cols`)
                    w = block_terms(qb, slot, c, q_regs, scales)
                    # [NT] q.z' - sum(off * qs); with several prep warpgroups, each on its own scratch.
                    # Summed over the whole tile: Mosaic's cross-warp sum of a column may take another
                    # order at another width (H200: T = 1 against T = 5 rows differed in the last bits)
                    w = with_lv(zeros_w, w, c)
                    if st.diag == "nobias":  # timing diagnostic: q s_k only, no bias sum
                        continue
                    bias_s[slot, pl.ds(c * NT, NT)] = (jnp.sum(w, axis=0) if NPREP == 1
                                                      else colreduce(w, red_s.at[NC + r], "add"))
                plgpu.commit_smem()
                plgpu.barrier_arrive(prepped.at[slot])

            def prep_pair(qb, slot_a, slot_b, q_regs):
                """Two blocks at once (`prep_pairs`): each block's q s_k as `prep_one`'s (`block_terms`), and both bias
                terms in one column sum over a tile holding block a's live columns then block b's (the
                same tile width as one block's sum: a column's sum is the same reduction either way)."""
                with scope("p_blk"):
                    with scope("p_wait"):
                        plgpu.barrier_wait(full.at[slot_a])
                        plgpu.barrier_wait(full.at[slot_b])
                    nl = LIVE[0]
                    parts = [block_terms(qb, slot, 0, q_regs, slot_scales(slot)) for slot in (slot_a, slot_b)]
                    both = jnp.concatenate(parts, axis=-1) if interp else _wg_cat_cols(parts, plgpu.Layout.WGMMA)
                    total = jnp.sum(both, axis=0)  # [NT]: block a's columns, then block b's
                    bias_s[slot_a, pl.ds(0, nl)] = cols(total, 0, nl)
                    bias_s[slot_b, pl.ds(0, nl)] = cols(total, nl, 2 * nl)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(prepped.at[slot_a])
                    plgpu.barrier_arrive(prepped.at[slot_b])

            def seg_prep(k, sg, base, rbase, carry, cnts):
                qb, n = sg["qb"], sg["n"]
                if not seq or r == 0:  # interpret mode: one waiter per barrier completion (see SLOTS)
                    plgpu.barrier_wait(qbar.at[qb])
                # `q_regs`: the segment's query tiles loaded once, into registers (float32 [D, live] per
                # column tile: at most D NT / 128 per thread), where every block would reload them from shared
                # memory (through a runtime-offset view when the balanced schedule double-buffers them)
                q_regs = [q_live(qb, c) for c in range(C)] if st.prep_q_regs else None
                if NPREP > 1 or seq or FLAT or not st.static_slots:  # runtime slots
                    if NPREP == 1:
                        i0, count = 0, n
                    else:  # this warpgroup's first block of the segment and its block count (n - i0 + NPREP - 1 >= 0)
                        i0 = lax.rem(r - lax.rem(base, NPREP) + NPREP, NPREP) if FLAT else r
                        count = (n - i0 + NPREP - 1) // NPREP
                    if GEO and not seq:  # (NPREP 1) block i in consumer (blk0 + i) % NC's ring
                        pl.loop(0, n)(lambda i: prep_block(qb, geo_block_slot(cnts, sg["blk0"], i)[0], q_regs))
                    elif st.prep_pairs:  # (NPREP 1: i0 0) blocks 2j and 2j + 1, then an odd last one alone
                        pl.loop(0, lax.div(n, i32(2)))(
                            lambda j: prep_pair(qb, slot_of(base + 2 * j), slot_of(base + 2 * j + 1), q_regs))
                        _when(lax.rem(n, i32(2)) == 1)(lambda: prep_block(qb, slot_of(base + n - 1), q_regs))
                    else:
                        pl.loop(0, count)(lambda j: prep_block(qb, slot_of(base + i0 + NPREP * j), q_regs))
                else:  # static slots (see the consumers' `unrolled`), then the rest (base 0)
                    @pl.loop(0, n // S)
                    def _(k):
                        for u in range(S):
                            prep_block(qb, u, q_regs)

                    pl.loop(n // S * S, n)(lambda i: prep_block(qb, lax.rem(i, S), q_regs))
                if FLAT and not seq:
                    plgpu.barrier_arrive(qfree.at[qb])  # done with the segment's query
                return carry

            walk(seg_prep, i32(0))

        # -------------------------------------------------------------------- consumers
        def role_consumer(w):
            dep_wait()
            with scope("c_all"):
                consumer_role(w)

        def consumer_role(w):
            if not seq:
                plgpu.set_max_registers(cons_regs, action="increase")
            red = red_s.at[w]
            tok_rows = {width: _iota((MT, width), 0) for width in set(LIVE)}  # token row of each element
            zeros_t = lambda: _cast(jnp.zeros((MT, NT), f32), plgpu.Layout.WGMMA)  # noqa: E731
            zeros_p = lambda: _cast(jnp.zeros((MT, NT), f16), plgpu.Layout.WGMMA)  # noqa: E731
            neg_c = lambda: _cast(jnp.full((NT,), NEG, f32), COL)  # noqa: E731
            ones_c = lambda: _cast(jnp.ones((NT,), f32), COL)  # noqa: E731

            def scores(a_tiles, b_refs):
                """S^T tiles [a][c] = A_a [64, K] . B_c [K, NT] (a: register values or SMEM tiles)."""
                def run(*accs):
                    for ai, a in enumerate(a_tiles):
                        if not reg_a:
                            ak_s[w] = a
                            plgpu.commit_smem()
                            a = ak_s.at[w]
                        for c in range(C):
                            plgpu.wgmma(accs[ai * C + c], a, b_refs[c])
                        if not reg_a:
                            plgpu.wgmma_wait(0)
                    return [acc[...] for acc in accs]
                return pl.run_scoped(run, *[plgpu.ACC((MT, NT), f32) for _ in range(len(a_tiles) * C)])

            def values(os_, make_a, b_ref, twin_buf):
                """O^T[mc][c] += V^T_mc [64, K] . P_c [K, NT] for the MTV channel tiles: accumulated in
                place in the wgmma accumulators (GPU), or summed onto O from fresh ones (twin).
                make_a(mc) / b_ref(c) build their refs when called: inside `pl.run_state` a ref
                sliced outside it with static bounds does not lower (jax 0.11.2)."""
                if reg_a:
                    def run(accs):
                        for mc in range(MTV):
                            a = make_a(mc)
                            for c in range(C):
                                plgpu.wgmma(accs[mc * C + c], a, b_ref(c))
                    flat = pl.run_state(run)(tuple(plgpu.ACC.init(os_[c][mc]) for mc in range(MTV) for c in range(C)))
                    return tuple(tuple(flat[mc * C + c] for mc in range(MTV)) for c in range(C))

                def run_twin(*accs):
                    for mc in range(MTV):
                        twin_buf[w] = make_a(mc)
                        plgpu.commit_smem()
                        for c in range(C):
                            plgpu.wgmma(accs[mc * C + c], twin_buf.at[w], b_ref(c))
                        plgpu.wgmma_wait(0)
                    return [acc[...] for acc in accs]
                pv = pl.run_scoped(run_twin, *[plgpu.ACC((MT, NT), f32) for _ in range(MTV * C)])
                return tuple(tuple(os_[c][mc] + pv[mc * C + c] for mc in range(MTV)) for c in range(C))

            def lazy_reference(s_by_c, ms):
                """(new references, alphas, flag) for the masked score tiles s_by_c[c] (log2 units,
                masked entries NEG): a column keeps its reference m unless a score exceeds
                m + LAZY_TH; then it takes the block's exact max. The flag (any column changed)
                costs one warpgroup barrier, which also orders this block's score-MMA reads of the
                slot's B operand before its P stores."""
                if st.diag in ("nolazybar", "nobars"):  # timing diagnostic: no barrier, the reference never moves
                    return tuple(ms), [m * 0.0 + 1.0 for m in ms], jnp.zeros((), jnp.int32)
                flag = any_positive([s - bcast_col(m + LAZY_TH, s.shape) for s_t, m in zip(s_by_c, ms) for s in s_t])

                def exact(ms):
                    out = []
                    for s_t, m in zip(s_by_c, ms):
                        bm = colreduce(functools.reduce(jnp.maximum, s_t), red, "max")
                        out.append(jnp.where(bm > m + LAZY_TH, bm, m))
                    return tuple(out)

                new_ms = lax.cond(flag > 0, exact, lambda ms: ms, tuple(ms))
                alphas = [jnp.where(mn > m, jnp.exp2(m - mn), 1.0) for m, mn in zip(ms, new_ms)]
                return new_ms, alphas, flag

            def rescaled(flag, alphas, ls, ys, os_):
                """(l, y, O) x alpha per column, skipped when no column's reference moved."""
                def scale(args):
                    ls, ys, os_ = args
                    a = [bcast_col(x, (MT, NT)) for x in alphas]
                    return (tuple(x * a[c] for c, x in enumerate(ls)), tuple(x * a[c] for c, x in enumerate(ys)),
                            tuple(tuple(o * a[c] for o in oc) for c, oc in enumerate(os_)))
                return lax.cond(flag > 0, scale, lambda args: args, (tuple(ls), tuple(ys), tuple(os_)))

            # ------------------------------------------------------------ quantized blocks
            def code_operand(planes, slot, rows, nb):
                """float16 A operand [MT, 2 nb] of the slot's code rows [rows, rows + MT) (upper
                plane, and the lower one for the target): registers on the GPU, the twin else."""
                hi = planes.at[slot, 0].at[pl.ds(rows, MT)]
                lo = planes.at[slot, 1].at[pl.ds(rows, MT)] if target else None
                if reg_a:
                    return mg.register_operand(_load(hi, plgpu.Layout.WGMMA_8BIT),
                                               None if lo is None else _load(lo, plgpu.Layout.WGMMA_8BIT),
                                               MT, nb, lop3=st.diag != "and_or",
                                               raw=st.diag in ("noconv", "noconv_nosoftmax"))
                return mg.twin_operand(hi[...], None if lo is None else lo[...])

            def k_tiles(slot):
                """K operand tiles of the block in `slot`, once the slot is loaded and prepared."""
                with scope("c_wait"):
                    if not seq:  # (interpret mode: the prep role waited)
                        plgpu.barrier_wait(full.at[slot])
                    plgpu.barrier_wait(prepped.at[slot])
                return [code_operand(k_s, slot, mt * MT, Dh) for mt in range(MTK)]

            def qs_refs(slot):  # the score MMA's B operands: the slot's q s_k tiles
                return [qp_s.at[slot, c, pl.ds(0, D)] for c in range(C)]

            def p_ref(slot):  # the value MMA's B operand of column tile c: the slot's P s_v
                return lambda c: qp_s.at[slot, c, pl.ds(0, G)]

            def v_tiles(slot):  # the value MMA's A operand of channel tile mc, built when called
                return lambda mc: code_operand(v_s, slot, mc * MT, Gh)

            def seg_consume(k, sg, base, rbase, carry_, cnts):
                """Segment k: its quantized blocks (the CTA stream's gi = base + i with gi % NC == w;
                GEO: the pair's blocks blk0 + i with (blk0 + i) % NC == w), its ring tiles, and this
                consumer's partial of it."""
                blk0, n, qb = sg["blk0"], sg["n"], sg["qb"]
                if not seq:  # (interpret mode: the prep role waited)
                    plgpu.barrier_wait(qbar.at[qb])
                pos_c = [_load(pos_buf(qb).at[pl.ds(c * NT, NT)], COL) for c in range(C)]
                # this consumer's first block of the segment (default schedule: base 0)
                i0 = first_of(w, blk0, base) if FLAT else w

                def softmax_p(i, slot, s_all, ms, ls, ys, os_):
                    """Block i's masked scores -> new (m, l, y), O rescaled if a reference moved, and
                    P s_v stored over the slot's qs (the score MMA has finished reading it)."""
                    blk = blk0 + i
                    sv = [_load(sv_s.at[slot, pl.ds(mt * MT, MT)], ROW).astype(f32) * kfac for mt in range(MTK)]
                    zv = [_load(zv_s.at[slot, pl.ds(mt * MT, MT)], ROW).astype(f32) for mt in range(MTK)]
                    if target:
                        zv = [z - s * 8.0 for z, s in zip(zv, sv)]  # min - s/2 with sv = s/16
                    s_by_c, vis_by_c = [], []
                    for c in range(C):  # the live columns of each tile (`live_cols`)
                        nl = LIVE[c]
                        bias = _load(bias_s.at[slot, pl.ds(c * NT, nl)], COL)
                        tiles = [s_all[mt * C + c] for mt in range(MTK)]
                        if st.pipeline and nl < NT and not interp:
                            # every accumulator register used here, the unread columns too: with half of
                            # them dead, ptxas serialized the pipelined wgmmas (C7511; H200 2026-11-29,
                            # block loop 605 -> 484 instructions, batch 1 / 128k 66.5 -> 49.3 us)
                            tiles = [_wg_keep(x) for x in tiles]
                        s_t = [lv(x, c) + bcast_col(bias, (MT, nl)) for x in tiles]
                        vis = None
                        if st.window is not None:
                            vis = [bcast_col(lv(pos_c[c], c), (MT, nl)) - (blk * G + mt * MT + tok_rows[nl]) < st.window
                                   for mt in range(MTK)]
                            s_t = [jnp.where(v, s, NEG) for s, v in zip(s_t, vis)]
                        s_by_c.append(s_t)
                        vis_by_c.append(vis)
                    if st.diag in ("nosoftmax", "noconv_nosoftmax"):  # timing diagnostic: P = the scores
                        any_positive([s for s_t in s_by_c for s in s_t])  # (the barrier before the P stores)
                        for c in range(C):
                            for mt in range(MTK):
                                pp = s_by_c[c][mt].astype(f16)
                                qp_s[slot, c, pl.ds(mt * MT, MT)] = pp if LIVE[c] == NT else with_lv(zeros_p(), pp, c)
                        plgpu.commit_smem()
                        return ms, ls, ys, os_
                    live_ms, live_alphas, flag = lazy_reference(s_by_c, [lv(m, c) for c, m in enumerate(ms)])
                    alphas = [a if LIVE[c] == NT else with_lv(ones_c(), a, c) for c, a in enumerate(live_alphas)]
                    ls, ys, os_ = rescaled(flag, alphas, ls, ys, os_)
                    new_ls, new_ys = [], []
                    for c in range(C):
                        nl = LIVE[c]
                        pr = [jnp.exp2(s - bcast_col(live_ms[c], (MT, nl))) for s in s_by_c[c]]
                        if vis_by_c[c] is not None:
                            pr = [jnp.where(v, x, 0.0) for x, v in zip(pr, vis_by_c[c])]
                        pp = [(pr[mt] * bcast_row(sv[mt], (MT, nl))).astype(f16) for mt in range(MTK)]
                        y = lv(ys[c], c)
                        for mt in range(MTK):
                            tok_off = jnp.where(mt * MT + tok_rows[nl] < Gh, off_lo, off_hi)
                            y = y + pr[mt] * bcast_row(zv[mt], (MT, nl)) - tok_off * pp[mt].astype(f32)
                            # (the dead columns' P: zero, so their O^T columns stay finite)
                            qp_s[slot, c, pl.ds(mt * MT, MT)] = pp[mt] if nl == NT else with_lv(zeros_p(), pp[mt], c)
                        new_ls.append(with_lv(ls[c], lv(ls[c], c) + functools.reduce(jnp.add, pr), c))
                        new_ys.append(with_lv(ys[c], y, c))
                    if st.diag not in ("nocommit", "nobars"):  # timing diagnostic: the P stores unpublished (a race)
                        plgpu.commit_smem()
                    new_ms = tuple(with_lv(m, live_ms[c], c) for c, m in enumerate(ms))
                    return new_ms, tuple(new_ls), tuple(new_ys), os_

                # Slots: consumer w's j-th block (i = w + NC j) sits in slot w + NC (j % S2). With
                # `static_slots` the loops below are unrolled over the S2 slots, so that every shared-
                # memory address of a step is a compile-time offset (a runtime slot costs ~1150 address
                # and uniform-register instructions per block, ncu 2026-11-26); the last < S2 steps run
                # with a runtime slot. Interpret mode: slot = block (see SLOTS).
                def slot_at(i, u):  # the slot of the segment's block i = i0 + NC j, u = j % S2 (static) or None
                    if seq:
                        return base + i
                    if u is not None and not FLAT:  # (base 0, i0 = w)
                        return w + NC * u
                    if GEO:
                        return geo_slot(cnts, w, lax.div(i - i0, NC))[0]
                    return lax.rem(base + i, S)

                def unrolled(steps, body, carry):
                    """carry after body(j, carry, u) for j in [0, steps), u = j % S2 static for all
                    but the last steps % S2 steps (u = None there); the same steps in the same order."""
                    if not st.static_slots:
                        return lax.fori_loop(0, steps, lambda j, c: body(j, c, None), carry)

                    def group(k, c):
                        for u in range(S2):
                            c = body(k * S2 + u, c, u)
                        return c
                    full_groups = steps // S2
                    carry = lax.fori_loop(0, full_groups, group, carry)
                    return lax.fori_loop(full_groups * S2, steps, lambda j, c: body(j, c, None), carry)

                def quant_body(j, carry, u):
                    """Block w + NC j, one after the other: K, scores, softmax, values, release."""
                    with scope("c_blk"):
                        return quant_block(j, carry, u)

                def quant_block(j, carry, u):
                    ms, ls, ys, os_ = carry
                    i = i0 + NC * j
                    slot = slot_at(i, u)
                    if stream_only:  # timing diagnostic: the pipeline alone
                        if not seq:
                            plgpu.barrier_wait(full.at[slot])
                        plgpu.barrier_wait(prepped.at[slot])
                        plgpu.barrier_arrive(consumed.at[slot])
                        return carry
                    a_k = k_tiles(slot)
                    s_all = scores(a_k, qs_refs(slot))
                    if st.diag == "scores_only":  # timing diagnostic: the scores kept (one add), nothing after
                        plgpu.barrier_arrive(consumed.at[slot])
                        return ms, ls, tuple(y + s_all[c] for c, y in enumerate(ys)), os_
                    return finish_block(i, slot, carry, s_all)

                def finish_block(i, slot, carry, s_all):
                    """Block i (in `slot`) from its scores on: softmax, P, value MMA, release."""
                    ms, ls, ys, os_ = softmax_p(i, slot, s_all, *carry)
                    if st.diag == "no_values":  # timing diagnostic: no value MMA (nor its V conversion)
                        plgpu.barrier_arrive(consumed.at[slot])
                        return ms, ls, ys, os_
                    new_os = values(os_, v_tiles(slot), p_ref(slot), av_s)
                    plgpu.barrier_arrive(consumed.at[slot])
                    return ms, ls, ys, new_os

                def values_then_scores(os_, slot, slot2):
                    """Software pipelining: the value MMA of the block in `slot` is issued, then (while
                    the tensor cores run it) the consumer's next block's slot2 is awaited, its K
                    converted and its score MMA issued; one wait for both. The same MMAs on the same
                    operands as `quant_body`, in the same accumulation order, so the same bits; only
                    their overlap changes."""
                    if not reg_a:  # the twin: the same steps, one after the other
                        new_os = values(os_, v_tiles(slot), p_ref(slot), av_s)
                        return new_os, scores(k_tiles(slot2), qs_refs(slot2))
                    a_v = v_tiles(slot)

                    def run(accs):
                        o_accs, s_accs = accs[:MTV * C], accs[MTV * C:]
                        for mc in range(MTV):
                            a = a_v(mc)
                            for c in range(C):
                                plgpu.wgmma(o_accs[mc * C + c], a, p_ref(slot)(c))
                        a_k = k_tiles(slot2)
                        b_refs = qs_refs(slot2)
                        for ai, a in enumerate(a_k):
                            for c in range(C):
                                plgpu.wgmma(s_accs[ai * C + c], a, b_refs[c])

                    inits = tuple(plgpu.ACC.init(os_[c][mc]) for mc in range(MTV) for c in range(C))
                    inits += tuple(plgpu.ACC.init(zeros_t()) for _ in range(MTK * C))
                    flat = pl.run_state(run)(inits)
                    new_os = tuple(tuple(flat[mc * C + c] for mc in range(MTV)) for c in range(C))
                    return new_os, list(flat[MTV * C:])

                def pipelined_body(j, carry, u):
                    """Block i = w + NC j with its scores computed; ends with block i + NC's scores."""
                    ms, ls, ys, os_, s_all = carry
                    i = i0 + NC * j
                    slot = slot_at(i, u)
                    slot2 = slot_at(i + NC, None if u is None else (u + 1) % S2)
                    ms, ls, ys, os_ = softmax_p(i, slot, s_all, ms, ls, ys, os_)
                    os_, s_next = values_then_scores(os_, slot, slot2)
                    plgpu.barrier_arrive(consumed.at[slot])
                    return ms, ls, ys, os_, tuple(s_next)

                init = (tuple(neg_c() for _ in range(C)), tuple(zeros_t() for _ in range(C)),
                        tuple(zeros_t() for _ in range(C)),
                        tuple(tuple(zeros_t() for _ in range(MTV)) for _ in range(C)))
                nq = (n - i0 + NC - 1) // NC  # this consumer's blocks (i0 < NC, so the numerator is >= 0)
                if st.pipeline and not stream_only:
                    def first_last(carry):
                        slot = slot_at(i0, 0)
                        s0 = tuple(scores(k_tiles(slot), qs_refs(slot)))
                        ms, ls, ys, os_, s_all = unrolled(nq - 1, pipelined_body, (*carry, s0))
                        # the last block: no next scores to issue
                        last = i0 + NC * (nq - 1)
                        return finish_block(last, slot_at(last, None), (ms, ls, ys, os_), s_all)

                    carry = lax.cond(nq > 0, first_last, lambda carry: carry, init)
                else:
                    carry = unrolled(nq, quant_body, init)
                # the rest of the segment's numbers, derived now rather than held through the loop
                post = segment(k) if FLAT else seg0
                b, h, nrt, r0, rstride, ring_owner, q_len, fp_start = (
                    post[f] for f in ("b", "h", "nrt", "r0", "rstride", "ring_owner", "q_len", "fp_start"))

                # ------------------------------------------------------------------- FP ring
                # Operands in float16 (bf16 -> f16 is exact in float16's normal range, which the
                # float16 scales already assume). B operands in this consumer's own slots, free now:
                # the query in slot w, the P of the current tile in slot w + NC. (Balanced schedule:
                # in its own buffers, as the stream has moved on to the next segment's blocks.)
                if FLAT:
                    ring_q = lambda c, rows: rq_s.at[w, 0, c, pl.ds(0, rows)]  # noqa: E731
                    ring_p = lambda c, rows: rq_s.at[w, 1, c, pl.ds(0, rows)]  # noqa: E731
                else:
                    ring_q = lambda c, rows: qp_s.at[w, c, pl.ds(0, rows)]  # noqa: E731
                    ring_p = lambda c, rows: qp_s.at[w + NC, c, pl.ds(0, rows)]  # noqa: E731
                if NRB == 4:  # tile k of the CTA's ring stream goes to consumer (k + ring_owner) % 2
                    # this consumer's first ring tile (default schedule: rbase 0)
                    k0 = lax.rem(w - ring_owner - lax.rem(rbase, 2) + 4, 2) if FLAT else lax.rem(w - ring_owner + 2, 2)
                    nr = (nrt - k0 + 1) // 2
                else:
                    k0 = 0
                    nr = jnp.where(w == ring_owner, nrt, 0)

                @pl.when(nr > 0)
                def _():
                    for c in range(C):
                        ring_q(c, D)[...] = (q_tile(qb, c) * QSCALE).astype(f16)
                    plgpu.commit_smem()

                slot_row = _iota((MT, NT), 0)

                def ring_body(j, carry):
                    ms, ls, ys, os_ = carry
                    k = k0 + 2 * j if NRB == 4 else j
                    t = r0 + k * rstride
                    s0 = ring_start(t)
                    kslot = ring_item_slot(2 * (rbase + k), ring_owner)
                    vslot = ring_item_slot(2 * (rbase + k) + 1, ring_owner)
                    if stream_only:  # timing diagnostic: the pipeline alone
                        for sl in (kslot, vslot):
                            plgpu.barrier_wait(rfull.at[sl])
                            plgpu.barrier_arrive(rconsumed.at[sl])
                        return carry
                    plgpu.barrier_wait(rfull.at[kslot])
                    if reg_a:
                        a_k = [_load(kr_s.at[kslot], plgpu.Layout.WGMMA).astype(f16)]
                    else:
                        a_k = [kr_s[kslot].astype(f16)]
                    if NRB == 1:  # K is in registers (or the twin's copy): the buffer can take V
                        plgpu.barrier_arrive(rconsumed.at[kslot])
                    s_all = scores(a_k, [ring_q(c, D) for c in range(C)])
                    if NRB > 1:
                        plgpu.barrier_arrive(rconsumed.at[kslot])
                    slot_idx = s0 + slot_row
                    jlog = lax.rem(slot_idx - fp_start + R, R)  # logical ring index
                    kpos = q_len + jlog
                    fresh = slot_idx >= t * RT  # not already covered by the previous tile
                    s_by_c, vis_by_c = [], []
                    for c in range(C):
                        qpos = bcast_col(pos_c[c], (MT, NT))
                        vis = (kpos <= qpos) & fresh
                        if st.window is not None:
                            vis = vis & (qpos - kpos < st.window)
                        s_by_c.append([jnp.where(vis, s_all[c], NEG)])
                        vis_by_c.append(vis)
                    new_ms, alphas, flag = lazy_reference(s_by_c, ms)
                    ls, ys, os_ = rescaled(flag, alphas, ls, ys, os_)
                    new_ls = []
                    for c in range(C):
                        pr = jnp.where(vis_by_c[c], jnp.exp2(s_by_c[c][0] - bcast_col(new_ms[c], (MT, NT))), 0.0)
                        ring_p(c, RT)[...] = pr.astype(f16)
                        new_ls.append(ls[c] + pr)
                    plgpu.commit_smem()
                    plgpu.barrier_wait(rfull.at[vslot])

                    def a_v(mc):
                        vt = kr_s.at[vslot, :, pl.ds(mc * MT, MT)]  # [slots, 64 channels] -> V^T [64, slots]
                        if reg_a:
                            return plgpu.layout_cast(_load(mg.transpose_ref(vt), plgpu.Layout.WGMMA_TRANSPOSED),
                                                     plgpu.Layout.WGMMA).astype(f16)
                        return vt[...].T.astype(f16)

                    new_os = values(os_, a_v, lambda c: ring_p(c, RT), at_s)
                    plgpu.barrier_arrive(rconsumed.at[vslot])
                    return tuple(new_ms), tuple(new_ls), ys, new_os

                def ring_tile(j, carry):
                    with scope("c_ring"):
                        return ring_body(j, carry)

                ms, ls, ys, os_ = lax.fori_loop(0, nr, ring_tile, carry)
                with scope("c_end"):
                    segment_end(ms, ls, ys, os_, b, h, qb, sg)
                return carry_

            def pair_merge_in_kernel(b, h):
                """The CTA's partial is stored: count it on the pair's counter; the last of the pair's NP CTAs
                to arrive merges their partials in `mosaic_gpu.merge_tree`'s order (pairwise, `combine`),
                writes the normalized output rows and leaves the counter at zero for the next call."""
                idx = b * st.H + h
                if seq:  # interpret mode: the CTAs run one after another
                    old = ctr_ref[idx].astype(jnp.int32)
                    ctr_ref[idx] = (old + 1).astype(jnp.uint32)
                else:
                    with scope("c_arr"):
                        plgpu.commit_smem()  # warpgroup barrier: every thread's partial stores precede the release
                        _common.ptx(_ARRIVE_OLD_ASM, ctr_ref.at[pl.ds(idx, 1)], km_s, shared=(1,))
                        plgpu.commit_smem()  # every thread reads what thread 0 stored
                        old = km_s[0]

                def last_merge():
                    if not seq:
                        _common.ptx(_ACQUIRE_ASM)  # every thread: the other CTAs' partials are visible

                    def leaf(j, c):
                        cols_ = pl.ds(c * NT, NT)
                        return (_load_gmem(ml_ref.at[b, h, j, 0, cols_], COL),
                                _load_gmem(ml_ref.at[b, h, j, MT // 2, cols_], COL),
                                [_load_gmem(o_ref.at[b, h, j, pl.ds(mc * MT, MT), cols_], plgpu.Layout.WGMMA)
                                 for mc in range(MTV)])

                    def evaluate(node, c):  # (ptxas hoists the leaves' loads ahead of the combines itself)
                        if isinstance(node, int):
                            return leaf(node, c)
                        return combine(evaluate(node[0], c), evaluate(node[1], c))

                    tree = mg.merge_tree(st.NP)
                    hq, n_real = st.H * st.n_rep, st.n_rep * st.tokens
                    for c in range(C):
                        _, l_tot, o_tot = evaluate(tree, c)
                        inv = bcast_col(1.0 / jnp.where(l_tot > 0, l_tot, 1.0), (MT, NT))
                        for mc in range(MTV):
                            store_out(o_tot[mc] * inv, b, h, c, mc, hq, n_real)
                    if seq:
                        ctr_ref[idx] = jnp.uint32(0)
                    else:
                        _common.ptx(_RESET_ASM, ctr_ref.at[pl.ds(idx, 1)])

                @pl.when(old == st.NP - 1)
                def _():
                    with scope("c_km"):
                        last_merge()

            def store_out(y, b, h, c, mc, hq, n_real):
                """y: O^T [64 channels, NT columns] of column tile c, channel tile mc -> out rows (b T + t) Hq
                + h n_rep + r for column n = t n_rep + r < n_real (the rest are padding columns)."""
                if seq:
                    for n in range(NT):
                        gn = c * NT + n
                        if gn >= n_real:
                            break
                        t, r = divmod(gn, st.n_rep)
                        row = (b * st.tokens + t) * hq + h * st.n_rep + r
                        out_ref[pl.ds(row, 1), pl.ds(mc * MT, MT)] = y[:, n][None].astype(out_ref.dtype)
                    return
                gn = _iota((MT, NT), 1) + c * NT
                t = lax.div(gn, i32(st.n_rep))
                rows = (b * st.tokens + t) * hq + h * st.n_rep + (gn - t * st.n_rep)
                cols_ = _iota((MT, NT), 0) + mc * MT
                _common.tile_access(NT, True)(y, rows, cols_, (gn < n_real).astype(i32), out_ref)

            def segment_end(ms, ls, ys, os_, b, h, qb, sg):
                """This consumer's partial of the segment: its column sums, then its store (or, with the pair
                merge, its hand-over to the CTA's last consumer, which merges and stores)."""
                row = _iota((MT, NT), 0)
                parts = []  # per column tile: (m [NT], l [NT], O^T tiles [MTV][64, NT]) of this consumer
                for c in range(C):
                    y = colreduce(ys[c], red, "add")
                    l = colreduce(ls[c], red, "add")
                    parts.append((ms[c], l, [os_[c][mc] + bcast_col(y, (MT, NT)) for mc in range(MTV)]))

                def store(pi, c, part):
                    m, l, o_tiles = part
                    for mc in range(MTV):
                        if KM:  # O^T as accumulated [D, CN]: the kernel's own merge reads it back
                            o_ref[b, h, pi, pl.ds(mc * MT, MT), pl.ds(c * NT, NT)] = o_tiles[mc]
                        else:
                            mg.store_transposed(o_ref.at[b, h, pi, pl.ds(c * NT, NT), pl.ds(mc * MT, MT)],
                                                o_tiles[mc], interp)
                    ml_ref[b, h, pi, :, pl.ds(c * NT, NT)] = jnp.where(row < MT // 2, bcast_col(m, (MT, NT)),
                                                                       bcast_col(l, (MT, NT)))

                if not st.pair_merge:
                    for c in range(C):
                        store(sg["j_out"] * NC + w, c, parts[c])
                    if FLAT:  # the pair's last CTA: its slots after this one are neutral (m NEG, l 0, O 0)
                        empty = (neg_c(), _cast(jnp.zeros((NT,), f32), COL), [zeros_t() for _ in range(MTV)])
                        for jj in range(1, st.flat_cap + 1):
                            @_when(sg["last"] & (jj > sg["j_out"]))
                            def _():
                                for c in range(C):
                                    store(jj * NC + w, c, empty)
                        if not seq:
                            plgpu.barrier_arrive(qfree.at[qb])  # done with the segment's query and positions
                    return
                xo_ref, xml_ref = x_refs  # [B, H, NP (NC-1), D, CN], [B, H, NP (NC-1), 64, CN] float32

                @_when(w < NC - 1)
                def _():  # leave this partial for the last consumer (O^T as accumulated), then signal
                    xi = p * (NC - 1) + w
                    for c, (m, l, o_tiles) in enumerate(parts):
                        for mc in range(MTV):
                            xo_ref[b, h, xi, pl.ds(mc * MT, MT), pl.ds(c * NT, NT)] = o_tiles[mc]
                        xml_ref[b, h, xi, :, pl.ds(c * NT, NT)] = jnp.where(row < MT // 2, bcast_col(m, (MT, NT)),
                                                                            bcast_col(l, (MT, NT)))
                    if not seq:
                        plgpu.commit_smem()  # warpgroup barrier: every thread's stores precede the arrival
                    plgpu.barrier_arrive(pdone.at[0])

                @_when(w == NC - 1)
                def _():  # merge the CTA's partials in consumer order, pairwise (`merge_heads`' combine)
                    plgpu.barrier_wait(pdone.at[0])
                    for c in range(C):
                        cols = pl.ds(c * NT, NT)
                        acc = None
                        for v in range(NC - 1):
                            xi = p * (NC - 1) + v
                            other = (_load_gmem(xml_ref.at[b, h, xi, 0, cols], COL),
                                     _load_gmem(xml_ref.at[b, h, xi, MT // 2, cols], COL),
                                     [_load_gmem(xo_ref.at[b, h, xi, pl.ds(mc * MT, MT), cols], plgpu.Layout.WGMMA)
                                      for mc in range(MTV)])
                            acc = other if acc is None else combine(acc, other)
                        store(p, c, combine(acc, parts[c]))
                    if KM:
                        pair_merge_in_kernel(b, h)

            walk(seg_consume, i32(0))

        if seq:
            role_tma()
            for r in range(NPREP):
                role_prep(r)
            for w in range(NC):
                role_consumer(w)
        else:
            wg = lax.axis_index("wg")
            pl.when(wg == WG_TMA)(role_tma)
            pl.when((wg >= WG_PREP) & (wg < WG_TMA))(lambda: role_prep(wg - WG_PREP))
            pl.when(wg < NC)(lambda: role_consumer(wg))

    sd = st.scale_dtype
    fp_item = jnp.dtype(st.fp_dtype).itemsize
    tw = None if reg_a else plgpu.SMEM  # the twin's operand tiles (interpret mode only)
    scratch = dict(
        q_s=plgpu.SMEM((D, CN) if QB == 1 else (QB, D, CN), jnp.bfloat16, transforms=mg.swizzle_transforms(NT * 2, 2)),
        pos_s=plgpu.SMEM((mg.pos_width(CN),) if QB == 1 else (QB, mg.pos_width(CN)), jnp.int32),
        k_s=plgpu.SMEM((SLOTS, n_planes, G, Dh), jnp.uint8, transforms=mg.swizzle_transforms(Dh, 1)),
        v_s=plgpu.SMEM((SLOTS, n_planes, D, Gh), jnp.uint8, transforms=mg.swizzle_transforms(Gh, 1)),
        sk_s=plgpu.SMEM((SLOTS, D), sd), zk_s=plgpu.SMEM((SLOTS, D), sd),
        sv_s=plgpu.SMEM((SLOTS, G), sd), zv_s=plgpu.SMEM((SLOTS, G), sd),
        qp_s=plgpu.SMEM((SLOTS, C, QP, NT), f16, transforms=mg.swizzle_transforms(NT * 2, 2)),
        bias_s=plgpu.SMEM((SLOTS, CN), f32),
        kr_s=plgpu.SMEM((RSLOTS, RT, D), st.fp_dtype, transforms=mg.swizzle_transforms(D * fp_item, fp_item)),
        rq_s=plgpu.SMEM((NC, 2, C, QP, NT), f16, transforms=mg.swizzle_transforms(NT * 2, 2)) if FLAT else None,
        red_s=plgpu.SMEM((red_rows(NC, NPREP), RED_ELEMS), f32),
        ak_s=None if tw is None else tw((NC, MT, D), f16, transforms=mg.swizzle_transforms(D * 2, 2)),
        av_s=None if tw is None else tw((NC, MT, G), f16, transforms=mg.swizzle_transforms(G * 2, 2)),
        at_s=None if tw is None else tw((NC, MT, RT), f16, transforms=mg.swizzle_transforms(RT * 2, 2)),
        qbar=plgpu.Barrier(num_arrivals=2, num_barriers=QB),
        # balanced schedule: a segment's query buffer is free once every prep and consumer warpgroup is done
        qfree=plgpu.Barrier(num_arrivals=NC + NPREP, num_barriers=QB) if FLAT and not seq else None,
        full=plgpu.Barrier(num_arrivals=2 * n_planes + (0 if st.diag == "stream_planes" else 4), num_barriers=SLOTS),
        prepped=plgpu.Barrier(num_arrivals=1, num_barriers=SLOTS),
        consumed=plgpu.Barrier(num_arrivals=1, num_barriers=SLOTS),
        rfull=plgpu.Barrier(num_arrivals=1, num_barriers=RSLOTS),
        rconsumed=plgpu.Barrier(num_arrivals=1, num_barriers=RSLOTS),
        pdone=plgpu.Barrier(num_arrivals=NC - 1, num_barriers=1) if st.pair_merge else None,
        km_s=plgpu.SMEM((1,), jnp.int32) if KM and not seq else None,  # the counter's old value, for the warpgroup
    )
    live = {k: v for k, v in scratch.items() if v is not None}

    def entry(*args, **refs):
        kernel(*args, **{k: refs.get(k) for k in scratch})

    if FLAT:
        NPP = (st.flat_cap + 1) * NC
    else:
        NPP = st.NP if st.pair_merge else st.NP * NC  # partials per (row, KV head)
    # the partials: O transposed [CN, D] for `merge_heads`, or O^T [D, CN] for the kernel's own merge
    out_type = (jax.ShapeDtypeStruct((st.B, st.H, NPP, D, CN) if KM else (st.B, st.H, NPP, CN, D), jnp.float32),
                jax.ShapeDtypeStruct((st.B, st.H, NPP, MT, CN), jnp.float32))
    if st.pair_merge:  # consumers 0 .. NC-2 of each CTA leave their partials here for the last one
        out_type += (jax.ShapeDtypeStruct((st.B, st.H, st.NP * (NC - 1), D, CN), jnp.float32),
                     jax.ShapeDtypeStruct((st.B, st.H, st.NP * (NC - 1), MT, CN), jnp.float32))
    if KM:  # the merged output, rows (b T + t) Hq + h n_rep + r
        out_type += (jax.ShapeDtypeStruct((st.B * st.tokens * st.H * st.n_rep, D), st.out_dtype),)
    kw = {}
    if interp:
        params = getattr(plgpu, "InterpretGPUParams", None)  # public from jax 0.11
        if params is None:
            from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
        kw["interpret"] = params()
    mesh_kw = dict(grid=(st.flat_ctas, 1, 1) if FLAT else (st.NP, st.H, st.B), grid_names=("p", "h", "b"),
                   num_threads=None if seq else NC + NPREP + 1, thread_name=None if seq else "wg",
                   kernel_name=f"quantspec_{st.view}_mgpu_ws")
    params = plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=reg_a,
                                  **(dict(profile_space=st.profile_space, profile_dir=st.profile_dir)
                                     if st.profile_dir else {}))
    if not KM:
        return plgpu.kernel(entry, out_type=out_type, scratch_types=live, compiler_params=params, **mesh_kw, **kw)

    # The counters are a ref operand (written in place, left at zero): pl.kernel over a plgpu.Mesh, as
    # plgpu.kernel does inside (its vmap wrapper takes no refs).
    def body(*refs):
        pl.run_scoped(functools.partial(entry, *refs), collective_axes=mesh_kw["thread_name"] or (), **live)

    return pl.kernel(body, out_type=out_type, mesh=plgpu.Mesh(**mesh_kw), compiler_params=params,
                     interpret=kw.get("interpret", False), name=mesh_kw["kernel_name"])


def pair_merge_default(np_: int, asked: bool | None) -> bool:
    """Whether the last consumer of each CTA merges the CTA's partials: as asked, else from
    PAIR_MERGE_MIN_CTAS CTAs per (row, KV head) up. NP depends on the geometry only, so every T of a
    cache makes the same choice (T-invariance)."""
    return bool(asked) if asked is not None else np_ >= PAIR_MERGE_MIN_CTAS


KERNEL_MERGE_ENV = "QSPEC_MGPU_KERNEL_MERGE"  # "1" / "0": the split merge inside the kernel (row split)
PDL_ENV = "QSPEC_MGPU_PDL"  # "1" / "0": programmatic dependent launch of the attention kernel


def pdl_of(config: Any, interpret: bool) -> bool:
    """Whether a call launches as a programmatic dependent (`MgpuConfig.ws_pdl`, else $QSPEC_MGPU_PDL,
    else off); never in interpret mode (no grid dependencies there). Same bits either way."""
    asked = getattr(config, "ws_pdl", None)
    if asked is None:
        asked = bool(env_flag(PDL_ENV))
    return bool(asked) and not interpret


def kernel_merge_of(config: Any, flat: bool) -> bool:
    """Whether a call merges its splits inside the kernel (`MgpuConfig.ws_kernel_merge`, else
    $QSPEC_MGPU_KERNEL_MERGE, else off): the row split only (the balanced schedule's pairs span a
    varying number of CTAs; asking for both is an error). From the config and the environment, never
    from T: the verify and the autoregressive pass it is compared with merge the same way."""
    asked = getattr(config, "ws_kernel_merge", None)
    if asked is None:
        asked = bool(env_flag(KERNEL_MERGE_ENV)) and not flat
    if asked and flat:
        raise ValueError("ws_kernel_merge: the in-kernel split merge runs on the row split (ws_flat=False) only")
    return bool(asked)


PREP_Q_REGS_ENV = "QSPEC_MGPU_PREP_QREGS"  # "1" / "0": the prep's query in registers or not (A/B runs)
# The prep's query registers per thread the default allows (D x C NT / 128 float32): the draft's C = 1 at
# D = 128 is 16; the verify view's wider calls would crowd the prep's 56 registers.
PREP_Q_REGS_MAX = 16


def prep_q_regs_of(config: Any, D: int, C: int, view: str = "draft", flat: bool = False) -> bool:
    """Whether the prep warpgroup loads a segment's query tiles into registers once, rather than
    from shared memory for every block: `config.ws_prep_q_regs`, else $QSPEC_MGPU_PREP_QREGS, else
    on for the draft view's row split (H200 2026-11-29, 8B batch 1 / 128k: 56.2 -> 54.9 us; at batch
    8 and in the balanced schedule within +-1%); in every case only where they fit in
    PREP_Q_REGS_MAX registers per thread (D C NT / 128). The operands' values are the same either
    way (only where they are read from changes), so a choice that depends on C (i.e. on T) keeps
    T-invariance."""
    asked = getattr(config, "ws_prep_q_regs", None)
    if asked is None:
        v = env_flag(PREP_Q_REGS_ENV)
        asked = v if v is not None else (view == "draft" and not flat)
    return bool(asked) and D * C * NT // 128 <= PREP_Q_REGS_MAX


PREP_PAIRS_ENV = "QSPEC_MGPU_PREP_PAIRS"  # "1" / "0": the balanced schedule's prep two blocks per pass or not


def prep_pairs_of(config: Any, flat: bool, preps: int, live: tuple[int, ...], no_prep_work: bool = False) -> bool:
    """Whether the prep warpgroup prepares two blocks per pass: `config.ws_prep_pairs`, else
    $QSPEC_MGPU_PREP_PAIRS, else off; only in the balanced schedule (the draft view, whose calls all have
    T = 1) with one prep warpgroup and one column tile whose live columns are at most half of it (both
    blocks' bias terms in one column sum of the tile's width), and not in the diagnostics without the
    prep's bias sum (`no_prep_work`).
    Same bits as one block per pass (H200). Measured (H200 2026-12-01, SmolLM2 batch 32 / 8k, kernel
    alone, uniform / ragged rows): with the default two consumers 34.1 / 28.4 -> 34.8 / 29.0 us (the
    consumers pace the kernel); with three consumers and 9 stages 35.5 / 29.8 -> 32.0 / 27.2 (there the
    prep paced it), but three consumers' 1.5x partials cost the XLA merge more than the kernel saves
    (docs/kernel_notes.md, twenty-eighth session): off until the balanced schedule merges in the CTA."""
    asked = getattr(config, "ws_prep_pairs", None)
    if asked is None:
        asked = bool(env_flag(PREP_PAIRS_ENV))
    return bool(asked) and flat and preps == 1 and len(live) == 1 and 2 * live[0] <= NT and not no_prep_work


LIVE_COLS_ENV = "QSPEC_MGPU_LIVE_COLS"  # "0": whole tiles where the live columns are the default (A/B runs)


def live_of(config: Any, cols: int | None, C: int) -> tuple[int, ...]:
    """`_WsStatic.live` of a call with `cols` query columns (n_rep T; None: all C NT): `live_cols`
    unless `config.ws_live_cols` or $QSPEC_MGPU_LIVE_COLS=0 turns it off; () (every column of every
    tile) then. A real column is computed by the same instructions at every T (its tile's live width
    may change with T: the bias is summed over the whole tile, see `_build_ws`), so T-invariance
    holds. Measured (H200 2026-11-29, docs/kernel_notes.md, fourteenth and fifteenth sessions): the
    verify view at 8B batch 8 / 32k, T 5, 182-186 -> 170-171 us; the draft view, once its pipelined
    consumer reads every accumulator register (`_wg_keep`), 8B batch 1 / 128k 54.9 -> 49.3 us."""
    asked = getattr(config, "ws_live_cols", None)
    if asked is None:
        asked = env_flag(LIVE_COLS_ENV) is not False
    if not asked or cols is None:
        return ()
    if not 0 < cols <= C * NT:
        raise ValueError(f"cols={cols}: expected 1 .. {C * NT} query columns for {C} column tiles")
    return live_cols(cols, C)


def static_config(B: int, H: int, D: int, G: int, R: int, S_max: int, C: int, c_max: int, view: str,
                  window: int | None, register_a: bool, interpret: bool, scale_dtype: Any, fp_dtype: Any,
                  config: Any, cols: int | None = None, n_rep: int = 0, tokens: int = 0,
                  out_dtype: Any = jnp.bfloat16) -> _WsStatic:
    """The kernel's static parameters for a call with C column tiles. Stages and ring buffers are
    sized for c_max >= C, the column tiles of the widest call of this cache (T = gamma_max + 1), so
    that every T runs the same schedule (they change the ring's consumer and order). Raises if
    c_max tiles cannot fit in shared memory. `cols`: the call's query columns (n_rep T), for the
    live columns of its last tile (`live_of`); n_rep, tokens and out_dtype: where the in-kernel
    merge (`kernel_merge_of`) writes the output."""
    if not C <= c_max:
        raise ValueError(f"C={C} column tiles > c_max={c_max}")
    n_blocks = max(1, S_max // G)
    flat = flat_of(config, view, B)
    geo = flat and view == "target"  # the target view's balanced schedule: shares by the geometry (`geo_work`)
    np_ = config.num_splits or env_splits() or default_ctas(B, H, n_blocks, view)
    # Software-pipelined consumers (a block's value MMA overlapping the next block's K conversion
    # and score MMA) by default for the draft view only: the verify kernel's two planes and wider
    # accumulators run out of registers (ptxas serializes its wgmmas; H100 run 2026-11-26: 128 vs
    # 106 us at 128k, T = 5). A pipelined consumer holds both of its slots at once, so it gets three
    # (6 stages) where they fit: with 4 it was slower than unpipelined (67 vs 59 us), with 6 faster (56.5).
    nc, npr = consumers_of(config, view, flat, -(-n_blocks // np_)), config.ws_preps or 1
    if (nc, npr) not in REGS:
        raise ValueError(f"ws_consumers={nc}, ws_preps={npr}: the warp-specialized schedule has (consumers, preps) "
                         f"in {sorted(REGS)}")
    # Not in the balanced schedule, whose consumers switch segments: there one block after the other is
    # faster with the live columns (H200 2026-11-29, 8B batch 8 / 32k: 103.9 -> 94.3 us on rows at
    # 32k, 82.4 -> 73.8 on 16k-32k; SmolLM2 batch 32 / 8k 34.5 -> 33.8). The row split of two
    # consumers keeps it (batch 1 / 128k: 49.3 pipelined, 50.6 not); its default now is three
    # unpipelined consumers (47.1, `consumers_of`).
    kmerge = kernel_merge_of(config, flat)
    pipeline = config.ws_pipeline if config.ws_pipeline is not None else (view == "draft" and nc == 2 and not flat)
    if geo and (pipeline or npr > 1 or config.ws_prep_pairs):
        raise ValueError("ws_flat, target view: the geometric balanced schedule runs unpipelined consumers, one prep "
                         "warpgroup and one block per prep pass (no ws_pipeline, ws_preps > 1 or ws_prep_pairs)")
    # (the draft's balanced schedule: its calls all have T = 1, sized for its C; the target view's: for c_max)
    plan = functools.partial(ring_plan, view, D, G, C if flat and not geo else c_max, scale_dtype=scale_dtype,
                             fp_dtype=fp_dtype, consumers=nc, preps=npr, flat=flat)
    no_prep_work = config.ws_diag in (*STREAM_DIAGS, "noprep", "nobias")
    pairs = prep_pairs_of(config, flat and not geo, npr, live_of(config, cols, C), no_prep_work)
    stages = config.stages
    if stages is None and nc == 3:  # two slots per consumer (three where the prep pairs keep up, see FLAT_WIDE_STAGES)
        stages = FLAT_WIDE_STAGES if flat and pairs and plan(FLAT_WIDE_STAGES) is not None else 6
    elif stages is None and pipeline:
        stages = 6 if plan(6) is not None else 4
    elif stages is None:
        stages = 6 if plan(6) == 4 else 4
    if stages < 2 * nc or stages % nc or stages % npr:
        raise ValueError(f"stages={stages}: the warp-specialized schedule with {nc} consumers and {npr} prep "
                         f"warpgroups needs a multiple of {math.lcm(nc, npr)} >= {2 * nc}")
    bufs = plan(stages)
    if bufs is None:
        raise ValueError(f"Mosaic GPU decode attention (ws): {view} D={D} G={G} with {c_max} column tiles, "
                         f"{stages} stages and {nc} consumers does not fit in {SMEM_BYTES} bytes of shared memory")
    regs = tuple(config.ws_regs) if config.ws_regs else REGS[nc, npr]
    pool = register_pool(nc, npr)
    if nc * regs[0] + npr * regs[1] + regs[2] > pool or min(regs) < 24 or any(r % 8 for r in regs):
        raise ValueError(f"ws_regs={regs}: with {nc} consumers and {npr} prep warpgroups, {nc} x consumers + {npr} x "
                         f"prep + TMA must be <= {pool} (the CTA's register pool), each a multiple of 8 >= 24")
    n_ring_tiles = -(-R // RT)
    flat_fields = {}
    if flat:
        if config.ws_static_slots or config.ws_pair_merge:
            raise ValueError("ws_flat: the balanced schedule runs with runtime slots and one partial per consumer "
                             "(no ws_static_slots, no ws_pair_merge)")
        f = flat_split(B, H, D, G, R, S_max, view, scale_dtype, fp_dtype, config.ws_flat_ctas)
        rw = f["ring_w"]
        # a share's bound (`flat_work`): blocks and segments (pairs overlapping it) of one CTA
        share = max(-(-(B * H * (n_blocks + rw)) // f["flat_ctas"]), -(-(n_blocks + rw) // f["flat_cap"]))
        segs = min(B * H, share // rw + 2)
        per, ring_tiles_per_cta = share, n_ring_tiles * segs
        flat_fields = dict(flat=True, seq_segs=segs, **f)
    else:
        per = -(-n_blocks // np_)
        ring_tiles_per_cta = -(-n_ring_tiles // np_)
    seq_slots = max(2 * nc, -(-per // nc) * nc)  # every block its slot; the ring's B operands in 2 per consumer
    seq_ring_slots = 2 * ring_tiles_per_cta
    return _WsStatic(view=view, B=B, H=H, D=D, G=G, R=R, C=C, NP=int(np_), stages=int(stages), ring_bufs=bufs,
                     seq_slots=seq_slots, seq_ring_slots=seq_ring_slots,
                     window=window, register_a=register_a, interpret=interpret, diag=config.ws_diag,
                     pipeline=bool(pipeline),
                     static_slots=bool(config.ws_static_slots), tma_warp=config.ws_tma_warp is not False,
                     consumers=nc, preps=npr,
                     pair_merge=not flat and (kmerge or pair_merge_default(np_, config.ws_pair_merge)),
                     kernel_merge=kmerge, pdl=pdl_of(config, interpret),
                     n_rep=n_rep if kmerge else 0, tokens=tokens if kmerge else 0,
                     out_dtype=jnp.dtype(out_dtype) if kmerge else None,
                     scale_dtype=jnp.dtype(scale_dtype), fp_dtype=jnp.dtype(fp_dtype), regs=regs,
                     prep_q_regs=prep_q_regs_of(config, D, C, view, flat), live=live_of(config, cols, C),
                     prep_pairs=pairs,
                     profile_dir=getattr(config, "ws_profile_dir", None),
                     profile_space=profile_space(per, ring_tiles_per_cta, flat_fields.get("seq_segs", 1)),
                     **flat_fields)


def build(st: _WsStatic):
    """The kernel for `st` (a `plgpu.kernel` callable; outputs the partials o, ml of
    `mosaic_gpu.merge_heads`, one per consumer warpgroup of each CTA)."""
    return _build_ws(st)
