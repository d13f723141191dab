"""qspec-convert: bad inputs give one clear message, exit code 2 and no output; good inputs round-trip;
OUT is checked first; an interrupt at any stage leaves nothing behind.

The validation tests call `convert.convert` in-process (the same `convert_into` steps the
command's worker process runs, without starting one); the command itself is run in a subprocess
where its exit status, its one-line messages and its signal handling are what is tested.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from convert import ConversionError, cli, convert
from convert.safetensors_io import SafetensorsError, SafetensorsFile, write_safetensors
from qspec_jax import model as M
from qspec_jax.checkpoint import MANIFEST, CheckpointError, load

Q0 = "model.layers.0.self_attn.q_proj.weight"
REPO = Path(__file__).resolve().parent.parent


def run_cli(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str]:
    rc = cli.main([str(a) for a in args] + ["--no-progress"])
    return rc, capsys.readouterr().err


def run_command(*args: Any, env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m convert ARGS` as a user runs it (CPU)."""
    return subprocess.run([sys.executable, "-m", "convert", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})


def assert_nothing_left(out: Path, before: set[str] | None = None) -> None:
    """No OUT, and no hidden partial directory (nor anything else new) next to it."""
    assert not os.path.lexists(out)
    if out.parent.exists():
        left = {p.name for p in out.parent.iterdir()} - (before or set())
        assert not left, f"left behind: {sorted(left)}"
        assert not [p for p in out.parent.iterdir() if ".partial-" in p.name]


def assert_refused(capsys: pytest.CaptureFixture[str], src: Path, out: Path, *fragments: str) -> str:
    """`convert` raises one ConversionError line holding `fragments` and leaves nothing behind.
    (The command prints exactly this message after `qspec-convert: error: `, see the CLI tests.)"""
    before = {p.name for p in out.parent.iterdir()} if out.parent.exists() else set()
    with pytest.raises(ConversionError) as info:
        convert(src, out, progress=False)
    message = str(info.value)
    assert "\n" not in message, message
    for frag in fragments:
        assert frag in message, f"{frag!r} not in {message!r}"
    assert_nothing_left(out, before)
    return message


def flat_params(ckpt: Path) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in M.params_to_flat(load(ckpt, dtype="float32", tokenizer=False).params).items()}


# ------------------------------------------------------------------------------------ bad input
def test_missing_tensor(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    src = synthetic_hf_dir(drop=("model.layers.1.mlp.up_proj.weight",))
    assert_refused(capsys, src, tmp_path / "out", "missing tensor", "model.layers.1.mlp.up_proj.weight")


def test_missing_lm_head_when_untied(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    src = synthetic_hf_dir(drop=("lm_head.weight",))
    assert_refused(capsys, src, tmp_path / "out", "missing tensor", "lm_head.weight", "tie_word_embeddings=False")


def test_wrong_shape(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    src = synthetic_hf_dir(replace={Q0: np.zeros((32, 31), np.float32)})
    assert_refused(capsys, src, tmp_path / "out", Q0, "shape (32, 31)", "expected (32, 32)")


def test_unexpected_tensor(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    src = synthetic_hf_dir(extra={"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)})
    assert_refused(capsys, src, tmp_path / "out", "unexpected tensor", "q_proj.bias")


def test_layer_beyond_config(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    src = synthetic_hf_dir(extra={"model.layers.2.input_layernorm.weight": np.ones(32, np.float32)})
    assert_refused(capsys, src, tmp_path / "out", "model.layers.2.input_layernorm.weight", "num_layers=2")


def test_unsupported_model_type(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    src = synthetic_hf_dir({"model_type": "gpt2"})
    assert_refused(capsys, src, tmp_path / "out", "config.json", "unsupported model_type='gpt2'")


def test_unsupported_rope_type(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    src = synthetic_hf_dir({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert_refused(capsys, src, tmp_path / "out", "rope_type", "'yarn'")


def test_truncated_safetensors(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    src = synthetic_hf_dir()
    st = src / "model.safetensors"
    last = max(SafetensorsFile(st).tensors.values(), key=lambda t: t.end).name
    data = st.read_bytes()
    st.write_bytes(data[: len(data) - 100])
    assert_refused(capsys, src, tmp_path / "out", str(st), "truncated", repr(last))


def test_corrupt_safetensors_header(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    src = synthetic_hf_dir()
    st = src / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[8:12] = b"\xff\xfe{["
    st.write_bytes(bytes(data))
    assert_refused(capsys, src, tmp_path / "out", str(st), "header")


def test_tiny_file_is_not_safetensors(tmp_path: Path) -> None:
    p = tmp_path / "x.safetensors"
    p.write_bytes(b"abc")
    with pytest.raises(SafetensorsError, match="x.safetensors"):
        SafetensorsFile(p)


def test_shard_index_names_missing_file(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    src = synthetic_hf_dir(shards=3)
    (src / "model-00002-of-00003.safetensors").unlink()
    assert_refused(capsys, src, tmp_path / "out", "model.safetensors.index.json", "model-00002-of-00003.safetensors")


def test_no_weights(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    src = synthetic_hf_dir()
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"")
    assert_refused(capsys, src, tmp_path / "out", "no *.safetensors", "pytorch_model.bin", "safe_serialization")


def test_nonexistent_source(tmp_path: Path, capsys: Any) -> None:
    assert_refused(capsys, tmp_path / "nope", tmp_path / "out", str(tmp_path / "nope"), "no such file or directory")


def test_directory_without_config(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "empty").mkdir()
    assert_refused(capsys, tmp_path / "empty", tmp_path / "out", "no config.json")


def test_out_already_exists(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    src, out = synthetic_hf_dir(), tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = run_cli(capsys, src, out)
    assert rc == 2 and err.startswith("qspec-convert: error: ") and "already exists" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging directory either


def test_failure_during_write_leaves_nothing(synthetic_hf_dir: Callable[..., Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception while writing (here: from the tokenizer writer) leaves no OUT, no partial dir,
    and no parent directories that the call created."""
    src = synthetic_hf_dir(files={"tokenizer_config.json": "{}"})
    import convert.hf as hf

    def boom(*a: Any, **k: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(hf.shutil, "copy2", boom)
    out = tmp_path / "new" / "deeper" / "out"
    with pytest.raises(OSError, match="disk full"):
        convert(src, out, progress=False)
    assert not (tmp_path / "new").exists()
    assert list(tmp_path.iterdir()) == []


def test_convert_api_raises_conversion_error(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="no such file"):
        convert(tmp_path / "missing", tmp_path / "out")
    assert issubclass(ConversionError, ValueError)


def test_real_cli_exit_code_and_no_traceback(tmp_path: Path) -> None:
    proc = run_command(tmp_path / "nope", tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.startswith("qspec-convert: error: ") and "no such file" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert_nothing_left(tmp_path / "out", {"nope"})


def test_real_cli_bad_tensor_is_one_line(synthetic_hf_dir: Callable[..., Path], tmp_path: Path) -> None:
    """A problem found by the conversion process (here a missing tensor) reaches the user as one line."""
    src = synthetic_hf_dir(drop=("model.layers.1.mlp.up_proj.weight",))
    proc = run_command(src, tmp_path / "out", "--no-progress")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("qspec-convert: error: ")
    assert "missing tensor" in proc.stderr and "model.layers.1.mlp.up_proj.weight" in proc.stderr
    assert_nothing_left(tmp_path / "out")


# ---------------------------------------------------------------------------------- good input
def test_hf_conversion_is_torch_free_and_exact(synthetic_hf_dir: Callable[..., Path], tmp_path: Path) -> None:
    """Converting a safetensors directory (what the command's worker process runs) never imports
    torch; float32 storage is exact."""
    src, out = synthetic_hf_dir(dtype=np.float16), tmp_path / "out"
    code = ("import sys; from convert import convert; convert(sys.argv[1], sys.argv[2], 'float32', progress=False); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    hf = {n: SafetensorsFile(src / "model.safetensors").get(n).astype(np.float32)
          for n in SafetensorsFile(src / "model.safetensors").keys()}
    got = flat_params(out)
    np.testing.assert_array_equal(got["embed"], hf["model.embed_tokens.weight"])
    np.testing.assert_array_equal(got["lm_head"], hf["lm_head.weight"].T)
    np.testing.assert_array_equal(got["final_norm"], hf["model.norm.weight"])
    for i in range(2):
        np.testing.assert_array_equal(got["layers/wk"][i], hf[f"model.layers.{i}.self_attn.k_proj.weight"].T)
        np.testing.assert_array_equal(got["layers/w_down"][i], hf[f"model.layers.{i}.mlp.down_proj.weight"].T)
        np.testing.assert_array_equal(got["layers/mlp_norm"][i], hf[f"model.layers.{i}.post_attention_layernorm.weight"])
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["source_format"] == "hf" and manifest["dtype"] == "float32"
    assert manifest["source_dtypes"] == ["F16"]


def test_sharded_equals_single(synthetic_hf_dir: Callable[..., Path], tmp_path: Path) -> None:
    a = convert(synthetic_hf_dir(seed=5), tmp_path / "a", progress=False)
    b = convert(synthetic_hf_dir(seed=5, shards=3), tmp_path / "b", progress=False)
    pa, pb = flat_params(a), flat_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


def test_tied_ignores_lm_head_and_ignores_inv_freq(synthetic_hf_dir: Callable[..., Path], tmp_path: Path) -> None:
    src = synthetic_hf_dir({"tie_word_embeddings": True},
                           extra={"lm_head.weight": np.zeros((96, 32), np.float32),
                                  "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)})
    got = flat_params(convert(src, tmp_path / "out", progress=False))
    assert "lm_head" not in got
    model = load(tmp_path / "out", tokenizer=False)
    assert model.config.tie_word_embeddings and model.params.lm_head is None


def test_tokenizer_files_and_generation_eos(synthetic_hf_dir: Callable[..., Path], tmp_path: Path) -> None:
    """Tokenizer files are copied; generation_config.json's EOS ids are merged after config's."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    src = synthetic_hf_dir(files={"generation_config.json": json.dumps({"eos_token_id": [7, 2, 9]})})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 96)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(src)
    out = convert(src, tmp_path / "out", progress=False)
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    assert (out / "tokenizer" / "generation_config.json").is_file()
    model = load(out, dtype="float32")
    assert model.config.eos_token_ids == (2, 7, 9)
    assert model.encode("w5 w17 w5") == [5, 17, 5]
    assert model.decode([5, 17]) == "w5 w17"


def test_format_version_stamp_refused(synthetic_hf_dir: Callable[..., Path], tmp_path: Path) -> None:
    out = convert(synthetic_hf_dir(), tmp_path / "out", progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["format_version"] == 1 and manifest["library"] == "qspec-jax"
    manifest["format_version"] = 999
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"format_version=999.*re-run qspec-convert"):
        load(out)


def test_safetensors_roundtrip(tmp_path: Path) -> None:
    import ml_dtypes

    arrs = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones((4,), ml_dtypes.bfloat16),
            "c": np.full((2, 2), 0.5, np.float16), "d": np.zeros((0, 3), np.float64)}
    write_safetensors(tmp_path / "t.safetensors", arrs)
    f = SafetensorsFile(tmp_path / "t.safetensors")
    assert f.keys() == list(arrs)
    for k, v in arrs.items():
        assert f.get(k).dtype == v.dtype
        np.testing.assert_array_equal(f.get(k), v)


def test_draft_weights_int4(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    """--draft-weights int4 stores INT4 draft weights that `load` returns, equal to quantizing
    the stored target weights with the same settings."""
    from qspec_jax.weight_quant import DraftWeightsConfig, QuantizedWeight, make_draft_params

    out = tmp_path / "out"
    rc, err = run_cli(capsys, synthetic_hf_dir(), out, "--draft-weights", "int4", "--draft-group", "32",
                      "--draft-scope", "ffn", "--draft-method", "clip", "--draft-fold-norms")
    assert rc == 0, err
    model = load(out, tokenizer=False)
    want = DraftWeightsConfig(group_size=32, scope="ffn", method="clip", fold_norms=True)
    assert model.draft_weights_config == want and model.draft_params is not None
    ref = make_draft_params(model.params, want)
    for name in ("w_gate", "w_up", "w_down"):
        got, exp = getattr(model.draft_params.layers, name), getattr(ref.layers, name)
        assert isinstance(got, QuantizedWeight)
        np.testing.assert_array_equal(np.asarray(got.packed), np.asarray(exp.packed))
    assert not isinstance(model.draft_params.layers.wq, QuantizedWeight)  # scope "ffn"
    assert isinstance(model.draft_params.lm_head, QuantizedWeight)
    # the norms whose readers are all INT4 are folded (--draft-fold-norms): ones in the draft, the target's kept
    d, t = model.draft_params, model.params
    assert want.fold_norms and d.unit_norms == ("mlp_norm", "final_norm") and t.unit_norms == ()
    assert (np.asarray(d.layers.mlp_norm) == 1).all() and (np.asarray(d.final_norm) == 1).all()
    np.testing.assert_array_equal(np.asarray(d.layers.attn_norm), np.asarray(t.layers.attn_norm))
    assert not (np.asarray(t.layers.mlp_norm) == 1).all()
    # a manifest written before fold_norms existed describes an unfolded draft
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["draft_weights"]["fold_norms"] is True
    del manifest["draft_weights"]["fold_norms"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    old = load(out, tokenizer=False)
    assert old.draft_weights_config == DraftWeightsConfig(group_size=32, scope="ffn", method="clip", fold_norms=False)
    assert old.draft_params.unit_norms == ()
    np.testing.assert_array_equal(np.asarray(old.draft_params.layers.mlp_norm), np.asarray(t.layers.mlp_norm))


def test_draft_group_must_divide(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    src = synthetic_hf_dir()  # hidden 32, MLP 64
    rc, err = run_cli(capsys, src, tmp_path / "out", "--draft-weights", "int4", "--draft-group", "128")
    assert rc == 2 and "--draft-group 128" in err and "layers/wq (input dim 32)" in err
    assert_nothing_left(tmp_path / "out")


@pytest.mark.parametrize("args, message", [
    (["--draft-group", "7"], "--draft-group must be one of 32, 64, 128, got 7"),
    (["--draft-scope", "mlp"], "--draft-scope must be one of all, ffn, got mlp"),
    (["--draft-method", "clip", "--calibration-text", "x.txt"],
     "--calibration-text is used by --draft-method gptq only, not clip"),
])
def test_draft_flags_are_checked_by_name(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any,
                                         args: list[str], message: str) -> None:
    rc, err = run_cli(capsys, synthetic_hf_dir(), tmp_path / "out", *args)
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"qspec-convert: error: {message}"), err
    assert_nothing_left(tmp_path / "out")


def test_draft_flags_without_draft_are_refused(tmp_path: Path, capsys: Any) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([str(tmp_path / "src"), str(tmp_path / "out"), "--draft-weights", "none", "--draft-group", "64"])
    assert info.value.code == 2
    assert "--draft-weights none" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- GGUF
def test_gguf_synthetic_matches_hf(synthetic_gguf: Callable[..., Any], synthetic_hf_dir: Callable[..., Path],
                                   tmp_path: Path) -> None:
    """A GGUF written like llama.cpp (q/k rows permuted, F32) converts to exactly the parameters
    of the HF directory with the same weights: the permutation is undone and layouts agree."""
    gguf_path, hf_tensors = synthetic_gguf(seed=3)
    a = convert(gguf_path, tmp_path / "from_gguf", dtype="float32", progress=False)
    b = convert(synthetic_hf_dir(tensors=hf_tensors), tmp_path / "from_hf", dtype="float32", progress=False)
    pa, pb = flat_params(a), flat_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    cfg = load(a, tokenizer=False).config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 8)
    assert not cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert json.loads((a / MANIFEST).read_text())["source_format"] == "gguf"


def test_gguf_quantized_q8_0(synthetic_gguf: Callable[..., Any], tmp_path: Path) -> None:
    gguf_path, hf_tensors = synthetic_gguf(seed=4, qtype="Q8_0")
    got = flat_params(convert(gguf_path, tmp_path / "out", dtype="float32", progress=False))
    ref = hf_tensors["model.layers.1.self_attn.q_proj.weight"].T
    assert np.abs(got["layers/wq"][1] - ref).max() < 0.01 * np.abs(ref).max()


def test_gguf_unsupported_architecture(synthetic_gguf: Callable[..., Any], tmp_path: Path, capsys: Any) -> None:
    gguf_path, _ = synthetic_gguf(arch="gpt2")
    assert_refused(capsys, gguf_path, tmp_path / "out", "general.architecture='gpt2'", "'llama'")


def test_gguf_unsupported_rope_scaling(synthetic_gguf: Callable[..., Any], tmp_path: Path, capsys: Any) -> None:
    gguf_path, _ = synthetic_gguf(metadata={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    assert_refused(capsys, gguf_path, tmp_path / "out", "rope_type", "'yarn'")


def test_gguf_linear_rope_scaling(synthetic_gguf: Callable[..., Any], tmp_path: Path) -> None:
    gguf_path, _ = synthetic_gguf(metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    cfg = load(convert(gguf_path, tmp_path / "out", progress=False), tokenizer=False).config
    assert cfg.rope_scaling is not None
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 2.0)
    assert not (tmp_path / "out" / "tokenizer").exists()  # the GGUF has no tokenizer metadata


def test_gguf_truncated(synthetic_gguf: Callable[..., Any], tmp_path: Path, capsys: Any) -> None:
    gguf_path, _ = synthetic_gguf()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[:-500])
    assert_refused(capsys, cut, tmp_path / "out", str(cut))


def test_gguf_package_missing(synthetic_gguf: Callable[..., Any], tmp_path: Path, capsys: Any,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_path, _ = synthetic_gguf()
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    assert_refused(capsys, gguf_path, tmp_path / "out", "gguf", "pip install 'qspec-jax[gguf]'")


@pytest.mark.slow
def test_smollm2_gguf_roundtrip(smollm2_checkpoint: Path) -> None:
    """The GGUF metadata becomes SmolLM2's known architecture (SPEC §9) and its chat template
    survives. (Reads config and tokenizer only; test_parity_hf loads the parameters.)"""
    from transformers import AutoTokenizer

    from qspec_jax.checkpoint import MODEL_CONFIG
    from qspec_jax.config import ModelConfig

    from qspec_jax.calibration import CALIBRATION_MAX_TOKENS
    from qspec_jax.weight_quant import DraftWeightsConfig

    manifest = json.loads((smollm2_checkpoint / MANIFEST).read_text())
    assert manifest["source_format"] == "gguf"
    # the default draft, calibrated on the built-in text through the GGUF's tokenizer
    assert manifest["draft_weights"] == DraftWeightsConfig().to_dict()
    assert manifest["draft_calibration"] == {"text": "the built-in text (botchan.txt)",
                                             "tokens": CALIBRATION_MAX_TOKENS}
    assert manifest["source_tensor_types"] == ["F32", "Q4_1", "Q8_0"]
    cfg = ModelConfig.from_dict(json.loads((smollm2_checkpoint / MODEL_CONFIG).read_text()))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings
    assert cfg.rope_theta == 1e5 and cfg.rope_scaling is None and cfg.max_position_embeddings == 8192
    assert cfg.vocab_size == 49152 and cfg.intermediate_size == 1536
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    tok = AutoTokenizer.from_pretrained(smollm2_checkpoint / "tokenizer")
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False)[0]) == "<|im_start|>"


def test_out_parent_is_created(synthetic_hf_dir: Callable[..., Path], tmp_path: Path) -> None:
    out = convert(synthetic_hf_dir(), tmp_path / "a" / "b" / "ckpt", progress=False)
    assert (out / MANIFEST).is_file()
    shutil.rmtree(tmp_path / "a")


@pytest.mark.slow  # parses the real 49k-token GGUF vocabulary twice (ours and transformers')
def test_gguf_tokenizer_without_torch_matches_transformers(smollm2_gguf_path):
    """The converter rebuilds SmolLM2's byte-level BPE tokenizer without torch (make demo installs
    none); it must encode, decode and template exactly as transformers' GGUF loader does."""
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from convert.gguf_source import _byte_level_tokenizer

    ours = _byte_level_tokenizer(smollm2_gguf_path)
    ref = AutoTokenizer.from_pretrained(str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name)
    texts = ["What is the capital of France?", "  spaces\tand tabs\nnewlines 12345 678 3.14159",
             "Ünïcödé — ✓ 漢字 émoji 🙂", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
             "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert (ours.bos_token, ours.eos_token, ours.pad_token, len(ours)) == (ref.bos_token, ref.eos_token,
                                                                           ref.pad_token, len(ref))


# ------------------------------------------------------------------------ OUT checked first
def _immutable_dir(path: Path) -> Path:
    """A directory nobody (root included) can create entries in (chattr +i); skips without it."""
    path.mkdir()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)],
                                                         capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    return path


@pytest.mark.parametrize("case", ["exists_dir", "exists_file", "parent_is_file", "ancestor_is_file", "unwritable"])
def test_bad_out_is_refused_before_reading(tmp_path: Path, capsys: Any, case: str) -> None:
    """An unusable OUT fails with one line naming the path and the problem; SRC is not even
    looked at (it does not exist here), and nothing is created."""
    src = tmp_path / "no-such-model"
    if case == "exists_dir":
        out = tmp_path / "out"
        out.mkdir()
        expect = [f"{out}: already exists (a directory)"]
    elif case == "exists_file":
        out = tmp_path / "out"
        out.write_text("x")
        expect = [f"{out}: already exists (a file)"]
    elif case == "parent_is_file":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "out"
        expect = [f"{out}: cannot create the output directory: {tmp_path / 'f'} is not a directory"]
    elif case == "ancestor_is_file":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "a" / "b" / "out"
        expect = [f"{out}: cannot create the output directory: {tmp_path / 'f'} is not a directory"]
    else:
        locked = _immutable_dir(tmp_path / "locked")
        out = locked / "sub" / "out"
        expect = [f"{out}: cannot create the output directory: {locked} is not writable"]
    before = {p.name for p in tmp_path.iterdir()}
    try:
        rc, err = run_cli(capsys, src, out)
        listing = {p.name for p in tmp_path.iterdir()}
        inner = sorted(p.name for p in (tmp_path / "locked").iterdir()) if case == "unwritable" else []
    finally:
        if case == "unwritable":
            subprocess.run(["chattr", "-i", str(tmp_path / "locked")], check=True)
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("qspec-convert: error: "), err
    for frag in expect:
        assert frag in lines[0], (frag, lines[0])
    assert listing == before and inner == []


def test_bad_out_fails_without_importing_jax(tmp_path: Path) -> None:
    """The OUT check runs before jax (or anything that reads weights) is imported: it cannot
    cost the seconds a model load does."""
    (tmp_path / "f").write_text("x")
    code = ("import sys; from convert.cli import main; rc = main(sys.argv[1:]); "
            "assert 'jax' not in sys.modules and 'numpy' not in sys.modules, 'imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "src"), str(tmp_path / "f" / "out")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("qspec-convert: error: ") and "is not a directory" in proc.stderr


def test_not_enough_space_is_refused_before_reading(synthetic_hf_dir: Callable[..., Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With less free space than the estimated checkpoint, nothing is read and nothing is left."""
    import collections

    import convert.api as api
    import convert.output as output

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(output.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 50_000, 50_000))
    monkeypatch.setattr(api, "fill", lambda *a, **k: pytest.fail("weights were read"))
    out = tmp_path / "new" / "out"
    with pytest.raises(ConversionError) as info:
        convert(synthetic_hf_dir(), out, progress=False)
    assert str(info.value).startswith(f"{out}: not enough free space: the checkpoint needs about ")
    assert "50.0 kB free" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # neither the staging directory nor the parent it made


def test_estimate_is_the_tensor_bytes_written(synthetic_hf_dir: Callable[..., Path], tmp_path: Path) -> None:
    """estimate_bytes (the free-space check's need) is exactly the bytes of the stored arrays,
    target and INT4 draft."""
    import orbax.checkpoint as ocp

    from convert.api import estimate_bytes
    from qspec_jax.checkpoint import PARAMS_DIR, flatten
    from qspec_jax.weight_quant import DraftWeightsConfig

    wide = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16}  # divisible by group 64
    for dtype, config, draft in (("bfloat16", None, DraftWeightsConfig()),
                                 ("float32", wide, DraftWeightsConfig(group_size=64, scope="ffn"))):
        out = convert(synthetic_hf_dir(config), tmp_path / dtype, dtype, progress=False, draft_weights=draft)
        stored = flatten(ocp.StandardCheckpointer().restore(out / PARAMS_DIR))
        assert sum(np.asarray(v).nbytes for v in stored.values()) == estimate_bytes(load(out).config, draft)


def test_manifest_name_agrees() -> None:
    """convert.output (jax-free) names the manifest as qspec_jax.checkpoint does."""
    from convert.output import MANIFEST_NAME

    assert MANIFEST_NAME == MANIFEST


# ------------------------------------------------------------------- default draft, tokenizer
def test_default_conversion_stores_the_default_draft(synthetic_hf_dir: Callable[..., Path], tmp_path: Path) -> None:
    """`qspec-convert SRC OUT` stores DraftWeightsConfig()'s draft (GPTQ), which SpecConfig() asks
    for, so generation uses the stored draft object as it is; calibrated (`calibration.make_draft`,
    tested in test_weight_quant) here without a tokenizer: on random token ids, which the last
    line says; a model without tokenizer files converts with one warning line that says what will
    not work."""
    from qspec_jax import calibration as C
    from qspec_jax.speculative import SpecConfig, draft_params_for
    from qspec_jax.weight_quant import DraftWeightsConfig

    out = tmp_path / "out"
    proc = run_command(synthetic_hf_dir(), out, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("qspec-convert: warning: ") and "no tokenizer files" in lines[0]
    assert "qspec-generate" in lines[0] and "token ids" in lines[0]
    assert lines[1].startswith(f"qspec-convert: wrote {out} (bfloat16 + INT4 draft weights (gptq, group 32, "
                               "all linears + lm_head; calibrated on ")
    assert "tokens of random token ids (the model has no tokenizer))" in lines[1]
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["draft_weights"] == DraftWeightsConfig().to_dict() and DraftWeightsConfig().method == "gptq"
    assert manifest["draft_calibration"]["text"] == "random token ids (the model has no tokenizer)"
    assert manifest["draft_calibration"]["tokens"] == C.CALIBRATION_MAX_TOKENS
    model = load(out)
    assert model.draft_weights_config == SpecConfig().draft_weights_config
    assert draft_params_for(model, SpecConfig()) is model.draft_params
    assert model.with_draft_weights() is model  # nothing to re-quantize
    assert not (out / "tokenizer").exists()


def test_api_warns_without_tokenizer(synthetic_hf_dir: Callable[..., Path], tmp_path: Path) -> None:
    from convert.api import ConversionWarning

    with pytest.warns(ConversionWarning, match="no tokenizer files.*qspec-generate"):
        convert(synthetic_hf_dir(), tmp_path / "out", progress=False)


def test_gguf_without_tokenizer_warns(synthetic_gguf: Callable[..., Any], tmp_path: Path) -> None:
    from convert.api import ConversionWarning

    gguf_path, _ = synthetic_gguf()
    with pytest.warns(ConversionWarning, match=r"no tokenizer metadata \(tokenizer.ggml.tokens\)"):
        convert(gguf_path, tmp_path / "out", progress=False)


# -------------------------------------------------------------------------------- interrupts
INTERRUPT_CASES = [(stage, sig) for stage in ("read", "quantize", "write") for sig in ("SIGINT", "SIGTERM")]


@pytest.mark.parametrize("stage, sig", INTERRUPT_CASES)
def test_interrupt_leaves_nothing(tiny_chat_source: Path, tmp_path: Path, stage: str, sig: str) -> None:
    """SIGINT (to the whole process group, as Ctrl-C in a terminal) or SIGTERM (to the command,
    as `kill`) while the conversion reads, quantizes the draft (XLA work in flight) or writes
    (orbax's commit in flight): exit 128 + signal, one line, no traceback, no OUT, no partial
    directory (orbax's temporary one included), and the conversion process is gone."""
    signum = signal.Signals[sig]
    out, marker = tmp_path / "ckpt" / "out", tmp_path / "paused"
    (tmp_path / "ckpt").mkdir()
    # The draft is smaller where it is not the point: fewer XLA compilations before the pause.
    draft = (["--draft-scope", "ffn", "--no-draft-lm-head", "--draft-method", "clip"] if stage == "quantize"
             else ["--draft-weights", "none"])
    proc = subprocess.Popen([sys.executable, "-m", "convert", str(tiny_chat_source), str(out), "--no-progress",
                             *draft], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "QSPEC_CONVERT_TEST_PAUSE": f"{stage}:{marker}"})
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"never reached {stage}: {proc.communicate(timeout=60)}"
        worker = int(marker.read_text())
        staging = [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".out.partial-")]
        assert len(staging) == 1
        if stage == "write":  # orbax's save was called: its temporary directory, or (when its
            # background commit already finished: a race, the model is tiny) the committed params
            names = sorted(p.name for p in staging[0].iterdir())
            assert "model_config.json" in names and \
                any(n == "params" or "orbax-checkpoint-tmp" in n for n in names), names
        if sig == "SIGINT":
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signum, stderr
    assert stderr.splitlines() == [f"qspec-convert: interrupted by {sig}; nothing was written"], stderr
    assert stdout == ""
    assert_nothing_left(out)
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)


@pytest.mark.slow
def test_interrupt_real_model_while_orbax_writes(smollm2_gguf_path: Path, tmp_path: Path) -> None:
    """Ctrl-C on a real SmolLM2 conversion (no test hook) the moment orbax's temporary directory
    appears, and at a few moments before: the same clean exit every time."""
    pytest.importorskip("gguf")
    for when in ("orbax-tmp", 2.0, 6.0):
        out = tmp_path / f"out-{when}"
        # clip: the fast draft (the default GPTQ calibration would add minutes before the write)
        proc = subprocess.Popen([sys.executable, "-m", "convert", str(smollm2_gguf_path), str(out), "--draft-method",
                                 "clip"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                start_new_session=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        try:
            t0 = time.monotonic()
            while proc.poll() is None:
                if when == "orbax-tmp":
                    if any("orbax-checkpoint-tmp" in q.name for p in tmp_path.glob(".out-*.partial-*")
                           for q in p.iterdir()):
                        break
                elif time.monotonic() - t0 > when:
                    break
                time.sleep(0.01)
            assert proc.poll() is None, f"finished before the interrupt ({when}): {proc.communicate()}"
            os.killpg(proc.pid, signal.SIGINT)
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 130, (when, stderr)
        assert stderr.splitlines()[-1] == "qspec-convert: interrupted by SIGINT; nothing was written", stderr
        assert "Traceback" not in stderr and "Fatal Python error" not in stderr
        assert_nothing_left(out)


@pytest.mark.slow
def test_calibrated_draft_through_the_command(tiny_chat_source: Path, tmp_path: Path) -> None:
    """--draft-method gptq --calibration-text: the text is tokenized with the source's tokenizer,
    and the stored draft is the calibrated one, which generation then uses as it is."""
    from qspec_jax.weight_quant import DraftWeightsConfig

    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 120)  # > 4096 byte tokens
    out = tmp_path / "out"
    proc = run_command(tiny_chat_source, out, "--no-progress", "--draft-method", "gptq", "--calibration-text", text)
    assert proc.returncode == 0, proc.stderr
    assert f"INT4 draft weights (gptq, group 32, all linears + lm_head; calibrated on 5120 tokens of {text})" \
        in proc.stderr  # 5400 byte tokens: 10 windows of 512 (the model's positions)
    model = load(out)
    assert model.draft_weights_config == DraftWeightsConfig(method="gptq")
    short = tmp_path / "short.txt"
    short.write_text("too short")
    proc = run_command(tiny_chat_source, tmp_path / "out2", "--no-progress", "--draft-method", "gptq",
                       "--calibration-text", short)
    assert proc.returncode == 2 and "--calibration-text" in proc.stderr and str(short) in proc.stderr, proc.stderr
    assert_nothing_left(tmp_path / "out2", {"calibration.txt", "out", "short.txt"})


# ------------------------------------------------------------------ the newcomer's list (issue 25)
def test_empty_out_is_refused(synthetic_hf_dir: Callable[..., Path], capsys: Any) -> None:
    """OUT '' used to resolve to the current directory ("already exists; remove it")."""
    rc, err = run_cli(capsys, synthetic_hf_dir(), "")
    assert rc == 2 and err.splitlines() == ["qspec-convert: error: OUT is empty (''): give the checkpoint directory "
                                            "to create"]


@pytest.mark.parametrize("kind, why", [("missing", "no such file"), ("binary", "not a UTF-8 text file"),
                                       ("empty", "the file is empty")])
def test_calibration_text_is_checked_before_the_weights(synthetic_hf_dir: Callable[..., Path], tmp_path: Path,
                                                        capsys: Any, kind: str, why: str) -> None:
    """A bad --calibration-text is refused before any tensor is read (it was found after reading
    every weight): the conversion stops before the "read" stage."""
    text = tmp_path / "calib.txt"
    if kind == "binary":
        text.write_bytes(b"\x00\x01binary")
    elif kind == "empty":
        text.write_text("  \n")
    marker = tmp_path / "read-reached"
    os.environ["QSPEC_CONVERT_TEST_PAUSE"] = f"read:{marker}"  # would hang the worker if it got that far
    try:
        rc, err = run_cli(capsys, synthetic_hf_dir(), tmp_path / "out", "--draft-method", "gptq",
                          "--calibration-text", text)
    finally:
        del os.environ["QSPEC_CONVERT_TEST_PAUSE"]
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"qspec-convert: error: --calibration-text {text}: "
                                                               f"{why}"), err
    assert not marker.exists()
    assert_nothing_left(tmp_path / "out", {"calib.txt"} if kind != "missing" else set())


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_partial_directory_of_a_killed_conversion_is_removed(synthetic_hf_dir: Callable[..., Path], tmp_path: Path,
                                                             capsys: Any) -> None:
    """SIGKILL leaves `.OUT.partial-PID-*` behind (nothing can clean up); the next conversion to
    that OUT removes it and says so. A partial directory of a running conversion (live pid) and
    one without a pid (older qspec-convert) stay; the latter is mentioned."""
    from convert.output import remove_stale_partials

    out = tmp_path / "out"
    stale = tmp_path / f".out.partial-{_dead_pid()}-k1ll3d"
    (stale / "params").mkdir(parents=True)
    (stale / "model_config.json").write_text("{}")
    live = tmp_path / f".out.partial-{os.getpid()}-running"
    live.mkdir()
    legacy = tmp_path / ".out.partial-abc123xy"
    legacy.mkdir()
    other = tmp_path / f".other.partial-{_dead_pid()}-x"  # another OUT's: not ours to judge
    other.mkdir()
    rc, err = run_cli(capsys, synthetic_hf_dir(), out)
    assert rc == 0, err
    lines = err.splitlines()
    assert lines[0] == f"qspec-convert: removed {stale}, left by an earlier conversion to this OUT that was killed"
    assert lines[1] == (f"qspec-convert: note: {legacy} looks left by an earlier, killed conversion; remove it unless "
                        "one is running")
    assert not stale.exists() and live.is_dir() and legacy.is_dir() and other.is_dir()
    assert (out / MANIFEST).is_file()
    assert remove_stale_partials(out) == ([], [legacy])  # nothing left to remove


def test_progress_from_the_first_second(synthetic_hf_dir: Callable[..., Path], tmp_path: Path, capsys: Any) -> None:
    """With progress on, a line names SRC and OUT at once, the worker says what it loads before its
    seconds of imports, and the write (no bar of its own) is announced."""
    src, out = synthetic_hf_dir(), tmp_path / "out"
    assert cli.main([str(src), str(out)]) == 0
    lines = [x for x in capsys.readouterr().err.replace("\r", "\n").splitlines() if x.strip()]
    assert lines[0] == f"qspec-convert: converting {src} into {out}"
    assert lines[1] == "loading the libraries, then the model's metadata and tokenizer"
    writing = next(i for i, x in enumerate(lines) if x.startswith("writing the checkpoint ("))
    assert lines[-1].startswith(f"qspec-convert: wrote {out}") and writing < len(lines) - 1
    assert any(x.startswith("reading ") and "tensor" in x for x in lines[2:writing]), lines  # the bars in between
    from qspec_jax.weight_quant import DraftWeightsConfig

    draft = DraftWeightsConfig()  # the default draft's bar names its method
    assert any(x.startswith(f"INT4 draft ({draft.method}, g{draft.group_size}):") for x in lines[2:writing]), lines
