"""Model configuration: what a Llama/Mistral checkpoint is, read from a HF `config.json`.

`ModelConfig` is frozen and hashable so it can be a static argument of `jax.jit`.
Anything the model code does not implement is refused here with an error that names the
field and its value, so an unsupported checkpoint never produces silently wrong logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ATTENTION_IMPLS = ("auto", "reference", "pallas", "mosaic", "triton")
PREFILL_ATTENTION_IMPLS = ("auto", "reference", "cudnn", "xla")  # qspec_jax.attention.prefill_attention
INT4_MATMUL_IMPLS = ("auto", "xla", "pallas", "mosaic", "triton", "interpret")  # qspec_jax.linear
DENSE_MATMUL_IMPLS = ("xla", "mosaic", "auto", "interpret")  # qspec_jax.linear ("interpret": the kernel's CPU twin)
NORM_IMPLS = ("auto", "xla", "mosaic", "interpret")  # qspec_jax.norm
DTYPES = ("bfloat16", "float32")


class ConfigError(ValueError):
    """A model configuration names something this library does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is one of SUPPORTED_ROPE_TYPES minus "default"."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, plus run-time choices (dtype, the kernels' implementations).

    Sizes: hidden D = `hidden_size`, query heads Hq = `num_heads`, KV heads Hkv = `num_kv_heads`,
    head dim Dh = `head_dim`, MLP width F = `intermediate_size`, L = `num_layers`, V = `vocab_size`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    # Run-time choices, not part of the architecture.
    dtype: str = "bfloat16"  # parameter and activation dtype; norms/softmax accumulate in float32
    attention_impl: str = "auto"  # "auto": Pallas kernel on GPU (Mosaic on Hopper), jnp reference elsewhere
    int4_matmul_impl: str = "auto"  # INT4 draft linears: "auto" (Mosaic on Hopper, Triton on older GPUs, XLA on CPU)
    # bf16 target linears in decode: "auto" (the Mosaic kernel on Hopper where the device has a measured launch shape
    # for the weight, cuBLAS elsewhere: `linear.dense_uses_kernel`), "xla" (cuBLAS on GPU), "mosaic" (Hopper kernel),
    # "interpret" (the kernel's CPU twin: tests)
    dense_matmul_impl: str = "auto"
    # Prompt attention: "auto" (cuDNN flash attention on a GPU where it takes the case, the jnp code elsewhere),
    # "cudnn", "reference" (jnp), "xla" (the flash path's split-and-merge through jax.nn's XLA attention: tests).
    prefill_attention_impl: str = "auto"
    # The decode layers' residual add + RMSNorm where no INT4 kernel takes it (the target's layers): "auto" (one
    # Mosaic kernel per norm on Hopper, XLA's elsewhere), "xla", "mosaic", "interpret" (the kernel on a CPU: tests).
    norm_impl: str = "auto"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE and nibble packing")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; expected one of {DTYPES}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(f"attention_impl={self.attention_impl!r}; expected one of {ATTENTION_IMPLS}")
        if self.int4_matmul_impl not in INT4_MATMUL_IMPLS:
            raise ConfigError(f"int4_matmul_impl={self.int4_matmul_impl!r}; expected one of {INT4_MATMUL_IMPLS}")
        if self.dense_matmul_impl not in DENSE_MATMUL_IMPLS:
            raise ConfigError(f"dense_matmul_impl={self.dense_matmul_impl!r}; expected one of {DENSE_MATMUL_IMPLS}")
        if self.norm_impl not in NORM_IMPLS:
            raise ConfigError(f"norm_impl={self.norm_impl!r}; expected one of {NORM_IMPLS}")
        if self.prefill_attention_impl not in PREFILL_ATTENTION_IMPLS:
            raise ConfigError(f"prefill_attention_impl={self.prefill_attention_impl!r}; expected one of "
                              f"{PREFILL_ATTENTION_IMPLS}")

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (the GQA group)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------- HF config
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], source: str = "config.json", **overrides: Any) -> "ModelConfig":
        """Builds a config from a HF `config.json` dict; `source` names the file in errors."""

        def bad(field: str, value: Any, expected: str) -> ConfigError:
            return ConfigError(f"{source}: unsupported {field}={value!r} (expected {expected})")

        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise bad("model_type", model_type, " or ".join(SUPPORTED_MODEL_TYPES))
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag, False):
                raise bad(flag, hf[flag], "false")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise bad("hidden_act", act, "'silu'")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise bad("pretraining_tp", hf["pretraining_tp"], "1")

        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if hf.get(k) is None]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {missing}")

        num_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // num_heads

        # transformers >= 5 writes `rope_parameters`; older versions `rope_theta` + `rope_scaling`.
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        rope.update({k: v for k, v in legacy.items() if k not in rope})
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise bad("rope_scaling.rope_type", rope_type, " or ".join(SUPPORTED_ROPE_TYPES))
        scaling = None
        if rope_type != "default":
            if "factor" not in rope:
                raise ConfigError(f"{source}: rope_scaling of type {rope_type!r} has no 'factor'")
            scaling = RopeScaling(
                rope_type=rope_type,
                factor=float(rope["factor"]),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
            )

        eos = hf.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
        window = hf.get("sliding_window") if model_type == "mistral" else None
        if hf.get("use_sliding_window") is False:
            window = None

        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window else None,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=model_type,
            **overrides,
        )

    @classmethod
    def from_hf_file(cls, path: str | Path, **overrides: Any) -> "ModelConfig":
        path = Path(path)
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(hf, source=str(path), **overrides)

    # ---------------------------------------------------------------------- own serialization
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "config") -> "ModelConfig":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown field(s) {unknown}")
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)
