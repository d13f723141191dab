"""The fused INT4 kernels of issue 32 (`mosaic_gpu.Epilogue`: RMSNorm, SiLU(gate)·up and the
residual add inside the Mosaic W4A16 kernel) on the CPU: the SMEM twin in GPU interpret mode
against `epilogue_reference` on fixed and random shapes, bitwise row invariance, the producer's
pair addressing against the swizzled x tile, launch shapes, bad inputs, CUDA lowering under jax
0.10 and 0.11 and the inline PTX through ptxas. tools/device/check_w4a16.py runs the register
kernels on the GPU.

The interpret-mode runs happen in a child process with 8 host devices (`_child`,
`tests/helpers/subproc.run_in_child` says why: with one host device the simulation of three
warpgroups can deadlock on a 2-core machine). ~5-10 s per kernel call.
"""

import functools
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels.linear as plinear
from pallas_kernels.linear import layout as lay
from pallas_kernels.linear import mosaic_gpu as mg


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HERE = Path(__file__).parent
subproc = _load("subproc", HERE / "helpers" / "subproc.py")
base = _load("w4a16_mgpu_tests", HERE / "test_w4a16_mgpu.py")  # shared helpers (weights, x, swizzle image)
_qweight, _x, _rel = base._qweight, base._x, base._rel
_swizzled_x_image, _rows_are_independent, LLAMA, SMOL = (base._swizzled_x_image, base._rows_are_independent,
                                                          base.LLAMA, base.SMOL)

pytestmark = pytest.mark.usefixtures("reuse_interpreter_programs")  # conftest: GPU interpret mode, faster


def _child(fn: str, *args) -> None:
    """`fn(*args)` of this module in a child with 8 host devices (the module docstring says why)."""
    subproc.run_in_child(__file__, fn, *args)


def _fused_case(seed: int, m: int, k: int, n: int, g: int, lead: tuple[int, ...] = ()):
    """A packed weight, x, a norm weight near 1 and a residual for the fused-kernel tests."""
    rng = np.random.default_rng(seed + 1000)
    p = lay.pack_quantized(_qweight(seed, lead, k, n, g))
    gw = jnp.asarray(1.0 + 0.3 * rng.standard_normal((*lead, k)).astype(np.float32)).astype(jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((m, n)).astype(np.float32)).astype(jnp.bfloat16)
    return p, _x(seed + 2, m, k), gw, res


def _epi_kwargs(epi: mg.Epilogue, gw, res) -> dict:
    return dict(norm_weight=gw if epi.norm and epi.gain else None, unit_norm=epi.norm and not epi.gain,
                swiglu=epi.swiglu, residual=res if epi.residual else None, row_sums=epi.row_sums)


def _check_fused(seed: int, m: int, g: int, kt: int, wgs: int, splits: int, epi: mg.Epilogue, nt: int = 1,
                 reduce: str = "gmem", k_groups: int = 1) -> None:
    """The interpret-mode twin with epilogue `epi` against `epilogue_reference` on the kernel's own
    bf16 weight: float32 outputs to 1e-5 (only float32 summation order differs); a residual,
    added in bf16, against the unfused kernel's output plus the residual, bit for bit (and its rows'
    sums of squares, `Epilogue.row_sums`, against `chunk_row_sums` of that output); a norm
    without weight (`Epilogue.gain` False), against the kernel given a weight of ones, to float32
    rounding (bit for bit on the GPU)."""
    k, n = 2 * splits * max(kt, g), 64 * wgs * nt
    p, x, gw, res = _fused_case(seed, m, k, n, g)
    cfg = mg.MgpuConfig(wgs=wgs, k_tile=max(kt, g), splits=splits, stages=2 * k_groups, reduce=reduce,
                        k_groups=k_groups)
    wb = lay.dequantize_bf16(p).astype(jnp.float32)
    run = functools.partial(mg.int4_matmul_mgpu, x, p, config=cfg, variant="smem", interpret=True)
    if epi.residual:
        y = run(**_epi_kwargs(epi, gw, res))
        if epi.row_sums:  # the output rows' sums of squares per 64-column tile, to float32 rounding
            y, sums = y
            assert sums.shape == (n // 64, mg.rows_for(m)) and sums.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(sums), np.asarray(mg.chunk_row_sums(y, mg.rows_for(m))),
                                       rtol=1e-6, atol=0)
            assert not np.asarray(sums)[:, m:].any(), "rows past M must sum to 0"
        y = np.asarray(y)
        plain = run(**_epi_kwargs(epi.replace(residual=False, row_sums=False), gw, res))
        np.testing.assert_array_equal(y.view(np.uint16), np.asarray(plain + res).view(np.uint16))
        ref = mg.epilogue_reference(x, wb, epi.replace(row_sums=False), norm_weight=gw, residual=res)
        assert _rel(y, np.asarray(ref, np.float64)) < 1e-2  # bf16 output roundings
        return
    y = np.asarray(run(out_dtype=jnp.float32, **_epi_kwargs(epi, gw, res)))
    assert y.shape == (m, n // 2 if epi.swiglu else n) and not np.isnan(y).any(), "unwritten output elements"
    ref = np.asarray(mg.epilogue_reference(x, wb, epi, norm_weight=gw, out_dtype=jnp.float32), np.float64)
    assert _rel(y, ref) < 1e-5
    if epi.norm and not epi.gain:  # no weight is a weight of ones: x g = x exactly, the rest is the same math
        gw = jnp.ones_like(gw)
        ones = np.asarray(run(out_dtype=jnp.float32, **_epi_kwargs(epi.replace(gain=True), gw, res)))
        # to float32 rounding, not bit for bit: the twin's row sums are jnp reductions whose order XLA:CPU picks per
        # program (a program with g fuses them differently); the GPU kernels' bitwise equality is checked on the
        # device (tools/device/norm_consumers_gpu.py)
        np.testing.assert_allclose(y, ones, rtol=1e-6, atol=0)
    if epi.norm:  # against the model's unfused math: RMSNorm in bf16, then the product
        xf = np.asarray(x, np.float64)
        h = (xf / np.sqrt(np.mean(xf ** 2, axis=-1, keepdims=True) + epi.eps)) * np.asarray(gw, np.float64)
        full = h @ np.asarray(wb, np.float64)
        if epi.swiglu:
            gate, up = np.split(full, 2, axis=-1)
            full = gate / (1 + np.exp(-gate)) * up
        assert _rel(y, full) < 2e-2


def _epi(name: str) -> mg.Epilogue:
    """"unorm": the norm without weight (`Epilogue.gain` False)."""
    return mg.Epilogue(norm="norm" in name, gain="unorm" not in name, swiglu="swiglu" in name, residual="res" in name,
                       row_sums="sums" in name)


def _check_fused_named(seed, m, g, kt, wgs, splits, name, nt=1) -> None:
    _check_fused(seed, m, g, kt, wgs, splits, _epi(name), nt=nt)


@pytest.mark.parametrize("m,g,kt,wgs,splits,name", [
    (5, 32, 128, 1, 1, "norm"), (13, 64, 256, 2, 1, "norm"), (3, 32, 128, 2, 1, "norm+swiglu"),
    (1, 128, 128, 2, 1, "swiglu"), (5, 32, 64, 1, 2, "res"), (9, 64, 128, 2, 1, "res"), (2, 32, 64, 1, 1, "norm+res"),
    (32, 32, 128, 2, 1, "norm+swiglu"),  # M_pad 32: the wide exchange's shapes (its layouts are GPU-only)
    (5, 32, 128, 1, 1, "unorm"), (3, 64, 128, 2, 1, "unorm+swiglu"),  # the norm without weight
    # the output rows' sums of squares: in the kernel (one split, two warpgroups: each its tile), and by XLA
    (9, 32, 128, 2, 1, "res+sums"), (32, 32, 64, 1, 1, "res+sums"), (5, 32, 64, 1, 2, "res+sums"),
])
def test_fused_twin_matches_reference(m, g, kt, wgs, splits, name):
    _child("_check_fused_named", 21, m, g, kt, wgs, splits, name)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 1000), m=st.integers(1, mg.MAX_FUSED_M), g=st.sampled_from([32, 64, 128]),
       kt=st.sampled_from([64, 128, 256]),
       name=st.sampled_from(["norm", "norm+swiglu", "res", "norm+res", "unorm", "unorm+swiglu", "res+sums"]),
       nt=st.integers(1, 2))
def test_fused_twin_random_shapes(seed, m, g, kt, name, nt):
    """Random shapes and epilogues (each new shape compiles the interpreted kernel anew)."""
    _child("_check_fused_named", seed, m, g, kt, 2 if "swiglu" in name else 1, 1, name, nt)


def test_fused_stacked_norm_weight_follows_the_layer():
    """A stacked weight and norm weight [L, ...] are read at `layer` (a traced index) in place."""
    _child("_case_stacked")


def _case_stacked() -> None:
    p, x, gw, _ = _fused_case(31, 4, 128, 256, 32, lead=(3,))
    cfg = mg.MgpuConfig(wgs=2, k_tile=64, splits=1, stages=2)
    f = jax.jit(lambda x, i: mg.int4_matmul_mgpu(x, p, layer=i, config=cfg, variant="smem", interpret=True,
                                                out_dtype=jnp.float32, norm_weight=gw, swiglu=True))
    epi = mg.Epilogue(norm=True, swiglu=True)
    for i in (2, 0):
        pi = lay.W4A16Packed(qw=p.qw[i], sz=p.sz[i], group_size=32)
        ref = mg.epilogue_reference(x, lay.dequantize_bf16(pi).astype(jnp.float32), epi, norm_weight=gw[i],
                                    out_dtype=jnp.float32)
        assert _rel(f(x, jnp.int32(i)), np.asarray(ref, np.float64)) < 1e-5


def test_sem_split_sum_matches_gmem_bitwise():
    """reduce="sem" (the last split of each column tile adds the others' partials from global
    memory) gives the bits of the XLA sum of the same splits ("gmem": same order of additions),
    plain and with the residual, at plain and wide row counts; and runs SiLU·up and the norm (the
    splits' row sums x^2 added the same way) on its sums, against `epilogue_reference`."""
    _child("_case_sem")


def test_k_groups_run_every_epilogue():
    """`MgpuConfig.k_groups` = 2 (two warpgroups per row tile, their partials added in the CTA
    before everything else): the norm, SiLU·up (warpgroups 0 and 1 of group 0 pair), the residual
    (bitwise the plain kernel's output plus the residual), and after the "sem" split sum, against
    `epilogue_reference`."""
    _child("_case_k_groups")


def _case_k_groups() -> None:
    for seed, m, g, kt, wgs, splits, name, red in ((51, 3, 32, 64, 2, 1, "norm+swiglu", "gmem"),
                                                  (52, 5, 32, 64, 1, 1, "norm", "gmem"),
                                                  (53, 2, 64, 64, 1, 2, "res", "sem"),
                                                  (54, 32, 32, 64, 2, 1, "norm+swiglu", "gmem")):
        _check_fused(seed, m, g, kt, wgs, splits, _epi(name), reduce=red, k_groups=2)


def _case_sem() -> None:
    for m, g, kt, wgs, splits, epi, nt in ((3, 32, 64, 1, 2, "", 2), (5, 32, 64, 2, 3, "res", 1),
                                           (40, 32, 64, 1, 4, "res", 1)):
        k, n = splits * 2 * max(kt, g), 64 * wgs * nt
        p, x, _, res = _fused_case(m + splits, m, k, n, g)
        ys = [np.asarray(mg.int4_matmul_mgpu(
            x, p, config=mg.MgpuConfig(wgs=wgs, k_tile=max(kt, g), splits=splits, stages=2, reduce=red),
            variant="smem", interpret=True, residual=res if epi else None)).view(np.uint16) for red in ("gmem", "sem")]
        np.testing.assert_array_equal(ys[0], ys[1])
    for seed, m, g, kt, wgs, splits, name in ((34, 16, 64, 128, 2, 2, "swiglu"), (35, 5, 32, 64, 1, 3, "norm"),
                                              (36, 13, 64, 128, 2, 2, "norm+swiglu"), (37, 40, 32, 64, 1, 2, "norm+res")):
        _check_fused(seed, m, g, kt, wgs, splits, _epi(name), reduce="sem")
    assert mg.epilogue_allows(mg.Epilogue(norm=True, swiglu=True), 2, 4, "sem")
    assert not mg.epilogue_allows(mg.Epilogue(norm=True), 2, 4, "gmem")


@pytest.mark.parametrize("name", ["norm+swiglu", "res"])
def test_fused_rows_are_independent_bitwise(name):
    _child("_case_rows", name)


def _case_rows(name: str) -> None:
    epi = _epi(name)
    p, _, gw, _ = _fused_case(41, 13, 128, 256, 32)
    cfg = mg.MgpuConfig(wgs=2, k_tile=64, splits=1, stages=2)
    rng = np.random.default_rng(5)
    res_rows = jnp.asarray(rng.standard_normal((13, 256)).astype(np.float32)).astype(jnp.bfloat16)

    def call(x):  # a row's residual is that row's: fixed per row content (its first element's bits)
        res = res_rows[np.asarray(x[:, 0]).view(np.uint16) % 13] if epi.residual else None
        return mg.int4_matmul_mgpu(x, p, config=cfg, variant="smem", interpret=True,
                                   **_epi_kwargs(epi, gw, res))

    _rows_are_independent(call, 128)


def test_norm_pair_offsets_address_the_swizzled_tile():
    """The producer's pair addresses (static row part + per-thread part, as `_norm_stage` adds
    them) hold x[r, 2q : 2q + 2] in the TMA image of the stage's x tile."""
    for kt, mp in ((64, 8), (128, 16), (256, 24)):
        x = np.asarray(_x(kt + mp, mp, kt))
        img = _swizzled_x_image(x, kt)
        for r in range(mp):
            for q in range(kt // 2):
                off = mg.norm_pair_offset(r, q, kt)
                assert off == mg.norm_row_offset(r, kt) + mg.norm_lane_offset(q, r % 8)
                assert img[off:off + 4].tobytes() == x[r, 2 * q:2 * q + 2].tobytes(), (kt, r, q)


def test_norm_lookahead_keeps_the_bits():
    """The producer's norm pass `norm_ahead` steps ahead of the consumers (1, 2, 3, and 9 clamped
    to stages - 1) over 4 K steps in 4 stages: the same bits (interpret twin: the prologue's and
    the loop's pass order; 0 is refused). Interpret mode wants every phase of a barrier a thread
    waits on observed by it, which a producer refilling fewer slots than the consumers release
    does not do: with refills (steps > stages) the lookahead runs on the GPU only
    (tools/device/check_w4a16.py time_fused compares its bits there)."""
    _child("_case_lookahead")


def _case_lookahead() -> None:
    p, x, gw, _ = _fused_case(7, 5, 256, 128, 32)
    outs = []
    for ahead in (1, 2, 3, 9):
        cfg = mg.MgpuConfig(wgs=2, k_tile=64, stages=4, norm_ahead=ahead)
        outs.append(np.asarray(mg.int4_matmul_mgpu(x, p, config=cfg, variant="smem", interpret=True, norm_weight=gw,
                                                   swiglu=True, out_dtype=jnp.float32)))
    assert not np.isnan(outs[0]).any()
    for o in outs[1:]:
        np.testing.assert_array_equal(o.view(np.uint32), outs[0].view(np.uint32))
    with pytest.raises(ValueError, match="norm_ahead"):
        mg.int4_matmul_mgpu(x, p, config=mg.MgpuConfig(wgs=2, k_tile=64, norm_ahead=0), variant="smem",
                            interpret=True, norm_weight=gw)


def test_norm_threads_cover_every_pair_once():
    """The producer's norm pass: over its 128 threads every (row < M, pair < KT / 2) is handled
    exactly once, a warp's 32 threads share their row (one 128-byte tile row per load), and the
    kernel's split of a row's address (static `norm_row_offset(R j)` + 128 x the thread's row
    lane) is the row's offset."""
    for kt in (64, 128, 256):
        lanes = mg.norm_row_lanes(kt)
        for m in (1, 3, 5, 8, 13, 32, 37, 64):
            seen = set()
            for t in range(128):
                q, rows = mg.norm_thread_rows(t, m, kt)
                assert q < kt // 2 and all(r < m for r in rows)
                seen |= {(r, q) for r in rows}
                warp0 = mg.norm_thread_rows(32 * (t // 32), m, kt)[1]
                assert rows == warp0
            assert seen == {(r, q) for r in range(m) for q in range(kt // 2)}, (kt, m)
        for r0 in range(0, 64, lanes):
            for lr in range(lanes):
                assert mg.norm_row_offset(r0, kt) + 128 * lr == mg.norm_row_offset(r0 + lr, kt)
    with pytest.raises(ValueError, match="k_tile"):
        mg.norm_row_lanes(512)


def test_consumer_row_sums_cover_every_column_once():
    """The consumers' x^2 sums (`norm_in_consumers`): the columns `fragment_sum_plan` gives a lane's
    chain are what its `ldmatrix.x4` registers hold in the TMA image of the stage's x tile (register
    t of the load for steps j, j + 1: matrix t, addressed by lane 8 t + row), the four lanes of a quad
    cover each column of their row exactly once (lo and hi of each pair), and the lanes each thread
    takes its two accumulator columns 2 (lane % 4) + e from hold exactly those activation rows."""
    for kt, mp in ((64, 8), (128, 16), (256, 24)):
        x = np.asarray(_x(kt + mp, mp, kt))
        img = _swizzled_x_image(x, kt)
        for ct in range(mp // 8):
            for row in range(8):
                seen = []
                for lane in range(4 * row, 4 * row + 4):
                    r, cols, _ = mg.fragment_sum_plan(lane, kt)
                    assert r == row
                    seen += [c for c0 in cols for c in (c0, c0 + 1)]
                    for i, c0 in enumerate(cols):  # i = 8 kb + 4 (j // 2) + t
                        kb, j, t = i // 8, 2 * ((i % 8) // 4), i % 4
                        off = mg.x_fragment_offset(ct, kb, j, 8 * t + row, kt) + 4 * (lane % 4)
                        assert img[off:off + 4].tobytes() == x[8 * ct + row, c0:c0 + 2].tobytes(), (kt, lane, i)
                assert sorted(seen) == list(range(kt)), (kt, row)
    for lane in range(32):
        for e, src in enumerate(mg.fragment_sum_plan(lane, 64)[2]):
            assert 0 <= src < 32 and mg.fragment_sum_plan(src, 64)[0] == 2 * (lane % 4) + e


def test_norm_runs_in_the_consumers_for_small_k(monkeypatch):
    """`norm_in_consumers`: the "mma" variant on the GPU with the norm, one split, one k group and K up to
    CONSUMER_NORM_MAX_K (SmolLM2's 576); the 8B's K 4096, split or grouped sums, the other variants,
    interpret mode and QSPEC_W4A16_NORM_PASS=1 keep the producer's pass; a bad switch value is refused, and
    so is a timing diagnostic of its parts where it does not run."""
    norm = mg.Epilogue(norm=True)
    on = dict(epi=norm, kind="int4", variant="mma", interpret=False, k=576, splits=1, k_groups=1)
    monkeypatch.delenv("QSPEC_W4A16_NORM_PASS", raising=False)
    assert mg.norm_in_consumers(**on)
    assert mg.norm_in_consumers(**{**on, "epi": mg.Epilogue(norm=True, swiglu=True)})
    assert mg.norm_in_consumers(**{**on, "k": mg.CONSUMER_NORM_MAX_K})
    for off in (dict(k=4096), dict(splits=2), dict(k_groups=2), dict(interpret=True), dict(variant="wgmma"),
                dict(variant="smem"), dict(kind="bf16"), dict(epi=mg.Epilogue(residual=True))):
        assert not mg.norm_in_consumers(**{**on, **off}), off
    monkeypatch.setenv("QSPEC_W4A16_NORM_PASS", "1")
    assert not mg.norm_in_consumers(**on)
    monkeypatch.delenv("QSPEC_W4A16_NORM_PASS")
    x, gw = _x(3, 4, 128), jnp.ones((128,), jnp.bfloat16)
    p = lay.pack_quantized(_qweight(3, (), 128, 64, 32))
    for d in mg.NORM_DIAGNOSTICS:  # its timing diagnostics need it (interpret mode keeps the pass)
        with pytest.raises(ValueError, match=f"diag='{d}' leaves out a part of the norm in the consumers"):
            mg.int4_matmul_mgpu(x, p, norm_weight=gw, config=mg.MgpuConfig(wgs=1, k_tile=64, diag=d),
                                variant="smem", interpret=True)
    monkeypatch.setenv("QSPEC_W4A16_NORM_PASS", "yes")
    with pytest.raises(ValueError, match="QSPEC_W4A16_NORM_PASS"):
        mg.norm_in_consumers(**on)


def test_default_config_honours_the_epilogue():
    for k, n in LLAMA[:4] + SMOL[:4]:
        for epi in (mg.Epilogue(norm=True), mg.Epilogue(norm=True, swiglu=True), mg.Epilogue(residual=True)):
            if epi.swiglu and n % 128:
                continue
            for reduce in ("gmem", "cluster"):
                cfg = mg.default_config(k, n, 32, num_sms=132, reduce=reduce, epilogue=epi)
                assert mg.epilogue_allows(epi, cfg.wgs, cfg.splits, cfg.reduce)
                assert not epi.swiglu or cfg.wgs == 2
                assert reduce == "cluster" or not (epi.norm or epi.swiglu) or cfg.splits == 1
    # the 8B draft shapes keep their measured default launch shapes
    for k, n, epi in ((4096, 6144, mg.Epilogue(norm=True)), (4096, 28672, mg.Epilogue(norm=True, swiglu=True)),
                      (4096, 4096, mg.Epilogue(residual=True)), (14336, 4096, mg.Epilogue(residual=True))):
        assert mg.default_config(k, n, 32, num_sms=132, epilogue=epi) == mg.default_config(k, n, 32, num_sms=132)


def test_fused_bad_inputs_raise():
    p, x, gw, res = _fused_case(51, 3, 256, 128, 64)
    kw = dict(variant="smem", interpret=True)
    with pytest.raises(ValueError, match="M=65 rows"):
        mg.int4_matmul_mgpu(_x(1, 65, 256), p, norm_weight=gw, **kw)
    with pytest.raises(ValueError, match="norm_weight"):
        mg.int4_matmul_mgpu(x, p, norm_weight=gw.astype(jnp.float32), **kw)
    with pytest.raises(ValueError, match="norm_weight"):
        mg.int4_matmul_mgpu(x, p, norm_weight=gw[:128], **kw)
    with pytest.raises(ValueError, match="layer="):
        mg.int4_matmul_mgpu(x, p, norm_weight=jnp.stack([gw, gw]), **kw)
    with pytest.raises(ValueError, match="swiglu"):
        mg.int4_matmul_mgpu(x, lay.pack_quantized(_qweight(52, (), 256, 64, 64)), swiglu=True, **kw)
    with pytest.raises(ValueError, match="swiglu"):
        mg.int4_matmul_mgpu(x, p, swiglu=True, residual=res[:, :64], **kw)
    with pytest.raises(ValueError, match="residual"):
        mg.int4_matmul_mgpu(x, p, residual=res[:2], **kw)
    with pytest.raises(ValueError, match="residual"):
        mg.int4_matmul_mgpu(x, p, residual=res.astype(jnp.float32), **kw)
    with pytest.raises(ValueError, match="whole K"):  # partials summed by XLA: no row scale in the kernel
        mg.int4_matmul_mgpu(x, p, norm_weight=gw, config=mg.MgpuConfig(wgs=1, k_tile=64, splits=2), **kw)
    with pytest.raises(ValueError, match="whole K"):
        mg.int4_matmul_mgpu(x, p, swiglu=True, config=mg.MgpuConfig(wgs=1, k_tile=64), **kw)
    # the sums' rules, the same for the kernel's entry and every int4_linear backend
    sums = mg.chunk_row_sums(x, mg.rows_for(3))
    for call in (functools.partial(mg.int4_matmul_mgpu, x, p, **kw),
                 functools.partial(plinear.int4_linear, x, p, backend="reference")):
        with pytest.raises(ValueError, match="pass residual= with it"):  # row sums of no residual output
            call(row_sums=True)
        with pytest.raises(ValueError, match="pass residual= with it"):
            call(swiglu=True, row_sums=True)
        with pytest.raises(ValueError, match="norm_sums are the norm's row sums"):  # sums for no norm
            call(norm_sums=sums)
        with pytest.raises(ValueError, match=r"norm_sums must be float32 \[P, 8\]"):
            call(norm_weight=gw, norm_sums=sums[:, :4])
        with pytest.raises(ValueError, match=r"norm_sums must be float32 \[P, 8\]"):
            call(norm_weight=gw, norm_sums=sums.astype(jnp.bfloat16))


_LOWER_PRELUDE = r'''
import jax, jax.numpy as jnp
from pallas_kernels.linear import layout as lay, mosaic_gpu as mg
S = jax.ShapeDtypeStruct
def W(lead, k, n, g=32):
    c = max(64, g)
    return lay.W4A16Packed(qw=S((*lead, n // 64, k // 64, 128, 4), jnp.uint32),
                           sz=S((*lead, n // 64, k // c, 64 * c // g), jnp.uint32), group_size=g)
def lower(f, *a):
    return jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
'''
FUSED_LOWER_SCRIPT = _LOWER_PRELUDE + r'''
cl = mg.MgpuConfig(wgs=1, k_tile=256, splits=2, reduce="cluster", tma_view="wide")
sm = mg.MgpuConfig(wgs=2, k_tile=256, splits=2, reduce="sem", tma_view="wide")  # the last split sums
kc = cl.replace(k_groups=2)  # two warpgroups per row tile, then the cluster sum
kw = mg.MgpuConfig(wgs=2, k_tile=128, k_groups=2, tma_view="wide")  # one CTA per column tile, k groups
n_ok = 0
for m in (1, 13, 24, 32, 40, 64):  # above 24 rows the wide exchange (no cluster sum there)
    x, i = S((m, 1024), jnp.bfloat16), S((), jnp.int32)
    gs, g1, res = S((3, 1024), jnp.bfloat16), S((1024,), jnp.bfloat16), S((m, 256), jnp.bfloat16)
    for variant in ("mma", "wgmma"):
        cases = [
            (lambda x, w, g, l: mg.int4_matmul_mgpu(x, w, layer=l, norm_weight=g, variant=variant, interpret=False),
             (x, W((3,), 1024, 256), gs, i)),
            (lambda x, w, g, l: mg.int4_matmul_mgpu(x, w, layer=l, norm_weight=g, swiglu=True, variant=variant,
                                                    interpret=False), (x, W((3,), 1024, 512), gs, i)),
            (lambda x, w, r, l: mg.int4_matmul_mgpu(x, w, layer=l, residual=r, variant=variant, interpret=False),
             (x, W((3,), 1024, 256), res, i)),
            (lambda x, w, r, l: mg.int4_matmul_mgpu(x, w, layer=l, residual=r, config=cl.replace(pdl=True),
                                                    variant=variant, interpret=False), (x, W((3,), 1024, 256), res, i)),
            (lambda x, w, g, l: mg.int4_matmul_mgpu(x, w, layer=l, norm_weight=g, config=cl, variant=variant,
                                                    interpret=False), (x, W((3,), 1024, 256), g1, i)),
            (lambda x, w, g: mg.int4_matmul_mgpu(x, w, norm_weight=g, config=mg.MgpuConfig(
                wgs=2, k_tile=128, pdl=True), swiglu=True, variant=variant, interpret=False), (x, W((), 1024, 512), g1)),
            (lambda x, w, g: mg.int4_matmul_mgpu(x, w, norm_weight=g, config=mg.MgpuConfig(  # 4 rows at once
                wgs=1, k_tile=64), variant=variant, interpret=False), (x, W((), 1024, 256), g1)),
            (lambda x, w, r, l: mg.int4_matmul_mgpu(x, w, layer=l, residual=r, config=sm, variant=variant,
                                                    interpret=False), (x, W((3,), 1024, 256), res, i)),
            (lambda x, w: mg.int4_matmul_mgpu(x, w, swiglu=True, config=sm, variant=variant, interpret=False),
             (x, W((), 1024, 512))),
            (lambda x, w, g, l: mg.int4_matmul_mgpu(x, w, layer=l, norm_weight=g, config=sm, variant=variant,
                                                    interpret=False), (x, W((3,), 1024, 256), gs, i)),
            (lambda x, w, g: mg.int4_matmul_mgpu(x, w, norm_weight=g, swiglu=True, config=kw, variant=variant,
                                                 interpret=False), (x, W((), 1024, 512), g1)),
            (lambda x, w, r, l: mg.int4_matmul_mgpu(x, w, layer=l, residual=r, config=kc, variant=variant,
                                                    interpret=False), (x, W((3,), 1024, 256), res, i)),
        ]
        for f, a in (cases if m <= mg.PLAIN_EXCHANGE_MP else [cases[i] for i in (0, 1, 2, 5, 6, 7, 8, 9, 10)]):
            text = lower(f, *a)
            assert "mosaic_gpu" in text
            n_ok += 1
for m in (1, 32):  # SmolLM2's K 576 at k_tile 192 (three k blocks per stage; the norm in the consumers)
    x, g1 = S((m, 576), jnp.bfloat16), S((576,), jnp.bfloat16)
    for wgs, n, swiglu in ((1, 960, False), (2, 3072, True)):
        f = lambda x, w, g: mg.int4_matmul_mgpu(x, w, norm_weight=g, swiglu=swiglu, interpret=False,
                                                config=mg.MgpuConfig(wgs=wgs, k_tile=192))
        assert "mosaic_gpu" in lower(f, x, W((), 576, n), g1)
        n_ok += 1
for m in (1, 32):  # the norm without weight (unit_norm): in the consumers at K 576, the producer's pass at 1024
    for k, wgs, n, swiglu, kt in ((576, 1, 960, False, 192), (576, 2, 3072, True, 192), (1024, 2, 512, True, 128),
                                  (1024, 1, 256, False, 256)):
        f = lambda x, w, l: mg.int4_matmul_mgpu(x, w, layer=l, unit_norm=True, swiglu=swiglu, interpret=False,
                                                config=mg.MgpuConfig(wgs=wgs, k_tile=kt))
        text = lower(f, S((m, k), jnp.bfloat16), W((3,), k, n), S((), jnp.int32))
        assert "mosaic_gpu" in text and "_norm1" in text
        n_ok += 1
for m in (1, 13, 32, 64):  # the residual kernels' row sums (one split, the cluster and "sem" sums; by XLA after "gmem")
    for k, n, cfg in ((576, 576, mg.MgpuConfig(wgs=1, k_tile=192)), (1536, 576, mg.MgpuConfig(wgs=1, k_tile=192)),
                      (1024, 256, mg.MgpuConfig(wgs=2, k_tile=256, splits=2, reduce="sem")),
                      (1024, 256, mg.MgpuConfig(wgs=2, k_tile=256)),
                      (1024, 256, mg.MgpuConfig(wgs=1, k_tile=256, splits=2, reduce="cluster"))):
        if cfg.reduce == "cluster" and m > mg.PLAIN_EXCHANGE_MP:
            continue
        f = lambda x, w, r, l: mg.int4_matmul_mgpu(x, w, layer=l, residual=r, row_sums=True, config=cfg,
                                                   interpret=False)
        text = lower(f, S((m, k), jnp.bfloat16), W((3,), k, n), S((m, n), jnp.bfloat16), S((), jnp.int32))
        assert "mosaic_gpu" in text and "_resq" in text
        n_ok += 1
    # the norm kernel given the rows' sums (SmolLM2's gate_up: the norm in the consumers, SiLU·up)
    f = lambda x, w, g, s: mg.int4_matmul_mgpu(x, w, norm_weight=g, norm_sums=s, swiglu=True, interpret=False,
                                               config=mg.MgpuConfig(wgs=2, k_tile=192))
    text = lower(f, S((m, 576), jnp.bfloat16), W((), 576, 3072), S((576,), jnp.bfloat16),
                 S((9, mg.rows_for(m)), jnp.float32))
    assert "mosaic_gpu" in text and "_norms_swiglu" in text
    n_ok += 1
for d in mg.NORM_DIAGNOSTICS:  # the consumer norm's timing diagnostics (parts left out)
    f = lambda x, w, g: mg.int4_matmul_mgpu(x, w, norm_weight=g, interpret=False,
                                            config=mg.MgpuConfig(wgs=1, k_tile=64, diag=d))
    assert "mosaic_gpu" in lower(f, S((32, 576), jnp.bfloat16), W((), 576, 960), S((576,), jnp.bfloat16))
    n_ok += 1
print("ALL OK", n_ok, jax.__version__)
'''




@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no ptxas on PATH")
def test_fused_inline_ptx_assembles():
    """The producer's inline PTX (the norm stage's loads, predicated stores, product and x^2
    partials, first and later; the finish's shuffles and predicated stores) and the consumers' row-sum
    shuffle (`_fragment_row_sums`) assemble for sm_90a, each block in a kernel of its own."""
    blocks = [(mg._LD_B32_ASM, "=r,r"), (mg._LD_F32_IF_ASM, "=f,r,r"), (mg._ST_B32_IF_ASM, "r,r,r"),
              (mg._ST_F32_IF_ASM, "r,f,r"), (mg._MUL_BF16X2_ASM, "=r,r,r"), (mg._SQ_FIRST_ASM, "=f,r"),
              (mg._SQ_NEXT_ASM, "=f,r,f"), (mg._SHFL_ASM.format(16), "=f,f"), (mg._LD_F32_ASM, "=f,r"), (mg._ST_LANE0_ASM, "r,f,r"),
              (mg._ST_F32_ASM, "r,f"), (mg._SHFL_IDX_ASM, "=f,f,r")]
    body, regs = [], {"r": 0, "f": 0}
    for asm, cons in blocks:
        subs = []
        for c in cons.split(","):
            kind = "f" if "f" in c else "r"
            subs.append(f"%{kind}{regs[kind]}")
            body.append(f"mov.{'f32' if kind == 'f' else 'u32'} {subs[-1]}, {'0f3F800000' if kind == 'f' else 16};")
            regs[kind] += 1
        a = re.sub(r"\$(\d+)", lambda mm: subs[int(mm.group(1))], asm)
        body.append(a if a.startswith("{") else "{\n" + a + "\n}")
    ptx = (".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry k() {\n.reg .b32 %r<64>;\n"
           ".reg .f32 %f<64>;\n" + "\n".join(body) + "\nret;\n}\n")
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "t.ptx"
        src.write_text(ptx)
        r = subprocess.run(["ptxas", "-arch=sm_90a", str(src), "-o", str(Path(d) / "t.cubin")], capture_output=True,
                           text=True)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ the qkv epilogue (Epilogue.qkv)
def _qkv_case(seed: int, b: int, hq: int, hkv: int, n_layers: int = 2, ring: int = 32, cn: int = 16, k: int = 128,
              dh: int = 128, t: int = 1):
    """A stacked q|k|v weight of `dh`-channel heads, x of T tokens per batch row (row m = b T + t),
    norm weights, positions, slots and random query operand and rings (so that untouched elements
    are recognisable)."""
    rng = np.random.default_rng(seed)
    n = (hq + 2 * hkv) * dh
    p = lay.pack_quantized(_qweight(seed, (n_layers,), k, n, 32))
    x = _x(seed + 1, b * t, k)
    gw = jnp.asarray(1.0 + 0.3 * rng.standard_normal((n_layers, k)).astype(np.float32)).astype(jnp.bfloat16)
    pos = jnp.asarray(rng.integers(0, 100_000, b * t), jnp.int32)
    slots = jnp.asarray(rng.permutation(ring)[:b * t], jnp.int32)
    bf = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(jnp.bfloat16)  # noqa: E731
    return p, x, gw, pos, slots, bf(b, hkv, dh, cn), bf(n_layers, b, hkv, ring, dh), bf(n_layers, b, hkv, ring, dh)


def _inv_freq(theta: float = 500_000.0, dh: int = 128) -> jnp.ndarray:
    return jnp.asarray(1.0 / theta ** (np.arange(0, dh, 2) / dh), jnp.float32)


def test_qkv_epilogue_matches_reference():
    """The qkv epilogue (norm, product, RoPE, query operand, ring writes) in GPU interpret mode
    against `qkv_cache_reference`: each written element within one bf16 step of the float32
    reference (plus the float32 summation order near zero), every other element untouched;
    query heads land in column r of their KV head, keys and values in each row's slot of the
    asked layer only. In a child with 8 host devices."""
    _child("_case_qkv_cache")


def test_qkv_epilogue_64_channel_heads_matches_reference():
    """The same for SmolLM2's 64-channel heads (one head per warpgroup, RoPE's pairs 32 rows
    apart in one tile): two warpgroups per CTA over 2 query heads, a key and a value head (the
    second CTA holds a key and a value head), and SmolLM2's K = 576 with 3 query heads of one KV
    head (N = 320, an odd number of 64-column tiles) at the default launch shape (one warpgroup
    per CTA, 9 pipeline steps through 4 stages)."""
    _child("_case_qkv_cache", 64, 2, 2, 1, 5)
    _child("_case_qkv_cache", 64, None, 3, 1, 11, 576)


def test_qkv_epilogue_norm_without_weight_matches_reference():
    """The qkv epilogue with the norm without weight (`unit_norm`: the draft's attention norm
    folded into its weights) at SmolLM2's shape, against the reference, which equals the
    reference with a weight of ones bit for bit."""
    _child("_case_qkv_cache", 64, None, 3, 1, 11, 576, True)


def test_qkv_epilogue_takes_several_tokens_per_row():
    """The qkv epilogue for T tokens of each batch row (M = B T, row m = b T + t: the verify's
    shape): query head r of token t lands in column t n_rep + r of its KV head (what a one-token
    call writes for that token, in its columns 0..n_rep-1), keys and values in each token's slot,
    for 128-channel heads (T 2) and SmolLM2's 64-channel ones at its K 576 (T 3)."""
    _child("_case_qkv_cache", 128, 2, 4, 2, 7, 128, False, False, 2)
    _child("_case_qkv_cache", 64, None, 3, 1, 11, 576, False, False, 3)


def test_bf16_qkv_epilogue_matches_reference():
    """The qkv epilogue on the bf16 kernel (`bf16_qkv_cache_mgpu`: a target's q|k|v, x already
    normed) against `qkv_cache_reference` on the same bf16 weight, one token per row and T per row,
    128- and 64-channel heads."""
    _child("_case_qkv_cache", 128, 2, 4, 2, 7, 128, False, False, 1, True)
    _child("_case_qkv_cache", 64, None, 3, 1, 11, 576, False, False, 3, True)


def test_bf16_qkv_epilogue_row_blocks_match_reference():
    """Above `QKV_BLOCK_ROWS` rows (64-channel heads: 32) the bf16 qkv epilogue runs its rows in blocks of 32 on a
    grid axis of its own: SmolLM2's heads at K 576, T 3, batch 12 (36 rows: two blocks, the second mostly padding)
    and 32 (96 rows, the verify's at batch 32 and γ 2: three) against `qkv_cache_reference`; a batch row's writes
    are bit for bit those of a call holding only the first 12 batch rows (the same blocks of 32: a row's bits do
    not depend on the rows beside it or the block count)."""
    assert mg.qkv_blocks(36, 64) == (2, 32) and mg.qkv_blocks(96, 64) == (3, 32) and mg.qkv_blocks(32, 64) == (1, 32)
    assert mg.qkv_blocks(96, 128) == (1, 96) and mg.qkv_rows(36, 64) == 64
    _child("_case_qkv_cache", 64, None, 3, 1, 11, 576, False, False, 3, True, 12)
    _child("_case_qkv_cache", 64, None, 3, 1, 19, 576, False, False, 3, True, 32, 12)


def test_qkv_epilogue_with_given_sums_matches_reference():
    """The qkv epilogue with the rows' sums of x^2 given (`norm_sums`, `Epilogue.sums`: the kernel
    sums no x^2; here by 64-column chunks, added in order) at SmolLM2's shape, against the
    reference given the same sums, which agrees with the reference that sums x^2 itself."""
    _child("_case_qkv_cache", 64, None, 3, 1, 13, 576, False, True)


def chunk_sums(x, chunk: int = 64):
    """The rows' sums of x^2 as float32 [K / chunk, rows_for(M)]: one part per column chunk."""
    m, k = x.shape
    xf = x.astype(jnp.float32).reshape(m, k // chunk, chunk)
    return jnp.pad(jnp.sum(xf * xf, axis=-1).T, ((0, 0), (0, mg.rows_for(m) - m)))


def _case_qkv_cache(dh: int = 128, wgs: int | None = 2, hq: int = 4, hkv: int = 2, seed: int = 7,
                    k: int = 128, unit: bool = False, sums: bool = False, t: int = 1, dense: bool = False,
                    b: int = 3, sub: int = 0) -> None:
    """wgs None: the default launch shape; `unit`: the norm without weight; `sums`: the rows' sums
    of x^2 given (`norm_sums`, by 64-column chunks); `t`: tokens per batch row; `dense`: the bf16
    kernel (`bf16_qkv_cache_mgpu`, no norm) on the same weight's bf16 values; `b`: batch rows; `sub`: also a call
    on the first `sub` batch rows alone, whose writes must be the whole call's for those rows bit for bit."""
    p, x, gw, pos, slots, qb, kr, vr = _qkv_case(seed, b, hq, hkv, dh=dh, k=k, t=t, ring=max(32, b * t))
    rope = mg.rope_table(pos, _inv_freq(dh=dh))
    cfg = None if wgs is None else mg.MgpuConfig(wgs=wgs, k_tile=64, splits=1, stages=2)
    layer = jnp.int32(1)
    ss = chunk_sums(x) if sums else None
    if dense:  # no norm in the bf16 kernel: the reference without one
        gw, unit = None, False
        got = mg.bf16_qkv_cache_mgpu(x, lay.dequantize_bf16(p), layer=layer, rope=rope, slots=slots, q_buf=qb,
                                     k_ring=kr, v_ring=vr, config=cfg, interpret=True)
        if sub:  # the first `sub` batch rows alone: the same bits where they write
            r = sub * t
            part = mg.bf16_qkv_cache_mgpu(x[:r], lay.dequantize_bf16(p), layer=layer,
                                          rope=mg.rope_table(pos[:r], _inv_freq(dh=dh)), slots=slots[:r],
                                          q_buf=qb[:sub], k_ring=kr[:, :sub], v_ring=vr[:, :sub], config=cfg,
                                          interpret=True)
            for name, a, whole in zip(("q_buf", "k_ring", "v_ring"), part, got):
                whole = whole[:sub] if name == "q_buf" else whole[:, :sub]
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(whole, np.float32), err_msg=name)
    else:
        got = mg.int4_qkv_cache_mgpu(x, p, layer=layer, rope=rope, slots=slots, q_buf=qb, k_ring=kr, v_ring=vr,
                                     norm_weight=None if unit else gw, unit_norm=unit, norm_sums=ss, config=cfg,
                                     interpret=True)
    wb = lay.dequantize_bf16(p).astype(jnp.float32)[1]
    gw1 = None if unit or gw is None else gw[1]
    want = mg.qkv_cache_reference(x, wb, layer=1, rope=rope, slots=slots, q_buf=qb, k_ring=kr, v_ring=vr,
                                  norm_weight=gw1, unit_norm=unit, norm_sums=ss)
    if sums:  # the given sums are the row's sums: the reference that sums x^2 itself agrees to float32 order
        own = mg.qkv_cache_reference(x, wb, layer=1, rope=rope, slots=slots, q_buf=qb, k_ring=kr, v_ring=vr,
                                     norm_weight=None if unit else gw[1], unit_norm=unit)
        for a, b_ in zip(want, own):
            a, b_ = np.asarray(a, np.float32), np.asarray(b_, np.float32)
            assert (np.abs(a - b_) <= 2.0 ** -7 * np.abs(b_)).all()
        # and they are used: sums of 4 x^2 give r / 2
        half = mg.qkv_cache_reference(x, wb, layer=1, rope=rope, slots=slots, q_buf=qb, k_ring=kr, v_ring=vr,
                                      norm_weight=None if unit else gw[1], unit_norm=unit, norm_sums=4 * ss)
        assert not np.array_equal(np.asarray(half[1], np.float32), np.asarray(want[1], np.float32))
    if unit:  # the norm without weight is the norm with a weight of ones (the reference's)
        ones = mg.qkv_cache_reference(x, wb, layer=1, rope=rope, slots=slots, q_buf=qb, k_ring=kr, v_ring=vr,
                                      norm_weight=jnp.ones_like(gw[1]))
        for a, b_ in zip(want, ones):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b_, np.float32))
    for name, a, r, orig in zip(("q_buf", "k_ring", "v_ring"), got, want, (qb, kr, vr)):
        a, r, orig = (np.asarray(t, np.float32) for t in (a, r, orig))
        assert a.shape[-1 if name != "q_buf" else -2] == dh, (name, a.shape)
        written = r != orig
        assert written.any(), name
        np.testing.assert_array_equal(a[~written], orig[~written], err_msg=name)  # nothing else touched
        # one bf16 step (the twin's float32 sums run in another order) plus that order near zero
        assert (np.abs(a - r) <= 2.0 ** -7 * np.abs(r) + 2.0 ** -10 * np.abs(r).max()).all(), name
    # where the reference writes: query columns 0..T n_rep-1 of each KV head; layer 1, the rows' slots
    n_rep = hq // hkv
    q_cols = np.nonzero((np.asarray(want[0], np.float32) != np.asarray(qb, np.float32)).any(axis=(0, 1, 2)))[0]
    assert set(q_cols) <= set(range(t * n_rep))
    k_w = np.argwhere((np.asarray(want[1], np.float32) != np.asarray(kr, np.float32)).any(axis=(2, 4)))
    assert {(int(layer_), int(row), int(slot)) for layer_, row, slot in k_w} <= {
        (1, i // t, int(slots[i])) for i in range(b * t)}
    for tt in range(t if t > 1 else 0):  # token tt's columns t n_rep .. hold what a one-token call writes for it
        one = mg.qkv_cache_reference(x[tt::t], wb, layer=1, rope=mg.rope_table(pos[tt::t], _inv_freq(dh=dh)),
                                     slots=slots[tt::t], q_buf=qb, k_ring=kr, v_ring=vr, norm_weight=gw1,
                                     unit_norm=unit)
        a = np.asarray(got[0], np.float32)[..., tt * n_rep:(tt + 1) * n_rep]
        r = np.asarray(one[0], np.float32)[..., :n_rep]
        assert (np.abs(a - r) <= 2.0 ** -7 * np.abs(r) + 2.0 ** -10 * np.abs(r).max()).all(), tt


@pytest.mark.parametrize("dh", [128, 64])
def test_rope_table_is_the_models_rope(dh):
    """`rope_table`'s cos and sin rotate exactly as `model.apply_rope` (bitwise, float32), so the
    fused and unfused drafts rope with the same angles; for 64-channel heads its rows 32..63
    repeat rows 0..31 (tile row r and r + 32 are one RoPE pair)."""
    from qspec_jax import model as M

    pos = jnp.asarray([0, 7, 4095, 131_071, 1_000_000], jnp.int32)
    inv, half = _inv_freq(dh=dh), dh // 2
    x = jax.random.normal(jax.random.PRNGKey(0), (5, 1, 1, dh), jnp.float32)
    want = M.apply_rope(x, pos[:, None], np.asarray(inv))
    cs = mg.rope_table(pos, inv)
    cos, sin = cs[0, :half, :5].T[:, None, None], cs[1, :half, :5].T[:, None, None]
    x1, x2 = x[..., :half], x[..., half:]
    got = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert cs.shape == (2, 64, 8) and float(jnp.abs(cs[:, :, 5:] - jnp.asarray([1.0, 0.0])[:, None, None]).max()) == 0
    np.testing.assert_array_equal(np.asarray(cs[:, half:]), np.asarray(cs[:, :64 - half]))
    with pytest.raises(ValueError, match="inv_freq"):
        mg.rope_table(pos, inv[:16])


def test_qkv_epilogue_bad_inputs_raise():
    p, x, gw, pos, slots, qb, kr, vr = _qkv_case(3, 2, 2, 1)
    rope = mg.rope_table(pos, _inv_freq())
    kw = dict(layer=0, rope=rope, slots=slots, q_buf=qb, k_ring=kr, v_ring=vr, norm_weight=gw, interpret=True)
    with pytest.raises(ValueError, match="T tokens per batch row: a multiple of the batch 2"):
        mg.int4_qkv_cache_mgpu(_x(1, 3, 128), p, **kw)
    with pytest.raises(ValueError, match="q_buf"):
        mg.int4_qkv_cache_mgpu(x, p, **{**kw, "q_buf": qb[:, :, :64]})
    with pytest.raises(ValueError, match="k_ring"):
        mg.int4_qkv_cache_mgpu(x, p, **{**kw, "v_ring": vr[:, :, :, :16]})
    with pytest.raises(ValueError, match="slots"):
        mg.int4_qkv_cache_mgpu(x, p, **{**kw, "slots": slots.astype(jnp.float32)})
    with pytest.raises(ValueError, match="rope"):
        mg.int4_qkv_cache_mgpu(x, p, **{**kw, "rope": rope[:, :32]})
    with pytest.raises(ValueError, match="wgs=2"):
        mg.int4_qkv_cache_mgpu(x, p, config=mg.MgpuConfig(wgs=1, k_tile=64), **kw)
    with pytest.raises(ValueError, match="heads"):
        mg.int4_qkv_cache_mgpu(x, lay.pack_quantized(_qweight(5, (2,), 128, 320, 32)), **kw)
    with pytest.raises(ValueError, match="k_ring"):  # a head dim the epilogue does not take
        mg.int4_qkv_cache_mgpu(x, p, **{**kw, "k_ring": kr[..., :96], "v_ring": vr[..., :96]})
    p32, x32, gw32, pos32, slots32, qb32, kr32, vr32 = _qkv_case(4, 25, 2, 1, ring=64)  # 25 rows: M_pad 32 > 24
    with pytest.raises(ValueError, match="at most 24 rows"):
        mg.int4_qkv_cache_mgpu(x32, p32, layer=0, rope=mg.rope_table(pos32, _inv_freq()), slots=slots32, q_buf=qb32,
                               k_ring=kr32, v_ring=vr32, norm_weight=gw32, interpret=True)
    p, x, gw, pos, slots, qb, kr, vr = _qkv_case(3, 2, 2, 1, dh=64)
    kw.update(rope=mg.rope_table(pos, _inv_freq(dh=64)), slots=slots, q_buf=qb, k_ring=kr, v_ring=vr, norm_weight=gw)
    with pytest.raises(ValueError, match="64-channel heads needs wgs=1 or 2"):
        mg.int4_qkv_cache_mgpu(x, p, config=mg.MgpuConfig(wgs=4, k_tile=64), **kw)


QKV_LOWER_SCRIPT = _LOWER_PRELUDE + r'''
def lower_qkv(b, L, hq, hkv, D, K, R, cfg, unit=False, sums=False, t=1):
    n, CN, m = (hq + 2 * hkv) * D, 16 * -(-t * (hq // hkv) // 16), b * t
    args = (S((m, K), jnp.bfloat16), W((L,), K, n), S((L, K), jnp.bfloat16), S((), jnp.int32),
            S((2, 64, mg.rows_for(m)), jnp.float32), S((m,), jnp.int32), S((b, hkv, D, CN), jnp.bfloat16),
            S((L, b, hkv, R, D), jnp.bfloat16), S((L, b, hkv, R, D), jnp.bfloat16),
            S((K // 64, mg.rows_for(m)), jnp.float32))
    f = lambda x, w, g, l, cs, sl, q, k, v, ss: mg.int4_qkv_cache_mgpu(
        x, w, layer=l, rope=cs, slots=sl, q_buf=q, k_ring=k, v_ring=v, norm_weight=None if unit else g,
        unit_norm=unit, norm_sums=ss if sums else None, config=cfg, interpret=False)
    text = lower(f, *args)
    assert "mosaic_gpu" in text and "output_operand_aliases" in text
n_ok = 0
for b in (1, 3, 8, 24):  # the 8B heads: one CTA and the cluster sum
    for cfg in (None, mg.MgpuConfig(wgs=2, k_tile=256, splits=2, reduce="cluster", tma_view="wide")):
        lower_qkv(b, 4, 32, 8, 128, 4096, 288, cfg)
        n_ok += 1
for b in (1, 8, 24, 32):  # 64-channel heads: SmolLM2's (N = 960, one warpgroup per CTA) and two per CTA, to 32 rows
    for L, hq, hkv, K, wgs in ((30, 9, 3, 576, 1), (2, 8, 4, 1024, 2)):
        lower_qkv(b, L, hq, hkv, 64, K, 96, mg.MgpuConfig(wgs=wgs, k_tile=64, splits=1))
        n_ok += 1
    lower_qkv(b, 30, 9, 3, 64, 576, 96, mg.MgpuConfig(wgs=1, k_tile=192, splits=1))  # three k blocks per stage
    lower_qkv(b, 30, 9, 3, 64, 576, 96, mg.MgpuConfig(wgs=1, k_tile=192, splits=1), unit=True)  # no norm weight
    lower_qkv(b, 30, 9, 3, 64, 576, 96, mg.MgpuConfig(wgs=1, k_tile=192, splits=1), sums=True)  # the sums given
    n_ok += 3
for b in (1, 24):  # the 8B heads' norm without weight (the producer's pass)
    lower_qkv(b, 4, 32, 8, 128, 4096, 288, None, unit=True)
    n_ok += 1
for b, t in ((1, 2), (4, 4), (1, 5)):  # T tokens per batch row (the verify's rows): the 8B heads (to 16 rows, one CTA)
    lower_qkv(b, 4, 32, 8, 128, 4096, 288, None, t=t)
    n_ok += 1
for b, t in ((1, 5), (4, 3), (6, 5)):  # SmolLM2's, to 30 rows
    lower_qkv(b, 30, 9, 3, 64, 576, 96, mg.MgpuConfig(wgs=1, k_tile=192, splits=1), t=t)
    n_ok += 1
for b, t, L, hq, hkv, D, K, R in ((1, 1, 4, 32, 8, 128, 4096, 288), (1, 5, 4, 32, 8, 128, 4096, 288),
                                  (32, 1, 30, 9, 3, 64, 576, 96), (6, 5, 30, 9, 3, 64, 576, 96),
                                  (12, 3, 30, 9, 3, 64, 576, 96), (32, 3, 30, 9, 3, 64, 576, 96)):  # the bf16 kernel
    # (the last two in row blocks of 32: 36 and 96 rows, the verify's at SmolLM2's batch 32 and γ 2)
    n, m = (hq + 2 * hkv) * D, b * t
    CN = 16 * -(-t * (hq // hkv) // 16)
    f = lambda x, w, l, cs, sl, q, k, v: mg.bf16_qkv_cache_mgpu(x, w, layer=l, rope=cs, slots=sl, q_buf=q, k_ring=k,
                                                                v_ring=v, interpret=False)
    text = lower(f, S((m, K), jnp.bfloat16), S((L, K, n), jnp.bfloat16), S((), jnp.int32),
                 S((2, 64, mg.qkv_rows(m, D)), jnp.float32), S((m,), jnp.int32), S((b, hkv, D, CN), jnp.bfloat16),
                 S((L, b, hkv, R, D), jnp.bfloat16), S((L, b, hkv, R, D), jnp.bfloat16))
    assert "mosaic_gpu" in text and "output_operand_aliases" in text
    n_ok += 1
print("ALL OK", n_ok, jax.__version__)
'''


LOWER_SCRIPTS = {"fused": FUSED_LOWER_SCRIPT, "qkv": QKV_LOWER_SCRIPT}


@pytest.mark.parametrize("jax_version", ["0.10", "0.11"])
@pytest.mark.parametrize("script", sorted(LOWER_SCRIPTS))
def test_fused_kernels_lower_for_cuda(script, jax_version):
    """The fused kernels lower to a Mosaic GPU custom call without a GPU, under jax 0.10 (this
    interpreter) and 0.11 (the device's; skipped without one). "fused": every epilogue on both
    register kernels (one CTA, the cluster sum, the last split's sum through global memory
    ("sem": residual and SiLU·up), PDL; the norm at k tiles 256, 128 and 64: 1, 2 and 4 rows per
    producer pass) at M = 1, 13, 24, and the one-CTA and "sem" ones at M = 32, 40, 64 (the wide
    exchange: swizzled [64, M_pad] tiles, the norm's row sums as a vector; a plain tile there
    fails Mosaic's transfer planning), and SmolLM2's K 576 at k_tile 192 (the norm in the
    consumers, three k blocks per stage; its x^2 in 2 and 4 chains), the residual kernels' row sums
    (`row_sums`: one CTA, the cluster and "sem" sums, 1 to 64 rows) and gate_up given them
    (`norm_sums`). "qkv": the qkv epilogue (T tokens per batch row, to 30 rows; the bf16 kernel's, one
    and T tokens per row; one CTA and the cluster sum, 1
    to 24 rows, the 8B heads; SmolLM2's 64-channel heads to 32 rows, one and two warpgroups per
    CTA, and k_tile 192, its x^2 in 4 chains), whose outputs alias the query operand and the rings."""
    python = sys.executable if jax_version == "0.10" else subproc.jax011_python()
    if python is None:
        pytest.skip("no jax 0.11 interpreter (QSPEC_JAX011_PYTHON or /tmp/j11)")
    r = subproc.run_script(python, LOWER_SCRIPTS[script])
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
