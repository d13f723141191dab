"""Llama/Mistral decoder as pure functions over a parameter pytree and a KV-cache pytree.

Layers are stacked on a leading L axis and run in one loop over the layer index (a
`lax.while_loop` of known trip count, `_scan_layers`), so compile time does not grow with depth.
The cache rides in the loop carry: each layer writes its new K/V in place and reads its own slice.

Shapes: B batch, T new tokens, D hidden, Hq/Hkv query/KV heads, Dh head dim, F MLP width,
V vocabulary, L layers. Activations and parameters are in `config.dtype` (bfloat16 or float32);
norms, RoPE angles, softmax and matmul accumulation are float32.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qspec_jax.attention import (
    attention_inputs,
    cache_attention,
    chunk_attention,
    prefill_attention,
    prefill_impl,
    query_operand_shape,
)
from qspec_jax.cache import DenseKVCache, QuantSpecCache, prefill_quantized_len
from qspec_jax.config import ModelConfig
from qspec_jax.linear import (
    StackedLayer,
    dense_swiglu_fusable,
    fusable,
    keep_stacked,
    kernel_layout_wanted,
    layer_tail,
    layer_tail_sync,
    linear,
    norm_sums_fusable,
    norm_sums_of,
    qkv_cache_fusable,
    qkv_into_cache,
    qkv_pass_inputs,
    tail_fusable,
    target_qkv_cache_backend,
    to_kernel_layout,
)
from qspec_jax.norm import add_norm_backend, add_rms_norm
from qspec_jax.weight_quant import QuantizedWeight

Array = jax.Array
Cache = DenseKVCache | QuantSpecCache
# A linear weight (qspec_jax.linear): a dense [Din, Dout] array or an INT4 weight (QuantizedWeight,
# or the Hopper kernel's W4A16Packed); inside the layer scan, a StackedLayer.
Weight = Any


@struct.dataclass
class LayerParams:
    """Weights of all layers, stacked on a leading L axis. Linear weights are [L, Din, Dout].

    The checkpoint layout has separate projections. `fuse_projections` (used by
    `linear.for_device` on a single GPU) concatenates q|k|v into `wqkv` and gate|up into
    `w_gate_up`, leaving the separate fields None: one launch per group instead of three / two,
    and wider outputs for the skinny GEMMs.
    """

    attn_norm: Array  # [L, D]
    wq: Weight  # [L, D, Hq*Dh]; None when fused
    wk: Weight  # [L, D, Hkv*Dh]; None when fused
    wv: Weight  # [L, D, Hkv*Dh]; None when fused
    wo: Weight  # [L, Hq*Dh, D]
    mlp_norm: Array  # [L, D]
    w_gate: Weight  # [L, D, F]; None when fused
    w_up: Weight  # [L, D, F]; None when fused
    w_down: Weight  # [L, F, D]
    wqkv: Weight = None  # [L, D, (Hq + 2 Hkv)*Dh]: columns q, then k, then v
    w_gate_up: Weight = None  # [L, D, 2F]: columns gate, then up


@struct.dataclass
class Params:
    """All weights of a model plus its (static) config."""

    embed: Array  # [V, D]; never quantized
    layers: LayerParams
    final_norm: Array  # [D]
    lm_head: Weight | None  # [D, V]; None when tied to `embed`
    config: ModelConfig = struct.field(pytree_node=False)
    mesh: Any = struct.field(pytree_node=False, default=None)  # tensor-parallel mesh (qspec_jax.sharding)
    # Norm weights ("attn_norm", "mlp_norm", "final_norm") that are all ones because a draft folded them into the
    # INT4 linears that read them (`weight_quant.folded_norms`); the fused kernels then neither load nor multiply
    # them (the same bits as multiplying by ones).
    unit_norms: tuple[str, ...] = struct.field(pytree_node=False, default=())


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


FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def fuse_projections(params: Params) -> Params:
    """Params with q|k|v and gate|up concatenated along the output dim (dense arrays or INT4
    QuantizedWeight, whose packed/scale/zero are per output column, so concatenation is exact).
    Idempotent. Not for tensor-parallel layouts (a column split would mix q, k and v)."""
    layers = params.layers
    if layers.wqkv is not None:
        return params

    def cat(ws: list[Any]) -> Any:
        if all(isinstance(w, QuantizedWeight) for w in ws):
            return jax.tree.map(lambda *a: jnp.concatenate(a, axis=-1), *ws)
        if all(isinstance(w, jax.Array) for w in ws):
            return jnp.concatenate(ws, axis=-1)
        raise TypeError(f"cannot fuse weights of types {[type(w).__name__ for w in ws]}")

    fused = {name: cat([getattr(layers, p) for p in parts]) for name, parts in FUSED.items()}
    cleared = {p: None for parts in FUSED.values() for p in parts}
    return params.replace(layers=layers.replace(**fused, **cleared))


def unfuse_projections(params: Params) -> Params:
    """The inverse of `fuse_projections` (the checkpoint's layout: what `make_draft_params` and
    the sharding layout take); params already separate come back unchanged."""
    layers, cfg = params.layers, params.config
    if layers.wqkv is None:
        return params
    if not isinstance(layers.wqkv, (jax.Array, QuantizedWeight)):
        raise TypeError(f"cannot unfuse a {type(layers.wqkv).__name__} (a kernel layout): unfuse before packing")
    nq, nkv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size

    def cols(w: Any, lo: int, hi: int) -> Any:
        return jax.tree.map(lambda a: a[..., lo:hi], w)

    return params.replace(layers=layers.replace(
        wq=cols(layers.wqkv, 0, nq), wk=cols(layers.wqkv, nq, nq + nkv), wv=cols(layers.wqkv, nq + nkv, nq + 2 * nkv),
        w_gate=cols(layers.w_gate_up, 0, f), w_up=cols(layers.w_gate_up, f, 2 * f), wqkv=None, w_gate_up=None))


def for_device(params: Params) -> Params:
    """`params` laid out for this device, exactly (same products): on a single GPU, or wherever
    the INT4 kernels are requested, q|k|v and gate|up are fused (`fuse_projections`: 4 linears
    per layer instead of 7), and INT4 weights go into the Hopper layout (`W4A16Packed`) where
    the Mosaic kernel runs (`linear.kernel_layout_wanted`). Elsewhere (the CPU with "auto",
    tensor-parallel meshes) `params` come back unchanged. The conversion reads the weights once:
    call it when params are loaded or made, not per step; it is idempotent."""
    if params.mesh is not None and params.mesh.size > 1:
        return params
    pack = kernel_layout_wanted(params.config)
    if not (pack or jax.default_backend() == "gpu"):
        return params
    params = fuse_projections(params)
    if not pack:
        return params
    layers = params.layers.replace(**{n: to_kernel_layout(w) for n, w in vars(params.layers).items()})
    return params.replace(layers=layers, lm_head=to_kernel_layout(params.lm_head))


def params_from_flat(cfg: ModelConfig, flat: dict[str, Any]) -> Params:
    """Builds `Params` from {"layers/wq": array, ...} (the checkpoint's flat layout)."""
    layers = LayerParams(**{k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith("layers/")})
    return Params(embed=flat["embed"], layers=layers, final_norm=flat["final_norm"],
                  lm_head=flat.get("lm_head"), config=cfg)


def params_to_flat(params: Params) -> dict[str, Any]:
    flat = {"embed": params.embed, "final_norm": params.final_norm}
    flat.update({f"layers/{k}": v for k, v in vars(params.layers).items() if v is not None})
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
    """RMSNorm(x) = weight * bf16(x r), r = rsqrt(mean(x^2) + eps): HF Llama's order of roundings.

    Kept in this order on purpose: folding r behind the product (r ((x g) W), the fused INT4
    kernel's form) lets XLA compute the norm in one kernel instead of two (AR step 15.3 -> 13.3
    launches per layer, H100), but moves the bf16 roundings away from HF's, and SmolLM2 in
    bfloat16 then answered "L'Étoile" where it answered "Paris" (docs/kernel_notes.md, "Measured,
    then reverted: RMSNorm(x) W computed as r ((x g) W)"). Under XLA's default excess precision an
    x formed in the same program (the residual add x + d) can reach this function unrounded, in
    float32; the Hopper decode path (`norm.add_rms_norm`) rounds it to bf16 first, as HF does."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def _matmul(cfg: ModelConfig, mesh: Any, **kw: Any) -> Callable[[Array, Weight], Array]:
    """`linear` with the config's implementation choices bound."""
    return functools.partial(linear, dense_impl=cfg.dense_matmul_impl, int4_impl=cfg.int4_matmul_impl,
                             mesh=mesh, **kw)


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


def _qkv(cfg: ModelConfig, lp: LayerParams, h: Array, positions: Array, mesh: Any,
         norm: Any = None, unit_norm: bool = False, norm_sums: Array | None = None) -> tuple[Array, Array, Array]:
    """Normed x [B, T, D] -> q [B, T, Hq, Dh], k/v [B, Hkv, T, Dh], with RoPE applied to q and k.
    With `norm` (the fused draft layer, `_draft_fusion`), h is the layer input x and the attention
    norm with that weight runs inside the qkv kernel (`unit_norm`: a weight of ones, not read;
    `norm_sums`: x's rows' sums of squares, given: `LayerFusion.sums`)."""
    b, t, _ = h.shape
    inv_freq = rope_inv_freq(cfg)
    mm = _matmul(cfg, mesh)
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if norm is not None:
        q, k, v = jnp.split(mm(h, lp.wqkv, norm=norm, norm_unit=unit_norm, norm_eps=cfg.rms_norm_eps,
                               norm_sums=norm_sums), [nq, nq + nkv], axis=-1)
    elif lp.wqkv is not None:
        q, k, v = jnp.split(mm(h, lp.wqkv), [nq, nq + nkv], axis=-1)
    else:
        q, k, v = mm(h, lp.wq), mm(h, lp.wk), mm(h, lp.wv)
    q = apply_rope(q.reshape(b, t, cfg.num_heads, cfg.head_dim), positions, inv_freq)
    k = apply_rope(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), positions, inv_freq)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    return q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)


@struct.dataclass
class LayerFusion:
    """Which glue a decode layer runs inside kernels of ours (`_layer_fusion`); the default, none."""
    norm: bool = struct.field(pytree_node=False, default=False)  # attention norm in qkv, MLP norm + SiLU·up in gate_up
    residual: bool = struct.field(pytree_node=False, default=False)  # the residual adds in o and down
    # Where the INT4 kernels do not take the norms (the target's layers): the `pallas_kernels.rms_norm` backend
    # that runs each residual add + RMSNorm as one kernel ("" : `rms_norm` under XLA).
    add_norm: str = struct.field(pytree_node=False, default="")
    # With `norm`: the norm weights that are ones (`Params.unit_norms`), which the kernels then do not read.
    unit_norms: tuple[str, ...] = struct.field(pytree_node=False, default=())
    # With `norm` and `residual`: the norm kernels take the rows' sums of x^2 from the kernel that formed x (the o
    # and down kernels' `row_sums`; the first layer's from XLA on the embedding), so the layer loop carries the pair
    # (x [B, T, D], its sums float32 [D / 64, M_pad]) instead of x.
    sums: bool = struct.field(pytree_node=False, default=False)
    # Without `norm` (the target's bf16 layers): SiLU(gate)·up inside the gate_up kernel (`linear.dense_swiglu_fusable`).
    swiglu: bool = struct.field(pytree_node=False, default=False)
    # With `norm` and `residual`: o, the MLP norm, gate_up, SiLU·up and down in one persistent kernel
    # (`linear.tail_fusable`, QSPEC_W4A16_TAIL=1), its flags on one ref per pass (`linear.layer_tail_sync`).
    tail: bool = struct.field(pytree_node=False, default=False)

    @property
    def defers_residual(self) -> bool:
        """Whether a layer leaves its last residual add (x + down) to the next layer's first norm
        kernel: the layer loop then carries (x, down) instead of their sum."""
        return bool(self.add_norm) and not self.residual


def _input_norm(cfg: ModelConfig, fusion: LayerFusion, x: Any, weight: Any) -> tuple[Any, Array]:
    """A decode layer's attention norm: (the layer input x [B, T, D], RMSNorm(x) weight). With
    `fusion.defers_residual`, x arrives as the pair (x, down) of the previous layer and the sum
    is formed here, in the norm's kernel."""
    if not fusion.add_norm:
        return x, rms_norm(x, weight, cfg.rms_norm_eps)
    x, d = x if fusion.defers_residual else (x, None)
    return add_rms_norm(x, weight, eps=cfg.rms_norm_eps, backend=fusion.add_norm, residual=d)


def _attn_out_and_mlp(cfg: ModelConfig, lp: LayerParams, x: Array, attn: Array, mesh: Any,
                      fusion: LayerFusion = LayerFusion(), tail_sync: Any = None) -> tuple[Array, Array | None, Any]:
    """Residual adds of the attention output projection and the SwiGLU MLP.

    attn: [B, T, Hq*Dh]. Returns (x [B, T, D], the MLP's normed input [B, T, D], its down
    projection's input [B, T, F]); the last two are what calibration measures. `fusion` (the
    draft layer, `_draft_fusion`): `residual`, the residual adds run inside the o and down
    kernels; `norm`, the MLP norm and SiLU(gate)·up inside the gate_up kernel, and the normed
    input is not formed (None); `add_norm`, the residual add and the MLP norm in one kernel, and
    with `defers_residual` the first return value is the pair (x, down) whose sum the next
    layer's attention norm forms; `sums`, the o and down kernels also return their outputs' rows'
    sums of squares, which the MLP norm takes, and the first return value is the pair (x, sums);
    `tail`, all of it in one kernel (`linear.layer_tail`, the pass's `tail_sync` ref with the layer
    index as its ordinal), and neither the normed input nor the down input is formed (None, None).
    """
    if fusion.tail:
        out = layer_tail(attn, x, lp.wo, lp.mlp_norm, lp.w_gate_up, lp.w_down, int4_impl=cfg.int4_matmul_impl,
                         norm_eps=cfg.rms_norm_eps, row_sums=fusion.sums, sync=tail_sync, ordinal=lp.wo.layer)
        return out, None, None
    col = _matmul(cfg, mesh)
    row = _matmul(cfg, mesh, row_parallel=True)
    sums = None
    if fusion.sums:  # o's output with its rows' sums of squares, the MLP norm's input
        x, sums = row(attn, lp.wo, residual=x, row_sums=True)
    elif fusion.residual:
        x = row(attn, lp.wo, residual=x)
    elif not fusion.add_norm:
        x = x + row(attn, lp.wo)
    if fusion.norm:
        h, act = None, col(x, lp.w_gate_up, norm=lp.mlp_norm, norm_unit="mlp_norm" in fusion.unit_norms,
                           norm_eps=cfg.rms_norm_eps, norm_sums=sums, swiglu=True)
    else:
        if fusion.add_norm:
            x, h = add_rms_norm(x, lp.mlp_norm, eps=cfg.rms_norm_eps, backend=fusion.add_norm,
                                residual=None if fusion.residual else row(attn, lp.wo))
        else:
            h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
        if fusion.swiglu:
            act = col(h, lp.w_gate_up, swiglu=True)
        else:
            if lp.w_gate_up is not None:
                gate, up = jnp.split(col(h, lp.w_gate_up), 2, axis=-1)
            else:
                gate, up = col(h, lp.w_gate), col(h, lp.w_up)
            act = jax.nn.silu(gate) * up
    if fusion.residual:  # with `fusion.sums` the pair (out, its rows' sums of squares)
        out = row(act, lp.w_down, residual=x, row_sums=fusion.sums)
    elif fusion.defers_residual:
        out = (x, row(act, lp.w_down))
    else:
        out = x + row(act, lp.w_down)
    return out, h, act


def layer_forward(cfg: ModelConfig, lp: LayerParams, x: Array, positions: Array, *, mesh: Any = None,
                  attend: Callable[[Array, Array, Array], Array] | None = None,
                  ) -> tuple[Array, tuple[Array, Array], dict[str, Array]]:
    """One decoder layer over x [B, T, D]: the prefill's math. Returns (output [B, T, D], (k, v)
    [B, Hkv, T, Dh] for the cache, the inputs of the four linear groups: {"attn_in", "attn_out",
    "mlp_in", "mlp_out"}).

    `attend(q, k, v)` -> [B, T, Hq, Dh] is the attention (q roped [B, T, Hq, Dh], k/v the layer's
    own [B, Hkv, T, Dh]); None: causal attention among the T tokens (`prefill_attention` through
    the config's `prefill_attention_impl`). A chunked prefill passes attention over the cache too."""
    b, t, _ = x.shape
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    q, k, v = _qkv(cfg, lp, h, positions, mesh)
    if attend is None:
        impl = prefill_impl(cfg.prefill_attention_impl, cfg.head_dim, q.dtype, cfg.sliding_window, mesh=mesh)
        attn = prefill_attention(q, k, v, positions, cfg.sliding_window, impl)
    else:
        attn = attend(q, k, v)
    attn = attn.reshape(b, t, -1)
    out, h2, act = _attn_out_and_mlp(cfg, lp, x, attn, mesh)
    return out, (k, v), {"attn_in": h, "attn_out": attn, "mlp_in": h2, "mlp_out": act}


NORM_SELECT_ENV = "QSPEC_NORM_SELECT"  # how the layer loop takes a layer's RMSNorm weights (`_layer_norm_row`)
NORM_SELECT_MODES = ("slice", "onehot")


def _norm_select() -> str:
    """QSPEC_NORM_SELECT: "onehot" (the default) or "slice" (`_layer_norm_row`). Read at trace time."""
    mode = os.environ.get(NORM_SELECT_ENV, "onehot")
    if mode not in NORM_SELECT_MODES:
        raise ValueError(f"{NORM_SELECT_ENV}={mode!r}: expected one of {', '.join(NORM_SELECT_MODES)}")
    return mode


def _layer_norm_row(w: Array, i: Array) -> Array:
    """Row i of the stacked RMSNorm weights w [L, D] as a one-hot contraction instead of a dynamic
    slice: the same values (one product w[i] x 1, the others x 0, for finite weights; a -0.0 comes
    back +0.0). On a GPU, XLA (jax 0.11) turns the per-layer slice of a norm it runs itself
    (SmolLM2's 576-wide norms, which our norm kernel does not take) into an asynchronous copy on a
    second stream; the contraction fuses into the norm's own fusion instead (kernel_notes,
    "Fifty-fourth session" and "Fifty-fifth session"). The default: with it the target's q|k|v
    kernel at SmolLM2's head dim pays in the AR loop, where with the sliced rows it left the loop
    idle (H100, `linear.TARGET_QKV_CACHE_AUTO_ROWS`); QSPEC_NORM_SELECT=slice takes the rows by
    dynamic slice."""
    sel = (jnp.arange(w.shape[0]) == i).astype(w.dtype)
    return jnp.einsum("l,ld->d", sel, w)


def _scan_layers(params: Params, x: Array, cache: Any,
                 layer_fn: Callable[[LayerParams, Array, Any, Array], tuple[Array, Any]],
                 stack_norms: bool = False, stack: tuple[str, ...] = ()) -> tuple[Array, Any]:
    """Runs `layer_fn(layer_params, x, cache, layer_index)` over the stacked layers; `cache` is
    whatever the layers thread through the loop's carry (the cache, or a tuple holding it).

    Weights a kernel reads (INT4 ones, dense ones where `linear.keep_stacked` sends them to the
    Mosaic kernel at this pass's rows) stay stacked outside the loop's slicing and reach `linear`
    as StackedLayer, so the kernel reads its layer in place instead of a per-step copy.

    A `while_loop` over the layer index (XLA sees a known trip count, as for a scan) rather than a
    scan over `arange(L)`: the kernels then take the loop's own induction variable as their layer
    operand, where a scanned index costs a dynamic-slice kernel per layer on a GPU.
    `stack_norms`: the RMSNorm weights stay stacked too (the fused kernels read them in place);
    `stack`: so do these weights (a kernel reads them whatever `dense_matmul_impl` says).
    The norm weights the loop slices are taken as QSPEC_NORM_SELECT says (`_layer_norm_row`).
    """
    impl = params.config.dense_matmul_impl
    rows = int(np.prod(jax.tree.leaves(x)[0].shape[:-1]))  # x [B, T, D], or a pair led by it (`_carry_in`)
    stacked = {n: w for n, w in vars(params.layers).items()
               if keep_stacked(w, impl, rows) or (stack_norms and n in ("attn_norm", "mlp_norm")) or n in stack}
    sliced = params.layers.replace(**{n: None for n in stacked})
    onehot = ([n for n in ("attn_norm", "mlp_norm") if getattr(sliced, n) is not None]
              if _norm_select() == "onehot" else [])

    def body(carry):
        i, x, cache = carry
        lp = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False),
                          sliced.replace(**{n: None for n in onehot}))
        lp = lp.replace(**{n: _layer_norm_row(getattr(sliced, n), i) for n in onehot})
        lp = lp.replace(**{n: StackedLayer(w, i) for n, w in stacked.items()})
        x, cache = layer_fn(lp, x, cache, i)
        return i + 1, x, cache

    n_layers = params.config.num_layers
    _, x, cache = jax.lax.while_loop(lambda c: c[0] < n_layers, body, (jnp.int32(0), x, cache))
    return x, cache


def _logits(params: Params, x: Array) -> Array:
    """x [..., D] -> float32 logits [..., V]."""
    cfg = params.config
    h = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:
        return jnp.einsum("...d,vd->...v", h, params.embed).astype(jnp.float32)  # see `linear`
    return _matmul(cfg, params.mesh, out_dtype=jnp.float32)(h, params.lm_head)


def _layer_fusion(params: Params, rows: int) -> LayerFusion:
    """`decode`'s glue fusion for a pass of `rows` = B x T rows: the draft's INT4 kernels'
    (`_draft_fusion`), and where they do not take the norms (the target's bf16 layers, or the
    draft above 24 rows) the residual add + RMSNorm kernel (`norm.add_norm_backend`) and, for a
    bf16 gate | up weight on the Mosaic kernel, SiLU(gate)·up in it (`linear.dense_swiglu_fusable`)."""
    fusion = _draft_fusion(params, rows)
    if fusion.norm:
        return fusion
    cfg, w = params.config, params.layers.w_gate_up
    swiglu = ((params.mesh is None or params.mesh.size == 1) and w is not None
              and dense_swiglu_fusable(w, cfg.dense_matmul_impl, rows))
    return fusion.replace(add_norm=add_norm_backend(cfg.norm_impl, rows, cfg.hidden_size, cfg.dtype, params.mesh),
                          swiglu=swiglu)


def _draft_fusion(params: Params, rows: int) -> LayerFusion:
    """The glue `decode` runs inside each layer's INT4 kernels (`linear.fusable`: the draft on
    Hopper; QSPEC_W4A16_FUSE=0 turns it off): the residual adds in the o and down kernels, and
    the attention norm in the qkv kernel, the MLP norm and SiLU(gate)·up in the gate_up kernel,
    each where its kernels fuse `rows` = B x T rows (the norm up to 24, or up to 32 where the q|k|v
    into the cache kernel runs there: `linear.fused_norm_rows`; the residual up to 64); with both,
    the norms' x^2 sums from the o and down kernels where the norm kernels take them
    (`linear.norm_sums_fusable`: `LayerFusion.sums`)."""
    lp, cfg = params.layers, params.config
    ws = (lp.wqkv, lp.wo, lp.w_gate_up, lp.w_down)
    if (params.mesh is not None and params.mesh.size > 1) or any(w is None for w in ws):
        return LayerFusion()
    ok = functools.partial(fusable, int4_impl=cfg.int4_matmul_impl, rows=rows)
    norm = (ok(lp.wqkv, norm=True, head_dim=cfg.head_dim)
            and ok(lp.w_gate_up, norm=True, swiglu=True, head_dim=cfg.head_dim))
    residual = ok(lp.wo, residual=True) and ok(lp.w_down, residual=True)
    sums = (norm and residual and norm_sums_fusable(lp.wqkv, cfg.int4_matmul_impl, rows)
            and norm_sums_fusable(lp.w_gate_up, cfg.int4_matmul_impl, rows, swiglu=True))
    tail = norm and residual and tail_fusable(lp.wo, lp.w_gate_up, lp.w_down, cfg.int4_matmul_impl, rows)
    return LayerFusion(norm=norm, residual=residual, unit_norms=params.unit_norms if norm else (), sums=sums,
                       tail=tail)


# ------------------------------------------------------------------------------ entry points
def prefill(params: Params, tokens: Array, lengths: Array, cache: Cache, *,
            all_logits: bool = False, chunk: int | None = None, progress: bool = False) -> tuple[Array, Cache]:
    """Runs right-padded prompts through the model and places their K/V in an empty cache.

    tokens: int32[B, T] (row b valid up to lengths[b]); lengths: int32[B], each >= 1.
    Returns (logits, cache): float32 logits [B, V] at each row's last prompt token, or
    [B, T, V] for every position when `all_logits`; the cache holds `lengths` tokens per row.

    chunk: None (or >= T) runs the whole prompt at once: every layer's temporaries hold T tokens.
    An int C (a multiple of a QuantSpecCache's group size) runs it C tokens at a time
    (`_prefill_chunked`): temporaries hold C tokens, so peak memory is weights + cache + O(C),
    and each chunk's queries read the earlier chunks from the cache the way decoding will
    (`attention.chunk_attention`: the quantized prefix through the target's INT8 view), which
    changes logits by the cache's quantization error (docs/QUALITY.md, "Chunked prefill").

    progress: report each finished layer (of each chunk) on stderr from the device's side
    (`jax.debug.callback`; the CLIs turn it on for long prompts).
    """
    if tokens.ndim != 2:
        raise ValueError(f"prefill: tokens must be int32[B, T] (one row per prompt), got shape {tokens.shape}")
    b, t = tokens.shape
    if chunk is not None:
        group = cache.group_size if isinstance(cache, QuantSpecCache) else 1
        if not isinstance(chunk, (int, np.integer)) or chunk < 1 or chunk % group:
            raise ValueError(f"prefill: chunk={chunk!r} must be a positive multiple of the cache's group size "
                             f"{group} (or None: the whole prompt at once)")
        if chunk < t:
            return _prefill_chunked(params, tokens, lengths, cache, int(chunk), all_logits, progress)
    cfg = params.config
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = params.embed[tokens]

    def layer(lp, x, cache, i):
        x, (k, v), _ = layer_forward(cfg, lp, x, positions, mesh=params.mesh)
        if progress:
            _report_progress(x, i + 1, cfg.num_layers, f"{t:,} tokens x {cfg.num_layers} layers")
        return x, cache.prefill_layer(i, k, v, lengths)

    x, cache = _scan_layers(params, x, cache, layer)
    cache = cache.finish_prefill(lengths)
    if not all_logits:
        x = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return _logits(params, x), cache


def _report_progress(x: Array, step: Array, steps: int, what: str) -> None:
    """Reports step `step` (1-based) of `steps` of a prefill once `x`, the step's output, exists:
    one stderr line rewritten in place, ended when the last step is done. `what` names the work."""

    def show(_: Any, done: Any) -> None:
        done = int(done)
        print(f"\rprefill: {100 * done // steps:3d}% of {what}", end="\n" if done >= steps else "",
              file=sys.stderr, flush=True)

    jax.debug.callback(show, x[0, 0, 0], step)


def _prefill_chunked(params: Params, tokens: Array, lengths: Array, cache: Cache, chunk: int,
                     all_logits: bool, progress: bool = False) -> tuple[Array, Cache]:
    """`prefill` C = `chunk` tokens at a time: a loop over the T // C full chunks, then the tail.

    Chunk c (positions s = cC .. s+C-1) runs every layer: its K/V go into the cache
    (`prefill_chunk_layer`: full G-blocks quantized at their positions, ring positions to the
    ring) and its queries attend to positions < s from the cache and causally to the chunk
    (`chunk_attention`). The carry keeps each row's hidden state at its last prompt token.
    """
    cfg = params.config
    b, t = tokens.shape
    n_full, tail = divmod(t, chunk)
    n_chunks = n_full + (tail > 0)
    quantized_len = (prefill_quantized_len(lengths, cache.group_size) if isinstance(cache, QuantSpecCache)
                     else jnp.zeros_like(lengths))
    impl = prefill_impl(cfg.prefill_attention_impl, cfg.head_dim, params.embed.dtype, cfg.sliding_window,
                        chunked=True, mesh=params.mesh)
    last = (lengths - 1).astype(jnp.int32)  # [B]: each row's last prompt position
    x_last = jnp.zeros((b, cfg.hidden_size), params.embed.dtype)
    all_x = jnp.zeros((b, t, cfg.hidden_size), params.embed.dtype) if all_logits else None

    def run_chunk(start: Array | int, toks: Array, carry: tuple) -> tuple:
        cache, x_last, all_x = carry
        c = toks.shape[1]
        positions = jnp.broadcast_to(start + jnp.arange(c, dtype=jnp.int32), (b, c))

        def layer(lp, x, cache, i):
            attend = functools.partial(chunk_attention, positions=positions, cache=cache, layer=i, start=start,
                                       span=chunk, quantized_len=quantized_len,
                                       sliding_window=cfg.sliding_window, impl=impl)
            x, (k, v), _ = layer_forward(cfg, lp, x, positions, mesh=params.mesh, attend=attend)
            if progress:
                _report_progress(x, (start // chunk) * cfg.num_layers + i + 1, n_chunks * cfg.num_layers,
                                 f"{t:,} tokens x {cfg.num_layers} layers, in {n_chunks} chunks of {chunk:,}")
            return x, cache.prefill_chunk_layer(i, k, v, start, lengths)

        x, cache = _scan_layers(params, params.embed[toks], cache, layer)
        at = last - start
        here = (at >= 0) & (at < c)
        x_at = jnp.take_along_axis(x, jnp.clip(at, 0, c - 1)[:, None, None], axis=1)[:, 0]
        x_last = jnp.where(here[:, None], x_at, x_last)
        if all_x is not None:
            all_x = jax.lax.dynamic_update_slice(all_x, x, (0, start, 0))
        return cache, x_last, all_x

    def full_chunk(c: Array, carry: tuple) -> tuple:
        start = c * chunk
        return run_chunk(start, jax.lax.dynamic_slice(tokens, (0, start), (b, chunk)), carry)

    carry = jax.lax.fori_loop(0, n_full, full_chunk, (cache, x_last, all_x))
    if tail:
        carry = run_chunk(n_full * chunk, tokens[:, n_full * chunk:], carry)
    cache, x_last, all_x = carry
    return _logits(params, all_x if all_logits else x_last), cache.finish_prefill(lengths)


def decode(params: Params, tokens: Array, cache: Cache, *, view: str = "target",
           width: int | None = None) -> tuple[Array, Cache]:
    """Appends T tokens per row after each row's committed tokens and returns their logits.

    tokens: int32[B, T]. `view` selects what a QuantSpecCache's quantized region looks like:
    "target" (both nibbles) or "draft" (upper nibble only). Returns float32 logits [B, T, V]
    and the cache with the T tokens committed (`cache.rollback` un-commits).

    `width` (>= T): compute the pass over `width` token columns, the T real ones first and
    padding after (their K/V land in slots past the committed tokens, which is garbage by the
    cache protocol, and their logits are dropped). Every operation's arithmetic on a row then
    depends on the pass's shape [B, width] and not on T: XLA's dots and the GPU libraries pick
    their algorithm (and so the summation order) from the shape, while at one fixed shape a
    row's result does not depend on its index or on the other rows. Autoregressive decoding
    with width = gamma_max + 1 therefore computes, bit for bit, what the speculative verify
    pass computes for the same position (docs/QUALITY.md, "Fidelity" and "Exactness": at any
    width, tested at 3 and 8 on the CPU).
    """
    if tokens.ndim != 2:
        raise ValueError(f"decode: tokens must be int32[B, T] (one column per new token), got shape {tokens.shape}")
    cfg = params.config
    t = tokens.shape[1]
    if width is not None and width != t:
        if width < t:
            raise ValueError(f"decode: width={width} is smaller than the {t} tokens to decode")
        tokens = jnp.pad(tokens, ((0, 0), (0, width - t)))
    positions = cache.next_positions(tokens.shape[1])
    x = params.embed[tokens]
    b, w = tokens.shape
    q_struct = jax.ShapeDtypeStruct((b, w, cfg.num_heads, cfg.head_dim), x.dtype)
    inputs = attention_inputs(q_struct, positions, cache, view, cfg.attention_impl)
    fusion = _layer_fusion(params, b * w)
    tail_sync = layer_tail_sync(params.layers.w_down, x) if fusion.tail else None  # one per pass
    into_cache = _qkv_cache_plan(params, fusion, cache, view, q_struct)
    if into_cache is not None:
        return _decode_qkv_cache(params, x, positions, cache, view, inputs, fusion, q_struct, *into_cache, t,
                                 tail_sync)

    def layer(lp, x, cache, i):  # x [B, T, D], or the pair (x, down) / (x, sums): fusion.defers_residual / sums
        if fusion.norm:
            x, sums = x if fusion.sums else (x, None)
            q, k, v = _qkv(cfg, lp, x, positions, params.mesh, norm=lp.attn_norm,
                           unit_norm="attn_norm" in fusion.unit_norms, norm_sums=sums)
        else:
            x, h = _input_norm(cfg, fusion, x, lp.attn_norm)
            q, k, v = _qkv(cfg, lp, h, positions, params.mesh)
        cache = cache.append_layer(i, k, v)
        attn = cache_attention(q, positions, cache, i, view, cfg.attention_impl, cfg.sliding_window,
                               mesh=params.mesh, inputs=inputs)
        return _attn_out_and_mlp(cfg, lp, x, attn.reshape(b, w, -1), params.mesh, fusion, tail_sync)[0], cache

    x, cache = _scan_layers(params, _carry_in(fusion, x), cache, layer,
                            stack_norms=fusion.norm or bool(fusion.add_norm))
    # The lm_head runs over all `width` columns too (its shape must not depend on T).
    return _logits(params, _carry_out(fusion, x))[:, :t], cache.advance(t)


def _carry_in(fusion: LayerFusion, x: Array) -> Any:
    """The layer loop's x for the embedding x [B, T, D]: x, or with `fusion.defers_residual` the
    pair (x, zeros) (the first layer's pending residual: x + 0 is x), or with `fusion.sums` the
    pair (x, its rows' sums of squares from XLA: no kernel formed the embedding)."""
    if fusion.defers_residual:
        return x, jnp.zeros_like(x)
    if fusion.sums:
        return x, norm_sums_of(x)
    return x


def _carry_out(fusion: LayerFusion, x: Any) -> Array:
    """The last layer's output [B, T, D] from the layer loop's x (`_carry_in`)."""
    if fusion.defers_residual:
        return x[0] + x[1]
    return x[0] if fusion.sums else x


def _qkv_cache_plan(params: Params, fusion: LayerFusion, cache: Cache, view: str,
                    q_struct: jax.ShapeDtypeStruct) -> tuple[tuple[int, ...], str] | None:
    """(the attention's query operand shape, the kernel backend) where `decode` runs each layer's
    q|k|v into the cache in one kernel (`_decode_qkv_cache`), else None. Where the new tokens'
    buffers (`append_buffers`) are bf16 and the attention kernel takes a prepared query operand:
    the fused draft layer (`fusion.norm`) decoding one token per row over a QuantSpecCache with
    heads its INT4 kernel takes (`linear.qkv_cache_fusable`), or a target's bf16 layer where
    `linear.target_qkv_cache_backend` runs one (the verify and the AR decode at its width alike:
    from the pass's shape, not T; over a dense cache, the AR-bf16 baseline)."""
    cfg = params.config
    b, t = q_struct.shape[:2]
    buf = cache.append_buffers[0]
    if buf.dtype != jnp.bfloat16:
        return None
    if fusion.norm:
        ok = (t == 1 and isinstance(cache, QuantSpecCache)
              and qkv_cache_fusable(params.layers.wqkv, cfg.int4_matmul_impl, b, cfg.head_dim))
        backend = "interpret" if cfg.int4_matmul_impl == "interpret" else "mosaic"
    else:
        single = params.mesh is None or params.mesh.size == 1
        backend = target_qkv_cache_backend(params.layers.wqkv, b * t, cfg.head_dim, buffer=buf) if single else None
        ok = backend is not None
    shape = query_operand_shape(q_struct, cache, view, cfg.attention_impl) if ok else None
    return None if shape is None else (shape, backend)


def _decode_qkv_cache(params: Params, x: Array, positions: Array, cache: Cache, view: str,
                      inputs: Any, fusion: LayerFusion, q_struct: jax.ShapeDtypeStruct,
                      q_operand: tuple[int, ...], backend: str, t: int, tail_sync: Any = None) -> tuple[Array, Cache]:
    """`decode`'s layer loop with each layer's q|k|v product, RoPE, query operand and ring writes
    in one kernel (`linear.qkv_into_cache`; the draft's with its attention norm inside, a target's
    after the norm's own kernel): the same function as the unfused layer (`_qkv`, `append_layer`,
    the attention's own query preparation) up to where the fused kernel rounds. The query
    operand [B, Hkv, D, CN] rides in the loop's carry: each layer writes its columns in place, the
    padding columns stay the zeros they start as. The new tokens' K / V go to the cache's
    `append_buffers` at `append_slots`, clipped into the buffer as `append_layer`'s scatter clips
    them (generation sizes caches so that this never triggers; the kernel's stores stay in bounds)."""
    cfg = params.config
    width, rows = positions.shape[1], cache.append_buffers[0].shape[3]
    slots = jnp.clip(cache.append_slots(width), 0, rows - 1)
    rope, slots = qkv_pass_inputs(positions, slots, rope_inv_freq(cfg))  # once per pass

    def layer(lp, x, carry, i):  # x [B, W, D], or a pair (`_carry_in`)
        cache, q_buf = carry
        k_buf, v_buf = cache.append_buffers
        bufs = dict(backend=backend, rope=rope, slots=slots, q_buf=q_buf, k_ring=k_buf, v_ring=v_buf)
        if fusion.norm:  # the draft: the attention norm inside the kernel
            x, sums = x if fusion.sums else (x, None)
            q_buf, k_buf, v_buf = qkv_into_cache(x, lp.wqkv, norm=lp.attn_norm, norm_eps=cfg.rms_norm_eps,
                                                 norm_unit="attn_norm" in fusion.unit_norms, norm_sums=sums, **bufs)
        else:
            x, h = _input_norm(cfg, fusion, x, lp.attn_norm)
            q_buf, k_buf, v_buf = qkv_into_cache(h, lp.wqkv, **bufs)
        cache = cache.with_append_buffers(k_buf, v_buf)
        attn = cache_attention(q_struct, positions, cache, i, view, cfg.attention_impl, cfg.sliding_window,
                               inputs=inputs, q_operand=q_buf)
        return (_attn_out_and_mlp(cfg, lp, x, attn.reshape(*positions.shape, -1), params.mesh, fusion, tail_sync)[0],
                (cache, q_buf))

    q_buf = jnp.zeros(q_operand, jnp.bfloat16)
    x, (cache, _) = _scan_layers(params, _carry_in(fusion, x), (cache, q_buf), layer,
                                 stack_norms=fusion.norm or bool(fusion.add_norm), stack=("wqkv",))
    return _logits(params, _carry_out(fusion, x))[:, :t], cache.advance(t)
