"""`make demo` on the real model, as a new user runs it on a CPU: the demo's prompt and two more
questions get right answers, speculative tokens equal autoregressive tokens of the same target,
and the speed lines name the device and say why speculation is slower on it.

The checkpoint is converted as `make demo` converts it (`smollm2_demo_checkpoint`: bfloat16
weights, the default INT4 draft); qspec-generate then computes in float32 on the CPU
(`--dtype auto`), which is what makes the first answer token right: in bfloat16 arithmetic
"The" and "L" are within one rounding step of each other (README).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from qspec_jax.cli import generate

REPO = Path(__file__).resolve().parent.parent


def demo_argv(checkpoint: Path, prompt: str) -> list[str]:
    """The Makefile's demo command line, with its checkpoint and prompt filled in."""
    line = next(x for x in (REPO / "Makefile").read_text().splitlines() if "qspec-generate" in x and "$(CKPT)" in x)
    argv = shlex.split(line.split("qspec-generate", 1)[1].replace("$(PROMPT)", "PROMPT_HERE"))
    return [str(checkpoint) if a == "$(CKPT)" else prompt if a == "PROMPT_HERE" else a for a in argv]


@pytest.mark.slow
def test_make_demo_answers_right_and_explains_its_speed(smollm2_demo_checkpoint: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    default_prompt = re.search(r"^PROMPT \?= (.*)$", (REPO / "Makefile").read_text(), re.M)[1]
    assert default_prompt == "What is the capital of France?"
    assert generate.main(demo_argv(smollm2_demo_checkpoint, default_prompt)) == 0
    out = capsys.readouterr()
    assert "Paris" in out.out and "L'" not in out.out, out.out
    err = out.err.splitlines()
    spec = next(x for x in err if x.startswith("[spec]"))
    assert "CPU (" in spec and "float32, int8 KV cache" in spec
    assert any(x.startswith("[ar] ") and "the same target: same tokens" in x for x in err), err
    why = next(x for x in err if x.startswith("why: "))
    assert "speculation does not pay on a CPU" in why or "yet speculation paid off here" in why


@pytest.mark.slow
@pytest.mark.parametrize("question, answer", [("What is 2 + 2?", r"\b4\b"),
                                              ("How many days are in a week?", r"\b7\b|\bseven\b")])
def test_demo_answers_more_questions(smollm2_demo_checkpoint: Path, question: str, answer: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert generate.main([*demo_argv(smollm2_demo_checkpoint, question), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert re.search(answer, out["text"], re.I), out["text"]
    assert out["ar_same_tokens"] is True and out["dtype"] == "float32"
