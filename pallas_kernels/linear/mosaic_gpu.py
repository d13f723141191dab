"""Pallas Mosaic GPU skinny GEMMs for Hopper: out [M, N] = x [M, K] @ W [K, N] at decode-sized M.

Both kernels compute out^T = W^T x^T: the weight tile is the MMA's A operand (64 rows of N per
warpgroup, 16 per warp) and the activation rows, padded to M_pad = 8 * ceil(M / 8), are the B
operand (MMA N = M_pad; the INT4 "mma" kernel issues one n8 MMA per 8 columns), so M = 1..8 cost
the same and M = 16 little more.

* `int4_matmul_mgpu`: W in INT4 (`pallas_kernels.linear.layout.W4A16Packed`). Per 64-column k
  block a thread loads its 32 codes with one 16-byte shared-memory load and turns them into its A
  fragment in registers: per bf16 pair one shift, one lop3 (128 + U exactly), one bf16x2
  subtraction (U - 8 exactly) and one bf16x2 fma with (bf16(s), bf16(z + 8 s)): 15 instructions
  per 8 weights; each (group, row) scale record, stored as that bf16 pair, costs 2 more (byte
  permutes to (s, s) and (zc, zc)).
  No shuffle: the layout stores the nibbles in the fragment's own order.
  `variant`: "mma" (default: warp-level `mma.sync.m16n8k16`, activation fragments by `ldmatrix`),
  "wgmma" (the same registers as the register A operand of `wgmma`) or "smem", the SMEM-operand
  twin: the same layout, split-K ranges, reduction order and dequantization (jnp, in GPU interpret
  mode), written to shared memory and multiplied from there. GPU interpret mode cannot run the
  register kernels (inline Mosaic GPU code): CI runs the twin and replays the register kernels'
  per-thread work (their PTX, emulated) against the layout; tools/device/check_w4a16.py runs them.
* `bf16_matmul_mgpu`: W in bf16 [K, N] as stored (the wgmma reads the [k, 64] tile from shared
  memory transposed), for the target's dense linears.

Schedule (`MgpuConfig`, chosen by `default_config` from (K, N, G) and the device only, never
from M: a measured shape from `TUNED_SHAPES` where there is one, else the cost model): a grid of
(N / (64 wgs), splits) CTAs; each CTA has `wgs` compute warpgroups (64 rows each) and one
producer warpgroup that streams the weight tiles, the scale records and the x tile with TMA
through a `stages`-deep ring of shared-memory buffers (full / empty mbarriers). CTA (j, s) sums
k in [s K/S, (s+1) K/S) in order, 16 columns per MMA step, into a float32 accumulator; with
`k_groups` G > 1, G warpgroups per row tile take the CTA's k steps round-robin and add their
accumulators in the CTA (p_0 + p_1 + ...; more warps per row tile without a split-K sum).
With splits S > 1 the partials are summed in a fixed order, p[0] + p[1] + ... + p[S-1], either by
an unrolled XLA sum of float32 partials [S, M, N] ("gmem"), inside the kernel across the CTAs
of a thread-block cluster through distributed shared memory ("cluster", the model's default), or
inside the kernel by the last split of each column tile, which waits on a global-memory semaphore
for the other splits' partials and reads them from a global workspace ("sem": no cluster to
co-schedule and no XLA kernel; checked bit for bit against "gmem" on the H100): never atomics on
the data. The orders are the same, so all three give the same bits.

Fused glue (issue 32, `Epilogue`; `epilogue_reference` is its math): the INT4 kernel can fold an
RMSNorm of x into the product (the producer warpgroup scales each landed x tile and sums x^2, or,
for small K, the consumers do it in their activation fragments: `norm_in_consumers`),
return SiLU(gate)·up of a gate | up weight (warpgroups 0 and 1 of a CTA pair the halves), and add
a residual in its store: the draft layer's glue without XLA kernels between the linears. The q|k|v
product can also RoPE its heads and write them where the decode attention reads them
(`int4_qkv_cache_mgpu`: the query operand and the FP rings, aliased in and out).

Row invariance (issue 11): every choice above depends on (K, N, G) only, the columns of an MMA
are independent, and padding rows are zeros (TMA out-of-bounds fill) or never stored, so row i
of a call with M rows equals the same row computed alone, bit for bit; `tests/test_w4a16_mgpu.py`
checks it in interpret mode and tools/device/check_w4a16.py on the GPU.

Measured (H200, docs/kernel_notes.md "W4A16 (Mosaic GPU, H200)"): the INT4 kernels stream their
code words at <= ~1.95 TB/s because TMA copies them as 16-byte rows (`tma_view="thread"`);
`tma_view="wide"` copies the same bytes as 1-KB rows and is the default of `default_config`
since it checked out and timed faster on the H200 (gate_up 2.60 vs 1.85 TB/s).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _common
from pallas_kernels.linear import layout as lay

Array = jax.Array

MAX_M = 64  # rows per call (M_pad <= 64; larger M is prefill: use a dense GEMM)
DENSE_MAX_M = 4 * MAX_M  # rows of a plain bf16 call, in row blocks of at most MAX_M (`dense_blocks`)
SMEM_BUDGET = 200 * 1024  # bytes of pipeline buffers per CTA (the H100/H200 limit is 227 KB)
SMEM_LIMIT = 219 * 1024  # all of a CTA's scratch: the 227 KB opt-in limit less barriers and alignment
REDUCE_MODES = ("gmem", "cluster", "sem")
MAX_CLUSTER = 8  # portable cluster size: the most CTAs a "cluster" split-K reduction spans
VARIANTS = ("mma", "wgmma", "smem")  # register A + mma.sync | register A + wgmma | SMEM twin
SWIZZLE = 128  # bytes: 64 bf16 per swizzled row, the wgmma k group
# TMA views of the code words. Each (row tile, k block) is 512 contiguous u32 (2 KB) and TMA
# copies a box row by row along its innermost dimension. "thread" views them as the layout's
# [128 threads, 4 words] (16-byte rows): measured on the H200, that copy streams at most ~1.95
# TB/s even with all compute removed (docs/kernel_notes.md, run 3). "wide" views the same bytes
# as [2, 256] (1-KB rows; a free reshape): the diagnosed fix, lowered but NOT yet run on a GPU,
# so it is opt-in until tools/device/check_w4a16.py has checked and timed it.
TMA_VIEWS = {"thread": (lay.THREADS, lay.WORDS), "wide": (2, 256)}


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Launch shape. Only `splits` changes the arithmetic (the partial sums); every field comes
    from (K, N, G) in `default_config`, never from M, except `stages` (buffer count only)."""

    wgs: int = 2  # compute warpgroups per CTA: 64 * wgs rows of N per CTA (1, 2 or 4)
    k_tile: int = 256  # k columns per pipeline stage (a multiple of 64 and of the group size)
    splits: int = 1  # split-K factor S (divides K / k_tile)
    stages: int = 4  # pipeline depth (shared-memory buffers in flight)
    # split-K partial sum, in a fixed order: "gmem" (XLA) | "cluster" (in-kernel, DSMEM) | "sem" (in-kernel,
    # the last split of each tile adds the others' partials from global memory once a semaphore says so)
    reduce: str = "gmem"
    tma_view: str = "thread"  # TMA view of the code words: "thread" [128, 4] | "wide" [2, 256]
    diag: str = ""  # timing experiments on the "mma" kernel only (see mma_stage); "" in real use
    # Programmatic dependent launch (jax >= 0.11 launches a kernel that waits on its grid
    # dependency with the PDL attribute): the producer streams the first `stages` weight tiles,
    # which no earlier kernel writes, before `griddepcontrol.wait`, and only then the activation
    # tiles, so the weight fetch can overlap the previous kernel's tail. Off by default: on the
    # H200 it sped up back-to-back Mosaic kernels (lm_head 128.5 -> 116.4 us) but in the model,
    # where XLA fusions (which never trigger their dependents early) sit between the linears, the
    # draft step measured 3.25 ms with it and 3.17 ms without (docs/kernel_notes.md). Never in
    # interpret mode.
    pdl: bool = False
    # Fused norm: steps the producer's norm pass runs ahead of the consumers (at most stages - 1; no pass
    # where the consumers run the norm, `norm_in_consumers`).
    # 1: step j + 1 is normalized while the consumers work on step j, so the pass sits on their
    # path once per step (SmolLM2 at M 32: consumers waiting 10x as often as without the norm,
    # Nsight Compute 2026-11-27); more leaves the TMA fewer steps of slack. Being measured.
    norm_ahead: int = 1
    # Independent accumulator chains of the "mma" kernel per stage: k16 step s of a stage goes into
    # chain s % mma_chains (chain 0 carries the running sum, the others start at zero) and the stage
    # ends with ((c0 + c1) + c2) + ...; 1 is one dependent chain of KT/16 mma.sync per column tile.
    # Changes the float32 summation order only (fixed per config, never dependent on M). H200,
    # 2026-11-28, draft step at 4k, batch 1: INT4 linears 2.184 ms with 1 chain, 2.072 with 2, 2.074
    # with 4 (down 593 -> 518 us, o 250 -> 228); docs/kernel_notes.md.
    mma_chains: int = 2
    # Consumer warpgroups per row tile: the CTA's k steps dealt round-robin to `k_groups` warpgroups of
    # its `wgs` row tiles (step i to group i % k_groups, each with its own slots of the ring), whose
    # float32 partials the group-0 warpgroup adds in group order, p_0 + p_1 + ..., in shared memory
    # before the split-K sum and the epilogue. More warps streaming a row tile at the same CTA count
    # and no global sum (the split-K sums cost a kernel or a cluster barrier); changes the float32
    # summation order only (fixed per config, never dependent on M). 1: one warpgroup per row tile.
    k_groups: int = 1

    def replace(self, **kw: Any) -> "MgpuConfig":
        return dataclasses.replace(self, **kw)


MAX_FUSED_M = MAX_M  # rows of a call with a fused epilogue (see `Epilogue`: above 24, the wide exchange)
PLAIN_EXCHANGE_MP = 24  # M_pad up to which [64, M_pad] float32 tiles go through shared memory untransformed
# Rows up to which "auto" dispatch and the model fuse an epilogue into the kernel (`auto_fused_rows`).
# Every fused kernel is checked on the GPU up to 64 rows (tools/device/check_w4a16.py --fused-m
# 1,16,32,64 --fused-cases 8b,smollm2; H100, 2026-11-27), but above 24 rows (the wide exchange) only
# the residual pays for itself: SmolLM2 at batch 32 (H100, in the draft step) o / down with the
# residual 4.6 / 6.4 us against 4.3 / 6.1 plain plus a ~1.3 us XLA add each; qkv with the norm 6.7
# us and gate_up with norm and SiLU·up 8.4 us against 4.2 / 4.4 plus ~3 us of XLA glue, a wash that
# measured slower in the speculative loop (docs/kernel_notes.md).
AUTO_FUSED_M = 24  # epilogues with the norm or SiLU·up
AUTO_RESIDUAL_M = MAX_FUSED_M  # a residual add alone
# Rows up to which the draft's q|k|v-into-the-cache kernel (`int4_qkv_cache_mgpu`, with the norm it needs, and then
# gate_up's norm and SiLU·up too: `qspec_jax.linear.fused_norm_rows`) runs by default, per head dim where it is more
# than AUTO_FUSED_M. 64 (SmolLM2's, a head per warpgroup): checked on the H200 at 32 rows (tools/device/
# qkv_cache_gpu.py --batches 32: kernel against its reference, deterministic, other ring slots bitwise; the model's
# draft step against the unfused one), and there the whole layer's fusion pays: SmolLM2 shape, batch 32, draft step
# 2.124 -> 1.990 ms (466 -> 228 launches), QuantSpec loop 3.398 -> 3.035 ms per token (2026-11-30, docs/kernel_notes.md,
# twenty-third session). 128 (two warpgroups per head) stays at PLAIN_EXCHANGE_MP: its halves' exchange does not lower
# above it (`_qkv_geometry`).
QKV_CACHE_FUSED_M = {64: 32}
# Above this many rows (per head dim) the qkv epilogue without a norm (the target's bf16 q|k|v, `bf16_qkv_cache_mgpu`:
# the verify's B x T rows, 96 at SmolLM2's batch 32 and γ 2) runs its rows in blocks of that many, one grid axis of
# blocks: each CTA is the checked 32-row CTA (M_pad 32 in every scratch), x, the RoPE table and the slots are read
# at the block's rows, the query operand and ring writes index by the global row (`qkv_blocks`). Up to QKV_MAX_M rows.
QKV_BLOCK_ROWS = {64: 32}
QKV_MAX_M = 128
# Elements of each buffer [L, B, Hkv, R, D] the qkv epilogue writes into: its stores index the flat buffer in int32.
QKV_MAX_BUFFER_ELEMENTS = 2 ** 31 - 1


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """Glue fused into the INT4 kernel around out = x W (static; `epilogue_reference` is the math).

    * `norm`: RMSNorm of the input folded in. The producer warpgroup multiplies each landed x tile
      by the norm weight in place (bf16(x g), the MMA's operand) and sums x^2 per row in float32;
      the accumulator is scaled by r = rsqrt(sum x^2 / K + eps) before anything else:
      out = r (bf16(x g) W). A row's sum has a fixed order (per thread over its stage pairs, a
      warp butterfly, then warps 0 + 1 + 2 + 3; split-K ranks in rank order), independent of M.
      Where `norm_in_consumers` (the "mma" variant, K <= CONSUMER_NORM_MAX_K) the consumers scale
      their B fragments (the same bf16(x g)) and sum x^2 from them in another fixed order
      (`fragment_sum_plan`), also independent of M.
      `gain` False: the norm has no weight (g = 1: the draft's norm weights folded into its INT4
      weights, `qspec_jax.weight_quant`'s `fold_norms`), so there is no g operand, no g loads and
      no multiply: out = r (x W), bit for bit what a weight of ones gives (bf16(x 1) = x).
      `sums`: the rows' sums of x^2 come in (`norm_sums` float32 [P, M_pad]: P partial sums of each
      row, e.g. of column chunks of x, added in the order p = 0, 1, ..., P - 1 into the row's sum)
      and the kernel sums no x^2: where x is formed by a kernel or an XLA fusion that can sum it
      on the way (the draft's layer loop, `qspec_jax.model`). In the consumers only (on the GPU:
      `norm_in_consumers`; interpret mode's pass takes them instead of its own sums).
    * `swiglu`: the weight holds gate | up column halves (N = 2F): warpgroup 0 of CTA j computes
      gate columns [64 j, 64 j + 64), warpgroup 1 the same up columns, and out [M, F] =
      silu(gate) up in float32 (silu(a) = a / (1 + exp(-a))), rounded once.
    * `residual`: out = bf16(acc) + res in the output dtype (one rounding of the sum of two
      output-dtype values, i.e. the unfused `linear(x, W) + res` bit for bit).
      `row_sums` (with `residual`): the kernel also returns what the next RMSNorm of out needs,
      the rows' sums of out^2 per 64-column tile, float32 [N / 64, M_pad] (`chunk_row_sums` is
      the math; rows >= M are 0): the next norm kernel's `norm_sums` (`sums`), so that kernel
      sums no x^2. Each warpgroup sums its tile's rows from the output tile in shared memory
      after the residual add (`_tile_row_sums`: a warp per row, a lane per two columns, a
      butterfly: a fixed order per row, independent of M); where XLA adds the residual (split-K
      partials summed by XLA) XLA forms them in the same fusion.
    * `qkv` (`QkvCache`): no out [M, N]; the (normed) float32 product of each 128-channel head is
      RoPE'd (query and key heads, float32, the table's cos and sin) and stored in bf16 into the
      attention's query operand or the FP rings (`int4_qkv_cache_mgpu`, `qkv_cache_reference`).

    The in-kernel parts exchange [64, M_pad] float32 tiles through shared memory in the WGMMA
    layout: untransformed up to M_pad = 24, above in swizzled tiles (`exchange_transforms`; the
    norm's row sums then as one [M_pad] vector, broadcast over the 64 rows). The split-K sum in a
    cluster stays at M_pad <= 24 (`reduce_mode`). Norm and swiglu need the whole K sum in one CTA
    (splits == 1) or an in-kernel split-K sum (a cluster, or the last split's: "sem", which also
    adds the splits' row sums x^2 in rank order); a residual with split-K partials summed
    by XLA ("gmem") is added by XLA after the sum, with the same formula."""

    norm: bool = False
    eps: float = 1e-5
    gain: bool = True  # norm: x is multiplied by the norm weight g (False: no weight, g = 1)
    sums: bool = False  # norm: the rows' sums of x^2 are an input (norm_sums [P, M_pad]), not computed
    swiglu: bool = False
    residual: bool = False
    row_sums: bool = False  # residual: also the rows' sums of out^2 per 64-column tile, [N / 64, M_pad] float32
    qkv: "QkvCache | None" = None

    def __bool__(self) -> bool:
        return self.norm or self.swiglu or self.residual or self.qkv is not None

    def replace(self, **kw: Any) -> "Epilogue":
        return dataclasses.replace(self, **kw)

    def tag(self) -> str:
        """Kernel-name suffix ("" for the plain kernel)."""
        parts = (("_norm", self.norm), ("1", self.norm and not self.gain), ("s", self.norm and self.sums),
                 ("_swiglu", self.swiglu),
                 ("_res", self.residual), ("q", self.residual and self.row_sums), ("_qkvcache", self.qkv is not None))
        return "".join(t for t, on in parts if on)


@dataclasses.dataclass(frozen=True)
class QkvCache:
    """Static geometry of the qkv epilogue (`Epilogue.qkv`, `int4_qkv_cache_mgpu`): instead of
    out [M, N], the kernel writes what the decode attention reads, for M = B T rows, T new tokens
    of each batch row (row m = b T + t): RoPE'd query heads into the attention's query operand
    [B, Hkv, D, CN] (column t n_rep + r of KV head h for query head h n_rep + r of token t, other
    columns untouched), RoPE'd key heads and the value heads into ring slot `slots[m]` of layer
    `layer` of the FP rings [L, B, Hkv, R, D].
    The weight's columns are q | k | v heads of D channels. D = 128 (QKV_HEAD_DIM): one CTA of
    two warpgroups per head (channels 0..63 and 64..127: RoPE's rotate-half pairs row r of one
    with row r of the other). D = 64 (SmolLM2): one warpgroup per head (its rows r and r + 32
    pair), one or two per CTA."""

    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    batch: int  # B = M
    ring: int  # R, ring slots
    q_cols: int  # CN, the query operand's columns per KV head (>= Hq / Hkv)
    layers: int  # L of the rings
    head_dim: int = 128  # D, one of QKV_HEAD_DIMS
    tokens: int = 1  # T, new tokens per batch row (M = B T)


QKV_HEAD_DIM = 2 * 64  # the qkv epilogue's two-warpgroup head dim: one head per CTA of two 64-row warpgroups
QKV_HEAD_DIMS = (64, QKV_HEAD_DIM)  # head dims the qkv epilogue takes (64: one head per warpgroup)


def auto_fused_rows(epi: Epilogue) -> int:
    """Rows up to which "auto" dispatch (and the model, `qspec_jax.linear.fusable`) runs `epi`
    inside the kernel: AUTO_FUSED_M with the norm or SiLU·up, AUTO_RESIDUAL_M for a residual alone."""
    return AUTO_FUSED_M if (epi.norm or epi.swiglu) else AUTO_RESIDUAL_M


def epilogue_reference(x: Array, w: Array, epi: Epilogue, *, norm_weight: Array | None = None,
                       residual: Array | None = None, out_dtype: Any = None, norm_sums: Array | None = None) -> Array:
    """jnp: what the fused INT4 kernel computes for x [M, K] and the weight as its MMA sees it,
    w [K, N] float32 (the bf16 dequantization for the Mosaic kernel, `lay.dequantize_bf16`).
    float32 with HIGHEST-precision dots; see `Epilogue` for the math (`norm_sums` [P, M_pad] with
    `epi.sums`; with `epi.row_sums` the pair (out, `chunk_row_sums(out, rows_for(M))`))."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    xf = x.astype(jnp.float32)
    if epi.norm and epi.sums:
        ss = norm_sums[0, :x.shape[0]]
        for p in range(1, norm_sums.shape[0]):  # in order p = 0, 1, ...
            ss = ss + norm_sums[p, :x.shape[0]]
        r = lax.rsqrt(ss[:, None] * (1.0 / x.shape[-1]) + epi.eps)
    elif epi.norm:
        r = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + epi.eps)
    if epi.norm and epi.gain:
        xf = (xf * norm_weight.astype(jnp.float32)).astype(jnp.bfloat16).astype(jnp.float32)
    acc = jnp.dot(xf, w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    if epi.norm:
        acc = acc * r
    if epi.swiglu:
        gate, up = jnp.split(acc, 2, axis=-1)
        acc = gate / (1.0 + jnp.exp(-gate)) * up
    out = acc.astype(out_dtype)
    if epi.residual:
        out = out + residual.astype(out_dtype)
    if epi.row_sums:
        return out, chunk_row_sums(out, rows_for(x.shape[0]))
    return out


def chunk_row_sums(y: Array, rows: int) -> Array:
    """The rows' sums of y^2 per 64-column chunk: y [M, N] (N a multiple of 64) -> float32
    [N / 64, rows] (rows >= M: 0), sums[c, m] = sum_j y[m, 64 c + j]^2 in float32. What a norm
    kernel takes as `norm_sums` for RMSNorm(y) (`Epilogue.sums`; it adds the chunks in order c = 0,
    1, ...), and what the residual kernels write with `Epilogue.row_sums` (in their own order
    inside a chunk: equal up to float32 rounding)."""
    m, n = y.shape
    if n % lay.ROWS or rows < m:
        raise ValueError(f"chunk_row_sums: y [{m}, {n}] needs N a multiple of {lay.ROWS} and rows >= {m}, got {rows}")
    yf = y.astype(jnp.float32)
    if jnp.dtype(y.dtype) == jnp.bfloat16:  # y's own values: XLA may drop a bf16 rounding inside a fusion
        yf = lax.reduce_precision(yf, exponent_bits=8, mantissa_bits=7)
    sums = jnp.sum((yf * yf).reshape(m, n // lay.ROWS, lay.ROWS), axis=-1).T  # [N / 64, M]
    return jnp.pad(sums, ((0, 0), (0, rows - m)))


def exchange_transforms(mp: int) -> tuple:
    """Shared-memory transforms of a [64, M_pad] float32 tile that a warpgroup stores and another
    loads in the WGMMA layout. Up to PLAIN_EXCHANGE_MP none (Mosaic plans a conflict-free plain
    transfer); above, it finds none ("Failed to synthesize a transfer pattern that avoids bank
    conflicts"), but one for the tile in 8 x w tiles with a 4w-byte swizzle (w = 32, 16 or 8,
    the widest dividing M_pad; lowered for CUDA at M_pad 8..64, jax 0.10.2 and 0.11.2)."""
    if mp <= PLAIN_EXCHANGE_MP:
        return ()
    w = next(w for w in (32, 16, 8) if mp % w == 0)
    return (plgpu.TilingTransform((8, w)), plgpu.SwizzleTransform(4 * w))


def rows_for(m: int) -> int:
    """M_pad: the wgmma N for M activation rows (a multiple of 8)."""
    return 8 * max(1, -(-m // 8))


def qkv_blocks(m: int, head_dim: int) -> tuple[int, int]:
    """(row blocks, rows per block M_pad) of the qkv epilogue at M rows of `head_dim`-channel heads: one block of
    rows_for(M), or above QKV_BLOCK_ROWS[head_dim] rows blocks of that many (`QKV_BLOCK_ROWS`)."""
    block = QKV_BLOCK_ROWS.get(head_dim)
    if block is None or m <= block:
        return 1, rows_for(m)
    return -(-m // block), block


def dense_blocks(m: int) -> tuple[int, int]:
    """(row blocks, rows per block M_pad) of a plain bf16 call at M rows (`bf16_matmul_mgpu`): one block of
    rows_for(M) up to MAX_M rows, else the fewest blocks of at most MAX_M rows, of equal size (96 rows: 2 x 48),
    one grid axis of them in one launch (each CTA the kernel at M_pad rows: rows do not depend on the block)."""
    if m <= MAX_M:
        return 1, rows_for(m)
    nb = -(-m // MAX_M)
    return nb, rows_for(-(-m // nb))


def bf16_qkv_max_rows(head_dim: int) -> int:
    """Rows up to which `bf16_qkv_cache_mgpu` runs checked for `head_dim`-channel heads: QKV_MAX_M where its rows go in
    blocks (`QKV_BLOCK_ROWS`), else the rows the draft's q|k|v kernel is checked at (QKV_CACHE_FUSED_M, or
    AUTO_FUSED_M)."""
    return QKV_MAX_M if head_dim in QKV_BLOCK_ROWS else QKV_CACHE_FUSED_M.get(head_dim, AUTO_FUSED_M)


def qkv_rows(m: int, head_dim: int) -> int:
    """Rows of the qkv epilogue's RoPE table and slots for M rows (`rope_table`): its blocks' rows together."""
    nb, mp = qkv_blocks(m, head_dim)
    return nb * mp


def _x_stage_bytes(mp: int, kt: int) -> int:
    return mp * kt * 2


def _w_stage_bytes(kind: str, wgs: int, kt: int, g: int | None) -> int:
    if kind == "bf16":
        return wgs * kt * lay.ROWS * 2
    return wgs * (kt * lay.ROWS // 2 + lay.ROWS * (kt // g) * 4)


def _stages_for(kind: str, cfg: MgpuConfig, mp: int, g: int | None, fit: tuple[int, int] | None = None) -> int:
    """Pipeline depth: cfg.stages, within SMEM_BUDGET for the weight and x stage buffers and, with
    `fit` = (bytes of the other scratch, bytes of all scratch per stage), within SMEM_LIMIT for the
    CTA's whole scratch (the output and epilogue tiles are up to ~60 KB at M_pad 64 with a norm);
    rounded down to a multiple of cfg.k_groups (each k group owns the slots of its residue)."""
    per = _w_stage_bytes(kind, cfg.wgs, cfg.k_tile, g) + _x_stage_bytes(mp, cfg.k_tile)
    limit = SMEM_BUDGET // per if fit is None else min(SMEM_BUDGET // per, (SMEM_LIMIT - fit[0]) // fit[1])
    st = max(2, min(cfg.stages, limit))
    return max(cfg.k_groups, st - st % cfg.k_groups)


def _smem_bytes(scratch: dict[str, Any]) -> int:
    """Shared-memory bytes of a scratch declaration (barriers not counted: SMEM_LIMIT leaves room)."""
    return sum(math.prod(v.shape) * jnp.dtype(v.dtype).itemsize for v in scratch.values() if hasattr(v, "shape"))


SM_BYTES_PER_US = 4.35e6 / 132  # bytes one SM streams per microsecond at the read ceiling
CTA_FIXED_US = 1.5  # per-CTA fill + drain (first TMA round trip, epilogue) not hidden by others
REDUCE_US = {"gmem": 2.0, "cluster": 0.5, "sem": 1.0}  # the split-K sum: an XLA kernel, in-kernel DSMEM or global


def predicted_us(k: int, n: int, group_size: int | None, cfg: MgpuConfig, num_sms: int = 132) -> float:
    """The cost model `default_config` minimises (microseconds, read ceiling): waves of CTAs
    streaming their tiles, a fixed cost per CTA round that co-resident CTAs hide, and the
    split-K reduction. Rough by design; the benchmark measures."""
    bpe = 2.0 if group_size is None else 0.5 + 4.0 / group_size  # weight bytes per element
    ctas = n // (lay.ROWS * cfg.wgs) * cfg.splits
    per_cta = lay.ROWS * cfg.wgs * (k // cfg.splits) * bpe
    kind = "bf16" if group_size is None else "int4"
    smem = _stages_for(kind, cfg, 16, group_size) * (_w_stage_bytes(kind, cfg.wgs, cfg.k_tile, group_size)
                                                     + _x_stage_bytes(16, cfg.k_tile))
    resident = max(1, min(2, 227 * 1024 // max(smem, 1)))
    waves = -(-ctas // num_sms)
    t = waves * per_cta / SM_BYTES_PER_US + CTA_FIXED_US * -(-ctas // (num_sms * resident))
    return t + (REDUCE_US[cfg.reduce] if cfg.splits > 1 else 0.0)


def epilogue_allows(epi: Epilogue | None, wgs: int, splits: int, reduce: str) -> bool:
    """Whether a launch shape can run epilogue `epi` (see `Epilogue`): norm and swiglu need the
    whole K sum inside the kernel (one split, the cluster sum or the last split's "sem" sum);
    swiglu and the qkv epilogue of 128-channel heads pair warpgroups 0 and 1; that of 64-channel
    heads takes one or two warpgroups (a head each)."""
    if not epi:
        return True
    whole_k = splits == 1 or reduce in ("cluster", "sem")
    if (epi.norm or epi.swiglu or epi.qkv is not None) and not whole_k:
        return False
    if epi.qkv is not None and epi.qkv.head_dim != QKV_HEAD_DIM:
        return wgs in (1, 2)
    return not (epi.swiglu or epi.qkv is not None) or wgs == 2


# Measured launch shapes that beat the cost model, per device kind (a substring of
# `jax.Device.device_kind`) and INT4 weight (K, N, G): (wgs, k_tile, splits, reduce[, k_groups,
# stages]) (k_groups 1 and 4 stages where not given). Each entry
# comes from `tools/device/w4a16_config_sweep.py` (every valid shape timed, 4 stages, the split's
# XLA sum included) and is used where it can run the call's epilogue (`epilogue_allows`) and its
# reduction (a "cluster" entry only where the call allows cluster sums). From (K, N, G) only, never
# from M, like the model.

# SmolLM2's K-576 INT4 draft linears at k_tile 192 (3 steps, all of K in flight at once) instead of 64 (9 steps), the
# same shapes on both cards. H200, 2026-11-30 (docs/bench/*_h200_2026-11-30e*): the draft step at batch 32, 8k
# (`tuned_table_run.py --linear-config k_tile=192 --linear-k 576`): gate_up 243.4 -> 220.9 us, q|k|v 226.2 -> 215.5,
# o 137.3 -> 120.0, wall 1.964 -> 1.896 ms; the lm_head (576, 49152) 15.6 -> 16.4 us, so it keeps the cost model's
# k_tile 64. H100, 2026-12-06 (docs/bench/kt192_smollm2_b32_h100_2026-12-06e.log, `STAGES=kt192`: checked on fresh
# inputs, then the draft step at batch 32, 8k): q|k|v 205.2 -> 190.0 us, gate_up 203.4 -> 187.6, o 135.6 -> 121.7,
# wall 1.856 -> 1.811 ms.
_SMOLLM2_K576_INT4 = {(576, 960, 32): (1, 192, 1, "cluster"), (576, 3072, 32): (2, 192, 1, "cluster"),
                      (576, 576, 32): (1, 192, 1, "cluster")}
# SmolLM2's bf16 target linears (G None) at the cost model's own shapes (6 stages; the same on both cards), entered
# so that "auto" takes our kernel for them (`qspec_jax.linear.dense_uses_kernel`), ms a token at 8k, `--dense-matmul
# xla -> mosaic`. H100, 2026-12-06 (docs/bench/dsf_smollm2_*_h100_2026-12-06c.log): batch 1 AR 1.121 -> 1.069, γ 2
# 1.283 -> 1.213 (the stack read in place, replacing XLA's own matrix-vector reduce fusions at the AR step's one row
# and, at the verify's three, cuBLAS on a dynamic slice of the stack, whose command buffer XLA re-records every
# layer); at batch 32 (above DENSE_AUTO_MAX_ROWS) even. H200, 2026-12-06 (docs/bench/
# dsf_smollm2_b1_b8_8k_h200_2026-12-06f.log, two alternating trials): batch 1 AR 1.105 / 1.112 -> 1.060 / 1.054, γ 2
# 1.236 / 1.236 -> 1.159 / 1.164; batch 8 AR 1.319 / 1.332 -> 1.253 / 1.249, γ 2 1.344 / 1.343 -> 1.358 / 1.349 (even).
_SMOLLM2_BF16 = {(576, 960, None): (1, 64, 1, "cluster", 1, 6), (576, 576, None): (1, 64, 1, "cluster", 1, 6),
                 (576, 3072, None): (1, 64, 1, "cluster", 1, 6), (1536, 576, None): (1, 128, 3, "cluster", 1, 6)}
TUNED_SHAPES: dict[str, dict[tuple[int, int, int], tuple]] = {
    # H100 SXM, jax 0.11.2, 2026-11-27 (docs/bench/w4a16_config_sweep_h100_2026-11-27.log), M = 1 / 8:
    # the 8B draft's down 19.6 / 21.8 us against 22.1 / 22.2 for the model's wgs 1, S 2 cluster (the
    # same shape with a cluster sum: 27.1 / 28.3). In the draft step (4k) down went 615 -> 508 us at
    # batch 1 and 606 -> 517 at batch 8 for ~42 us of XLA sums. o's best (wgs 2, S 8, gmem: 9.1 us
    # against 10.0) saved 38-42 us of kernel time and cost as much in XLA sums: not taken.
    "H100": {(14336, 4096, 32): (2, 256, 4, "gmem"), **_SMOLLM2_K576_INT4, **_SMOLLM2_BF16},
    # H200, jax 0.11.2, 2026-11-29 (docs/bench/*_h200_2026-11-29d*): the 8B draft's down and o with two k
    # groups per row tile (`MgpuConfig.k_groups`), the model's wgs 1, S 2 cluster otherwise. Stand-alone at
    # M = 1: down 19.86 -> 17.07 us (8 stages; the split sums through global memory ran 17.9-19.4 plus a
    # launch), o 8.26 -> 7.79 us (4 stages). In the draft step at 4k (`tuned_table_run.py`): batch 1 down
    # 522.8 -> 453.9 us, o 228.7 -> 216.8, wall 2.684 -> 2.599 ms; batch 8 wall 3.287 -> 3.177 ms; launches
    # unchanged. qkv with two k groups: no gain (342.9 -> 350.2 us), not taken.
    # The 8B target's bf16 q|k|v (G None) with the qkv epilogue, 2026-12-01 (docs/bench/*_h200_2026-12-01g*,
    # `qkv_cache_gpu.py --parts sweep`, kernel time from a trace, M = 5): 21.0 us for the cost model's wgs 2, k_tile
    # 64, S 8 cluster; 15.2 at k_tile 256, S 2 (S 4: 20.1, S 8: 25.6; cuBLAS's GEMM alone 17.6 there).
    # The 8B target's other bf16 linears, plain, 2026-12-02 (docs/bench/*_h200_2026-12-02a*, the same sweep, M = 1 / 5):
    # one split at k_tile 256 against the cost model's 2 cluster splits at k_tile 128 (64 for gate_up): o 10.84 ->
    # 9.77 / 9.78 us, gate_up (two warpgroups) 62.2 -> 55.6 / 56.3, down 29.6 -> 28.7 / 29.0 (floors 7.7, 54.0, 27.0).
    "H200": {(14336, 4096, 32): (1, 256, 2, "cluster", 2, 8), (4096, 4096, 32): (1, 256, 2, "cluster", 2, 4),
             (4096, 6144, None): (2, 256, 2, "cluster", 1, 4), (4096, 4096, None): (1, 256, 1, "cluster"),
             (4096, 28672, None): (2, 256, 1, "cluster"), (14336, 4096, None): (1, 256, 1, "cluster"),
             **_SMOLLM2_K576_INT4, **_SMOLLM2_BF16},
}


def tuned_config(k: int, n: int, group_size: int | None, *, device_kind: str | None = None,
                 reduce: str = "cluster", epilogue: Epilogue | None = None) -> "MgpuConfig | None":
    """The TUNED_SHAPES entry for this device and weight, if one applies, else None."""
    kind = _common.device_kind() if device_kind is None else device_kind
    for key, table in TUNED_SHAPES.items():
        if key in kind and (k, n, group_size) in table:
            wgs, kt, splits, red, *rest = table[k, n, group_size]
            kg, stages = rest if rest else (1, 4)
            red = red if splits > 1 else reduce  # one split sums nothing: any call's reduction runs it
            if (red == "cluster" and reduce != "cluster") or not epilogue_allows(epilogue, wgs, splits, red):
                return None
            return MgpuConfig(wgs=wgs, k_tile=kt, splits=splits, reduce=red, stages=stages, tma_view=_tma_view(),
                              pdl=_pdl(), mma_chains=_mma_chains(), k_groups=kg)
    return None


def _tma_view() -> str:
    # The code words' TMA view: "wide" (1-KB rows) by default, checked and timed on the H200
    # (gate_up M=1 G=32: 28.2 us vs 39.7 for "thread"); QSPEC_W4A16_TMA_VIEW=thread restores the old one.
    tma_view = os.environ.get("QSPEC_W4A16_TMA_VIEW", "wide")
    if tma_view not in TMA_VIEWS:
        raise ValueError(f"QSPEC_W4A16_TMA_VIEW={tma_view!r}; expected one of {tuple(TMA_VIEWS)}")
    return tma_view


def _pdl() -> bool:
    return os.environ.get("QSPEC_W4A16_PDL", "0") == "1"  # QSPEC_W4A16_PDL=1: programmatic launch (A/B)


MMA_CHAINS = (1, 2, 4)  # the values `MgpuConfig.mma_chains` takes (a power of two dividing KT/16 >= 4)
K_GROUPS = (1, 2, 4)  # the values `MgpuConfig.k_groups` takes


def _mma_chains() -> int:
    # QSPEC_W4A16_CHAINS=1|2|4: the "mma" kernel's accumulator chains per stage (default MgpuConfig's)
    v = os.environ.get("QSPEC_W4A16_CHAINS", str(MgpuConfig.mma_chains))
    if v not in map(str, MMA_CHAINS):
        raise ValueError(f"QSPEC_W4A16_CHAINS={v!r}; expected one of {MMA_CHAINS}")
    return int(v)


def default_config(k: int, n: int, group_size: int | None, *, num_sms: int | None = None,
                   reduce: str = "cluster", epilogue: Epilogue | None = None,
                   device_kind: str | None = None) -> MgpuConfig:
    """The launch shape for a [K, N] weight (`group_size` None: bf16 weights); from (K, N, G),
    the device and its SM count only, never from M. A measured shape (`tuned_config`, set
    QSPEC_W4A16_TUNED=0 to skip) where there is one; else the minimum of `predicted_us` over wgs
    in (2, 1), k_tile and splits (dividing K / k_tile, each split >= 2 steps and >= 512 columns;
    at most 8 splits for the cluster reduction); ties go to fewer splits, then two warpgroups,
    then larger k_tile. Only shapes that can run `epilogue` are considered (`epilogue_allows`)."""
    if os.environ.get("QSPEC_W4A16_TUNED", "1") != "0":
        tuned = tuned_config(k, n, group_size, device_kind=device_kind, reduce=reduce, epilogue=epilogue)
        if tuned is not None:
            return tuned
    sms = num_sms or _common.num_sms()
    kind = "bf16" if group_size is None else "int4"
    tma_view, pdl, chains = _tma_view(), _pdl(), _mma_chains()
    c = lay.KB if group_size is None else lay.chunk_cols(group_size)
    tiles_k = (256, 128, 64) if kind == "int4" else (128, 64)
    best, best_key = None, None
    for wgs in (2, 1):
        if n % (lay.ROWS * wgs):
            continue
        for kt in tiles_k:
            if kt % c or k % kt:
                continue
            steps = k // kt
            for s in range(1, min(steps, MAX_CLUSTER if reduce == "cluster" else 16) + 1):
                if steps % s or (s > 1 and (steps // s < 2 or k // s < 512)):
                    continue
                if not epilogue_allows(epilogue, wgs, s, reduce):
                    continue
                cfg = MgpuConfig(wgs=wgs, k_tile=kt, splits=s, reduce=reduce,
                                 stages=4 if kind == "int4" else 6, tma_view=tma_view, pdl=pdl,
                                 mma_chains=chains)
                key = (round(predicted_us(k, n, group_size, cfg, sms), 1), s, -wgs, -kt)
                if best_key is None or key < best_key:
                    best, best_key = cfg, key
    if best is None:
        raise ValueError(f"no Mosaic GPU launch shape for K={k}, N={n}, G={group_size} "
                         f"(K must be a multiple of {c}, N of {lay.ROWS})")
    return best


# ------------------------------------------------------------------------------ interpret mode
interpret_params = _common.interpret_params  # GPU interpret-mode parameters (CPU), shared by the Mosaic kernels


def _T(ref: Any) -> Any:
    """Transposed view of a 2-D ref (jax 0.11 spells it ref.T, 0.10 transpose_ref)."""
    if jax.__version_info__ >= (0, 11):
        return ref.T
    return plgpu.transpose_ref(ref, (1, 0))


# ----------------------------------------------------------------------- register dequantization
# PTX per uint32 word of 8 codes -> 4 bf16x2 A registers. Pair p is bits 4p and 16 + 4p. lop3 LUT
# 0xEA = (a & b) | c gives the bf16 pair 0x4300 | U = 128 + U exactly; 0x4308 = 136 removes
# 128 + 8 (exact: small integers), and one fma applies (s, z + 8 s) of the pair's row.
_CONVERT_ASM = """{
.reg .b32 t<4>, m;
mov.b32 m, 0x43084308;
lop3.b32 t0, $4, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t1, $4, 4;
lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t2, $4, 8;
lop3.b32 t2, t2, 0x000F000F, 0x43004300, 0xEA;
shr.u32 t3, $4, 12;
lop3.b32 t3, t3, 0x000F000F, 0x43004300, 0xEA;
sub.bf16x2 t0, t0, m;
sub.bf16x2 t1, t1, m;
sub.bf16x2 t2, t2, m;
sub.bf16x2 t3, t3, m;
fma.rn.bf16x2 $0, t0, $5, $6;
fma.rn.bf16x2 $1, t1, $7, $8;
fma.rn.bf16x2 $2, t2, $5, $6;
fma.rn.bf16x2 $3, t3, $7, $8;
}"""
# One scale record (bf16 s | bf16 zc << 16, the layout's kernel pair) -> bf16x2 (s, s) and (zc, zc):
# two byte permutes (layout version 1 stored float16 scale / zero: five instructions per record).
_SCALE_ASM = "prmt.b32 $0, $2, 0, 0x1010;\nprmt.b32 $1, $2, 0, 0x3232;"


def _mgpu_modules():
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental import mosaic as _mosaic  # noqa: F401
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu
    return ir, arith, llvm, mgpu, fa, mu


def _smem_addr(ref: Any) -> Any:
    """i32 shared-memory address of a memref (its dynamic offset folded in)."""
    ir, _, llvm, _, _, mu = _mgpu_modules()
    return llvm.ptrtoint(ir.IntegerType.get_signless(32), mu.memref_ptr(ref))


def _ld_shared(addr: Any, n: int) -> list[Any]:
    """`n` (1, 2 or 4) consecutive u32 words at a 4n-byte aligned shared address; one vector load.
    Side-effecting asm: the load stays after the mbarrier wait that publishes the data."""
    ir, _, llvm, _, _, _ = _mgpu_modules()
    i32 = ir.IntegerType.get_signless(32)
    outs = ",".join(f"${i}" for i in range(n))
    vec = "" if n == 1 else f".v{n}"
    asm = f"ld.shared{vec}.b32 {{{outs}}}, [${n}];" if n > 1 else "ld.shared.b32 $0, [$1];"
    res = llvm.inline_asm(llvm.StructType.get_literal([i32] * n) if n > 1 else i32, [addr], asm,
                          ",".join(["=r"] * n + ["r"]), has_side_effects=True)
    if n == 1:
        return [res]
    return [llvm.extractvalue(i32, res, [i]) for i in range(n)]


def block_plan(group_size: int, kb: int) -> tuple[int, int, list[int]]:
    """(kc, records, word_group) for k block `kb` of a stage: the scale chunk holding it, the u32
    words per thread record row (2 C/G) and, per word j, its group index inside the chunk."""
    c = lay.chunk_cols(group_size)
    gpc, kpc = c // group_size, c // lay.KB
    sub = kb % kpc
    return kb // kpc, 2 * gpc, [(sub * lay.KB + 16 * j) // group_size for j in range(lay.WORDS)]


def word_offset(kb: int, tid: int) -> int:
    """Byte offset of thread `tid`'s 4 code words of k block `kb` in a warpgroup's stage buffer."""
    return (kb * lay.THREADS + tid) * 16


def record_offset(kc: int, tid: int, records: int) -> int:
    """Byte offset of thread `tid`'s scale records (row pair tid // 4) of chunk `kc`."""
    return (kc * 32 + tid // 4) * 4 * records


def register_index(j: int, p: int) -> tuple[int, int]:
    """(8-column tile, row half) of the WGMMA-layout register that pair p of word j becomes."""
    return 2 * j + p // 2, p % 2


def _dequant_block(group_size: int, kb: int):
    """inline_mgpu function: (w_ref uint32 [KT/64, 128, 4] (or its [KT/64, 2, 256] TMA view), sz_ref uint32 [KT/C, 64 C/G]) of
    one warpgroup and stage -> the bf16 A fragment [64, 64] (WGMMA layout) of k block `kb`.
    Addresses and register placement come from `word_offset`, `record_offset`, `register_index`
    (pure functions that tests/test_w4a16_mgpu.py replays against the layout)."""
    kc, nrec, word_group = block_plan(group_size, kb)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((lay.ROWS, lay.KB), jnp.bfloat16,
                                                          layout=plgpu.Layout.WGMMA))
    def fn(ctx, w_ref, sz_ref):
        del ctx
        ir, arith, llvm, mgpu, fa, mu = _mgpu_modules()
        i32 = ir.IntegerType.get_signless(32)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        tid = arith.remui(mu.thread_idx(), mu.c(lay.THREADS, i32))
        # word_offset(kb, tid) = kb * 2048 + 16 tid
        w_addr = arith.addi(_smem_addr(w_ref), arith.addi(arith.muli(tid, mu.c(16, i32)),
                                                          mu.c(word_offset(kb, 0), i32)))
        words = _ld_shared(w_addr, lay.WORDS)
        # record_offset(kc, tid, nrec) = (32 kc + tid // 4) * 4 nrec
        s_addr = arith.addi(_smem_addr(sz_ref), arith.addi(
            arith.muli(arith.shrui(tid, mu.c(2, i32)), mu.c(4 * nrec, i32)),
            mu.c(record_offset(kc, 0, nrec), i32)))
        recs = _ld_shared(s_addr, nrec)
        scales: dict[tuple[int, int], tuple[Any, Any]] = {}

        def pair(i: int, e: int) -> tuple[Any, Any]:
            if (i, e) not in scales:
                res = llvm.inline_asm(llvm.StructType.get_literal([i32, i32]), [recs[2 * i + e]],
                                      _SCALE_ASM, "=r,=r,r", has_side_effects=False)
                scales[(i, e)] = (llvm.extractvalue(i32, res, [0]), llvm.extractvalue(i32, res, [1]))
            return scales[(i, e)]

        layout = fa.WGMMA_LAYOUT
        regs = np.empty(layout.registers_shape((lay.ROWS, lay.KB)), dtype=object)
        for j in range(lay.WORDS):
            i = word_group[j]  # group index within the chunk
            (s0, z0), (s1, z1) = pair(i, 0), pair(i, 1)
            res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [words[j], s0, z0, s1, z1],
                                  _CONVERT_ASM, "=r,=r,=r,=r,r,r,r,r,r", has_side_effects=False)
            for p in range(4):
                idx = [0] * regs.ndim
                idx[1], idx[4] = register_index(j, p)
                regs[tuple(idx)] = mu.bitcast(llvm.extractvalue(i32, res, [p]), bf16x2)
        return fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

    return fn


_MMA_ASM = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
_LDMATRIX_ASM = "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];"


def x_tile_offset(ct: int, kb: int, kt: int) -> int:
    """Byte offset of the 8 x 64 tile (n tile ct, k block kb) in the stage's x tile [M_pad, KT]."""
    return (ct * (kt // lay.KB) + kb) * 1024


def x_fragment_offset(ct: int, kb: int, j: int, lane: int, kt: int) -> int:
    """Byte offset (in the stage's x tile [M_pad, KT], 8 x 64 tiles, 128-byte swizzle) of the
    8 bf16 that lane `lane` addresses in `ldmatrix.x4` for k16 steps j, j + 1 (j even) of k block
    `kb` and n tile `ct`: matrix q = lane // 8 is (step j + q // 2, k half q % 2), row lane % 8
    is activation row 8 ct + lane % 8. Matrix q lands in register q: (b0, b1) of step j, then of
    step j + 1 (the mma.sync B fragment: B[k = 2c.., n = g] = x[g, 2c..])."""
    q, r = lane // 8, lane % 8
    chunk = 2 * j + q  # 16-byte chunk of the 128-byte tile row
    return x_tile_offset(ct, kb, kt) + r * 128 + ((chunk ^ r) & 7) * 16


DIAGNOSTICS = ("", "stream", "load", "convert", "mma_raw", "noscale", "nosq", "nonorm")
NORM_DIAGNOSTICS = ("noscale", "nosq", "nonorm")  # parts of the norm in the consumers (`norm_in_consumers`) left out


def mma_chain_plan(kt: int, chains: int) -> list[int]:
    """The accumulator chain of each k16 step s = 4 kb + j of a stage (`MgpuConfig.mma_chains`):
    s % chains, so consecutive MMAs of a column tile never wait on each other."""
    return [s % chains for s in range(kt // 16)]


# Weights of K up to this run the fused norm in the consumers (`norm_in_consumers`). Measured at SmolLM2's K 576
# (H200, 2026-11-30, draft step at batch 32, rows 4k-8k: q|k|v into the cache 258.6 -> 224.2 us per step, gate_up
# with SiLU·up 261.6 -> 242.9, INT4 linears 0.843 -> 0.791 ms; docs/kernel_notes.md, twenty-fourth session); the
# 8B's K 4096 keeps the pass (consumer-side scaling alone slowed its gate_up 9% at M 1).
CONSUMER_NORM_MAX_K = 1024


def norm_in_consumers(epi: "Epilogue", kind: str, variant: str, interpret: bool, k: int, splits: int,
                      k_groups: int) -> bool:
    """Whether the fused norm runs in the consumer warpgroups (`mma_stage(..., norm=True)`) rather than in
    the producer's per-stage pass and finish (`_norm_stage`, `_norm_finish`). The consumers scale their
    `ldmatrix` B registers by g (`mul.rn.bf16x2`: the product the pass stores) and sum the raw x^2 from the
    same registers (each thread a chain over its pair of every 8-column chunk, then a butterfly over the
    lane quad that shares a row, `_fragment_row_sums`); x and g land straight on the consumers' barrier and
    the producer only issues TMA. Why: at SmolLM2's K 576 (9 stages of 64 columns) the producer's 9
    passes and its finish ran in series and the consumers waited on them (s_qkv at M 32: 4.90 us plain,
    7.62 with the norm, Nsight Compute, H200, 2026-11-30; scaling in the fragments alone did not help: the
    pass and finish stayed). Where: the "mma" variant on the GPU, one split and one k group (the sum is the
    whole row's), and K <= CONSUMER_NORM_MAX_K: the added consumer work is per k block, and at the 8B's K
    4096, M 1 the consumers are issue-bound (the fragment scaling alone cost gate_up 9% there). Chosen by
    (K, splits, k groups), never by M: a row's sum is the same chain at every M. QSPEC_W4A16_NORM_PASS=1
    keeps the producer's pass (A/B runs)."""
    env = os.environ.get("QSPEC_W4A16_NORM_PASS", "0")
    if env not in ("0", "1"):
        raise ValueError(f"QSPEC_W4A16_NORM_PASS={env!r}; expected 0 or 1")
    return (bool(epi.norm) and kind == "int4" and variant == "mma" and not interpret and splits == 1
            and k_groups == 1 and k <= CONSUMER_NORM_MAX_K and env == "0")


def takes_norm_sums(k: int, n: int, group_size: int | None, m: int, *, swiglu: bool = False,
                    interpret: bool | None = None) -> bool:
    """Whether the norm kernel of a [K, N] INT4 weight at M rows, at its default launch shape,
    takes the rows' sums of x^2 as an input (`norm_sums`, `Epilogue.sums`): where its norm runs
    in the consumers (`norm_in_consumers`: K <= CONSUMER_NORM_MAX_K, one split), and always in
    interpret mode. From (K, N, G) and the device, like the launch shape."""
    interp = _common.interpret_default(interpret)
    if interp:
        return True
    epi = Epilogue(norm=True, swiglu=swiglu)
    cfg = default_config(k, n, group_size, reduce=reduce_mode(m, interp), epilogue=epi)
    return norm_in_consumers(epi, "int4", "mma", interp, k, cfg.splits, cfg.k_groups)


def mma_stage(group_size: int, kt: int, mp: int, diag: str, chains: int, norm: bool = False, gain: bool = True,
              sq: bool = True):
    """inline_mgpu function: one pipeline stage of the register kernel with warp-level MMAs.

    (w_ref uint32 [KT/64, 128, 4] (or its TMA view), sz_ref uint32 [KT/C, 64 C/G], x_ref bf16 [M_pad, KT] (8 x 64
    tiles, 128-byte swizzle), acc float32 [64, M_pad] WGMMA layout) -> acc + W_tile^T x_tile^T.
    Per k16 step a warp multiplies its 16 weight rows (the A fragment built from one code word,
    exactly the wgmma fragment of `_dequant_block`) by each 8-column activation tile with
    `mma.sync.m16n8k16` (B fragments by `ldmatrix.x4`, two k steps per load). Column tiles are
    independent n8 MMAs on the same A registers, so a row's arithmetic never depends on M_pad.

    `diag` (timing experiments only; wrong results): "stream" does no work on the stage,
    "load" only its shared-memory loads, "convert" loads + dequantization without MMAs,
    "mma_raw" loads + MMAs on the raw code words (no dequantization); with `norm`, "noscale"
    leaves out the x g multiply and g's loads, "nosq" the x^2 chains, "nonorm" both (what each
    costs the consumers; the row sums and their scale after the loop stay).

    `chains` (`MgpuConfig.mma_chains`): k16 step s = 4 kb + j of the stage accumulates into chain
    s % chains; chain 0 starts from `acc`, the others from zero, summed in chain order at the end.

    `norm` (`norm_in_consumers`): two more operands, g_ref bf16 [KT] (the stage's norm weights) and
    ssq float32 [64, M_pad] (WGMMA layout: register (ct, 0, element 0) of each thread is its running
    x^2 chain for activation row 8 ct + lane // 4, the other registers unused), and the function returns
    (acc, ssq). Register t of the x4 load for k16 steps j, j + 1 holds 16-byte chunk 2 j + t of the
    row, pair lane % 4 (`x_fragment_offset`): its x^2 goes into the chain (lo^2 then hi^2, chunks in k
    order) and the register becomes bf16(x g) with (g[k], g[k + 1]) before the MMAs (`gain` False: no
    g_ref operand and no multiply, the norm without weight, `Epilogue.gain`; `sq` False: no ssq
    operand, no chains, and only acc returned: the sums come in, `Epilogue.sums`). (Two or four
    chains per tile, summed pairwise after the loop, were measured on the H200 and gained nothing:
    docs/kernel_notes.md, twenty-seventh session.)"""
    g = group_size
    nkb = kt // lay.KB
    nct = mp // 8
    plan = mma_chain_plan(kt, chains)
    x_tf = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    acc_ty = plgpu.ShapeDtypeStruct((lay.ROWS, mp), jnp.float32, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(transforms=x_tf),
                   *((plgpu.RefType(),) if norm and gain else ()), plgpu.Layout.WGMMA,
                   *((plgpu.Layout.WGMMA,) if norm and sq else ())),
        return_type=(acc_ty, acc_ty) if norm and sq else acc_ty)
    def fn(ctx, w_ref, sz_ref, x_ref, *rest):
        del ctx
        rest = list(rest)
        g_ref = rest.pop(0) if norm and gain else None
        ssq = rest.pop() if norm and sq else None
        (acc,) = rest
        ir, arith, llvm, mgpu, fa, mu = _mgpu_modules()
        i32 = ir.IntegerType.get_signless(32)
        f32 = ir.F32Type.get()
        tid = arith.remui(mu.thread_idx(), mu.c(lay.THREADS, i32))
        lane = arith.remui(tid, mu.c(32, i32))
        w_base = arith.addi(_smem_addr(w_ref), arith.muli(tid, mu.c(16, i32)))
        s_base = _smem_addr(sz_ref)
        x_base = _smem_addr(x_ref)
        # lane-dependent part of x_fragment_offset: r * 128 + ((chunk ^ r) & 7) * 16 with
        # chunk = 2 j + q; (2 j + q) ^ r = 2 j ^ (q ^ r) for j in {0, 2} since q < 4
        r = arith.remui(lane, mu.c(8, i32))
        q = arith.divui(lane, mu.c(8, i32))
        lane_row = arith.muli(r, mu.c(128, i32))
        qr = arith.xori(q, r)
        x_lane = {j: arith.addi(lane_row, arith.muli(arith.andi(arith.xori(qr, mu.c(2 * j, i32)),
                                                                 mu.c(7, i32)), mu.c(16, i32)))
                  for j in (0, 2)}
        # norm: g pair (g[k], g[k + 1]) of chunk c of k block kb at byte kb 128 + 16 c + 4 (lane % 4)
        g_base = (arith.addi(_smem_addr(g_ref), arith.muli(arith.remui(lane, mu.c(4, i32)), mu.c(4, i32)))
                  if g_ref is not None else None)
        # norm: ct -> this thread's x^2 chain (register (ct, 0, 0) of ssq)
        chain_sq = {ct: wgmma_element(ssq, ct, 0, 0) for ct in range(nct)} if ssq is not None else {}
        # accumulator registers: [0, ct, 0, 0, h, 0, 0, 0, 0] = (row g + 8 h, cols 2c, 2c + 1)
        regs_in = acc.registers
        cur = {(ct, 2 * h + e): wgmma_element(acc, ct, h, e) for ct in range(nct) for h in range(2) for e in range(2)}
        zero = arith.constant(f32, 0.0)
        # chains[c][ct]: the 4 accumulator registers of column tile ct in chain c
        c_acc = [[[cur[(ct, i)] for i in range(4)] for ct in range(nct)]]
        c_acc += [[[zero] * 4 for _ in range(nct)] for _ in range(chains - 1)]
        sink = mu.c(0, i32)  # diagnostics: values folded in so the work is not dead code
        for kb in range(nkb if diag != "stream" else 0):
            kc, nrec, word_group = block_plan(g, kb)
            words = _ld_shared(arith.addi(w_base, mu.c(word_offset(kb, 0), i32)), lay.WORDS)
            recs = _ld_shared(arith.addi(s_base, arith.addi(
                arith.muli(arith.shrui(tid, mu.c(2, i32)), mu.c(4 * nrec, i32)),
                mu.c(record_offset(kc, 0, nrec), i32))), nrec)
            scales: dict[tuple[int, int], tuple[Any, Any]] = {}

            def pair(i: int, e: int) -> tuple[Any, Any]:
                if (i, e) not in scales:
                    res = llvm.inline_asm(llvm.StructType.get_literal([i32, i32]), [recs[2 * i + e]],
                                          _SCALE_ASM, "=r,=r,r", has_side_effects=False)
                    scales[(i, e)] = (llvm.extractvalue(i32, res, [0]), llvm.extractvalue(i32, res, [1]))
                return scales[(i, e)]

            b_frag: dict[tuple[int, int], tuple[Any, Any]] = {}
            scale = norm and gain and diag not in ("noscale", "nonorm")
            g_pair = ([llvm.inline_asm(i32, [arith.addi(g_base, mu.c(kb * 128 + 16 * c, i32))], _LD_B32_ASM,
                                       "=r,r", has_side_effects=True) for c in range(8)] if scale else None)
            for ct in range(nct):
                for j in (0, 2):
                    addr = arith.addi(x_base, arith.addi(x_lane[j], mu.c(x_tile_offset(ct, kb, kt), i32)))
                    res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [addr], _LDMATRIX_ASM,
                                          "=r,=r,=r,=r,r", has_side_effects=True)
                    b = [llvm.extractvalue(i32, res, [t]) for t in range(4)]
                    if ssq is not None and diag not in ("nosq", "nonorm"):  # chunk 2 j + t: x^2 into the chain
                        for t in range(4):
                            chain_sq[ct] = llvm.inline_asm(f32, [b[t], chain_sq[ct]], _SQ_NEXT_ASM, "=f,r,f",
                                                           has_side_effects=False)
                    if scale:  # then bf16(x g)
                        b = [llvm.inline_asm(i32, [b[t], g_pair[2 * j + t]], _MUL_BF16X2_ASM, "=r,r,r",
                                             has_side_effects=False) for t in range(4)]
                    b_frag[(ct, j)], b_frag[(ct, j + 1)] = (b[0], b[1]), (b[2], b[3])
            if diag == "load":
                for v in (*words, *recs, *(b for bb in b_frag.values() for b in bb)):
                    sink = arith.xori(sink, v)
                continue
            for j in range(lay.WORDS):
                if diag == "mma_raw":
                    a = [words[j], words[(j + 1) % 4], words[(j + 2) % 4], words[(j + 3) % 4]]
                else:
                    i = word_group[j]
                    (s0, z0), (s1, z1) = pair(i, 0), pair(i, 1)
                    res = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [words[j], s0, z0, s1, z1],
                                          _CONVERT_ASM, "=r,=r,=r,=r,r,r,r,r,r", has_side_effects=False)
                    a = [llvm.extractvalue(i32, res, [p]) for p in range(4)]
                if diag == "convert":
                    for v in (*a, *(b for bb in b_frag.values() for b in bb)):
                        sink = arith.xori(sink, v)
                    continue
                chain = c_acc[plan[lay.WORDS * kb + j]]
                for ct in range(nct):
                    out = llvm.inline_asm(
                        llvm.StructType.get_literal([f32] * 4), [*a, *b_frag[(ct, j)], *chain[ct]], _MMA_ASM,
                        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False)
                    chain[ct] = [llvm.extractvalue(f32, out, [t]) for t in range(4)]
        for extra in c_acc[1:]:  # ((c0 + c1) + c2) + ...
            for ct in range(nct):
                c_acc[0][ct] = [arith.addf(u, v) for u, v in zip(c_acc[0][ct], extra[ct])]
        c_acc = c_acc[0]
        if diag in ("load", "convert"):
            c_acc[0][0] = arith.addf(c_acc[0][0], arith.bitcast(f32, sink))
        out = _wgmma_array(regs_in.shape, acc.layout, lambda ct, h, e: c_acc[ct][2 * h + e])
        if ssq is None:
            return out
        return out, _wgmma_array(regs_in.shape, ssq.layout,
                                 lambda ct, h, e: chain_sq[ct] if (h, e) == (0, 0) else zero)

    return fn


def wgmma_element(arr: Any, ct: int, h: int, e: int) -> Any:
    """Element e of register [0, ct, 0, 0, h, 0, ...] of a float32 [64, M_pad] FragmentedArray of the
    WGMMA layout, i.e. (row lane // 4 + 8 h of the warp's 16, column 8 ct + 2 (lane % 4) + e): the
    read `_wgmma_array` inverts (inside an inline_mgpu function)."""
    ir, arith, llvm, _, _, _ = _mgpu_modules()
    idx = [0] * arr.registers.ndim
    idx[1], idx[4] = ct, h
    return llvm.extractelement(arr.registers[tuple(idx)], arith.constant(ir.IntegerType.get_signless(32), e))


def _wgmma_array(shape: tuple[int, ...], layout: Any, value: Any) -> Any:
    """A float32 [64, M_pad] FragmentedArray of the WGMMA layout (register array `shape`) from
    value(ct, h, e): register [0, ct, 0, 0, h, 0, ...] element e, i.e. (row lane // 4 + 8 h of the
    warp's 16, column 8 ct + 2 (lane % 4) + e)."""
    ir, arith, llvm, _, fa, _ = _mgpu_modules()
    i32 = ir.IntegerType.get_signless(32)
    vec_ty = ir.VectorType.get((2,), ir.F32Type.get())
    regs = np.empty(shape, dtype=object)
    for ct in range(shape[1]):
        for h in range(2):
            idx = [0] * len(shape)
            idx[1], idx[4] = ct, h
            v = llvm.mlir_undef(vec_ty)
            for e in range(2):
                v = llvm.insertelement(v, value(ct, h, e), arith.constant(i32, e))
            regs[tuple(idx)] = v
    return fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)


_SHFL_IDX_ASM = "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;"  # float32 of lane $2


def fragment_sum_plan(lane: int, kt: int) -> tuple[int, list[int], list[int]]:
    """The consumers' x^2 sums (`mma_stage(..., norm=True)`, `_fragment_row_sums`, which compute the
    same in MLIR), for lane `lane` of a warp and one n tile: (the activation row within the tile whose
    chain the lane holds, the k columns of one stage its chain adds, in order, as the first of each
    bf16 pair (lo^2 then hi^2), the lanes whose summed chains give its two accumulator columns
    2 (lane % 4) + e). The `ldmatrix.x4` for k16 steps j, j + 1 of k block kb gives register t the
    pair at column 64 kb + 8 (2 j + t) + 2 (lane % 4) of row lane // 4 (`x_fragment_offset`)."""
    cols = [lay.KB * kb + 8 * (2 * j + t) + 2 * (lane % 4) for kb in range(kt // lay.KB) for j in (0, 2)
            for t in range(4)]
    return lane // 4, cols, [8 * (lane % 4) + 4 * e for e in range(2)]


def _fragment_row_sums(mp: int):
    """inline_mgpu function, a consumer warpgroup after its main loop (`norm_in_consumers`): ssq (the
    chains of `mma_stage(..., norm=True)`) -> ss float32 [64, M_pad], WGMMA layout, every row the same:
    ss[., c] = the sum of x[c, :]^2. Per n tile: the thread's chain + its partner's over lanes ^ 1,
    then ^ 2 (the lane quad sharing activation row 8 ct + lane // 4; every lane of the quad ends with the same bits:
    float addition is commutative), then each thread takes the sums of its accumulator columns 8 ct +
    2 (lane % 4) + e from a lane of quad 2 (lane % 4) + e. Warp-local: no barrier, no shared memory."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct((lay.ROWS, mp), jnp.float32, layout=plgpu.Layout.WGMMA))
    def fn(ctx, ssq):
        del ctx
        ir, arith, llvm, _, _, mu = _mgpu_modules()
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        lane = arith.remui(mu.thread_idx(), mu.c(32, i32))
        # fragment_sum_plan's source lanes: 8 (lane % 4) + 4 e, a lane of quad 2 (lane % 4) + e
        quad = arith.muli(arith.remui(lane, mu.c(4, i32)), mu.c(8, i32))
        src = [quad, arith.addi(quad, mu.c(4, i32))]
        shfl = lambda v, text, *a: llvm.inline_asm(f32, [v, *a], text, "=f,f" + ",r" * len(a),  # noqa: E731
                                                   has_side_effects=True)
        cols = {}  # ct -> the sums of this thread's two accumulator columns
        for ct in range(mp // 8):
            v = wgmma_element(ssq, ct, 0, 0)
            for sh in (1, 2):
                v = arith.addf(v, shfl(v, _SHFL_ASM.format(sh)))
            cols[ct] = [shfl(v, _SHFL_IDX_ASM, src[e]) for e in range(2)]
        return _wgmma_array(ssq.registers.shape, ssq.layout, lambda ct, h, e: cols[ct][e])

    return fn


# ------------------------------------------------------------------- the fused RMSNorm (producer)
def norm_pair_offset(r: int, q: int, kt: int) -> int:
    """Byte offset of x[r, 2q : 2q + 2] (one bf16 pair) in a stage's x tile [M_pad, KT] (8 x 64
    tiles, 128-byte swizzle, as TMA writes it). The producer's thread handling pair q of row r
    (`norm_thread_rows`) reads k block q // 32 at lane q % 32: the 32 threads of a warp share r
    and read one 128-byte tile row, conflict-free. The kernel adds the static `norm_row_offset`
    and the per-thread `norm_lane_offset`."""
    rr, lane = r % 8, q % 32
    return x_tile_offset(r // 8, q // 32, kt) + rr * 128 + (((lane // 4) ^ rr) & 7) * 16 + 4 * (lane % 4)


def norm_row_offset(r: int, kt: int) -> int:
    """The part of `norm_pair_offset(r, q, kt)` that does not depend on the pair (`_norm_stage`
    adds it for r = R j and 128 lane_row in the thread's base: R divides 8)."""
    return x_tile_offset(r // 8, 0, kt) + (r % 8) * 128


def norm_lane_offset(q: int, rr: int) -> int:
    """The part that does (pair q, row r with r % 8 == rr); `_norm_stage` computes it in MLIR."""
    warp, lane = q // 32, q % 32
    return warp * 1024 + (((lane // 4) ^ rr) & 7) * 16 + 4 * (lane % 4)


# The producer's norm pass, as small asm pieces the kernel emits in an interleaved order (all of a
# batch's loads, then its arithmetic, then its stores) so that a thread has up to NORM_BATCH rows'
# shared-memory round trips in flight; one side-effecting asm per row (load, multiply, store, load,
# fma, store: ~80 cycles of dependent latency) made the pass ~12 us at M 32, K 576.
_LD_B32_ASM = "ld.shared.b32 $0, [$1];"
_LD_F32_IF_ASM = "{\n.reg .pred p;\nsetp.ne.u32 p, $2, 0;\nmov.f32 $0, 0f00000000;\n@p ld.shared.f32 $0, [$1];\n}"
_ST_B32_IF_ASM = "{\n.reg .pred p;\nsetp.ne.u32 p, $2, 0;\n@p st.shared.b32 [$0], $1;\n}"
_ST_F32_IF_ASM = "{\n.reg .pred p;\nsetp.ne.u32 p, $2, 0;\n@p st.shared.f32 [$0], $1;\n}"
_MUL_BF16X2_ASM = "mul.rn.bf16x2 $0, $1, $2;"  # bf16(x g): the correctly rounded product
# A pair's x^2 partial, lo^2 then hi^2 (the first stage's, or added to the running one $2)
_SQ_FIRST_ASM = ("{\n.reg .b32 t;\n.reg .f32 lo, hi;\nshl.b32 t, $1, 16;\nmov.b32 lo, t;\n"
                 "and.b32 t, $1, 0xFFFF0000;\nmov.b32 hi, t;\nmul.rn.f32 $0, lo, lo;\nfma.rn.f32 $0, hi, hi, $0;\n}")
_SQ_NEXT_ASM = ("{\n.reg .b32 t;\n.reg .f32 lo, hi, a;\nshl.b32 t, $1, 16;\nmov.b32 lo, t;\n"
                "and.b32 t, $1, 0xFFFF0000;\nmov.b32 hi, t;\nfma.rn.f32 a, lo, lo, $2;\nfma.rn.f32 $0, hi, hi, a;\n}")
NORM_BATCH = 8  # rows per thread whose loads are in flight together


def norm_row_lanes(kt: int) -> int:
    """Rows of a stage the producer's 128 threads normalize at once: a row has KT / 2 bf16 pairs,
    thread t takes pair t % (KT / 2) of rows t // (KT / 2) + R j (R = 256 / KT: 1, 2 or 4)."""
    if kt not in (64, 128, 256):
        raise ValueError(f"k_tile={kt}: the fused norm takes k_tile in (64, 128, 256)")
    return (2 * lay.THREADS) // kt


def norm_thread_rows(t: int, m: int, kt: int) -> tuple[int, list[int]]:
    """(pair q, rows r < M) that the producer's thread t normalizes in every stage (`_norm_stage`
    computes the same in MLIR): q = t % (KT / 2), r = t // (KT / 2) + R j."""
    lanes, pairs = norm_row_lanes(kt), kt // 2
    return t % pairs, [r0 + t // pairs for r0 in range(0, m, lanes) if r0 + t // pairs < m]


def _norm_stage(m: int, kt: int, first: bool, gain: bool = True):
    """inline_mgpu function run by the producer warpgroup on a landed stage: (x_ref bf16 [M_pad,
    KT] (swizzled tiles), g_ref bf16 [KT] (`gain` only), part_ref float32 [M, 128]) -> x rows < M
    multiplied by g in place (`gain`; without, x is left as it landed), part[r, q] (+)= the sum of
    x[r, pair q]^2 for the KT / 2 pairs q of the stage
    (`first`: the stage that initializes part, and zeroes part[r, q >= KT / 2], which the finish
    sums too). Thread t handles pair q = t % (KT / 2) of rows r = t // (KT / 2) + R j (see
    `norm_row_lanes`); a row's partials are the same whichever thread computes them, so the
    sums do not depend on M. Ends with a proxy fence (the wgmma variants read x through the
    async proxy); each thread's mbarrier arrive afterwards releases its own stores."""
    lanes = norm_row_lanes(kt)
    pairs = kt // 2

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms=(plgpu.TilingTransform((8, SWIZZLE // 2)),
                                                            plgpu.SwizzleTransform(SWIZZLE))),
                                  *((plgpu.RefType(),) if gain else ()), plgpu.RefType()))
    def fn(ctx, x_ref, *refs):
        del ctx
        g_ref, part_ref = refs if gain else (None, *refs)
        ir, arith, llvm, _, _, mu = _mgpu_modules()
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        void = ir.Type.parse("!llvm.void")
        c = lambda v: mu.c(v, i32)  # noqa: E731
        asm = lambda ty, args, text, cons, side=False: llvm.inline_asm(  # noqa: E731
            ty, args, text, cons, has_side_effects=side)
        tid = arith.remui(mu.thread_idx(), c(lay.THREADS))
        lane_row, q = arith.divui(tid, c(pairs)), arith.remui(tid, c(pairs))
        # norm_lane_offset(q, r % 8) with r % 8 = (R j) % 8 + lane_row (R divides 8)
        qwarp, qlane = arith.divui(q, c(32)), arith.remui(q, c(32))
        quad = arith.divui(qlane, c(4))
        x_base = arith.addi(_smem_addr(x_ref), arith.addi(
            arith.muli(qwarp, c(1024)), arith.addi(arith.muli(arith.remui(qlane, c(4)), c(4)),
                                                   arith.muli(lane_row, c(128)))))
        g_val = (asm(i32, [arith.addi(_smem_addr(g_ref), arith.muli(q, c(4)))], _LD_B32_ASM, "=r,r", True)
                 if gain else None)
        p_base = arith.addi(_smem_addr(part_ref), arith.addi(arith.muli(q, c(4)),
                                                             arith.muli(lane_row, c(4 * lay.THREADS))))
        rows = list(range(0, m, lanes))  # r0 = R j: this thread's row is r0 + lane_row
        zero = arith.constant(f32, 0.0)
        for b in range(0, len(rows), NORM_BATCH):
            batch = []
            for r0 in rows[b:b + NORM_BATCH]:
                rr = arith.addi(c(r0 % 8), lane_row)
                swz = arith.muli(arith.andi(arith.xori(quad, rr), c(7)), c(16))
                x_addr = arith.addi(x_base, arith.addi(swz, c(norm_row_offset(r0, kt))))  # + 128 lane_row in x_base
                ok = c(1) if r0 + lanes <= m else arith.extui(
                    i32, arith.cmpi(arith.CmpIPredicate.ult, lane_row, c(m - r0)))
                batch.append((x_addr, arith.addi(p_base, c(4 * lay.THREADS * r0)), ok))
            xs = [asm(i32, [xa], _LD_B32_ASM, "=r,r", True) for xa, _, _ in batch]
            if not first:
                accs = [asm(f32, [pa, ok], _LD_F32_IF_ASM, "=f,r,r", True) for _, pa, ok in batch]
            ys = [asm(i32, [xv, g_val], _MUL_BF16X2_ASM, "=r,r,r") for xv in xs] if gain else [None] * len(xs)
            sq = ([asm(f32, [xv], _SQ_FIRST_ASM, "=f,r") for xv in xs] if first else
                  [asm(f32, [xv, a], _SQ_NEXT_ASM, "=f,r,f") for xv, a in zip(xs, accs)])
            for (xa, pa, ok), y, v in zip(batch, ys, sq):
                if gain:
                    asm(void, [xa, y, ok], _ST_B32_IF_ASM, "r,r,r", True)
                asm(void, [pa, v, ok], _ST_F32_IF_ASM, "r,f,r", True)
                if first:  # the slots of pairs this K tile does not have (the finish sums all 128)
                    for i in range(1, lanes):
                        asm(void, [arith.addi(pa, c(4 * pairs * i)), zero, ok], _ST_F32_IF_ASM, "r,f,r", True)
        asm(void, [], "fence.proxy.async.shared::cta;", "", True)

    return fn


_SHFL_ASM = "shfl.sync.bfly.b32 $0, $1, {}, 0x1f, 0xffffffff;"  # float32 butterfly partner (lane ^ {})
_LD_F32_ASM = "ld.shared.f32 $0, [$1];"
_ST_F32_ASM = "st.shared.f32 [$0], $1;"
_ST_LANE0_ASM = "{\n.reg .pred p;\nsetp.eq.u32 p, $2, 0;\n@p st.shared.f32 [$0], $1;\n}"  # $2: the lane


def _norm_finish(m: int, mp: int):
    """inline_mgpu function, producer warpgroup, after the last stage: (part_ref float32 [M, 128],
    ssw_ref float32 [4, M_pad], ss_ref float32 [64, M_pad]) -> ss[n, r] = sum_t part[r, t] for
    every n (0 for padding rows r >= M), after a warpgroup barrier (the stages' slots of a row
    belong to other threads than the ones that sum them): per warp a butterfly over its 32 lanes
    (every lane ends with the same bits: float addition is commutative), then warps 0 + 1 + 2 + 3
    in that order.
    ss has the accumulator's shape, so the consumers load it in the WGMMA layout."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
    def fn(ctx, part_ref, ssw_ref, ss_ref):
        del ctx
        ir, arith, llvm, _, _, mu = _mgpu_modules()
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        c = lambda v: mu.c(v, i32)  # noqa: E731
        void = ir.Type.parse("!llvm.void")
        tid = arith.remui(mu.thread_idx(), c(lay.THREADS))
        warp, lane = arith.divui(tid, c(32)), arith.remui(tid, c(32))
        part, ssw, ss = _smem_addr(part_ref), _smem_addr(ssw_ref), _smem_addr(ss_ref)
        ld = lambda addr: llvm.inline_asm(f32, [addr], _LD_F32_ASM, "=f,r", has_side_effects=True)  # noqa: E731
        # Thread t reads part[r, t], which another thread wrote in the last stage wherever KT < 256
        # (`norm_thread_rows`: row r's pairs go to the threads of lane row r % R). Without this
        # barrier those rows' sums raced the last stage's stores (H100, 2026-11-27: M 8, KT 128 gave
        # wrong odd rows, different on every run; docs/kernel_notes.md "The fused norm's race").
        mu.warpgroup_barrier()
        # rows in batches whose loads and butterfly steps interleave (independent chains in flight)
        for b in range(0, mp, 2 * NORM_BATCH):
            rows = range(b, min(b + 2 * NORM_BATCH, mp))
            vals = {r: ld(arith.addi(part, arith.muli(arith.addi(tid, c(lay.THREADS * r)), c(4))))
                    for r in rows if r < m}
            for sh in (16, 8, 4, 2, 1):
                other = {r: llvm.inline_asm(f32, [v], _SHFL_ASM.format(sh), "=f,f", has_side_effects=True)
                         for r, v in vals.items()}
                vals = {r: arith.addf(v, other[r]) for r, v in vals.items()}
            for r in rows:
                v = vals[r] if r < m else arith.constant(f32, 0.0)
                addr = arith.addi(ssw, arith.muli(arith.addi(arith.muli(warp, c(mp)), c(r)), c(4)))
                llvm.inline_asm(void, [addr, v, lane], _ST_LANE0_ASM, "r,f,r", has_side_effects=True)
        mu.warpgroup_barrier()
        elems = range(lay.ROWS * mp // lay.THREADS)  # element e = t + 128 j of ss [64, M_pad]
        for b in range(0, len(elems), NORM_BATCH):
            js = elems[b:b + NORM_BATCH]
            es = {j: arith.addi(tid, c(lay.THREADS * j)) for j in js}
            parts = {j: [ld(arith.addi(ssw, arith.addi(arith.muli(arith.remui(es[j], c(mp)), c(4)), c(4 * w * mp))))
                         for w in range(4)] for j in js}
            for j in js:
                tot = parts[j][0]
                for v in parts[j][1:]:  # warps 0 + 1 + 2 + 3, in that order
                    tot = arith.addf(tot, v)
                llvm.inline_asm(void, [arith.addi(ss, arith.muli(es[j], c(4))), tot], _ST_F32_ASM, "r,f",
                                has_side_effects=True)

    return fn


def _norm_twin(x: Array, g: Array | None = None) -> tuple[Array, Array]:
    """Interpret mode's `_norm_stage` on values: x [M_pad, KT] bf16, g [KT] -> (bf16(x g), the
    same product as `mul.rn.bf16x2`, or x itself without g; the row sums of x^2 [M_pad] float32,
    jnp order)."""
    xf = x.astype(jnp.float32)
    xg = x if g is None else (xf * g.astype(jnp.float32)[None, :]).astype(x.dtype)
    return xg, jnp.sum(xf * xf, axis=1)


# ------------------------------------------------------------------------------ the SMEM twin
def twin_dequant(words: Array, recs: Array, group_size: int, kb: int) -> Array:
    """jnp: uint32 words [128, 4] and records [64 C/G] of one warpgroup and stage -> the bf16
    tile W^T [64 rows, 64 cols] of k block `kb`, with the register kernel's arithmetic.
    Static reshapes and transposes only (a Mosaic GPU kernel may not capture array constants)."""
    g = group_size
    _, nrec, word_group = block_plan(g, kb)
    gpc = nrec // 2
    shift = (4 * lax.broadcasted_iota(jnp.uint32, (lay.THREADS, lay.WORDS, 4, 2), 2)
             + 16 * lax.broadcasted_iota(jnp.uint32, (lay.THREADS, lay.WORDS, 4, 2), 3))
    nib = (words[:, :, None, None] >> shift) & 0xF  # [t, j, p, h]
    # t = 32 w + 4 g + c, p = 2 pr + pc: row = 16 w + 8 pc + g, col = 16 j + 8 pr + 2 c + h
    nib = nib.reshape(4, 8, 4, lay.WORDS, 2, 2, 2)  # [w, g, c, j, pr, pc, h]
    codes = jnp.transpose(nib, (0, 5, 1, 3, 4, 2, 6)).reshape(lay.ROWS, lay.KB)
    # records: word 2 gpc r + 2 i + e of row pair r = 8 w + g -> row 16 w + 8 e + g
    rec = jnp.transpose(recs.reshape(4, 8, gpc, 2), (0, 3, 1, 2)).reshape(lay.ROWS, gpc)
    ss = lax.bitcast_convert_type((rec & 0xFFFF).astype(jnp.uint16), jnp.bfloat16)  # [64, gpc] (s, zc)
    zz = lax.bitcast_convert_type((rec >> 16).astype(jnp.uint16), jnp.bfloat16)
    if gpc == 1:
        ss = jnp.broadcast_to(ss, (lay.ROWS, lay.KB))
        zz = jnp.broadcast_to(zz, (lay.ROWS, lay.KB))
    else:  # G = 32: columns 0..31 are group word_group[0], 32..63 group word_group[2]
        assert word_group == [0, 0, 1, 1]
        ss = jnp.broadcast_to(ss[:, :, None], (lay.ROWS, gpc, g)).reshape(lay.ROWS, lay.KB)
        zz = jnp.broadcast_to(zz[:, :, None], (lay.ROWS, gpc, g)).reshape(lay.ROWS, lay.KB)
    q = (codes.astype(jnp.int32) - 8).astype(jnp.float32)
    return (q * ss.astype(jnp.float32) + zz.astype(jnp.float32)).astype(jnp.bfloat16)


# ----------------------------------------------------------------------------------- kernels
def _kernel(*refs, names: tuple[str, ...], kind: str, variant: str, interpret: bool, m: int, mp: int, kt: int,
            wgs: int, steps: int, stages: int, splits: int, g: int | None, w_stacked: bool, g_stacked: bool,
            n_layers: int, reduce: str, diag: str = "", pdl: bool = False, epi: Epilogue = Epilogue(),
            k_total: int = 0, half_tiles: int = 0, norm_ahead: int = 1, mma_chains: int = 1, k_groups: int = 1,
            cn: bool = False, row_blocks: int = 1):
    """One CTA: column tile `nt` (64 wgs rows of N), k split `ks`. See the module docstring;
    `epi` the fused glue (`Epilogue`; `cn`: the norm in the consumers, `norm_in_consumers`, decided by
    `_call`, which sizes the barriers and scratch for it; `norm_ahead`: `MgpuConfig.norm_ahead`; `k_groups`:
    `MgpuConfig.k_groups`; `row_blocks`: the qkv epilogue's row blocks, `qkv_blocks`: this CTA's rows are
    row0 .. row0 + M_pad - 1 of x, M_pad = `mp`). `names` names the refs (inputs, output, scratch: `_call`).

    Warpgroups: consumers wg = q wgs + r (row tile r, k group q) for q < k_groups, then the
    producer. Group 0's warpgroups are wg 0 .. wgs - 1 and run everything after the main loop
    (split-K sum, epilogue, store), so there `wg` is the row tile."""
    r = dict(zip(names, refs))
    x_gmem, w_gmem, sz_gmem, g_gmem, res_gmem = (r.get(k) for k in ("x", "w", "sz", "g", "res"))
    out_gmem, ws_gmem, wss_gmem = r["out"], r.get("ws"), r.get("wss")
    x_smem, w_smem, sz_smem = r["x_smem"], r["w_smem"], r.get("sz_smem")
    twin = (r["a_twin"], r["xt_twin"]) if "a_twin" in r else None
    o_smem, full, empty, red = r["o_smem"], r["full"], r["empty"], r.get("red")
    xfull, g_smem, part, ssw, ss_ref, norm_bar = (r.get(k) for k in ("xfull", "g_smem", "part", "ssw", "ss",
                                                                     "norm_bar"))
    res_smem, res_bar, pair, pair_bar = (r.get(k) for k in ("res_smem", "res_bar", "pair", "pair_bar"))
    cs_gmem, slots_gmem, qbuf, kring, vring = (r.get(k) for k in ("cs", "slots", "qbuf", "kring", "vring"))
    ssin_gmem = r.get("ssin")  # Epilogue.sums: the rows' sums of x^2, float32 [P, M_pad]
    rsq_gmem = r.get("rsq")  # Epilogue.row_sums: the output rows' sums of squares, float32 [N / 64, M_pad]
    rpair, rope_bar, seq_bar = (r.get(k) for k in ("rpair", "rope_bar", "seq_bar"))
    kx, kx_bar = r.get("kx"), r.get("kx_bar")  # k groups > 1: the partials of groups 1 .. k_groups - 1
    nt = lax.axis_index("nt")
    ks = lax.axis_index("ks")
    wg = lax.axis_index("wg")
    row0 = lax.axis_index("rb") * mp if row_blocks > 1 else 0  # this CTA's first row of x
    # reduce == "sem": one semaphore per column tile of one warpgroup (zeroed by Pallas per call)
    sem = (pl.get_global(plgpu.SemaphoreType.REGULAR((ws_gmem.shape[1],)))
           if ws_gmem is not None and not interpret else None)
    col0 = (nt * wgs + wg) * lay.ROWS  # this warpgroup's first output column
    k_split = steps * kt
    layer_idx = jnp.clip(r["layer"][0], 0, n_layers - 1) if "layer" in r else None
    lead: tuple[Any, ...] = (layer_idx,) if w_stacked else ()
    g_lead: tuple[Any, ...] = (layer_idx,) if g_stacked else ()

    def given_sums():
        """Epilogue.sums: ss [64, M_pad] (every row the same) = norm_sums[0] + norm_sums[1] + ..."""
        vec = (lambda p: ssin_gmem.at[p][...]) if interpret else (
            lambda p: _common.load_with_layout(ssin_gmem.at[p], plgpu.Layout.WGMMA.reduce(0), optimized=False))
        ss = vec(0)
        for p in range(1, ssin_gmem.shape[0]):  # in order: row independent, M independent
            ss = ss + vec(p)
        return lax.broadcast_in_dim(ss, (lay.ROWS, mp), (1,))

    @pl.when(wg == wgs * k_groups)
    def _producer():
        def issue_x(i, slot):
            k0 = ks * k_split + i * kt
            # norm: x goes through the producer's pass first, unless the consumers run the norm (cn)
            bar = xfull.at[slot] if epi.norm and not cn else full.at[slot]
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(row0, mp), pl.ds(k0, kt)], x_smem.at[slot], bar)
            if epi.norm and epi.gain:
                plgpu.copy_gmem_to_smem(g_gmem.at[(*g_lead, pl.ds(k0, kt))], g_smem.at[slot], bar)

        def issue_w(i, slot):
            k0 = ks * k_split + i * kt
            if kind == "int4":
                c = lay.chunk_cols(g)
                # swiglu: warpgroup cw streams row tile nt + cw N/128 (gate, then the same up columns)
                boxes = ([(pl.ds(nt + cw * half_tiles, 1), w_smem.at[slot, pl.ds(cw, 1)],
                           sz_smem.at[slot, pl.ds(cw, 1)]) for cw in range(wgs)] if epi.swiglu
                         else [(pl.ds(nt * wgs, wgs), w_smem.at[slot], sz_smem.at[slot])])
                for src_rows, w_dst, sz_dst in boxes:
                    plgpu.copy_gmem_to_smem(
                        w_gmem.at[(*lead, src_rows, pl.ds(k0 // lay.KB, kt // lay.KB))], w_dst, full.at[slot])
                    plgpu.copy_gmem_to_smem(
                        sz_gmem.at[(*lead, src_rows, pl.ds(k0 // c, kt // c))], sz_dst, full.at[slot])
            else:
                for cw in range(wgs):  # swiglu: as above, warpgroup cw the gate (0) or up (1) tile nt
                    tile = nt + cw * half_tiles if epi.swiglu else nt * wgs + cw
                    plgpu.copy_gmem_to_smem(
                        w_gmem.at[(*lead, pl.ds(k0, kt), pl.ds(tile * lay.ROWS, lay.ROWS))],
                        w_smem.at[slot, cw], full.at[slot])

        def step(i, carry):
            slot = lax.rem(i, stages)

            @pl.when(i >= stages)
            def _():
                plgpu.barrier_wait(empty.at[slot])

            issue_w(i, slot)
            issue_x(i, slot)
            return carry

        def process(j, first):  # norm: the landed x tile of step j times g (gain), and the sums of x^2
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(xfull.at[slot])
            g_op = (g_smem.at[slot],) if epi.gain else ()
            if interpret:
                xg, ss = _norm_twin(x_smem.at[slot][...], *(g[...] for g in g_op))
                if epi.gain:
                    x_smem.at[slot][...] = xg
                if not epi.sums:
                    part[...] = ss if first else part[...] + ss
            else:
                _norm_stage(m, kt, first, epi.gain)(x_smem.at[slot], *g_op, part)
            plgpu.barrier_arrive(full.at[slot])

        # static: the prologue's tiles (pdl: the weight tiles, which no earlier kernel writes, go
        # out before the grid-dependency wait; x and the residual after it)
        first = min(stages, steps) if (pdl or (epi.norm and not cn)) else 0
        for i in range(first if pdl else 0):
            issue_w(i, i)
        if pdl:
            plgpu.griddepcontrol_wait()  # x, written by the previous kernel, is visible after this
        if res_smem is not None:
            # only the CTA that stores the output reads the residual: cluster rank 0, or the last split
            @pl.when(ks == (splits - 1 if ws_gmem is not None else 0))
            def _():
                for cw in range(wgs):
                    plgpu.copy_gmem_to_smem(res_gmem.at[pl.ds(0, m), pl.ds((nt * wgs + cw) * lay.ROWS, lay.ROWS)],
                                            res_smem.at[cw, pl.ds(0, m)], res_bar.at[0])
        for i in range(0 if pdl else first):
            issue_w(i, i)
        for i in range(first):
            issue_x(i, i)

        def drain():
            # GPU interpret mode only: a thread that waits on a barrier must see every phase of it
            # before the kernel ends (the interpreter checks), so the producer also waits for the
            # consumers' last release of each slot it reused; on the GPU it just exits
            if interpret and steps > stages:
                for slot in range(stages):
                    plgpu.barrier_wait(empty.at[slot])

        if not epi.norm or cn:
            lax.fori_loop(first, steps, step, 0)
            drain()
            return
        # norm: step j + ahead is processed while the consumers work on step j (its x was issued
        # when step j + ahead - stages was released); then the slot of step j is refilled with
        # step j + stages once they release it
        ahead = min(norm_ahead, stages - 1)
        for j in range(min(ahead, steps)):
            process(j, j == 0)

        def norm_step(i, carry):
            @pl.when(i + ahead < steps)
            def _():
                process(i + ahead, False)

            @pl.when(i + stages < steps)
            def _():
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(empty.at[slot])
                issue_w(i + stages, slot)
                issue_x(i + stages, slot)

            return carry

        lax.fori_loop(0, steps, norm_step, 0)
        drain()
        if interpret:
            ss_ref[...] = given_sums() if epi.sums else jnp.broadcast_to(part[...][None, :], (lay.ROWS, mp))
        else:
            _norm_finish(m, mp)(part, ssw, ss_ref)
        if red is None:  # one CTA per column tile: the consumers wait for the sums (the cluster syncs instead)
            plgpu.barrier_arrive(norm_bar.at[0])

    def final(acc, ss):
        """The epilogue of this warpgroup's whole-K accumulator [64, M_pad] float32 (ss: the
        rows' sums of x^2 in the same layout, norm only), then the store."""
        if epi.norm:
            acc = acc * lax.rsqrt(ss * (1.0 / k_total) + epi.eps)
        if epi.qkv is not None:
            qkv_store(acc)
            return
        res = dict(res=res_smem.at[wg], res_bar=res_bar.at[0]) if res_smem is not None else {}
        if not epi.swiglu:
            sums = rsq_gmem.at[nt * wgs + wg] if rsq_gmem is not None else None
            _store_tile(acc, o_smem, out_gmem, wg=wg, col0=col0, m=m, interpret=interpret, sums=sums, row0=row0,
                        **res)
            return

        @pl.when(wg == 1)  # up
        def _():
            pair[...] = acc
            plgpu.barrier_arrive(pair_bar.at[0])

        @pl.when(wg == 0)  # gate: silu(gate) * up, columns 64 nt .. of out [M, N / 2]
        def _():
            plgpu.barrier_wait(pair_bar.at[0])
            up = _load_acc(pair, interpret)
            _store_tile(acc / (1.0 + jnp.exp(-acc)) * up, o_smem, out_gmem, wg=wg, col0=nt * lay.ROWS, m=m,
                        interpret=interpret, row0=row0, **res)

    def qkv_store(acc):
        """Epilogue.qkv (`QkvCache`). 128-channel heads: head `nt` (this CTA's 128 columns;
        warpgroup wg holds channels 64 wg .. 64 wg + 63); both warpgroups exchange their tiles
        through shared memory (RoPE pairs channel c with c + 64). 64-channel heads: head
        `nt wgs + wg` (this warpgroup's 64 columns); the warpgroup writes its tile twice, one copy
        under the other, and reads it back 32 rows on (RoPE pairs channel c with c + 32 mod 64).
        Then each rotates (query and key heads) and stores its rows where the attention reads
        them."""
        geo = epi.qkv
        hq, hkv, dh = geo.num_heads, geo.num_kv_heads, geo.head_dim
        n_rep = hq // hkv
        tile = acc if interpret else plgpu.layout_cast(acc, plgpu.Layout.WGMMA)
        row = wgmma_iota((lay.ROWS, mp), 0, interpret)  # row of this warpgroup's tile
        if dh == QKV_HEAD_DIM:
            head, channel = nt, row + wg * lay.ROWS
            rpair.at[wg][...] = tile
        else:
            head, channel = nt * wgs + wg, row
            rpair.at[wg, pl.ds(0, lay.ROWS)][...] = tile
            rpair.at[wg, pl.ds(lay.ROWS, lay.ROWS)][...] = tile
        plgpu.barrier_arrive(rope_bar.at[0])  # every tile written (one arrival per warpgroup) ...
        plgpu.barrier_wait(rope_bar.at[0])  # ... before any is read
        if dh == QKV_HEAD_DIM:
            other = _load_acc(rpair.at[1 - wg], interpret)  # other[r] = channel r + 64 (wg 0) or r (wg 1)
            sign = (2 * wg - 1).astype(jnp.float32)
        else:  # other[r] = channel (r + 32) mod 64 (plain loads: a 32-row offset)
            half = rpair.at[wg, pl.ds(lay.ROWS // 2, lay.ROWS)]
            other = half[...] if interpret else load_wgmma(half, optimized=False)
            sign = jnp.where(row < lay.ROWS // 2, -1.0, 1.0).astype(jnp.float32)
        load_g = (lambda ref: ref[...]) if interpret else (lambda ref: load_wgmma(ref, optimized=False))
        # row r: the angle of r's pair (rope_table), columns: this block's rows
        cs = [cs_gmem.at[i] if row_blocks == 1 else cs_gmem.at[i, :, pl.ds(row0, mp)] for i in range(2)]
        cos, sin = load_g(cs[0]), load_g(cs[1])
        # rotate-half: channel c < D/2 gets x_c cos - x_(c+D/2) sin, channel c + D/2 x_(c+D/2) cos + x_c sin
        roped = acc * cos + sign * (other * sin)
        mrow = wgmma_iota((lay.ROWS, mp), 1, interpret) + row0  # row of x: m = b T + t
        valid = mrow < m
        # batch row b and the query operand's first column of token t, t n_rep (T = 1: b = m, t = 0)
        b, t_col = (mrow, None) if geo.tokens == 1 else (mrow // geo.tokens, lax.rem(mrow, geo.tokens) * n_rep)
        slots_blk = slots_gmem if row_blocks == 1 else slots_gmem.at[pl.ds(row0, mp)]
        slot_col = slots_blk[...] if interpret else _common.load_with_layout(
            slots_blk, plgpu.Layout.WGMMA.reduce(0), optimized=False)
        slot = lax.broadcast_in_dim(slot_col, (lay.ROWS, mp), (1,))

        def ring_offsets(h):  # flat index of ring[layer, b, h, slot[b], channel]
            return (((layer_idx * geo.batch + b) * hkv + h) * geo.ring + slot) * dh + channel

        def store(vals, offs, dst):
            offs = jnp.where(valid, offs, -1)
            if not interpret:
                _scatter_bf16(vals, offs, dst)
                return
            # interpret mode: a whole-ref update, the two warpgroups one after the other
            @pl.when(wg == 1)
            def _():
                plgpu.barrier_wait(seq_bar.at[0])

            flat = dst[...]
            idx = jnp.where(offs >= 0, offs, flat.shape[0]).reshape(-1)
            dst[...] = flat.at[idx].set(vals.reshape(-1).astype(flat.dtype), mode="drop")

            @pl.when(wg == 0)
            def _():
                plgpu.barrier_arrive(seq_bar.at[0])

        @pl.when(head < hq)
        def _():  # query head: qbuf[b, head // n_rep, channel, t n_rep + head % n_rep]
            store(roped, ((b * hkv + head // n_rep) * dh + channel) * geo.q_cols
                  + (head % n_rep if t_col is None else t_col + head % n_rep), qbuf)

        @pl.when((head >= hq) & (head < hq + hkv))
        def _():
            store(roped, ring_offsets(head - hq), kring)

        @pl.when(head >= hq + hkv)
        def _():
            store(acc, ring_offsets(head - hq - hkv), vring)

    def finish(acc, ss=None):
        """A consumer warpgroup after its main loop: publish the cluster partial, store the
        split-K partial (XLA sums; "sem": the last split sums), or run the epilogue (`ss`: the
        norm's row sums where the consumers computed them, `cn`)."""
        if red is not None:  # publish the partial; rank 0 sums them below
            red.at[wg][...] = acc
        elif ws_gmem is not None:
            sem_sum(acc)
        elif splits > 1:
            _store_tile(acc, o_smem, out_gmem.at[ks], wg=wg, col0=col0, m=m, interpret=interpret, row0=row0)
        else:
            if epi.norm and ss is None:
                plgpu.barrier_wait(norm_bar.at[0])
                ss = _load_row_sums(ss_ref, mp, interpret)
            final(acc, ss)

    def sem_sum(acc):
        """reduce == "sem": splits 0 .. S-2 of column tile `tile` store their partial (with the
        norm also their row sums x^2) in the workspace and count up its semaphore (after a
        warpgroup barrier: every thread's stores first; release at gpu scope); split S-1 waits for
        S-1 counts (acquire; it leaves the semaphore at 0 for the next call), adds p[0] + p[1] +
        ... + p[S-1] in that order (the "gmem" sum's order: the same bits; the row sums in the
        cluster sum's order) and runs the epilogue. Split S-1 has the highest linear
        CTA index of its tile (grid (nt, ks), nt fastest), so under in-order dispatch every CTA it
        waits for has started, and none of them waits. Interpret mode runs the grid in order (ks
        fastest) without the semaphore."""
        tile = nt * wgs + wg
        ss = None
        if epi.norm:  # this split's row sums of x^2 over its k range (norm: they travel with the partial)
            plgpu.barrier_wait(norm_bar.at[0])
            ss = _load_row_sums(ss_ref, mp, interpret)

        @pl.when(ks < splits - 1)
        def _():
            for ws, v in ((ws_gmem, acc), (wss_gmem, ss)):
                if ws is not None:
                    ws.at[ks, tile][...] = v if interpret else plgpu.layout_cast(v, plgpu.Layout.WGMMA)
            if not interpret:
                plgpu.commit_smem()  # warpgroup barrier
                plgpu.semaphore_signal(sem.at[tile], memory_scope="gpu")

        @pl.when(ks == splits - 1)
        def _():
            if not interpret:
                plgpu.semaphore_wait(sem.at[tile], splits - 1, memory_scope="gpu")

            def total(ws, own):  # p[0] + p[1] + ... + p[S-1], this split's last
                t = _load_partial(ws.at[0, tile], interpret)
                for i in range(1, splits - 1):
                    t = t + _load_partial(ws.at[i, tile], interpret)
                return t + own

            final(total(ws_gmem, acc), total(wss_gmem, ss) if epi.norm else None)

    def gather_groups(acc, ss=None):
        """k_groups > 1: group q > 0 leaves its partial in shared memory; the group-0 warpgroup of
        the same row tile adds them in group order (p_0 + p_1 + ...) and goes on (`finish`)."""
        if k_groups == 1:
            finish(acc, ss)
            return
        q, rt = wg // wgs, lax.rem(wg, wgs)

        @pl.when(q > 0)
        def _():
            kx.at[q - 1, rt][...] = acc
            plgpu.barrier_arrive(kx_bar.at[rt])

        @pl.when(q == 0)
        def _():
            plgpu.barrier_wait(kx_bar.at[rt])
            tot = acc
            for i in range(k_groups - 1):
                tot = tot + _load_acc(kx.at[i, rt], interpret)
            finish(tot)

    @pl.when(wg < wgs * k_groups)
    def _compute():
        if pdl:  # every thread that stores the output waits for the earlier grid too
            plgpu.griddepcontrol_wait()
            plgpu.griddepcontrol_launch_dependents()
        # this warpgroup's row tile and k group: steps i = q, q + k_groups, ... (slots i % stages, whose
        # residues mod k_groups are q's alone: stages is a multiple of k_groups)
        rt, q = lax.rem(wg, wgs), wg // wgs
        group_steps = steps // k_groups
        if kind == "int4" and variant == "mma":  # register A, warp-level MMAs, no async state
            def mma_step(j, carry):
                slot = lax.rem(j * k_groups + q, stages)
                plgpu.barrier_wait(full.at[slot])
                ops = (w_smem.at[slot, rt], sz_smem.at[slot, rt], x_smem.at[slot])
                if cn:  # carry: (acc, the x^2 chains), or acc where the sums come in
                    sq = not epi.sums
                    out = mma_stage(g, kt, mp, diag, mma_chains, norm=True, gain=epi.gain, sq=sq)(
                        *ops, *((g_smem.at[slot],) if epi.gain else ()), *(carry if sq else (carry,)))
                    carry = out
                else:
                    carry = mma_stage(g, kt, mp, diag, mma_chains)(*ops, carry)
                plgpu.barrier_arrive(empty.at[slot])
                return carry

            acc0 = plgpu.layout_cast(jnp.zeros((lay.ROWS, mp), jnp.float32), plgpu.Layout.WGMMA)
            if cn and epi.sums:
                gather_groups(lax.fori_loop(0, group_steps, mma_step, acc0), given_sums())
            elif cn:
                acc, ssq = lax.fori_loop(0, group_steps, mma_step, (acc0, acc0))
                gather_groups(acc, _fragment_row_sums(mp)(ssq))
            else:
                gather_groups(lax.fori_loop(0, group_steps, mma_step, acc0))
            return

        def acc_scope(acc_ref):
            def step(j, carry):
                slot = lax.rem(j * k_groups + q, stages)
                plgpu.barrier_wait(full.at[slot])
                if kind == "bf16" and not interpret:  # A straight from shared memory, transposed
                    plgpu.wgmma(acc_ref, _T(w_smem.at[slot, rt]), _T(x_smem.at[slot]))
                for kb in range(kt // lay.KB if (kind == "int4" or interpret) else 0):
                    cols = pl.ds(kb * lay.KB, lay.KB)
                    x_kb = x_smem.at[slot, :, cols]
                    if kind == "int4" and variant == "wgmma":
                        a = _dequant_block(g, kb)(w_smem.at[slot, rt], sz_smem.at[slot, rt])
                        plgpu.wgmma(acc_ref, a, _T(x_kb))
                        plgpu.wgmma_wait(1)
                        continue
                    a_smem, xt_smem = twin
                    if kind == "int4":  # the twin: dequantize into shared memory
                        c = lay.chunk_cols(g)
                        tile = twin_dequant(w_smem.at[slot, rt, kb][...].reshape(lay.THREADS, lay.WORDS),
                                             sz_smem.at[slot, rt, kb // (c // lay.KB)][...], g, kb)
                        a_smem.at[wg][...] = tile
                        a_op = a_smem.at[wg]
                    else:  # bf16 weights, interpret mode: materialize W^T
                        a_smem.at[wg][...] = w_smem.at[slot, rt, cols, :][...].T
                        a_op = a_smem.at[wg]
                    if interpret:  # the interpreter's wgmma takes no transposed operand
                        xt_smem.at[wg][...] = x_kb[...].T
                        b_op = xt_smem.at[wg]
                    else:
                        b_op = _T(x_kb)
                    plgpu.wgmma(acc_ref, a_op, b_op)
                    plgpu.wgmma_wait(0)
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(empty.at[slot])
                return carry

            lax.fori_loop(0, group_steps, step, 0)
            return acc_ref[...]

        gather_groups(pl.run_scoped(acc_scope, plgpu.ACC((lay.ROWS, mp), jnp.float32)))

    if red is not None:
        _cluster_sync()

        @pl.when((wg < wgs) & (ks == 0))
        def _reduce():
            tot = load_wgmma(red.at[wg])
            for i in range(1, splits):  # fixed order: p[0] + p[1] + ... + p[S-1]
                tot = tot + load_wgmma(plgpu.cluster_ref(red, {"ks": i}).at[wg])
            ss = None
            if epi.norm:  # the ranks' sums of x^2 over their k ranges, in the same order
                ss = load_wgmma(ss_ref)
                for i in range(1, splits):
                    ss = ss + load_wgmma(plgpu.cluster_ref(ss_ref, {"ks": i}))
            final(tot, ss)

        _cluster_sync()  # no CTA leaves while rank 0 still reads its shared memory


def _store_tile(acc: Array, o_smem: Any, dst: Any, *, wg: Any, col0: Any, m: int, interpret: bool,
                res: Any = None, res_bar: Any = None, sums: Any = None, row0: Any = 0) -> None:
    """acc [64 (n), M_pad] float32 -> out rows row0 .. row0 + M - 1, columns col0 .. col0 + 63 (transposed
    through shared memory, one TMA store). `res` (shared [M_pad, 64], landing on `res_bar`):
    the tile in the output dtype plus res, in that dtype (`Epilogue.residual`). `sums` (global
    float32 [M_pad], `Epilogue.row_sums`): the rows' sums of the stored tile squared, read back
    from shared memory while the TMA store runs."""
    val = acc.astype(o_smem.dtype)
    tile = o_smem.at[wg]
    if interpret:
        tile[...] = val.T
    else:
        _T(tile)[...] = plgpu.layout_cast(val, plgpu.Layout.WGMMA_TRANSPOSED)
    if res is not None:
        plgpu.commit_smem()  # the whole tile is written (warpgroup barrier) before any thread reads it
        plgpu.barrier_wait(res_bar)
        tile[...] = tile[...] + res[...]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[wg, pl.ds(0, m)], dst.at[pl.ds(row0, m), pl.ds(col0, lay.ROWS)])
    if sums is not None:
        if interpret:
            sums[...] = chunk_row_sums(tile[...][:m], tile.shape[0])[0]
        else:
            _tile_row_sums(m, tile.shape[0])(tile, sums)
    plgpu.wait_smem_to_gmem(0)


def thread_coords() -> tuple[Any, Any, Any, Any]:
    """Inside an inline_mgpu function of one warpgroup: (c, tid, warp, lane), c(v) an i32 constant,
    tid the thread's index in its warpgroup (0..127), warp = tid / 32 and lane = tid % 32 (i32)."""
    ir, arith, _, _, _, mu = _mgpu_modules()
    i32 = ir.IntegerType.get_signless(32)

    def c(v: int) -> Any:
        return arith.constant(i32, v)

    tid = arith.remui(mu.thread_idx(), c(lay.THREADS))
    return c, tid, arith.divui(tid, c(32)), arith.remui(tid, c(32))


_SHFL_BFLY = "shfl.sync.bfly.b32 $0, $1, {}, 0x1f, 0xffffffff;"  # float32 butterfly partner (lane ^ {})


def butterfly_sum(v: Any, partners: tuple[int, ...]) -> Any:
    """Inside an inline_mgpu function: float32 v plus its butterfly partners' (lane ^ p for p in
    `partners`, in that order, each step adding the partner's running sum): every lane of the
    group ends with the same bits (float addition is commutative)."""
    ir, arith, llvm, _, _, _ = _mgpu_modules()
    f32 = ir.F32Type.get()
    for p in partners:
        v = arith.addf(v, llvm.inline_asm(f32, [v], _SHFL_BFLY.format(p), "=f,f", has_side_effects=True))
    return v


def _tile_row_sums(m: int, mp: int):
    """inline_mgpu function of one warpgroup: (tile shared [M_pad, 64] of the output dtype, dst
    global float32 [M_pad]) -> dst[r] = sum_c tile[r, c]^2 in float32 for r < M, 0 above (rows
    past M hold no output). Warp w takes rows w, w + 4, ...; lane l of it columns 2 l and 2 l + 1
    (a warp reads one row's 128 bytes: every bank once), x_2l^2 + x_2l+1^2, then a butterfly over
    the 32 lanes (partners 16, 8, 4, 2, 1: every lane ends with the same bits, float addition
    being commutative) and lane 0 stores. A row's order is fixed: independent of M and of the
    other rows. The tile must be complete (a warpgroup barrier after its last store)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def fn(ctx, tile, dst):
        del ctx
        ir, arith, _, _, _, _ = _mgpu_modules()
        from jax._src.lib.mlir.dialects import memref, scf

        index, f32 = ir.IndexType.get(), ir.F32Type.get()
        c, _, warp, lane = thread_coords()
        cols = [arith.index_cast(index, arith.addi(arith.muli(lane, c(2)), c(e))) for e in range(2)]
        is_f32 = ir.MemRefType(tile.type).element_type == f32
        for j in range(mp // 4):
            row = arith.addi(warp, c(4 * j))
            vals = [memref.load(tile, [arith.index_cast(index, row), col]) for col in cols]
            vals = [v if is_f32 else arith.extf(f32, v) for v in vals]
            tot = butterfly_sum(arith.addf(arith.mulf(vals[0], vals[0]), arith.mulf(vals[1], vals[1])),
                                (16, 8, 4, 2, 1))
            tot = arith.select(arith.cmpi(arith.CmpIPredicate.ult, row, c(m)), tot, arith.constant(f32, 0.0))
            branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.eq, lane, c(0)))
            with ir.InsertionPoint(branch.then_block):
                memref.store(tot, dst, [arith.index_cast(index, row)])
                scf.yield_([])

    return fn


def wgmma_iota(shape: tuple[int, int], dim: int, interpret: bool) -> Array:
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _scatter_bf16(vals: Array, offs: Array, dst: Any) -> None:
    """dst[offs[i, j]] = bf16(vals[i, j]) where offs[i, j] >= 0: vals float32 and offs int32, both
    [64, M_pad] WGMMA arrays; dst a flat bf16 global-memory ref. Each thread stores its own
    elements (a handful per thread at decode sizes; no relayout, no shared memory)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, scf, vector

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(ctx, v, o, ref):
        del ctx
        index, i32, bf16 = ir.IndexType.get(), ir.IntegerType.get_signless(32), ir.BF16Type.get()
        zero = arith.constant(i32, 0)
        for vreg, oreg in zip(v.registers.flat, o.registers.flat):
            for e in range(ir.VectorType(vreg.type).shape[0]):
                val = vector.extract(vreg, dynamic_position=[], static_position=[e])
                off = vector.extract(oreg, dynamic_position=[], static_position=[e])
                branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.sge, off, zero))
                with ir.InsertionPoint(branch.then_block):
                    memref.store(arith.truncf(bf16, val), ref, [arith.index_cast(index, off)])
                    scf.yield_([])

    store(vals, offs, dst)


def _cluster_sync() -> None:
    """barrier.cluster arrive (release) + wait (acquire), by every thread of every CTA of the
    cluster: orders the partials' shared-memory stores before the peers' DSMEM reads."""

    @plgpu.inline_mgpu()
    def fn(ctx):
        del ctx
        ir, _, llvm, _, _, _ = _mgpu_modules()
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [],
                        "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;",
                        "", has_side_effects=True)

    fn()


def load_wgmma(ref: Any, optimized: bool = True) -> Array:
    """A [64, M_pad] float32 partial in the WGMMA layout from (local or peer) shared memory, or with
    optimized=False from global memory (plain loads: Mosaic has no optimized transfer from there)."""
    return _common.load_with_layout(ref, plgpu.Layout.WGMMA, optimized)


def _load_partial(ref: Any, interpret: bool) -> Array:
    """A partial from the "sem" workspace in global memory; a plain load in interpret mode."""
    return ref[...] if interpret else load_wgmma(ref, optimized=False)


def _load_acc(ref: Any, interpret: bool) -> Array:
    """`load_wgmma` on the GPU; a plain load in interpret mode."""
    return ref[...] if interpret else load_wgmma(ref)


def _load_row_sums(ss_ref: Any, mp: int, interpret: bool) -> Array:
    """The norm's row sums ss [64, M_pad] (every row the same) in the WGMMA layout. Above
    PLAIN_EXCHANGE_MP the tile cannot be loaded in that layout (see `exchange_transforms`): its
    row 0 is loaded as a per-column vector and broadcast (the same values)."""
    if interpret or mp <= PLAIN_EXCHANGE_MP:
        return _load_acc(ss_ref, interpret)
    col = plgpu.Layout.WGMMA.reduce(0)
    row0 = _common.load_with_layout(ss_ref.at[0], col)
    return lax.broadcast_in_dim(row0, (lay.ROWS, mp), (1,))


def _call(kind: str, x: Array, w_arrays: tuple[Array, ...], layer: Any, *, k: int, n: int,
          g: int | None, cfg: MgpuConfig, out_dtype: Any, variant: str, interpret: bool,
          n_layers: int, w_stacked: bool, epi: Epilogue = Epilogue(), norm_weight: Array | None = None,
          residual: Array | None = None, qkv_operands: dict[str, Any] | None = None,
          norm_sums: Array | None = None) -> Array:
    """Builds and runs one launch. `qkv_operands` (Epilogue.qkv): the arrays "cs" and "slots" and
    the refs "qbuf", "kring", "vring" (flat, `jax.new_ref`), which the kernel writes in place."""
    m = x.shape[0]
    # row blocks, M_pad each: the qkv epilogue's (`qkv_blocks`) or a plain call's (`dense_blocks`)
    nb, mp = qkv_blocks(m, epi.qkv.head_dim) if epi.qkv is not None else dense_blocks(m)
    kt, wgs, s, kg = cfg.k_tile, cfg.wgs, cfg.splits, cfg.k_groups
    steps = k // (kt * s)
    plain_blocks = nb > 1 and epi.qkv is None  # a plain call's row blocks: each stores its whole block
    if nb > 1 and not plain_blocks and (epi.norm or s > 1 or kg > 1):
        raise ValueError(f"M={m} rows of {epi.qkv.head_dim}-channel heads run in {nb} row blocks, which take the qkv "
                         f"epilogue without a norm, one split and one k group (the target's bf16 q|k|v); got "
                         f"norm={epi.norm}, splits={s}, k_groups={kg}")
    reduce = cfg.reduce if s > 1 else "gmem"
    if plain_blocks and (epi.norm or epi.residual or kg > 1 or reduce != "gmem"):
        # (a block has M_pad > 24 rows, where the cluster sum does not lower: `reduce_mode`)
        raise ValueError(f"M={m} rows run in {nb} row blocks of {mp}, which take no norm or residual, one k group "
                         f"and the 'gmem' split-K sum; got norm={epi.norm}, residual={epi.residual}, "
                         f"k_groups={kg}, reduce={reduce!r}")
    m_cta = mp if plain_blocks else m  # rows a CTA stores
    if interpret and reduce == "cluster":
        raise ValueError("the cluster split-K reduction does not run in interpret mode; use reduce='gmem'")
    if cfg.norm_ahead < 1:
        raise ValueError(f"norm_ahead={cfg.norm_ahead}: the norm pass runs at least one step ahead (>= 1)")
    if not epilogue_allows(epi, wgs, s, reduce):
        raise ValueError(f"{epi} needs the whole K sum in the kernel (splits == 1, the cluster or the 'sem' sum; "
                         f"swiglu: wgs == 2); got wgs={wgs}, splits={s}, reduce={reduce!r}")
    # the kernel writes [M, N] (else float32 partials [S, M, N]); "sem" also the workspace of the
    # partials of splits 0 .. S-2, [S-1, N/64, 64, M_pad] float32 tiles in the accumulator's layout
    # (and with the norm their row sums x^2, the same shape)
    whole = s == 1 or reduce in ("cluster", "sem")
    res_in_kernel = epi.residual and whole
    use_twin = variant == "smem" or interpret
    o_dtype = jnp.dtype(out_dtype) if whole else jnp.dtype(jnp.float32)
    f32 = jnp.float32
    x_tf = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    cn = norm_in_consumers(epi, kind, variant, interpret, k, s, kg)  # the norm in the consumers: x and g land there
    if epi.sums and not (cn or interpret) or epi.sums and s > 1:
        raise ValueError(f"norm_sums (the rows' sums of x^2 given) run in the consumers, with one split: the 'mma' "
                         f"variant, K <= {CONSUMER_NORM_MAX_K} (norm_in_consumers); got variant={variant!r}, K={k}, "
                         f"splits={s}")
    if cfg.diag in NORM_DIAGNOSTICS and not cn:
        raise ValueError(f"diag={cfg.diag!r} leaves out a part of the norm in the consumers; this launch has none "
                         f"(norm_in_consumers: the 'mma' variant on the GPU, the norm, one split and k group, "
                         f"K <= {CONSUMER_NORM_MAX_K}; got norm={epi.norm}, variant={variant!r}, K={k}, splits={s})")
    # full's arrivals: x (the pass's, or x and g in the consumers) + w
    n_full = (2 if cn and epi.gain else 1) + ((2 * wgs if epi.swiglu else 2) if kind == "int4" else wgs)

    def declare_scratch(stages: int) -> dict[str, Any]:
        scratch: dict[str, Any] = {"x_smem": plgpu.SMEM((stages, mp, kt), jnp.bfloat16, transforms=x_tf)}
        if kind == "int4":
            c = lay.chunk_cols(g)
            scratch["w_smem"] = plgpu.SMEM((stages, wgs, kt // lay.KB, *TMA_VIEWS[cfg.tma_view]), jnp.uint32)
            scratch["sz_smem"] = plgpu.SMEM((stages, wgs, kt // c, 64 * c // g), jnp.uint32)
        else:
            scratch["w_smem"] = plgpu.SMEM((stages, wgs, kt, lay.ROWS), jnp.bfloat16, transforms=x_tf)
        if use_twin:  # one operand tile per consumer warpgroup
            a_tf = () if interpret else x_tf
            scratch["a_twin"] = plgpu.SMEM((wgs * kg, lay.ROWS, lay.KB), jnp.bfloat16, transforms=a_tf)
            scratch["xt_twin"] = plgpu.SMEM((wgs * kg, lay.KB, mp), jnp.bfloat16)
        scratch["o_smem"] = plgpu.SMEM((wgs, mp, lay.ROWS), o_dtype)
        scratch["full"] = plgpu.Barrier(num_barriers=stages, num_arrivals=n_full)
        scratch["empty"] = plgpu.Barrier(num_barriers=stages, num_arrivals=wgs)
        if reduce == "cluster":
            scratch["red"] = plgpu.SMEM((wgs, lay.ROWS, mp), f32)
        if kg > 1:  # the partials of k groups 1 .. kg - 1, per row tile, for group 0
            scratch["kx"] = plgpu.SMEM((kg - 1, wgs, lay.ROWS, mp), f32,
                                       transforms=() if interpret else exchange_transforms(mp))
            scratch["kx_bar"] = plgpu.Barrier(num_barriers=wgs, num_arrivals=kg - 1)
        if epi.norm and epi.gain:
            scratch["g_smem"] = plgpu.SMEM((stages, kt), jnp.bfloat16)
        if epi.norm and not cn:  # the producer's pass and finish
            scratch["xfull"] = plgpu.Barrier(num_barriers=stages, num_arrivals=2 if epi.gain else 1)  # x (and g)
            scratch["part"] = plgpu.SMEM((mp,) if interpret else (m, lay.THREADS), f32)
            if not interpret:
                scratch["ssw"] = plgpu.SMEM((4, mp), f32)
            scratch["ss"] = plgpu.SMEM((lay.ROWS, mp), f32)
            scratch["norm_bar"] = plgpu.Barrier(num_barriers=1, num_arrivals=1)
        if res_in_kernel:
            scratch["res_smem"] = plgpu.SMEM((wgs, mp, lay.ROWS), o_dtype)
            scratch["res_bar"] = plgpu.Barrier(num_barriers=1, num_arrivals=wgs)
        if epi.swiglu:
            scratch["pair"] = plgpu.SMEM((lay.ROWS, mp), f32, transforms=() if interpret else exchange_transforms(mp))
            scratch["pair_bar"] = plgpu.Barrier(num_barriers=1, num_arrivals=1)
        if epi.qkv is not None:  # the two halves of a head, or a tile twice (mp <= 24: plain transfers)
            twice = epi.qkv.head_dim != QKV_HEAD_DIM
            scratch["rpair"] = plgpu.SMEM((wgs, 2 * lay.ROWS, mp) if twice else (2, lay.ROWS, mp), f32)
            scratch["rope_bar"] = plgpu.Barrier(num_barriers=1, num_arrivals=wgs)
            if interpret:
                scratch["seq_bar"] = plgpu.Barrier(num_barriers=1, num_arrivals=1)
        return scratch

    # Pipeline depth: the declaration at 0 and 1 stages gives the other scratch and a stage's.
    other = _smem_bytes(declare_scratch(0))
    stages = _stages_for(kind, cfg, mp, g, (other, _smem_bytes(declare_scratch(1)) - other))
    if stages % kg:
        raise ValueError(f"k_groups={kg}: the pipeline's {stages} stages (k_tile={kt}, M_pad={mp}) must be a "
                         f"multiple of it (each k group owns the slots of its residue)")
    scratch = declare_scratch(stages)
    n_out = n // 2 if epi.swiglu else n
    m_out = nb * mp if plain_blocks else m  # the output's rows (plain blocks: rows past M are cut below)
    out_shape = (m_out, n_out) if whole else (s, m_out, n)
    # the TMA view of x tiles rows by 8 (above 8 rows, M must be a multiple: rows_for) and every row block is whole:
    if nb * mp > max(m, 8):  # zero rows, never stored (rows stay independent)
        x = jnp.pad(x, ((0, nb * mp - m), (0, 0)))
    inputs: dict[str, Array] = {"x": x, "w": w_arrays[0]}
    if kind == "int4":
        inputs["sz"] = w_arrays[1]
    if epi.norm and epi.gain:
        inputs["g"] = norm_weight
    if epi.sums:
        inputs["ssin"] = norm_sums
    if res_in_kernel:
        inputs["res"] = residual
    g_stacked = epi.norm and epi.gain and norm_weight.ndim == 2
    if w_stacked or g_stacked or epi.qkv is not None:
        inputs["layer"] = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    if epi.qkv is not None:
        inputs.update(qkv_operands)
    sem_ws = reduce == "sem" and s > 1
    ws_names = (("ws", "wss") if epi.norm else ("ws",)) if sem_ws else ()  # partials (and row sums x^2)
    rsq_names = ("rsq",) if epi.row_sums and res_in_kernel else ()  # the output rows' sums of squares
    names = (*inputs, "out", *rsq_names, *ws_names, *scratch)
    kernel = functools.partial(
        _kernel, names=names, kind=kind, variant=variant, interpret=interpret, m=m_cta, mp=mp, kt=kt, wgs=wgs,
        steps=steps, stages=stages, splits=s, g=g, w_stacked=w_stacked, g_stacked=g_stacked, n_layers=n_layers,
        reduce=reduce, diag=cfg.diag, pdl=cfg.pdl and not interpret, epi=epi, k_total=k,
        half_tiles=n // 2 // lay.ROWS, norm_ahead=cfg.norm_ahead, mma_chains=cfg.mma_chains, k_groups=kg, cn=cn,
        row_blocks=nb)
    kw: dict[str, Any] = {}
    if interpret:
        kw["interpret"] = interpret_params()
    if reduce == "cluster":  # the S CTAs of a column tile form one cluster (rank = split index)
        kw.update(grid=(n // (lay.ROWS * wgs),), grid_names=("nt",), cluster=(s,), cluster_names=("ks",))
    elif nb > 1:  # row blocks (`qkv_blocks`, `dense_blocks`)
        kw.update(grid=(n // (lay.ROWS * wgs), s, nb), grid_names=("nt", "ks", "rb"))
    else:
        kw.update(grid=(n // (lay.ROWS * wgs), s), grid_names=("nt", "ks"))
    out_types = [jax.ShapeDtypeStruct(out_shape, o_dtype)]
    out_types += [jax.ShapeDtypeStruct((n // lay.ROWS, mp), f32) for _ in rsq_names]
    out_types += [jax.ShapeDtypeStruct((s - 1, n // lay.ROWS, lay.ROWS, mp), f32) for _ in ws_names]
    out_type = tuple(out_types) if len(out_types) > 1 else out_types[0]
    name = f"{kind}_{variant}_skinny_k{k}_n{n}_g{g}_s{s}{f'_kg{kg}' if kg > 1 else ''}{epi.tag()}"
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    if epi.qkv is None:
        call = plgpu.kernel(kernel, out_type=out_type, num_threads=wgs * kg + 1, thread_name="wg",
                            scratch_types=list(scratch.values()), compiler_params=params, kernel_name=name, **kw)
        y = call(*inputs.values())
    else:  # refs among the operands, aliased in and out: pl.kernel (plgpu.kernel's vmap wrapper takes no refs)
        interp = kw.pop("interpret", False)
        mesh = plgpu.Mesh(num_threads=wgs * kg + 1, thread_name="wg", kernel_name=name, **kw)

        def body(*refs):
            pl.run_scoped(functools.partial(kernel, *refs), *scratch.values(), collective_axes="wg")

        y = pl.kernel(body, out_type=(out_type,), mesh=mesh, compiler_params=params, interpret=interp,
                      name=name)(*inputs.values())[0]
    rsq = y[1] if rsq_names else None
    if len(out_types) > 1:
        y = y[0]
    if m_out > m:  # a plain call's last block's padding rows
        y = y[:, :m] if not whole else y[:m]
    if not whole:  # fixed-order sum of the split-K partials: p[0] + p[1] + ... + p[S-1]
        acc = y[0]
        for i in range(1, s):
            acc = acc + y[i]
        y = acc.astype(out_dtype)
        if epi.residual:  # the kernel's formula: the output-dtype product plus the residual
            y = y + residual
        if epi.row_sums:  # in the same XLA fusion
            rsq = chunk_row_sums(y, mp)
    return (y, rsq) if epi.row_sums else y


# ------------------------------------------------------------------------------ public entries
def _check_x(x: Array, k: int, max_m: int = MAX_M) -> int:
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"x dtype {x.dtype}: the Mosaic GPU kernels take bfloat16 activations")
    m, kx = x.shape
    if kx != k:
        raise ValueError(f"x has K={kx} columns but the weight has K={k} rows")
    if not 1 <= m <= max_m:
        raise ValueError(f"M={m} rows; the skinny kernels take 1..{max_m} (decode-sized M)")
    return m


def _check_cfg(cfg: MgpuConfig, k: int, n: int, c: int) -> None:
    if cfg.wgs not in (1, 2, 4) or n % (lay.ROWS * cfg.wgs):
        raise ValueError(f"wgs={cfg.wgs}: must be 1, 2 or 4 with N={n} a multiple of {lay.ROWS * cfg.wgs}")
    if cfg.k_tile % c or k % (cfg.k_tile * cfg.splits):
        raise ValueError(f"k_tile={cfg.k_tile} x splits={cfg.splits} must divide K={k} "
                         f"(k_tile a multiple of {c})")
    if cfg.reduce not in REDUCE_MODES:
        raise ValueError(f"reduce={cfg.reduce!r}; expected one of {REDUCE_MODES}")
    if cfg.reduce == "cluster" and cfg.splits > MAX_CLUSTER:
        raise ValueError(f"reduce='cluster' spans at most {MAX_CLUSTER} CTAs; splits={cfg.splits}")
    if cfg.diag not in DIAGNOSTICS:
        raise ValueError(f"diag={cfg.diag!r}; expected one of {DIAGNOSTICS}")
    if cfg.mma_chains not in MMA_CHAINS:
        raise ValueError(f"mma_chains={cfg.mma_chains}; expected one of {MMA_CHAINS}")
    if cfg.k_groups not in K_GROUPS or (k // (cfg.k_tile * cfg.splits)) % cfg.k_groups:
        raise ValueError(f"k_groups={cfg.k_groups}: expected one of {K_GROUPS}, dividing the "
                         f"{k // (cfg.k_tile * cfg.splits)} k steps of a split (K={k}, k_tile={cfg.k_tile}, "
                         f"splits={cfg.splits})")
    if cfg.tma_view not in TMA_VIEWS:
        raise ValueError(f"tma_view={cfg.tma_view!r}; expected one of {tuple(TMA_VIEWS)}")


def reduce_mode(m: int, interpret: bool) -> str:
    """The split-K sum: in-cluster (DSMEM) up to 24 rows; beyond, the float32 partial tiles
    [64, M_pad >= 32] have no bank-conflict-free WGMMA-layout load (Mosaic's transfer planner
    refuses it: H200, SmolLM2 w_down at M = 32), so the partials go through global memory.
    Interpret mode has no clusters. Both sum p[0] + p[1] + ... in that order, so a row's bits
    do not depend on the mode (tools/device/check_w4a16.py, check 2)."""
    return "gmem" if interpret or rows_for(m) > PLAIN_EXCHANGE_MP else "cluster"


def _check_epilogue(epi: Epilogue, m: int, k: int, n: int, layer: Any, out_dtype: Any,
                    norm_weight: Array | None, residual: Array | None) -> None:
    check_sums_flags(epi)  # first: row_sums alone is a falsy (empty) epilogue
    if not epi:
        return
    if m > MAX_FUSED_M:
        raise ValueError(f"M={m} rows; a fused epilogue takes 1..{MAX_FUSED_M} (Epilogue)")
    if epi.norm and not epi.gain and norm_weight is not None:
        raise ValueError("unit_norm (a norm without weight) takes no norm_weight")
    if epi.norm and epi.gain:
        if norm_weight.dtype != jnp.bfloat16 or norm_weight.ndim not in (1, 2) or norm_weight.shape[-1] != k:
            raise ValueError(f"norm_weight must be bfloat16 [K={k}] or a stack [L, K]; got "
                             f"{norm_weight.dtype} {norm_weight.shape}")
    if epi.swiglu and (epi.residual or n % (2 * lay.ROWS)):
        raise ValueError(f"swiglu: N={n} must be gate | up halves of a multiple of {lay.ROWS} columns, "
                         "without a residual")
    if epi.residual and (residual.shape != (m, n) or residual.dtype != out_dtype):
        raise ValueError(f"residual must be [{m}, {n}] {out_dtype} (the output's shape and dtype); "
                         f"got {residual.dtype} {residual.shape}")


def check_sums_flags(epi: Epilogue) -> None:
    """The sums' rules of an `Epilogue` (every backend's): `sums` needs the norm, `row_sums` a residual
    output (not SiLU·up, not the qkv epilogue)."""
    if epi.sums and not epi.norm:
        raise ValueError("norm_sums are the norm's row sums: pass norm_weight or unit_norm=True with them")
    if epi.row_sums and not (epi.residual and not epi.swiglu and epi.qkv is None):
        raise ValueError("row_sums=True are the sums of the residual kernel's output (the next norm's input): "
                         "pass residual= with it (not swiglu)")


def check_norm_sums(norm_sums: Array | None, m: int) -> None:
    """`norm_sums` for M rows: None or float32 [P, rows_for(M)]."""
    if norm_sums is not None and (norm_sums.ndim != 2 or norm_sums.shape[1] != rows_for(m)
                                  or norm_sums.dtype != jnp.float32):
        raise ValueError(f"norm_sums must be float32 [P, {rows_for(m)}] (P partial sums per row, rows padded to "
                         f"rows_for({m})); got {norm_sums.dtype} {norm_sums.shape}")


def int4_matmul_mgpu(x: Array, w: lay.W4A16Packed, *, layer: Any = None, out_dtype: Any = None,
                     config: MgpuConfig | None = None, variant: str = "mma",
                     interpret: bool | None = None, norm_weight: Array | None = None, norm_eps: float = 1e-5,
                     unit_norm: bool = False, norm_sums: Array | None = None, swiglu: bool = False,
                     residual: Array | None = None, row_sums: bool = False) -> Array | tuple[Array, Array]:
    """x [M, K] bf16 @ W [K, N] (INT4, packed layout) -> [M, N] (default bf16) on Hopper.

    `w` holds one layer ([N/64, K/64, 128, 4] ...) or a stack [L, ...] with `layer` (int or traced
    int32 scalar, clamped to 0..L-1) read in place. `variant`: "mma" (dequantize into registers,
    warp-level mma.sync: the GPU default), "wgmma" (dequantize into the wgmma register operand) or
    "smem" (the shared-memory twin; interpret mode). `interpret=None` interprets unless the default
    backend is a GPU; the register variants cannot be interpreted (ValueError).

    Fused glue (`Epilogue`; at most MAX_FUSED_M rows): `norm_weight` bf16 [K] (or a stack [L, K]
    read at `layer`) folds RMSNorm(x) with that weight and `norm_eps` into the product, `unit_norm`
    RMSNorm without a weight (g = 1: `Epilogue.gain` False; no norm_weight), `norm_sums` float32
    [P, rows_for(M)] the rows' sums of x^2 in P parts (`Epilogue.sums`: not computed here);
    `swiglu` returns silu(gate) * up [M, N/2] of the gate | up halves of W; `residual` [M, N]
    (the output dtype) is added to the output, and with `row_sums` the call returns (out, the
    rows' sums of out^2 per 64-column tile, float32 [N / 64, rows_for(M)]: the next norm's
    `norm_sums`). `epilogue_reference` is the math."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; expected one of {VARIANTS}")
    if not isinstance(w, lay.W4A16Packed):
        raise TypeError(f"w must be a W4A16Packed (pallas_kernels.linear.layout.pack_*), got {type(w).__name__}")
    n_lead = len(w.lead)
    g_stacked = norm_weight is not None and norm_weight.ndim == 2
    if n_lead > 1 or (layer is None) != (n_lead == 0 and not g_stacked):
        raise ValueError(f"weight leading dims {w.lead} need layer= exactly when stacked ([L, ...]); "
                         f"got layer={layer!r}")
    k, n, g = w.k, w.n, w.group_size
    lay.check_shape(k, n, g)
    m = _check_x(x, k)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    epi = Epilogue(norm=norm_weight is not None or unit_norm, eps=float(norm_eps), gain=not unit_norm,
                   sums=norm_sums is not None, swiglu=swiglu, residual=residual is not None, row_sums=row_sums)
    _check_epilogue(epi, m, k, n, layer, out_dtype, norm_weight, residual)
    check_norm_sums(norm_sums, m)
    n_layers = w.lead[0] if n_lead else (norm_weight.shape[0] if g_stacked else 0)
    if g_stacked and norm_weight.shape[0] != n_layers:
        raise ValueError(f"norm_weight has {norm_weight.shape[0]} layers, the weight {n_layers}")
    interp = _common.interpret_default(interpret)
    if interp and variant != "smem":
        raise ValueError(f"variant={variant!r} (register operand) does not run in GPU interpret mode "
                         "(inline Mosaic GPU code); use variant='smem' on the CPU")
    cfg = config or default_config(k, n, g, reduce=reduce_mode(m, interp), epilogue=epi)
    _check_cfg(cfg, k, n, lay.chunk_cols(g))
    qw_tma = w.qw.reshape(*w.qw.shape[:-2], *TMA_VIEWS[cfg.tma_view])  # same bytes
    return _call("int4", x, (qw_tma, w.sz), layer, k=k, n=n, g=g, cfg=cfg, out_dtype=out_dtype, variant=variant,
                 interpret=interp, n_layers=n_layers, w_stacked=bool(n_lead), epi=epi, norm_weight=norm_weight,
                 residual=residual, norm_sums=norm_sums)


def rope_table(positions: Array, inv_freq: Array) -> Array:
    """float32 [2, 64, qkv_rows(M, D)] (M_pad, or the row blocks' rows together): cos and sin of
    positions[m] x inv_freq[r mod D/2] in row r, the
    RoPE angles of the qkv epilogue for the pair a warpgroup's tile row r belongs to
    (`model.apply_rope`'s formula; columns past M are zero angles). positions: int32 [M] (one
    token per row); inv_freq: float32 [D/2] for a head dim D in QKV_HEAD_DIMS (D = 64: the 32
    angles twice)."""
    if inv_freq.ndim != 1 or 2 * inv_freq.shape[0] not in QKV_HEAD_DIMS:
        raise ValueError(f"inv_freq must be [D/2] for a head dim D in {QKV_HEAD_DIMS}, got {inv_freq.shape}")
    inv = jnp.tile(jnp.asarray(inv_freq, jnp.float32), lay.ROWS // inv_freq.shape[0])  # [64]
    m = positions.shape[0]
    pos = jnp.pad(positions.astype(jnp.float32), (0, qkv_rows(m, 2 * inv_freq.shape[0]) - m))
    ang = pos[None, :] * inv[:, None]  # [64, M_pad]
    return jnp.stack([jnp.cos(ang), jnp.sin(ang)])


def _qkv_geometry(m: int, n: int, q_buf: Array, k_ring: Array, v_ring: Array, rope: Array,
                  slots: Array) -> QkvCache:
    if k_ring.shape != v_ring.shape or k_ring.ndim != 5 or k_ring.shape[-1] not in QKV_HEAD_DIMS:
        raise ValueError(f"k_ring, v_ring must both be [L, B, Hkv, R, D] with D in {QKV_HEAD_DIMS}; got "
                         f"{k_ring.shape}, {v_ring.shape}")
    n_layers, b, hkv, ring, dh = k_ring.shape
    if k_ring.size > QKV_MAX_BUFFER_ELEMENTS:
        raise ValueError(f"k_ring, v_ring {k_ring.shape}: {k_ring.size} elements; the qkv epilogue indexes them "
                         f"in int32 (at most {QKV_MAX_BUFFER_ELEMENTS})")
    if dh == QKV_HEAD_DIM and rows_for(m) > PLAIN_EXCHANGE_MP:
        raise ValueError(f"x has {m} rows: with head dim {dh} the qkv epilogue's two warpgroups exchange a head's "
                         f"halves through shared memory untransformed, at most {PLAIN_EXCHANGE_MP} rows (above, "
                         f"Mosaic GPU finds no bank-conflict-free transfer; H200, 2026-11-30)")
    if n % dh or n // dh <= 2 * hkv:
        raise ValueError(f"N={n} must be q | k | v heads of {dh} channels with {hkv} KV heads each for k and v")
    hq = n // dh - 2 * hkv
    if m % b:
        raise ValueError(f"x has {m} rows; the qkv epilogue takes T tokens per batch row: a multiple of the batch {b}")
    t = m // b
    if hq % hkv or q_buf.ndim != 4 or q_buf.shape[:3] != (b, hkv, dh) or q_buf.shape[3] < t * (hq // hkv):
        raise ValueError(f"q_buf must be [B={b}, Hkv={hkv}, {dh}, CN >= T n_rep = {t * (hq // hkv)}] (Hq={hq}, T={t}); "
                         f"got {q_buf.shape}")
    for name, a in (("q_buf", q_buf), ("k_ring", k_ring), ("v_ring", v_ring)):
        if a.dtype != jnp.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {a.dtype}")
    if m > QKV_MAX_M:
        raise ValueError(f"x has {m} rows; the qkv epilogue takes at most {QKV_MAX_M}")
    rows = qkv_rows(m, dh)
    if rope.shape != (2, lay.ROWS, rows) or rope.dtype != jnp.float32:
        raise ValueError(f"rope must be float32 [2, {lay.ROWS}, {rows}] (rope_table); got {rope.dtype} "
                         f"{rope.shape}")
    if slots.shape not in ((m,), (rows,)) or slots.dtype != jnp.int32:
        raise ValueError(f"slots must be int32 [{m}] (or padded to [{rows}]), got {slots.dtype} {slots.shape}")
    return QkvCache(num_heads=hq, num_kv_heads=hkv, batch=b, ring=ring, q_cols=q_buf.shape[3], layers=n_layers,
                    head_dim=dh, tokens=t)


def int4_qkv_cache_mgpu(x: Array, w: lay.W4A16Packed, *, layer: Any, rope: Array, slots: Array, q_buf: Array,
                        k_ring: Array, v_ring: Array, norm_weight: Array | None = None, norm_eps: float = 1e-5,
                        unit_norm: bool = False, norm_sums: Array | None = None, config: MgpuConfig | None = None,
                        interpret: bool | None = None) -> tuple[Array, Array, Array]:
    """The draft's q|k|v projection written where the decode attention reads it (`QkvCache`):
    RMSNorm (optional, with or without weight, as `int4_matmul_mgpu`), the INT4 product, RoPE of
    the query and key heads, the queries into the attention's operand and the keys and values
    into the FP rings, in one kernel that replaces the product's three XLA consumers (query rope + pad, key rope + ring
    write, value ring write).

    x [M, K] bf16, M = B T: T new tokens of each batch row, row m = b T + t; w the fused weight
    [K, (Hq + 2 Hkv) D] for a head dim D in QKV_HEAD_DIMS (stacked [L, ...] and read at `layer`,
    or one layer); rope float32 [2, 64, M_pad] (`rope_table` of the rows' positions); slots int32
    [M], each row's ring slot (or padded to [M_pad], which a caller looping over layers does
    once); q_buf bf16 [B, Hkv, D, CN] (the attention's query operand: column t n_rep + r of KV
    head h gets query head h n_rep + r of token t, the others are left as they are); k_ring,
    v_ring bf16 [L, B, Hkv, R, D] (the cache's `k_fp`, `v_fp`).
    Returns the updated (q_buf, k_ring, v_ring): the kernel writes them in place (aliased in and
    out), so a caller that donates or loop-carries them pays no copy. `qkv_cache_reference` is
    the math."""
    if not isinstance(w, lay.W4A16Packed):
        raise TypeError(f"w must be a W4A16Packed (pallas_kernels.linear.layout.pack_*), got {type(w).__name__}")
    k, n, g = w.k, w.n, w.group_size
    lay.check_shape(k, n, g)
    m = _check_x(x, k)
    geo = _qkv_geometry(m, n, q_buf, k_ring, v_ring, rope, slots)
    n_lead = len(w.lead)
    if n_lead > 1 or (n_lead == 1 and w.lead[0] != geo.layers):
        raise ValueError(f"weight leading dims {w.lead}: one layer, or a stack of the rings' {geo.layers} layers")
    epi = Epilogue(norm=norm_weight is not None or unit_norm, eps=float(norm_eps), gain=not unit_norm,
                   sums=norm_sums is not None, qkv=geo)
    _check_epilogue(epi, m, k, n, layer, jnp.dtype(jnp.bfloat16), norm_weight, None)
    check_norm_sums(norm_sums, m)
    interp = _common.interpret_default(interpret)
    cfg = config or default_config(k, n, g, reduce=reduce_mode(m, interp), epilogue=epi)
    _check_cfg(cfg, k, n, lay.chunk_cols(g))
    _check_qkv_cfg(epi, cfg)

    def run(x, qw, sz, norm_weight, norm_sums, layer, rope, slots, bufs):
        qw_tma = qw.reshape(*qw.shape[:-2], *TMA_VIEWS[cfg.tma_view])
        return _qkv_cache_call("int4", x, (qw_tma, sz), layer, rope, slots, bufs, k=k, n=n, g=g, cfg=cfg,
                               variant="smem" if interp else "mma", interpret=interp,
                               n_layers=w.lead[0] if n_lead else geo.layers, w_stacked=bool(n_lead), epi=epi,
                               norm_weight=norm_weight, norm_sums=norm_sums)

    return jax.jit(run)(x, w.qw, w.sz, norm_weight, norm_sums, layer, rope, slots, (q_buf, k_ring, v_ring))


def _check_qkv_cfg(epi: Epilogue, cfg: MgpuConfig) -> None:
    if not epilogue_allows(epi, cfg.wgs, cfg.splits, cfg.reduce if cfg.splits > 1 else "gmem"):
        wgs = "wgs=2" if epi.qkv.head_dim == QKV_HEAD_DIM else "wgs=1 or 2"
        raise ValueError(f"the qkv epilogue of {epi.qkv.head_dim}-channel heads needs {wgs} and the whole K sum in "
                         f"the kernel; got {cfg}")


def _qkv_cache_call(kind: str, x: Array, w_arrays: tuple[Array, ...], layer: Any, rope: Array, slots: Array,
                    bufs: tuple[Array, Array, Array], **kw: Any) -> tuple[Array, Array, Array]:
    """`_call` with the qkv epilogue (under jit: refs in global memory exist only there; inside an
    outer jit this one is inlined): the query operand and the rings `bufs` written in place."""
    refs = [jax.new_ref(a.reshape(-1), memory_space=plgpu.GMEM) for a in bufs]
    rows = rope.shape[-1]  # qkv_rows(M, D) (`_qkv_geometry` checked)
    _call(kind, x, w_arrays, layer, out_dtype=jnp.bfloat16,
          qkv_operands=dict(cs=rope, slots=jnp.pad(slots, (0, rows - slots.shape[0])), qbuf=refs[0],
                            kring=refs[1], vring=refs[2]), **kw)
    return tuple(r[...].reshape(a.shape) for r, a in zip(refs, bufs))


def _check_bf16_weight(w: Array, entry: str) -> tuple[int, int]:
    """(K, N) of a bf16 weight [K, N] or stack [L, K, N] the bf16 kernel takes."""
    if w.dtype != jnp.bfloat16:
        raise ValueError(f"w dtype {w.dtype}: {entry} takes bfloat16 weights")
    if w.ndim not in (2, 3):
        raise ValueError(f"w must be [K, N] or a stack [L, K, N]; got {w.shape}")
    k, n = w.shape[-2:]
    if k % lay.KB or n % lay.ROWS:
        raise ValueError(f"W [K={k}, N={n}]: K must be a multiple of {lay.KB} and N of {lay.ROWS}")
    return k, n


def bf16_qkv_cache_mgpu(x: Array, w: Array, *, layer: Any, rope: Array, slots: Array, q_buf: Array,
                        k_ring: Array, v_ring: Array, config: MgpuConfig | None = None,
                        interpret: bool | None = None) -> tuple[Array, Array, Array]:
    """`int4_qkv_cache_mgpu` for a bf16 weight (the target's q|k|v): x [M, K] bf16 already normed
    (no norm in the kernel), w [K, N] or a stack [L, K, N] read at `layer`; the product (the bf16
    kernel's, rows independent of M), RoPE and the writes as there. M up to QKV_MAX_M for 64-channel
    heads, whose rows above QKV_BLOCK_ROWS go in blocks of that many (`qkv_blocks`: the verify's B x T
    rows; `rope` then has `qkv_rows(M, D)` columns, as `rope_table` makes it). `qkv_cache_reference` with
    w in float32 is the math."""
    k, n = _check_bf16_weight(w, "bf16_qkv_cache_mgpu")
    m = _check_x(x, k, max_m=QKV_MAX_M)
    geo = _qkv_geometry(m, n, q_buf, k_ring, v_ring, rope, slots)
    if w.ndim == 3 and w.shape[0] != geo.layers:
        raise ValueError(f"weight stack of {w.shape[0]} layers; the rings hold {geo.layers}")
    epi = Epilogue(qkv=geo)
    _check_epilogue(epi, min(m, qkv_blocks(m, geo.head_dim)[1]), k, n, layer, jnp.dtype(jnp.bfloat16), None, None)
    interp = _common.interpret_default(interpret)
    cfg = config or default_config(k, n, None, reduce=reduce_mode(m, interp), epilogue=epi)
    _check_cfg(cfg, k, n, lay.KB)
    _check_qkv_cfg(epi, cfg)

    def run(x, w, layer, rope, slots, bufs):
        return _qkv_cache_call("bf16", x, (w,), layer, rope, slots, bufs, k=k, n=n, g=None, cfg=cfg,
                               variant="wgmma", interpret=interp, n_layers=w.shape[0] if w.ndim == 3 else geo.layers,
                               w_stacked=w.ndim == 3, epi=epi)

    return jax.jit(run)(x, w, layer, rope, slots, (q_buf, k_ring, v_ring))


def qkv_cache_reference(x: Array, w: Array, *, layer: Any, rope: Array, slots: Array, q_buf: Array,
                        k_ring: Array, v_ring: Array, norm_weight: Array | None = None,
                        norm_eps: float = 1e-5, unit_norm: bool = False,
                        norm_sums: Array | None = None) -> tuple[Array, Array, Array]:
    """jnp: what `int4_qkv_cache_mgpu` computes, for the weight as its MMA sees it (w [K, N]
    float32, `lay.dequantize_bf16`): `epilogue_reference`'s float32 product (with the norm),
    RoPE in float32 with the table's cos and sin, then the bf16 writes."""
    m = x.shape[0]
    geo = _qkv_geometry(m, w.shape[1], q_buf, k_ring, v_ring, rope, slots)
    hq, hkv, dh = geo.num_heads, geo.num_kv_heads, geo.head_dim
    half = dh // 2
    y = epilogue_reference(x, w, Epilogue(norm=norm_weight is not None or unit_norm, eps=float(norm_eps),
                                          gain=not unit_norm, sums=norm_sums is not None),
                           norm_weight=norm_weight, norm_sums=norm_sums, out_dtype=jnp.float32).reshape(m, -1, dh)
    cos, sin = rope[0, :half, :m].T[:, None], rope[1, :half, :m].T[:, None]  # [M, 1, D/2]
    x1, x2 = y[..., :half], y[..., half:]
    roped = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(jnp.bfloat16)
    t, n_rep = geo.tokens, hq // hkv
    q = roped[:, :hq].reshape(m // t, t, hkv, n_rep, dh)  # [B, T, Hkv, n_rep, D]
    q = jnp.transpose(q, (0, 2, 4, 1, 3)).reshape(m // t, hkv, dh, t * n_rep)  # column t n_rep + r
    q_buf = q_buf.at[:, :, :, :t * n_rep].set(q)
    b = jnp.arange(m) // t  # row m = b T + t
    slots = slots[:m]
    k_ring = k_ring.at[layer, b, :, slots].set(roped[:, hq:hq + hkv])
    v_ring = v_ring.at[layer, b, :, slots].set(y[:, hq + hkv:].astype(jnp.bfloat16))
    return q_buf, k_ring, v_ring


def bf16_matmul_mgpu(x: Array, w: Array, *, layer: Any = None, out_dtype: Any = None,
                     config: MgpuConfig | None = None, interpret: bool | None = None,
                     swiglu: bool = False) -> Array:
    """x [M, K] bf16 @ W [K, N] bf16 -> [M, N] with row-invariant results (module docstring), M up to
    DENSE_MAX_M: above MAX_M rows in equal row blocks of one launch (`dense_blocks`; a verify's B x T rows).
    `w` is one layer [K, N] or a stack [L, K, N] with `layer` read in place. `swiglu` (the
    target's gate | up weight; each row block as a call of its rows): silu(gate) * up [M, N / 2] from the
    float32 products, as the INT4 kernel's `Epilogue.swiglu` (`epilogue_reference` is the math)."""
    k, n = _check_bf16_weight(w, "bf16_matmul_mgpu")
    if (layer is None) != (w.ndim == 2):
        raise ValueError(f"w must be [K, N], or [L, K, N] with layer=; got {w.shape} and layer={layer!r}")
    m = _check_x(x, k, max_m=DENSE_MAX_M)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    epi = Epilogue(swiglu=swiglu)
    mp = dense_blocks(m)[1]  # each row block is a call of mp rows (one launch holds them all)
    _check_epilogue(epi, mp, k, n, layer, out_dtype, None, None)
    interp = _common.interpret_default(interpret)
    cfg = config or default_config(k, n, None, reduce=reduce_mode(mp, interp), epilogue=epi)
    _check_cfg(cfg, k, n, lay.KB)
    return _call("bf16", x, (w,), layer, k=k, n=n, g=None, cfg=cfg, out_dtype=out_dtype, variant="wgmma",
                 interpret=interp, n_layers=w.shape[0] if w.ndim == 3 else 0, w_stacked=w.ndim == 3, epi=epi)


__all__ = ["AUTO_FUSED_M", "AUTO_RESIDUAL_M", "DENSE_MAX_M", "MAX_FUSED_M", "MAX_M", "QKV_BLOCK_ROWS",
           "QKV_CACHE_FUSED_M", "QKV_HEAD_DIM", "QKV_MAX_M",
           "QKV_HEAD_DIMS", "QKV_MAX_BUFFER_ELEMENTS", "Epilogue", "MgpuConfig", "QkvCache", "auto_fused_rows",
           "bf16_matmul_mgpu", "bf16_qkv_cache_mgpu", "bf16_qkv_max_rows",
           "chunk_row_sums", "default_config", "dense_blocks", "epilogue_reference", "int4_matmul_mgpu",
           "int4_qkv_cache_mgpu",
           "check_norm_sums", "check_sums_flags", "interpret_params", "qkv_blocks", "qkv_cache_reference", "qkv_rows",
           "rope_table", "rows_for",
           "takes_norm_sums", "tuned_config"]
