"""Pallas (Triton lowering) decode attention over the QuantSpec hierarchical cache and a dense cache.

Two kernels, each behind one function that a Mosaic-GPU version could replace:

* `quantized_decode_attention`: split-K flash-decoding over the quantized region of a
  `QuantSpecCache` (INT4 "draft" view: upper planes only; INT8 "target" view: both planes),
  fused with the FP ring in the same launch (the last `ring_splits` programs of each
  (row, KV head) attend to the ring).
* `dense_decode_attention`: the same structure over a bf16 (or f32) dense cache; the AR-bf16
  baseline.

Both return flash-decoding partials (o, m, l) that `merge_partials` combines by log-sum-exp.
`cache_attention` is the drop-in for `qspec_jax.attention.cache_attention`.

Design (SPEC §3, §5):

* Grid (batch row, KV head, split). A program takes ALL n_rep query heads x T query tokens of
  its KV head as the rows of one tile (padded to M >= 16 rows), so K/V bytes are read once per
  KV head and never copied per query head.
* The kernels receive the FULL stacked cache arrays [L, B, Hkv, ...] (no BlockSpec, so no XLA
  slice is materialized) plus a small int32 `meta` array holding the layer index and the
  per-row lengths; the layer is indexed inside the kernel with pointer offsets.
* Splits are static (chosen from max_len and the GPU size); the chunk each split covers is
  computed per row at run time from q_len, so a half-full cache still spreads over all
  programs. A split with no tokens runs zero loop iterations and writes the neutral partial
  (m = -1e30, l = 0, o = 0); every partial is always written.
* Keys: per-channel (s, z) per G-token block. s (times the half's factor) is folded into q once
  per block, q.z is a per-block bias. Values: per-token (s, z); s multiplies p per token and
  sum(p z) is accumulated separately.
* Codes. Split-halves packing: byte j = channel j (low nibble) | channel j + D/2 (high
  nibble), so each tile does one dot per half. "fast" path (bf16/f16 activations): codes are
  turned into float16 operands with one or two bit operations (the 0x6400 "magic number":
  the f16 with bits 0x6400 | n is exactly 1024 + n for n < 1024), never with int->float
  conversions; the constant offset is removed afterwards with a per-row correction computed
  from the same rounded operands, so it cancels exactly:
      draft,  low half : 0x6400 | (b & 0x0F)                    = 1024 + U
      draft,  high half: 0x6400 | (b & 0xF0)                    = 1024 + 16 U
      target, low half : 0x6400 | ((h << 4) & 0xF0) | (l & 0x0F) = 1024 + 16 U + L'
      target, high half: 0x6400 | (h & 0xF0) | (l >> 4)          = 1024 + 16 U + L'
  (L' = L + 8 is the stored biased lower nibble, so 16 U + L' - 1032 = 16 U + (L - 8).)
  The "exact" path (float32 activations, used by the tests' 1e-5 check) converts the codes to
  float32 and uses IEEE float32 dots.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._common import interpret_default, next_pow2, num_sms

Array = jax.Array

NEG = -1e30  # "minus infinity" that stays finite: exp(NEG - m) == 0, NEG - NEG == 0
BIG_POS = 2**30  # position of padding query rows: they see everything (finite garbage, dropped)
MIN_ROWS = 16  # tensor-core dots need M >= 16
RING_TILE = 32  # ring slots per loop step; ring size is a multiple of this (cache.RING_ALIGN)
MAGIC = 0x6400  # float16 bits of 1024.0; 0x6400 | n == 1024 + n for 0 <= n < 1024
SUPPORTED_HEAD_DIMS = (64, 128)
_DEBUG = False  # print the Triton IR at lowering (offline inspection)
MAX_ROWS = 128  # n_rep * T


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tuning knobs. None means the heuristic default (see `_default_config`)."""

    block_s: int | None = None  # tokens per inner step (power of two dividing G / S)
    num_splits: int | None = None  # quantized (or dense) splits per (row, KV head)
    ring_splits: int | None = None  # programs per (row, KV head) that attend to the FP ring
    num_warps: int | None = None
    num_stages: int | None = None
    k_interleave: bool = False  # one interleaved-channel dot for q.K instead of one per half
    row_groups: int | None = None  # copies of the query rows per program tile (see row_groups)
    # How codes become dot operands. "magic" (the default): float16 operands built with bit
    # operations (0x6400 | code), float16 tensor-core dots; passed the compiled check on an H100
    # (2026-11-21, bf16 relerr 2.2e-3) and runs 1.6x faster than "f32" there (INT4 draft at 128k:
    # 0.179 vs 0.286 ms). "f32": int -> float32 conversions and TF32 dots (IEEE float32 dots for
    # float32 activations, which always take the exact path). An inline-PTX version of "magic"
    # gave wrong results on the H100 and was removed (docs/kernel_notes.md).
    codes: str | None = None


# ------------------------------------------------------------------------------- utilities
CODES_ENV = "QSPEC_KERNEL_CODES"


def default_codes() -> str:
    """The code-to-operand path when none is configured: "magic", unless the
    QSPEC_KERNEL_CODES environment variable names another (benchmarks compare paths with it)."""
    return os.environ.get(CODES_ENV, "magic")


def rows_for(n_rep: int, t: int) -> int:
    """Rows of a program's query tile: n_rep * T padded to a power of two >= 16."""
    return max(MIN_ROWS, next_pow2(n_rep * t))


def _dot(a: Array, b: Array, *, trans_b: bool = False, tf32: bool = False) -> Array:
    """a [M, K] @ b [K, N] (or b [N, K] with trans_b) with float32 accumulation. float32
    operands use IEEE float32 products unless `tf32` (tensor cores, 10-bit mantissa)."""
    prec = lax.Precision.HIGHEST if (a.dtype == jnp.float32 and not tf32) else None
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


_dot_global = _dot


def _online_update(s: Array, vis: Array, m: Array, l: Array):
    """One online-softmax step: s [M, N] scores (masked to NEG where not vis)."""
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    if vis is not None:
        p = jnp.where(vis, p, 0.0)
    l = l * alpha + jnp.sum(p, axis=1)
    return p, alpha, m_new, l


def _group_queries(q: Array, q_pos: Array, hkv: int, m_rows: int, groups: int = 1):
    """q [B, T, Hq, D] -> float32 [B, Hkv, M, D] pre-scaled by 1/sqrt(D), and positions [B, M].

    The M rows are `groups` copies of a group of M / groups rows; a group holds the n_rep * T
    real query rows t-major (row = t * n_rep + j) and then padding rows (q = 0, position
    BIG_POS)."""
    b, t, hq, d = q.shape
    n_rep = hq // hkv
    rg = m_rows // groups
    qg = q.reshape(b, t, hkv, n_rep, d).astype(jnp.float32) * (d ** -0.5)
    qg = jnp.transpose(qg, (0, 2, 1, 3, 4)).reshape(b, hkv, t * n_rep, d)
    pad = rg - t * n_rep
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, pad), (0, 0)))
    pos = jnp.repeat(q_pos.astype(jnp.int32), n_rep, axis=1)
    pos = jnp.pad(pos, ((0, 0), (0, pad)), constant_values=BIG_POS)
    return jnp.tile(qg, (1, 1, groups, 1)), jnp.tile(pos, (1, groups))


def row_groups(n_rep: int, t: int, block_s: int) -> int:
    """How many copies of the n_rep * T query rows fill a program's M rows (each copy takes its
    own block_s / groups tokens per step), keeping >= 16 tokens per copy."""
    m_rows = rows_for(n_rep, t)
    return max(1, min(m_rows // next_pow2(n_rep * t), block_s // 16))


def deinterleave(o: Array) -> Array:
    """[..., D] with column 2j = channel j and 2j + 1 = channel j + D/2 -> natural order."""
    d = o.shape[-1]
    return jnp.swapaxes(o.reshape(*o.shape[:-1], d // 2, 2), -1, -2).reshape(o.shape)


def merge_partials(o: Array, m: Array, l: Array, t: int, n_rep: int, dtype: Any, groups: int = 1) -> Array:
    """Log-sum-exp merge of split partials.

    o: float32 [B, Hkv, P, M, D] (unnormalized), m, l: float32 [B, Hkv, P, M].
    Neutral partials (m = NEG, l = 0, o = 0) get weight 0 unless every partial of a row is
    neutral, in which case l = 0 and the row's output is 0 (never NaN).
    Returns [B, T, Hkv * n_rep, D] in `dtype`.
    """
    b, hkv, n_p, m_rows, d = o.shape
    if groups > 1:  # row groups are more partials of the same query rows
        rg = m_rows // groups
        o = o.reshape(b, hkv, n_p * groups, rg, d)
        m = m.reshape(b, hkv, n_p * groups, rg)
        l = l.reshape(b, hkv, n_p * groups, rg)
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_max)  # [B, Hkv, P, M]
    l_tot = jnp.sum(w * l, axis=2)  # [B, Hkv, M]
    o_tot = jnp.sum(w[..., None] * o, axis=2)  # [B, Hkv, M, D]
    o_tot = o_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]
    o_tot = o_tot[:, :, : t * n_rep].reshape(b, hkv, t, n_rep, d)
    return jnp.transpose(o_tot, (0, 2, 1, 3, 4)).reshape(b, t, hkv * n_rep, d).astype(dtype)


def _check_common(q: Array, q_pos: Array, hkv: int, d: int) -> tuple[int, int, int]:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
    b, t, hq, dq = q.shape
    if dq != d:
        raise ValueError(f"q head_dim {dq} != cache head_dim {d}")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"pallas decode attention supports head_dim in {SUPPORTED_HEAD_DIMS}, got {d}")
    if hq % hkv:
        raise ValueError(f"{hq} query heads is not a multiple of {hkv} KV heads")
    n_rep = hq // hkv
    if n_rep * t > MAX_ROWS:
        raise ValueError(f"n_rep * T = {n_rep} * {t} = {n_rep * t} rows per KV head exceeds {MAX_ROWS}")
    if q_pos.shape != (b, t):
        raise ValueError(f"q_pos must be [B, T] = {(b, t)}, got {q_pos.shape}")
    return b, t, n_rep


def _default_warps(m_rows: int, d: int) -> int:
    # 4 warps spill registers at M=32, D=128 (T=5/7 verify); measured offline with ptxas.
    return 4 if m_rows * d < 32 * 128 else 8


def _quant_kernel(meta_ref, pos_ref, q_ref, *refs, target: bool, fast: bool, G: int, BS: int,
                  NS: int, NR: int, R: int, D: int, window: int | None,
                  k_interleave: bool = False, J: int = 1, tf32: bool = False):
    if target:
        (khi_ref, klo_ref, vhi_ref, vlo_ref, ks_ref, kz_ref, vs_ref, vz_ref, kfp_ref, vfp_ref,
         o_ref, m_ref, l_ref) = refs
    else:
        khi_ref, vhi_ref, ks_ref, kz_ref, vs_ref, vz_ref, kfp_ref, vfp_ref, o_ref, m_ref, l_ref = refs
        klo_ref = vlo_ref = None
    Dh = D // 2
    _dot = functools.partial(_dot_global, tf32=tf32)
    b, g, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = meta_ref[b, 0]
    q_len = meta_ref[b, 1]
    pos = pos_ref[b, :]  # [M] int32
    q_lo = q_ref[b, g, :, pl.ds(0, Dh)]  # [M, Dh] float32, pre-scaled
    q_hi = q_ref[b, g, :, pl.ds(Dh, Dh)]
    M = q_lo.shape[0]
    f32 = jnp.float32
    cdt = jnp.float16 if fast else f32

    def visible(kpos):  # kpos [N] or [M, N] -> bool [M, N]
        kpos = kpos if kpos.ndim == 2 else kpos[None, :]
        ok = kpos <= pos[:, None]
        if window is not None:
            ok &= pos[:, None] - kpos < window
        return ok

    # Per-half code transform: effective code = (c - off) * f_half.
    if fast:
        off = 1032.0 if target else 1024.0
        f_lo, f_hi = (1.0 / 16, 1.0 / 16) if target else (1.0, 1.0 / 16)
    else:
        off = 0.0
        f_lo, f_hi = (1.0 / 16, 1.0 / 16) if target else (1.0, 1.0)

    def codes(hi_ref, lo_ref, tok0, n):
        """[n, Dh] operands (c_lo, c_hi) for tokens tok0.. of this (layer, b, g)."""
        h = hi_ref[layer, b, g, pl.ds(tok0, n), :]
        if fast:
            h = h.astype(jnp.uint16)
            magic = jnp.uint16(MAGIC)
            if target:
                lo = lo_ref[layer, b, g, pl.ds(tok0, n), :].astype(jnp.uint16)
                c_lo = ((h << 4) & 0xF0) | (lo & 0x0F) | magic
                c_hi = (h & 0xF0) | (lo >> 4) | magic
            else:
                c_lo = (h & 0x0F) | magic
                c_hi = (h & 0xF0) | magic
            return lax.bitcast_convert_type(c_lo, jnp.float16), lax.bitcast_convert_type(c_hi, jnp.float16)
        h = h.astype(jnp.int32)
        if target:
            lo = lo_ref[layer, b, g, pl.ds(tok0, n), :].astype(jnp.int32)
            c_lo = 16 * (h & 0xF) + (lo & 0xF) - 8
            c_hi = 16 * (h >> 4) + (lo >> 4) - 8
        else:
            c_lo, c_hi = h & 0xF, h >> 4
        return c_lo.astype(f32), c_hi.astype(f32)

    zeros_m = jnp.zeros((M,), f32)
    neg_m = jnp.full((M,), NEG, f32)

    def interleave(x_lo, x_hi):  # [N, Dh] x2 -> [N, D]: column 2j = x_lo[:, j], 2j + 1 = x_hi[:, j]
        n = x_lo.shape[0]
        return jnp.stack([x_lo, x_hi], axis=-1).reshape(n, D)

    SB = BS // J  # tokens per row group per step
    rg = lax.iota(jnp.int32, M) // (M // J)  # row group of each row

    def rsel(r):  # [M, 1] bool: rows of group r
        return (rg == r)[:, None]

    # Columns of the interleaved value accumulator that hold high-half channels.
    hi_col = (lax.iota(jnp.int32, D) % 2) == 1

    def quant_part():
        n_blk_row = q_len // G
        blk_per_split = (n_blk_row + NS - 1) // NS
        blk0 = p * blk_per_split
        n_blk = jnp.maximum(jnp.minimum(blk_per_split, n_blk_row - blk0), 0)
        # One P operand for both value halves: w = p * s_t * f_v; in the draft's fast path the
        # high half's codes carry an extra factor 16, removed at the end.
        f_v = f_lo if f_lo == f_hi else 1.0

        def block(i, carry):
            acc, m, l, zs, ws = carry
            gb = blk0 + i
            ks_lo = ks_ref[layer, b, g, gb, pl.ds(0, Dh)].astype(f32)
            ks_hi = ks_ref[layer, b, g, gb, pl.ds(Dh, Dh)].astype(f32)
            kz_lo = kz_ref[layer, b, g, gb, pl.ds(0, Dh)].astype(f32)
            kz_hi = kz_ref[layer, b, g, gb, pl.ds(Dh, Dh)].astype(f32)
            a_lo = (q_lo * (ks_lo * f_lo)[None, :]).astype(cdt)
            a_hi = (q_hi * (ks_hi * f_hi)[None, :]).astype(cdt)
            bias = jnp.sum(q_lo * kz_lo[None, :], axis=1) + jnp.sum(q_hi * kz_hi[None, :], axis=1)
            if off:
                bias = bias - off * (jnp.sum(a_lo.astype(f32), axis=1) + jnp.sum(a_hi.astype(f32), axis=1))
            if k_interleave:
                a_int = interleave(a_lo, a_hi)
            for j in range(G // BS):  # static sub-tiles of the G-token block
                tok0 = gb * G + j * BS
                # Row group r (rows r*RG .. r*RG + RG - 1, each a copy of the real query rows)
                # takes tokens tok0 + r*SB .. + SB - 1: J groups fill the M >= 16 rows of the
                # tensor-core tile with real work instead of padding.
                s = None
                for r in range(J):
                    kc_lo, kc_hi = codes(khi_ref, klo_ref, tok0 + r * SB, SB)
                    if k_interleave:
                        s_r = _dot(a_int, interleave(kc_lo, kc_hi), trans_b=True)
                    else:
                        s_r = _dot(a_lo, kc_lo, trans_b=True) + _dot(a_hi, kc_hi, trans_b=True)
                    s = s_r if s is None else jnp.where(rsel(r), s_r, s)
                s = s + bias[:, None]
                if window is not None:  # quantized tokens precede every query: only the window masks
                    vis = visible(tok0 + rg[:, None] * SB + lax.iota(jnp.int32, SB)[None, :])
                    s = jnp.where(vis, s, NEG)
                    pexp, alpha, m, l = _online_update(s, vis, m, l)
                else:
                    pexp, alpha, m, l = _online_update(s, None, m, l)
                vs = vz = None
                for r in range(J):
                    vs_r = vs_ref[layer, b, g, pl.ds(tok0 + r * SB, SB), 0].astype(f32)[None, :]  # [1, SB]
                    vz_r = vz_ref[layer, b, g, pl.ds(tok0 + r * SB, SB), 0].astype(f32)[None, :]
                    vs = vs_r if vs is None else jnp.where(rsel(r), vs_r, vs)
                    vz = vz_r if vz is None else jnp.where(rsel(r), vz_r, vz)
                w = (pexp * (vs * f_v)).astype(cdt)
                pv = None
                for r in range(J):
                    vc_lo, vc_hi = codes(vhi_ref, vlo_ref, tok0 + r * SB, SB)
                    w_r = w if J == 1 else jnp.where(rsel(r), w, jnp.zeros_like(w))
                    d_r = _dot(w_r, interleave(vc_lo, vc_hi))
                    pv = d_r if pv is None else pv + d_r
                acc = acc * alpha[:, None] + pv
                zs = zs * alpha + jnp.sum(pexp * vz, axis=1)
                if off:
                    ws = ws * alpha + jnp.sum(w.astype(f32), axis=1)
            return acc, m, l, zs, ws

        init = (jnp.zeros((M, D), f32), neg_m, zeros_m, zeros_m, zeros_m)
        acc, m, l, zs, ws = lax.fori_loop(0, n_blk, block, init)
        if off:
            acc = acc - off * ws[:, None]
        if f_lo != f_hi:  # draft fast path: high-half codes are 16 U
            acc = acc * jnp.where(hi_col, f_hi, 1.0)[None, :]
        return acc + zs[:, None], m, l

    def ring_part():
        fp_start = meta_ref[b, 2]
        max_pos = meta_ref[b, 3]
        n_vis = jnp.clip(max_pos - q_len + 1, 0, R)  # logical ring entries any row can see
        tiles_per = -(-(R // RING_TILE) // NR)
        t0 = (p - NS) * tiles_per
        n_tiles = jnp.maximum(jnp.minimum(tiles_per, (n_vis + RING_TILE - 1) // RING_TILE - t0), 0)
        rdt = kfp_ref.dtype if fast else f32  # exact path: float32 dots even over a bf16 ring
        qr_lo, qr_hi = q_lo.astype(rdt), q_hi.astype(rdt)

        def tile(i, carry):
            acc, m, l = carry
            j = (t0 + i) * RING_TILE + lax.iota(jnp.int32, RING_TILE)  # logical ring index
            slot = lax.rem(fp_start + j, R)
            k_lo = kfp_ref[layer, b, g, slot, pl.ds(0, Dh)].astype(rdt)
            k_hi = kfp_ref[layer, b, g, slot, pl.ds(Dh, Dh)].astype(rdt)
            s = _dot(qr_lo, k_lo, trans_b=True) + _dot(qr_hi, k_hi, trans_b=True)
            vis = visible(q_len + j) & (j < n_vis)[None, :]
            if J > 1:  # the ring is attended by row group 0 only (the others are copies)
                vis &= rsel(0)
            s = jnp.where(vis, s, NEG)
            pexp, alpha, m, l = _online_update(s, vis, m, l)
            v_lo = vfp_ref[layer, b, g, slot, pl.ds(0, Dh)].astype(rdt)
            v_hi = vfp_ref[layer, b, g, slot, pl.ds(Dh, Dh)].astype(rdt)
            pc = pexp.astype(rdt)
            acc = acc * alpha[:, None] + _dot(pc, interleave(v_lo, v_hi))
            return acc, m, l

        return lax.fori_loop(0, n_tiles, tile, (jnp.zeros((M, D), f32), neg_m, zeros_m))

    o, m, l = lax.cond(p < NS, quant_part, ring_part)
    o_ref[...] = o  # interleaved channel order (see `deinterleave`)
    m_ref[...] = m
    l_ref[...] = l


def _quant_config(cfg: KernelConfig | None, *, batch: int, hkv: int, max_len: int, G: int, R: int,
                  D: int, target: bool, m_rows: int) -> tuple[int, int, int, int, int]:
    cfg = cfg or KernelConfig()
    n_blocks = max_len // G
    bs = cfg.block_s or min(G, 128 if m_rows <= 32 else 64)
    if G % bs or bs & (bs - 1) or bs < 16:
        raise ValueError(f"block_s={bs} must be a power of two >= 16 dividing G={G}")
    if cfg.num_splits:
        ns = cfg.num_splits
    else:
        target_programs = 2 * num_sms()
        min_chunk_blocks = max(1, 512 // G)  # at least 512 tokens per split
        ns = max(1, min(-(-target_programs // (batch * hkv)), n_blocks // min_chunk_blocks))
    ns = max(1, min(ns, max(n_blocks, 1)))
    n_tiles = R // RING_TILE
    if cfg.ring_splits:
        nr = cfg.ring_splits
    else:
        # Balance a ring program's bytes (bf16 K+V per slot) against a quantized split's.
        planes = 2 if target else 1
        quant_bytes = -(-max_len // ns) * (D // 2) * 2 * planes
        ring_bytes = R * D * 2 * 2
        nr = max(1, min(n_tiles, round(ring_bytes / max(quant_bytes, 1))))
    nr = max(1, min(nr, n_tiles))
    nr = -(-n_tiles // -(-n_tiles // nr))  # no empty ring program
    warps = cfg.num_warps or _default_warps(m_rows, D)
    stages = cfg.num_stages or 2
    return bs, ns, nr, warps, stages


def _partials_call(kernel: Any, args: list, grid: tuple[int, int, int], m_rows: int, D: int, warps: int,
                   stages: int, interpret: bool | None, name: str) -> tuple[Array, Array, Array]:
    """Launches a split-K kernel over grid (B, Hkv, programs) that reads full-array refs and
    writes one float32 partial (o [m_rows, D], m [m_rows], l [m_rows]) per program."""
    b, hkv, n = grid
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=[
            pl.BlockSpec((None, None, None, m_rows, D), lambda i, j, k: (i, j, k, 0, 0)),
            pl.BlockSpec((None, None, None, m_rows), lambda i, j, k: (i, j, k, 0)),
            pl.BlockSpec((None, None, None, m_rows), lambda i, j, k: (i, j, k, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, n, m_rows, D), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, n, m_rows), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, n, m_rows), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret_default(interpret),
        debug=_DEBUG,
        name=name,
    )(*args)


def quantized_decode_attention(q: Array, q_pos: Array, cache: Any, layer: Array | int, *, view: str,
                               sliding_window: int | None = None, interpret: bool | None = None,
                               config: KernelConfig | None = None, fast: bool | None = None,
                               return_partials: bool = False):
    """Attention of T query tokens over one layer of a QuantSpecCache (quantized region + ring).

    q: [B, T, Hq, D] (roped); q_pos: int32[B, T]; layer: int or traced int32 scalar.
    Returns [B, T, Hq, D] in q's dtype, or the raw partials (o, m, l) with return_partials.
    `fast` (default: q is not float32) selects float16 magic-number operands.
    """
    if view not in ("draft", "target"):
        raise ValueError(f"view={view!r}; expected 'draft' or 'target'")
    target = view == "target"
    L, B, hkv, S, dh = cache.k_hi.shape
    D = 2 * dh
    b, t, n_rep = _check_common(q, q_pos, hkv, D)
    if b != B:
        raise ValueError(f"q batch {b} != cache batch {B}")
    G = cache.group_size
    R = cache.ring_size
    if G < 16 or G & (G - 1):
        raise ValueError(f"group_size={G} must be a power of two >= 16")
    if R % RING_TILE:
        raise ValueError(f"ring size {R} must be a multiple of {RING_TILE}")
    if cache.v_scale.shape[-1] != 1:
        raise ValueError("one value-quantization group per token is required (head_dim <= 128)")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window={sliding_window} must be positive")
    window = None if sliding_window is None or sliding_window >= S + R else int(sliding_window)
    m_rows = rows_for(n_rep, t)
    cfg_codes = config.codes if config is not None and config.codes is not None else default_codes()
    if cfg_codes not in ("f32", "magic"):
        raise ValueError(f"codes={cfg_codes!r}; expected 'f32' or 'magic'")
    if fast is None:
        fast = cfg_codes != "f32" and q.dtype != jnp.float32
    tf32 = q.dtype != jnp.float32
    bs, ns, nr, warps, stages = _quant_config(config, batch=B, hkv=hkv, max_len=S, G=G, R=R, D=D,
                                              target=target, m_rows=m_rows)
    J = row_groups(n_rep, t, bs) if (config is None or config.row_groups is None) else config.row_groups
    qg, pos = _group_queries(q, q_pos, hkv, m_rows, J)
    layer = jnp.asarray(layer, jnp.int32)
    meta = jnp.stack([jnp.broadcast_to(layer, (B,)), cache.q_len.astype(jnp.int32),
                      cache.fp_start.astype(jnp.int32), jnp.max(q_pos, axis=1).astype(jnp.int32)], axis=1)
    planes = ([cache.k_hi, cache.k_lo, cache.v_hi, cache.v_lo] if target else [cache.k_hi, cache.v_hi])
    args = [meta, pos, qg, *planes, cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero,
            cache.k_fp, cache.v_fp]
    n_prog = ns + nr
    kernel = functools.partial(_quant_kernel, target=target, fast=fast, G=G, BS=bs, NS=ns, NR=nr, R=R,
                               D=D, window=window, tf32=tf32,
                               k_interleave=bool(config and config.k_interleave), J=J)
    o, m, l = _partials_call(kernel, args, (B, hkv, n_prog), m_rows, D, warps, stages, interpret,
                             f"quantspec_{view}_decode")
    if return_partials:
        return deinterleave(o), m, l
    return merge_partials(deinterleave(o), m, l, t, n_rep, q.dtype, J)


# ============================================================================ dense kernel
def _dense_kernel(meta_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, BS: int, NS: int,
                  S: int, window: int | None, exact: bool):
    b, g, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = meta_ref[b, 0]
    kv_len = jnp.minimum(meta_ref[b, 1] + 1, S)  # max query position + 1
    pos = pos_ref[b, :]
    cdt = jnp.float32 if exact else k_ref.dtype
    q = q_ref[b, g, :, :].astype(cdt)  # [M, D]
    M, D = q.shape
    f32 = jnp.float32
    n_tiles_row = (kv_len + BS - 1) // BS
    per_split = (n_tiles_row + NS - 1) // NS
    tile0 = p * per_split
    n_tiles = jnp.maximum(jnp.minimum(per_split, n_tiles_row - tile0), 0)

    def tile(i, carry):
        acc, m, l = carry
        tok0 = (tile0 + i) * BS
        k = k_ref[layer, b, g, pl.ds(tok0, BS), :].astype(cdt)
        s = _dot(q, k, trans_b=True)
        kpos = tok0 + lax.iota(jnp.int32, BS)
        vis = kpos[None, :] <= pos[:, None]
        if window is not None:
            vis &= pos[:, None] - kpos[None, :] < window
        s = jnp.where(vis, s, NEG)
        pexp, alpha, m, l = _online_update(s, vis, m, l)
        v = v_ref[layer, b, g, pl.ds(tok0, BS), :].astype(cdt)
        acc = acc * alpha[:, None] + _dot(pexp.astype(cdt), v)
        return acc, m, l

    init = (jnp.zeros((M, D), f32), jnp.full((M,), NEG, f32), jnp.zeros((M,), f32))
    acc, m, l = lax.fori_loop(0, n_tiles, tile, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def dense_decode_attention(q: Array, q_pos: Array, k: Array, v: Array, layer: Array | int, *,
                           sliding_window: int | None = None, interpret: bool | None = None,
                           config: KernelConfig | None = None, return_partials: bool = False):
    """Causal GQA decode attention over one layer of a stacked dense cache.

    q: [B, T, Hq, D]; q_pos: int32[B, T]; k, v: [L, B, Hkv, S, D] (the whole stacked cache).
    A query at position p sees cached positions <= p (the new tokens must already be written).
    """
    if k.shape != v.shape or k.ndim != 5:
        raise ValueError(f"k, v must both be [L, B, Hkv, S, D], got {k.shape} and {v.shape}")
    L, B, hkv, S, D = k.shape
    b, t, n_rep = _check_common(q, q_pos, hkv, D)
    if b != B:
        raise ValueError(f"q batch {b} != cache batch {B}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window={sliding_window} must be positive")
    window = None if sliding_window is None or sliding_window >= S else int(sliding_window)
    cfg = config or KernelConfig()
    m_rows = rows_for(n_rep, t)
    bs = cfg.block_s or (64 if D >= 128 or m_rows > 32 else 128)
    while bs > 16 and S % bs:
        bs //= 2
    if S % bs:
        raise ValueError(f"dense cache max_len={S} must be a multiple of 16")
    n_tiles = S // bs
    if cfg.num_splits:
        ns = cfg.num_splits
    else:
        min_tiles = max(1, 512 // bs)
        ns = max(1, min(-(-2 * num_sms() // (B * hkv)), n_tiles // min_tiles))
    ns = max(1, min(ns, n_tiles))
    warps = cfg.num_warps or _default_warps(m_rows, D)
    stages = cfg.num_stages or 3
    qg, pos = _group_queries(q, q_pos, hkv, m_rows)
    layer = jnp.asarray(layer, jnp.int32)
    meta = jnp.stack([jnp.broadcast_to(layer, (B,)), jnp.max(q_pos, axis=1).astype(jnp.int32)], axis=1)
    kernel = functools.partial(_dense_kernel, BS=bs, NS=ns, S=S, window=window, exact=q.dtype == jnp.float32)
    o, m, l = _partials_call(kernel, [meta, pos, qg, k, v], (B, hkv, ns), m_rows, D, warps, stages, interpret,
                             "dense_decode")
    if return_partials:
        return o, m, l
    return merge_partials(o, m, l, t, n_rep, q.dtype)


# ================================================================================ dispatch
def cache_attention(q: Array, q_pos: Array, cache: Any, layer: Array | int, *, view: str = "target",
                    sliding_window: int | None = None, interpret: bool | None = None,
                    config: KernelConfig | None = None) -> Array:
    """Same semantics as `qspec_jax.attention.cache_attention` for both cache types.

    QuantSpecCache: `view` "draft" reads the upper planes only (INT4), "target" both (INT8);
    the FP ring is attended in the same launch. DenseKVCache: `view` is ignored.
    """
    from qspec_jax.cache import DenseKVCache, QuantSpecCache  # lazy: keeps this module light

    if isinstance(cache, QuantSpecCache):
        return quantized_decode_attention(q, q_pos, cache, layer, view=view, sliding_window=sliding_window,
                                          interpret=interpret, config=config)
    if isinstance(cache, DenseKVCache):
        return dense_decode_attention(q, q_pos, cache.k, cache.v, layer, sliding_window=sliding_window,
                                      interpret=interpret, config=config)
    raise TypeError(f"unsupported cache type {type(cache).__name__}")
