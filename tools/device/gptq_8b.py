"""Times the default draft (GPTQ, `calibration.make_draft`, as `qspec-convert` makes it) on the
Llama-3.1-8B shape with random bf16 weights, on the first device (issue 24: <= 5 minutes on the H200).

    python tools/device/gptq_8b.py [--tokens 8192] [--layers 32] [--quick]

Calibration tokens: random ids (the path `make_draft` takes for a model without a tokenizer); a
real conversion tokenizes the built-in text instead, which costs the same per token. Prints the
seconds of: random weights, the whole draft (Hessians collected one layer at a time and GPTQ of
every linear and the lm_head, compiles included), a second run of the same (compiled), and one
JSON line with all of it. `--layers N` runs an N-layer model of the same shape (the time is about
linear in N); `--quick` a tiny model (a CPU smoke test).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

import qspec_jax  # noqa: E402,F401  (XLA flags before the first computation)
from qspec_jax import calibration as C  # noqa: E402
from qspec_jax import model as M  # noqa: E402
from qspec_jax.bench.e2e import LLAMA31_8B, QUICK  # noqa: E402
from qspec_jax.weight_quant import DraftWeightsConfig  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=C.CALIBRATION_MAX_TOKENS, help="calibration tokens")
    p.add_argument("--layers", type=int, default=None, help="layers (default: the model's 32)")
    p.add_argument("--quick", action="store_true", help="a tiny model of the same structure")
    args = p.parse_args()
    cfg = QUICK if args.quick else LLAMA31_8B
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers)
    dcfg = DraftWeightsConfig()
    print(f"device {jax.devices()[0].device_kind}; {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"MLP {cfg.intermediate_size}, vocab {cfg.vocab_size}; draft {dcfg}; {args.tokens} calibration tokens",
          flush=True)
    t0 = time.perf_counter()
    params = jax.block_until_ready(jax.jit(lambda k: M.init_random_params(cfg, k))(jax.random.PRNGKey(0)))
    out = {"device": jax.devices()[0].device_kind, "layers": cfg.num_layers, "tokens": args.tokens,
           "init_s": time.perf_counter() - t0}
    for run in ("first_s", "second_s"):  # the first compiles; the second is the same work compiled
        t0 = time.perf_counter()
        draft, info = C.make_draft(params, dcfg, max_tokens=args.tokens, progress=True)
        jax.block_until_ready(draft)
        out[run] = time.perf_counter() - t0
        del draft
        print(f"{run}: {out[run]:.1f} s ({info})", flush=True)
    out["first_s_per_layer"] = out["first_s"] / cfg.num_layers
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
