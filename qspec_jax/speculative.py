"""QuantSpec self-speculative generation in one jitted `lax.while_loop` (SPEC §4, §6, §7).

One round, per batch row (every row drafts the round's d tokens; each accepts its own number):

    draft   d steps of the draft model (INT4 weights, draft view of the shared cache) on the
            pending token x_N, then g_1 .. g_{d-1}; each writes its K/V into the ring
    verify  one target pass (bf16 weights, target view) over [x_N, g_1 .. g_d] (padded to the
            static verify width), overwriting those ring slots with target K/V
    accept  each row verifies its first k = min(d, flush horizon) drafts. Greedy: accept while
            g_i is the target argmax; sampling: accept g_i with probability min(1, p(g_i)/q(g_i)),
            on rejection sample from norm(max(p - q, 0)); the bonus token comes from p_{k+1}
            when all k are accepted
    commit  the row's committed length moves to old + n + 1 (x_N, g_1 .. g_n); the correction or
            bonus token becomes the new pending token; finished rows commit nothing
    flush   rows whose ring holds >= 2G tokens quantize their oldest G

The draft and the target share one cache, so drafting costs no extra KV memory.

Draft length (SpecConfig.draft_policy). The round's draft length d is a traced scalar, the same
for every row (BASS: the batch drafts together, each row accepts its own count): "fixed" keeps
d = gamma; "bass" adapts d after every round from the live rows' accepted counts (BASS,
Algorithm 1: longer when some row accepted all d drafts, shorter otherwise, never below the
largest count accepted), within 1..draft_limit; "cycle" steps through every length (tests). The
draft loop runs d steps and stops (a `lax.while_loop`: skipped steps cost nothing), and no more
than the largest number of drafts a live row may verify this round. The draft buffer and every
verify pass keep their static width (gamma_max + 1 columns in the exact mode): slots past d hold
PAD_ID and lie past each row's verification limit min(d, flush horizon), so they never change
what is accepted, and the pass computes what it computes at a fixed d.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qspec_jax import model as M
from qspec_jax.cache import DEFAULT_GAMMA_MAX, DEFAULT_GROUP_SIZE
from qspec_jax.generation import (PAD_ID, Progress, check_fits, check_prefill_chunk, eos_array, initial_logits,
                                   loop_rounds, new_cache, pad_prompts, progress_of, prng_key, record_logits,
                                   run_generation)
from qspec_jax.planner import (Request, check_params_fit, decode_cache_len, out_of_memory, prefill_chunk_for,
                               resource_exhausted, weight_bytes)
from qspec_jax.sampling import SamplingConfig, log_probs, sample
from qspec_jax.weight_quant import DraftWeightsConfig

Array = jax.Array
DRAFT_KV = ("int4", "int8", "bf16")
TARGET_KV = ("int8", "bf16")
DRAFT_WEIGHTS = ("int4", "bf16")
DRAFT_POLICIES = ("fixed", "bass", "cycle")


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
    draft_fold_norms: bool = DraftWeightsConfig.fold_norms
    target_kv: str = "int8"
    # Benchmarks only: accept each draft with this probability instead of verifying (output is
    # then not the target's). None (the default) verifies.
    forced_acceptance: float | None = None
    # Also return the float32 target logits each emitted token was chosen from (SpecResult.logits).
    return_logits: bool = False
    # True (default): verify passes have the autoregressive step's shape and rounds stop at the
    # flush horizon, so greedy output is the target's own, bit for bit (docs/QUALITY.md,
    # "Fidelity"). False: the INEXACT fast mode: gamma + 1 columns per verify pass and no
    # horizon, as before the fix; its output can differ from autoregressive decoding wherever the
    # target's top-2 logits are within rounding of each other. Kept to measure what exactness costs.
    exact: bool = True
    # Draft length per round (module docstring, "Draft length"): "fixed" drafts gamma tokens every
    # round; "bass" starts at gamma and adapts within 1..draft_limit (BASS, Algorithm 1, with
    # l_incre = bass_increment and l_mod = bass_mod); "cycle" runs gamma, gamma+1, .., draft_limit,
    # 1, 2, .. (a diagnostic schedule that forces every length; tests use it).
    draft_policy: str = "fixed"
    draft_limit: int | None = None  # longest draft of "bass"/"cycle"; None: gamma_max
    # BASS's own values are l_incre 2, l_mod 10 for l_limit 32; these suit limits near 8 (measured:
    # docs/QUALITY.md, "Draft length").
    bass_increment: int = 1
    bass_mod: int = 4
    # How the prompt is prefilled: "auto", "whole" or a chunk size, and whether its progress is reported on
    # stderr (GenerationConfig.prefill_chunk, prefill_progress).
    prefill_chunk: int | str = "auto"
    prefill_progress: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.gamma, str):
            raise ValueError(f"gamma={self.gamma!r}: SpecConfig takes a number of draft tokens; gamma 'auto' is "
                             "chosen by qspec_jax.planner.plan(model, prompts, SpecConfig(...)) from measured step "
                             "costs, which returns the SpecConfig to use")
        if not 1 <= self.gamma <= self.gamma_max:
            raise ValueError(f"gamma={self.gamma} must be in 1..gamma_max={self.gamma_max}")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"draft_policy={self.draft_policy!r}; expected one of {DRAFT_POLICIES}")
        if self.draft_limit is not None and not self.gamma <= self.draft_limit <= self.gamma_max:
            raise ValueError(f"draft_limit={self.draft_limit} must be in gamma..gamma_max = "
                             f"{self.gamma}..{self.gamma_max} (or None: gamma_max)")
        if self.draft_limit is not None and self.draft_policy == "fixed":
            raise ValueError(f"draft_limit={self.draft_limit} bounds a dynamic draft_policy; with "
                             "draft_policy='fixed' every round drafts gamma tokens (leave draft_limit None)")
        if self.bass_increment < 1 or self.bass_mod < 1:
            raise ValueError(f"bass_increment={self.bass_increment}, bass_mod={self.bass_mod}: both must be >= 1")
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
        check_prefill_chunk(self.prefill_chunk, self.group_size if self.target_kv == "int8" else 1)
        self.sampling  # validates the sampling fields
        self.draft_weights_config  # validates the draft-weight fields

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    @property
    def draft_weights_config(self) -> DraftWeightsConfig:
        return DraftWeightsConfig(group_size=self.draft_group, scope=self.draft_scope,
                                  lm_head=self.draft_lm_head, method=self.draft_method,
                                  fold_norms=self.draft_fold_norms)

    @property
    def draft_view(self) -> str:
        return "draft" if self.draft_kv == "int4" else "target"

    @property
    def max_draft(self) -> int:
        """The longest draft of any round: gamma ("fixed") or the dynamic policy's limit."""
        if self.draft_policy == "fixed":
            return self.gamma
        return self.gamma_max if self.draft_limit is None else self.draft_limit

    @property
    def verify_width(self) -> int:
        """Token columns of every verify pass: gamma_max + 1 whatever gamma or the draft length
        is, the width at which autoregressive decoding (GenerationConfig.width) computes the same
        logits bit for bit (max_draft + 1 in the inexact mode)."""
        return self.gamma_max + 1 if self.exact else self.max_draft + 1

    @property
    def draft_slots(self) -> int:
        """Draft tokens each verify pass holds (verify_width - 1): the rounds' drafts, PAD_ID past
        the round's draft length."""
        return self.verify_width - 1

    def memory_request(self, batch: int, prompt_len: int, longest: int | None = None) -> Request:
        """What generating with these settings from `batch` prompts padded to `prompt_len` tokens
        (the longest `longest` before padding) asks of a device (`planner.request_bytes`)."""
        return Request(batch, prompt_len, self.max_new_tokens, kv=self.target_kv, width=self.verify_width,
                       group_size=self.group_size, gamma_max=self.gamma_max, longest=longest, speculative=True,
                       draft_view=self.draft_view, sampling=not self.sampling.greedy, return_logits=self.return_logits)


@struct.dataclass
class SpecResult:
    """Generated tokens plus per-row counters (SPEC §7).

    tokens: int32[B, max_new_tokens] (PAD_ID past lengths); lengths: int32[B] (the first token,
    sampled from the prefill logits, included). drafted/accepted: draft tokens offered to / accepted
    by verification; rounds: verify passes; emitted: tokens emitted by rounds (lengths minus the
    prefill token). draft_steps: draft-model steps run in the row's rounds (the round's draft
    length, cut to the most drafts any live row could verify); rejected: rounds in which the row
    rejected a draft. logits: float32[B, max_new_tokens, V], the target logits each token was
    chosen from, with SpecConfig.return_logits (else None).
    """

    tokens: Array
    lengths: Array
    drafted: Array
    accepted: Array
    rounds: Array
    emitted: Array
    draft_steps: Array
    rejected: Array
    logits: Array | None = None

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (corrections and bonus tokens not counted)."""
        return float(np.sum(self.accepted)) / max(1, float(np.sum(self.drafted)))

    @property
    def tokens_per_round(self) -> float:
        """Emitted tokens / verify passes (about 1 + gamma * acceptance)."""
        return float(np.sum(self.emitted)) / max(1, float(np.sum(self.rounds)))

    @property
    def mean_draft_length(self) -> float:
        """Draft-model steps per round (gamma for the fixed policy, less only in rounds that end
        at the flush horizon; the policy's mean length for a dynamic one)."""
        return float(np.sum(self.draft_steps)) / max(1, float(np.sum(self.rounds)))

    @property
    def alpha_estimate(self) -> float:
        """Per-position acceptance probability alpha of the i.i.d. model behind E[tokens/round] =
        (1 - alpha^(gamma+1)) / (1 - alpha): its maximum-likelihood estimate from the rounds, each
        verified draft a trial until the first rejection: accepted / (accepted + rejected).
        Unlike acceptance_rate, it does not depend on gamma when the model holds."""
        acc = float(np.sum(self.accepted))
        return acc / max(1.0, acc + float(np.sum(self.rejected)))

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
    draft_steps: Array
    rejected: Array
    draft_len: Array  # int32[]: the policy's draft length for the next round, 1..spec.max_draft
    shrink: Array  # int32[]: BASS's s, 1 after a round that shortened the draft
    logits: Array | None  # float32[B, N, V] with return_logits


# --------------------------------------------------------------------------------- phases
def draft_tokens(draft_params: M.Params, pending: Array, cache: Any, key: Array, spec: SpecConfig,
                 steps: Array | int | None = None) -> tuple[Array, Array | None, Any]:
    """`steps` draft steps from the pending token (default gamma): a Python int runs a loop of
    that static trip count; a traced int32 scalar (0..spec.draft_slots) a `lax.while_loop` that
    stops after them. On a GPU a loop of unknown trip count copies its predicate to the host
    every iteration and the device idles while the host launches the next one, so the fixed
    draft length uses the static loop.

    Returns (g int32[B, draft_slots], draft logits float32[B, draft_slots, V] or None when greedy,
    cache). Slots past `steps` hold PAD_ID (and zero logits).
    """
    b, slots, vocab = pending.shape[0], spec.draft_slots, draft_params.config.vocab_size
    greedy = spec.sampling.greedy
    steps = spec.gamma if steps is None else steps

    def body(carry):
        i, tok, cache, g, q = carry
        logits, cache = M.decode(draft_params, tok[:, None], cache, view=spec.draft_view)
        logits = logits[:, 0]
        nxt = sample(jax.random.fold_in(key, i), logits, spec.sampling)
        g = jax.lax.dynamic_update_slice(g, nxt[:, None], (0, i))
        if not greedy:
            q = jax.lax.dynamic_update_slice(q, logits[:, None].astype(q.dtype), (0, i, 0))
        return i + 1, nxt, cache, g, q

    g0 = jnp.full((b, slots), PAD_ID, jnp.int32)
    q0 = None if greedy else jnp.zeros((b, slots, vocab), jnp.float32)
    init = (jnp.int32(0), pending, cache, g0, q0)
    if isinstance(steps, int):
        _, _, cache, g, q = jax.lax.fori_loop(0, steps, lambda _, c: body(c), init)
    else:
        _, _, cache, g, q = jax.lax.while_loop(lambda c: c[0] < steps, body, init)
    return g, q, cache


def next_draft_length(spec: SpecConfig, length: Array, shrink: Array, n: Array, limit: Array,
                      live: Array) -> tuple[Array, Array]:
    """The draft policy's length for the next round, and BASS's s (SpecConfig.draft_policy).

    length, shrink: int32[] (this round's length d and s); n, limit: int32[B] (drafts each row
    accepted / could verify this round, n <= limit <= d); live: bool[B] (rows that took part).
    "bass" (BASS, Algorithm 1, over live rows): if some row accepted all d drafts, d <- min(d +
    bass_increment, max_draft) and s <- 0; otherwise, if some row rejected a draft, d <- max(1,
    max_b n_b, d - d // bass_mod - s) and s <- 1. A round in which no live row saw a rejection nor
    could accept d drafts (rows stopped short by the flush horizon) leaves both unchanged: it says
    nothing about the draft. "cycle": d <- d % max_draft + 1. "fixed": gamma.
    """
    if spec.draft_policy == "fixed":
        return length, shrink
    top = spec.max_draft
    if spec.draft_policy == "cycle":
        return length % top + 1, shrink
    full = jnp.any(live & (n >= length))
    reject = jnp.any(live & (n < limit))
    longest = jnp.max(jnp.where(live, n, 0))
    up = jnp.minimum(length + spec.bass_increment, top)
    down = jnp.maximum(jnp.maximum(1, longest), length - length // spec.bass_mod - shrink)
    new = jnp.where(full, up, jnp.where(reject, down, length))
    s = jnp.where(full, 0, jnp.where(reject, 1, shrink))
    return new.astype(jnp.int32), s.astype(jnp.int32)


def _limit(limit: Array | None, g: Array) -> Array:
    """int32[B]: how many of the gamma drafts each row verifies (all by default)."""
    gamma = g.shape[1]
    return jnp.full(g.shape[:1], gamma, jnp.int32) if limit is None else jnp.minimum(limit, gamma)


def accept_greedy(p_logits: Array, g: Array, limit: Array | None = None) -> tuple[Array, Array]:
    """p_logits [B, gamma+1, V], g [B, gamma] -> (n accepted int32[B], next token int32[B]).

    Row b verifies only its first limit[b] drafts (default: all): n <= limit, and the next token
    is the target's argmax after the n accepted ones.
    """
    best = jnp.argmax(p_logits, axis=-1).astype(jnp.int32)  # [B, gamma+1]
    n = jnp.sum(jnp.cumprod(g == best[:, :-1], axis=1), axis=1).astype(jnp.int32)
    n = jnp.minimum(n, _limit(limit, g))
    return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]


def accept_sampling(key: Array, p_logits: Array, q_logits: Array, g: Array, cfg: SamplingConfig,
                    limit: Array | None = None) -> tuple[Array, Array]:
    """Speculative sampling (Leviathan et al.; Chen et al.): reproduces the target distribution.

    p_logits [B, gamma+1, V] (target), q_logits [B, gamma, V] (draft), g [B, gamma]. Row b verifies
    only its first k = limit[b] drafts: exactly the algorithm with gamma = k for that row (the
    later drafts are discarded unseen), so when all k are accepted the next token is the bonus
    sampled from p at row k, not a residual.
    """
    k = _limit(limit, g)
    k_u, k_y = jax.random.split(key)
    p = jnp.exp(log_probs(p_logits, cfg))
    q = jnp.exp(log_probs(q_logits, cfg))
    p_g = jnp.take_along_axis(p[:, :-1], g[..., None], axis=-1)[..., 0]
    q_g = jnp.take_along_axis(q, g[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_u, g.shape)
    ok = u * q_g < p_g  # u < p/q, i.e. accept with probability min(1, p/q)
    n = jnp.minimum(jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32), k)
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    at_n = lambda x: jnp.take_along_axis(x, n[:, None, None], axis=1)[:, 0]  # noqa: E731
    q_n = jnp.where((n < k)[:, None], at_n(q_pad), 0.0)  # all k accepted: q = 0, the bonus ~ p
    resid = jnp.maximum(at_n(p) - q_n, 0.0)
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


def forced_accept(key: Array, p_logits: Array, rate: float, gamma: int,
                  limit: Array | None = None) -> tuple[Array, Array]:
    """Benchmark-only acceptance: each draft is accepted i.i.d. with probability `rate`, so
    n ~ the leading successes (E[tokens/round] = (1 - rate^(gamma+1)) / (1 - rate)). The emitted
    tokens are then NOT the target's output; this exists to time rounds at a chosen acceptance."""
    b = p_logits.shape[0]
    ok = jax.random.uniform(key, (b, gamma)) < rate
    n = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    if limit is not None:
        n = jnp.minimum(n, limit)
    best = jnp.argmax(p_logits, axis=-1).astype(jnp.int32)
    return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]


def speculative_start(cache: Any, first: Array, key: Array, *, spec: SpecConfig, eos_ids: tuple[int, ...],
                      first_logits: Array | None = None) -> _SpecState:
    """The loop state before the first round: `cache` holds the prompts; `first` int32[B] is the
    token sampled from the prefill logits `first_logits` (emitted as token 0 and pending: its K/V
    is not computed)."""
    n_max, b = spec.max_new_tokens, first.shape[0]
    eos = eos_array(eos_ids)
    zeros = jnp.zeros((b,), jnp.int32)
    return _SpecState(
        tokens=jnp.full((b, n_max), PAD_ID, jnp.int32).at[:, 0].set(first),
        num_emitted=jnp.ones((b,), jnp.int32), pending=first,
        done=jnp.isin(first, eos) | (n_max == 1), cache=cache.flush(), key=key,
        drafted=zeros, accepted=zeros, rounds=zeros, emitted=zeros, draft_steps=zeros, rejected=zeros,
        draft_len=jnp.int32(spec.gamma), shrink=jnp.int32(0),
        logits=initial_logits(first_logits, n_max, spec.return_logits) if first_logits is not None else None)


def speculative_rounds(target: M.Params, draft: M.Params, state: _SpecState, *, spec: SpecConfig,
                       eos_ids: tuple[int, ...], max_rounds: Array | None = None) -> _SpecState:
    """Speculative rounds from `state` until every row is done (or `max_rounds` rounds:
    `generation.loop_rounds`).

    Exactness (greedy output == autoregressive output at GenerationConfig.width =
    spec.verify_width, bit for bit in the logits): every verify pass has the autoregressive
    step's shape [B, gamma_max + 1] (`model.decode`'s width), and a row accepts no token at or
    past its cache's flush horizon (`tokens_until_flush`), so every committed position is
    computed over the same quantized/FP split as autoregressive decoding computes it.
    """
    n_max, b = spec.max_new_tokens, state.tokens.shape[0]
    eos = eos_array(eos_ids)

    def cond(s: _SpecState) -> Array:
        return ~jnp.all(s.done)

    def body(s: _SpecState) -> _SpecState:
        k_draft, k_accept, key = jax.random.split(s.key, 3)
        committed = s.cache.total_lengths()
        live = ~s.done
        # Drafts each row may verify (0..d): rows past the flush horizon would see the next block
        # in full precision where autoregressive decoding sees it quantized.
        d = s.draft_len
        limit = jnp.clip(s.cache.tokens_until_flush() - 1, 0, d) if spec.exact else jnp.broadcast_to(d, (b,))
        if spec.draft_policy == "fixed":  # a static trip count (draft_tokens); drafts past a row's limit are
            steps = spec.gamma            # never verified (rounds at a flush horizon draft a few for nothing)
        else:  # drafts past every live row's limit are never verified
            steps = jnp.max(jnp.where(live, limit, 0))
        g, q_logits, cache = draft_tokens(draft, s.pending, s.cache, k_draft, spec, steps)
        verify_in = jnp.concatenate([s.pending[:, None], g], axis=1)  # [B, draft_slots + 1] = verify_width
        p_logits, cache = M.decode(target, verify_in, cache.rollback(committed), view="target",
                                   width=spec.verify_width)
        if spec.forced_acceptance is not None:
            n, y = forced_accept(k_accept, p_logits, spec.forced_acceptance, spec.draft_slots, limit)
        elif spec.sampling.greedy:
            n, y = accept_greedy(p_logits, g, limit)
        else:
            n, y = accept_sampling(k_accept, p_logits, q_logits, g, spec.sampling, limit)
        tokens, count, hit_eos, _ = _emit(s, g, n, y, eos, n_max)
        num = s.num_emitted + count
        cache = cache.rollback(committed + jnp.where(live, n + 1, 0)).flush()
        live_i = live.astype(jnp.int32)
        j = jnp.arange(spec.draft_slots + 1)[None, :]
        cols = jnp.where(j < count[:, None], s.num_emitted[:, None] + j, n_max)  # token j <- row j
        draft_len, shrink = next_draft_length(spec, d, s.shrink, n, limit, live)
        return _SpecState(
            tokens=tokens, num_emitted=num, pending=y, done=s.done | hit_eos | (num >= n_max),
            cache=cache, key=key,
            drafted=s.drafted + live_i * limit, accepted=s.accepted + live_i * n,
            rounds=s.rounds + live_i, emitted=s.emitted + count,
            draft_steps=s.draft_steps + live_i * steps, rejected=s.rejected + live_i * (n < limit),
            draft_len=draft_len, shrink=shrink,
            logits=record_logits(s.logits, cols, p_logits))

    return loop_rounds(cond, body, state, max_rounds)


def _spec_result(s: _SpecState) -> SpecResult:
    return SpecResult(tokens=s.tokens, lengths=s.num_emitted, drafted=s.drafted, accepted=s.accepted,
                      rounds=s.rounds, emitted=s.emitted, draft_steps=s.draft_steps, rejected=s.rejected,
                      logits=s.logits)


def speculative_loop(target: M.Params, draft: M.Params, cache: Any, first: Array, key: Array, *,
                     spec: SpecConfig, eos_ids: tuple[int, ...], first_logits: Array | None = None,
                     return_cache: bool = False) -> SpecResult | tuple[SpecResult, Any]:
    """Speculative rounds from a cache that holds the prompts (`speculative_start`) until every
    row is done (`speculative_rounds`).

    return_cache: also return the final cache, as (result, cache). A jitted caller that donates
    `cache` needs it: XLA aliases a donated input only to an output of its shape, and copies an
    unaliased one into the loop's state (measured: 81.6 GiB at 1.29M tokens, out of memory)."""
    state = speculative_start(cache, first, key, spec=spec, eos_ids=eos_ids, first_logits=first_logits)
    state = speculative_rounds(target, draft, state, spec=spec, eos_ids=eos_ids)
    return (_spec_result(state), state.cache) if return_cache else _spec_result(state)


def _prefilled(target: M.Params, tokens: Array, lengths: Array, key: Array, *, spec: SpecConfig,
               eos_ids: tuple[int, ...], max_len: int, chunk: int | None) -> _SpecState:
    cache = new_cache(target.config, spec.target_kv, tokens.shape[0], max_len, spec.group_size, spec.gamma_max,
                      mesh=target.mesh)
    # The target's weights fill the shared cache.
    logits, cache = M.prefill(target, tokens, lengths, cache, chunk=chunk, progress=spec.prefill_progress)
    key, sub = jax.random.split(key)
    first = sample(sub, logits, spec.sampling)
    return speculative_start(cache, first, key, spec=spec, eos_ids=eos_ids, first_logits=logits)


@functools.partial(jax.jit, static_argnames=("spec", "eos_ids", "max_len", "chunk"))
def speculative_program(target: M.Params, draft: M.Params, tokens: Array, lengths: Array, key: Array, *,
                        spec: SpecConfig, eos_ids: tuple[int, ...], max_len: int,
                        chunk: int | None = None) -> SpecResult:
    """The whole of `generate` (without on_tokens) as one jitted program: a cache of max_len
    slots, the prefill (in chunks of `chunk` tokens, or whole) and every round (what
    `planner.request_bytes` models)."""
    state = _prefilled(target, tokens, lengths, key, spec=spec, eos_ids=eos_ids, max_len=max_len, chunk=chunk)
    return _spec_result(speculative_rounds(target, draft, state, spec=spec, eos_ids=eos_ids))


def _speculative_start(target: M.Params, draft: M.Params, tokens: Array, lengths: Array, key: Array, *,
                       spec: SpecConfig, eos_ids: tuple[int, ...], max_len: int,
                       chunk: int | None = None) -> tuple[_SpecState, Progress]:
    state = _prefilled(target, tokens, lengths, key, spec=spec, eos_ids=eos_ids, max_len=max_len, chunk=chunk)
    return state, progress_of(state)


def _speculative_chunk(target: M.Params, draft: M.Params, state: _SpecState, max_rounds: Array, *,
                       spec: SpecConfig, eos_ids: tuple[int, ...]) -> tuple[_SpecState, Progress]:
    state = speculative_rounds(target, draft, state, spec=spec, eos_ids=eos_ids, max_rounds=max_rounds)
    return state, progress_of(state)


# ---------------------------------------------------------------------------------- public
def draft_format_fields(cfg: DraftWeightsConfig) -> dict[str, Any]:
    """SpecConfig's draft_* fields for the INT4 draft format `cfg` (e.g. a checkpoint's stored one,
    so that `draft_params_for` uses the stored draft as it is)."""
    return dict(draft_group=cfg.group_size, draft_scope=cfg.scope, draft_lm_head=cfg.lm_head, draft_method=cfg.method,
                draft_fold_norms=cfg.fold_norms)


def stored_draft(model: Any, spec: SpecConfig) -> M.Params | None:
    """The draft's params when they exist already: the target's for draft_weights="bf16", the
    checkpoint's INT4 draft when its format is the one `spec` asks for; None when they must be
    made (`draft_params_for`)."""
    if spec.draft_weights == "bf16":
        return model.params
    have = getattr(model, "draft_params", None)
    if have is not None and getattr(model, "draft_weights_config", None) == spec.draft_weights_config:
        return have
    return None


def check_memory(model: Any, spec: SpecConfig, shape: tuple[int, int], longest: int,
                 draft_params: M.Params | None = None) -> tuple[Request, M.Params | None]:
    """Refuses (`planner.DoesNotFitError`, a ValueError) speculative generation from prompts
    padded to `shape` = (batch, tokens) that does not fit this device, before a draft is made
    or anything compiled. Returns the request (its `chunk`: how the prompt will be prefilled,
    `planner.prefill_chunk_for`) and the draft when it exists already
    (`draft_params`, else `stored_draft`; None: it will be made, and its bytes are counted from
    its format)."""
    request = spec.memory_request(*shape, longest=longest)
    draft = draft_params if draft_params is not None else stored_draft(model, spec)
    made = 0 if draft is not None else weight_bytes(model.params.config, spec.draft_weights_config)["draft"]
    chunk = prefill_chunk_for(model.params, request, spec.prefill_chunk, draft=draft, draft_bytes=made)
    request = dataclasses.replace(request, chunk=chunk)
    check_params_fit(model.params, request, draft=draft, draft_bytes=made)
    return request, draft


def draft_params_for(model: Any, spec: SpecConfig) -> M.Params:
    """The draft's params: the target's for draft_weights="bf16", else INT4 weights, taken from
    the checkpoint when they match `spec` and made now otherwise (`Model.with_draft_weights`: a
    calibrated method calibrates on the built-in text)."""
    found = stored_draft(model, spec)
    if found is not None:
        return found
    want = spec.draft_weights_config
    have = getattr(model, "draft_params", None)
    if have is not None:  # the stored draft is not used: say so (the CLIs print their own line)
        warnings.warn(f"quantizing the INT4 draft again: the checkpoint stores {model.draft_weights_config}, "
                      f"SpecConfig asks for {want}; set SpecConfig's draft_* fields to the stored format to use "
                      "it as it is", stacklevel=3)
    return model.with_draft_weights(want).draft_params


def generate(model: Any, prompt_ids: Sequence[Sequence[int]] | np.ndarray, config: SpecConfig = SpecConfig(),
             key: Array | None = None, draft_params: M.Params | None = None, *,
             timings: dict[str, float] | None = None,
             on_tokens: Callable[[list[list[int]]], None] | None = None,
             bucket: int | None = None, time_prefill: bool = False) -> SpecResult:
    """Speculative generation of up to `config.max_new_tokens` tokens per prompt.

    `model` is a `qspec_jax.Model`. `draft_params` overrides the draft (any params with the
    target's config; tests use this to check exactness with a deliberately different draft).
    Greedy output equals the target's own greedy output; sampling follows the target's
    distribution exactly. Pass a dict as `timings` to get compile and run seconds; with
    `time_prefill` also the prefill's own seconds ("prefill_s": `generation.run_generation`).

    on_tokens: streaming. Called in this thread with a list per prompt of the tokens committed
    since the previous call (first the token sampled from the prefill, then the first round's,
    then every few rounds: `generation.stream_chunks`); the result is the same as without it,
    token for token.
    `qspec_jax.streaming.TokenStream` turns it into an iterator.
    bucket: the prompt padding (`generation.pad_prompts`): None pads to the `length_bucket`
    ladder, which bounds the compiled programs; an int pads to a multiple of it (1: none).

    A request that does not fit this device's memory raises `planner.DoesNotFitError` (a
    ValueError) before a draft is made or anything compiled; out of memory in XLA while running
    it, `planner.OutOfMemoryError` (as `generation.generate_autoregressive` says).
    """
    if not isinstance(config, SpecConfig):
        raise TypeError(f"generate: config must be a SpecConfig, got {type(config).__name__}"
                        + (" (GenerationConfig is for generate_autoregressive)"
                           if type(config).__name__ == "GenerationConfig" else ""))
    key = prng_key(key, "generate")
    target: M.Params = M.for_device(model.params)  # a no-op for models from `load`
    cfg = target.config
    tokens, lengths = pad_prompts(prompt_ids, cfg.vocab_size, bucket)
    check_fits(cfg, lengths, config.max_new_tokens)
    request, draft = check_memory(model, config, tokens.shape, int(lengths.max()), draft_params)
    eos = config.eos_token_ids if config.eos_token_ids is not None else cfg.eos_token_ids
    draft = draft if draft is not None else draft_params_for(model, config)
    if draft.config.replace(attention_impl=cfg.attention_impl) != cfg:
        raise ValueError("draft_params were built for a different model config than the target's")
    draft = M.for_device(draft.replace(config=cfg))  # a no-op for drafts from load / draft_params_for
    if draft.mesh != target.mesh:
        raise ValueError("the draft params are not on the target's mesh: shard both (qspec_jax.sharding.shard)")
    max_len = decode_cache_len(tokens.shape[1], config.max_new_tokens, config.verify_width, config.group_size,
                               config.target_kv)
    try:
        return run_generation(speculative_program, _speculative_start, _speculative_chunk, (target, draft),
                              (jnp.asarray(tokens), jnp.asarray(lengths), key),
                              dict(spec=config, eos_ids=tuple(eos), max_len=max_len, chunk=request.chunk),
                              dict(spec=config, eos_ids=tuple(eos)), _spec_result, timings, on_tokens,
                              time_prefill)
    except Exception as e:
        if resource_exhausted(e):  # the estimate let it through: the same kind of line, from XLA's account
            raise out_of_memory(target, request, e, draft=draft) from e
        raise
