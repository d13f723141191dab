"""qspec-bench profile: where a decode step's time goes, kernel by kernel, on the GPU.

Runs the project's own step programs (AR-bf16 over a dense cache, the draft step over the INT4
view, the verify pass over the INT8 view at the verify width) and real generation loops (AR and
speculative at forced acceptance) under `jax.profiler`, reads the GPU kernel events of the trace
and reports per step (per token for the loops):

    wall         median time of the program per step (timed apart from the trace)
    kernels      GPU kernel time summed, and the number of kernel launches
    categories   linear (each INT4 / bf16 Mosaic shape, cuBLAS), attention, glue (every other
                 XLA fusion), copies; each against its byte floor at the read ceiling
    traced idle  the stretches of the traced call with no kernel running, by the boundary they
                 sit at (the kernel that ended before -> the one that starts after)

The wall is timed with XLA's command buffers (CUDA graphs) as the program runs; the trace, by
default, is of the program launched op by op (XLA turns its command buffers off under the
profiler), so a kernel's traced duration is its own, "gaps" (wall - kernels) estimates the timed
run's idle (a lower bound where the graph runs independent kernels side by side), and the traced
idle is the op-by-op launch's. `--graphs-in-trace` keeps the command
buffers while tracing (`--xla_enable_command_buffers_during_profiling`): the traced idle and
kernel times are then the graphs' own, which tells a kernel that runs slower inside a graph from
a wait between kernels.

The byte floor of a category is the fewest bytes it must read over the device's read ceiling
(`timing.read_ceiling_bps`: the H200's measured 4.35 TB/s, the H100's datasheet 3.35 TB/s): the
weights of each linear (INT4 codes + f16 scale/zero per group, from the Mosaic kernel's name),
the cache bytes of the attention's view, none for glue (activations are a few KB per layer).

Caches hold random data at the target context (synthetic.py); weights are random with the
Llama-3.1-8B shape, or SmolLM2-135M's (`--shape smollm2`), at `--batch` rows (`--quick`: tiny sizes,
runs on a CPU where the trace has no GPU kernels).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.linear.layout import packed_bytes
from qspec_jax import model as M
from qspec_jax.bench import e2e, options, report
from qspec_jax.bench.kernel import dense_bytes, quant_bytes
from qspec_jax.bench.prefill import SMOLLM2
from qspec_jax.bench.timing import read_ceiling_bps
from qspec_jax.cache import DEFAULT_GAMMA_MAX, QuantSpecCache
from qspec_jax.config import DENSE_MATMUL_IMPLS
from qspec_jax.generation import GenerationConfig, autoregressive_loop
from qspec_jax.planner import tree_bytes
from qspec_jax.speculative import speculative_loop
from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

PROGRAMS = ("ar_bf16", "draft", "verify", "ar_loop", "spec_loop")
GRAPHS_IN_TRACE_FLAG = "--xla_enable_command_buffers_during_profiling=true"
SHAPES = {"llama3-8b": (e2e.LLAMA31_8B, "Llama-3.1-8B shape"), "smollm2": (SMOLLM2, "SmolLM2-135M shape")}
CATEGORIES = ("linear", "attention", "glue", "copy")
_MOSAIC_LINEAR = re.compile(r"(int4|bf16)_(mma|wgmma|smem)_skinny_k(\d+)_n(\d+)_g(\w+?)_s(\d+)")
_MOSAIC_TAIL = re.compile(r"int4_layer_tail_kq(\d+)_d(\d+)_f(\d+)_g(\d+)")  # o + gate_up + down in one kernel
_CUBLAS = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas", re.I)
_ATTENTION = re.compile(r"quantspec_(draft|target)_mgpu|decode_attention|dense_decode|quantized_decode|attn", re.I)
_COPY = re.compile(r"^(memcpy|memset)|^copy[._-]|^Memcpy|^Memset", re.I)


def log(msg: str) -> None:
    print(f"[profile {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------- the trace
def kernel_events(trace_dir: Path) -> list[dict[str, Any]]:
    """GPU kernel events {name, dur_us, ts_us} of the newest trace under `trace_dir` (the Perfetto JSON
    that `jax.profiler.trace(..., create_perfetto_trace=True)` writes); [] when it has none (a
    CPU run)."""
    files = sorted(trace_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        return []
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    return gpu_events(data["traceEvents"] if isinstance(data, dict) else data)


def gpu_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The complete ("X") events of GPU processes (their process_name names a GPU)."""
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    return [{"name": e["name"], "dur_us": float(e["dur"]), "ts_us": float(e.get("ts", 0.0))} for e in events
            if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]


def idle_boundaries(events: list[dict[str, Any]], per: int, top: int = 4) -> dict[str, Any]:
    """The idle of a traced call of `per` steps, per step: its kernels on one timeline (any stream),
    from the first kernel's start to the last one's end (`span_us`), the stretches with no kernel
    running (`idle_us`), and the `top` boundaries that hold the most of it: (label of the kernel
    that ended last before the stretch, label of the kernel that starts after it, us per step,
    stretches per step). Labels as `classify` gives them."""
    ev = sorted(events, key=lambda e: e["ts_us"])
    if not ev:
        return {"span_us": 0.0, "idle_us": 0.0, "boundaries": []}
    by_pair: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    last, end, idle = ev[0], ev[0]["ts_us"] + ev[0]["dur_us"], 0.0
    for e in ev[1:]:
        gap = e["ts_us"] - end
        if gap > 0:
            a = by_pair[(classify(last["name"])[1], classify(e["name"])[1])]
            a[0] += gap
            a[1] += 1
            idle += gap
        if e["ts_us"] + e["dur_us"] >= end:
            last, end = e, e["ts_us"] + e["dur_us"]
    pairs = sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]
    return {"span_us": (end - ev[0]["ts_us"]) / per, "idle_us": idle / per,
            "boundaries": [{"before": b, "after": a, "us": v[0] / per, "count": v[1] / per}
                           for (b, a), v in pairs]}


def classify(name: str) -> tuple[str, str, int | None]:
    """(category, label, floor bytes or None) of a kernel name. Mosaic linears carry their shape
    in the name, so each gets its own label and byte floor; cuBLAS kernels share one label."""
    m = _MOSAIC_LINEAR.search(name)
    if m:
        kind, _, k, n, g, _ = m.groups()
        k, n = int(k), int(n)
        nbytes = 2 * k * n if kind == "bf16" else packed_bytes(k, n, int(g))
        return "linear", f"{kind} k{k} n{n}" + (f" g{g}" if kind == "int4" else ""), nbytes
    m = _MOSAIC_TAIL.search(name)
    if m:  # the persistent layer tail (pallas_kernels.linear.tail_mgpu): o [Kq, D], gate_up [D, 2F], down [F, D]
        kq, d, f, g = (int(v) for v in m.groups())
        return "linear", f"int4 layer tail kq{kq} d{d} f{f} g{g}", sum(
            packed_bytes(k, n, g) for k, n in ((kq, d), (d, 2 * f), (f, d)))
    if _CUBLAS.search(name):
        return "linear", "cuBLAS", None
    if _ATTENTION.search(name):
        return "attention", name, None
    if _COPY.search(name):
        return "copy", name, None
    return "glue", name, None


def summarize(events: list[dict[str, Any]], per: int, ceiling: float | None = None) -> dict[str, Any]:
    """Per-step totals of `events` (a trace of `per` steps): busy time, launches, time by
    category and by label, each label's launches per step and (Mosaic linears) byte floor at
    `ceiling` bytes/s (default: this device's `read_ceiling_bps`)."""
    ceiling = ceiling or read_ceiling_bps()
    by_label: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0, 0])
    for e in events:
        cat, label, nbytes = classify(e["name"])
        a = by_label[(cat, label)]
        a[0] += e["dur_us"]
        a[1] += 1
        a[2] = nbytes or 0
    labels = [{"category": cat, "label": label, "us": a[0] / per, "launches": a[1] / per,
               "floor_us": a[2] * (a[1] / per) / ceiling * 1e6 if a[2] else None}
              for (cat, label), a in by_label.items()]
    labels.sort(key=lambda r: -r["us"])
    cats = {c: {"us": sum(r["us"] for r in labels if r["category"] == c),
                "launches": sum(r["launches"] for r in labels if r["category"] == c)} for c in CATEGORIES}
    return {"busy_us": sum(e["dur_us"] for e in events) / per, "launches": len(events) / per,
            "categories": cats, "labels": labels}


# ------------------------------------------------------------------------------ the floors
def linear_floor_bytes(params: M.Params) -> int:
    """Bytes a step's linears must read: every layer weight and the lm_head (tied: embed)."""
    ws = [getattr(params.layers, n) for n in (*M.LINEAR_NAMES, *M.FUSED)]
    head = params.lm_head if params.lm_head is not None else params.embed
    return tree_bytes([w for w in ws if w is not None]) + tree_bytes(head)


def attention_floor_bytes(cfg: Any, cache: Any, t: int, view: str) -> int:
    """Bytes all layers' attention must move over the cache's rows, each at its own length
    (kernel.py's per-call counts)."""
    if hasattr(cache, "k_hi"):
        per_layer = quant_bytes(cache, t, cfg.num_heads, view == "target")
    else:
        b = cache.k.shape[1]
        mean_len = float(np.sum(np.asarray(cache.lengths))) / b  # dense_bytes counts b rows of one length
        per_layer = dense_bytes(b, cfg.num_kv_heads, mean_len, cfg.head_dim, t, cfg.num_heads)
    return cfg.num_layers * per_layer


# --------------------------------------------------------------------------- the programs
def _profile(call: Any, trace_dir: Path, per: int, trials: int) -> dict[str, Any]:
    """Wall per step (median of `trials` timed calls) and the trace summary of one more call.
    (For the fusions' contents, run with XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text".)"""
    jax.block_until_ready(call())  # compile + warm-up
    wall = e2e.median_seconds(call, trials) / per
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        jax.block_until_ready(call())
    events = kernel_events(trace_dir)
    out = summarize(events, per)
    out["traced"] = idle_boundaries(events, per)
    out["graphs_in_trace"] = GRAPHS_IN_TRACE_FLAG in os.environ.get("XLA_FLAGS", "").split()
    out["wall_us"] = wall * 1e6
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg, name = SHAPES[args.shape]
    if args.dense_matmul is not None:
        cfg = cfg.replace(dense_matmul_impl=args.dense_matmul)
    if args.quick:  # tiny sizes of the shape (the head layout kept)
        cfg, name = (e2e.QUICK if args.shape == "llama3-8b" else
                     cfg.replace(vocab_size=512, num_layers=2, intermediate_size=512)), f"tiny {name} (--quick)"
    key = jax.random.PRNGKey(0)
    dcfg = DraftWeightsConfig(group_size=args.draft_group, method="clip")  # random weights: the format, data-free
    params = jax.jit(lambda k: M.init_random_params(cfg, k))(key)
    draft = jax.block_until_ready(M.for_device(make_draft_params(params, dcfg)))
    params = jax.block_until_ready(M.for_device(params))
    floors = {"target": linear_floor_bytes(params), "draft": linear_floor_bytes(draft)}
    trace_root = args.out / "traces"
    results: list[dict[str, Any]] = []
    for c in args.contexts:
        error = options.run_case(lambda c=c: profile_context(args, cfg, c, params, draft, floors, trace_root, results))
        if error is not None:  # a context whose caches do not fit this device: recorded, and the next one runs
            log(f"context {c}: {error}")
            results.append({"context": c, "error": error})
    return {"config": name, "batch": args.batch, "dense_matmul": cfg.dense_matmul_impl,
            "draft": dcfg.to_dict(), "gamma": args.gamma, "alpha": args.alpha, "verify_t": args.verify_t,
            "read_ceiling_bytes_per_s": read_ceiling_bps(), "rows": results}


def profile_context(args: argparse.Namespace, cfg: Any, c: int, params: M.Params, draft: M.Params,
                    floors: dict[str, int], trace_root: Path, results: list[dict[str, Any]]) -> None:
    """Appends to `results` one row per program of `args.programs` at context `c`, as each is
    measured. A program that does not fit this device gets a row with its "error" and the next one
    runs (the loops need memory the step programs do not: batch 8 at 32k on the H200 measured the
    three steps, then the AR loop ran out of memory); caches that do not fit raise (the caller
    records the whole context)."""
    key = jax.random.PRNGKey(0)
    B = args.batch
    first = jnp.full((B,), 7, jnp.int32)
    ceiling = read_ceiling_bps()  # bytes/s, this device's

    def measured(name: str, measure: Any) -> None:
        error = options.run_case(measure)
        if error is not None:
            log(f"{name} at context {c}: {error}")
            results.append({"program": name, "context": c, "error": error})

    lengths = e2e.batch_lengths(B, c) if args.ragged else None  # int32[B] in [c/2, c], or every row at c
    caches = jax.block_until_ready({  # allocated here (caches that do not fit: the whole context); donated call by call
        "dense": e2e.random_dense_cache(cfg, B, c, jax.random.fold_in(key, c), lengths),
        "quant": e2e.random_quant_cache(cfg, B, c, jax.random.fold_in(key, c + 1), lengths)})
    steps = {  # name: (params, cache kind, T, view, linear floor)
        "ar_bf16": (params, "dense", 1, "target", floors["target"]),
        "draft": (draft, "quant", 1, "draft", floors["draft"]),
        "verify": (params, "quant", args.verify_t, "target", floors["target"]),
    }
    for name, (p, ck, t, view, lin_floor) in steps.items():
        if name not in args.programs:
            continue
        toks = jnp.full((B, t), 7, jnp.int32)

        def call(p=p, toks=toks, view=view, ck=ck):
            out, caches[ck] = e2e.decode_steps(p, caches[ck], toks, n=args.steps, view=view)
            return out

        def step_row(name=name, call=call, ck=ck, t=t, view=view, lin_floor=lin_floor) -> None:
            log(f"{name} at context {c}")
            r = _profile(call, trace_root / f"{name}_{c}", args.steps, args.trials)
            r.update(program=name, context=c, t=t, unit="step",
                     floor_us={"linear": lin_floor / ceiling * 1e6,
                               "attention": attention_floor_bytes(cfg, caches[ck], t, view) / ceiling * 1e6,
                               "glue": 0.0, "copy": 0.0})
            if lengths is not None:
                r["lengths"] = lengths.tolist()
            results.append(r)
            show(r, args.top, cfg.num_layers)

        measured(name, step_row)
    loops = {  # name: () -> the loop's call
        "ar_loop": lambda: restarted(caches, "dense", lambda c, p, f, k: autoregressive_loop(
            p, c, f, k, eos_ids=(), return_cache=True,
            gen=GenerationConfig(max_new_tokens=args.loop_tokens, kv="bf16", width=1)), (params, first, key)),
        "spec_loop": lambda: restarted(caches, "quant", lambda c, p, d, f, k: speculative_loop(
            p, d, c, f, k, eos_ids=(), return_cache=True,
            spec=e2e.loop_spec(args.gamma, max_new_tokens=args.loop_tokens, forced_acceptance=args.alpha,
                               eos_token_ids=())), (params, draft, first, key)),
    }
    for name, make in loops.items():
        if name not in args.programs:
            continue

        def loop_row(name=name, make=make) -> None:
            log(f"{name} at context {c}")
            r = _profile(make(), trace_root / f"{name}_{c}", args.loop_tokens, args.trials)
            r.update(program=name, context=c, unit="token", floor_us={})
            if lengths is not None:
                r["lengths"] = lengths.tolist()
            results.append(r)
            show(r, args.top, cfg.num_layers)

        measured(name, loop_row)


def bookkeeping(cache: Any) -> dict[str, jax.Array]:
    """A cache's per-row length fields: all a generation loop moves but the contents."""
    names = ("q_len", "fp_len", "fp_start") if isinstance(cache, QuantSpecCache) else ("lengths",)
    return {n: getattr(cache, n) for n in names}


def restarted(caches: dict[str, Any], kind: str, loop: Any, operands: tuple[Any, ...] = ()) -> Any:
    """A call of `loop(cache, *operands) -> (result, cache)` that donates `caches[kind]` and puts
    the cache it returns back there with the lengths it started from, so that every call (warm-up,
    timed trials, trace) decodes from the same context. Without the donation XLA copies the cache
    into the loop's state: a second 32.5 GB dense cache at batch 8 and 32k, out of memory on the
    H200. The weights go in as `operands` (jit arguments): a loop that closed over them captured
    them as constants of the program (16 GB for the 8B; its compile outran a ten-minute call)."""
    marks = {n: np.asarray(v) for n, v in bookkeeping(caches[kind]).items()}  # host copies (the donation deletes)

    @functools.partial(jax.jit, donate_argnums=0)
    def run(cache: Any, operands: tuple[Any, ...]) -> tuple[Any, Any]:
        result, cache = loop(cache, *operands)
        return result, cache.replace(**marks)

    def call() -> Any:
        result, caches[kind] = run(caches[kind], operands)
        return result

    return call


# ---------------------------------------------------------------------------------- output
def gaps_us(r: dict[str, Any]) -> float:
    """What a step (or token) of the timed, untraced run spends outside kernels: its wall minus the trace's kernel
    time (launch gaps, host steps of loops, synchronizations). An estimate, not a measurement of idle: the trace runs
    op by op (the profiler turns XLA's command buffers off), where kernels run one at a time and at their own speed,
    while the timed run's graphs may run independent kernels side by side (a body that branches: its gaps understate
    its idle by the overlap) or a kernel slower than alone. `--graphs-in-trace` measures the graphs' own idle."""
    return r["wall_us"] - r["busy_us"]


def show(r: dict[str, Any], top: int, layers: int) -> None:
    unit = r["unit"]
    at = r["context"] if "lengths" not in r else f"{r['context']} (rows of {min(r['lengths'])}..{max(r['lengths'])})"
    if not r["launches"]:
        print(f"\n== {r['program']} at {at}: wall {r['wall_us'] / 1e3:.3f} ms/{unit}; the trace has no GPU "
              "kernel events (not a GPU run)")
        return
    print(f"\n== {r['program']} at {at}: wall {r['wall_us'] / 1e3:.3f} ms/{unit}, kernels "
          f"{r['busy_us'] / 1e3:.3f} ms in {r['launches']:.0f} launches/{unit} "
          f"({r['launches'] / layers:.1f} per layer), gaps {gaps_us(r) / 1e3:.3f} ms")
    tr = r.get("traced")
    if tr and tr["span_us"]:
        print(f"   traced   {tr['span_us'] / 1e3:8.3f} ms from the first kernel to the last, idle "
              f"{tr['idle_us'] / 1e3:.3f} ms ({'graphs kept' if r.get('graphs_in_trace') else 'op by op'})")
        for b in tr["boundaries"]:
            print(f"      idle {b['us']:8.1f} us  x{b['count']:6.1f}  {b['before'][:40]} -> {b['after'][:40]}")
    for c in CATEGORIES:
        v = r["categories"][c]
        fl = r["floor_us"].get(c)
        frac = f", floor {fl / 1e3:.3f} ms ({fl / v['us']:.0%})" if fl and v["us"] else ""
        print(f"   {c:<9} {v['us'] / 1e3:8.3f} ms  {v['launches']:6.1f} launches{frac}")
    for lab in r["labels"][:top]:
        fl = f"  floor {lab['floor_us']:.1f} us ({lab['floor_us'] / lab['us']:.0%})" if lab["floor_us"] else ""
        print(f"   {lab['us']:9.1f} us  x{lab['launches']:6.1f}  [{lab['category']}] {lab['label'][:80]}{fl}")
    sys.stdout.flush()


def markdown(results: dict[str, Any], command: str, env: dict[str, Any], top: int) -> str:
    parts = [f"## Profile: where a step's time goes\n\n{report.env_line(env, command)}\n",
             f"{results['config']}, batch {results['batch']}; kernel times from the GPU trace of one call, per step (per token for "
             f"the loops); floors at {results['read_ceiling_bytes_per_s'] / 1e12:.2f} TB/s. Draft: INT4 g{results['draft']['group_size']}; "
             f"verify at T = {results['verify_t']}; loops: AR width 1 over a bf16 cache, QuantSpec γ = "
             f"{results['gamma']} at forced α = {results['alpha']}. Gaps: the timed wall minus the kernels "
             "(the GPU idle between kernels).\n"]
    rows = []
    measured = [r for r in results["rows"] if "error" not in r]
    for r in measured:
        cells = [r["program"], r["context"], r["wall_us"] / 1e3, r["busy_us"] / 1e3,
                 gaps_us(r) / 1e3 if r["launches"] else float("nan"), round(r["launches"])]
        for c in CATEGORIES:
            v, fl = r["categories"][c], r["floor_us"].get(c)
            cells.append(f"{v['us'] / 1e3:.3f}" + (f" ({fl / v['us']:.0%})" if fl and v["us"] else ""))
        rows.append(cells)
    parts.append(report.table(["program", "context", "wall ms", "kernels ms", "gaps ms", "launches"]
                              + [f"{c} ms (% of floor)" for c in CATEGORIES], rows))
    parts += [f"\n- {r['program'] + ' at ' if 'program' in r else ''}context {r['context']}: {r['error']}"
              for r in results["rows"] if "error" in r]
    for r in measured:
        if r["program"] != "draft":
            continue
        parts.append(f"\nTop kernels of the draft step at {r['context']} (per step):\n")
        parts.append(report.table(["us", "launches", "category", "kernel", "floor us"],
                                  [[lab["us"], lab["launches"], lab["category"], lab["label"][:70],
                                    lab["floor_us"] if lab["floor_us"] else float("nan")]
                                   for lab in r["labels"][:top]]))
    return "\n".join(parts)


PROG = "qspec-bench profile"


def build_parser() -> argparse.ArgumentParser:
    from qspec_jax.cli import Parser, comma_choices, comma_list

    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=comma_list(int), default="4096,131072", help="contexts (tokens)")
    p.add_argument("--programs", type=comma_choices(PROGRAMS), default=",".join(PROGRAMS),
                   help="comma-separated programs to profile")
    p.add_argument("--shape", choices=tuple(SHAPES), default="llama3-8b",
                   help="model shape (random weights); the report's section is the default shape at batch 1")
    p.add_argument("--batch", type=int, default=1, help="rows decoded together")
    p.add_argument("--ragged", action="store_true",
                   help="rows of different lengths, evenly from context/2 to context (as `qspec-bench e2e --parts "
                        "batch`); needs --batch >= 2")
    p.add_argument("--steps", type=int, default=8, help="steps per profiled call")
    p.add_argument("--trials", type=int, default=3, help="timed calls for the wall time (the median is reported)")
    p.add_argument("--loop-tokens", type=int, default=128, help="tokens per profiled loop")
    p.add_argument("--gamma", type=int, default=4, help="draft length of the speculative loop")
    p.add_argument("--alpha", type=float, default=0.9, help="forced acceptance of the speculative loop")
    p.add_argument("--verify-t", type=int, default=None,
                   help="tokens of the verify pass (default: --gamma + 1, the speculative loop's verify width)")
    p.add_argument("--draft-group", type=int, default=DraftWeightsConfig.group_size, help="INT4 draft group size")
    p.add_argument("--dense-matmul", choices=DENSE_MATMUL_IMPLS, default=None,
                   help="the target's bf16 linears: xla (cuBLAS), mosaic (the Hopper kernel), auto (the kernel on "
                        "Hopper where the device has a measured launch shape, up to 24 rows) or interpret (its CPU "
                        "twin); default: the model config's")
    p.add_argument("--top", type=int, default=24, help="kernels listed per program")
    p.add_argument("--graphs-in-trace", action="store_true",
                   help="keep XLA's command buffers (CUDA graphs) while tracing "
                        f"({GRAPHS_IN_TRACE_FLAG}): kernel times and idle inside the graphs; "
                        "by default the trace is of the program launched op by op")
    options.add_output_args(p, "profile", "BENCHMARKS.md")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, and tiny contexts unless given (runs on a CPU, where the trace has no GPU "
                        "kernels); writes no report")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Every argument before anything runs: one line, exit status 2."""
    from qspec_jax.cli import fail, require
    from qspec_jax.weight_quant import WEIGHT_GROUPS

    options.positive(PROG, args, "--contexts", "--batch", "--steps", "--trials", "--loop-tokens", "--top")
    require(PROG, 1 <= args.gamma <= DEFAULT_GAMMA_MAX, "--gamma", args.gamma, f"in 1..{DEFAULT_GAMMA_MAX}")
    require(PROG, 0.0 <= args.alpha <= 1.0, "--alpha", args.alpha, "in [0, 1]")
    if args.verify_t is None:
        args.verify_t = args.gamma + 1
    require(PROG, 1 <= args.verify_t <= DEFAULT_GAMMA_MAX + 1, "--verify-t", args.verify_t,
            f"in 1..{DEFAULT_GAMMA_MAX + 1}")
    require(PROG, args.draft_group in WEIGHT_GROUPS, "--draft-group", args.draft_group,
            f"one of {', '.join(map(str, WEIGHT_GROUPS))}")
    if args.ragged and args.batch < 2:
        fail(PROG, f"--ragged: rows of different lengths need --batch >= 2, got --batch {args.batch}")
    if args.doc is not None and (args.shape, args.batch) != ("llama3-8b", 1):
        fail(PROG, f"--doc: the report's profile section is the llama3-8b shape at batch 1, got --shape {args.shape} "
                   f"--batch {args.batch}; write this profile with --out only")
    if args.doc is not None and jax.default_backend() != "gpu":
        fail(PROG, f"--doc: no GPU ({jax.default_backend()} backend): the trace would have no kernels to report")


def keep_graphs_in_trace(environ: Any = None) -> None:
    """Adds GRAPHS_IN_TRACE_FLAG to XLA_FLAGS (read when jax creates its backend, so before any
    computation); refuses where XLA_FLAGS already sets that flag otherwise, or the backend exists."""
    from qspec_jax.cli import fail

    environ = os.environ if environ is None else environ
    name = GRAPHS_IN_TRACE_FLAG.split("=")[0]
    given = [f for f in environ.get("XLA_FLAGS", "").split() if f.split("=")[0] == name]
    if given and given != [GRAPHS_IN_TRACE_FLAG]:
        fail(PROG, f"--graphs-in-trace: XLA_FLAGS sets {given[-1]}; expected {GRAPHS_IN_TRACE_FLAG} or nothing")
    from jax._src import xla_bridge  # no public way to ask whether XLA_FLAGS has been read yet

    if xla_bridge.backends_are_initialized():
        fail(PROG, "--graphs-in-trace: jax's backend already exists, so XLA_FLAGS can no longer change; "
                   f"set XLA_FLAGS={GRAPHS_IN_TRACE_FLAG} before starting instead")
    if not given:
        environ["XLA_FLAGS"] = " ".join([environ.get("XLA_FLAGS", ""), GRAPHS_IN_TRACE_FLAG]).strip()


def main(argv: Sequence[str] | None = None) -> int:
    return options.run_bench(PROG, _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.graphs_in_trace:
        keep_graphs_in_trace()
    options.resolve_outputs(PROG, args, "profile", "BENCHMARKS.md", quick=args.quick)
    check_args(args)  # every argument given, --quick or not
    options.require_gpu(PROG, args.quick, "the profile runs the 8B shape's step programs (16 GB of weights, caches "
                                          "of each context) and reads GPU kernel events")
    if args.quick:  # tiny sizes, except those given
        options.quick_sizes(args, build_parser(), dict(contexts=(512,), steps=2, trials=1, loop_tokens=16,
                                                       draft_group=64))
    args.out.mkdir(parents=True, exist_ok=True)
    env = report.environment()
    command = options.command_line(PROG, argv)
    results = {"environment": env, "command": command, **run(args)}
    with options.writing(PROG, "--out", args.out, "profile.json"):
        (args.out / "profile.json").write_text(json.dumps(results, indent=1))
    log(f"wrote {args.out / 'profile.json'}")
    if args.doc is not None:
        with options.writing(PROG, "--doc", args.doc, "its profile section"):
            report.update_section("profile", markdown(results, command, env, args.top), args.doc)
        log(f"wrote the 'profile' section of {args.doc}")
    if not options.measured_any(results["rows"]):
        log(f"{PROG}: nothing was measured: no context fits this device")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
