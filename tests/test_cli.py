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
    ("qspec-generate", ["--prefill-chunk", "0"],
     "argument --prefill-chunk: expected 'auto', 'whole' or a positive number of tokens, got '0'"),
    ("qspec-generate", ["--prefill-chunk", "all"],
     "argument --prefill-chunk: expected 'auto', 'whole' or a positive number of tokens, got 'all'"),
    ("qspec-eval-ppl", ["--batch", "0"], "--batch must be >= 1, got 0"),
    ("qspec-eval-ppl", ["--offset", "-10"], "--offset must be >= 0, got -10"),
    ("qspec-eval-ppl", ["--group-size", "7"], "--group-size must be one of 16, 32, 64, 128, 256, got 7"),
    ("qspec-eval-ppl", ["--context", "0"], "--context must be >= 1, got 0"),
    ("qspec-eval-ppl", ["--eval-tokens", "0"], "--eval-tokens must be >= 1, got 0"),
    ("qspec-eval-ppl", ["--draft-group", "64"], "add --weights draft to evaluate with the draft's weights"),
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


# ------------------------------------------------------------------ the newcomer's list (issue 25)
def test_non_utf8_prompt_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes that are not UTF-8 reach Python as surrogate escapes; encoding them used to raise a
    UnicodeEncodeError traceback inside the tokenizer."""
    line = error_of(generate.main, ["--checkpoint", tmp_path / "none", "--prompt", "caf\udce9 au lait"], capsys)
    assert line == ("qspec-generate: error: --prompt is not valid UTF-8 text (byte e9 at character 3); pass UTF-8 "
                    "text, or the prompt in a UTF-8 file with --prompt-file")


def test_non_utf8_prompt_from_the_shell(tmp_path: Path) -> None:
    """The same through a real command line (argv bytes), before jax is even imported."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "qspec_jax.cli.generate", "--checkpoint", str(tmp_path),
                           "--prompt", b"caf\xe9"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == ["qspec-generate: error: --prompt is not valid UTF-8 text (byte e9 at character "
                                        "3); pass UTF-8 text, or the prompt in a UTF-8 file with --prompt-file"]


@pytest.mark.parametrize("prompt, why", [("   \n\t", "is empty (only whitespace)"), ("", "is empty:")])
@pytest.mark.parametrize("chat", [False, True])
def test_blank_prompt_is_refused(prompt: str, why: str, chat: bool, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--checkpoint", tmp_path / "none", "--prompt", prompt] + (["--chat"] if chat else [])
    line = error_of(generate.main, argv, capsys)
    assert line.startswith(f"qspec-generate: error: --prompt {why}"), line


def test_gguf_file_as_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gguf = tmp_path / "SmolLM2.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    line = error_of(generate.main, ["--checkpoint", gguf, "--prompt", "hi"], capsys)
    assert line == (f"qspec-generate: error: {gguf}: a .gguf file, not a converted checkpoint; convert it once with "
                    f"`qspec-convert {gguf} OUT` and pass the directory OUT")
    other = tmp_path / "notes.txt"
    other.write_text("x")
    line = error_of(generate.main, ["--checkpoint", other, "--prompt", "hi"], capsys)
    assert line.endswith(f"{other}: a file, not a checkpoint directory (qspec-convert writes a directory)")


def _broken_copy(src: Path, dst: Path, breakage: str) -> Path:
    shutil.copytree(src, dst)
    if breakage == "truncated tokenizer.json":
        data = (dst / "tokenizer" / "tokenizer.json").read_bytes()
        (dst / "tokenizer" / "tokenizer.json").write_bytes(data[: len(data) // 2])
    elif breakage == "binary tokenizer.json":
        (dst / "tokenizer" / "tokenizer.json").write_bytes(b"\xfe\xff\x00garbage")
    elif breakage == "no tokenizer.json":
        (dst / "tokenizer" / "tokenizer.json").unlink()
    elif breakage == "no model_config.json":
        (dst / "model_config.json").unlink()
    elif breakage == "bad model_config.json":
        (dst / "model_config.json").write_text('{"vocab_size": ')
    return dst


@pytest.mark.parametrize("breakage, message", [
    ("truncated tokenizer.json", "tokenizer/tokenizer.json: not valid JSON (Unterminated string"),
    ("binary tokenizer.json", "tokenizer/tokenizer.json: not a UTF-8 text file (invalid start byte at byte 0)"),
    ("no tokenizer.json", "tokenizer/tokenizer.json: no such file; the checkpoint's tokenizer is incomplete"),
    ("no model_config.json", "model_config.json: missing; the checkpoint is incomplete: re-run qspec-convert"),
    ("bad model_config.json", "model_config.json: not valid JSON (Expecting value"),
])
def test_damaged_checkpoint_names_the_file(tiny_chat_checkpoint: Path, tmp_path: Path, breakage: str, message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _broken_copy(tiny_chat_checkpoint, tmp_path / "ckpt", breakage)
    line = error_of(generate.main, ["--checkpoint", ckpt, "--prompt", "hi"], capsys)
    assert line.startswith(f"qspec-generate: error: {ckpt}/") and message in line, line


def test_damaged_tokenizer_through_the_api(tiny_chat_checkpoint: Path, tmp_path: Path) -> None:
    import qspec_jax

    ckpt = _broken_copy(tiny_chat_checkpoint, tmp_path / "ckpt", "truncated tokenizer.json")
    with pytest.raises(qspec_jax.CheckpointError, match=r"tokenizer\.json: not valid JSON .* re-run qspec-convert"):
        qspec_jax.load(ckpt)


@pytest.mark.parametrize("kind", ["under a file", "a directory"])
def test_unwritable_plan_cache_is_refused_before_measuring(kind: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Found after 76 s of measuring before; now before the checkpoint is even read."""
    (tmp_path / "file").write_text("x")
    cache = tmp_path / "file" / "costs.json" if kind == "under a file" else tmp_path
    line = error_of(generate.main, ["--checkpoint", tmp_path / "none", "--prompt", "hi", "--gamma", "auto",
                                    "--plan-cache", cache], capsys)
    expect = (f"--plan-cache {cache}: cannot be created: {tmp_path / 'file'} is not a directory"
              if kind == "under a file" else f"--plan-cache {cache}: exists and is not a regular file")
    assert line == f"qspec-generate: error: {expect}"


def test_eval_context_past_the_model_limit(tiny_chat_checkpoint: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The model's max_position_embeddings is named, not the text's length."""
    text = tmp_path / "t.txt"
    text.write_text("Some real text. " * 40)
    line = error_of(eval_ppl.main, ["--checkpoint", tiny_chat_checkpoint, "--text", text, "--context", "100000",
                                    "--eval-tokens", "16"], capsys)
    assert line == ("qspec-eval-ppl: error: --context 100000 + --eval-tokens 16 = 100016 positions, more than the "
                    "model's max_position_embeddings 512")
    line = error_of(eval_accept.main, ["--checkpoint", tiny_chat_checkpoint, "--text", text, "--context", "64,600",
                                       "--gamma", "2", "--new-tokens", "8"], capsys)
    assert line == ("qspec-eval-accept: error: --context 600 + --new-tokens 8 = 608 positions, more than the model's "
                    "max_position_embeddings 512")


def test_tp_larger_than_the_machine(tiny_chat_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import jax

    n = jax.local_device_count() + 1
    line = error_of(generate.main, ["--checkpoint", tiny_chat_checkpoint, "--prompt", "hi", "--tp", n], capsys)
    assert line == (f"qspec-generate: error: --tp {n}: only {n - 1} local cpu device(s) (without GPUs, set "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count={n} to split the CPU)")


def test_usage_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's own errors (a bad choice, a bad type, an unknown flag) are one line too."""
    line = error_of(generate.main, ["--checkpoint", tmp_path, "--prompt", "hi", "--mode", "beam"], capsys)
    assert line.startswith("qspec-generate: error: argument --mode: invalid choice: 'beam'")
    assert line.endswith("(`qspec-generate --help` lists the options)")
    line = error_of(eval_ppl.main, ["--checkpoint", tmp_path, "--draft-weights"], capsys)
    assert "unrecognized arguments: --draft-weights" in line or "required" in line


def test_draft_weights_flag_means_one_thing() -> None:
    """`--draft-weights` takes int4|bf16 (the draft's weights) wherever it exists; eval-ppl chooses
    the evaluated weights with `--weights target|draft` instead of a boolean --draft-weights."""
    found = parsers()
    for name in ("qspec-generate", "qspec-eval-accept"):
        action = next(a for a in found[name]._actions if "--draft-weights" in a.option_strings)
        assert tuple(action.choices) == ("int4", "bf16") and action.default == "int4", name
    ppl = {f: a for a in found["qspec-eval-ppl"]._actions for f in a.option_strings}
    assert "--draft-weights" not in ppl and tuple(ppl["--weights"].choices) == ("target", "draft")
    convert_action = next(a for a in found["qspec-convert"]._actions if "--draft-weights" in a.option_strings)
    assert tuple(convert_action.choices) == ("int4", "none")  # store the draft or not: a choice as well


def test_help_reads_as_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tool's and benchmark's --help, at several widths: each option's default appears once
    and as the user types it (no Python reprs: None, tuples, lists, Path objects), and no flag or
    identifier is split at a hyphen by the line wrapping."""
    import re

    for name, parser in parsers().items():
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            text = rendered_help(parser, action)
            assert text.count("(default") + text.count("default:") <= 2, (name, action.option_strings, text)
            assert len(re.findall(r"\(default[:)]", text)) <= 1, (name, action.option_strings, text)
            for bad in ("(default: None)", "(default: (", "(default: [", "PosixPath", "(default: <", "==SUPPRESS=="):
                assert bad not in text, (name, action.option_strings, text)
        for width in (60, 80, 100):
            monkeypatch.setenv("COLUMNS", str(width))
            out = parser.format_help()
            words = set(" ".join(out.split()).split(" "))
            source = " ".join(" ".join(rendered_help(parser, a).split()) for a in parser._actions if a.help)
            for token in set(source.split(" ")):
                if "-" in token.strip("-.,;:()`'\"") and token in source:
                    assert token in words, (name, width, token)


def test_gamma_max_copy_matches_the_cache() -> None:
    """qspec_jax.cli repeats DEFAULT_GAMMA_MAX and DEFAULT_GROUP_SIZE so that building the parsers imports no jax."""
    from qspec_jax import cli
    from qspec_jax.cache import DEFAULT_GAMMA_MAX, DEFAULT_GROUP_SIZE

    assert (cli.DEFAULT_GAMMA_MAX, cli.DEFAULT_GROUP_SIZE) == (DEFAULT_GAMMA_MAX, DEFAULT_GROUP_SIZE)


def test_tools_start_without_jax() -> None:
    """Importing the tools (and `import qspec_jax`) imports neither jax nor transformers: what runs
    before a tool's own Ctrl-C handling is milliseconds, and jax loads inside it."""
    import subprocess
    import sys

    code = ("import sys; import qspec_jax, qspec_jax.cli.generate, qspec_jax.cli.eval_ppl, qspec_jax.cli.eval_accept, "
            "qspec_jax.cli.bench, convert.cli; print(sorted(m for m in ('jax', 'transformers', 'torch') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    import qspec_jax

    assert qspec_jax.load is qspec_jax.checkpoint.load and qspec_jax.sharding.make_mesh  # lazily imported names
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        qspec_jax.nope  # noqa: B018


def _interrupt_when(proc: Any, ready: Callable[[], bool], timeout: float = 240) -> tuple[str, str]:
    import os
    import signal
    import time

    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the whole process group
    return proc.communicate(timeout=120)


def _jax_loading(pid: int) -> Callable[[], bool]:
    """True once the process has mapped jaxlib's shared library: it is importing jax."""

    def ready() -> bool:
        try:
            return "jaxlib" in Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return False

    return ready


@pytest.mark.parametrize("prog, module, argv", [
    ("qspec-generate", "qspec_jax.cli.generate", ["--prompt", "hi"]),
    ("qspec-eval-ppl", "qspec_jax.cli.eval_ppl", ["--text", "TEXT", "--context", "8", "--eval-tokens", "8"]),
    ("qspec-eval-accept", "qspec_jax.cli.eval_accept",
     ["--text", "TEXT", "--context", "8", "--gamma", "2", "--new-tokens", "8"]),
    ("qspec-bench quality", "qspec_jax.cli.bench", ["quality", "--text-dir", "DIR"]),
])
def test_early_ctrl_c_is_one_line(prog: str, module: str, argv: list[str], tiny_chat_checkpoint: Path,
                                  tmp_path: Path) -> None:
    """Ctrl-C while the tool imports jax (its first second): one line and exit status 130; it
    printed a 30-line KeyboardInterrupt traceback before."""
    import os
    import subprocess
    import sys

    if sys.platform != "linux":
        pytest.skip("watches /proc/PID/maps")
    (tmp_path / "t.txt").write_text("Some text to evaluate. " * 30)
    argv = [str(tmp_path / "t.txt") if a == "TEXT" else str(tmp_path) if a == "DIR" else a for a in argv]
    flag = "--checkpoint"
    proc = subprocess.Popen([sys.executable, "-m", module, *argv[:1], flag, str(tiny_chat_checkpoint), *argv[1:]]
                            if module.endswith("bench") else
                            [sys.executable, "-m", module, flag, str(tiny_chat_checkpoint), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    _, err = _interrupt_when(proc, _jax_loading(proc.pid))
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines() == [f"{prog}: interrupted"], err


@pytest.mark.slow  # a real generation per case: > ~15 CPU-s
def test_ctrl_c_while_compiling_is_one_line(tiny_chat_checkpoint: Path) -> None:
    import os
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "qspec_jax.cli.generate", "--checkpoint", str(tiny_chat_checkpoint),
                             "--prompt", "hi", "--max-new-tokens", "64"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
    # The draft line is printed after loading, right before compilation starts.
    import select

    err_lines = []
    while proc.poll() is None:
        ready, _, _ = select.select([proc.stderr], [], [], 60)
        assert ready, "no draft line within 60 s"
        line = proc.stderr.readline()
        err_lines.append(line)
        if "draft:" in line:
            break
    _, err = _interrupt_when(proc, lambda: True)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "qspec-generate: interrupted", err


# ---------------------------------------------------------------- the demo's comparison (issue 25)
def _generate_json(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[dict[str, Any], list[str]]:
    assert generate.main([str(a) for a in argv] + ["--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err.splitlines()


@pytest.mark.slow  # four generations with their compiles: > ~15 CPU-s
def test_compare_ar_uses_the_same_target(tiny_chat_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--compare-ar decodes the same target (INT8 cache, same dtype) autoregressively: same
    tokens; --mode ar alone gives those tokens too (both modes default to the same target)."""
    base = ["--checkpoint", tiny_chat_checkpoint, "--chat", "--prompt", "Hello there", "--max-new-tokens", "24"]
    spec, _ = _generate_json(capsys, *base, "--compare-ar")
    assert spec["ar_same_tokens"] is True and spec["ar_tokens_per_s"] > 0 and "ar_bf16_tokens_per_s" not in spec
    assert spec["dtype"] == "float32" and spec["device"].startswith("CPU (")
    ar, _ = _generate_json(capsys, *base, "--mode", "ar")
    assert ar["tokens"] == spec["tokens"] and "acceptance_rate" not in ar
    both, _ = _generate_json(capsys, *base, "--compare-ar", "both")
    assert both["ar_same_tokens"] is True and "ar_bf16_same_tokens" in both and both["ar_bf16_tokens_per_s"] > 0
    bf16, _ = _generate_json(capsys, *base, "--dtype", "bfloat16")
    assert bf16["dtype"] == "bfloat16"


def test_speed_lines_name_the_device_and_explain(tiny_chat_checkpoint: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert generate.main(["--checkpoint", str(tiny_chat_checkpoint), "--chat", "--prompt", "Hello there",
                          "--max-new-tokens", "8", "--compare-ar", "both"]) == 0
    err = capsys.readouterr().err.splitlines()
    spec = next(x for x in err if x.startswith("[spec]"))
    assert "CPU (" in spec and "float32, int8 KV cache" in spec
    ar = next(x for x in err if x.startswith("[ar] "))
    assert "the same target: same tokens, as speculative decoding promises; speedup" in ar
    bf16 = next(x for x in err if x.startswith("[ar bf16]"))
    assert "a different target (a dense bf16 KV cache, not int8): tokens" in bf16
    why = next(x for x in err if x.startswith("why: "))
    assert why.startswith("why: a round cost") and "a CPU is bound by arithmetic" in why


def test_broken_exactness_is_reported_and_fails(tiny_chat_checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """If greedy AR over the same target ever differs from speculative decoding, the line says so
    and the exit status is 1 (stand-in results: the real ones are equal by construction)."""
    results = {"spec": dict(mode="spec", text="a", tokens=[1, 2, 3], tokens_per_s=2.0, compile_s=1.0, run_s=1.5,
                            acceptance_rate=0.5, tokens_per_round=1.5, mean_draft_length=4.0, rounds=2),
               "ar": dict(mode="ar", text="b", tokens=[1, 2, 4], tokens_per_s=4.0, compile_s=1.0, run_s=0.75)}
    monkeypatch.setattr(generate, "_run", lambda model, ids, args, mode, partial, kv=None: dict(results[mode]))
    assert generate.main(["--checkpoint", str(tiny_chat_checkpoint), "--prompt", "hi", "--compare-ar"]) == 1
    err = capsys.readouterr().err
    assert "the same target: TOKENS DIFFER, which greedy speculative decoding must never do" in err


@pytest.mark.parametrize("platform, speedup, expect", [
    ("cpu", 0.5, "a CPU is bound by arithmetic, and unpacking INT4 weights adds some: speculation does not pay on a CPU"),
    ("cpu", 1.2, "yet speculation paid off here"),
    ("gpu", 1.6, "a decode step here is bound by the bytes it reads"),
    ("gpu", 0.8, "a small model's steps are bound by kernel launches instead"),
])
def test_explain_speed(platform: str, speedup: float, expect: str) -> None:
    from qspec_jax.cli.generate import explain_speed

    text = explain_speed(platform, round_cost=5.0, draft_length=4.0, tokens_per_round=3.5, speedup=speedup)
    assert text.startswith("why: a round cost 5.0 autoregressive steps and emitted 3.50 tokens; its verify pass costs "
                           "one step (the same shape), so each of its 4.0 INT4 draft steps cost 1.00 steps")
    assert expect in text


def test_eval_progress_ends_with_the_work(tiny_chat_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The teacher-forced bar counts positions (prefill included) and advances only after the step's
    results are ready: it used to reach 100% at dispatch and then sit for minutes."""
    import jax

    import qspec_jax
    from qspec_jax import evaluation

    events: list[str] = []
    real_block = jax.block_until_ready

    def block(x: Any) -> Any:
        events.append("ready")
        return real_block(x)

    class Bar:
        def __init__(self, *a: Any, total: int, **k: Any) -> None:
            events.append(f"total {total}")
            self.n = 0

        def __enter__(self) -> "Bar":
            return self

        def __exit__(self, *a: Any) -> None:
            events.append(f"closed at {self.n}")

        def set_postfix_str(self, text: str) -> None:
            pass

        def update(self, n: int) -> None:
            self.n += n
            events.append(f"update {n}")

    monkeypatch.setattr(evaluation.jax, "block_until_ready", block)
    monkeypatch.setattr(evaluation, "tqdm", Bar)
    monkeypatch.setattr(evaluation, "STEP_CHUNK", 4)  # few positions, the same loop
    model = qspec_jax.load(tiny_chat_checkpoint)
    tokens = np.arange(20 + 2 * 4 + 1, dtype=np.int32)[None] % 200
    evaluation.teacher_forced(model.params, tokens, 20, group_size=16)
    total = tokens.shape[1]
    assert events == [f"total {total}", "ready", "update 20", "ready", "update 4", "ready", "update 4", "ready",
                      "update 1", f"closed at {total}"]
