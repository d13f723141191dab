"""Pallas GPU kernels for qspec-jax.

`cache_attention(q, q_pos, cache, layer, *, view, sliding_window=None, interpret=None, impl="auto")`
is the entry `qspec_jax.attention.cache_attention` dispatches to (with `attention_inputs(q, q_pos,
cache, view=...)`, the per-pass inputs a model computes once outside its layer loop): the Mosaic GPU kernels
(`decode_attention.mosaic_gpu`) on Hopper, the Triton kernels (`decode_attention`) elsewhere.
`interpret=None` runs Pallas' interpreter unless `jax.default_backend() == "gpu"`.
"""

from pallas_kernels import decode_attention, linear
from pallas_kernels.decode_attention import *  # noqa: F403  (the attention op's API at the top level)

__all__ = [*decode_attention.__all__, "decode_attention", "linear"]
