"""qspec-eval-ppl: teacher-forced perplexity of M tokens after an N-token context of a text.

    qspec-eval-ppl --checkpoint DIR --text FILE --context N --eval-tokens M
                   [--kv bf16|int8|int4] [--group-size G] [--offset K] [--batch B]
                   [--weights target|draft [--draft-group G ...]] [--tp N] [--json]

The cache evolves as in decoding (prefill, then append and flush per token), so every evaluated
token sees a quantized past and an FP ring. --kv int4 reads only the upper nibbles (the draft's
view); --weights draft evaluates with the INT4 draft weights instead of the target's (the
checkpoint's stored draft unless a --draft-* flag asks for another format). The progress bar
counts tokens, prefill and compilation included, and ends when the work does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from qspec_jax.cli import (KV_GROUP_SIZES, HelpFormatter, Parser, add_compile_cache_arg, add_draft_format_args,
                           check_draft_flags, compile_cache, draft_fields, fail, read_text, require, require_kv_group,
                           require_positions,
                           require_tokenizer, run_cli, tp_mesh, use_draft)

PROG = "qspec-eval-ppl"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, formatter_class=HelpFormatter, description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, type=Path, help="directory written by qspec-convert")
    p.add_argument("--text", required=True, type=Path, help="UTF-8 plain-text file to evaluate on")
    p.add_argument("--context", required=True, type=int, help="context tokens N before the evaluated ones (>= 1)")
    p.add_argument("--eval-tokens", required=True, type=int, help="evaluated tokens M per window (>= 1)")
    p.add_argument("--kv", choices=("bf16", "int8", "int4"), default="int8",
                   help="KV cache: dense bf16, hierarchical INT8 (the target's view) or its upper 4 bits (the "
                        "draft's view)")
    p.add_argument("--group-size", type=int, default=128,
                   help=f"tokens per quantization group of the INT8/INT4 cache, one of "
                        f"{', '.join(map(str, KV_GROUP_SIZES))}")
    p.add_argument("--offset", type=int, default=0, help="skip this many tokens of the text first (>= 0)")
    p.add_argument("--batch", type=int, default=1,
                   help="evaluate B windows, each M tokens further into the text (>= 1)")
    p.add_argument("--weights", choices=("target", "draft"), default="target",
                   help="evaluate with the target's weights or the INT4 draft's (the checkpoint's stored draft, or the "
                        "format the --draft-* flags ask for)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prefill the context in chunks of this many tokens (a multiple of --group-size; each chunk "
                        "reads the earlier ones from the cache, as `model.prefill(chunk=)` does); default: the "
                        "whole context at once")
    p.add_argument("--json", action="store_true", help='print one JSON object: ppl and the number of tokens')
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (a 1-D mesh over local devices)")
    add_draft_format_args(p)
    add_compile_cache_arg(p)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Refuses bad flag values before anything is loaded; messages name the flag."""
    require(PROG, args.context >= 1, "--context", args.context, ">= 1")
    require(PROG, args.eval_tokens >= 1, "--eval-tokens", args.eval_tokens, ">= 1")
    require(PROG, args.batch >= 1, "--batch", args.batch, ">= 1")
    require(PROG, args.offset >= 0, "--offset", args.offset, ">= 0")
    require(PROG, args.tp >= 1, "--tp", args.tp, ">= 1")
    require_kv_group(PROG, args.group_size)
    if args.prefill_chunk is not None:
        require(PROG, args.prefill_chunk >= 1 and args.prefill_chunk % args.group_size == 0, "--prefill-chunk",
                args.prefill_chunk, f"a positive multiple of --group-size {args.group_size}")
    check_draft_flags(PROG, args)
    if draft_fields(args) and args.weights != "draft":
        fail(PROG, "--draft-group/--draft-scope/--draft-method/--draft-lm-head choose the draft's format; "
                   "add --weights draft to evaluate with the draft's weights")


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    read_text(args.text, "--text")  # a missing or binary file fails before the model loads
    with compile_cache(args):
        return _evaluate(args)


def _evaluate(args: argparse.Namespace) -> int:
    import numpy as np

    import qspec_jax
    from qspec_jax.evaluation import eval_request, perplexity, read_text_tokens, teacher_forced
    from qspec_jax.planner import check_params_fit

    model = qspec_jax.load(args.checkpoint, mesh=tp_mesh(args.tp, PROG))
    require_tokenizer(model)
    window = args.context + args.eval_tokens
    require_positions(PROG, model.config, window, f"--context {args.context} + --eval-tokens {args.eval_tokens}")
    # DoesNotFitError (one line, exit status 2) before a draft is made or the text is read
    check_params_fit(model.params, eval_request(args.batch, args.context, args.eval_tokens, args.kv, args.group_size))
    if args.weights == "draft":
        model = use_draft(PROG, model, draft_fields(args))
    params = model.draft_params if args.weights == "draft" else model.params
    ids = read_text_tokens(model, args.text, window + (args.batch - 1) * args.eval_tokens, args.offset,
                           what="--text")
    tokens = np.stack([ids[b * args.eval_tokens: b * args.eval_tokens + window] for b in range(args.batch)])
    res = teacher_forced(params, tokens, args.context, kv=args.kv, group_size=args.group_size,
                         progress=not args.json, prefill_chunk=args.prefill_chunk)
    out = {"ppl": perplexity(res["nll"]), "tokens": int(res["nll"].size)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"perplexity {out['ppl']:.4f} over {out['tokens']} tokens (context {args.context}, kv {args.kv})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
