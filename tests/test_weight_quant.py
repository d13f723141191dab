"""INT4 draft weights: error bound, packing, clipping search, quantized linear."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    y = qw.apply(x) if not lead else jax.vmap(lambda q, xx: q.apply(xx))(qw, x)
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
