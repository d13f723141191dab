"""The model's building blocks against their definitions (HF parity of whole models: test_parity_hf.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qspec_jax import model as M


def _inputs(dtype):
    kx, kg, kw = jax.random.split(jax.random.PRNGKey(0), 3)
    x = (3.0 * jax.random.normal(kx, (2, 3, 64), jnp.float32)).astype(dtype)
    x = x.at[1, 2].multiply(40.0)  # rows of very different RMS: the row scale must be per row
    g = (1.0 + 0.5 * jax.random.normal(kg, (64,), jnp.float32)).astype(dtype)
    w = (0.1 * jax.random.normal(kw, (64, 48), jnp.float32)).astype(dtype)
    return x, g, w


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_normed_product_is_rms_norm_then_the_product(dtype, tol):
    """`normed_product`'s folded form r ((x g) W) is RMSNorm(x) W (`rms_norm`, as HF Llama, then
    the product): to float32 rounding in float32, within a few bf16 steps in bfloat16."""
    x, g, w = _inputs(dtype)
    xg, scale = M.normed_product(x, g, 1e-5)
    got = scale(xg @ w)
    want = M.rms_norm(x, g, 1e-5) @ w
    assert got.dtype == x.dtype and got.shape == want.shape
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    scale_ref = np.abs(np.asarray(want, np.float64)).max(axis=-1, keepdims=True)  # per row
    assert (err <= tol * scale_ref).all(), float((err / scale_ref).max())


def test_normed_product_rows_are_independent():
    """A row's result depends on that row only (what makes decode T-invariant): the same row
    alone or among others gives the same bits."""
    x, g, w = _inputs(jnp.bfloat16)
    xg, scale = M.normed_product(x, g, 1e-5)
    full = np.asarray(scale(xg @ w), np.float32)
    xg1, scale1 = M.normed_product(x[1:2, 2:3], g, 1e-5)
    np.testing.assert_array_equal(np.asarray(scale1(xg1 @ w), np.float32)[0, 0], full[1, 2])
