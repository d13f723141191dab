"""The command-line tools as a user meets them: help texts, errors that name the flag typed,
validation before anything loads, text files, checkpoints without a tokenizer, and which
INT4 draft generation and evaluation use (the stored one, unless a flag asks for another).

Flag errors need no model: they are found before the checkpoint is read. Generation runs use
`tiny_chat_checkpoint` (a tiny Llama with a byte-level tokenizer and chat template, converted
with the default INT4 draft).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from qspec_jax.cache import DEFAULT_GAMMA_MAX as GMAX
from qspec_jax.cli import KV_GROUP_SIZES, bench, eval_accept, eval_ppl, generate

CLIS = {"qspec-generate": generate, "qspec-eval-ppl": eval_ppl, "qspec-eval-accept": eval_accept}
STORED_LINE = "draft: the checkpoint's stored INT4 weights (gptq, group 32, all linears + lm_head)"


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every CLI's parser, and those of the benchmarks that build theirs in build_parser()."""
    import importlib

    from convert import cli as convert_cli

    found = {name: mod.build_parser() for name, mod in CLIS.items()}
    found["qspec-convert"] = convert_cli.build_parser()
    for name, (module, _) in bench.BENCHMARKS.items():
        mod = importlib.import_module(module)
        if hasattr(mod, "build_parser"):
            found[f"qspec-bench {name}"] = mod.build_parser()
    return found


def rendered_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help line of `action` exactly as --help prints it (defaults and placeholders filled in)."""
    return parser._get_formatter()._expand_help(action)


def error_of(main: Callable[[list[str]], int], argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Runs a CLI expecting exit status 2 and exactly one `PROG: error: ...` line; returns it."""
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in argv])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], lines
    return lines[0]


# ----------------------------------------------------------------------------------- help texts
@pytest.mark.parametrize("name", ["qspec-convert", "qspec-generate", "qspec-eval-ppl", "qspec-eval-accept",
                                  "qspec-bench"])
def test_every_option_is_described_with_its_default(name: str) -> None:
    found = parsers()
    if name == "qspec-bench":
        benches = [n for n in found if n.startswith("qspec-bench ")]
        assert {"qspec-bench kernel", "qspec-bench e2e", "qspec-bench quality"} <= set(benches)
        for bench_name in benches:
            _check_options(bench_name, found[bench_name])
    else:
        _check_options(name, found[name])


def _check_options(name: str, parser: argparse.ArgumentParser) -> None:
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert options
    for action in options:
        text = rendered_help(parser, action)
        assert action.help and len(action.help) >= 12, (name, action.option_strings, action.help)
        flag = action.nargs == 0 and action.default in (False, None)
        required = action.required or any(g.required and action in g._group_actions
                                          for g in parser._mutually_exclusive_groups)
        if not (flag or required):
            assert "default" in text, (name, action.option_strings, text)
        if not name.startswith("qspec-bench"):  # ours never print a bare Python None
            assert "(default: None)" not in text and "{group" not in text, (name, action.option_strings, text)


def test_limits_are_stated() -> None:
    p = parsers()
    helps = {name: {a.dest: rendered_help(parser, a) for a in parser._actions} for name, parser in p.items()}
    assert f"1..{GMAX} (gamma_max" in helps["qspec-generate"]["gamma"]
    assert f"1..{GMAX}, gamma_max" in helps["qspec-eval-accept"]["gamma"]
    for name in ("qspec-convert", "qspec-generate", "qspec-eval-ppl", "qspec-eval-accept"):
        assert "one of 32, 64, 128" in helps[name]["draft_group"], name
        assert "default: " in helps[name]["draft_group"]
    assert "default: 32)" in helps["qspec-convert"]["draft_group"]  # DraftWeightsConfig's
    for name in ("qspec-eval-ppl", "qspec-eval-accept"):
        assert ", ".join(map(str, KV_GROUP_SIZES)) in helps[name]["group_size"]
    for method in ("clip", "minmax", "hqq", "gptq"):
        assert method in helps["qspec-convert"]["draft_method"]


def test_convert_help_does_not_need_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    from convert import cli as convert_cli

    with pytest.raises(SystemExit) as info:
        convert_cli.main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "input rows per quantization group, one of 32, 64, 128 (default: 32)" in text
    assert "Exit status: 0 written, 2 bad input, 130/143 interrupted" in text


def test_bench_help_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (module, line) in bench.BENCHMARKS.items():
        assert f"  {name}  " in out or f"  {name} " in out
        assert line in out and len(line) > 40
    assert bench.main(["nope"]) == 2
    assert f"unknown benchmark 'nope'; choose one of {', '.join(bench.BENCHMARKS)}" in capsys.readouterr().err


# ------------------------------------------------------------------------------ flag errors
BAD_FLAGS = [
    ("qspec-generate", ["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    ("qspec-generate", ["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    ("qspec-generate", ["--gamma", str(GMAX + 1)], f"--gamma must be in 1..{GMAX} (gamma_max), got {GMAX + 1}"),
    ("qspec-generate", ["--gamma", "0"], f"--gamma must be in 1..{GMAX} (gamma_max), got 0"),
    ("qspec-generate", ["--temperature", "-1"], "--temperature must be >= 0 (0 = greedy), got -1.0"),
    ("qspec-generate", ["--top-k", "-3"], "--top-k must be >= 0 (0 = all tokens), got -3"),
    ("qspec-generate", ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    ("qspec-generate", ["--tp", "0"], "--tp must be >= 1, got 0"),
    ("qspec-generate", ["--draft-group", "48"], "--draft-group must be one of 32, 64, 128, got 48"),
    ("qspec-eval-ppl", ["--batch", "0"], "--batch must be >= 1, got 0"),
    ("qspec-eval-ppl", ["--offset", "-10"], "--offset must be >= 0, got -10"),
    ("qspec-eval-ppl", ["--group-size", "7"], "--group-size must be one of 16, 32, 64, 128, 256, got 7"),
    ("qspec-eval-ppl", ["--context", "0"], "--context must be >= 1, got 0"),
    ("qspec-eval-ppl", ["--eval-tokens", "0"], "--eval-tokens must be >= 1, got 0"),
    ("qspec-eval-ppl", ["--draft-group", "64"], "add --draft-weights to evaluate with the draft's weights"),
    ("qspec-eval-accept", ["--gamma", f"2,{GMAX + 2}"], f"--gamma must be in 1..{GMAX} (gamma_max), got {GMAX + 2}"),
    ("qspec-eval-accept", ["--context", "0,64"], "--context must be >= 1, got 0"),
    ("qspec-eval-accept", ["--group-size", "7"], "--group-size must be one of 16, 32, 64, 128, 256, got 7"),
    ("qspec-eval-accept", ["--batch", "0"], "--batch must be >= 1, got 0"),
    ("qspec-eval-accept", ["--offset", "-1"], "--offset must be >= 0, got -1"),
    ("qspec-eval-accept", ["--new-tokens", "0"], "--new-tokens must be >= 1, got 0"),
]
BASE_ARGS = {"qspec-generate": ["--prompt", "hi"],
             "qspec-eval-ppl": ["--text", "t.txt", "--context", "8", "--eval-tokens", "8"],
             "qspec-eval-accept": ["--text", "t.txt", "--context", "8", "--gamma", "2", "--new-tokens", "8"]}


def _with(base: list[str], extra: list[str]) -> list[str]:
    """base with extra's flags replacing the same flags in base."""
    out, skip = [], set(extra[::2])
    for flag, value in zip(base[::2], base[1::2]):
        if flag not in skip:
            out += [flag, value]
    return out + extra


@pytest.mark.parametrize("prog, argv, message", BAD_FLAGS)
def test_bad_flag_names_the_flag(prog: str, argv: list[str], message: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before the checkpoint is read (it does not exist here), with the flag as typed."""
    line = error_of(CLIS[prog].main, ["--checkpoint", tmp_path / "none", *_with(BASE_ARGS[prog], argv)], capsys)
    assert line.startswith(f"{prog}: error: ") and message in line, line


def _binary(path: Path, kind: str) -> Path:
    path.write_bytes(b"PK\x03\x04\x00\x00binary" if kind == "nul" else "caf\xe9 latin-1\n".encode("latin-1"))
    return path


@pytest.mark.parametrize("kind, why", [("nul", "NUL byte at byte 4"),
                                       ("latin1", "invalid continuation byte at byte 3")])
@pytest.mark.parametrize("prog, flag", [("qspec-eval-ppl", "--text"), ("qspec-eval-accept", "--text"),
                                        ("qspec-generate", "--prompt-file")])
def test_binary_text_file_is_refused(prog: str, flag: str, kind: str, why: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    bad = _binary(tmp_path / "data.bin", kind)
    argv = ["--checkpoint", tmp_path / "none", *BASE_ARGS[prog]]
    argv = [bad if a == "t.txt" else a for a in argv] if flag == "--text" else \
        ["--checkpoint", tmp_path / "none", "--prompt-file", bad]
    line = error_of(CLIS[prog].main, argv, capsys)
    assert line == f"{prog}: error: {flag} {bad}: not a UTF-8 text file ({why}); expected plain text", line


@pytest.mark.parametrize("prog, flag", [("qspec-eval-ppl", "--text"), ("qspec-generate", "--prompt-file")])
def test_missing_text_file_is_refused(prog: str, flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--checkpoint", tmp_path / "none"] + ([*_with(BASE_ARGS[prog], ["--text", str(tmp_path / "gone.txt")])]
                                                  if flag == "--text" else ["--prompt-file", tmp_path / "gone.txt"])
    line = error_of(CLIS[prog].main, argv, capsys)
    assert line == f"{prog}: error: {flag} {tmp_path / 'gone.txt'}: no such file"


# ------------------------------------------------------------------------- no tokenizer
def test_checkpoint_without_tokenizer(synthetic_hf_dir: Callable[..., Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Converted with a warning (test_convert); the text tools then refuse it naming the
    checkpoint, before compiling anything."""
    from convert import convert

    ckpt = convert(synthetic_hf_dir(), tmp_path / "ckpt", progress=False)
    text = tmp_path / "t.txt"
    text.write_text("plain text " * 50)
    expect = f"error: the checkpoint {ckpt} has no tokenizer: it was converted from a model without tokenizer files"
    for prog, argv in (("qspec-generate", ["--prompt", "hi"]),
                       ("qspec-eval-ppl", ["--text", text, "--context", "8", "--eval-tokens", "8"])):
        line = error_of(CLIS[prog].main, ["--checkpoint", ckpt, *argv], capsys)
        assert line.startswith(f"{prog}: {expect}"), line


# --------------------------------------------------------------------------- draft choice
@pytest.fixture
def no_quantizing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any INT4 quantization of the draft fails the test: the stored draft must be used."""
    import qspec_jax.calibration as calibration
    import qspec_jax.weight_quant as weight_quant

    def refuse(*a: Any, **k: Any) -> None:
        pytest.fail("the draft was quantized again")

    monkeypatch.setattr(calibration, "make_draft", refuse)  # what Model.with_draft_weights calls
    monkeypatch.setattr(weight_quant, "make_draft_params", refuse)


def test_generate_uses_the_stored_draft(tiny_chat_checkpoint: Path, no_quantizing: None,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A default conversion + a default qspec-generate: the stored draft as it is, said in one line."""
    assert generate.main(["--checkpoint", str(tiny_chat_checkpoint), "--chat", "--prompt", "Hello there",
                          "--max-new-tokens", "6", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert 1 <= len(out["tokens"]) <= 6 and 0.0 <= out["acceptance_rate"] <= 1.0
    assert captured.err.splitlines() == [f"qspec-generate: {STORED_LINE}"]


def test_eval_accept_uses_the_stored_draft(tiny_chat_checkpoint: Path, no_quantizing: None, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat. " * 20)
    assert eval_accept.main(["--checkpoint", str(tiny_chat_checkpoint), "--text", str(text), "--context", "32",
                             "--gamma", "2,3", "--new-tokens", "8", "--group-size", "16", "--teacher-forced",
                             "--json"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert [(r["context"], r["gamma"]) for r in rows] == [(32, 2), (32, 3)]
    assert captured.err.splitlines() == [f"qspec-eval-accept: {STORED_LINE}"]


def test_a_different_format_is_quantized_and_said(tiny_chat_checkpoint: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A flag equal to the stored format keeps the stored object; a different one quantizes a new
    draft (equal to quantizing the target with that format) and the line names the flag."""
    import qspec_jax
    from qspec_jax.cli import use_draft
    from qspec_jax.weight_quant import make_draft_params

    model = qspec_jax.load(tiny_chat_checkpoint)
    assert use_draft("qspec-generate", model, {"method": "gptq", "group_size": 32}) is model
    assert capsys.readouterr().err.strip() == f"qspec-generate: {STORED_LINE}"
    other = use_draft("qspec-generate", model, {"method": "minmax", "lm_head": False})
    assert capsys.readouterr().err.strip() == (
        "qspec-generate: draft: quantizing INT4 weights now (minmax, group 32, all linears, lm_head not "
        "quantized): --draft-method minmax, --no-draft-lm-head differ from the checkpoint's stored draft "
        "(gptq, group 32, all linears + lm_head)")
    assert other.draft_weights_config.method == "minmax" and not other.draft_weights_config.lm_head
    ref = make_draft_params(model.params, other.draft_weights_config)
    np.testing.assert_array_equal(np.asarray(other.draft_params.layers.wq.packed), np.asarray(ref.layers.wq.packed))
    assert not np.array_equal(np.asarray(other.draft_params.layers.wq.packed),
                              np.asarray(model.draft_params.layers.wq.packed))


def test_group_that_does_not_divide_names_the_flag(tiny_chat_checkpoint: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import qspec_jax
    from qspec_jax.cli import use_draft

    with pytest.raises(SystemExit) as info:  # the tiny model's hidden size is 32
        use_draft("qspec-generate", qspec_jax.load(tiny_chat_checkpoint), {"group_size": 64})
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "qspec-generate: error: --draft-group 64 does not divide the input dimension of layers/w_gate (input dim 32), "
        "layers/w_up (input dim 32), layers/wk (input dim 32), layers/wo (input dim 32), layers/wq (input dim 32), "
        "layers/wv (input dim 32), lm_head (input dim 32); choose a group size that does"]


def test_calibrated_method_is_made_on_the_builtin_text(tiny_chat_checkpoint: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """--draft-method gptq on a checkpoint that stores another draft: calibrated now on the
    built-in text through the checkpoint's tokenizer, as a default conversion stores it (same
    codes), and the line says so."""
    import qspec_jax
    from qspec_jax.cli import use_draft

    model = qspec_jax.load(tiny_chat_checkpoint)
    clip = use_draft("qspec-generate", model, {"method": "clip"})
    capsys.readouterr()
    again = use_draft("qspec-generate", clip, {"method": "gptq"})
    first = capsys.readouterr().err.splitlines()[0]
    assert first == ("qspec-generate: draft: quantizing INT4 weights now (gptq, group 32, all linears + lm_head): "
                     "--draft-method gptq differs from the checkpoint's stored draft (clip, group 32, all linears + "
                     "lm_head); calibrating on the built-in text, which takes a while on a CPU (qspec-convert "
                     "stores it)")
    assert again.draft_weights_config == model.draft_weights_config
    for name in ("wq", "w_down"):
        np.testing.assert_array_equal(np.asarray(getattr(again.draft_params.layers, name).packed),
                                      np.asarray(getattr(model.draft_params.layers, name).packed))


def test_checkpoint_without_draft_says_it_quantizes(tiny_chat_checkpoint: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import qspec_jax
    from qspec_jax.checkpoint import MANIFEST
    from qspec_jax.cli import use_draft

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_chat_checkpoint, ckpt)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    del manifest["draft_weights"]
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    model = use_draft("qspec-eval-ppl", qspec_jax.load(ckpt), {"method": "clip"})
    assert model.draft_params is not None
    assert capsys.readouterr().err.strip() == (
        "qspec-eval-ppl: draft: quantizing INT4 weights now (clip, group 32, all linears + lm_head): the checkpoint "
        "stores none (qspec-convert stores one unless --draft-weights none)")


def test_python_api_says_when_it_requantizes(tiny_chat_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SpecConfig() matches the stored default draft (used as it is); another format warns."""
    import qspec_jax
    import qspec_jax.calibration as calibration
    import qspec_jax.checkpoint as checkpoint
    from qspec_jax.speculative import SpecConfig, draft_params_for

    model = qspec_jax.load(tiny_chat_checkpoint)
    assert draft_params_for(model, SpecConfig()) is model.draft_params
    monkeypatch.setattr(calibration, "make_draft", lambda params, cfg, **kw: (("made", cfg), None))
    monkeypatch.setattr(checkpoint.M, "for_device", lambda params: params)  # the stand-in is no Params
    with pytest.warns(UserWarning, match="quantizing the INT4 draft again: the checkpoint stores"):
        made = draft_params_for(model, SpecConfig(draft_method="minmax"))
    assert made == ("made", SpecConfig(draft_method="minmax").draft_weights_config)
