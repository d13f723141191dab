"""Verify equals decode: greedy speculative output is the target's own autoregressive output.

Over the hierarchical INT8 cache (the default target) and the dense cache, in bfloat16 and
float32, for gamma 1..6 and batches of prompts of different lengths, with a group size small
enough that every run crosses several flushes: the tokens are identical AND the float32
logits of every emitted token are bit-identical to autoregressive decoding at the verify width
(GenerationConfig.width, default gamma_max + 1).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qspec_jax import model as M
from qspec_jax.cache import QuantSpecCache
from qspec_jax.checkpoint import Model
from qspec_jax.config import ModelConfig
from qspec_jax.generation import GenerationConfig, generate_autoregressive
from qspec_jax.speculative import SpecConfig, accept_greedy, accept_sampling, generate
from qspec_jax.sampling import SamplingConfig

# Bitwise sweeps over dtype x batch x gamma (~400 CPU-seconds in all): `make test` runs them,
# `make test-fast` leaves them out (test_speculative keeps greedy spec == AR in the fast loop).
pytestmark = pytest.mark.slow

# Wide enough (hidden 256, head_dim 64) that XLA's CPU dots pick shape-dependent algorithms:
# a pass of 1 column and one of 5 columns differ in the last bits here (test below).
BASE = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=6,
                   num_kv_heads=2, head_dim=64, dtype="float32", max_position_embeddings=2048,
                   eos_token_ids=(), attention_impl="reference")
G = 16  # 40 new tokens on prompts of 37..121 tokens cross several flushes
NEW = 40
LENGTHS = (37, 80, 121)


def _model(dtype: str) -> Model:
    cfg = dataclasses.replace(BASE, dtype=dtype)
    return Model(config=cfg, params=M.init_random_params(cfg, jax.random.PRNGKey(1), scale=0.08))


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def model(request):
    return _model(request.param)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, BASE.vocab_size, n).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def ar_ref(model, prompts):
    """Autoregressive reference for batch 3 and batch 1 (first prompt), INT8 and dense caches."""
    out = {}
    for kv in ("int8", "bf16"):
        cfg = GenerationConfig(max_new_tokens=NEW, kv=kv, group_size=G, return_logits=True)
        out[kv, 3] = generate_autoregressive(model, prompts, cfg)
        out[kv, 1] = generate_autoregressive(model, prompts[:1], cfg)
    return out


@pytest.mark.parametrize("gamma", [1, 2, 4, 6])
@pytest.mark.parametrize("batch", [1, 3])
def test_int8_spec_equals_ar_bitwise(model, prompts, ar_ref, gamma, batch, bitwise_logits):
    """The full method (INT4 weights + INT4 KV draft, INT8 target) against AR-int8."""
    spec = SpecConfig(gamma=gamma, max_new_tokens=NEW, group_size=G, draft_group=32, return_logits=True)
    res = generate(model, prompts[:batch], spec)
    ref = ar_ref["int8", batch]
    assert res.to_lists() == ref.to_lists()
    assert bitwise_logits(ref, res)
    assert res.acceptance_rate < 1.0  # rejections happened: rollback and the correction path ran


def test_int8_spec_with_the_row_loop_flush_equals_ar(model, prompts, ar_ref, bitwise_logits, monkeypatch):
    """QSPEC_FLUSH=rows (the flush as a while loop over the flushing rows): the speculative loop's
    output equals AR's with the all-rows flush, tokens and logits. (gamma 3: no other test
    compiles it, so the loop is traced with the switch set.)"""
    monkeypatch.setenv("QSPEC_FLUSH", "rows")
    spec = SpecConfig(gamma=3, max_new_tokens=NEW, group_size=G, draft_group=32, return_logits=True)
    res = generate(model, prompts, spec)
    assert res.to_lists() == ar_ref["int8", 3].to_lists()
    assert bitwise_logits(ar_ref["int8", 3], res)


def test_int8_spec_at_gamma_max_gamma_equals_ar_at_its_width(model, prompts, bitwise_logits):
    """A fixed gamma with gamma_max = gamma (verify passes of gamma + 1 = 3 columns, README's advice for a
    fixed draft length): greedy output equals AR-int8 at width 3, tokens and logits. Before the reference
    attention summed its value-zero term as a reduction, the float32 logits differed here in the last bits
    (XLA:CPU's matrix-vector product at 3-5 columns; docs/QUALITY.md, "Exactness")."""
    spec = SpecConfig(gamma=2, gamma_max=2, max_new_tokens=NEW, group_size=G, draft_group=32, return_logits=True)
    res = generate(model, prompts, spec)
    ref = generate_autoregressive(model, prompts, GenerationConfig(max_new_tokens=NEW, kv="int8", group_size=G,
                                                                   width=spec.verify_width, return_logits=True))
    assert spec.verify_width == 3
    assert res.to_lists() == ref.to_lists()
    assert bitwise_logits(ref, res)
    assert res.acceptance_rate < 1.0


@pytest.mark.parametrize("gamma", [2, 6])
def test_dense_spec_equals_ar_bitwise(model, prompts, ar_ref, gamma, bitwise_logits):
    """Dense target cache, INT4-weight draft over the same cache."""
    spec = SpecConfig(gamma=gamma, max_new_tokens=NEW, draft_kv="bf16", target_kv="bf16", draft_group=32,
                      return_logits=True)
    res = generate(model, prompts, spec)
    assert res.to_lists() == ar_ref["bf16", 3].to_lists()
    assert bitwise_logits(ar_ref["bf16", 3], res)


def test_runs_cross_flushes(prompts):
    """The runs above really flush during generation (else the horizon logic is untested)."""
    for n in LENGTHS:
        q_start = G * max(0, n // G - 1)
        q_end = G * max(0, (n + NEW) // G - 1)
        assert q_end > q_start


def test_width_is_what_makes_it_exact():
    """Without the shape match (AR at width 1) bf16 logits differ from the verify pass's: the
    default width is doing real work, and the test model is wide enough to show it."""
    m = _model("bfloat16")
    rng = np.random.default_rng(3)
    p = [rng.integers(0, BASE.vocab_size, 90).tolist()]
    cfg = dict(max_new_tokens=12, kv="int8", group_size=G, return_logits=True)
    wide = generate_autoregressive(m, p, GenerationConfig(**cfg))
    narrow = generate_autoregressive(m, p, GenerationConfig(**cfg, width=1))
    n = min(int(wide.lengths[0]), int(narrow.lengths[0]))
    assert not np.array_equal(np.asarray(wide.logits)[0, 1:n], np.asarray(narrow.logits)[0, 1:n])


def test_decode_row_does_not_depend_on_other_columns(model):
    """model.decode at a fixed width: a position's logits are the same whether it is the only
    real token (AR) or one of several (verify)."""
    cfg = model.config
    rng = np.random.default_rng(1)
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 150)), jnp.int32)
    cache = QuantSpecCache.init(cfg, 1, 192, group_size=G, gamma_max=7)
    _, cache = jax.jit(M.prefill)(model.params, toks, jnp.array([150], jnp.int32), cache)
    new = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 5)), jnp.int32)
    dec = jax.jit(M.decode, static_argnames=("view", "width"))
    l5, _ = dec(model.params, new, cache, width=8)
    c = cache
    for i in range(5):
        l1, c = dec(model.params, new[:, i:i + 1], c, width=8)
        assert np.array_equal(np.asarray(l1[0, 0]), np.asarray(l5[0, i])), i
    with pytest.raises(ValueError, match="width=2 is smaller than the 5 tokens"):
        M.decode(model.params, new, cache, width=2)
    with pytest.raises(ValueError, match=r"tokens must be int32\[B, T\]"):
        M.decode(model.params, new[0], cache)


# ------------------------------------------------------------------------- per-row acceptance
def test_each_row_accepts_its_own_count():
    """Batched rows keep their own acceptance: each row's counters and tokens equal those of the
    same prompt run alone (float32: no near-ties between batch shapes). Cutting any row's accepted
    count to another row's (e.g. the batch minimum) changes its counters and fails this."""
    m = _model("float32")
    rng = np.random.default_rng(5)
    # Prompts repeating a short pattern are easy for any draft; random ones are not.
    easy = (list(rng.integers(0, 512, 6)) * 12)[:70]
    ps = [easy, rng.integers(0, 512, 50).tolist(), easy[:64]]
    spec = SpecConfig(gamma=4, max_new_tokens=24, group_size=G, draft_group=32)  # the INT4 draft
    batched = generate(m, ps, spec)
    acc = np.asarray(batched.accepted)
    assert len(set(acc.tolist())) > 1, acc  # the rows really differ
    for b, p in enumerate(ps):
        alone = generate(m, [p], spec)
        assert alone.to_lists()[0] == batched.to_lists()[b]
        for field in ("accepted", "drafted", "rounds", "emitted"):
            assert int(np.asarray(getattr(alone, field))[0]) == int(np.asarray(getattr(batched, field))[b]), (b, field)


def test_accept_limit_caps_each_row():
    p = jnp.full((3, 5, 8), -1.0)
    best = np.array([[3, 5, 1, 7, 2], [2, 2, 2, 2, 2], [4, 4, 4, 4, 4]])
    p = p.at[np.arange(3)[:, None], np.arange(5)[None], best].set(1.0)
    g = jnp.array([[3, 5, 1, 7], [2, 2, 2, 2], [4, 0, 4, 4]])
    n, y = accept_greedy(p, g, jnp.array([2, 4, 3]))
    np.testing.assert_array_equal(np.asarray(n), [2, 4, 1])
    np.testing.assert_array_equal(np.asarray(y), [1, 2, 4])  # row 0: capped, next = argmax at row 2


def test_accept_sampling_limit_gives_bonus_from_p():
    """Row limit k with all k drafts accepted: the next token is the bonus drawn from p at row k,
    not a residual norm(max(p - q, 0)). At row k, p is 50/50 on tokens {3, 4} and q is all on 3:
    the residual would always give 4, the bonus gives 3 about half the time."""
    v, gamma, k = 6, 4, 2
    logits = jnp.zeros((1, gamma + 1, v))
    logits = logits.at[0, k].set(jnp.array([-30.0, -30.0, -30.0, 5.0, 5.0, -30.0]))
    q_logits = logits[:, :gamma].at[0, k].set(jnp.array([-30.0, -30.0, -30.0, 20.0, -30.0, -30.0]))
    g = jnp.array([[0, 0, 3, 0]], jnp.int32)  # g_3 = 3 would be accepted w.p. 1/2 without the cap
    cfg = SamplingConfig(temperature=1.0)
    ys = []
    for seed in range(40):
        n, y = accept_sampling(jax.random.PRNGKey(seed), logits, q_logits, g, cfg, jnp.array([k]))
        assert int(n[0]) == k  # rows 0, 1: p == q, always accepted; never past the cap
        ys.append(int(y[0]))
    assert set(ys) == {3, 4}, ys
