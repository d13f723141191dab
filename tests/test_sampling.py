"""Speculative sampling reproduces the target's distribution (chi-square tests, fixed seeds)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qspec_jax import model as M
from qspec_jax.cache import DenseKVCache
from qspec_jax.checkpoint import Model
from qspec_jax.config import ModelConfig
from qspec_jax.sampling import SamplingConfig, log_probs, sample
from qspec_jax.speculative import SpecConfig, accept_sampling, generate

V = 32
CFG = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=16, dtype="float32", max_position_embeddings=256, eos_token_ids=(),
                  attention_impl="reference")
PROMPT = [3, 17, 9]
SAMPLES, CHUNK = 20_000, 5_000
P_MIN = 1e-3


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square test; cells with expected count < 5 are pooled."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    assert obs[~keep].sum() == 0, "samples in cells of zero probability"
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(jax.scipy.special.gammaincc(df / 2.0, stat / 2.0))


@pytest.fixture(scope="module")
def models():
    target = M.init_random_params(CFG, jax.random.PRNGKey(11), scale=0.4)
    draft = M.init_random_params(CFG, jax.random.PRNGKey(12), scale=0.4)  # deliberately different
    return Model(config=CFG, params=target), draft


def exact_marginals(params: M.Params, sampling: SamplingConfig) -> list[np.ndarray]:
    """Target distribution of the 1st, 2nd and 3rd generated tokens, by enumerating prefixes."""
    def next_probs(prefixes: np.ndarray) -> np.ndarray:
        b, t = prefixes.shape
        cache = DenseKVCache.init(CFG, b, 64)
        logits, _ = M.prefill(params, jnp.asarray(prefixes), jnp.full((b,), t, jnp.int32), cache)
        return np.asarray(jnp.exp(log_probs(logits, sampling)), np.float64)

    p1 = next_probs(np.asarray([PROMPT]))[0]  # [V]
    pre2 = np.asarray([PROMPT + [a] for a in range(V)])
    p2_given = next_probs(pre2)  # [V, V]
    pre3 = np.asarray([PROMPT + [a, b] for a in range(V) for b in range(V)])
    p3_given = next_probs(pre3).reshape(V, V, V)
    joint12 = p1[:, None] * p2_given
    return [p1, joint12.sum(0), (joint12[..., None] * p3_given).sum((0, 1))]


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=1.0, top_k=6),
                                      SamplingConfig(temperature=0.8, top_p=0.9)],
                         ids=["t1", "topk6", "t0.8-topp0.9"])
def test_speculative_sampling_follows_target(models, sampling):
    model, draft = models
    spec = SpecConfig(gamma=2, max_new_tokens=3, temperature=sampling.temperature, top_k=sampling.top_k,
                      top_p=sampling.top_p, draft_kv="bf16", target_kv="bf16", eos_token_ids=())
    rows = []
    for i in range(SAMPLES // CHUNK):
        res = generate(model, [PROMPT] * CHUNK, spec, jax.random.PRNGKey(100 + i), draft_params=draft, bucket=1)
        rows.append(np.asarray(res.tokens))
        assert res.acceptance_rate < 0.9  # the draft really differs, so rejections are exercised
    toks = np.concatenate(rows)
    for pos, probs in enumerate(exact_marginals(model.params, sampling)):
        counts = np.bincount(toks[:, pos], minlength=V)
        p = chi_square_p(counts, probs)
        assert p > P_MIN, f"token {pos + 1}: chi-square p = {p:.2e}"


def test_accept_sampling_first_token_is_distributed_as_p():
    """One round with gamma = 1 on fixed p and q: emitted token ~ p, whatever q is."""
    n = 200_000
    key = jax.random.PRNGKey(0)
    p_logits = jax.random.normal(key, (V,)) * 2.0
    q_logits = jax.random.normal(jax.random.fold_in(key, 1), (V,)) * 2.0
    cfg = SamplingConfig(temperature=1.0)
    g = sample(jax.random.fold_in(key, 2), jnp.broadcast_to(q_logits, (n, V)), cfg)[:, None]
    pl = jnp.broadcast_to(jnp.stack([p_logits, p_logits]), (n, 2, V))
    ql = jnp.broadcast_to(q_logits[None], (n, 1, V))
    acc, y = accept_sampling(jax.random.fold_in(key, 3), pl, ql, g, cfg)
    first = np.where(np.asarray(acc) > 0, np.asarray(g[:, 0]), np.asarray(y))
    probs = np.asarray(jax.nn.softmax(p_logits), np.float64)
    assert chi_square_p(np.bincount(first, minlength=V), probs) > P_MIN
    # and the draft alone would fail the same test, so the test has power
    assert chi_square_p(np.bincount(np.asarray(g[:, 0]), minlength=V), probs) < 1e-6


def test_sampling_config_errors():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(temperature=1, top_p=0.0)
