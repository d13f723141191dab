"""qspec-eval-accept: acceptance rate and tokens/round of the draft on real text (greedy).

    qspec-eval-accept --checkpoint DIR --text FILE --context N[,N...] --gamma G[,G...]
                      --new-tokens M [--batch B] [--teacher-forced] [--json]
                      [--draft-kv int4|int8] [--draft-weights int4|bf16] [--draft-group 32|64|128]
                      [--draft-scope all|ffn] [--draft-method clip|minmax] [--no-draft-lm-head]

Free-running (default): real speculative generation from B prompts of N tokens cut from the
text. --teacher-forced: draft and target argmax at every position of the text's true
continuation, with rounds simulated on that agreement sequence (free-running text of a small
model often loops, which inflates agreement).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from qspec_jax.cli import run_cli, tp_mesh
from qspec_jax.weight_quant import DraftWeightsConfig

PROG = "qspec-eval-accept"


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--text", required=True, type=Path)
    p.add_argument("--context", required=True, type=_int_list, help="context lengths, e.g. 1024,4096")
    p.add_argument("--gamma", required=True, type=_int_list, help="draft lengths, e.g. 2,4,6")
    p.add_argument("--new-tokens", required=True, type=int)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--offset", type=int, default=0, help="skip this many tokens of the text first")
    p.add_argument("--teacher-forced", action="store_true")
    p.add_argument("--draft-kv", choices=("int4", "int8"), default="int4")
    p.add_argument("--draft-weights", choices=("int4", "bf16"), default="int4")
    p.add_argument("--draft-group", type=int, default=DraftWeightsConfig.group_size)
    p.add_argument("--draft-scope", choices=("all", "ffn"), default="all")
    p.add_argument("--draft-method", choices=("clip", "minmax"), default="clip")
    p.add_argument("--no-draft-lm-head", action="store_true", help="keep the draft's lm_head in bf16")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--json", action="store_true")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (a 1-D mesh over local devices)")
    return p


def _prompts(ids: Any, context: int, stride: int, batch: int) -> Any:
    import numpy as np

    return np.stack([ids[b * stride: b * stride + context] for b in range(batch)])


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    import jax

    import qspec_jax
    from qspec_jax.evaluation import read_text_tokens, simulate_rounds, teacher_forced
    from qspec_jax.speculative import SpecConfig, draft_params_for, generate

    model = qspec_jax.load(args.checkpoint, mesh=tp_mesh(args.tp))
    gamma_max = max(8, max(args.gamma))
    base = SpecConfig(gamma=1, gamma_max=gamma_max, max_new_tokens=args.new_tokens, draft_kv=args.draft_kv,
                      draft_weights=args.draft_weights, draft_group=args.draft_group, draft_scope=args.draft_scope,
                      draft_method=args.draft_method, draft_lm_head=not args.no_draft_lm_head,
                      group_size=args.group_size, eos_token_ids=())
    draft = draft_params_for(model, base)
    stride = args.new_tokens
    rows = []
    for context in args.context:
        ids = read_text_tokens(model, args.text, context + args.new_tokens + (args.batch - 1) * stride, args.offset)
        if args.teacher_forced:
            toks = _prompts(ids, context + args.new_tokens, stride, args.batch)
            res = teacher_forced(model.params, toks, context, kv="int8", draft=draft, draft_kv=args.draft_kv,
                                 group_size=args.group_size, progress=not args.json)
            agree = res["draft_top"] == res["target_top"]
            for g in args.gamma:
                sim = simulate_rounds(agree, g)
                rows.append({"context": context, "gamma": g, "acceptance_rate": sim["acceptance_rate"],
                             "tokens_per_round": sim["tokens_per_round"], "agreement": float(agree.mean()),
                             "mode": "teacher-forced"})
        else:
            prompts = _prompts(ids, context, stride, args.batch)
            for g in args.gamma:
                spec = dataclasses.replace(base, gamma=g)
                r = generate(model, prompts, spec, jax.random.PRNGKey(0), draft_params=draft)
                rows.append({"context": context, "gamma": g, "acceptance_rate": r.acceptance_rate,
                             "tokens_per_round": r.tokens_per_round, "mode": "free-running"})
        if not args.json:
            for row in rows[-len(args.gamma):]:
                print(f"context {row['context']:>6}  gamma {row['gamma']}  acceptance {row['acceptance_rate']:.3f}  "
                      f"tokens/round {row['tokens_per_round']:.2f}  ({row['mode']})", flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
