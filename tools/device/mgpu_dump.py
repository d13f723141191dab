"""Dump and summarize what the compiler emitted for the Mosaic GPU decode-attention kernels.

    PYTHONPATH=. python3 tools/device/mgpu_dump.py OUT_DIR [--schedule legacy|ws] [--cases draft:1,target:5] [--flat]
        [--batch B] [--live 0|1] [--regs C/P/T] [--diag D] [--pipeline 0|1] [--shape smollm2] [--kernel-merge]

Compiles the INT4 draft (T=1) and INT8 target (T=5) kernels (or --cases) at the Llama-3-8B shape
with MOSAIC_GPU_DUMP_TO set, without running them, then prints per kernel: ptxas registers/spills
and the count of each SASS opcode (HGMMA present? PRMT/LOP3 per converted word? LDS/STS, SHFL,
BAR, MUFU). Copies the SASS of the kernels to OUT_DIR. --live 0|1 sets MgpuConfig.ws_live_cols for every
case, --regs / --diag / --pipeline its ws_regs / ws_diag / ws_pipeline (docs/kernel_notes.md, fourteenth and
fifteenth sessions: ptxas's C7511 with and without the live columns); --shape smollm2 the
real model's heads (9 q, 3 KV, D 64) instead of the 8B's; --kernel-merge the row split with the split merge
in the kernel (`MgpuConfig.ws_kernel_merge`).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import shutil
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="mgpu_dump_")
os.environ["MOSAIC_GPU_DUMP_TO"] = DUMP

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from sass_of_ptx import sass_of_ptx  # noqa: E402


def main(out_dir: str, schedule: str | None = None, cases: str = "draft:1,target:5", consumers: int | None = None,
         preps: int | None = None, flat: bool = False, batch: int = 1, live: int | None = None,
         regs: tuple[int, int, int] | None = None, diag: str | None = None, pipeline: bool | None = None,
         shape: str = "llama3-8b", kernel_merge: bool = False) -> int:
    from pallas_kernels.decode_attention import mosaic_gpu as mg
    from qspec_jax.bench.synthetic import attention_config, random_quant_cache

    hq, hkv, d = (9, 3, 64) if shape == "smollm2" else (32, 8, 128)
    cfg = attention_config(hq, hkv, d)
    cache = random_quant_cache(cfg, batch, 8192, jax.random.PRNGKey(0), layers=1)
    conf = mg.MgpuConfig(schedule=schedule, ws_consumers=consumers, ws_preps=preps,
                         ws_flat=False if kernel_merge else flat or None,
                         ws_live_cols=None if live is None else bool(live), ws_regs=regs, ws_diag=diag,
                         ws_pipeline=pipeline, ws_kernel_merge=kernel_merge or None)
    for case in cases.split(","):
        view, t = case.split(":")
        t = int(t)
        q = jnp.ones((batch, t, hq, d), jnp.bfloat16)
        qp = (cache.q_len + cache.fp_len)[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
        jax.jit(lambda q, p, c, v=view: mg.quantized_decode_attention_mgpu(q, p, c, 0, view=v, config=conf)).lower(
            q, qp, cache).compile()
    os.makedirs(out_dir, exist_ok=True)
    files = sorted(glob.glob(os.path.join(DUMP, "*")))
    print("dumped:", [os.path.basename(f) for f in files])
    for f in files:
        if f.endswith(".ptxas"):
            print(f"== {os.path.basename(f)}")
            print(open(f).read()[-1500:])
    sass_files = [f for f in files if f.endswith(".sass")]
    for f in files:  # no nvdisasm next to the pip CUDA: assemble the PTX with the system toolkit
        if f.endswith(".ptx") and not any(x.startswith(f[:-4]) for x in sass_files):
            sass, report = sass_of_ptx(f)
            print(f"== ptxas {os.path.basename(f)}: {report[-600:]}")
            sass_files.append(sass)
            shutil.copy(f, os.path.join(out_dir, os.path.basename(f)))
    for f in sass_files:
        txt = open(f).read()
        ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(
            r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", txt))
        print(f"== {os.path.basename(f)}: {sum(ops.values())} instructions")
        print("  " + ", ".join(f"{k} {v}" for k, v in ops.most_common(40)))
        shutil.copy(f, os.path.join(out_dir, os.path.basename(f)))
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", nargs="?", default=".")
    ap.add_argument("--schedule", default=None)
    ap.add_argument("--cases", default="draft:1,target:5")
    ap.add_argument("--consumers", type=int, default=None, help="ws: consumer warpgroups (MgpuConfig.ws_consumers)")
    ap.add_argument("--preps", type=int, default=None, help="ws: prep warpgroups (MgpuConfig.ws_preps)")
    ap.add_argument("--flat", action="store_true", help="ws, draft view: the balanced schedule (MgpuConfig.ws_flat)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--live", type=int, choices=(0, 1), default=None, help="MgpuConfig.ws_live_cols")
    ap.add_argument("--regs", default=None, help="MgpuConfig.ws_regs as C/P/T, e.g. 216/56/24")
    ap.add_argument("--diag", default=None, help="MgpuConfig.ws_diag (e.g. and_or)")
    ap.add_argument("--pipeline", type=int, choices=(0, 1), default=None, help="MgpuConfig.ws_pipeline")
    ap.add_argument("--shape", choices=("llama3-8b", "smollm2"), default="llama3-8b")
    ap.add_argument("--kernel-merge", action="store_true", help="MgpuConfig.ws_kernel_merge (the row split)")
    a = ap.parse_args()
    sys.exit(main(a.out_dir, a.schedule, a.cases, a.consumers, a.preps, a.flat, a.batch, a.live,
                  None if a.regs is None else tuple(int(x) for x in a.regs.split("/")), a.diag,
                  None if a.pipeline is None else bool(a.pipeline), a.shape, a.kernel_merge))
