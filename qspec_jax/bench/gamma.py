"""qspec-bench gamma: draft length on real text -> docs/QUALITY.md ("Draft length").

    qspec-bench gamma --text-dir DIR [--checkpoint DIR] [--contexts 4096,1024] [--batches 1,4]
                      [--prompts 4] [--new-tokens 128] [--bass 1:4,2:10] [--quick]

Free-running greedy speculative generation of SmolLM2 from windows of the Shakespeare comedies
(quality.COMEDIES, after quality.TEXT_OFFSET; never the history plays, which are calibration
text), for every fixed gamma 1..gamma_max and for the dynamic "bass" policy (each
increment:mod pair in --bass): tokens per round, acceptance (SPEC §7), mean draft length per
round and the per-position alpha estimate, at each context and batch (--prompts windows per
context, run --batches rows at a time; every run emits the target's own tokens, which the
benchmark checks across policies). Part tf: the same policies' rounds simulated on the
teacher-forced draft/target agreement of the true text (free-running greedy text of a small
model drifts into repetition that both models predict easily; the true text does not).

Free-running settings are also timed: tokens/s of each setting and of autoregressive decoding
(width 1, the faster of bf16 and INT8 KV) on the same prompts, so BASS is compared with the best
fixed gamma in tokens/s, not only in tokens per round.

Then the expected speed of each setting, combining these measured tokens/round with per-phase
step costs: SmolLM2's own, measured on the device this runs on (planner.measure_step_costs;
the cost table is written to gamma_step_costs_<device>.json and labelled with the device),
the SPEC §8 roofline floors of the 8B shape at 4k, and (--costs FILE) a stored per-phase JSON
of tools/device/exactness_cost.py. For each, the planner's choice: from alpha alone (measured by
the gamma-4 run, as `qspec-generate --gamma auto` calibrates) and from the measured tokens/round
of every setting.

Part loops (`bench.gamma_loops`): the 8B shape at forced acceptance on this device: its step
costs, the planner's choice for each alpha, and the measured loop tokens/s of every fixed gamma,
BASS and AR, into docs/BENCHMARKS.md ("gamma-loops").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from qspec_jax.bench import gamma_loops, options, report
from qspec_jax.bench.quality import CALIBRATION_PLAYS, COMEDIES, QUALITY_HEADER, QUALITY_MD, TEXT_OFFSET, check_disjoint
from qspec_jax.cache import DEFAULT_GAMMA_MAX
from qspec_jax.planner import StepCosts, plan_gamma, policy_label

FIRST_BUILD_COSTS = options.REPO / "docs" / "bench" / "exactness_cost_h200.json"  # the first Hopper build's (--costs)
# SPEC §8 roofline floors, Llama-3.1-8B at 4k on the H200 (ms): draft step, verify (the gamma-4
# floor: the pass is weight-bound, so 9 columns read the same bytes), AR-bf16 step.
FLOOR_4K_MS = (1.11, 3.6, 3.57)
CALIBRATION_GAMMA = 4  # the fixed gamma whose alpha estimate stands in for `--gamma auto`'s calibration run


def log(msg: str) -> None:
    print(f"[gamma {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for the report."""
    import platform

    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0]} ({len(names)} logical cores)" if names else (platform.processor() or "unknown CPU")


def device_label() -> str:
    """This machine's accelerator for the report: the GPU's name, or "CPU <model name>"."""
    dev = jax.devices()[0]
    return f"CPU {cpu_model()}" if dev.platform == "cpu" else getattr(dev, "device_kind", dev.platform)


def device_slug() -> str:
    """device_label() as a file-name part ("nvidia_h200", "cpu")."""
    dev = jax.devices()[0]
    name = "cpu" if dev.platform == "cpu" else getattr(dev, "device_kind", dev.platform)
    return "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_")


def prompt_windows(model: Any, text_dir: Path, n: int, context: int, gap: int) -> np.ndarray:
    """n windows of `context` tokens: comedy b % 3, from TEXT_OFFSET + (b // 3) * gap."""
    from qspec_jax.evaluation import read_text_tokens

    files = [COMEDIES[b % len(COMEDIES)] for b in range(n)]
    check_disjoint(CALIBRATION_PLAYS, files)
    return np.stack([read_text_tokens(model, text_dir / f, context, TEXT_OFFSET + (b // len(COMEDIES)) * gap)
                     for b, f in enumerate(files)])


def policies(gamma_max: int, bass: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
    """SpecConfig fields of every measured setting: fixed 1..gamma_max, then each BASS pair."""
    out = [dict(gamma=g) for g in range(1, gamma_max + 1)]
    out += [dict(gamma=CALIBRATION_GAMMA, draft_policy="bass", bass_increment=i, bass_mod=m) for i, m in bass]
    return out


def label(fields: dict[str, Any]) -> str:
    if fields.get("draft_policy", "fixed") == "fixed":
        return f"gamma={fields['gamma']}"
    return f"bass {fields['bass_increment']}:{fields['bass_mod']} from {fields['gamma']}"


def measure_ar(model: Any, prompts: np.ndarray, batch: int, new_tokens: int) -> dict[str, float]:
    """Tokens/s of autoregressive decoding (width 1: the fastest) over all prompts, `batch` rows
    at a time, with the dense bf16 and the INT8 cache (compile excluded)."""
    from qspec_jax.generation import GenerationConfig, generate_autoregressive

    out = {}
    for kind in ("bf16", "int8"):
        gen = GenerationConfig(max_new_tokens=new_tokens, kv=kind, width=1, eos_token_ids=())
        tokens, run_s = 0, 0.0
        for start in range(0, len(prompts), batch):
            tm: dict[str, float] = {}
            res = generate_autoregressive(model, prompts[start:start + batch], gen, jax.random.PRNGKey(0), timings=tm)
            tokens += int(np.sum(np.asarray(res.lengths)))
            run_s += tm["run_s"]
        out[kind] = tokens / run_s
    log(f"AR tokens/s: bf16 {out['bf16']:.1f}, int8 {out['int8']:.1f}")
    return out


def measure(model: Any, draft: Any, prompts: np.ndarray, batch: int, new_tokens: int,
            settings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs every setting over all prompts, `batch` rows at a time; counters summed over runs;
    tokens/s = emitted tokens (the prefill's first included) / run seconds (compile excluded)."""
    from qspec_jax.speculative import SpecConfig, generate

    rows, reference = [], None
    for fields in settings:
        spec = SpecConfig(max_new_tokens=new_tokens, eos_token_ids=(), **fields)
        sums = dict.fromkeys(("emitted", "rounds", "drafted", "accepted", "draft_steps", "rejected"), 0)
        tokens, run_s, compile_s, emitted_all = [], 0.0, 0.0, 0
        for start in range(0, len(prompts), batch):
            tm: dict[str, float] = {}
            res = generate(model, prompts[start:start + batch], spec, jax.random.PRNGKey(0), draft_params=draft,
                           timings=tm)
            for k in sums:
                sums[k] += int(np.sum(np.asarray(getattr(res, k))))
            tokens += res.to_lists()
            emitted_all += int(np.sum(np.asarray(res.lengths)))
            run_s += tm["run_s"]
            compile_s += tm["compile_s"]
        reference = tokens if reference is None else reference
        row = {"setting": label(fields), "fields": fields, "batch": batch, **sums,
               "tokens_per_round": sums["emitted"] / sums["rounds"],
               "acceptance": sums["accepted"] / max(1, sums["drafted"]),
               "mean_draft_length": sums["draft_steps"] / sums["rounds"],
               "alpha": sums["accepted"] / max(1, sums["accepted"] + sums["rejected"]),
               "same_tokens": tokens == reference, "run_s": run_s, "compile_s": compile_s,
               "tokens_per_s": emitted_all / run_s}
        log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
        rows.append(row)
    return rows


MODES = {"free": "free-running", "tf": "teacher-forced"}


def block_key(b: dict[str, Any]) -> tuple[int, int, int]:
    """Order of the report: free-running first, longer contexts first, then batch; contexts that
    did not fit ("mode" "error") last."""
    mode = b.get("mode", "free-running")
    return ({"free-running": 0, "error": 2}.get(mode, 1), -b["context"], b["batch"])


def simulate_policy(agree: np.ndarray, spec: Any) -> dict[str, int]:
    """Greedy rounds of `spec`'s draft policy over teacher-forced agreement rows agree
    bool[B, M] (draft argmax == target argmax on the true text), the B rows in one batch: a
    round drafts the policy's d for every live row; row b accepts the leading run of agreements
    of its next d positions (as evaluation.simulate_rounds: the last position is only emitted)
    and moves n + 1 on; d then follows speculative.next_draft_length, as in generation."""
    import jax.numpy as jnp

    from qspec_jax.speculative import next_draft_length

    agree = np.atleast_2d(agree)
    b, m = agree.shape
    t = np.zeros(b, np.int64)
    d, shrink = spec.gamma, 0
    out = dict.fromkeys(("emitted", "rounds", "drafted", "accepted", "draft_steps", "rejected"), 0)
    while (t < m).any():
        live = t < m
        limit = np.where(live, np.minimum(d, m - t - 1), 0)
        n = np.zeros(b, np.int64)
        for r in np.flatnonzero(live):
            window = agree[r, t[r]: t[r] + limit[r]]
            n[r] = len(window) if window.all() else int(np.argmin(window))
        out["rounds"] += int(live.sum())
        out["drafted"] += int(limit[live].sum())
        out["accepted"] += int(n[live].sum())
        out["emitted"] += int((n + 1)[live].sum())
        out["draft_steps"] += int(live.sum()) * int(limit[live].max())
        out["rejected"] += int((n < limit)[live].sum())
        nd, ns = next_draft_length(spec, jnp.int32(d), jnp.int32(shrink), jnp.asarray(n, jnp.int32),
                                   jnp.asarray(limit, jnp.int32), jnp.asarray(live))
        d, shrink = int(nd), int(ns)
        t = np.where(live, t + n + 1, t)
    return out


def simulate(agree: np.ndarray, batch: int, settings: list[dict[str, Any]], base: Any) -> list[dict[str, Any]]:
    """Rows like `measure`'s, from `simulate_policy` over the agreement rows, `batch` at a time."""
    rows = []
    for fields in settings:
        spec = dataclasses.replace(base, **fields)
        sums: dict[str, int] = {}
        for start in range(0, agree.shape[0], batch):
            for k, v in simulate_policy(agree[start:start + batch], spec).items():
                sums[k] = sums.get(k, 0) + v
        rows.append({"setting": label(fields), "fields": fields, "batch": batch, **sums,
                     "tokens_per_round": sums["emitted"] / sums["rounds"],
                     "acceptance": sums["accepted"] / max(1, sums["drafted"]),
                     "mean_draft_length": sums["draft_steps"] / sums["rounds"],
                     "alpha": sums["accepted"] / max(1, sums["accepted"] + sums["rejected"]), "same_tokens": True})
        log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}))
    return rows


def cost_scenarios(path: Path | None, width: int) -> dict[str, dict[str, float]]:
    """{name: {draft_s, verify_s, ar_s}} of the SPEC §8 floors and, given `path`, a stored
    per-phase JSON of tools/device/exactness_cost.py (8B shape, batch 1; named "stored ..." with
    its device). The verify pass has `width` columns; when the JSON has no pass of that width,
    the narrowest wider one measured stands in (an upper bound) and the name says so."""
    out = {}
    if path is not None and path.exists():
        for r in json.loads(path.read_text())["8b"]:
            have = sorted(int(k[len("int8_t"):]) for k in r if k.startswith("int8_t") and int(k[len("int8_t"):]) >= width)
            if not have:
                log(f"{path}: no verify pass of >= {width} columns at context {r['context']}")
                continue
            name = (f"stored {path.name}: 8B {r['context'] // 1024}k"
                    + ("" if have[0] == width else f" (verify T={have[0]})"))
            out[name] = dict(draft_s=r["draft_t1"] * 1e-3, verify_s=r[f"int8_t{have[0]}"] * 1e-3,
                             ar_s=min(r["bf16_t1"], r["int8_t1"]) * 1e-3)
    elif path is not None:
        log(f"{path} not found: no stored cost scenario")
    d, v, a = FLOOR_4K_MS
    out["8B floors 4k (SPEC §8)"] = dict(draft_s=d * 1e-3, verify_s=v * 1e-3, ar_s=a * 1e-3)
    return out


def analyse(rows: list[dict[str, Any]], scenarios: dict[str, dict[str, float]], gamma_max: int) -> dict[str, Any]:
    """Predicted speedups over AR of every setting, the best fixed gamma, the dynamic policies'
    tokens/round against the fixed gammas' at the same mean draft length (equal cost per round),
    and the planner's choices."""
    from qspec_jax.speculative import SpecConfig

    fixed = sorted((r for r in rows if r["fields"].get("draft_policy", "fixed") == "fixed"),
                   key=lambda r: r["fields"]["gamma"])
    xs = [r["mean_draft_length"] for r in fixed]
    ys = [r["tokens_per_round"] for r in fixed]
    for r in rows:  # fixed gammas' tokens/round interpolated at this setting's mean draft length
        r["fixed_tpr_at_same_length"] = float(np.interp(r["mean_draft_length"], xs, ys))
        r["tpr_vs_fixed_at_same_length"] = r["tokens_per_round"] / r["fixed_tpr_at_same_length"]
    if all("tokens_per_s" in r for r in rows):  # free-running: measured speed against the best fixed gamma
        best = max(r["tokens_per_s"] for r in fixed)
        for r in rows:
            r["tokens_per_s_vs_best_fixed"] = r["tokens_per_s"] / best
    base = SpecConfig(eos_token_ids=())
    cal = next(r for r in fixed if r["fields"]["gamma"] == CALIBRATION_GAMMA)
    plans = {}
    for name, c in scenarios.items():
        costs = StepCosts(c["draft_s"], c["verify_s"], c["ar_s"], verify_width=gamma_max + 1)
        for r in rows:
            r.setdefault("speedup", {})[name] = \
                r["tokens_per_round"] * c["ar_s"] / costs.round_s(r["mean_draft_length"])
        best_fixed = max(fixed, key=lambda r: r["speedup"][name])
        by_spec = {SpecConfig(eos_token_ids=(), **r["fields"]): r for r in rows}
        alpha_plan = plan_gamma(costs, base, cal["alpha"])
        measured_plan = plan_gamma(costs, base, measured={s: (r["tokens_per_round"], r["mean_draft_length"])
                                                          for s, r in by_spec.items()})
        chosen = by_spec.get(dataclasses.replace(alpha_plan.best.spec, eos_token_ids=()))
        plans[name] = {
            "costs_ms": {k: v * 1e3 for k, v in c.items()},
            "best_fixed": best_fixed["setting"], "best_fixed_speedup": best_fixed["speedup"][name],
            "alpha": cal["alpha"], "alpha_choice": policy_label(alpha_plan.best.spec) if alpha_plan.spec else "AR",
            "alpha_best": policy_label(alpha_plan.best.spec),
            "alpha_predicted_speedup": alpha_plan.speedup,
            "alpha_choice_measured_speedup": chosen["speedup"][name] if chosen else None,
            "alpha_choice_measured_tokens_per_s": chosen.get("tokens_per_s") if chosen else None,
            "measured_choice": measured_plan.best.label if measured_plan.spec else "AR",
            "measured_best": measured_plan.best.label, "measured_best_speedup": measured_plan.speedup,
            "summary": alpha_plan.summary()}
    return plans


def write_section(results: dict[str, Any], doc: Path = QUALITY_MD) -> None:
    env = results["environment"]
    head = (f"{report.env_line(env, results['command'])}; CPU: {results['cpu']}. Compute dtype "
            f"{results['dtype']}; draft {results['draft']}; greedy; {results['new_tokens']} new tokens per prompt, "
            f"{results['prompts']} prompts per context (Shakespeare comedies {', '.join(COMEDIES)}, windows from token "
            f"{TEXT_OFFSET}).")
    out = [f"## Draft length: fixed gamma vs BASS-style dynamic length (SmolLM2)\n\n{head}\n\n"
           "Free-running: real greedy speculative generation. Teacher-forced: draft and target argmax on the true "
           "text (no drift into repetition), rounds of each policy simulated on that agreement sequence "
           "(`simulate_policy`, the same `next_draft_length` as generation).\n\n"
           "tokens/round = emitted / verify passes and acceptance = accepted / drafted (SPEC §7); draft length = draft "
           "steps per round; alpha = accepted / (accepted + rejections), the per-position acceptance of the i.i.d. "
           "model; vs fixed = tokens/round over the fixed gammas' tokens/round interpolated at the same mean draft "
           "length (equal cost per round). tokens/s: measured, emitted tokens over the run's seconds (compile "
           "excluded), and against the best fixed gamma's; AR: autoregressive decoding, width 1, the faster of bf16 "
           "and INT8 KV, on the same prompts. Speedup = tokens/round x c_AR / (draft length x c_draft + c_verify) "
           "with the per-phase costs of SmolLM2 measured on this run's device (`planner.measure_step_costs`, at "
           "each batch; named with the device), the SPEC §8 floors (8B, 4k: this run's acceptance with another "
           "model's costs) and any stored cost JSON given with --costs (named 'stored'). same tokens: the output "
           "equals the first setting's (all are the target's own greedy output).\n"]
    for block in results["blocks"]:
        if "error" in block:
            out.append(f"\n- context {block['context']}: {block['error']}")
            continue
        rows, scen = block["rows"], list(block["plans"])
        free = block.get("mode", "free-running") == "free-running"
        what = (f"{rows[0]['emitted']} tokens emitted per setting" if free else
                f"agreement {block['agreement']:.3f}; rounds simulated over {rows[0]['emitted']} positions")
        out.append(f"\n### {block.get('mode', 'free-running')}, context {block['context']}, batch {block['batch']} "
                   f"({what})\n")
        timed = free and all("tokens_per_s" in r for r in rows)
        hdr = (["setting", "draft length", "acceptance", "tokens/round", "alpha", "vs fixed"]
               + (["tokens/s", "tokens/s vs best fixed"] if timed else [])
               + [f"speedup, {s}" for s in scen] + (["same tokens"] if free else []))
        body = [[r["setting"], f"{r['mean_draft_length']:.2f}", f"{r['acceptance']:.3f}", f"{r['tokens_per_round']:.2f}",
                 f"{r['alpha']:.3f}", f"{r['tpr_vs_fixed_at_same_length']:.3f}"]
                + ([f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s_vs_best_fixed'] - 1:+.1%}"] if timed else [])
                + [f"{r['speedup'][s]:.2f}x" for s in scen] + (["yes" if r["same_tokens"] else "NO"] if free else [])
                for r in rows]
        out.append(report.table(hdr, body))
        if timed and block.get("ar_tokens_per_s"):
            ar = max(block["ar_tokens_per_s"].values())
            fastest = max(rows, key=lambda r: r["tokens_per_s"])
            line = (f"\nMeasured: AR {ar:.1f} tokens/s (bf16 KV {block['ar_tokens_per_s']['bf16']:.1f}, INT8 KV "
                    f"{block['ar_tokens_per_s']['int8']:.1f}); fastest speculative setting {fastest['setting']} "
                    f"{fastest['tokens_per_s']:.1f} tokens/s ({fastest['tokens_per_s'] / ar:.2f}x AR).")
            own = [(k, p) for k, p in block["plans"].items() if k.startswith("SmolLM2 ")]
            for name, p in own:
                got = ar if p["alpha_choice"] == "AR" else p.get("alpha_choice_measured_tokens_per_s")
                if got:
                    line += (f" Planner with {name} costs picks {p['alpha_choice']}: {got:.1f} tokens/s measured, "
                             f"{got / max(ar, fastest['tokens_per_s']):.3f} of the fastest (AR included).")
            out.append(line + "\n")
        out.append("\nPlanner (alpha from the gamma=4 run; 'measured': from every setting's measured tokens/round):\n")
        hdr = ["costs", "c_draft / c_verify / c_AR ms", "best fixed", "planner (alpha)", "its measured speedup",
               "planner (measured)"]
        body = []
        for s, p in block["plans"].items():
            c = p["costs_ms"]
            a = p["alpha_choice"] if p["alpha_choice"] == "AR" else f"{p['alpha_choice']} ({p['alpha_predicted_speedup']:.2f}x)"
            if p["alpha_choice"] == "AR":
                a = f"AR (best {p['alpha_best']}: {p['alpha_predicted_speedup']:.2f}x)"
            m = p["measured_choice"] if p["measured_choice"] == "AR" else f"{p['measured_choice']} ({p['measured_best_speedup']:.2f}x)"
            if p["measured_choice"] == "AR":
                m = f"AR (best {p['measured_best']}: {p['measured_best_speedup']:.2f}x)"
            meas = "–" if p["alpha_choice"] == "AR" or p["alpha_choice_measured_speedup"] is None else \
                f"{p['alpha_choice_measured_speedup']:.2f}x"
            body.append([s, f"{c['draft_s']:.3g} / {c['verify_s']:.3g} / {c['ar_s']:.3g}",
                         f"{p['best_fixed']} ({p['best_fixed_speedup']:.2f}x)", a, meas, m])
        out.append(report.table(hdr, body))
    report.update_section("gamma", "\n".join(out), doc, QUALITY_HEADER)


def _pairs(s: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(x) for x in p.split(":")) for p in s.split(",") if p]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected INCREMENT:MOD pairs of integers >= 1, e.g. 1:4,2:10; got {s!r}")
    return pairs  # type: ignore[return-value]


PROG = "qspec-bench gamma"
PARTS = ("free", "tf", "loops")


def build_parser() -> argparse.ArgumentParser:
    from qspec_jax.cli import HelpFormatter, Parser, comma_choices, comma_list

    p = Parser(prog=PROG, description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    options.add_checkpoint_arg(p, what="SmolLM2 ")
    options.add_text_dir_arg(p)
    p.add_argument("--contexts", type=comma_list(int), default="4096,1024", help="comma-separated prompt lengths (tokens)")
    p.add_argument("--batches", type=comma_list(int), default="1,4",
                   help="comma-separated batch sizes; each must divide --prompts")
    p.add_argument("--prompts", type=int, default=4, help="prompt windows per context")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens generated per prompt")
    p.add_argument("--parts", type=comma_choices(PARTS), default="free,tf",
                   help="free: free-running generation (timed, with AR); tf: rounds simulated on teacher-forced "
                        "agreement; loops: the 8B shape at forced acceptance, the planner's choice against measured "
                        "loops (its report section goes to BENCHMARKS.md beside the --doc file; a GPU part: --quick "
                        "runs it at tiny sizes)")
    p.add_argument("--tf-tokens", type=int, default=512, help="tf part: evaluated tokens per prompt")
    p.add_argument("--bass", type=_pairs, default="1:4,2:10",
                   help="BASS settings measured, as bass_increment:bass_mod pairs (BASS's paper: 2:10)")
    p.add_argument("--costs", type=Path, default=None,
                   help="also a stored per-phase cost JSON of tools/device/exactness_cost.py (e.g. the checkout's "
                        "docs/bench/exactness_cost_h200.json, the first Hopper build's), named 'stored' in the report "
                        "(default: none)")
    p.add_argument("--no-device-costs", action="store_true",
                   help="skip measuring SmolLM2's step costs on this run's device")
    p.add_argument("--loop-contexts", type=comma_list(int), default=",".join(map(str, gamma_loops.LOOP_CONTEXTS)),
                   help="loops part: contexts of the 8B shape")
    p.add_argument("--loop-batches", type=comma_list(int), default="1", help="loops part: batch sizes")
    p.add_argument("--loop-alphas", type=comma_list(float, "numbers"),
                   default=",".join(map(str, gamma_loops.LOOP_ALPHAS)), help="loops part: forced acceptance rates")
    p.add_argument("--loop-tokens", type=int, default=128, help="loops part: new tokens per row per loop")
    p.add_argument("--loop-trials", type=int, default=3, help="loops part: timed repetitions (median)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32",
                   help="compute dtype (the other QUALITY.md CPU tables use float32)")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for the JSON results (default: ~/.cache/qspec-jax/bench/gamma, or gamma-quick "
                        "with --quick)")
    options.add_doc_arg(p, "QUALITY.md")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, except those given (a smoke test of the harness); writes no report")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return options.run_bench(PROG, _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    import qspec_jax
    from qspec_jax.cli import fail
    from qspec_jax.evaluation import teacher_forced
    from qspec_jax.planner import measure_step_costs
    from qspec_jax.speculative import SpecConfig, draft_params_for

    args = build_parser().parse_args(argv)
    options.resolve_outputs(PROG, args, "gamma", "QUALITY.md", quick=args.quick)
    options.positive(PROG, args, "--contexts", "--batches", "--prompts", "--new-tokens", "--tf-tokens",
                     "--loop-contexts", "--loop-batches", "--loop-tokens", "--loop-trials")  # --quick or not
    if args.quick:  # tiny sizes, except those given
        options.quick_sizes(args, build_parser(), dict(
            contexts=(256,), batches=(1, 2), prompts=2, new_tokens=16, tf_tokens=24, loop_tokens=16, loop_trials=1,
            loop_contexts=tuple(gamma_loops.QUICK_CONTEXTS)))
    contexts, batches, loop_contexts = list(args.contexts), list(args.batches), list(args.loop_contexts)
    parts = list(args.parts)
    bad = [b for b in batches if args.prompts % b]
    if bad:
        fail(PROG, f"--batches {','.join(map(str, bad))}: each must divide --prompts={args.prompts}")
    bad = [a for a in args.loop_alphas if not 0 < a <= 1]
    if bad:
        fail(PROG, f"--loop-alphas must be in (0, 1], got {','.join(map(str, bad))}")
    if args.costs is not None and not args.costs.is_file():
        fail(PROG, f"--costs {args.costs}: no such file (tools/device/exactness_cost.py writes it on a GPU)")
    if set(parts) - {"loops"}:
        options.check_model_inputs(PROG, args)
    if "loops" in parts:
        options.require_gpu(PROG, args.quick, "part loops builds the 8B shape's weights (16 GB) and caches")
    command = options.command_line(PROG, argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if "loops" in parts:
        loops_measured = part_loops(args, loop_contexts, command)
        if parts == ["loops"]:
            return 0 if loops_measured else 1
    model = qspec_jax.load(args.checkpoint, dtype=args.dtype)
    base = SpecConfig(eos_token_ids=())
    with warnings.catch_warnings():  # the checkpoint's stored draft may have another format: say it once
        warnings.simplefilter("ignore")
        draft = draft_params_for(model, base)
    log(f"draft: {base.draft_weights_config}")
    settings = policies(base.gamma_max, args.bass)
    if args.quick:  # the harness end to end, on few compiles
        settings = [f for f in settings if f["gamma"] in (1, CALIBRATION_GAMMA)][:2] + settings[-1:]
    scenarios = cost_scenarios(args.costs, base.verify_width)
    store = args.out / f"gamma_smollm2_{device_slug()}.json"
    same = {"dtype": model.config.dtype, "draft": json.dumps(base.draft_weights_config.to_dict()),
            "new_tokens": args.new_tokens, "prompts": args.prompts, "gamma_max": base.gamma_max}
    results: dict[str, Any] = {"blocks": [], "commands": []}

    def save(block: dict[str, Any]) -> None:
        """Adds a block (mode, context, batch) to the store; blocks of earlier or concurrent
        invocations with the same settings are kept."""
        nonlocal results
        old = json.loads(store.read_text()) if store.exists() else {}
        if any(old.get(k) != v for k, v in same.items()):
            old = {}  # another measurement: start over
        blocks = [b for b in old.get("blocks", []) + results["blocks"] if block_key(b) != block_key(block)]
        blocks = list({block_key(b): b for b in blocks}.values()) + [block]
        commands = list(dict.fromkeys(old.get("commands", []) + results["commands"] + [command]))
        results = {**old, **same, "environment": report.environment(), "cpu": cpu_model(), "commands": commands,
                   "command": " ; ".join(commands), "blocks": sorted(blocks, key=block_key)}
        with options.writing(PROG, "--out", args.out, store.name):
            store.write_text(json.dumps(results, indent=1))
        if args.doc:
            with options.writing(PROG, "--doc", args.doc, "its gamma section"):
                write_section(results, args.doc)

    def run_context(context: int) -> None:
        """Every part's blocks at one prompt length (the generation functions refuse what does not fit)."""
        if "free" in parts:
            prompts = prompt_windows(model, args.text_dir, args.prompts, context, gap=context + 4 * args.new_tokens)
        if "tf" in parts:
            tf = prompt_windows(model, args.text_dir, args.prompts, context + args.tf_tokens,
                                gap=context + 4 * args.new_tokens)
            log(f"context {context}: teacher-forced draft/target agreement on {tf.shape[0]} x {args.tf_tokens} tokens")
            res = teacher_forced(model.params, tf, context, kv="int8", draft=draft, draft_kv=base.draft_kv)
            agree = np.asarray(res["draft_top"] == res["target_top"])
            log(f"agreement {agree.mean():.4f}")
        for batch in batches:
            scen = dict(scenarios)
            if not args.no_device_costs:  # this device's cost table, labelled with its name
                c = measure_step_costs(model, base, context=context + args.new_tokens // 2, batch=batch,
                                       draft_params=draft, path=args.out / f"gamma_step_costs_{device_slug()}.json")
                scen[f"SmolLM2 {device_label()}, batch {batch}"] = dict(draft_s=c.draft_s, verify_s=c.verify_s,
                                                                        ar_s=c.ar_s)
            ar_speed = measure_ar(model, prompts, batch, args.new_tokens) if "free" in parts else None
            for mode in [m for m in ("free", "tf") if m in parts]:
                log(f"{MODES[mode]}, context {context}, batch {batch}: {len(settings)} settings")
                if mode == "free":
                    rows = measure(model, draft, prompts, batch, args.new_tokens, settings)
                else:
                    rows = simulate(agree, batch, settings, base)
                plans = analyse(rows, scen, base.gamma_max)
                for name, pl in plans.items():
                    log(f"{name}: {pl['summary']}")
                block = {"mode": MODES[mode], "context": context, "batch": batch, "rows": rows, "plans": plans}
                if mode == "free":
                    block["ar_tokens_per_s"] = ar_speed
                if mode == "tf":
                    block["agreement"] = float(agree.mean())
                save(block)

    measured = 0
    for context in contexts:
        error = options.run_case(functools.partial(run_context, context))
        if error is None:
            measured += 1
            continue
        log(f"context {context}: {error}")  # recorded, and the next context runs
        save({"mode": "error", "context": context, "batch": 0, "error": error})
    return 0 if measured else 1


def part_loops(args: argparse.Namespace, contexts: Sequence[int], command: str) -> bool:
    """The 8B shape's loops on this device (`bench.gamma_loops`) -> JSON and, with --doc, the
    "gamma-loops" section of BENCHMARKS.md beside the --doc file (docs/BENCHMARKS.md). Returns
    whether anything was measured (a case that does not fit is recorded as its row's error)."""
    bass = [(i, m) for i, m in args.bass]
    settings = policies(DEFAULT_GAMMA_MAX, bass)  # SpecConfig's default gamma_max
    if args.quick:  # every fixed gamma (the planner may pick any), one BASS setting
        settings = settings[:DEFAULT_GAMMA_MAX + 1]
    data = gamma_loops.measure_loops(quick=args.quick, contexts=contexts, batches=list(args.loop_batches),
                                     alphas=list(args.loop_alphas), settings=settings,
                                     new_tokens=args.loop_tokens, steps=8, trials=args.loop_trials, log=log)
    data.update(environment=report.environment(), command=command, device=device_label())
    with options.writing(PROG, "--out", args.out, f"gamma_loops_{device_slug()}.json"):
        (args.out / f"gamma_loops_{device_slug()}.json").write_text(json.dumps(data, indent=1))
    if args.doc:
        from qspec_jax.speculative import SpecConfig

        labels = [policy_label(SpecConfig(**f)) for f in settings if f.get("draft_policy") == "bass"]
        text = (f"## Gamma planner and dynamic draft length: measured loops\n\n"
                f"{report.env_line(data['environment'], command)}\n\n" + gamma_loops.section(data, device_label(), labels))
        with options.writing(PROG, "--doc", args.doc, "the gamma-loops section of BENCHMARKS.md beside it"):
            report.update_section("gamma-loops", text, args.doc.parent / "BENCHMARKS.md")
    return options.measured_any(data["rows"])


if __name__ == "__main__":
    sys.exit(main())
