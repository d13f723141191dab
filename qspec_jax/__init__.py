"""qspec-jax: QuantSpec-style self-speculative decoding for long-context LLMs in JAX/Pallas.

Data flow: convert (qspec-convert) -> load -> prefill -> (draft -> verify -> accept ->
commit/flush)* -> detokenize.

The public names below are imported on first use (PEP 562), so `import qspec_jax` and the
command-line tools start without importing jax: a Ctrl-C in a tool's first second is then
caught by the tool (one line, exit 130) instead of interrupting an import with a traceback.
"""

from importlib import import_module
from typing import Any

from qspec_jax.xla_flags import apply_recommended_xla_flags

apply_recommended_xla_flags()  # before any submodule can make JAX create its backend

# public name -> the submodule that defines it
_EXPORTS = {
    "CheckpointError": "checkpoint",
    "ConfigError": "config",
    "DenseKVCache": "cache",
    "GenerationConfig": "generation",
    "GenerationResult": "generation",
    "Model": "checkpoint",
    "ModelConfig": "config",
    "Params": "model",
    "QuantSpecCache": "cache",
    "SamplingConfig": "sampling",
    "cache_bytes": "cache",
    "decode": "model",
    "generate_autoregressive": "generation",
    "load": "checkpoint",
    "prefill": "model",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(f"qspec_jax.{_EXPORTS[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    try:  # a submodule (qspec_jax.sharding, qspec_jax.speculative, ...) used as an attribute
        return import_module(f"qspec_jax.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"qspec_jax.{name}":
            raise
    raise AttributeError(f"module 'qspec_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
