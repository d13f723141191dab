"""How many kernels XLA makes of the target's residual add + RMSNorm, by row count (issue 32).

The target's decode layer computes h = x + d (the residual add) and y = model.rms_norm(h, g) in
HF's order. On the GPU XLA makes that two or three kernels at small row counts (a reduction does not
fuse with its broadcast consumer) and one Triton "normalization" fusion at larger ones, by its cost
model. This prints, per row count M: the optimized HLO's kernels (fusions and custom calls) and the
time of 32 chained add + norm pairs (a layer loop's worth) against the time of the adds alone.

    PYTHONPATH=. python3 tools/device/norm_fusion_probe.py [--rows 1,5,8,40] [--dim 4096]
"""
from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp

from qspec_jax.model import rms_norm


def kernels(compiled_text: str) -> list[str]:
    """The launched ops of every computation (the entry and the loop's body): fusions and custom
    calls, by kind."""
    out = []
    for line in compiled_text.splitlines():
        m = re.search(r"= \S+ (fusion|custom-call)\(", line)
        if m:
            kind = re.search(r"kind=(\w+)", line)
            name = re.search(r"(\S+) = ", line).group(1)
            target = re.search(r'custom_call_target="([^"]+)"', line)
            out.append(f"{name}:{kind.group(1) if kind else (target.group(1) if target else '')}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,5,8,40")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    key = jax.random.PRNGKey(0)
    for m in [int(r) for r in args.rows.split(",")]:
        x = jax.random.normal(key, (m, args.dim), jnp.bfloat16)
        d = jax.random.normal(jax.random.fold_in(key, 1), (args.layers, m, args.dim), jnp.bfloat16)
        g = (1 + 0.1 * jax.random.normal(jax.random.fold_in(key, 2), (args.layers, args.dim))).astype(jnp.bfloat16)

        def chain(x, d, g, norm=True):
            def body(i, c):
                h = c + d[i]
                return rms_norm(h, g[i], 1e-5) if norm else h * g[i]
            return jax.lax.fori_loop(0, args.layers, body, x)

        for label, norm in (("add+norm", True), ("add*g", False)):
            f = jax.jit(lambda x, d, g: chain(x, d, g, norm))
            c = f.lower(x, d, g).compile()
            ks = kernels(c.as_text())
            f(x, d, g).block_until_ready()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(20):
                    r = f(x, d, g)
                r.block_until_ready()
                ts.append((time.perf_counter() - t0) / 20)
            print(f"M {m:3d} {label:8s}: {min(ts) * 1e6 / args.layers:6.2f} us per layer  kernels {ks}", flush=True)


if __name__ == "__main__":
    main()
