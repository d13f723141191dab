"""Streaming: `on_tokens` and `TokenStream` hand out exactly the tokens the non-streamed run
returns (same logits, bit for bit), chunk by chunk from the prefill's token on; `TextDecoder`
never prints half a character; `qspec-generate --stream` prints the same text as without it,
and Ctrl-C keeps what was generated (a real SIGINT to a real process, exit status 130)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from qspec_jax import model as M
from qspec_jax.checkpoint import Model
from qspec_jax.config import ModelConfig
from qspec_jax.generation import (STREAM_FIRST_ROUNDS, STREAM_OVERHEAD, GenerationConfig, chunk_rounds,
                                  generate_autoregressive)
from qspec_jax.speculative import SpecConfig, generate
from qspec_jax.streaming import TextDecoder, TokenStream

REPO = Path(__file__).resolve().parent.parent
TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=6,
                   num_kv_heads=2, head_dim=16, dtype="float32", max_position_embeddings=512,
                   eos_token_ids=(5,), attention_impl="reference")
CONFIGS = {"ar": (generate_autoregressive, GenerationConfig(max_new_tokens=40, kv="int8", group_size=16,
                                                            return_logits=True)),
           "spec": (generate, SpecConfig(gamma=3, max_new_tokens=40, group_size=16, draft_group=32,
                                         return_logits=True))}


@pytest.fixture(scope="module")
def tiny() -> Model:
    """The tiny model with its INT4 draft made once (generate would quantize it at every call)."""
    model = Model(config=TINY, params=M.init_random_params(TINY, jax.random.PRNGKey(1), scale=0.3))
    return model.with_draft_weights(CONFIGS["spec"][1].draft_weights_config)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(6, TINY.vocab_size, n).tolist() for n in (7, 30, 19)]


@pytest.mark.parametrize("mode", ["ar", "spec"])
def test_streamed_chunks_are_the_result(tiny: Model, prompts: list[list[int]], mode: str, bitwise_logits: Any) -> None:
    """Every row's chunks concatenate to its tokens; the streamed result equals the one-program
    result token for token and logit for logit; the first chunk is the prefill's token alone,
    and the next ones hold STREAM_FIRST_ROUNDS (1, 2, 4) rounds at most."""
    fn, config = CONFIGS[mode]
    plain = fn(tiny, prompts, config)
    chunks: list[list[list[int]]] = []
    streamed = fn(tiny, prompts, config, on_tokens=chunks.append)
    assert streamed.to_lists() == plain.to_lists()
    assert bitwise_logits(plain, streamed)
    assert [sum((c[b] for c in chunks), []) for b in range(len(prompts))] == plain.to_lists()
    assert all(len(row) == 1 for row in chunks[0])
    per_round = 1 if mode == "ar" else config.gamma + 1  # most tokens a row commits per round
    for chunk, k in zip(chunks[1:], STREAM_FIRST_ROUNDS):
        assert max(map(len, chunk)) <= k * per_round
    lengths = [len(t) for t in plain.to_lists()]
    assert len(set(lengths)) > 1 and min(lengths) < config.max_new_tokens  # a row stopped at EOS early


def test_chunk_length_keeps_the_fixed_cost_small() -> None:
    """A chunk of k rounds costs a + b k seconds: the next chunk is the shortest with a fixed share
    <= STREAM_OVERHEAD (a = 0.6 s, b = 1.4 s, a CPU with bf16 weights: 21 rounds); with no fixed
    cost one round per chunk; before two lengths were timed, or when the times fall with the
    length (noise), twice the previous length."""
    def timed(a: float, b: float) -> list[tuple[int, float]]:
        return [(k, a + b * k) for k in (1, 2, 4)]

    k = chunk_rounds(timed(0.6, 1.4), 4)
    assert k == 21 and 0.6 / (0.6 + 1.4 * k) <= STREAM_OVERHEAD < 0.6 / (0.6 + 1.4 * (k - 1))
    assert chunk_rounds(timed(0.0, 0.03), 4) == 1
    assert chunk_rounds([(1, 1.0)], 1) == 2 and chunk_rounds([(1, 2.0), (2, 1.0)], 2) == 4


def test_token_stream_iterates_and_raises(tiny: Model, prompts: list[list[int]]) -> None:
    fn, config = CONFIGS["spec"]
    stream = TokenStream(fn, tiny, prompts, config)  # the programs of the test above
    with pytest.raises(RuntimeError, match="iterate over the stream"):
        _ = stream.result
    got = [[], [], []]
    for chunk in stream:
        for row, new in zip(got, chunk):
            row += new
    assert got == stream.result.to_lists() == fn(tiny, prompts, config).to_lists()
    bad = TokenStream(fn, tiny, [[1, 2, TINY.vocab_size]], config)  # an id outside the vocabulary
    with pytest.raises(ValueError, match="outside"):
        list(bad)


def test_text_decoder_never_splits_a_character() -> None:
    """Byte tokens of 'aé€b': the decoder returns 'a', then nothing until the 2- and 3-byte
    characters are complete; an invalid byte is released once text follows it."""
    text = TextDecoder(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    data = list("aé€b".encode())  # a, c3 a9, e2 82 ac, b
    pieces = [text.push([x]) for x in data]
    assert pieces == ["a", "", "é", "", "", "€", "b"]
    assert text.push([0xFF]) == "" and text.push([ord("c")]) == "\ufffdc"
    assert text.push([0xE2]) == "" and text.flush() == "\ufffd"
    assert text.text == "aé€b\ufffdc\ufffd"


# ----------------------------------------------------------------------------------- the CLI
def cli_json(ckpt: Path, *extra: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "qspec_jax.cli.generate", "--checkpoint", str(ckpt), "--chat",
                          "--prompt", "Tell me a story", "--max-new-tokens", "400", "--json", *extra],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_stream_prints_what_the_plain_run_prints(tiny_chat_checkpoint: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from qspec_jax.cli import generate as cli

    args = ["--checkpoint", str(tiny_chat_checkpoint), "--chat", "--prompt", "Hi", "--max-new-tokens", "24"]
    assert cli.main(args) == 0
    plain = capsys.readouterr().out
    assert cli.main(args + ["--stream"]) == 0
    assert capsys.readouterr().out == plain
    with pytest.raises(SystemExit) as info:
        cli.main(args + ["--stream", "--json"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == ("qspec-generate: error: --stream prints text as it is generated and "
                                               "--json one object at the end; choose one")


def test_interrupt_without_stream_prints_the_text_so_far(tiny_chat_checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A KeyboardInterrupt in the middle of a run (raised where the tokens arrive, as Ctrl-C
    does in the waiting main thread): the text of the tokens generated so far is printed, and
    the tool returns 130."""
    from qspec_jax.cli import generate as cli

    seen: list[int] = []
    real_add = cli.Partial.add

    def add(self: Any, new: list[int]) -> None:
        real_add(self, new)
        seen.extend(new)
        if len(seen) >= 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli.Partial, "add", add)
    model_decode = __import__("qspec_jax").load(tiny_chat_checkpoint).decode
    rc = cli.main(["--checkpoint", str(tiny_chat_checkpoint), "--chat", "--prompt", "Hi", "--max-new-tokens", "24"])
    captured = capsys.readouterr()
    assert rc == 130 and 5 <= len(seen) < 24
    assert captured.out == model_decode(seen) + "\n"
    assert captured.err.splitlines()[-1] == "qspec-generate: interrupted"


@pytest.mark.slow  # two processes, each loading JAX and the model
@pytest.mark.parametrize("stream", [True, False])
def test_sigint_keeps_the_text_and_exits_130(tiny_chat_checkpoint: Path, stream: bool) -> None:
    """A real Ctrl-C (SIGINT) to a running `qspec-generate`: exit status 130, one line on stderr
    and no traceback, and on stdout (with --stream) a prefix of the full answer: what had been
    printed when the signal came. Without --stream, the signal comes as soon as the model is
    loaded (before or during generation): the same exit, and the text of whatever was generated."""
    cmd = [sys.executable, "-m", "qspec_jax.cli.generate", "--checkpoint", str(tiny_chat_checkpoint), "--chat",
           "--prompt", "Tell me a story", "--max-new-tokens", "400"]
    full = cli_json(tiny_chat_checkpoint)["text"]
    proc = subprocess.Popen(cmd + (["--stream"] if stream else []), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=REPO)
    seen = b""
    deadline = time.monotonic() + 300
    if stream:  # wait for the first text, then stop the process where it is and interrupt it
        while not seen and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1)[0]:
                seen += os.read(proc.stdout.fileno(), 1 << 16)
        assert seen, "no streamed text within 300 s"
    else:  # wait for the draft line (the model is loaded), then interrupt
        line = proc.stderr.readline()
        assert b"draft:" in line, line
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    text = (seen + out).decode()
    assert proc.returncode == 130, err
    assert b"Traceback" not in err and err.decode().strip().splitlines()[-1] == "qspec-generate: interrupted"
    if stream or text:  # (nothing at all when the signal came before generation started)
        assert text.endswith("\n") and full.startswith(text[:-1].rstrip("\ufffd"))  # (a character cut in half)
    if stream:
        assert 0 < len(text) - 1 < len(full)
