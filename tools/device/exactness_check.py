"""GPU check that greedy speculative decoding emits the target's own autoregressive tokens with
bit-identical logits, through the GPU's kernels (Mosaic attention and W4A16, cuBLAS), on an
8B-shaped model (or SmolLM2-shaped: --shape smollm2) with random weights and fewer layers (not in CI; the CPU tests cover the logic).

    PYTHONPATH=. python3 tools/device/exactness_check.py [--layers 4] [--prompt 3000] [--new 96]
        [--batches 1,3] [--shape smollm2]

AR runs at the verify width (GenerationConfig(width=gamma_max + 1)) over the same INT8 cache
geometry; prompts of different lengths in one batch; the run crosses flushes. Prints one line
per batch and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import numpy as np  # noqa: E402

import qspec_jax  # noqa: E402,F401  (XLA flags)
from qspec_jax import model as M  # noqa: E402
from qspec_jax.bench.e2e import LLAMA31_8B  # noqa: E402
from qspec_jax.checkpoint import Model  # noqa: E402
from qspec_jax.generation import GenerationConfig, generate_autoregressive  # noqa: E402
from qspec_jax.speculative import SpecConfig, generate  # noqa: E402
from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=3000)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--batches", default="1,3")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--shape", choices=("llama3-8b", "smollm2"), default="llama3-8b")
    args = ap.parse_args(argv)
    if args.prompt < 2 or args.new < 1 or args.layers < 1:
        ap.error(f"--prompt >= 2, --new >= 1 and --layers >= 1; got {args.prompt}, {args.new}, {args.layers}")
    from qspec_jax.bench.prefill import SMOLLM2

    base = SMOLLM2 if args.shape == "smollm2" else LLAMA31_8B
    cfg = base.replace(num_layers=args.layers, max_position_embeddings=65536)
    params = jax.jit(lambda k: M.init_random_params(cfg, k, scale=0.05))(jax.random.PRNGKey(0))
    model = Model(config=cfg, params=params)
    # The INT4 draft (clipped round-to-nearest: no calibration text needed for random weights), in
    # this device's kernel layout; exactness must hold for any draft.
    draft = jax.block_until_ready(M.for_device(make_draft_params(params, DraftWeightsConfig(method="clip"))))
    rng = np.random.default_rng(0)
    spec = SpecConfig(gamma=args.gamma, max_new_tokens=args.new, eos_token_ids=(), return_logits=True)
    gen = GenerationConfig(max_new_tokens=args.new, kv="int8", width=spec.verify_width, eos_token_ids=(),
                           return_logits=True)
    bad = 0
    for b in (int(x) for x in args.batches.split(",")):
        # lengths spread over [prompt / 2, prompt] (137-token steps, wrapping), so any batch size works
        prompts = [rng.integers(0, cfg.vocab_size, args.prompt - (137 * i) % (args.prompt // 2 + 1)).tolist()
                   for i in range(b)]
        ar = generate_autoregressive(model, prompts, gen)
        sp = generate(model, prompts, spec, draft_params=draft)
        same_tokens = ar.to_lists() == sp.to_lists()
        la, ls = np.asarray(ar.logits), np.asarray(sp.logits)
        same_logits = la.shape == ls.shape and np.array_equal(la.view(np.uint32), ls.view(np.uint32))
        ok = same_tokens and same_logits
        bad += not ok
        print(f"batch {b}: tokens equal {same_tokens}, logits bitwise {same_logits}, acceptance "
              f"{sp.acceptance_rate:.3f}, tokens/round {sp.tokens_per_round:.2f}, "
              f"max |dlogit| {float(np.max(np.abs(la - ls))) if la.shape == ls.shape else float('nan'):.3g}",
              flush=True)
    print("EXACT" if not bad else f"MISMATCH in {bad} batch(es)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
