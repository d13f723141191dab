"""W4A16 launch-config sweep at M=1 on Llama-3-8B shapes (G=64)."""
import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.getcwd())
from pallas_kernels.linear import layout as lay
from pallas_kernels.linear.triton import default_config, w4a16_matmul

SMALL = os.environ.get("SMALL") == "1"
SHAPES = {"q_o": (4096, 4096), "gate_up": (4096, 14336), "down": (14336, 4096)} if not SMALL else {"t": (256, 256)}
G, REP = 64, (40 if not SMALL else 2)
res = []
def bench(k, n, cfg):
    key = jax.random.PRNGKey(0)
    packed = jax.random.randint(key, (k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8)
    scale = jnp.full((k // G, n), 0.01, jnp.float16); zero = jnp.full((k // G, n), -0.08, jnp.float16)
    x = jnp.ones((1, k), jnp.bfloat16)
    @jax.jit
    def loop(x):
        def body(i, acc):
            xi = x * (1 + i.astype(jnp.bfloat16) * 1e-3)
            return acc + w4a16_matmul(xi, packed, scale, zero, config=cfg).astype(jnp.float32)
        return jax.lax.fori_loop(0, REP, body, jnp.zeros((1, n), jnp.float32))
    jax.block_until_ready(loop(x)); ts = []
    for _ in range(5):
        t0 = time.perf_counter(); jax.block_until_ready(loop(x)); ts.append(time.perf_counter() - t0)
    return sorted(ts)[2] / REP
for name, (k, n) in SHAPES.items():
    d = default_config(1, k, n, G)
    base = bench(k, n, d); wbytes = lay.packed_bytes(k, n, G)
    print(f"{name} default {d} {base*1e6:.1f} us {wbytes/base/1e12:.2f} TB/s", flush=True)
    res.append({"shape": name, "cfg": str(d), "us": base * 1e6, "default": True})
    best = (base, d)
    for bn, nw, ns, ksm in itertools.product((64, 128, 256), (2, 4, 8), (2, 4), (1, 2)):
        ks = d.k_splits * ksm
        if (k // G) % ks or n % bn or (k // G) // ks < 1:
            continue
        cfg = d.replace(block_n=bn, num_warps=nw, num_stages=ns, k_splits=ks)
        try:
            t = bench(k, n, cfg)
        except Exception as e:
            print(name, cfg, "ERR", str(e)[:100]); continue
        res.append({"shape": name, "cfg": str(cfg), "us": t * 1e6})
        if t < best[0]:
            best = (t, cfg)
    print(f"{name} BEST {best[1]} {best[0]*1e6:.1f} us {wbytes/best[0]/1e12:.2f} TB/s ({base/best[0]:.2f}x default)", flush=True)
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/w4_sweep.json", "w"), indent=1)
