"""XLA flags qspec-jax turns on by default for GPU decoding.

Decode is a chain of GEMVs over layer weights stacked on a leading L axis. XLA's Triton GEMM
emitter fuses the per-layer slice of the stacked weight into its GEMM and then reads it at about
0.9 TB/s on an H100; with Triton GEMMs off the same dots go to cuBLAS, which reads the slice in
place at 2.1-2.7 TB/s (measured, docs/BENCHMARKS.md "Where the time goes"). The flags only take
effect if set before JAX creates its GPU backend, so `qspec_jax` applies them on import; set
QSPEC_XLA_FLAGS=0 to leave XLA_FLAGS untouched.
"""

from __future__ import annotations

import os
from typing import MutableMapping

RECOMMENDED_GPU_FLAGS: tuple[str, ...] = ("--xla_gpu_enable_triton_gemm=false",)


def apply_recommended_xla_flags(environ: MutableMapping[str, str] = os.environ) -> str:
    """Appends each recommended flag to XLA_FLAGS unless that flag is already set there.

    Returns the resulting XLA_FLAGS. A flag the user set (to any value) is never overridden.
    """
    if environ.get("QSPEC_XLA_FLAGS", "1") == "0":
        return environ.get("XLA_FLAGS", "")
    current = environ.get("XLA_FLAGS", "")
    names = {f.split("=")[0] for f in current.split()}
    extra = [f for f in RECOMMENDED_GPU_FLAGS if f.split("=")[0] not in names]
    if extra:
        environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()
    return environ.get("XLA_FLAGS", "")
