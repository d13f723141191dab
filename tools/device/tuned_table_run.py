"""Run `qspec-bench` with a candidate W4A16 `TUNED_SHAPES` table (issue 32): the table of the checkout with
entries added, replaced or dropped for this process only, so that several tables can be compared in the model on
one warm machine without editing the tree between runs.

    PYTHONPATH=. python3 tools/device/tuned_table_run.py [--set KIND:K,N,G=WGS,KT,S,REDUCE[,K_GROUPS,STAGES] ...] \
        [--drop KIND:K,N,G ...] [--attn-splits VIEW=N ...] [--attn-config FIELD=VALUE,...] \
        -- profile --batch 1 --contexts 4096 ...

--attn-splits draft=8 fixes the quantized attention's CTAs per (row, KV head) of one view (the cost model's
`default_ctas` otherwise), for the same kind of A/B of the attention's split count; --attn-config
ws_pair_merge=1[,stages=6] changes the defaults of the attention's `MgpuConfig` (what the model's calls get);
--linear-config norm_ahead=3[,stages=6] replaces those fields (integers, or strings such as diag=nosq) of every
INT4 / bf16 W4A16 launch shape the model's calls get (`mosaic_gpu.default_config`; the consumer norm's diagnostics,
`mosaic_gpu.NORM_DIAGNOSTICS`, only where the call has the norm), --linear-k 576 only where the weight's K is 576;
--fold-norms makes every draft made with make_draft_params fold its norm weights into its INT4 weights
(`DraftWeightsConfig.fold_norms`, off by default: the kernels then run the norm without weight), the A/B of
folding. After `--`, a
path ending in .py runs that check script under the same patches instead of qspec-bench
(`-- tools/device/qkv_cache_gpu.py --batches 32 ...`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tools", "device"))

from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402


def _entry(spec: str) -> tuple[str, tuple[int, int, int], str]:
    kind, _, rest = spec.partition(":")
    key, _, value = rest.partition("=")
    k, n, g = (int(v) for v in key.split(","))
    return kind, (k, n, g), value


def main() -> int:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", action="append", default=[], help="KIND:K,N,G=WGS,KT,S,REDUCE[,K_GROUPS,STAGES]")
    ap.add_argument("--drop", action="append", default=[], help="KIND:K,N,G")
    ap.add_argument("--attn-splits", action="append", default=[], help="VIEW=N (draft or target)")
    ap.add_argument("--attn-config", default="", help="FIELD=VALUE,... defaults of the attention's MgpuConfig")
    ap.add_argument("--linear-config", default="", help="FIELD=INT,... of the W4A16 kernels' launch shapes")
    ap.add_argument("--linear-k", type=int, default=0, help="--linear-config only for weights of this K (0: all)")
    ap.add_argument("--fold-norms", action="store_true", help="drafts fold their norm weights (fold_norms)")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    for spec in args.drop:
        kind, key, _ = _entry(spec)
        mg.TUNED_SHAPES.get(kind, {}).pop(key, None)
    for spec in args.set:
        kind, key, value = _entry(spec)
        wgs, kt, s, red, *more = value.split(",")  # (not `rest`: the qspec-bench arguments)
        if red not in mg.REDUCE_MODES or len(more) not in (0, 2):
            raise SystemExit(f"--set {spec}: expected WGS,KT,S,REDUCE[,K_GROUPS,STAGES] with REDUCE in {mg.REDUCE_MODES}")
        mg.TUNED_SHAPES.setdefault(kind, {})[key] = (int(wgs), int(kt), int(s), red, *(int(v) for v in more))
    print(f"TUNED_SHAPES = {mg.TUNED_SHAPES}", flush=True)
    if args.fold_norms:
        from qspec_jax import weight_quant

        base_folded = weight_quant.folded_norms  # make_draft_params looks the name up at call time
        weight_quant.folded_norms = lambda cfg: base_folded(dataclasses.replace(cfg, fold_norms=True))
        print("drafts fold their norm weights (fold_norms)", flush=True)
    if args.attn_splits:
        from pallas_kernels.decode_attention import mosaic_gpu_ws as ws

        fixed = {v: int(n) for v, _, n in (s.partition("=") for s in args.attn_splits)}
        base = ws.default_ctas

        def default_ctas(batch: int, hkv: int, n_blocks: int, view: str) -> int:
            return min(fixed[view], max(1, n_blocks)) if view in fixed else base(batch, hkv, n_blocks, view)

        ws.default_ctas = default_ctas
        print(f"attention CTAs per (row, KV head): {fixed}", flush=True)
    if args.attn_config:
        from check_attention import parse_configs  # the "FIELD=VALUE,..." syntax of its --mgpu-configs
        from pallas_kernels.decode_attention import mosaic_gpu as amg

        (parsed,) = parse_configs(args.attn_config)
        over = {f.name: (f.type, getattr(parsed, f.name)) for f in dataclasses.fields(parsed)
                if getattr(parsed, f.name) != f.default}
        amg.MgpuConfig = dataclasses.make_dataclass(
            "MgpuConfig", [(k, t, dataclasses.field(default=v)) for k, (t, v) in over.items()],
            bases=(amg.MgpuConfig,), frozen=True)
        print(f"attention MgpuConfig defaults: { {k: v for k, (_, v) in over.items()} }", flush=True)
    if args.linear_config:
        fields = {k: int(v) if v.lstrip("-").isdigit() else v
                  for k, _, v in (f.partition("=") for f in args.linear_config.split(","))}
        base_config = mg.default_config

        def default_config(k, n, group_size, **kw):
            cfg = base_config(k, n, group_size, **kw)
            if args.linear_k not in (0, k):
                return cfg
            epi = kw.get("epilogue")
            if fields.get("diag") in mg.NORM_DIAGNOSTICS and not (epi is not None and epi.norm):
                return cfg.replace(**{f: v for f, v in fields.items() if f != "diag"})  # norm kernels only
            return cfg.replace(**fields)

        mg.default_config = default_config  # the module's own calls look the name up at call time
        print(f"W4A16 launch shapes with {fields} (K {args.linear_k or 'all'})", flush=True)
    if rest and rest[0].endswith(".py"):  # a check script under the same patches (e.g. qkv_cache_gpu.py)
        import runpy

        sys.argv = rest
        try:
            runpy.run_path(rest[0], run_name="__main__")
        except SystemExit as e:
            return int(e.code or 0) if not isinstance(e.code, str) else 1
        return 0
    from qspec_jax.cli import bench

    sys.argv = ["qspec-bench", *rest]
    return bench.main()


if __name__ == "__main__":
    sys.exit(main())
