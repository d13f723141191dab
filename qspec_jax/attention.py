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


# ------------------------------------------------------------------------------------ prefill
# Prompt attention has two forms. A whole prompt (or the first chunk of one) attends causally to
# itself. A later chunk of a chunked prefill (`model.prefill(chunk=C)`) attends to the cache's
# prefix (every position before the chunk, read as decode will read it) and causally to itself.
#
# Implementations (ModelConfig.prefill_attention_impl):
#   "reference": the jnp code below (the oracle, and the CPU path);
#   "cudnn":     cuDNN's fused flash attention; a chunk runs one call per prefix span (`prefix_span`
#                keys, a multiple of C), one over the ring and one causal call over itself, merged by
#                log-sum-exp (SGLang's split form: cuDNN's causal mask is aligned top-left, so a chunk's
#                offset cannot be expressed in one call);
#   "xla":       the same split-and-merge through jax.nn's XLA attention (runs anywhere: tests check the
#                split-and-merge against the reference on the CPU);
#   "auto":      "cudnn" on a GPU where cuDNN takes the case (`cudnn_unsupported_reason`), else "reference".
PREFILL_QUERY_CHUNK = 512
# Keys (x batch rows) per flash call over a chunk's cached prefix: each call dequantizes its span to
# the model dtype ([B, Hkv, L, D] for K and V: 256 MiB at the 8B shape) and costs one float32
# merge of the chunk's [B, C, Hq, D] accumulator; longer spans amortize the merge and keep cuDNN's
# tiles busy (H200, 8B shape, C = 8192: a 1.29M-token prefill took ~18-20 min in 8192-key spans,
# 14.3-14.7 min in 65536-key ones).
PREFIX_SPAN_TOKENS = 65536
_FAR = 2**30  # the logical position of a key no query may see


def _positional_attention(q: Array, k: Array, v: Array, q_pos: Array, k_pos: Array, sliding_window: int | None,
                          chunk: int = PREFILL_QUERY_CHUNK) -> Array:
    """`dense_attention` of T queries, `chunk` queries at a time, so the float32 scores stay
    [B, Hkv, chunk, n_rep, S] rather than T x S.

    q: [B, T, Hq, D]; k, v: [B, Hkv, S, D]; q_pos: int32[B, T]; k_pos: int32[B, S] (_FAR: never seen).
    """
    b, t = q.shape[:2]
    if t <= chunk:
        return dense_attention(q, k, v, q_pos, k_pos, sliding_window)
    n = -(-t // chunk)
    pad = n * chunk - t
    qc = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, chunk, *q.shape[2:])
    pc = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=_FAR - 1).reshape(b, n, chunk)  # padding rows: dropped
    out = jax.lax.map(lambda qp: dense_attention(qp[0], k, v, qp[1], k_pos, sliding_window),
                      (jnp.swapaxes(qc, 0, 1), jnp.swapaxes(pc, 0, 1)))  # [n, B, chunk, Hq, D]
    return jnp.swapaxes(out, 0, 1).reshape(b, n * chunk, *q.shape[2:])[:, :t]


def cudnn_unsupported_reason(head_dim: int, dtype: Any, sliding_window: int | None = None,
                             chunked: bool = False, platform: str | None = None) -> str | None:
    """Why cuDNN's flash attention cannot run a prefill of this model on `platform` (default this
    process's backend), or None when it can."""
    platform = platform or jax.default_backend()
    if platform != "gpu":
        return f"no GPU (backend {platform!r})"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (cuDNN flash attention takes bfloat16 or float16)"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim} (cuDNN takes a multiple of 8 up to 256)"
    if chunked and sliding_window is not None:
        return "a sliding window over a cached prefix (cuDNN's window is causal and aligned top-left)"
    return None


def prefill_impl(impl: str, head_dim: int, dtype: Any, sliding_window: int | None = None, chunked: bool = False,
                 mesh: Any = None, platform: str | None = None) -> str:
    """ModelConfig.prefill_attention_impl resolved for `platform` (default this process's
    backend): "auto" picks "cudnn" where `cudnn_unsupported_reason` is None and the model is not
    tensor-parallel (cuDNN's partitioning under a mesh is not measured here), else "reference". A
    forced "cudnn" that cannot run raises."""
    if impl == "auto":
        ok = cudnn_unsupported_reason(head_dim, dtype, sliding_window, chunked, platform) is None
        return "cudnn" if ok and (mesh is None or mesh.size == 1) else "reference"
    if impl == "cudnn":
        why = cudnn_unsupported_reason(head_dim, dtype, sliding_window, chunked, platform)
        if why is not None:
            raise ValueError(f"prefill_attention_impl='cudnn' cannot run here: {why}; use 'auto' or 'reference'")
    if impl == "xla" and chunked and sliding_window is not None:
        raise ValueError("prefill_attention_impl='xla' takes no sliding window over a cached prefix; use 'reference'")
    return impl


def prefix_span(chunk: int, batch: int, max_len: int) -> int:
    """Keys per flash call over a chunk's cached prefix: the largest multiple of `chunk` with
    batch x span <= PREFIX_SPAN_TOKENS (at least `chunk`), and no longer than the cache."""
    span = chunk * max(1, PREFIX_SPAN_TOKENS // (chunk * batch))
    return max(chunk, min(span, max_len // chunk * chunk))


def _to_bsnh(x: Array) -> Array:
    """[B, H, S, D] -> [B, S, H, D] (the flash kernels' layout)."""
    return jnp.swapaxes(x, 1, 2)


def _flash_part(q: Array, k: Array, v: Array, kv_len: Array | None, *, causal: bool, impl: str,
                sliding_window: int | None = None) -> tuple[Array, Array]:
    """Softmax attention of q [B, T, Hq, D] over k, v [B, S, Hkv, D] (scale D^-1/2) through a flash
    kernel, with its log-sum-exp so that parts over disjoint key sets can be merged.

    kv_len: int32[B] or None: row b sees keys [0, kv_len[b]) only. causal: query i sees keys
    j <= i (aligned top-left). Returns (o float32 [B, T, Hq, D], lse float32 [B, T, Hq]); a row
    that sees no key gets o = 0 and lse = _NEG, which `merge_attention` weighs as nothing.
    """
    b, t, _, d = q.shape
    window = None if sliding_window is None else (sliding_window - 1, 0)
    if impl == "cudnn":
        # jax.nn.dot_product_attention(return_residual=True) rounds the log-sum-exp to the output
        # dtype (bfloat16: an error of up to ~1/16 at lse ~ 16, ~6% in a merge weight); the cuDNN
        # primitive underneath returns it in float32.
        from jax._src.cudnn import fused_attention_stablehlo as cudnn

        if kv_len is None:
            mask, q_len = (cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK), None
        else:
            mask = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
            q_len = jnp.full((b,), t, jnp.int32)
        o, lse = cudnn.dot_product_attention(
            q, k, v, None, None, q_len, kv_len, scale=d ** -0.5, mask_type=mask, qkv_layout="BTNH",
            sliding_window_length=None if window is None else sliding_window, return_residual=True)
        lse = jnp.swapaxes(lse, 1, 2)  # cuDNN returns [B, N, T]
    elif impl == "xla":
        o, lse = jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, key_value_seq_lengths=kv_len, local_window_size=window,
            implementation="xla", return_residual=True)
    else:
        raise ValueError(f"flash attention impl {impl!r}; expected 'cudnn' or 'xla'")
    o, lse = o.astype(jnp.float32), lse.astype(jnp.float32)
    if kv_len is not None:
        seen = (kv_len > 0)[:, None, None]
        o = jnp.where(seen[..., None], o, 0.0)
        lse = jnp.where(seen, lse, _NEG)
    return o, lse


def merge_attention(a: tuple[Array, Array], b: tuple[Array, Array]) -> tuple[Array, Array]:
    """Softmax attention over the union of two disjoint key sets from the parts over each:
    (o [..., D], lse [...]) float32 pairs, weighed by exp(lse - logaddexp(lse_a, lse_b))."""
    (oa, la), (ob, lb) = a, b
    lse = jnp.logaddexp(la, lb)
    return oa * jnp.exp(la - lse)[..., None] + ob * jnp.exp(lb - lse)[..., None], lse


def prefill_attention(q: Array, k: Array, v: Array, positions: Array, sliding_window: int | None = None,
                      impl: str = "reference") -> Array:
    """Causal self-attention of a prompt (or of a chunked prefill's first chunk).

    q: [B, T, Hq, D]; k, v: [B, Hkv, T, D]; positions: int32[B, T] (consecutive from 0 in each row;
    padding columns past a row's length see garbage and are dropped). `impl`: a resolved
    `prefill_impl`. Returns [B, T, Hq, D] in q's dtype.
    """
    if impl == "reference":
        return _positional_attention(q, k, v, positions, positions, sliding_window)
    if impl == "cudnn":
        window = None if sliding_window is None else (sliding_window - 1, 0)
        return jax.nn.dot_product_attention(q, _to_bsnh(k), _to_bsnh(v), is_causal=True, local_window_size=window,
                                            implementation="cudnn")
    o, _ = _flash_part(q, _to_bsnh(k), _to_bsnh(v), None, causal=True, impl=impl, sliding_window=sliding_window)
    return o.astype(q.dtype)


def chunk_attention(q: Array, k: Array, v: Array, positions: Array, cache: DenseKVCache | QuantSpecCache,
                    layer: Array, start: Array | int, span: int, quantized_len: Array,
                    sliding_window: int | None = None, impl: str = "reference",
                    prefix_keys: int | None = None) -> Array:
    """Attention of a prompt chunk: its queries see every position before the chunk as the cache
    holds it and, causally, the chunk itself.

    q: [B, C, Hq, D]; k, v: [B, Hkv, C, D], the chunk's own; positions: int32[B, C] = start + 0..C-1;
    `cache` holds positions [0, start) of `layer` (`start` a multiple of `span`, the chunk size).
    A QuantSpecCache is read the way decode reads it (`cache.prefill_chunk_layer` placed it):
    positions below each row's `quantized_len` (int32[B], SPEC §4's Q) through the target's INT8
    view, the rest from the bf16 ring (slot j = position Q + j). A dense cache is read as stored.
    `impl`: a resolved `prefill_impl`. On the flash path the prefix is read `prefix_keys` keys per
    call (a multiple of `span`; default `prefix_span(span, B, max_len)`), from `start` downwards: span j
    covers [max(start - (j+1) L, 0), start - j L), read as the L keys from its lower end with the
    keys past its upper end masked off. Returns [B, C, Hq, D] in q's dtype.
    """
    quant = isinstance(cache, QuantSpecCache)
    if impl == "reference":
        ks, vs, ps = [], [], []
        s = cache.max_len
        t_pos = jnp.arange(s, dtype=jnp.int32)[None, :]
        if quant:
            kq, vq = cache.dequantized_layer(layer, "target")  # float32 [B, Hkv, S, D]
            limit = jnp.minimum(quantized_len, start)[:, None]
            ring_pos = quantized_len[:, None] + jnp.arange(cache.ring_size, dtype=jnp.int32)[None, :]
            ks += [kq, cache.k_fp[layer]]
            vs += [vq, cache.v_fp[layer]]
            ps += [jnp.where(t_pos < limit, t_pos, _FAR), jnp.where(ring_pos < start, ring_pos, _FAR)]
        else:
            ks.append(cache.k[layer])
            vs.append(cache.v[layer])
            ps.append(jnp.where(t_pos < start, t_pos, _FAR))
        ks, vs, ps = ks + [k], vs + [v], ps + [positions]
        cat = lambda xs: jnp.concatenate([x.astype(jnp.float32) for x in xs], axis=2)  # noqa: E731
        k_pos = jnp.concatenate([jnp.broadcast_to(p, (q.shape[0], p.shape[1])) for p in ps], axis=1)
        return _positional_attention(q, cat(ks), cat(vs), positions, k_pos, sliding_window)

    dtype = q.dtype
    b = q.shape[0]

    n_keys = prefix_span(span, b, cache.max_len) if prefix_keys is None else prefix_keys
    if n_keys % span or n_keys > cache.max_len:
        raise ValueError(f"prefix_keys={n_keys}: expected a multiple of the chunk ({span}) <= max_len "
                         f"({cache.max_len})")
    # Positions below `seen` are read from the cache (for the hierarchical cache, those below Q: the
    # INT8 view; [Q, start) come from the ring below); in every span they are a prefix of its keys.
    seen = jnp.broadcast_to(jnp.minimum(quantized_len, start) if quant else jnp.asarray(start, jnp.int32), (b,))

    def one_span(j: Array, acc: tuple[Array, Array]) -> tuple[Array, Array]:
        lo = jnp.maximum(start - (j + 1) * n_keys, 0)  # a multiple of the chunk, hence of G
        if quant:
            kp, vp = cache.dequantized_span(layer, lo, n_keys, "target", dtype)
        else:
            kp, vp = cache.span(layer, lo, n_keys)
        kv_len = jnp.clip(jnp.minimum(seen, start - j * n_keys) - lo, 0, n_keys).astype(jnp.int32)
        return merge_attention(acc, _flash_part(q, _to_bsnh(kp), _to_bsnh(vp), kv_len, causal=False, impl=impl))

    acc = _flash_part(q, _to_bsnh(k), _to_bsnh(v), None, causal=True, impl=impl, sliding_window=sliding_window)
    acc = jax.lax.fori_loop(0, (start + n_keys - 1) // n_keys, one_span, acc)
    if quant:
        ring_len = jnp.clip(start - quantized_len, 0, cache.ring_size).astype(jnp.int32)
        ring = _flash_part(q, _to_bsnh(cache.k_fp[layer].astype(dtype)), _to_bsnh(cache.v_fp[layer].astype(dtype)),
                           jnp.broadcast_to(ring_len, (b,)), causal=False, impl=impl)
        acc = merge_attention(acc, ring)
    return acc[0].astype(dtype)


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
    # sum_s p vz as a product and a sum over the last axis, not a dot: with one value group per token
    # (n = 1) the dot is a matrix-vector product, which XLA:CPU sums in an order that depends on the query
    # row's index at some widths (3-7, 9, 10 columns: a row's bits then depend on the pass's other
    # columns, docs/QUALITY.md "Exactness"); a reduction over s sums every row alike.
    o_q = o_q + jnp.sum(p_q[..., None, :] * jnp.swapaxes(vz, -1, -2)[:, :, None, None], axis=-1)[..., None]
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


def query_operand_shape(q: Any, cache: DenseKVCache | QuantSpecCache, view: str,
                        impl: str) -> tuple[int, ...] | None:
    """The shape of the prepared query operand (`cache_attention(q_operand=...)`) this pass's
    kernel takes instead of q [B, T, Hq, D] (an array or its ShapeDtypeStruct), or None where
    `impl` resolves to no kernel that takes one."""
    if not uses_kernels(impl):
        return None
    import pallas_kernels

    return pallas_kernels.query_operand_shape(q, cache, view=view, impl=_kernel_impl(impl))


def cache_attention(q: Array, q_pos: Array, cache: DenseKVCache | QuantSpecCache, layer: Array,
                    view: str, impl: str, sliding_window: int | None, mesh: Any = None,
                    inputs: dict[str, Array] | None = None, q_operand: Array | None = None) -> Array:
    """Attention of new queries over one layer of `cache` (which already holds their K/V).

    `impl` is ModelConfig.attention_impl: "pallas" uses `pallas_kernels` (Mosaic GPU kernels on
    Hopper, Triton elsewhere), "mosaic" / "triton" force one of them, "reference" the jnp code
    above, "auto" picks the kernels on GPU and the jnp code elsewhere. With a tensor-parallel
    `mesh` the kernel runs per device on its local heads; the jnp code is partitioned by XLA.
    `inputs`: `attention_inputs(...)` of this pass (None: the kernels compute them per call).
    `q_operand`: the queries already in the kernel's operand layout (`query_operand_shape`), as
    the draft's fused qkv kernel writes them; q then gives only the shapes (single device).
    """
    if q_operand is not None and (mesh is not None and mesh.size > 1 or not uses_kernels(impl)):
        raise ValueError("q_operand: only the single-device attention kernels take a prepared query operand")
    if uses_kernels(impl):
        import pallas_kernels  # imported lazily: the CPU path needs no Triton

        def attend(q, q_pos, cache, layer, inputs):
            return pallas_kernels.cache_attention(q, q_pos, cache, layer, view=view, sliding_window=sliding_window,
                                                  impl=_kernel_impl(impl), inputs=inputs, q_operand=q_operand)

        if mesh is not None and mesh.size > 1:
            return spmd.sharded_cache_attention(attend, mesh, q, q_pos, cache, layer, inputs)
        return attend(q, q_pos, cache, layer, inputs)
    if isinstance(cache, QuantSpecCache):
        return quantized_cache_attention(q, q_pos, cache, layer, view, sliding_window)
    k_pos = jnp.broadcast_to(jnp.arange(cache.max_len, dtype=jnp.int32), (q.shape[0], cache.max_len))
    return dense_attention(q, cache.k[layer], cache.v[layer], q_pos, k_pos, sliding_window)
