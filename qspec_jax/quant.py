"""Hierarchical INT8 = INT4 (upper nibble) + INT4 (lower nibble) quantization of K/V (SPEC §2).

For a group of values x with min m and max M:

    s = (M - m) / 15                     shared scale, stored in `scale_dtype`
    U = clamp(round((x - m) / s), 0, 15) upper nibble: the draft's INT4 code
    L = clamp(round(E / (s/16)), -8, 7)  lower nibble of the residual E = x - (U s + m), stored as L + 8
    draft  = U s + m                     |x - draft|  <= s/2
    target = U s + (L - 8) s/16 + m      |x - target| <= s/32

Keys are grouped per channel over blocks of G tokens; values per token over groups of
min(head_dim, 128) channels. Codes are packed two per byte in "split halves" order: byte j of a
token holds channel j in its low nibble and channel j + D/2 in its high nibble, so a kernel can
compute q[:D/2]·lo + q[D/2:]·hi without interleaving.

Scale and zero are rounded to their storage dtype *before* the codes are computed, with the zero
rounded down and the scale rounded up, so the bounds above hold for the stored numbers exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

NIBBLE_MAX = 15
LOWER_BIAS = 8
VALUE_GROUP_MAX = 128


def value_group_size(head_dim: int) -> int:
    """Channels per value-quantization group: min(head_dim, 128)."""
    return min(head_dim, VALUE_GROUP_MAX)


# ------------------------------------------------------------------------------- nibble packing
def pack_nibbles(codes: Array) -> Array:
    """int codes in 0..15, [..., D] -> uint8 [..., D/2] in split-halves order."""
    d = codes.shape[-1]
    if d % 2:
        raise ValueError(f"pack_nibbles: last dim must be even, got {d}")
    c = codes.astype(jnp.int32)
    return (c[..., : d // 2] | (c[..., d // 2 :] << 4)).astype(jnp.uint8)


def unpack_nibbles(packed: Array) -> Array:
    """uint8 [..., D/2] -> int32 codes [..., D] in 0..15 (inverse of `pack_nibbles`)."""
    p = packed.astype(jnp.int32)  # widen before shifting
    return jnp.concatenate([p & 0xF, p >> 4], axis=-1)


# ------------------------------------------------------------------------------- core quantizer
def _round_toward(x: Array, dtype, direction: float) -> Array:
    """Rounds float32 `x` to `dtype`, toward -inf (direction < 0) or +inf (direction > 0)."""
    r = x.astype(dtype)
    rf = r.astype(jnp.float32)
    off = (rf > x) if direction < 0 else (rf < x)
    stepped = jnp.nextafter(r, jnp.asarray(direction * jnp.inf, dtype))
    return jnp.where(off, stepped, r)


def hierarchical_quantize(x: Array, axis: int, scale_dtype=jnp.float16) -> tuple[Array, Array, Array, Array]:
    """Quantizes `x` with one (scale, zero) per slice along `axis`.

    Returns (upper, lower_biased, scale, zero): int32 codes in 0..15 shaped like `x`, and
    scale/zero in `scale_dtype` with `axis` kept at size 1. A constant group whose value is
    representable in `scale_dtype` gets scale 0 and codes (0, 8), which dequantize exactly;
    otherwise it gets a tiny scale and stays within the bounds. float16 scales overflow for
    values beyond +-65504: use float32 scales for such data.
    """
    xf = x.astype(jnp.float32)
    lo = jnp.min(xf, axis=axis, keepdims=True)
    hi = jnp.max(xf, axis=axis, keepdims=True)
    zero = _round_toward(lo, scale_dtype, -1.0)
    z = zero.astype(jnp.float32)
    scale = _round_toward((hi - z) / NIBBLE_MAX, scale_dtype, +1.0)
    # A range so small that (max - zero)/15 flushes to zero (float32 subnormal) still needs s > 0.
    scale = jnp.where((hi > z) & (scale.astype(jnp.float32) <= 0), jnp.finfo(scale_dtype).smallest_normal, scale)
    s = scale.astype(jnp.float32)
    nonzero = s > 0
    inv_s = jnp.where(nonzero, 1.0 / jnp.where(nonzero, s, 1.0), 0.0)
    upper = jnp.clip(jnp.round((xf - z) * inv_s), 0, NIBBLE_MAX)
    residual = xf - (upper * s + z)
    lower = jnp.clip(jnp.round(residual * (16.0 * inv_s)), -LOWER_BIAS, LOWER_BIAS - 1)
    return upper.astype(jnp.int32), (lower + LOWER_BIAS).astype(jnp.int32), scale, zero


def dequantize(upper: Array, lower_biased: Array | None, scale: Array, zero: Array) -> Array:
    """float32 values from codes; `lower_biased=None` gives the draft (upper-nibble) view."""
    s = scale.astype(jnp.float32)
    x = upper.astype(jnp.float32) * s + zero.astype(jnp.float32)
    if lower_biased is not None:
        x = x + (lower_biased.astype(jnp.float32) - LOWER_BIAS) * (s / 16.0)
    return x


# ----------------------------------------------------------------------------- keys and values
def quantize_keys(k: Array, group: int, scale_dtype=jnp.float16) -> tuple[Array, Array, Array, Array]:
    """Per-channel quantization over blocks of `group` tokens.

    k: [..., S, D] with S a multiple of `group`.
    Returns hi, lo: uint8 [..., S, D/2]; scale, zero: [..., S/group, D].
    """
    *lead, seq, d = k.shape
    if seq % group:
        raise ValueError(f"quantize_keys: {seq} tokens is not a multiple of the group size {group}")
    blocks = k.reshape(*lead, seq // group, group, d)
    upper, lower, scale, zero = hierarchical_quantize(blocks, axis=-2, scale_dtype=scale_dtype)
    upper = upper.reshape(*lead, seq, d)
    lower = lower.reshape(*lead, seq, d)
    return pack_nibbles(upper), pack_nibbles(lower), scale[..., 0, :], zero[..., 0, :]


def quantize_values(v: Array, scale_dtype=jnp.float16) -> tuple[Array, Array, Array, Array]:
    """Per-token quantization over groups of min(D, 128) channels.

    v: [..., S, D]. Returns hi, lo: uint8 [..., S, D/2]; scale, zero: [..., S, D/Gv].
    """
    *lead, seq, d = v.shape
    gv = value_group_size(d)
    groups = v.reshape(*lead, seq, d // gv, gv)
    upper, lower, scale, zero = hierarchical_quantize(groups, axis=-1, scale_dtype=scale_dtype)
    upper = upper.reshape(*lead, seq, d)
    lower = lower.reshape(*lead, seq, d)
    return pack_nibbles(upper), pack_nibbles(lower), scale[..., 0], zero[..., 0]


def dequantize_keys(hi: Array, lo: Array | None, scale: Array, zero: Array) -> Array:
    """hi/lo: uint8 [..., S, D/2]; scale/zero: [..., S/G, D] -> float32 [..., S, D]."""
    group = hi.shape[-2] // scale.shape[-2]
    s = jnp.repeat(scale, group, axis=-2)
    z = jnp.repeat(zero, group, axis=-2)
    return dequantize(unpack_nibbles(hi), None if lo is None else unpack_nibbles(lo), s, z)


def dequantize_values(hi: Array, lo: Array | None, scale: Array, zero: Array) -> Array:
    """hi/lo: uint8 [..., S, D/2]; scale/zero: [..., S, D/Gv] -> float32 [..., S, D]."""
    d = hi.shape[-1] * 2
    gv = d // scale.shape[-1]
    s = jnp.repeat(scale, gv, axis=-1)
    z = jnp.repeat(zero, gv, axis=-1)
    return dequantize(unpack_nibbles(hi), None if lo is None else unpack_nibbles(lo), s, z)
