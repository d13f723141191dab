"""Diff the Mosaic GPU module of a kernel (the decode attention, or an INT4 linear) between two builds, on a machine
without a GPU.

    .venv/bin/python tools/mosaic_module_diff.py BASE_DIR [--batch 8] [--view draft] [--t 1] [--flat 0|1]
    .venv/bin/python tools/mosaic_module_diff.py BASE_DIR --kernel int4 [--m 32] [--k 576] [--n 960] \
        [--epilogue norm|swiglu|residual|plain] [--config k_tile=192,mma_chains=2]

BASE_DIR holds an earlier build's `pallas_kernels/` (e.g. `git archive 178f384 pallas_kernels | tar x -C
BASE_DIR`). Each build's kernel (8B heads, 8k cache) is lowered for CUDA in its own process (`lowering_platforms=
("cuda",)`: no GPU needed), the `mosaic_gpu_v2` custom call's module bytecode decoded and printed in a context
with the Mosaic GPU dialect, SSA names stripped, and the two op sequences diffed (`difflib`). Prints the op counts,
the count of shared-memory views with a runtime offset (`offset: ?`: swizzled addresses computed at run time), and
each differing hunk. How the thirteenth session found the row split's buffer index (docs/kernel_notes.md).
`--kernel int4` lowers `mosaic_gpu.int4_matmul_mgpu` instead (M rows, a [K, N] weight of group 32, the epilogue,
`MgpuConfig` fields as FIELD=INT or FIELD=NAME; a field the base build lacks is an error there): 0 differing hunks
is what a refactor of the kernel's code generation must show (twenty-sixth session: `wgmma_element`).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile

_LOWER = r'''
import dataclasses, sys
import jax, jax.numpy as jnp
from pallas_kernels.decode_attention import mosaic_gpu as mg
from qspec_jax.bench.synthetic import random_quant_cache
from qspec_jax.config import ModelConfig
out, batch, view, t, flat = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
cfg = ModelConfig(vocab_size=8, hidden_size=4096, intermediate_size=8, num_layers=1, num_heads=32, num_kv_heads=8,
                  head_dim=128, dtype="bfloat16")
cache = jax.eval_shape(lambda: random_quant_cache(cfg, batch, 8192, jax.random.PRNGKey(0), layers=1))
fields = {f.name for f in dataclasses.fields(mg.MgpuConfig)}
conf = mg.MgpuConfig(**({"ws_flat": flat == "1"} if "ws_flat" in fields and flat else {}))
q = jax.ShapeDtypeStruct((batch, t, 32, 128), jnp.bfloat16)
qp = jax.ShapeDtypeStruct((batch, t), jnp.int32)
f = jax.jit(lambda q, p, c: mg.quantized_decode_attention_mgpu(q, p, c, 0, view=view, config=conf))
open(out, "w").write(f.trace(q, qp, cache).lower(lowering_platforms=("cuda",)).as_text())
'''

_LOWER_INT4 = r'''
import sys
import jax, jax.numpy as jnp
from pallas_kernels.linear import layout as lay, mosaic_gpu as mg
out, m, k, n, epi, conf = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
fields = {f: int(v) if v.lstrip("-").isdigit() else v for f, _, v in (p.partition("=") for p in conf.split(",") if p)}
cfg = mg.MgpuConfig(**fields) if fields else None
S = jax.ShapeDtypeStruct
w = lay.W4A16Packed(qw=S((n // 64, k // 64, 128, 4), jnp.uint32), sz=S((n // 64, k // 64, 64 * 64 // 32), jnp.uint32),
                    group_size=32)
arrays = {"plain": {}, "norm": {"norm_weight": S((k,), jnp.bfloat16)}, "swiglu": {"norm_weight": S((k,), jnp.bfloat16)},
          "residual": {"residual": S((m, n), jnp.bfloat16)}}[epi]
f = jax.jit(lambda x, w, a: mg.int4_matmul_mgpu(x, w, config=cfg, interpret=False, swiglu=epi == "swiglu", **a))
open(out, "w").write(f.trace(S((m, k), jnp.bfloat16), w, arrays).lower(lowering_platforms=("cuda",)).as_text())
'''


def module_bytes(stablehlo: str) -> bytes:
    """The `module = "..."` attribute of the first mosaic_gpu_v2 custom call, unescaped."""
    i = stablehlo.index('module = "', stablehlo.index("mosaic_gpu_v2")) + len('module = "')
    out, j = bytearray(), i
    simple = {"\\": 92, '"': 34, "n": 10, "t": 9}
    while stablehlo[j] != '"':
        c = stablehlo[j]
        if c != "\\":
            out.extend(c.encode("utf-8"))
            j += 1
        elif stablehlo[j + 1] in simple:
            out.append(simple[stablehlo[j + 1]])
            j += 2
        else:
            out.append(int(stablehlo[j + 1:j + 3], 16))
            j += 3
    return bytes(out)


def op_lines(stablehlo: str) -> list[str]:
    """The kernel module's operations, one line each, SSA names and block labels stripped."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import mosaic_gpu_dialect as mgpu
    from jax._src.lib.mlir import ir

    ctx = jmlir.make_ir_context()
    mgpu.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    with ctx:
        text = ir.Module.parse(module_bytes(stablehlo)).operation.get_asm(large_elements_limit=16)
    lines = []
    for line in text.splitlines():
        t = line.strip()
        if t and not t.startswith("//"):
            lines.append(re.sub(r"\^bb\d+", "^bb", re.sub(r"%[\w#:]+", "%", re.sub(r"loc\(.*\)$", "", t))))
    return lines


def lower(src_dir: str, out: str, args: argparse.Namespace) -> str:
    # locations off: the two builds' source paths and line numbers would differ in every op
    env = dict(os.environ, PYTHONPATH=src_dir, JAX_PLATFORMS="cpu", JAX_TRACEBACK_IN_LOCATIONS_LIMIT="0")
    if args.kernel == "int4":
        cmd = [_LOWER_INT4, out, str(args.m), str(args.k), str(args.n), args.epilogue, args.config]
    else:
        cmd = [_LOWER, out, str(args.batch), args.view, str(args.t), args.flat]
    subprocess.run([sys.executable, "-c", *cmd], cwd=src_dir, env=env, check=True)
    with open(out) as f:
        return f.read()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base_dir", help="a directory holding the earlier build's pallas_kernels/")
    ap.add_argument("--kernel", default="attention", choices=("attention", "int4"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--view", default="draft", choices=("draft", "target"))
    ap.add_argument("--t", type=int, default=1)
    ap.add_argument("--flat", default="0", choices=("", "0", "1"),
                    help="the draft's balanced schedule (MgpuConfig.ws_flat; '' leaves the build's default)")
    ap.add_argument("--m", type=int, default=32, help="int4: rows")
    ap.add_argument("--k", type=int, default=576, help="int4: the weight's K")
    ap.add_argument("--n", type=int, default=960, help="int4: the weight's N")
    ap.add_argument("--epilogue", default="norm", choices=("plain", "norm", "swiglu", "residual"))
    ap.add_argument("--config", default="", help="int4: MgpuConfig fields, FIELD=VALUE,... ('': the default's)")
    ap.add_argument("--hunk-lines", type=int, default=8)
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = os.path.abspath(args.base_dir)
    with tempfile.TemporaryDirectory() as tmp:
        if not os.path.isdir(os.path.join(base, "qspec_jax")):  # its kernels with this checkout's model code
            os.symlink(os.path.join(here, "qspec_jax"), os.path.join(tmp, "qspec_jax"))
            os.symlink(os.path.join(base, "pallas_kernels"), os.path.join(tmp, "pallas_kernels"))
            base = tmp
        ops = {name: op_lines(lower(d, os.path.join(tmp, f"{name}.mlir"), args))
               for name, d in (("base", base), ("new", here))}
    a, b = ops["base"], ops["new"]
    for name, lines in ops.items():
        print(f"{name}: {len(lines)} ops, {sum('offset: ?' in x for x in lines)} with a runtime-offset view")
    hunks = [h for h in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if h[0] != "equal"]
    for tag, i1, i2, j1, j2 in hunks:
        print(f"--- {tag} base[{i1}:{i2}] new[{j1}:{j2}]")
        for x in a[i1:i2][:args.hunk_lines]:
            print("  -", x[:200])
        for x in b[j1:j2][:args.hunk_lines]:
            print("  +", x[:200])
    print(f"{len(hunks)} differing hunks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
