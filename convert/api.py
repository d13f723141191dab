"""`convert(src, out)`: a HF directory or a .gguf file -> a qspec-jax checkpoint directory.

The steps, each usable alone (`qspec-convert` runs them in a child process, `convert.worker`):

    open_source    metadata only: config, tensor plan, tokenizer; validated (`core.validate`)
    check_draft    the INT4 draft's group size divides every quantized input dimension
    estimate_bytes the checkpoint's size, for the free-space check before any weight is read
    convert_into   reads the weights, makes the draft, writes everything into a directory
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from convert.core import OUTPUT_DTYPES, ConversionError, Source, fill, validate
from convert.output import Staging, check_free_space, commit, create_staging, discard
from convert.safetensors_io import SafetensorsError
from qspec_jax.checkpoint import draft_group_problems, draft_weight_shapes, write_checkpoint_into
from qspec_jax.config import ConfigError, ModelConfig
from qspec_jax.model import param_shapes

__all__ = ["ConversionWarning", "check_draft", "convert", "convert_into", "estimate_bytes", "locate", "open_source"]

SCALE_BYTES = {"float16": 2, "float32": 4}


class ConversionWarning(UserWarning):
    """The conversion succeeds, but part of the checkpoint will be missing (e.g. no tokenizer)."""


def locate(src: str | Path, progress: bool = True) -> tuple[Path, str]:
    """(local path, how the manifest names the source) of `src`: a local path as it is, or a
    Hugging Face Hub repository id resolved to its cached (or now downloaded) snapshot
    (`convert.hub`)."""
    from convert import hub

    if hub.looks_like_repo_id(src):
        return hub.resolve(str(src), progress=progress)
    return Path(src), str(Path(src).resolve())


def open_source(src: str | Path, dtype: str = "bfloat16", *, tokenizer: bool = True) -> Source:
    """Parses `src` (metadata only) into a `Source`; raises ConversionError for bad input.
    `src` is a local path or a Hugging Face Hub repository id (`locate`)."""
    if dtype not in OUTPUT_DTYPES:
        raise ConversionError(f"dtype={dtype!r}; expected one of {', '.join(OUTPUT_DTYPES)}")
    src, _ = locate(src)
    if not src.exists():
        raise ConversionError(f"{src}: no such file or directory")
    try:
        if src.is_dir():
            from convert.hf import open_hf_dir

            return open_hf_dir(src, dtype)
        from convert.gguf_source import is_gguf, open_gguf

        if is_gguf(src):
            return open_gguf(src, dtype, tokenizer=tokenizer)
        raise ConversionError(f"{src}: not a model directory (config.json + *.safetensors) or a .gguf file")
    except (ConfigError, SafetensorsError) as e:
        raise ConversionError(str(e)) from e


def check_draft(cfg: ModelConfig, draft: Any, flag: str = "--draft-group") -> None:
    """Refuses a draft group size that does not divide a quantized weight's input dimension."""
    bad = draft_group_problems(cfg, draft)
    if bad:
        raise ConversionError(f"{flag} {draft.group_size} does not divide the input dimension of "
                              f"{', '.join(bad)}; choose a group size that does")


def estimate_bytes(cfg: ModelConfig, draft: Any = None) -> int:
    """Bytes of the checkpoint's tensors: the target in cfg.dtype, plus the INT4 draft (packed
    codes at 4 bits, scale and zero per group of `draft.group_size` input rows)."""
    item = OUTPUT_DTYPES[cfg.dtype].itemsize
    total = sum(math.prod(s) for s in param_shapes(cfg).values()) * item
    if draft is not None:
        for *lead, din, dout in draft_weight_shapes(cfg, draft).values():
            n = math.prod(lead)
            total += n * din * dout // 2 + 2 * n * (din // draft.group_size) * dout * SCALE_BYTES[draft.scale_dtype]
    return total


def _make_draft(cfg: ModelConfig, flat: dict[str, np.ndarray], draft: Any, source: Source,
                calibration_text: Sequence[str | Path] | None, progress: bool,
                on_stage: Callable[[str], None] | None) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """The INT4 draft weights ("draft/..." keys) made from the stored target weights, and what a
    calibrated method calibrated on (`qspec_jax.calibration.make_draft`: --calibration-text, else
    the built-in text, else random token ids when the source has no tokenizer)."""
    import jax.numpy as jnp

    from qspec_jax.calibration import CalibrationError, make_draft
    from qspec_jax.checkpoint import draft_to_flat
    from qspec_jax.model import params_from_flat

    params = params_from_flat(cfg, {k: jnp.asarray(v) for k, v in flat.items()})
    try:
        tokenizer = source.tokenizer() if source.tokenizer is not None else None
        draft_params, calibration = make_draft(params, draft, tokenizer=tokenizer,
                                               calibration_text=list(calibration_text or []), progress=progress)
    except CalibrationError as e:
        raise ConversionError(str(e)) from None
    if on_stage is not None:
        on_stage("quantize")  # the quantization may still be running on XLA's threads here
    return draft_to_flat(draft_params), calibration


def convert_into(dst: str | Path, src: str | Path, dtype: str = "bfloat16", *, draft_weights: Any = None,
                 calibration_text: Sequence[str | Path] | None = None, progress: bool = True,
                 staging: Staging | None = None, warn: Callable[[str], None] | None = None,
                 on_stage: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Converts `src` into the existing empty directory `dst` (no rename); returns the manifest.

    Validates everything from metadata first (tensor plan, draft group, and, given `staging`,
    the free space for `estimate_bytes`), then reads, quantizes and writes. `warn(message)`
    receives what will not work (no tokenizer files). `on_stage(name)` is called during
    "read" (after the first tensor), "quantize" and "write" (tests interrupt there).
    """
    src, manifest_source = locate(src, progress)
    source = open_source(src, dtype)
    try:
        validate(source)
        if draft_weights is not None:
            check_draft(source.cfg, draft_weights)
        if staging is not None:
            check_free_space(staging, estimate_bytes(source.cfg, draft_weights))
        for message in source.warnings:
            (warn or _warn)(message)
        on_read = None if on_stage is None else (lambda i, n: on_stage("read") if i == 0 else None)
        flat = fill(source, progress=progress, desc=f"reading {Path(manifest_source).name}", on_read=on_read)
        extra = dict(source.extra)
        if draft_weights is not None:
            weights, calibration = _make_draft(source.cfg, flat, draft_weights, source, calibration_text, progress,
                                               on_stage)
            flat.update(weights)
            extra["draft_weights"] = draft_weights.to_dict()
            if calibration is not None:
                extra["draft_calibration"] = calibration
        if progress:  # orbax's write takes seconds with no bar of its own
            print(f"writing the checkpoint ({estimate_bytes(source.cfg, draft_weights) / 1e6:,.0f} MB)",
                  file=sys.stderr, flush=True)
        write_checkpoint_into(dst, source.cfg, flat, source=manifest_source, write_tokenizer=source.write_tokenizer,
                              extra=extra, on_stage=on_stage)
    finally:
        source.close()
    return {"source": manifest_source, "dtype": source.cfg.dtype, **extra}


def _warn(message: str) -> None:
    warnings.warn(message, ConversionWarning, stacklevel=3)


def convert(src: str | Path, out: str | Path, dtype: str = "bfloat16", *, progress: bool = True,
            draft_weights: Any = None, calibration_text: Sequence[str | Path] | None = None) -> Path:
    """Converts a HF model directory (or Hub repository id, `locate`) or a Llama `.gguf` file
    into a checkpoint at `out`.

    dtype: the stored parameter dtype, "bfloat16" (default) or "float32".
    draft_weights: a `qspec_jax.weight_quant.DraftWeightsConfig` to also store INT4 draft
    weights (made from the stored target weights; `load` returns them as `draft_params`);
    calibration_text: text file(s) for the calibrated methods (`CALIBRATED_METHODS`, the default
    GPTQ among them); default: the library's built-in text (`qspec_jax.calibration.BUILTIN_TEXT`).
    OUT is checked before anything is read (`convert.output`); the checkpoint is written next to
    it and renamed into place, so after a failure `out` does not exist. Raises ConversionError
    for bad input and warns (ConversionWarning) about what will not work. Returns `out`.

    For a conversion that Ctrl-C can interrupt safely at any moment, use `qspec-convert`: in
    this process, an interrupt can only stop the main thread while JAX compiles and orbax
    writes on their own threads (see `convert.cli`).
    """
    staging = create_staging(out)
    try:
        convert_into(staging.dir, src, dtype, draft_weights=draft_weights, calibration_text=calibration_text,
                     progress=progress, staging=staging)
        return commit(staging)
    except BaseException:
        discard(staging)
        raise
