"""Out of memory is an answer, not a crash (issue 33).

The planner's byte model (`planner.prefill_workspace_bytes`, `step_workspace_bytes`,
`request_bytes`) against XLA's own account of the compiled programs (`memory_analysis()` on the
CPU), within `planner.MEMORY_MODEL_MARGIN`, so it cannot drift from the code it models; the
Python API refusing, before compiling, a request that cannot fit (`DoesNotFitError`, a
ValueError, whose message's numbers are the estimate's), and turning XLA's RESOURCE_EXHAUSTED
into `OutOfMemoryError` when the estimate let one through; the CLIs saying the same in one line
(exit status 2 for the refusal, 1 for XLA's), with no traceback and nothing on stdout.

The out-of-memory cases are real: on a CPU a request of a terabyte is refused by the allocator
at once (XLA asks for it in one block), so nothing large is ever touched.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qspec_jax import model as M
from qspec_jax import planner as P
from qspec_jax.bench.e2e import peak_bytes
from qspec_jax.checkpoint import Model
from qspec_jax.compilation import programs
from qspec_jax.config import ModelConfig
from qspec_jax.generation import (GenerationConfig, autoregressive_loop, autoregressive_program, generate_autoregressive,
                                  new_cache)
from qspec_jax.speculative import SpecConfig, generate, speculative_loop, speculative_program
from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

MARGIN = P.MEMORY_MODEL_MARGIN
# The byte model's shapes: small enough to compile in a second, large enough that the
# temporaries, not XLA's fixed overheads, decide the peak.
BASE = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=64, dtype="float32", max_position_embeddings=1 << 20)
# Wide K/V per token (32 KB in float32): a terabyte of cache at 30M tokens of one row.
WIDE_KV = ModelConfig(vocab_size=272, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=16,
                      num_kv_heads=16, head_dim=64, dtype="float32", max_position_embeddings=1 << 26,
                      bos_token_id=257, eos_token_ids=(258,))
GB = 10**9


def within_margin(estimate: int, measured: int) -> bool:
    return abs(estimate - measured) <= MARGIN * measured


def abstract_params(cfg: ModelConfig) -> M.Params:
    return jax.eval_shape(lambda: M.init_random_params(cfg, jax.random.PRNGKey(0)))


# ----------------------------------------------------------------- the estimate against XLA's
@pytest.mark.parametrize("overrides, kind, batch, prompt, chunk", [
    ({}, "bf16", 2, 1024, None), ({}, "int8", 1, 4096, None), ({"dtype": "bfloat16"}, "int8", 3, 1536, None),
    ({"intermediate_size": 2048}, "bf16", 1, 2048, None), ({"num_heads": 8, "head_dim": 128}, "int8", 2, 768, None),
    ({}, "int8", 2, 2048, 256), ({}, "bf16", 1, 2048, 512), ({"dtype": "bfloat16"}, "int8", 1, 1536, 256)])
def test_prefill_workspace_matches_xla(overrides: dict[str, Any], kind: str, batch: int, prompt: int,
                                       chunk: int | None) -> None:
    """The temporaries of the compiled `model.prefill` (cache an argument, so only its workspace
    is temporary), whole or chunked, within the margin of `prefill_workspace_bytes`."""
    cfg = BASE.replace(**overrides)
    cache = jax.eval_shape(lambda: new_cache(cfg, kind, batch, -(-(prompt + 16) // 128) * 128, 128, 7))
    tokens, lengths = jax.ShapeDtypeStruct((batch, prompt), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)
    fn = jax.jit(functools.partial(M.prefill, chunk=chunk))
    measured = fn.lower(abstract_params(cfg), tokens, lengths, cache).compile().memory_analysis()
    estimate = P.prefill_workspace_bytes(cfg, batch, prompt, chunk)
    assert within_margin(estimate, measured.temp_size_in_bytes), (estimate, measured.temp_size_in_bytes)


def test_chunked_prefill_is_the_formula_at_the_chunk() -> None:
    """A chunk of the prompt or more is the whole prompt at once. On a GPU (cuDNN's flash
    attention) a chunk's temporaries do not grow with the prompt and are smaller than the whole
    prompt's; the CPU's jnp chunk reads the whole cache, so its grow (and the XLA test above
    checks them)."""
    whole = P.prefill_workspace_bytes(BASE, 2, 8192)
    assert P.prefill_workspace_bytes(BASE, 2, 8192, chunk=8192) == whole
    assert P.prefill_workspace_bytes(BASE, 2, 8192, chunk=16384) == whole
    gpu = BASE.replace(dtype="bfloat16")
    chunked = P.prefill_workspace_bytes(gpu, 2, 8192, chunk=1024, platform="gpu")
    assert chunked == P.prefill_workspace_bytes(gpu, 2, 65536, chunk=1024, platform="gpu")
    assert P.prefill_workspace_bytes(gpu, 2, 1024, platform="gpu") < chunked
    assert chunked < P.prefill_workspace_bytes(gpu, 2, 8192, platform="gpu")
    assert P.prefill_workspace_bytes(BASE, 2, 65536, chunk=1024) > P.prefill_workspace_bytes(BASE, 2, 8192, chunk=1024)


@pytest.mark.parametrize("overrides, kind, view, batch, slots, width", [
    ({}, "bf16", "target", 4, 4096, 1), ({}, "int8", "target", 1, 16384, 8), ({}, "int8", "draft", 4, 2048, 8),
    ({"dtype": "bfloat16"}, "bf16", "target", 4, 4096, 1), ({"head_dim": 128}, "int8", "target", 1, 4096, 8),
    ({"num_heads": 8}, "int8", "draft", 1, 4096, 1)])
def test_step_workspace_matches_xla(overrides: dict[str, Any], kind: str, view: str, batch: int, slots: int,
                                    width: int) -> None:
    """The temporaries of one compiled `model.decode` pass (the jnp attention of the CPU) within
    the margin of `step_workspace_bytes`."""
    cfg = BASE.replace(**overrides)
    cache = jax.eval_shape(lambda: new_cache(cfg, kind, batch, slots, 128, 7))
    toks = jax.ShapeDtypeStruct((batch, width), jnp.int32)
    exe = jax.jit(functools.partial(M.decode, view=view)).lower(abstract_params(cfg), toks, cache).compile()
    estimate = P.step_workspace_bytes(cfg, batch, width, slots, kv=kind, view=view)
    assert within_margin(estimate, exe.memory_analysis().temp_size_in_bytes)


@pytest.mark.parametrize("mode", ["ar", "spec"])
def test_decode_loops_update_a_donated_cache_in_place(mode: str) -> None:
    """A jitted decoding loop that is given a prefilled cache and donates it updates it in place
    only when the loop returns it (`return_cache=True`): XLA aliases the donated cache to that
    output, and otherwise copies it into the loop's state (at 1.29M tokens on the H200: 81.6 GiB,
    out of memory). Compiled on the CPU: the copy shows as a cache's worth of temporaries."""
    params, key = abstract_params(BASE), jax.random.PRNGKey(0)
    first = jax.ShapeDtypeStruct((1,), jnp.int32)
    cache = jax.eval_shape(lambda: new_cache(BASE, "int8", 1, 32768, 128, 7))
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    if mode == "ar":
        gen = GenerationConfig(max_new_tokens=4, kv="int8")
        loop = lambda rc: lambda p, c, f, k: autoregressive_loop(p, c, f, k, gen=gen, eos_ids=(),  # noqa: E731
                                                                 return_cache=rc)
        args, donate = (params, cache, first, key), 1
    else:
        spec = SpecConfig(gamma=2, max_new_tokens=4, forced_acceptance=0.9)
        draft = jax.eval_shape(lambda p: make_draft_params(p, DraftWeightsConfig(group_size=32, method="clip")), params)
        loop = lambda rc: lambda p, d, c, f, k: speculative_loop(p, d, c, f, k, spec=spec, eos_ids=(),  # noqa: E731
                                                                 return_cache=rc)
        args, donate = (params, draft, cache, first, key), 2
    analysis = {}
    for rc in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Some donated buffers were not usable" (rc False): the point
            analysis[rc] = jax.jit(loop(rc), donate_argnums=(donate,)).lower(*args).compile().memory_analysis()
    assert analysis[True].alias_size_in_bytes >= cache_bytes
    assert analysis[False].alias_size_in_bytes < cache_bytes
    assert analysis[False].temp_size_in_bytes - analysis[True].temp_size_in_bytes >= 0.9 * cache_bytes


@pytest.mark.parametrize("mode, kv, batch, prompt, new, overrides", [
    ("ar", "bf16", 2, 1024, 64, {}), ("ar", "int8", 8, 512, 256, {}), ("ar", "int8", 1, 256, 4096, {}),
    ("spec", "int8", 1, 4096, 32, {}), ("spec", "int8", 2, 256, 2048, {"dtype": "bfloat16"}),
    ("ar", "bf16", 1, 256, 8192, {"num_layers": 4, "head_dim": 128})])
def test_request_matches_the_compiled_generation(mode: str, kv: str, batch: int, prompt: int, new: int,
                                                 overrides: dict[str, Any]) -> None:
    """The whole generation program's peak (weights in, cache, loop state, prefill and decode
    temporaries) within the margin of `request_bytes`: prefill-bound and decode-bound shapes, AR
    and speculative."""
    cfg = BASE.replace(**overrides)
    params, key = abstract_params(cfg), jax.random.PRNGKey(0)
    tokens, lengths = jax.ShapeDtypeStruct((batch, prompt), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)
    if mode == "ar":
        gen = GenerationConfig(max_new_tokens=new, kv=kv, eos_token_ids=())
        request = gen.memory_request(batch, prompt)
        exe = autoregressive_program.lower(params, tokens, lengths, key, gen=gen, eos_ids=(),
                                           max_len=request.cache_len)
        weights = P.tree_bytes(params)
    else:
        spec = SpecConfig(max_new_tokens=new, eos_token_ids=())
        draft = jax.eval_shape(lambda p: make_draft_params(p, DraftWeightsConfig(method="clip")), params)
        request = dataclasses.replace(spec.memory_request(batch, prompt),
                                      draft_weights=P.weight_bytes(cfg, spec.draft_weights_config)["draft"])
        exe = speculative_program.lower(params, draft, tokens, lengths, key, spec=spec, eos_ids=(),
                                        max_len=request.cache_len)
        weights = P.tree_bytes(params)
    estimate = P.request_bytes(cfg, request, weights=weights)
    assert within_margin(estimate["total"], peak_bytes(exe.compile().memory_analysis())), estimate


# ------------------------------------------------------------------------------------- the API
@pytest.fixture(scope="module")
def wide_model() -> Model:
    """Random weights of the WIDE_KV shape (no tokenizer, no stored draft)."""
    return Model(config=WIDE_KV, params=M.init_random_params(WIDE_KV, jax.random.PRNGKey(0)))


@pytest.fixture
def device_bytes(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Sets what `planner.device_memory_bytes` reports (a fixed machine, so the message's
    numbers can be checked exactly; the real value moves with the other processes)."""
    return lambda n: monkeypatch.setattr(P, "device_memory_bytes", lambda device=None: n)


def fits(cfg: ModelConfig, request: P.Request, weights: int, available: int) -> bool:
    return P.request_bytes(cfg, request, weights=weights)["total"] <= available


def test_generate_autoregressive_refuses_before_compiling(wide_model: Model,
                                                         device_bytes: Callable[[int], None]) -> None:
    """The issue's case (4096 prompts x 4000 new tokens): a DoesNotFitError (a ValueError) with
    the request, the estimate's bytes, the device's and the largest batch that fits, raised
    before anything is compiled."""
    device_bytes(20 * GB)
    weights = P.tree_bytes(wide_model.params)
    config = GenerationConfig(max_new_tokens=4000, kv="bf16")
    compiled = programs().compiles
    with pytest.raises(P.DoesNotFitError) as info:
        generate_autoregressive(wide_model, np.ones((4096, 6), np.int32), config)
    err = info.value
    assert isinstance(err, ValueError) and programs().compiles == compiled
    request = config.memory_request(4096, 256, longest=6)
    assert err.parts == P.request_bytes(WIDE_KV, request, weights=weights)
    assert err.available == 20 * GB + weights  # on a CPU the loaded weights are no longer in MemAvailable
    text = str(err)
    assert "\n" not in text and text.startswith(
        "does not fit in memory: batch 4096 x (prompt 6 tokens, padded to 256, + 4000 new tokens), decoding over a "
        f"dense bf16 KV cache, needs {P.format_bytes(err.needed)} (KV cache {P.format_bytes(err.parts['cache'])}")
    assert f"this machine has {P.format_bytes(err.available)} of available RAM" in text
    batch = int(re.search(r"fits: batch <= (\d+)", text).group(1))
    assert fits(WIDE_KV, request.resized(batch=batch), weights, err.available)
    assert not fits(WIDE_KV, request.resized(batch=batch + 1), weights, err.available)


def test_refusal_uses_this_machines_memory(wide_model: Model) -> None:
    """Without a fixed device: the available RAM of this machine, and a terabyte is refused."""
    with pytest.raises(P.DoesNotFitError) as info:
        generate_autoregressive(wide_model, [[1, 2, 3]], GenerationConfig(max_new_tokens=30_000_000, kv="bf16"))
    err = info.value
    assert err.needed > 10**12 > err.available > P.tree_bytes(wide_model.params)
    assert f"needs {P.format_bytes(err.needed)}" in str(err) and P.format_bytes(err.available) in str(err)


def test_what_fits_names_the_int8_cache_and_fewer_new_tokens(wide_model: Model,
                                                            device_bytes: Callable[[int], None]) -> None:
    """A dense cache that does not fit where the INT8 one does: --kv int8 is offered, and the
    most new tokens that fit at this batch."""
    weights = P.tree_bytes(wide_model.params)
    config = GenerationConfig(max_new_tokens=200_000, kv="bf16")
    request = config.memory_request(1, 256, longest=3)
    dense, int8 = (P.request_bytes(WIDE_KV, dataclasses.replace(request, kv=kv), weights=weights)["total"]
                   for kv in ("bf16", "int8"))
    assert int8 < dense
    device_bytes((int8 + dense) // 2 - weights)
    with pytest.raises(P.DoesNotFitError) as info:
        generate_autoregressive(wide_model, [[1, 2, 3]], config)
    text = str(info.value)
    assert "the INT8 KV cache (--kv int8; GenerationConfig(kv='int8'))" in text
    new = int(re.search(r"new tokens <= (\d+) at batch 1", text).group(1))
    assert fits(WIDE_KV, request.resized(new_tokens=new), weights, info.value.available)
    assert not fits(WIDE_KV, request.resized(new_tokens=new + 1), weights, info.value.available)


def test_chunked_prefill_is_offered_when_the_prompt_is_what_does_not_fit(device_bytes: Callable[[int], None]) -> None:
    """A long prompt whose prefill temporaries, not its cache, exceed the device: the line names
    the option that chunks it; a request already chunked is not offered it again."""
    request = P.Request(1, 65536, 16, kv="int8", width=8)
    parts = P.request_bytes(BASE, request, weights=10**6)
    assert parts["prefill"] > parts["step"]
    room = parts["total"] - parts["prefill"] + parts["step"]
    with pytest.raises(P.DoesNotFitError, match=r"or a prefill in chunks \(--prefill-chunk N; prefill_chunk=N in the "
                                                 r"configs: its temporaries, "
                                                 + re.escape(P.format_bytes(parts["prefill"]))):
        P.check_request_fits(BASE, request, weights=10**6, device_bytes=room, platform="cpu")
    chunked = dataclasses.replace(request, chunk=P.DEFAULT_PREFILL_CHUNK)
    with pytest.raises(P.DoesNotFitError) as info:
        P.check_request_fits(BASE, chunked, weights=10**6, device_bytes=1, platform="cpu")
    assert "prefill in chunks" not in str(info.value)


def test_speculative_generate_refuses_before_making_a_draft(wide_model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model has no stored draft: the refusal comes before one is quantized (GPTQ would
    calibrate for minutes), with the draft's bytes counted from its format."""
    def no_draft(*a: Any, **k: Any) -> Model:
        raise AssertionError("a draft was made for a request that does not fit")

    monkeypatch.setattr(Model, "with_draft_weights", no_draft)
    spec = SpecConfig(max_new_tokens=4000)
    with pytest.raises(P.DoesNotFitError, match=r"^does not fit in memory: batch 4096 x .*speculative decoding "
                                                 r"over an INT8 KV cache, needs") as info:
        generate(wide_model, np.ones((4096, 6), np.int32), spec)
    assert info.value.parts["weights"] == (P.tree_bytes(wide_model.params)
                                           + P.weight_bytes(WIDE_KV, spec.draft_weights_config)["draft"])


def test_teacher_forced_and_plan_refuse_before_allocating(wide_model: Model) -> None:
    from qspec_jax.evaluation import eval_request, teacher_forced

    tokens = np.ones((100_000, 2), np.int32)
    with pytest.raises(P.DoesNotFitError, match=r"^does not fit in memory: batch 100000 x \(prompt 1 token \+ 1 new "
                                                 r"token\), decoding over an INT8 KV cache") as info:
        teacher_forced(wide_model.params, tokens, 1, kv="int8", progress=False)
    request = eval_request(100_000, 1, 1, "int8")
    assert info.value.parts == P.request_bytes(WIDE_KV, request, weights=P.tree_bytes(wide_model.params))
    with pytest.raises(P.DoesNotFitError, match="speculative decoding over an INT8 KV cache"):
        P.plan(wide_model, np.ones((4096, 6), np.int32), SpecConfig(max_new_tokens=4000), alpha=0.8)


def test_out_of_memory_in_xla_is_an_out_of_memory_error(wide_model: Model, device_bytes: Callable[[int], None]) -> None:
    """With the estimate told the device is huge, XLA itself runs out of memory allocating the
    program's buffers (a terabyte, refused at once): OutOfMemoryError, a DoesNotFitError, with
    XLA's words and the estimate, which is within the margin of what XLA asked for."""
    device_bytes(10**16)
    with pytest.raises(P.OutOfMemoryError) as info:
        generate_autoregressive(wide_model, [[1, 2, 3, 4, 5, 6]], GenerationConfig(max_new_tokens=30_000_000,
                                                                                   kv="bf16"), timings={})
    err = info.value
    assert isinstance(err, P.DoesNotFitError) and P.resource_exhausted(err.__cause__)
    asked = int(re.search(r"Out of memory allocating (\d+) bytes", str(err)).group(1))
    assert within_margin(err.needed, asked)
    assert str(err).startswith("does not fit in memory: batch 1 x (prompt 6 tokens, padded to 256, + 30000000 new "
                               "tokens), decoding over a dense bf16 KV cache ran out of memory (Out of memory "
                               "allocating")


def test_device_memory_is_the_cpus_available_ram() -> None:
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert abs(P.device_memory_bytes() - avail) < 0.2 * avail  # other processes move it a little
    assert P.format_bytes(1_196_803_703_136) == "1.2 TB" and P.format_bytes(23.2e9) == "23.2 GB"
    assert P.format_bytes(512) == "512 B"


# -------------------------------------------------------------------------------------- the CLIs
def one_error_line(main: Callable[[list[str]], int], argv: list[Any], code: int,
                   capsys: pytest.CaptureFixture[str]) -> str:
    """Runs a CLI in-process expecting exit status `code`, one `PROG: error:` line on stderr, no
    traceback and nothing on stdout; returns the line."""
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert info.value.code == code, err
    assert ": error: " in lines[-1] and "Traceback" not in err, err
    assert out == "", out
    return lines[-1]


@pytest.mark.parametrize("mode", ["ar", "spec"])
def test_generate_cli_refuses_what_does_not_fit(mode: str, wide_kv_checkpoint: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before a draft is made (the checkpoint stores none) or anything compiles: exit 2."""
    from qspec_jax.cli import generate as cli

    compiled = programs().compiles
    line = one_error_line(cli.main, ["--checkpoint", wide_kv_checkpoint, "--prompt", "hi", "--mode", mode,
                                     "--max-new-tokens", 30_000_000], 2, capsys)
    what = "speculative decoding over an INT8" if mode == "spec" else "decoding over an INT8"
    assert line.startswith("qspec-generate: error: does not fit in memory: batch 1 x (prompt 2 tokens, padded to "
                           f"256, + 30000000 new tokens), {what} KV cache, needs ")
    assert "of available RAM; fits: new tokens <= " in line
    assert programs().compiles == compiled


def test_generate_cli_compare_ar_is_checked_too(wide_kv_checkpoint: Path, capsys: pytest.CaptureFixture[str],
                                              device_bytes: Callable[[int], None]) -> None:
    """Speculative decoding over the INT8 cache fits; --compare-ar bf16's dense cache does not:
    refused before the speculative run, not after it printed its text."""
    from qspec_jax.cli import generate as cli
    from qspec_jax.checkpoint import load

    model = load(wide_kv_checkpoint)
    weights = P.tree_bytes(model.params)
    spec = SpecConfig(max_new_tokens=100_000).memory_request(1, 256, longest=2)
    dense = GenerationConfig(max_new_tokens=100_000, kv="bf16").memory_request(1, 256, longest=2)
    spec_draft = dataclasses.replace(spec, draft_weights=P.weight_bytes(
        model.config, SpecConfig().draft_weights_config)["draft"])
    need_spec = P.request_bytes(model.config, spec_draft, weights=weights)["total"]
    need_dense = P.request_bytes(model.config, dense, weights=weights)["total"]
    assert need_spec < need_dense
    device_bytes((need_spec + need_dense) // 2 - weights)
    line = one_error_line(cli.main, ["--checkpoint", wide_kv_checkpoint, "--prompt", "hi", "--max-new-tokens",
                                     100_000, "--compare-ar", "bf16"], 2, capsys)
    assert "decoding over a dense bf16 KV cache, needs" in line


def test_generate_cli_out_of_memory_in_xla(wide_kv_checkpoint: Path, capsys: pytest.CaptureFixture[str],
                                         device_bytes: Callable[[int], None]) -> None:
    """The estimate told the device is huge, XLA runs out of memory: the same kind of line, exit
    status 1, nothing on stdout."""
    from qspec_jax.cli import generate as cli

    device_bytes(10**16)
    line = one_error_line(cli.main, ["--checkpoint", wide_kv_checkpoint, "--prompt", "hi", "--mode", "ar", "--kv",
                                     "bf16", "--max-new-tokens", 30_000_000, "--no-compile-cache"], 1, capsys)
    assert line.startswith("qspec-generate: error: does not fit in memory: batch 1 x (prompt 2 tokens, padded to "
                           "256, + 30000000 new tokens), decoding over a dense bf16 KV cache ran out of memory (Out "
                           "of memory allocating ")


def test_eval_ppl_cli_refuses_what_does_not_fit(wide_kv_checkpoint: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from qspec_jax.cli import eval_ppl

    text = tmp_path / "long.txt"
    text.write_text("Enter the king. " * 8000)
    line = one_error_line(eval_ppl.main, ["--checkpoint", wide_kv_checkpoint, "--text", text, "--context", 1,
                                          "--eval-tokens", 1, "--batch", 100_000], 2, capsys)
    assert line.startswith("qspec-eval-ppl: error: does not fit in memory: batch 100000 x (prompt 1 token + 1 new "
                           "token), decoding over an INT8 KV cache, needs ")
    assert re.search(r"fits: batch <= \d+", line)


def test_eval_accept_cli_refuses_what_does_not_fit(wide_kv_checkpoint: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The longest context is checked before any is run (or a draft made)."""
    from qspec_jax.cli import eval_accept

    text = tmp_path / "t.txt"
    text.write_text("Enter the king. " * 100)
    line = one_error_line(eval_accept.main, ["--checkpoint", wide_kv_checkpoint, "--text", text, "--context",
                                             "16,20000000", "--gamma", 4, "--new-tokens", 8], 2, capsys)
    assert line.startswith("qspec-eval-accept: error: does not fit in memory: batch 1 x (prompt 20000000 tokens, "
                           "padded to ")


@pytest.mark.parametrize("late", [False, True])
def test_plan_cache_that_cannot_be_written_names_the_flag(late: bool, tiny_chat_checkpoint: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """--plan-cache /proc/nope.json: refused before measuring (a file cannot be created there), or
    when the check is passed (late: a disk that fills up meanwhile) when the measured costs are
    written; either way the flag and the path given, never a temporary file's name."""
    from qspec_jax.cli import generate as cli

    if late:
        monkeypatch.setattr(cli, "require_writable_file", lambda *a: None)
    argv = ["--checkpoint", tiny_chat_checkpoint, "--prompt", "hi", "--gamma", "auto", "--acceptance", "0.8",
            "--max-new-tokens", 4, "--plan-cache", "/proc/nope.json", "--no-compile-cache"]
    line = one_error_line(cli.main, argv, 2, capsys)
    expect = "cannot write it (" if late else "cannot be created: /proc"
    assert line.startswith(f"qspec-generate: error: --plan-cache /proc/nope.json: {expect}") and ".tmp" not in line
