"""Dynamic draft length (SpecConfig.draft_policy): the BASS update, exactness, distribution.

A draft policy changes how many drafts a round offers, never what verification does: greedy
output stays the target's own autoregressive output bit for bit (the "cycle" schedule forces
every length 1..gamma_max, "bass" adapts), and speculative sampling still follows the target's
distribution (chi-square, as in test_sampling.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qspec_jax import model as M
from qspec_jax.cache import DEFAULT_GAMMA_MAX
from qspec_jax.checkpoint import Model
from qspec_jax.config import ModelConfig
from qspec_jax.generation import GenerationConfig, generate_autoregressive
from qspec_jax.speculative import SpecConfig, generate, next_draft_length
from test_sampling import CFG as TINY, CHUNK, P_MIN, PROMPT, SAMPLES, V, chi_square_p, exact_marginals

# As tests/test_exactness.py: wide enough that XLA's CPU dots round differently per pass shape.
BASE = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=6,
                   num_kv_heads=2, head_dim=64, dtype="bfloat16", max_position_embeddings=2048,
                   eos_token_ids=(), attention_impl="reference")
G = 16
NEW = 40
LENGTHS = (37, 80, 121)


def _model(dtype: str = "bfloat16", seed: int = 1) -> Model:
    cfg = dataclasses.replace(BASE, dtype=dtype)
    return Model(config=cfg, params=M.init_random_params(cfg, jax.random.PRNGKey(seed), scale=0.08))


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, BASE.vocab_size, n).tolist() for n in LENGTHS]


# ---------------------------------------------------------------------------- the update rule
def bass_reference(length: int, s: int, accepted: list[int], limit: list[int], live: list[bool], *, incre: int,
                   mod: int, top: int) -> tuple[int, int, str]:
    """BASS Algorithm 1 over the live rows, transcribed: increase when some row accepted all
    `length` drafts, else (some row rejected) decrease, never below the largest accepted count;
    rows that neither rejected nor could accept `length` (cut by the flush horizon) say nothing.
    Returns (length, s, branch)."""
    xs = [x for x, a in zip(accepted, live) if a]
    lims = [m for m, a in zip(limit, live) if a]
    if xs and max(xs) == length:
        return min(length + incre, top), 0, "up"
    if any(x < m for x, m in zip(xs, lims)):
        return max(1, *xs, length - length // mod - s), 1, "down"
    return length, s, "same"


def test_bass_update_matches_algorithm_1():
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(300):
        incre, mod = int(rng.integers(1, 4)), int(rng.integers(1, 12))
        spec = SpecConfig(gamma=1, gamma_max=8, draft_policy="bass", bass_increment=incre, bass_mod=mod)
        b = int(rng.integers(1, 5))
        length, s = int(rng.integers(1, 9)), int(rng.integers(0, 2))
        limit = rng.integers(0, length + 1, b) if rng.random() < 0.3 else np.full(b, length)
        acc = np.array([rng.integers(0, m + 1) for m in limit])
        live = rng.random(b) < 0.8
        *want, branch = bass_reference(length, s, acc.tolist(), limit.tolist(), live.tolist(), incre=incre,
                                       mod=mod, top=8)
        got = next_draft_length(spec, jnp.int32(length), jnp.int32(s), jnp.asarray(acc, jnp.int32),
                                jnp.asarray(limit, jnp.int32), jnp.asarray(live))
        assert [int(got[0]), int(got[1])] == want, (length, s, acc, limit, live, incre, mod)
        seen.add(branch)
    assert seen == {"up", "down", "same"}  # every branch was exercised


def test_bass_update_examples():
    """Hand-worked rounds (bass_increment 1, bass_mod 4, limit 8, one live row)."""
    spec = SpecConfig(gamma=4, gamma_max=8, draft_policy="bass")
    f = lambda d, s, n, lim: tuple(int(x) for x in next_draft_length(  # noqa: E731
        spec, jnp.int32(d), jnp.int32(s), jnp.array([n]), jnp.array([lim]), jnp.array([True])))
    assert f(4, 0, 4, 4) == (5, 0)  # all accepted: longer
    assert f(8, 0, 8, 8) == (8, 0)  # ... up to the limit
    assert f(8, 0, 2, 8) == (6, 1)  # rejection: 8 - 8 // 4 - 0
    assert f(6, 1, 0, 6) == (4, 1)  # again: 6 - 1 - 1
    assert f(4, 1, 3, 4) == (3, 1)  # 4 - 1 - 1 = 2, but 3 were accepted
    assert f(2, 1, 0, 2) == (1, 1)  # never below 1
    assert f(5, 1, 2, 2) == (5, 1)  # flush horizon: 2 of 2 verifiable accepted, no signal


def test_cycle_and_fixed_updates():
    live, n, lim = jnp.array([True]), jnp.array([0]), jnp.array([1])
    cyc = SpecConfig(gamma=3, draft_policy="cycle", draft_limit=5)
    d, seq = jnp.int32(3), []
    for _ in range(7):
        seq.append(int(d))
        d, _ = next_draft_length(cyc, d, jnp.int32(0), n, lim, live)
    assert seq == [3, 4, 5, 1, 2, 3, 4]
    fixed = SpecConfig(gamma=3)
    assert int(next_draft_length(fixed, jnp.int32(3), jnp.int32(0), n, lim, live)[0]) == 3


def test_config_fields():
    assert SpecConfig(gamma=2, draft_policy="bass").max_draft == DEFAULT_GAMMA_MAX
    assert SpecConfig(gamma=2, draft_policy="bass", draft_limit=5).max_draft == 5
    assert SpecConfig(gamma=2).max_draft == 2
    # exact mode: one verify width whatever the policy; inexact: the longest draft + 1
    assert SpecConfig(gamma=2, draft_policy="bass", draft_limit=5).verify_width == DEFAULT_GAMMA_MAX + 1
    assert SpecConfig(gamma=2, draft_policy="bass", draft_limit=5, exact=False).verify_width == 6
    assert hash(SpecConfig(draft_policy="bass")) == hash(SpecConfig(draft_policy="bass"))
    with pytest.raises(ValueError, match="draft_policy='adaptive'"):
        SpecConfig(draft_policy="adaptive")
    with pytest.raises(ValueError, match=r"draft_limit=3 must be in gamma..gamma_max = 4..8"):
        SpecConfig(gamma=4, gamma_max=8, draft_policy="bass", draft_limit=3)
    with pytest.raises(ValueError, match="draft_limit=9"):
        SpecConfig(gamma=4, gamma_max=8, draft_policy="bass", draft_limit=9)
    with pytest.raises(ValueError, match="bounds a dynamic draft_policy"):
        SpecConfig(gamma=4, draft_limit=6)
    with pytest.raises(ValueError, match="bass_mod=0"):
        SpecConfig(draft_policy="bass", bass_mod=0)
    with pytest.raises(ValueError, match=r"gamma='auto'.*planner\.plan"):
        SpecConfig(gamma="auto")


# ------------------------------------------------------------------------------- exactness
@pytest.fixture(scope="module")
def ar_int8(model, prompts):
    cfg = GenerationConfig(max_new_tokens=NEW, kv="int8", group_size=G, return_logits=True)
    return {b: generate_autoregressive(model, prompts[:b], cfg) for b in (1, 3)}


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
@pytest.mark.parametrize("policy", ["cycle", "bass"])
@pytest.mark.parametrize("batch", [1, 3])
def test_dynamic_policy_equals_ar_bitwise(model, prompts, ar_int8, policy, batch, bitwise_logits):
    """The full method (INT4 weights + INT4 KV draft, INT8 target crossing flushes) with a draft
    length that changes every round: tokens and float32 logits equal autoregressive decoding's."""
    spec = SpecConfig(gamma=1, max_new_tokens=NEW, group_size=G, draft_group=32, draft_policy=policy,
                      return_logits=True)
    res = generate(model, prompts[:batch], spec)
    ref = ar_int8[batch]
    assert res.to_lists() == ref.to_lists()
    assert bitwise_logits(ref, res)
    assert res.acceptance_rate < 1.0  # rejections happened
    assert 1.0 < res.mean_draft_length < spec.gamma_max  # the length really moved
    drafted, steps = np.asarray(res.drafted), np.asarray(res.draft_steps)
    assert np.all(drafted <= steps)  # a row verifies no draft that was not made


def _cycle_steps(gamma: int, top: int, rounds: int) -> int:
    d, total = gamma, 0
    for _ in range(rounds):
        total += d
        d = d % top + 1
    return total


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_cycle_runs_every_length_dense(model, prompts, bitwise_logits):
    """Dense cache (no flush horizon), batch 1: the rounds draft exactly the cycle 1, 2, .., gamma_max, 1, ..
    (every length), every draft made is offered to verification, and the output is AR's."""
    ref = generate_autoregressive(model, prompts[:1], GenerationConfig(max_new_tokens=NEW, kv="bf16",
                                                                       return_logits=True))
    spec = SpecConfig(gamma=1, max_new_tokens=NEW, draft_kv="bf16", target_kv="bf16", draft_group=32,
                      draft_policy="cycle", return_logits=True)
    res = generate(model, prompts[:1], spec)
    assert res.to_lists() == ref.to_lists()
    assert bitwise_logits(ref, res)
    rounds = int(res.rounds[0])
    assert rounds >= spec.gamma_max  # the schedule came round to every length
    assert int(res.draft_steps[0]) == _cycle_steps(1, spec.gamma_max, rounds)
    assert int(res.drafted[0]) == int(res.draft_steps[0])


def test_bass_lengthens_for_a_good_draft_and_shortens_for_a_bad_one(prompts):
    """float32, dense cache. The target's own weights as draft (every draft accepted): BASS climbs
    1, 2, .., gamma_max and stays there. A random unrelated draft (almost nothing accepted): it stays
    near 1. A policy that ignored acceptance would give both the same lengths."""
    m = _model("float32")
    spec = SpecConfig(gamma=1, max_new_tokens=NEW, draft_kv="bf16", target_kv="bf16", draft_policy="bass")
    good = generate(m, prompts[:1], spec, draft_params=m.params)
    assert good.acceptance_rate == 1.0
    rounds = int(good.rounds[0])
    # lengths 1..gamma_max, then gamma_max: each round emits d + 1 tokens until NEW - 1 are out
    climb = [min(r + 1, spec.gamma_max) for r in range(rounds)]
    assert sum(d + 1 for d in climb[:-1]) < NEW - 1 <= sum(d + 1 for d in climb)
    assert int(good.draft_steps[0]) == sum(climb)
    bad = generate(m, prompts[:1], spec, draft_params=_model("float32", seed=7).params)
    assert bad.acceptance_rate < 0.2
    assert bad.mean_draft_length < 2.0 < good.mean_draft_length


# ----------------------------------------------------------------------------- distribution
@pytest.fixture(scope="module")
def tiny_models():
    target = M.init_random_params(TINY, jax.random.PRNGKey(11), scale=0.4)
    draft = M.init_random_params(TINY, jax.random.PRNGKey(12), scale=0.4)  # deliberately different
    return Model(config=TINY, params=target), draft


@pytest.mark.parametrize("policy,gamma,limit", [("cycle", 1, 3), ("cycle", 3, 3), ("bass", 2, 4)],
                         ids=["cycle-1-2", "cycle-3-1", "bass"])
@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_dynamic_sampling_follows_target(tiny_models, policy, gamma, limit):
    """Speculative sampling with rounds of different lengths (cycle 1 then 2; cycle 3 then 1;
    BASS from 2) reproduces the target's distribution of the first three tokens."""
    model, draft = tiny_models
    spec = SpecConfig(gamma=gamma, max_new_tokens=3, temperature=1.0, draft_kv="bf16", target_kv="bf16",
                      eos_token_ids=(), draft_policy=policy, draft_limit=limit)
    rows = []
    for i in range(SAMPLES // CHUNK):
        res = generate(model, [PROMPT] * CHUNK, spec, jax.random.PRNGKey(200 + i), draft_params=draft, bucket=1)
        rows.append(np.asarray(res.tokens))
        assert res.acceptance_rate < 0.9  # rejections are exercised
        assert res.mean_draft_length != gamma  # rounds of another length ran
    toks = np.concatenate(rows)
    for pos, probs in enumerate(exact_marginals(model.params, spec.sampling)):
        p = chi_square_p(np.bincount(toks[:, pos], minlength=V), probs)
        assert p > P_MIN, f"token {pos + 1}: chi-square p = {p:.2e}"


# ------------------------------------------------------------- the benchmark's round simulator
def test_simulated_policy_rounds():
    """qspec-bench gamma's teacher-forced simulation: a fixed gamma reproduces
    evaluation.simulate_rounds; BASS on an all-agreeing row climbs 1, 2, .., 8; on a row that
    never agrees it stays at 1."""
    from qspec_jax.bench.gamma import simulate_policy
    from qspec_jax.evaluation import simulate_rounds

    rng = np.random.default_rng(0)
    agree = rng.random((3, 200)) < 0.8
    for gamma in (1, 3, 6):
        want = simulate_rounds(agree, gamma)
        got = simulate_policy(agree[:1], SpecConfig(gamma=gamma))
        for r in agree[1:]:
            got = {k: v + simulate_policy(r[None], SpecConfig(gamma=gamma))[k] for k, v in got.items()}
        assert got["rounds"] == want["rounds"]
        assert got["emitted"] / got["rounds"] == pytest.approx(want["tokens_per_round"])
    bass = SpecConfig(gamma=1, gamma_max=8, draft_policy="bass")
    good = simulate_policy(np.ones((1, 100), bool), bass)
    # 8 rounds of 1..8 drafts reach position 44, six of 8 reach 98, and the last position's round
    # can verify one draft only (positions past the row cannot be accepted)
    assert good["accepted"] == good["drafted"] and good["rounds"] == 15
    assert good["draft_steps"] == sum(range(1, 9)) + 6 * 8 + 1
    bad = simulate_policy(np.zeros((1, 50), bool), bass)
    assert bad["rounds"] == 50 and bad["draft_steps"] == 49 and bad["accepted"] == 0
