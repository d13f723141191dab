"""Speculative generation sharded over the local devices (tensor parallelism), checked against
one device.

What it shows:
  * `qspec_jax.sharding.make_mesh(n)`: a 1-D mesh named "tp" over the first n local devices;
  * `qspec_jax.sharding.shard(model, mesh)`: target and INT4 draft weights laid out over it
    (attention heads and MLP columns split, `wo`/`w_down` rows split, the vocabulary split);
    `qspec_jax.load(path, mesh=mesh)` does the same at load time. Every cache array is then laid
    out along KV heads inside the jitted program; `generate` itself is unchanged;
  * the same prompts through the unsharded model, and whether the tokens are the same.

Without GPUs, JAX can split the CPU into several devices, but only if
`XLA_FLAGS=--xla_force_host_platform_device_count=N` is set BEFORE jax is imported (XLA reads it
once, when it creates the CPU backend). `--cpu-devices N` makes this script set it (and
JAX_PLATFORMS=cpu) itself, before its first `import jax`; or set the variable yourself.

Run (from the repository root; `make demo` makes the default checkpoint):

    python examples/tensor_parallel.py --cpu-devices 2          # no GPU: 2 CPU devices
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python examples/tensor_parallel.py
    python examples/tensor_parallel.py --tp 2                   # 2 of the machine's GPUs

The model's query heads, KV heads, MLP width and vocabulary must divide by the device count
(SmolLM2-135M has 3 KV heads, so it runs on 1 or 3 devices; Llama-3-8B on 2, 4 or 8).
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
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
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


def main() -> int:
    args = parse_args()
    if args.cpu_devices:
        force_cpu_devices(args.cpu_devices)  # before jax is imported, i.e. before the imports below

    import jax

    import qspec_jax
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

    model = qspec_jax.load(args.checkpoint)  # on one device
    if model.tokenizer is None:
        sys.exit(f"{args.checkpoint}: this checkpoint has no tokenizer/ directory; this example needs one")
    try:
        spec = SpecConfig(gamma=args.gamma, max_new_tokens=args.max_new_tokens, group_size=args.group_size,
                          temperature=args.temperature)
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
        sys.exit(f"cannot shard this model over {n} devices: {e}")

    wq, dq = sharded.params.layers.wq, sharded.draft_params.layers.wq
    print("layout (PartitionSpec; the shape each device holds):")
    for name, x in (("target wq [L, D, Hq*Dh]", wq), ("target wo [L, Hq*Dh, D]", sharded.params.layers.wo),
                    ("target embed [V, D]", sharded.params.embed), ("draft wq.packed [L, D/2, Hq*Dh]", dq.packed)):
        print(f"  {name:<34} {str(tuple(x.sharding.spec)):<22} global {tuple(x.shape)} -> per device "
              f"{tuple(x.addressable_shards[0].data.shape)}")

    prompts = [model.encode(p, chat=True) for p in args.prompts]
    key = jax.random.PRNGKey(args.seed)

    def run(m, label):
        timings: dict[str, float] = {}
        res = generate(m, prompts, spec, key, draft_params=m.draft_params, timings=timings)
        answers = res.to_lists()
        n_tok = sum(map(len, answers))
        print(f"\n== {label}: compile {timings['compile_s']:.1f} s, run {timings['run_s']:.3f} s, {n_tok} tokens, "
              f"{n_tok / timings['run_s']:.1f} tokens/s, acceptance {res.acceptance_rate:.3f}, "
              f"{res.tokens_per_round:.2f} tokens/round")
        for b, ids in enumerate(answers):
            print(f"[{b}] {model.decode(ids).strip()!r}\n    ids: {' '.join(map(str, ids))}")
        return answers

    t0 = time.perf_counter()
    out = run(sharded, f"sharded over {n} devices")
    if args.no_compare:
        return 0
    ref = run(model, "one device")
    same = out == ref
    print(f"\nsharded tokens == one-device tokens: {'yes' if same else 'no'} "
          f"({time.perf_counter() - t0:.1f} s for both runs)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
