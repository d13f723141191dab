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
import numpy as np

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


# ------------------------------------------------------------------- cache plane layout (SPEC §3)
# The cache stores its nibble planes in the order the Hopper decode-attention kernels consume them
# (pallas_kernels/decode_attention/mosaic_gpu.py; measurement in docs/kernel_notes.md):
#
# * Byte order: within every 16-byte group of a plane row, stored byte 4j + i holds logical byte
#   2j + i // 2 + 8 (i % 2) (j = 0..3, i = 0..3). A thread that loads the 32-bit word 4j..4j+3
#   then finds in its nibble pairs (bytes 0, 2) and (bytes 1, 3) exactly the element pairs
#   (2j, 2j+1) and (2j+8, 2j+9) that the wgmma register-operand layout gives it, so codes become
#   operands with one bit operation per pair and no shuffles.
# * Keys: per token, split halves (logical byte c = channel c | channel c + D/2 << 4), in that
#   byte order: [S, D/2] rows.
# * Values: per flushed block of G tokens, transposed: logical byte (c, t) of a [D, G/2] array is
#   token t of channel c in its low nibble and token t + G/2 in its high nibble, rows in the byte
#   order above; the block's [D, G/2] bytes fill its G rows of the [S, D/2] plane (same size).
#   The value kernel's operand is V^T (channels x tokens), so tokens must lie along a row.
KERNEL_BYTE_GROUP = 16


def kernel_byte_order(n: int) -> np.ndarray:
    """int64[n]: `perm` with stored[..., q] = logical[..., perm[q]] for a plane row of n bytes.
    Whole 16-byte groups are permuted; a remainder shorter than 16 bytes (rows of geometries the
    Hopper kernels do not take) stays in order."""
    q = np.arange(n)
    r = q % KERNEL_BYTE_GROUP
    grouped = q - r + 2 * (r // 4) + (r % 4) // 2 + 8 * (r % 2)
    return np.where(q < n - n % KERNEL_BYTE_GROUP, grouped, q)


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    return inv


def _permute_last(x: Array, perm: np.ndarray) -> Array:
    return x if np.array_equal(perm, np.arange(perm.size)) else x[..., perm]


def key_plane_to_kernel(plane: Array) -> Array:
    """Split-halves key plane uint8 [..., S, D/2] (as `quantize_keys` returns) -> cache layout."""
    return _permute_last(plane, kernel_byte_order(plane.shape[-1]))


def key_plane_from_kernel(plane: Array) -> Array:
    """Cache-layout key plane -> split-halves uint8 [..., S, D/2] (inverse of key_plane_to_kernel)."""
    return _permute_last(plane, _inverse(kernel_byte_order(plane.shape[-1])))


def value_plane_to_kernel(plane: Array, block: int) -> Array:
    """Split-halves value plane uint8 [..., S, D/2] (as `quantize_values` returns), S a multiple
    of `block` (the key group G), -> cache layout (each block a transposed [D, G/2] byte array)."""
    *lead, s, dh = plane.shape
    if s % block or block % 2:
        raise ValueError(f"value plane of {s} tokens: needs whole blocks of an even {block} tokens")
    codes = unpack_nibbles(plane).reshape(*lead, s // block, block, 2 * dh)  # [..., n, G, D]
    half = block // 2
    pairs = codes[..., :half, :] | (codes[..., half:, :] << 4)  # [..., n, G/2, D]: byte (t, c)
    pairs = _permute_last(jnp.swapaxes(pairs, -1, -2), kernel_byte_order(half))  # [..., n, D, G/2]
    return pairs.astype(jnp.uint8).reshape(*lead, s, dh)


def _value_codes(plane: Array, block: int) -> Array:
    """Cache-layout value plane uint8 [..., S, D/2] -> int32 codes [..., S, D]."""
    *lead, s, dh = plane.shape
    half = block // 2
    pairs = _permute_last(plane.reshape(*lead, s // block, 2 * dh, half), _inverse(kernel_byte_order(half)))
    pairs = jnp.swapaxes(pairs.astype(jnp.int32), -1, -2)  # [..., n, G/2, D]
    codes = jnp.concatenate([pairs & 0xF, pairs >> 4], axis=-2)  # [..., n, G, D]
    return codes.reshape(*lead, s, 2 * dh)


def value_plane_from_kernel(plane: Array, block: int) -> Array:
    """Cache-layout value plane -> split-halves uint8 [..., S, D/2] (inverse of value_plane_to_kernel)."""
    return pack_nibbles(_value_codes(plane, block))


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


# ------------------------------------------------------------------ cache-layout entry points
def quantize_keys_cache(k: Array, group: int, scale_dtype=jnp.float16) -> tuple[Array, Array, Array, Array]:
    """`quantize_keys` with the planes in the cache layout (`key_plane_to_kernel`)."""
    hi, lo, scale, zero = quantize_keys(k, group, scale_dtype)
    return key_plane_to_kernel(hi), key_plane_to_kernel(lo), scale, zero


def quantize_values_cache(v: Array, block: int, scale_dtype=jnp.float16) -> tuple[Array, Array, Array, Array]:
    """`quantize_values` of whole blocks of `block` tokens with the planes in the cache layout."""
    hi, lo, scale, zero = quantize_values(v, scale_dtype)
    return value_plane_to_kernel(hi, block), value_plane_to_kernel(lo, block), scale, zero


def dequantize_keys_cache(hi: Array, lo: Array | None, scale: Array, zero: Array) -> Array:
    """`dequantize_keys` of cache-layout planes."""
    return dequantize_keys(key_plane_from_kernel(hi), None if lo is None else key_plane_from_kernel(lo), scale, zero)


def dequantize_values_cache(hi: Array, lo: Array | None, scale: Array, zero: Array, block: int) -> Array:
    """`dequantize_values` of cache-layout planes (blocks of `block` tokens)."""
    lo = None if lo is None else value_plane_from_kernel(lo, block)
    return dequantize_values(value_plane_from_kernel(hi, block), lo, scale, zero)


def key_codes_cache(plane: Array) -> Array:
    """Cache-layout key plane uint8 [..., S, D/2] -> int32 codes [..., S, D] in 0..15."""
    return unpack_nibbles(key_plane_from_kernel(plane))


def value_codes_cache(plane: Array, block: int) -> Array:
    """Cache-layout value plane uint8 [..., S, D/2] -> int32 codes [..., S, D] in 0..15."""
    return _value_codes(plane, block)
