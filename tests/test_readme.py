"""The README runs as written: every ```python block on its own (each is self-contained), on the
CPU, with the checkpoint path the README uses replaced by a tiny converted checkpoint that has a
tokenizer, a chat template and the default INT4 draft (`tiny_chat_checkpoint`); the shell
block's make targets exist; every flag and choice of the command-line synopsis is one the tool
accepts; the benchmark list is complete; the --tp claim names exactly the tools that take it."""

from __future__ import annotations

import re
import shlex
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
    spaces = []
    for i, block in enumerate(blocks):
        assert f'"{README_CHECKPOINT}"' in block, f"block {i + 1} is not self-contained: it loads no checkpoint"
        code = compile(block.replace(f'"{README_CHECKPOINT}"', repr(str(tiny_chat_checkpoint))),
                       f"README.md python block {i + 1}", "exec")
        ns: dict[str, Any] = {"__name__": "readme"}
        exec(code, ns)  # noqa: S102 - the point of the test: each block alone, as a user pastes it
        spaces.append(ns)
    api = spaces[0]
    low = next(ns for ns in spaces if "next_tok" in ns)  # the lower-level block
    streamed = [ns for ns in spaces if "stream" in ns]  # the streaming block: the same tokens as `generate`
    assert streamed and streamed[0]["stream"].result.to_lists() == api["res"].to_lists()
    # What the blocks promise, on the tiny model: spec and AR results, the decode step's shapes.
    assert api["model"].path == tiny_chat_checkpoint and api["model"].draft_params is not None
    assert api["model"].config.dtype == "float32"  # dtype="auto" on a CPU
    assert 1 <= len(api["res"].to_lists()[0]) <= 64 and 0.0 <= api["res"].acceptance_rate <= 1.0
    assert api["ar"].to_lists() == api["res"].to_lists()
    vocab = low["model"].config.vocab_size
    assert low["tokens"].shape == (1, len(low["ids"])) and low["next_tok"].shape == (1, 1)
    assert low["logits"].shape == (1, 1, vocab) and np.isfinite(np.asarray(low["logits"])).all()
    assert np.asarray(low["cache"].total_lengths()).tolist() == [len(low["ids"])]  # rolled back to the prompt
    assert capsys.readouterr().out.strip()  # the examples print their text and rates


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_make_targets_exist() -> None:
    """The shell block's `make` targets are the Makefile's (they are run by CI and `make demo`
    users; the demo's own command line is checked by test_makefile_demo_command_parses)."""
    makefile = (README.parent / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):", makefile, flags=re.M))
    used = [line.split()[1] for block in shell_blocks(README.read_text()) for line in block.splitlines()
            if line.startswith("make ")]
    assert used and set(used) <= targets, (used, targets)


def test_makefile_demo_command_parses() -> None:
    """`make demo`'s qspec-generate command line is one qspec-generate accepts, and it compares
    with autoregressive decoding of the same target."""
    from qspec_jax.cli.generate import build_parser

    makefile = (README.parent / "Makefile").read_text()
    line = next(x for x in makefile.splitlines() if "qspec-generate" in x and "$(CKPT)" in x)
    argv = shlex.split(line.split("qspec-generate", 1)[1].replace("$(CKPT)", "ckpt").replace("$(PROMPT)", "Hi"))
    args = build_parser().parse_args(argv)
    assert args.compare_ar == "same" and args.chat and args.dtype == "auto"


SYNOPSIS_TOOLS = ("qspec-convert", "qspec-generate", "qspec-eval-ppl", "qspec-eval-accept", "qspec-bench")


def synopsis_commands() -> list[tuple[str, str]]:
    """(tool, the rest of its command) for every command of the README's text synopsis, with
    continuation lines joined."""
    block = re.search(r"^Synopsis .*?\n\n```text\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    assert block, "the README's command-line synopsis"
    commands: list[list[str]] = []
    for line in block[1].splitlines():
        text = line.split("#", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not text.strip():
            continue
        first = text.split()[0]
        if first in SYNOPSIS_TOOLS:
            commands.append([first, text.split(None, 1)[1] if len(text.split()) > 1 else ""])
        elif line.startswith(" ") and commands:
            commands[-1][1] += " " + text.strip()
    return [(tool, rest) for tool, rest in commands]


def test_readme_synopsis_matches_the_tools() -> None:
    """Every flag in the synopsis exists in its tool, and every `a|b` list of values is a subset
    of what the flag accepts: the synopsis is a synopsis of the real tools, not of old ones."""
    import importlib

    from convert import cli as convert_cli
    from qspec_jax.cli import bench, eval_accept, eval_ppl, generate

    parsers = {"qspec-convert": convert_cli.build_parser(), "qspec-generate": generate.build_parser(),
               "qspec-eval-ppl": eval_ppl.build_parser(), "qspec-eval-accept": eval_accept.build_parser()}
    commands = synopsis_commands()
    assert {tool for tool, _ in commands} == set(SYNOPSIS_TOOLS)
    for tool, rest in commands:
        tokens = rest.replace("[", " ").replace("]", " ").split()
        if tool == "qspec-bench":
            names = tokens[0].split("|")
            assert names == list(bench.BENCHMARKS), f"the README lists benchmarks {names}, qspec-bench has " \
                                                    f"{list(bench.BENCHMARKS)}"
            targets = [importlib.import_module(bench.BENCHMARKS[n][0]).build_parser() for n in names]
            tokens = tokens[1:]
        else:
            targets = [parsers[tool]]
        for parser in targets:
            flags = {f: a for a in parser._actions for f in a.option_strings}
            for i, tok in enumerate(tokens):
                if not tok.startswith("--"):
                    continue
                assert tok in flags, f"{tool}: the README's {tok} is not an option of {parser.prog}"
                value = tokens[i + 1] if i + 1 < len(tokens) else ""
                if "|" in value and flags[tok].choices is not None:
                    assert set(value.split("|")) <= set(flags[tok].choices), (tool, tok, value)


def test_readme_tp_claim() -> None:
    """The README names exactly the tools that take --tp."""
    from convert import cli as convert_cli
    from qspec_jax.cli import eval_accept, eval_ppl, generate

    text = " ".join(README.read_text().split())
    claim = "`qspec-generate`, `qspec-eval-ppl` and `qspec-eval-accept` take `--tp N`"
    assert claim in text and "All CLIs take" not in text
    for mod in (generate, eval_ppl, eval_accept):
        assert any("--tp" in a.option_strings for a in mod.build_parser()._actions), mod.__name__
    assert not any("--tp" in a.option_strings for a in convert_cli.build_parser()._actions)


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
