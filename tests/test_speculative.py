"""Speculative generation on tiny random float32 models: exactness, batching, stops, bad input."""

import dataclasses

import jax
import numpy as np
import pytest

from qspec_jax import model as M
from qspec_jax.checkpoint import Model
from qspec_jax.config import ModelConfig
from qspec_jax.generation import PAD_ID, GenerationConfig, generate_autoregressive
from qspec_jax.speculative import SpecConfig, accept_greedy, generate

TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=6,
                   num_kv_heads=2, head_dim=16, dtype="float32", max_position_embeddings=512,
                   eos_token_ids=(), attention_impl="reference")
EXACT = dict(draft_kv="bf16", target_kv="bf16")  # dense cache for both: speculative == autoregressive


@pytest.fixture(scope="module")
def tiny():
    return Model(config=TINY, params=M.init_random_params(TINY, jax.random.PRNGKey(1), scale=0.3))


@pytest.fixture(scope="module")
def other_draft():
    """A draft that disagrees with the target often: another random model of the same shape."""
    return M.init_random_params(TINY, jax.random.PRNGKey(7), scale=0.3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, TINY.vocab_size, n).tolist() for n in (5, 17, 40)]


@pytest.fixture(scope="module")
def ar_greedy(tiny, prompts):
    return generate_autoregressive(tiny, prompts, GenerationConfig(max_new_tokens=24)).to_lists()


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_equals_autoregressive_with_identical_draft(tiny, prompts, ar_greedy, gamma):
    res = generate(tiny, prompts, SpecConfig(gamma=gamma, max_new_tokens=24, draft_weights="bf16", **EXACT))
    assert res.to_lists() == ar_greedy
    assert res.acceptance_rate == 1.0  # the draft is the target


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_equals_autoregressive_with_disagreeing_draft(tiny, other_draft, prompts, ar_greedy, gamma):
    res = generate(tiny, prompts, SpecConfig(gamma=gamma, max_new_tokens=24, **EXACT), draft_params=other_draft)
    assert res.to_lists() == ar_greedy
    assert res.acceptance_rate < 0.5  # rejections really happened, so rollback was exercised
    np.testing.assert_array_equal(np.asarray(res.drafted), gamma * np.asarray(res.rounds))
    np.testing.assert_array_equal(np.asarray(res.emitted), np.asarray(res.lengths) - 1)


def test_counters_match_definitions(tiny, other_draft, prompts):
    res = generate(tiny, prompts, SpecConfig(gamma=4, max_new_tokens=24, **EXACT), draft_params=other_draft)
    emitted, rounds = np.asarray(res.emitted), np.asarray(res.rounds)
    assert res.tokens_per_round == pytest.approx(emitted.sum() / rounds.sum())
    assert res.acceptance_rate == pytest.approx(np.asarray(res.accepted).sum() / np.asarray(res.drafted).sum())
    # Each live round emits n + 1 tokens, except a round cut short by max_new_tokens.
    assert (emitted <= np.asarray(res.accepted) + rounds).all()


@pytest.mark.slow
def test_hierarchical_cache_int4_draft_matches_int8_autoregressive(tiny, prompts):
    """Full method (INT4 weights + INT4 KV draft, INT8 target) on the tiny model."""
    spec = SpecConfig(gamma=4, max_new_tokens=24, group_size=16, draft_group=32)
    res = generate(tiny, prompts, spec)
    ar = generate_autoregressive(tiny, prompts, GenerationConfig(max_new_tokens=24, kv="int8", group_size=16))
    assert res.to_lists() == ar.to_lists()


@pytest.mark.slow
def test_batch_rows_equal_single_runs(tiny, prompts):
    spec = SpecConfig(gamma=3, max_new_tokens=20, group_size=16, draft_group=32)
    batched = generate(tiny, prompts, spec).to_lists()
    for p, row in zip(prompts, batched):
        assert generate(tiny, [p], spec).to_lists()[0] == row


def test_accept_greedy_counts_leading_matches():
    import jax.numpy as jnp

    p = jnp.full((2, 4, 8), -1.0)
    best = np.array([[3, 5, 1, 7], [2, 2, 2, 2]])
    p = p.at[np.arange(2)[:, None], np.arange(4)[None], best].set(1.0)
    g = jnp.array([[3, 5, 0], [2, 2, 2]])
    n, y = accept_greedy(p, g)
    np.testing.assert_array_equal(np.asarray(n), [2, 3])
    np.testing.assert_array_equal(np.asarray(y), [1, 2])  # correction at 2; bonus from the last position


def test_eos_mid_round_stops_the_row(tiny, prompts, ar_greedy):
    row = ar_greedy[1]
    # an EOS token whose first occurrence is mid-stream: it ends the row right there
    pos = next(i for i in range(3, len(row)) if row[i] not in row[:i])
    eos = row[pos]
    spec = SpecConfig(gamma=6, max_new_tokens=24, draft_weights="bf16", eos_token_ids=(eos,), **EXACT)
    res = generate(tiny, [prompts[1]], spec)
    assert res.to_lists()[0] == row[: pos + 1]
    toks = np.asarray(res.tokens)[0]
    assert (toks[pos + 1:] == PAD_ID).all()
    ar = generate_autoregressive(tiny, [prompts[1]], GenerationConfig(max_new_tokens=24, eos_token_ids=(eos,)))
    assert ar.to_lists()[0] == row[: pos + 1]


@pytest.mark.parametrize("max_new", [1, 2, 7, 12])
def test_max_new_tokens_mid_round(tiny, prompts, ar_greedy, max_new):
    spec = SpecConfig(gamma=4, max_new_tokens=max_new, draft_weights="bf16", **EXACT)  # rounds emit 5 tokens
    res = generate(tiny, prompts, spec)
    assert res.tokens.shape == (3, max_new)
    assert res.to_lists() == [r[:max_new] for r in ar_greedy]
    np.testing.assert_array_equal(np.asarray(res.lengths), max_new)
    np.testing.assert_array_equal(np.asarray(res.emitted), max_new - 1)


def test_bad_inputs(tiny):
    with pytest.raises(ValueError, match="gamma=0"):
        SpecConfig(gamma=0)
    with pytest.raises(ValueError, match="gamma=8 must be in 1..gamma_max=7"):
        SpecConfig(gamma=8)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=512"):
        generate(tiny, [[1] * 500], SpecConfig(max_new_tokens=20))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(tiny, [[1, 2], []], SpecConfig())
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate(tiny, [], SpecConfig())
    with pytest.raises(ValueError, match="draft reads the target's cache"):
        SpecConfig(draft_kv="int4", target_kv="bf16")
    with pytest.raises(ValueError, match="outside"):
        generate(tiny, [[1, 64]], SpecConfig())


def test_spec_config_is_static_and_hashable():
    a, b = SpecConfig(gamma=3), dataclasses.replace(SpecConfig(), gamma=3)
    assert a == b and hash(a) == hash(b)


def test_fixed_draft_length_runs_a_static_loop(tiny):
    """A fixed draft length drafts in a loop of static trip count (on a GPU a loop of unknown trip
    count syncs with the host every iteration); a traced length keeps the while loop. Both give
    the same drafts."""
    from qspec_jax.cache import DenseKVCache
    from qspec_jax.speculative import draft_tokens

    spec = SpecConfig(gamma=3, max_new_tokens=8, **EXACT)
    cache = DenseKVCache.init(TINY, 2, 64)
    _, cache = M.prefill(tiny.params, np.array([[3, 5, 7, 9], [2, 4, 6, 8]], np.int32),
                         np.array([4, 3], np.int32), cache)
    pending = np.array([11, 13], np.int32)
    key = jax.random.PRNGKey(3)
    static = jax.make_jaxpr(lambda c: draft_tokens(tiny.params, pending, c, key, spec, steps=3))(cache)
    traced = jax.make_jaxpr(lambda c, n: draft_tokens(tiny.params, pending, c, key, spec, steps=n))(cache, 3)
    outer = lambda jaxpr: {e.primitive.name for e in jaxpr.jaxpr.eqns}  # noqa: E731
    assert "while" not in outer(static) and "scan" in outer(static)
    assert "while" in outer(traced)
    g_static, _, _ = draft_tokens(tiny.params, pending, cache, key, spec, steps=3)
    g_traced, _, _ = jax.jit(lambda c, n: draft_tokens(tiny.params, pending, c, key, spec, steps=n))(cache, 3)
    np.testing.assert_array_equal(np.asarray(g_static), np.asarray(g_traced))
    assert (np.asarray(g_static)[:, :3] != PAD_ID).any()
