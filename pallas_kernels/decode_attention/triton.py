"""Pallas (Triton lowering) decode attention over the QuantSpec hierarchical cache and a dense cache:
the backend for GPUs before Hopper, and the dense AR-bf16 kernel on every GPU (`api` dispatches).

* `quantized_decode_attention`: split-K flash-decoding over the quantized region of a
  `QuantSpecCache` (INT4 "draft" view: upper planes only; INT8 "target" view: both planes),
  fused with the FP ring in the same launch (the last `ring_splits` programs of each
  (row, KV head) attend to the ring). The kernel for GPUs before Hopper; on Hopper
  `mosaic_gpu` is faster.
* `dense_decode_attention`: the same structure over a bf16 (or f32) dense cache; the AR-bf16
  baseline.

Both kernels return flash-decoding partials (o, m, l) that `merge_partials` combines by
log-sum-exp.

Design (SPEC §3, §5):

* Grid (batch row, KV head, split). A program takes ALL n_rep query heads x T query tokens of
  its KV head, in row tiles of ROW_TILE = 16 rows (t-major: row = t * n_rep + j), so K/V bytes
  are read once per KV head and never copied per query head.
* Exactness (issue 11): the row tile, block sizes, warps, stages, split counts and boundaries
  and the merge order depend on the geometry, never on T. T only changes how many row tiles a
  program runs, each by the same instructions; rows of one dot never interact; masked entries
  contribute exact zeros.
* The kernels receive the FULL stacked cache arrays [L, B, Hkv, ...] (no BlockSpec, so no XLA
  slice is materialized) plus a small int32 `meta` array holding the layer index and the
  per-row lengths; the layer is indexed inside the kernel with pointer offsets.
* Splits are static (chosen from max_len and the GPU size); the chunk each split covers is
  computed per row at run time from q_len, so a half-full cache still spreads over all
  programs. A split with no tokens runs zero loop iterations and writes the neutral partial
  (m = NEG, l = 0, o = 0); every partial is always written.
* Cache layout (`qspec_jax.quant`): key planes split halves per token, value planes transposed
  per G-token block ([D, G/2] bytes, tokens t and t + G/2 in the low and high nibble), both in
  the kernel byte order (undone here with a reshape + transpose of each loaded tile). One loop
  step covers one key block: two halves of G/2 tokens.
* Keys: per-channel (s, z) per G-token block. s (times the half's factor) is folded into q once
  per block, q.z is a per-block bias. Values: per-token (s, z); s multiplies p per token and
  sum(p z) is accumulated separately.
* Codes. "magic" path (bf16/f16 activations): codes are turned into float16 operands with bit
  operations (the f16 with bits 0x6400 | n is exactly 1024 + n for n < 1024); the constant
  offset is removed afterwards with a per-row correction computed from the same rounded
  operands, so it cancels exactly:
      draft,  low nibble : 0x6400 | (b & 0x0F)                    = 1024 + U
      draft,  high nibble: 0x6400 | (b & 0xF0)                    = 1024 + 16 U
      target, low nibble : 0x6400 | ((h << 4) & 0xF0) | (l & 0x0F) = 1024 + 16 U + L'
      target, high nibble: 0x6400 | (h & 0xF0) | (l >> 4)          = 1024 + 16 U + L'
  (L' = L + 8 is the stored biased lower nibble, so 16 U + L' - 1032 = 16 U + (L - 8).)
  The "exact" path (float32 activations) converts the codes to float32 and uses IEEE float32 dots.
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

from pallas_kernels._common import interpret_default, num_sms

Array = jax.Array

NEG = -1e30  # "minus infinity" that stays finite: exp(NEG - m) == 0, NEG - NEG == 0
BIG_POS = 2**30  # position of padding query rows: they see everything (finite garbage, dropped)
ROW_TILE = 16  # query rows per dot (tensor-core dots need M >= 16); fixed, never a function of T
RING_TILE = 32  # ring slots per loop step; ring size is a multiple of this (cache.RING_ALIGN)
MAGIC = 0x6400  # float16 bits of 1024.0; 0x6400 | n == 1024 + n for 0 <= n < 1024
SUPPORTED_HEAD_DIMS = (64, 128)
NUM_WARPS = 4
MAX_ROWS = 128  # n_rep * T


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tuning knobs of the Triton kernels. None means the heuristic default, which
    depends on the geometry only (never on T)."""

    num_splits: int | None = None  # quantized (or dense) splits per (row, KV head)
    ring_splits: int | None = None  # programs per (row, KV head) that attend to the FP ring
    num_warps: int | None = None
    num_stages: int | None = None
    block_s: int | None = None  # dense kernel: tokens per step
    # How codes become dot operands. "magic" (the default): float16 operands built with bit
    # operations (0x6400 | code), float16 tensor-core dots. "f32": int -> float32 conversions and
    # TF32 dots (IEEE float32 dots for float32 activations, which always take the exact path).
    codes: str | None = None


CODES_ENV = "QSPEC_KERNEL_CODES"


def default_codes() -> str:
    """The code-to-operand path when none is configured: "magic", unless the
    QSPEC_KERNEL_CODES environment variable names another (benchmarks compare paths with it)."""
    return os.environ.get(CODES_ENV, "magic")


def row_tiles(n_rep: int, t: int) -> int:
    """Row tiles of ROW_TILE rows holding the n_rep * T query rows of one KV head."""
    return -(-(n_rep * t) // ROW_TILE)


def rows_for(n_rep: int, t: int) -> int:
    """Rows of a program's query array: n_rep * T padded to whole row tiles."""
    return row_tiles(n_rep, t) * ROW_TILE


def _dot(a: Array, b: Array, *, trans_b: bool = False, tf32: bool = False) -> Array:
    """a [M, K] @ b [K, N] (or b [N, K] with trans_b) with float32 accumulation. float32
    operands use IEEE float32 products unless `tf32` (tensor cores, 10-bit mantissa)."""
    prec = lax.Precision.HIGHEST if (a.dtype == jnp.float32 and not tf32) else None
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _online_update(s_parts: list, m: Array, l: Array, vis_parts: list | None = None):
    """One online-softmax step over score tiles s_parts (each [M, N], masked to NEG where not
    visible). Returns (p_parts, alpha, m_new, l_new)."""
    m_new = m
    for s in s_parts:
        m_new = jnp.maximum(m_new, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p_parts = [jnp.exp(s - m_new[:, None]) for s in s_parts]
    if vis_parts is not None:
        p_parts = [jnp.where(v, p, 0.0) for p, v in zip(p_parts, vis_parts)]
    l = l * alpha
    for p in p_parts:
        l = l + jnp.sum(p, axis=1)
    return p_parts, alpha, m_new, l


def dense_operand_shape(q_shape: tuple[int, ...], hkv: int) -> tuple[int, int, int, int]:
    """[B, Hkv, D, CN]: the dense kernel's prepared query operand for queries [B, T, Hq, D]
    (`dense_decode_attention(q_operand=...)`; CN = rows_for(n_rep, T), the Mosaic kernels'
    operand layout at the same column count)."""
    b, t, hq, d = q_shape
    return b, hkv, d, rows_for(hq // hkv, t)


def _group_queries(q: Array, hkv: int) -> Array:
    """q [B, T, Hq, D] -> float32 [B, Hkv, M, D] pre-scaled by 1/sqrt(D) (M = rows_for(n_rep, T)):
    the n_rep * T real rows t-major (row = t * n_rep + j), then zero padding rows."""
    b, t, hq, d = q.shape
    n_rep = hq // hkv
    qg = q.reshape(b, t, hkv, n_rep, d).astype(jnp.float32) * (d ** -0.5)
    qg = jnp.transpose(qg, (0, 2, 1, 3, 4)).reshape(b, hkv, t * n_rep, d)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, rows_for(n_rep, t) - t * n_rep), (0, 0)))


def kernel_inputs(q_pos: Array, cache: Any, n_rep: int) -> dict[str, Array]:
    """The kernel inputs every layer of a decode pass shares (a model computes them once per
    pass, outside its layer loop, and passes them as `inputs=`):

        meta  int32 [B, 3] (QuantSpecCache: q_len, fp_start, max query position) or [B, 1]
              (dense cache: max query position) per row
        pos   int32 [B, M]  position of query row t * n_rep + j; padding rows BIG_POS

    q_pos: int32 [B, T]; M = rows_for(n_rep, T)."""
    t = q_pos.shape[1]
    pos = jnp.repeat(q_pos.astype(jnp.int32), n_rep, axis=1)
    pos = jnp.pad(pos, ((0, 0), (0, rows_for(n_rep, t) - t * n_rep)), constant_values=BIG_POS)
    max_pos = jnp.max(q_pos, axis=1).astype(jnp.int32)
    if hasattr(cache, "q_len"):
        meta = jnp.stack([cache.q_len.astype(jnp.int32), cache.fp_start.astype(jnp.int32), max_pos], axis=1)
    else:
        meta = max_pos[:, None]
    return {"meta": meta, "pos": pos}


def _checked_inputs(inputs: dict[str, Array] | None, q_pos: Array, cache: Any, n_rep: int) -> tuple[Array, Array]:
    if inputs is None:
        inputs = kernel_inputs(q_pos, cache, n_rep)
    b, t = q_pos.shape
    expect = {"meta": (b, 3 if hasattr(cache, "q_len") else 1), "pos": (b, rows_for(n_rep, t))}
    for name, shape in expect.items():
        if inputs[name].shape != shape:
            raise ValueError(f"inputs[{name!r}] has shape {inputs[name].shape}; this call needs "
                             f"{shape} (kernel_inputs(q_pos, cache, n_rep={n_rep}))")
    return inputs["meta"], inputs["pos"]


def merge_partials(o: Array, m: Array, l: Array, t: int, n_rep: int, dtype: Any) -> Array:
    """Log-sum-exp merge of split partials, in split order.

    o: float32 [B, Hkv, P, M, D] (unnormalized), m, l: float32 [B, Hkv, P, M].
    Written as an unrolled chain of elementwise operations over the P partials, so every output
    element is the same expression whatever the other shapes (no shape-dependent reduction).
    Neutral partials (m = NEG, l = 0, o = 0) get weight 0 unless every partial of a row is
    neutral, in which case l = 0 and the row's output is 0 (never NaN).
    Returns [B, T, Hkv * n_rep, D] in `dtype`.
    """
    b, hkv, n_p, m_rows, d = o.shape
    m_max = m[:, :, 0]
    for i in range(1, n_p):
        m_max = jnp.maximum(m_max, m[:, :, i])
    l_tot = jnp.zeros_like(m_max)
    o_tot = jnp.zeros((b, hkv, m_rows, d), o.dtype)
    for i in range(n_p):
        w = jnp.exp(m[:, :, i] - m_max)
        l_tot = l_tot + w * l[:, :, i]
        o_tot = o_tot + w[..., None] * o[:, :, i]
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


def _logical_bytes(x: Array) -> Array:
    """Undoes the cache's kernel byte order along the last axis of a loaded uint8 tile
    (`qspec_jax.quant.kernel_byte_order`: stored byte 4j + 2a + u of a 16-byte group holds
    logical byte 8u + 2j + a). Rows shorter than one group are stored in order."""
    n, w = x.shape
    if w % 16:
        return x
    y = x.reshape(n, w // 16, 4, 2, 2)  # (j, a, u)
    return jnp.transpose(y, (0, 1, 4, 2, 3)).reshape(n, w)  # (u, j, a)


def _quant_kernel(layer_ref, meta_ref, pos_ref, q_ref, *refs, target: bool, fast: bool, G: int, NS: int, NR: int, R: int,
                  D: int, RT: int, window: int | None, tf32: bool):
    if target:
        (khi_ref, klo_ref, vhi_ref, vlo_ref, ks_ref, kz_ref, vs_ref, vz_ref, kfp_ref, vfp_ref,
         o_ref, m_ref, l_ref) = refs
    else:
        khi_ref, vhi_ref, ks_ref, kz_ref, vs_ref, vz_ref, kfp_ref, vfp_ref, o_ref, m_ref, l_ref = refs
        klo_ref = vlo_ref = None
    Dh, Gh = D // 2, G // 2
    dot = functools.partial(_dot, tf32=tf32)
    b, g, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    q_len = meta_ref[b, 0]
    f32 = jnp.float32
    cdt = jnp.float16 if fast else f32
    M = ROW_TILE
    pos = [pos_ref[b, pl.ds(r * M, M)] for r in range(RT)]  # [M] int32 per row tile
    q_lo = [q_ref[b, g, pl.ds(r * M, M), pl.ds(0, Dh)] for r in range(RT)]  # [M, Dh] float32, pre-scaled
    q_hi = [q_ref[b, g, pl.ds(r * M, M), pl.ds(Dh, Dh)] for r in range(RT)]

    # Per-nibble code transform: effective code = (c - off) * f (f_lo / f_hi: low / high nibble).
    if fast:
        off = 1032.0 if target else 1024.0
        f_lo, f_hi = (1.0 / 16, 1.0 / 16) if target else (1.0, 1.0 / 16)
    else:
        off = 0.0
        f_lo, f_hi = (1.0 / 16, 1.0 / 16) if target else (1.0, 1.0)

    def codes(h, lo):
        """uint8 tiles (upper plane, lower plane or None) -> (codes of the low nibbles, codes of
        the high nibbles), float16 magic operands (fast) or float32 values."""
        if fast:
            h = h.astype(jnp.uint16)
            magic = jnp.uint16(MAGIC)
            if target:
                lo = lo.astype(jnp.uint16)
                c_lo = ((h << 4) & 0xF0) | (lo & 0x0F) | magic
                c_hi = (h & 0xF0) | (lo >> 4) | magic
            else:
                c_lo = (h & 0x0F) | magic
                c_hi = (h & 0xF0) | magic
            return lax.bitcast_convert_type(c_lo, jnp.float16), lax.bitcast_convert_type(c_hi, jnp.float16)
        h = h.astype(jnp.int32)
        if target:
            lo = lo.astype(jnp.int32)
            return (16 * (h & 0xF) + (lo & 0xF) - 8).astype(f32), (16 * (h >> 4) + (lo >> 4) - 8).astype(f32)
        return (h & 0xF).astype(f32), (h >> 4).astype(f32)

    def visible(r, kpos):  # kpos [N] or [M, N] -> bool [M, N]
        kpos = kpos if kpos.ndim == 2 else kpos[None, :]
        ok = kpos <= pos[r][:, None]
        if window is not None:
            ok &= pos[r][:, None] - kpos < window
        return ok

    zeros_m = jnp.zeros((M,), f32)
    neg_m = jnp.full((M,), NEG, f32)

    def quant_part():
        n_blk_row = q_len // G
        blk_per_split = (n_blk_row + NS - 1) // NS
        blk0 = p * blk_per_split
        n_blk = jnp.maximum(jnp.minimum(blk_per_split, n_blk_row - blk0), 0)

        def block(i, carry):
            gb = blk0 + i
            tok0 = gb * G
            ks_lo = ks_ref[layer, b, g, gb, pl.ds(0, Dh)].astype(f32)
            ks_hi = ks_ref[layer, b, g, gb, pl.ds(Dh, Dh)].astype(f32)
            kz_lo = kz_ref[layer, b, g, gb, pl.ds(0, Dh)].astype(f32)
            kz_hi = kz_ref[layer, b, g, gb, pl.ds(Dh, Dh)].astype(f32)
            # key codes of the block's two token halves: [Gh, Dh] per nibble half
            kc = []
            for hlf in range(2):
                hb = _logical_bytes(khi_ref[layer, b, g, pl.ds(tok0 + hlf * Gh, Gh), :])
                lb = None if klo_ref is None else _logical_bytes(klo_ref[layer, b, g, pl.ds(tok0 + hlf * Gh, Gh), :])
                kc.append(codes(hb, lb))
            # value codes: [D, Gh] bytes (channel, token pair), low nibble = token t, high = t + Gh
            vb = _logical_bytes(vhi_ref[layer, b, g, pl.ds(gb * D, D), :])
            vlb = None if vlo_ref is None else _logical_bytes(vlo_ref[layer, b, g, pl.ds(gb * D, D), :])
            vt = codes(vb, vlb)  # (V^T of tokens 0..Gh-1, V^T of tokens Gh..G-1), [D, Gh] each
            vs = [vs_ref[layer, b, g, pl.ds(tok0 + hlf * Gh, Gh)].astype(f32) for hlf in range(2)]  # [Gh]
            vz = [vz_ref[layer, b, g, pl.ds(tok0 + hlf * Gh, Gh)].astype(f32) for hlf in range(2)]
            # One P operand for both value halves: w = p * s_t * f_v. In the draft's fast path the
            # high-nibble tokens carry an extra factor 16, removed by scaling their w by 1/16.
            f_v = [f_lo, f_hi]
            out = []
            for r in range(RT):
                acc, m, l, zs, ws = carry[r]
                a_lo = (q_lo[r] * (ks_lo * f_lo)[None, :]).astype(cdt)
                a_hi = (q_hi[r] * (ks_hi * f_hi)[None, :]).astype(cdt)
                bias = jnp.sum(q_lo[r] * kz_lo[None, :], axis=1) + jnp.sum(q_hi[r] * kz_hi[None, :], axis=1)
                if off:
                    bias = bias - off * (jnp.sum(a_lo.astype(f32), axis=1) + jnp.sum(a_hi.astype(f32), axis=1))
                s = [dot(a_lo, kc[hlf][0], trans_b=True) + dot(a_hi, kc[hlf][1], trans_b=True) + bias[:, None]
                     for hlf in range(2)]
                vis = None
                if window is not None:  # quantized tokens precede every query: only the window masks
                    vis = [visible(r, tok0 + hlf * Gh + lax.iota(jnp.int32, Gh)) for hlf in range(2)]
                    s = [jnp.where(v, x, NEG) for x, v in zip(s, vis)]
                pexp, alpha, m, l = _online_update(s, m, l, vis)
                w = [(pexp[hlf] * (vs[hlf] * f_v[hlf])[None, :]).astype(cdt) for hlf in range(2)]
                pv = dot(w[0], vt[0], trans_b=True) + dot(w[1], vt[1], trans_b=True)
                acc = acc * alpha[:, None] + pv
                zs = zs * alpha + jnp.sum(pexp[0] * vz[0][None, :], axis=1) + jnp.sum(pexp[1] * vz[1][None, :], axis=1)
                if off:
                    ws = ws * alpha + jnp.sum(w[0].astype(f32), axis=1) + jnp.sum(w[1].astype(f32), axis=1)
                out.append((acc, m, l, zs, ws))
            return tuple(out)

        init = tuple((jnp.zeros((M, D), f32), neg_m, zeros_m, zeros_m, zeros_m) for _ in range(RT))
        res = lax.fori_loop(0, n_blk, block, init)
        # sum_t w_t (c_t - off) = sum_t w_t c_t - off sum_t w_t, with the same rounded w_t
        return tuple((acc - off * ws[:, None] + zs[:, None], m, l) for acc, m, l, zs, ws in res)

    def ring_part():
        fp_start = meta_ref[b, 1]
        max_pos = meta_ref[b, 2]
        n_vis = jnp.clip(max_pos - q_len + 1, 0, R)  # logical ring entries any row can see
        tiles_per = -(-(R // RING_TILE) // NR)
        t0 = (p - NS) * tiles_per
        n_tiles = jnp.maximum(jnp.minimum(tiles_per, (n_vis + RING_TILE - 1) // RING_TILE - t0), 0)
        rdt = kfp_ref.dtype if fast else f32  # exact path: float32 dots even over a bf16 ring

        def tile(i, carry):
            j = (t0 + i) * RING_TILE + lax.iota(jnp.int32, RING_TILE)  # logical ring index
            slot = lax.rem(fp_start + j, R)
            k_lo = kfp_ref[layer, b, g, slot, pl.ds(0, Dh)].astype(rdt)  # [RING_TILE, Dh]
            k_hi = kfp_ref[layer, b, g, slot, pl.ds(Dh, Dh)].astype(rdt)
            v = vfp_ref[layer, b, g, slot, :].astype(rdt)  # [RING_TILE, D]
            out = []
            for r in range(RT):
                acc, m, l = carry[r]
                s = dot(q_lo[r].astype(rdt), k_lo, trans_b=True) + dot(q_hi[r].astype(rdt), k_hi, trans_b=True)
                vis = visible(r, q_len + j) & (j < n_vis)[None, :]
                s = jnp.where(vis, s, NEG)
                (pexp,), alpha, m, l = _online_update([s], m, l, [vis])
                acc = acc * alpha[:, None] + dot(pexp.astype(rdt), v)
                out.append((acc, m, l))
            return tuple(out)

        init = tuple((jnp.zeros((M, D), f32), neg_m, zeros_m) for _ in range(RT))
        return lax.fori_loop(0, n_tiles, tile, init)

    res = lax.cond(p < NS, quant_part, ring_part)
    for r, (o, m, l) in enumerate(res):
        o_ref[pl.ds(r * M, M), :] = o
        m_ref[pl.ds(r * M, M)] = m
        l_ref[pl.ds(r * M, M)] = l


def _quant_config(cfg: KernelConfig | None, *, batch: int, hkv: int, max_len: int, G: int, R: int,
                  D: int, target: bool) -> tuple[int, int, int, int]:
    """(splits, ring programs, warps, stages): functions of the geometry, never of T."""
    cfg = cfg or KernelConfig()
    n_blocks = max_len // G
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
    return ns, nr, cfg.num_warps or NUM_WARPS, cfg.num_stages or 2


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
        name=name,
    )(*args)


def quantized_decode_attention(q: Array, q_pos: Array, cache: Any, layer: Array | int, *, view: str,
                               sliding_window: int | None = None, interpret: bool | None = None,
                               config: KernelConfig | None = None, fast: bool | None = None,
                               return_partials: bool = False, inputs: dict[str, Array] | None = None):
    """Attention of T query tokens over one layer of a QuantSpecCache (quantized region + ring),
    Triton kernel.

    q: [B, T, Hq, D] (roped); q_pos: int32[B, T]; layer: int or traced int32 scalar;
    inputs: `kernel_inputs(q_pos, cache, n_rep)` computed once per pass (default: here).
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
    if G < 32 or G & (G - 1):
        raise ValueError(f"group_size={G} must be a power of two >= 32 for the Triton kernel")
    if R % RING_TILE:
        raise ValueError(f"ring size {R} must be a multiple of {RING_TILE}")
    if cache.v_scale.shape[-1] != 1:
        raise ValueError("one value-quantization group per token is required (head_dim <= 128)")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window={sliding_window} must be positive")
    window = None if sliding_window is None or sliding_window >= S + R else int(sliding_window)
    cfg_codes = config.codes if config is not None and config.codes is not None else default_codes()
    if cfg_codes not in ("f32", "magic"):
        raise ValueError(f"codes={cfg_codes!r}; expected 'f32' or 'magic'")
    if fast is None:
        fast = cfg_codes != "f32" and q.dtype != jnp.float32
    tf32 = q.dtype != jnp.float32
    ns, nr, warps, stages = _quant_config(config, batch=B, hkv=hkv, max_len=S, G=G, R=R, D=D, target=target)
    qg = _group_queries(q, hkv)
    m_rows = qg.shape[2]
    meta, pos = _checked_inputs(inputs, q_pos, cache, n_rep)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    vblocks = lambda x: x.reshape(L, B, hkv, (S // G) * D, G // 2)  # noqa: E731  (free reshape)
    planes = ([cache.k_hi, cache.k_lo, vblocks(cache.v_hi), vblocks(cache.v_lo)] if target
              else [cache.k_hi, vblocks(cache.v_hi)])
    args = [layer, meta, pos, qg, *planes, cache.k_scale, cache.k_zero, cache.v_scale.reshape(L, B, hkv, S),
            cache.v_zero.reshape(L, B, hkv, S), cache.k_fp, cache.v_fp]
    kernel = functools.partial(_quant_kernel, target=target, fast=fast, G=G, NS=ns, NR=nr, R=R, D=D,
                               RT=m_rows // ROW_TILE, window=window, tf32=tf32)
    o, m, l = _partials_call(kernel, args, (B, hkv, ns + nr), m_rows, D, warps, stages, interpret,
                             f"quantspec_{view}_decode")
    if return_partials:
        return o, m, l
    return merge_partials(o, m, l, t, n_rep, q.dtype)


# ============================================================================ dense kernel
def _dense_kernel(layer_ref, meta_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, BS: int, NS: int,
                  S: int, RT: int, window: int | None, exact: bool, operand: bool = False):
    """`operand`: q_ref is the prepared query operand, bf16 [B, Hkv, D, CN] unscaled (as the qkv
    epilogue writes it), scaled here as `_group_queries` scales q: the same float32 product, so
    the same bits as from q."""
    b, g, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    kv_len = jnp.minimum(meta_ref[b, 0] + 1, S)  # max query position + 1
    M = ROW_TILE
    cdt = jnp.float32 if exact else k_ref.dtype
    pos = [pos_ref[b, pl.ds(r * M, M)] for r in range(RT)]
    if operand:  # [D, M] columns -> [M, D] rows, scaled
        scale = q_ref.shape[2] ** -0.5
        qs = [(q_ref[b, g, :, pl.ds(r * M, M)].T.astype(jnp.float32) * scale).astype(cdt) for r in range(RT)]
    else:
        qs = [q_ref[b, g, pl.ds(r * M, M), :].astype(cdt) for r in range(RT)]  # [M, D]
    D = qs[0].shape[1]
    f32 = jnp.float32
    n_tiles_row = (kv_len + BS - 1) // BS
    per_split = (n_tiles_row + NS - 1) // NS
    tile0 = p * per_split
    n_tiles = jnp.maximum(jnp.minimum(per_split, n_tiles_row - tile0), 0)

    def tile(i, carry):
        tok0 = (tile0 + i) * BS
        k = k_ref[layer, b, g, pl.ds(tok0, BS), :].astype(cdt)
        v = v_ref[layer, b, g, pl.ds(tok0, BS), :].astype(cdt)
        kpos = tok0 + lax.iota(jnp.int32, BS)
        out = []
        for r in range(RT):
            acc, m, l = carry[r]
            s = _dot(qs[r], k, trans_b=True)
            vis = kpos[None, :] <= pos[r][:, None]
            if window is not None:
                vis &= pos[r][:, None] - kpos[None, :] < window
            s = jnp.where(vis, s, NEG)
            (pexp,), alpha, m, l = _online_update([s], m, l, [vis])
            acc = acc * alpha[:, None] + _dot(pexp.astype(cdt), v)
            out.append((acc, m, l))
        return tuple(out)

    init = tuple((jnp.zeros((M, D), f32), jnp.full((M,), NEG, f32), jnp.zeros((M,), f32)) for _ in range(RT))
    res = lax.fori_loop(0, n_tiles, tile, init)
    for r, (acc, m, l) in enumerate(res):
        o_ref[pl.ds(r * M, M), :] = acc
        m_ref[pl.ds(r * M, M)] = m
        l_ref[pl.ds(r * M, M)] = l


def dense_decode_attention(q: Array, q_pos: Array, k: Array, v: Array, layer: Array | int, *,
                           sliding_window: int | None = None, interpret: bool | None = None,
                           config: KernelConfig | None = None, return_partials: bool = False,
                           inputs: dict[str, Array] | None = None, q_operand: Array | None = None):
    """Causal GQA decode attention over one layer of a stacked dense cache.

    q: [B, T, Hq, D]; q_pos: int32[B, T]; k, v: [L, B, Hkv, S, D] (the whole stacked cache);
    inputs: `kernel_inputs(q_pos, None, n_rep)` computed once per pass (default: here).
    `q_operand`: the queries already as bf16 [B, Hkv, D, CN] (`dense_operand_shape`: column
    t n_rep + r holds query head h n_rep + r of token t, the rest zero), as a fused q|k|v kernel
    writes them; q then gives only the shapes. The same bits as from q of those values.
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
    bs = cfg.block_s or (64 if D >= 128 else 128)
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
    warps = cfg.num_warps or NUM_WARPS
    stages = cfg.num_stages or 3
    if q_operand is None:
        qg = _group_queries(q, hkv)
    else:
        want = dense_operand_shape(q.shape, hkv)
        if q_operand.shape != want or q_operand.dtype != jnp.bfloat16 or q.dtype != jnp.bfloat16:
            raise ValueError(f"q_operand must be bfloat16 {want} for bfloat16 queries {q.shape}; got {q_operand.dtype} "
                             f"{q_operand.shape} (queries {q.dtype})")
        qg = q_operand
    m_rows = rows_for(n_rep, t)
    meta, pos = _checked_inputs(inputs, q_pos, None, n_rep)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    kernel = functools.partial(_dense_kernel, BS=bs, NS=ns, S=S, RT=m_rows // ROW_TILE, window=window,
                               exact=q.dtype == jnp.float32, operand=q_operand is not None)
    o, m, l = _partials_call(kernel, [layer, meta, pos, qg, k, v], (B, hkv, ns), m_rows, D, warps, stages, interpret,
                             "dense_decode")
    if return_partials:
        return o, m, l
    return merge_partials(o, m, l, t, n_rep, q.dtype)
