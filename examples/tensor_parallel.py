"""Speculative generation sharded over the local devices (tensor parallelism), checked exactly
against autoregressive decoding under the same sharding, and within a tolerance against one device.

What it shows:
  * `qspec_jax.sharding.make_mesh(n)`: a 1-D mesh named "tp" over the first n local devices;
  * `qspec_jax.sharding.shard(model, mesh)`: target and INT4 draft weights laid out over it
    (attention heads and MLP columns split, `wo`/`w_down` rows split, the vocabulary split);
    `qspec_jax.load(path, mesh=mesh)` does the same at load time. Every cache array is then laid
    out along KV heads inside the jitted program; `generate` itself is unchanged;
  * what tensor parallelism promises, checked: (1) greedy speculative tokens == greedy
    autoregressive tokens of the same sharded target, exactly (the same claim as on one device);
    (2) the sharded target's logits are those of one device within a tolerance: a sharded matmul
    sums its partial products across devices in another order, so the last bits differ. The
    tolerance is on max |logit difference| / max |logit| over the positions where both runs had
    the same history: 1e-4 in float32 and 0.1 in bfloat16 (measured on SmolLM2 over 3 CPU
    devices, 3 prompts x 24 tokens: 2.3e-6 and 0.035, i.e. about 20 float32 and 9 bfloat16 ulps
    of the largest logit). Greedy tokens can part where two logits are closer than that, so the
    one-device tokens are shown, not required.

Without GPUs, JAX can split the CPU into several devices, but only if
`XLA_FLAGS=--xla_force_host_platform_device_count=N` is set BEFORE jax is imported (XLA reads it
once, when it creates the CPU backend). `--cpu-devices N` makes this script set it (and
JAX_PLATFORMS=cpu) itself, before its first `import jax`; or set the variable yourself.

The model's query heads, KV heads, MLP width and vocabulary must divide by the device count:
SmolLM2-135M (9 query heads, 3 KV heads), the default model, runs on 1 or 3 devices;
Llama-3-8B on 2, 4 or 8.

Run (from the repository root; `make demo` makes the default checkpoint):

    python examples/tensor_parallel.py --cpu-devices 3          # no GPU: 3 CPU devices (SmolLM2)
    XLA_FLAGS=--xla_force_host_platform_device_count=3 python examples/tensor_parallel.py
    python examples/tensor_parallel.py --tp 2 --checkpoint DIR   # 2 of the machine's GPUs, a model that splits in 2

Exit status: 0 when both checks pass, 1 when one fails, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "smollm2-135m-instruct"
DEFAULT_PROMPTS = ("What is the capital of France?", "Name two planets of the solar system.",
                   "Write one sentence about the ocean.")


# Tolerance of the one-device comparison: max |logit difference| / max |logit| (see the docstring).
RELATIVE_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT, help="directory written by qspec-convert")
    p.add_argument("--cpu-devices", type=int, default=0,
                   help="split the CPU into this many JAX devices (sets XLA_FLAGS before importing jax); 0 = off")
    p.add_argument("--tp", type=int, default=0, help="devices to shard over (0 = all local devices)")
    p.add_argument("--prompts", nargs="+", default=list(DEFAULT_PROMPTS), help="one chat prompt per batch row")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (at most)")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per round (1..gamma_max, 7 by default)")
    p.add_argument("--group-size", type=int, default=128, help="tokens per quantized KV block (G)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="compute dtype: auto = float32 on a CPU, bfloat16 on a GPU (qspec_jax.load)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the exactness check needs greedy)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed (sampling)")
    p.add_argument("--no-compare", action="store_true", help="skip the single-device run")
    args = p.parse_args()
    if args.cpu_devices < 0 or args.tp < 0:
        p.error("--cpu-devices and --tp must be >= 0")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    return args


def force_cpu_devices(n: int) -> None:
    """Makes JAX see n CPU devices. Must run before the first `import jax` anywhere in the process."""
    if "jax" in sys.modules:
        sys.exit("force_cpu_devices: jax is already imported; the device count can no longer change")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


def common_prefix_logit_gap(a, b) -> tuple[float, float, int]:
    """(max |logit difference|, max |logit|, positions compared) over each row's tokens up to and
    including its first divergence: there both runs chose from the same history."""
    import numpy as np

    la, lb = np.asarray(a.logits), np.asarray(b.logits)
    gap = scale = 0.0
    n = 0
    for r, (ta, tb) in enumerate(zip(a.to_lists(), b.to_lists())):
        k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)) - 1) + 1
        gap = max(gap, float(np.abs(la[r, :k] - lb[r, :k]).max()))
        scale = max(scale, float(np.abs(lb[r, :k]).max()))
        n += k
    return gap, scale, n


def main() -> int:
    args = parse_args()
    if args.cpu_devices:
        force_cpu_devices(args.cpu_devices)  # before jax is imported, i.e. before the imports below

    import jax

    import qspec_jax
    from qspec_jax.generation import GenerationConfig, generate_autoregressive
    from qspec_jax.sharding import ShardingError, make_mesh, shard
    from qspec_jax.speculative import SpecConfig, generate

    devices = jax.local_devices()
    n = args.tp or len(devices)
    print(f"devices: {len(devices)} x {devices[0].platform} ({devices[0].device_kind}); sharding over {n}")
    if n > len(devices):
        sys.exit(f"--tp {n}: only {len(devices)} local device(s). Without GPUs, pass --cpu-devices {n} "
                 f"(or set XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting Python).")
    if not (args.checkpoint / "qspec_checkpoint.json").is_file():
        sys.exit(f"{args.checkpoint}: no converted checkpoint there. Make the default one with `make demo`, or "
                 "convert a model with `qspec-convert SRC OUT` and pass --checkpoint OUT.")

    model = qspec_jax.load(args.checkpoint, dtype=args.dtype)  # on one device
    if model.tokenizer is None:
        sys.exit(f"{args.checkpoint}: this checkpoint has no tokenizer/ directory; this example needs one")
    try:
        spec = SpecConfig(gamma=args.gamma, max_new_tokens=args.max_new_tokens, group_size=args.group_size,
                          temperature=args.temperature, return_logits=True)
        ar_config = GenerationConfig(max_new_tokens=args.max_new_tokens, kv="int8", group_size=args.group_size,
                                     temperature=args.temperature, width=spec.verify_width, return_logits=True)
    except ValueError as e:  # messages name SpecConfig's fields (gamma, group_size, temperature)
        sys.exit(f"bad setting: {e}")
    # The INT4 draft: the weights qspec-convert stored next to the target, used as they are
    # (made now, with DraftWeightsConfig's defaults, when the checkpoint has none),
    # so that `shard` lays it out with the target.
    if model.draft_params is None:
        model = model.with_draft_weights()
    try:
        sharded = shard(model, make_mesh(n))  # or: qspec_jax.load(path, mesh=make_mesh(n))
    except ShardingError as e:
        sys.exit(f"cannot shard this model over {n} devices: {e} (SmolLM2-135M, the default model, splits over 1 "
                 "or 3 devices: --cpu-devices 3)")

    wq, dq = sharded.params.layers.wq, sharded.draft_params.layers.wq
    print(f"compute dtype: {model.config.dtype}")
    print("layout (PartitionSpec; the shape each device holds):")
    for name, x in (("target wq [L, D, Hq*Dh]", wq), ("target wo [L, Hq*Dh, D]", sharded.params.layers.wo),
                    ("target embed [V, D]", sharded.params.embed), ("draft wq.packed [L, D/2, Hq*Dh]", dq.packed)):
        print(f"  {name:<34} {str(tuple(x.sharding.spec)):<22} global {tuple(x.shape)} -> per device "
              f"{tuple(x.addressable_shards[0].data.shape)}")

    prompts = [model.encode(p, chat=True) for p in args.prompts]
    key = jax.random.PRNGKey(args.seed)

    def run(m, label, mode):
        timings: dict[str, float] = {}
        if mode == "spec":
            res = generate(m, prompts, spec, key, draft_params=m.draft_params, timings=timings)
            rates = f", acceptance {res.acceptance_rate:.3f}, {res.tokens_per_round:.2f} tokens/round"
        else:
            res = generate_autoregressive(m, prompts, ar_config, key, timings=timings)
            rates = ""
        answers = res.to_lists()
        n_tok = sum(map(len, answers))
        print(f"\n== {label}: compile {timings['compile_s']:.1f} s, run {timings['run_s']:.3f} s, {n_tok} tokens, "
              f"{n_tok / timings['run_s']:.1f} tokens/s{rates}")
        for b, ids in enumerate(answers):
            print(f"[{b}] {model.decode(ids).strip()!r}\n    ids: {' '.join(map(str, ids))}")
        return res

    t0 = time.perf_counter()
    spec_res = run(sharded, f"sharded over {n} devices, speculative", "spec")
    ar_res = run(sharded, f"sharded over {n} devices, autoregressive (the same target)", "ar")
    ok = True
    if args.temperature == 0:
        same = spec_res.to_lists() == ar_res.to_lists()
        print(f"\nsharded speculative == sharded autoregressive: {'yes' if same else 'NO'} (exact: the same sharded "
              "target decodes both)")
        ok &= same
    else:
        print("\nsampled (--temperature > 0): both follow the target's distribution; no exact check")
    if not args.no_compare:
        ref = run(model, "one device, autoregressive", "ar")
        gap, scale, positions = common_prefix_logit_gap(ar_res, ref)
        tol = RELATIVE_TOLERANCE[model.config.dtype]
        within = gap <= tol * scale
        rows_same = sum(x == y for x, y in zip(ar_res.to_lists(), ref.to_lists()))
        print(f"\nsharded vs one device: max |logit difference| {gap:.3g} over {positions} positions, "
              f"{gap / scale:.2g} of the largest |logit| {scale:.3g} (tolerance {tol:g} x: a sharded sum rounds "
              f"differently): {'within' if within else 'OUTSIDE'}; tokens equal on {rows_same}/{len(prompts)} rows")
        ok &= within
    print(f"\n{'all checks passed' if ok else 'a check FAILED'} ({time.perf_counter() - t0:.1f} s of runs)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
