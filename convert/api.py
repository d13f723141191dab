"""`convert(src, out)`: a HF directory or a .gguf file -> a qspec-jax checkpoint directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from convert.core import OUTPUT_DTYPES, ConversionError, Source, fill, validate
from convert.safetensors_io import SafetensorsError
from qspec_jax.checkpoint import CheckpointError, write_checkpoint
from qspec_jax.config import ConfigError, ModelConfig


def open_source(src: str | Path, dtype: str = "bfloat16", *, tokenizer: bool = True) -> Source:
    """Parses `src` (metadata only) into a `Source`; raises ConversionError for bad input."""
    src = Path(src)
    if dtype not in OUTPUT_DTYPES:
        raise ConversionError(f"dtype={dtype!r}; expected one of {', '.join(OUTPUT_DTYPES)}")
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


def _missing_ancestors(path: Path) -> list[Path]:
    """`path`'s ancestors that do not exist yet, deepest first (write_checkpoint creates them)."""
    out = []
    for p in path.parents:
        if p.exists():
            break
        out.append(p)
    return out


def _check_draft(cfg: ModelConfig, draft: Any) -> None:
    """Refuses draft settings whose group size does not divide a quantized input dimension."""
    from qspec_jax.weight_quant import DRAFT_SCOPES

    din = {"wq": cfg.hidden_size, "wk": cfg.hidden_size, "wv": cfg.hidden_size,
           "wo": cfg.num_heads * cfg.head_dim, "w_gate": cfg.hidden_size, "w_up": cfg.hidden_size,
           "w_down": cfg.intermediate_size}
    dims = {f"layers/{n}": din[n] for n in DRAFT_SCOPES[draft.scope]}
    if draft.lm_head:
        dims["lm_head"] = cfg.hidden_size
    bad = sorted(f"{name} (input dim {d})" for name, d in dims.items() if d % draft.group_size)
    if bad:
        raise ConversionError(f"--draft-group {draft.group_size} does not divide the input dimension of "
                              f"{', '.join(bad)}; choose a group size that does")


def _add_draft(cfg: ModelConfig, flat: dict[str, np.ndarray], draft: Any) -> None:
    """Adds the INT4 draft weights ("draft/..." keys) made from the stored target weights."""
    import jax.numpy as jnp

    from qspec_jax.checkpoint import draft_to_flat
    from qspec_jax.model import params_from_flat
    from qspec_jax.weight_quant import make_draft_params

    params = params_from_flat(cfg, {k: jnp.asarray(v) for k, v in flat.items()})
    flat.update(draft_to_flat(make_draft_params(params, draft)))


def convert(src: str | Path, out: str | Path, dtype: str = "bfloat16", *, progress: bool = True,
            draft_weights: Any = None) -> Path:
    """Converts a HF model directory or a Llama `.gguf` file into a checkpoint at `out`.

    dtype: the stored parameter dtype, "bfloat16" (default) or "float32".
    draft_weights: a `qspec_jax.weight_quant.DraftWeightsConfig` to also store INT4 draft
    weights (made from the stored target weights; `load` returns them as `draft_params`).
    Everything is validated before anything is written; on any failure `out` does not exist
    afterwards. Raises ConversionError for bad input. Returns `out`.
    """
    out = Path(os.path.abspath(out))
    if out.exists():
        raise ConversionError(f"{out}: already exists; remove it or choose another output directory")
    source = open_source(src, dtype)
    created = _missing_ancestors(out)
    try:
        validate(source)
        if draft_weights is not None:
            _check_draft(source.cfg, draft_weights)
        flat = fill(source, progress=progress, desc=f"converting {Path(src).name}")
        if draft_weights is not None:
            _add_draft(source.cfg, flat, draft_weights)
            source.extra["draft_weights"] = draft_weights.to_dict()
        try:
            write_checkpoint(out, source.cfg, flat, source=str(Path(src).resolve()),
                             write_tokenizer=source.write_tokenizer, extra=source.extra)
        except CheckpointError as e:
            raise ConversionError(str(e)) from e
    except BaseException:
        for p in created:  # only directories this call created, and only if still empty
            try:
                p.rmdir()
            except OSError:
                break
        raise
    finally:
        source.close()
    return out
