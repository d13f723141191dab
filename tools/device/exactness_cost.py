"""What exact verification costs on a GPU (issue 11): side-by-side pass and loop timings.

    python tools/device/exactness_cost.py --out DIR [--contexts 4096,32768,131072]
        [--smollm-checkpoint CKPT --text-dir TEXTS --smollm-batch 8]

Exact speculative decoding runs every verify pass at W = gamma_max + 1 columns (8) instead of
gamma + 1 (5 at gamma 4), and autoregressive decoding that matches it runs W columns instead of
1. Part 8b times those passes on the Llama-3.1-8B shape (random weights, batch 1): target over
the INT8 cache at T = 1, 5, W, over a dense bf16 cache at T = 1, W, and the INT4 draft step, and
derives a round's cost at gamma 4 with both verify widths. Part smollm measures tokens/s of
real generation (SmolLM2, real text): speculative exact vs inexact (SpecConfig.exact=False),
autoregressive at width W vs 1. Medians of repeated in-device loops; prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import jax

from qspec_jax import model as M
from qspec_jax.bench import e2e
from qspec_jax.cache import DEFAULT_GAMMA_MAX
from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

W = DEFAULT_GAMMA_MAX + 1  # the exact verify width


def part_8b(contexts: list[int], steps: int, trials: int, quick: bool = False) -> list[dict]:
    cfg = e2e.QUICK if quick else e2e.LLAMA31_8B
    key = jax.random.PRNGKey(0)
    params = jax.jit(lambda k: M.init_random_params(cfg, k))(key)
    draft = make_draft_params(params, DraftWeightsConfig(method="clip"))
    jax.block_until_ready(draft)
    rows = []
    for c in contexts:
        row = {"context": c}
        quant = e2e.random_quant_cache(cfg, 1, c, jax.random.fold_in(key, c))
        for name, p, t, view in (("int8_t1", params, 1, "target"), ("int8_t5", params, 5, "target"),
                                 (f"int8_t{W}", params, W, "target"), ("draft_t1", draft, 1, "draft")):
            fn = functools.partial(e2e._steps, n=steps, view=view)
            secs, quant = e2e.run_steps(fn, p, quant, t, steps, trials)
            row[name] = secs * 1e3
            print(f"  8b ctx {c} {name}: {secs * 1e3:.3f} ms", flush=True)
        del quant
        dense = e2e.random_dense_cache(cfg, 1, c, jax.random.fold_in(key, c + 1))
        for name, t in (("bf16_t1", 1), (f"bf16_t{W}", W)):
            fn = functools.partial(e2e._steps, n=steps, view="target")
            secs, dense = e2e.run_steps(fn, params, dense, t, steps, trials)
            row[name] = secs * 1e3
            print(f"  8b ctx {c} {name}: {secs * 1e3:.3f} ms", flush=True)
        del dense
        g = 4
        row["round_exact_ms"] = g * row["draft_t1"] + row[f"int8_t{W}"]
        row["round_inexact_ms"] = g * row["draft_t1"] + row["int8_t5"]
        row["slowdown_pct"] = 100 * (row["round_exact_ms"] / row["round_inexact_ms"] - 1)
        rows.append(row)
    return rows


def part_smollm(ckpt: str, text_dir: str, batch: int, prompt_tokens: int, new: int, trials: int) -> dict:
    import qspec_jax
    from qspec_jax.bench.fidelity import prompts_from_plays
    from qspec_jax.generation import GenerationConfig, generate_autoregressive
    from qspec_jax.speculative import SpecConfig, generate

    model = qspec_jax.load(ckpt)
    prompts = prompts_from_plays(model, Path(text_dir), batch, prompt_tokens)
    runs = {
        "ar_w1": lambda: generate_autoregressive(model, prompts, GenerationConfig(max_new_tokens=new, kv="int8", width=1, eos_token_ids=())),
        f"ar_w{W}": lambda: generate_autoregressive(model, prompts, GenerationConfig(max_new_tokens=new, kv="int8", eos_token_ids=())),
        "ar_bf16_w1": lambda: generate_autoregressive(model, prompts, GenerationConfig(max_new_tokens=new, kv="bf16", width=1, eos_token_ids=())),
        "spec_exact": lambda: generate(model, prompts, SpecConfig(gamma=4, max_new_tokens=new, eos_token_ids=())),
        "spec_inexact": lambda: generate(model, prompts, SpecConfig(gamma=4, max_new_tokens=new, eos_token_ids=(), exact=False)),
    }
    out = {"batch": batch, "new_tokens": new}
    for name, fn in runs.items():
        res = fn()  # compile + warm-up
        jax.block_until_ready(res.tokens)
        times = []
        for _ in range(trials):
            t0 = time.perf_counter()
            res = fn()
            jax.block_until_ready(res.tokens)
            times.append(time.perf_counter() - t0)
        toks = sum(len(r) for r in res.to_lists())
        out[name] = {"tokens_per_s": toks / statistics.median(times), "seconds": statistics.median(times)}
        if hasattr(res, "acceptance_rate"):
            out[name].update(acceptance=res.acceptance_rate, tokens_per_round=res.tokens_per_round)
        print(f"  smollm B={batch} {name}: {out[name]}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--smollm-checkpoint", default=None)
    ap.add_argument("--text-dir", default=None)
    ap.add_argument("--smollm-batch", type=int, default=8)
    ap.add_argument("--parts", default="8b,smollm")
    ap.add_argument("--quick", action="store_true", help="tiny 8B-structured model (CPU smoke test)")
    args = ap.parse_args()
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
    parts = args.parts.split(",")
    if "smollm" in parts and args.smollm_checkpoint:
        res["smollm"] = part_smollm(args.smollm_checkpoint, args.text_dir, args.smollm_batch, 2000, 96, args.trials)
        (args.out / "exactness_cost.json").write_text(json.dumps(res, indent=1))
    if "8b" in parts:
        res["8b"] = part_8b([int(c) for c in args.contexts.split(",")], args.steps, args.trials, args.quick)
        (args.out / "exactness_cost.json").write_text(json.dumps(res, indent=1))
    print(f"\n| context | verify T=5 | T={W} | draft | round γ=4 exact | inexact | slowdown | AR-int8 T=1 | T={W} | "
          f"AR-bf16 T=1 | T={W} |")
    for r in res.get("8b", []):
        print(f"| {r['context']} | {r['int8_t5']:.3f} | {r[f'int8_t{W}']:.3f} | {r['draft_t1']:.3f} | "
              f"{r['round_exact_ms']:.3f} | {r['round_inexact_ms']:.3f} | {r['slowdown_pct']:+.1f}% | {r['int8_t1']:.3f} | "
              f"{r[f'int8_t{W}']:.3f} | {r['bf16_t1']:.3f} | {r[f'bf16_t{W}']:.3f} |")
    if "smollm" in res:
        print(json.dumps(res["smollm"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
