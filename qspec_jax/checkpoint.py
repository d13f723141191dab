"""The converted-checkpoint format, and `load` which turns one into a `Model`.

A checkpoint directory holds:

    qspec_checkpoint.json   format stamp: {"format_version", "library", "source", "dtype", ...}
    model_config.json       ModelConfig.to_dict()
    params/                 orbax-checkpoint of the nested params tree (numpy arrays)
    tokenizer/              the tokenizer files (loadable with transformers.AutoTokenizer)

It is written into a temporary sibling directory and renamed into place at the end, so a failed
or interrupted conversion leaves no checkpoint behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax import model as M
from qspec_jax.config import ModelConfig
from qspec_jax.weight_quant import DraftWeightsConfig, QuantizedWeight, make_draft_params

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


def draft_to_flat(draft: M.Params) -> dict[str, np.ndarray]:
    """The quantized tensors of draft params as {"draft/layers/wq/packed": ..., ...}."""
    flat = {}
    named = [(f"layers/{n}", getattr(draft.layers, n)) for n in M.LINEAR_NAMES] + [("lm_head", draft.lm_head)]
    for name, w in named:
        if isinstance(w, QuantizedWeight):
            for part in ("packed", "scale", "zero"):
                flat[f"draft/{name}/{part}"] = np.asarray(getattr(w, part))
    return flat


def draft_from_flat(params: M.Params, flat: dict[str, Any]) -> M.Params:
    """Draft params: `params` with the linears found under "draft/..." replaced by INT4 weights."""
    quantized = {}
    for key in flat:
        if key.startswith("draft/") and key.endswith("/packed"):
            name = key[len("draft/"):-len("/packed")]
            quantized[name] = QuantizedWeight(**{p: jnp.asarray(flat[f"draft/{name}/{p}"])
                                                 for p in ("packed", "scale", "zero")})
    layers = params.layers.replace(**{n.split("/", 1)[1]: w for n, w in quantized.items() if n.startswith("layers/")})
    return params.replace(layers=layers, lm_head=quantized.get("lm_head", params.lm_head))


def write_checkpoint(out: str | Path, cfg: ModelConfig, flat_params: dict[str, np.ndarray], *,
                     source: str, write_tokenizer: Callable[[Path], None] | None = None,
                     extra: dict[str, Any] | None = None) -> Path:
    """Atomically writes a checkpoint to `out`, which must not exist yet.

    `write_tokenizer(dir)` saves the tokenizer files into `dir`. `extra` goes into the manifest.
    """
    out = Path(out).absolute()  # orbax wants absolute paths
    if out.exists():
        raise CheckpointError(f"{out}: already exists; remove it or choose another output directory")
    created = [p for p in reversed(out.parents) if not p.exists()]  # parents this call makes
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        import orbax.checkpoint as ocp

        (tmp / MODEL_CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2))
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(tmp / PARAMS_DIR, nest(flat_params))
        ckpt.wait_until_finished()
        if write_tokenizer is not None:
            (tmp / TOKENIZER_DIR).mkdir()
            write_tokenizer(tmp / TOKENIZER_DIR)
        manifest = {"format_version": FORMAT_VERSION, "library": "qspec-jax", "source": source,
                    "dtype": cfg.dtype, **(extra or {})}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))  # written last: marks completeness
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it 0700
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in reversed(created):  # innermost first; only if still empty
            try:
                p.rmdir()
            except OSError:
                break
        raise
    return out


def read_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
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

    def with_draft_weights(self, cfg: DraftWeightsConfig = DraftWeightsConfig()) -> "Model":
        """This model with INT4 draft weights made by `cfg` (reused if they already match)."""
        if self.draft_weights_config == cfg and self.draft_params is not None:
            return self
        return dataclasses.replace(self, draft_params=make_draft_params(self.params, cfg), draft_weights_config=cfg)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of `text`; with `chat`, wrapped in the tokenizer's chat template as a user turn."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        if chat:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _cast(x: np.ndarray, dtype: Any) -> jax.Array:
    """Floating arrays to `dtype`; integer arrays (packed codes) unchanged."""
    if np.issubdtype(x.dtype, np.floating) or x.dtype == jnp.bfloat16:
        return jnp.asarray(x, dtype=dtype)
    return jnp.asarray(x)


def load(path: str | Path, *, dtype: str | None = None, attention_impl: str | None = None,
         tokenizer: bool = True, mesh: Any = None) -> Model:
    """Loads a converted checkpoint.

    dtype: "bfloat16" or "float32" to override the stored dtype (e.g. float32 for tests);
    attention_impl: "auto" | "reference" | "pallas" (see ModelConfig); mesh: a tensor-parallel
    mesh (`qspec_jax.sharding.make_mesh`) to lay the weights out on.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    manifest = read_manifest(path)
    overrides = {k: v for k, v in (("dtype", dtype), ("attention_impl", attention_impl)) if v}
    cfg = ModelConfig.from_dict(json.loads((path / MODEL_CONFIG).read_text()), source=str(path / MODEL_CONFIG))
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
        draft_cfg = DraftWeightsConfig(**manifest["draft_weights"])
        draft = draft_from_flat(params, flat)
    tok = None
    if tokenizer and (path / TOKENIZER_DIR).is_dir():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path / TOKENIZER_DIR)
    model = Model(config=cfg, params=params, tokenizer=tok, draft_params=draft, draft_weights_config=draft_cfg,
                  path=path)
    if mesh is not None:
        from qspec_jax.sharding import shard

        model = shard(model, mesh)
    return model
