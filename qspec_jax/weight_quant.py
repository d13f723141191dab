"""INT4 draft weights: asymmetric 4-bit codes in groups of G_w along the input dimension.

For a linear weight W [Din, Dout] and each group n of G_w consecutive input rows:

    W[n*G_w + j, o] ~= U[n, j, o] * scale[n, o] + zero[n, o],   U in 0..15

Methods (`DRAFT_METHODS`); all produce this one format, so the kernels and their speed do not
depend on the method:

- "minmax": round-to-nearest on the group's (min, max).
- "clip": round-to-nearest on a shrunk range (a*min, a*max); per group and output column the
  factor with the lowest squared error wins, a = 1 among them, so never worse than min/max.
- "hqq": HQQ (Badri & Shaji 2023), data-free: from the clipping search's (scale, zero), the
  zero is optimized by half-quadratic splitting of the sparsity-promoting l_p (p = 0.7) error
  ||W - dequant(quant(W))||_p^p; per group and output column the iterate with the lowest mean
  |error| is kept, the start among them, so never worse than "clip" in that error.
- "gptq": GPTQ (Frantar et al. 2023), second order, needs calibration Hessians H = X^T X / n of
  each linear's inputs (`qspec_jax.calibration`): rows (input channels) are quantized one at a
  time and each one's error is compensated on the rows not yet quantized, minimizing
  ||X W - X Q||^2. Groups stay contiguous: group parameters are set (clipping search weighted by
  diag H) when a group's first row is reached, and with act-order the groups are visited in
  decreasing diag-H mass and the rows within a group in decreasing diag H.

Folded norms (`DraftWeightsConfig.fold_norms`): an RMSNorm weight g whose every reader is an
INT4 draft linear is folded into those weights before quantization, W' = diag(g) W (then
quantized as above, by any method; GPTQ's Hessian becomes H' = diag(1/g) H diag(1/g), the
Hessian of the unweighted norm's output), and the draft's copy of g becomes ones
(`with_unit_norms`): RMSNorm(x) W = (x r) diag(g) W. The fused Hopper kernels then skip g
(`pallas_kernels.linear.mosaic_gpu.Epilogue.gain`); the target's weights and norms are untouched.

Packing: byte [n, j, o] holds row j of group n in its low nibble and row j + G_w/2 in its high
nibble (split halves within each group), stored as uint8 [Din/2, Dout].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from qspec_jax.quant import NIBBLE_MAX

Array = jax.Array
DRAFT_SCOPES = {
    "all": ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"),
    "ffn": ("w_gate", "w_up", "w_down"),
}
CLIP_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
WEIGHT_GROUPS = (32, 64, 128)
# The draft-weight methods (module docstring); all but CALIBRATED_METHODS are data-free.
DRAFT_METHODS = ("clip", "minmax", "hqq", "gptq")
CALIBRATED_METHODS = ("gptq",)  # need calibration Hessians: make_draft_params(..., hessians=...)
# HQQ's published defaults (l_p norm, penalty beta and its growth kappa per iteration, iterations).
HQQ_LP_NORM, HQQ_BETA, HQQ_KAPPA, HQQ_ITERS = 0.7, 10.0, 1.01, 20
GPTQ_DAMP = 0.01  # Tikhonov damping of H, relative to its mean diagonal (GPTQ's default)
GPTQ_DAMP_RETRIES = 6  # x10 damping per retry while the Cholesky factorization fails
GPTQ_ACT_ORDER = True
# Each RMSNorm weight and the linears that read its output: a norm is folded (`folded_norms`) when all of them
# are INT4 draft weights.
NORM_READERS = {"attn_norm": ("wq", "wk", "wv"), "mlp_norm": ("w_gate", "w_up"), "final_norm": ("lm_head",)}
# Layers quantized together (one vmapped GPTQ per weight kind) while their Hessians fit this many
# bytes: GPTQ's row loop is sequential (one step per input row), so on a CPU and a GPU alike its
# time is the loop's overhead, which a batch of layers shares (SmolLM2: all 30 layers, 0.4 GB;
# an 8B Llama's 1.1 GB per layer: one at a time).
GPTQ_BATCH_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class DraftWeightsConfig:
    """How the draft's INT4 weights are made; `method` is one of DRAFT_METHODS (module docstring).

    The default, "gptq", needs calibration Hessians: `qspec-convert` collects them by default
    (on the library's built-in text, or --calibration-text FILE), and
    `qspec_jax.calibration.make_draft` anywhere else (`speculative.draft_params_for` and
    `Model.with_draft_weights` use it when a checkpoint stores no draft of this format).
    """

    # g32 by measurement (docs/QUALITY.md): draft/target agreement 0.85 vs 0.77 at g64 on SmolLM2
    # real text, for 5 instead of 4.5 bits per weight.
    group_size: int = 32
    scope: str = "all"
    lm_head: bool = True
    # gptq by measurement (docs/QUALITY.md, "Calibration text of the default draft"): gamma-4
    # acceptance 0.78 (built-in text, 8192 tokens) against clip's 0.59 on SmolLM2 and unseen
    # text, for the same kernels and bytes.
    method: str = "gptq"
    scale_dtype: str = "float16"
    # The norm weights folded into the INT4 linears that read them (module docstring, `folded_norms`). Off by
    # measurement (docs/QUALITY.md, "Folded norms"): on SmolLM2 the kernels gain ~25 us of a 1.81 ms draft step
    # (H200, batch 32) but the norm weights vary up to 100x inside a weight group, and the acceptance falls (GPU,
    # 8,000-token prompts, batch 32: 0.949 -> 0.936 at gamma 2; CPU teacher-forced agreement 0.918 -> 0.889).
    fold_norms: bool = False

    def __post_init__(self) -> None:
        if self.group_size not in WEIGHT_GROUPS:
            raise ValueError(f"draft group_size={self.group_size}; expected one of {WEIGHT_GROUPS}")
        if self.scope not in DRAFT_SCOPES:
            raise ValueError(f"draft scope={self.scope!r}; expected one of {tuple(DRAFT_SCOPES)}")
        if self.method not in DRAFT_METHODS:
            raise ValueError(f"draft method={self.method!r}; expected one of {DRAFT_METHODS}")
        if self.scale_dtype not in ("float16", "float32"):
            raise ValueError(f"draft scale_dtype={self.scale_dtype!r}; expected 'float16' or 'float32'")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def folded_norms(cfg: DraftWeightsConfig) -> tuple[str, ...]:
    """The norm weights (`NORM_READERS` names) that a draft of `cfg` folds into its INT4 weights:
    with `fold_norms`, each norm whose readers `cfg` all quantizes (scope "all" and the lm_head:
    all three; scope "ffn": the MLP norm only)."""
    if not cfg.fold_norms:
        return ()
    quantized = set(DRAFT_SCOPES[cfg.scope]) | ({"lm_head"} if cfg.lm_head else set())
    return tuple(n for n, readers in NORM_READERS.items() if set(readers) <= quantized)


def with_unit_norms(params: Any, names: tuple[str, ...]) -> Any:
    """`params` (a `model.Params`) with the norm weights `names` replaced by ones and recorded as
    such (`Params.unit_norms`): the draft's side of folding them into its INT4 weights."""
    layers = params.layers.replace(**{n: jnp.ones_like(getattr(params.layers, n)) for n in names if n != "final_norm"})
    final = jnp.ones_like(params.final_norm) if "final_norm" in names else params.final_norm
    return params.replace(layers=layers, final_norm=final, unit_norms=tuple(names))


def _fold(w: Array, g: Array | None) -> Array:
    """diag(g) W in float32 for w [..., Din, Dout] and g [..., Din]; None: w itself, as it is (the
    quantizers widen it to float32 themselves)."""
    return w if g is None else g.astype(jnp.float32)[..., :, None] * w.astype(jnp.float32)


def _unfold_hessian(h: Array, g: Array | None) -> Array:
    """diag(1/g) H diag(1/g): the Hessian of the inputs x / g of a folded weight diag(g) W, for H
    [..., Din, Din] of x and g [..., Din]; a channel with g = 0 gets no input (its folded row is 0)."""
    if g is None:
        return h
    gf = g.astype(jnp.float32)
    inv = jnp.where(gf != 0, 1.0 / jnp.where(gf != 0, gf, 1.0), 0.0)
    return h.astype(jnp.float32) * inv[..., :, None] * inv[..., None, :]


@struct.dataclass
class QuantizedWeight:
    """INT4 weight with leading dims `...` (e.g. the stacked layer axis L)."""

    packed: Array  # uint8[..., Din/2, Dout]
    scale: Array  # f16|f32[..., Din/G_w, Dout]
    zero: Array  # f16|f32[..., Din/G_w, Dout]

    @property
    def group_size(self) -> int:
        return 2 * self.packed.shape[-2] // self.scale.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-2], 2 * self.packed.shape[-2], self.packed.shape[-1])

    def codes(self) -> Array:
        """int32 codes [..., Din/G_w, G_w, Dout]."""
        *lead, half, dout = self.packed.shape
        n = self.scale.shape[-2]
        p = self.packed.reshape(*lead, n, half // n, dout).astype(jnp.int32)  # widen before shifting
        return jnp.concatenate([p & 0xF, p >> 4], axis=-2)

    def dequantize(self) -> Array:
        """float32 [..., Din, Dout]."""
        w = self.codes() * self.scale[..., None, :].astype(jnp.float32) + self.zero[..., None, :].astype(jnp.float32)
        return w.reshape(self.shape)


def _codes(w: Array, scale: Array, zero: Array) -> Array:
    """Round-to-nearest codes (float32, 0..15) of w on the grid of the stored (scale, zero)."""
    s, z = scale.astype(jnp.float32), zero.astype(jnp.float32)
    inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)  # s = 0: constant group, codes 0
    return jnp.clip(jnp.round((w - z) * inv), 0, NIBBLE_MAX)


def _dequant(u: Array, scale: Array, zero: Array) -> Array:
    return u * scale.astype(jnp.float32) + zero.astype(jnp.float32)


def _quantize_range(w: Array, lo: Array, hi: Array, scale_dtype: Any) -> tuple[Array, Array, Array]:
    """Codes for w [..., n, G, Dout] within [lo, hi] ([..., n, 1, Dout]); returns (U, scale, zero)."""
    zero = lo.astype(scale_dtype)
    scale = ((hi - zero.astype(jnp.float32)) / NIBBLE_MAX).astype(scale_dtype)
    return _codes(w, scale, zero), scale, zero


def _clip_search(wf: Array, factors: tuple[float, ...], scale_dtype: Any,
                 importance: Array | None = None) -> tuple[Array, Array, Array]:
    """Per group and output column, the range factor with the lowest (importance-weighted)
    squared error. wf [..., n, G, Dout]; importance broadcastable to it (GPTQ: diag H per row)."""
    wmin, wmax = jnp.min(wf, axis=-2, keepdims=True), jnp.max(wf, axis=-2, keepdims=True)
    best = None
    for a in factors:
        u, scale, zero = _quantize_range(wf, a * wmin, a * wmax, scale_dtype)
        sq = (_dequant(u, scale, zero) - wf) ** 2
        err = jnp.sum(sq if importance is None else sq * importance, axis=-2, keepdims=True)
        if best is None:
            best = (err, u, scale, zero)
        else:
            better = err < best[0]
            best = tuple(jnp.where(better, new, old) for new, old in zip((err, u, scale, zero), best))
    return best[1], best[2], best[3]


def _shrink_lp(x: Array, beta: float, p: float) -> Array:
    """Proximal operator of (1/beta)|x|^p (p < 1): HQQ's generalized soft-threshold."""
    ax = jnp.abs(x)
    return jnp.sign(x) * jax.nn.relu(ax - jnp.power(jnp.maximum(ax, 1e-30), p - 1.0) / beta)


def _hqq(wf: Array, scale: Array, zero: Array, scale_dtype: Any) -> tuple[Array, Array, Array]:
    """HQQ's zero-point optimization (scale fixed) of wf [..., n, G, Dout] from (scale, zero).

    Half-quadratic splitting of min_z ||wf - dequant(quant(wf))||_p^p: W_e = shrink_p(wf - W_r)
    is the sparse error estimate and z the mean of (wf - W_e - s U) over the group, the
    closed-form minimizer of the quadratic term; beta grows by kappa per iteration. The error is
    evaluated with z rounded to `scale_dtype` (what is stored); per group and output column the
    lowest mean |error| over the start and the iterates is kept.
    """
    def l1(z: Array) -> Array:
        return jnp.mean(jnp.abs(_dequant(_codes(wf, scale, z), scale, z) - wf), axis=-2, keepdims=True)

    s = scale.astype(jnp.float32)
    best_z, best_err = zero, l1(zero)
    z, beta = zero.astype(jnp.float32), HQQ_BETA
    for _ in range(HQQ_ITERS):  # unrolled: 20 cheap elementwise steps
        u = _codes(wf, scale, z)
        w_e = _shrink_lp(wf - (u * s + z), beta, HQQ_LP_NORM)
        z = jnp.mean(wf - w_e - u * s, axis=-2, keepdims=True)
        beta *= HQQ_KAPPA
        zq = z.astype(scale_dtype)
        err = l1(zq)
        better = err < best_err
        best_z, best_err = jnp.where(better, zq, best_z), jnp.where(better, err, best_err)
    return _codes(wf, scale, best_z), scale, best_z


def _group_quant(wf: Array, method: str, scale_dtype: Any, importance: Array | None = None
                 ) -> tuple[Array, Array, Array]:
    """(U, scale, zero) of wf [..., n, G, Dout] by a data-free method (scale/zero [..., n, 1, Dout])."""
    if method == "minmax":
        return _clip_search(wf, (1.0,), scale_dtype)
    u, scale, zero = _clip_search(wf, CLIP_FACTORS, scale_dtype, importance)
    if method == "clip":
        return u, scale, zero
    if method == "hqq":
        return _hqq(wf, scale, zero, scale_dtype)
    raise ValueError(f"draft method={method!r}; expected one of {tuple(m for m in DRAFT_METHODS if m not in CALIBRATED_METHODS)}"
                     + (" (gptq needs calibration Hessians: use gptq_quantize / make_draft_params(hessians=...))"
                        if method in CALIBRATED_METHODS else ""))


def _pack(u: Array) -> Array:
    """Codes [..., n, G, Dout] (any int/float dtype, 0..15) -> split-halves uint8 [..., n*G/2, Dout]."""
    *lead, n, g, dout = u.shape
    u = u.astype(jnp.int32)
    packed = (u[..., : g // 2, :] | (u[..., g // 2:, :] << 4)).astype(jnp.uint8)
    return packed.reshape(*lead, n * g // 2, dout)


def _check_group(din: int, group_size: int) -> None:
    if din % group_size:
        raise ValueError(f"input dim {din} is not a multiple of the draft group size {group_size}")


def quantize_weight(w: Array, group_size: int, method: str = "clip", scale_dtype: Any = jnp.float16) -> QuantizedWeight:
    """Quantizes w [..., Din, Dout] (Din a multiple of group_size) to INT4 by a data-free method
    ("clip", "minmax" or "hqq"; "gptq" is `gptq_quantize`, which needs the inputs' Hessian)."""
    *lead, din, dout = w.shape
    _check_group(din, group_size)
    wf = w.astype(jnp.float32).reshape(*lead, din // group_size, group_size, dout)
    u, scale, zero = _group_quant(wf, method, scale_dtype)
    return QuantizedWeight(packed=_pack(u), scale=scale[..., 0, :], zero=zero[..., 0, :])


def _inverse_cholesky_upper(h: Array, damp: float) -> Array:
    """Upper-triangular U with U^T U = (h + d * mean(diag h) * I)^-1, float32 [n, n].

    One Cholesky factorization and one triangular inverse: with J the row-reversal permutation
    and J h J = L L^T (L lower), h = R R^T with R = J L J upper, so h^-1 = R^-T R^-1 and
    U = R^-1 = J L^-1 J (the Cholesky factor is unique, so this is the U of chol(h^-1)). Half the
    work of inverting h and factorizing the inverse (3.4 -> 0.5 s at n = 1536 on a 2-core CPU).
    d starts at `damp` and grows x10 (GPTQ_DAMP_RETRIES times at most) while the factorization
    fails (non-finite), as happens for a rank-deficient h from too few calibration tokens.
    """
    n = h.shape[0]
    eye = jnp.eye(n, dtype=jnp.float32)
    mean_diag = jnp.mean(jnp.diagonal(h))
    rev = h[::-1, ::-1]  # J h J

    def attempt(d: Array) -> Array:
        chol = jnp.linalg.cholesky(rev + d * mean_diag * eye)  # L, lower
        return jax.scipy.linalg.solve_triangular(chol, eye, lower=True)[::-1, ::-1]  # J L^-1 J, upper

    def retry(c: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        d, _, i = c
        return d * 10.0, attempt(d * 10.0), i + 1

    d0 = jnp.float32(damp)
    _, u, _ = jax.lax.while_loop(lambda c: ~jnp.all(jnp.isfinite(c[1])) & (c[2] < GPTQ_DAMP_RETRIES),
                                 retry, (d0, attempt(d0), jnp.int32(0)))
    return u


def gptq_quantize(w: Array, hessian: Array, group_size: int, scale_dtype: Any = jnp.float16, *,
                  damp: float = GPTQ_DAMP, act_order: bool = GPTQ_ACT_ORDER,
                  group_method: str = "clip") -> QuantizedWeight:
    """GPTQ of one weight w [Din, Dout] given its inputs' Hessian [Din, Din] (X^T X / n).

    Same format as `quantize_weight`. Rows are processed group by group (contiguous groups, so
    the packed layout is unchanged); inside a group one row at a time, each row's scaled error
    (w - q) / U_jj updating the group's later rows, and the whole group's errors then updating
    every later row in one matmul (GPTQ's lazy batch update). `group_method` ("clip", "minmax"
    or "hqq") sets each group's (scale, zero) from its error-updated rows; "clip" weights its
    squared error by diag H. Rows that never see input (diag H = 0) are quantized without
    passing error on.
    """
    din, dout = w.shape
    _check_group(din, group_size)
    if hessian.shape != (din, din):
        raise ValueError(f"GPTQ Hessian shape {tuple(hessian.shape)}; expected ({din}, {din}) for a weight of shape {tuple(w.shape)}")
    g, n = group_size, din // group_size
    hp = jax.lax.Precision.HIGHEST
    h = hessian.astype(jnp.float32)
    diag = jnp.diagonal(h)
    h = h + jnp.diag(jnp.where(diag > 0, 0.0, 1.0))  # dead inputs: a unit diagonal, no coupling
    diag = jnp.diagonal(h)
    if act_order:
        group_order = jnp.argsort(-diag.reshape(n, g).sum(axis=1))
        within = jnp.argsort(-diag.reshape(n, g), axis=1)
        perm = (group_order[:, None] * g + within[group_order]).reshape(din)
    else:
        group_order, perm = jnp.arange(n), jnp.arange(din)
    wp = w.astype(jnp.float32)[perm]  # [Din, Dout], rows in processing order
    u_inv = _inverse_cholesky_upper(h[perm][:, perm], damp)
    importance = diag[perm]
    rows_idx = jnp.arange(g)
    cols_idx = jnp.arange(din)

    def group_step(k: Array, carry: tuple[Array, Array, Array, Array]) -> tuple[Array, Array, Array, Array]:
        wp, codes, scales, zeros = carry
        start = k * g
        rows = jax.lax.dynamic_slice(wp, (start, 0), (g, dout))
        imp = jax.lax.dynamic_slice(importance, (start,), (g,))[:, None]
        if group_method in ("minmax", "clip"):
            _, scale, zero = _clip_search(rows[None], CLIP_FACTORS if group_method == "clip" else (1.0,),
                                          scale_dtype, imp[None])
        else:
            _, scale, zero = _group_quant(rows[None], group_method, scale_dtype)
        scale, zero = scale[0], zero[0]  # [1, Dout]
        ublk = jax.lax.dynamic_slice(u_inv, (start, start), (g, g))

        def row_step(j: Array, c: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            rows, q, err = c
            wj = rows[j][None]  # [1, Dout]
            qj = _codes(wj, scale, zero)
            ej = (wj - _dequant(qj, scale, zero)) / ublk[j, j]
            rows = rows - jnp.where(rows_idx > j, ublk[j], 0.0)[:, None] * ej  # later rows of this group
            return rows, q.at[j].set(qj[0]), err.at[j].set(ej[0])

        zeros_g = jnp.zeros((g, dout), jnp.float32)
        _, q, err = jax.lax.fori_loop(0, g, row_step, (rows, zeros_g, zeros_g))
        u_rows = jax.lax.dynamic_slice(u_inv, (start, 0), (g, din))
        u_rows = jnp.where(cols_idx >= start + g, u_rows, 0.0)  # only rows after this group
        wp = wp - jnp.matmul(u_rows.T, err, precision=hp)
        codes = jax.lax.dynamic_update_slice(codes, q, (start, 0))
        return wp, codes, scales.at[k].set(scale[0]), zeros.at[k].set(zero[0])

    init = (wp, jnp.zeros((din, dout), jnp.float32), jnp.zeros((n, dout), scale_dtype), jnp.zeros((n, dout), scale_dtype))
    _, codes, scales, zeros = jax.lax.fori_loop(0, n, group_step, init)
    codes = codes[jnp.argsort(perm)].reshape(n, g, dout)  # back to the original row order
    back = jnp.argsort(group_order)
    return QuantizedWeight(packed=_pack(codes), scale=scales[back], zero=zeros[back])


# Module-level jits: one compilation per weight shape and setting per process, however many
# drafts are made (a jax.jit of a fresh functools.partial per call would compile every time).
# one weight [Din, Dout] folded with its norm weight g [Din] (or None) inside the jit: no float32 copy made outside it
_quantize_jit = jax.jit(lambda w, g, group_size, method, scale_dtype: quantize_weight(
    _fold(w, g), group_size, method, scale_dtype), static_argnums=(2, 3, 4))
# a stack [L, Din, Dout] one layer at a time (lax.map bounds peak memory), each folded with its norm weight g [L, Din]
_quantize_stack_jit = jax.jit(lambda w, g, group_size, method, scale_dtype: jax.lax.map(
    lambda wg: quantize_weight(_fold(*wg), group_size, method, scale_dtype), (w, g)), static_argnums=(2, 3, 4))
_gptq_jit = jax.jit(gptq_quantize, static_argnames=("group_size", "scale_dtype", "damp", "act_order", "group_method"))
_gptq_layers_jit = jax.jit(jax.vmap(gptq_quantize, in_axes=(0, 0, None, None)), static_argnums=(2, 3))


def _gptq_shared(ws: list[Array], hessian: Array, group_size: int, scale_dtype: Any) -> list[QuantizedWeight]:
    """GPTQ of weights [..., Din, Dout_i] that see the same input (one Hessian [..., Din, Din]),
    in one call over their output columns side by side: GPTQ treats output columns
    independently given H, so this is each weight's own GPTQ, with one Cholesky factorization
    and one row loop instead of one per weight. A leading axis (layers) is vmapped."""
    w = ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=-1)
    if w.ndim == 3:
        q = _gptq_layers_jit(w, hessian, group_size, scale_dtype)
    else:
        q = _gptq_jit(w, hessian, group_size=group_size, scale_dtype=scale_dtype)
    if len(ws) == 1:
        return [q]
    out, at = [], 0
    for w in ws:
        cols = slice(at, at + w.shape[-1])
        out.append(QuantizedWeight(packed=q.packed[..., cols], scale=q.scale[..., cols], zero=q.zero[..., cols]))
        at += w.shape[-1]
    return out


def _layers_per_batch(hessians: dict[str, Array], num_layers: int) -> int:
    """The largest divisor of num_layers whose layers' distinct Hessians fit GPTQ_BATCH_BYTES
    (a divisor: every batch has one shape, so one compilation)."""
    per_layer = sum(h.size * h.dtype.itemsize for h in {id(h): h for h in hessians.values()}.values())
    k = max(1, min(num_layers, GPTQ_BATCH_BYTES // max(1, per_layer)))
    return max(d for d in range(1, k + 1) if num_layers % d == 0)


def make_draft_params(params: Any, cfg: DraftWeightsConfig, *, hessians: Any = None,
                      progress: bool = False) -> Any:
    """Draft params: the target's, with the scoped linears (and lm_head) quantized to INT4.

    The embedding is shared with the target (not copied), and so are the norms, except those
    `cfg` folds into the INT4 weights (`folded_norms`: W' = diag(g) W is quantized, the draft's
    g is ones, `with_unit_norms`). `hessians` (for the
    CALIBRATED_METHODS): `qspec_jax.calibration.CalibrationHessians`, which computes one layer's
    Hessians at a time (`.layer(i)` -> {"layers/wq": [Din, Din], ...}, `.head()` -> [D, D]), or
    a mapping {"layers/wq": [L, Din, Din], ..., "lm_head": [D, D]}; weights whose Hessian is the
    same array object (wq/wk/wv, w_gate/w_up in `.layer(i)`) are quantized in one GPTQ call.
    `qspec_jax.calibration.make_draft` collects the Hessians from text. `progress`: a tqdm bar.
    """
    from tqdm.auto import tqdm  # lazily: only this function reports progress

    names = [f"layers/{n}" for n in DRAFT_SCOPES[cfg.scope]] + (["lm_head"] if cfg.lm_head else [])
    folded = folded_norms(cfg)
    # the norm weight folded into each quantized weight: [L, Din] for a layer's linears, [D] for the lm_head
    gains = {(f"layers/{r}" if r != "lm_head" else r): (getattr(params.layers, n) if n != "final_norm"
                                                        else params.final_norm)
             for n in folded for r in NORM_READERS[n]}
    sd = jnp.dtype(cfg.scale_dtype)
    desc = f"INT4 draft ({cfg.method}, g{cfg.group_size})"
    lm_head_w = params.embed.T if params.lm_head is None else params.lm_head
    out: dict[str, Any] = {}
    if cfg.method in CALIBRATED_METHODS:
        missing = [k for k in names if hessians is None or k not in hessians]
        if missing:
            raise ValueError(
                f"draft method {cfg.method!r} needs calibration Hessians (qspec_jax.calibration.make_draft collects "
                f"them from text; qspec-convert does by default); missing: {', '.join(missing)}")
        if hasattr(hessians, "layer"):
            layer_h, head_h = hessians.layer, hessians.head
        else:
            layer_h, head_h = (lambda i: {k: hessians[k][i] for k in names if k != "lm_head"}), (lambda: hessians["lm_head"])
        # Layers in batches (_layers_per_batch): a CalibrationHessians computes one layer's
        # Hessians at a time; a batch's are stacked and its layers quantized in one vmapped call.
        num_layers, at = params.config.num_layers, 0
        chunks: dict[str, list[QuantizedWeight]] = {}  # per weight: [batch, ...] quantized layers, in order
        with tqdm(total=num_layers, desc=desc, unit="layer", disable=not progress) as bar:
            while at < num_layers:
                first = layer_h(at)
                batch = [first] + [layer_h(i) for i in range(at + 1, at + _layers_per_batch(first, num_layers))]
                shared: dict[int, list[str]] = {}  # weights grouped by their Hessian (the same array object)
                for k in names:
                    if k != "lm_head":
                        shared.setdefault(id(first[k]), []).append(k)
                for ks in shared.values():
                    gain = gains[ks[0]][at: at + len(batch)] if ks[0] in gains else None  # one norm per Hessian
                    ws = [_fold(getattr(params.layers, k.split("/", 1)[1])[at: at + len(batch)], gain) for k in ks]
                    h = jnp.stack([hs[ks[0]] for hs in batch]) if len(batch) > 1 else first[ks[0]][None]
                    h = _unfold_hessian(h, gain)
                    qs = _gptq_shared(ws if len(batch) > 1 else [w[0] for w in ws], h if len(batch) > 1 else h[0],
                                      cfg.group_size, sd)
                    for k, q in zip(ks, qs):
                        chunks.setdefault(k, []).append(q if len(batch) > 1 else jax.tree.map(lambda a: a[None], q))
                at += len(batch)
                bar.update(len(batch))
        out = {k: jax.tree.map(lambda *xs: jnp.concatenate(xs), *qs) for k, qs in chunks.items()}
        if cfg.lm_head:
            g = gains.get("lm_head")
            out["lm_head"] = _gptq_jit(_fold(lm_head_w, g), _unfold_hessian(head_h(), g), group_size=cfg.group_size,
                                       scale_dtype=sd)
    else:
        for k in tqdm(names, desc=desc, unit="weight", disable=not progress):
            out[k] = (_quantize_jit(lm_head_w, gains.get(k), cfg.group_size, cfg.method, sd)
                      if k == "lm_head" else
                      _quantize_stack_jit(getattr(params.layers, k.split("/", 1)[1]), gains.get(k), cfg.group_size,
                                          cfg.method, sd))
    layers = params.layers.replace(**{k.split("/", 1)[1]: v for k, v in out.items() if k != "lm_head"})
    draft = params.replace(layers=layers, lm_head=out.get("lm_head", params.lm_head))
    return with_unit_norms(draft, folded)
