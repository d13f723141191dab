"""The pure-function API, one speculative round at a time, with the shape of every array.

What it shows (the README's "Lower level" section, runnable):
  1. `QuantSpecCache.init`: the hierarchical INT8 cache (nibble planes, scales/zeros, FP ring);
  2. `prefill` of right-padded prompts with the target weights: logits [B, V], the prompt's
     K/V quantized up to a block boundary and the rest in the FP ring;
  3. gamma draft steps, `decode(draft_params, tok[B, 1], cache, view="draft")`: INT4 weights
     reading only the upper nibbles, each step writing its K/V into the ring;
  4. `cache.rollback(committed)` then one verify pass of the target over [pending, g_1..g_gamma]
     (`view="target"`), which overwrites those gamma+1 ring slots with target K/V. It runs at a
     fixed `width` of gamma_max + 1 token columns (padded), the width autoregressive decoding
     uses too, so a position's logits do not depend on how many tokens are verified with it;
  5. `accept_greedy`: how many drafts each row accepts, and the row's next token. A row accepts
     no token at or past its flush horizon (`cache.tokens_until_flush()`): past it, autoregressive
     decoding would already see the next block quantized;
  6. commit with `cache.rollback(committed + n + 1)` (rollback only moves a length), then
     `cache.flush()`, which quantizes the oldest G ring tokens of rows whose ring holds >= 2G.
Every function is pure (new cache out, old cache untouched), so each is `jax.jit`-ed as is.
`speculative.generate` runs exactly these rounds inside one `lax.while_loop`. At the end the
tokens are checked against the target's own greedy autoregressive output, which they equal.

Run (from the repository root; `make demo` makes the default checkpoint):

    python examples/lower_level.py
    python examples/lower_level.py --rounds 40 --group-size 32   # enough rounds to see flushes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import qspec_jax
from qspec_jax import QuantSpecCache, decode, prefill
from qspec_jax.generation import GenerationConfig, decode_cache_len, generate_autoregressive, length_bucket
from qspec_jax.speculative import SpecConfig, accept_greedy

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "smollm2-135m-instruct"
DEFAULT_PROMPTS = ("What is the capital of France?",
                   "List three rivers of Europe and the seas they flow into, one per line.")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT, help="directory written by qspec-convert")
    p.add_argument("--prompts", nargs="+", default=list(DEFAULT_PROMPTS), help="one chat prompt per batch row")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
    p.add_argument("--rounds", type=int, default=3, help="speculative rounds to run (the first one is printed in full)")
    p.add_argument("--gamma-max", type=int, default=8,
                   help="largest gamma the cache's ring is sized for; verify passes are gamma_max + 1 wide")
    p.add_argument("--group-size", type=int, default=128, help="tokens per quantized KV block (G)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: must be >= 1")
    try:  # SpecConfig checks 1 <= gamma <= gamma_max < group_size, with messages naming the fields
        args.spec = SpecConfig(gamma=args.gamma, gamma_max=args.gamma_max, group_size=args.group_size,
                               max_new_tokens=1 + args.rounds * (args.gamma + 1), eos_token_ids=())
    except ValueError as e:
        p.error(str(e))
    return args


def show(name: str, x) -> None:
    """One line per array: name, dtype[shape] (and the values of small integer vectors)."""
    if isinstance(x, (jax.Array, np.ndarray)):
        val = f"  = {np.asarray(x).tolist()}" if x.ndim <= 2 and x.size <= 16 and x.dtype.kind in "iu" else ""
        print(f"  {name:<24}{x.dtype}[{', '.join(map(str, x.shape))}]{val}")
    else:
        print(f"  {name:<24}{x!r}")


def show_cache(cache: QuantSpecCache) -> None:
    for name, value in vars(cache).items():  # every field of the pytree (static ones too)
        show(f"cache.{name}", value)
    show("cache.ring_size", cache.ring_size)


def lengths_line(cache: QuantSpecCache) -> str:
    return (f"q_len={np.asarray(cache.q_len).tolist()} fp_len={np.asarray(cache.fp_len).tolist()} "
            f"fp_start={np.asarray(cache.fp_start).tolist()}")


def main() -> int:
    args = parse_args()
    if not (args.checkpoint / "qspec_checkpoint.json").is_file():
        sys.exit(f"{args.checkpoint}: no converted checkpoint there. Make the default one with `make demo`, or "
                 "convert a model with `qspec-convert SRC OUT` and pass --checkpoint OUT.")
    model = qspec_jax.load(args.checkpoint)
    if model.tokenizer is None:
        sys.exit(f"{args.checkpoint}: this checkpoint has no tokenizer/ directory; this example needs one")
    cfg, spec = model.config, args.spec
    G, gamma, width = spec.group_size, spec.gamma, spec.verify_width
    # The draft: the INT4 weights `qspec-convert` stores with the target, or made now if absent.
    if model.draft_params is None:
        model = model.with_draft_weights()
    target, draft = model.params, model.draft_params
    print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} query / {cfg.num_kv_heads} KV "
          f"heads of {cfg.head_dim}, vocab {cfg.vocab_size}, {cfg.dtype}; draft: {model.draft_weights_config}")
    print("weights (layers stacked on a leading L axis; linears are [L, Din, Dout]):")
    show("target.layers.wq", target.layers.wq)
    wq = draft.layers.wq  # a QuantizedWeight: two 4-bit codes per byte, a scale and zero per group of rows
    show("draft.layers.wq.packed", wq.packed)
    show("draft.layers.wq.scale", wq.scale)
    show("draft.layers.wq.zero", wq.zero)

    # ---- prompts: right-padded into tokens [B, T] with per-row lengths [B]
    prompts = [model.encode(p, chat=True) for p in args.prompts]
    B = len(prompts)
    T = length_bucket(max(map(len, prompts)))  # the padded length generate() uses (a short geometric ladder)
    tokens = np.zeros((B, T), np.int32)
    for b, ids in enumerate(prompts):
        tokens[b, : len(ids)] = ids
    lengths = np.array([len(ids) for ids in prompts], np.int32)
    # Room for the prompt, every token a run can emit (the first from prefill, then up to
    # gamma+1 per round) and one verify pass of `width` columns: a multiple of G, sized as
    # generate() and generate_autoregressive() size it.
    max_len = decode_cache_len(T, spec.max_new_tokens, width, G)
    print(f"\nprompts: tokens/lengths (T padded to length_bucket's ladder); max_len={max_len}, G={G}, "
          f"gamma={gamma}, verify width={width}")
    show("tokens", tokens)
    show("lengths", lengths)

    # ---- 1. an empty cache
    print("\n1. QuantSpecCache.init(config, batch, max_len, group_size, gamma_max):")
    cache = QuantSpecCache.init(cfg, batch=B, max_len=max_len, group_size=G, gamma_max=spec.gamma_max)
    show_cache(cache)

    prefill_jit = jax.jit(prefill)
    decode_jit = jax.jit(decode, static_argnames=("view", "width"))

    # ---- 2. prefill with the target
    logits, cache = prefill_jit(target, jnp.asarray(tokens), jnp.asarray(lengths), cache)
    print(f"\n2. prefill(target, tokens, lengths, cache): {lengths_line(cache)}")
    show("logits", logits)
    pending = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # greedy first token; its K/V is not computed yet
    show("pending", pending)
    emitted = [[int(t)] for t in np.asarray(pending)]

    for r in range(args.rounds):
        verbose = r == 0
        committed = cache.total_lengths()  # int32[B]: tokens whose K/V the target has committed
        # Drafts each row may accept: none at or past the row's flush horizon.
        limit = jnp.clip(cache.tokens_until_flush() - 1, 0, gamma)

        # ---- 3. gamma draft steps (INT4 weights, upper nibbles of the quantized past + FP ring)
        if verbose:
            print(f"\n3. {gamma} draft steps, decode(draft, tok[B, 1], cache, view='draft'):")
        tok, drafts = pending, []
        for i in range(gamma):
            d_logits, cache = decode_jit(draft, tok[:, None], cache, view="draft")
            tok = jnp.argmax(d_logits[:, 0], axis=-1).astype(jnp.int32)
            drafts.append(tok)
            if verbose:
                show(f"step {i}: draft logits", d_logits)
        g = jnp.stack(drafts, axis=1)  # [B, gamma]
        if verbose:
            show("g (drafts)", g)
            print(f"  after drafting: {lengths_line(cache)} (the drafts are committed for now)")

        # ---- 4. verify: un-commit the drafts, then the target over [pending, g_1 .. g_gamma]
        cache = cache.rollback(committed)
        verify_in = jnp.concatenate([pending[:, None], g], axis=1)  # [B, gamma+1]
        p_logits, cache = decode_jit(target, verify_in, cache, view="target", width=width)
        if verbose:
            print(f"\n4. cache.rollback(committed); decode(target, [pending, g], cache, view='target', width={width}):")
            show("verify input", verify_in)
            show("target logits", p_logits)

        # ---- 5. accept (greedy): n[b] <= limit[b] leading drafts equal the target's argmax; y[b] next
        n, y = accept_greedy(p_logits, g, limit)
        if verbose:
            print("\n5. accept_greedy(target logits, g, limit):")
            show("limit", limit)
            show("n (accepted)", n)
            show("y (next token)", y)

        # ---- 6. commit pending + n accepted drafts, then flush full blocks of the ring
        cache = cache.rollback(committed + n + 1)
        before = lengths_line(cache)
        cache = cache.flush()
        if verbose:
            print("\n6. cache.rollback(committed + n + 1).flush():")
            print(f"  committed: {before}\n  flushed:   {lengths_line(cache)}")
        else:
            print(f"round {r + 1}: limit={np.asarray(limit).tolist()} n={np.asarray(n).tolist()} "
                  f"y={np.asarray(y).tolist()}; {lengths_line(cache)}")
        for b in range(B):
            emitted[b] += [int(t) for t in np.asarray(g[b, : int(n[b])])] + [int(y[b])]
        pending = y

    print("\nemitted tokens per row:")
    for b, ids in enumerate(emitted):
        print(f"[{b}] {len(ids)} tokens: {model.decode(ids).strip()!r}")

    # Greedy speculative output is the target's own greedy output: autoregressive decoding over
    # the same INT8 cache, at the verify pass's width, gives these tokens.
    ar_cfg = GenerationConfig(max_new_tokens=spec.max_new_tokens, kv="int8", group_size=G, width=width,
                              eos_token_ids=())
    ar = generate_autoregressive(model, prompts, ar_cfg).to_lists()
    same = all(ar[b][: len(ids)] == ids for b, ids in enumerate(emitted))
    print(f"same tokens as greedy generate_autoregressive: {'yes' if same else 'no'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
