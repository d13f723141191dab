"""Streaming overhead: tokens/s of one generation program against the same generation streamed.

    # CPU, the real SmolLM2 checkpoint (make demo converts it):
    python tools/device/stream_overhead.py --checkpoint checkpoints/smollm2-135m-instruct
    # GPU, the Llama-3.1-8B shape with random bf16 weights and the INT4 draft (as qspec-bench e2e):
    python tools/device/stream_overhead.py --shape 8b --context 4096 --new-tokens 512

Variants, timed in turn (`--trials` times each, median reported), all greedy with no EOS, on
the same prompt:
  program    `generate(...)`: prefill and every round in one program (no streaming)
  chunks     `generate(..., on_tokens=...)`: the library's streaming (`generation.stream_chunks`):
             rounds in chunks of 1, 2, 4, then of the length that keeps a chunk's fixed cost
             under 2% (`generation.chunk_rounds`), the next chunk queued before the host reads
             the last one's tokens
  callback   the alternative measured against it: one program whose loop body calls the host
             once per round (`jax.experimental.io_callback`, the round's tokens), patched in
             here; not in the library (a program with a host callback cannot go to JAX's
             persistent compilation cache, and Ctrl-C cannot stop it between rounds)
Prints one line per variant (median tokens/s, overhead against `program`) and checks that every
variant produced the same tokens. Besides wall-clock tokens/s it reports tokens per CPU-second of
this process (all its threads): on a machine shared with other work, wall time varies run to run
by far more than 3%, while the process's own CPU time does not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import qspec_jax  # noqa: E402  (applies the XLA flags before the backend starts)
from qspec_jax import generation, speculative  # noqa: E402
from qspec_jax.speculative import SpecConfig, generate  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="a converted checkpoint (its stored INT4 draft)")
    src.add_argument("--shape", choices=("8b", "quick"),
                     help="random weights: 8b = Llama-3.1-8B (qspec_jax.bench.e2e.LLAMA31_8B), quick = its tiny twin")
    p.add_argument("--context", type=int, default=512, help="prompt tokens (random ids)")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per run")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--trials", type=int, default=5, help="timed runs per variant (after one warm-up each)")
    p.add_argument("--variants", default="program,chunks,callback")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="--checkpoint: compute dtype (auto: float32 on a CPU, bfloat16 on a GPU, as qspec-generate)")
    return p


def load_model(args: argparse.Namespace) -> Any:
    if args.checkpoint is not None:
        return qspec_jax.load(args.checkpoint, dtype=args.dtype)
    from qspec_jax import model as M
    from qspec_jax.bench.e2e import LLAMA31_8B, QUICK
    from qspec_jax.checkpoint import Model
    from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

    cfg = LLAMA31_8B if args.shape == "8b" else QUICK
    params = jax.jit(lambda k: M.init_random_params(cfg, k))(jax.random.PRNGKey(0))
    dcfg = DraftWeightsConfig(method="clip")  # random weights: the INT4 format, data-free (no calibration)
    draft = jax.block_until_ready(M.for_device(make_draft_params(params, dcfg)))
    return Model(config=cfg, params=jax.block_until_ready(M.for_device(params)), draft_params=draft,
                 draft_weights_config=dcfg)


def callback_rounds(cond: Any, body: Any, state: Any, max_rounds: Any = None) -> Any:
    """`generation.loop_rounds` with a host callback after every round (the tokens committed
    in it), the io_callback design."""
    from jax.experimental import io_callback

    width = SpecConfig().gamma_max + 1
    seen: list[Any] = []

    def host(start: np.ndarray, count: np.ndarray, window: np.ndarray) -> None:
        seen.append([window[b, : count[b]].tolist() for b in range(len(count))])

    def with_callback(s: Any) -> Any:
        s2 = body(s)
        cols = jnp.minimum(s.num_emitted[:, None] + jnp.arange(width)[None, :], s2.tokens.shape[1] - 1)
        window = jnp.take_along_axis(s2.tokens, cols, axis=1)
        io_callback(host, None, s.num_emitted, s2.num_emitted - s.num_emitted, window, ordered=False)
        return s2

    return jax.lax.while_loop(cond, with_callback, state) if max_rounds is None else \
        generation.loop_rounds(cond, with_callback, state, max_rounds)


def main() -> None:
    args = build_parser().parse_args()
    model = load_model(args)
    cfg = model.config
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, cfg.vocab_size, args.context).tolist()
    spec = SpecConfig(gamma=args.gamma, max_new_tokens=args.new_tokens, eos_token_ids=())
    if model.draft_weights_config is not None:
        d = model.draft_weights_config
        spec = SpecConfig(gamma=args.gamma, max_new_tokens=args.new_tokens, eos_token_ids=(), draft_group=d.group_size,
                          draft_scope=d.scope, draft_lm_head=d.lm_head, draft_method=d.method)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; model: "
          f"{args.checkpoint or args.shape} ({cfg.num_layers} layers, hidden {cfg.hidden_size}); prompt "
          f"{args.context} tokens, {args.new_tokens} new, gamma {args.gamma}, {args.trials} trials", flush=True)

    def callback_program() -> Any:
        """`speculative.speculative_program` compiled with callback_rounds in place of loop_rounds, on the
        arguments `generate` would pass it."""
        import functools

        tokens, lengths = generation.pad_prompts([prompt], cfg.vocab_size)
        max_len = generation.decode_cache_len(tokens.shape[1], spec.max_new_tokens, spec.verify_width,
                                              spec.group_size, spec.target_kv)
        inputs = (model.params, model.draft_params, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.PRNGKey(0))
        static = dict(spec=spec, eos_ids=(), max_len=max_len)
        speculative.loop_rounds = callback_rounds
        try:
            fn = jax.jit(functools.partial(speculative.speculative_program.__wrapped__), static_argnames=tuple(static))
            exe = fn.lower(*inputs, **static).compile()
        finally:
            speculative.loop_rounds = generation.loop_rounds
        return lambda: exe(*inputs)

    programs: dict[str, Any] = {}

    def run(variant: str) -> tuple[float, float, list[int], int]:
        """(tokens/s, tokens per CPU-second, tokens, chunks) of one run, compiled beforehand."""
        chunks: list[Any] = []
        if variant == "callback":
            if "callback" not in programs:
                programs["callback"] = callback_program()
            call = programs["callback"]
        else:
            def call() -> Any:  # the first call (the warm-up) compiles
                return generate(model, [prompt], spec, jax.random.PRNGKey(0), draft_params=model.draft_params,
                                on_tokens=chunks.append if variant == "chunks" else None)
        c0, t0 = time.process_time(), time.perf_counter()
        res = jax.block_until_ready(call())
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = res.to_lists()[0]
        return len(tokens) / wall, len(tokens) / cpu, tokens, len(chunks)

    variants = args.variants.split(",")
    tps: dict[str, list[float]] = {v: [] for v in variants}
    cps: dict[str, list[float]] = {v: [] for v in variants}
    tokens: dict[str, list[int]] = {}
    chunks: dict[str, int] = {}
    for v in variants:  # warm-up: compiles
        t0 = time.perf_counter()
        _, _, tokens[v], chunks[v] = run(v)
        print(f"  {v}: compiled and ran once in {time.perf_counter() - t0:.1f} s", flush=True)
    for _ in range(args.trials):
        for v in variants:
            rate, cpu_rate, toks, _ = run(v)
            tps[v].append(rate)
            cps[v].append(cpu_rate)
            assert toks == tokens[v]
    base, cbase = statistics.median(tps[variants[0]]), statistics.median(cps[variants[0]])
    for v in variants:
        med, cmed = statistics.median(tps[v]), statistics.median(cps[v])
        extra = f", {chunks[v]} chunks" if v == "chunks" else ""
        print(f"{v:9s} {med:9.2f} tokens/s (overhead {100 * (1 - med / base):+.2f}%; trials "
              f"{', '.join(f'{x:.1f}' for x in tps[v])}); {cmed:9.2f} tokens/CPU-s (overhead "
              f"{100 * (1 - cmed / cbase):+.2f}%; trials {', '.join(f'{x:.1f}' for x in cps[v])}){extra}")
    same = all(tokens[v] == tokens[variants[0]] for v in variants)
    print(f"same tokens in every variant: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
