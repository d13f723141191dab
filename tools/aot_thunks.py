"""Compile a decode program for a Hopper GPU on a machine without one, and print the thunks XLA would run.

    /path/to/py312-venv/bin/python tools/aot_thunks.py [--shape smollm2] [--batch 32] [--context 8192] \
        [--programs ar_loop,spec_loop] [--gamma 2] [--dense-matmul mosaic] [--xla NAME=VALUE ...] \
        [--out /tmp/aot_thunks] [--target tools/gpu_specs/h100_sxm.txtpb]

Needs jax 0.11.x with `jax-cuda12-plugin` / `jax-cuda12-pjrt` and `nvidia-cuda-nvcc-cu12` installed (no GPU, no
driver: `jax.experimental.topologies` compiles against the target config's device description). The model's backend
choices (`pallas_kernels.linear.device_arch`, `jax.default_backend`) are pointed at an sm_90 GPU for the trace, so the
programs carry the same Mosaic GPU and Triton custom calls as on the device; the arguments are abstract
(`jax.eval_shape`: random SmolLM2- or 8B-shaped weights, caches of `--context` rows, ragged as the profile's). The
QSPEC_* switches apply as on the device. XLA dumps each program under `--out/<program>` (the optimized HLO, and
`*.thunk_sequence_after_thunk_passes.txt`: the thunks after the command-buffer conversion); the script prints how many
command buffers there are and which thunks run outside them (each such thunk is a launch of its own from the host, per
loop trip inside a loop). `--summarize FILE...` prints the same for dumps made elsewhere (the device stages of
tools/device/h200_state_gpu.sh use it on the GPU's own). What it cannot show: what is decided at run time on the
device (command-buffer updates, trace-cache hits), and cuBLAS's algorithm choices (no autotuning without a device).
Nor which thunks the device's XLA takes into a command buffer where that depends on the CUDA driver: on an H100
(driver 580, jax 0.11.2; kernel_notes, "Fifty-fifth session") cuBLAS on a slice of a stacked weight
(`kDynamicSliceFusion`) and the norms' row copies on a second stream (`kAsyncStart` / `kAsyncDone`) run inside the
layer body's command buffer, where this compile, with no driver, leaves them outside: read its "outside" list for
those as the deviceless compile's, and summarize the device's own dumps (`--summarize`) before concluding.
The script sets JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (the plugin checks the CUDA runtime's version at import, and
nothing runs here).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("smollm2", "llama3-8b"), default="smollm2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--programs", default="ar_loop,spec_loop")
    p.add_argument("--gamma", type=int, default=2)
    p.add_argument("--loop-tokens", type=int, default=16)
    p.add_argument("--dense-matmul", default=None, help="the target's bf16 linears (ModelConfig.dense_matmul_impl)")
    p.add_argument("--target", type=Path, default=ROOT / "tools" / "gpu_specs" / "h100_sxm.txtpb")
    p.add_argument("--out", type=Path, default=Path("/tmp/aot_thunks"))
    p.add_argument("--summarize", type=Path, nargs="+", metavar="THUNKS",
                   help="only print the summary of these dumped `*thunk_sequence_after_thunk_passes.txt` files (e.g. "
                        "a GPU run's, XLA_FLAGS=--xla_dump_to=DIR), compiling nothing")
    p.add_argument("--xla", action="append", default=[], metavar="FLAG=VALUE",
                   help="an XLA debug option for the compile (repeatable; XLA_FLAGS did not reach it in jax "
                        "0.11.2), e.g. xla_gpu_graph_min_graph_size=1")
    return p.parse_args()


def _option(text: str) -> tuple[str, object]:
    """"NAME=VALUE" as a compile option: an int, float or boolean where VALUE reads as one, else the string."""
    name, _, value = text.partition("=")
    name = name.lstrip("-")
    for conv in (int, float):
        try:
            return name, conv(value)
        except ValueError:
            pass
    return name, {"true": True, "false": False}.get(value.lower(), value)


def _summary(path: Path) -> str:
    """The command buffers of a thunk sequence (and how many thunks each holds directly), and the thunks that run
    outside every command buffer, counted by kind and name."""
    lines = path.read_text().splitlines()
    out, kinds_out, n_cb, cb_sizes = [], {}, 0, []
    indent_cb = None
    for line in lines:
        m = re.match(r"^(\s*)\d+: (k[A-Za-z]+)\s*\[.*?\]\s*(.*)$", line)
        if not m:
            continue
        ind, kind, rest = len(m.group(1)), m.group(2), m.group(3)
        if indent_cb is not None and ind <= indent_cb:
            indent_cb = None
        if kind == "kCommandBuffer":
            n_cb += 1
            indent_cb = ind
            cb_sizes.append(0)
            continue
        if indent_cb is not None:
            if ind == indent_cb + 4:
                cb_sizes[-1] += 1
            continue
        name = rest.split(" grid:")[0].strip()[:60]
        kinds_out[(kind, name)] = kinds_out.get((kind, name), 0) + 1
    out.append(f"  command buffers: {n_cb} (thunks directly inside each: {cb_sizes})")
    out.append("  thunks outside command buffers (each a launch of its own, per loop trip inside loops; "
               "nested ones too):")
    for (kind, name), n in sorted(kinds_out.items(), key=lambda kv: -kv[1]):
        out.append(f"    {n:4d}  {kind} {name}".rstrip())
    return "\n".join(out)


def main() -> None:
    args = _args()
    if args.summarize:
        for path in args.summarize:
            print(f"== {path.name}\n{_summary(path)}")
        return
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no CUDA runtime to check: nothing runs here
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    topo = topologies.get_topology_desc("aot", "cuda", target_config=args.target.read_text(), topology="1x1x1")
    dev = topo.devices[0]
    # The model asks the default device what it is; answer "an sm_90 GPU" while tracing.
    jax.default_backend = lambda: "gpu"
    jax.devices = lambda *a, **k: [dev]
    from jax._src.pallas.triton import gpu_info  # Triton's lowering asks the default device's kind

    gpu_info.get_device_kind = lambda: dev.device_kind
    from qspec_jax import model as M
    from qspec_jax.bench import e2e
    from qspec_jax.bench.profile import SHAPES
    from qspec_jax.generation import GenerationConfig, autoregressive_loop
    from qspec_jax.speculative import speculative_loop
    from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

    for mod in list(sys.modules.values()):  # every module of ours that holds `device_arch`, by name or not
        if getattr(mod, "__name__", "").startswith(("pallas_kernels", "qspec_jax")) and hasattr(mod, "device_arch"):
            mod.device_arch = lambda: ("gpu", 9)

    cfg = SHAPES[args.shape][0]
    if args.dense_matmul is not None:
        cfg = cfg.replace(dense_matmul_impl=args.dense_matmul)
    key = jax.random.PRNGKey(0)
    dcfg = DraftWeightsConfig(group_size=32, method="clip")
    params = jax.eval_shape(lambda k: M.init_random_params(cfg, k), key)
    draft = jax.eval_shape(lambda p: M.for_device(make_draft_params(p, dcfg)), params)
    params = jax.eval_shape(M.for_device, params)
    B, c = args.batch, args.context
    lengths = e2e.batch_lengths(B, c)
    dense = jax.eval_shape(lambda k: e2e.random_dense_cache(cfg, B, c, k, lengths), key)
    quant = jax.eval_shape(lambda k: e2e.random_quant_cache(cfg, B, c, k, lengths), key)
    first = jax.ShapeDtypeStruct((B,), jnp.int32)
    sharding = jax.sharding.SingleDeviceSharding(dev)

    def on_dev(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)

    programs = {
        "ar_loop": (lambda p, cch, f, k: autoregressive_loop(
            p, cch, f, k, eos_ids=(), return_cache=True,
            gen=GenerationConfig(max_new_tokens=args.loop_tokens, kv="bf16", width=1)), (params, dense, first, key)),
        "spec_loop": (lambda p, d, cch, f, k: speculative_loop(
            p, d, cch, f, k, eos_ids=(), return_cache=True,
            spec=e2e.loop_spec(args.gamma, max_new_tokens=args.loop_tokens, forced_acceptance=0.9,
                               eos_token_ids=())), (params, draft, quant, first, key)),
    }
    names = args.programs.split(",")
    if unknown := [n for n in names if n not in programs]:
        sys.exit(f"aot_thunks: --programs {','.join(unknown)}: expected some of {', '.join(programs)}")
    for name in names:
        fn, fargs = programs[name]
        out = args.out / name
        out.mkdir(parents=True, exist_ok=True)
        lowered = jax.jit(fn).trace(*on_dev(fargs)).lower(lowering_platforms=("cuda",))
        lowered.compile({"xla_dump_to": str(out), "xla_dump_hlo_as_text": True, **dict(map(_option, args.xla))})
        seqs = sorted(out.glob("*thunk_sequence_after_thunk_passes.txt"), key=lambda p: -p.stat().st_size)
        switches = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("QSPEC_"))
        print(f"== {name} (dense linears {cfg.dense_matmul_impl}; {switches or 'no QSPEC_ switches'}): "
              f"{seqs[0].name if seqs else 'no dump'}")
        if seqs:
            print(_summary(seqs[0]))


if __name__ == "__main__":
    main()
