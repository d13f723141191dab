"""Memory planning: bytes of weights and caches, and the longest context that fits a device.

All numbers come from array shapes (`jax.eval_shape`), so nothing is allocated.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from qspec_jax import model as M
from qspec_jax.cache import DEFAULT_GAMMA_MAX, DEFAULT_GROUP_SIZE, cache_bytes
from qspec_jax.config import ModelConfig
from qspec_jax.weight_quant import DraftWeightsConfig, QuantizedWeight, make_draft_params

# Room left for activations, logits, compiler workspace and allocator slack.
DEFAULT_HEADROOM_BYTES = 4 << 30


def tree_bytes(tree: Any) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def weight_bytes(cfg: ModelConfig, draft: DraftWeightsConfig | None = None) -> dict[str, int]:
    """Bytes of the target weights and (when `draft` is given) of the extra INT4 draft weights."""
    target = jax.eval_shape(lambda: M.init_random_params(cfg, jax.random.PRNGKey(0)))
    out = {"target": tree_bytes(target)}
    if draft is not None:
        d = jax.eval_shape(lambda p: make_draft_params(p, draft), target)
        linears = [getattr(d.layers, n) for n in M.LINEAR_NAMES] + [d.lm_head]
        out["draft"] = tree_bytes([w for w in linears if isinstance(w, QuantizedWeight)])  # the rest is shared
    return out


def max_context(cfg: ModelConfig, kind: str, device_bytes: int, *, batch: int = 1,
                draft: DraftWeightsConfig | None = None, group_size: int = DEFAULT_GROUP_SIZE,
                gamma_max: int = DEFAULT_GAMMA_MAX, headroom_bytes: int = DEFAULT_HEADROOM_BYTES) -> dict[str, int]:
    """Longest context (a multiple of group_size) whose weights + cache + headroom fit.

    kind: "bf16" (dense cache, AR) or "int8" (hierarchical cache; with `draft`, the INT4 draft
    weights are counted too). Returns {"context", "weights", "cache", "total"} in tokens/bytes.
    """
    weights = sum(weight_bytes(cfg, draft).values())
    kw = dict(group_size=group_size, gamma_max=gamma_max) if kind == "int8" else {}
    per_block = sum(cache_bytes(kind, cfg, batch, 2 * group_size, **kw).values()) - \
        sum(cache_bytes(kind, cfg, batch, group_size, **kw).values())
    fixed = sum(cache_bytes(kind, cfg, batch, group_size, **kw).values()) - per_block
    room = device_bytes - headroom_bytes - weights - fixed
    blocks = max(0, room // per_block)
    context = int(blocks * group_size)
    cache = sum(cache_bytes(kind, cfg, batch, max(context, group_size), **kw).values())
    return {"context": context, "weights": int(weights), "cache": int(cache), "total": int(weights + cache)}
