"""Batch generation with speculative decoding, jitted once in your own script.

What it shows:
  * how to `jax.jit` speculative generation yourself from the library's pure pieces
    (`QuantSpecCache.init` -> `prefill` -> `speculative_loop`), compile it ahead of time once
    and then call the compiled program, so compile time and run time are measured apart;
  * a batch of prompts of different lengths (right-padded, each row stops on its own), greedy
    and sampled, with each answer's tokens/s, acceptance rate and tokens per verify round;
  * the same batch through plain autoregressive decoding (`generate_autoregressive`, the
    library's one-call API) for comparison, and whether the greedy outputs are equal. They are:
    speculation changes speed, not output. Autoregressive steps run at the verify pass's width
    (gamma_max + 1 token columns, `--ar-width`), so both compute every logit bit for bit alike;
    `--ar-width 1` is the fastest autoregressive decoding, whose logits can differ in the last
    bit (another matmul shape sums in another order) and so flip a near-tied greedy choice.

Run (from the repository root; `make demo` makes the default checkpoint):

    python examples/generate_batch.py
    python examples/generate_batch.py --checkpoint checkpoints/smollm2-135m-instruct \
        --prompts "What is 2+2?" "Write a limerick about JAX." --max-new-tokens 64 --gamma 4
    python examples/generate_batch.py --modes greedy --kv bf16   # dense bf16 cache instead of INT8

Tokens/s of a row is its tokens over the whole batch's run time (rows run together).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import qspec_jax
from qspec_jax import DenseKVCache, QuantSpecCache, prefill
from qspec_jax.generation import GenerationConfig, decode_cache_len, generate_autoregressive, pad_prompts
from qspec_jax.sampling import sample
from qspec_jax.speculative import SpecConfig, SpecResult, speculative_loop

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "smollm2-135m-instruct"
DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, then give one everyday example of the same effect "
    "that a child could observe at home.",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT, help="directory written by qspec-convert")
    p.add_argument("--prompts", nargs="+", default=list(DEFAULT_PROMPTS), help="one chat prompt per batch row")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (at most)")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per round (1..gamma_max, 7 by default)")
    p.add_argument("--kv", choices=("int8", "bf16"), default="int8",
                   help="target KV cache: hierarchical INT8 (the draft reads its upper nibbles) or dense")
    p.add_argument("--group-size", type=int, default=128, help="tokens per quantized KV block (G)")
    p.add_argument("--modes", default="greedy,sampled", help="comma-separated: greedy, sampled")
    p.add_argument("--temperature", type=float, default=0.7, help="sampled mode")
    p.add_argument("--top-k", type=int, default=50, help="sampled mode (0 = off)")
    p.add_argument("--top-p", type=float, default=0.9, help="sampled mode (1 = off)")
    p.add_argument("--ar-width", type=int, default=None,
                   help="token columns of each autoregressive step: by default gamma_max + 1, the verify pass's "
                        "width, so both compute the same logits bit for bit; 1 is the fastest autoregressive decoding")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (sampling)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="override the checkpoint's stored dtype (weights, activations, FP ring)")
    p.add_argument("--show-ids", action="store_true", help="also print each answer's token ids")
    args = p.parse_args()
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in ("greedy", "sampled")]
    if bad or not args.modes:
        p.error(f"--modes {','.join(args.modes)}: expected a comma-separated subset of greedy,sampled")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if args.ar_width is not None and args.ar_width < 1:
        p.error(f"--ar-width {args.ar_width}: must be >= 1")
    try:  # SpecConfig validates gamma, group size and sampling settings (messages name its fields)
        SpecConfig(gamma=args.gamma, max_new_tokens=args.max_new_tokens, group_size=args.group_size,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as e:
        p.error(str(e))
    return args


# ---------------------------------------------------------------------------------------------
# Your own jitted generate. Everything static (the SpecConfig, EOS ids, cache length) is a static
# argument: one compiled program per setting and padded batch shape, reused for every call.
@functools.partial(jax.jit, static_argnames=("spec", "eos_ids", "max_len"))
def speculative_generate(target: qspec_jax.Params, draft: qspec_jax.Params, tokens: jax.Array,
                         lengths: jax.Array, key: jax.Array, *, spec: SpecConfig, eos_ids: tuple[int, ...],
                         max_len: int) -> SpecResult:
    """tokens int32[B, T] right-padded prompts, lengths int32[B] -> SpecResult (tokens [B, N])."""
    cfg = target.config
    b = tokens.shape[0]
    # One cache shared by draft and target: the draft reads the upper nibbles of the INT8 cache
    # (or the dense cache itself when --kv bf16), so drafting costs no KV memory.
    if spec.target_kv == "int8":
        cache = QuantSpecCache.init(cfg, b, max_len, group_size=spec.group_size, gamma_max=spec.gamma_max)
    else:
        cache = DenseKVCache.init(cfg, b, max_len)
    logits, cache = prefill(target, tokens, lengths, cache)  # the target fills the cache: logits [B, V]
    key, sub = jax.random.split(key)
    first = sample(sub, logits, spec.sampling)  # token 0 of every answer, int32[B]
    # draft gamma -> verify gamma+1 -> accept -> commit/flush, in one lax.while_loop
    return speculative_loop(target, draft, cache, first, key, spec=spec, eos_ids=eos_ids)


def row_stats(res: SpecResult, b: int) -> str:
    """Acceptance rate and tokens per round of batch row b (SPEC §7 definitions)."""
    drafted, accepted = int(res.drafted[b]), int(res.accepted[b])
    rounds, emitted = int(res.rounds[b]), int(res.emitted[b])
    if rounds == 0:
        return "no rounds (its first token ended it)"
    return f"acceptance {accepted / max(1, drafted):.3f}, {emitted / rounds:.2f} tokens/round"


def main() -> int:
    args = parse_args()
    if not (args.checkpoint / "qspec_checkpoint.json").is_file():
        sys.exit(f"{args.checkpoint}: no converted checkpoint there. Make the default one with `make demo`, or "
                 "convert a model with `qspec-convert SRC OUT` and pass --checkpoint OUT.")
    model = qspec_jax.load(args.checkpoint, dtype=args.dtype)
    if model.tokenizer is None:
        sys.exit(f"{args.checkpoint}: this checkpoint has no tokenizer/ directory; this example needs one to "
                 "encode the prompts (convert a model directory that has tokenizer files)")
    cfg = model.config
    # The INT4 draft: the weights qspec-convert stored next to the target, used as they are
    # (made now, with DraftWeightsConfig's defaults, when the checkpoint has none).
    if model.draft_params is None:
        model = model.with_draft_weights()
    print(f"model: {args.checkpoint.name} ({cfg.num_layers} layers, {cfg.dtype}), draft: {model.draft_weights_config}, "
          f"devices: {jax.devices()}")

    # Prompts of different lengths -> one right-padded batch (T is rounded up to a step of a short
    # geometric ladder, generation.length_bucket, so that new prompt lengths rarely recompile).
    prompts = [model.encode(p, chat=True) for p in args.prompts]
    tokens, lengths = pad_prompts(prompts, cfg.vocab_size)  # int32[B, T], int32[B]
    eos_ids = tuple(cfg.eos_token_ids)
    print(f"batch: {len(prompts)} prompts of {lengths.tolist()} tokens, padded to {tokens.shape}")

    greedy: dict[str, list[list[int]]] = {}
    for mode in args.modes:
        sampling = {} if mode == "greedy" else dict(temperature=args.temperature, top_k=args.top_k,
                                                   top_p=args.top_p)
        kv = {} if args.kv == "int8" else dict(target_kv="bf16", draft_kv="bf16")
        spec = SpecConfig(gamma=args.gamma, max_new_tokens=args.max_new_tokens, group_size=args.group_size,
                          **kv, **sampling)
        draft = model.draft_params
        # The cache holds the padded prompt, every new token and one verify pass of
        # spec.verify_width (= gamma_max + 1) columns; autoregressive generation sizes its cache
        # by the same formula, so both read caches of the same geometry.
        max_len = decode_cache_len(tokens.shape[1], spec.max_new_tokens, spec.verify_width, spec.group_size, spec.target_kv)
        key = jax.random.PRNGKey(args.seed)
        inputs = (model.params, draft, jnp.asarray(tokens), jnp.asarray(lengths), key)

        t0 = time.perf_counter()
        compiled = speculative_generate.lower(*inputs, spec=spec, eos_ids=eos_ids, max_len=max_len).compile()
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = jax.block_until_ready(compiled(*inputs))  # static args are baked into `compiled`
        run_s = time.perf_counter() - t0

        answers = res.to_lists()
        n_tok = sum(map(len, answers))
        print(f"\n== speculative {mode} (gamma {spec.gamma}, target KV {spec.target_kv}, draft KV {spec.draft_kv}): "
              f"compile {compile_s:.2f} s, run {run_s:.3f} s, {n_tok} tokens, {n_tok / run_s:.1f} tokens/s, "
              f"acceptance {res.acceptance_rate:.3f}, {res.tokens_per_round:.2f} tokens/round")
        for b, ids in enumerate(answers):
            print(f"[{b}] {int(lengths[b])} prompt tokens -> {len(ids)} tokens, {len(ids) / run_s:.1f} tokens/s, "
                  f"{row_stats(res, b)}")
            print("    " + model.decode(ids).strip().replace("\n", "\n    "))
            if args.show_ids:
                print("    ids: " + " ".join(map(str, ids)))

        # The same batch through plain autoregressive decoding of the same target and cache kind,
        # with the library's one-call API (`timings` compiles ahead of time and times both parts).
        # At the verify pass's width each step computes what verification computes, bit for bit.
        ar_width = args.ar_width or spec.verify_width
        ar_cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, kv=args.kv, group_size=args.group_size,
                                  width=ar_width, **sampling)
        timings: dict[str, float] = {}
        ar = generate_autoregressive(model, prompts, ar_cfg, jax.random.PRNGKey(args.seed), timings=timings)
        ar_answers = ar.to_lists()
        n_ar = sum(map(len, ar_answers))
        ar_tps = n_ar / timings["run_s"]
        print(f"== autoregressive {mode} (KV {args.kv}, width {ar_width}): compile {timings['compile_s']:.2f} s, "
              f"run {timings['run_s']:.3f} s, {n_ar} tokens, {ar_tps:.1f} tokens/s "
              f"(speculative/autoregressive: {(n_tok / run_s) / ar_tps:.2f}x)")
        for b, ids in enumerate(ar_answers):
            line = f"[{b}] {len(ids)} tokens, {len(ids) / timings['run_s']:.1f} tokens/s"
            if mode == "greedy":
                same = ids == answers[b]
                first = next((i for i, (x, y) in enumerate(zip(ids, answers[b])) if x != y),
                             min(len(ids), len(answers[b])))
                line += ", same tokens as speculative: " + ("yes" if same else f"no (first differs at token {first})")
            print(line)
            if mode != "greedy":
                print("    " + model.decode(ids).strip().replace("\n", "\n    "))
            if args.show_ids:
                print("    ids: " + " ".join(map(str, ids)))
        if mode == "greedy":
            greedy["spec"], greedy["ar"] = answers, ar_answers

    if greedy:
        n_same = sum(s == a for s, a in zip(greedy["spec"], greedy["ar"]))
        print(f"\ngreedy speculative == greedy autoregressive: {n_same}/{len(greedy['ar'])} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
