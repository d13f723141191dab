"""Reference attention (SPEC §5).

- `dense_attention` against a naive per-query-head numpy implementation that repeats K/V.
- `quantized_cache_attention` (the folded-scale form: q·s per key block, bias q·z, p·s per value
  token, Σ p z) against `dense_attention` over the cache's dequantized K/V concatenated with the
  FP ring in logical position order, for caches built through the public API.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qspec_jax.attention import cache_attention, dense_attention, quantized_cache_attention
from qspec_jax.cache import DenseKVCache, QuantSpecCache
from qspec_jax.config import ModelConfig

HEAD_DIM = 16
GROUP = 8
GAMMA_MAX = 4  # T = gamma + 1 = 5 verify tokens
MAX_LEN = 64
PROMPT_PAD = 40
PAD_POS = 2**30  # k_pos of padding keys: never visible

_dense = jax.jit(dense_attention, static_argnames=("sliding_window",))
_qattn = jax.jit(quantized_cache_attention, static_argnames=("view", "sliding_window"))


def make_cfg(hkv: int, n_rep: int, num_layers: int = 2) -> ModelConfig:
    return ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=num_layers,
                       num_heads=hkv * n_rep, num_kv_heads=hkv, head_dim=HEAD_DIM, dtype="float32")


def random_kv(rng: np.random.Generator, shape, outliers: float = 0.02) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < outliers] *= 30.0
    return x


# ------------------------------------------------------------------------- naive dense oracle
def naive_attention(q, k, v, q_pos, k_pos, sliding_window=None):
    """float64 per-head loops; K/V repeated per query head (head h uses KV head h // n_rep)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, t_, hq, d = q.shape
    hkv = k.shape[1]
    n_rep = hq // hkv
    k_rep = np.repeat(k, n_rep, axis=1)  # [B, Hq, S, D]
    v_rep = np.repeat(v, n_rep, axis=1)
    out = np.zeros_like(q)
    any_visible = np.zeros((b_, t_), bool)
    for b in range(b_):
        for t in range(t_):
            vis = k_pos[b] <= q_pos[b, t]
            if sliding_window is not None:
                vis &= q_pos[b, t] - k_pos[b] < sliding_window
            any_visible[b, t] = vis.any()
            if not vis.any():
                continue
            for h in range(hq):
                s = k_rep[b, h, vis] @ q[b, t, h] / np.sqrt(d)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, t, h] = p @ v_rep[b, h, vis]
    return out, any_visible


@settings(max_examples=40, deadline=None)
@given(hkv=st.sampled_from([1, 2]), n_rep=st.sampled_from([1, 3]), t=st.sampled_from([1, 5]),
       window=st.sampled_from([None, 4]), seed=st.integers(0, 2**32 - 1))
def test_dense_attention_matches_naive_repeated_kv(hkv, n_rep, t, window, seed):
    rng = np.random.default_rng(seed)
    b, s, d = 3, 12, HEAD_DIM
    q = rng.standard_normal((b, t, hkv * n_rep, d)).astype(np.float32) * 2
    k = random_kv(rng, (b, hkv, s, d))
    v = random_kv(rng, (b, hkv, s, d))
    # Shuffled key positions, some past every query (garbage slots), and one row with none visible.
    k_pos = np.stack([rng.permutation(s) for _ in range(b)]).astype(np.int32) + 3
    k_pos[1, rng.random(s) < 0.3] = 10**6
    q_pos = np.sort(rng.integers(3, s + 4, size=(b, t)), axis=1).astype(np.int32)
    q_pos[2] = np.arange(t)  # row 2: keys at positions >= 3 are invisible to queries 0..2
    got = np.asarray(_dense(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(q_pos),
                            jnp.asarray(k_pos), sliding_window=window))
    want, vis = naive_attention(q, k, v, q_pos, k_pos, window)
    assert got.shape == q.shape and got.dtype == np.float32
    assert np.all(np.isfinite(got))  # fully masked rows give finite garbage, never NaN
    scale = np.abs(v).max()
    np.testing.assert_allclose(got[vis], want[vis], rtol=1e-5, atol=1e-5 * scale)


def test_dense_attention_bf16_values():
    """P·V with P in V's dtype (bf16), accumulated in float32: close to the float64 oracle."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 5, 6, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((2, 2, 20, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((2, 2, 20, HEAD_DIM)).astype(np.float32)
    v_bf = jnp.asarray(v, jnp.bfloat16)
    k_pos = np.tile(np.arange(20, dtype=np.int32), (2, 1))
    q_pos = np.tile(np.arange(15, 20, dtype=np.int32), (2, 1))
    got = np.asarray(dense_attention(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), v_bf,
                                     jnp.asarray(q_pos), jnp.asarray(k_pos)).astype(jnp.float32))
    want, _ = naive_attention(np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32)),
                              np.asarray(jnp.asarray(k, jnp.bfloat16).astype(jnp.float32)),
                              np.asarray(v_bf.astype(jnp.float32)), q_pos, k_pos)
    np.testing.assert_allclose(got, want, atol=3e-2)


# ------------------------------------------------------------------- cache built by the public API
@jax.jit
def _prefill(cache, k, v, lengths):
    for layer in range(k.shape[0]):
        cache = cache.prefill_layer(jnp.asarray(layer), k[layer], v[layer], lengths)
    return cache.finish_prefill(lengths)


@jax.jit
def _append(cache, k, v):
    for layer in range(k.shape[0]):
        cache = cache.append_layer(layer, k[layer], v[layer])
    return cache


_commit_flush = jax.jit(lambda c, lengths: c.rollback(lengths).flush())
_dequant = jax.jit(lambda c, layer, view: c.dequantized_layer(layer, view), static_argnums=(1, 2))


def build_cache(rng, cfg, prompt_lens, rounds, t, scale_dtype):
    """Prefill (with loud padding), a few rounds of append/partial-accept/flush, then append t
    new tokens (uncommitted) whose queries the test computes."""
    L, H, B = cfg.num_layers, cfg.num_kv_heads, len(prompt_lens)
    cache = QuantSpecCache.init(cfg, B, MAX_LEN, group_size=GROUP, gamma_max=GAMMA_MAX,
                                scale_dtype=scale_dtype, fp_dtype=jnp.float32)
    p = np.asarray(prompt_lens, np.int32)
    k = random_kv(rng, (L, B, H, PROMPT_PAD, HEAD_DIM))
    v = random_kv(rng, (L, B, H, PROMPT_PAD, HEAD_DIM))
    for b in range(B):
        k[:, b, :, p[b]:] = 1e4  # padding: must never be attended
        v[:, b, :, p[b]:] = -1e4
    cache = _prefill(cache, jnp.asarray(k), jnp.asarray(v), jnp.asarray(p))
    for accept in rounds:  # accept: [B] tokens kept of GAMMA_MAX + 1 appended
        kk = random_kv(rng, (L, B, H, GAMMA_MAX + 1, HEAD_DIM))
        vv = random_kv(rng, (L, B, H, GAMMA_MAX + 1, HEAD_DIM))
        cache = _append(cache, jnp.asarray(kk), jnp.asarray(vv))
        cache = _commit_flush(cache, cache.total_lengths() + jnp.asarray(accept, jnp.int32))
    kk = random_kv(rng, (L, B, H, t, HEAD_DIM))
    vv = random_kv(rng, (L, B, H, t, HEAD_DIM))
    return _append(cache, jnp.asarray(kk), jnp.asarray(vv))


def logical_kv(cache, layer: int, view: str, t: int):
    """Per row: dequantized K/V of positions < q_len, then ring entries in position order
    (committed ones and the t just-appended ones), padded to a common length."""
    kq, vq = (np.asarray(a) for a in _dequant(cache, layer, view))
    k_fp, v_fp = np.asarray(cache.k_fp[layer]), np.asarray(cache.v_fp[layer])
    q_len, fp_len, start = (np.asarray(a) for a in (cache.q_len, cache.fp_len, cache.fp_start))
    r = cache.ring_size
    B, H = kq.shape[:2]
    n = q_len + fp_len + t
    s_pad = MAX_LEN  # fixed, so the dense reference compiles once per query shape
    assert n.max() <= s_pad
    k_full = np.zeros((B, H, s_pad, HEAD_DIM), np.float32)
    v_full = np.zeros_like(k_full)
    k_pos = np.full((B, s_pad), PAD_POS, np.int32)
    for b in range(B):
        qb = int(q_len[b])
        slots = (start[b] + np.arange(fp_len[b] + t)) % r
        k_full[b, :, : n[b]] = np.concatenate([kq[b, :, :qb], k_fp[b][:, slots]], axis=1)
        v_full[b, :, : n[b]] = np.concatenate([vq[b, :, :qb], v_fp[b][:, slots]], axis=1)
        k_pos[b, : n[b]] = np.arange(n[b])
    return k_full, v_full, k_pos


# Rows: empty (q_len = 0, fp_len = 0), ring only, ring only with >= G tokens, several quantized
# blocks; the prompt of each row is drawn from its own small set.
ROW_PROMPTS = [[0, 3], [5, 7], [8, 12, 15], [19, 33, 40]]


prompts_st = st.tuples(*[st.sampled_from(c) for c in ROW_PROMPTS])
rounds_st = st.lists(st.lists(st.integers(0, GAMMA_MAX + 1), min_size=4, max_size=4), max_size=3)


# (Hkv, scale dtype) are drawn as pairs and the sliding window is a separate test: every distinct
# combination is a compile of the attention and of the cache ops.
@pytest.mark.slow
@settings(max_examples=24, deadline=None)
@given(hkv_sd=st.sampled_from([(1, "float32"), (2, "float16")]), n_rep=st.sampled_from([1, 3]),
       t=st.sampled_from([1, 5]), prompts=prompts_st, rounds=rounds_st, seed=st.integers(0, 2**32 - 1))
def test_quantized_cache_attention_matches_dense_over_dequantized(hkv_sd, n_rep, t, prompts, rounds, seed):
    hkv, sd = hkv_sd
    check_against_dense(hkv, n_rep, t, sd, None, prompts, rounds, seed)


@settings(max_examples=8, deadline=None)
@given(t=st.sampled_from([1, 5]), prompts=prompts_st, rounds=rounds_st, seed=st.integers(0, 2**32 - 1))
def test_quantized_cache_attention_sliding_window(t, prompts, rounds, seed):
    check_against_dense(2, 3, t, "float16", 11, prompts, rounds, seed)


def check_against_dense(hkv, n_rep, t, sd, window, prompts, rounds, seed):
    rng = np.random.default_rng(seed)
    cfg = make_cfg(hkv, n_rep)
    cache = build_cache(rng, cfg, prompts, rounds, t, jnp.dtype(sd))
    total = np.asarray(cache.total_lengths())
    assert np.all(total + t <= MAX_LEN)
    q_pos = (total[:, None] + np.arange(t)[None, :]).astype(np.int32)  # the t appended tokens
    q = rng.standard_normal((len(prompts), t, cfg.num_heads, HEAD_DIM)).astype(np.float32) * 2
    for layer in range(cfg.num_layers):
        for view in ("draft", "target"):
            got = np.asarray(_qattn(jnp.asarray(q), jnp.asarray(q_pos), cache, layer, view=view,
                                    sliding_window=window))
            k_full, v_full, k_pos = logical_kv(cache, layer, view, t)
            want = np.asarray(_dense(jnp.asarray(q), jnp.asarray(k_full), jnp.asarray(v_full), jnp.asarray(q_pos),
                                     jnp.asarray(k_pos), sliding_window=window))
            assert got.shape == q.shape and np.all(np.isfinite(got))
            scale = np.abs(v_full).max()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=5e-6 * scale,
                                       err_msg=f"layer {layer} view {view} prompts {prompts}")
            # And the float64 oracle agrees (guards against a shared error in both f32 paths).
            want64, _ = naive_attention(q, k_full, v_full, q_pos, k_pos, window)
            np.testing.assert_allclose(got, want64, rtol=1e-4, atol=1e-5 * scale)


def test_draft_and_target_views_differ_and_target_is_closer():
    """The draft reads only upper nibbles: its output differs from the target's and is farther
    from attention over the exact (unquantized) keys and values."""
    rng = np.random.default_rng(1)
    cfg = make_cfg(2, 3, num_layers=1)
    B, H, P = 2, 2, 40
    cache = QuantSpecCache.init(cfg, B, MAX_LEN, group_size=GROUP, gamma_max=GAMMA_MAX, fp_dtype=jnp.float32)
    k = rng.standard_normal((1, B, H, P, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((1, B, H, P, HEAD_DIM)).astype(np.float32)
    cache = _prefill(cache, jnp.asarray(k), jnp.asarray(v), jnp.full((B,), P, jnp.int32))
    q = rng.standard_normal((B, 1, 6, HEAD_DIM)).astype(np.float32) * 2
    q_pos = jnp.full((B, 1), P - 1, jnp.int32)
    exact = np.asarray(_dense(jnp.asarray(q), jnp.asarray(k[0]), jnp.asarray(v[0]), q_pos,
                                       jnp.tile(jnp.arange(P, dtype=jnp.int32), (B, 1))))
    d = np.asarray(_qattn(jnp.asarray(q), q_pos, cache, 0, view="draft"))
    t = np.asarray(_qattn(jnp.asarray(q), q_pos, cache, 0, view="target"))
    assert np.abs(d - t).max() > 1e-4
    assert np.abs(t - exact).max() < np.abs(d - exact).max()
    assert np.abs(t - exact).max() < 0.05


def test_quantized_cache_attention_rejects_unknown_view():
    cfg = make_cfg(1, 1, num_layers=1)
    cache = QuantSpecCache.init(cfg, 1, MAX_LEN, group_size=GROUP, gamma_max=GAMMA_MAX)
    with pytest.raises(ValueError):
        quantized_cache_attention(jnp.zeros((1, 1, 1, HEAD_DIM)), jnp.zeros((1, 1), jnp.int32), cache, 0, "int2")


def test_cache_attention_reference_dispatch():
    """impl="reference" on CPU: QuantSpecCache -> quantized_cache_attention; dense -> dense_attention."""
    rng = np.random.default_rng(2)
    cfg = make_cfg(2, 3)
    cache = build_cache(rng, cfg, [0, 5, 12, 40], [[5, 1, 0, 3]], 5, jnp.float16)
    total = cache.total_lengths()
    q_pos = total[:, None] + jnp.arange(5, dtype=jnp.int32)[None, :]
    q = jnp.asarray(rng.standard_normal((4, 5, 6, HEAD_DIM)), jnp.float32)
    dispatch = jax.jit(cache_attention, static_argnums=(4, 5, 6))
    for view in ("draft", "target"):
        a = dispatch(q, q_pos, cache, jnp.asarray(1), view, "reference", None)
        b = _qattn(q, q_pos, cache, 1, view=view)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)

    dense = DenseKVCache.init(cfg, 2, 16)
    kd = jnp.asarray(rng.standard_normal((2, 2, 7, HEAD_DIM)), jnp.float32)
    dense = dense.prefill_layer(0, kd, kd, jnp.asarray([7, 4])).finish_prefill(jnp.asarray([7, 4]))
    qd = q[:2, :1]
    qp = dense.total_lengths()[:, None] - 1
    a = dispatch(qd, qp, dense, jnp.asarray(0), "target", "reference", None)
    b = _dense(qd, dense.k[0], dense.v[0], qp, jnp.tile(jnp.arange(16, dtype=jnp.int32), (2, 1)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_reference_attention_computes_each_query_column_alike():
    """Every query column's result is the same bits whatever the pass's width and the
    other columns' queries: what makes a verify pass of gamma_max + 1 columns compute a position as
    autoregressive decoding at that width does, at any gamma_max (docs/QUALITY.md, "Exactness"). The
    exactness tests' head shape (6 query heads over 2 KV heads of 64 channels, one value group per token):
    with the value zero's sum written as a matrix-vector product, XLA:CPU gave the 3rd and later columns
    other bits at widths 3-7, 9 and 10."""
    hkv, n_rep, d, g = 2, 3, 64, 16
    cfg = ModelConfig(vocab_size=32, hidden_size=hkv * n_rep * d, intermediate_size=64, num_layers=1,
                      num_heads=hkv * n_rep, num_kv_heads=hkv, head_dim=d, dtype="float32")
    rng = np.random.default_rng(7)
    batch, n = 3, 150
    k = jnp.asarray(random_kv(rng, (batch, hkv, n, d)))
    v = jnp.asarray(random_kv(rng, (batch, hkv, n, d)))
    q_cache = QuantSpecCache.init(cfg, batch, 192, group_size=g, gamma_max=7)
    lengths = jnp.full((batch,), n, jnp.int32)
    q_cache = q_cache.prefill_layer(0, k, v, lengths).finish_prefill(lengths)  # 128 quantized + 22 ring tokens
    assert int(q_cache.q_len[0]) == 128
    k_pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
    # each view jitted as decode's layer sees it: the layer a constant, the cache an argument
    views = {view: jax.jit(lambda q, p, c, view=view: quantized_cache_attention(q, p, c, 0, view))
             for view in ("target", "draft")}
    dense = jax.jit(lambda q, p, k, v: dense_attention(q, k, v, p, k_pos))
    runs = {"target": lambda q, p: views["target"](q, p, q_cache), "draft": lambda q, p: views["draft"](q, p, q_cache),
            "dense": lambda q, p: dense(q, p, k, v)}
    for name, run in runs.items():
        for width in (1, 3, 4, 5, 7, 8):
            pos = jnp.full((batch, width), n - 1, jnp.int32)
            q = jnp.asarray(rng.standard_normal((batch, width, hkv * n_rep, d)), jnp.float32)
            full = np.asarray(run(q, pos))
            for i in range(width):  # column i's query moved to column 0 among other random queries
                other = jnp.asarray(rng.standard_normal(q.shape), jnp.float32).at[:, 0].set(q[:, i])
                np.testing.assert_array_equal(np.asarray(run(other, pos))[:, 0], full[:, i],
                                              err_msg=f"{name}: column {i} of a pass of {width}")
