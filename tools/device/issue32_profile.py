"""Issue 32 on the GPU: the draft step of the 8B shape (batch 1, `--contexts`) with the glue fused
into the INT4 kernels and without, and with programmatic dependent launch; one process, one set
of weights (a variant is an environment switch read at trace time, then `jax.clear_caches()`).

    PYTHONPATH=. python3 tools/device/issue32_profile.py --out $OUT [--quick]

Per variant: the step's wall time and its kernels by category and label (`qspec-bench profile`'s
`_profile` / `show`), launches per layer. Also writes the optimized HLO of the unfused and the
fused draft step (draft_step_<variant>.hlo.txt.gz) and prints what each `loop_convert_fusion`
computes (issue 32: find what it converts). `--quick`: the tiny shape on the CPU (interpret-mode
kernels off: XLA path), to check the script itself.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from qspec_jax import model as M  # noqa: E402
from qspec_jax.bench import e2e, profile  # noqa: E402
from qspec_jax.bench.timing import read_ceiling_bps  # noqa: E402
from qspec_jax.generation import GenerationConfig, autoregressive_loop  # noqa: E402
from qspec_jax.linear import FUSE_ENV  # noqa: E402
from qspec_jax.speculative import SpecConfig, speculative_loop  # noqa: E402
from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params  # noqa: E402

VARIANTS = {  # name: environment (read at trace time by qspec_jax.linear / linear.mosaic_gpu.default_config)
    "unfused": {FUSE_ENV: "0", "QSPEC_W4A16_PDL": "0"},
    "fused": {FUSE_ENV: "1", "QSPEC_W4A16_PDL": "0"},
    "fused_pdl": {FUSE_ENV: "1", "QSPEC_W4A16_PDL": "1"},
    "unfused_pdl": {FUSE_ENV: "0", "QSPEC_W4A16_PDL": "1"},
}


def fusion_bodies(hlo: str, pattern: str = r"loop_convert_fusion") -> list[str]:
    """The fused computations called by fusions whose name matches `pattern`, from optimized HLO
    text: each `name = ... fusion(...), calls=%comp` and the body of %comp."""
    out = []
    for mm in re.finditer(rf"^\s*(%?{pattern}[\w.]*) = [^\n]*calls=(%?[\w.\-]+)[^\n]*$", hlo, re.M):
        comp = mm.group(2)
        body = re.search(rf"^{re.escape(comp)} [^\n]*\{{\n(.*?)^\}}", hlo, re.M | re.S)
        out.append(mm.group(0).strip() + "\n" + (body.group(1) if body else "(body not found)"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/issue32")))
    ap.add_argument("--contexts", default="4096")
    ap.add_argument("--variants", default="unfused,fused,fused_pdl")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--budget", type=float, default=170.0, help="seconds; later variants are skipped past it")
    ap.add_argument("--spec-loop", default="", help="variants of the QuantSpec loop to profile too (comma list), "
                    "gamma 4 at forced acceptance 0.9, after the draft steps and within the budget")
    ap.add_argument("--loop-tokens", type=int, default=64)
    ap.add_argument("--ar-loop", type=int, default=0, help="1: also the AR-bf16 loop (width 1), the speedup's base")
    ap.add_argument("--hlo", type=int, default=1, help="1: write the optimized HLO of the unfused and fused step")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = e2e.QUICK if args.quick else e2e.LLAMA31_8B
    key = jax.random.PRNGKey(0)
    params = jax.jit(lambda k: M.init_random_params(cfg, k))(key)
    draft = jax.block_until_ready(M.for_device(make_draft_params(params, DraftWeightsConfig(group_size=32,
                                                                                           method="clip"))))
    params = M.for_device(params) if (args.spec_loop or args.ar_loop) else None
    print(f"[issue32] draft params ready ({time.perf_counter() - t0:.1f} s); layers: "
          f"{ {n: type(w).__name__ for n, w in vars(draft.layers).items() if w is not None} }", flush=True)
    rows = []
    for c in (int(v) for v in args.contexts.split(",")):
        quant = e2e.random_quant_cache(cfg, 1, c, jax.random.fold_in(key, c + 1))
        toks = jnp.full((1, 1), 7, jnp.int32)
        for name in args.variants.split(","):
            if time.perf_counter() - t0 > args.budget:
                print(f"[issue32] budget spent: skipping {name} at {c}", flush=True)
                continue
            os.environ.update(VARIANTS[name])
            jax.clear_caches()  # the switches are read at trace time
            fused = M._draft_fusion(draft, 1).norm
            state = {"cache": quant}

            def call(state=state):
                out, state["cache"] = e2e.decode_steps(draft, state["cache"], toks, n=args.steps, view="draft")
                return out

            ts = time.perf_counter()
            try:
                r = profile._profile(call, args.out / "traces" / f"{name}_{c}", args.steps, args.trials)
            except Exception as e:  # noqa: BLE001
                print(f"[issue32] {name} at {c}: ERROR {type(e).__name__}: {str(e)[:2000]}", flush=True)
                continue
            r.update(program=f"draft/{name}", context=c, unit="step", fused=fused,
                     floor_us={"linear": profile.linear_floor_bytes(draft) / read_ceiling_bps() * 1e6})
            rows.append(r)
            profile.show(r, 30, cfg.num_layers)
            print(f"[issue32] {name} at {c}: fused={fused} ({time.perf_counter() - ts:.1f} s)", flush=True)
            if c == int(args.contexts.split(",")[0]) and name in ("unfused", "fused") and args.hlo:
                hlo = e2e.decode_steps.lower(draft, state["cache"], toks, n=1, view="draft").compile().as_text()
                with gzip.open(args.out / f"draft_step_{name}.hlo.txt.gz", "wt") as f:
                    f.write(hlo)
                for body in fusion_bodies(hlo)[:3]:
                    print(f"[issue32] {name}: loop_convert_fusion\n{body[:3000]}", flush=True)
            quant = state["cache"]
        for name in filter(None, args.spec_loop.split(",")):
            if time.perf_counter() - t0 > args.budget:
                print(f"[issue32] budget spent: skipping the loop {name} at {c}", flush=True)
                continue
            os.environ.update(VARIANTS[name])
            jax.clear_caches()
            spec = SpecConfig(gamma=4, max_new_tokens=args.loop_tokens, forced_acceptance=0.9, eos_token_ids=())
            loop = jax.jit(speculative_loop, static_argnames=("spec", "eos_ids"))

            def call(loop=loop, spec=spec, quant=quant):
                return loop(params, draft, quant, jnp.array([7], jnp.int32), key, eos_ids=(), spec=spec)

            ts = time.perf_counter()
            try:
                r = profile._profile(call, args.out / "traces" / f"loop_{name}_{c}", args.loop_tokens, 3)
            except Exception as e:  # noqa: BLE001
                print(f"[issue32] loop {name} at {c}: ERROR {type(e).__name__}: {str(e)[:2000]}", flush=True)
                continue
            r.update(program=f"spec_loop/{name}", context=c, unit="token", floor_us={})
            rows.append(r)
            profile.show(r, 12, cfg.num_layers)
            print(f"[issue32] loop {name} at {c} ({time.perf_counter() - ts:.1f} s)", flush=True)
        if args.ar_loop and time.perf_counter() - t0 <= args.budget:  # the baseline the loop's speedup divides
            dense = e2e.random_dense_cache(cfg, 1, c, jax.random.fold_in(key, c))
            ar = jax.jit(autoregressive_loop, static_argnames=("gen", "eos_ids"))
            gen = GenerationConfig(max_new_tokens=args.loop_tokens, kv="bf16", width=1)
            try:
                r = profile._profile(lambda: ar(params, dense, jnp.array([7], jnp.int32), key, eos_ids=(), gen=gen),
                                     args.out / "traces" / f"ar_loop_{c}", args.loop_tokens, 3)
                r.update(program="ar_loop/bf16", context=c, unit="token", floor_us={})
                rows.append(r)
                profile.show(r, 8, cfg.num_layers)
            except Exception as e:  # noqa: BLE001
                print(f"[issue32] AR loop at {c}: ERROR {type(e).__name__}: {str(e)[:2000]}", flush=True)
            del dense
    (args.out / "issue32_profile.json").write_text(json.dumps({"rows": rows}, indent=1, default=str))
    print("\n==== draft step (ms/step) and QuantSpec loop (ms/token) per variant ====")
    for r in rows:
        lin = r["categories"]["linear"]["us"]
        print(f"{r['program']:20s} ctx {r['context']:6d} wall {r['wall_us'] / 1e3:.3f} ms  kernels "
              f"{r['busy_us'] / 1e3:.3f} ms  launches/layer {r['launches'] / cfg.num_layers:5.1f}  linear "
              f"{lin / 1e3:.3f} ms  glue {r['categories']['glue']['us'] / 1e3:.3f} ms  attention "
              f"{r['categories']['attention']['us'] / 1e3:.3f} ms")
    print(f"[issue32] done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
