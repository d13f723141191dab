"""Attention: plain-jnp references and the dispatch to the Pallas kernels.

The jnp functions here are the oracle for `pallas_kernels` and the CPU path. GQA is computed by
grouping query heads per KV head ([B, Hkv, T, n_rep, ...]); K/V are never repeated per head.

Masking is by logical position only: a query at position p sees keys at positions <= p (and
within `sliding_window` if set). Slots past a row's end hold garbage at positions > p.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qspec_jax import quant, spmd
from qspec_jax.cache import DenseKVCache, QuantSpecCache

Array = jax.Array
VIEWS = ("draft", "target")
_NEG = -1e30  # finite: a fully masked (padding) query row gives finite garbage, never NaN


def _grouped_queries(q: Array, num_kv_heads: int) -> Array:
    """[B, T, Hq, D] -> float32 [B, Hkv, T, n_rep, D], pre-scaled by 1/sqrt(D)."""
    b, t, hq, d = q.shape
    g = q.reshape(b, t, num_kv_heads, hq // num_kv_heads, d).astype(jnp.float32) * (d ** -0.5)
    return jnp.swapaxes(g, 1, 2)


def _ungroup(o: Array, dtype) -> Array:
    """[B, Hkv, T, n_rep, D] -> [B, T, Hq, D]."""
    b, g, t, r, d = o.shape
    return jnp.swapaxes(o, 1, 2).reshape(b, t, g * r, d).astype(dtype)


def _visible(q_pos: Array, k_pos: Array, sliding_window: int | None) -> Array:
    """q_pos [B, T], k_pos [B, S] -> bool [B, 1, T, 1, S]."""
    qp, kp = q_pos[:, None, :, None, None], k_pos[:, None, None, None, :]
    ok = kp <= qp
    if sliding_window is not None:
        ok &= qp - kp < sliding_window
    return ok


def dense_attention(q: Array, k: Array, v: Array, q_pos: Array, k_pos: Array,
                    sliding_window: int | None = None) -> Array:
    """Causal GQA attention.

    q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; q_pos: int32[B, T]; k_pos: int32[B, S].
    Scores and softmax in float32; P·V with P in V's dtype, accumulated in float32.
    Returns [B, T, Hq, D] in q's dtype.
    """
    qg = _grouped_queries(q, k.shape[1])
    s = jnp.einsum("bgtrd,bgsd->bgtrs", qg, k.astype(jnp.float32))
    s = jnp.where(_visible(q_pos, k_pos, sliding_window), s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bgtrs,bgsd->bgtrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return _ungroup(o, q.dtype)


PREFILL_QUERY_CHUNK = 512


def prefill_attention(q: Array, k: Array, v: Array, positions: Array, sliding_window: int | None = None,
                      chunk: int = PREFILL_QUERY_CHUNK) -> Array:
    """Causal self-attention of a prompt, `chunk` queries at a time so the float32 scores stay
    [B, Hkv, chunk, n_rep, T] rather than T x T. Same math as `dense_attention`.

    q: [B, T, Hq, D]; k, v: [B, Hkv, T, D]; positions: int32[B, T].
    """
    b, t = q.shape[:2]
    if t <= chunk:
        return dense_attention(q, k, v, positions, positions, sliding_window)
    n = -(-t // chunk)
    pad = n * chunk - t
    qc = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, chunk, *q.shape[2:])
    pc = jnp.pad(positions, ((0, 0), (0, pad)), constant_values=t).reshape(b, n, chunk)
    out = jax.lax.map(lambda qp: dense_attention(qp[0], k, v, qp[1], positions, sliding_window),
                      (jnp.swapaxes(qc, 0, 1), jnp.swapaxes(pc, 0, 1)))  # [n, B, chunk, Hq, D]
    return jnp.swapaxes(out, 0, 1).reshape(b, n * chunk, *q.shape[2:])[:, :t]


def quantized_cache_attention(q: Array, q_pos: Array, cache: QuantSpecCache, layer: Array | int,
                              view: str = "target", sliding_window: int | None = None) -> Array:
    """Attention of T query tokens over one layer of the hierarchical cache (SPEC §5), in jnp.

    Written in the folded form the kernel uses: key scales are multiplied into q per block, the
    key zero becomes a per-block bias q·z, value scales multiply p per token and value zeros add
    Σ p z. The draft view reads only the upper planes; the target view adds the lower planes.

    q: [B, T, Hq, D] (roped); q_pos: int32[B, T]. Returns [B, T, Hq, D].
    """
    if view not in VIEWS:
        raise ValueError(f"view={view!r}; expected one of {VIEWS}")
    target = view == "target"
    G = cache.group_size
    _, B, Hkv, S, _ = cache.k_hi.shape  # [L, B, Hkv, S, D/2]
    qg = _grouped_queries(q, Hkv)  # [B, g, T, r, D]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    # Quantized keys: per channel c, per block n of G tokens.
    ks, kz = f32(cache.k_scale[layer]), f32(cache.k_zero[layer])  # [B, g, N, D]
    n_blocks, d = ks.shape[2], ks.shape[3]
    blocks = lambda plane: quant.key_codes_cache(plane[layer]).reshape(B, Hkv, n_blocks, G, d)  # noqa: E731
    q_s = jnp.einsum("bgtrd,bgnd->bgtrnd", qg, ks)  # q_c s_c per block
    s_q = jnp.einsum("bgtrnd,bgnkd->bgtrnk", q_s, f32(blocks(cache.k_hi)))
    if target:
        lower = f32(blocks(cache.k_lo)) - quant.LOWER_BIAS
        s_q = s_q + jnp.einsum("bgtrnd,bgnkd->bgtrnk", q_s / 16.0, lower)
    s_q = s_q + jnp.einsum("bgtrd,bgnd->bgtrn", qg, kz)[..., None]
    s_q = s_q.reshape(*s_q.shape[:4], S)
    t_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    vis_q = _visible(q_pos, t_pos, sliding_window) & (t_pos < cache.q_len[:, None])[:, None, None, None, :]
    s_q = jnp.where(vis_q, s_q, _NEG)

    # FP ring.
    k_fp, v_fp = cache.k_fp[layer], cache.v_fp[layer]  # [B, g, R, D]
    s_fp = jnp.einsum("bgtrd,bgsd->bgtrs", qg, f32(k_fp))
    s_fp = jnp.where(_visible(q_pos, cache.ring_positions(), sliding_window), s_fp, _NEG)

    p = jax.nn.softmax(jnp.concatenate([s_q, s_fp], axis=-1), axis=-1)
    p_q, p_fp = p[..., :S], p[..., S:]

    # Quantized values: per token t, per channel group n of Gv channels.
    vs, vz = f32(cache.v_scale[layer]), f32(cache.v_zero[layer])  # [B, g, S, D/Gv]
    n_groups = vs.shape[-1]
    groups = lambda plane: quant.value_codes_cache(plane[layer], G).reshape(B, Hkv, S, n_groups, d // n_groups)  # noqa: E731
    p_s = p_q[..., None] * vs[:, :, None, None]  # p_t s_t: [B, g, T, r, S, n]
    o_q = jnp.einsum("bgtrsn,bgsnc->bgtrnc", p_s, f32(groups(cache.v_hi)))
    if target:
        lower = f32(groups(cache.v_lo)) - quant.LOWER_BIAS
        o_q = o_q + jnp.einsum("bgtrsn,bgsnc->bgtrnc", p_s / 16.0, lower)
    o_q = o_q + jnp.einsum("bgtrs,bgsn->bgtrn", p_q, vz)[..., None]
    o = o_q.reshape(*o_q.shape[:4], d) + jnp.einsum("bgtrs,bgsd->bgtrd", p_fp, f32(v_fp))
    return _ungroup(o, q.dtype)


def uses_kernels(impl: str, platform: str | None = None) -> bool:
    """Whether decode attention under ModelConfig.attention_impl `impl` runs the Pallas kernels
    (rather than the jnp code here): "auto" on a GPU (`platform`, default this process's backend),
    or a kernel named."""
    if impl == "auto":
        return (platform or jax.default_backend()) == "gpu"
    return impl in ("pallas", "mosaic", "triton")


def _kernel_impl(impl: str) -> str:
    """ModelConfig.attention_impl -> pallas_kernels.cache_attention's impl ("pallas" and "auto"
    let the kernels pick: Mosaic GPU on Hopper, Triton elsewhere)."""
    return impl if impl in ("mosaic", "triton") else "auto"


def attention_inputs(q: Any, q_pos: Array, cache: DenseKVCache | QuantSpecCache, view: str,
                     impl: str) -> dict[str, Array] | None:
    """What every layer's `cache_attention` of one decode pass shares (the kernels' per-row
    lengths and per-column positions), computed once per pass outside the layer loop; None where
    `impl` resolves to the jnp code. `q`: the queries [B, T, Hq, D] or their ShapeDtypeStruct."""
    if not uses_kernels(impl):
        return None
    import pallas_kernels

    return pallas_kernels.attention_inputs(q, q_pos, cache, view=view, impl=_kernel_impl(impl))


def cache_attention(q: Array, q_pos: Array, cache: DenseKVCache | QuantSpecCache, layer: Array,
                    view: str, impl: str, sliding_window: int | None, mesh: Any = None,
                    inputs: dict[str, Array] | None = None) -> Array:
    """Attention of new queries over one layer of `cache` (which already holds their K/V).

    `impl` is ModelConfig.attention_impl: "pallas" uses `pallas_kernels` (Mosaic GPU kernels on
    Hopper, Triton elsewhere), "mosaic" / "triton" force one of them, "reference" the jnp code
    above, "auto" picks the kernels on GPU and the jnp code elsewhere. With a tensor-parallel
    `mesh` the kernel runs per device on its local heads; the jnp code is partitioned by XLA.
    `inputs`: `attention_inputs(...)` of this pass (None: the kernels compute them per call).
    """
    if uses_kernels(impl):
        import pallas_kernels  # imported lazily: the CPU path needs no Triton

        def attend(q, q_pos, cache, layer, inputs):
            return pallas_kernels.cache_attention(q, q_pos, cache, layer, view=view, sliding_window=sliding_window,
                                                  impl=_kernel_impl(impl), inputs=inputs)

        if mesh is not None and mesh.size > 1:
            return spmd.sharded_cache_attention(attend, mesh, q, q_pos, cache, layer, inputs)
        return attend(q, q_pos, cache, layer, inputs)
    if isinstance(cache, QuantSpecCache):
        return quantized_cache_attention(q, q_pos, cache, layer, view, sliding_window)
    k_pos = jnp.broadcast_to(jnp.arange(cache.max_len, dtype=jnp.int32), (q.shape[0], cache.max_len))
    return dense_attention(q, cache.k[layer], cache.v[layer], q_pos, k_pos, sliding_window)
