"""Length buckets: prompts are padded to a short geometric ladder, so a process that sees many
prompt lengths compiles one program per ladder step, and the padding changes no token."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from qspec_jax import model as M
from qspec_jax.checkpoint import Model
from qspec_jax.compilation import programs
from qspec_jax.config import ModelConfig
from qspec_jax.generation import (FINE_BUCKETS_FROM, MIN_LENGTH_BUCKET, GenerationConfig, generate_autoregressive,
                                  length_bucket, pad_prompts)
from qspec_jax.speculative import SpecConfig, generate

TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=6,
                   num_kv_heads=2, head_dim=16, dtype="float32", max_position_embeddings=8192,
                   eos_token_ids=(), attention_impl="reference")


@pytest.fixture(scope="module")
def tiny() -> Model:
    model = Model(config=TINY, params=M.init_random_params(TINY, jax.random.PRNGKey(1), scale=0.3))
    return model.with_draft_weights(SpecConfig().draft_weights_config)


def test_the_ladder() -> None:
    """256, then 1.5x steps to 4096, then 1.25x: 9 buckets cover 1..4096, each >= its lengths,
    padding at most 1.5x (1.25x past 4096), and a ladder step is its own bucket."""
    steps = sorted({length_bucket(n) for n in range(1, 4097)})
    assert steps == [256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
    assert [length_bucket(n) for n in (4097, 5121, 8192, 8193, 100_000)] == [5120, 6144, 8192, 10240, 114688]
    for n in list(range(1, 20_000, 7)) + [131_071, 131_073]:
        b = length_bucket(n)
        assert b >= n and length_bucket(b) == b
        if n > MIN_LENGTH_BUCKET:
            assert b <= (1.5 if n <= FINE_BUCKETS_FROM else 1.25) * n
    with pytest.raises(ValueError, match="n=0"):
        length_bucket(0)


def test_pad_prompts_buckets() -> None:
    tokens, lengths = pad_prompts([[1, 2, 3], list(range(1, 301))], 512)
    assert tokens.shape == (2, 384) and lengths.tolist() == [3, 300]
    assert tokens[0, :3].tolist() == [1, 2, 3] and not tokens[0, 3:].any() and not tokens[1, 300:].any()
    assert pad_prompts([[1, 2, 3]], 512, bucket=1)[0].shape == (1, 3)
    assert pad_prompts([[1, 2, 3]], 512, bucket=64)[0].shape == (1, 64)
    with pytest.raises(ValueError, match="bucket=0"):
        pad_prompts([[1]], 512, bucket=0)


def test_one_program_per_bucket_and_the_same_tokens(tiny: Model) -> None:
    """Three prompt lengths in one bucket compile one program; the padding changes no token
    (autoregressive decoding over the INT8 cache, against the unpadded run)."""
    rng = np.random.default_rng(0)
    config = GenerationConfig(max_new_tokens=12, kv="int8", group_size=16)
    prompts = [rng.integers(1, TINY.vocab_size, n).tolist() for n in (20, 130, 250)]
    before = programs().compiles
    outs = [generate_autoregressive(tiny, [p], config).to_lists()[0] for p in prompts]
    assert programs().compiles - before == 1
    assert generate_autoregressive(tiny, [prompts[1]], config, bucket=1).to_lists()[0] == outs[1]


def test_speculative_padding_changes_no_token(tiny: Model) -> None:
    rng = np.random.default_rng(1)
    prompt = [rng.integers(1, TINY.vocab_size, 300).tolist()]
    config = SpecConfig(gamma=3, max_new_tokens=16, group_size=16, draft_group=32)
    assert generate(tiny, prompt, config).to_lists() == generate(tiny, prompt, config, bucket=1).to_lists()


@pytest.mark.slow
def test_100_prompts_of_random_lengths_compile_at_most_10_programs(tiny: Model) -> None:
    """The issue's target: 100 prompts of 16..4000 tokens through `generate` in one process
    compile <= 10 programs (9 here: the ladder steps they fall into), and the output of one
    prompt per bucket is the unpadded run's."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(16, 4001, 100)
    config = SpecConfig(gamma=3, max_new_tokens=4, group_size=16, draft_group=32)
    before = programs().compiles
    outs = {}
    for n in lengths:
        outs[int(n)] = generate(tiny, [rng.integers(1, TINY.vocab_size, n).tolist()], config).to_lists()[0]
        assert len(outs[int(n)]) == 4
    compiled = programs().compiles - before
    assert compiled == len({length_bucket(int(n)) for n in lengths}) <= 10
    rng = np.random.default_rng(8)
    for n in (int(lengths.min()), 1000, int(lengths.max())):
        prompt = [rng.integers(1, TINY.vocab_size, n).tolist()]
        assert generate(tiny, prompt, config).to_lists() == generate(tiny, prompt, config, bucket=1).to_lists()
