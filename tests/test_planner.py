"""The planners: memory (the longest context that fits) and speed (gamma from measured step costs).

Speed: synthetic cost tables with hand-worked answers, a property check against a brute-force
oracle (the planner never picks a setting predicted slower than autoregressive decoding, and
never misses one predicted faster), the fall-back to AR, the JSON step-cost cache and the
calibration runs on a tiny model. Memory: max_context against cache and weight sizes computed
independently from array shapes and from the INT4 format's byte count.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

from qspec_jax import model as M
from qspec_jax import planner as P
from qspec_jax.cache import DenseKVCache, QuantSpecCache
from qspec_jax.checkpoint import Model
from qspec_jax.config import ModelConfig
from qspec_jax.speculative import SpecConfig
from qspec_jax.weight_quant import DraftWeightsConfig

GM = SpecConfig().gamma_max  # the default gamma_max (candidates 1..GM)
W = SpecConfig().verify_width  # GM + 1 columns per verify pass
H200_4K = dict(draft_s=8.92e-3, verify_s=7.35e-3, ar_s=6.07e-3)  # docs/bench/exactness_cost_h200.json, 8B shape


def costs(draft_s: float, verify_s: float, ar_s: float, batch: int = 1) -> P.StepCosts:
    return P.StepCosts(draft_s, verify_s, ar_s, verify_width=W, batch=batch, source="synthetic")


def oracle_tokens_per_s(alpha: float, gamma: int, c: P.StepCosts) -> float:
    """Brute force: accepted drafts i with probability alpha^i, plus the one target token."""
    e = sum(alpha ** i for i in range(gamma + 1))
    return c.batch * e / (gamma * c.draft_s + c.verify_s)


# ------------------------------------------------------------------------------ speed: model
def test_expected_tokens_per_round():
    assert P.expected_tokens_per_round(0.0, 4) == 1.0
    assert P.expected_tokens_per_round(1.0, 4) == 5.0
    assert P.expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    assert P.expected_tokens_per_round(0.8, 6) == pytest.approx(3.951424)
    with pytest.raises(ValueError, match="alpha=1.2"):
        P.expected_tokens_per_round(1.2, 4)


def test_plan_picks_the_fastest_gamma():
    """draft 1, verify 10, AR 10 (ms), alpha 0.8: tokens/ms = E/(g + 10) is 0.1636, 0.2033,
    0.2271, 0.2401, 0.2459, 0.2470, 0.2448, 0.2405 for g = 1..8: gamma 6, 2.47x AR."""
    assert GM >= 7
    c = costs(1e-3, 10e-3, 10e-3)
    plan = P.plan_gamma(c, SpecConfig(temperature=0.7, top_k=5), alpha=0.8)
    assert plan.spec.gamma == 6 and plan.spec.draft_policy == "fixed"
    assert (plan.spec.temperature, plan.spec.top_k) == (0.7, 5)  # the base's other settings kept
    assert plan.best.tokens_per_s == pytest.approx(3.951424 / 16e-3)
    assert plan.speedup == pytest.approx(2.4696, abs=1e-4)
    assert [c.spec.gamma for c in plan.candidates][:3] == [6, 5, 7]
    assert "gamma=6" in plan.summary() and "2.47x" in plan.summary()


def test_cheap_draft_and_high_alpha_take_the_longest_draft():
    plan = P.plan_gamma(costs(0.1e-3, 5e-3, 5e-3), SpecConfig(), alpha=0.95)
    assert plan.spec.gamma == GM


def test_falls_back_to_ar_with_todays_h200_costs():
    """The 8B draft step (8.92 ms) costs more than an AR step (6.07 ms): no gamma wins, even when
    every draft is accepted (gamma 7: 8 tokens / 69.8 ms vs 1 / 6.07 ms)."""
    for alpha in (0.5, 0.9, 1.0):
        plan = P.plan_gamma(costs(**H200_4K), SpecConfig(), alpha=alpha)
        assert plan.spec is None
        assert plan.speedup < 1.0
        line = plan.summary()
        assert "decoding autoregressively" in line and "\n" not in line


def test_never_slower_than_ar_and_never_misses_a_win():
    rng = np.random.default_rng(0)
    chosen = fallback = 0
    for _ in range(400):
        c = costs(*np.exp(rng.uniform(np.log(1e-4), np.log(2e-2), 3)), batch=int(rng.integers(1, 9)))
        alpha = float(rng.uniform(0, 1))
        plan = P.plan_gamma(c, SpecConfig(), alpha=alpha)
        speeds = {g: oracle_tokens_per_s(alpha, g, c) for g in range(1, GM + 1)}
        best = max(speeds, key=speeds.get)
        ar = c.batch / c.ar_s
        assert plan.ar_tokens_per_s == pytest.approx(ar)
        assert plan.best.tokens_per_s == pytest.approx(speeds[best])
        if speeds[best] > ar * (1 + 1e-9):
            assert plan.spec is not None and plan.spec.gamma == best
            chosen += 1
        elif speeds[best] < ar * (1 - 1e-9):
            assert plan.spec is None
            fallback += 1
    assert chosen > 50 and fallback > 50  # both outcomes exercised


def test_min_speedup_margin():
    c = costs(1e-3, 10e-3, 10e-3)  # best 2.47x
    assert P.plan_gamma(c, SpecConfig(), alpha=0.8, min_speedup=2.4).spec.gamma == 6
    assert P.plan_gamma(c, SpecConfig(), alpha=0.8, min_speedup=2.5).spec is None


def test_measured_candidates_compete():
    """A measured dynamic policy with more tokens per round than the alpha model gives any fixed
    gamma at the same cost wins; a worse one does not."""
    c = costs(1e-3, 10e-3, 10e-3)
    base = SpecConfig()
    bass = SpecConfig(gamma=4, draft_policy="bass")
    plan = P.plan_gamma(c, base, alpha=0.8, measured={bass: (4.5, 5.0)})  # 4.5 / 15 ms > 0.2470
    assert plan.spec == bass and plan.best.measured and f"bass 4..{GM} (+1, /4) (measured)" == plan.best.label
    plan = P.plan_gamma(c, base, alpha=0.8, measured={bass: (3.0, 5.0)})
    assert plan.spec.gamma == 6 and plan.spec.draft_policy == "fixed"
    only = P.plan_gamma(c, base, measured={bass: (3.0, 5.0), SpecConfig(gamma=2): (2.5, 2.0)})
    assert only.spec == SpecConfig(gamma=2) and len(only.candidates) == 2  # 2.5/12 > 3/15


def test_plan_gamma_bad_input():
    c = costs(1e-3, 10e-3, 10e-3)
    with pytest.raises(ValueError, match=f"verify passes of {W} columns; this SpecConfig verifies 5"):
        P.plan_gamma(c, SpecConfig(gamma=2, gamma_max=4), alpha=0.8)
    with pytest.raises(ValueError, match="exact=False"):
        P.plan_gamma(c, SpecConfig(exact=False), alpha=0.8)
    with pytest.raises(ValueError, match="give alpha"):
        P.plan_gamma(c, SpecConfig())
    with pytest.raises(ValueError, match=r"alpha=-0.1"):
        P.plan_gamma(c, SpecConfig(), alpha=-0.1)
    with pytest.raises(ValueError, match="tokens/round 0.5 must be >= 1"):
        P.plan_gamma(c, SpecConfig(), measured={SpecConfig(): (0.5, 4.0)})
    with pytest.raises(ValueError, match=r"StepCosts.draft_s=-1"):
        P.StepCosts(-1, 1.0, 1.0, 9)
    with pytest.raises(ValueError, match=r"StepCosts.ar_s=nan"):
        P.StepCosts(1.0, 1.0, float("nan"), 9)


def test_context_bucket():
    assert [P.context_bucket(n) for n in (1, 1000, 1500, 2800, 2900, 4096, 6000, 131072)] == \
        [1024, 1024, 2048, 2048, 4096, 4096, 8192, 131072]
    with pytest.raises(ValueError, match="context=0"):
        P.context_bucket(0)


# -------------------------------------------------------------- speed: measuring, on a model
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, dtype="float32", max_position_embeddings=8192, eos_token_ids=(),
                   attention_impl="reference")
SPEC = SpecConfig(gamma=2, max_new_tokens=16, group_size=32, draft_group=32, draft_method="clip")  # data-free: fast


@pytest.fixture(scope="module")
def tiny():
    return Model(config=TINY, params=M.init_random_params(TINY, jax.random.PRNGKey(0), scale=0.3))


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_step_cost_cache(tiny, tmp_path, monkeypatch):
    path = tmp_path / "sub" / "costs.json"
    calls = []
    real = P.time_passes
    monkeypatch.setattr(P, "time_passes", lambda *a, **k: calls.append(k["width"]) or real(*a, **k))
    kw = dict(path=path, steps=2, trials=1, progress=False)
    c = P.measure_step_costs(tiny, SPEC, context=1000, **kw)
    assert calls == [1, W, 1, 1]  # draft, verify at gamma_max + 1, AR over bf16 and INT8 caches
    assert c.verify_width == W and c.batch == 1 and min(c.draft_s, c.verify_s, c.ar_s) > 0
    entry, = json.loads(path.read_text())["entries"].values()
    assert entry["context"] == 1024 and entry["ar_s"] == min(entry["ar_bf16_s"], entry["ar_int8_s"])
    again = P.measure_step_costs(tiny, SPEC, context=1100, **kw)  # same bucket: read, not measured
    assert len(calls) == 4 and (again.draft_s, again.verify_s, again.ar_s) == (c.draft_s, c.verify_s, c.ar_s)
    assert str(path) in again.source and "measured" not in again.source
    P.measure_step_costs(tiny, SPEC, context=1100, refresh=True, **kw)
    assert len(calls) == 8
    P.measure_step_costs(tiny, SPEC, context=3000, **kw)  # another bucket
    P.measure_step_costs(tiny, SPEC, context=1000, batch=2, **kw)  # another batch
    P.measure_step_costs(tiny, dataclasses.replace(SPEC, draft_method="minmax"), context=1000, **kw)  # another draft
    assert len(calls) == 20 and len(json.loads(path.read_text())["entries"]) == 4
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"step-cost cache {path}: not readable JSON"):
        P.measure_step_costs(tiny, SPEC, context=1000, **kw)


def test_estimate_alpha(tiny):
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    dense = dataclasses.replace(SPEC, draft_kv="bf16", target_kv="bf16")
    alpha, trials = P.estimate_alpha(tiny, prompts, dense, draft_params=tiny.params)  # the draft is the target
    assert alpha == 1.0 and trials > 0
    other = M.init_random_params(TINY, jax.random.PRNGKey(5), scale=0.3)
    alpha, trials = P.estimate_alpha(tiny, prompts, dense, draft_params=other)
    assert 0.0 <= alpha < 0.5 and trials > 0


def test_plan_end_to_end(tiny):
    prompts = [[1, 2, 3, 4, 5]]
    dense = dataclasses.replace(SPEC, draft_kv="bf16", target_kv="bf16")
    cheap = costs(0.1e-3, 1e-3, 1e-3)
    p = P.plan(tiny, prompts, dense, costs=cheap, draft_params=tiny.params)  # alpha measured: 1.0
    assert p.alpha == 1.0 and p.alpha_trials > 0 and p.spec.gamma == GM
    assert p.spec.max_new_tokens == dense.max_new_tokens and p.spec.target_kv == "bf16"
    p = P.plan(tiny, prompts, dense, costs=costs(**H200_4K), alpha=0.9)
    assert p.spec is None and p.alpha_trials is None


# ----------------------------------------------------------------------------------- memory
MEM = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, dtype="bfloat16", max_position_embeddings=1 << 20, eos_token_ids=())


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _cache_nbytes(kind: str, batch: int, max_len: int, group: int = 32, gamma_max: int = 8) -> int:
    if kind == "bf16":
        return _nbytes(jax.eval_shape(lambda: DenseKVCache.init(MEM, batch, max_len)))
    return _nbytes(jax.eval_shape(lambda: QuantSpecCache.init(MEM, batch, max_len, group_size=group,
                                                              gamma_max=gamma_max)))


def test_weight_bytes_count_the_int4_format():
    """Draft bytes: per INT4 linear [Din, Dout], Din*Dout/2 packed bytes plus float16 scale and
    zero per group of 32 inputs; the tied lm_head [D, V] is quantized too."""
    w = P.weight_bytes(MEM, DraftWeightsConfig(group_size=32))
    assert w["target"] == _nbytes(jax.eval_shape(lambda: M.init_random_params(MEM, jax.random.PRNGKey(0))))
    d, q, kv, f, v = 64, 4 * 16, 2 * 16, 128, 96
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    int4 = lambda din, dout: din * dout // 2 + 2 * 2 * (din // 32) * dout  # noqa: E731
    assert w["draft"] == MEM.num_layers * sum(int4(*s) for s in shapes) + int4(d, v)
    assert "draft" not in P.weight_bytes(MEM)


@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_max_context_is_the_longest_that_fits(kind, batch):
    draft = DraftWeightsConfig(group_size=32) if kind == "int8" else None
    weights = sum(P.weight_bytes(MEM, draft).values())
    headroom = 1 << 20
    device = weights + headroom + 50_000_000
    kw = dict(batch=batch, draft=draft, group_size=32, gamma_max=8, headroom_bytes=headroom)
    out = P.max_context(MEM, kind, device, **kw)
    ctx = out["context"]
    assert ctx > 0 and ctx % 32 == 0
    assert out["weights"] == weights and out["cache"] == _cache_nbytes(kind, batch, ctx)
    assert weights + _cache_nbytes(kind, batch, ctx) + headroom <= device  # fits
    assert weights + _cache_nbytes(kind, batch, ctx + 32) + headroom > device  # one block more does not
    assert out["total"] == weights + out["cache"]


def test_max_context_compares_the_caches():
    """The INT8 cache holds about twice the context of the bf16 one (1 byte + scales per element
    instead of 2) and more rows take proportionally less; nothing fits in too small a device."""
    weights = sum(P.weight_bytes(MEM, DraftWeightsConfig(group_size=32)).values())
    device = weights + (1 << 20) + 200_000_000
    kw = dict(group_size=32, headroom_bytes=1 << 20)
    bf16 = P.max_context(MEM, "bf16", device, **kw)["context"]
    int8 = P.max_context(MEM, "int8", device, draft=DraftWeightsConfig(group_size=32), **kw)["context"]
    assert 1.6 < int8 / bf16 < 2.0
    four = P.max_context(MEM, "bf16", device, batch=4, **kw)["context"]
    assert abs(four * 4 - bf16) <= 4 * 32
    assert P.max_context(MEM, "bf16", weights, **kw)["context"] == 0


# ---------------------------------------------------------------------- qspec-generate --gamma auto
def _cli_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from qspec_jax.cli import generate

    with pytest.raises(SystemExit) as info:
        generate.main([str(a) for a in argv])
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--acceptance", "0.5"], "--acceptance must be given only with --gamma auto, got 0.5"),
    (["--gamma", "auto", "--acceptance", "1.5"], "--acceptance must be in [0, 1], got 1.5"),
    (["--plan-cache", "c.json"], "--plan-cache must be given only with --gamma auto, got c.json"),
    (["--gamma", "auto", "--draft-policy", "bass"], "--draft-policy bass with --gamma auto"),
    (["--gamma", "fast"], f"argument --gamma: expected an integer 1..{GM} or 'auto', got 'fast'"),
])
def test_gamma_auto_bad_flags(argv, message, tmp_path, capsys):
    line = _cli_error(["--checkpoint", tmp_path / "none", "--prompt", "hi", *argv], capsys)
    assert line.startswith("qspec-generate: error: ") and message in line, line


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_generate_gamma_auto(tiny_chat_checkpoint, tmp_path, capsys):
    """--gamma auto measures the step costs once (cached), then: at alpha 0 every round emits one
    token for a draft step and a verify pass, slower than an AR step: it decodes autoregressively
    and says so in one line; with the cached costs edited to a free draft and alpha 1, gamma_max."""
    from qspec_jax.cli import generate

    cache = tmp_path / "costs.json"
    argv = ["--checkpoint", str(tiny_chat_checkpoint), "--prompt", "Hello there", "--max-new-tokens", "6",
            "--gamma", "auto", "--plan-cache", str(cache), "--json"]
    assert generate.main(argv + ["--acceptance", "0"]) == 0
    out, err = capsys.readouterr()
    res, lines = json.loads(out), [ln for ln in err.splitlines() if "--gamma auto" in ln]
    assert len(lines) == 1 and lines[0].startswith("qspec-generate: --gamma auto: no draft length is predicted")
    assert lines[0].endswith("decoding autoregressively")
    assert res["gamma"] is None and "acceptance_rate" not in res and 1 <= len(res["tokens"]) <= 6
    data = json.loads(cache.read_text())
    entry, = data["entries"].values()
    entry.update(draft_s=1e-9, verify_s=entry["ar_s"])  # drafting free, verify as cheap as AR
    cache.write_text(json.dumps(data))
    assert generate.main(argv + ["--acceptance", "1"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)
    assert res["gamma"] == GM and "acceptance_rate" in res and f"gamma={GM}: predicted" in res["plan"]
    assert "[planner] measuring" not in err  # the cached costs were used


# ------------------------------------------------- qspec-bench gamma: this device, measured loops
def test_gamma_bench_labels_costs_with_this_device(tmp_path):
    """The cost table is this run's device's, named with it (never "this CPU"); a stored cost
    JSON is used only when given, and named as stored."""
    from qspec_jax.bench import gamma as G

    label, slug = G.device_label(), G.device_slug()
    dev = jax.devices()[0]
    assert label.startswith("CPU ") if dev.platform == "cpu" else label == dev.device_kind
    assert slug and all(ch.isalnum() or ch == "_" for ch in slug)
    assert list(G.cost_scenarios(None, W)) == ["8B floors 4k (SPEC §8)"]
    stored = tmp_path / "costs.json"
    stored.write_text(json.dumps({"8b": [{"context": 4096, "draft_t1": 3.0, "int8_t8": 5.0, "int8_t9": 6.0,
                                          "bf16_t1": 5.5, "int8_t1": 5.2}]}))
    scen = G.cost_scenarios(stored, W)
    assert scen["stored costs.json: 8B 4k"] == pytest.approx(dict(draft_s=3e-3, verify_s=5e-3, ar_s=5.2e-3))
    assert not any("this CPU" in k for k in scen)


def test_loops_compare_the_planners_choice_with_the_fastest():
    """bench.gamma_loops.compare: the planner's choice (from alpha and costs) against measured
    loop tokens/s of every setting and AR; the fastest includes AR."""
    from qspec_jax.bench.gamma_loops import compare

    base = SpecConfig(eos_token_ids=())
    c = costs(1e-3, 10e-3, 10e-3)  # gamma 6 is predicted fastest at alpha 0.8 (test above)
    plan = P.plan_gamma(c, base, alpha=0.8)
    measured = {f"gamma={g}": {"tokens_per_s": 100.0 + g, "fields": {"gamma": g}} for g in range(1, GM + 1)}
    measured["bass 4..7 (+1, /4)"] = {"tokens_per_s": 120.0, "fields": {"gamma": 4, "draft_policy": "bass"}}
    row = compare(plan, measured, {"bf16": 90.0, "int8": 95.0})
    assert row["choice"] == "gamma=6" and row["choice_tokens_per_s"] == 106.0
    assert row["fastest"] == "bass 4..7 (+1, /4)" and row["choice_vs_fastest"] == pytest.approx(106 / 120)
    assert row["best_fixed"] == f"gamma={GM}" and row["best_fixed_tokens_per_s"] == 100.0 + GM
    row = compare(plan, measured, {"bf16": 200.0, "int8": 95.0})  # AR measured fastest
    assert row["fastest"] == "AR" and row["fastest_tokens_per_s"] == 200.0
    ar_plan = P.plan_gamma(costs(10e-3, 10e-3, 1e-3), base, alpha=0.5)  # a slow draft: AR predicted
    assert ar_plan.spec is None
    row = compare(ar_plan, measured, {"bf16": 90.0, "int8": 95.0})
    assert row["choice"] == "AR" and row["choice_tokens_per_s"] == 95.0
    with pytest.raises(ValueError, match="the planner chose gamma=6, which was not measured"):
        compare(plan, {k: v for k, v in measured.items() if k != "gamma=6"}, {"bf16": 1.0, "int8": 1.0})


@pytest.mark.slow  # > ~15 CPU-s: full suite only (README, Tests)
def test_gamma_bench_loops_part_quick(tmp_path):
    """`qspec-bench gamma --parts loops --quick` end to end on this CPU: this device's costs, the
    planner's choice for each alpha measured against the loops of every fixed gamma, BASS and AR."""
    from qspec_jax.bench import gamma as G

    assert G.main(["--parts", "loops", "--quick", "--loop-contexts", "256", "--loop-alphas", "0.9", "--out",
                   str(tmp_path), "--text-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / f"gamma_loops_{G.device_slug()}.json").read_text())
    assert data["device"] == G.device_label() and len(data["rows"]) == 1  # one context, batch 1, one alpha
    for row in data["rows"]:
        assert set(row["measured"]) == {f"gamma={g}" for g in range(1, GM + 1)} | {"bass 4..7 (+1, /4)"}
        assert row["choice"] in set(row["measured"]) | {"AR"} and 0 < row["choice_vs_fastest"] <= 1
        assert all(v["tokens_per_s"] > 0 for v in row["measured"].values())
        assert row["measured"]["gamma=4"]["tokens_per_round"] > 1  # alpha 0.9: drafts accepted
