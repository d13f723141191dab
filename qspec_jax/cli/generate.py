"""qspec-generate: generate text from a converted checkpoint, speculatively or autoregressively.

    qspec-generate --checkpoint DIR (--prompt TEXT | --prompt-file F) [--chat] [--json]
                   [--mode spec|ar] [--gamma N] [--kv bf16|int8] [--max-new-tokens N]
                   [--temperature T] [--top-k K] [--top-p P] [--seed S] [--compare-ar]

tokens/s is measured on the run alone: the program is compiled ahead of time first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from qspec_jax.cli import fail, run_cli, tp_mesh

PROG = "qspec-generate"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Generate text with QuantSpec self-speculative decoding.")
    p.add_argument("--checkpoint", required=True, type=Path, help="directory written by qspec-convert")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file holding the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--mode", choices=("spec", "ar"), default="spec", help="speculative (default) or autoregressive")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per round (spec mode)")
    p.add_argument("--kv", choices=("bf16", "int8"), default=None,
                   help="target KV cache: int8 hierarchical (spec default) or dense bf16 (ar default); "
                        "in spec mode bf16 makes the draft read the dense cache too")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-ar", action="store_true", help="spec mode: also run autoregressive and print both speeds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (a 1-D mesh over local devices)")
    return p


def _run(model: Any, ids: list[int], args: argparse.Namespace, mode: str) -> dict[str, Any]:
    import jax

    from qspec_jax.generation import GenerationConfig, generate_autoregressive
    from qspec_jax.speculative import SpecConfig, generate

    key = jax.random.PRNGKey(args.seed)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p)
    timings: dict[str, float] = {}
    out: dict[str, Any] = {"mode": mode}
    kv_kind = args.kv or ("int8" if mode == "spec" else "bf16")
    if mode == "ar":
        res = generate_autoregressive(model, [ids], GenerationConfig(kv=kv_kind, **sampling), key, timings=timings)
    else:
        kv = dict(target_kv="bf16", draft_kv="bf16") if kv_kind == "bf16" else {}
        res = generate(model, [ids], SpecConfig(gamma=args.gamma, **kv, **sampling), key, timings=timings)
        out.update(acceptance_rate=res.acceptance_rate, tokens_per_round=res.tokens_per_round)
    tokens = res.to_lists()[0]
    out.update(text=model.decode(tokens), tokens=tokens, tokens_per_s=len(tokens) / timings["run_s"],
               compile_s=timings["compile_s"])
    return out


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            fail(PROG, f"--prompt-file {args.prompt_file}: no such file")
        args.prompt = args.prompt_file.read_text()
    if args.max_new_tokens < 1:
        fail(PROG, f"--max-new-tokens {args.max_new_tokens}: must be >= 1")

    import qspec_jax

    model = qspec_jax.load(args.checkpoint, mesh=tp_mesh(args.tp))
    ids = model.encode(args.prompt, chat=args.chat)
    result = _run(model, ids, args, args.mode)
    ar = _run(model, ids, args, "ar") if args.compare_ar and args.mode == "spec" else None
    if args.json:
        if ar is not None:
            result["ar_tokens_per_s"] = ar["tokens_per_s"]
        print(json.dumps({k: result[k] for k in result if k != "mode"}))
        return 0
    print(result["text"])
    line = f"{'[' + result['mode'] + ']':7}{len(result['tokens'])} tokens, {result['tokens_per_s']:.1f} tokens/s"
    if result["mode"] == "spec":
        line += (f", gamma={args.gamma}, acceptance rate {result['acceptance_rate']:.2f}, "
                 f"{result['tokens_per_round']:.2f} tokens/round")
    print(line + f" (compile {result['compile_s']:.1f} s)", file=sys.stderr)
    if ar is not None:
        same = "same tokens" if ar["tokens"] == result["tokens"] else "tokens differ"
        print(f"{'[ar]':7}{len(ar['tokens'])} tokens, {ar['tokens_per_s']:.1f} tokens/s ({same}; "
              f"speedup {result['tokens_per_s'] / ar['tokens_per_s']:.2f}x)", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
