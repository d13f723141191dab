"""qspec-bench gamma, part `loops`: the planner's choice against measured loops, on this device.

For the Llama-3.1-8B shape (random bf16 weights, INT4 draft; `--quick`: the same structure at
tiny sizes) at each context and batch, over caches filled with random data (bench.synthetic):

1. the step costs, timed as `planner.measure_step_costs` times them (`planner.time_passes`: the
   draft step, the verify pass at gamma_max + 1 columns, the AR step over the dense bf16 and the
   INT8 cache): this device's cost table, written to the JSON and the report with its name;
2. for each forced acceptance alpha (SpecConfig.forced_acceptance: every draft accepted i.i.d.
   with probability alpha, the planner's model), what `plan_gamma` picks from those costs
   (what `qspec-generate --gamma auto` and `planner.plan` pick for that alpha);
3. the measured tokens/s of whole decoding loops (`speculative_loop` / `autoregressive_loop`,
   max_new_tokens per row, median of trials) for every fixed gamma 1..gamma_max, each BASS
   setting, and AR (width 1, bf16 and INT8 KV), so the report says how far the planner's choice
   is from the fastest measured setting, and how BASS compares with the best fixed gamma in
   tokens/s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from qspec_jax import model as M
from qspec_jax.bench import e2e, options
from qspec_jax.generation import GenerationConfig, autoregressive_loop
from qspec_jax.planner import StepCosts, plan_gamma, policy_label, time_passes
from qspec_jax.speculative import SpecConfig, speculative_loop
from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

LOOP_CONTEXTS = (4096, 131072)
LOOP_ALPHAS = (0.6, 0.8, 0.9)
QUICK_CONTEXTS = (256, 1024)


def _median_s(call: Callable[[], Any], trials: int) -> float:
    jax.block_until_ready(call())  # compiles (or warms up); not timed
    return e2e.median_seconds(call, trials)


def compare(plan: Any, measured: dict[str, dict[str, Any]], ar: dict[str, float]) -> dict[str, Any]:
    """The planner's choice against measured loops: `plan` a GammaPlan, `measured` {policy_label:
    {"tokens_per_s", "fields", ...}} of the speculative settings, `ar` {kv kind: tokens/s} of
    autoregressive decoding. The fastest is the fastest of all of them, AR included."""
    ar_best = max(ar.values())
    fixed = {k: v for k, v in measured.items() if v["fields"].get("draft_policy", "fixed") == "fixed"}
    best_fixed = max(fixed, key=lambda k: fixed[k]["tokens_per_s"])
    fastest = max(measured, key=lambda k: measured[k]["tokens_per_s"])
    if measured[fastest]["tokens_per_s"] <= ar_best:
        fastest = "AR"
    choice = policy_label(plan.spec) if plan.spec is not None else "AR"
    if choice != "AR" and choice not in measured:
        raise ValueError(f"the planner chose {choice}, which was not measured")
    choice_tok_s = measured[choice]["tokens_per_s"] if choice != "AR" else ar_best
    fastest_tok_s = ar_best if fastest == "AR" else measured[fastest]["tokens_per_s"]
    return {"ar_tokens_per_s": ar, "measured": measured, "choice": choice,
            "choice_predicted_tokens_per_s": plan.best.tokens_per_s if plan.spec is not None else plan.ar_tokens_per_s,
            "choice_tokens_per_s": choice_tok_s, "fastest": fastest, "fastest_tokens_per_s": fastest_tok_s,
            "choice_vs_fastest": choice_tok_s / fastest_tok_s, "best_fixed": best_fixed,
            "best_fixed_tokens_per_s": fixed[best_fixed]["tokens_per_s"], "summary": plan.summary()}


def measure_loops(*, quick: bool, contexts: Sequence[int], batches: Sequence[int], alphas: Sequence[float],
                  settings: Sequence[dict[str, Any]], new_tokens: int, steps: int, trials: int,
                  log: Callable[[str], None]) -> dict[str, Any]:
    """Step costs, the planner's choice and measured loop tokens/s (module docstring).

    settings: SpecConfig fields of the speculative settings measured (every fixed gamma and the
    BASS pairs, as `gamma.policies` lists them). Returns {"config", "rows": [...]}, one row per
    (context, batch, alpha)."""
    cfg = (e2e.QUICK if quick else e2e.LLAMA31_8B)
    key = jax.random.PRNGKey(0)
    base = SpecConfig(eos_token_ids=())
    width = base.verify_width
    if new_tokens + 2 * width > e2e.EXTRA_SLOTS:
        raise ValueError(f"--loop-tokens {new_tokens}: the random caches have room for {e2e.EXTRA_SLOTS - 2 * width}")
    # Random weights: the draft's format (g32, all linears + lm_head) made data-free; a GPTQ draft
    # of the same format reads the same bytes with the same kernels.
    dcfg = DraftWeightsConfig(group_size=base.draft_group, method="clip")
    params = jax.jit(lambda k: M.init_random_params(cfg, k))(key)
    draft = jax.block_until_ready(M.for_device(make_draft_params(params, dcfg)))
    params = jax.block_until_ready(M.for_device(params))
    ar_loop = jax.jit(autoregressive_loop, static_argnames=("gen", "eos_ids"))
    spec_loop = jax.jit(speculative_loop, static_argnames=("spec", "eos_ids"))
    rows: list[dict[str, Any]] = []

    def case(c: int, b: int) -> None:
        """Every measurement at context c and batch b: one row per alpha."""
        first = jnp.full((b,), 7, jnp.int32)
        quant = e2e.random_quant_cache(cfg, b, c, jax.random.fold_in(key, c))
        dense = e2e.random_dense_cache(cfg, b, c, jax.random.fold_in(key, c + 1))
        timed = dict(steps=steps, trials=trials)
        costs_s = {"draft_s": time_passes(draft, quant, 1, view=base.draft_view, width=1, **timed),
                   "verify_s": time_passes(params, quant, width, view="target", width=width, **timed),
                   "ar_int8_s": time_passes(params, quant, 1, view="target", width=1, **timed),
                   "ar_bf16_s": time_passes(params, dense, 1, view="target", width=1, **timed)}
        costs_s["ar_s"] = min(costs_s["ar_int8_s"], costs_s["ar_bf16_s"])
        costs = StepCosts(costs_s["draft_s"], costs_s["verify_s"], costs_s["ar_s"], width, b,
                          source="planner.time_passes over random caches")
        log(f"context {c}, batch {b}: costs ms " + ", ".join(f"{k[:-2]} {v * 1e3:.3f}" for k, v in costs_s.items()))
        n = b * new_tokens
        ar = {}
        for kind, cache in (("bf16", dense), ("int8", quant)):
            gen = GenerationConfig(max_new_tokens=new_tokens, kv=kind, width=1)
            ar[kind] = n / _median_s(functools.partial(ar_loop, params, cache, first, key, gen=gen, eos_ids=()),
                                     trials)
        del dense
        log(f"context {c}, batch {b}: AR tokens/s bf16 {ar['bf16']:.1f}, int8 {ar['int8']:.1f}")
        for a in alphas:
            plan = plan_gamma(costs, base, a)
            measured = {}
            for fields in settings:
                spec = SpecConfig(max_new_tokens=new_tokens, forced_acceptance=a, eos_token_ids=(), **fields)
                secs = _median_s(functools.partial(spec_loop, params, draft, quant, first, key, spec=spec,
                                                   eos_ids=()), trials)
                res = spec_loop(params, draft, quant, first, key, spec=spec, eos_ids=())
                measured[policy_label(spec)] = {"tokens_per_s": n / secs, "tokens_per_round": res.tokens_per_round,
                                                "mean_draft_length": res.mean_draft_length, "fields": fields}
            row = {"context": c, "batch": b, "alpha": a, "costs_ms": {k: v * 1e3 for k, v in costs_s.items()},
                   **compare(plan, measured, ar)}
            log(f"context {c}, batch {b}, alpha {a}: planner {row['choice']} ({row['choice_tokens_per_s']:.1f} "
                f"tokens/s measured), fastest {row['fastest']} ({row['fastest_tokens_per_s']:.1f}), best fixed "
                f"{row['best_fixed']} ({row['best_fixed_tokens_per_s']:.1f}): {row['choice_vs_fastest']:.3f} of "
                "the fastest")
            rows.append(row)

    for c in contexts:
        for b in batches:
            error = options.run_case(functools.partial(case, c, b))
            if error is not None:  # recorded, and the next case runs
                log(f"context {c}, batch {b}: {error}")
                rows.append({"context": c, "batch": b, "error": error})
    shape = "tiny Llama-3.1-8B-structured model (--quick)" if quick else "Llama-3.1-8B shape"
    return {"config": f"{shape}, random bf16 weights, INT4 draft {dataclasses.asdict(dcfg)}", "rows": rows,
            "new_tokens": new_tokens}


def section(data: dict[str, Any], device: str, bass_labels: Sequence[str]) -> str:
    """The report text of `measure_loops`'s result."""
    from qspec_jax.bench import report

    rows = data["rows"]
    out = [f"### Planner and dynamic draft length against measured loops ({data['config']}, {device})\n",
           f"Forced acceptance alpha (each draft accepted i.i.d.); {data['new_tokens']} new tokens per row per loop, "
           "median of trials; caches of random data at the context. Costs: this device's step costs "
           "(`planner.time_passes`, as `measure_step_costs` times them). Planner: `plan_gamma(costs, alpha)`, "
           "what `--gamma auto` picks for that alpha. Fastest: the fastest measured loop of every fixed gamma, "
           "BASS setting and AR (width 1, the faster of bf16 and INT8 KV).\n"]
    hdr = (["context", "batch", "alpha", "c_draft / c_verify / c_AR ms", "planner", "its tokens/s", "fastest",
            "its tokens/s", "planner / fastest", "best fixed", "AR tokens/s"]
           + [f"{b} tokens/s (vs best fixed)" for b in bass_labels])
    body = []
    for r in (r for r in rows if "error" not in r):
        c = r["costs_ms"]
        best = r["best_fixed_tokens_per_s"]
        bass = [f"{r['measured'][b]['tokens_per_s']:.1f} ({r['measured'][b]['tokens_per_s'] / best - 1:+.1%})"
                if b in r["measured"] else "–" for b in bass_labels]
        body.append([r["context"], r["batch"], r["alpha"],
                     f"{c['draft_s']:.3g} / {c['verify_s']:.3g} / {c['ar_s']:.3g}",
                     r["choice"], f"{r['choice_tokens_per_s']:.1f}", r["fastest"], f"{r['fastest_tokens_per_s']:.1f}",
                     f"{r['choice_vs_fastest']:.3f}", f"{r['best_fixed']} ({r['best_fixed_tokens_per_s']:.1f})",
                     f"{max(r['ar_tokens_per_s'].values()):.1f}"] + bass)
    out.append(report.table(hdr, body))
    out += [f"\n- context {r['context']}, batch {r['batch']}: {r['error']}" for r in rows if "error" in r]
    return "\n".join(out)
