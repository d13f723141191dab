"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4 (see
tests/test_tensor_parallel.py): sharded generation equals single-device generation."""

import dataclasses
import sys

import jax
import numpy as np

from qspec_jax import model as M
from qspec_jax.checkpoint import Model
from qspec_jax.config import ModelConfig
from qspec_jax.generation import GenerationConfig, generate_autoregressive, new_cache
from qspec_jax.sharding import ShardingError, make_mesh, shard
from qspec_jax.speculative import SpecConfig, generate
from qspec_jax.weight_quant import DraftWeightsConfig

CLIP32 = DraftWeightsConfig(group_size=32, method="clip")  # random weights: the draft format, data-free

assert jax.device_count() == 4, jax.devices()
CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4,
                  head_dim=16, dtype="float32", max_position_embeddings=512, eos_token_ids=(),
                  attention_impl="reference")
rng = np.random.default_rng(0)
PROMPTS = [rng.integers(0, 64, n).tolist() for n in (5, 17, 40)]
SPEC = SpecConfig(gamma=3, max_new_tokens=16, group_size=16, draft_group=32, draft_method="clip")
SAMPLE = SpecConfig(gamma=3, max_new_tokens=16, group_size=16, draft_group=32, draft_method="clip", temperature=1.0,
                    top_k=10)
AR = GenerationConfig(max_new_tokens=16)
KEY = jax.random.PRNGKey(3)


def run_all(model):
    return {"spec": generate(model, PROMPTS, SPEC).to_lists(),
            "ar": generate_autoregressive(model, PROMPTS, AR).to_lists(),
            "ar_int8": generate_autoregressive(model, PROMPTS, GenerationConfig(max_new_tokens=16, kv="int8",
                                                                                group_size=16)).to_lists(),
            "sample": generate(model, PROMPTS, SAMPLE, KEY).to_lists()}


def spec_of(x):
    return tuple(x.sharding.spec)


params = M.init_random_params(CFG, jax.random.PRNGKey(1), scale=0.3)
single = Model(config=CFG, params=params).with_draft_weights(CLIP32)
ref = run_all(single)
for n in (2, 4):
    sharded = shard(single, make_mesh(n))
    p, d = sharded.params, sharded.draft_params
    assert spec_of(p.embed) == ("tp", None), spec_of(p.embed)
    assert spec_of(p.layers.wq) == (None, None, "tp") and spec_of(p.layers.w_up) == (None, None, "tp")
    assert spec_of(p.layers.wo) == (None, "tp", None) and spec_of(p.layers.w_down) == (None, "tp", None)
    assert spec_of(p.layers.attn_norm) in ((), (None, None)), spec_of(p.layers.attn_norm)
    assert spec_of(d.layers.wk.packed) == (None, None, "tp") and spec_of(d.layers.wk.scale) == (None, None, "tp")
    assert spec_of(d.layers.w_down.packed) == (None, "tp", None) and spec_of(d.lm_head.packed) == (None, "tp")
    assert p.layers.wq.addressable_shards[0].data.shape == (2, 64, 128 // n)  # each device holds its heads
    for kind in ("bf16", "int8"):  # caches made inside jit are laid out along KV heads
        cache = jax.jit(lambda prm: M.prefill(prm, jax.numpy.ones((3, 64), jax.numpy.int32),
                                              jax.numpy.asarray([5, 17, 40]),
                                              new_cache(CFG, kind, 3, 128, 16, mesh=prm.mesh))[1])(p)
        for leaf in jax.tree.leaves(cache):
            want = (None, None, "tp") if leaf.ndim >= 3 else ()
            assert spec_of(leaf)[:3] == want or (leaf.ndim < 3 and spec_of(leaf) in ((), (None,))), (kind, spec_of(leaf))
    got = run_all(sharded)
    chunks = []  # streamed: the state (cache included) donated from chunk to chunk across the mesh
    streamed = generate(sharded, PROMPTS, SPEC, on_tokens=chunks.append).to_lists()
    got["streamed"] = [sum((c[b] for c in chunks), []) for b in range(len(PROMPTS))]
    assert streamed == got["streamed"] == ref["spec"], (n, streamed, got["streamed"], ref["spec"])
    for k in ref:
        assert got[k] == ref[k], (n, k, got[k], ref[k])
    print(f"tp={n}: shardings and tokens (spec, streamed spec, ar, ar_int8, sampling) equal to one device", flush=True)

# The Pallas kernels (interpret mode on CPU) per device inside shard_map: attention (head_dim 64)
# and the INT4 matmuls (output widths multiples of 128).
CFG_P = CFG.replace(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=256,
                    attention_impl="pallas",
                    int4_matmul_impl="pallas")
params_p = M.init_random_params(CFG_P, jax.random.PRNGKey(2), scale=0.2)
pallas = Model(config=CFG_P, params=params_p).with_draft_weights(CLIP32)
reference = Model(config=CFG_P.replace(attention_impl="reference", int4_matmul_impl="xla"),
                  params=params_p.replace(config=CFG_P.replace(attention_impl="reference", int4_matmul_impl="xla")))
reference = reference.with_draft_weights(CLIP32)
SPEC_P = dataclasses.replace(SPEC, group_size=32)  # the Triton attention kernel takes groups of >= 32
want = generate(reference, PROMPTS, SPEC_P).to_lists()
assert generate(pallas, PROMPTS, SPEC_P).to_lists() == want, "pallas single-device differs from the reference"
got = generate(shard(pallas, make_mesh(2)), PROMPTS, SPEC_P).to_lists()
assert got == want, (got, want)
print("tp=2 with the Pallas attention and W4A16 kernels under shard_map: same tokens", flush=True)

# A pass's kernel inputs may hold refs (the in-kernel split merge's counters, $QSPEC_MGPU_KERNEL_MERGE): they stay
# outside shard_map (inside it a ref loses its memory space), and each device's kernel call makes its own.
import jax.numpy as jnp  # noqa: E402
import pallas_kernels  # noqa: E402
from qspec_jax import attention as A  # noqa: E402
from qspec_jax.bench import synthetic  # noqa: E402

seen = []
real_attention = pallas_kernels.cache_attention
pallas_kernels.cache_attention = lambda q, *a, inputs=None, **k: (
    seen.append({n: isinstance(v, jax.ref.Ref) for n, v in (inputs or {}).items()}) or jnp.zeros_like(q))
qcache = synthetic.random_quant_cache(CFG_P, 2, 200, jax.random.PRNGKey(4), group=32, gamma_max=4)
q = jnp.zeros((2, 1, CFG_P.num_heads, CFG_P.head_dim), jnp.float32)
qpos = (qcache.q_len + qcache.fp_len)[:, None] - 1


@jax.jit
def attend_with_ref(q, qpos, qcache):
    inputs = {"pos": qpos, "merge_counters": jax.new_ref(jnp.zeros((4,), jnp.uint32))}
    return A.cache_attention(q, qpos, qcache, jnp.int32(0), "target", "pallas", None, mesh=make_mesh(2), inputs=inputs)


attend_with_ref(q, qpos, qcache)
pallas_kernels.cache_attention = real_attention
assert seen and all(s == {"pos": False} for s in seen), seen
print("tp=2: a pass's kernel-input refs stay outside shard_map", flush=True)

try:
    shard(single, make_mesh(3))
except ShardingError as e:
    assert "num_attention_heads=8 is not divisible by the tensor-parallel size 3" in str(e), e
else:
    sys.exit("expected a ShardingError for tp=3")
print("TP-CHECKS-OK")
