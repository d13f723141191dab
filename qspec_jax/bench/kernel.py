"""`qspec-bench kernel`: decode-attention kernels on one layer, on device, against bf16 baselines.

Variants (ours): the Mosaic GPU kernels (Hopper) -- INT4 draft (T=1), INT8 verify (T=5 and
T=9 = gamma_max + 1) over a QuantSpecCache --, the Triton kernels (INT4 draft T=1, INT8 T=5) and
our dense bf16 Triton kernel (T=1). Baselines (bf16, T=1): XLA (the jnp `dense_attention` under jit), cuDNN
(`jax.nn.dot_product_attention(implementation="cudnn")`), JAX Pallas
`decode_attention.gqa`, and torch SDPA FlashAttention when torch is importable.

Timing (SPEC §7): many repetitions inside one jitted `lax.fori_loop` whose carry is the
attention output fed back as the next query (so nothing is hoisted); median of several trials.
Caches hold random data. When one call's bytes fit in L2 (50 MB), each repetition runs over
several cache copies in turn. A device-to-device copy (read + write) is measured in the same run.
On a GPU one more run of each of our kernels goes under the profiler: "kernel alone" is the
attention kernel's own time from that trace, without the XLA query preparation, split merge and
launch gaps the call's time includes (what `qspec-bench profile` reports per layer in the model;
H200, 2026-12-02: the INT4 draft call 73.5 us at 128k where the model's kernel takes 46.5).

Usage: qspec-bench kernel [--out DIR] [--doc [FILE]] [--quick]   (entry: `main(argv)`); results go to
--out (the user's cache by default), the Kernel section of docs/BENCHMARKS.md only with --doc.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

L2_BYTES = 50 * 2**20
from qspec_jax.bench import options, report
from qspec_jax.bench.synthetic import attention_config, random_quant_cache
from qspec_jax.bench.timing import copy_bandwidth, read_ceiling_bps, time_loop

MAX_COPIES = 8
SHAPES = {  # name: (query heads, kv heads, head_dim)
    "llama3-8b": (32, 8, 128),
    "smollm2": (9, 3, 64),
}


def log(*a: Any) -> None:
    print(*a, flush=True)


def quant_bytes(cache, t: int, hq: int, target: bool) -> int:
    """Bytes one attention call must read and write: the planes it reads over each row's q_len
    tokens, their scales and zeros, the visible ring entries, q and the output (rows of different
    lengths each count their own)."""
    _, b, hkv, _, dh = cache.k_hi.shape
    d = 2 * dh
    q_lens = [int(v) for v in np.asarray(cache.q_len)]  # per row
    n_fp = int(np.sum(np.asarray(cache.fp_len)))  # ring entries, all rows
    sd = jnp.dtype(cache.k_scale.dtype).itemsize
    planes = 4 if target else 2
    n = planes * hkv * sum(q_lens) * dh  # uint8 planes
    n += 2 * hkv * sum(q // cache.group_size for q in q_lens) * d * sd  # key scale + zero
    n += 2 * hkv * sum(q_lens) * cache.v_scale.shape[-1] * sd  # value scale + zero
    n += 2 * hkv * n_fp * d * jnp.dtype(cache.k_fp.dtype).itemsize  # ring K + V
    n += 2 * b * t * hq * d * 2  # q in, o out (bf16)
    return int(n)


def dense_bytes(b: int, hkv: int, ctx: float, d: int, t: int, hq: int) -> int:
    """Bytes of b rows of `ctx` tokens (the mean length, for rows of different lengths)."""
    return int(2 * b * hkv * ctx * d * 2 + 2 * b * t * hq * d * 2)


# ----------------------------------------------------------------------------- variants
def bench_ours(kind: str, name: str, hq: int, hkv: int, d: int, batch: int, ctx: int, t: int, trials: int,
               configs: list, key, impl: str = "triton", trace_dir: Any = None,
               lengths: np.ndarray | None = None) -> list[dict]:
    """Times one of our kernels (`impl` "triton" or "mosaic" for the quantized views) under each
    config in `configs` (KernelConfig / MgpuConfig); returns one row each. With `trace_dir` a row
    also has "kernel_s" (the attention kernel alone, from a profiler trace) and "gpu_s" (every GPU
    kernel of the call: query preparation, the kernel, the split merge), per call. `lengths`
    int32[batch] <= ctx: rows of different lengths (all ctx by default)."""
    import pallas_kernels as pk
    from pallas_kernels.decode_attention import mosaic_gpu as mg
    from qspec_jax.cache import QuantSpecCache  # noqa: F401

    cfg = attention_config(hq, hkv, d)
    if kind == "dense":
        per_copy = 2 * batch * hkv * ctx * d * 2
    else:
        per_copy = batch * hkv * ctx * d * (2 if kind == "target" else 1)
    copies = max(1, min(MAX_COPIES, math.ceil(2 * L2_BYTES / per_copy)))
    q = jax.random.normal(key, (batch, t, hq, d), jnp.float32).astype(jnp.bfloat16)
    if kind == "dense":
        kk, vk = jax.random.split(key)
        shape = (copies, batch, hkv, ctx, d)
        k = jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(vk, shape, jnp.float32).astype(jnp.bfloat16)
        rows_len = np.full((batch,), ctx) if lengths is None else np.asarray(lengths)
        q_pos = jnp.asarray(rows_len[:, None] - t, jnp.int32) + jnp.arange(t, dtype=jnp.int32)
        nbytes = dense_bytes(batch, hkv, float(np.mean(rows_len)), d, t, hq)  # (as profile.attention_floor_bytes)

        data = (q_pos, k, v)

        def make_step(conf):
            def step(x, data):
                q_pos, k, v = data
                for c in range(copies):
                    x = pk.dense_decode_attention(x, q_pos, k, v, jnp.int32(c), interpret=None, config=conf)
                return x
            return step
    else:
        cache = random_quant_cache(cfg, batch, ctx, key, layers=copies, fp_start=3, lengths=lengths)
        tot = cache.q_len + cache.fp_len
        q_pos = tot[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
        nbytes = quant_bytes(cache, t, hq, kind == "target")

        data = (q_pos, cache)

        def make_step(conf):
            def step(x, data):
                q_pos, cache = data
                for c in range(copies):
                    if impl == "mosaic":
                        x = mg.quantized_decode_attention_mgpu(x, q_pos, cache, jnp.int32(c), view=kind, config=conf,
                                                               interpret=jax.default_backend() != "gpu")
                    else:
                        x = pk.quantized_decode_attention(x, q_pos, cache, jnp.int32(c), view=kind, interpret=None,
                                                          config=conf)
                return x
            return step

    rows = []
    for conf in configs:
        try:
            sub = None if trace_dir is None else Path(trace_dir) / f"{kind}-{t}-{len(rows)}"
            r = time_loop(make_step(conf), q, 3, trials, data=data, trace_dir=sub)
            s = r["s"] / copies
            row = {"variant": _variant(kind, impl), "config": _conf_str(conf), "s": s, "bytes": nbytes,
                   "copies": copies, "reps": r["reps"], "spread_s": r["spread"] / copies}
            if r.get("kernels"):  # the attention kernel's own name (the Triton / Mosaic kernels' `name`s)
                own = "dense_decode" if kind == "dense" else "quantspec"
                row["kernel_s"] = sum(us for k, us in r["kernels"].items() if own in k) / copies / 1e6
                row["gpu_s"] = sum(r["kernels"].values()) / copies / 1e6
            rows.append(row)
        except Exception as e:  # a config that does not compile on this device
            rows.append({"variant": _variant(kind, impl), "config": _conf_str(conf), "error": options.case_error(e)})
    return rows


def _variant(kind: str, impl: str) -> str:
    if kind == "dense":
        return "ours-dense"
    return f"ours-{impl}-{'int4-draft' if kind == 'draft' else 'int8-target'}"


def _conf_str(conf) -> str:
    if conf is None:
        return "default"
    return ",".join(f"{k}={v}" for k, v in vars(conf).items() if v not in (None, False))


def bench_baselines(hq: int, hkv: int, d: int, batch: int, ctx: int, trials: int, key, torch_ok: bool,
                    which: tuple = ("torch", "xla", "cudnn", "gqa")) -> list[dict]:
    from qspec_jax.attention import dense_attention

    t = 1
    per_copy = 2 * batch * hkv * ctx * d * 2
    copies = max(1, min(MAX_COPIES, math.ceil(2 * L2_BYTES / per_copy)))
    nbytes = dense_bytes(batch, hkv, ctx, d, t, hq)
    kk, vk = jax.random.split(key)
    q = jax.random.normal(key, (batch, t, hq, d), jnp.float32).astype(jnp.bfloat16)
    rows = []

    def run(name, make):
        try:
            step, data = make()
            r = time_loop(step, q, 3, trials, data=data)
            rows.append({"variant": name, "config": "", "s": r["s"] / copies, "bytes": nbytes, "copies": copies,
                         "reps": r["reps"], "spread_s": r["spread"] / copies})
        except Exception as e:
            rows.append({"variant": name, "error": options.case_error(e)})
            log(f"  {name} failed: {rows[-1]['error'][:160]}")

    # XLA: the jnp reference over [B, Hkv, S, D].
    shape = (copies, batch, hkv, ctx, d)
    k = jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(vk, shape, jnp.float32).astype(jnp.bfloat16)
    q_pos = jnp.full((batch, 1), ctx - 1, jnp.int32)
    k_pos = jnp.broadcast_to(jnp.arange(ctx, dtype=jnp.int32), (batch, ctx))

    def make_xla(k=k, v=v):
        def step(x, data):
            k, v = data
            for c in range(copies):
                x = dense_attention(x, k[c], v[c], q_pos, k_pos)
            return x
        return step, (k, v)

    if "xla" in which:
        run("xla-bf16", make_xla)
    del k, v
    # cuDNN and Pallas gqa take [B, S, Hkv, D].
    shape = (copies, batch, ctx, hkv, d)
    k = jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(vk, shape, jnp.float32).astype(jnp.bfloat16)

    def make_cudnn(k=k, v=v):
        def step(x, data):
            k, v = data
            for c in range(copies):
                x = jax.nn.dot_product_attention(x, k[c], v[c], implementation="cudnn")
            return x
        return step, (k, v)

    if "cudnn" in which:
        run("cudnn-bf16", make_cudnn)

    def make_gqa(k=k, v=v):
        from jax.experimental.pallas.ops.gpu import decode_attention as up

        def step(x, data):
            k, v = data
            for c in range(copies):
                x = up.gqa(x[:, 0], k[c], v[c])[:, None].astype(x.dtype)
            return x
        return step, (k, v)

    if "gqa" in which:
        run("pallas-gqa-bf16", make_gqa)
    del k, v
    if torch_ok and "torch" in which:
        rows.insert(0, bench_torch(hq, hkv, d, batch, ctx, trials, copies, nbytes))
    return rows


def bench_torch(hq, hkv, d, batch, ctx, trials, copies, nbytes) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        dev = "cuda"
        q = torch.randn(batch, hq, 1, d, device=dev, dtype=torch.bfloat16)
        ks = [torch.randn(batch, hkv, ctx, d, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        vs = [torch.randn(batch, hkv, ctx, d, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        f = torch.nn.functional.scaled_dot_product_attention

        def once(ks=ks, vs=vs):
            x = q
            for c in range(copies):
                x = f(x, ks[c], vs[c], enable_gqa=True)
            return x

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            once()
            torch.cuda.synchronize()
            reps = 50
            s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s0.record()
            for _ in range(reps):
                once()
            s1.record()
            torch.cuda.synchronize()
            est = s0.elapsed_time(s1) / 1e3 / reps
            reps = int(max(50, min(5000, 0.03 / max(est, 1e-7))))
            times = []
            for _ in range(trials):
                s0.record()
                for _ in range(reps):
                    once()
                s1.record()
                torch.cuda.synchronize()
                times.append(s0.elapsed_time(s1) / 1e3 / reps)
        del ks, vs
        torch.cuda.empty_cache()
        s = statistics.median(times)
        return {"variant": "torch-sdpa-flash-bf16", "config": f"torch {torch.__version__}", "s": s / copies,
                "bytes": nbytes, "copies": copies, "reps": reps, "spread_s": (max(times) - min(times)) / 2 / copies}
    except Exception as e:
        log(f"  torch failed: {e}"[:200])
        return {"variant": "torch-sdpa-flash-bf16", "error": f"{type(e).__name__}: {e}"[:300]}


# ------------------------------------------------------------------------------ reporting
def fits(batch: int, hkv: int, ctx: int, d: int) -> bool:
    """bf16 K+V of one copy plus its BSHD twin must leave room on this device
    (`planner.device_memory_bytes`)."""
    from qspec_jax.planner import device_memory_bytes

    need = 2 * (2 * batch * hkv * ctx * d * 2) + 4 * batch * hkv * ctx * d // 2
    return need < 0.6 * device_memory_bytes()


def write_outputs(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_bench.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out / "kernel_bench.md").write_text(md)
    plot(out / "kernel_speedup.png", result)


def markdown(result: dict) -> str:
    ceiling = read_ceiling_bps(result["device"])
    lines = [
        f"Device: {result['device']}; jax {result['jax']}; {result['date']}; command: `{result['command']}`.",
        f"Device-to-device copy measured in the run: {result['copy_bw_Bps'] / 1e12:.2f} TB/s (read + write). Times "
        f"are medians of {result['trials']} trials of a jitted loop (the kernel's XLA query preparation and merge "
        f"included). `% ceiling` is bytes moved / time against the {ceiling / 1e12:.2f} TB/s read ceiling; `vs flash` "
        "is torch SDPA FlashAttention (bf16, T = 1) time / this row's time at the same shape, batch and context; "
        "`kernel alone` (ours, GPU) is the attention kernel's own time in a profiler trace of the same loop, "
        "without the query preparation, merge and launch gaps, and its % of the ceiling.",
    ]
    origins: dict[tuple[str, str], list[str]] = {}  # rows kept from earlier runs (--keep-parts), by run
    fresh = {(r["shape"], r["batch"]) for r in result["rows"] if "kept_from" not in r}
    for r in result["rows"]:
        if "kept_from" in r:  # "shape B=b", or "shape B=b ctx=c" where this run measured other contexts of it
            pair = f"{r['shape']} B={r['batch']}" + (f" ctx={r['ctx']}" if (r["shape"], r["batch"]) in fresh else "")
            runs = origins.setdefault((r["kept_from"]["command"], r["kept_from"]["date"]), [])
            if pair not in runs:
                runs.append(pair)
    lines += [f"Rows of {', '.join(pairs)} kept from an earlier run ({date}): `{cmd}`."
              for (cmd, date), pairs in origins.items()]
    lines += [
        "",
        "| shape | B | context | variant | T | ms | MB moved | TB/s | % ceiling | vs flash | kernel alone ms (% ceiling) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r or r.get("best") is False:
            continue
        tbs = r["bytes"] / r["s"] / 1e12
        vf, ks = r.get("vs_flash"), r.get("kernel_s")
        alone = f"{ks * 1e3:.4f} ({100 * r['bytes'] / ks / ceiling:.0f}%)" if ks else ""
        lines.append(f"| {r['shape']} | {r['batch']} | {_ctx(r['ctx'])} | {r['variant']} | {r['t']} | "
                     f"{r['s'] * 1e3:.4f} | {r['bytes'] / 1e6:.1f} | {tbs:.2f} | "
                     f"{100 * r['bytes'] / r['s'] / ceiling:.0f}% | "
                     f"{'' if vf is None else f'{vf:.2f}x'} | {alone} |")
    errs = [r for r in result["rows"] if "error" in r]
    if errs:
        lines += ["", "Failed or skipped:", ""]
        lines += [f"- {r.get('shape')} B={r.get('batch')} {r.get('ctx')} {r['variant']} {r.get('config', '')}: "
                  f"{r['error'][:200]}" for r in errs]
    for sk in result.get("skipped", []):
        lines.append(f"- skipped: {sk}")
    return "\n".join(lines) + "\n"


def _ctx(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot(path: Path, result: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, shape in zip(axes, SHAPES):
        for var in ("ours-mosaic-int4-draft", "ours-mosaic-int8-target", "ours-triton-int4-draft", "ours-dense"):
            for b in (1, 8):
                for t in (1, 5):
                    pts = sorted((r["ctx"], r["vs_flash"]) for r in result["rows"]
                                 if r.get("shape") == shape and r["variant"] == var and r.get("batch") == b
                                 and r.get("t") == t and r.get("vs_flash") and r.get("best") is not False)
                    if pts:
                        ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], marker="o",
                                label=f"{var} T={t} B={b}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (k tokens)")
        ax.set_ylabel("speedup vs torch SDPA flash (bf16)")
        ax.set_title(shape)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------------ main
PROG = "qspec-bench kernel"
IMPLS = ("mosaic", "triton", "dense")
BASELINES = ("torch", "xla", "cudnn", "gqa")


def _combo(text: str) -> tuple[str, int]:
    """--combos item SHAPE:BATCH."""
    shape, _, batch = text.partition(":")
    if shape not in SHAPES or not batch.isdigit() or int(batch) < 1:
        raise argparse.ArgumentTypeError(f"expected SHAPE:BATCH pairs with SHAPE one of {','.join(SHAPES)} and "
                                         f"BATCH >= 1, e.g. llama3-8b:1,smollm2:8; got {text!r}")
    return shape, int(batch)


def build_parser() -> argparse.ArgumentParser:
    from qspec_jax.cli import HelpFormatter, Parser, comma_choices, comma_list

    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    options.add_output_args(ap, "kernel", "BENCHMARKS.md")
    ap.add_argument("--quick", action="store_true", help="small sizes (runs on CPU in interpret mode)")
    ap.add_argument("--trials", type=int, default=5, help="timed trials per measurement (the median is reported)")
    ap.add_argument("--contexts", type=comma_list(int), default=None,
                    help="comma-separated contexts in tokens (default: 4096,16384,65536,131072; --quick: 512 on a "
                         "CPU, 4096,16384 on a GPU)")
    ap.add_argument("--shapes", type=comma_choices(tuple(SHAPES)), default=",".join(SHAPES),
                    help="comma-separated attention shapes (query heads, KV heads, head_dim) by name")
    ap.add_argument("--batches", type=comma_list(int), default="1,8",
                    help="comma-separated batch sizes (--quick on a CPU: 1)")
    ap.add_argument("--no-sweep", action="store_true", help="only the default kernel configs")
    ap.add_argument("--combos", type=comma_list(_combo, "SHAPE:BATCH pairs"), default=None,
                    help="SHAPE:BATCH pairs to run instead of shapes x batches (default: all of them)")
    ap.add_argument("--impls", type=comma_choices(IMPLS), default=None,
                    help=f"subset of our kernels to time: {','.join(IMPLS)} (default: all)")
    ap.add_argument("--baselines", type=comma_choices(BASELINES), default=",".join(BASELINES),
                    help="bf16 baselines to time (GPU only)")
    ap.add_argument("--target-ts", type=comma_list(int), default="5,9",
                    help="query tokens T of the Mosaic INT8 verify rows")
    ap.add_argument("--keep-parts", action="store_true",
                    help="keep the rows of the (shape, batch, context) cases this run does not measure from "
                         "the kernel_bench.json already in --out (`make bench-kernel` runs one pair, or one "
                         "pair's contexts in two parts, per ten-minute call)")
    return ap


def kept_rows(path: Path, measured: list[tuple[str, int, int]]) -> tuple[list[dict], list[str]]:
    """The rows (and skip notes) of an earlier kernel_bench.json at `path` whose (shape, batch,
    context) this run does not measure, each row marked with `kept_from` (that run's command and
    date); ([], []) without such a file. A file that is not a kernel bench result is refused by name."""
    def pick(old: dict[str, Any]) -> tuple[list[dict], list[str]]:
        origin = {"command": old["command"], "date": old["date"]}
        rows = [{**r, "kept_from": r.get("kept_from", origin)} for r in old["rows"]
                if (r["shape"], r["batch"], r["ctx"]) not in measured]
        skipped = [x for x in old.get("skipped", [])
                   if not any(x.startswith(f"{sh} B={b} ctx={c}:") for sh, b, c in measured)]
        return rows, skipped

    return options.kept_from_earlier(path, "kernel", pick, ([], []))


def main(argv: list[str] | None = None) -> int:
    return options.run_bench(PROG, lambda a: _main(a), argv)


def _main(argv: list[str] | None) -> int:
    from qspec_jax.cli import fail

    args = build_parser().parse_args(argv)
    options.positive(PROG, args, "--trials", "--batches", "--target-ts", *(["--contexts"] if args.contexts else []))
    options.resolve_outputs(PROG, args, "kernel", "BENCHMARKS.md", quick=args.quick)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.quick:
        fail(PROG, f"no GPU ({jax.default_backend()} backend): the kernels are timed on a GPU; --quick runs the "
                   "harness at tiny sizes in interpret mode")
    if not on_gpu:  # interpret mode (the kernels' default off-GPU): only a smoke run of the code paths
        global MAX_COPIES
        MAX_COPIES = 1
    contexts = (list(args.contexts) if args.contexts else
                ([4096, 16384] if args.quick and on_gpu else [512] if args.quick else
                 [4096, 16384, 65536, 131072]))
    batches = list(args.batches) if not (args.quick and not on_gpu) else [1]
    shapes = list(args.shapes)
    trials = args.trials if on_gpu else 1
    try:
        import torch

        torch_ok = on_gpu and torch.cuda.is_available()
    except Exception:
        torch_ok = False

    dev = jax.devices()[0]
    result = {"device": f"{dev.device_kind} ({dev.platform})", "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
              "command": options.command_line(PROG, argv),
              "trials": trials, "rows": [], "skipped": []}
    combos = (list(args.combos) if args.combos else [(s_, b) for s_ in shapes for b in batches])
    if args.keep_parts:
        try:
            result["rows"], result["skipped"] = kept_rows(Path(args.out) / "kernel_bench.json",
                                                          [(sh, b, c) for sh, b in combos for c in contexts])
        except ValueError as e:
            fail(PROG, str(e))
    copy_n = 2 * 2**30 if on_gpu else 2**24
    result["copy_bw_Bps"] = copy_bandwidth(copy_n, trials)
    log(f"copy bandwidth: {result['copy_bw_Bps'] / 1e12:.3f} TB/s")
    out = args.out

    from pallas_kernels.decode_attention.mosaic_gpu import MgpuConfig

    # (impl, kind, T): the draft view at T = 1, the target view at T = gamma + 1 = 5 and 9.
    target_ts = list(args.target_ts)
    variants = ([("mosaic", "draft", 1)] + [("mosaic", "target", t) for t in target_ts]
                + [("triton", "draft", 1), ("triton", "target", 5), ("triton", "dense", 1)])
    if args.impls:
        variants = [v for v in variants if v[0] in args.impls or (v[1] == "dense" and "dense" in args.impls)]
    legacy = functools.partial(MgpuConfig, schedule="legacy")
    sweep = {"mosaic": [None, MgpuConfig(schedule="ws", stages=6), legacy(), legacy(stages=2), legacy(stages=4),
                        legacy(auto_barriers=True)],
             "triton": [None]}
    best: dict[tuple, Any] = {}
    key = jax.random.PRNGKey(0)
    if args.quick or args.no_sweep:
        sweep = {k: [None] for k in sweep}
    for shape, batch in combos:
        hq, hkv, d = SHAPES[shape]
        for ctx in sorted(contexts, reverse=True):  # largest first: the sweep picks configs there
            if on_gpu and not fits(batch, hkv, ctx, d):
                result["skipped"].append(f"{shape} B={batch} ctx={ctx}: does not fit in memory")
                log(f"skip {shape} B={batch} ctx={ctx}")
                continue
            base = dict(shape=shape, batch=batch, ctx=ctx)
            t0 = time.time()
            rows = []
            for impl, kind, t in variants:
                kb = (impl, kind, t, shape)
                confs = sweep[impl] if kb not in best else [best[kb]]
                traces = tempfile.mkdtemp(prefix="qspec-kernel-trace-") if on_gpu else None  # "kernel alone"
                try:
                    rs = bench_ours(kind, shape, hq, hkv, d, batch, ctx, t, trials, confs, key, impl=impl,
                                    trace_dir=traces)
                finally:
                    if traces:
                        shutil.rmtree(traces, ignore_errors=True)
                ok = [r for r in rs if "error" not in r]
                if ok:
                    win = min(ok, key=lambda r: r["s"])
                    if kb not in best:
                        best[kb] = confs[[_conf_str(c) for c in confs].index(win["config"])]
                    for r in ok:
                        r["best"] = r is win
                for r in rs:
                    r.update(base, t=t)
                rows += rs
            if on_gpu:
                for r in bench_baselines(hq, hkv, d, batch, ctx, trials, key, torch_ok, list(args.baselines)):
                    r.update(base, t=1)
                    rows.append(r)
            flash = [r["s"] for r in rows if r["variant"] == "torch-sdpa-flash-bf16" and "error" not in r]
            for r in rows:
                if "error" not in r and flash:
                    r["vs_flash"] = flash[0] / r["s"]
            result["rows"] += rows
            for r in rows:
                if "error" in r:
                    log(f"  {r['variant']} {r.get('config', '')}: ERROR {r['error'][:150]}")
                else:
                    log(f"  {shape} B={batch} ctx={ctx} {r['variant']:>24} T={r['t']} {r.get('config', ''):>20} "
                        f"{r['s'] * 1e3:8.4f} ms {r['bytes'] / r['s'] / 1e12:5.2f} TB/s "
                        f"{100 * r['bytes'] / r['s'] / read_ceiling_bps():4.0f}% "
                        f"{'' if r.get('vs_flash') is None else format(r['vs_flash'], '.2f') + 'x'}"
                        + (f"  kernel alone {r['kernel_s'] * 1e3:.4f} ms" if r.get("kernel_s") else ""))
            log(f"{shape} B={batch} ctx={ctx}: {time.time() - t0:.1f}s")
            write_outputs(out, result)  # after every shape: a killed run keeps what it measured
    write_outputs(out, result)
    log(f"wrote {out}/kernel_bench.json, kernel_bench.md, kernel_speedup.png")
    if args.doc:
        report.update_section("kernel", "## Decode attention kernel (Pallas: Mosaic GPU and Triton)\n\n"
                              + markdown(result), args.doc)
        log(f"rewrote the kernel section of {args.doc}")
    log(markdown(result))
    # A kernel of ours that no config could run is a failure (a sweep config that fails while
    # another runs is not, nor a case that does not fit the device's memory; baselines that are
    # unavailable are reported in the table, not here).
    what = lambda r: (r["variant"], r.get("shape"), r.get("batch"), r.get("ctx"), r.get("t"))  # noqa: E731
    ours = [r for r in result["rows"] if r["variant"].startswith("ours")]
    failed = ({what(r) for r in ours if "error" in r and not r["error"].startswith("does not fit")}
              - {what(r) for r in ours if "error" not in r})
    if failed:
        log(f"{PROG}: {len(failed)} of our kernel measurements failed: "
            + "; ".join(" ".join(map(str, f)) for f in sorted(failed, key=str)))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
