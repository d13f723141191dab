"""The target layer's residual add + RMSNorm in one kernel (one op, one folder).

* `api`: the entry (`add_rms_norm`), the dispatch by device and the jnp oracle (`add_rms_norm_reference`).
* `mosaic_gpu`: the Hopper (sm_90) kernel, one warpgroup per row.
"""

from pallas_kernels.rms_norm.api import BACKENDS, add_rms_norm, add_rms_norm_reference, pick_backend

__all__ = ["BACKENDS", "add_rms_norm", "add_rms_norm_reference", "pick_backend"]
