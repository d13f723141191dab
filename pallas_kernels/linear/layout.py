"""Pre-packed INT4 weight layout for the Hopper (Mosaic GPU) W4A16 kernel.

The kernel (`pallas_kernels.linear.mosaic_gpu`) computes out^T = W^T x^T with the weight tile as the
wgmma A operand held in registers. On Hopper an A fragment of a 64-row warpgroup tile is fixed
by the hardware: thread t = 32 w + 4 g + c (warp w, row group g, column pair c) holds, for every
16-column k step j, rows R0 = 16 w + g and R1 = R0 + 8 at columns 16 j + 2 c + {0, 1} and
16 j + 8 + 2 c + {0, 1}, as four bf16x2 registers (a0a1, a2a3, a4a5, a6a7 in PTX's naming).
This layout stores exactly those nibbles in exactly that order, so one 16-byte shared-memory
load per thread and k-block gives a thread its 32 codes and no shuffle or permute follows.

Arrays (leading dims `...`, e.g. a stacked layer axis L, are kept):

    qw  uint32 [..., N/64, K/64, 128, 4]
        word [rt, kb, t, j], bits 4 p + 16 h .. +3 (p = 0..3, h = 0..1) hold the code U in 0..15
        of W[k, n] with  n = 64 rt + 16 (t // 32) + (t % 32) // 4 + 8 (p % 2),
                         k = 64 kb + 16 j + 2 (t % 4) + 8 (p // 2) + h.
        A register pair p comes out of a word with one shift (by 4 p) and one lop3 (mask
        0x000F000F, OR 0x4300 4300: the bf16 pair 128 + U exactly); no byte permute.
    sz  uint32 [..., N/64, K/C, 64 C/G]   with C = max(64, G) (the k columns one record covers)
        word [rt, kc, 2 (C/G) r + 2 i + e] = s | zc << 16 (bfloat16 bit patterns, the kernel pair
        below) of row n = 64 rt + 16 (r // 8) + r % 8 + 8 e and group kc C/G + i. Thread t reads
        the words of r = t // 4 with one vector load (4 threads share a record: broadcast, no bank
        conflict). (One flat last axis: TMA needs every non-minor stride to be a multiple of 16 bytes.)

Values: the codes U are `qspec_jax.weight_quant`'s, bit for bit; each (group, row) record holds the
kernel pair (s, zc) = (bf16(scale), bf16(zero + 8 scale)) of that group's float16 scale and zero
(`kernel_scales`: float32 fma, one rounding each). The kernel computes, per bf16 pair, (128 + U) -
136 = U - 8 exactly, then fma(U - 8, s, zc) rounded once to bf16 (`dequantize_bf16`; the centered
zero is the group's middle, so rounding it costs far less than rounding `zero` itself). Storing
the pair rather than the float16 numbers (layout version 2) spares the kernel three of every five
instructions per record (two byte permutes instead of two conversions, an fma and two more
conversions: ~10% of a stage's instructions) for the same bits of W; the price is that the
float16 scale and zero cannot be recovered from the layout: keep the QuantizedWeight where they are
needed (the Triton kernel reads them).

Public: `W4A16Packed`, `packed_bytes` (a weight's bytes: the byte floor), `pack_fields`, `pack_quantized`,
`pack_float`, `unpack_codes` (codes and the kernel pair), `unpack_packed_codes` (the codes as the QuantizedWeight field), `dequantize_f32` / `dequantize_bf16` (the kernel's own dequantization in jnp, before
and after its one rounding: the oracle for the layout), `kernel_scales`, `thread_elements` (the
index map above, shared with the kernels and the tests).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

Array = jax.Array

ROWS = 64  # rows of N per warpgroup tile (the wgmma M)
KB = 64  # k columns per 16-byte thread load (one wgmma k group at 128-byte swizzle)
THREADS = 128  # threads in a warpgroup
WORDS = 4  # uint32 words per thread and k block (32 codes)
GROUPS = (32, 64, 128)
LAYOUT_VERSION = 2  # 2: records hold the kernel pair (bf16 s, bf16 z + 8 s); 1 held float16 (scale, zero)


def chunk_cols(group_size: int) -> int:
    """k columns covered by one scale record row (C = max(64, G))."""
    return max(KB, group_size)


@functools.lru_cache(maxsize=None)
def thread_elements() -> np.ndarray:
    """int32 [128, 4, 4, 2, 2]: (row, col) inside a 64x64 tile of code (thread t, word j, pair p,
    half h). The single definition of the A-fragment order; the packer, the unpacker, the SMEM
    twin and the register kernel all use it."""
    out = np.zeros((THREADS, WORDS, 4, 2, 2), np.int32)
    for t in range(THREADS):
        w, g, c = t // 32, (t % 32) // 4, t % 4
        for j in range(WORDS):
            for p in range(4):
                for h in range(2):
                    out[t, j, p, h] = (16 * w + g + 8 * (p % 2), 16 * j + 2 * c + 8 * (p // 2) + h)
    return out


@functools.lru_cache(maxsize=None)
def _tile_gather() -> np.ndarray:
    """int32 [64 * 64]: flat (t, j, p, h) position of tile element (row, col), row-major."""
    te = thread_elements().reshape(-1, 2)
    inv = np.empty(ROWS * KB, np.int32)
    inv[te[:, 0] * KB + te[:, 1]] = np.arange(te.shape[0], dtype=np.int32)
    assert np.array_equal(np.sort(inv), np.arange(ROWS * KB))  # a bijection
    return inv


@struct.dataclass
class W4A16Packed:
    """INT4 weight W [K, N] in the kernel's layout (see the module docstring); leading dims kept."""

    qw: Array  # uint32 [..., N/64, K/64, 128, 4]
    sz: Array  # uint32 [..., N/64, K/C, 64 C/G]: bf16 pairs (s, zc)
    group_size: int = struct.field(pytree_node=False)

    @property
    def k(self) -> int:
        return self.qw.shape[-3] * KB

    @property
    def n(self) -> int:
        return self.qw.shape[-4] * ROWS

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.qw.shape[:-4])

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.lead, self.k, self.n)

    @property
    def nbytes(self) -> int:
        return int(self.qw.size * 4 + self.sz.size * 4)


def check_shape(k: int, n: int, group_size: int) -> None:
    """Raises ValueError naming the constraint a [K, N] weight breaks."""
    if group_size not in GROUPS:
        raise ValueError(f"group size {group_size}; the W4A16 layout supports {GROUPS}")
    c = chunk_cols(group_size)
    if k % c:
        raise ValueError(f"K={k} must be a multiple of {c} (64 and the group size {group_size})")
    if n % ROWS:
        raise ValueError(f"N={n} must be a multiple of {ROWS} (the wgmma tile rows)")


def packed_bytes(k: int, n: int, group_size: int) -> int:
    """Bytes of one [K, N] weight in this layout (`W4A16Packed.nbytes`), what a kernel reads of it: half
    a byte per code and a 4-byte record (s, zc) per group and row. The INT4 linears' byte floor."""
    return k * n // 2 + 4 * (k // group_size) * n


# ------------------------------------------------------------------------------------- packing
def _codes_from_fields(packed: Array, group_size: int) -> Array:
    """uint8 [..., K/2, N] split-halves packing -> int32 codes [..., K, N]."""
    *lead, half, n = packed.shape
    ng = 2 * half // group_size
    p = packed.reshape(*lead, ng, group_size // 2, n).astype(jnp.int32)  # widen before shifting
    return jnp.concatenate([p & 0xF, p >> 4], axis=-2).reshape(*lead, 2 * half, n)


def _fields_from_codes(codes: Array, group_size: int) -> Array:
    *lead, k, n = codes.shape
    u = codes.reshape(*lead, k // group_size, group_size, n).astype(jnp.int32)
    h = group_size // 2
    return (u[..., :h, :] | (u[..., h:, :] << 4)).astype(jnp.uint8).reshape(*lead, k // 2, n)


def pack_codes(codes: Array, scale: Array, zero: Array) -> W4A16Packed:
    """Codes int [..., K, N] in 0..15 and float16 scale / zero [..., K/G, N] -> the layout (the
    codes as they are, each group's scale and zero as the kernel pair `kernel_scales`)."""
    *lead, k, n = codes.shape
    ng = scale.shape[-2]
    if scale.shape != zero.shape or scale.shape[-1] != n or k % ng:
        raise ValueError(f"scale {scale.shape} / zero {zero.shape} do not match codes [..., K={k}, N={n}]")
    check_shape(k, n, k // ng)
    if scale.dtype != jnp.float16 or zero.dtype != jnp.float16:
        raise ValueError(f"scale/zero must be float16 (the draft format), got {scale.dtype}/{zero.dtype}")
    return _pack_codes(codes, scale, zero)


@jax.jit
def _pack_codes(codes: Array, scale: Array, zero: Array) -> W4A16Packed:
    *lead, k, n = codes.shape
    g = k // scale.shape[-2]
    te = thread_elements()  # [128, 4, 4, 2, 2]
    # [.., K, N] -> W^T tiles [.., N/64, K/64, 64 (row), 64 (col)]
    u = codes.astype(jnp.uint32)
    wt = jnp.swapaxes(u, -1, -2).reshape(*lead, n // ROWS, ROWS, k // KB, KB)
    wt = jnp.swapaxes(wt, -2, -3)  # [.., rt, kb, row, col]
    nib = wt[..., te[..., 0], te[..., 1]]  # [.., rt, kb, 128, 4, 4(p), 2(h)]
    shifts = (4 * np.arange(4)[:, None] + 16 * np.arange(2)[None, :]).astype(np.uint32)
    qw = jnp.sum(nib << shifts, axis=(-1, -2), dtype=jnp.uint32)  # disjoint bits: sum == OR
    c = chunk_cols(g)
    gpc = c // g
    s, zc = kernel_scales(scale, zero)
    rec = lax_bitcast_u16(s).astype(jnp.uint32) | (lax_bitcast_u16(zc).astype(jnp.uint32) << 16)  # [.., K/G, N]
    rec = rec.reshape(*lead, k // c, gpc, n // ROWS, 4, 2, 8)  # [.., kc, i, rt, w, e, gg]
    rec = _permute_tail(rec, (2, 0, 3, 5, 1, 4))  # [.., rt, kc, w, gg, i, e]
    sz = rec.reshape(*lead, n // ROWS, k // c, 64 * gpc)
    return W4A16Packed(qw=qw, sz=sz, group_size=g)


def lax_bitcast_u16(a: Array) -> Array:
    return jax.lax.bitcast_convert_type(a, jnp.uint16)


def _permute_tail(a: Array, perm: tuple[int, ...]) -> Array:
    """Transposes the last len(perm) axes of `a` by `perm` (leading axes stay)."""
    lead = a.ndim - len(perm)
    return jnp.transpose(a, (*range(lead), *(lead + q for q in perm)))


@jax.jit
def unpack_codes(p: W4A16Packed) -> tuple[Array, Array, Array]:
    """(codes int32 [..., K, N], s, zc bfloat16 [..., K/G, N]): the codes `pack_codes` was given,
    bit for bit, and the kernel pair it stored (`kernel_scales` of the float16 scale / zero)."""
    lead, k, n, g = p.lead, p.k, p.n, p.group_size
    shifts = (4 * np.arange(4)[:, None] + 16 * np.arange(2)[None, :]).astype(np.uint32)
    nib = (p.qw[..., None, None] >> shifts) & 0xF  # [.., rt, kb, 128, 4, 4, 2]
    flat = nib.reshape(*lead, n // ROWS, k // KB, -1)
    tile = flat[..., _tile_gather()].reshape(*lead, n // ROWS, k // KB, ROWS, KB)
    wt = jnp.swapaxes(tile, -2, -3).reshape(*lead, n, k)
    codes = jnp.swapaxes(wt, -1, -2).astype(jnp.int32)
    c = chunk_cols(g)
    gpc = c // g
    rec = p.sz.reshape(*lead, n // ROWS, k // c, 4, 8, gpc, 2)  # [.., rt, kc, w, gg, i, e]
    rec = _permute_tail(rec, (1, 4, 0, 2, 5, 3))  # [.., kc, i, rt, w, e, gg]
    rec = rec.reshape(*lead, k // g, n)
    s = jax.lax.bitcast_convert_type((rec & 0xFFFF).astype(jnp.uint16), jnp.bfloat16)
    zc = jax.lax.bitcast_convert_type((rec >> 16).astype(jnp.uint16), jnp.bfloat16)
    return codes, s, zc


def pack_fields(packed: Array, scale: Array, zero: Array) -> W4A16Packed:
    """QuantizedWeight fields (uint8 [..., K/2, N] split halves, float16 [..., K/G, N]) -> layout."""
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed must be uint8 [..., K/2, N], got {packed.dtype}")
    k = 2 * packed.shape[-2]
    ng = scale.shape[-2]
    if ng == 0 or k % ng or (k // ng) % 2:
        raise ValueError(f"scale rows {ng} do not divide K={k} into even groups (packed {packed.shape})")
    if packed.ndim > 2:  # layer by layer: a stack's int32 codes and uint32 gathers are 8x its bytes
        return _map_layers(lambda p, s, z: pack_codes(_codes_from_fields(p, k // ng), s, z), packed, scale, zero)
    return pack_codes(_codes_from_fields(packed, k // ng), scale, zero)


def _map_layers(f: Callable[..., Any], *arrays: Array) -> Any:
    """f over the leading axes of [..., A, B] arrays one [A, B] slice at a time (`lax.map`), its
    outputs stacked back on those axes: only one slice's temporaries are alive at a time (the
    8B's gate_up stack as uint32 codes would be 14 GiB)."""
    lead = arrays[0].shape[:-2]
    out = jax.lax.map(lambda xs: f(*xs), tuple(a.reshape(-1, *a.shape[-2:]) for a in arrays))
    return jax.tree.map(lambda a: a.reshape(*lead, *a.shape[1:]), out)


def pack_quantized(qw: Any) -> W4A16Packed:
    """A QuantizedWeight-like object (.packed, .scale, .zero) -> the kernel layout."""
    return pack_fields(qw.packed, qw.scale, qw.zero)


def pack_float(w: Array, group_size: int, quantizer: Callable[..., Any]) -> W4A16Packed:
    """Float weights [..., K, N] -> the layout, through `quantizer(w, group_size)` (e.g.
    `qspec_jax.weight_quant.quantize_weight`, the project's one quantizer: this lower-layer
    module does not import it) which returns a QuantizedWeight-like object."""
    return pack_quantized(quantizer(w, group_size))


@jax.jit
def unpack_packed_codes(p: W4A16Packed) -> Array:
    """The codes as the QuantizedWeight's uint8 [..., K/2, N] split-halves field (bit for bit what
    `pack_fields` was given; the float16 scale / zero are not in the layout)."""
    return _fields_from_codes(unpack_codes(p)[0], p.group_size)


# -------------------------------------------------------------------------------- the math
def kernel_scales(scale: Array, zero: Array) -> tuple[Array, Array]:
    """(bf16(scale), bf16(zero + 8 scale)) from float16 scale / zero: the kernel's per-group pair
    (float32 fma, one rounding to bf16 each; float16 -> float32 is exact)."""
    s = scale.astype(jnp.float32)
    return s.astype(jnp.bfloat16), (zero.astype(jnp.float32) + 8.0 * s).astype(jnp.bfloat16)


@jax.jit
def dequantize_f32(p: W4A16Packed) -> Array:
    """W [..., K, N] float32 = (U - 8) s + zc from the stored kernel pair, before the kernel's one
    rounding to bf16 ((U - 8) s is exact in float32; adding zc rounds at most once more, never for
    the magnitudes a quantizer produces)."""
    codes, s, zc = unpack_codes(p)
    g = p.group_size
    s = jnp.repeat(s.astype(jnp.float32), g, axis=-2)
    zc = jnp.repeat(zc.astype(jnp.float32), g, axis=-2)
    return (codes - 8).astype(jnp.float32) * s + zc


@jax.jit
def dequantize_bf16(p: W4A16Packed) -> Array:
    """W [..., K, N] in bf16 exactly as the kernels form it: fma(U - 8, s, zc) rounded once (the
    bf16x2 fma of the register kernel; `dequantize_f32` rounded)."""
    return dequantize_f32(p).astype(jnp.bfloat16)


def dequantize_fields(packed: Array, scale: Array, zero: Array) -> Array:
    """W [..., K, N] in float32 = U * scale + zero from the QuantizedWeight fields (the formula of
    `qspec_jax.weight_quant.QuantizedWeight.dequantize`: the oracle's weight)."""
    codes = _codes_from_fields(packed, 2 * packed.shape[-2] // scale.shape[-2])
    g = codes.shape[-2] // scale.shape[-2]
    s = jnp.repeat(scale.astype(jnp.float32), g, axis=-2)
    z = jnp.repeat(zero.astype(jnp.float32), g, axis=-2)
    return codes.astype(jnp.float32) * s + z


__all__ = [
    "GROUPS", "KB", "LAYOUT_VERSION", "ROWS", "THREADS", "WORDS", "W4A16Packed",
    "check_shape", "chunk_cols", "dequantize_bf16", "dequantize_f32", "dequantize_fields", "kernel_scales", "pack_codes",
    "pack_fields", "pack_float", "pack_quantized", "packed_bytes", "thread_elements", "unpack_codes",
    "unpack_packed_codes",
]
