"""Pallas Mosaic GPU (Hopper, sm_90) decode attention over the QuantSpec cache.

Two schedules of the same math (`MgpuConfig.schedule`, `resolve_schedule`): "ws", the default, the
warp-specialized kernel of `mosaic_gpu_ws` (TMA / prep / two consumer warpgroups per CTA,
issue 31), and "legacy", this module's `_build` (one warpgroup per program, issue 13), which the
docstring below describes; the wrapper, the code conversion and the merge are shared.

One launch per view plus an XLA merge of the split partials:

* ``view="draft"``: the INT4 view, upper nibble planes only;
* ``view="target"``: the INT8 view, both planes merged into one 8-bit code 16 U + L' per element
  (scale s/16, zero min - s/2; SPEC §2), so INT8 costs one conversion per element, not two.

Orientation (docs/kernel_notes.md, "Attention (Mosaic GPU, H200)"): the cache tokens are the
wgmma M dimension (64 per warpgroup instruction) and the query rows of one (batch row, KV head)
-- n_rep heads x T tokens -- are the N dimension, in column tiles of NT = 16:

    S^T [tokens, cols] = K [tokens, D] . (q s_k)^T [D, cols]          K from registers
    O^T [D, cols]     += V^T [D, tokens] . (p s_v)^T [tokens, cols]   V^T from registers

Keys are per channel per G-token block, so the key scale is folded into the query once per block
(the B operand ``qs``) and the key zero is a per-column bias; values are per token, so the value
scale is folded into the probabilities (the B operand ``p s_v``) and the value zero is a
per-column sum. Codes become float16 operands with the 0x6400 magic number (the float16 with bits
0x6400 | n is 1024 + n, n < 1024): 1024 + c for 8-bit codes and low nibbles, 64 + U for high
nibbles (0x5400 | U << 4); the constant offsets are removed through the same bias and sum,
computed from the same float16-rounded operands. The cache stores the planes so that a thread's
32-bit word turns into its operand registers with one or two integer instructions per two
elements and no shuffles (`quant.kernel_byte_order`; values transposed within a flushed block).
The bf16 FP ring is attended by the last programs of each (row, KV head) in the same launch
(64-slot tiles, bf16 operands) and merged with the quantized splits by log-sum-exp in XLA
(`merge_heads`, one fusion). Each program stores its O^T accumulator transposed, as O [cols, D]
(`store_transposed`), so the merge writes the output's [B, T, Hq, D] order directly.

Exactness (issue 11): tile sizes, the split count and boundaries, the ring partition and the merge
order depend on (B, Hkv, n_rep, D, G, S_max, R, view), never on T. T only changes how many
column tiles a program runs, each computed by the same instructions; columns never interact
(reductions run over tokens); masked entries contribute exact zeros; a block skipped by a
sliding window is one that every row of the launch masks completely, which is an exact no-op.

Testing: the register-operand path (codes converted in registers by ``inline_mgpu``) only runs on
a GPU. ``register_a=False`` selects its twin, which converts the same 32-bit words with the same
bit formulas in jnp, places them with the same register mapping, stores the operand tile to SMEM
and feeds wgmma from SMEM: GPU interpret mode on the CPU runs it (tests/test_attention_mgpu.py).
"""

from __future__ import annotations

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

from pallas_kernels._common import load_with_layout, num_sms

Array = jax.Array

MT = 64  # rows of one wgmma (tokens for S^T, channels for O^T)
NT = 16  # query columns per column tile (wgmma N); fixed, so T never changes the arithmetic
RING_TILE = 64  # ring slots per step
NEG = -1e30  # finite "minus infinity": exp2(NEG - m) == 0 and NEG - NEG == 0
BIG_POS = 2**30  # position of padding columns (they see everything; dropped by the merge)
LOG2E = 1.4426950408889634
MAGIC_LO = 0x64006400  # two float16 1024.0: | n (n < 1024) gives 1024 + n
MAGIC_HI = 0x54005400  # two float16 64.0: | (U << 4) gives 64 + U
OFF_LO, OFF_HI = 1024.0, 64.0
SUPPORTED_HEAD_DIMS = (64, 128)
VIEWS = ("draft", "target")
PROGRAMS_PER_SM = 2  # resident programs per SM (register-bound: ~200 registers x 128 threads)
SCHEDULES = ("legacy", "ws")
DEFAULT_SCHEDULE = "ws"  # checked and timed on the H200 (docs/kernel_notes.md, issue 31): 1.3-2x legacy
# The split merge (`merge_heads`): "global", each partial weighted by exp2(m_i - max_j m_j); "pairwise",
# flash-decoding's pairwise combine (each tree node rescales its two children to their own max), which needs no
# global max, so XLA fuses it into one kernel where "global" takes two (H100, 8B draft step at 4k, batch 1: the
# step's kernels 3.050 -> 2.987 ms, one launch fewer per layer; docs/kernel_notes.md).
MERGES = ("global", "pairwise")
DEFAULT_MERGE = "pairwise"


def _named_choice(config: "MgpuConfig | None", field: str, env: str, default: str, choices: tuple) -> str:
    """A named option of a call: the config's `field`, else $env, else `default`; one of `choices`."""
    import os

    name = (getattr(config, field) if config is not None else None) or os.environ.get(env) or default
    if name not in choices:
        raise ValueError(f"Mosaic GPU decode attention: {field}={name!r} (config or ${env}); expected one of {choices}")
    return name


def schedule_of(config: "MgpuConfig | None") -> str:
    """The schedule a call runs: the config's, else $QSPEC_MGPU_SCHEDULE, else DEFAULT_SCHEDULE."""
    return _named_choice(config, "schedule", "QSPEC_MGPU_SCHEDULE", DEFAULT_SCHEDULE, SCHEDULES)


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Static knobs; None means the heuristic (which never looks at T)."""

    num_splits: int | None = None  # quantized splits per (row, KV head)
    ring_splits: int | None = None  # programs per (row, KV head) that attend to the FP ring
    stages: int | None = None  # TMA pipeline depth (blocks in flight per program)
    register_a: bool | None = None  # codes -> operands in registers (GPU); False: the SMEM twin
    # Pallas inserts a warpgroup barrier around every SMEM store unless told not to; the kernel
    # places its own (a barrier at the top of each step, commit_smem after the operand stores).
    auto_barriers: bool = False
    # "legacy": one warpgroup per program does everything (2 programs per SM); "ws": the
    # warp-specialized schedule of decode_attention.mosaic_gpu_ws (TMA / prep / 2 consumer warpgroups,
    # lazy softmax reference). None: $QSPEC_MGPU_SCHEDULE, else DEFAULT_SCHEDULE.
    schedule: str | None = None
    ws_regs: tuple[int, int, int] | None = None  # "ws" setmaxnreg (consumers, prep, TMA)
    # "ws" timing diagnostics (wrong results): "stream", "stream_planes", "stream_noring", "noring", "noprep",
    # "scores_only", "no_values", "noconv", "nosoftmax", "noconv_nosoftmax", "nobias", "nolazybar", "nocommit",
    # "nobars"; "and_or" (right results);
    # see `mosaic_gpu_ws._WsStatic.diag`
    ws_diag: str | None = None
    # "ws": issue a block's value MMA, then the next block's K conversion and score MMA, before
    # waiting (software-pipelined consumers); False: one block after the other. Same bits.
    # None: pipelined for the draft view's row split with two consumers only (see mosaic_gpu_ws.static_config).
    ws_pipeline: bool | None = None
    # "ws": the consumer and prep loops unrolled over their slots, so that shared-memory addresses
    # are compile-time offsets. Same bits either way; None: off (it spills, see mosaic_gpu_ws).
    ws_static_slots: bool | None = None
    # "ws": one warp of the TMA warpgroup issues the copies, the other three leave (None: on).
    ws_tma_warp: bool | None = None
    # "ws": consumer warpgroups per CTA, 2 or 3 (unpipelined, 2 slots and 136 registers each). None:
    # $QSPEC_MGPU_CONSUMERS, else 3 for the draft's row split on long rows, 2 otherwise (`mosaic_gpu_ws.consumers_of`)
    ws_consumers: int | None = None
    # "ws": prep warpgroups per CTA (block i prepared by i % ws_preps), 1 (default) or 2 (with 2 consumers)
    ws_preps: int | None = None
    # "ws": the last consumer warpgroup of each CTA merges the CTA's partials before the store (one
    # partial per CTA for the XLA merge instead of one per consumer). None: on from
    # mosaic_gpu_ws.PAIR_MERGE_MIN_CTAS CTAs per (row, KV head) (`pair_merge_default`)
    ws_pair_merge: bool | None = None
    # the split merge, one of MERGES (None: $QSPEC_MGPU_MERGE, else DEFAULT_MERGE); see `merge_heads`
    merge: str | None = None
    # "ws", row split: the split merge inside the kernel (the last CTA of each (row, KV head) to finish,
    # counted on a global counter, merges the pair's partials in `merge_heads`' pairwise tree and writes the
    # output), so no XLA merge kernel follows the call. None: $QSPEC_MGPU_KERNEL_MERGE ("1" / "0"), else off
    # (`mosaic_gpu_ws.kernel_merge_of`). Exact (H200); timed in the model (docs/kernel_notes.md, "Thirty-sixth
    # session"): a tie in the 8B's draft step, ~40 us slower in its verify step, so off: the last CTA's arrival
    # (1.9 us) and merge (3.5 us at T 1, 9.5 at T 3) cost what the XLA merge and its launch did.
    ws_kernel_merge: bool | None = None
    # "ws": the balanced schedule: persistent CTAs, each an equal share of the flattened (row, KV head,
    # block) work. Draft view (`mosaic_gpu_ws.flat_work`): shares of the rows' real lengths, so rows of
    # different lengths cost their sum; None: $QSPEC_MGPU_FLAT, else on from two rows up. Target view
    # (`mosaic_gpu_ws.geo_work`): shares of the cache's geometry, so a row's bits do not depend on the
    # other rows; None: $QSPEC_MGPU_TARGET_FLAT, else off (`mosaic_gpu_ws.flat_of`). ws_flat_ctas: its CTA
    # count (None: one per SM).
    ws_flat: bool | None = None
    ws_flat_ctas: int | None = None
    # "ws": the prep warpgroup holds a segment's query in registers instead of reloading it from shared
    # memory per block (same values). None: $QSPEC_MGPU_PREP_QREGS, else on for the draft's row split
    # (`mosaic_gpu_ws.prep_q_regs_of`).
    ws_prep_q_regs: bool | None = None
    # "ws": the prep's q s_k and the consumers' softmax on each column tile's live columns only (its real
    # query columns rounded up to 8; `mosaic_gpu_ws.live_cols`), the rest of the tile zero P. None:
    # $QSPEC_MGPU_LIVE_COLS (0: off), else on (`mosaic_gpu_ws.live_of`).
    ws_live_cols: bool | None = None
    # "ws", balanced schedule: the prep warpgroup prepares two blocks per pass (both blocks' q s_k, their
    # bias terms summed in one column sum), where a column tile's live columns are at most half of it
    # (`mosaic_gpu_ws.prep_pairs_of`; same bits). None: $QSPEC_MGPU_PREP_PAIRS, else off (measured: it pays only
    # with three consumers, docs/kernel_notes.md, twenty-eighth session).
    ws_prep_pairs: bool | None = None
    # "ws" timing diagnostic: a directory into which every call writes a Perfetto trace of each warpgroup's
    # named regions (Mosaic GPU's on-device profiler; `mosaic_gpu_ws.PROFILE_REGIONS`). None: off.
    ws_profile_dir: str | None = None
    # "ws": programmatic dependent launch (`mosaic_gpu_ws.pdl_of`): the TMA warp issues the row split's
    # first blocks before `griddepcontrol.wait` (every role waits before it reads the query, the FP ring or
    # the positions, which the kernel before it writes) and lets the kernel after it launch early. None:
    # $QSPEC_MGPU_PDL ("1" / "0"), else off (an A/B knob: docs/kernel_notes.md, forty-second session). Never in
    # interpret mode.
    ws_pdl: bool | None = None


def merge_of(config: "MgpuConfig | None") -> str:
    """The split merge a call runs: the config's, else $QSPEC_MGPU_MERGE, else DEFAULT_MERGE."""
    return _named_choice(config, "merge", "QSPEC_MGPU_MERGE", DEFAULT_MERGE, MERGES)


# ----------------------------------------------------------------------------- code words
# The conversion of one 32-bit word of the upper plane (and of the lower plane for the target
# view) into four words of two float16 each. Written once over an `ops` object, so the register
# path (MLIR i32 values) and the twin (jnp uint32 arrays) run the same formulas.
#
# Output order: [pair02 of the low-nibble half, pair13 of the low half, pair02 of the high half,
# pair13 of the high half], where pair02 holds the elements of bytes 0 and 2 and pair13 those of
# bytes 1 and 3. With the cache's byte order, bytes (0, 2) and (1, 3) of the word loaded by lane
# j are the element pairs (2j, 2j+1) and (2j+8, 2j+9) of their 16-element group.
def convert_words(h, l, ops) -> list:
    """Four float16x2 words from an upper-plane word h (and a lower-plane word l, or None)."""
    if l is None:  # draft: U of the low nibbles -> 1024 + U, of the high nibbles -> 64 + U
        hs = ops.shr(h, 8)
        return [ops.mask_or(h, 0x000F000F, MAGIC_LO), ops.mask_or(hs, 0x000F000F, MAGIC_LO),
                ops.mask_or(h, 0x00F000F0, MAGIC_HI), ops.mask_or(hs, 0x00F000F0, MAGIC_HI)]
    # target: per byte, the 8-bit code 16 U + L' of the low-nibble element and of the high one
    a = ops.blend(ops.shl(h, 4), l, 0xF0F0F0F0)  # (x & m) | (y & ~m)
    b = ops.blend(h, ops.shr(l, 4), 0xF0F0F0F0)
    return [ops.prmt64(a, 0x4240), ops.prmt64(a, 0x4341), ops.prmt64(b, 0x4240), ops.prmt64(b, 0x4341)]


def offsets(view: str) -> tuple[float, float]:
    """Operand value minus code, for elements of the low-nibble half and the high-nibble half."""
    return (OFF_LO, OFF_HI) if view == "draft" else (OFF_LO, OFF_LO)


class _JnpOps:
    """`convert_words` over jnp uint32 arrays (the twin)."""

    @staticmethod
    def shr(x, n):
        return x >> jnp.uint32(n)

    @staticmethod
    def shl(x, n):
        return x << jnp.uint32(n)

    @staticmethod
    def mask_or(x, m, c):
        return (x & jnp.uint32(m)) | jnp.uint32(c)

    @staticmethod
    def blend(x, y, m):
        return (x & jnp.uint32(m)) | (y & jnp.uint32(~m & 0xFFFFFFFF))

    @staticmethod
    def prmt64(x, sel):
        """PTX prmt.b32 d, x, 0x64646464, sel (byte i of d = byte sel[i] of {0x64646464, x})."""
        out = jnp.zeros_like(x)
        for i in range(4):
            s = (sel >> (4 * i)) & 0x7
            byte = (x >> jnp.uint32(8 * s)) & jnp.uint32(0xFF) if s < 4 else jnp.uint32(0x64)
            out = out | (byte << jnp.uint32(8 * i))
        return out


def twin_operand(hi: Array, lo: Array | None) -> Array:
    """The operand tile the register path builds, computed with jnp: uint8 [rows, nb] planes in
    the cache byte order -> float16 [rows, 2 nb] (columns: nb low-nibble elements in logical
    order, then nb high-nibble elements), each element = offset + code."""
    rows, nb = hi.shape
    words = lambda x: lax.bitcast_convert_type(x.reshape(rows, nb // 4, 4), jnp.uint32)  # noqa: E731
    outs = convert_words(words(hi), None if lo is None else words(lo), _JnpOps)
    f16 = [lax.bitcast_convert_type(w, jnp.float16).reshape(rows, nb // 16, 4, 2) for w in outs]

    def half(p02, p13):  # word 4kb + j: pair02 -> cols 16kb + 2j + e, pair13 -> 16kb + 8 + 2j + e
        return jnp.stack([p02.reshape(rows, nb // 16, 8), p13.reshape(rows, nb // 16, 8)], axis=2).reshape(rows, nb)

    return jnp.concatenate([half(f16[0], f16[1]), half(f16[2], f16[3])], axis=1)


def register_operand(hi, lo, rows: int, nb: int, *, lop3: bool = True, raw: bool = False):
    """Register path: uint8 [rows=64, nb] arrays in the WGMMA_8BIT layout (lane j of a quad holds
    bytes 4j..4j+3 of each 16-byte group of its two rows) -> float16 [64, 2 nb] in the WGMMA
    layout (lane j holds columns 8k + 2j, 8k + 2j + 1 of its rows). Written at the Mosaic GPU
    level (`inline_mgpu`): the registers are built one by one, so no relayout is ever emitted.
    lop3: each mask-and-merge as one inline-PTX `lop3.b32` (one SASS LOP3 per output word); False
    writes it as and + or, which ptxas emits as two LOP3s (kept for A/B timing only). raw: the code
    words themselves as the operand's registers, no conversion (a timing diagnostic: wrong values)."""
    # jax.extend.mlir has no llvm dialect (inline PTX for prmt): the same modules as Mosaic GPU's own.
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    import jax.experimental.mosaic.gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    out_ty = plgpu.ShapeDtypeStruct((rows, 2 * nb), jnp.float16, layout=plgpu.Layout.WGMMA)
    arg_types = (plgpu.Layout.WGMMA_8BIT,) if lo is None else (plgpu.Layout.WGMMA_8BIT, plgpu.Layout.WGMMA_8BIT)

    @plgpu.inline_mgpu(arg_types=arg_types, return_type=out_ty)
    def convert(ctx, *arrays):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
        def const(v):  # a 32-bit pattern as a signless i32 constant
            return arith.constant(i32, ir.IntegerAttr.get(i32, v - (1 << 32) if v >= 1 << 31 else v))

        class Ops:
            shr = staticmethod(lambda x, n: arith.shrui(x, const(n)))
            shl = staticmethod(lambda x, n: arith.shli(x, const(n)))

            @staticmethod
            def mask_or(x, m, c):
                if not lop3:  # and + or: ptxas emits two LOP3s (one immediate each)
                    return arith.ori(arith.andi(x, const(m)), const(c))
                # One LOP3 (LUT 0xEA = (a & b) | c): written as lop3 with both constants, ptxas
                # keeps one in a register hoisted out of the loop and the other as the immediate.
                return llvm.inline_asm(i32, [x], f"lop3.b32 $0, $1, {hex(m)}, {hex(c)}, 0xEA;", "=r,r")

            @staticmethod
            def blend(x, y, m):
                if not lop3:
                    return arith.ori(arith.andi(x, const(m)), arith.andi(y, const(~m & 0xFFFFFFFF)))
                # (a & c) | (b & ~c): LUT 0xE4
                return llvm.inline_asm(i32, [x, y], f"lop3.b32 $0, $1, $2, {hex(m)}, 0xE4;", "=r,r,r")

            @staticmethod
            def prmt64(x, sel):
                return llvm.inline_asm(i32, [x], f"prmt.b32 $0, $1, 0x64646464, {hex(sel)};", "=r,r")

        h_regs = arrays[0].registers
        l_regs = None if lo is None else arrays[1].registers
        out = np.empty(fa.WGMMA_LAYOUT.registers_shape((rows, 2 * nb)), dtype=object)
        half_blocks = nb // 8  # 8-column register blocks in the low half
        for idx in np.ndindex(h_regs.shape):
            kb = idx[1]
            h = mgpu.utils.bitcast(h_regs[idx], i32)
            l = None if l_regs is None else mgpu.utils.bitcast(l_regs[idx], i32)
            words = [h, h if l is None else l] * 2 if raw else convert_words(h, l, Ops)
            for kc, w in zip((2 * kb, 2 * kb + 1, half_blocks + 2 * kb, half_blocks + 2 * kb + 1), words):
                j = list(idx)
                j[1] = kc
                out[tuple(j)] = mgpu.utils.bitcast(w, f16x2)
        return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return convert(hi) if lo is None else convert(hi, lo)


# ------------------------------------------------------------------------- small helpers
ROW = plgpu.Layout.WGMMA.reduce(1)  # a value per row of a [64k, n] WGMMA array
COL = plgpu.Layout.WGMMA.reduce(0)  # a value per column


def transpose_ref(ref):
    return ref.transpose((1, 0)) if hasattr(ref, "transpose") else plgpu.transpose_ref(ref, (1, 0))


def store_transposed(dst, tile: Array, interpret: bool) -> None:
    """Store the float32 [64, NT] WGMMA tile (rows: channels, columns: query columns) transposed
    into dst, a float32 [NT, 64] view of a global-memory partial, so that the merge reads the
    partials in the output's [query column, channel] order (no transpose kernel after it). On the
    GPU each thread stores its own elements (8 per tile; no relayout and no shared memory)."""
    if interpret:
        dst[...] = tile.T
        return
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, vector

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(ctx, a, ref):
        del ctx
        index = ir.IndexType.get()
        for (row, col), reg in zip(a.layout.thread_idxs(a.shape), a.registers.flat):
            for e in range(ir.VectorType(reg.type).shape[0]):
                v = vector.extract(reg, dynamic_position=[], static_position=[e])
                memref.store(v, ref, [arith.addi(col, arith.constant(index, e)), row])

    store(tile, dst)


def bcast_row(v, shape):
    return lax.broadcast_in_dim(v, shape, [0])


def bcast_col(v, shape):
    return lax.broadcast_in_dim(v, shape, [1])


def swizzle_transforms(row_bytes: int, itemsize: int) -> tuple:
    sw = min(128, row_bytes)
    if sw not in (32, 64, 128):
        raise ValueError(f"rows of {row_bytes} bytes cannot be swizzled")
    return (plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw))


@dataclasses.dataclass(frozen=True)
class _Static:
    view: str
    B: int
    H: int
    D: int
    G: int
    R: int
    C: int  # column tiles (the only T-dependent number: how many tiles, not their size)
    NS: int
    NR: int
    stages: int
    window: int | None
    register_a: bool
    interpret: bool
    no_auto_barriers: bool
    scale_dtype: Any
    fp_dtype: Any


# ---------------------------------------------------------------------------------- kernel
def _build(st: _Static):
    target = st.view == "target"
    D, G, C, R = st.D, st.G, st.C, st.R
    Dh, Gh = D // 2, G // 2
    CN = C * NT
    MTK = G // MT  # token M tiles per block
    MTV = D // MT  # channel M tiles
    n_planes = 2 if target else 1
    off_lo, off_hi = offsets(st.view)
    kfac = 1.0 / 16 if target else 1.0  # code step: s/16 (target) or s (draft)
    NP = st.NS + st.NR
    n_ring_tiles = -(-R // RING_TILE)
    ring_per = -(-n_ring_tiles // st.NR)
    f32, f16 = jnp.float32, jnp.float16
    reg_a = st.register_a

    def _load(ref, layout):  # interpret mode has no layouts: a plain read
        return ref[...] if st.interpret else load_with_layout(ref, layout)

    def _cast(x, layout):
        return x if st.interpret else plgpu.layout_cast(x, layout)

    def _iota(shape, dim):
        if st.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    def operand(hi_ref, lo_ref, rows_start, nb):
        """[64, 2 nb] float16 operand of plane rows rows_start.. (register value or SMEM ref)."""
        hi = hi_ref.at[pl.ds(rows_start, MT)]
        lo = None if lo_ref is None else lo_ref.at[pl.ds(rows_start, MT)]
        if reg_a:
            h = _load(hi, plgpu.Layout.WGMMA_8BIT)
            l = None if lo is None else _load(lo, plgpu.Layout.WGMMA_8BIT)
            return register_operand(h, l, MT, nb)
        return twin_operand(hi[...], None if lo is None else lo[...])

    def softmax_step(s_tiles, vis_tiles, m, l_acc, alpha_out=None):
        """Online softmax over the token rows of one column tile (log2 units)."""
        shape = s_tiles[0].shape
        if vis_tiles is not None:
            s_tiles = [jnp.where(v, s, NEG) for s, v in zip(s_tiles, vis_tiles)]
        mloc = functools.reduce(jnp.maximum, [jnp.max(s, axis=0) for s in s_tiles])
        m_new = jnp.maximum(m, mloc)
        alpha = jnp.exp2(m - m_new)
        p = [jnp.exp2(s - bcast_col(m_new, shape)) for s in s_tiles]
        if vis_tiles is not None:
            p = [jnp.where(v, x, 0.0) for x, v in zip(p, vis_tiles)]
        l_acc = l_acc * bcast_col(alpha, shape) + functools.reduce(jnp.add, p)
        return p, m_new, alpha, l_acc

    def kernel(layer_ref, meta_ref, pos_ref, q_ref, *refs, q_s, pos_s, qbar):
        planes = refs[: 2 * n_planes]
        ks_ref, kz_ref, vs_ref, vz_ref, kfp_ref, vfp_ref, o_ref, ml_ref = refs[2 * n_planes:]
        kp_refs = planes[:n_planes]  # k_hi (, k_lo): [LBH, S, Dh]
        vp_refs = planes[n_planes:]  # v_hi (, v_lo): [LBH, (S/G) D, G/2]
        p = lax.axis_index("p")
        h = lax.axis_index("h")
        b = lax.axis_index("b")
        layer = layer_ref[0]
        q_len = meta_ref[b, 0]
        fp_start = meta_ref[b, 1]
        min_pos = meta_ref[b, 2]
        lbh = (layer * st.B + b) * st.H + h
        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_s, qbar.at[0])
        plgpu.copy_gmem_to_smem(pos_ref.at[b], pos_s, qbar.at[0])
        plgpu.barrier_wait(qbar.at[0])
        pos_c = [_load(pos_s.at[pl.ds(c * NT, NT)], COL) for c in range(C)]

        def q_tile(c):
            return _load(q_s.at[:, pl.ds(c * NT, NT)], plgpu.Layout.WGMMA)  # f32 [D, NT]

        def write(c, o_tiles, m, l):
            for mc in range(MTV):
                store_transposed(o_ref.at[b, h, p, pl.ds(c * NT, NT), pl.ds(mc * MT, MT)], o_tiles[mc], st.interpret)
            row = _iota((MT, NT), 0)
            ml_ref[b, h, p, :, pl.ds(c * NT, NT)] = jnp.where(row < MT // 2, bcast_col(m, (MT, NT)),
                                                              bcast_col(l, (MT, NT)))

        zeros_t = lambda: _cast(jnp.zeros((MT, NT), f32), plgpu.Layout.WGMMA)  # noqa: E731
        neg_c = lambda: _cast(jnp.full((NT,), NEG, f32), COL)  # noqa: E731

        # ---------------------------------------------------------------- quantized region
        def quant_part(k_s, v_s, sk_s, zk_s, sv_s, zv_s, qs_s, pp_s, ak_s, av_s, bar):
            n_blk_row = q_len // G
            per = (n_blk_row + st.NS - 1) // st.NS
            blk0 = p * per
            n = jnp.maximum(jnp.minimum(per, n_blk_row - blk0), 0)
            if st.window is not None:  # blocks before every row's window: exact no-ops, skipped
                first = jnp.maximum(min_pos - st.window + 1, 0) // G
                skip = jnp.clip(first - blk0, 0, n)
                blk0, n = blk0 + skip, n - skip

            def issue(i, slot):
                blk = blk0 + i
                for j, r in enumerate(kp_refs):
                    plgpu.copy_gmem_to_smem(r.at[lbh, pl.ds(blk * G, G)], k_s.at[slot, j], bar.at[slot])
                for j, r in enumerate(vp_refs):
                    plgpu.copy_gmem_to_smem(r.at[lbh, pl.ds(blk * D, D)], v_s.at[slot, j], bar.at[slot])
                plgpu.copy_gmem_to_smem(ks_ref.at[lbh, blk], sk_s.at[slot], bar.at[slot])
                plgpu.copy_gmem_to_smem(kz_ref.at[lbh, blk], zk_s.at[slot], bar.at[slot])
                plgpu.copy_gmem_to_smem(vs_ref.at[lbh, pl.ds(blk * G, G)], sv_s.at[slot], bar.at[slot])
                plgpu.copy_gmem_to_smem(vz_ref.at[lbh, pl.ds(blk * G, G)], zv_s.at[slot], bar.at[slot])

            for s in range(st.stages):
                @pl.when(s < n)
                def _():
                    issue(s, s)

            ch_row = _iota((D, NT), 0)
            off_k = jnp.where(ch_row < Dh, off_lo, off_hi)  # [D, NT]
            tok_row = _iota((MT, NT), 0)

            def body(i, carry):
                ms, ls, ys, os_ = carry
                slot = lax.rem(i, st.stages)
                blk = blk0 + i
                plgpu.barrier_wait(bar.at[slot])
                # Every warp is done with block i - 1 (its SMEM reads, wgmma operands and stores):
                # refill its slot, and the stores below may overwrite qs_s / pp_s.
                plgpu.commit_smem()

                @pl.when((i >= 1) & (i - 1 + st.stages < n))
                def _():
                    issue(i - 1 + st.stages, lax.rem(i - 1, st.stages))

                sk = _load(sk_s.at[slot], ROW).astype(f32)  # [D] per-channel key scale
                zk = _load(zk_s.at[slot], ROW).astype(f32)
                s_eff = sk * kfac
                z_eff = zk - sk * 0.5 if target else zk
                biases = []
                for c in range(C):
                    qt = q_tile(c)
                    qs = (qt * bcast_row(s_eff, (D, NT))).astype(f16)
                    qs_s[c] = qs
                    w = qt * bcast_row(z_eff, (D, NT)) - off_k * qs.astype(f32)
                    biases.append(jnp.sum(w, axis=0))  # [NT] q.z' - sum(off * qs)
                plgpu.commit_smem()

                def qk(*accs):
                    for mt in range(MTK):
                        a = operand(k_s.at[slot, 0], k_s.at[slot, 1] if target else None, mt * MT, Dh)
                        if not reg_a:
                            ak_s[...] = a
                            plgpu.commit_smem()
                            a = ak_s
                        for c in range(C):
                            plgpu.wgmma(accs[mt * C + c], a, qs_s.at[c])
                        if not reg_a:
                            plgpu.wgmma_wait(0)
                    return [acc[...] for acc in accs]

                s_all = pl.run_scoped(qk, *[plgpu.ACC((MT, NT), f32) for _ in range(MTK * C)])
                new_ms, new_ls, new_ys, alphas = [], [], [], []
                sv = [_load(sv_s.at[slot, pl.ds(mt * MT, MT)], ROW).astype(f32) * kfac for mt in range(MTK)]
                zv = [_load(zv_s.at[slot, pl.ds(mt * MT, MT)], ROW).astype(f32) for mt in range(MTK)]
                if target:
                    zv = [z - s * 8.0 for z, s in zip(zv, sv)]  # min - s/2 with sv = s/16
                tok_off = [jnp.where(mt * MT + tok_row < Gh, off_lo, off_hi) for mt in range(MTK)]
                for c in range(C):
                    s_t = [s_all[mt * C + c] + bcast_col(biases[c], (MT, NT)) for mt in range(MTK)]
                    vis = None
                    if st.window is not None:
                        vis = [bcast_col(pos_c[c], (MT, NT)) - (blk * G + mt * MT + tok_row) < st.window
                               for mt in range(MTK)]
                    pr, m_new, alpha, l_acc = softmax_step(s_t, vis, ms[c], ls[c])
                    pp = [(pr[mt] * bcast_row(sv[mt], (MT, NT))).astype(f16) for mt in range(MTK)]
                    y = ys[c] * bcast_col(alpha, (MT, NT))
                    for mt in range(MTK):
                        y = y + pr[mt] * bcast_row(zv[mt], (MT, NT)) - tok_off[mt] * pp[mt].astype(f32)
                        pp_s[c, pl.ds(mt * MT, MT)] = pp[mt]
                    new_ms.append(m_new)
                    new_ls.append(l_acc)
                    new_ys.append(y)
                    alphas.append(alpha)
                plgpu.commit_smem()

                def pv(*accs):  # accs[mc * C + c]
                    for mc in range(MTV):
                        a = operand(v_s.at[slot, 0], v_s.at[slot, 1] if target else None, mc * MT, Gh)
                        if not reg_a:
                            av_s[...] = a
                            plgpu.commit_smem()
                            a = av_s
                        for c in range(C):
                            plgpu.wgmma(accs[mc * C + c], a, pp_s.at[c])
                        if not reg_a:
                            plgpu.wgmma_wait(0)
                    return [acc[...] for acc in accs]

                pv_all = pl.run_scoped(pv, *[plgpu.ACC((MT, NT), f32) for _ in range(MTV * C)])
                new_os = tuple(tuple(os_[c][mc] * bcast_col(alphas[c], (MT, NT)) + pv_all[mc * C + c]
                                     for mc in range(MTV)) for c in range(C))

                return tuple(new_ms), tuple(new_ls), tuple(new_ys), new_os

            init = (tuple(neg_c() for _ in range(C)), tuple(zeros_t() for _ in range(C)),
                    tuple(zeros_t() for _ in range(C)),
                    tuple(tuple(zeros_t() for _ in range(MTV)) for _ in range(C)))
            ms, ls, ys, os_ = lax.fori_loop(0, n, body, init)
            for c in range(C):
                y = jnp.sum(ys[c], axis=0)
                o_tiles = [os_[c][mc] + bcast_col(y, (MT, NT)) for mc in range(MTV)]
                write(c, o_tiles, ms[c], jnp.sum(ls[c], axis=0))

        # ---------------------------------------------------------------------- FP ring
        def ring_part(kr_s, vr_s, qb_s, pb_s, at_s, bar):
            r = p - st.NS
            t0 = r * ring_per
            nt = jnp.maximum(jnp.minimum(ring_per, n_ring_tiles - t0), 0)

            def start_of(t):  # the last tile is moved back to end at R; its overlap is masked
                return jnp.minimum(t * RING_TILE, R - RING_TILE)

            def issue(i, slot):
                s0 = start_of(t0 + i)
                plgpu.copy_gmem_to_smem(kfp_ref.at[lbh, pl.ds(s0, RING_TILE)], kr_s.at[slot], bar.at[slot])
                plgpu.copy_gmem_to_smem(vfp_ref.at[lbh, pl.ds(s0, RING_TILE)], vr_s.at[slot], bar.at[slot])

            for s in range(2):
                @pl.when(s < nt)
                def _():
                    issue(s, s)

            for c in range(C):
                qb_s[c] = q_tile(c).astype(st.fp_dtype)
            plgpu.commit_smem()
            slot_row = _iota((MT, NT), 0)

            def body(i, carry):
                ms, ls, os_ = carry
                slot = lax.rem(i, 2)
                t = t0 + i
                s0 = start_of(t)
                plgpu.barrier_wait(bar.at[slot])
                plgpu.commit_smem()  # every warp is done with tile i - 1: refill its slot

                @pl.when((i >= 1) & (i + 1 < nt))
                def _():
                    issue(i + 1, lax.rem(i - 1, 2))


                def qk(*accs):
                    if reg_a:
                        a = _load(kr_s.at[slot], plgpu.Layout.WGMMA)
                    else:
                        a = kr_s.at[slot]
                    for c in range(C):
                        plgpu.wgmma(accs[c], a, qb_s.at[c])
                    return [acc[...] for acc in accs]

                s_all = pl.run_scoped(qk, *[plgpu.ACC((MT, NT), f32) for _ in range(C)])
                slot_idx = s0 + slot_row
                j = lax.rem(slot_idx - fp_start + R, R)  # logical ring index
                kpos = q_len + j
                fresh = slot_idx >= t * RING_TILE  # not already covered by the previous tile
                new_ms, new_ls, alphas = [], [], []
                for c in range(C):
                    qpos = bcast_col(pos_c[c], (MT, NT))
                    vis = (kpos <= qpos) & fresh
                    if st.window is not None:
                        vis = vis & (qpos - kpos < st.window)
                    pr, m_new, alpha, l_acc = softmax_step([s_all[c]], [vis], ms[c], ls[c])
                    pb_s[c] = pr[0].astype(st.fp_dtype)
                    new_ms.append(m_new)
                    new_ls.append(l_acc)
                    alphas.append(alpha)
                plgpu.commit_smem()

                def pv(*accs):  # accs[mc * C + c]
                    for mc in range(MTV):
                        vt = vr_s.at[slot, :, pl.ds(mc * MT, MT)]  # [slots, 64 channels]
                        if reg_a:
                            a = plgpu.layout_cast(_load(transpose_ref(vt), plgpu.Layout.WGMMA_TRANSPOSED),
                                                  plgpu.Layout.WGMMA)
                        else:
                            at_s[...] = vt[...].T
                            plgpu.commit_smem()
                            a = at_s
                        for c in range(C):
                            plgpu.wgmma(accs[mc * C + c], a, pb_s.at[c])
                        if not reg_a:
                            plgpu.wgmma_wait(0)
                    return [acc[...] for acc in accs]

                pv_all = pl.run_scoped(pv, *[plgpu.ACC((MT, NT), f32) for _ in range(MTV * C)])
                new_os = tuple(tuple(os_[c][mc] * bcast_col(alphas[c], (MT, NT)) + pv_all[mc * C + c]
                                     for mc in range(MTV)) for c in range(C))

                return tuple(new_ms), tuple(new_ls), new_os

            init = (tuple(neg_c() for _ in range(C)), tuple(zeros_t() for _ in range(C)),
                    tuple(tuple(zeros_t() for _ in range(MTV)) for _ in range(C)))
            ms, ls, os_ = lax.fori_loop(0, nt, body, init)
            for c in range(C):
                write(c, list(os_[c]), ms[c], jnp.sum(ls[c], axis=0))

        sd = st.scale_dtype
        itemsize = jnp.dtype(sd).itemsize
        quant_scratch = dict(
            k_s=plgpu.SMEM((st.stages, n_planes, G, Dh), jnp.uint8, transforms=swizzle_transforms(Dh, 1)),
            v_s=plgpu.SMEM((st.stages, n_planes, D, Gh), jnp.uint8, transforms=swizzle_transforms(Gh, 1)),
            sk_s=plgpu.SMEM((st.stages, D), sd), zk_s=plgpu.SMEM((st.stages, D), sd),
            sv_s=plgpu.SMEM((st.stages, G), sd), zv_s=plgpu.SMEM((st.stages, G), sd),
            qs_s=plgpu.SMEM((C, D, NT), f16, transforms=swizzle_transforms(NT * 2, 2)),
            pp_s=plgpu.SMEM((C, G, NT), f16, transforms=swizzle_transforms(NT * 2, 2)),
            ak_s=None if reg_a else plgpu.SMEM((MT, D), f16, transforms=swizzle_transforms(D * 2, 2)),
            av_s=None if reg_a else plgpu.SMEM((MT, G), f16, transforms=swizzle_transforms(G * 2, 2)),
            bar=plgpu.Barrier(num_arrivals=2 * n_planes + 4, num_barriers=st.stages),
        )
        del itemsize
        fp_item = jnp.dtype(st.fp_dtype).itemsize
        ring_scratch = dict(
            kr_s=plgpu.SMEM((2, RING_TILE, D), st.fp_dtype, transforms=swizzle_transforms(D * fp_item, fp_item)),
            vr_s=plgpu.SMEM((2, RING_TILE, D), st.fp_dtype, transforms=swizzle_transforms(D * fp_item, fp_item)),
            qb_s=plgpu.SMEM((C, D, NT), st.fp_dtype, transforms=swizzle_transforms(NT * fp_item, fp_item)),
            pb_s=plgpu.SMEM((C, RING_TILE, NT), st.fp_dtype, transforms=swizzle_transforms(NT * fp_item, fp_item)),
            at_s=None if reg_a else plgpu.SMEM((MT, RING_TILE), st.fp_dtype,
                                               transforms=swizzle_transforms(RING_TILE * fp_item, fp_item)),
            bar=plgpu.Barrier(num_arrivals=2, num_barriers=2),
        )

        def scoped(part, types):
            live = {k: v for k, v in types.items() if v is not None}
            pl.run_scoped(lambda **refs: part(**{k: refs.get(k) for k in types}), **live)

        @pl.when(p < st.NS)
        def _():
            scoped(quant_part, quant_scratch)

        @pl.when(p >= st.NS)
        def _():
            scoped(ring_part, ring_scratch)

    out_type = (jax.ShapeDtypeStruct((st.B, st.H, NP, CN, D), jnp.float32),
                jax.ShapeDtypeStruct((st.B, st.H, NP, MT, CN), jnp.float32))
    kw = {}
    if st.interpret:
        params = getattr(plgpu, "InterpretGPUParams", None)  # public from jax 0.11
        if params is None:
            from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
        kw["interpret"] = params()
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(NP, st.H, st.B),
        grid_names=("p", "h", "b"),
        scratch_types=dict(
            q_s=plgpu.SMEM((D, CN), jnp.float32, transforms=swizzle_transforms(NT * 4, 4)),
            pos_s=plgpu.SMEM((pos_width(CN),), jnp.int32),
            qbar=plgpu.Barrier(num_arrivals=2, num_barriers=1),
        ),
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=st.no_auto_barriers),
        kernel_name=f"quantspec_{st.view}_mgpu",
        **kw,
    )


def pos_width(cn: int) -> int:
    return -(-cn // 32) * 32  # int32 rows of a multiple of 128 bytes (TMA copies)


# --------------------------------------------------------------------------------- wrapper
def unsupported_reason(q_shape, cache, view: str) -> str | None:
    """Why the Mosaic GPU kernel cannot take this call (None: it can)."""
    if view not in VIEWS:
        return f"view={view!r}; expected one of {VIEWS}"
    L, B, hkv, S, dh = cache.k_hi.shape
    D = 2 * dh
    G, R = cache.group_size, cache.ring_size
    if D not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {D} not in {SUPPORTED_HEAD_DIMS}"
    if G % MT or G > 256:
        return f"group_size {G} must be a multiple of {MT} and at most 256"
    if R < RING_TILE:
        return f"ring of {R} slots is shorter than {RING_TILE}"
    if cache.v_scale.shape[-1] != 1:
        return "one value-quantization group per token is required (head_dim <= 128)"
    if jnp.dtype(cache.k_fp.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"FP ring dtype {cache.k_fp.dtype}: the kernel needs bfloat16 or float16"
    if len(q_shape) != 4 or q_shape[3] != D or q_shape[2] % hkv or q_shape[0] != B:
        return f"q shape {q_shape} does not match the cache (B={B}, Hkv={hkv}, D={D})"
    return None


def default_splits(batch: int, hkv: int, max_len: int, G: int, R: int, D: int, view: str,
                   config: MgpuConfig | None = None) -> tuple[int, int]:
    """(quantized splits, ring programs) per (row, KV head), so that the whole grid is one wave
    of PROGRAMS_PER_SM programs per SM (ring programs included), with at least one block per
    split. Depends on the geometry and the view only, never on T."""
    cfg = config or MgpuConfig()
    n_blocks = max(1, max_len // G)
    wave = max(1, PROGRAMS_PER_SM * num_sms() // (batch * hkv))  # programs per (row, KV head)
    n_tiles = -(-R // RING_TILE)
    if cfg.ring_splits:
        nr = cfg.ring_splits
    else:  # balance a ring program's bytes (bf16 K+V) against a quantized split's
        planes = 2 if view == "target" else 1
        quant_bytes = -(-n_blocks // wave) * G * D // 2 * 2 * planes
        nr = round(R * D * 2 * 2 / max(quant_bytes, 1))
    nr = max(1, min(nr, n_tiles))
    nr = -(-n_tiles // -(-n_tiles // nr))  # no empty ring program
    ns = cfg.num_splits or max(1, wave - nr)
    return max(1, min(ns, n_blocks)), nr


def resolve_schedule(config: MgpuConfig | None, view: str, D: int, G: int, c_max: int, scale_dtype: Any,
                     fp_dtype: Any) -> str:
    """The schedule a call runs. It depends on the geometry and c_max (the column tiles of the
    cache's widest call, T = gamma_max + 1) only, never on T, so every T of a cache runs the same
    kernel. A "ws" that comes from the default (not the config) and cannot fit c_max column tiles
    in shared memory falls back to "legacy"; one the config asks for raises instead."""
    from pallas_kernels.decode_attention import mosaic_gpu_ws as ws

    name = schedule_of(config)
    if name == "ws" and (config is None or config.schedule != "ws") and not ws.fits(view, D, G, c_max, scale_dtype,
                                                                                     fp_dtype):
        return "legacy"
    return name


def column_tiles(n_rep: int, t: int) -> int:
    return -(-(n_rep * t) // NT)


def query_operand_shape(q_shape: tuple[int, ...], hkv: int) -> tuple[int, int, int, int]:
    """[B, Hkv, D, CN]: the warp-specialized kernel's query operand for queries [B, T, Hq, D]
    (column n = t * n_rep + r holds query head h n_rep + r of KV head h at token t; the columns
    past T n_rep are zero)."""
    b, t, hq, d = q_shape
    return b, hkv, d, column_tiles(hq // hkv, t) * NT


def takes_query_operand(q_shape: tuple[int, ...], cache: Any, view: str, config: MgpuConfig | None = None) -> bool:
    """Whether `quantized_decode_attention_mgpu` takes this call's queries as a prepared operand
    (`q_operand=`: the warp-specialized schedule, whose operand is raw bf16) rather than q."""
    if unsupported_reason(q_shape, cache, view) is not None:
        return False
    hkv, d = cache.k_hi.shape[2], 2 * cache.k_hi.shape[4]
    c_max = column_tiles(q_shape[2] // hkv, max(q_shape[1], cache.gamma_max + 1))
    return resolve_schedule(config, view, d, cache.group_size, c_max, cache.k_scale.dtype, cache.k_fp.dtype) == "ws"


def kernel_inputs(q_pos: Array, cache: Any, n_rep: int, view: str | None = None) -> dict[str, Array]:
    """The kernel inputs every layer of a decode pass shares, so a model computes them once per
    pass, outside its layer loop (`inputs=` below):

        meta  int32 [B, 3]  q_len, fp_start and the smallest query position of each row
        pos   int32 [B, W]  the position of query column n = t * n_rep + r; padding columns BIG_POS
        ws_pairs, ws_ctas   with `view` given, where that view runs the balanced schedule by
                            default: its work split (`mosaic_gpu_ws.flat_inputs`)
        merge_counters      with `view` given, under jit, where $QSPEC_MGPU_KERNEL_MERGE=1 has the row
                            split merge in the kernel: its counters' ref, zero between calls

    q_pos: int32 [B, T]. W covers the column tiles of n_rep * T columns (a multiple of 32)."""
    b, t = q_pos.shape
    cn = column_tiles(n_rep, t) * NT
    pos = jnp.repeat(q_pos.astype(jnp.int32), n_rep, axis=1)
    pos = jnp.pad(pos, ((0, 0), (0, pos_width(cn) - t * n_rep)), constant_values=BIG_POS)
    meta = jnp.stack([cache.q_len.astype(jnp.int32), cache.fp_start.astype(jnp.int32),
                      jnp.min(q_pos, axis=1).astype(jnp.int32)], axis=1)
    out = {"meta": meta, "pos": pos}
    if view is not None:
        from pallas_kernels.decode_attention import mosaic_gpu_ws as ws

        out.update(ws.flat_inputs(cache, view))
        # $QSPEC_MGPU_KERNEL_MERGE: one counter ref for the pass (refs in global memory exist only under jit; an
        # eager caller's calls each make their own)
        if ws.kernel_merge_of(None, ws.flat_of(None, view, b)) and isinstance(meta, jax.core.Tracer):
            out["merge_counters"] = jax.new_ref(merge_counters_zeros(b, cache.k_hi.shape[2]),
                                                memory_space=plgpu.GMEM)
    return out


def merge_counters_zeros(batch: int, hkv: int) -> Array:
    """The in-kernel split merge's counters at rest: uint32 [B Hkv] zeros, one per (row, KV head);
    every call leaves them so, so one ref serves every layer of a pass (`kernel_inputs`)."""
    return jnp.zeros((batch * hkv,), jnp.uint32)


def _tree(xs: list, op: Any) -> Any:
    """op-reduction of xs as a balanced binary tree in a fixed order: ((x0 . x1) . (x2 . x3)) ...
    It depends on len(xs) only, so every output element is the same expression whatever the
    other shapes; its depth is log2(P) where a left-to-right chain is P (the merge kernel is
    latency-bound: each output element's operations run one after another)."""
    while len(xs) > 1:
        xs = [op(xs[i], xs[i + 1]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def merge_tree(n: int) -> Any:
    """The order in which `merge_heads` combines n partials: `_tree` over 0 .. n - 1 as nested pairs
    (an int is a leaf), for a merge that evaluates it depth-first (the in-kernel merge of
    `mosaic_gpu_ws`, which loads each partial where the tree reaches it)."""
    return _tree(list(range(n)), lambda a, b: (a, b))


def pairwise_weights(m_x: Array, m_y: Array) -> tuple[Array, Array, Array]:
    """Flash-decoding's pairwise combine of two partials with maxima m_x, m_y (log2 units): the
    combined max and each partial's weight exp2(m - max). NEG - NEG == 0, so two neutral partials
    (m = NEG, l = 0, o = 0) stay neutral. The XLA merge (`merge_heads`) and the in-kernel one
    (`mosaic_gpu_ws`, ws_pair_merge) both weigh with it."""
    mx = jnp.maximum(m_x, m_y)
    return mx, jnp.exp2(m_x - mx), jnp.exp2(m_y - mx)


def merge_heads(o: Array, ml: Array, t: int, n_rep: int, how: str = DEFAULT_MERGE) -> Array:
    """Log-sum-exp merge of the programs' partials into float32 [B, T, Hkv * n_rep, D] (query
    column n = t * n_rep + r is head h * n_rep + r of token t).

    o: float32 [B, H, P, CN, D], unnormalized O with the query columns as rows (the kernels store
    it transposed, `store_transposed`); ml: [B, H, P, 64, CN] with m (log2 units) in row 0 and l
    in row 32. Neutral partials (m = NEG, l = 0, o = 0) weigh 0. `how` (MERGES): "global", the
    weights exp2(m_i - max_j m_j); "pairwise", each node of the tree rescales its two children to
    their own max. Both sum over the partials as a fixed binary tree (`_tree`), so every output
    element is the same expression whatever T is (T-invariant)."""
    if how not in MERGES:
        raise ValueError(f"merge={how!r}; expected one of {MERGES}")
    b, hkv, n_p, _, d = o.shape
    n = t * n_rep
    m = ml[:, :, :, 0, :n]  # [B, H, P, n]
    l = ml[:, :, :, MT // 2, :n]
    o = o[:, :, :, :n]  # [B, H, P, n, D]
    if how == "global":
        m_max = _tree([m[:, :, i] for i in range(n_p)], jnp.maximum)
        w = [jnp.exp2(m[:, :, i] - m_max) for i in range(n_p)]
        l_tot = _tree([w[i] * l[:, :, i] for i in range(n_p)], jnp.add)
        o_tot = _tree([w[i][..., None] * o[:, :, i] for i in range(n_p)], jnp.add)
    else:
        def combine(x: tuple, y: tuple) -> tuple:
            mx, wx, wy = pairwise_weights(x[0], y[0])
            return mx, wx * x[1] + wy * y[1], wx[..., None] * x[2] + wy[..., None] * y[2]
        _, l_tot, o_tot = _tree([(m[:, :, i], l[:, :, i], o[:, :, i]) for i in range(n_p)], combine)
    out = o_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]  # [B, H, n, D]
    return jnp.transpose(out.reshape(b, hkv, t, n_rep, d), (0, 2, 1, 3, 4)).reshape(b, t, hkv * n_rep, d)


def quantized_decode_attention_mgpu(q: Array, q_pos: Array, cache: Any, layer: Array | int, *, view: str,
                                    sliding_window: int | None = None, interpret: bool = False,
                                    config: MgpuConfig | None = None, return_partials: bool = False,
                                    inputs: dict[str, Array] | None = None, q_operand: Array | None = None):
    """Attention of T query tokens over one layer of a QuantSpecCache (quantized region + ring),
    with the Mosaic GPU kernel. Same semantics as `qspec_jax.attention.quantized_cache_attention`.

    q: [B, T, Hq, D] (roped); q_pos: int32[B, T]; layer: int or traced int32 scalar.
    interpret: run the kernel in GPU interpret mode (CPU); it then uses the SMEM-operand twin.
    inputs: `kernel_inputs(q_pos, cache, n_rep)` of this call's q_pos and cache, computed once per
    pass by a caller that attends every layer with the same positions (default: computed here);
    their shapes are checked, their values cannot be.
    q_operand: the queries already in the warp-specialized kernel's operand layout
    (`query_operand_shape`, bf16; `takes_query_operand` says when), as the draft's fused qkv
    kernel writes them; q then only gives the shapes and the output dtype (an array or a
    jax.ShapeDtypeStruct).
    Returns [B, T, Hq, D] in q's dtype, or the raw partials (o [B, Hkv, P, CN, D], ml
    [B, Hkv, P, 64, CN]; see `merge_heads`) with return_partials.
    """
    reason = unsupported_reason(q.shape, cache, view)
    if reason:
        raise ValueError(f"Mosaic GPU decode attention: {reason}")
    L, B, hkv, S, dh = cache.k_hi.shape
    D = 2 * dh
    b, t, hq, _ = q.shape
    if q_pos.shape != (b, t):
        raise ValueError(f"q_pos must be [B, T] = {(b, t)}, got {q_pos.shape}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window={sliding_window} must be positive")
    n_rep = hq // hkv
    G, R = cache.group_size, cache.ring_size
    window = None if sliding_window is None or sliding_window >= S + R else int(sliding_window)
    cfg = config or MgpuConfig()
    C = column_tiles(n_rep, t)
    CN = C * NT
    register_a = (not interpret) if cfg.register_a is None else bool(cfg.register_a)
    if register_a and interpret:
        raise ValueError("the register-operand path does not run in interpret mode; use register_a=False")
    from pallas_kernels.decode_attention import mosaic_gpu_ws as ws

    c_max = column_tiles(n_rep, max(t, cache.gamma_max + 1))
    ws_schedule = resolve_schedule(cfg, view, D, G, c_max, cache.k_scale.dtype, cache.k_fp.dtype) == "ws"
    st_ws = None
    if ws_schedule:
        st_ws = ws.static_config(B, hkv, D, G, R, S, C, c_max, view, window, register_a, bool(interpret),
                                 cache.k_scale.dtype, cache.k_fp.dtype, cfg, cols=n_rep * t, n_rep=n_rep, tokens=t,
                                 out_dtype=q.dtype)
        kernel = ws.build(st_ws)
    else:
        ns, nr = default_splits(B, hkv, S, G, R, D, view, cfg)
        stages = cfg.stages or (2 if view == "target" else 4)  # H200 sweep, docs/kernel_notes.md
        st = _Static(view=view, B=B, H=hkv, D=D, G=G, R=R, C=C, NS=ns, NR=nr, stages=stages,
                     window=window, register_a=register_a, interpret=bool(interpret),
                     no_auto_barriers=register_a and not cfg.auto_barriers,
                     scale_dtype=jnp.dtype(cache.k_scale.dtype), fp_dtype=jnp.dtype(cache.k_fp.dtype))
        kernel = _build(st)

    # Queries: [B, Hkv, D, CN], column n = t * n_rep + r; legacy: float32 pre-scaled by
    # log2(e)/sqrt(D); ws: raw bfloat16 (the scale is folded into the key scales in the kernel).
    if q_operand is not None:
        if not ws_schedule:
            raise ValueError("q_operand: only the warp-specialized schedule takes a prepared query operand")
        want = query_operand_shape(q.shape, hkv)
        if q_operand.shape != want or q_operand.dtype != jnp.bfloat16:
            raise ValueError(f"q_operand must be bfloat16 {want} (query_operand_shape); got {q_operand.dtype} "
                             f"{q_operand.shape}")
        qg = q_operand
    else:
        if ws_schedule:
            qg = q.astype(jnp.bfloat16).reshape(b, t, hkv, n_rep, D)
        else:
            qg = q.astype(jnp.float32).reshape(b, t, hkv, n_rep, D) * (LOG2E / math.sqrt(D))
        qg = jnp.transpose(qg, (0, 2, 4, 1, 3)).reshape(b, hkv, D, t * n_rep)
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, CN - t * n_rep)))
    inputs = inputs if inputs is not None else kernel_inputs(q_pos, cache, n_rep)
    meta, pos = inputs["meta"], inputs["pos"]
    if meta.shape != (B, 3) or pos.shape != (B, pos_width(CN)):
        raise ValueError(f"inputs do not match this call: meta {meta.shape}, pos {pos.shape}; expected "
                         f"{(B, 3)} and {(B, pos_width(CN))} (kernel_inputs(q_pos, cache, n_rep={n_rep}))")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    lbh = L * B * hkv
    flat = lambda x: x.reshape(lbh, *x.shape[3:])  # noqa: E731  (free: row-major reshapes)
    kplanes = [cache.k_hi, cache.k_lo] if view == "target" else [cache.k_hi]
    vplanes = [cache.v_hi, cache.v_lo] if view == "target" else [cache.v_hi]
    args = [layer, meta, pos, qg,
            *[flat(x) for x in kplanes],
            *[x.reshape(lbh, (S // G) * D, G // 2) for x in vplanes],
            flat(cache.k_scale), flat(cache.k_zero),
            cache.v_scale.reshape(lbh, S), cache.v_zero.reshape(lbh, S),
            flat(cache.k_fp), flat(cache.v_fp)]
    if ws_schedule and st_ws.flat:  # the balanced schedule's work split (per pass when `inputs` has it)
        want = {"ws_pairs": (B * hkv, 3), "ws_ctas": (st_ws.flat_ctas, 4)}
        if all(k in inputs and inputs[k].shape == v for k, v in want.items()):
            pairs, ctas = inputs["ws_pairs"], inputs["ws_ctas"]
        else:
            pairs, ctas = ws.work_of(meta[:, 0], hkv, G, st_ws.flat_ctas, st_ws.flat_cap, st_ws.ring_w,
                                     st_ws.geo_blocks)
        args += [pairs, ctas]
    if ws_schedule and st_ws.kernel_merge:  # the split merge in the kernel: its output, no XLA merge
        if return_partials:
            raise ValueError("return_partials: the in-kernel split merge (ws_kernel_merge) returns the output only")
        counters = inputs.get("merge_counters")
        if counters is None:  # a call of its own: fresh zeros (a caller looping over layers passes one ref per pass)
            return jax.jit(lambda args, z: kernel(*args, jax.new_ref(z, memory_space=plgpu.GMEM))[-1])(
                args, merge_counters_zeros(B, hkv)).reshape(b, t, hq, D)
        return kernel(*args, counters)[-1].reshape(b, t, hq, D)
    o, ml = kernel(*args)[:2]  # ("ws" with ws_pair_merge: the consumers' exchange buffers follow)
    if return_partials:
        return o, ml
    return merge_heads(o, ml, t, n_rep, merge_of(cfg)).astype(q.dtype)
