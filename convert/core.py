"""Format-independent part of the converter: the tensor plan, its validation, and the streaming fill.

A source reader (`convert.hf`, `convert.gguf_source`) turns its input into a `Source`: the
`ModelConfig` plus one `Entry` per source tensor saying where it goes ("layers/wq", layer 3,
transposed) and how to read it. `validate` checks the whole plan against
`qspec_jax.model.param_shapes(cfg)` from metadata alone, before any tensor data is touched, so a
bad input fails fast with one message that names the tensor. `fill` then streams the tensors
into preallocated output arrays, one at a time: peak host memory is about one copy of the output
plus one source tensor.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np

from convert.errors import ConversionError
from qspec_jax.config import ModelConfig
from qspec_jax.model import param_shapes

__all__ = ["OUTPUT_DTYPES", "ConversionError", "Entry", "Source", "TensorNaming", "fill", "no_tokenizer_warning",
           "validate"]

OUTPUT_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
_LIST_MAX = 8  # how many names an error message lists before "and N more"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One source tensor and where it lands in the flat params dict."""

    source_name: str  # its name in the source ("model.layers.0.self_attn.q_proj.weight")
    where: str  # the file it lives in, for messages
    target: str  # flat params name ("layers/wq")
    layer: int | None  # slice of the stacked [L, ...] target, None for unstacked tensors
    shape: tuple[int, ...]  # source shape, numpy order
    transpose: bool  # HF [out, in] -> our [in, out]
    read: Callable[[], np.ndarray]  # the tensor's values in `shape` (any float dtype)


@dataclasses.dataclass(frozen=True)
class TensorNaming:
    """A format's tensor names -> (flat target, transpose), and back.

    `global_names` are whole names; `layer_names` are suffixes after `layer_prefix`, a pattern
    with one "{}" for the layer index ("model.layers.{}.").
    """

    global_names: dict[str, tuple[str, bool]]
    layer_names: dict[str, tuple[str, bool]]
    layer_prefix: str

    def __post_init__(self) -> None:
        head, tail = self.layer_prefix.split("{}")
        object.__setattr__(self, "_layer_re", re.compile(rf"^{re.escape(head)}(\d+){re.escape(tail)}(.+)$"))
        by_target = {t: n for n, (t, _) in self.global_names.items()}
        by_target |= {t: self.layer_prefix + n for n, (t, _) in self.layer_names.items()}
        object.__setattr__(self, "_by_target", by_target)

    def resolve(self, name: str) -> tuple[str, int | None, bool] | None:
        """(target, layer or None, transpose) for a source tensor name; None if the model has no use for it."""
        if name in self.global_names:
            target, transpose = self.global_names[name]
            return target, None, transpose
        m = self._layer_re.match(name)
        if m and m.group(2) in self.layer_names:
            target, transpose = self.layer_names[m.group(2)]
            return target, int(m.group(1)), transpose
        return None

    def source_name(self, target: str, layer: int | None) -> str:
        """The source tensor name of flat target `target` (layer `layer`)."""
        name = self._by_target[target]
        return name if layer is None else name.format(layer)


@dataclasses.dataclass
class Source:
    """A parsed input: config, tensor plan, tokenizer writer and manifest extras."""

    cfg: ModelConfig
    entries: list[Entry]
    # (target, layer) -> the tensor name this format would use; for "missing tensor" messages.
    source_name: Callable[[str, int | None], str]
    config_source: str  # what the config was read from, for messages
    write_tokenizer: Callable[[Path], None] | None = None
    tokenizer: Callable[[], Any] | None = None  # loads the tokenizer object (calibration text)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)  # what the checkpoint will lack
    close: Callable[[], None] = lambda: None


def no_tokenizer_warning(src: Path, what: str) -> str:
    """The conversion warning for a source without a tokenizer: what will not work."""
    return (f"{src} has {what}: the checkpoint will have no tokenizer, so qspec-generate, qspec-eval-ppl and "
            "qspec-eval-accept will refuse it (they read and write text); the Python API works with token ids")


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LIST_MAX])
    return shown + (f" (and {len(names) - _LIST_MAX} more)" if len(names) > _LIST_MAX else "")


def expected_source_shape(cfg: ModelConfig, target: str, layer: int | None, transpose: bool) -> tuple[int, ...]:
    shape = param_shapes(cfg)[target]
    if layer is not None:
        shape = shape[1:]
    return tuple(reversed(shape)) if transpose else tuple(shape)


def _arch_summary(cfg: ModelConfig) -> str:
    return (f"vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}, "
            f"intermediate_size={cfg.intermediate_size}, num_layers={cfg.num_layers}, "
            f"num_heads={cfg.num_heads}, num_kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}")


def validate(src: Source) -> None:
    """Checks that the plan fills every expected tensor exactly once with the right shape."""
    cfg = src.cfg
    expected = param_shapes(cfg)
    seen: dict[tuple[str, int | None], Entry] = {}
    unexpected: list[str] = []
    for e in src.entries:
        if e.target not in expected:  # e.g. lm_head of a tied model never gets here
            unexpected.append(e.source_name)
            continue
        stacked = e.target.startswith("layers/")
        if stacked != (e.layer is not None) or (stacked and not 0 <= e.layer < cfg.num_layers):
            unexpected.append(f"{e.source_name} (the config has num_layers={cfg.num_layers})"
                              if stacked and e.layer is not None else e.source_name)
            continue
        key = (e.target, e.layer)
        if key in seen:
            raise ConversionError(
                f"tensor {e.source_name} appears twice ({seen[key].where} and {e.where})")
        seen[key] = e
    if unexpected:
        raise ConversionError(f"unexpected tensor(s) not used by a {cfg.model_type} model: {_listing(unexpected)}")

    missing = []
    for target, shape in expected.items():
        layers = range(cfg.num_layers) if target.startswith("layers/") else [None]
        missing += [src.source_name(target, i) for i in layers if (target, i) not in seen]
    if missing:
        raise ConversionError(
            f"missing tensor(s) {_listing(missing)} (required by {src.config_source}: "
            f"{_arch_summary(cfg)}, tie_word_embeddings={cfg.tie_word_embeddings})")

    for (target, layer), e in seen.items():
        want = expected_source_shape(cfg, target, layer, e.transpose)
        if tuple(e.shape) != want:
            raise ConversionError(
                f"tensor {e.source_name} in {e.where} has shape {tuple(e.shape)}, expected {want} "
                f"from {src.config_source} ({_arch_summary(cfg)})")


def fill(src: Source, *, progress: bool = True, desc: str = "converting",
         on_read: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray]:
    """Reads every entry into freshly allocated output arrays in `src.cfg.dtype`.

    `on_read(i, n)` is called after tensor i of n has been stored."""
    from tqdm import tqdm

    cfg = src.cfg
    dtype = OUTPUT_DTYPES[cfg.dtype]
    out = {name: np.empty(shape, dtype) for name, shape in param_shapes(cfg).items()}
    # Layer order within each tensor kind keeps file access roughly sequential.
    entries = sorted(src.entries, key=lambda e: (e.where, e.source_name))
    for i, e in enumerate(tqdm(entries, desc=desc, unit="tensor", file=sys.stderr, disable=not progress,
                               dynamic_ncols=True, leave=False)):
        try:
            arr = e.read()
        except ConversionError:
            raise
        except Exception as exc:  # a truncated/corrupt file surfaces here at the earliest
            raise ConversionError(f"cannot read tensor {e.source_name} from {e.where}: {exc}") from exc
        if tuple(arr.shape) != tuple(e.shape):
            raise ConversionError(
                f"tensor {e.source_name} in {e.where} decoded to shape {tuple(arr.shape)}, "
                f"its header says {tuple(e.shape)}")
        if not np.issubdtype(arr.dtype, np.floating) and arr.dtype != ml_dtypes.bfloat16:
            raise ConversionError(f"tensor {e.source_name} in {e.where} has non-float dtype {arr.dtype}")
        dst = out[e.target] if e.layer is None else out[e.target][e.layer]
        dst[...] = arr.T if e.transpose else arr  # casts to the output dtype in place
        del arr
        if on_read is not None:
            on_read(i, len(entries))
    return out
