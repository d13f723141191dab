"""Decode-sized linears with INT4 (W4A16) and bf16 weights (one op, one folder).

* `api`: the entry (`int4_linear`, `dense_linear`) and the dispatch by device (`pick_backend`); its
  "reference" backend is the jnp oracle of every kernel test, "xla" the CPU path.
* `layout`: the pre-packed Hopper INT4 layout (`pack_fields`; codes kept bit for bit, each group's scale / zero
  stored as the kernel's bf16 pair) and its dequantization (`dequantize_bf16`: the kernels' own weight).
* `mosaic_gpu`: the Hopper (sm_90) skinny GEMMs, INT4 and bf16, with the fused draft-layer epilogues
  (and `epilogue_reference`, their jnp oracle).
* `tail_mgpu`: the draft layer's o -> RMSNorm -> gate_up -> SiLU·up -> down tail in one persistent Hopper kernel
  (`int4_layer_tail_mgpu`, `layer_tail_reference`; the model runs it behind QSPEC_W4A16_TAIL=1,
  `qspec_jax.linear.tail_fusable`: docs/kernel_notes.md, "Twentieth session" on).
* `triton`: the Triton W4A16 kernel for GPUs before Hopper.
"""

from pallas_kernels.linear.api import (
    BACKENDS,
    DENSE_BLOCKED_MAX_ROWS,
    bf16_qkv_cache,
    dense_linear,
    dense_supports,
    device_arch,
    int4_layer_tail,
    int4_linear,
    int4_qkv_cache,
    pick_backend,
    supports,
)

__all__ = ["BACKENDS", "DENSE_BLOCKED_MAX_ROWS", "bf16_qkv_cache", "dense_linear", "dense_supports", "device_arch",
           "int4_layer_tail", "int4_linear", "int4_qkv_cache", "pick_backend", "supports"]
