"""The residual add + RMSNorm of a decode pass, dispatching by device.

    add_rms_norm(x, weight, eps=..., residual=d, backend="auto") -> (h = x + d, RMSNorm(h) g)

Backends ("auto" picks by the default device):

| backend     | what runs                                                                  |
|-------------|----------------------------------------------------------------------------|
| "mosaic"    | Hopper (sm_90): `mosaic_gpu.add_rms_norm_mgpu`, one kernel                 |
| "xla"       | `add_rms_norm_reference` under XLA (two or three kernels on a GPU)          |
| "interpret" | the Mosaic kernel in GPU interpret mode (CPU tests)                        |
| "reference" | the jnp oracle, `add_rms_norm_reference`                                   |

"auto": "mosaic" on a GPU of compute capability 9.x for shapes the kernel takes
(`mosaic_gpu.supports`: bf16, decode-sized M, D a multiple of 1024), else "xla".
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.rms_norm import mosaic_gpu as mg

Array = jax.Array
BACKENDS = ("auto", "mosaic", "xla", "interpret", "reference")


def add_rms_norm_reference(x: Array, weight: Array, *, eps: float, residual: Array | None = None,
                           layer: Any = None) -> tuple[Array, Array]:
    """The oracle, HF Llama's order of roundings: h = x + d in x's dtype, then
    y = weight * bf16(h rsqrt(mean(h^2) + eps)) with the mean in float32."""
    h = x if residual is None else x + residual
    g = weight if layer is None else weight[layer]
    hf = h.astype(jnp.float32)
    normed = hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)
    return h, g * normed.astype(h.dtype)


def pick_backend(m: int, d: int, dtype: Any) -> str:
    """The backend "auto" resolves to for [M, D] rows of `dtype` on the default device."""
    from pallas_kernels.linear import device_arch

    if device_arch() == ("gpu", 9) and mg.supports(m, d, dtype):
        return "mosaic"
    return "xla"


def add_rms_norm(x: Array, weight: Array, *, eps: float, residual: Array | None = None, layer: Any = None,
                 backend: str = "auto") -> tuple[Array, Array]:
    """(h, y) = (x + residual, RMSNorm(x + residual) weight) over the last axis of x [..., D]
    (h is x without a residual). weight [D], or stacked [L, D] read at `layer` (int or traced
    scalar; the kernel reads it in place)."""
    if backend not in BACKENDS:
        raise ValueError(f"add_rms_norm: backend={backend!r}; expected one of {BACKENDS}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual shape {residual.shape} != x shape {x.shape}")
    m, d = math.prod(x.shape[:-1]), x.shape[-1]
    if backend == "auto":
        backend = pick_backend(m, d, x.dtype)
    if backend in ("xla", "reference"):
        return add_rms_norm_reference(x, weight, eps=eps, residual=residual, layer=layer)
    flat = lambda a: None if a is None else a.reshape(m, d)  # noqa: E731
    h, y = mg.add_rms_norm_mgpu(flat(x), weight, eps=eps, residual=flat(residual), layer=layer,
                                interpret=backend == "interpret")
    return h.reshape(x.shape), y.reshape(x.shape)
