"""Pallas GPU kernels for qspec-jax.

`cache_attention(q, q_pos, cache, layer, *, view, sliding_window=None, interpret=None, impl="auto")`
is the entry `qspec_jax.attention.cache_attention` dispatches to (with `attention_inputs(q, q_pos,
cache, view=...)`, the per-pass inputs a model computes once outside its layer loop): the Mosaic GPU kernels
on Hopper, the Triton kernels elsewhere. `interpret=None` runs Pallas' interpreter unless
`jax.default_backend() == "gpu"`.

One folder per op (as tokamax lays out `_src/ops/<op>/`): an `api` module (the entry and the dispatch by
device), one module per backend, and the reference named in the folder's docstring:

* `decode_attention/`: `api`, `mosaic_gpu` (+ `mosaic_gpu_ws`, its warp-specialized schedule), `triton`;
* `linear/`: `api` (`int4_linear`, `dense_linear`; its "reference" backend), `layout`, `mosaic_gpu`, `triton`.
"""

from pallas_kernels import decode_attention, linear
from pallas_kernels.decode_attention import *  # noqa: F403  (the attention op's API at the top level)

__all__ = [*decode_attention.__all__, "decode_attention", "linear"]
