"""Dump the optimized HLO of the 2-device tensor-parallel AR decode loop (8B shape, 4k context)."""
import collections
import functools
import os
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import qspec_jax  # noqa: F401  (XLA flags)
from qspec_jax import model as M
from qspec_jax.bench import e2e
from qspec_jax.generation import GenerationConfig, autoregressive_loop
from qspec_jax.sharding import cache_specs, make_mesh, shard_params

cfg = e2e.LLAMA31_8B
key = jax.random.PRNGKey(0)
mesh = make_mesh(2)
params = shard_params(jax.jit(lambda k: M.init_random_params(cfg, k))(key), mesh, 64)
cache = e2e.random_dense_cache(cfg, 1, 4096, key)
cache = jax.device_put(cache, jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(cache)))
fn = jax.jit(functools.partial(autoregressive_loop, gen=GenerationConfig(max_new_tokens=8, kv="bf16"), eos_ids=()))
txt = fn.lower(params, cache, jnp.array([7], jnp.int32), key).compile().as_text()
open(os.environ["OUT"] + "/tp2_ar_hlo.txt", "w").write(txt)
c = collections.Counter()
for line in txt.splitlines():
    m = re.search(r"= \S+ (all-reduce|all-gather|reduce-scatter|collective-permute|copy|custom-call|fusion|dynamic-slice|all-to-all)\(", line)
    if m:
        t = re.search(r'custom_call_target="([^"]+)"', line)
        c[m.group(1) + (":" + t.group(1) if t else "")] += 1
for k, v in c.most_common(): print(v, k)
