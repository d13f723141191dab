"""The converted-checkpoint format, and `load` which turns one into a `Model`.

A checkpoint directory holds:

    qspec_checkpoint.json   format stamp: {"format_version", "library", "source", "dtype", ...}
    model_config.json       ModelConfig.to_dict()
    params/                 orbax-checkpoint of the nested params tree (numpy arrays)
    tokenizer/              the tokenizer files (loadable with transformers.AutoTokenizer)

`write_checkpoint_into` fills a directory; `qspec-convert` (convert.output) gives it a hidden
staging directory next to OUT and renames that into place at the end, so a failed or
interrupted conversion leaves no checkpoint behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax import model as M
from qspec_jax.config import ModelConfig
from qspec_jax.weight_quant import DraftWeightsConfig, QuantizedWeight, folded_norms, with_unit_norms

FORMAT_VERSION = 1
MANIFEST = "qspec_checkpoint.json"
MODEL_CONFIG = "model_config.json"
PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, stale or inconsistent."""


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{"layers/wq": x} -> {"layers": {"wq": x}}."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Inverse of `nest`."""
    flat = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            flat.update(flatten(v, f"{prefix}{k}/"))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def draft_weight_shapes(cfg: ModelConfig, draft: DraftWeightsConfig) -> dict[str, tuple[int, ...]]:
    """[..., Din, Dout] of every weight the draft quantizes ("layers/wq": [L, D, Hq*Dh], ...,
    "lm_head": [D, V], which for a tied model is the embedding transposed)."""
    from qspec_jax.weight_quant import DRAFT_SCOPES

    shapes = {f"layers/{n}": M.param_shapes(cfg)[f"layers/{n}"] for n in DRAFT_SCOPES[draft.scope]}
    if draft.lm_head:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return shapes


def draft_group_problems(cfg: ModelConfig, draft: DraftWeightsConfig) -> list[str]:
    """The quantized weights whose input dimension draft.group_size does not divide, as
    "layers/wq (input dim 32)"; empty when the draft can be made."""
    return sorted(f"{name} (input dim {shape[-2]})" for name, shape in draft_weight_shapes(cfg, draft).items()
                  if shape[-2] % draft.group_size)


def draft_to_flat(draft: M.Params) -> dict[str, np.ndarray]:
    """The quantized tensors of draft params as {"draft/layers/wq/packed": ..., ...}."""
    flat = {}
    named = [(f"layers/{n}", getattr(draft.layers, n)) for n in M.LINEAR_NAMES] + [("lm_head", draft.lm_head)]
    for name, w in named:
        if isinstance(w, QuantizedWeight):
            for part in ("packed", "scale", "zero"):
                flat[f"draft/{name}/{part}"] = np.asarray(getattr(w, part))
    return flat


def draft_from_flat(params: M.Params, flat: dict[str, Any], unit_norms: tuple[str, ...] = ()) -> M.Params:
    """Draft params: `params` with the linears found under "draft/..." replaced by INT4 weights,
    and the norm weights `unit_norms` (those the stored draft folded into its weights,
    `weight_quant.folded_norms`) by ones."""
    quantized = {}
    for key in flat:
        if key.startswith("draft/") and key.endswith("/packed"):
            name = key[len("draft/"):-len("/packed")]
            quantized[name] = QuantizedWeight(**{p: jnp.asarray(flat[f"draft/{name}/{p}"])
                                                 for p in ("packed", "scale", "zero")})
    layers = params.layers.replace(**{n.split("/", 1)[1]: w for n, w in quantized.items() if n.startswith("layers/")})
    return with_unit_norms(params.replace(layers=layers, lm_head=quantized.get("lm_head", params.lm_head)), unit_norms)


def write_checkpoint_into(dst: str | Path, cfg: ModelConfig, flat_params: dict[str, np.ndarray], *,
                          source: str, write_tokenizer: Callable[[Path], None] | None = None,
                          extra: dict[str, Any] | None = None,
                          on_stage: Callable[[str], None] | None = None) -> None:
    """Writes a checkpoint's files into the existing, empty directory `dst`.

    The caller makes the result appear atomically (renames `dst` into place) and removes `dst`
    on failure. `write_tokenizer(dir)` saves the tokenizer files into `dir`; `extra` goes into
    the manifest. `on_stage("write")` is called while orbax's background commit may still be
    writing (tests interrupt the conversion there). When this returns or raises, nothing
    writes into `dst` any more: orbax's commit thread has been waited for.
    """
    import orbax.checkpoint as ocp

    dst = Path(dst).absolute()  # orbax wants absolute paths
    (dst / MODEL_CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2))
    ckpt = ocp.StandardCheckpointer()
    try:
        ckpt.save(dst / PARAMS_DIR, nest(flat_params))  # returns while a background thread commits
        if on_stage is not None:
            on_stage("write")
        ckpt.wait_until_finished()
    finally:
        ckpt.close()  # waits for the commit thread on any exception too, before dst can be removed
    if write_tokenizer is not None:
        (dst / TOKENIZER_DIR).mkdir()
        write_tokenizer(dst / TOKENIZER_DIR)
    manifest = {"format_version": FORMAT_VERSION, "library": "qspec-jax", "source": source,
                "dtype": cfg.dtype, **(extra or {})}
    (dst / MANIFEST).write_text(json.dumps(manifest, indent=2))  # written last: marks completeness


def read_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if path.suffix.lower() == ".gguf" or magic == b"GGUF":
            raise CheckpointError(f"{path}: a .gguf file, not a converted checkpoint; convert it once with "
                                  f"`qspec-convert {path} OUT` and pass the directory OUT")
        raise CheckpointError(f"{path}: a file, not a checkpoint directory (qspec-convert writes a directory)")
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    mf = path / MANIFEST
    if not mf.is_file():
        raise CheckpointError(f"{path}: not a qspec-jax checkpoint (no {MANIFEST}); convert it with qspec-convert")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mf}: not valid JSON ({e}); re-run qspec-convert") from None
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{mf}: format_version={version!r}, this qspec-jax reads format_version={FORMAT_VERSION}; "
            "re-run qspec-convert on the original model")
    return manifest


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: config, target params, tokenizer, and (optionally) INT4 draft params
    together with the settings they were made with."""

    config: ModelConfig
    params: M.Params
    tokenizer: Any = None
    draft_params: M.Params | None = None
    draft_weights_config: DraftWeightsConfig | None = None
    path: Path | None = None

    def with_draft_weights(self, cfg: DraftWeightsConfig = DraftWeightsConfig(), *,
                           progress: bool = False) -> "Model":
        """This model with INT4 draft weights made by `cfg`: the stored ones (this very object)
        when they were made with `cfg`, else made now (on the target's mesh, if any) by
        `calibration.make_draft`: a calibrated method (the default, GPTQ) calibrates on the
        built-in text through this model's tokenizer (random token ids without one), which
        takes a while on a CPU (`progress`: tqdm bars)."""
        if self.draft_weights_config == cfg and self.draft_params is not None:
            return self
        from qspec_jax.calibration import make_draft

        draft, _ = make_draft(M.unfuse_projections(self.params), cfg, tokenizer=self.tokenizer, progress=progress)
        if self.params.mesh is not None:
            from qspec_jax.sharding import shard_params

            draft = shard_params(draft, self.params.mesh, cfg.group_size)
        return dataclasses.replace(self, draft_params=M.for_device(draft), draft_weights_config=cfg)

    def require_tokenizer(self) -> Any:
        """The tokenizer; CheckpointError naming the checkpoint when there is none."""
        if self.tokenizer is not None:
            return self.tokenizer
        if self.path is not None and (self.path / TOKENIZER_DIR).is_dir():
            raise CheckpointError(f"{self.path}: loaded with tokenizer=False; load it with tokenizer=True "
                                  "to encode or decode text")
        where = f"the checkpoint {self.path}" if self.path is not None else "this model"
        fix = (f" (re-convert from a model that has tokenizer files, or save a tokenizer into "
               f"{self.path / TOKENIZER_DIR})" if self.path is not None else "")
        raise CheckpointError(f"{where} has no tokenizer: it was converted from a model without tokenizer "
                              f"files, so it can only be used with token ids{fix}")

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of `text`; with `chat`, wrapped in the tokenizer's chat template as a user turn."""
        tok = self.require_tokenizer()
        if chat:
            if not getattr(tok, "chat_template", None):
                raise CheckpointError(f"{self.path or 'this model'}: the tokenizer has no chat template; "
                                      "pass the prompt without chat formatting")
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
            return list(tok.encode(text, add_special_tokens=False))
        return list(tok.encode(text))

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        """The text of token ids (a flat list or 1-D array); ValueError for an id outside the
        model's vocabulary [0, vocab_size), which the tokenizer would decode to nothing or fail on."""
        tok = self.require_tokenizer()
        arr = np.asarray(ids)
        if arr.size == 0:
            return ""
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"decode: expected a flat list of integer token ids, got "
                             f"{'shape ' + str(arr.shape) if arr.ndim != 1 else 'dtype ' + str(arr.dtype)}")
        bad = arr[(arr < 0) | (arr >= self.config.vocab_size)]
        if bad.size:
            raise ValueError(f"decode: token id {int(bad[0])} is outside the model's vocabulary "
                             f"[0, {self.config.vocab_size})")
        return tok.decode(arr.tolist(), skip_special_tokens=skip_special_tokens)


def _cast(x: np.ndarray, dtype: Any) -> jax.Array:
    """Floating arrays to `dtype`; integer arrays (packed codes) unchanged."""
    if np.issubdtype(x.dtype, np.floating) or x.dtype == jnp.bfloat16:
        return jnp.asarray(x, dtype=dtype)
    return jnp.asarray(x)


def device_dtype() -> str:
    """The compute dtype `dtype="auto"` picks: "float32" on a CPU, "bfloat16" on a GPU or TPU.

    A CPU has no bfloat16 arithmetic to gain from, and bfloat16 rounding decides near-tied
    greedy choices (SmolLM2's first answer token to "What is the capital of France?": float32
    logits 25.325 for "The" and 25.243 for "L", less than one bfloat16 step apart); on a GPU,
    bfloat16 halves the bytes every decode step reads, which is what decoding is bound by there.
    """
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load(path: str | Path, *, dtype: str | None = None, attention_impl: str | None = None,
         tokenizer: bool = True, mesh: Any = None) -> Model:
    """Loads a converted checkpoint.

    dtype: None keeps the stored dtype; "bfloat16" or "float32" computes in that dtype (e.g.
    float32 for tests); "auto" is `device_dtype()`: float32 on a CPU, bfloat16 on a GPU.
    attention_impl: "auto" | "reference" | "pallas" (see ModelConfig); mesh: a tensor-parallel
    mesh (`qspec_jax.sharding.make_mesh`) to lay the weights out on.
    """
    import orbax.checkpoint as ocp

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load: path must be a checkpoint directory (str or os.PathLike), got "
                        f"{type(path).__name__} {path!r}")
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"load: mesh must be a jax.sharding.Mesh (qspec_jax.sharding.make_mesh(n)) or None, got "
                        f"{type(mesh).__name__}")
    if dtype not in (None, "auto", "bfloat16", "float32"):
        raise ValueError(f"load: dtype={dtype!r}; expected None (the stored dtype), 'auto', 'bfloat16' or 'float32'")
    dtype = device_dtype() if dtype == "auto" else dtype
    path = Path(path).absolute()
    manifest = read_manifest(path)
    overrides = {k: v for k, v in (("dtype", dtype), ("attention_impl", attention_impl)) if v}
    for name in (MODEL_CONFIG, PARAMS_DIR):
        if not (path / name).exists():
            raise CheckpointError(f"{path / name}: missing; the checkpoint is incomplete: re-run qspec-convert")
    try:
        config_dict = json.loads((path / MODEL_CONFIG).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / MODEL_CONFIG}: not valid JSON ({e}); re-run qspec-convert") from None
    cfg = ModelConfig.from_dict(config_dict, source=str(path / MODEL_CONFIG))
    cfg = cfg.replace(**overrides)
    flat = flatten(ocp.StandardCheckpointer().restore(path / PARAMS_DIR))
    expected = M.param_shapes(cfg)
    target_flat = {k: v for k, v in flat.items() if not k.startswith("draft/")}
    problems = [f"missing {k}" for k in sorted(set(expected) - set(target_flat))]
    problems += [f"unexpected {k}" for k in sorted(set(target_flat) - set(expected))]
    problems += [f"{k}: shape {tuple(target_flat[k].shape)}, expected {s}"
                 for k, s in expected.items() if k in target_flat and tuple(target_flat[k].shape) != s]
    if problems:
        raise CheckpointError(f"{path / PARAMS_DIR}: " + "; ".join(problems))
    jdtype = jnp.dtype(cfg.dtype)
    params = M.params_from_flat(cfg, {k: _cast(v, jdtype) for k, v in target_flat.items()})
    draft, draft_cfg = None, None
    if manifest.get("draft_weights"):
        # a manifest written before `fold_norms` existed describes an unfolded draft
        draft_cfg = DraftWeightsConfig(**{"fold_norms": False, **manifest["draft_weights"]})
        draft = draft_from_flat(params, flat, folded_norms(draft_cfg))
    tok = None
    if tokenizer and (path / TOKENIZER_DIR).is_dir():
        from qspec_jax.tokenizer import TokenizerError, load_tokenizer

        try:
            tok = load_tokenizer(path / TOKENIZER_DIR)
        except TokenizerError as e:
            raise CheckpointError(str(e)) from None
    model = Model(config=cfg, params=params, tokenizer=tok, draft_params=draft, draft_weights_config=draft_cfg,
                  path=path)
    if mesh is not None:
        from qspec_jax.sharding import shard

        model = shard(model, mesh)
    else:  # once, here: this device's layout (fused projections on a GPU, the INT4 kernel's packing)
        model = dataclasses.replace(model, params=M.for_device(params),
                                    draft_params=None if draft is None else M.for_device(draft))
    return model
