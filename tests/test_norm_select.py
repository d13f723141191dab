"""QSPEC_NORM_SELECT: how the decode layer loop takes each layer's RMSNorm weights.

"onehot" (`model._layer_norm_row`, the default) exists for the GPU's command buffers (kernel_notes,
"Fifty-fourth session"); it must not change a single bit of what the model computes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qspec_jax import model as M
from qspec_jax.bench import synthetic
from qspec_jax.config import ModelConfig

# D = 96: a width the norm kernel does not take, so that the layer loop slices the norms (as at SmolLM2's 576).
CFG = ModelConfig(vocab_size=256, hidden_size=96, intermediate_size=128, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=24, dtype="bfloat16", attention_impl="reference")


def _params():
    params = M.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.1)
    return params.replace(layers=params.layers.replace(  # a different norm per layer, away from 1
        attn_norm=(1 + 0.3 * jax.random.normal(jax.random.PRNGKey(1), (3, 96))).astype(jnp.bfloat16),
        mlp_norm=(1 + 0.3 * jax.random.normal(jax.random.PRNGKey(2), (3, 96))).astype(jnp.bfloat16)))


_ROW = M._layer_norm_row


def _decode(monkeypatch, mode: str, calls: list[int]):
    monkeypatch.setenv(M.NORM_SELECT_ENV, mode)

    def spy(w, i):
        calls.append(w.shape[0])
        return _ROW(w, i)

    monkeypatch.setattr(M, "_layer_norm_row", spy)
    params = _params()
    cache = synthetic.random_quant_cache(CFG, 2, 96, jax.random.PRNGKey(5), group=32, gamma_max=4, fp_start=7)
    toks = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32)
    return jax.jit(lambda c: M.decode(params, toks, c, view="target", width=5))(cache)


def test_onehot_norm_rows_give_the_sliced_decode_bit_for_bit(monkeypatch):
    """A target decode pass (3 tokens per row) with the norms taken by one-hot contraction gives
    the logits and cache of the sliced ones, bit for bit; the one-hot path really runs (both norms
    of the layer loop through `_layer_norm_row`), and the slice path never calls it."""
    sliced_calls, onehot_calls = [], []
    a, ca = _decode(monkeypatch, "slice", sliced_calls)
    b, cb = _decode(monkeypatch, "onehot", onehot_calls)
    assert sliced_calls == [] and onehot_calls == [3, 3]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for x, y in zip(jax.tree.leaves(ca), jax.tree.leaves(cb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_layer_norm_row_is_the_row():
    """`_layer_norm_row(w, i)` is w[i] exactly for every layer i, traced with i a loop variable."""
    w = (1 + 0.3 * jax.random.normal(jax.random.PRNGKey(3), (5, 40))).astype(jnp.bfloat16)
    rows = jax.jit(lambda w: jax.lax.map(lambda i: M._layer_norm_row(w, i), jnp.arange(5)))(w)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(w))


def test_onehot_is_the_default(monkeypatch):
    monkeypatch.delenv(M.NORM_SELECT_ENV, raising=False)
    assert M._norm_select() == "onehot"


def test_bad_mode_is_named(monkeypatch):
    monkeypatch.setenv(M.NORM_SELECT_ENV, "gather")
    with pytest.raises(ValueError, match="QSPEC_NORM_SELECT='gather': expected one of slice, onehot"):
        M._norm_select()
