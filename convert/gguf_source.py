"""Reading a Llama-architecture `.gguf` file (llama.cpp's format) with the `gguf` package.

Tensors are dequantized one at a time with `gguf.quants.dequantize` (no torch). Two layout facts:

* GGUF lists dimensions fastest-first (ne0 = columns), so a GGUF shape [in, out] is the numpy /
  HF nn.Linear shape [out, in]; `GGUFReader` already hands out the data in numpy order.
* llama.cpp's HF->GGUF converter permutes the rows of the q and k projections (per head, the
  rotate-half pairs (i, i + Dh/2) become interleaved pairs (2i, 2i + 1)) for its interleaved
  RoPE. `reverse_permute` undoes that, exactly as transformers' GGUF loader does
  (`LlamaTensorProcessor._reverse_permute_weights`), giving back the HF rotate-half layout
  this library's RoPE uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from convert.core import ConversionError, Entry, Source, TensorNaming, no_tokenizer_warning
from qspec_jax.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama",)
GGUF_MAGIC = b"GGUF"

GGUF_NAMES = TensorNaming(global_names={
    "token_embd.weight": ("embed", False),
    "output_norm.weight": ("final_norm", False),
    "output.weight": ("lm_head", True),
}, layer_names={
    "attn_norm.weight": ("layers/attn_norm", False),
    "ffn_norm.weight": ("layers/mlp_norm", False),
    "attn_q.weight": ("layers/wq", True),
    "attn_k.weight": ("layers/wk", True),
    "attn_v.weight": ("layers/wv", True),
    "attn_output.weight": ("layers/wo", True),
    "ffn_gate.weight": ("layers/w_gate", True),
    "ffn_up.weight": ("layers/w_up", True),
    "ffn_down.weight": ("layers/w_down", True),
}, layer_prefix="blk.{}.")


def is_gguf(path: Path) -> bool:
    """True for a file that starts with the GGUF magic (or is named *.gguf)."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation. w: [n_head * Dh, Din] (HF [out, in] layout)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _import_gguf() -> Any:
    try:
        import gguf  # noqa: F401
        from gguf import quants  # noqa: F401
    except ImportError as e:
        raise ConversionError(
            f"reading .gguf files needs the 'gguf' package ({e}); install it with "
            "pip install 'qspec-jax[gguf]'") from None
    return gguf


class _Fields:
    """Typed access to a GGUFReader's metadata, with errors that name the file and key."""

    def __init__(self, reader: Any, path: Path):
        self.reader, self.path = reader, path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:  # noqa: BLE001 - any decoding failure is a corrupt file
            raise ConversionError(f"{self.path}: cannot decode metadata {key} ({e})") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConversionError(f"{self.path}: GGUF metadata lacks required key {key}")
        return value


def hf_config_from_gguf(f: _Fields, tensor_names: set[str]) -> dict[str, Any]:
    """An HF-style config.json dict from GGUF metadata (then validated by ModelConfig.from_hf_dict)."""
    arch = f.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(
            f"{f.path}: unsupported GGUF architecture general.architecture={arch!r} "
            f"(expected {' or '.join(repr(a) for a in SUPPORTED_ARCHITECTURES)})")
    p = f"{arch}."
    if (f.get(p + "expert_count") or 0) > 0:
        raise ConversionError(f"{f.path}: {p}expert_count={f.get(p + 'expert_count')}: mixture-of-experts "
                              "models are not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ConversionError(
            f"{f.path}: has a rope_freqs.weight tensor (per-frequency RoPE factors, e.g. Llama 3.1 "
            "scaling baked into the GGUF), which this converter does not map back to a rope_scaling "
            "config; convert the original Hugging Face checkpoint instead")

    heads = int(f.require(p + "attention.head_count"))
    hidden = int(f.require(p + "embedding_length"))
    head_dim = int(f.get(p + "attention.key_length") or hidden // heads)
    v_dim = f.get(p + "attention.value_length")
    if v_dim is not None and int(v_dim) != head_dim:
        raise ConversionError(f"{f.path}: {p}attention.value_length={v_dim} differs from key_length="
                              f"{head_dim}; not supported")
    rot = f.get(p + "rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ConversionError(f"{f.path}: unsupported {p}rope.dimension_count={rot} (partial rotary; "
                              f"expected head_dim={head_dim})")

    tokens = f.reader.fields.get("tokenizer.ggml.tokens")
    vocab = f.get(p + "vocab_size")
    if vocab is None and tokens is not None:
        vocab = len(tokens.data)
    if vocab is None:
        raise ConversionError(f"{f.path}: cannot tell the vocabulary size (no {p}vocab_size and no "
                              "tokenizer.ggml.tokens)")

    eos = [f.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                              "tokenizer.ggml.eom_token_id")]
    hf: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(f.require(p + "feed_forward_length")),
        "num_hidden_layers": int(f.require(p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.get(p + "attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(f.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(f.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(f.get(p + "context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
    }
    if hf["bos_token_id"] is not None:
        hf["bos_token_id"] = int(hf["bos_token_id"])
    rope_type = f.get(p + "rope.scaling.type")
    if rope_type not in (None, "none"):
        hf["rope_scaling"] = {"rope_type": rope_type}
        if (factor := f.get(p + "rope.scaling.factor")) is not None:
            hf["rope_scaling"]["factor"] = float(factor)
        if (orig := f.get(p + "rope.scaling.original_context_length")) is not None:
            hf["rope_scaling"]["original_max_position_embeddings"] = int(orig)
    return hf


def open_gguf(path: Path, dtype: str, *, tokenizer: bool = True) -> Source:
    """Parses the GGUF metadata and tensor index; builds the tokenizer (transformers)."""
    gguf = _import_gguf()
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - GGUFReader raises assorted errors on bad files
        raise ConversionError(f"{path}: not a readable GGUF file (corrupt or truncated?): "
                              f"{type(e).__name__}: {e}") from None
    fields = _Fields(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    hf = hf_config_from_gguf(fields, set(tensors))
    cfg = ModelConfig.from_hf_dict(hf, source=f"{path} (GGUF metadata)", dtype=dtype)

    entries: list[Entry] = []
    unexpected: list[str] = []
    qtypes: set[str] = set()
    for name, t in tensors.items():
        resolved = GGUF_NAMES.resolve(name)
        if resolved is None:
            unexpected.append(name)
            continue
        target, layer, transpose = resolved
        n_perm = {"layers/wq": cfg.num_heads, "layers/wk": cfg.num_kv_heads}.get(target)
        shape = tuple(int(d) for d in reversed(list(t.shape)))  # GGUF order is fastest-first
        qtypes.add(t.tensor_type.name)

        def read(t: Any = t, shape: tuple[int, ...] = shape, n_perm: int | None = n_perm) -> np.ndarray:
            try:
                w = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise ConversionError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which "
                                      f"gguf cannot dequantize ({e})") from None
            w = np.asarray(w)
            if w.shape != shape and w.size == int(np.prod(shape)):
                w = w.reshape(shape)
            if n_perm is not None and w.shape == shape:
                w = reverse_permute(w, n_perm)
            return w

        entries.append(Entry(source_name=name, where=path.name, target=target, layer=layer,
                             shape=shape, transpose=transpose, read=read))
    if unexpected:
        raise ConversionError(
            f"{path}: unexpected tensor(s) not used by a llama model: " + ", ".join(unexpected[:8])
            + (f" (and {len(unexpected) - 8} more)" if len(unexpected) > 8 else ""))

    tok = None
    has_template = fields.get("tokenizer.chat_template") is not None
    warnings = []
    if tokenizer and "tokenizer.ggml.tokens" in reader.fields:
        tok = _gguf_tokenizer(path, reader)  # built now, before any tensor work, so a tokenizer problem fails fast
    elif tokenizer:
        warnings.append(no_tokenizer_warning(path, "no tokenizer metadata (tokenizer.ggml.tokens)"))

    return Source(cfg=cfg, entries=entries, source_name=GGUF_NAMES.source_name,
                  config_source=f"{path.name} (GGUF metadata)",
                  write_tokenizer=tok.save_pretrained if tok is not None else None,
                  tokenizer=(lambda: tok) if tok is not None else None, warnings=warnings,
                  extra={"source_format": "gguf", "source_tensor_types": sorted(qtypes),
                         "gguf_name": fields.get("general.name"), "chat_template": has_template})


# Byte-level BPE vocabularies whose pre-tokenizer is GPT-2's own regex (no custom split).
GPT2_REGEX_PRE_TYPES = (None, "default", "gpt2", "smollm")
GGUF_CONTROL_TOKEN = 3  # tokenizer.ggml.token_type of special (control) tokens


def _gguf_tokenizer(path: Path, reader: Any = None) -> Any:
    """The tokenizer rebuilt from the GGUF's tokenizer metadata (chat template included).
    `reader`: the file's open `gguf.GGUFReader`, if the caller has one (parsing SmolLM2's
    metadata takes ~6 s).

    Byte-level BPE files with GPT-2's pre-tokenizer (SmolLM2's kind) are rebuilt here with the
    `tokenizers` library, exactly as transformers rebuilds them but without torch, which its GGUF
    reader imports; other kinds go through transformers (and need torch).
    """
    try:
        return _byte_level_tokenizer(path, reader) or _transformers_gguf_tokenizer(path)
    except ConversionError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConversionError(f"{path}: cannot build a tokenizer from the GGUF metadata "
                              f"({type(e).__name__}: {e})") from None


def _byte_level_tokenizer(path: Path, reader: Any = None) -> Any:
    """transformers' byte-level BPE tokenizer for a "gpt2"-model GGUF, or None for other kinds.
    `reader`: the file's open `gguf.GGUFReader` (default: parse `path` again)."""
    import gguf

    from qspec_jax.tokenizer import import_transformers

    PreTrainedTokenizerFast = import_transformers().PreTrainedTokenizerFast

    reader = reader if reader is not None else gguf.GGUFReader(str(path))

    def get(key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    if get("tokenizer.ggml.model") != "gpt2" or get("tokenizer.ggml.pre") not in GPT2_REGEX_PRE_TYPES:
        return None
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, types = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.token_type") or []
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges") or []]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, kind in zip(tokens, types) if kind == GGUF_CONTROL_TOKEN])
    special = {name: tokens[i] for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                                                 ("pad_token", "padding"))
               if (i := get(f"tokenizer.ggml.{key}_token_id")) is not None}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, add_bos_token=bool(get("tokenizer.ggml.add_bos_token")),
                                  **special)
    template = get("tokenizer.chat_template")
    if template:
        tok.chat_template = template
    return tok


def _transformers_gguf_tokenizer(path: Path) -> Any:
    try:
        from qspec_jax.tokenizer import import_transformers

        return import_transformers().AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ImportError as e:
        raise ConversionError(f"{path}: building this GGUF's tokenizer needs transformers' GGUF support with torch "
                              f"({e}); pip install torch") from None
