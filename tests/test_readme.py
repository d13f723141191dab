"""The README's Python code runs as written: every ```python block, in order, in one namespace
(a later block continues an earlier one), on the CPU, with the checkpoint path the README uses
replaced by a tiny converted checkpoint that has a tokenizer, a chat template and the default
INT4 draft (`tiny_chat_checkpoint`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
README_CHECKPOINT = "checkpoints/smollm2-135m-instruct"  # what `make demo` converts


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_readme_python_blocks_run(tiny_chat_checkpoint: Path, capsys: Any) -> None:
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 2, "the README's Python API and lower-level examples"
    assert f'"{README_CHECKPOINT}"' in blocks[0]
    ns: dict[str, Any] = {"__name__": "readme"}
    for i, block in enumerate(blocks):
        code = compile(block.replace(f'"{README_CHECKPOINT}"', repr(str(tiny_chat_checkpoint))),
                       f"README.md python block {i + 1}", "exec")
        exec(code, ns)  # noqa: S102 - the point of the test
    # What the blocks promise, on the tiny model: spec and AR results, the decode step's shapes.
    assert ns["model"].path == tiny_chat_checkpoint and ns["model"].draft_params is not None
    assert 1 <= len(ns["res"].to_lists()[0]) <= 64 and 0.0 <= ns["res"].acceptance_rate <= 1.0
    assert 1 <= len(ns["ar"].to_lists()[0]) <= 64
    vocab = ns["model"].config.vocab_size
    assert ns["tokens"].shape == (1, len(ns["ids"])) and ns["next_tok"].shape == (1, 1)
    assert ns["logits"].shape == (1, 1, vocab) and np.isfinite(np.asarray(ns["logits"])).all()
    assert np.asarray(ns["cache"].total_lengths()).tolist() == [len(ns["ids"])]  # rolled back to the prompt
    assert capsys.readouterr().out.strip()  # the example prints its text and rates


def test_token_shapes_are_explained(tiny_chat_checkpoint: Path) -> None:
    """A [B] token vector (the natural first try after argmax) is refused with the shape expected."""
    import jax.numpy as jnp
    import pytest

    import qspec_jax
    from qspec_jax import QuantSpecCache, decode, prefill

    model = qspec_jax.load(tiny_chat_checkpoint)
    cache = QuantSpecCache.init(model.config, batch=1, max_len=128, group_size=16, gamma_max=8)
    with pytest.raises(ValueError, match=r"decode: tokens must be int32\[B, T\].*got shape \(1,\)"):
        decode(model.params, jnp.zeros((1,), jnp.int32), cache)
    with pytest.raises(ValueError, match=r"prefill: tokens must be int32\[B, T\].*got shape \(5,\)"):
        prefill(model.params, jnp.zeros((5,), jnp.int32), jnp.asarray([5], jnp.int32), cache)
