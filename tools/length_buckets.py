"""What the length buckets cost: prefill time of the padded prompt against the unpadded one,
and cache bytes, at several prompt lengths (`qspec_jax.generation.length_bucket`).

    python tools/length_buckets.py --checkpoint checkpoints/smollm2-135m-instruct [--lengths 300,1100,2100,4097]

For each length n: the bucket b = length_bucket(n), the median seconds of `model.prefill` over
[1, n] and [1, b] tokens (the INT8 cache of generate's size; compiled first, not timed), and
the cache bytes of `generate`'s INT8 cache (speculative, default SpecConfig) at n and b.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qspec_jax  # noqa: E402
from qspec_jax import model as M  # noqa: E402
from qspec_jax.cache import cache_bytes  # noqa: E402
from qspec_jax.compilation import programs  # noqa: E402
from qspec_jax.generation import decode_cache_len, length_bucket, new_cache  # noqa: E402
from qspec_jax.speculative import SpecConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--lengths", default="300,1100,2100,4097")
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args()
    model = qspec_jax.load(args.checkpoint)
    cfg, spec = model.config, SpecConfig()
    rng = np.random.default_rng(0)
    print(f"{args.checkpoint.name} on {jax.devices()[0].device_kind}, jax {jax.__version__}; INT8 cache, "
          f"SpecConfig() ({spec.max_new_tokens} new tokens); median of {args.trials}")
    print("| prompt | bucket | prefill unpadded (s) | prefill padded (s) | ratio | cache unpadded (MB) | "
          "cache padded (MB) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for n in map(int, args.lengths.split(",")):
        b = length_bucket(n)
        row = []
        for t in (n, b):
            max_len = decode_cache_len(t, spec.max_new_tokens, spec.verify_width, spec.group_size, spec.target_kv)
            tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (1, t)), jnp.int32)
            lengths = jnp.asarray([n], jnp.int32)
            cache = new_cache(cfg, "int8", 1, max_len, spec.group_size, spec.gamma_max)
            run, _ = programs().compiled(M.prefill, (model.params, tokens, lengths, cache), {})
            times = []
            for _ in range(args.trials):
                t0 = time.perf_counter()
                jax.block_until_ready(run(model.params, tokens, lengths, cache))
                times.append(time.perf_counter() - t0)
            nbytes = sum(cache_bytes("int8", cfg, 1, max_len, group_size=spec.group_size,
                                     gamma_max=spec.gamma_max).values())
            row.append((statistics.median(times), nbytes / 1e6))
        (ta, ca), (tb, cb) = row
        print(f"| {n} | {b} | {ta:.3f} | {tb:.3f} | {tb / ta:.2f} | {ca:.1f} | {cb:.1f} | {cb / ca:.2f} |", flush=True)


if __name__ == "__main__":
    main()
