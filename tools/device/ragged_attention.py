"""Decode attention over rows of different lengths: does the Mosaic ws kernel's cost follow the sum
of the lengths, and at which split count (issue 31's batch-8 gap).

    PYTHONPATH=. python3 tools/device/ragged_attention.py [--batch 8] [--ctx 32768] [--nps 0,2,3,4,6,8,flat]

For the INT4 draft view (T 1), the INT8 verify view (T 5, --target-t) and our dense bf16 kernel (T 1), 8B
shape: every row at --ctx against rows evenly from ctx/2 to ctx (`e2e.batch_lengths`, the e2e
batch part's). The Mosaic views under each CTA count per (row, KV head) in --nps (0: the row
split's default, `mosaic_gpu_ws.default_ctas`; "flat": the balanced schedule, `ws_flat`: the draft's by the
rows' lengths, the target view's by the geometry).
Prints per call the wall time in a device loop, the attention kernel alone and all GPU kernels
(query prep, kernel, merge) from a profiler trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import numpy as np  # noqa: E402

import qspec_jax  # noqa: E402,F401  (XLA flags)
from pallas_kernels.decode_attention.mosaic_gpu import MgpuConfig  # noqa: E402
from qspec_jax.bench import kernel as K  # noqa: E402
from qspec_jax.bench.e2e import batch_lengths  # noqa: E402
from qspec_jax.bench.synthetic import attention_config, random_quant_cache  # noqa: E402


def config_of(token: str) -> MgpuConfig:
    """"4" -> 4 CTAs per (row, KV head), "0" the row split's default count (`default_ctas`; the
    balanced schedule off, as before it became the draft's default from two rows up), "flat" the
    balanced schedule ("flat128": on 128 CTAs); "+q" / "-q" suffixes: the prep's query in registers
    or not (`ws_prep_q_regs`), "+l" / "-l": the softmax on the live columns or whole tiles
    (`ws_live_cols`), "+p" / "-p": the software-pipelined consumers or not (`ws_pipeline`), "+b" / "-b": the
    prep two blocks per pass or not (`ws_prep_pairs`), "+k" / "-k": the split merge in the kernel or not
    (`ws_kernel_merge`, the row split); a
    ":stream" suffix: the kernel's TMA-only timing diagnostic (wrong results), or another `ws_diag`;
    an "@216/56/24" suffix (last): setmaxnreg per role (`ws_regs`); "~3": consumer warpgroups per CTA
    (`ws_consumers`), "%8": pipeline stages (`stages`), both before any other suffix ("0~3%6+l")."""
    token, _, regs = token.partition("@")
    split, _, diag = token.partition(":")
    extra: dict = {"ws_regs": tuple(int(x) for x in regs.split("/"))} if regs else {}
    fields = {"q": "ws_prep_q_regs", "l": "ws_live_cols", "p": "ws_pipeline", "b": "ws_prep_pairs",
              "k": "ws_kernel_merge"}
    while split[-2:-1] in ("+", "-") and split[-1:] in fields:
        extra[fields[split[-1]]] = split[-2] == "+"
        split = split[:-2]
    split, _, stages = split.partition("%")
    split, _, consumers = split.partition("~")
    if stages:
        extra["stages"] = int(stages)
    if consumers:
        extra["ws_consumers"] = int(consumers)
    if split.startswith("flat"):
        base = MgpuConfig(ws_flat=True, ws_flat_ctas=int(split[4:]) if split[4:] else None)
    else:
        # (an earlier build's MgpuConfig, in the `ab` runs of flat_gpu.sh, may have no ws_flat)
        row = {"ws_flat": False} if "ws_flat" in {f.name for f in dataclasses.fields(MgpuConfig)} else {}
        base = MgpuConfig(num_splits=int(split) or None, **row)
    return dataclasses.replace(base, ws_diag=diag or None, **extra)


def view_cases(args, hq: int, hkv: int, d: int, layouts: dict, seed: int, view: str = "draft", t: int = 1):
    """Per layout: (name, run(config) -> float64 output, the jnp reference's output), on a fresh random
    cache and query (`view` with T `t`, by default the draft's T 1; PRNG seed + the layout's index)."""
    import jax.numpy as jnp

    from pallas_kernels.decode_attention import mosaic_gpu as mg
    from qspec_jax import attention as A

    cfg = attention_config(hq, hkv, d)
    call = jax.jit(lambda q, p, c, conf: mg.quantized_decode_attention_mgpu(q, p, c, jnp.int32(0), view=view,
                                                                            config=conf), static_argnums=3)
    for i, (name, lengths) in enumerate(layouts.items()):
        key = jax.random.PRNGKey(seed + i)
        cache = random_quant_cache(cfg, args.batch, args.ctx, key, layers=1, fp_start=3, lengths=lengths)
        q = jax.random.normal(jax.random.fold_in(key, 1), (args.batch, t, hq, d), jnp.float32).astype(jnp.bfloat16)
        q_pos = (cache.q_len + cache.fp_len)[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
        ref = np.asarray(jax.jit(lambda q, p, c: A.quantized_cache_attention(q, p, c, jnp.int32(0), view, None))(
            q, q_pos, cache), np.float64)
        yield name, (lambda conf, q=q, q_pos=q_pos, cache=cache: np.asarray(
            call(q, q_pos, cache, conf).astype(jnp.float32), np.float64)), ref


def check_flat(args, hq: int, hkv: int, d: int, layouts: dict) -> None:
    """The balanced schedule against the jnp reference and the row split, fresh random
    cache and queries per layout (relative error; the two schedules sum in different orders)."""
    for name, run, ref in view_cases(args, hq, hkv, d, layouts, 100):
        confs = {"row": MgpuConfig(ws_flat=False), "flat": MgpuConfig(ws_flat=True)}
        if args.check_q_regs:  # the prep's query in registers (on by default for the row split) against it off:
            # the same operands, so the same bits
            confs = {n + x: dataclasses.replace(c, ws_prep_q_regs=x == "+q") for n, c in confs.items() for x in ("", "+q")}
        outs = {n: run(conf) for n, conf in confs.items()}
        for n, o in outs.items():
            err = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
            ok = np.isfinite(o).all() and err <= 2e-2
            if n.endswith("+q"):
                same = np.array_equal(o, outs[n[:-2]])
                ok = ok and same
                err_s = f"relerr {err:.2e}, {'bitwise equal to' if same else 'DIFFERS from'} {n[:-2]}"
            else:
                err_s = f"relerr {err:.2e} vs the jnp reference"
            print(f"check {n:7s} {name:11s}: {err_s} {'ok' if ok else 'FAIL'}", flush=True)


def check_tokens(args, hq: int, hkv: int, d: int, layouts: dict, view: str = "draft", t: int = 1) -> list[str]:
    """Every --nps token's call (`view`, T `t`) against the jnp reference (relative error, finite) and against
    the first token's call (bitwise or not), fresh random cache and queries per layout. A token the
    kernel refuses (e.g. stages that do not fit in shared memory) is reported and dropped; returns
    the tokens that ran."""
    tokens = list(dict.fromkeys(args.nps.split(",")))
    for name, run, ref in view_cases(args, hq, hkv, d, layouts, 200, view, t):
        first = None
        for tok in list(tokens):
            try:
                o = run(config_of(tok))
            except ValueError as e:  # a launch the kernel refuses: say so, time the others
                print(f"check {tok:16s} {name:11s}: refused: {str(e)[:200]}", flush=True)
                tokens.remove(tok)
                continue
            err = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
            ok = bool(np.isfinite(o).all()) and err <= 2e-2
            same = "" if first is None else (", bitwise equal to " if np.array_equal(o, first) else ", differs from ") + tokens[0]
            first = o if first is None else first
            print(f"check {view} {tok:16s} {name:11s}: relerr {err:.2e} vs the jnp reference{same} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
    return tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(K.SHAPES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--nps", default="0,2,3,4,6,8")
    ap.add_argument("--views", default="draft,target,dense")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--target-t", type=int, default=5, help="query tokens per row of the INT8 verify view's calls")
    ap.add_argument("--check-q-regs", action="store_true",
                    help="also check the prep's query in registers (ws_prep_q_regs) bitwise against it off")
    ap.add_argument("--check-tokens", action="store_true",
                    help="check every --nps token's call (the draft's, or the verify's when the views have no "
                         "draft) against the jnp reference first (fresh inputs)")
    ap.add_argument("--layouts", default="uniform,ragged,ragged_desc",
                    help="uniform: every row at ctx; ragged: e2e.batch_lengths (shortest row first); ragged_desc: "
                         "the same rows longest first (the grid's row order is the dispatch order)")
    args = ap.parse_args(argv)
    hq, hkv, d = K.SHAPES[args.shape]
    key = jax.random.PRNGKey(0)
    ragged = batch_lengths(args.batch, args.ctx)
    layouts = {"uniform": None, "ragged": ragged, "ragged_desc": ragged[::-1].copy()}
    layouts = {k: layouts[k] for k in args.layouts.split(",")}
    print(f"ragged rows: {ragged.tolist()}", flush=True)
    if args.check_tokens and ("draft" in args.views or "target" in args.views):
        view = "draft" if "draft" in args.views else "target"
        args.nps = ",".join(check_tokens(args, hq, hkv, d, layouts, view, 1 if view == "draft" else args.target_t))
    elif any(n.startswith("flat") for n in args.nps.split(",")) and "draft" in args.views:
        check_flat(args, hq, hkv, d, layouts)
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for view in args.views.split(","):
            kind, t, impl = {"draft": ("draft", 1, "mosaic"), "target": ("target", args.target_t, "mosaic"),
                             "dense": ("dense", 1, "triton")}[view]
            nps = args.nps.split(",") if impl == "mosaic" else ["0"]
            confs = [None if impl != "mosaic" else config_of(n) for n in nps]
            for name, lengths in layouts.items():
                # (bench_ours compiles every config, then times them alternately: say what is under way)
                print(f"{view:6s} {name:7s}: compiling and timing {len(confs)} configs ...", flush=True)
                rows = K.bench_ours(kind, args.shape, hq, hkv, d, args.batch, args.ctx, t, args.trials, confs, key,
                                    impl=impl, trace_dir=f"{tmp}/{view}-{name}", lengths=lengths)
                for n, r in zip(nps, rows):
                    n = "dflt" if n == "0" else n
                    if "s" not in r:
                        print(f"{view:6s} {name:7s} NP {n:>4}: {r.get('error', '')[:300]}", flush=True)
                        continue
                    gs = r.get("gpu_s", float("nan"))
                    ks = r.get("kernel_s") or gs  # the dense kernel's trace name is not matched: all GPU kernels
                    table.append((view, name, n, r["s"], ks, gs, r["bytes"]))
                    print(f"{view:6s} {name:7s} NP {n:>4}: {r['s'] * 1e6:8.1f} us/call, kernel "
                          f"{ks * 1e6:8.1f} us ({r['bytes'] / ks / 1e12:.2f} TB/s), all GPU {gs * 1e6:8.1f} us",
                          flush=True)
    print("\n| view | rows | NP | us/call | kernel us | all GPU us | kernel TB/s |\n|---|---|---|---|---|---|---|")
    for view, name, n, s, ks, gs, nb in table:
        print(f"| {view} | {name} | {n} | {s * 1e6:.1f} | {ks * 1e6:.1f} | {gs * 1e6:.1f} | "
              f"{nb / ks / 1e12:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
