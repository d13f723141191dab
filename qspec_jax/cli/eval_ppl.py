"""qspec-eval-ppl: teacher-forced perplexity of M tokens after an N-token context of a text.

    qspec-eval-ppl --checkpoint DIR --text FILE --context N --eval-tokens M
                   --kv bf16|int8|int4 [--group-size G] [--offset K] [--draft-weights] [--json]

The cache evolves as in decoding (prefill, then append and flush per token), so every evaluated
token sees a quantized past and an FP ring. --kv int4 reads only the upper nibbles (the draft's
view); --draft-weights evaluates with the INT4 draft weights instead of the target's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from qspec_jax.cli import run_cli, tp_mesh

PROG = "qspec-eval-ppl"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--text", required=True, type=Path, help="plain-text file")
    p.add_argument("--context", required=True, type=int, help="context tokens N")
    p.add_argument("--eval-tokens", required=True, type=int, help="evaluated tokens M")
    p.add_argument("--kv", choices=("bf16", "int8", "int4"), default="int8")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--offset", type=int, default=0, help="skip this many tokens of the text first")
    p.add_argument("--batch", type=int, default=1, help="evaluate B windows, each M tokens further on")
    p.add_argument("--draft-weights", action="store_true", help="use the INT4 draft weights")
    p.add_argument("--json", action="store_true", help='print {"ppl": ..., "tokens": ...}')
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (a 1-D mesh over local devices)")
    return p


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    import numpy as np

    import qspec_jax
    from qspec_jax.evaluation import perplexity, read_text_tokens, teacher_forced

    model = qspec_jax.load(args.checkpoint, mesh=tp_mesh(args.tp))
    if args.draft_weights:
        model = model if model.draft_params is not None else model.with_draft_weights()
    params = model.draft_params if args.draft_weights else model.params
    window = args.context + args.eval_tokens
    ids = read_text_tokens(model, args.text, window + (args.batch - 1) * args.eval_tokens, args.offset)
    tokens = np.stack([ids[b * args.eval_tokens: b * args.eval_tokens + window] for b in range(args.batch)])
    res = teacher_forced(params, tokens, args.context, kv=args.kv, group_size=args.group_size,
                         progress=not args.json)
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
