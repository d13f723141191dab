"""Llama/Mistral decoder as pure functions over a parameter pytree and a KV-cache pytree.

Layers are stacked on a leading L axis and run with `lax.scan`, so compile time does not grow
with depth. The cache rides in the scan carry: each layer writes its new K/V in place and reads
its own slice.

Shapes: B batch, T new tokens, D hidden, Hq/Hkv query/KV heads, Dh head dim, F MLP width,
V vocabulary, L layers. Activations and parameters are in `config.dtype` (bfloat16 or float32);
norms, RoPE angles, softmax and matmul accumulation are float32.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qspec_jax.attention import cache_attention, prefill_attention
from qspec_jax.cache import DenseKVCache, QuantSpecCache
from qspec_jax.config import ModelConfig
from qspec_jax.weight_quant import QuantizedWeight, StackedLayerWeight

Array = jax.Array
Cache = DenseKVCache | QuantSpecCache
# A linear weight is a dense [Din, Dout] array, a QuantizedWeight, or (inside the layer scan) a
# StackedLayerWeight; the last two have `.apply(x, out_dtype, impl)`.
Weight = Any


@struct.dataclass
class LayerParams:
    """Weights of all layers, stacked on a leading L axis. Linear weights are [L, Din, Dout]."""

    attn_norm: Array  # [L, D]
    wq: Weight  # [L, D, Hq*Dh]
    wk: Weight  # [L, D, Hkv*Dh]
    wv: Weight  # [L, D, Hkv*Dh]
    wo: Weight  # [L, Hq*Dh, D]
    mlp_norm: Array  # [L, D]
    w_gate: Weight  # [L, D, F]
    w_up: Weight  # [L, D, F]
    w_down: Weight  # [L, F, D]


@struct.dataclass
class Params:
    """All weights of a model plus its (static) config."""

    embed: Array  # [V, D]; never quantized
    layers: LayerParams
    final_norm: Array  # [D]
    lm_head: Weight | None  # [D, V]; None when tied to `embed`
    config: ModelConfig = struct.field(pytree_node=False)
    mesh: Any = struct.field(pytree_node=False, default=None)  # tensor-parallel mesh (qspec_jax.sharding)


LINEAR_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every tensor, keyed by its path in the params pytree ("layers/wq")."""
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "embed": (V, D),
        "final_norm": (D,),
        "layers/attn_norm": (L, D),
        "layers/wq": (L, D, q),
        "layers/wk": (L, D, kv),
        "layers/wv": (L, D, kv),
        "layers/wo": (L, q, D),
        "layers/mlp_norm": (L, D),
        "layers/w_gate": (L, D, F),
        "layers/w_up": (L, D, F),
        "layers/w_down": (L, F, D),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def params_from_flat(cfg: ModelConfig, flat: dict[str, Any]) -> Params:
    """Builds `Params` from {"layers/wq": array, ...} (the checkpoint's flat layout)."""
    layers = LayerParams(**{k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith("layers/")})
    return Params(embed=flat["embed"], layers=layers, final_norm=flat["final_norm"],
                  lm_head=flat.get("lm_head"), config=cfg)


def params_to_flat(params: Params) -> dict[str, Any]:
    flat = {"embed": params.embed, "final_norm": params.final_norm}
    flat.update({f"layers/{k}": v for k, v in vars(params.layers).items()})
    if params.lm_head is not None:
        flat["lm_head"] = params.lm_head
    return flat


def init_random_params(cfg: ModelConfig, key: Array, scale: float = 0.02) -> Params:
    """Random weights with the model's shapes (tests and benchmarks); norms are 1."""
    dtype = jnp.dtype(cfg.dtype)
    shapes = param_shapes(cfg)
    keys = jax.random.split(key, len(shapes))
    flat = {}
    for k, (name, shape) in zip(keys, sorted(shapes.items())):
        if name.endswith("norm"):
            flat[name] = jnp.ones(shape, dtype)
        else:
            flat[name] = (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
    return params_from_flat(cfg, flat)


# ------------------------------------------------------------------------------------ blocks
def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def linear(x: Array, w: Weight, int4_impl: str = "auto", out_dtype: Any = None, *, mesh: Any = None,
           row_parallel: bool = False) -> Array:
    """x [..., Din] @ w [Din, Dout]; output in `out_dtype` (x's by default).

    Dense dots produce x's dtype and are cast afterwards: the GEMM accumulates in float32
    internally (cuBLAS, XLA CPU) either way, but asking XLA for a float32 result of a bf16 dot
    at M = 1 moves it off cuBLAS onto a GEMV 3.7x slower on an H100 (docs/BENCHMARKS.md). Logits
    are therefore rounded to the model dtype before the float32 cast, as in HF transformers.
    With a tensor-parallel `mesh` every matmul runs per device on its local weight slice
    (`row_parallel` ones all-reduce their partial products): see `sharding.sharded_matmul`.
    """
    if isinstance(w, (QuantizedWeight, StackedLayerWeight)):
        return w.apply(x, out_dtype, int4_impl, mesh=mesh, row_parallel=row_parallel)
    if mesh is not None and mesh.size > 1:
        from qspec_jax.sharding import sharded_matmul  # lazily: sharding imports this module

        return sharded_matmul(lambda x, w, _: _dense_matmul(x, w, pad_single_row=True), mesh, x, w, None,
                              row_parallel).astype(out_dtype or x.dtype)
    return _dense_matmul(x, w, pad_single_row=False).astype(out_dtype or x.dtype)


def _dense_matmul(x: Array, w: Array, *, pad_single_row: bool) -> Array:
    """x [..., Din] @ w [Din, Dout] in x's dtype.

    `pad_single_row` (used per device under tensor parallelism): a single row (decode at batch 1)
    is padded to two. On the halved per-device shapes XLA's GPU compiler rewrites most
    vector-matrix dots as a broadcast-multiply written to memory plus a reduction; a two-row
    product stays a cuBLAS GEMM (2 H200s: +10% tokens/s at 128k). On one device the pad measured
    4-6% slower on an H100, so it is not used there.
    """
    lead = x.shape[:-1]
    if not pad_single_row or int(np.prod(lead)) != 1:
        return jnp.einsum("...i,io->...o", x, w)
    x2 = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
    return (x2 @ w)[:1].reshape(*lead, w.shape[-1])


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """float32[Dh/2] inverse frequencies, with `linear` or `llama3` scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    if rs.rope_type == "linear":
        return (inv / rs.factor).astype(np.float32)
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    old = rs.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rs.low_freq_factor, old / rs.high_freq_factor
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x: Array, positions: Array, inv_freq: np.ndarray) -> Array:
    """Rotates x [B, T, H, Dh] by positions int32[B, T] (rotate-half convention, as HF Llama)."""
    ang = positions.astype(jnp.float32)[:, :, None, None] * jnp.asarray(inv_freq)  # [B, T, 1, Dh/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _qkv(cfg: ModelConfig, lp: LayerParams, x: Array, positions: Array, mesh: Any) -> tuple[Array, Array, Array]:
    """x [B, T, D] -> q [B, T, Hq, Dh], k/v [B, Hkv, T, Dh], with RoPE applied to q and k."""
    b, t, _ = x.shape
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    inv_freq = rope_inv_freq(cfg)
    mm = lambda w: linear(h, w, cfg.int4_matmul_impl, mesh=mesh)  # noqa: E731
    q = apply_rope(mm(lp.wq).reshape(b, t, cfg.num_heads, cfg.head_dim), positions, inv_freq)
    k = apply_rope(mm(lp.wk).reshape(b, t, cfg.num_kv_heads, cfg.head_dim), positions, inv_freq)
    v = mm(lp.wv).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    return q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)


def _attn_out_and_mlp(cfg: ModelConfig, lp: LayerParams, x: Array, attn: Array, mesh: Any) -> Array:
    """Residual adds of the attention output projection and the SwiGLU MLP."""
    b, t = x.shape[:2]
    col = functools.partial(linear, int4_impl=cfg.int4_matmul_impl, mesh=mesh)
    row = functools.partial(col, row_parallel=True)
    x = x + row(attn.reshape(b, t, -1), lp.wo)
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    return x + row(jax.nn.silu(col(h, lp.w_gate)) * col(h, lp.w_up), lp.w_down)


def _scan_layers(params: Params, x: Array, cache: Cache,
                 layer_fn: Callable[[LayerParams, Array, Cache, Array], tuple[Array, Cache]]) -> tuple[Array, Cache]:
    """Runs `layer_fn(layer_params, x, cache, layer_index)` over the stacked layers.

    INT4 weights stay stacked (outside the scan's slicing) and reach the matmul as
    StackedLayerWeight, so a kernel reads its layer in place instead of a per-step copy.
    """
    stacked = {n: w for n, w in vars(params.layers).items() if isinstance(w, QuantizedWeight)}
    scanned = params.layers.replace(**{n: None for n in stacked})

    def body(carry, xs):
        x, cache = carry
        lp, i = xs
        lp = lp.replace(**{n: StackedLayerWeight(w, i) for n, w in stacked.items()})
        return layer_fn(lp, x, cache, i), None

    idx = jnp.arange(params.config.num_layers, dtype=jnp.int32)
    (x, cache), _ = jax.lax.scan(body, (x, cache), (scanned, idx))
    return x, cache


def _logits(params: Params, x: Array) -> Array:
    """x [..., D] -> float32 logits [..., V]."""
    cfg = params.config
    h = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:
        return jnp.einsum("...d,vd->...v", h, params.embed).astype(jnp.float32)  # see `linear`
    return linear(h, params.lm_head, cfg.int4_matmul_impl, out_dtype=jnp.float32, mesh=params.mesh)


# ------------------------------------------------------------------------------ entry points
def prefill(params: Params, tokens: Array, lengths: Array, cache: Cache, *,
            all_logits: bool = False) -> tuple[Array, Cache]:
    """Runs right-padded prompts through the model and places their K/V in an empty cache.

    tokens: int32[B, T] (row b valid up to lengths[b]); lengths: int32[B], each >= 1.
    Returns (logits, cache): float32 logits [B, V] at each row's last prompt token, or
    [B, T, V] for every position when `all_logits`; the cache holds `lengths` tokens per row.
    """
    cfg = params.config
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = params.embed[tokens]

    def layer(lp, x, cache, i):
        q, k, v = _qkv(cfg, lp, x, positions, params.mesh)
        attn = prefill_attention(q, k, v, positions, cfg.sliding_window)
        cache = cache.prefill_layer(i, k, v, lengths)
        return _attn_out_and_mlp(cfg, lp, x, attn, params.mesh), cache

    x, cache = _scan_layers(params, x, cache, layer)
    cache = cache.finish_prefill(lengths)
    if not all_logits:
        x = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return _logits(params, x), cache


def decode(params: Params, tokens: Array, cache: Cache, *, view: str = "target") -> tuple[Array, Cache]:
    """Appends T tokens per row after each row's committed tokens and returns their logits.

    tokens: int32[B, T]. `view` selects what a QuantSpecCache's quantized region looks like:
    "target" (both nibbles) or "draft" (upper nibble only). Returns float32 logits [B, T, V]
    and the cache with the T tokens committed (`cache.rollback` un-commits).
    """
    cfg = params.config
    t = tokens.shape[1]
    positions = cache.next_positions(t)
    x = params.embed[tokens]

    def layer(lp, x, cache, i):
        q, k, v = _qkv(cfg, lp, x, positions, params.mesh)
        cache = cache.append_layer(i, k, v)
        attn = cache_attention(q, positions, cache, i, view, cfg.attention_impl, cfg.sliding_window,
                               mesh=params.mesh)
        return _attn_out_and_mlp(cfg, lp, x, attn, params.mesh), cache

    x, cache = _scan_layers(params, x, cache, layer)
    return _logits(params, x), cache.advance(t)
