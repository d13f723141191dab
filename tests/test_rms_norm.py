"""The residual add + RMSNorm kernel (`pallas_kernels.rms_norm`) against its jnp oracle.

The Mosaic GPU kernel runs here in GPU interpret mode; tools/device/add_norm_gpu.py checks and
times it on the GPU. The oracle is HF Llama's order of roundings (h rounded to bf16 before the
norm, bf16(h r) before the weight), evaluated op by op.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.rms_norm import add_rms_norm, add_rms_norm_reference, pick_backend
from pallas_kernels.rms_norm import mosaic_gpu as mg


def _inputs(seed: int, m: int, d: int, layers: int):
    k = jax.random.PRNGKey(seed)
    x = (2 * jax.random.normal(k, (m, d))).astype(jnp.bfloat16)
    res = (0.5 * jax.random.normal(jax.random.fold_in(k, 1), (m, d))).astype(jnp.bfloat16)
    g = (1 + 0.3 * jax.random.normal(jax.random.fold_in(k, 2), (layers, d))).astype(jnp.bfloat16)
    return x, res, g


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), m=st.integers(1, 6), d=st.sampled_from([1024, 2048, 3072]),
       with_res=st.booleans(), stacked=st.booleans(), eps=st.sampled_from([1e-5, 1e-6]))
def test_kernel_matches_the_oracle_bitwise(seed, m, d, with_res, stacked, eps):
    """h and y of the interpreted kernel equal the oracle's bit for bit: random rows, widths,
    with and without the residual, the weight one layer's or layer l of a stack (read in place).
    The oracle runs row by row: the kernel sums a row's h^2 in float32 as one [D] reduction (in
    interpret mode, XLA's 1-D reduce), and the oracle over [M, D] reduces rows of a 2-D array,
    which XLA orders differently: the float32 sums then differ in their last bit on some rows
    (seed 65535, M 2, D 2048: 8849.453 against 8849.451), and so may r and y. Every rounding of
    HF's order (h to bf16, bf16(h r), the weight) is the same either way."""
    x, res, g = _inputs(seed, m, d, 3)
    layer = seed % 3 if stacked else None
    w = g if stacked else g[1]
    r = res if with_res else None
    h, y = add_rms_norm(x, w, eps=eps, residual=r, layer=layer, backend="interpret")
    rows = [add_rms_norm_reference(x[i], w, eps=eps, residual=None if r is None else r[i], layer=layer) for i in range(m)]
    h0, y0 = (jnp.stack([row[k] for row in rows]) for k in (0, 1))
    assert h.dtype == y.dtype == jnp.bfloat16 and h.shape == y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(h), np.asarray(h0))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))


def test_rounds_the_sum_before_the_norm():
    """The norm reads h = bf16(x + d), HF's residual stream, not the float32 sum (which XLA uses
    when it fuses the add into the norm and may skip the rounding): the two differ on these
    inputs, and the kernel gives the rounded one."""
    x, res, g = _inputs(3, 4, 1024, 1)
    _, y = add_rms_norm(x, g[0], eps=1e-5, residual=res, backend="interpret")
    xf = x.astype(jnp.float32) + res.astype(jnp.float32)  # unrounded sum
    y_f32_sum = g[0] * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5)).astype(jnp.bfloat16)
    assert not np.array_equal(np.asarray(y), np.asarray(y_f32_sum))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(add_rms_norm_reference(x, g[0], eps=1e-5,
                                                                                   residual=res)[1]))


def test_a_row_does_not_depend_on_the_others():
    """Row invariance (issue 11): a row computed in a pass of 5 rows equals the row alone, bit
    for bit, so an AR pass and a verify pass of the same width agree."""
    x, res, g = _inputs(7, 5, 2048, 2)
    h, y = add_rms_norm(x, g, eps=1e-5, residual=res, layer=1, backend="interpret")
    h2, y2 = add_rms_norm(x[2:3], g, eps=1e-5, residual=res[2:3], layer=1, backend="interpret")
    np.testing.assert_array_equal(np.asarray(y[2:3]), np.asarray(y2))
    np.testing.assert_array_equal(np.asarray(h[2:3]), np.asarray(h2))


def test_leading_dims_and_cpu_dispatch():
    """[B, T, D] inputs flatten to rows and come back in shape; "auto" is XLA on the CPU and
    equals the oracle."""
    x, res, g = _inputs(1, 6, 1024, 1)
    x3, r3 = x.reshape(2, 3, 1024), res.reshape(2, 3, 1024)
    h, y = add_rms_norm(x3, g[0], eps=1e-5, residual=r3, backend="interpret")
    assert h.shape == y.shape == (2, 3, 1024)
    np.testing.assert_array_equal(np.asarray(y).reshape(6, 1024),
                                  np.asarray(add_rms_norm_reference(x, g[0], eps=1e-5, residual=res)[1]))
    assert pick_backend(6, 1024, jnp.bfloat16) == "xla"
    ha, ya = add_rms_norm(x3, g[0], eps=1e-5, residual=r3)
    np.testing.assert_array_equal(np.asarray(ya), np.asarray(add_rms_norm_reference(x3, g[0], eps=1e-5,
                                                                                     residual=r3)[1]))


def test_bad_inputs_are_named():
    x, res, g = _inputs(0, 2, 1024, 2)
    assert not mg.supports(2, 576, jnp.bfloat16) and not mg.supports(2, 1024, jnp.float32)
    assert not mg.supports(mg.MAX_ROWS + 1, 1024, jnp.bfloat16) and mg.supports(1, 4096, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"bfloat16 \[M, D\].*D a multiple of 1024"):
        mg.add_rms_norm_mgpu(x[:, :576], g[0, :576], eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="residual"):
        mg.add_rms_norm_mgpu(x, g[0], eps=1e-5, residual=res[:1], interpret=True)
    with pytest.raises(ValueError, match=r"weight shape \(2, 1024\) must be \[1024\], or \[L, 1024\] with layer="):
        mg.add_rms_norm_mgpu(x, g, eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="backend='cuda'"):
        add_rms_norm(x, g[0], eps=1e-5, backend="cuda")
    with pytest.raises(ValueError, match="residual shape"):
        add_rms_norm(x, g[0], eps=1e-5, residual=res[:1])


@pytest.mark.parametrize("m,d,with_res,stacked", [(1, 4096, True, True), (40, 4096, False, False),
                                                  (5, 8192, True, False)])
def test_lowers_for_cuda(m, d, with_res, stacked):
    """The GPU code path (strided global loads, the warpgroup's reduction, the stacked weight's
    layer index) lowers to a Mosaic GPU custom call without a GPU."""
    s = jax.ShapeDtypeStruct
    x, i = s((m, d), jnp.bfloat16), s((), jnp.int32)
    g = s((32, d) if stacked else (d,), jnp.bfloat16)

    def f(x, g, r, i):
        return mg.add_rms_norm_mgpu(x, g, eps=1e-5, residual=r, layer=i if stacked else None)

    text = jax.jit(functools.partial(f)).trace(x, g, x if with_res else None, i).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
