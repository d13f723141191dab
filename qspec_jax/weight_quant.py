"""INT4 draft weights: asymmetric 4-bit codes in groups of G_w along the input dimension.

For a linear weight W [Din, Dout] and each group n of G_w consecutive input rows:

    W[n*G_w + j, o] ~= U[n, j, o] * scale[n, o] + zero[n, o],   U in 0..15

`zero` is the (possibly clipped) group minimum. The clipping search tries shrink factors of the
group's range (min, max) -> (a*min, a*max) and keeps, per group and output column, the factor
with the lowest squared error; a = 1 (plain min/max) is always a candidate, so the search is
never worse than min/max.

Packing: byte [n, j, o] holds row j of group n in its low nibble and row j + G_w/2 in its high
nibble (split halves within each group), stored as uint8 [Din/2, Dout].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qspec_jax.quant import NIBBLE_MAX

Array = jax.Array
DRAFT_SCOPES = {
    "all": ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"),
    "ffn": ("w_gate", "w_up", "w_down"),
}
CLIP_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
WEIGHT_GROUPS = (32, 64, 128)


@dataclasses.dataclass(frozen=True)
class DraftWeightsConfig:
    """How the draft's INT4 weights are made. `method` is "clip" (search) or "minmax"."""

    # g32 by measurement (docs/QUALITY.md): draft/target agreement 0.85 vs 0.77 at g64 on SmolLM2
    # real text, for 5 instead of 4.5 bits per weight.
    group_size: int = 32
    scope: str = "all"
    lm_head: bool = True
    method: str = "clip"
    scale_dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.group_size not in WEIGHT_GROUPS:
            raise ValueError(f"draft group_size={self.group_size}; expected one of {WEIGHT_GROUPS}")
        if self.scope not in DRAFT_SCOPES:
            raise ValueError(f"draft scope={self.scope!r}; expected one of {tuple(DRAFT_SCOPES)}")
        if self.method not in ("clip", "minmax"):
            raise ValueError(f"draft method={self.method!r}; expected 'clip' or 'minmax'")
        if self.scale_dtype not in ("float16", "float32"):
            raise ValueError(f"draft scale_dtype={self.scale_dtype!r}; expected 'float16' or 'float32'")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@struct.dataclass
class QuantizedWeight:
    """INT4 weight with leading dims `...` (e.g. the stacked layer axis L)."""

    packed: Array  # uint8[..., Din/2, Dout]
    scale: Array  # f16|f32[..., Din/G_w, Dout]
    zero: Array  # f16|f32[..., Din/G_w, Dout]

    @property
    def group_size(self) -> int:
        return 2 * self.packed.shape[-2] // self.scale.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-2], 2 * self.packed.shape[-2], self.packed.shape[-1])

    def codes(self) -> Array:
        """int32 codes [..., Din/G_w, G_w, Dout]."""
        *lead, half, dout = self.packed.shape
        n = self.scale.shape[-2]
        p = self.packed.reshape(*lead, n, half // n, dout).astype(jnp.int32)  # widen before shifting
        return jnp.concatenate([p & 0xF, p >> 4], axis=-2)

    def dequantize(self) -> Array:
        """float32 [..., Din, Dout]."""
        w = self.codes() * self.scale[..., None, :].astype(jnp.float32) + self.zero[..., None, :].astype(jnp.float32)
        return w.reshape(self.shape)

    def apply(self, x: Array, out_dtype: Any = None, impl: str = "xla", **tp: Any) -> Array:
        """x [..., Din] @ W -> [..., Dout] (one layer's weight); see `int4_matmul`."""
        return int4_matmul(x, self, impl=impl, out_dtype=out_dtype, **tp)


@struct.dataclass
class StackedLayerWeight:
    """Layer `layer` of a stacked QuantizedWeight [L, ...], left unsliced so a kernel can read
    that layer in place (a sliced operand of a custom call would be copied every step)."""

    weight: QuantizedWeight
    layer: Array  # int32[]

    def apply(self, x: Array, out_dtype: Any = None, impl: str = "xla", **tp: Any) -> Array:
        return int4_matmul(x, self.weight, self.layer, impl=impl, out_dtype=out_dtype, **tp)


def int4_matmul(x: Array, w: QuantizedWeight, layer: Array | None = None, *, impl: str = "auto",
                out_dtype: Any = None, mesh: Any = None, row_parallel: bool = False) -> Array:
    """x [..., Din] @ W with float32 accumulation; `layer` selects a layer of a stacked `w`.

    impl "pallas": the Pallas W4A16 kernel (dequantizes in registers, reads a stacked layer in
    place); "xla": dequantize-then-dot, which XLA may fuse into the dot's operand; "auto":
    Pallas on GPU, XLA elsewhere. With a tensor-parallel `mesh` the kernel runs per device
    (`row_parallel` weights all-reduce their partial products); XLA partitions its own path.
    """
    out_dtype = out_dtype or x.dtype
    want_pallas = impl == "pallas" or (impl == "auto" and jax.default_backend() == "gpu")
    tp = 1 if mesh is None else mesh.size
    local_n = w.shape[-1] if row_parallel else w.shape[-1] // tp  # the kernel sees one device's slice
    if want_pallas and _kernel_supports(int(np.prod(x.shape[:-1])), local_n, w.group_size):
        from pallas_kernels.w4a16 import w4a16_apply  # lazily: the CPU path needs no Triton

        if mesh is not None and mesh.size > 1:
            from qspec_jax.sharding import sharded_matmul

            def local(x, w, layer):
                return w4a16_apply(x, w, out_dtype, layer=layer)

            return sharded_matmul(local, mesh, x, w, layer, row_parallel)
        return w4a16_apply(x, w, out_dtype, layer=layer)
    if layer is not None:
        w = jax.tree.map(lambda a: a[layer], w)
    wd = w.dequantize().astype(x.dtype)
    return jnp.einsum("...i,io->...o", x, wd).astype(out_dtype)  # x's dtype out: see model.linear


KERNEL_MAX_M = 128  # the W4A16 kernel is for decode-sized M; larger M (prefill) uses XLA
KERNEL_N_MULTIPLE = 128


def _kernel_supports(m: int, n: int, group_size: int) -> bool:
    """Shapes the Pallas W4A16 kernel takes; others (e.g. SmolLM2's 192-wide k/v) use XLA."""
    return m <= KERNEL_MAX_M and n % KERNEL_N_MULTIPLE == 0 and group_size in WEIGHT_GROUPS


def _quantize_range(w: Array, lo: Array, hi: Array, scale_dtype: Any) -> tuple[Array, Array, Array]:
    """Codes for w [..., n, G, Dout] within [lo, hi] ([..., n, 1, Dout]); returns (U, scale, zero)."""
    zero = lo.astype(scale_dtype)
    z = zero.astype(jnp.float32)
    scale = ((hi - z) / NIBBLE_MAX).astype(scale_dtype)
    s = scale.astype(jnp.float32)
    inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
    u = jnp.clip(jnp.round((w - z) * inv), 0, NIBBLE_MAX)
    return u, scale, zero


def quantize_weight(w: Array, group_size: int, method: str = "clip", scale_dtype: Any = jnp.float16) -> QuantizedWeight:
    """Quantizes w [..., Din, Dout] (Din a multiple of group_size) to INT4."""
    *lead, din, dout = w.shape
    if din % group_size:
        raise ValueError(f"input dim {din} is not a multiple of the draft group size {group_size}")
    n = din // group_size
    wf = w.astype(jnp.float32).reshape(*lead, n, group_size, dout)
    wmin, wmax = jnp.min(wf, axis=-2, keepdims=True), jnp.max(wf, axis=-2, keepdims=True)
    factors = CLIP_FACTORS if method == "clip" else (1.0,)
    best = None
    for a in factors:
        u, scale, zero = _quantize_range(wf, a * wmin, a * wmax, scale_dtype)
        err = jnp.sum((u * scale.astype(jnp.float32) + zero.astype(jnp.float32) - wf) ** 2, axis=-2, keepdims=True)
        if best is None:
            best = (err, u, scale, zero)
        else:
            better = err < best[0]
            best = tuple(jnp.where(better, new, old) for new, old in zip((err, u, scale, zero), best))
    _, u, scale, zero = best
    half = group_size // 2
    u = u.astype(jnp.int32)
    packed = (u[..., :half, :] | (u[..., half:, :] << 4)).astype(jnp.uint8)
    return QuantizedWeight(packed=packed.reshape(*lead, din // 2, dout), scale=scale[..., 0, :], zero=zero[..., 0, :])


def make_draft_params(params: Any, cfg: DraftWeightsConfig) -> Any:
    """Draft params: the target's, with the scoped linears (and lm_head) quantized to INT4.

    The embedding and the norms are shared with the target (not copied).
    """
    one = jax.jit(functools.partial(quantize_weight, group_size=cfg.group_size, method=cfg.method,
                                    scale_dtype=jnp.dtype(cfg.scale_dtype)))
    per_layer = jax.jit(lambda w: jax.lax.map(one, w))  # one layer at a time bounds peak memory
    layers = params.layers.replace(**{name: per_layer(getattr(params.layers, name))
                                      for name in DRAFT_SCOPES[cfg.scope]})
    lm_head = params.lm_head
    if cfg.lm_head:
        lm_head = one(params.embed.T if params.lm_head is None else params.lm_head)
    return params.replace(layers=layers, lm_head=lm_head)
