"""`model.decode` with the residual add + RMSNorm kernel (`qspec_jax.norm`, `pallas_kernels.rms_norm`).

The target's layers run each norm with the residual add before it in one kernel, and a layer
leaves its last residual add to the next layer's first norm. The kernel itself is checked against
its oracle in tests/test_rms_norm.py; here the wiring, with the kernel interpreted on the CPU.
"""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qspec_jax import model as M
from qspec_jax import norm as qnorm
from qspec_jax.bench import synthetic
from qspec_jax.config import ConfigError, ModelConfig

_spec = importlib.util.spec_from_file_location("subproc", Path(__file__).parent / "helpers" / "subproc.py")
subproc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(subproc)

# D = 1024: the kernel takes widths that are multiples of 1024.
CFG = ModelConfig(vocab_size=256, hidden_size=1024, intermediate_size=256, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=32, dtype="bfloat16", attention_impl="reference")


def _params(norm_impl: str):
    params = M.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.1)
    params = params.replace(layers=params.layers.replace(  # norms away from 1, so that they matter
        attn_norm=(1 + 0.3 * jax.random.normal(jax.random.PRNGKey(1), (3, 1024))).astype(jnp.bfloat16),
        mlp_norm=(1 + 0.3 * jax.random.normal(jax.random.PRNGKey(2), (3, 1024))).astype(jnp.bfloat16)))
    return params.replace(config=CFG.replace(norm_impl=norm_impl))


def _decode_both(width: int | None = 5):
    """Logits and caches of one target decode pass (3 tokens per row) with the XLA norms and
    with the interpreted kernel."""
    cache = synthetic.random_quant_cache(CFG, 2, 96, jax.random.PRNGKey(5), group=32, gamma_max=4, fp_start=7)
    toks = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32)
    out = {}
    for impl in ("xla", "interpret"):
        p = _params(impl)
        out[impl] = jax.jit(lambda c: M.decode(p, toks, c, view="target", width=width))(cache)
    return out


def _case_bitwise() -> None:
    out = _decode_both()
    (a, ca), (b, cb) = out["xla"], out["interpret"]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for x, y in zip(jax.tree.leaves(ca), jax.tree.leaves(cb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_decode_with_the_kernel_is_the_xla_decode_bit_for_bit():
    """With XLA held to the written bf16 roundings (`--xla_allow_excess_precision=false`, in a
    child process), a target decode pass with the norm kernel gives the same logits and cache,
    bit for bit, as with XLA's norms: the kernel's residual adds (the deferred one included) and
    norms are the model's, in the model's order. (With excess precision allowed, XLA keeps x + d
    in float32 for the norm and the two differ by bf16 roundings; see the next test.)"""
    script = (f"import importlib.util\n"
              f"spec = importlib.util.spec_from_file_location('t', {str(Path(__file__).resolve())!r})\n"
              f"mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
              f"mod._case_bitwise()\nprint('CHILD OK')\n")
    r = subproc.run_script(sys.executable, script, xla_flags="--xla_allow_excess_precision=false")
    assert r.returncode == 0 and "CHILD OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


def test_decode_with_the_kernel_is_close_and_row_invariant(monkeypatch):
    """Under the default XLA flags: the kernel's decode is within bf16 roundings of the XLA one
    (rel < 3e-2), each layer calls it twice (the attention norm with the previous layer's pending
    residual, the MLP norm with o's output), and a pass of T = 3 at width 5 equals three T = 1
    passes at width 5 bit for bit (speculative == autoregressive)."""
    calls = []
    real = qnorm.add_rms_norm

    def counted(x, weight, *, eps, backend, residual=None):
        calls.append((backend, residual is not None))
        return real(x, weight, eps=eps, backend=backend, residual=residual)

    monkeypatch.setattr(M, "add_rms_norm", counted)
    out = _decode_both()
    assert calls == [("interpret", True)] * 2  # traced once in the layer loop's body
    a, b = (np.asarray(out[k][0], np.float64) for k in ("xla", "interpret"))
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 3e-2
    p = _params("interpret")
    cache = synthetic.random_quant_cache(CFG, 2, 96, jax.random.PRNGKey(5), group=32, gamma_max=4, fp_start=7)
    toks = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32)
    step = jax.jit(lambda c, tk: M.decode(p, tk, c, view="target", width=5))
    ar = []
    for j in range(3):
        lg, cache = step(cache, toks[:, j:j + 1])
        ar.append(np.asarray(lg)[:, 0])
    np.testing.assert_array_equal(np.stack(ar, 1), np.asarray(out["interpret"][0]))


def test_which_passes_take_the_kernel(monkeypatch):
    """`_layer_fusion`: the kernel where the draft's INT4 kernels do not take the norms and the
    width is a multiple of 1024; "xla" and QSPEC_ADD_NORM=0 turn it off, other values are errors;
    on the CPU "auto" keeps XLA."""
    assert M._layer_fusion(_params("interpret"), 6) == M.LayerFusion(add_norm="interpret")
    assert M._layer_fusion(_params("interpret"), 6).defers_residual
    assert M._layer_fusion(_params("xla"), 6) == M.LayerFusion()
    assert M._layer_fusion(_params("auto"), 6) == M.LayerFusion()  # CPU: XLA
    narrow = _params("interpret").replace(config=CFG.replace(hidden_size=512, norm_impl="interpret"))
    assert M._layer_fusion(narrow, 6) == M.LayerFusion()
    monkeypatch.setenv(qnorm.ADD_NORM_ENV, "0")
    assert M._layer_fusion(_params("interpret"), 6) == M.LayerFusion()
    monkeypatch.setenv(qnorm.ADD_NORM_ENV, "on")
    with pytest.raises(ValueError, match="QSPEC_ADD_NORM='on': expected 0 or 1"):
        M._layer_fusion(_params("interpret"), 6)
    with pytest.raises(ConfigError, match="norm_impl='cudnn'"):
        CFG.replace(norm_impl="cudnn")
