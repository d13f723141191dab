"""`qspec-bench profile`: trace parsing, kernel categories and byte floors, argument checks.

The GPU run itself needs a GPU (docs/BENCHMARKS.md, "Profile"); here the trace reader runs on
a synthetic Perfetto trace with the kernel names the H200 runs produced, and the CLI on the CPU.
"""

from __future__ import annotations

import gzip
import json
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from qspec_jax.bench import profile as P
from qspec_jax.bench.timing import read_ceiling_bps
from qspec_jax.cli import bench as cli

NAMES = {  # real kernel names from the H200 traces (docs/bench/profile_h200.json)
    "int4_mma_skinny_k4096_n6144_g32_s1_mosaic_gpu_kernel": ("linear", "int4 k4096 n6144 g32"),
    "bf16_wgmma_skinny_k4096_n4096_gNone_s2": ("linear", "bf16 k4096 n4096"),
    "int4_layer_tail_kq4096_d4096_f14336_g32_c4x8x8": ("linear", "int4 layer tail kq4096 d4096 f14336 g32"),
    "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": ("linear", "cuBLAS"),
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": ("linear", "cuBLAS"),
    "quantspec_draft_mgpu_mosaic_gpu_kernel": ("attention", None),
    "dense_decode": ("attention", None),
    "loop_convert_fusion": ("glue", None),
    "input_scatter_fusion_1": ("glue", None),
    "memcpy32_post": ("copy", None),
    "MemcpyD2H": ("copy", None),
}


def test_classify_names_categories_and_floors():
    for name, (cat, label) in NAMES.items():
        got_cat, got_label, nbytes = P.classify(name)
        assert got_cat == cat, name
        if label is not None:
            assert got_label == label, name
    assert P.classify(next(iter(NAMES)))[2] == int(4096 * 6144 * (0.5 + 4 / 32))  # codes + f16 scale/zero
    assert P.classify("bf16_wgmma_skinny_k4096_n4096_gNone_s2")[2] == 2 * 4096 * 4096
    assert P.classify("loop_convert_fusion")[2] is None
    assert P.classify("int4_layer_tail_kq4096_d4096_f14336_g32_c4x8x8")[2] == int(  # o + gate_up + down
        (4096 * 4096 + 4096 * 2 * 14336 + 14336 * 4096) * (0.5 + 4 / 32))


def _trace(tmp_path: Path, events: list[dict]) -> Path:
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    return tmp_path


def test_trace_summary_per_step(tmp_path):
    """Two steps' kernels: only GPU events count, totals and launches are per step, and a Mosaic
    linear's floor is its bytes over the read ceiling."""
    lin = "int4_mma_skinny_k4096_n4096_g32_s2"
    ev = []
    for _ in range(2):
        ev += [{"ph": "X", "pid": 1, "tid": 1, "name": lin, "ts": 0, "dur": 8.0},
               {"ph": "X", "pid": 1, "tid": 1, "name": "loop_add_fusion", "ts": 9, "dur": 1.5},
               {"ph": "X", "pid": 1, "tid": 1, "name": "quantspec_target_mgpu", "ts": 11, "dur": 20.0}]
    ev.append({"ph": "X", "pid": 2, "tid": 1, "name": "host work", "ts": 0, "dur": 500.0})  # not a kernel
    events = P.kernel_events(_trace(tmp_path, ev))
    assert len(events) == 6 and [e["ts_us"] for e in events[:3]] == [0.0, 9.0, 11.0]  # start times kept
    s = P.summarize(events, per=2)
    assert s["busy_us"] == pytest.approx(29.5) and s["launches"] == 3
    assert s["categories"]["linear"] == {"us": 8.0, "launches": 1.0}
    assert s["categories"]["glue"]["us"] == pytest.approx(1.5)
    assert s["categories"]["attention"]["us"] == pytest.approx(20.0)
    top = s["labels"][0]
    assert top["category"] == "attention" and top["us"] == pytest.approx(20.0)
    lin_row = next(r for r in s["labels"] if r["category"] == "linear")
    assert lin_row["floor_us"] == pytest.approx(4096 * 4096 * (0.5 + 4 / 32) / 4.35e12 * 1e6)  # the CPU: the H200's
    h100 = P.summarize(events, per=2, ceiling=read_ceiling_bps("NVIDIA H100 80GB HBM3"))
    assert next(r for r in h100["labels"] if r["category"] == "linear")["floor_us"] == pytest.approx(
        4096 * 4096 * (0.5 + 4 / 32) / 3.35e12 * 1e6)
    assert P.kernel_events(tmp_path / "nothing-here") == []


def test_read_ceiling_by_device():
    """Floors are against the device's read ceiling: the H200's measured one, the H100's datasheet
    one, the H200's for anything else (a CPU run has no GPU kernels to compare)."""
    assert read_ceiling_bps("NVIDIA H200") == 4.35e12
    assert read_ceiling_bps("NVIDIA H100 80GB HBM3") == 3.35e12
    assert read_ceiling_bps("cpu") == 4.35e12 == read_ceiling_bps()  # this machine


def test_floor_bytes_of_a_model():
    """The linear floor counts every layer weight and the lm_head, not the norms."""
    from qspec_jax import model as M
    from qspec_jax.config import ModelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, dtype="bfloat16", tie_word_embeddings=False)
    params = M.init_random_params(cfg, jax.random.PRNGKey(0))
    per_layer = 32 * (32 + 2 * 16) + 32 * 32 + 3 * 32 * 48  # q|k|v, o, gate, up, down
    assert P.linear_floor_bytes(params) == 2 * (2 * per_layer + 32 * 64)


@pytest.mark.parametrize("argv,message", [
    (["--programs", "draft,nonsense"], "comma-separated subset of ar_bf16,draft"),
    (["--contexts", "4k"], "expected comma-separated integers, got '4k'"),
    (["--gamma", "0"], "--gamma must be in 1..7, got 0"),
    (["--alpha", "1.5"], "--alpha must be in [0, 1], got 1.5"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--draft-group", "48"], "--draft-group must be one of 32, 64, 128, got 48"),
    (["--quick", "--doc"], "--doc with --quick"),
    (["--doc"], "--doc: no GPU (cpu backend)"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--shape", "gpt2"], "argument --shape: invalid choice: 'gpt2'"),
    (["--shape", "smollm2", "--doc"], "--doc: the report's profile section is the llama3-8b shape at batch 1, got "
                                      "--shape smollm2 --batch 1"),
    (["--batch", "8", "--doc"], "got --shape llama3-8b --batch 8; write this profile with --out only"),
    (["--ragged"], "--ragged: rows of different lengths need --batch >= 2, got --batch 1"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    """Every bad argument is refused before anything is measured: one line, exit status 2."""
    with pytest.raises(SystemExit) as e:
        cli.main(["profile", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("qspec-bench profile: error:")


@pytest.mark.slow  # compiles a tiny model's step programs (~20 CPU-s)
def test_quick_run_on_the_cpu(tmp_path, capsys, monkeypatch):
    """On a CPU the trace has no GPU kernels: the run still times the programs, says so and
    writes its JSON where told; its report section renders from that JSON. The verify step and
    the speculative loop's verify passes are gamma + 1 columns wide by default."""
    from qspec_jax.bench import report

    widths = []  # the speculative loop's verify width, each time it is traced
    spec_loop = P.speculative_loop
    monkeypatch.setattr(P, "speculative_loop", lambda *a, spec, **kw: (widths.append(spec.verify_width),
                                                                       spec_loop(*a, spec=spec, **kw))[1])
    out = tmp_path / "prof"
    assert cli.main(["profile", "--quick", "--programs", "draft,ar_loop,spec_loop", "--gamma", "2",
                     "--out", str(out)]) == 0
    res = json.loads((out / "profile.json").read_text())
    assert res["verify_t"] == 3 and widths and set(widths) == {3}
    assert [r["program"] for r in res["rows"]] == ["draft", "ar_loop", "spec_loop"]
    assert all(r["wall_us"] > 0 and r["launches"] == 0 for r in res["rows"])
    assert "no GPU kernel events" in capsys.readouterr().out
    doc = tmp_path / "B.md"
    report.update_section("profile", P.markdown(res, res["command"], res["environment"], 5), doc)
    text = doc.read_text()
    assert "<!-- profile:begin -->" in text and "| draft | 512 |" in text and res["command"] in text


def test_a_program_that_does_not_fit_keeps_the_others(tmp_path, monkeypatch, capsys):
    """A program that runs out of memory (the AR loop at batch 8 and 32k on the H200, after the
    three step programs had been measured) gets its own "does not fit" row: the programs measured
    before it stay, the ones after it run, and the report names the program."""
    real = P._profile

    def oom_for_draft(call, trace_dir, per, trials):
        if trace_dir.name.startswith("draft_"):
            raise MemoryError("Out of memory allocating 34932285696 bytes")
        return real(call, trace_dir, per, trials)

    monkeypatch.setattr(P, "_profile", oom_for_draft)
    out = tmp_path / "prof"
    assert cli.main(["profile", "--quick", "--programs", "ar_bf16,draft,ar_loop", "--out", str(out)]) == 0
    rows = json.loads((out / "profile.json").read_text())["rows"]
    assert [r["program"] for r in rows] == ["ar_bf16", "draft", "ar_loop"]
    assert rows[0]["wall_us"] > 0 and rows[2]["wall_us"] > 0 and "error" not in rows[0] and "error" not in rows[2]
    assert rows[1]["error"].startswith("does not fit in memory: XLA ran out of memory")
    assert "draft at context 512: does not fit in memory" in capsys.readouterr().out
    res = json.loads((out / "profile.json").read_text())
    md = P.markdown(res, res["command"], res["environment"], 3)
    assert "- draft at context 512: does not fit in memory" in md and "| ar_bf16 | 512 |" in md


def test_loops_donate_the_cache_and_restart_from_its_lengths():
    """`restarted` donates the cache to the loop (no second copy in memory: batch 8 at 32k ran out
    of memory without it), passes the weights as arguments (not captured constants: 16 GB of them
    for the 8B) and keeps the returned one at the starting lengths, so every timed call decodes
    the same tokens from the same context."""
    from qspec_jax import model as M
    from qspec_jax.bench import e2e
    from qspec_jax.generation import GenerationConfig, autoregressive_loop

    cfg = e2e.QUICK
    params = M.init_random_params(cfg, jax.random.PRNGKey(1))
    caches = {"dense": e2e.random_dense_cache(cfg, 2, 96, jax.random.PRNGKey(2))}
    start, given = np.asarray(caches["dense"].lengths), caches["dense"]
    first, key = jax.numpy.array([3, 5], jax.numpy.int32), jax.random.PRNGKey(0)
    call = P.restarted(caches, "dense", lambda c, p, f, k: autoregressive_loop(
        p, c, f, k, eos_ids=(), return_cache=True, gen=GenerationConfig(max_new_tokens=6, kv="bf16")),
        (params, first, key))
    limit = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", 4096)  # the weights are ~1 MB: as constants they warn
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = call().tokens
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", limit)
    assert not [w for w in caught if "constants were captured" in str(w.message)]  # weights are jit arguments
    assert given.k.is_deleted()  # donated
    assert (caches["dense"].lengths == start).all()
    b = call().tokens
    assert a.shape == (2, 6) and (a == b).all()


def test_torch_decode_peer_step_runs_on_the_cpu():
    """The PyTorch peer's decode step (bf16 weights) on a tiny shape on the CPU: it writes the new
    K/V at the current position, attends over the cache up to it, and returns a token; without
    CUDA the CLI records a skip instead of failing."""
    torch = pytest.importorskip("torch")
    from qspec_jax.bench import torch_decode as T

    shape = dict(hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=50, rope_theta=1e4, eps=1e-5)
    m = T.build("bf16", 7, 32, shape=shape, device="cpu")
    before = m["k"].clone()
    tok = T.step_fn(m)(torch.tensor([3]))
    assert tok.shape == (1,) and 0 <= int(tok) < 50
    assert not torch.equal(m["k"][:, :, :, 7], before[:, :, :, 7])  # slot 7 (the position) written
    assert torch.equal(m["k"][:, :, :, :7], before[:, :, :, :7])
    if not torch.cuda.is_available():
        assert T.main(["--contexts", "64", "--weights", "bf16"]) == 0


def test_torch_decode_peer_takes_smollm2s_shape_and_a_batch(tmp_path, capsys):
    """The PyTorch peer at B rows (part smollm's, `--shape smollm2 --batches`): every row's K / V
    written at the position, a token per row; its literal shapes are the JAX side's configs; a
    tinygemm group that does not divide the shape's K is refused by name; without CUDA each
    (context, batch) is recorded as skipped."""
    torch = pytest.importorskip("torch")
    from qspec_jax.bench import e2e
    from qspec_jax.bench import torch_decode as T
    from qspec_jax.bench.prefill import SMOLLM2

    for lit, cfg in ((T.SHAPES["smollm2"], SMOLLM2), (T.SHAPES["llama3-8b"], e2e.LLAMA31_8B)):
        assert lit == dict(hidden=cfg.hidden_size, inter=cfg.intermediate_size, layers=cfg.num_layers,
                           heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                           vocab=cfg.vocab_size, rope_theta=cfg.rope_theta, eps=cfg.rms_norm_eps)
    shape = dict(hidden=64, inter=96, layers=2, heads=3, kv_heads=1, head_dim=16, vocab=50, rope_theta=1e4, eps=1e-5)
    m = T.build("bf16", 7, 32, shape=shape, device="cpu", batch=3)
    assert m["k"].shape == (2, 3, 1, 8, 16)
    before = m["k"].clone()
    tok = T.step_fn(m)(torch.tensor([3, 4, 5]))
    assert tok.shape == (3,) and all(0 <= int(t) < 50 for t in tok)
    for row in range(3):  # each row's slot 7 written, the rest untouched
        assert not torch.equal(m["k"][:, row, :, 7], before[:, row, :, 7])
    assert torch.equal(m["k"][:, :, :, :7], before[:, :, :, :7])
    with pytest.raises(SystemExit):
        T.main(["--shape", "smollm2", "--weights", "int4", "--group", "128"])
    assert "--group 128: the smollm2 shape's linears have K = 576, 1536, 576" in capsys.readouterr().err
    if not torch.cuda.is_available():
        out = tmp_path / "peer.json"
        assert T.main(["--shape", "smollm2", "--batches", "1,32", "--contexts", "64", "--group", "32",
                       "--out", str(out)]) == 0
        recs = json.loads(out.read_text())
        assert [(r["weights"], r["batch"]) for r in recs] == [("bf16", 1), ("bf16", 32), ("int4", 1), ("int4", 32)]
        assert all(r["status"].startswith("skipped") for r in recs)


@pytest.mark.slow  # two tiny SmolLM2-layout draft programs (~30 CPU-s)
def test_shape_and_batch_reach_the_programs(tmp_path):
    """--shape and --batch build the caches and tokens the programs run on: the SmolLM2 layout's
    attention floor doubles from batch 1 to 2 (every row reads its own cache)."""
    floors = {}
    for b in (1, 2):
        out = tmp_path / f"b{b}"
        assert cli.main(["profile", "--quick", "--shape", "smollm2", "--batch", str(b), "--programs", "draft",
                         "--out", str(out)]) == 0
        res = json.loads((out / "profile.json").read_text())
        assert res["batch"] == b and res["config"].startswith("tiny SmolLM2-135M shape")
        floors[b] = res["rows"][0]["floor_us"]["attention"]
    assert floors[2] == pytest.approx(2 * floors[1])


@pytest.mark.slow  # a tiny SmolLM2-layout draft program and the AR loop (~30 CPU-s)
def test_ragged_rows_reach_the_programs(tmp_path, capsys):
    """--ragged: the caches hold rows of different lengths, evenly from context/2 to context (the e2e
    batch part's), the rows record them, the attention floor follows their mean, and the loop
    restarts from them."""
    out = tmp_path / "r"
    assert cli.main(["profile", "--quick", "--shape", "smollm2", "--batch", "2", "--ragged", "--contexts", "512",
                     "--programs", "draft,ar_loop", "--out", str(out)]) == 0
    assert "== draft at 512 (rows of 256..512)" in capsys.readouterr().out
    rows = json.loads((out / "profile.json").read_text())["rows"]
    assert [r["lengths"] for r in rows] == [[256, 512], [256, 512]]
    assert all(r["wall_us"] > 0 for r in rows)
    assert cli.main(["profile", "--quick", "--shape", "smollm2", "--batch", "2", "--contexts", "512",
                     "--programs", "draft", "--out", str(tmp_path / "u")]) == 0
    uniform = json.loads((tmp_path / "u" / "profile.json").read_text())["rows"][0]
    assert "lengths" not in uniform
    assert 0.5 * uniform["floor_us"]["attention"] < rows[0]["floor_us"]["attention"] < uniform["floor_us"]["attention"]


def test_attention_floor_counts_each_rows_length():
    """The quantized view's byte floor of rows of different lengths is the sum of each row's own
    (planes, scales and ring over its own q_len / fp_len), not batch x the first row's."""
    from qspec_jax.bench import e2e
    from qspec_jax.bench.kernel import quant_bytes

    cfg = P.SHAPES["smollm2"][0].replace(vocab_size=512, num_layers=2, intermediate_size=512)
    key = jax.random.PRNGKey(0)

    def cache(lengths):
        return e2e.random_quant_cache(cfg, len(lengths), 512, key, np.asarray(lengths, np.int32))

    for target in (False, True):
        both = quant_bytes(cache([256, 512]), 5, cfg.num_heads, target)
        alone = [quant_bytes(cache([n]), 5, cfg.num_heads, target) for n in (256, 512)]
        assert both == sum(alone) and alone[0] < alone[1]


def test_gaps_are_the_wall_outside_kernels(capsys):
    """A GPU row's line and report row give the wall a step spends outside kernels (wall - kernels): the loops'
    idle that the kernel times alone hide; a row without kernel events (a CPU run) has none in the report."""
    cats = {c: {"us": 0.0, "launches": 0.0} for c in P.CATEGORIES}
    gpu = {"program": "ar_loop", "context": 8192, "unit": "token", "wall_us": 2915.0, "busy_us": 2779.0,
           "launches": 459.0, "categories": cats, "floor_us": {}, "labels": []}
    assert P.gaps_us(gpu) == pytest.approx(136.0)
    P.show(gpu, 3, 30)
    assert "kernels 2.779 ms in 459 launches/token (15.3 per layer), gaps 0.136 ms" in capsys.readouterr().out
    cpu = dict(gpu, program="draft", busy_us=0.0, launches=0.0)
    res = {"config": "cfg", "batch": 32, "read_ceiling_bytes_per_s": 4.35e12, "draft": {"group_size": 32},
           "verify_t": 3, "gamma": 2, "alpha": 0.9, "rows": [gpu, cpu]}
    env = {"device": "H100", "backend": "gpu", "num_devices": 1, "date": "2026-12-05", "jax": "0.11.2"}
    md = P.markdown(res, "cmd", env, 3)
    assert "| gaps ms |" in md and "| ar_loop | 8192 | 2.92 | 2.78 | 0.136 | 459 |" in md
    assert "| draft | 8192 | 2.92 | 0 | – | 0 |" in md


def test_traced_idle_is_charged_to_its_boundary(capsys):
    """`idle_boundaries`: kernels on one timeline (two streams overlapping count once), the stretches with none
    running, each charged to (the kernel that ended last before it, the one after it), per step; largest first."""
    lin, att = "int4_mma_skinny_k576_n960_g32_s1", "quantspec_draft_mgpu_ws_mosaic_gpu_kernel"
    ev = []
    for base in (0.0, 100.0):  # two steps
        ev += [{"name": lin, "ts_us": base, "dur_us": 10.0},
               {"name": "loop_add_fusion", "ts_us": base + 4.0, "dur_us": 2.0},  # inside lin's span: no idle
               {"name": att, "ts_us": base + 13.0, "dur_us": 20.0},  # 3 us after lin ended
               {"name": "memcpy32_post", "ts_us": base + 40.0, "dur_us": 2.0}]  # 7 us after att ended
    t = P.idle_boundaries(ev, per=2, top=4)
    assert t["span_us"] == pytest.approx(142.0 / 2)  # 0 .. the second step's copy's end
    assert t["idle_us"] == pytest.approx((3 + 7 + 58 + 3 + 7) / 2)  # 58: the first copy's end to the next step
    b = t["boundaries"]
    assert [(x["before"], x["after"]) for x in b] == [
        ("memcpy32_post", "int4 k576 n960 g32"), (att, "memcpy32_post"), ("int4 k576 n960 g32", att)]
    assert [x["us"] for x in b] == pytest.approx([29.0, 7.0, 3.0]) and [x["count"] for x in b] == [0.5, 1, 1]
    assert len(P.idle_boundaries(ev, per=2, top=1)["boundaries"]) == 1
    assert P.idle_boundaries([], per=1) == {"span_us": 0.0, "idle_us": 0.0, "boundaries": []}
    cats = {c: {"us": 0.0, "launches": 0.0} for c in P.CATEGORIES}
    row = {"program": "draft", "context": 8192, "unit": "step", "wall_us": 80.0, "busy_us": 33.0, "launches": 4.0,
           "categories": cats, "floor_us": {}, "labels": [], "traced": t, "graphs_in_trace": True}
    P.show(row, 3, 30)
    out = capsys.readouterr().out
    assert "traced      0.071 ms from the first kernel to the last, idle 0.039 ms (graphs kept)" in out
    assert "idle     29.0 us  x   0.5  memcpy32_post -> int4 k576 n960 g32" in out
    P.show(dict(row, graphs_in_trace=False), 3, 30)
    assert "(op by op)" in capsys.readouterr().out


def test_graphs_in_trace_sets_the_xla_flag(monkeypatch):
    """`--graphs-in-trace` adds XLA's keep-command-buffers-while-profiling flag to XLA_FLAGS, keeps the others,
    accepts it already given, and refuses a conflicting value or a backend that has read XLA_FLAGS already."""
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}
    P.keep_graphs_in_trace(env)
    assert env["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=false " + P.GRAPHS_IN_TRACE_FLAG
    P.keep_graphs_in_trace(env)  # given already: unchanged
    assert env["XLA_FLAGS"].split().count(P.GRAPHS_IN_TRACE_FLAG) == 1
    empty: dict[str, str] = {}
    P.keep_graphs_in_trace(empty)
    assert empty == {"XLA_FLAGS": P.GRAPHS_IN_TRACE_FLAG}
    with pytest.raises(SystemExit) as e:
        P.keep_graphs_in_trace({"XLA_FLAGS": "--xla_enable_command_buffers_during_profiling=false"})
    assert e.value.code == 2
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    with pytest.raises(SystemExit):
        P.keep_graphs_in_trace({})
