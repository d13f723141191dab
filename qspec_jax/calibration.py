"""Calibration for data-aware draft weights (GPTQ): per-linear input Hessians over real text.

GPTQ quantizes a linear W to minimize ||X W - X Q||^2 over calibration inputs X; all it needs of
X is H = X^T X / n (float32 [Din, Din]). Every layer has four distinct linear inputs, and the
lm_head one more:

    attn_in  = rms_norm(x)             inputs of wq, wk, wv      [D, D]
    attn_out = attention output         input of wo               [Hq*Dh, Hq*Dh]
    mlp_in   = rms_norm(x + attn wo)    inputs of w_gate, w_up    [D, D]
    mlp_out  = silu(h wg) * (h wu)      input of w_down           [F, F]
    head     = final rms_norm(x)        input of lm_head          [D, D]

`CalibrationHessians` computes them one layer at a time: it keeps the residual stream of all
calibration tokens at one layer boundary ([N, T, D] in the model dtype) and runs one layer over
it, a batch of windows per jitted call, summing the Gram matrices. Memory is that stream plus
one layer's Hessians (an 8B Llama: 0.5 GB of stream for 64k tokens and 1 GB of Hessians, where
all 32 layers' would be 33 GB). The inputs are the target's own (every layer sees unquantized
predecessors): the draft is meant to reproduce the target. `collect_hessians` materializes all
layers at once (small models, tests).

The layer is `model.layer_forward`, the very function `model.prefill` runs per layer, which
also returns the four linear inputs; `tests/test_weight_quant.py` checks that this pass
reproduces `model.prefill`'s logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax import model as M
from qspec_jax.evaluation import read_text_file

Array = jax.Array
CALIBRATION_FLAG = "--calibration-text"
CALIBRATION_SEQ_LEN = 2048  # tokens per calibration window (capped at the model's positions)
CALIBRATION_MAX_TOKENS = 65536  # windows beyond this budget are dropped (evenly over the text)
MIN_CALIBRATION_TOKENS = 4096  # fewer leaves H = X^T X badly conditioned for F-wide inputs
CALIBRATION_BATCH_TOKENS = 8192  # tokens per jitted accumulation step (bounds activation memory)
# Which accumulated input each quantizable weight sees.
HESSIAN_OF = {"layers/wq": "attn_in", "layers/wk": "attn_in", "layers/wv": "attn_in", "layers/wo": "attn_out",
              "layers/w_gate": "mlp_in", "layers/w_up": "mlp_in", "layers/w_down": "mlp_out", "lm_head": "head"}


class CalibrationError(ValueError):
    """Unusable calibration text; the message names the flag and the file."""


def read_calibration_tokens(paths: str | Path | Sequence[str | Path], tokenizer: Any, *,
                            min_tokens: int = MIN_CALIBRATION_TOKENS, flag: str = CALIBRATION_FLAG) -> np.ndarray:
    """Token ids (int32 [N]) of the calibration text file(s), concatenated in order.

    Raises CalibrationError naming `flag` and the file for a missing, empty or binary file (NUL
    bytes or not UTF-8: `evaluation.read_text_file`) and for fewer than `min_tokens` tokens in all.
    """
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise CalibrationError(f"{flag}: no file given")
    ids: list[int] = []
    for path in paths:
        try:
            text = read_text_file(path, flag)  # missing, directory, empty, binary: named errors
        except ValueError as e:
            raise CalibrationError(str(e)) from None
        ids += tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < min_tokens:
        names = ", ".join(str(p) for p in paths)
        raise CalibrationError(f"{flag} {names}: {len(ids)} tokens, need at least {min_tokens}; pass more text")
    return np.asarray(ids, np.int32)


def calibration_windows(ids: np.ndarray, seq_len: int, max_tokens: int = CALIBRATION_MAX_TOKENS) -> np.ndarray:
    """int32 [n, seq_len]: non-overlapping windows of `ids`, at most max_tokens // seq_len of
    them, spread evenly over the text (so every part of a multi-file corpus contributes)."""
    total = len(ids) // seq_len
    if total < 1:
        raise CalibrationError(f"{len(ids)} calibration tokens, fewer than one window of {seq_len}")
    keep = max(1, min(total, max_tokens // seq_len))
    starts = np.linspace(0, total - 1, keep).round().astype(np.int64) * seq_len
    return np.stack([ids[s: s + seq_len] for s in starts])


def _gram(x: Array) -> Array:
    """x [..., d] -> float32 sum over rows of x x^T [d, d]."""
    xf = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return jnp.matmul(xf.T, xf, precision=jax.lax.Precision.HIGHEST)


@jax.jit
def _layer_step(params: M.Params, i: Array, x: Array) -> tuple[Array, dict[str, Array]]:
    """Layer i of the stacked params on x [B, T, D] (full windows): (output, Gram of each input)."""
    lp = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), params.layers)
    b, t = x.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    y, _, inputs = M.layer_forward(params.config, lp, x, positions)
    return y, {k: _gram(v) for k, v in inputs.items()}


@jax.jit
def _head(params: M.Params, x: Array) -> tuple[Array, Array]:
    """The lm_head input rms_norm(x) and its Gram."""
    h = M.rms_norm(x, params.final_norm, params.config.rms_norm_eps)
    return h, _gram(h)


def final_hidden(params: M.Params, tokens: Array) -> Array:
    """The lm_head input rms_norm(x) [B, T, D] of full windows tokens [B, T], through the same
    layer steps the Hessians come from (its logits are `model.prefill`'s)."""
    x = params.embed[tokens]
    for i in range(params.config.num_layers):
        x, _ = _layer_step(params, jnp.int32(i), x)
    return _head(params, x)[0]


class CalibrationHessians:
    """H = X^T X / n (float32) of every quantizable weight's input, computed one layer at a time.

    `layer(i)` -> {"layers/wq": [D, D], ..., "layers/w_down": [F, F]} of layer i (weights that
    share an input share one array); `head()` -> the lm_head's [D, D]. In-order calls run each
    layer once; an earlier layer restarts from the embeddings. `make_draft_params(hessians=...)`
    takes this object (and a plain {"layers/wq": [L, D, D], ..., "lm_head": [D, D]} mapping).
    The target `params` must be dense (unquantized).
    """

    def __init__(self, params: M.Params, windows: np.ndarray, *, batch_tokens: int = CALIBRATION_BATCH_TOKENS,
                 progress: bool = False) -> None:
        cfg = params.config
        windows = np.asarray(windows, np.int32)
        if windows.ndim != 2 or not 0 < windows.shape[1] <= cfg.max_position_embeddings or not len(windows):
            raise ValueError(f"calibration windows of shape {windows.shape}; expected [N, T] with N >= 1 and "
                             f"1 <= T <= max_position_embeddings={cfg.max_position_embeddings}")
        if windows.min() < 0 or windows.max() >= cfg.vocab_size:
            raise ValueError(f"calibration token ids span [{windows.min()}, {windows.max()}]; "
                             f"the model's vocabulary is [0, {cfg.vocab_size})")
        per = max(1, batch_tokens // windows.shape[1])
        self.params, self.num_layers, self.tokens = params, cfg.num_layers, int(windows.size)
        self._batches = [windows[i: i + per] for i in range(0, len(windows), per)]  # the last may be short
        self._progress = progress
        self._restart()

    def _restart(self) -> None:
        self._x = [self.params.embed[jnp.asarray(b)] for b in self._batches]  # residual at layer self._at
        self._at = 0

    def _run_layer(self) -> dict[str, Array]:
        from tqdm.auto import tqdm

        acc: dict[str, Array] = {}
        i = jnp.int32(self._at)
        for j in tqdm(range(len(self._x)), desc=f"calibration layer {self._at}", unit="batch",
                      disable=not self._progress, leave=False):
            self._x[j], grams = _layer_step(self.params, i, self._x[j])
            acc = grams if not acc else {k: acc[k] + grams[k] for k in acc}
        self._at += 1
        return {k: v / self.tokens for k, v in acc.items()}

    def __contains__(self, name: object) -> bool:
        return name in HESSIAN_OF

    def keys(self) -> Any:
        return HESSIAN_OF.keys()

    def layer(self, i: int) -> dict[str, Array]:
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i}; the model has {self.num_layers}")
        if i < self._at:
            self._restart()
        while self._at < i:
            self._run_layer()
        h = self._run_layer()
        return {name: h[key] for name, key in HESSIAN_OF.items() if name != "lm_head"}

    def head(self) -> Array:
        while self._at < self.num_layers:
            self._run_layer()
        return sum(_head(self.params, x)[1] for x in self._x) / self.tokens


def collect_hessians(params: M.Params, windows: np.ndarray, *, batch_tokens: int = CALIBRATION_BATCH_TOKENS,
                     progress: bool = True) -> dict[str, Array]:
    """All layers' Hessians at once: {"layers/wq": [L, D, D], ..., "lm_head": [D, D]} (small
    models and tests; `CalibrationHessians` bounds the memory to one layer's)."""
    from tqdm.auto import tqdm

    hs = CalibrationHessians(params, windows, batch_tokens=batch_tokens)
    layers = [hs.layer(i) for i in tqdm(range(hs.num_layers), desc="calibration", unit="layer", disable=not progress)]
    out = {k: jnp.stack([h[k] for h in layers]) for k in layers[0] if k.startswith("layers/")}
    shared = {}  # weights that share an input share one array, as in CalibrationHessians.layer
    for name, key in HESSIAN_OF.items():
        if name != "lm_head":
            out[name] = shared.setdefault(key, out[name])
    out["lm_head"] = hs.head()
    return out
