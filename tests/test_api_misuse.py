"""The Python API refuses misuse a newcomer tries in the first hour with an exception that says
what was expected (issue 25's list): token ids outside the vocabulary, an int as a PRNG key, a
missing or wrong config, a path or mesh of the wrong type, a cache group that is not a power of
two, a mesh larger than the machine, named as the API (not as a CLI flag) names it, a
prefill timing with nowhere to report, and token arrays of the wrong rank for the model's passes."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import qspec_jax
from qspec_jax import GenerationConfig, QuantSpecCache, generate_autoregressive
from qspec_jax.speculative import SpecConfig, generate


@pytest.fixture(scope="module")
def model(tiny_chat_checkpoint: Path):
    return qspec_jax.load(tiny_chat_checkpoint)


@pytest.mark.parametrize("ids, bad", [([-1], -1), ([65, 10**6], 10**6), ([272], 272)])
def test_decode_refuses_ids_outside_the_vocabulary(model, ids: list[int], bad: int) -> None:
    """-1 raised OverflowError deep in the tokenizer and 10**6 decoded silently to ""."""
    with pytest.raises(ValueError, match=rf"decode: token id {bad} is outside the model's vocabulary \[0, 272\)"):
        model.decode(ids)


def test_decode_accepts_arrays_and_the_whole_vocabulary(model) -> None:
    ids = model.encode("Hi")
    assert model.decode(ids) == "Hi"
    assert model.decode(jnp.asarray(ids, jnp.int32)) == "Hi"  # a row of a result, as an array
    assert model.decode([]) == ""
    assert isinstance(model.decode([271]), str)  # the model's last id (a padding row of the vocabulary)
    with pytest.raises(ValueError, match=r"decode: expected a flat list of integer token ids, got shape \(1, 2\)"):
        model.decode([[72, 105]])


@pytest.mark.parametrize("fn, cfg", [(generate, SpecConfig(max_new_tokens=2)),
                                     (generate_autoregressive, GenerationConfig(max_new_tokens=2))])
def test_int_key_is_refused(model, fn, cfg) -> None:
    ids = model.encode("hi")
    with pytest.raises(TypeError, match=rf"{fn.__name__}: key must be a JAX PRNG key such as "
                                        r"jax.random.PRNGKey\(0\), got int 0"):
        fn(model, [ids], cfg, 0)
    with pytest.raises(TypeError, match=r"got float32\[2\]"):
        fn(model, [ids], cfg, jnp.zeros((2,), jnp.float32))


def test_typed_and_raw_keys_are_accepted() -> None:
    """jax.random.PRNGKey(seed) (uint32[2]) and a typed jax.random.key(seed) both pass, unchanged."""
    from qspec_jax.generation import prng_key

    raw, typed = jax.random.PRNGKey(3), jax.random.key(3)
    assert prng_key(raw, "generate") is raw and prng_key(typed, "generate") is typed
    assert (prng_key(None, "generate") == jax.random.PRNGKey(0)).all()
    with pytest.raises(TypeError, match=r"generate: key must be a JAX PRNG key .* got uint32\[3\]"):
        prng_key(jnp.zeros((3,), jnp.uint32), "generate")


def test_wrong_config_is_refused(model) -> None:
    ids = model.encode("hi")
    with pytest.raises(TypeError, match=r"generate: config must be a SpecConfig, got NoneType"):
        generate(model, [ids], None)
    with pytest.raises(TypeError, match=r"got GenerationConfig \(GenerationConfig is for generate_autoregressive\)"):
        generate(model, [ids], GenerationConfig())
    with pytest.raises(TypeError, match=r"generate_autoregressive: config must be a GenerationConfig, got SpecConfig "
                                        r"\(SpecConfig is for speculative.generate\)"):
        generate_autoregressive(model, [ids], SpecConfig())


def test_load_refuses_wrong_types(tiny_chat_checkpoint: Path) -> None:
    with pytest.raises(TypeError, match=r"load: path must be a checkpoint directory \(str or os.PathLike\), got int 123"):
        qspec_jax.load(123)
    with pytest.raises(TypeError, match=r"load: mesh must be a jax.sharding.Mesh .* got int"):
        qspec_jax.load(tiny_chat_checkpoint, mesh=2)
    with pytest.raises(ValueError, match=r"load: dtype='fp16'; expected None \(the stored dtype\), 'auto'"):
        qspec_jax.load(tiny_chat_checkpoint, dtype="fp16")


def test_load_dtype_auto_is_float32_on_a_cpu(tiny_chat_checkpoint: Path) -> None:
    from qspec_jax.checkpoint import device_dtype

    assert jax.default_backend() == "cpu" and device_dtype() == "float32"
    assert qspec_jax.load(tiny_chat_checkpoint, dtype="auto").config.dtype == "float32"
    assert qspec_jax.load(tiny_chat_checkpoint, dtype="bfloat16").config.dtype == "bfloat16"


def test_make_mesh_names_the_api_not_the_cli_flag() -> None:
    """`load(path, mesh=make_mesh(4))` on one device: the message names make_mesh, not `--tp`."""
    from qspec_jax.sharding import ShardingError, make_mesh

    n = len(jax.local_devices()) + 1
    with pytest.raises(ShardingError) as info:
        make_mesh(n)
    msg = str(info.value)
    assert msg.startswith(f"make_mesh({n}): only {n - 1} device(s) available") and "--tp" not in msg
    assert f"--xla_force_host_platform_device_count={n}" in msg


@pytest.mark.parametrize("group", [100, 48, 0, 1.5])
def test_cache_group_size_must_be_a_power_of_two(model, group) -> None:
    with pytest.raises(ValueError, match=rf"group_size={group!r} must be a power of two \(16, 32, 64, 128 or 256"):
        QuantSpecCache.init(model.config, batch=1, max_len=800, group_size=group)
    assert QuantSpecCache.init(model.config, batch=1, max_len=256, group_size=128).group_size == 128


@pytest.mark.parametrize("fn, cfg", [(generate, SpecConfig(max_new_tokens=2)),
                                     (generate_autoregressive, GenerationConfig(max_new_tokens=2))])
def test_time_prefill_needs_timings_and_no_stream(model, fn, cfg) -> None:
    """time_prefill times the prefill alone beside the whole program: without a `timings` dict it
    has nowhere to report, and a streamed run (on_tokens) has no whole program; both are refused
    before anything runs. With `timings` it records prefill_s and leaves the tokens unchanged."""
    ids = model.encode("hi")
    with pytest.raises(ValueError, match=r"time_prefill: needs a `timings` dict and no `on_tokens`"):
        fn(model, [ids], cfg, time_prefill=True)
    with pytest.raises(ValueError, match=r"time_prefill: needs a `timings` dict and no `on_tokens`"):
        fn(model, [ids], cfg, timings={}, on_tokens=lambda chunk: None, time_prefill=True)
    tm: dict[str, float] = {}
    res = fn(model, [ids], cfg, timings=tm, time_prefill=True)
    assert 0 < tm["prefill_s"] and 0 < tm["run_s"]
    assert (jnp.asarray(res.tokens) == jnp.asarray(fn(model, [ids], cfg).tokens)).all()


def test_model_passes_refuse_tokens_of_the_wrong_rank(model) -> None:
    """`model.prefill` and `model.decode` take int32[B, T] and say so for a flat [T] array, before
    anything is traced."""
    from qspec_jax import model as M

    cache = QuantSpecCache.init(model.config, batch=1, max_len=256, group_size=32)
    flat = jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match=r"prefill: tokens must be int32\[B, T\] \(one row per prompt\), got shape"):
        M.prefill(model.params, flat, jnp.array([4], jnp.int32), cache)
    with pytest.raises(ValueError, match=r"decode: tokens must be int32\[B, T\] \(one column per new token\), got "
                                         r"shape \(4,\)"):
        M.decode(model.params, flat, cache)
