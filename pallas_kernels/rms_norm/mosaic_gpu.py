"""The target's residual add + RMSNorm in one Mosaic GPU kernel (Hopper), in HF Llama's order.

    h = x + d                                   bf16 [M, D] (the residual stream; d optional)
    y = bf16(g * bf16(h r)),  r = rsqrt(mean(h^2) + eps)   bf16 [M, D]

XLA makes two kernels of each of the target layer's norms on the GPU (a reduction does not fuse
with its broadcast consumer: `input_reduce_fusion` + `loop_multiply_fusion` at a few rows, the
residual add + a Triton normalization fusion above; tools/device/norm_fusion_probe.py). Here a
CTA of one warpgroup owns one row: it loads x, d and the layer's g straight from global memory
into registers (the strided layout: thread t holds elements 8t + 1024 j of the row, D = 4096 is 4
vectors of 8 per thread), sums h^2 in float32 (per thread, then the warpgroup's reduction through
shared memory: a fixed order) and stores h and y. No TMA or shared-memory tiles: the row is 8 KB
and the kernel's time is its launch and one round trip to memory.

Row invariance: a row's result depends on its own values only (one CTA per row, the same code
for every M), so a decode pass computes the same bits for a row whatever the pass's other rows.
Against XLA's add + `model.rms_norm`: XLA (excess precision allowed, its default) feeds the norm
the float32 sum x + d unrounded, where this kernel, like HF, rounds h to bf16 first; and the
float32 sum of h^2 runs in another order, so r can differ in its last bit. On an H200 y matched a
float64-sum oracle of HF's order bit for bit at M 1..160 (tools/device/add_norm_gpu.py).

`interpret=True` runs the same kernel in GPU interpret mode (CPU tests).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import interpret_params

Array = jax.Array
THREADS = 128  # one warpgroup per row
VEC = 8  # bf16 elements per thread per vector (16 bytes)
MAX_ROWS = 1024  # decode-sized passes (B x width); prefill-sized M stays with XLA


def supports(m: int, d: int, dtype: Any) -> bool:
    """Whether the kernel takes [M, D] rows of `dtype`: bf16, 1 <= M <= MAX_ROWS, D a multiple of
    THREADS x VEC (each thread holds whole 16-byte vectors)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and 1 <= m <= MAX_ROWS and d % (THREADS * VEC) == 0


def _kernel(*refs: Any, names: tuple[str, ...], eps: float, d: int, n_layers: int) -> None:
    r = dict(zip(names, refs))
    row = lax.axis_index("row")
    f32 = jnp.float32
    # The weight first: its address waits on the layer index (a load of its own), and no load can
    # move above the warpgroup barrier of the reduction below.
    if "layer" in r:  # clipped here: an XLA clip of the loop's index would be a kernel of its own
        g = r["g"][jnp.clip(r["layer"][0], 0, n_layers - 1)].astype(f32)
    else:
        g = r["g"][...].astype(f32)
    hf = r["x"][row].astype(f32)  # [D], strided: the same layout for every [D] operand here
    if "res" in r:
        h = (hf + r["res"][row].astype(f32)).astype(jnp.bfloat16)
        r["h"][row] = h
        hf = h.astype(f32)
    ss = jnp.sum(hf * hf)  # float32: per thread over its vectors, then across the warpgroup
    scale = lax.rsqrt(ss / f32(d) + f32(eps))
    normed = (hf * scale).astype(jnp.bfloat16).astype(f32)
    r["y"][row] = (g * normed).astype(jnp.bfloat16)


def add_rms_norm_mgpu(x: Array, weight: Array, *, eps: float, residual: Array | None = None,
                      layer: Any = None, interpret: bool = False) -> tuple[Array, Array]:
    """(h, y) for x [M, D] bf16, weight [D] (or stacked [L, D] with `layer`, read in place),
    residual [M, D] bf16 or None (then h is x). See the module docstring for the formula."""
    m, d = x.shape
    if not supports(m, d, x.dtype):
        raise ValueError(f"add_rms_norm_mgpu: x {x.dtype}{list(x.shape)}; the kernel takes bfloat16 [M, D] with "
                         f"1 <= M <= {MAX_ROWS} and D a multiple of {THREADS * VEC}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"add_rms_norm_mgpu: residual {residual.dtype}{list(residual.shape)} must match x "
                         f"{x.dtype}{list(x.shape)}")
    if weight.shape[-1] != d or weight.ndim not in (1, 2) or (weight.ndim == 2) != (layer is not None):
        raise ValueError(f"add_rms_norm_mgpu: weight shape {weight.shape} must be [{d}], or [L, {d}] with layer=")
    inputs: dict[str, Array] = {"x": x}
    if residual is not None:
        inputs["res"] = residual
    inputs["g"] = weight.astype(jnp.bfloat16)
    if layer is not None:
        inputs["layer"] = jnp.asarray(layer, jnp.int32).reshape(1)
    outs = ("h", "y") if residual is not None else ("y",)
    kernel = functools.partial(_kernel, names=(*inputs, *outs), eps=float(eps), d=d,
                               n_layers=weight.shape[0] if layer is not None else 1)
    kw: dict[str, Any] = {"interpret": interpret_params()} if interpret else {}
    call = plgpu.kernel(kernel, out_type=tuple(jax.ShapeDtypeStruct((m, d), jnp.bfloat16) for _ in outs),
                        grid=(m,), grid_names=("row",),
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
                        kernel_name=f"add_rms_norm_d{d}{'_res' if residual is not None else ''}", **kw)
    out = call(*inputs.values())
    return (out[0], out[1]) if residual is not None else (x, out[0])
