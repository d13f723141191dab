"""One process of a 2-process tensor-parallel run on localhost (see tests/test_tensor_parallel.py).

argv: process_id coordinator_port. Prints "TOKENS <json>" with the gathered sharded results and
"REF <json>" with this process's own single-device results.
"""

import json
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{sys.argv[2]}", num_processes=2,
                           process_id=int(sys.argv[1]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from qspec_jax import model as M  # noqa: E402
from qspec_jax.checkpoint import Model  # noqa: E402
from qspec_jax.config import ModelConfig  # noqa: E402
from qspec_jax.generation import GenerationConfig, generate_autoregressive  # noqa: E402
from qspec_jax.sharding import make_mesh, shard  # noqa: E402
from qspec_jax.speculative import SpecConfig, generate  # noqa: E402
from qspec_jax.weight_quant import DraftWeightsConfig  # noqa: E402

CLIP32 = DraftWeightsConfig(group_size=32, method="clip")  # random weights: the draft format, data-free

assert jax.process_count() == 2 and jax.device_count() == 2, (jax.process_count(), jax.device_count())
CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4,
                  head_dim=16, dtype="float32", max_position_embeddings=512, eos_token_ids=(), attention_impl="reference")
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
SPEC = SpecConfig(gamma=3, max_new_tokens=10, group_size=16, draft_group=32, draft_method="clip")
AR = GenerationConfig(max_new_tokens=10)

# Host (numpy) weights, identical in both processes: device_put lays them out on the global mesh.
params = jax.tree.map(np.asarray, M.init_random_params(CFG, jax.random.PRNGKey(1), scale=0.3))
local = Model(config=CFG, params=jax.tree.map(jnp.asarray, params)).with_draft_weights(CLIP32)
ref = {"ar": generate_autoregressive(local, PROMPTS, AR).to_lists(), "spec": generate(local, PROMPTS, SPEC).to_lists()}

model = Model(config=CFG, params=params).with_draft_weights(CLIP32)
sharded = shard(model, make_mesh(2, devices=jax.devices()))
out = {}
for name, res in (("ar", generate_autoregressive(sharded, PROMPTS, AR)), ("spec", generate(sharded, PROMPTS, SPEC))):
    toks = np.asarray(multihost_utils.process_allgather(res.tokens, tiled=True))
    lens = np.asarray(multihost_utils.process_allgather(res.lengths, tiled=True))
    out[name] = [toks[b, : lens[b]].tolist() for b in range(len(PROMPTS))]
print("TOKENS " + json.dumps(out), flush=True)
print("REF " + json.dumps(ref), flush=True)
jax.distributed.shutdown()
