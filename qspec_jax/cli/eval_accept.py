"""qspec-eval-accept: acceptance rate and tokens/round of the draft on real text (greedy).

    qspec-eval-accept --checkpoint DIR --text FILE --context N[,N...] --gamma G[,G...]
                      --new-tokens M [--batch B] [--offset K] [--teacher-forced] [--json]
                      [--draft-kv int4|int8] [--draft-weights int4|bf16] [--draft-group G]
                      [--draft-scope all|ffn] [--draft-method M] [--no-draft-lm-head]

Free-running (default): real speculative generation from B prompts of N tokens cut from the
text. --teacher-forced: draft and target argmax at every position of the text's true
continuation, with rounds simulated on that agreement sequence (free-running text of a small
model often loops, which inflates agreement). The draft is the checkpoint's stored INT4 draft
unless a --draft-* flag asks for another format (stderr says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from qspec_jax.cli import (DEFAULT_GAMMA_MAX, KV_GROUP_SIZES, HelpFormatter, Parser, add_compile_cache_arg,
                           add_draft_format_args, check_draft_flags, compile_cache, draft_fields, fail, read_text,
                           require, require_kv_group, require_positions, require_tokenizer, run_cli, tp_mesh,
                           use_draft)

PROG = "qspec-eval-accept"


def _int_list(s: str) -> list[int]:
    try:
        values = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, formatter_class=HelpFormatter, description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, type=Path, help="directory written by qspec-convert")
    p.add_argument("--text", required=True, type=Path, help="UTF-8 plain-text file the prompts are cut from")
    p.add_argument("--context", required=True, type=_int_list,
                   help="prompt (context) lengths in tokens, comma-separated, e.g. 1024,4096 (each >= 1)")
    p.add_argument("--gamma", required=True, type=_int_list,
                   help=f"draft lengths, comma-separated, e.g. 2,4,6 (each in 1..{DEFAULT_GAMMA_MAX}, gamma_max)")
    p.add_argument("--new-tokens", required=True, type=int,
                   help="tokens generated (free-running) or evaluated (teacher-forced) per prompt (>= 1)")
    p.add_argument("--batch", type=int, default=1, help="prompts per context, each --new-tokens further on (>= 1)")
    p.add_argument("--offset", type=int, default=0, help="skip this many tokens of the text first (>= 0)")
    p.add_argument("--teacher-forced", action="store_true",
                   help="measure draft/target agreement on the text's own continuation instead of generating")
    p.add_argument("--draft-kv", choices=("int4", "int8"), default="int4",
                   help="the draft's view of the KV cache: upper 4 bits (QuantSpec) or full INT8")
    p.add_argument("--draft-weights", choices=("int4", "bf16"), default="int4",
                   help="the draft's weights: INT4, or the target's own (the KV-only ablation)")
    p.add_argument("--group-size", type=int, default=128,
                   help=f"tokens per KV quantization group, one of {', '.join(map(str, KV_GROUP_SIZES))}")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (a 1-D mesh over local devices)")
    add_draft_format_args(p)
    add_compile_cache_arg(p)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Refuses bad flag values before anything is loaded; messages name the flag."""
    bad_ctx = [c for c in args.context if c < 1]
    require(PROG, not bad_ctx, "--context", ",".join(map(str, bad_ctx)), ">= 1")
    bad_gamma = [g for g in args.gamma if not 1 <= g <= DEFAULT_GAMMA_MAX]
    require(PROG, not bad_gamma, "--gamma", ",".join(map(str, bad_gamma)), f"in 1..{DEFAULT_GAMMA_MAX} (gamma_max)")
    require(PROG, args.new_tokens >= 1, "--new-tokens", args.new_tokens, ">= 1")
    require(PROG, args.batch >= 1, "--batch", args.batch, ">= 1")
    require(PROG, args.offset >= 0, "--offset", args.offset, ">= 0")
    require(PROG, args.tp >= 1, "--tp", args.tp, ">= 1")
    require_kv_group(PROG, args.group_size)
    check_draft_flags(PROG, args)
    if draft_fields(args) and args.draft_weights == "bf16":
        fail(PROG, "--draft-group/--draft-scope/--draft-method/--draft-lm-head set the INT4 draft's format; "
                   "they do not apply with --draft-weights bf16")


def check_fits(model: Any, base: Any, context: int, args: argparse.Namespace) -> None:
    """The longest context's run must fit this device's memory: DoesNotFitError (one line, exit
    status 2) otherwise, before a draft is made or anything compiles. Free-running: speculative
    generation from prompts padded as `generation.pad_prompts` pads them; teacher-forced: the
    evaluation with its draft (`evaluation.eval_request`)."""
    from qspec_jax.evaluation import eval_request
    from qspec_jax.generation import length_bucket
    from qspec_jax.planner import check_params_fit, weight_bytes
    from qspec_jax.speculative import check_memory

    if args.teacher_forced:
        made = 0 if args.draft_weights == "bf16" else weight_bytes(model.config, base.draft_weights_config)["draft"]
        check_params_fit(model.params, eval_request(args.batch, context, args.new_tokens, "int8", args.group_size,
                                                    with_draft=True), draft_bytes=made)
    else:
        check_memory(model, base, (args.batch, length_bucket(context)), context)


def _prompts(ids: Any, context: int, stride: int, batch: int) -> Any:
    import numpy as np

    return np.stack([ids[b * stride: b * stride + context] for b in range(batch)])


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    read_text(args.text, "--text")  # a missing or binary file fails before the model loads
    with compile_cache(args):
        return _evaluate(args)


def _evaluate(args: argparse.Namespace) -> int:
    import jax

    import qspec_jax
    from qspec_jax.evaluation import read_text_tokens, simulate_rounds, teacher_forced
    from qspec_jax.speculative import SpecConfig, generate

    model = qspec_jax.load(args.checkpoint, mesh=tp_mesh(args.tp, PROG))
    require_tokenizer(model)
    longest = max(args.context)
    require_positions(PROG, model.config, longest + args.new_tokens,
                      f"--context {longest} + --new-tokens {args.new_tokens}")
    base = SpecConfig(gamma=1, gamma_max=DEFAULT_GAMMA_MAX, max_new_tokens=args.new_tokens, draft_kv=args.draft_kv,
                      draft_weights=args.draft_weights, group_size=args.group_size, eos_token_ids=())
    check_fits(model, base, longest, args)  # before a draft is made or the text is read
    if args.draft_weights == "int4":
        model = use_draft(PROG, model, draft_fields(args))
        draft = model.draft_params
    else:
        print(f"{PROG}: draft: the target's own weights (--draft-weights bf16)", file=sys.stderr, flush=True)
        draft = model.params
    stride = args.new_tokens
    rows = []
    for context in args.context:
        ids = read_text_tokens(model, args.text, context + args.new_tokens + (args.batch - 1) * stride, args.offset,
                               what="--text")
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
