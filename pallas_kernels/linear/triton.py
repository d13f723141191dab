"""Pallas (Triton lowering) W4A16 matmul for decode-sized M: x [M, K] @ W [K, N], W in INT4.

W is given in the draft-weight format of `qspec_jax.weight_quant` (one layer, no leading dims):

    packed uint8 [K/2, N]   byte [n*G/2 + j, o] = row n*G + j (low nibble) | row n*G + G/2 + j (high)
    scale  f16|f32 [K/G, N]
    zero   f16|f32 [K/G, N]  W[n*G + j, o] = U * scale[n, o] + zero[n, o],  U in 0..15

The kernel never materializes W in memory. Per group n of G input rows it loads the [G/2, BN]
packed tile (uint8, widened before shifting), turns the two nibbles into dot operands in
registers and, in the default "folded" mode, computes

    acc += scale[n] * (x_lo @ U_lo + x_hi @ U_hi) + zero[n] * sum(x[:, group n])

in float32, where x_lo / x_hi are the group's two halves of x (columns n*G + j and
n*G + G/2 + j). The group sums come from two tensor-core dots with a ones tile (cheap at these
M), so there is no in-kernel reduction and no extra XLA kernel. In "dequant" mode the tile is
instead dequantized in registers to the activation dtype, centered for accuracy as
(U - 8) * scale + (zero + 8 * scale) (bf16: relative output error ~3e-3 against the float32
oracle, XLA's `dequantize().astype(bf16)` path ~2e-3, the folded form ~1e-6 before the output
cast), and fed to plain dots: its cost does not grow with M (the folded epilogue is 2 FMAs per
[M_pad, BN] element per group), so it wins for M_pad >= 32 and for G = 32.

Layout of the work:

* Grid (N / BLOCK_N, k_splits). Program (j, s) covers output columns j*BN .. j*BN + BN - 1 and
  the s-th contiguous range of K/G / k_splits groups. With k_splits == 1 it writes the output
  directly in `out_dtype`; otherwise it writes float32 partials [k_splits, M, N] that one XLA
  reduction sums (split-K: at M = 1 and N = 4096 there are only 32 column blocks for 132 SMs).
* x is read straight from its [M, K] array; rows M .. M_pad - 1 (M_pad = max(16, 2^ceil(log2 M)),
  the tensor-core tile) are masked loads (zeros) and masked stores, so nothing is padded or
  sliced outside the kernel.
* Code -> operand conversion (`dequant`):
    "bits"    (default for bf16/f16 x) integer ops only: the bf16 with bits 0x4300 | n is exactly
              128 + n (f16: 0x6400 | n == 1024 + n), so a code becomes an operand with an AND or
              a shift and one OR; the constant offset is removed exactly: with the group sum in
              the folded form (x . (c + U) = x . U + c * sum(x)), by a subtraction of small
              integers in the dequant form.
    "convert" int32 -> float conversion (the only mode for float32 x: exact IEEE dots).

Offline inspection (TTIR from this lowering on jax 0.10.2 and 0.11.2, compiled with Triton 3.6
for sm_90 without a GPU; ptxas: no spills, 66-231 registers): the packed tile is pipelined into
shared memory with cp.async and read back byte-wise in the mma B-operand layout, and the two dots
of a group chain into one accumulator. The inner loop issues about 10.5 instructions per packed
byte per thread at M <= 16, G = 64, BN = 128 (folded), 8.9 at G = 128, 12.6 at M = 32 (dequant)
and ~14-17 in the folded form at M = 32 or with BN = 64. Full HBM bandwidth on an H100 needs
<= ~10 per byte (4 warp-instructions/clock/SM against ~12 bytes/clock/SM), so the kernel sits
near the issue limit: expect roughly 65-85% of copy bandwidth at M <= 16, less at M = 32.

Public entry points: `w4a16_matmul`, `w4a16_apply` (QuantizedWeight-like, leading dims of x
flattened into M) and `default_config` (the shape heuristic; the benchmark
`qspec_jax.bench.w4a16` times it against variants). Both entry points also take stacked weights
[L, ...] with `layer=` (an int or traced scalar): the kernel then indexes the layer itself, so a
layer loop that closes over the stacked weights never copies a layer slice (XLA materializes a
dynamic slice that feeds a custom call, i.e. re-reads and re-writes the weights).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _common
from pallas_kernels._common import interpret_default, next_pow2

Array = jax.Array

SUPPORTED_GROUPS = (32, 64, 128)
N_ALIGN = 128
MIN_ROWS = 16  # tensor-core dots need M >= 16
MAX_ROWS = 128  # beyond this, use a dense GEMM (the kernel is for decode-sized M)
DEQUANT_MODES = ("bits", "convert")
# bf16 0x4300 | n == 128 + n and f16 0x6400 | n == 1024 + n for 0 <= n < 128 (resp. 1024).
_MAGIC = {jnp.dtype(jnp.bfloat16): (0x4300, 128.0), jnp.dtype(jnp.float16): (0x6400, 1024.0)}


@dataclasses.dataclass(frozen=True)
class W4A16Config:
    """Static tuning knobs of one launch (see `default_config` for the heuristic)."""

    block_n: int = 128  # output columns per program (power of two, divides N)
    k_splits: int = 1  # split-K factor (divides K / G); > 1 writes float32 partials
    group_unroll: int = 1  # groups per loop step, statically unrolled (divides groups per split)
    num_warps: int = 4
    num_stages: int = 3
    dequant: str = "bits"  # "bits" | "convert" (float32 x always uses "convert")
    mode: str = "folded"  # "folded" | "dequant" (see the module docstring)

    def replace(self, **kw: Any) -> "W4A16Config":
        return dataclasses.replace(self, **kw)


# ------------------------------------------------------------------------------- utilities
def rows_for(m: int) -> int:
    """Rows of the tensor-core tile for M activation rows: a power of two >= 16."""
    return max(MIN_ROWS, next_pow2(m))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_shapes(x: Array, packed: Array, scale: Array, zero: Array,
                  stacked: bool = False) -> tuple[int, int, int, int]:
    """Validates the operands (one layer, or a stack [L, ...] when `stacked`); returns (M, K, N, G)."""
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape} (use w4a16_apply for leading dims)")
    nd = 3 if stacked else 2
    if packed.ndim != nd or scale.ndim != nd or zero.ndim != nd:
        what = "3-D [L, ...] (stacked layers, with layer=)" if stacked else "2-D (one layer; pass layer= for [L, ...])"
        raise ValueError(f"packed/scale/zero must be {what}, got {packed.shape}, {scale.shape}, {zero.shape}")
    if stacked:
        if not (packed.shape[0] == scale.shape[0] == zero.shape[0]):
            raise ValueError(f"packed/scale/zero have different layer counts: {packed.shape}, {scale.shape}, "
                             f"{zero.shape}")
        packed, scale, zero = packed[0], scale[0], zero[0]  # shapes only (traced: no data moves)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"x dtype {x.dtype} not supported (bfloat16, float16 or float32)")
    for name, a in (("scale", scale), ("zero", zero)):
        if a.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
            raise ValueError(f"{name} dtype {a.dtype} not supported (float16, bfloat16 or float32)")
    m, k = x.shape
    half, n = packed.shape
    if k != 2 * half:
        raise ValueError(f"x has K={k} columns but packed [K/2, N] = {packed.shape} holds K={2 * half}")
    if scale.shape != zero.shape or scale.shape[1] != n:
        raise ValueError(f"scale {scale.shape} and zero {zero.shape} must both be [K/G, N={n}]")
    ng = scale.shape[0]
    if ng == 0 or k % ng:
        raise ValueError(f"K={k} is not a multiple of the number of groups {ng} (scale rows)")
    g = k // ng
    if g not in SUPPORTED_GROUPS:
        raise ValueError(f"group size G = K / scale rows = {g}; supported: {SUPPORTED_GROUPS}")
    if n % N_ALIGN:
        raise ValueError(f"N={n} must be a multiple of {N_ALIGN}")
    if m < 1 or m > MAX_ROWS:
        raise ValueError(f"M={m} rows; the W4A16 kernel supports 1..{MAX_ROWS} (decode-sized M)")
    return m, k, n, g


def default_config(m: int, k: int, n: int, group_size: int, x_dtype: Any = jnp.bfloat16,
                   num_sms: int | None = None) -> W4A16Config:
    """Shape heuristic (see the module docstring for why).

    * mode: "folded" when the row tile is 16 (M <= 16) and G >= 64; else "dequant" (its cost
      does not grow with M, and G = 32 makes the per-group epilogue too frequent).
    * block_n 128 (one 128-byte line per packed row); k_splits: the smallest divisor of K/G
      that gives >= 2 programs per SM, keeping >= 2 groups per split and the float32 partials'
      traffic (2 * k_splits * M * N * 4 bytes, mostly L2-resident) under the packed weights'
      bytes. If that still leaves fewer programs than SMs, block_n 64 (twice the column blocks).
    """
    sms = num_sms or _common.num_sms()
    ng = k // group_size
    target = 2 * sms - sms // 8  # ~2 programs per SM
    weight_bytes = k * n // 2

    def pick_splits(bn: int) -> int:
        ks = 1
        for d in _divisors(ng)[1:]:
            if ng // d < 2 or 2 * d * m * n * 4 > weight_bytes:
                break
            if (n // bn) * ks >= target:
                break
            ks = d
        return ks

    bn = 128
    ks = pick_splits(bn)
    if (n // bn) * ks < sms:
        bn = 64
        ks = pick_splits(bn)
    mp = rows_for(m)
    mode = "folded" if mp == MIN_ROWS and group_size >= 64 else "dequant"
    dq = "convert" if jnp.dtype(x_dtype) == jnp.float32 else "bits"
    return W4A16Config(block_n=bn, k_splits=ks, group_unroll=1, num_warps=4, num_stages=3,
                       dequant=dq, mode=mode)


# ================================================================================== kernel
def _dot(a: Array, b: Array) -> Array:
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None  # IEEE float32 dots
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _w4a16_kernel(x_ref, p_ref, s_ref, z_ref, *refs, M: int, MP: int, G: int, BN: int, GPS: int,
                  GU: int, KS: int, dequant: str, cdt: Any, out_dtype: Any, mode: str, L: int):
    # refs: [layer (int32 [1]) when L > 0], [aliased poison buffer when check_writes], output
    o_ref = refs[-1]
    # Stacked weights [L, ...]: the layer is indexed in the kernel (no XLA slice is materialized).
    lead = (jnp.minimum(jnp.maximum(refs[0][0], 0), L - 1),) if L else ()
    H = G // 2
    f32 = jnp.float32
    jn, ks = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(jn * BN, BN)
    row_ok = lax.broadcasted_iota(jnp.int32, (MP, H), 0) < M if MP != M else None
    magic = _MAGIC.get(jnp.dtype(cdt))
    offset = magic[1] if dequant != "convert" else 0.0
    ones = jnp.ones((H, BN), cdt)

    def load_x(col):  # [MP, H] in the operand dtype; rows >= M read as 0
        if row_ok is None:
            v = x_ref[:, pl.ds(col, H)]
        else:
            v = pltriton.load(x_ref.at[pl.ds(0, MP), pl.ds(col, H)], mask=row_ok, other=0.0)
        return v.astype(cdt)

    def codes(pk):  # uint8 [H, BN] -> (lo, hi) operands, each equal to offset + U
        if dequant == "convert":
            w = pk.astype(jnp.int32)  # widen before shifting
            return (w & 0xF).astype(cdt), (w >> 4).astype(cdt)
        w = pk.astype(jnp.uint16)
        bits = jnp.uint16(magic[0])
        lo = lax.bitcast_convert_type((w & jnp.uint16(0xF)) | bits, cdt)
        hi = lax.bitcast_convert_type((w >> jnp.uint16(4)) | bits, cdt)
        return lo, hi

    def group(g, acc):
        pk = p_ref[(*lead, pl.ds(g * H, H), pl.ds(n0, BN))]  # uint8 [H, BN]
        sc = s_ref[(*lead, g, pl.ds(n0, BN))].astype(f32)  # [BN]
        ze = z_ref[(*lead, g, pl.ds(n0, BN))].astype(f32)
        x_lo = load_x(g * G)
        x_hi = load_x(g * G + H)
        c_lo, c_hi = codes(pk)
        if mode == "dequant":  # W tile in the activation dtype, plain dots
            # Centered: W = s (U - 8) + (z + 8 s). U - 8 is exact; z + 8 s (the group's middle)
            # is small, so rounding s and it to a 16-bit dtype costs far less than rounding z.
            off = jnp.asarray(offset + 8.0, cdt)
            c_lo, c_hi = c_lo - off, c_hi - off  # exact: small integers
            zm = ze + 8.0 * sc
            sw, zw = sc.astype(cdt)[None, :], zm.astype(cdt)[None, :]
            return acc + _dot(x_lo, c_lo * sw + zw) + _dot(x_hi, c_hi * sw + zw)
        d = _dot(x_lo, c_lo) + _dot(x_hi, c_hi)  # x.U + offset * sum(x)   [MP, BN]
        xs = _dot(x_lo, ones) + _dot(x_hi, ones)  # sum(x) over the group, on every column
        zc = ze - offset * sc if offset else ze
        return acc + sc[None, :] * d + zc[None, :] * xs

    def step(i, acc):
        g0 = ks * GPS + i * GU
        for u in range(GU):
            acc = group(g0 + u, acc)
        return acc

    acc = lax.fori_loop(0, GPS // GU, step, jnp.zeros((MP, BN), f32))
    val = acc.astype(out_dtype)
    if KS == 1:
        dst = o_ref.at[pl.ds(0, MP), pl.ds(n0, BN)]
    else:
        dst = o_ref.at[ks, pl.ds(0, MP), pl.ds(n0, BN)]
    if MP == M:
        pltriton.store(dst, val)
    else:
        pltriton.store(dst, val, mask=lax.broadcasted_iota(jnp.int32, (MP, BN), 0) < M)


def _resolve_config(m: int, k: int, n: int, g: int, x_dtype: Any, config: W4A16Config | None,
                    overrides: dict[str, Any]) -> W4A16Config:
    unknown = set(overrides) - {f.name for f in dataclasses.fields(W4A16Config)}
    if unknown:
        raise TypeError(f"unknown W4A16 tuning argument(s): {sorted(unknown)}")
    base = config or default_config(m, k, n, g, x_dtype)
    cfg = base.replace(**{kk: v for kk, v in overrides.items() if v is not None})
    ng = k // g
    if jnp.dtype(x_dtype) == jnp.float32 and cfg.dequant != "convert":
        cfg = cfg.replace(dequant="convert")  # exact float32 path
    if cfg.mode not in ("folded", "dequant"):
        raise ValueError(f"mode={cfg.mode!r}; expected 'folded' or 'dequant'")
    if cfg.dequant not in DEQUANT_MODES:
        raise ValueError(f"dequant={cfg.dequant!r}; expected one of {DEQUANT_MODES}")
    bn = cfg.block_n
    if bn < 16 or bn & (bn - 1) or n % bn:
        raise ValueError(f"block_n={bn} must be a power of two >= 16 dividing N={n}")
    if cfg.k_splits < 1 or ng % cfg.k_splits:
        raise ValueError(f"k_splits={cfg.k_splits} must divide the number of groups K/G = {ng}")
    gps = ng // cfg.k_splits
    if cfg.group_unroll < 1 or gps % cfg.group_unroll:
        raise ValueError(f"group_unroll={cfg.group_unroll} must divide the groups per split ({gps})")
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        raise ValueError(f"num_warps={cfg.num_warps} / num_stages={cfg.num_stages} invalid")
    return cfg


def w4a16_matmul(x: Array, packed: Array, scale: Array, zero: Array, *, out_dtype: Any = None,
                 interpret: bool | None = None, config: W4A16Config | None = None,
                 check_writes: bool = False, layer: Array | int | None = None, **tuning: Any) -> Array:
    """x [M, K] (bf16 / f16 / f32) @ W [K, N] with W in the INT4 draft format -> [M, N].

    packed uint8 [K/2, N], scale / zero [K/G, N] (G in 32/64/128, inferred). Float32
    accumulation; the result is cast to `out_dtype` (default: x's dtype).
    `interpret=None` runs Pallas' interpreter unless `jax.default_backend() == "gpu"`.
    Tuning: `config=W4A16Config(...)` and/or keyword overrides of its fields (block_n,
    k_splits, group_unroll, num_warps, num_stages, dequant, mode); unspecified fields come from
    `default_config`. `check_writes=True` aliases a NaN-filled buffer as the kernel's output
    (tests: an element the kernel never writes stays NaN).
    `layer`: with stacked weights packed [L, K/2, N], scale / zero [L, K/G, N] and an int or
    traced int32 scalar `layer` (clamped to 0..L-1), the kernel reads that layer's weights in
    place. Inside a layer loop this avoids the copy XLA makes when a dynamic slice of the stack
    feeds a custom call.
    """
    stacked = layer is not None
    m, k, n, g = _check_shapes(x, packed, scale, zero, stacked)
    cfg = _resolve_config(m, k, n, g, x.dtype, config, tuning)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    interp = interpret_default(interpret)
    dequant = cfg.dequant
    ks, bn = cfg.k_splits, cfg.block_n
    mp = rows_for(m)
    gps = (k // g) // ks
    kdt = out_dtype if ks == 1 else jnp.dtype(jnp.float32)
    out_shape = (m, n) if ks == 1 else (ks, m, n)
    n_layers = packed.shape[0] if stacked else 0
    kernel = functools.partial(_w4a16_kernel, M=m, MP=mp, G=g, BN=bn, GPS=gps, GU=cfg.group_unroll,
                               KS=ks, dequant=dequant, cdt=x.dtype, out_dtype=kdt, mode=cfg.mode,
                               L=n_layers)
    args = [x, packed, scale, zero]
    if stacked:
        args.append(jnp.asarray(layer, jnp.int32).reshape(1))
    aliases = {}
    if check_writes:
        args.append(jnp.full(out_shape, jnp.nan, kdt))
        aliases = {len(args) - 1: 0}
    out = pl.pallas_call(
        kernel,
        grid=(n // bn, ks),
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, kdt),
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interp,
        name=f"w4a16_g{g}_bn{bn}_ks{ks}",
    )(*args)
    if ks > 1:
        out = jnp.sum(out, axis=0).astype(out_dtype)
    return out


def w4a16_apply(x: Array, qw: Any, out_dtype: Any = None, *, layer: Array | int | None = None,
                **kwargs: Any) -> Array:
    """x [..., K] @ W for a QuantizedWeight-like `qw` (.packed, .scale, .zero) -> [..., N]; the
    leading dims of x are flattened into M. `qw` is one layer's weight (packed [K/2, N]), or a
    stack [L, K/2, N] with `layer` selecting the layer inside the kernel."""
    want = 2 if layer is None else 3
    if qw.packed.ndim != want:
        raise ValueError(f"w4a16_apply takes one layer's weight (packed [K/2, N]), or stacked weights "
                         f"[L, K/2, N] with layer=; got packed {qw.packed.shape} and layer={layer!r}")
    lead = x.shape[:-1]
    m = math.prod(lead)
    y = w4a16_matmul(x.reshape(m, x.shape[-1]), qw.packed, qw.scale, qw.zero, out_dtype=out_dtype,
                     layer=layer, **kwargs)
    return y.reshape(*lead, y.shape[-1])


__all__ = ["W4A16Config", "default_config", "rows_for", "w4a16_apply", "w4a16_matmul"]
