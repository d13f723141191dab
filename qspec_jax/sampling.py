"""Logits processing and token sampling, shared by autoregressive and speculative generation.

`SamplingConfig` is static (hashable): greedy vs sampling and top-k change the compiled program.
The same `log_probs` is applied to the draft (q) and the target (p) distributions, so
speculative sampling reproduces exactly the distribution autoregressive sampling draws from.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy (argmax of the raw logits); top_k 0 and top_p 1 disable those."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def log_probs(logits: Array, cfg: SamplingConfig) -> Array:
    """float32 log-probabilities [..., V] after temperature, top-k, then top-p (HF's order).

    Tokens removed by top-k/top-p get -inf. Not used when `cfg.greedy`.
    """
    x = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if cfg.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (at least one);
        # tokens tied with the last kept one are kept too.
        desc = -jnp.sort(-x, axis=-1)
        probs = jax.nn.softmax(desc, axis=-1)
        n_keep = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < cfg.top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(desc, n_keep - 1, axis=-1)
        x = jnp.where(x >= cutoff, x, -jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


def sample(key: Array, logits: Array, cfg: SamplingConfig) -> Array:
    """int32 tokens [...] from logits [..., V]."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, log_probs(logits, cfg), axis=-1).astype(jnp.int32)
