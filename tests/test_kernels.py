"""Pallas (Triton) decode-attention kernels (interpret mode on CPU) against the jnp references.

The Mosaic GPU kernels have their own file (tests/test_attention_mgpu.py).

Caches are built through the public QuantSpecCache / DenseKVCache API with random data.
Compilation dominates the run time, so shapes are drawn from small sets and every kernel call
goes through one jitted function per static configuration.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from pallas_kernels.decode_attention import triton as da
from qspec_jax import attention as A
from qspec_jax import model as M
from qspec_jax.cache import DenseKVCache, QuantSpecCache
from qspec_jax.config import ModelConfig

# The Triton kernels' split counts as on a GPU of 8 SMs (conftest.few_sms): interpret mode runs
# every program in turn.
pytestmark = pytest.mark.usefixtures("few_sms")

F32_TOL = 1e-5
BF16_TOL = 2e-2


def _cfg(hkv=2, n_rep=2, d=64, layers=2, dtype="float32", impl="reference"):
    return ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=96, num_layers=layers,
                       num_heads=hkv * n_rep, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                       attention_impl=impl)


def _relerr(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "kernel output has NaN/inf"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


@functools.partial(jax.jit, static_argnames=("cfg", "batch", "max_len", "group", "gamma", "rounds", "round_t"))
def _build_quant_cache(key, prompt_lens, *, cfg, batch, max_len, group, gamma, rounds, round_t):
    cache = QuantSpecCache.init(cfg, batch, max_len, group_size=group, gamma_max=gamma, fp_dtype=jnp.float32)
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)  # right-padded prompts
    for l in range(cfg.num_layers):
        kk, vk = jax.random.split(jax.random.fold_in(key, l))
        cache = cache.prefill_layer(l, jax.random.normal(kk, shape) * 2.0 + 0.5, jax.random.normal(vk, shape),
                                    prompt_lens)
    cache = cache.finish_prefill(prompt_lens)

    def one_round(r, cache):
        shape = (batch, cfg.num_kv_heads, round_t, cfg.head_dim)
        for l in range(cfg.num_layers):
            kk, vk = jax.random.split(jax.random.fold_in(key, 1000 + r * cfg.num_layers + l))
            cache = cache.append_layer(l, jax.random.normal(kk, shape) * 2.0, jax.random.normal(vk, shape))
        return cache.advance(round_t).flush()

    return jax.lax.fori_loop(0, rounds, one_round, cache)


def build_quant_cache(key, cfg, batch, max_len, prompt_lens, group, *, gamma=4, rounds=0, round_t=3,
                      fp_dtype=jnp.float32):
    """A QuantSpecCache filled with random K/V through the public API: prefill of `prompt_lens`
    tokens, then `rounds` decoding rounds that append `round_t` tokens per row, commit them and
    flush (quantizing the oldest ring block of rows whose ring holds >= 2G tokens)."""
    cache = _build_quant_cache(key, jnp.asarray(prompt_lens, jnp.int32), cfg=cfg, batch=batch, max_len=max_len,
                               group=group, gamma=gamma, rounds=rounds, round_t=round_t)
    if jnp.dtype(fp_dtype) != jnp.float32:
        cache = cache.replace(k_fp=cache.k_fp.astype(fp_dtype), v_fp=cache.v_fp.astype(fp_dtype))
    return cache


def build_dense_cache(key, cfg, batch, max_len, lens, dtype=jnp.float32):
    cache = DenseKVCache.init(cfg, batch, max_len, dtype=dtype)
    keys = jax.random.split(key, 2 * cfg.num_layers)
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    for l in range(cfg.num_layers):  # fill every slot: garbage past a row's end must stay masked
        cache = cache.prefill_layer(l, jax.random.normal(keys[2 * l], shape), jax.random.normal(keys[2 * l + 1], shape),
                                    jnp.asarray(lens))
    return cache.finish_prefill(jnp.asarray(lens, jnp.int32))


@functools.partial(jax.jit, static_argnames=("view", "window", "partials", "config"))
def _kernel(q, q_pos, cache, layer, view="target", window=None, partials=False, config=None):
    if partials:
        return pk.quantized_decode_attention(q, q_pos, cache, layer, view=view, sliding_window=window,
                                             interpret=True, return_partials=True, config=config)
    if config is not None:
        return pk.quantized_decode_attention(q, q_pos, cache, layer, view=view, sliding_window=window,
                                             interpret=True, config=config)
    return pk.cache_attention(q, q_pos, cache, layer, view=view, sliding_window=window, interpret=True)


@functools.partial(jax.jit, static_argnames=("view", "window"))
def _reference(q, q_pos, cache, layer, view="target", window=None):
    if isinstance(cache, QuantSpecCache):
        return A.quantized_cache_attention(q, q_pos, cache, layer, view, window)
    k_pos = jnp.broadcast_to(jnp.arange(cache.max_len, dtype=jnp.int32), (q.shape[0], cache.max_len))
    return A.dense_attention(q, cache.k[layer], cache.v[layer], q_pos, k_pos, window)


def _queries(key, cache, t, hq, d, dtype):
    """Random queries at the positions of the last t committed tokens of each row (their K/V are
    in the cache, as in the model, where append_layer runs before attention)."""
    q = jax.random.normal(key, (cache.total_lengths().shape[0], t, hq, d)).astype(dtype)
    q_pos = cache.total_lengths()[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
    return q, jnp.maximum(q_pos, 0)


def _check(cache, t, n_rep, dtype, view, layer=1, window=None, seed=0):
    hkv, d = cache.k_fp.shape[2], cache.k_fp.shape[4]
    q, q_pos = _queries(jax.random.PRNGKey(seed), cache, t, hkv * n_rep, d, dtype)
    out = _kernel(q, q_pos, cache, jnp.int32(layer), view=view, window=window)
    ref = _reference(q, q_pos, cache, jnp.int32(layer), view=view, window=window)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = _relerr(out, ref)
    assert err <= (F32_TOL if dtype == jnp.float32 else BF16_TOL), err
    return err


# ----------------------------------------------------------------------- quantized kernel
# One cache geometry (B=4, S=64, G=16, Hkv=2, D=64, L=2) for most tests, so that the jitted kernel
# and reference compile once per (n_rep, T, dtype, view): compilation dominates the run time.
S_MAX, GROUP, BATCH = 128, 32, 4


@functools.lru_cache(maxsize=None)
def shared_cache(fp_dtype: str, seed: int = 0) -> QuantSpecCache:
    """Rows: q_len = 0 with fp_len = 1; ring tokens only; the cache full of quantized tokens
    (q_len = max_len); an ordinary mixed row. Decoding rounds wrap the ring of some rows."""
    cfg = _cfg(hkv=2, n_rep=1)
    return build_quant_cache(jax.random.PRNGKey(seed), cfg, BATCH, S_MAX, [1, 40, S_MAX, 90], GROUP,
                             rounds=8, round_t=4, fp_dtype=fp_dtype)


@functools.lru_cache(maxsize=None)
def fresh_cache(seed: int) -> QuantSpecCache:
    """Same geometry, right after prefill of random mixed lengths (includes q_len = 0 rows)."""
    cfg = _cfg(hkv=2, n_rep=1)
    lens = np.random.default_rng(seed).integers(1, S_MAX + 1, BATCH).tolist()
    return build_quant_cache(jax.random.PRNGKey(seed), cfg, BATCH, S_MAX, lens, GROUP)


@pytest.mark.slow
def test_shared_cache_covers_edge_rows():
    cache = shared_cache("float32")
    q_len, fp_len = np.asarray(cache.q_len), np.asarray(cache.fp_len)
    assert q_len.max() == S_MAX and (q_len == 0).any() and (fp_len >= 1).all(), (q_len, fp_len)
    assert (np.asarray(cache.fp_start) > 0).any()  # the ring has wrapped for some row
    fresh = build_quant_cache(jax.random.PRNGKey(0), _cfg(hkv=2), BATCH, S_MAX, [1, 1, 5, 90], GROUP)
    assert np.asarray(fresh.q_len).tolist()[:2] == [0, 0] and np.asarray(fresh.fp_len).tolist()[:2] == [1, 1]


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    view=st.sampled_from(["draft", "target"]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    t=st.sampled_from([1, 5]),
    n_rep=st.sampled_from([3, 4]),
    which=st.sampled_from(["shared", "fresh"]),
    seed=st.integers(0, 3),
)
def test_quantized_kernel_matches_reference(view, dtype, t, n_rep, which, seed):
    """Random shapes and data; fp32 <= 1e-5 and bf16 <= 2e-2 relative error. T = 5 = gamma + 1
    exercises the causal mask inside the ring; n_rep = 3 the padded rows."""
    if which == "shared":
        cache = shared_cache("float32" if dtype == jnp.float32 else "bfloat16", seed % 2)
    else:
        cache = fresh_cache(seed)
    _check(cache, t, n_rep, dtype, view, seed=seed)


@pytest.mark.parametrize("view", ["draft", "target"])
def test_edge_rows_float32(view):
    """q_len = 0, fp_len = 1, q_len = max_len, ring-only and mixed rows in one batch, T = 1 and
    T = gamma + 1 (the n_rep = 3 configurations the hypothesis test may also draw)."""
    _check(shared_cache("float32"), 5, 3, jnp.float32, view)


def test_head_dim_128_group_64():
    cfg = _cfg(hkv=1, n_rep=4, d=128, layers=1)
    cache = build_quant_cache(jax.random.PRNGKey(3), cfg, 2, 256, [250, 140], 64, gamma=8,
                              fp_dtype=jnp.bfloat16)  # G = 64, D = 128: the cache byte order is in play
    _check(cache, 1, 4, jnp.bfloat16, "draft", layer=0)
    _check(cache, 7, 4, jnp.float32, "target", layer=0)  # 28 rows: two row tiles


def test_magic_number_codes_match_on_cpu():
    """The float16 magic-number operand path (opt-in: it failed the compiled H100 check, see
    KernelConfig.codes) still computes the reference on the CPU."""
    cache = shared_cache("bfloat16")
    q, q_pos = _queries(jax.random.PRNGKey(3), cache, 1, 8, 64, jnp.bfloat16)
    for view in ("draft", "target"):
        out = _kernel(q, q_pos, cache, jnp.int32(1), view=view, config=pk.KernelConfig(codes="magic"))
        assert _relerr(out, _reference(q, q_pos, cache, jnp.int32(1), view=view)) <= BF16_TOL


def test_sliding_window_masks():
    _check(shared_cache("float32"), 5, 3, jnp.float32, "target", window=23)


def test_partials_written_and_neutral():
    """Every partial is written (interpret mode fills outputs with NaN before the run, so an
    unwritten element stays NaN), and splits past q_len / unused ring programs are neutral."""
    cfg = _cfg(hkv=2, n_rep=4)
    cache = build_quant_cache(jax.random.PRNGKey(5), cfg, 2, 256, [70, 230], 32)
    q, q_pos = _queries(jax.random.PRNGKey(6), cache, 1, 8, 64, jnp.float32)
    o, m, l = _kernel(q, q_pos, cache, jnp.int32(0), view="draft", partials=True,
                      config=pk.KernelConfig(num_splits=8, ring_splits=2))
    o, m, l = map(np.asarray, (o, m, l))
    assert np.isfinite(o).all() and np.isfinite(m).all() and np.isfinite(l).all()
    neutral = l == 0
    assert neutral[0].any(), "row 0 has 32 quantized tokens: most of its splits must be empty"
    assert (m[neutral] == da.NEG).all() and (o[neutral] == 0).all()
    assert (l[1, :, 0] > 0).any(), "row 1's first split holds tokens"


def test_interpret_mode_poisons_outputs():
    """The premise of test_partials_written_and_neutral: an output element that a kernel does not
    write comes back NaN in interpret mode."""
    from jax.experimental import pallas as pl

    def kernel(o_ref):
        o_ref[0] = 1.0

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((2,), jnp.float32), interpret=True)()
    assert out[0] == 1.0 and np.isnan(np.asarray(out)[1])


def test_unsupported_shapes_raise():
    cfg = _cfg(hkv=2, n_rep=2, d=32, layers=1)
    cache = QuantSpecCache.init(cfg, 1, 64, group_size=16)
    q = jnp.zeros((1, 1, 4, 32))
    with pytest.raises(ValueError, match="head_dim"):
        pk.cache_attention(q, jnp.zeros((1, 1), jnp.int32), cache, 0, view="draft", interpret=True)
    cfg = _cfg(hkv=1, n_rep=8, d=64, layers=1)
    cache = QuantSpecCache.init(cfg, 1, 64, group_size=16)
    with pytest.raises(ValueError, match="rows"):
        pk.cache_attention(jnp.zeros((1, 17, 8, 64)), jnp.zeros((1, 17), jnp.int32), cache, 0, view="draft",
                           interpret=True)
    with pytest.raises(ValueError, match="view"):
        pk.cache_attention(jnp.zeros((1, 1, 8, 64)), jnp.zeros((1, 1), jnp.int32), cache, 0, view="int4",
                           interpret=True)


# --------------------------------------------------------------------------- dense kernel
@pytest.mark.parametrize("dtype,t,n_rep", [(jnp.float32, 5, 3), (jnp.bfloat16, 1, 4)])
def test_dense_kernel_matches_reference(dtype, t, n_rep):
    cfg = _cfg(hkv=2, n_rep=n_rep)
    cache = build_dense_cache(jax.random.PRNGKey(7), cfg, 3, 96, [96, 1, 50], dtype=dtype)
    hq, d = cfg.num_heads, cfg.head_dim
    q = jax.random.normal(jax.random.PRNGKey(8), (3, t, hq, d)).astype(dtype)
    q_pos = jnp.maximum(cache.lengths[:, None] - t + jnp.arange(t)[None, :], 0).astype(jnp.int32)
    out = _kernel(q, q_pos, cache, jnp.int32(1))
    ref = _reference(q, q_pos, cache, jnp.int32(1))
    assert _relerr(out, ref) <= (F32_TOL if dtype == jnp.float32 else BF16_TOL)
    if dtype == jnp.float32:
        win = _kernel(q, q_pos, cache, jnp.int32(1), window=20)
        assert _relerr(win, _reference(q, q_pos, cache, jnp.int32(1), window=20)) <= F32_TOL


@pytest.mark.parametrize("t,n_rep", [(1, 4), (5, 3)])
def test_dense_kernel_takes_a_prepared_query_operand(t, n_rep):
    """Given its queries as the bf16 operand [B, Hkv, D, CN] a fused q|k|v kernel writes
    (`dense_operand_shape`: column t n_rep + r holds query head h n_rep + r of token t, the rest
    zero), the dense kernel computes bit for bit what it computes from q, through
    `cache_attention` too (`query_operand_shape` gives the shape for a bf16 dense cache); an
    operand of another shape or dtype is refused by name."""
    cfg = _cfg(hkv=2, n_rep=n_rep)
    cache = build_dense_cache(jax.random.PRNGKey(7), cfg, 3, 96, [96, 9, 50], dtype=jnp.bfloat16)
    b, hq, d = 3, cfg.num_heads, cfg.head_dim
    q = jax.random.normal(jax.random.PRNGKey(8), (b, t, hq, d)).astype(jnp.bfloat16)
    q_pos = jnp.maximum(cache.lengths[:, None] - t + jnp.arange(t)[None, :], 0).astype(jnp.int32)
    shape = pk.query_operand_shape(q, cache, view="target")
    assert shape == pk.dense_operand_shape(q.shape, 2) == (b, 2, d, 16 * -(-t * n_rep // 16))
    cols = jnp.transpose(q.reshape(b, t, 2, n_rep, d), (0, 2, 4, 1, 3)).reshape(b, 2, d, t * n_rep)
    operand = jnp.zeros(shape, jnp.bfloat16).at[..., :t * n_rep].set(cols)
    want = np.asarray(_kernel(q, q_pos, cache, jnp.int32(1)))
    got = pk.dense_decode_attention(q, q_pos, cache.k, cache.v, jnp.int32(1), interpret=True, q_operand=operand)
    np.testing.assert_array_equal(np.asarray(got), want)
    got = pk.cache_attention(q, q_pos, cache, jnp.int32(1), interpret=True, q_operand=operand)
    np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="q_operand must be bfloat16"):
        pk.dense_decode_attention(q, q_pos, cache.k, cache.v, 1, interpret=True, q_operand=operand[..., :-1])
    with pytest.raises(ValueError, match="q_operand must be bfloat16"):
        pk.dense_decode_attention(q, q_pos, cache.k, cache.v, 1, interpret=True,
                                  q_operand=operand.astype(jnp.float32))
    assert pk.query_operand_shape(q.astype(jnp.float32), cache, view="target") is None


def test_dense_partials_past_length_are_neutral():
    cfg = _cfg(hkv=1, n_rep=2, layers=1)
    cache = build_dense_cache(jax.random.PRNGKey(9), cfg, 1, 1024, [30])
    q = jax.random.normal(jax.random.PRNGKey(10), (1, 1, 2, 64))
    o, m, l = pk.dense_decode_attention(q, cache.lengths[:, None] - 1, cache.k, cache.v, 0, interpret=True,
                                        return_partials=True)
    l = np.asarray(l)
    assert np.isfinite(np.asarray(o)).all() and (l[:, :, 1:] == 0).all() and (l[:, :, 0, :2] > 0).all()


# ------------------------------------------------------------------------- through the model
def test_lowering_passes_whole_stacked_cache():
    """Lowered for CUDA (Triton IR is generated on the CPU too): the big planes reach the
    pallas_call as the jitted function's own parameters, with no dynamic-slice of a layer."""
    cfg = _cfg(hkv=8, n_rep=4, d=128, layers=4, dtype="bfloat16")
    cache = jax.eval_shape(lambda: QuantSpecCache.init(cfg, 1, 4096))
    q = jax.ShapeDtypeStruct((1, 1, 32, 128), jnp.bfloat16)
    qp = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    for view in ("draft", "target"):
        f = lambda q, qp, c, l: pk.cache_attention(q, qp, c, l, view=view, interpret=False, impl="triton")  # noqa: E731
        txt = jax.jit(f).trace(q, qp, cache, jax.ShapeDtypeStruct((), jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in txt
        assert "dynamic_slice" not in txt and "stablehlo.slice" not in txt.split("xla.gpu.triton")[0][-2000:]
        call = txt[txt.index("@__gpu$xla.gpu.triton("):]
        call = call[: call.index(")")]
        # Row-major reshapes of whole arguments (value planes viewed as [.., S/G * D, G/2], value
        # scales as [.., S]) are bitcasts, not copies: count them as arguments.
        reshaped = set(re.findall(r"(%\S+) = stablehlo.reshape %arg", txt))
        operands = re.findall(r"%[\w#]+", call)
        direct = [o for o in operands if o.startswith("%arg") or o.split("#")[0] in reshaped]
        planes = 4 if view == "target" else 2
        # k_hi, (k_lo,) v_hi, (v_lo,), scales, zeros, ring: all function arguments.
        assert len(direct) >= planes + 6, call


@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_model_decode_pallas_matches_reference(kind):
    cfg_ref = _cfg(hkv=2, n_rep=2, layers=2, dtype="float32", impl="reference")
    cfg_pal = cfg_ref.replace(attention_impl="pallas")
    params = M.init_random_params(cfg_ref, jax.random.PRNGKey(11), scale=0.2)
    b, prompt = 2, 80
    tokens = jax.random.randint(jax.random.PRNGKey(12), (b, prompt), 0, cfg_ref.vocab_size)
    lengths = jnp.asarray([80, 45], jnp.int32)  # q_len 32 and 0
    if kind == "int8":
        cache = QuantSpecCache.init(cfg_ref, b, 128, group_size=32, gamma_max=4)
    else:
        cache = DenseKVCache.init(cfg_ref, b, 96)
    _, cache = jax.jit(M.prefill)(params, tokens, lengths, cache)
    step = jax.random.randint(jax.random.PRNGKey(13), (b, 5), 0, cfg_ref.vocab_size)
    for view in ("target",):  # the draft view's kernel path is covered above
        outs = {}
        for name, cfg in (("ref", cfg_ref), ("pallas", cfg_pal)):
            p = M.Params(params.embed, params.layers, params.final_norm, params.lm_head, cfg)
            logits, new_cache = jax.jit(functools.partial(M.decode, view=view))(p, step, cache)
            outs[name] = (np.asarray(logits), new_cache)
        assert _relerr(outs["pallas"][0], outs["ref"][0]) <= 1e-4


# ------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("view", ["draft", "target"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantized_kernel_row_independent_of_T_bitwise(dtype, view):
    """T = 1 at position p and T = 5 covering p..p+4 give bit-identical rows for p: the row tile,
    splits and merge order never depend on T (issue 11)."""
    cache = shared_cache("float32" if dtype == jnp.float32 else "bfloat16")
    b = cache.q_len.shape[0]
    q5 = jax.random.normal(jax.random.PRNGKey(21), (b, 5, 6, 64)).astype(dtype)
    pos5 = jnp.maximum(cache.total_lengths()[:, None] - 5, 0) + jnp.arange(5, dtype=jnp.int32)[None, :]
    o5 = np.asarray(_kernel(q5, pos5, cache, jnp.int32(1), view=view).astype(jnp.float32))
    o1 = np.asarray(_kernel(q5[:, :1], pos5[:, :1], cache, jnp.int32(1), view=view).astype(jnp.float32))
    np.testing.assert_array_equal(o1[:, 0], o5[:, 0])


def test_dense_kernel_row_independent_of_T_bitwise():
    cfg = _cfg(hkv=2, n_rep=3)
    cache = build_dense_cache(jax.random.PRNGKey(22), cfg, 2, 96, [96, 40], dtype=jnp.bfloat16)
    q5 = jax.random.normal(jax.random.PRNGKey(23), (2, 5, 6, 64)).astype(jnp.bfloat16)
    pos5 = cache.lengths[:, None] - 5 + jnp.arange(5, dtype=jnp.int32)[None, :]
    o5 = np.asarray(_kernel(q5, pos5, cache, jnp.int32(0)).astype(jnp.float32))
    o1 = np.asarray(_kernel(q5[:, :1], pos5[:, :1], cache, jnp.int32(0)).astype(jnp.float32))
    np.testing.assert_array_equal(o1[:, 0], o5[:, 0])
