"""Calibration for data-aware draft weights (GPTQ): per-linear input Hessians over real text.

GPTQ quantizes a linear W to minimize ||X W - X Q||^2 over calibration inputs X; all it needs of
X is H = X^T X / n (float32 [Din, Din]). Every layer has four distinct linear inputs, and the
lm_head one more:

    attn_in  = rms_norm(x)             inputs of wq, wk, wv      [D, D]
    attn_out = attention output         input of wo               [Hq*Dh, Hq*Dh]
    mlp_in   = rms_norm(x + attn wo)    inputs of w_gate, w_up    [D, D]
    mlp_out  = silu(h wg) * (h wu)      input of w_down           [F, F]
    head     = final rms_norm(x)        input of lm_head          [D, D]

`make_draft` is the entry point: the calibration tokens (`calibration_tokens`: the user's text,
else the library's built-in text `BUILTIN_TEXT`, else random token ids for a model without a
tokenizer), their Hessians and `weight_quant.make_draft_params`. `CalibrationHessians` computes
the Hessians one layer at a time: it keeps the residual stream of all
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
from qspec_jax.weight_quant import CALIBRATED_METHODS, DraftWeightsConfig, make_draft_params

Array = jax.Array
CALIBRATION_FLAG = "--calibration-text"
CALIBRATION_SEQ_LEN = 512  # tokens per calibration window (capped at the model's positions)
CALIBRATION_MAX_TOKENS = 8192  # windows beyond this budget are dropped (evenly over the text)
MIN_CALIBRATION_TOKENS = 4096  # fewer leaves H = X^T X badly conditioned for F-wide inputs
CALIBRATION_BATCH_TOKENS = 8192  # tokens per jitted accumulation step (bounds activation memory)
# The default calibration text: public domain, not Shakespeare (the evaluation texts);
# qspec_jax/data/README.md says what it is and where it comes from.
BUILTIN_TEXT = Path(__file__).resolve().parent / "data" / "botchan.txt"
RANDOM_TOKENS_SEED = 0  # calibration token ids of a model without a tokenizer
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


def calibration_tokens(tokenizer: Any, paths: Sequence[str | Path] | None = None, *, vocab_size: int,
                       max_tokens: int = CALIBRATION_MAX_TOKENS,
                       flag: str = CALIBRATION_FLAG) -> tuple[np.ndarray, str]:
    """(token ids int32 [N], what they are, for messages) to calibrate on.

    `paths` given: those files through `tokenizer` (`read_calibration_tokens`; CalibrationError
    without a tokenizer). Else `BUILTIN_TEXT` through `tokenizer`; else (a model without a
    tokenizer: token ids only) `max_tokens` uniform random token ids from a fixed seed, which give
    a valid, exact draft that accepts less than one calibrated on text.
    """
    if paths:
        if tokenizer is None:
            raise CalibrationError(f"{flag} is tokenized with the model's tokenizer, and this model has none")
        ids = read_calibration_tokens(paths, tokenizer, flag=flag)
        return ids, f"{', '.join(str(p) for p in paths)}"
    if tokenizer is not None:
        return read_calibration_tokens(BUILTIN_TEXT, tokenizer, flag="built-in calibration text"), \
            f"the built-in text ({BUILTIN_TEXT.name})"
    ids = np.random.default_rng(RANDOM_TOKENS_SEED).integers(0, vocab_size, max_tokens).astype(np.int32)
    return ids, "random token ids (the model has no tokenizer)"


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


def make_draft(params: M.Params, cfg: DraftWeightsConfig, *, tokenizer: Any = None,
               calibration_text: Sequence[str | Path] | None = None, max_tokens: int = CALIBRATION_MAX_TOKENS, seq_len: int = CALIBRATION_SEQ_LEN,
               progress: bool = False) -> tuple[M.Params, dict[str, Any] | None]:
    """The draft params of DraftWeightsConfig `cfg` for the dense, unfused target `params`, and
    for a calibrated method what it was calibrated on ({"text", "tokens"}; None otherwise).

    Data-free methods: `weight_quant.make_draft_params` as is. Calibrated methods (GPTQ): the
    Hessians over `calibration_tokens(tokenizer, calibration_text)`, windows of `seq_len` tokens,
    at most `max_tokens` of them spread evenly over the text, collected one layer at a time
    while the layers are quantized. Raises CalibrationError for unusable text.
    """
    if cfg.method not in CALIBRATED_METHODS:
        if calibration_text:
            raise CalibrationError(f"{CALIBRATION_FLAG} is for the calibrated draft methods "
                                   f"({', '.join(CALIBRATED_METHODS)}), not {cfg.method}")
        return make_draft_params(params, cfg, progress=progress), None
    ids, what = calibration_tokens(tokenizer, calibration_text, vocab_size=params.config.vocab_size,
                                   max_tokens=max_tokens)
    windows = calibration_windows(ids, min(seq_len, params.config.max_position_embeddings), max_tokens)
    hessians = CalibrationHessians(params, windows, progress=progress)
    draft = make_draft_params(params, cfg, hessians=hessians, progress=progress)
    return draft, {"text": what, "tokens": int(windows.size)}
