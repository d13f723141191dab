"""Parity of converted checkpoints with transformers (PyTorch, float32).

Tiny random Llama/Mistral models cover GQA, llama3 RoPE scaling, tied/untied embeddings,
sharded safetensors and a sliding window; SmolLM2-135M-Instruct (GGUF, Q4_1/Q8_0) covers a real
model, including llama.cpp's q/k row permutation. Everything is compared in float32: prefill
logits to 1e-3 max-abs error, greedy continuations token for token.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from convert import cli  # noqa: E402
from qspec_jax import model as M  # noqa: E402
from qspec_jax.cache import DenseKVCache  # noqa: E402
from qspec_jax.checkpoint import load  # noqa: E402
from qspec_jax.generation import GenerationConfig, generate_autoregressive  # noqa: E402

LOGIT_ATOL = 1e-3
NEW_TOKENS = 24
SEQ = 48  # > original_max_position_embeddings (32) of the llama3 case, > the sliding window (8)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
TINY_CASES: dict[str, dict[str, Any]] = {
    "llama_gqa_untied": dict(arch="llama", seed=0),
    "llama_gqa_tied": dict(arch="llama", seed=1, tie_word_embeddings=True),
    "llama3_rope_scaling": dict(arch="llama", seed=2, rope_scaling=LLAMA3_ROPE),
    "llama_sharded": dict(arch="llama", seed=3, max_shard_size="20KB"),
    "mistral_sliding_window": dict(arch="mistral", seed=4, sliding_window=8),
}


# ----------------------------------------------------------------------------------- helpers
@jax.jit
def _prefill_all_logits(params: M.Params, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    cache = DenseKVCache.init(params.config, tokens.shape[0], tokens.shape[1])
    logits, _ = M.prefill(params, tokens, lengths, cache, all_logits=True)
    return logits


def jax_logits(model: Any, rows: list[list[int]]) -> list[np.ndarray]:
    """float32 logits [len(row), V] of each row, run as one right-padded batch."""
    t = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), t), np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
    lengths = np.array([len(r) for r in rows], np.int32)
    out = np.asarray(_prefill_all_logits(model.params, jnp.asarray(tokens), jnp.asarray(lengths)))
    return [out[b, : len(r)] for b, r in enumerate(rows)]


def hf_logits(hf_model: Any, row: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([row])).logits[0].float().numpy()


def hf_greedy(hf_model: Any, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from transformers, with EOS disabled so it never stops early."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    assert len(new) == n, f"transformers stopped after {len(new)} of {n} tokens"
    return new


def jax_greedy(model: Any, prompts: list[list[int]], n: int, eos: tuple[int, ...] | None = ()) -> list[list[int]]:
    gen = GenerationConfig(max_new_tokens=n, kv="bf16", eos_token_ids=eos)
    return generate_autoregressive(model, prompts, gen, jax.random.PRNGKey(0)).to_lists()


def random_rows(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def record_error(request: pytest.FixtureRequest, err: float) -> None:
    request.node.user_properties.append(("max_abs_logit_error", err))
    print(f"{request.node.name}: max |logit error| = {err:.3g}")


# ------------------------------------------------------------------------------- tiny models
@pytest.fixture(scope="module", params=list(TINY_CASES), ids=list(TINY_CASES))
def tiny_case(request: pytest.FixtureRequest, tiny_checkpoint: Any) -> tuple[Any, Any]:
    """(HF model, converted model loaded as float32) for each tiny configuration."""
    hf, ckpt = tiny_checkpoint(**TINY_CASES[request.param])
    return hf.model, load(ckpt, dtype="float32", tokenizer=False)


def test_tiny_prefill_logits_match_hf(tiny_case: tuple[Any, Any], request: pytest.FixtureRequest) -> None:
    hf_model, model = tiny_case
    rows = random_rows(0, [SEQ, SEQ - 9], model.config.vocab_size)  # two lengths: padding too
    ours = jax_logits(model, rows)
    errs = []
    for row, got in zip(rows, ours):
        ref = hf_logits(hf_model, row)
        assert got.shape == ref.shape
        errs.append(float(np.abs(got - ref).max()))
    record_error(request, max(errs))
    assert max(errs) <= LOGIT_ATOL


def test_tiny_greedy_matches_hf(tiny_case: tuple[Any, Any]) -> None:
    """24 greedy tokens for two prompts of different lengths, generated as one right-padded
    batch, equal transformers' greedy continuation of each prompt alone."""
    hf_model, model = tiny_case
    prompts = random_rows(1, [40, 23], model.config.vocab_size)
    ours = jax_greedy(model, prompts, NEW_TOKENS)
    assert ours == [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


def test_tiny_batch_equals_single(tiny_checkpoint: Any) -> None:
    """A batch of two different-length prompts gives each prompt's own (alone) continuation.

    (The greedy test above already checks batched generation against transformers for every
    case; this one checks batch vs single within qspec-jax, on the sliding-window model where
    padding and the window interact.)"""
    _, ckpt = tiny_checkpoint(**TINY_CASES["mistral_sliding_window"])
    model = load(ckpt, dtype="float32", tokenizer=False)
    prompts = random_rows(2, [17, 41], model.config.vocab_size)
    batched = jax_greedy(model, prompts, NEW_TOKENS)
    single = [jax_greedy(model, [p], NEW_TOKENS)[0] for p in prompts]
    assert batched == single
    assert all(len(r) == NEW_TOKENS for r in batched)


@pytest.mark.parametrize("case, changed", [("mistral_sliding_window", {"sliding_window": None}),
                                           ("llama3_rope_scaling", {"rope_scaling": None})])
def test_tiny_cases_are_meaningful(tiny_hf_model: Any, case: str, changed: dict[str, Any]) -> None:
    """HF itself applies the window / the rope scaling at SEQ tokens, so parity above tests them."""
    with_feature = tiny_hf_model(**TINY_CASES[case]).model
    without = tiny_hf_model(**{**TINY_CASES[case], **changed}).model
    (row,) = random_rows(0, [SEQ], with_feature.config.vocab_size)
    assert np.abs(hf_logits(with_feature, row) - hf_logits(without, row)).max() > 1e-2


def test_tiny_sharded_source_has_several_shards(tiny_hf_model: Any) -> None:
    path = tiny_hf_model(**TINY_CASES["llama_sharded"]).path
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) >= 3


def test_tiny_bfloat16_storage_rounds_hf_weights(tiny_checkpoint: Any) -> None:
    """The default --dtype bfloat16 stores HF's float32 weights rounded to nearest bfloat16."""
    hf, ckpt = tiny_checkpoint(dtype="bfloat16", **TINY_CASES["llama_gqa_untied"])
    model = load(ckpt, dtype="float32", tokenizer=False)
    sd = {k: v.detach().numpy() for k, v in hf.model.state_dict().items()}
    bf16 = lambda x: x.astype(jnp.bfloat16).astype(np.float32)  # noqa: E731
    layer = model.params.layers
    np.testing.assert_array_equal(np.asarray(layer.wq[1]), bf16(sd["model.layers.1.self_attn.q_proj.weight"].T))
    np.testing.assert_array_equal(np.asarray(layer.w_down[0]), bf16(sd["model.layers.0.mlp.down_proj.weight"].T))
    np.testing.assert_array_equal(np.asarray(model.params.lm_head), bf16(sd["lm_head.weight"].T))
    np.testing.assert_array_equal(np.asarray(model.params.embed), bf16(sd["model.embed_tokens.weight"]))


def test_cli_in_process_and_subprocess_agree(tiny_checkpoint: Any, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`convert.cli.main` and the real `python -m convert` give the same parameters, exit 0."""
    hf, ref_ckpt = tiny_checkpoint(**TINY_CASES["llama_sharded"])
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    # --draft-weights none: the target's parameters are compared (the draft has its own tests).
    assert cli.main([str(hf.path), str(out_a), "--dtype", "float32", "--no-progress", "--draft-weights", "none"]) == 0
    assert "wrote" in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "convert", str(hf.path), str(out_b), "--dtype", "float32",
                           "--draft-weights", "none"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    params = [M.params_to_flat(load(p, tokenizer=False).params) for p in (ref_ckpt, out_a, out_b)]
    for name in params[0]:
        np.testing.assert_array_equal(np.asarray(params[1][name]), np.asarray(params[0][name]), err_msg=name)
        np.testing.assert_array_equal(np.asarray(params[2][name]), np.asarray(params[0][name]), err_msg=name)


# ------------------------------------------------------------------------- SmolLM2 (real GGUF)
SMOL_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village,"


@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint: Path) -> Any:
    return load(smollm2_checkpoint, dtype="float32")


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf(smollm2: Any, smollm2_hf_model: Any,
                                                request: pytest.FixtureRequest) -> None:
    """Both sides dequantize the same Q4_1/Q8_0 data to float32 and run float32 math, so the
    only differences are accumulation order: observed ~1e-4 on logits of magnitude ~30."""
    ids = smollm2.encode(SMOL_PROMPT)
    (ours,) = jax_logits(smollm2, [ids])
    ref = hf_logits(smollm2_hf_model, ids)
    err = float(np.abs(ours - ref).max())
    record_error(request, err)
    assert err <= LOGIT_ATOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.slow
def test_smollm2_greedy_32_tokens_match_transformers(smollm2: Any, smollm2_hf_model: Any) -> None:
    ids = smollm2.encode(SMOL_PROMPT)
    ours = jax_greedy(smollm2, [ids], 32)[0]
    assert ours == hf_greedy(smollm2_hf_model, ids, 32), smollm2.decode(ours)


@pytest.mark.slow
def test_smollm2_chat_answers_paris(smollm2: Any) -> None:
    ids = smollm2.encode("What is the capital of France?", chat=True)
    # Same static settings as the 32-token test above (EOS off), so the compiled generation
    # loop is reused; the answer is then cut at the model's EOS.
    tokens = jax_greedy(smollm2, [ids], 32)[0]
    eos = set(smollm2.config.eos_token_ids)
    end = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    answer = smollm2.decode(tokens[:end])
    assert "Paris" in answer, answer
