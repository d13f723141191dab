"""Which implementation runs a decode layer's residual add + RMSNorm, where no INT4 kernel takes it.

The formula is `model.rms_norm`'s (HF Llama's order of roundings). On Hopper the target's layers
(AR and verify passes; the draft's too where its INT4 kernels do not fuse the norm) run
`pallas_kernels.rms_norm`: h = x + d and RMSNorm(h) g in one kernel, where XLA makes two of every
norm (docs/kernel_notes.md, "The target's norm in one kernel"). `model.decode` then leaves each
layer's last residual add to the next layer's first norm, so a layer's glue around its two norms is
two kernels. This module owns the choice; `pallas_kernels.rms_norm` owns the kernel.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

from qspec_jax.linear import StackedLayer

Array = jax.Array
ADD_NORM_ENV = "QSPEC_ADD_NORM"  # "0": the XLA norms again (A/B on the GPU); "1" (default): `norm_impl` decides


def add_norm_backend(impl: str, rows: int, dim: int, dtype: Any, mesh: Any = None) -> str:
    """The `pallas_kernels.rms_norm` backend for a decode pass of `rows` rows of width `dim`, or ""
    for the XLA norms (`model.rms_norm`): "auto" the Mosaic kernel on Hopper where it takes the
    shape (bf16, decode-sized rows, dim a multiple of 1024); "mosaic" / "interpret" the kernel (on
    the GPU / interpreted on a CPU) where it takes the shape; "xla" never. Tensor-parallel meshes
    keep the XLA norms. Read at trace time; `impl` is a ModelConfig's, which checked it."""
    flag = os.environ.get(ADD_NORM_ENV, "1")
    if flag not in ("0", "1"):
        raise ValueError(f"{ADD_NORM_ENV}={flag!r}: expected 0 or 1")
    from pallas_kernels.rms_norm import mosaic_gpu, pick_backend

    if flag == "0" or impl == "xla" or (mesh is not None and mesh.size > 1):
        return ""
    if impl == "auto":  # pick_backend checks the shape too
        return "mosaic" if pick_backend(rows, dim, jnp.dtype(dtype)) == "mosaic" else ""
    return impl if mosaic_gpu.supports(rows, dim, jnp.dtype(dtype)) else ""


def add_rms_norm(x: Array, weight: Any, *, eps: float, backend: str,
                 residual: Array | None = None) -> tuple[Array, Array]:
    """(h, y) = (x + residual, RMSNorm(h) weight) [B, T, D] through `backend`; weight [D] or a
    StackedLayer of the stacked [L, D] norms (read in place). h is x without a residual."""
    from pallas_kernels.rms_norm import add_rms_norm as kernel

    w, layer = (weight.weight, weight.layer) if isinstance(weight, StackedLayer) else (weight, None)
    return kernel(x, w, eps=eps, residual=residual, layer=layer, backend=backend)
