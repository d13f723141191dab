"""The fused draft layer (issue 32) through the model on the CPU.

The fused INT4 kernels themselves are checked against `mosaic_gpu.epilogue_reference` in
tests/test_w4a16_mgpu.py (interpret mode) and on the GPU by tools/device/check_w4a16.py. Here:
one layer with the interpret-mode kernels against the model's unfused math, `decode`'s wiring
(stacked norms, the switch, the fallbacks) with the kernels replaced by their reference, the
target's path untouched by the draft's switches, the target's own q|k|v-into-the-cache
kernel behind its switch (QSPEC_TARGET_QKV_CACHE).
"""

import importlib.util
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import linear as plinear
from pallas_kernels.linear import tail_mgpu as tm
from qspec_jax import linear as qlinear
from qspec_jax import model as M
from qspec_jax.bench import synthetic
from qspec_jax.config import ModelConfig
from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

pytestmark = pytest.mark.usefixtures("reuse_interpreter_programs")  # conftest: GPU interpret mode, faster

_spec = importlib.util.spec_from_file_location("subproc", Path(__file__).parent / "helpers" / "subproc.py")
subproc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(subproc)

# Shapes the Mosaic kernel takes: q|k|v 128 + 64 + 64 and gate|up 2 x 128 columns (multiples of 64).
CFG = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=32, dtype="bfloat16", attention_impl="reference",
                  int4_matmul_impl="interpret")


def _target():
    params = M.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.1)
    return params.replace(layers=params.layers.replace(  # norms away from 1, so that they matter
        attn_norm=(1 + 0.3 * jax.random.normal(jax.random.PRNGKey(1), (2, 128))).astype(jnp.bfloat16),
        mlp_norm=(1 + 0.3 * jax.random.normal(jax.random.PRNGKey(2), (2, 128))).astype(jnp.bfloat16)))


def _make_draft(fold_norms: bool = False):
    """The draft with its norm weights kept (the kernels read them), or folded into its INT4
    weights (`fold_norms`: the kernels run the norm without weight)."""
    cfg = DraftWeightsConfig(group_size=64, method="clip", fold_norms=fold_norms)
    return M.for_device(make_draft_params(_target(), cfg))


@pytest.fixture(scope="module")
def draft():
    return _make_draft()


@pytest.fixture(scope="module")
def folded_draft():
    return _make_draft(fold_norms=True)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _layer(draft, i):
    """Layer i as the layer loop hands it to `layer_fn` with stacked norms."""
    names = ("wqkv", "wo", "w_gate_up", "w_down", "attn_norm", "mlp_norm")
    return draft.layers.replace(**{n: qlinear.StackedLayer(getattr(draft.layers, n), i) for n in names})


def test_fused_layer_kernels_match_the_unfused_math():
    """One draft layer with the interpret-mode fused kernels (qkv with the attention norm, o and
    down with the residual and their outputs' rows' sums of squares, gate_up with the MLP norm
    given o's sums and SiLU·up) against the same layer's
    unfused math (rms_norm, the plain INT4 product, silu(gate) * up, residual adds): the same
    function up to the bf16 roundings the fusion moves. In a child with 8 host devices
    (`subproc.run_in_child`: the gate_up kernel simulates three warpgroups)."""
    subproc.run_in_child(__file__, "_case_layer")


def _case_layer() -> None:
    os.environ[qlinear.FUSE_ENV] = "1"  # a child process of its own
    os.environ[qlinear.NORM_SUMS_ENV] = "1"  # the norms' sums from the o / down kernels at 2 rows too
    draft = _make_draft()
    i = jnp.int32(1)
    lp = _layer(draft, i)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 1, 128), jnp.float32).astype(jnp.bfloat16)
    attn = jax.random.normal(jax.random.PRNGKey(4), (2, 1, 128), jnp.float32).astype(jnp.bfloat16)
    pos = jnp.asarray([[7], [3]], jnp.int32)
    full = M.LayerFusion(norm=True, residual=True, sums=True)
    assert M._draft_fusion(draft, 2) == full
    q, k, v = M._qkv(CFG, lp, x, pos, None, norm=lp.attn_norm, norm_sums=qlinear.norm_sums_of(x))
    (out, sums), h, act = M._attn_out_and_mlp(CFG, lp, x, attn, None, full)
    assert h is None and act.shape == (2, 1, 128)
    # the down kernel's rows' sums of its output squared (the next layer's norm input), to float32 rounding
    np.testing.assert_allclose(np.asarray(sums), np.asarray(qlinear.norm_sums_of(out)), rtol=1e-6)
    plain = draft.replace(config=CFG.replace(int4_matmul_impl="xla"))  # dequantize -> dot, unfused
    norm1 = lambda w: w.weight[w.layer]  # noqa: E731
    lp0 = lp.replace(attn_norm=norm1(lp.attn_norm), mlp_norm=norm1(lp.mlp_norm))
    q0, k0, v0 = M._qkv(plain.config, lp0, M.rms_norm(x, lp0.attn_norm, CFG.rms_norm_eps), pos, None)
    out0, _, act0 = M._attn_out_and_mlp(plain.config, lp0, x, attn, None)
    for a, b in ((q, q0), (k, k0), (v, v0), (act, act0), (out, out0)):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert _rel(a, b) < 2e-2
    other = M._attn_out_and_mlp(CFG, _layer(draft, jnp.int32(0)), x, attn, None, full)[0][0]
    assert _rel(other, out0) > 10 * _rel(out, out0)  # it read layer 1's weights and norms
    # the residual adds alone in the kernels (above 24 rows): the MLP norm and SiLU·up in XLA
    lp1 = lp.replace(mlp_norm=norm1(lp.mlp_norm))
    out_r, h_r, act_r = M._attn_out_and_mlp(CFG, lp1, x, attn, None, M.LayerFusion(residual=True))
    assert h_r is not None and _rel(out_r, out0) < 2e-2 and _rel(act_r, act0) < 2e-2


@pytest.fixture
def reference_kernels(monkeypatch):
    """Every INT4 linear through `epilogue_reference` (backend "reference") instead of the
    interpret-mode kernels, which do not finish inside the layer loop on the CPU; records the
    fused calls as (norm, swiglu, residual), norm True with a weight, "unit" without."""
    calls = []
    real = plinear.int4_linear

    def fake(x, w, *, backend="auto", **kw):
        norm = "unit" if kw.get("unit_norm") else kw.get("norm_weight") is not None
        if norm or kw.get("swiglu") or kw.get("residual") is not None:
            calls.append((norm, kw.get("swiglu", False), kw.get("residual") is not None))
        return real(x, w, backend="reference", **kw)

    monkeypatch.setattr(plinear, "int4_linear", fake)
    return calls


def _draft_logits(draft, b):
    cache = synthetic.random_quant_cache(CFG, b, 96, jax.random.PRNGKey(5), group=32, gamma_max=4)
    toks = jnp.arange(b, dtype=jnp.int32)[:, None] + 3
    return M.decode(draft, toks, cache, view="draft")[0]


def test_decode_runs_the_fused_layer_when_switched_on(draft, reference_kernels, monkeypatch):
    monkeypatch.delenv(qlinear.FUSE_ENV, raising=False)
    assert qlinear.fusion_enabled() and M._draft_fusion(draft, 1) == M.LayerFusion(norm=True, residual=True)
    monkeypatch.setenv(qlinear.FUSE_ENV, "0")
    off = _draft_logits(draft, 2)
    assert reference_kernels == []
    monkeypatch.setenv(qlinear.FUSE_ENV, "1")
    on = _draft_logits(draft, 2)
    # the loop body is traced once: qkv (norm), o (residual), gate_up (norm + swiglu), down (residual)
    assert reference_kernels == [(True, False, False), (False, False, True), (True, True, False), (False, False, True)]
    assert _rel(on, off) < 2e-2
    assert (np.argmax(np.asarray(on), -1) == np.argmax(np.asarray(off), -1)).mean() >= 0.5


def test_decode_falls_back_beyond_the_fused_rows(draft, reference_kernels, monkeypatch):
    """Above 24 rows only the residual adds stay in the kernels (o, down); above 64 nothing."""
    monkeypatch.setenv(qlinear.FUSE_ENV, "1")
    assert M._draft_fusion(draft, 24) == M.LayerFusion(norm=True, residual=True)
    assert M._draft_fusion(draft, 25) == M._draft_fusion(draft, 64) == M.LayerFusion(residual=True)
    assert M._draft_fusion(draft, 65) == M.LayerFusion()
    on = _draft_logits(draft, 25)
    assert reference_kernels == [(False, False, True), (False, False, True)]
    monkeypatch.setenv(qlinear.FUSE_ENV, "0")
    off = _draft_logits(draft, 25)
    assert _rel(on, off) < 2e-2
    reference_kernels.clear()
    monkeypatch.setenv(qlinear.FUSE_ENV, "1")
    _draft_logits(draft, 65)
    assert reference_kernels == []


def test_target_path_is_unchanged(monkeypatch):
    """Dense (target) weights never take the fused path: the decode program and its logits are
    the same bits with the switch on and off."""
    params = M.for_device(M.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.1))
    cache = synthetic.random_quant_cache(CFG, 2, 96, jax.random.PRNGKey(5), group=32, gamma_max=4)
    toks = jnp.asarray([[3, 4], [5, 6]], jnp.int32)
    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(qlinear.FUSE_ENV, flag)
        assert M._draft_fusion(params, 4) == M.LayerFusion()
        out[flag] = np.asarray(M.decode(params, toks, cache, view="target")[0])
    np.testing.assert_array_equal(out["0"], out["1"])


@pytest.fixture
def qkv_reference(monkeypatch):
    """The q|k|v-into-the-cache kernels (the draft's INT4, a target's bf16) through their reference
    (their backends recorded), and the model's reference attention handed the query operand the
    kernel writes, turned back into queries (the operands recorded): ([backend of each call],
    [operand of each call])."""
    from pallas_kernels.decode_attention import mosaic_gpu as mgd

    qkv_calls, operands = [], []

    def recorded(real):
        def fake_qkv(*a, backend, **kw):
            qkv_calls.append(backend)
            return real(*a, backend="reference", **kw)
        return fake_qkv

    real_attention = M.cache_attention

    def attention(q, q_pos, cache, layer, view, impl, sliding_window, mesh=None, inputs=None, q_operand=None):
        if q_operand is not None:  # [B, Hkv, D, CN]: column t n_rep + r of KV head h is query head h n_rep + r
            b, t, hq, d = q.shape
            hkv = q_operand.shape[1]
            n_rep = hq // hkv
            operands.append(q_operand)
            q = q_operand[..., :t * n_rep].reshape(b, hkv, d, t, n_rep).transpose(0, 3, 1, 4, 2).reshape(b, t, hq, d)
        return real_attention(q, q_pos, cache, layer, view, impl, sliding_window, mesh=mesh, inputs=inputs)

    monkeypatch.setattr(plinear, "int4_qkv_cache", recorded(plinear.int4_qkv_cache))
    monkeypatch.setattr(plinear, "bf16_qkv_cache", recorded(plinear.bf16_qkv_cache))
    monkeypatch.setattr(M, "cache_attention", attention)
    # [B, Hkv, D, CN]: the Mosaic kernels' and the dense kernel's operand alike (16 columns a tile)
    monkeypatch.setattr(M, "query_operand_shape", lambda q, cache, view, impl: mgd.query_operand_shape(
        q.shape, cache.append_buffers[0].shape[2]))
    return qkv_calls, operands


def _head_dim_draft(head_dim: int):
    """A draft of CFG with q|k|v 2 + 1 + 1 heads of `head_dim` channels."""
    cfg = CFG.replace(num_heads=2, num_kv_heads=1, head_dim=head_dim)
    params = M.init_random_params(cfg, jax.random.PRNGKey(0), scale=0.1)
    return cfg, M.for_device(make_draft_params(params, DraftWeightsConfig(group_size=64, method="clip")))


@pytest.mark.parametrize("head_dim", [128, 64])
def test_decode_writes_qkv_into_the_cache_in_one_kernel(reference_kernels, qkv_reference, monkeypatch, head_dim):
    """With heads the qkv kernel takes (`linear.qkv_cache_fusable`; q|k|v 2 + 1 + 1 heads of 128
    channels, or of SmolLM2's 64) the draft's decode runs by default norm, q|k|v
    product, RoPE, the attention's query operand and the ring writes in one kernel
    (`linear.qkv_into_cache`, here through its reference), the operand riding in the layer loop's
    carry: the same logits and rings as the unfused layer (QSPEC_QKV_CACHE=0) up to the bf16
    roundings the fusion moves, and the ring slots the unfused path leaves alone untouched. The
    attention is the model's reference, handed the operand turned back into queries."""
    cfg, draft = _head_dim_draft(head_dim)
    qkv_calls, operands = qkv_reference
    cache = synthetic.random_quant_cache(cfg, 3, 96, jax.random.PRNGKey(5), group=32, gamma_max=4, fp_start=7)
    toks = jnp.asarray([[3], [4], [5]], jnp.int32)
    monkeypatch.delenv(qlinear.QKV_CACHE_ENV, raising=False)  # the default ("1") fuses both head dims
    on, on_cache = jax.jit(lambda c: M.decode(draft, toks, c, view="draft"))(cache)
    assert qkv_calls == ["interpret"] and len(operands) == 1
    monkeypatch.setenv(qlinear.QKV_CACHE_ENV, "yes")
    with pytest.raises(ValueError, match="QSPEC_QKV_CACHE='yes': expected one of 0, 1, all"):
        M.decode(draft, toks, cache, view="draft")
    monkeypatch.setenv(qlinear.QKV_CACHE_ENV, "0")
    off, off_cache = jax.jit(lambda c: M.decode(draft, toks, c, view="draft"))(cache)
    assert qkv_calls == ["interpret"]  # the unfused trace took the XLA rope and writes
    assert _rel(on, off) < 2e-2
    assert (np.argmax(np.asarray(on), -1) == np.argmax(np.asarray(off), -1)).mean() >= 0.5
    slots = np.asarray(cache.append_slots(1)[:, 0])
    for name in ("k_fp", "v_fp"):
        a, b, orig = (np.asarray(getattr(c, name), np.float32) for c in (on_cache, off_cache, cache))
        rows = np.arange(3)
        assert _rel(a[:, rows, :, slots], b[:, rows, :, slots]) < 2e-2, name
        keep = np.ones(a.shape, bool)
        keep[:, rows, :, slots] = False
        np.testing.assert_array_equal(a[keep], orig[keep])
    np.testing.assert_array_equal(np.asarray(on_cache.fp_len), np.asarray(off_cache.fp_len))


def _head_dim_target(head_dim: int):
    """A target of CFG (bf16, q|k|v and gate|up fused as on a GPU) with q|k|v 2 + 1 + 1 heads of
    `head_dim` channels."""
    cfg = CFG.replace(num_heads=2, num_kv_heads=1, head_dim=head_dim)
    return cfg, M.fuse_projections(M.init_random_params(cfg, jax.random.PRNGKey(0), scale=0.1))


def _target_decode(target, toks, cache, width=None):
    """The target's decode, traced anew (the switches are read at trace time)."""
    return jax.jit(lambda c, tk: M.decode(target, tk, c, view="target", width=width))(cache, toks)


@pytest.mark.parametrize("head_dim", [128, 64])
def test_target_writes_qkv_into_the_cache_in_one_kernel(qkv_reference, monkeypatch, head_dim):
    """QSPEC_TARGET_QKV_CACHE runs a target's verify-shaped pass (3 tokens per
    row over a QuantSpecCache, the target view) with each layer's bf16 q|k|v product, RoPE, the
    attention's query operand and the ring writes in one kernel (`linear.qkv_into_cache`, here
    through its reference) after the norm: the same logits and rings as the XLA path up to the
    bf16 roundings the fusion moves, the query operand's columns t n_rep + r, and the ring
    slots the XLA path leaves alone untouched. A bad value of the switch is refused by name."""
    from pallas_kernels.decode_attention import mosaic_gpu as mgd

    cfg, target = _head_dim_target(head_dim)
    qkv_calls, operands = qkv_reference
    b, t = 2, 3
    cache = synthetic.random_quant_cache(cfg, b, 96, jax.random.PRNGKey(5), group=32, gamma_max=4, fp_start=7)
    toks = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32)
    monkeypatch.setenv(qlinear.TARGET_QKV_CACHE_ENV, "0")
    off, off_cache = _target_decode(target, toks, cache)
    assert qkv_calls == [] and operands == []
    monkeypatch.setenv(qlinear.TARGET_QKV_CACHE_ENV, "interpret")
    on, on_cache = _target_decode(target, toks, cache)
    assert qkv_calls == ["interpret"]
    assert len(operands) == 1 and operands[0].shape == mgd.query_operand_shape((b, t, 2, head_dim), 1)
    assert _rel(on, off) < 2e-2
    assert (np.argmax(np.asarray(on), -1) == np.argmax(np.asarray(off), -1)).mean() >= 0.5
    slots = np.asarray(cache.append_slots(t))
    rows = np.repeat(np.arange(b), t)
    for name in ("k_fp", "v_fp"):
        a, r, orig = (np.asarray(getattr(c, name), np.float32) for c in (on_cache, off_cache, cache))
        assert _rel(a[:, rows, :, slots.reshape(-1)], r[:, rows, :, slots.reshape(-1)]) < 2e-2, name
        keep = np.ones(a.shape, bool)
        keep[:, rows, :, slots.reshape(-1)] = False
        np.testing.assert_array_equal(a[keep], orig[keep])
    np.testing.assert_array_equal(np.asarray(on_cache.fp_len), np.asarray(off_cache.fp_len))
    monkeypatch.setenv(qlinear.TARGET_QKV_CACHE_ENV, "yes")
    with pytest.raises(ValueError, match="QSPEC_TARGET_QKV_CACHE='yes': expected one of 0, auto, 1, interpret"):
        M.decode(target, toks, cache, view="target")


@pytest.mark.parametrize("batch", [2, 32])
def test_target_qkv_cache_keeps_the_verify_equal_to_ar(qkv_reference, monkeypatch, batch):
    """With the target's q|k|v into the cache on, a verify pass of 3 tokens and the autoregressive
    decode of the same tokens one at a time at the verify's width (`decode(width=3)`) give each
    position bit for bit the same logits: the path follows the pass's shape [B, width], never T
    (a pass of one token at width 3 runs the same kernel as the verify); at batch 32 (96 rows: the
    kernel's row blocks, `mosaic_gpu.QKV_BLOCK_ROWS`) as at 2."""
    cfg, target = _head_dim_target(64)
    qkv_calls, _ = qkv_reference
    monkeypatch.setenv(qlinear.TARGET_QKV_CACHE_ENV, "interpret")
    cache = synthetic.random_quant_cache(cfg, batch, 96, jax.random.PRNGKey(6), group=32, gamma_max=4, fp_start=3)
    toks = jax.random.randint(jax.random.PRNGKey(batch), (batch, 3), 3, cfg.vocab_size, jnp.int32)
    verify, _ = _target_decode(target, toks, cache)
    ar = jax.jit(lambda c, tk: M.decode(target, tk, c, view="target", width=3))
    for j in range(3):
        logits, cache = ar(cache, toks[:, j:j + 1])
        np.testing.assert_array_equal(np.asarray(logits[:, 0]), np.asarray(verify[:, j]))
    assert qkv_calls == ["interpret", "interpret"]  # one trace each: the verify, the AR step


def test_ar_bf16_writes_qkv_into_its_dense_cache(qkv_reference, monkeypatch):
    """Over the AR-bf16 baseline's dense cache, the target's q|k|v into the cache runs where the
    switch says so for dense caches ("auto", the default, leaves them alone until timed;
    "interpret" here): the new tokens' K / V at their positions (`DenseKVCache.append_slots`),
    the dense kernel's query operand; the logits and the new rows as the XLA path's up to the
    moved bf16 roundings, every other row of the cache untouched."""
    cfg, target = _head_dim_target(128)
    qkv_calls, operands = qkv_reference
    cache = synthetic.random_dense_cache(cfg, 2, 40, jax.random.PRNGKey(3), extra_slots=24,
                                         lengths=jnp.asarray([40, 17], jnp.int32))
    toks = jnp.asarray([[3], [4]], jnp.int32)
    monkeypatch.delenv(qlinear.TARGET_QKV_CACHE_ENV, raising=False)
    off, off_cache = _target_decode(target, toks, cache)
    assert qkv_calls == []
    monkeypatch.setenv(qlinear.TARGET_QKV_CACHE_ENV, "interpret")
    on, on_cache = _target_decode(target, toks, cache)
    assert qkv_calls == ["interpret"] and operands[0].shape == (2, 1, 128, 16)
    assert _rel(on, off) < 2e-2
    rows, pos = np.arange(2), np.asarray(cache.lengths)
    for name in ("k", "v"):
        a, r, orig = (np.asarray(getattr(c, name), np.float32) for c in (on_cache, off_cache, cache))
        assert _rel(a[:, rows, :, pos], r[:, rows, :, pos]) < 2e-2, name
        keep = np.ones(a.shape, bool)
        keep[:, rows, :, pos] = False
        np.testing.assert_array_equal(a[keep], orig[keep])
    np.testing.assert_array_equal(np.asarray(on_cache.lengths), pos + 1)


def test_target_qkv_cache_policy(draft, monkeypatch):
    """Where a target's layer runs `qkv_into_cache` (`linear.target_qkv_cache_backend`): a stacked
    bf16 q|k|v weight of heads the epilogue takes (64, 128 channels), up to the rows the draft's
    kernel runs at (24), or for 64 channels, whose rows go in blocks of 32 (`mosaic_gpu.QKV_BLOCK_ROWS`), up to
    `mosaic_gpu.QKV_MAX_M` (128: the verify's at SmolLM2's batch 32); not the draft's INT4 weight, not head dim 32; the
    Mosaic kernel on Hopper only (none here: by default, "auto", and with "1", no kernel runs on
    the CPU); "auto" takes only the head dims measured faster, up to the rows measured there (128 up to 24 rows, 64
    up to one row block of 32), over either cache, "0" none."""
    _, target = _head_dim_target(128)
    w = target.layers.wqkv
    pick = qlinear.target_qkv_cache_backend
    assert qlinear.TARGET_QKV_CACHE_AUTO_ROWS == {128: 24, 64: 32}
    for mode in ("auto", "1", "0"):
        monkeypatch.setenv(qlinear.TARGET_QKV_CACHE_ENV, mode)
        assert pick(w, 5, 128) is None  # the CPU
    monkeypatch.setattr(plinear, "device_arch", lambda: ("gpu", 9))  # as on Hopper
    monkeypatch.delenv(qlinear.TARGET_QKV_CACHE_ENV)
    assert pick(w, 5, 128) == "mosaic" and pick(w, 25, 128) is None
    assert pick(w, 1, 64) == pick(w, 32, 64) == "mosaic" and pick(w, 33, 64) is None and pick(w, 96, 64) is None
    monkeypatch.setenv(qlinear.TARGET_QKV_CACHE_ENV, "1")
    assert pick(w, 5, 128) == "mosaic" and pick(w, 5, 64) == "mosaic" and pick(w, 96, 64) == "mosaic"
    # a dense cache's buffer (the AR-bf16 baseline's [L, B, Hkv, S, D]): only those the kernel indexes in int32
    for mode in ("auto", "1"):
        monkeypatch.setenv(qlinear.TARGET_QKV_CACHE_ENV, mode)
        assert pick(w, 5, 128, buffer=(32, 1, 8, 8192, 128)) == "mosaic"
        assert pick(w, 5, 128, buffer=(32, 1, 8, 131072, 128)) is None  # 2^32 elements
    monkeypatch.setenv(qlinear.TARGET_QKV_CACHE_ENV, "0")
    assert pick(w, 5, 128) is None
    monkeypatch.setenv(qlinear.TARGET_QKV_CACHE_ENV, "interpret")
    assert pick(w, 24, 128) == "interpret" and pick(w, 25, 128) is None
    assert pick(w, 32, 64) == "interpret" and pick(w, 96, 64) == "interpret" and pick(w, 128, 64) == "interpret"
    assert pick(w, 129, 64) is None
    assert pick(w, 5, 32) is None and pick(w[0], 5, 128) is None
    assert pick(draft.layers.wqkv, 5, 128) is None
    # a bf16 weight's kernel has no norm: a norm handed to it is refused, not dropped
    stacked = qlinear.StackedLayer(w, jnp.int32(0))
    for bad in (dict(norm=target.layers.attn_norm[0]), dict(norm_unit=True), dict(norm_sums=jnp.zeros((2, 8)))):
        with pytest.raises(ValueError, match="a bf16 q.k.v weight takes x already normed"):
            qlinear.qkv_into_cache(jnp.zeros((1, 1, w.shape[1]), jnp.bfloat16), stacked, backend="reference",
                                   rope=None, slots=None, q_buf=None, k_ring=None, v_ring=None, **bad)


def test_norm_rows_follow_the_qkv_cache_kernel(reference_kernels, qkv_reference, monkeypatch):
    """Above 24 rows the draft keeps its norms (and SiLU·up) inside its INT4 kernels only where the
    q|k|v-into-the-cache kernel runs at that many rows (`linear.fused_norm_rows`,
    `mosaic_gpu.QKV_CACHE_FUSED_M`): head dim 64 (SmolLM2's) up to 32 rows while QSPEC_QKV_CACHE
    enables it; head dim 128, whose warpgroups' exchange stops at 24 rows, and the others at 24. A
    head-dim-64 draft decoding 32 rows runs the whole fused layer: q|k|v into the cache, gate_up
    with norm and SiLU·up, o and down with the residual."""
    monkeypatch.setenv(qlinear.FUSE_ENV, "1")
    monkeypatch.delenv(qlinear.QKV_CACHE_ENV, raising=False)
    (cfg, d64), (_, d128) = _head_dim_draft(64), _head_dim_draft(128)
    full, res = M.LayerFusion(norm=True, residual=True), M.LayerFusion(residual=True)
    # from 32 rows the norms take their sums from the o / down kernels (`linear.NORM_SUMS_MIN_ROWS`)
    assert M._draft_fusion(d64, 32) == full.replace(sums=True) and M._draft_fusion(d64, 33) == res
    assert M._draft_fusion(d128, 24) == full and M._draft_fusion(d128, 25) == res
    assert qlinear.qkv_cache_fusable(d64.layers.wqkv, "interpret", 32, 64)
    assert not qlinear.qkv_cache_fusable(d64.layers.wqkv, "interpret", 33, 64)
    assert not qlinear.qkv_cache_fusable(d128.layers.wqkv, "interpret", 25, 128)
    monkeypatch.setenv(qlinear.QKV_CACHE_ENV, "0")
    assert M._draft_fusion(d64, 24) == full and M._draft_fusion(d64, 25) == res
    monkeypatch.delenv(qlinear.QKV_CACHE_ENV)
    qkv_calls, operands = qkv_reference
    b = 32
    cache = synthetic.random_quant_cache(cfg, b, 96, jax.random.PRNGKey(5), group=32, gamma_max=4, fp_start=7)
    toks = jnp.arange(b, dtype=jnp.int32)[:, None] + 3
    logits = jax.jit(lambda c: M.decode(d64, toks, c, view="draft")[0])(cache)
    assert qkv_calls == ["interpret"] and len(operands) == 1 and operands[0].shape[0] == b
    assert reference_kernels == [(False, False, True), (True, True, False), (False, False, True)]  # o, gate_up, down
    assert logits.shape == (b, 1, cfg.vocab_size) and np.isfinite(np.asarray(logits)).all()


def test_folded_draft_runs_its_norms_without_weight(draft, folded_draft, reference_kernels, monkeypatch):
    """A draft whose norm weights are folded into its INT4 weights (`DraftWeightsConfig.fold_norms`)
    decodes with the norms in its kernels without weight (`unit_norm`: the kernels read no g);
    its fused decode matches its unfused one, and it approximates the target as closely as the
    unfolded draft does (the same function, INT4-rounded elsewhere), while a fold that applied
    the norm weights twice would not."""
    monkeypatch.setenv(qlinear.FUSE_ENV, "1")
    assert folded_draft.unit_norms == ("attn_norm", "mlp_norm", "final_norm") and draft.unit_norms == ()
    fused = M.LayerFusion(norm=True, residual=True, unit_norms=folded_draft.unit_norms)
    assert M._draft_fusion(folded_draft, 2) == fused
    on = _draft_logits(folded_draft, 2)
    # qkv, o, gate_up, down
    assert reference_kernels == [("unit", False, False), (False, False, True), ("unit", True, False),
                                 (False, False, True)]
    monkeypatch.setenv(qlinear.FUSE_ENV, "0")
    off = _draft_logits(folded_draft, 2)
    assert _rel(on, off) < 2e-2
    target = _draft_logits(M.for_device(_target()), 2)  # bf16 weights, the same (draft-view) cache
    err, err_unfolded = _rel(on, target), _rel(_draft_logits(draft, 2), target)
    assert err < 1.25 * err_unfolded, (err, err_unfolded)
    twice = folded_draft.replace(layers=folded_draft.layers.replace(attn_norm=draft.layers.attn_norm,
                                                                    mlp_norm=draft.layers.mlp_norm))
    assert _rel(_draft_logits(twice, 2), target) > 1.5 * err


@pytest.mark.parametrize("head_dim", [None, 64])
def test_norms_take_their_sums_from_the_residual_kernels(draft, reference_kernels, qkv_reference, monkeypatch,
                                                          head_dim):
    """`LayerFusion.sums` (where the norm kernels take them, `linear.norm_sums_fusable`: always in
    interpret mode; QSPEC_NORM_SUMS "auto" from 32 rows, "1" at any row count, "0" off): the o and
    down kernels return their outputs' rows' sums of squares (`row_sums`), which the next norm
    kernels take (`norm_sums`: gate_up, and the next layer's q|k|v, through `linear` or, at head dim
    64, the q|k|v-into-the-cache kernel), the first layer's from XLA on the embedding. Every norm call gets the sums of its own input
    (against `norm_sums_of` of the x it is given: float32 summation order only), and the logits
    are those without the sums up to the bf16 roundings a different float32 scale moves."""
    monkeypatch.setenv(qlinear.FUSE_ENV, "1")
    monkeypatch.delenv(qlinear.NORM_SUMS_ENV, raising=False)
    cfg, params = (CFG, draft) if head_dim is None else _head_dim_draft(head_dim)
    assert not M._draft_fusion(params, 3).sums  # "auto": not below 32 rows
    monkeypatch.setenv(qlinear.NORM_SUMS_ENV, "1")
    errs, produced = [], []

    def check(x, sums):  # the largest difference from x's own sums, relative to the largest sum
        ref = qlinear.norm_sums_of(x)
        jax.debug.callback(lambda e: errs.append(float(e)), jnp.max(jnp.abs(sums - ref)) / jnp.max(ref))

    lin = plinear.int4_linear  # the reference_kernels fixture's

    def fake_linear(x, w, **kw):
        if kw.get("norm_sums") is not None:
            check(x, kw["norm_sums"])
        produced.append(bool(kw.get("row_sums")))
        return lin(x, w, **kw)

    qkv = plinear.int4_qkv_cache  # the qkv_reference fixture's

    def fake_qkv(x, w, **kw):
        if kw.get("norm_sums") is not None:
            check(x, kw["norm_sums"])
        return qkv(x, w, **kw)

    monkeypatch.setattr(plinear, "int4_linear", fake_linear)
    monkeypatch.setattr(plinear, "int4_qkv_cache", fake_qkv)
    fusion = M._draft_fusion(params, 3)
    assert fusion.sums and fusion == M.LayerFusion(norm=True, residual=True, sums=True)
    b = 3
    cache = synthetic.random_quant_cache(cfg, b, 96, jax.random.PRNGKey(5), group=32, gamma_max=4, fp_start=7)
    toks = jnp.arange(b, dtype=jnp.int32)[:, None] + 3
    on = np.asarray(M.decode(params, toks, cache, view="draft")[0])
    # the loop body traced once: o and down return sums (qkv is its own kernel at head dim 64)
    assert produced.count(True) == 2
    assert len(errs) == 2 * cfg.num_layers and max(errs) < 1e-5, errs  # q|k|v's and gate_up's, every layer
    monkeypatch.setenv(qlinear.NORM_SUMS_ENV, "0")
    assert M._draft_fusion(params, 3) == M.LayerFusion(norm=True, residual=True)
    errs.clear()
    off = np.asarray(M.decode(params, toks, cache, view="draft")[0])
    assert errs == []
    assert _rel(on, off) < 2e-2  # the bf16 roundings downstream of the norms' scale (as fused against unfused)
    monkeypatch.setenv(qlinear.NORM_SUMS_ENV, "yes")
    with pytest.raises(ValueError, match="QSPEC_NORM_SUMS='yes': expected auto, 0 or 1"):
        M._draft_fusion(params, 3)


def test_target_silu_up_in_its_gate_up_kernel(monkeypatch):
    """Where the target's bf16 linears run on the Mosaic kernel (`dense_matmul_impl` "interpret":
    its CPU twin; on the H200 "auto" at the 8B's shapes), a decode pass of up to 24 rows forms
    SiLU(gate)·up inside the gate_up kernel (`LayerFusion.swiglu`, `linear.dense_swiglu_fusable`):
    the logits as the cuBLAS path's (xla) up to the bf16 roundings the fusion moves; a verify pass
    of 3 tokens and the AR decode of the same tokens at width 3 give each position bit for bit the
    same logits (the choice follows the pass's rows, never T); above 24 rows, and with
    QSPEC_W4A16_FUSE=0, the product and SiLU·up stay apart."""
    from pallas_kernels.linear import mosaic_gpu as mg

    calls = []
    kernel = mg.bf16_matmul_mgpu

    def recording(x, w, **kw):
        calls.append((x.shape[0], w.shape[-1], kw.get("swiglu", False)))
        return kernel(x, w, **kw)

    monkeypatch.setattr(mg, "bf16_matmul_mgpu", recording)
    cfg = CFG.replace(dense_matmul_impl="interpret")
    params = M.fuse_projections(M.init_random_params(cfg, jax.random.PRNGKey(0), scale=0.1))
    xla = params.replace(config=cfg.replace(dense_matmul_impl="xla"))
    cache = synthetic.random_quant_cache(cfg, 2, 96, jax.random.PRNGKey(6), group=32, gamma_max=4, fp_start=3)
    toks = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32)
    verify, _ = _target_decode(params, toks, cache)
    n_gate_up = 2 * cfg.intermediate_size
    n_qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    # one trace of the layer: q|k|v, o, gate_up with SiLU·up, down, each on the kernel
    assert sorted(calls) == sorted([(6, n_qkv, False), (6, cfg.hidden_size, False), (6, n_gate_up, True),
                                    (6, cfg.hidden_size, False)])
    ref, _ = _target_decode(xla, toks, cache)
    assert _rel(verify, ref) < 2e-2
    ar = jax.jit(lambda c, tk: M.decode(params, tk, c, view="target", width=3))
    step_cache = cache
    for j in range(3):
        logits, step_cache = ar(step_cache, toks[:, j:j + 1])
        np.testing.assert_array_equal(np.asarray(logits[:, 0]), np.asarray(verify[:, j]))
    assert M._layer_fusion(params, 24).swiglu and not M._layer_fusion(params, 25).swiglu
    assert not M._layer_fusion(xla, 6).swiglu
    monkeypatch.setenv(qlinear.FUSE_ENV, "0")
    assert not M._layer_fusion(params, 6).swiglu
    with pytest.raises(ValueError, match="swiglu on a dense weight needs the Mosaic kernel"):
        qlinear.linear(jnp.zeros((1, 128), jnp.bfloat16), xla.layers.w_gate_up[0], dense_impl="xla", swiglu=True)


# The persistent layer tail's shapes (`tail_mgpu.takes`): attention width, D and F multiples of a k tile (256 here;
# CFG_TAIL_192: SmolLM2's 192-column k steps and an odd number of 64-column tiles, 576 = 3 x 192 in small).
CFG_TAIL = CFG.replace(hidden_size=256, intermediate_size=256, num_heads=8)
CFG_TAIL_192 = CFG.replace(hidden_size=192, intermediate_size=384, num_heads=6)


def _tail_draft(cfg: ModelConfig = CFG_TAIL):
    params = M.init_random_params(cfg, jax.random.PRNGKey(0), scale=0.1)
    d = cfg.hidden_size
    params = params.replace(layers=params.layers.replace(  # norms away from 1, so that they matter
        attn_norm=(1 + 0.3 * jax.random.normal(jax.random.PRNGKey(1), (2, d))).astype(jnp.bfloat16),
        mlp_norm=(1 + 0.3 * jax.random.normal(jax.random.PRNGKey(2), (2, d))).astype(jnp.bfloat16)))
    return M.for_device(make_draft_params(params, DraftWeightsConfig(group_size=64, method="clip")))


def test_decode_runs_the_layer_tail_in_one_kernel_when_switched_on():
    """QSPEC_W4A16_TAIL=1 (`linear.tail_fusable`): a draft layer's o, MLP norm, gate_up, SiLU·up and
    down with both residuals in one persistent kernel (interpret mode): one layer against the three
    fused kernels (the same function up to float32 summation order before each bf16 rounding), with
    the down epilogue's row sums; then a jitted draft decode whose layer loop shares one sync ref
    (`linear.layer_tail_sync`), the layer index as each call's ordinal (the twin's output is NaN
    where a wait finds another count than its ordinal's), against the same decode without the tail, and
    with QSPEC_W4A16_TAIL=ready (the kernel's per-chunk ready counters) bit for bit the tail's decode;
    QSPEC_W4A16_TAIL=cluster hands the kernel its cluster (its chunks balanced over 16 CTAs: another float32
    order, so compared with the unfused decode); SmolLM2-like tiles (192-column k steps, an odd number of row
    tiles) are taken, with QSPEC_W4A16_TAIL_CHUNKS's K chunks in the kernel's config (bad ones refused by name);
    values other than 0, 1, ready and cluster are refused by name. In a child with 8 host
    devices (`subproc.run_in_child`)."""
    subproc.run_in_child(__file__, "_case_tail")


def _case_tail() -> None:
    os.environ[qlinear.FUSE_ENV] = "1"  # a child process of its own
    os.environ[qlinear.NORM_SUMS_ENV] = "1"
    os.environ[qlinear.TAIL_ENV] = "1"
    draft = _tail_draft()
    fused = M.LayerFusion(norm=True, residual=True, sums=True)
    assert M._draft_fusion(draft, 2) == fused.replace(tail=True)
    assert not M._draft_fusion(draft, 25).tail  # above the norm fusion's 24 rows
    lp = _layer(draft, jnp.int32(1))
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 1, 256), jnp.float32).astype(jnp.bfloat16)
    attn = jax.random.normal(jax.random.PRNGKey(4), (2, 1, 256), jnp.float32).astype(jnp.bfloat16)
    (out3, _), _, _ = M._attn_out_and_mlp(CFG_TAIL, lp, x, attn, None, fused)
    (out, sums), h, act = M._attn_out_and_mlp(CFG_TAIL, lp, x, attn, None, fused.replace(tail=True))
    assert h is None and act is None and out.shape == out3.shape == (2, 1, 256) and out.dtype == jnp.bfloat16
    assert _rel(out, out3) <= 2.0 ** -8  # tests/test_tail_mgpu.py's TOL says why
    np.testing.assert_allclose(np.asarray(sums), np.asarray(qlinear.norm_sums_of(out)), rtol=1e-5)
    # SmolLM2-like tiles (192-column k steps, an odd number of row tiles): one layer, the tail against the three
    draft192 = _tail_draft(CFG_TAIL_192)
    assert M._draft_fusion(draft192, 2).tail
    lp192 = _layer(draft192, jnp.int32(1))
    x192 = jax.random.normal(jax.random.PRNGKey(6), (2, 1, 192), jnp.float32).astype(jnp.bfloat16)
    a192 = jax.random.normal(jax.random.PRNGKey(7), (2, 1, 192), jnp.float32).astype(jnp.bfloat16)
    (out3, _), _, _ = M._attn_out_and_mlp(CFG_TAIL_192, lp192, x192, a192, None, fused)
    (out, _), _, _ = M._attn_out_and_mlp(CFG_TAIL_192, lp192, x192, a192, None, fused.replace(tail=True))
    assert out.shape == (2, 1, 192) and _rel(out, out3) <= 2.0 ** -8
    # QSPEC_W4A16_TAIL_CHUNKS reaches the kernel's config (down's two k steps in one chunk or two), checked by name
    real_mgpu, configs = tm.int4_layer_tail_mgpu, []

    def mgpu(*a, config, **kw):
        configs.append(config)
        return real_mgpu(*a, config=config, **kw)

    tm.int4_layer_tail_mgpu = mgpu
    for chunks in ((1, 1, 2), (1, 1, 1)):
        os.environ[qlinear.TAIL_CHUNKS_ENV] = ",".join(map(str, chunks))
        (out, _), _, _ = M._attn_out_and_mlp(CFG_TAIL_192, lp192, x192, a192, None, fused.replace(tail=True))
        assert configs[-1].chunks == chunks and _rel(out, out3) <= 2.0 ** -8
    for bad, msg in (("1,1", "expected three positive integers"), ("1,x,1", "expected three positive integers"),
                     ("1,0,1", "expected three positive integers"), ("2,1,1", "chunk count 0 must divide")):
        os.environ[qlinear.TAIL_CHUNKS_ENV] = bad
        try:
            M._attn_out_and_mlp(CFG_TAIL_192, lp192, x192, a192, None, fused.replace(tail=True))
            raise AssertionError(f"QSPEC_W4A16_TAIL_CHUNKS={bad} was accepted")
        except ValueError as e:
            assert msg in str(e) and (bad == "2,1,1" or f"QSPEC_W4A16_TAIL_CHUNKS={bad!r}" in str(e)), str(e)
    del os.environ[qlinear.TAIL_CHUNKS_ENV]
    tm.int4_layer_tail_mgpu = real_mgpu
    # the decode: every other INT4 linear through its reference (interpret-mode kernels are slow in a loop)
    real_linear, real_tail, syncs, readys, clusters = plinear.int4_linear, plinear.int4_layer_tail, [], [], []
    plinear.int4_linear = lambda x, w, *, backend="auto", **kw: real_linear(x, w, backend="reference", **kw)

    def tail(*a, sync=None, **kw):
        syncs.append(sync)
        readys.append(kw.get("chunk_ready"))
        clusters.append(kw.get("cluster"))
        return real_tail(*a, sync=sync, **kw)

    plinear.int4_layer_tail = tail
    cache = synthetic.random_quant_cache(CFG_TAIL, 2, 96, jax.random.PRNGKey(5), group=32, gamma_max=4)
    toks = jnp.asarray([[3], [4]], jnp.int32)
    on = np.asarray(jax.jit(lambda c: M.decode(draft, toks, c, view="draft")[0])(cache))
    assert len(syncs) == 1 and syncs[0] is not None  # the loop body traced once, handed the pass's ref
    os.environ[qlinear.TAIL_ENV] = "ready"
    ready = np.asarray(jax.jit(lambda c: M.decode(draft, toks, c, view="draft")[0])(cache))
    assert readys == [False, True] and len(syncs) == 2
    assert ready.dtype == on.dtype and ready.tobytes() == on.tobytes()
    os.environ[qlinear.TAIL_ENV] = "cluster"
    clustered = np.asarray(jax.jit(lambda c: M.decode(draft, toks, c, view="draft")[0])(cache))
    assert clusters == [0, 0, qlinear.TAIL_CLUSTER_CTAS] and len(syncs) == 3
    syncs[1:] = []
    os.environ[qlinear.TAIL_ENV] = "0"
    off = np.asarray(jax.jit(lambda c: M.decode(draft, toks, c, view="draft")[0])(cache))
    assert len(syncs) == 1 and np.isfinite(on).all() and np.isfinite(clustered).all()
    assert _rel(on, off) < 2e-2 and _rel(clustered, off) < 2e-2
    # other values refused by name (the dynamic deal's "dynamic" went with it, 2026-12-02)
    for bad in ("yes", "dynamic"):
        os.environ[qlinear.TAIL_ENV] = bad
        try:
            M._draft_fusion(draft, 2)
            raise AssertionError(f"QSPEC_W4A16_TAIL={bad} was accepted")
        except ValueError as e:
            assert f"QSPEC_W4A16_TAIL={bad!r}: expected 0, 1, ready or cluster" in str(e)
