"""Small helpers shared by the Pallas kernels."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax


def interpret_default(interpret: bool | None) -> bool:
    """None means: interpret mode (CPU) unless the default backend is a GPU."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


def interpret_params() -> Any:
    """Mosaic GPU interpret-mode parameters (CPU): out-of-bounds TMA reads give NaN instead of the
    hardware's zeros, so padding rows that leaked into a stored row would show."""
    try:
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams  # jax >= 0.11
    except ImportError:  # jax 0.10
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(out_of_bounds_reads="uninitialized")


def num_sms() -> int:
    """Streaming multiprocessors of the first GPU (132 on an H100 SXM when unknown)."""
    try:
        dev = jax.devices()[0]
        n = getattr(dev, "core_count", None)
        if dev.platform == "gpu" and n:
            return int(n)
    except Exception:  # pragma: no cover - no devices
        pass
    return 132


def device_kind() -> str:
    """The first device's kind ("NVIDIA H100 80GB HBM3", ...); "" off the GPU."""
    try:
        dev = jax.devices()[0]
        return str(dev.device_kind) if dev.platform == "gpu" else ""
    except Exception:  # pragma: no cover - no devices
        return ""


@functools.cache
def _load_idx_optional() -> bool:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return inspect.signature(plgpu.load).parameters["idx"].default is not inspect.Parameter.empty


def load_with_layout(ref, layout, optimized: bool = True):
    """Mosaic GPU: a whole ref loaded in `layout` (plgpu.load's index became optional in jax 0.11);
    optimized=False for global memory, which has no optimized transfer into a WGMMA layout."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if _load_idx_optional():
        return plgpu.load(ref, layout=layout, optimized=optimized)
    return plgpu.load(ref, (), layout=layout, optimized=optimized)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
