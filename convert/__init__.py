"""qspec-convert: Hugging Face safetensors directories and Llama GGUF files -> qspec-jax checkpoints.

    qspec-convert SRC OUT [--dtype bfloat16|float32] [--draft-weights int4|none] [--draft-group G ...]
    python -m convert SRC OUT
    convert.convert(src, out, dtype="bfloat16", draft_weights=None) -> Path

No torch is needed to read tensors: safetensors are memory-mapped by `convert.safetensors_io`,
GGUF tensors are dequantized by the `gguf` package (the `qspec-jax[gguf]` extra).
Modules: `api` (convert, convert_into, open_source, estimate_bytes), `core` (plan validation and
streaming fill), `output` (OUT checks, staging directory, commit; jax-free), `hf`, `gguf_source`,
`safetensors_io`, `cli` (the command: checks OUT, supervises `worker`, which converts).
"""

from typing import Any

from convert.errors import ConversionError

__all__ = ["ConversionError", "convert", "open_source"]


def __getattr__(name: str) -> Any:
    # Lazy, so `qspec-convert --help` and `import convert.cli` do not pay for importing jax.
    if name in ("convert", "open_source"):
        from convert import api

        return getattr(api, name)
    raise AttributeError(f"module 'convert' has no attribute {name!r}")
