"""qspec-bench e2e: whole-step GPU timings, projected and measured speedups, memory.

Parts (select with --parts):
  8b      Llama-3.1-8B-shaped model with random bf16 weights, batch 1: per-phase step times
          (AR-bf16, AR-int8, draft step, verify at each gamma) at each context, bytes moved per
          step against a device-to-device copy, projected speedup at the given acceptance
          rates, and a measured speculative loop at forced acceptance to check the projection.
  smollm  SmolLM2-135M real model on real text: AR vs speculative tokens/s at batch 1/8/32 (the fastest of
          --smollm-gamma, each gamma listed), decoding alone (the issues' and SPEC's measure: each
          method's own prefill, timed alone, taken out) and end to end (prefill included).
  memory  Peak memory of AR-bf16, AR-int8 and QuantSpec (8B shape) at 32k and 128k, and the
          longest context that fits, from the planner, confirmed by a run.
  prefill Time to first token: prompt attention per layer, 8B prefill at 8k-128k (whole and chunked),
          one 128k request end to end with the PyTorch peer, the longest prompt (`bench.prefill`).
  tp      Tensor parallelism: AR-bf16 and QuantSpec tokens/s of the 8B shape at 128k/256k on 1
          vs N devices (--tp-sizes), scaling efficiency and peak memory per device.

Caches for the 8B parts are filled with random data at the target context (a 128k prefill
would only add minutes of setup); step times do not depend on the values.

The autoregressive baselines are the fastest AR loops (one token column per pass, width 1): the
speedup's denominator. (AR at the verify width, GenerationConfig's default, computes bit for
bit what speculative decoding's target computes, at some cost; it is not the baseline.)
QuantSpec runs at a fixed gamma with gamma_max = gamma (`loop_spec`): verify passes of gamma + 1
columns, where SpecConfig's default gamma_max would make them DEFAULT_GAMMA_MAX + 1 wide at any gamma
(before 2026-12-01 they were).

Timing (SPEC §7): each measurement runs n steps inside one jitted loop and is repeated; the
median is reported. Loop tokens/s use the difference of two loop lengths, which cancels the
fixed cost of a call.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax import model as M
from qspec_jax.bench import options, report, synthetic
from qspec_jax.bench.prefill import part_prefill
from qspec_jax.bench.prefill import torch_peers as prefill_torch_peers
from qspec_jax.bench.timing import copy_bandwidth
from qspec_jax.cache import DenseKVCache, QuantSpecCache, prefill_quantized_len
from qspec_jax.config import ModelConfig, RopeScaling
from qspec_jax.generation import GenerationConfig, autoregressive_loop
from qspec_jax.linear import is_int4
from qspec_jax.planner import Request, device_memory_bytes, max_context, tree_bytes, weight_bytes
from qspec_jax.speculative import SpecConfig, speculative_loop
from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

LLAMA31_8B = ModelConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), max_position_embeddings=1 << 21,
    eos_token_ids=(), dtype="bfloat16", attention_impl="auto")
# Same structure, tiny sizes: `--quick` runs the whole harness on a CPU in about a minute.
QUICK = LLAMA31_8B.replace(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=64)
CONTEXTS = (4096, 16384, 32768, 65536, 131072)
GAMMAS = (2, 4, 6)
EXTRA_SLOTS = 512  # cache room past the context for the steps timed


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------ timing
def peak_bytes(ma: Any) -> int:
    """Peak device bytes of a compiled program (per device when sharded) from its XLA memory
    analysis: arguments + outputs + temporaries - donated aliases. Unlike the allocator's
    peak_bytes_in_use, it does not carry over from earlier programs in the same process."""
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes)


def median_seconds(call: Callable[[], Any], trials: int) -> float:
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@functools.partial(jax.jit, static_argnames=("n", "view"), donate_argnums=(1,))
def decode_steps(params: M.Params, cache: Any, toks: jax.Array, *, n: int, view: str) -> tuple[jax.Array, Any]:
    """n decode passes over toks [B, T] at a fixed context (rolled back after each pass); donates
    the cache. The step program every benchmark times and `qspec-bench profile` traces."""
    committed = cache.total_lengths()

    def body(_, carry):
        toks, cache = carry
        logits, cache = M.decode(params, toks, cache, view=view)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # feeds back: no pass can be hoisted
        return nxt, cache.rollback(committed)

    return jax.lax.fori_loop(0, n, body, (toks, cache))


def time_steps(params: M.Params, cache: Any, t: int, view: str, n: int, trials: int) -> tuple[float, Any]:
    """Median seconds per decode pass of t tokens per row (compiles on first use)."""
    return run_steps(lambda p, c, tk: decode_steps(p, c, tk, n=n, view=view), params, cache, t, n, trials)


def random_dense_cache(cfg: ModelConfig, batch: int, context: int, key: jax.Array,
                       lengths: np.ndarray | None = None) -> DenseKVCache:
    return synthetic.random_dense_cache(cfg, batch, context, key, extra_slots=EXTRA_SLOTS, lengths=lengths)


def random_quant_cache(cfg: ModelConfig, batch: int, context: int, key: jax.Array,
                       lengths: np.ndarray | None = None) -> QuantSpecCache:
    return synthetic.random_quant_cache(cfg, batch, context, key, extra_slots=EXTRA_SLOTS, lengths=lengths)


# ------------------------------------------------------------------------------- bytes model
def step_bytes(cfg: ModelConfig, weights: int, context: int, batch: int, kv: str, group: int = 128) -> int:
    """Fewest bytes one decode pass must read: weights plus the KV it attends over."""
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # K and V elements
    if kv == "bf16":
        kv_bytes = kv_per_token * 2 * context
    else:
        q = int(prefill_quantized_len(np.array([context]), group)[0])
        planes = kv_per_token // 2 * (1 if kv == "int4" else 2)  # bytes per quantized token
        scales = 2 * cfg.num_layers * cfg.num_kv_heads * 2 * (cfg.head_dim / group + 1)  # f16 s+z
        kv_bytes = q * (planes + scales) + (context - q) * kv_per_token * 2
    return int(weights + batch * kv_bytes)


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


# --------------------------------------------------------------------------------- part: 8b
def compile_all(programs: dict[Any, tuple[Any, tuple, dict]], workers: int = 8) -> dict[Any, Any]:
    """Lowers and compiles {name: (jitted_fn, abstract_args, static_kwargs)} in parallel threads
    (XLA compiles outside the GIL), so a benchmark pays the longest compile, not their sum."""
    from concurrent.futures import ThreadPoolExecutor

    def one(item):
        name, (fn, a, kw) = item
        t0 = time.perf_counter()
        try:
            exe = fn.lower(*a, **kw).compile()
        except Exception as e:  # noqa: BLE001 - one failing program must not sink the others
            traceback.print_exc()
            exe = f"{type(e).__name__}: {e}"[:500]
        return name, exe, time.perf_counter() - t0

    out = {}
    with ThreadPoolExecutor(workers) as pool:
        for name, exe, secs in pool.map(one, programs.items()):
            out[name] = exe
            log(f"{'compiled' if not isinstance(exe, str) else 'FAILED to compile'} {name} in {secs:.1f} s")
    return out


def run_steps(exe: Any, params: Any, cache: Any, t: int, n: int, trials: int) -> tuple[float, Any]:
    """Median seconds per pass of a compiled `decode_steps` program. Returns (seconds, cache)."""
    toks = jnp.full((cache.total_lengths().shape[0], t), 7, jnp.int32)
    toks, cache = exe(params, cache, toks)  # warm-up
    jax.block_until_ready(toks)
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        toks, cache = exe(params, cache, toks)
        jax.block_until_ready(toks)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times), cache


def bench_config(args: argparse.Namespace) -> ModelConfig:
    return (QUICK if args.quick else LLAMA31_8B).replace(attention_impl=args.attention_impl)


def loop_spec(gamma: int, **fields: Any) -> SpecConfig:
    """QuantSpec at a fixed draft length as the parts time it: gamma_max = gamma, so that every
    verify pass is gamma + 1 columns wide (SpecConfig's default gamma_max makes it DEFAULT_GAMMA_MAX
    + 1 at any gamma; exact either way, against AR at that verify width)."""
    return SpecConfig(gamma=gamma, gamma_max=gamma, **fields)


def time_generate_compile(p_abs: Any, d_abs: Any, args: argparse.Namespace) -> float:
    """Seconds to compile `generate` (prefill + speculative loop) for the model, alone."""
    from qspec_jax.speculative import speculative_program

    prompt = jax.ShapeDtypeStruct((1, 4096), jnp.int32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    t0 = time.perf_counter()
    speculative_program.lower(p_abs, d_abs, prompt, lengths, jax.random.PRNGKey(0),
                              spec=SpecConfig(gamma=4, max_new_tokens=128), eos_ids=(), max_len=4352).compile()
    secs = time.perf_counter() - t0
    log(f"compile of generate (prefill + speculative loop, {p_abs.config.num_layers} layers): {secs:.1f} s")
    return secs


def part_8b(args: argparse.Namespace, bw: float) -> dict[str, Any]:
    cfg = bench_config(args)
    key = jax.random.PRNGKey(0)
    dcfg = DraftWeightsConfig(group_size=args.draft_group, method="clip")  # random weights: the format, data-free
    p_abs = jax.eval_shape(lambda k: M.init_random_params(cfg, k), key)
    draft_src_abs = p_abs  # the checkpoint layout, which the draft is quantized from
    p_abs = jax.eval_shape(M.for_device, p_abs)  # the target as `load` lays it out here (fused on a GPU)
    # The draft's INT4 weights in the layout this device's kernel reads (Hopper: W4A16Packed).
    d_abs = jax.eval_shape(lambda p: M.for_device(make_draft_params(p, dcfg)), draft_src_abs)
    d_xla_abs = jax.eval_shape(lambda p: M.fuse_projections(make_draft_params(p, dcfg)), draft_src_abs).replace(
        config=cfg.replace(int4_matmul_impl="xla"))
    p_mosaic_abs = p_abs.replace(config=cfg.replace(dense_matmul_impl="mosaic"))
    first = jnp.array([7], jnp.int32)
    compile_generate_s = time_generate_compile(p_abs, d_abs, args)
    loop_new = args.loop_tokens
    ar_loop = jax.jit(autoregressive_loop, static_argnames=("gen", "eos_ids"))
    spec_loop = jax.jit(speculative_loop, static_argnames=("spec", "eos_ids"))

    programs: dict[Any, tuple[Any, tuple, dict]] = {}
    toks = lambda t: jax.ShapeDtypeStruct((1, t), jnp.int32)  # noqa: E731
    for c in args.contexts:
        dense = jax.eval_shape(lambda k: random_dense_cache(cfg, 1, c, k), key)
        quant = jax.eval_shape(lambda k: random_quant_cache(cfg, 1, c, k), key)
        steps = dict(n=args.steps)
        programs[("ar_bf16", c)] = (decode_steps, (p_abs, dense, toks(1)), dict(view="target", **steps))
        if args.dense_mosaic:  # the target's bf16 linears through the Mosaic GPU kernel instead of cuBLAS
            programs[("ar_bf16_mosaic", c)] = (decode_steps, (p_mosaic_abs, dense, toks(1)), dict(view="target", **steps))
        programs[("ar_int8", c)] = (decode_steps, (p_abs, quant, toks(1)), dict(view="target", **steps))
        programs[("draft", c)] = (decode_steps, (d_abs, quant, toks(1)), dict(view="draft", **steps))
        if c in (min(args.contexts), max(args.contexts)):  # the XLA INT4 path, for comparison
            programs[("draft_xla", c)] = (decode_steps, (d_xla_abs, quant, toks(1)), dict(view="draft", **steps))
        for g in args.gammas:
            programs[("verify", g, c)] = (decode_steps, (p_abs, quant, toks(g + 1)), dict(view="target", **steps))
        if c in args.loop_contexts:
            programs[("ar_bf16_loop", c)] = (ar_loop, (p_abs, dense, first, key), dict(
                gen=GenerationConfig(max_new_tokens=loop_new, kv="bf16", width=1), eos_ids=()))
            programs[("ar_int8_loop", c)] = (ar_loop, (p_abs, quant, first, key), dict(
                gen=GenerationConfig(max_new_tokens=loop_new, kv="int8", width=1), eos_ids=()))
            for a in args.alphas:
                programs[("spec_loop", args.loop_gamma, a, c)] = (spec_loop, (p_abs, d_abs, quant, first, key), dict(
                    spec=loop_spec(args.loop_gamma, max_new_tokens=loop_new, forced_acceptance=a,
                                   eos_token_ids=()), eos_ids=()))
    log(f"compiling {len(programs)} programs")
    t0 = time.perf_counter()
    exes = compile_all(programs, args.compile_workers)
    compile_wall = time.perf_counter() - t0
    log(f"all compiled in {compile_wall:.1f} s wall")

    log("random 8B bf16 weights + INT4 draft")
    params = jax.jit(lambda k: M.init_random_params(cfg, k))(key)
    unfused = make_draft_params(params, dcfg)
    wb = weight_bytes(cfg, dcfg)
    embed = tree_bytes(params.embed)
    target_read = wb["target"] - embed  # an embedding row is negligible; untied lm_head is read
    draft_read = wb["draft"] + tree_bytes([params.layers.attn_norm, params.layers.mlp_norm, params.final_norm])
    draft_read += tree_bytes([getattr(params.layers, n) for n in M.LINEAR_NAMES
                              if not is_int4(getattr(unfused.layers, n))])
    draft_xla = M.fuse_projections(unfused).replace(config=d_xla_abs.config)
    draft = jax.block_until_ready(M.for_device(unfused.replace(config=d_abs.config)))
    del unfused
    params = jax.block_until_ready(M.for_device(params))
    params_mosaic = params.replace(config=p_mosaic_abs.config)
    weights = tree_bytes(params) + 2 * wb["draft"]  # the target, the draft's INT4 weights in two layouts
    rows = []
    for c in args.contexts:
        row: dict[str, Any] = {"context": c, "errors": {}}

        def steps(name: Any, field: str, p: Any, cache: Any, t: int) -> Any:
            """Times one compiled step program into row[field] (NaN and an error if it failed)."""
            exe = exes.get(name)
            if exe is None or isinstance(exe, str):
                row[field], row["errors"][field] = float("nan"), exe or "not compiled"
                return cache
            secs, cache = run_steps(exe, p, cache, t, args.steps, args.trials)
            row[field] = secs * 1e3
            return cache

        def loop(name: Any, field: str, *call_args: Any) -> Any:
            exe = exes.get(name)
            if exe is None or isinstance(exe, str):
                row[field], row["errors"][field] = float("nan"), exe or "not compiled"
                return None
            res = exe(*call_args)
            row[field] = loop_new / median_seconds(lambda: exe(*call_args), args.trials)
            return res

        def measure_dense() -> None:
            dense = random_dense_cache(cfg, 1, c, jax.random.fold_in(key, c))
            dense = steps(("ar_bf16", c), "ar_bf16_ms", params, dense, 1)
            if args.dense_mosaic:
                dense = steps(("ar_bf16_mosaic", c), "ar_bf16_mosaic_ms", params_mosaic, dense, 1)
            if c in args.loop_contexts:
                loop(("ar_bf16_loop", c), "ar_bf16_loop_tok_s", params, dense, first, key)

        def measure_quant() -> None:
            quant = random_quant_cache(cfg, 1, c, jax.random.fold_in(key, c + 1))
            quant = steps(("ar_int8", c), "ar_int8_ms", params, quant, 1)
            quant = steps(("draft", c), "draft_ms", draft, quant, 1)
            quant = steps(("draft_xla", c), "draft_xla_int4_ms", draft_xla, quant, 1)
            for g in args.gammas:
                quant = steps(("verify", g, c), f"verify_g{g}_ms", params, quant, g + 1)
            if c in args.loop_contexts:
                loop(("ar_int8_loop", c), "ar_int8_loop_tok_s", params, quant, first, key)
                for a in args.alphas:
                    res = loop(("spec_loop", args.loop_gamma, a, c), f"spec_g{args.loop_gamma}_a{a}_loop_tok_s",
                               params, draft, quant, first, key)
                    if res is not None:
                        row[f"spec_g{args.loop_gamma}_a{a}_loop_tokens_per_round"] = res.tokens_per_round

        # The random caches (no prefill) and the programs' passes must fit beside the weights.
        verify = dataclasses.replace(loop_spec(max(args.gammas), max_new_tokens=loop_new).memory_request(1, c),
                                     prefill=False, cache_slots=-(-(c + EXTRA_SLOTS) // 128) * 128)
        errors = [options.run_case(measure_dense, cfg, Request(1, c, loop_new, kv="bf16", width=1, prefill=False,
                                                               cache_slots=c + EXTRA_SLOTS), weights),
                  options.run_case(measure_quant, cfg, verify, weights)]
        if any(errors):  # the row keeps what was measured; nothing is derived from it
            row["error"] = " | ".join(e for e in errors if e)
            log(f"context {c}: {row['error']}")
            rows.append(row)
            continue
        row.update(ar_bf16_bytes=step_bytes(cfg, target_read, c, 1, "bf16"),
                   ar_int8_bytes=step_bytes(cfg, target_read, c, 1, "int8"),
                   draft_bytes=step_bytes(cfg, draft_read, c, 1, "int4"))
        for k in ("ar_bf16", "ar_int8", "draft"):
            row[f"{k}_bw_frac"] = row[f"{k}_bytes"] / (row[f"{k}_ms"] * 1e-3) / bw
        for g in args.gammas:
            t_round = g * row["draft_ms"] + row[f"verify_g{g}_ms"]
            for a in args.alphas:
                e = expected_tokens_per_round(a, g)
                row[f"proj_g{g}_a{a}_vs_bf16"] = e * row["ar_bf16_ms"] / t_round
                row[f"proj_g{g}_a{a}_vs_int8"] = e * row["ar_int8_ms"] / t_round
        if c in args.loop_contexts:
            for a in args.alphas:
                measured = row[f"spec_g{args.loop_gamma}_a{a}_loop_tok_s"] / row["ar_bf16_loop_tok_s"]
                row[f"loop_g{args.loop_gamma}_a{a}_vs_bf16"] = measured
                row[f"loop_g{args.loop_gamma}_a{a}_vs_projection"] = measured / row[f"proj_g{args.loop_gamma}_a{a}_vs_bf16"]
        log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
        rows.append(row)
    return {"config": "Llama-3.1-8B shape, random bf16 weights, batch 1", "weights": wb,
            "draft": dcfg.to_dict(), "compile_wall_s": compile_wall, "compile_generate_s": compile_generate_s,
            "rows": rows,
            "note": "forced acceptance: each draft accepted i.i.d. with probability alpha (SpecConfig.forced_acceptance)"}


# ----------------------------------------------------------------------------- part: smollm
def part_smollm(args: argparse.Namespace) -> dict[str, Any]:
    import qspec_jax
    from qspec_jax.evaluation import read_text_tokens
    from qspec_jax.generation import generate_autoregressive
    from qspec_jax.speculative import draft_format_fields, generate

    model = qspec_jax.load(args.smollm_checkpoint, attention_impl=args.attention_impl)
    texts = sorted(Path(args.text_dir).glob("*.txt"))
    if not texts:
        raise FileNotFoundError(f"{args.text_dir}: no .txt files")
    ctx, new = args.smollm_context, args.smollm_new_tokens
    # The baselines are the fastest AR loops (width 1, as in every part); QuantSpec as every part runs it
    # (`loop_spec`: verify passes of gamma + 1 columns), its greedy tokens compared with AR-INT8 at that
    # verify width (`exact_ar`), where the target computes the verify's logits bit for bit (the width-1
    # loop may differ in a last bit: GenerationConfig).
    ar = {kv: GenerationConfig(max_new_tokens=new, kv=kv, eos_token_ids=(), width=1) for kv in ("bf16", "int8")}
    stored = model.draft_weights_config  # the checkpoint's INT4 draft, used as it is (None: the default format, made)
    fmt = draft_format_fields(stored) if stored is not None else {}
    spec = {g: loop_spec(g, max_new_tokens=new, eos_token_ids=(), **fmt) for g in args.smollm_gamma}
    exact_ar = {w: GenerationConfig(max_new_tokens=new, kv="int8", eos_token_ids=(), width=w)
                for w in sorted({c.verify_width for c in spec.values()})}
    rows = []
    for batch in args.smollm_batches:
        prompts = []
        for b in range(batch):  # different plays and offsets: real, distinct prompts
            ids = read_text_tokens(model, texts[b % len(texts)], ctx, offset=1000 + 97 * (b // len(texts)))
            prompts.append(ids)
        prompts = np.stack(prompts)
        row: dict[str, Any] = {"batch": batch, "context": ctx, "new_tokens": new}
        outs, exact = {}, {}  # method: its last run's result; verify width: AR-INT8's tokens at that width

        def measure() -> None:  # the generation functions refuse what does not fit (DoesNotFitError)
            runs = {"ar_bf16": lambda tm: generate_autoregressive(model, prompts, ar["bf16"], timings=tm,
                                                                  time_prefill=True),
                    "ar_int8": lambda tm: generate_autoregressive(model, prompts, ar["int8"], timings=tm,
                                                                  time_prefill=True),
                    **{f"spec_g{g}": (lambda tm, g=g: generate(model, prompts, spec[g], timings=tm, time_prefill=True))
                       for g in spec}}
            trials: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
            # Trials round-robin over the methods (the first compiles each program): a drift of the
            # machine during the part (clocks, other tenants) falls on every method alike.
            for t in range(args.trials):
                for name, fn in runs.items():
                    if t == 0:
                        log(f"smollm batch {batch}: {name}")
                    tm: dict[str, float] = {}
                    outs[name] = fn(tm)
                    trials[name].append(tm)
            for name, ts in trials.items():
                # Tokens are counted once (SPEC §7); the first of each row is the prefill's, so
                # decoding alone made sum(lengths) - batch of them in run_s - prefill_s.
                tokens = float(np.sum(np.asarray(outs[name].lengths)))
                row[f"{name}_tok_s"] = tokens / statistics.median(t["run_s"] for t in ts)
                decode_s = statistics.median(t["run_s"] - t["prefill_s"] for t in ts)
                # At a handful of tokens (CPU smoke runs) the prefill timed alone can outlast the run's
                # decoding: no rate then (nan, "–" in the report), never a negative one.
                if decode_s > 0:
                    row[f"{name}_decode_tok_s"] = (tokens - batch) / decode_s
                else:
                    row[f"{name}_decode_tok_s"] = math.nan
                    log(f"smollm batch {batch}: {name}: decoding not measurable (run less prefill "
                        f"{decode_s:.4f} s); decode tok/s left out")
                row[f"{name}_prefill_s"] = statistics.median(t["prefill_s"] for t in ts)
                row[f"{name}_compile_s"] = ts[0]["compile_s"]  # later trials reuse the program
            exact.update({w: np.asarray(generate_autoregressive(model, prompts, c).tokens)  # untimed
                          for w, c in exact_ar.items()})

        error = options.run_case(measure)
        if error is not None:
            row["error"] = error
            log(f"smollm batch {batch}: {error}")
            rows.append(row)
            continue
        # each gamma (SPEC §7 metrics), then the fastest as QuantSpec's row: the issues' "best gamma"
        row["by_gamma"] = [{"gamma": g, "tok_s": row.pop(f"spec_g{g}_tok_s"),
                            "decode_tok_s": row.pop(f"spec_g{g}_decode_tok_s"),
                            "prefill_s": row.pop(f"spec_g{g}_prefill_s"),
                            "compile_s": row.pop(f"spec_g{g}_compile_s"),
                            "acceptance_rate": outs[f"spec_g{g}"].acceptance_rate,
                            "tokens_per_round": outs[f"spec_g{g}"].tokens_per_round,
                            "verify_width": spec[g].verify_width,
                            "match_ar_int8": float(np.mean(np.asarray(outs[f"spec_g{g}"].tokens)
                                                           == exact[spec[g].verify_width]))}
                           for g in args.smollm_gamma]
        timed = [r for r in row["by_gamma"] if not math.isnan(r["decode_tok_s"])]
        best = (max(timed, key=lambda r: r["decode_tok_s"]) if timed  # else end to end
                else max(row["by_gamma"], key=lambda r: r["tok_s"]))
        row["gamma"], row["spec_tok_s"], row["spec_compile_s"] = best["gamma"], best["tok_s"], best["compile_s"]
        row["spec_decode_tok_s"], row["spec_prefill_s"] = best["decode_tok_s"], best["prefill_s"]
        row["acceptance_rate"], row["tokens_per_round"] = best["acceptance_rate"], best["tokens_per_round"]
        row["match_ar_int8"] = min(r["match_ar_int8"] for r in row["by_gamma"])  # every gamma's tokens
        for ar_name in ("ar_bf16", "ar_int8"):  # decoding alone (the issues' measure), then end to end
            row[f"decode_speedup_vs_{ar_name}"] = row["spec_decode_tok_s"] / row[f"{ar_name}_decode_tok_s"]
            row[f"speedup_vs_{ar_name}"] = row["spec_tok_s"] / row[f"{ar_name}_tok_s"]
        log(json.dumps(row))
        rows.append(row)
    return {"model": str(args.smollm_checkpoint), "gamma": list(args.smollm_gamma), "ar_width": 1, "rows": rows}


# ------------------------------------------------------------------------------ part: batch
def batch_lengths(batch: int, context: int) -> np.ndarray:
    """Rows of different prompt lengths, evenly from context/2 to context (BASS's setting)."""
    return np.linspace(context // 2, context, batch).astype(np.int32)


def part_batch(args: argparse.Namespace) -> dict[str, Any]:
    """AR-bf16 (width 1, dense cache) and QuantSpec (forced per-row acceptance, INT8 cache)
    generation loops of the 8B shape at batch `--batch-size`, rows of different lengths. Tokens/s
    counts every row's emitted tokens once (SPEC §7). A loop whose cache does not fit the device
    (the planner's estimate, or XLA out of memory) is recorded in its row's "error" and the
    next one runs."""
    cfg = bench_config(args)
    key = jax.random.PRNGKey(0)
    b = args.batch_size
    params = jax.jit(lambda k: M.init_random_params(cfg, k))(key)
    dcfg = DraftWeightsConfig(group_size=args.draft_group, method="clip")  # random weights: the format, data-free
    draft = jax.block_until_ready(M.for_device(make_draft_params(params, dcfg)))
    params = jax.block_until_ready(M.for_device(params))
    weights = tree_bytes(params) + tree_bytes(draft)
    first = jnp.full((b,), 7, jnp.int32)
    gen = GenerationConfig(max_new_tokens=args.loop_tokens, kv="bf16", width=1)
    ar = jax.jit(functools.partial(autoregressive_loop, gen=gen, eos_ids=()))
    rows = []
    for c in args.batch_contexts:
        lengths = batch_lengths(b, c)
        row: dict[str, Any] = {"batch": b, "context": c, "lengths": lengths.tolist()}

        def measure_ar() -> None:
            dense = synthetic.random_dense_cache(cfg, b, c, jax.random.fold_in(key, c), extra_slots=EXTRA_SLOTS,
                                                 lengths=lengths)
            res = ar(params, dense, first, key)
            row["ar_bf16_tok_s"] = float(np.sum(np.asarray(res.lengths))) / median_seconds(
                functools.partial(ar, params, dense, first, key), args.trials)

        def measure_spec() -> None:
            quant = synthetic.random_quant_cache(cfg, b, c, jax.random.fold_in(key, c + 1), extra_slots=EXTRA_SLOTS,
                                                 lengths=lengths)
            for a in args.alphas:
                spec = loop_spec(args.loop_gamma, max_new_tokens=args.loop_tokens, forced_acceptance=a,
                                 eos_token_ids=())
                sp = jax.jit(functools.partial(speculative_loop, spec=spec, eos_ids=()))
                res = sp(params, draft, quant, first, key)
                secs = median_seconds(functools.partial(sp, params, draft, quant, first, key), args.trials)
                row[f"spec_a{a}_tok_s"] = float(np.sum(np.asarray(res.lengths))) / secs
                row[f"spec_a{a}_tokens_per_round"] = res.tokens_per_round
                if "ar_bf16_tok_s" in row:
                    row[f"spec_a{a}_vs_ar"] = row[f"spec_a{a}_tok_s"] / row["ar_bf16_tok_s"]

        slots = c + EXTRA_SLOTS
        spec = loop_spec(args.loop_gamma, max_new_tokens=args.loop_tokens)
        quant_slots = -(-slots // spec.group_size) * spec.group_size
        errors = [options.run_case(measure_ar, cfg, Request(b, c, args.loop_tokens, kv="bf16", width=1, prefill=False,
                                                            cache_slots=slots), weights),
                  options.run_case(measure_spec, cfg, dataclasses.replace(spec.memory_request(b, c), prefill=False,
                                                                          cache_slots=quant_slots), weights)]
        if any(errors):
            row["error"] = " | ".join(e for e in errors if e)
        log(json.dumps(row))
        rows.append(row)
    return {"gamma": args.loop_gamma, "tokens": args.loop_tokens, "alphas": list(args.alphas), "rows": rows}


# ----------------------------------------------------------------------------- part: memory
def part_memory(args: argparse.Namespace) -> dict[str, Any]:
    cfg = bench_config(args)
    dcfg = DraftWeightsConfig(group_size=args.draft_group, method="clip")  # random weights: the format, data-free
    dev = jax.devices()[0]
    device_bytes = device_memory_bytes(dev)
    key = jax.random.PRNGKey(0)
    params = jax.eval_shape(lambda k: M.init_random_params(cfg, k), key)
    draft = jax.eval_shape(lambda p: make_draft_params(p, dcfg), params)
    programs: dict[Any, tuple[Any, tuple, dict]] = {}
    first = jax.ShapeDtypeStruct((1,), jnp.int32)
    for context in args.memory_contexts:
        dense = jax.eval_shape(lambda k: random_dense_cache(cfg, 1, context, k), key)
        quant = jax.eval_shape(lambda k: random_quant_cache(cfg, 1, context, k), key)
        for kind, cache in (("ar_bf16", dense), ("ar_int8", quant)):
            gen = GenerationConfig(max_new_tokens=64, kv=kind[3:], width=1)
            fn = jax.jit(functools.partial(autoregressive_loop, gen=gen, eos_ids=()))
            programs[(context, kind)] = (fn, (params, cache, first, key), {})
        fn = jax.jit(functools.partial(speculative_loop, spec=loop_spec(4, max_new_tokens=64), eos_ids=()))
        programs[(context, "spec")] = (fn, (params, draft, quant, first, key), {})
    rows = []
    for (context, kind), exe in compile_all(programs, args.compile_workers).items():
        if isinstance(exe, str):
            rows.append({"context": context, "kind": kind, "error": exe})
            continue
        ma = exe.memory_analysis()
        rows.append({"context": context, "kind": kind, "peak_bytes": peak_bytes(ma),
                     "arguments": int(ma.argument_size_in_bytes), "temp": int(ma.temp_size_in_bytes)})
        log(json.dumps(rows[-1]))
    plan = {"device_bytes": device_bytes,
            "ar_bf16": max_context(cfg, "bf16", device_bytes),
            "quantspec": max_context(cfg, "int8", device_bytes, draft=dcfg)}
    plan["ratio"] = plan["quantspec"]["context"] / max(1, plan["ar_bf16"]["context"])
    log(json.dumps(plan))
    confirm = {}
    if args.confirm_max_context:
        real = jax.jit(lambda k: M.init_random_params(cfg, k))(key)
        for kind in ("ar_bf16", "quantspec"):
            context = plan[kind]["context"]
            log(f"confirming {kind} at context {context}")
            try:
                if kind == "ar_bf16":
                    cache = random_dense_cache(cfg, 1, context, key)
                    t, cache = time_steps(real, cache, 1, "target", 2, 1)
                else:
                    d = make_draft_params(real, dcfg)
                    cache = random_quant_cache(cfg, 1, context, key)
                    t, cache = time_steps(d, cache, 1, "draft", 2, 1)
                    t2, cache = time_steps(real, cache, 5, "target", 2, 1)
                    del d
                stats = dev.memory_stats() or {}
                confirm[kind] = {"context": context, "ok": True, "step_ms": t * 1e3,
                                 "peak_bytes_in_use": int(stats.get("peak_bytes_in_use", -1))}
                del cache
            except Exception as e:  # noqa: BLE001 - an OOM here is the measurement
                confirm[kind] = {"context": context, "ok": False, "error": options.case_error(e)}
            log(json.dumps(confirm[kind]))
    return {"rows": rows, "plan": plan, "confirm": confirm}


# --------------------------------------------------------------------------------- part: tp
def part_tp(args: argparse.Namespace) -> dict[str, Any]:
    """AR-bf16 and QuantSpec (forced acceptance) tokens/s of the 8B shape on 1 vs N devices; on N
    devices also the per-layer all-reduce alone (`collectives`), at one row and at the verify
    width, and each row's bytes per device of an AR step, for the TP step floor."""
    from jax.sharding import NamedSharding

    from qspec_jax.bench.collectives import allreduce_latency
    from qspec_jax.sharding import make_mesh, shard_params
    from qspec_jax.spmd import cache_specs

    cfg = bench_config(args)
    key = jax.random.PRNGKey(0)
    dcfg = DraftWeightsConfig(group_size=args.draft_group, method="clip")  # random weights: the format, data-free
    first = jnp.array([7], jnp.int32)
    rows, collectives = [], []
    for n in args.tp_sizes:
        mesh = make_mesh(n) if n > 1 else None
        if mesh is not None:  # rows: one token (AR, draft) and the verify width
            for r in sorted({1, loop_spec(args.loop_gamma).verify_width}):
                collectives.append(allreduce_latency(mesh, r, cfg.hidden_size, args.trials))
                log(json.dumps(collectives[-1]))
        params = jax.jit(lambda k: M.init_random_params(cfg, k))(key)
        draft = make_draft_params(params, dcfg)
        if mesh is not None:
            params, draft = shard_params(params, mesh, dcfg.group_size), shard_params(draft, mesh, dcfg.group_size)
        place = (lambda c: c) if mesh is None else (  # noqa: E731
            lambda c: jax.device_put(c, jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(c))))
        for c in args.tp_contexts:
            row: dict[str, Any] = {"devices": n, "context": c}
            try:
                cache = place(random_dense_cache(cfg, 1, c, key))
                # weights (an embedding row is negligible unless the lm_head is tied to it) and the bf16
                # KV at the context, split n ways
                unread = tree_bytes(params.embed) if params.lm_head is not None else 0
                row["ar_bf16_bytes_per_device"] = step_bytes(cfg, tree_bytes(params) - unread, c, 1, "bf16") / n
                gen = GenerationConfig(max_new_tokens=args.loop_tokens, kv="bf16", width=1)
                ar = jax.jit(functools.partial(autoregressive_loop, gen=gen, eos_ids=())).lower(
                    params, cache, first, key).compile()
                jax.block_until_ready(ar(params, cache, first, key))
                row["ar_bf16_tok_s"] = args.loop_tokens / median_seconds(
                    functools.partial(ar, params, cache, first, key), args.trials)
                row["ar_bf16_peak_bytes_per_device"] = peak_bytes(ar.memory_analysis())
                del cache, ar
                cache = place(random_quant_cache(cfg, 1, c, key))
                spec = loop_spec(args.loop_gamma, max_new_tokens=args.loop_tokens,
                                 forced_acceptance=args.alphas[0], eos_token_ids=())
                sp = jax.jit(functools.partial(speculative_loop, spec=spec, eos_ids=())).lower(
                    params, draft, cache, first, key).compile()
                jax.block_until_ready(sp(params, draft, cache, first, key))
                row["spec_tok_s"] = args.loop_tokens / median_seconds(
                    functools.partial(sp, params, draft, cache, first, key), args.trials)
                row["spec_peak_bytes_per_device"] = peak_bytes(sp.memory_analysis())
                del cache, sp
            except Exception as e:  # noqa: BLE001 - e.g. 256k on one device may not fit: that is a result
                row["error"] = options.case_error(e)
            log(json.dumps(row))
            rows.append(row)
        del params, draft
    for r in rows:  # scaling efficiency: tokens/s on N devices / (N x tokens/s on one)
        base = next((b for b in rows if b["devices"] == 1 and b["context"] == r["context"]), None)
        for k in ("ar_bf16_tok_s", "spec_tok_s"):
            if base and k in base and k in r:
                r[k.replace("tok_s", "scaling_eff")] = r[k] / (r["devices"] * base[k])
    return {"alpha": args.alphas[0], "gamma": args.loop_gamma, "tokens": args.loop_tokens, "layers": cfg.num_layers,
            "rows": rows, "collectives": collectives}


# ------------------------------------------------------------------------------------ main
def torch_peer(contexts: Sequence[int], group: int, out: Path, shape: str = "llama3-8b",
               batches: Sequence[int] = (1,)) -> dict[str, Any]:
    """The PyTorch CUDA-graph decode step (`torch_decode`) at each context and batch, bf16 and int4
    tinygemm weights, in a child process started before this one touches the GPU (both
    frameworks take most of its memory). Records of a machine without torch say "skipped"."""
    import subprocess

    path = out / ("torch_decode.json" if shape == "llama3-8b" else f"torch_decode_{shape}.json")
    cmd = [sys.executable, "-m", "qspec_jax.bench.torch_decode", "--contexts", ",".join(map(str, contexts)),
           "--group", str(group), "--shape", shape, "--batches", ",".join(map(str, batches)), "--out", str(path)]
    log(f"PyTorch CUDA-graph decode peer: {' '.join(cmd[1:])}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not path.exists():
        return {"error": f"exit {r.returncode}: {r.stderr.strip()[-600:]}"}
    records = json.loads(path.read_text())
    for rec in records:
        log(json.dumps(rec))
    return {"group": group, "records": records}


PROG = "qspec-bench e2e"
# The int4 group of part smollm's PyTorch peer: the draft's own (DraftWeightsConfig's 32), which divides SmolLM2's
# K (576, 1536; tinygemm's 128 does not divide 576)
SMOLLM_TORCH_GROUP = 32
PARTS = ("8b", "batch", "smollm", "memory", "prefill", "tp")


def build_parser() -> argparse.ArgumentParser:
    from qspec_jax.cli import HelpFormatter, Parser, comma_choices, comma_list
    from qspec_jax.config import ATTENTION_IMPLS

    ints, floats = comma_list(int), comma_list(float, "numbers")
    p = Parser(prog=PROG, description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--parts", type=comma_choices(PARTS), default="8b,batch,smollm,memory",
                   help=f"comma-separated parts to run, any of {','.join(PARTS)}")
    options.add_output_args(p, "e2e", "BENCHMARKS.md")
    p.add_argument("--contexts", type=ints, default=",".join(map(str, CONTEXTS)),
                   help="part 8b: contexts of the per-phase step times")
    p.add_argument("--loop-contexts", type=ints, default="32768,131072",
                   help="contexts at which the forced-acceptance loop is also run")
    p.add_argument("--gammas", type=ints, default=",".join(map(str, GAMMAS)),
                   help="part 8b: draft lengths of the verify timings")
    p.add_argument("--loop-gamma", type=int, default=4, help="gamma of the measured forced-acceptance loop")
    p.add_argument("--loop-tokens", type=int, default=128, help="tokens generated by each measured loop")
    p.add_argument("--compile-workers", type=int, default=8, help="programs compiled in parallel (threads)")
    p.add_argument("--alphas", type=floats, default="0.9",
                   help="acceptance rates in (0, 1] for the projection (add the SmolLM2-measured one)")
    p.add_argument("--draft-group", type=int, default=DraftWeightsConfig.group_size,
                   help="INT4 draft weights: input rows per quantization group (--quick: 64)")
    p.add_argument("--attention-impl", choices=ATTENTION_IMPLS, default="auto",
                   help="decode attention implementation (see ModelConfig)")
    p.add_argument("--dense-mosaic", action="store_true",
                   help="part 8b: also time the AR-bf16 step with the target's linears on the Mosaic GPU kernel")
    p.add_argument("--steps", type=int, default=16, help="decode passes per timed call")
    p.add_argument("--trials", type=int, default=5, help="timed trials per measurement (the median is reported)")
    options.add_checkpoint_arg(p, "--smollm-checkpoint", "part smollm: ")
    options.add_text_dir_arg(p, "part smollm: the prompts are cut from this ")
    p.add_argument("--smollm-context", type=int, default=8000, help="part smollm: prompt tokens")
    p.add_argument("--smollm-new-tokens", type=int, default=128, help="part smollm: generated tokens")
    p.add_argument("--smollm-batches", type=ints, default="1,8,32", help="part smollm: batch sizes")
    p.add_argument("--smollm-gamma", type=ints, default="4",
                   help="part smollm: draft tokens per round; several (e.g. 2,3,4): each is timed and the fastest "
                        "is QuantSpec's row (best gamma)")
    p.add_argument("--memory-contexts", type=ints, default="32768,131072",
                   help="part memory: contexts whose peak memory is measured")
    p.add_argument("--confirm-max-context", action="store_true",
                   help="part memory: also run the planner's longest context to confirm it fits")
    p.add_argument("--batch-size", type=int, default=8, help="part batch: rows (prompt lengths context/2..context)")
    p.add_argument("--batch-contexts", type=ints, default="4096,32768", help="part batch: contexts")
    p.add_argument("--prefill-contexts", type=ints, default="8192,32768,131072", help="part prefill: prompt lengths")
    p.add_argument("--prefill-chunks", type=ints, default="8192",
                   help="part prefill: chunk sizes of the chunked prefills timed (multiples of 128)")
    p.add_argument("--request-context", type=int, default=131072, help="part prefill: the request's prompt tokens")
    p.add_argument("--request-new-tokens", type=int, default=256, help="part prefill: the request's new tokens")
    p.add_argument("--request-alpha", type=float, default=0.9, help="part prefill: the request's forced acceptance")
    p.add_argument("--request-gamma", type=int, default=4, help="part prefill: the request's draft tokens per round")
    p.add_argument("--prefill-smollm-batch", type=int, default=32,
                   help="part prefill: prompts of the SmolLM2-shaped batch prefill (0 skips it)")
    p.add_argument("--prefill-smollm-context", type=int, default=8000,
                   help="part prefill: tokens of each prompt of the SmolLM2-shaped batch")
    p.add_argument("--prefill-max-context", action="store_true",
                   help="part prefill: also prefill and decode the planner's longest QuantSpec context (minutes)")
    p.add_argument("--tp-sizes", type=ints, default="1,2", help="part tp: device counts compared")
    p.add_argument("--tp-contexts", type=ints, default="131072,262144", help="part tp: contexts")
    p.add_argument("--torch-group", type=int, default=128, choices=(0, 32, 64, 128, 256),
                   help="part 8b: int4 group of the PyTorch (tinygemm) CUDA-graph decode peer; 0 skips the peers "
                        "(part smollm's too, whose group is 32: SmolLM2's K 576 takes no larger)")
    p.add_argument("--keep-parts", action="store_true",
                   help="keep the parts an earlier run recorded in OUT/e2e.json that this run does not measure (each "
                        "with the command and date that measured it), so that the report covers them all: `make "
                        "bench` runs the parts one device call at a time this way")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, except those given (CPU smoke test of the harness); writes no report")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Every argument, before anything is measured: one line and exit status 2."""
    from qspec_jax.cache import DEFAULT_GAMMA_MAX
    from qspec_jax.cli import fail, require
    from qspec_jax.weight_quant import WEIGHT_GROUPS

    options.positive(PROG, args, "--contexts", "--loop-contexts", "--gammas", "--loop-tokens", "--compile-workers",
                     "--steps", "--trials", "--smollm-context", "--smollm-new-tokens", "--smollm-batches",
                     "--memory-contexts", "--tp-sizes", "--tp-contexts", "--batch-size", "--batch-contexts",
                     "--prefill-contexts", "--prefill-chunks", "--request-context", "--request-new-tokens",
                     "--prefill-smollm-context")
    require(PROG, args.prefill_smollm_batch >= 0, "--prefill-smollm-batch", args.prefill_smollm_batch, ">= 0")
    bad = [c for c in args.prefill_chunks if c % 128]
    require(PROG, not bad, "--prefill-chunks", ",".join(map(str, bad)), "multiples of 128 (the cache's group size)")
    require(PROG, 0 < args.request_alpha <= 1, "--request-alpha", args.request_alpha, "in (0, 1]")
    for flag in ("--gammas", "--loop-gamma", "--smollm-gamma", "--request-gamma"):
        value = getattr(args, flag[2:].replace("-", "_"))
        bad = [g for g in (value if isinstance(value, tuple) else (value,)) if not 1 <= g <= DEFAULT_GAMMA_MAX]
        require(PROG, not bad, flag, ",".join(map(str, bad)), f"in 1..{DEFAULT_GAMMA_MAX} (gamma_max)")
    require(PROG, len(set(args.smollm_gamma)) == len(args.smollm_gamma), "--smollm-gamma",
            ",".join(map(str, args.smollm_gamma)), "distinct values")
    bad = [a for a in args.alphas if not 0 < a <= 1]
    require(PROG, not bad, "--alphas", ",".join(map(str, bad)), "in (0, 1]")
    require(PROG, args.draft_group in WEIGHT_GROUPS, "--draft-group", args.draft_group,
            f"one of {', '.join(map(str, WEIGHT_GROUPS))}")
    if "smollm" in args.parts:
        others = ",".join(p for p in args.parts if p != "smollm")
        options.check_model_inputs(PROG, args, "--smollm-checkpoint",
                                   hint=f"; or leave part smollm out: --parts {others or '8b,memory'}")
    if "tp" in args.parts and max(args.tp_sizes) > jax.device_count():
        fail(PROG, f"--tp-sizes {max(args.tp_sizes)}: only {jax.device_count()} {jax.default_backend()} device(s) "
                   "here; the tp part needs that many GPUs")


def main(argv: Sequence[str] | None = None) -> int:
    return options.run_bench(PROG, _main, argv)


GPU_PARTS = ("8b", "batch", "prefill", "tp")  # they build the 8B shape's weights and caches (memory too, to confirm)


def kept_parts(path: Path, measured: Sequence[str]) -> dict[str, Any]:
    """The parts recorded in an earlier run's e2e.json at `path` that this run (`measured`) does not
    measure, each marked with `kept_from` (the command and date that measured it); {} when there
    is no such file. A file that is not an e2e.json is refused by name."""
    def pick(old: dict[str, Any]) -> dict[str, Any]:
        origin = {"command": old["command"], "date": old["environment"]["date"]}
        kept: dict[str, Any] = {}
        for part in PARTS:
            if part in old and part not in measured:
                kept[part] = {**old[part], "kept_from": old[part].get("kept_from", origin)}
        if "8b" in kept and "torch_decode" in old:  # the 8b part's PyTorch peer goes with it
            kept["torch_decode"] = old["torch_decode"]
        return kept

    return options.kept_from_earlier(path, "e2e", pick, {})


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    options.resolve_outputs(PROG, args, "e2e", "BENCHMARKS.md", quick=args.quick)
    check_args(args)  # every argument given, --quick or not
    big = [p for p in args.parts if p in GPU_PARTS or (p == "memory" and args.confirm_max_context)]
    if big:
        options.require_gpu(PROG, args.quick, f"--parts {','.join(big)} build{'s' if len(big) == 1 else ''} the 8B "
                                              "shape's weights (16 GB) and caches")
    if args.quick:  # tiny sizes, except those given
        options.quick_sizes(args, build_parser(), dict(
            contexts=(512, 1024), loop_contexts=(1024,), memory_contexts=(1024,), gammas=(2, 4), steps=2, trials=1,
            loop_tokens=16, smollm_batches=(1, 2), smollm_context=256, smollm_new_tokens=16, draft_group=64,
            tp_contexts=(1024,), batch_contexts=(512,), batch_size=2, prefill_contexts=(512,), prefill_chunks=(256,),
            request_context=512, request_new_tokens=8, prefill_smollm_batch=2, prefill_smollm_context=300))
    args.out.mkdir(parents=True, exist_ok=True)
    env = report.environment()
    log(json.dumps(env))
    results: dict[str, Any] = {"environment": env, "command": options.command_line(PROG, argv)}
    if args.keep_parts:
        from qspec_jax.cli import fail

        try:
            results.update(kept_parts(args.out / "e2e.json", args.parts))
        except ValueError as e:
            fail(PROG, str(e))
    if "8b" in args.parts and args.torch_group and not args.quick:  # before JAX allocates the GPU's memory
        results["torch_decode"] = torch_peer(args.contexts, args.torch_group, args.out)
    smollm_peer = None  # part smollm's: its shape at its batches and prompt length (random weights: speed only)
    if "smollm" in args.parts and args.torch_group and not args.quick:
        smollm_peer = torch_peer([args.smollm_context], SMOLLM_TORCH_GROUP, args.out, "smollm2", args.smollm_batches)
    prefill_peers = None
    if "prefill" in args.parts and not args.quick and jax.default_backend() == "gpu":  # before JAX allocates
        prefill_peers = prefill_torch_peers(args)
    bw = copy_bandwidth(256 << 20 if args.quick else 2 << 30, args.trials)
    results["copy_bandwidth_bytes_per_s"] = bw
    log(f"device-to-device copy: {bw / 1e12:.3f} TB/s")
    failed = []
    for part, fn in (("8b", lambda: part_8b(args, bw)), ("batch", lambda: part_batch(args)),
                     ("smollm", lambda: part_smollm(args)),
                     ("memory", lambda: part_memory(args)),
                     ("prefill", lambda: part_prefill(args, bench_config(args), prefill_peers)),
                     ("tp", lambda: part_tp(args))):
        if part not in args.parts:
            continue
        try:
            results[part] = fn()
            if part == "smollm" and smollm_peer is not None:
                results[part]["torch_decode"] = smollm_peer
        except Exception as e:  # noqa: BLE001 - record and go on with the other parts; the exit status says so
            line = options.does_not_fit(e)
            if line is None:
                traceback.print_exc()
            results[part] = {"error": line or f"{type(e).__name__}: {e}"[:2000]}
            failed.append(part)
        else:
            if "rows" in results[part] and not options.measured_any(results[part]["rows"]):
                log(f"part {part} measured nothing: every case failed")
                failed.append(part)
        with options.writing(PROG, "--out", args.out, "e2e.json"):
            (args.out / "e2e.json").write_text(json.dumps(results, indent=1))
    with options.writing(PROG, "--doc", args.doc, "its e2e section") if args.doc else contextlib.nullcontext():
        report.write_e2e(results, args.out, args.doc)
    log(f"wrote {args.out / 'e2e.json'}" + (f"; rewrote the e2e/tp sections of {args.doc}" if args.doc else ""))
    if failed:
        log(f"{PROG}: part(s) {', '.join(failed)} failed (tracebacks and errors above)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
