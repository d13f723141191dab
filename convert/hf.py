"""Reading a Hugging Face model directory (config.json + *.safetensors + tokenizer files).

No torch: tensors come from `convert.safetensors_io`, memory-mapped.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from convert.core import ConversionError, Entry, Source, TensorNaming, no_tokenizer_warning
from convert.safetensors_io import DTYPES, SafetensorsFile
from qspec_jax.config import ModelConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# Files copied into the checkpoint's tokenizer/ directory when present.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
    "vocab.txt", "spiece.model", "generation_config.json",
)
# Files that actually define a tokenizer (generation_config.json alone does not).
_TOKENIZER_DEFINING = set(TOKENIZER_FILES) - {"generation_config.json", "chat_template.jinja",
                                               "chat_template.json"}

# HF name -> (flat target, transpose)
HF_NAMES = TensorNaming(global_names={
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}, layer_names={
    "input_layernorm.weight": ("layers/attn_norm", False),
    "post_attention_layernorm.weight": ("layers/mlp_norm", False),
    "self_attn.q_proj.weight": ("layers/wq", True),
    "self_attn.k_proj.weight": ("layers/wk", True),
    "self_attn.v_proj.weight": ("layers/wv", True),
    "self_attn.o_proj.weight": ("layers/wo", True),
    "mlp.gate_proj.weight": ("layers/w_gate", True),
    "mlp.up_proj.weight": ("layers/w_up", True),
    "mlp.down_proj.weight": ("layers/w_down", True),
}, layer_prefix="model.layers.{}.")
_IGNORED_RE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # non-persistent buffers of old exports


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise ConversionError(f"{path}: cannot read ({e.strerror or e})") from None


def _eos_ids(value: Any) -> list[int]:
    items = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in items if v is not None]


def _weight_files(src: Path) -> list[Path]:
    index = src / INDEX
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{index}: no 'weight_map' in the shard index")
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not (src / f).is_file()]
        if absent:
            raise ConversionError(f"{index} names shard file(s) that do not exist: {', '.join(absent)}")
        return [src / f for f in files]
    if (src / SINGLE).is_file():
        return [src / SINGLE]
    found = sorted(src.glob("*.safetensors"))
    if found:
        return found
    legacy = sorted(p.name for p in src.glob("*.bin")) + sorted(p.name for p in src.glob("*.pt*"))
    hint = (f"; it has PyTorch weights ({', '.join(legacy)}): re-save them with "
            "save_pretrained(..., safe_serialization=True)") if legacy else ""
    raise ConversionError(f"{src}: no *.safetensors weights found{hint}")


def open_hf_dir(src: Path, dtype: str) -> Source:
    """Parses config, shard headers and tokenizer files of the HF directory `src` (no tensor data)."""
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        ggufs = sorted(p.name for p in src.glob("*.gguf"))
        hint = f"; to convert a GGUF file pass it directly, e.g. {src / ggufs[0]}" if ggufs else ""
        raise ConversionError(f"{src}: no config.json (expected a Hugging Face model directory or a "
                              f".gguf file){hint}")
    hf = _read_json(cfg_path)
    if not isinstance(hf, dict):
        raise ConversionError(f"{cfg_path}: expected a JSON object")
    cfg = ModelConfig.from_hf_dict(hf, source=str(cfg_path), dtype=dtype)

    gen_path = src / "generation_config.json"
    if gen_path.is_file():
        gen = _read_json(gen_path)
        extra_eos = _eos_ids(gen.get("eos_token_id")) if isinstance(gen, dict) else []
        merged = list(cfg.eos_token_ids) + [e for e in extra_eos if e not in cfg.eos_token_ids]
        cfg = cfg.replace(eos_token_ids=tuple(dict.fromkeys(merged)))

    files = _weight_files(src)
    shards = [SafetensorsFile(f) for f in files]  # parses and validates every header now
    entries: list[Entry] = []
    unexpected: list[str] = []
    dtypes: set[str] = set()
    for shard in shards:
        for name, info in shard.tensors.items():
            if _IGNORED_RE.search(name):
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # HF ties it to the embedding at load time, whatever the file holds
            resolved = HF_NAMES.resolve(name)
            if resolved is None:
                unexpected.append(f"{name} (in {shard.path.name})")
                continue
            target, layer, transpose = resolved
            if info.dtype not in DTYPES:
                raise ConversionError(f"tensor {name} in {shard.path.name} has dtype {info.dtype}; "
                                      f"supported: {', '.join(DTYPES)}")
            dtypes.add(info.dtype)
            entries.append(Entry(source_name=name, where=shard.path.name, target=target, layer=layer,
                                 shape=info.shape, transpose=transpose,
                                 read=(lambda s=shard, n=name: s.get(n))))
    if unexpected:
        raise ConversionError(
            f"unexpected tensor(s) not used by a {cfg.model_type} model: " + ", ".join(unexpected[:8])
            + (f" (and {len(unexpected) - 8} more)" if len(unexpected) > 8 else ""))

    tok_files = [src / f for f in TOKENIZER_FILES if (src / f).is_file()]

    def copy_tokenizer(dst: Path) -> None:
        for p in tok_files:
            shutil.copy2(p, dst / p.name)

    # Without a file that defines a tokenizer, write none (load() would fail on an empty one).
    write_tokenizer = copy_tokenizer if any(p.name in _TOKENIZER_DEFINING for p in tok_files) else None
    warnings = [] if write_tokenizer else [no_tokenizer_warning(
        src, "no tokenizer files (tokenizer.json, tokenizer.model, ...)")]

    def load_tokenizer() -> Any:
        from qspec_jax.tokenizer import import_transformers

        return import_transformers().AutoTokenizer.from_pretrained(src)

    def close() -> None:
        for s in shards:
            s.close()

    return Source(cfg=cfg, entries=entries, source_name=HF_NAMES.source_name, config_source=str(cfg_path),
                  write_tokenizer=write_tokenizer, tokenizer=load_tokenizer if write_tokenizer else None,
                  warnings=warnings, close=close,
                  extra={"source_format": "hf", "source_dtypes": sorted(dtypes),
                         "source_files": [f.name for f in files],
                         "tokenizer_files": [p.name for p in tok_files] if write_tokenizer else []})
