"""Latency of the collectives one TP decode step issues (2 GPUs): psum of [1, hidden] bf16, all-gather of logits."""
import json
import os
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

try:
    from jax import shard_map
except ImportError:
    from jax.experimental.shard_map import shard_map
mesh = Mesh(jax.devices()[:2], ("tp",))
res = {}
def bench(name, fn, x, n=2000):
    f = jax.jit(fn); jax.block_until_ready(f(x)); ts = []
    for _ in range(5):
        t0 = time.perf_counter(); jax.block_until_ready(f(x)); ts.append(time.perf_counter() - t0)
    res[name] = sorted(ts)[2] / n * 1e6; print(name, f"{res[name]:.2f} us/iter", flush=True)
def loop(body, n=2000):
    return lambda x: jax.lax.fori_loop(0, n, lambda i, y: body(y), x)
psum = shard_map(lambda y: jax.lax.psum(y, "tp") * 0.5, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False) if 'check_vma' in shard_map.__code__.co_varnames else shard_map(lambda y: jax.lax.psum(y, "tp") * 0.5, mesh=mesh, in_specs=P(), out_specs=P(), check_rep=False)
x = jnp.ones((1, 4096), jnp.bfloat16)
bench("psum [1,4096] bf16", loop(psum), x)
noop = lambda y: y * 0.5 + 0.25
bench("single elementwise kernel [1,4096]", loop(noop), x)
def gather_body(y):
    return jax.lax.all_gather(y, "tp", axis=1, tiled=True)[:, : y.shape[1]] * 0.5
ag = shard_map(gather_body, mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, "tp"))
xl = jnp.ones((1, 128256), jnp.float32)
bench("all-gather logits [1,128256] f32", loop(ag), xl)
json.dump(res, open(os.environ["OUT"] + "/collectives.json", "w"), indent=1)
