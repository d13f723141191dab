"""Planning: what fits a device (memory) and what runs fastest on it (speed).

Memory: bytes of weights and caches, and the longest context that fits a device. All numbers
come from array shapes (`jax.eval_shape`), so nothing is allocated.

Speed: the gamma that maximises expected tokens/s, or autoregressive decoding when no gamma
wins. A round of speculative decoding costs d draft steps and one verify pass, and emits
E[tokens/round] tokens per row; with a per-position acceptance probability alpha (drafts
accepted i.i.d. until the first rejection; SpecResult.alpha_estimate measures it)

    E[tokens/round](alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha)
    tokens/s(gamma) = B * E / (gamma * c_draft + c_verify)        against  B / c_ar

with per-pass costs c measured on the device (`measure_step_costs`: a short calibration run,
cached as JSON per model / device / context bucket / batch). `plan_gamma` evaluates every fixed
gamma 1..gamma_max (and any policy whose tokens/round was measured, e.g. the dynamic "bass"
policy: under the i.i.d. model alone a dynamic length cannot beat the best fixed gamma, its gain
comes from acceptance that varies along the text) and picks the fastest, or autoregressive
decoding when no candidate is predicted faster. `plan(model, prompts, SpecConfig(...))` does the
measuring and returns the plan; `qspec-generate --gamma auto` uses it.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax import model as M
from qspec_jax.cache import DEFAULT_GAMMA_MAX, DEFAULT_GROUP_SIZE, cache_bytes
from qspec_jax.compilation import programs, run_program, user_cache_dir
from qspec_jax.config import ModelConfig
from qspec_jax.weight_quant import DraftWeightsConfig, QuantizedWeight, make_draft_params

# Room left for activations, logits, compiler workspace and allocator slack.
DEFAULT_HEADROOM_BYTES = 4 << 30
COST_CACHE_FORMAT = 1
MIN_CONTEXT_BUCKET = 1024


# =========================================================================== memory planning
def tree_bytes(tree: Any) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def weight_bytes(cfg: ModelConfig, draft: DraftWeightsConfig | None = None) -> dict[str, int]:
    """Bytes of the target weights and (when `draft` is given) of the extra INT4 draft weights."""
    target = jax.eval_shape(lambda: M.init_random_params(cfg, jax.random.PRNGKey(0)))
    out = {"target": tree_bytes(target)}
    if draft is not None:  # every method makes the same format: shapes from the data-free one
        d = jax.eval_shape(lambda p: make_draft_params(p, dataclasses.replace(draft, method="clip")), target)
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


# ============================================================================ speed planning
@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Measured seconds per pass of each phase, for one model / device / context / batch.

    draft_s: one draft step (one token per row, draft weights, the draft's KV view);
    verify_s: one verify pass of `verify_width` columns (SpecConfig.verify_width: gamma_max + 1);
    ar_s: one autoregressive step (one column), the baseline speculative decoding must beat.
    """

    draft_s: float
    verify_s: float
    ar_s: float
    verify_width: int
    batch: int = 1
    source: str = ""  # where the numbers come from (a cache file and key, a JSON, "synthetic")

    def __post_init__(self) -> None:
        for name in ("draft_s", "verify_s", "ar_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"StepCosts.{name}={v!r}: expected a positive number of seconds")
        if self.verify_width < 2 or self.batch < 1:
            raise ValueError(f"StepCosts: verify_width={self.verify_width} must be >= 2 and batch={self.batch} >= 1")

    def round_s(self, draft_steps: float) -> float:
        """Seconds of one round with `draft_steps` draft steps and one verify pass."""
        return draft_steps * self.draft_s + self.verify_s

    @property
    def ar_tokens_per_s(self) -> float:
        return self.batch / self.ar_s


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[tokens/round] = (1 - alpha^(gamma+1)) / (1 - alpha) (= gamma + 1 at alpha = 1): the
    accepted drafts (leading successes of gamma Bernoulli(alpha) trials) plus the correction or
    bonus token."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha}: expected a per-position acceptance probability in [0, 1]")
    return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One setting the planner weighed: `spec` None is autoregressive decoding."""

    label: str
    spec: Any  # SpecConfig | None
    tokens_per_round: float
    draft_steps: float  # mean draft-model steps per round
    tokens_per_s: float  # predicted, all rows together
    measured: bool  # tokens_per_round measured (True) or from the alpha model (False)


@dataclasses.dataclass(frozen=True)
class GammaPlan:
    """The planner's answer: `spec` to pass to `speculative.generate`, or None when
    autoregressive decoding is predicted at least as fast as every candidate."""

    spec: Any  # SpecConfig | None
    best: Candidate  # the fastest speculative candidate (chosen or not)
    candidates: tuple[Candidate, ...]  # every candidate, fastest first
    ar_tokens_per_s: float
    costs: StepCosts
    alpha: float | None
    alpha_trials: int | None = None  # verified drafts the alpha estimate rests on (None: given)

    @property
    def speedup(self) -> float:
        """Predicted speedup of the best speculative candidate over autoregressive decoding."""
        return self.best.tokens_per_s / self.ar_tokens_per_s

    def summary(self) -> str:
        """One line: what was chosen and why."""
        a = "" if self.alpha is None else f", alpha {self.alpha:.3f}" + (
            "" if self.alpha_trials is None else f" (measured over {self.alpha_trials} verified drafts)")
        if self.spec is None:
            return (f"no draft length is predicted faster than autoregressive decoding (best: {self.best.label}, "
                    f"{self.speedup:.2f}x of AR's {self.ar_tokens_per_s:.1f} tokens/s{a}); decoding autoregressively")
        return (f"{self.best.label}: predicted {self.best.tokens_per_s:.1f} tokens/s, {self.speedup:.2f}x "
                f"autoregressive ({self.ar_tokens_per_s:.1f} tokens/s){a}")


def _candidate(label: str, spec: Any, tpr: float, steps: float, costs: StepCosts, measured: bool) -> Candidate:
    return Candidate(label, spec, float(tpr), float(steps), costs.batch * tpr / costs.round_s(steps), measured)


def policy_label(spec: Any) -> str:
    """"gamma=4"; "bass 4..8 (+1, /4)" for BASS from 4 up to 8 with bass_increment 1, bass_mod 4."""
    if spec.draft_policy == "fixed":
        return f"gamma={spec.gamma}"
    tail = f" (+{spec.bass_increment}, /{spec.bass_mod})" if spec.draft_policy == "bass" else ""
    return f"{spec.draft_policy} {spec.gamma}..{spec.max_draft}{tail}"


def plan_gamma(costs: StepCosts, base: Any, alpha: float | None = None, *,
               measured: Mapping[Any, tuple[float, float]] | None = None, alpha_trials: int | None = None,
               min_speedup: float = 1.0) -> GammaPlan:
    """Picks the setting with the highest predicted tokens/s.

    base: the SpecConfig whose other fields (sampling, draft format, gamma_max) the plan keeps.
    alpha: per-position acceptance probability; every fixed gamma 1..base.gamma_max becomes a
    candidate with E[tokens/round](alpha, gamma) and gamma draft steps. measured: {SpecConfig:
    (tokens per round, mean draft steps per round)} from real runs (any policy). A candidate is
    chosen only if its predicted tokens/s exceeds min_speedup x autoregressive decoding's
    (costs.ar_s); otherwise the plan's spec is None: decode autoregressively.
    """
    if not base.exact:
        raise ValueError("plan_gamma: base.exact=False: the planner plans exact speculative decoding (the verify "
                         "pass at gamma_max + 1 columns, whose cost StepCosts.verify_s is)")
    if costs.verify_width != base.verify_width:
        raise ValueError(f"plan_gamma: the step costs were measured with verify passes of {costs.verify_width} "
                         f"columns; this SpecConfig verifies {base.verify_width} (gamma_max={base.gamma_max}): "
                         "measure the costs for it")
    if alpha is None and not measured:
        raise ValueError("plan_gamma: give alpha (per-position acceptance) or measured tokens/round, or both")
    if min_speedup <= 0:
        raise ValueError(f"plan_gamma: min_speedup={min_speedup} must be > 0")
    cands = []
    if alpha is not None:
        for g in range(1, base.gamma_max + 1):
            spec = dataclasses.replace(base, gamma=g, draft_policy="fixed", draft_limit=None)
            cands.append(_candidate(policy_label(spec), spec, expected_tokens_per_round(alpha, g), g, costs, False))
    for spec, (tpr, steps) in (measured or {}).items():
        if not (tpr >= 1 and 0 <= steps <= spec.max_draft):
            raise ValueError(f"plan_gamma: measured {policy_label(spec)}: tokens/round {tpr} must be >= 1 and draft "
                             f"steps {steps} in 0..{spec.max_draft}")
        cands.append(_candidate(policy_label(spec) + " (measured)", spec, tpr, steps, costs, True))
    cands.sort(key=lambda c: -c.tokens_per_s)
    best = cands[0]
    wins = best.tokens_per_s > min_speedup * costs.ar_tokens_per_s
    return GammaPlan(spec=best.spec if wins else None, best=best, candidates=tuple(cands),
                     ar_tokens_per_s=costs.ar_tokens_per_s, costs=costs, alpha=alpha, alpha_trials=alpha_trials)


# ------------------------------------------------------------------ measuring the step costs
def default_cost_cache() -> Path:
    """~/.cache/qspec-jax/step_costs.json (XDG_CACHE_HOME honoured: `compilation.user_cache_dir`)."""
    return user_cache_dir() / "step_costs.json"


def context_bucket(context: int) -> int:
    """The power of two nearest `context` in log scale (at least MIN_CONTEXT_BUCKET): costs are
    measured, and cached, at that context."""
    if context < 1:
        raise ValueError(f"context={context} must be >= 1")
    return max(MIN_CONTEXT_BUCKET, 2 ** int(round(math.log2(context))))


def _digest(obj: Any) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cost_key(cfg: ModelConfig, spec: Any, bucket: int, batch: int) -> str:
    """The cache key: model (its config, compute dtype and attention implementation included),
    draft (weights format and KV view), target KV, verify width, device, jax version, context
    bucket and batch."""
    draft = "bf16" if spec.draft_weights == "bf16" else spec.draft_weights_config.to_dict()
    dev = jax.devices()[0]
    device = f"{getattr(dev, 'device_kind', dev.platform)} x{jax.device_count()}"
    model = _digest(cfg.to_dict())
    what = _digest({"draft": draft, "draft_kv": spec.draft_kv, "target_kv": spec.target_kv,
                    "group": spec.group_size, "width": spec.verify_width})
    return f"model {model} | draft {what} | {device} | jax {jax.__version__} | ctx {bucket} | batch {batch}"


def _read_cost_cache(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"format": COST_CACHE_FORMAT, "entries": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"step-cost cache {path}: not readable JSON ({e}); delete it to measure again") from e
    if not isinstance(data, dict) or data.get("format") != COST_CACHE_FORMAT or not isinstance(data.get("entries"), dict):
        raise ValueError(f"step-cost cache {path}: expected {{'format': {COST_CACHE_FORMAT}, 'entries': {{...}}}}; "
                         "delete it to measure again")
    return data


def _write_cost_cache(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one


@functools.partial(jax.jit, static_argnames=("n", "view", "width"))
def _passes(params: M.Params, cache: Any, toks: jax.Array, *, n: int, view: str, width: int) -> tuple[jax.Array, Any]:
    """n decode passes of toks [B, T] at `width` columns and a fixed context (rolled back after
    each); each pass's argmax feeds the next, so no pass can be hoisted."""
    committed = cache.total_lengths()

    def body(_, carry):
        toks, cache = carry
        logits, cache = M.decode(params, toks, cache, view=view, width=width)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache.rollback(committed)

    return jax.lax.fori_loop(0, n, body, (toks, cache))


def time_passes(params: M.Params, cache: Any, t: int, *, view: str, width: int, steps: int, trials: int) -> float:
    """Median seconds per decode pass of t tokens per row (SPEC §7: repetitions inside one
    jitted loop, median of trials; the first call compiles and is not timed)."""
    toks = jnp.full((cache.total_lengths().shape[0], t), 7, jnp.int32)
    run, _ = programs().compiled(_passes, (params, cache, toks), dict(n=steps, view=view, width=width))
    jax.block_until_ready(run(params, cache, toks))
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(run(params, cache, toks))
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def measure_step_costs(model: Any, spec: Any, *, context: int, batch: int = 1, draft_params: M.Params | None = None,
                       path: Path | str | None = None, refresh: bool = False, steps: int = 8, trials: int = 5,
                       progress: bool = True) -> StepCosts:
    """Per-phase step costs of `model` on this device at context_bucket(context) and `batch`:
    read from the JSON cache at `path` (default_cost_cache()) or, when missing or `refresh`,
    measured and stored there.

    Measured over caches holding a prefill of random tokens (a model with fewer positions than the
    bucket: its longest power of two): the draft step (draft weights,
    spec's draft view, one token), the verify pass (target, spec.verify_width columns) and the
    autoregressive step (target, one column) over a dense bf16 cache and over the INT8 cache;
    ar_s is the faster of the two, the baseline speculative decoding must beat.
    """
    from qspec_jax.generation import new_cache
    from qspec_jax.speculative import draft_params_for

    cfg = model.params.config
    width = spec.verify_width
    room = cfg.max_position_embeddings - 2 * width  # the passes timed go past the context
    if room < 1:
        raise ValueError(f"max_position_embeddings={cfg.max_position_embeddings} leaves no context for passes of "
                         f"{width} columns")
    bucket = min(context_bucket(context), 2 ** int(math.log2(room)))  # a short model: its longest power of two
    path = Path(path) if path is not None else default_cost_cache()
    key = cost_key(cfg, spec, bucket, batch)
    data = _read_cost_cache(path)
    hit = data["entries"].get(key)
    if hit is not None and not refresh:
        return StepCosts(hit["draft_s"], hit["verify_s"], hit["ar_s"], hit["verify_width"], hit["batch"],
                         source=f"{path} [{key}]")
    draft = draft_params if draft_params is not None else draft_params_for(model, spec)
    draft = draft.replace(config=cfg)
    max_len = -(-(bucket + 2 * width) // spec.group_size) * spec.group_size
    toks = jax.random.randint(jax.random.PRNGKey(0), (batch, bucket), 1, cfg.vocab_size, jnp.int32)
    lengths = jnp.full((batch,), bucket, jnp.int32)
    def filled(kind: str) -> Any:
        cache = new_cache(cfg, kind, batch, max_len, spec.group_size, spec.gamma_max, mesh=model.params.mesh)
        return run_program(M.prefill, (model.params, toks, lengths, cache), {})[1]

    timed = dict(steps=steps, trials=trials)
    say = (lambda m: print(f"[planner] {m}", file=sys.stderr, flush=True)) if progress else (lambda m: None)  # noqa: E731
    t0 = time.perf_counter()
    say(f"measuring step costs at context {bucket}, batch {batch} (cached in {path})")
    spec_cache = filled(spec.target_kv)
    out: dict[str, Any] = {
        "draft_s": time_passes(draft, spec_cache, 1, view=spec.draft_view, width=1, **timed),
        "verify_s": time_passes(model.params, spec_cache, width, view="target", width=width, **timed)}
    say(f"draft step {out['draft_s'] * 1e3:.2f} ms, verify ({width} columns) {out['verify_s'] * 1e3:.2f} ms")
    for kind in ("bf16", "int8"):
        cache = spec_cache if kind == spec.target_kv else filled(kind)
        out[f"ar_{kind}_s"] = time_passes(model.params, cache, 1, view="target", width=1, **timed)
        del cache
    del spec_cache
    out["ar_s"] = min(out["ar_bf16_s"], out["ar_int8_s"])
    say(f"autoregressive step {out['ar_s'] * 1e3:.2f} ms (bf16 KV {out['ar_bf16_s'] * 1e3:.2f}, INT8 KV "
        f"{out['ar_int8_s'] * 1e3:.2f}); {time.perf_counter() - t0:.0f} s")
    out.update(verify_width=width, batch=batch, context=bucket, jax=jax.__version__,
               device=getattr(jax.devices()[0], "device_kind", jax.devices()[0].platform),
               date=datetime.date.today().isoformat(), steps=steps, trials=trials)
    data = _read_cost_cache(path)  # re-read: another process may have added entries meanwhile
    data["entries"][key] = out
    _write_cost_cache(path, data)
    return StepCosts(out["draft_s"], out["verify_s"], out["ar_s"], width, batch, source=f"{path} [{key}] (measured)")


def estimate_alpha(model: Any, prompt_ids: Sequence[Sequence[int]] | np.ndarray, spec: Any, *, new_tokens: int = 32,
                   draft_params: M.Params | None = None, key: jax.Array | None = None) -> tuple[float, int]:
    """A short speculative calibration run (`new_tokens` per prompt at spec's gamma and sampling
    settings, fixed policy): (alpha, verified drafts it rests on), alpha =
    SpecResult.alpha_estimate."""
    from qspec_jax.speculative import generate

    cal = dataclasses.replace(spec, max_new_tokens=new_tokens, draft_policy="fixed", draft_limit=None,
                              return_logits=False)
    res = generate(model, prompt_ids, cal, key, draft_params=draft_params)
    return res.alpha_estimate, int(np.sum(res.accepted) + np.sum(res.rejected))


def plan(model: Any, prompt_ids: Sequence[Sequence[int]] | np.ndarray, base: Any = None, *,
         alpha: float | None = None, costs: StepCosts | None = None, draft_params: M.Params | None = None,
         cost_cache: Path | str | None = None, calibration_tokens: int = 32, refresh: bool = False,
         progress: bool = True) -> GammaPlan:
    """Chooses gamma for generating from `prompt_ids` with `base`'s other settings.

    Step costs: `costs`, else measured on this device at the decoding context (prompt + half the
    new tokens, bucketed) and batch, cached in `cost_cache`. alpha: given, else measured by a
    short speculative run on the prompts (`calibration_tokens` per prompt). Returns a GammaPlan:
    `plan.spec` is the SpecConfig for `speculative.generate`, or None: decode autoregressively.
    """
    from qspec_jax.generation import pad_prompts
    from qspec_jax.speculative import SpecConfig

    base = SpecConfig() if base is None else base
    _, lengths = pad_prompts(prompt_ids, model.params.config.vocab_size)
    if costs is None:
        context = int(lengths.max()) + base.max_new_tokens // 2
        costs = measure_step_costs(model, base, context=context, batch=len(lengths), draft_params=draft_params,
                                   path=cost_cache, refresh=refresh, progress=progress)
    trials = None
    if alpha is None:
        alpha, trials = estimate_alpha(model, prompt_ids, base, new_tokens=calibration_tokens,
                                       draft_params=draft_params)
    return plan_gamma(costs, base, alpha, alpha_trials=trials)
