"""One entry per weight kind for decode-sized linears, dispatching by device.

    int4_linear(x, w, backend="auto")   x [..., K] @ W (INT4) -> [..., N]
    int4_qkv_cache(x, w, backend=...)   the draft's q|k|v written into the attention's inputs
    bf16_qkv_cache(x, w, backend=...)   the same for a target's bf16 q|k|v (x already normed)
    int4_layer_tail(attn, x, wo, g, wgu, wd, backend=...)   the draft layer's o -> norm -> gate_up ->
                                        SiLU·up -> down with both residuals, one persistent kernel
    dense_linear(x, w, backend="auto")  x [..., K] @ W (bf16 [K, N]) -> [..., N] (swiglu=True: the gate | up
                                        halves' silu(gate) * up, in the kernel's epilogue)

Backends ("auto" picks by the default device):

| backend    | int4_linear                                   | dense_linear                      |
|------------|-----------------------------------------------|-----------------------------------|
| "mosaic"   | Hopper (sm_90): `mosaic_gpu.int4_matmul_mgpu` | `mosaic_gpu.bf16_matmul_mgpu`     |
| "triton"   | older GPUs: `triton.w4a16_matmul` (Triton)     | (n/a: "xla")                      |
| "xla"      | CPU: dequantize -> dot (float32 weight)       | XLA dot (cuBLAS on GPU)           |
| "interpret"| the Mosaic SMEM twin in GPU interpret mode    | the Mosaic kernel, interpreted    |
| "reference"| the jnp oracle: x (f32) @ W (f32), HIGHEST    | x (f32) @ W (f32), HIGHEST        |

"auto": "mosaic" on a GPU of compute capability 9.x with bf16 activations, M within the
kernels' range and (int4) a weight already in the Hopper layout; "triton" (int4 fields) / "xla"
(bf16, or the layout) on other GPUs; "xla" on the CPU. Shapes a kernel does not take (prefill-sized M, odd N)
fall back to "xla".

Weights: `int4_linear` takes the Hopper layout (`layout.W4A16Packed`) or the
QuantizedWeight fields (any object with .packed / .scale / .zero). The Mosaic backends read the
layout (fields are packed per call by `pack_fields`, which re-reads and re-writes the whole
weight: pack once at load time, not per call); the Triton kernel reads the fields only (the
layout keeps the kernel's bf16 pair, not the float16 scale / zero); "xla" and "reference" take
either, each with its own weight: U * scale + zero from the fields, the Mosaic kernel's own
bf16 weight (`layout.dequantize_f32`) from the layout. Stacked weights ([L, ...]) take `layer=`
(int or traced scalar) and are read in place by the kernels.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.linear import layout as lay
from pallas_kernels.linear import mosaic_gpu as mg
from pallas_kernels.linear import tail_mgpu as tm

Array = jax.Array
BACKENDS = ("auto", "mosaic", "triton", "xla", "interpret", "reference")


def device_arch() -> tuple[str, int | None]:
    """(platform, compute-capability major) of the default device; major None off CUDA."""
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    try:
        major = int(str(cc).split(".")[0]) if cc is not None else None
    except ValueError:
        major = None
    return dev.platform, major


def pick_backend(kind: str, m: int, k: int, n: int, x_dtype: Any, *, hopper_layout: bool = True) -> str:
    """The backend "auto" resolves to for an [M, K] @ [K, N] call of weight `kind` ("int4"/"bf16").

    `hopper_layout` False (an INT4 weight given as QuantizedWeight fields): never "mosaic",
    whose layout would have to be rebuilt on every call; True: never "triton", which reads the
    fields only."""
    platform, major = device_arch()
    if platform != "gpu":
        return "xla"
    if major == 9 and hopper_layout and jnp.dtype(x_dtype) == jnp.bfloat16 and supports("mosaic", m, k, n):
        return "mosaic"
    if kind == "int4" and not hopper_layout and supports("triton", m, k, n):
        return "triton"
    return "xla"


def supports(backend: str, m: int, k: int, n: int) -> bool:
    """Whether an explicit kernel backend takes an [M, K] @ [K, N] call (the model sends the
    shapes it does not take, e.g. prefill-sized M or SmolLM2's 192-wide k/v, to "xla")."""
    if backend in ("mosaic", "interpret"):
        return m <= mg.MAX_M and n % lay.ROWS == 0 and k % lay.KB == 0
    if backend == "triton":
        return m <= 128 and n % 128 == 0
    return True


# Rows up to which `dense_linear`'s kernel backends run a call, above `mosaic_gpu.MAX_M` as row blocks of one
# launch (a verify's B x T rows: SmolLM2 batch 32 at T 3 is 96, two blocks of 48; `mosaic_gpu.dense_blocks`). The
# kernel's rows do not depend on the rows sharing the call, so the blocks give the bits one call of MAX_M would.
# Above it: prefill, where a GEMM belongs.
DENSE_BLOCKED_MAX_ROWS = mg.DENSE_MAX_M


def dense_supports(backend: str, m: int, k: int, n: int) -> bool:
    """Whether `dense_linear` runs an [M, K] @ [K, N] bf16 call on the explicit kernel `backend`
    ("mosaic" / "interpret"), up to DENSE_BLOCKED_MAX_ROWS rows in row blocks of one launch; other backends
    as `supports`."""
    if backend in ("mosaic", "interpret"):
        return m <= DENSE_BLOCKED_MAX_ROWS and supports(backend, min(m, mg.MAX_M), k, n)
    return supports(backend, m, k, n)


def _dequantize_f32(w: Any) -> Array:
    """W [..., K, N] float32 as the weight's own format defines it: U * scale + zero from the
    fields, the Mosaic kernel's weight (before its bf16 rounding) from the layout."""
    if isinstance(w, lay.W4A16Packed):
        return lay.dequantize_f32(w)
    return lay.dequantize_fields(w.packed, w.scale, w.zero)


def _as_packed(w: Any) -> lay.W4A16Packed:
    return w if isinstance(w, lay.W4A16Packed) else lay.pack_fields(w.packed, w.scale, w.zero)


def _int4_shape(w: Any) -> tuple[int, int, tuple[int, ...]]:
    if isinstance(w, lay.W4A16Packed):
        return w.k, w.n, w.lead
    return 2 * w.packed.shape[-2], w.packed.shape[-1], tuple(w.packed.shape[:-2])


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")


def _flatten(x: Array, k: int) -> tuple[Array, tuple[int, ...]]:
    if x.shape[-1] != k:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match the weight's K={k}")
    lead = x.shape[:-1]
    return x.reshape(math.prod(lead), k), lead


def int4_linear(x: Array, w: Any, *, backend: str = "auto", layer: Any = None,
                out_dtype: Any = None, norm_weight: Array | None = None, norm_eps: float = 1e-5,
                unit_norm: bool = False, swiglu: bool = False, residual: Array | None = None,
                norm_sums: Array | None = None, row_sums: bool = False) -> Array | tuple[Array, Array]:
    """x [..., K] @ W [K, N] with W in INT4 -> [..., N] (float32 accumulation; `out_dtype`
    defaults to x's dtype). See the module docstring for `backend` and the weight formats.

    Fused glue (`mosaic_gpu.Epilogue`): `norm_weight` [K] (or [L, K] read at `layer`) applies
    RMSNorm to x first (`unit_norm`: RMSNorm without a weight, i.e. a weight of ones, which the
    Mosaic kernel neither loads nor multiplies; for norm weights folded into W), `swiglu` returns
    silu(gate) * up [..., N/2] of W's gate | up halves,
    `residual` [..., N] is added to the output; `norm_sums` float32 [P, M_pad] gives the norm the
    rows' sums of x^2 (`mosaic_gpu.Epilogue.sums`; the Mosaic kernel then sums none: where
    `mosaic_gpu.takes_norm_sums`), and `row_sums` (with `residual`) returns (out, the rows' sums of
    out^2 per 64-column tile, float32 [N / 64, M_pad]: the next norm's `norm_sums`,
    `mosaic_gpu.chunk_row_sums`), M the rows of x flattened. The Mosaic backends run them inside the kernel
    ("auto" picks them only where the kernel takes the call: bf16, Hopper, at most
    `mosaic_gpu.auto_fused_rows(epilogue)` rows; "mosaic" up to `MAX_FUSED_M`); every other backend computes
    `mosaic_gpu.epilogue_reference`."""
    _check_backend(backend)
    k, n, wlead = _int4_shape(w)
    g_stacked = norm_weight is not None and norm_weight.ndim == 2
    if (layer is None) != (len(wlead) == 0 and not g_stacked):
        raise ValueError(f"weight leading dims {wlead}: pass layer= exactly for stacked [L, ...] weights")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    x2, lead = _flatten(x, k)
    m = x2.shape[0]
    if unit_norm and norm_weight is not None:
        raise ValueError("unit_norm=True is RMSNorm without a weight: pass norm_weight=None")
    epi = mg.Epilogue(norm=norm_weight is not None or unit_norm, eps=float(norm_eps), gain=not unit_norm,
                      sums=norm_sums is not None, swiglu=swiglu, residual=residual is not None, row_sums=row_sums)
    mg.check_sums_flags(epi)  # every backend's rules, before the dispatch
    mg.check_norm_sums(norm_sums, m)
    res2 = residual.reshape(m, n) if epi.residual else None
    n_out = n // 2 if swiglu else n

    def shaped(y):  # [M, N'] (and the row sums) -> x's leading dims
        return (y[0].reshape(*lead, n_out), y[1]) if row_sums else y.reshape(*lead, n_out)
    if backend == "auto":
        backend = pick_backend("int4", m, k, n, x.dtype, hopper_layout=isinstance(w, lay.W4A16Packed))
        if epi and backend == "mosaic" and m > mg.auto_fused_rows(epi):
            backend = "xla"
    if epi and backend not in ("mosaic", "interpret"):
        if layer is not None:
            w = jax.tree.map(lambda a: a[layer], w) if wlead else w
            norm_weight = norm_weight[layer] if g_stacked else norm_weight
        wf = _dequantize_f32(w)
        return shaped(mg.epilogue_reference(x2, wf if backend == "reference" else wf.astype(x2.dtype), epi,
                                            norm_weight=norm_weight, residual=res2, out_dtype=out_dtype,
                                            norm_sums=norm_sums))
    if backend in ("mosaic", "interpret"):
        return shaped(mg.int4_matmul_mgpu(x2, _as_packed(w), layer=layer, out_dtype=out_dtype,
                                          variant="mma" if backend == "mosaic" else "smem",
                                          interpret=backend == "interpret", norm_weight=norm_weight,
                                          norm_eps=norm_eps, unit_norm=unit_norm, norm_sums=norm_sums,
                                          swiglu=swiglu, residual=res2, row_sums=row_sums))
    if backend == "triton":
        if isinstance(w, lay.W4A16Packed):
            raise ValueError("backend='triton' reads the QuantizedWeight fields (.packed, .scale, .zero); got a "
                             "W4A16Packed weight, whose records hold the Mosaic kernel's bf16 pair and not the "
                             "float16 scale / zero: pass the fields, or use backend 'mosaic' / 'xla'")
        from pallas_kernels.linear.triton import w4a16_matmul  # Triton: imported only where used

        y = w4a16_matmul(x2, w.packed, w.scale, w.zero, out_dtype=out_dtype, layer=layer)
    else:
        if layer is not None:  # one layer first: never unpack or dequantize the whole stack
            w = jax.tree.map(lambda a: a[layer], w)
        wf = _dequantize_f32(w)
        if backend == "reference":
            y = jnp.dot(x2.astype(jnp.float32), wf, precision=lax.Precision.HIGHEST).astype(out_dtype)
        else:  # "xla": the weight in the activation dtype, as the model's XLA path does
            y = jnp.dot(x2, wf.astype(x2.dtype), preferred_element_type=jnp.float32).astype(out_dtype)
    return y.reshape(*lead, n_out)


QKV_CACHE_BACKENDS = ("mosaic", "interpret", "reference")


def int4_qkv_cache(x: Array, w: Any, *, backend: str, layer: Any, rope: Array, slots: Array, q_buf: Array,
                   k_ring: Array, v_ring: Array, norm_weight: Array | None = None,
                   norm_eps: float = 1e-5, unit_norm: bool = False,
                   norm_sums: Array | None = None) -> tuple[Array, Array, Array]:
    """The draft's q|k|v projection written where the decode attention reads it: one kernel for
    RMSNorm, the INT4 product, RoPE, the query operand and the FP ring writes
    (`mosaic_gpu.int4_qkv_cache_mgpu` has the shapes). `backend`: "mosaic" (Hopper), "interpret"
    (its SMEM twin in GPU interpret mode) or "reference" (`mosaic_gpu.qkv_cache_reference`, the
    oracle: float32 product). x: [B, K] or [B, 1, K]. `unit_norm`: the norm without a weight (as
    `int4_linear`); `norm_sums` float32 [P, M_pad]: the rows' sums of x^2 in P parts, given
    (`mosaic_gpu.Epilogue.sums`). Returns (q_buf, k_ring, v_ring)."""
    if backend not in QKV_CACHE_BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {QKV_CACHE_BACKENDS}")
    k, _, wlead = _int4_shape(w)
    x2, _ = _flatten(x, k)
    if unit_norm and norm_weight is not None:
        raise ValueError("unit_norm=True is RMSNorm without a weight: pass norm_weight=None")
    kw = dict(layer=layer, rope=rope, slots=slots, q_buf=q_buf, k_ring=k_ring, v_ring=v_ring, norm_eps=norm_eps,
              unit_norm=unit_norm, norm_sums=norm_sums)
    if backend == "reference":
        w1 = jax.tree.map(lambda a: a[layer], w) if wlead else w
        g1 = norm_weight[layer] if norm_weight is not None and norm_weight.ndim == 2 else norm_weight
        return mg.qkv_cache_reference(x2, _dequantize_f32(w1), norm_weight=g1, **kw)
    return mg.int4_qkv_cache_mgpu(x2, _as_packed(w), norm_weight=norm_weight, interpret=backend == "interpret", **kw)


def int4_layer_tail(attn: Array, x: Array, wo: Any, norm_weight: Array, w_gate_up: Any, w_down: Any, *,
                    backend: str, layer: Any = None, norm_eps: float = 1e-5, row_sums: bool = False,
                    sync: Any = None, ordinal: Any = 0, chunk_ready: bool = False,
                    cluster: int = 0, chunks: tuple[int, int, int] | None = None) -> Array | tuple[Array, Array]:
    """The draft layer's tail after the attention, x1 = bf16(attn Wo) + x, out = bf16(act Wd) + x1,
    act = silu(gate) up of RMSNorm(x1) Wgu, in one persistent kernel (`tail_mgpu.int4_layer_tail_mgpu`
    has the shapes, `sync` and `ordinal`). attn [..., Kq], x [..., D] bf16 (M rows in all, flattened).
    `backend`: "mosaic" (Hopper), "interpret" (its twin in GPU interpret mode) or "reference"
    (`tail_mgpu.layer_tail_reference` over the kernel's own bf16 weights; `sync` unused). `row_sums`:
    also out's rows' sums of squares, float32 [D / 64, M_pad] (the next norm's `norm_sums`). `chunk_ready`:
    the producer waits per K chunk on ready counters instead of at the grid-wide flags (`TailConfig.chunk_ready`;
    the same bits). `cluster` > 0: the kernel as one thread-block cluster of that many CTAs, its phase ends the
    cluster barrier (`TailConfig.cluster`). `chunks`: the (o, gate_up, down) K chunk counts (`TailConfig.chunks`,
    each dividing its linear's k steps; they set the float32 summation order), None: balanced over the CTAs."""
    if backend not in QKV_CACHE_BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {QKV_CACHE_BACKENDS}")
    attn2, _ = _flatten(attn, _int4_shape(wo)[0])
    x2, lead = _flatten(x, _int4_shape(wo)[1])
    ws = [_as_packed(w) for w in (wo, w_gate_up, w_down)]
    if backend == "reference":
        pick = (lambda a: a[layer]) if ws[0].lead else (lambda a: a)
        wf = [lay.dequantize_bf16(jax.tree.map(pick, w)).astype(jnp.float32) for w in ws]
        g = norm_weight[layer] if norm_weight.ndim == 2 else norm_weight
        out = tm.layer_tail_reference(attn2, x2, wf[0], g, wf[1], wf[2], norm_eps=norm_eps).astype(x.dtype)
        res = (out, mg.chunk_row_sums(out, mg.rows_for(out.shape[0])) if row_sums else None)
    else:
        cfg = tm.default_tail_config(ws[0].k, ws[0].n, ws[2].k, ws[0].group_size, x2.shape[0],
                                     num_sms=cluster or None).replace(chunk_ready=chunk_ready, cluster=cluster > 0)
        if chunks is not None:
            cfg = cfg.replace(chunks=tuple(int(c) for c in chunks))
        res = tm.int4_layer_tail_mgpu(attn2, x2, ws[0], norm_weight, ws[1], ws[2], layer=layer, norm_eps=norm_eps,
                                      row_sums=row_sums, sync=sync, ordinal=ordinal, config=cfg,
                                      interpret=backend == "interpret")
        res = res if row_sums else (res, None)
    out = res[0].reshape(*lead, -1)
    return (out, res[1]) if row_sums else out


def bf16_qkv_cache(x: Array, w: Array, *, backend: str, layer: Any, rope: Array, slots: Array, q_buf: Array,
                   k_ring: Array, v_ring: Array) -> tuple[Array, Array, Array]:
    """A target's q|k|v projection written where the decode attention reads it: one kernel for
    the bf16 product, RoPE, the query operand and the ring writes (`mosaic_gpu.bf16_qkv_cache_mgpu`
    has the shapes; x [M, K] or [B, T, K], already normed, M = B T rows). `backend` as
    `int4_qkv_cache` ("reference": `mosaic_gpu.qkv_cache_reference`, float32 product). w: bf16
    [K, N] or a stack [L, K, N] read at `layer`. Returns (q_buf, k_ring, v_ring)."""
    if backend not in QKV_CACHE_BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {QKV_CACHE_BACKENDS}")
    x2, _ = _flatten(x, w.shape[-2])
    kw = dict(layer=layer, rope=rope, slots=slots, q_buf=q_buf, k_ring=k_ring, v_ring=v_ring)
    if backend == "reference":
        w1 = w[layer] if w.ndim == 3 else w
        return mg.qkv_cache_reference(x2, w1.astype(jnp.float32), **kw)
    return mg.bf16_qkv_cache_mgpu(x2, w, interpret=backend == "interpret", **kw)


def dense_linear(x: Array, w: Array, *, backend: str = "auto", layer: Any = None,
                 out_dtype: Any = None, swiglu: bool = False) -> Array:
    """x [..., K] @ W [K, N] (or a stack [L, K, N] with `layer`) -> [..., N]. On Hopper the
    Mosaic kernel's rows do not depend on how many rows share the call (bitwise), so the kernel
    backends run more than `mosaic_gpu.MAX_M` rows as row blocks of one launch, up to
    DENSE_BLOCKED_MAX_ROWS (`dense_supports`). `swiglu`: W
    holds gate | up column halves and the call returns silu(gate) * up [..., N / 2] (the kernel
    forms it from its float32 products, "auto" up to `mosaic_gpu.MAX_FUSED_M` rows; XLA from the bf16
    products, as the unfused model does)."""
    _check_backend(backend)
    if backend == "triton":
        raise ValueError("backend='triton' has no dense kernel; use 'xla' or 'mosaic'")
    if w.ndim not in (2, 3) or (layer is None) != (w.ndim == 2):
        raise ValueError(f"w must be [K, N], or [L, K, N] with layer=; got {w.shape} and layer={layer!r}")
    k, n = w.shape[-2:]
    if swiglu and n % 2:
        raise ValueError(f"swiglu: W [K, N={n}] must hold gate | up halves (N even)")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    x2, lead = _flatten(x, k)
    m = x2.shape[0]
    if backend == "auto":
        backend = pick_backend("bf16", m, k, n, x.dtype)
        if backend == "mosaic" and (w.dtype != jnp.bfloat16 or (swiglu and m > mg.MAX_FUSED_M)):
            backend = "xla"
    if backend in ("mosaic", "interpret"):
        if m > DENSE_BLOCKED_MAX_ROWS:
            raise ValueError(f"x has {m} rows; the {backend} kernel takes at most {DENSE_BLOCKED_MAX_ROWS} "
                             f"(in row blocks of at most {mg.MAX_M}); use backend='xla' for prefill-sized calls")
        # above MAX_M rows, row blocks of one launch (`mosaic_gpu.dense_blocks`; rows do not depend on the block)
        y = mg.bf16_matmul_mgpu(x2, w, layer=layer, out_dtype=out_dtype, interpret=backend == "interpret",
                                swiglu=swiglu)
    else:
        wl = w if layer is None else w[layer]
        if backend == "reference":
            y = mg.epilogue_reference(x2, wl.astype(jnp.float32), mg.Epilogue(swiglu=swiglu), out_dtype=out_dtype)
        else:
            y = jnp.dot(x2, wl.astype(x2.dtype))
            if swiglu:
                gate, up = jnp.split(y, 2, axis=-1)
                y = jax.nn.silu(gate) * up
            y = y.astype(out_dtype)
    return y.reshape(*lead, y.shape[-1])


__all__ = ["BACKENDS", "DENSE_BLOCKED_MAX_ROWS", "dense_linear", "dense_supports", "device_arch", "int4_linear",
           "pick_backend", "supports"]
