"""Command line: `qspec-convert SRC OUT [--dtype bfloat16|float32] [--draft-weights int4 ...]`.

Exit status: 0 on success; 2 for bad input (the message goes to stderr as
`qspec-convert: error: <message>`, no traceback); 130 when interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

PROG = "qspec-convert"
EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Convert a Hugging Face Llama/Mistral model directory (config.json + *.safetensors) "
                    "or a Llama-architecture .gguf file into a qspec-jax checkpoint directory.")
    p.add_argument("src", metavar="SRC", help="HF model directory or .gguf file")
    p.add_argument("out", metavar="OUT", help="output checkpoint directory (must not exist)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="stored parameter dtype (default: bfloat16)")
    p.add_argument("--draft-weights", choices=("int4",), default=None,
                   help="also store INT4 draft weights for speculative decoding")
    p.add_argument("--draft-group", type=int, choices=(32, 64, 128), default=None,
                   help="draft weights: input rows per quantization group (default: 32)")
    p.add_argument("--draft-scope", choices=("all", "ffn"), default=None,
                   help="draft weights: quantize all linears or only the MLP's (default: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from convert import ConversionError, convert

    draft = None
    if args.draft_weights:
        from qspec_jax.weight_quant import DraftWeightsConfig

        draft = DraftWeightsConfig(group_size=args.draft_group or 64, scope=args.draft_scope or "all")
    elif args.draft_group is not None or args.draft_scope is not None:
        parser.error("--draft-group/--draft-scope need --draft-weights int4")
    t0 = time.perf_counter()
    try:
        out = convert(args.src, args.out, dtype=args.dtype, progress=not args.no_progress, draft_weights=draft)
    except ConversionError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was written", file=sys.stderr)
        return 130
    what = args.dtype + (f" + INT4 draft weights (group {draft.group_size}, {draft.scope})" if draft else "")
    print(f"{PROG}: wrote {out} ({what}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
