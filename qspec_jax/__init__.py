"""qspec-jax: QuantSpec-style self-speculative decoding for long-context LLMs in JAX/Pallas.

Data flow: convert (qspec-convert) -> load -> prefill -> (draft -> verify -> accept ->
commit/flush)* -> detokenize.
"""

from qspec_jax.xla_flags import apply_recommended_xla_flags

apply_recommended_xla_flags()  # before any submodule can make JAX create its backend

from qspec_jax.cache import DenseKVCache, QuantSpecCache, cache_bytes
from qspec_jax.checkpoint import CheckpointError, Model, load
from qspec_jax.config import ConfigError, ModelConfig
from qspec_jax.generation import GenerationConfig, GenerationResult, generate_autoregressive
from qspec_jax.model import Params, decode, prefill
from qspec_jax.sampling import SamplingConfig

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DenseKVCache",
    "GenerationConfig",
    "GenerationResult",
    "Model",
    "ModelConfig",
    "Params",
    "QuantSpecCache",
    "SamplingConfig",
    "cache_bytes",
    "decode",
    "generate_autoregressive",
    "load",
    "prefill",
]
