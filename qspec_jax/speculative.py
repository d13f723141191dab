"""QuantSpec self-speculative generation in one jitted `lax.while_loop` (SPEC §4, §6, §7).

One round, per batch row (every row drafts gamma tokens; each accepts its own number):

    draft   gamma steps of the draft model (INT4 weights, draft view of the shared cache) on the
            pending token x_N, then g_1 .. g_{gamma-1}; each writes its K/V into the ring
    verify  one target pass (bf16 weights, target view) over [x_N, g_1 .. g_gamma], overwriting
            those gamma+1 ring slots with target K/V
    accept  greedy: accept while g_i is the target argmax; sampling: accept g_i with probability
            min(1, p(g_i)/q(g_i)), on rejection sample from norm(max(p - q, 0)); the bonus token
            comes from p_{gamma+1} when all are accepted
    commit  the row's committed length moves to old + n + 1 (x_N, g_1 .. g_n); the correction or
            bonus token becomes the new pending token; finished rows commit nothing
    flush   rows whose ring holds >= 2G tokens quantize their oldest G

The draft and the target share one cache, so drafting costs no extra KV memory.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qspec_jax import model as M
from qspec_jax.cache import DEFAULT_GAMMA_MAX, DEFAULT_GROUP_SIZE
from qspec_jax.generation import PAD_ID, cache_capacity, check_fits, eos_array, new_cache, pad_prompts, run_jitted
from qspec_jax.sampling import SamplingConfig, log_probs, sample
from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

Array = jax.Array
DRAFT_KV = ("int4", "int8", "bf16")
TARGET_KV = ("int8", "bf16")
DRAFT_WEIGHTS = ("int4", "bf16")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static settings of speculative generation.

    draft_kv / draft_weights / target_kv select the paper's ablations:
      both (default): draft_weights="int4", draft_kv="int4", target_kv="int8"
      KV only:        draft_weights="bf16", draft_kv="int4"
      weights only:   draft_weights="int4", draft_kv="int8" (or "bf16" with target_kv="bf16")
    The draft shares the target's cache, so draft_kv must be a view of it: "int4"/"int8" over
    the hierarchical cache (target_kv="int8"), or "bf16" over the dense one (target_kv="bf16").
    """

    gamma: int = 4
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_ids: tuple[int, ...] | None = None
    group_size: int = DEFAULT_GROUP_SIZE
    gamma_max: int = DEFAULT_GAMMA_MAX
    draft_kv: str = "int4"
    draft_weights: str = "int4"
    # Draft-weight format; defaults are DraftWeightsConfig's (chosen by measurement, docs/QUALITY.md).
    draft_group: int = DraftWeightsConfig.group_size
    draft_scope: str = DraftWeightsConfig.scope
    draft_lm_head: bool = DraftWeightsConfig.lm_head
    draft_method: str = DraftWeightsConfig.method
    target_kv: str = "int8"
    # Benchmarks only: accept each draft with this probability instead of verifying (output is
    # then not the target's). None (the default) verifies.
    forced_acceptance: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.gamma <= self.gamma_max:
            raise ValueError(f"gamma={self.gamma} must be in 1..gamma_max={self.gamma_max}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        for name, allowed in (("draft_kv", DRAFT_KV), ("target_kv", TARGET_KV), ("draft_weights", DRAFT_WEIGHTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; expected one of {allowed}")
        if self.target_kv == "int8" and self.gamma_max >= self.group_size:
            raise ValueError(f"gamma_max={self.gamma_max} must be < group_size={self.group_size} (SPEC §4 flush)")
        if (self.target_kv == "bf16") != (self.draft_kv == "bf16"):
            raise ValueError(
                f"draft_kv={self.draft_kv!r} with target_kv={self.target_kv!r}: the draft reads the target's "
                "cache, so use draft_kv int4/int8 with target_kv='int8', or bf16 with bf16")
        self.sampling  # validates the sampling fields
        self.draft_weights_config  # validates the draft-weight fields

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    @property
    def draft_weights_config(self) -> DraftWeightsConfig:
        return DraftWeightsConfig(group_size=self.draft_group, scope=self.draft_scope,
                                  lm_head=self.draft_lm_head, method=self.draft_method)

    @property
    def draft_view(self) -> str:
        return "draft" if self.draft_kv == "int4" else "target"


@struct.dataclass
class SpecResult:
    """Generated tokens plus per-row counters (SPEC §7).

    tokens: int32[B, max_new_tokens] (PAD_ID past lengths); lengths: int32[B] (the first token,
    sampled from the prefill logits, included). drafted/accepted: draft tokens proposed/accepted;
    rounds: verify passes; emitted: tokens emitted by rounds (lengths minus the prefill token).
    """

    tokens: Array
    lengths: Array
    drafted: Array
    accepted: Array
    rounds: Array
    emitted: Array

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (corrections and bonus tokens not counted)."""
        return float(np.sum(self.accepted)) / max(1, float(np.sum(self.drafted)))

    @property
    def tokens_per_round(self) -> float:
        """Emitted tokens / verify passes (about 1 + gamma * acceptance)."""
        return float(np.sum(self.emitted)) / max(1, float(np.sum(self.rounds)))

    def to_lists(self) -> list[list[int]]:
        toks, lens = np.asarray(self.tokens), np.asarray(self.lengths)
        return [toks[b, : lens[b]].tolist() for b in range(toks.shape[0])]


@struct.dataclass
class _SpecState:
    tokens: Array  # int32[B, N]
    num_emitted: Array  # int32[B]
    pending: Array  # int32[B]: sampled, K/V not yet computed
    done: Array  # bool[B]
    cache: Any
    key: Array
    drafted: Array
    accepted: Array
    rounds: Array
    emitted: Array


# --------------------------------------------------------------------------------- phases
def draft_tokens(draft_params: M.Params, pending: Array, cache: Any, key: Array, spec: SpecConfig
                 ) -> tuple[Array, Array | None, Any]:
    """gamma draft steps from the pending token.

    Returns (g int32[B, gamma], draft logits float32[B, gamma, V] or None when greedy, cache).
    """

    def step(carry, i):
        tok, cache = carry
        logits, cache = M.decode(draft_params, tok[:, None], cache, view=spec.draft_view)
        logits = logits[:, 0]
        nxt = sample(jax.random.fold_in(key, i), logits, spec.sampling)
        return (nxt, cache), (nxt, None if spec.sampling.greedy else logits)

    (_, cache), (g, q_logits) = jax.lax.scan(step, (pending, cache), jnp.arange(spec.gamma))
    return g.T, None if q_logits is None else jnp.swapaxes(q_logits, 0, 1), cache


def accept_greedy(p_logits: Array, g: Array) -> tuple[Array, Array]:
    """p_logits [B, gamma+1, V], g [B, gamma] -> (n accepted int32[B], next token int32[B])."""
    best = jnp.argmax(p_logits, axis=-1).astype(jnp.int32)  # [B, gamma+1]
    n = jnp.sum(jnp.cumprod(g == best[:, :-1], axis=1), axis=1).astype(jnp.int32)
    return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]


def accept_sampling(key: Array, p_logits: Array, q_logits: Array, g: Array, cfg: SamplingConfig
                    ) -> tuple[Array, Array]:
    """Speculative sampling (Leviathan et al.; Chen et al.): reproduces the target distribution.

    p_logits [B, gamma+1, V] (target), q_logits [B, gamma, V] (draft), g [B, gamma].
    """
    k_u, k_y = jax.random.split(key)
    p = jnp.exp(log_probs(p_logits, cfg))
    q = jnp.exp(log_probs(q_logits, cfg))
    p_g = jnp.take_along_axis(p[:, :-1], g[..., None], axis=-1)[..., 0]
    q_g = jnp.take_along_axis(q, g[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_u, g.shape)
    ok = u * q_g < p_g  # u < p/q, i.e. accept with probability min(1, p/q)
    n = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q_{gamma+1} = 0: bonus ~ p
    at_n = lambda x: jnp.take_along_axis(x, n[:, None, None], axis=1)[:, 0]  # noqa: E731
    resid = jnp.maximum(at_n(p) - at_n(q_pad), 0.0)
    total = jnp.sum(resid, axis=-1, keepdims=True)
    resid = jnp.where(total > 0, resid, at_n(p))  # p == q exactly: rejection cannot have happened
    y = jax.random.categorical(k_y, jnp.log(resid), axis=-1).astype(jnp.int32)
    return n, y


def _emit(s: _SpecState, g: Array, n: Array, y: Array, eos: Array, n_max: int) -> tuple[Array, Array, Array, Array]:
    """Writes g_1..g_n, y after each live row's emitted tokens, stopping at EOS and n_max.

    Returns (tokens, count emitted per row, hit_eos, live).
    """
    b, gamma = g.shape
    j = jnp.arange(gamma + 1)[None, :]
    seq = jnp.where(j < n[:, None], jnp.pad(g, ((0, 0), (0, 1))), y[:, None])  # [B, gamma+1]
    valid = j <= n[:, None]
    is_eos = valid & jnp.isin(seq, eos)
    first_eos = jnp.argmax(is_eos, axis=1)
    count = jnp.where(jnp.any(is_eos, axis=1), first_eos + 1, n + 1)
    live = ~s.done
    count = jnp.where(live, jnp.minimum(count, n_max - s.num_emitted), 0)
    col = jnp.where(j < count[:, None], s.num_emitted[:, None] + j, n_max)  # n_max: dropped
    tokens = s.tokens.at[jnp.arange(b)[:, None], col].set(seq, mode="drop")
    hit_eos = jnp.any(is_eos & (j < count[:, None]), axis=1)
    return tokens, count, hit_eos, live


def forced_accept(key: Array, p_logits: Array, rate: float, gamma: int) -> tuple[Array, Array]:
    """Benchmark-only acceptance: each draft is accepted i.i.d. with probability `rate`, so
    n ~ the leading successes (E[tokens/round] = (1 - rate^(gamma+1)) / (1 - rate)). The emitted
    tokens are then NOT the target's output; this exists to time rounds at a chosen acceptance."""
    b = p_logits.shape[0]
    ok = jax.random.uniform(key, (b, gamma)) < rate
    n = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    best = jnp.argmax(p_logits, axis=-1).astype(jnp.int32)
    return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]


def speculative_loop(target: M.Params, draft: M.Params, cache: Any, first: Array, key: Array, *,
                     spec: SpecConfig, eos_ids: tuple[int, ...]) -> SpecResult:
    """Speculative rounds from a cache that holds the prompts; `first` int32[B] is the token
    sampled from the prefill logits (emitted as token 0 and pending: its K/V is not computed)."""
    n_max, b = spec.max_new_tokens, first.shape[0]
    eos = eos_array(eos_ids)
    zeros = jnp.zeros((b,), jnp.int32)
    state = _SpecState(
        tokens=jnp.full((b, n_max), PAD_ID, jnp.int32).at[:, 0].set(first),
        num_emitted=jnp.ones((b,), jnp.int32), pending=first,
        done=jnp.isin(first, eos) | (n_max == 1), cache=cache.flush(), key=key,
        drafted=zeros, accepted=zeros, rounds=zeros, emitted=zeros)

    def cond(s: _SpecState) -> Array:
        return ~jnp.all(s.done)

    def body(s: _SpecState) -> _SpecState:
        k_draft, k_accept, key = jax.random.split(s.key, 3)
        committed = s.cache.total_lengths()
        g, q_logits, cache = draft_tokens(draft, s.pending, s.cache, k_draft, spec)
        verify_in = jnp.concatenate([s.pending[:, None], g], axis=1)  # [B, gamma+1]
        p_logits, cache = M.decode(target, verify_in, cache.rollback(committed), view="target")
        if spec.forced_acceptance is not None:
            n, y = forced_accept(k_accept, p_logits, spec.forced_acceptance, spec.gamma)
        elif spec.sampling.greedy:
            n, y = accept_greedy(p_logits, g)
        else:
            n, y = accept_sampling(k_accept, p_logits, q_logits, g, spec.sampling)
        tokens, count, hit_eos, live = _emit(s, g, n, y, eos, n_max)
        num = s.num_emitted + count
        cache = cache.rollback(committed + jnp.where(live, n + 1, 0)).flush()
        live_i = live.astype(jnp.int32)
        return _SpecState(
            tokens=tokens, num_emitted=num, pending=y, done=s.done | hit_eos | (num >= n_max),
            cache=cache, key=key,
            drafted=s.drafted + live_i * spec.gamma, accepted=s.accepted + live_i * n,
            rounds=s.rounds + live_i, emitted=s.emitted + count)

    s = jax.lax.while_loop(cond, body, state)
    return SpecResult(tokens=s.tokens, lengths=s.num_emitted, drafted=s.drafted, accepted=s.accepted,
                      rounds=s.rounds, emitted=s.emitted)


@functools.partial(jax.jit, static_argnames=("spec", "eos_ids", "max_len"))
def _speculative(target: M.Params, draft: M.Params, tokens: Array, lengths: Array, key: Array, *,
                 spec: SpecConfig, eos_ids: tuple[int, ...], max_len: int) -> SpecResult:
    cache = new_cache(target.config, spec.target_kv, tokens.shape[0], max_len, spec.group_size, spec.gamma_max,
                      mesh=target.mesh)
    logits, cache = M.prefill(target, tokens, lengths, cache)  # target weights fill the shared cache
    key, sub = jax.random.split(key)
    first = sample(sub, logits, spec.sampling)
    return speculative_loop(target, draft, cache, first, key, spec=spec, eos_ids=eos_ids)


# ---------------------------------------------------------------------------------- public
def draft_params_for(model: Any, spec: SpecConfig) -> M.Params:
    """The draft's params: the target's for draft_weights="bf16", else INT4 weights, taken from
    the checkpoint when they match `spec` and made now otherwise."""
    if spec.draft_weights == "bf16":
        return model.params
    want = spec.draft_weights_config
    have = getattr(model, "draft_params", None)
    if have is not None and getattr(model, "draft_weights_config", None) == want:
        return have
    draft = make_draft_params(model.params, want)
    if model.params.mesh is not None:
        from qspec_jax.sharding import shard_params

        draft = shard_params(draft, model.params.mesh, want.group_size)
    return draft


def generate(model: Any, prompt_ids: Sequence[Sequence[int]] | np.ndarray, config: SpecConfig = SpecConfig(),
             key: Array | None = None, draft_params: M.Params | None = None, *,
             timings: dict[str, float] | None = None) -> SpecResult:
    """Speculative generation of up to `config.max_new_tokens` tokens per prompt.

    `model` is a `qspec_jax.Model`. `draft_params` overrides the draft (any params with the
    target's config; tests use this to check exactness with a deliberately different draft).
    Greedy output equals the target's own greedy output; sampling follows the target's
    distribution exactly. Pass a dict as `timings` to get compile and run seconds.
    """
    target: M.Params = model.params
    cfg = target.config
    tokens, lengths = pad_prompts(prompt_ids, cfg.vocab_size)
    check_fits(cfg, lengths, config.max_new_tokens)
    eos = config.eos_token_ids if config.eos_token_ids is not None else cfg.eos_token_ids
    draft = draft_params if draft_params is not None else draft_params_for(model, config)
    if draft.config.replace(attention_impl=cfg.attention_impl) != cfg:
        raise ValueError("draft_params were built for a different model config than the target's")
    draft = draft.replace(config=cfg)
    if draft.mesh != target.mesh:
        raise ValueError("the draft params are not on the target's mesh: shard both (qspec_jax.sharding.shard)")
    max_len = cache_capacity(tokens.shape[1], config.max_new_tokens + config.gamma + 1, config.group_size)
    key = jax.random.PRNGKey(0) if key is None else key
    return run_jitted(_speculative, (target, draft, jnp.asarray(tokens), jnp.asarray(lengths), key),
                      dict(spec=config, eos_ids=tuple(eos), max_len=max_len), timings)
