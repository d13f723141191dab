"""Small helpers shared by the Pallas kernels."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax


def interpret_default(interpret: bool | None) -> bool:
    """None means: interpret mode (CPU) unless the default backend is a GPU."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


def interpret_params() -> Any:
    """Mosaic GPU interpret-mode parameters (CPU): out-of-bounds TMA reads give NaN instead of the
    hardware's zeros, so padding rows that leaked into a stored row would show."""
    try:
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams  # jax >= 0.11
    except ImportError:  # jax 0.10
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(out_of_bounds_reads="uninitialized")


def num_sms() -> int:
    """Streaming multiprocessors of the first GPU (132 on an H100 SXM when unknown)."""
    try:
        dev = jax.devices()[0]
        n = getattr(dev, "core_count", None)
        if dev.platform == "gpu" and n:
            return int(n)
    except Exception:  # pragma: no cover - no devices
        pass
    return 132


def device_kind() -> str:
    """The first device's kind ("NVIDIA H100 80GB HBM3", ...); "" off the GPU."""
    try:
        dev = jax.devices()[0]
        return str(dev.device_kind) if dev.platform == "gpu" else ""
    except Exception:  # pragma: no cover - no devices
        return ""


@functools.cache
def _load_idx_optional() -> bool:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return inspect.signature(plgpu.load).parameters["idx"].default is not inspect.Parameter.empty


def load_with_layout(ref, layout, optimized: bool = True):
    """Mosaic GPU: a whole ref loaded in `layout` (plgpu.load's index became optional in jax 0.11);
    optimized=False for global memory, which has no optimized transfer into a WGMMA layout."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if _load_idx_optional():
        return plgpu.load(ref, layout=layout, optimized=optimized)
    return plgpu.load(ref, (), layout=layout, optimized=optimized)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# --------------------------------------------------------------------------- Mosaic GPU inline pieces
def mlir_modules() -> tuple:
    """(ir, arith, llvm, memref, fragmented_array, mosaic gpu utils): the MLIR modules the inline
    Mosaic GPU helpers build with (jax.extend.mlir has no llvm dialect)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu
    return ir, arith, llvm, memref, fa, mu


def thread0_asm(body: str, regs: str = "") -> str:
    """Inline PTX for `ptx` that runs `body` on thread 0 of the calling warpgroup: a scope declaring
    .pred p (set on thread 0, i.e. %tid.x mod 128 == 0) and .u32 t (%tid.x mod 128, free to reuse once p
    is set), then the extra declarations `regs` (".reg .u32 v;\n"); `body`'s instructions carry `@p`
    themselves (it may branch on `@!p` instead)."""
    return ("{\n.reg .pred p;\n.reg .u32 t;\n" + regs + "mov.u32 t, %tid.x;\nand.b32 t, t, 127;\n"
            "setp.eq.u32 p, t, 0;\n" + body + "}")


def ptx(asm: str, *refs: Any, ints: tuple[int, ...] = (), shared: tuple[int, ...] = ()) -> None:
    """Mosaic GPU: inline PTX `asm` (side effects only) with operands $0.. the addresses of `refs`
    (64-bit global, or 32-bit shared for the positions in `shared`), then the int32 constants `ints`."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * len(refs))
    def fn(ctx, *mrefs):
        del ctx
        ir, arith, llvm, _, _, mu = mlir_modules()
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        ops = [llvm.ptrtoint(i32 if k in shared else i64, mu.memref_ptr(mr)) for k, mr in enumerate(mrefs)]
        ops += [arith.constant(i32, v) for v in ints]
        cons = ["r" if k in shared else "l" for k in range(len(refs))] + ["r"] * len(ints)
        llvm.inline_asm(ir.Type.parse("!llvm.void"), ops, asm, ",".join(cons), has_side_effects=True)

    fn(*refs)


def tile_access(mp: int, store: bool):
    """Mosaic GPU inline function over a 2-D global ref [R, C] and WGMMA-layout [64, mp] int32 arrays
    (row, col) with a validity mask: store=True, (vals float32, row, col, ok, ref) ->
    ref[row, col] = ref.dtype(vals) where ok; store=False, (row, col, ok, ref) -> float32 values
    ref[row, col] where ok, else 0. Each thread its own elements (a few per thread at decode
    sizes; plain global loads and stores, no shared memory)."""
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas import mosaic_gpu as plgpu

    wg = plgpu.Layout.WGMMA
    types = ((wg,) if store else ()) + (wg, wg, wg, plgpu.RefType())
    ret = None if store else plgpu.ShapeDtypeStruct((64, mp), jnp.float32, layout=wg)

    @plgpu.inline_mgpu(arg_types=types, return_type=ret)
    def fn(ctx, *args):
        del ctx
        ir, arith, llvm, memref, fa, _ = mlir_modules()
        from jax._src.lib.mlir.dialects import scf, vector
        index, i32, f32 = ir.IndexType.get(), ir.IntegerType.get_signless(32), ir.F32Type.get()
        vals, (rows, cols, oks, ref) = (args[0], args[1:]) if store else (None, args)
        elt = ir.MemRefType(ref.type).element_type
        zero_i, zero_f = arith.constant(i32, 0), arith.constant(f32, 0.0)
        regs = rows.registers.flat
        out = []
        for n, (rreg, creg, oreg) in enumerate(zip(regs, cols.registers.flat, oks.registers.flat)):
            width = ir.VectorType(rreg.type).shape[0]
            acc = llvm.mlir_undef(ir.VectorType.get((width,), f32))
            for e in range(width):
                get = lambda reg: vector.extract(reg, dynamic_position=[], static_position=[e])  # noqa: E731
                ok = arith.cmpi(arith.CmpIPredicate.ne, get(oreg), zero_i)
                if store:
                    branch = scf.IfOp(ok)
                    with ir.InsertionPoint(branch.then_block):
                        idx = [arith.index_cast(index, get(rreg)), arith.index_cast(index, get(creg))]
                        v = get(vals.registers.flat[n])
                        memref.store(arith.truncf(elt, v) if elt != f32 else v, ref, idx)
                        scf.yield_([])
                    continue
                # a load: row 0 where not ok (always in bounds), the value replaced by 0
                row = arith.select(ok, get(rreg), zero_i)
                v = memref.load(ref, [arith.index_cast(index, row), arith.index_cast(index, get(creg))])
                v = arith.extf(f32, v) if elt != f32 else v
                acc = llvm.insertelement(acc, arith.select(ok, v, zero_f), arith.constant(i32, e))
            out.append(acc)
        if store:
            return None
        regs_out = np.asarray(out, dtype=object).reshape(rows.registers.shape)
        return fa.FragmentedArray(_registers=regs_out, _layout=rows.layout, _is_signed=None)

    return fn
