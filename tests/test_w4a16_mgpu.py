"""Hopper (Mosaic GPU) skinny GEMMs on the CPU: the pre-packed INT4 layout, the SMEM-operand twin
and the bf16 kernel in GPU interpret mode, a replay of the register kernel's per-thread work
(its own PTX text, emulated), bitwise row invariance, dispatch, bad inputs and CUDA lowering.

The register-operand kernel itself cannot run in interpret mode (inline Mosaic GPU code); the
device check (tools/device/check_w4a16.py) runs it against the same references on the H200.
"""

import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import linear
from pallas_kernels.linear import layout as lay
from pallas_kernels.linear import mosaic_gpu as mg
from qspec_jax.weight_quant import QuantizedWeight, quantize_weight

_spec = importlib.util.spec_from_file_location("ptx_emu", Path(__file__).parent / "helpers" / "ptx_emu.py")
ptx_emu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ptx_emu)


pytestmark = pytest.mark.usefixtures("reuse_interpreter_programs")  # conftest: GPU interpret mode, faster


def _qweight(seed: int, lead: tuple[int, ...], k: int, n: int, g: int) -> QuantizedWeight:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((*lead, k, n)).astype(np.float32) * 0.05
    w.reshape(-1)[rng.integers(0, w.size, size=max(1, w.size // 300))] *= 20.0  # wide groups
    return quantize_weight(jnp.asarray(w), g)


def _x(seed: int, m: int, k: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32) * 2.0
                       ).astype(jnp.bfloat16)


def _rel(y, ref) -> float:
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def _oracle(x, qw: QuantizedWeight) -> np.ndarray:
    """The jnp/numpy reference: x (exact bf16 values) @ (U * scale + zero) in float64 (the SPEC's
    weight, from the QuantizedWeight fields: the layout keeps only the kernel's bf16 pair)."""
    return np.asarray(x, np.float64) @ np.asarray(qw.dequantize(), np.float64)


def _bf16_emulation(x, p: lay.W4A16Packed) -> np.ndarray:
    """x @ W with W rounded to bf16 exactly as the kernels dequantize it (float64 sums)."""
    return np.asarray(x, np.float64) @ np.asarray(lay.dequantize_bf16(p), np.float64)


# ------------------------------------------------------------------------------------ layout
def _random_fields(seed: int, lead: tuple[int, ...], k: int, n: int, g: int) -> QuantizedWeight:
    """Arbitrary bit patterns: every code and every float16 value (NaN, inf, -0 included)."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (*lead, k // 2, n), dtype=np.uint8)
    sz = rng.integers(0, 1 << 16, (2, *lead, k // g, n), dtype=np.uint16).view(np.float16)
    return QuantizedWeight(packed=jnp.asarray(packed), scale=jnp.asarray(sz[0]), zero=jnp.asarray(sz[1]))


def _same_bits_or_both_nan(a, b) -> bool:
    """bf16 arrays equal bit for bit, except that a NaN may have any payload (XLA may canonicalize)."""
    a, b = np.asarray(a), np.asarray(b)
    na, nb = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    return a.shape == b.shape and np.array_equal(na, nb) and np.array_equal(a.view(np.uint16)[~na],
                                                                           b.view(np.uint16)[~nb])


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 1000), lead=st.sampled_from([(), (2,), (2, 3)]), g=st.sampled_from([32, 64, 128]),
       kc=st.integers(1, 3), nt=st.integers(1, 3))
def test_pack_keeps_the_codes_and_stores_the_kernel_pair(seed, lead, g, kc, nt):
    """Arbitrary bits (every code, every float16 incl. NaN, inf, -0): the codes come back bit for
    bit, and each group's record holds `kernel_scales` of its float16 scale / zero."""
    k, n = kc * max(64, g), 64 * nt
    qw = _random_fields(seed, lead, k, n, g)
    p = lay.pack_quantized(qw)
    assert p.qw.shape == (*lead, n // 64, k // 64, 128, 4) and p.qw.dtype == jnp.uint32
    assert p.sz.shape == (*lead, n // 64, k // max(64, g), 64 * max(64, g) // g)
    assert p.shape == (*lead, k, n) and p.group_size == g
    assert p.nbytes == qw.packed.size + 2 * qw.scale.size * 2  # same bytes as the draft format
    assert lay.packed_bytes(k, n, g) * int(np.prod(lead, dtype=int)) == p.nbytes  # the byte floors' count
    codes = lay.unpack_packed_codes(p)
    assert codes.dtype == jnp.uint8 and np.array_equal(np.asarray(codes), np.asarray(qw.packed))
    _, s, zc = lay.unpack_codes(p)
    want_s, want_zc = lay.kernel_scales(qw.scale, qw.zero)
    assert s.dtype == zc.dtype == jnp.bfloat16
    assert _same_bits_or_both_nan(s, want_s) and _same_bits_or_both_nan(zc, want_zc)


def test_dequantize_matches_the_draft_format():
    qw = _qweight(2, (2,), 256, 128, 32)
    p = lay.pack_quantized(qw)
    np.testing.assert_array_equal(np.asarray(lay.dequantize_fields(qw.packed, qw.scale, qw.zero)),
                                  np.asarray(qw.dequantize()))
    # the kernel's weight from the fields, without the layout: fma(U - 8, bf16(s), bf16(z + 8 s)) in
    # float32, rounded once (what layout version 1 computed in the kernel from float16 records)
    s, zc = (np.repeat(np.asarray(v, np.float32), 32, axis=-2) for v in lay.kernel_scales(qw.scale, qw.zero))
    u = np.asarray(qw.codes()).reshape(2, 256, 128).astype(np.float32)
    want = ((u - 8) * s + zc).astype(jnp.bfloat16)
    assert np.array_equal(np.asarray(lay.dequantize_bf16(p)).view(np.uint16), want.view(np.uint16))
    assert np.array_equal(np.asarray(lay.dequantize_f32(p)), (u - 8) * s + zc)
    wb = np.asarray(lay.dequantize_bf16(p), np.float64)
    w32 = np.asarray(qw.dequantize(), np.float64)
    s = np.repeat(np.asarray(qw.scale, np.float64), 32, axis=-2)
    z = np.repeat(np.asarray(qw.zero, np.float64), 32, axis=-2)
    # bf16 roundings (unit roundoff 2^-8) of s (times |U - 8| <= 8), of z + 8 s and of the result
    bound = 2.0 ** -8 * (8 * s + np.abs(z + 8 * s) + np.abs(w32)) * 1.01
    assert (np.abs(wb - w32) <= bound).all()
    # ~5e-3 here (outlier groups: the rounded scale multiplies every code) against ~1.7e-3 for
    # rounding the float32 weight itself; both far below the INT4 quantization error
    assert np.linalg.norm(wb - w32) / np.linalg.norm(w32) < 1e-2


def test_layout_bits_follow_the_fragment_map():
    """Every nibble sits where the module docstring says: word [rt, kb, t, j], bits 4p + 16h,
    holds W[64 kb + col, 64 rt + row] with (row, col) = thread_elements()[t, j, p, h]."""
    k, n, g = 128, 128, 64
    qw = _qweight(3, (), k, n, g)
    p = lay.pack_quantized(qw)
    codes = np.asarray(qw.codes()).reshape(k, n)  # [K/G, G, N] -> [K, N]
    words = np.asarray(p.qw)
    te = lay.thread_elements()
    t, j, pp, h = np.meshgrid(np.arange(128), np.arange(4), np.arange(4), np.arange(2), indexing="ij")
    for rt in range(n // 64):
        for kb in range(k // 64):
            got = (words[rt, kb][t, j] >> (4 * pp + 16 * h)) & 0xF
            want = codes[64 * kb + te[..., 1], 64 * rt + te[..., 0]]
            np.testing.assert_array_equal(got, want)
    # the A-fragment rows/cols: thread 37 = warp 1, row group 1, column pair 1
    assert tuple(te[37, 2, 3, 1]) == (16 + 1 + 8, 32 + 2 + 8 + 1)
    # scale records: word 2 (C/G) r + 2 i + e of row 16 (r // 8) + r % 8 + 8 e, the kernel pair
    rec = np.asarray(p.sz)[1, 1, 2 * 13 + 1]  # rt 1, chunk 1, r = 13, i = 0, e = 1
    row, grp = 64 + 16 + 5 + 8, 1
    s, zc = (np.asarray(v).view(np.uint16) for v in lay.kernel_scales(qw.scale, qw.zero))
    assert rec & 0xFFFF == s[grp, row] and rec >> 16 == zc[grp, row]
    assert s[grp, row] != zc[grp, row]  # the halves are told apart


def test_pack_float_and_bad_layout_inputs():
    w = jnp.asarray(np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32))
    p = lay.pack_float(w, 32, quantize_weight)
    assert np.array_equal(np.asarray(lay.unpack_packed_codes(p)), np.asarray(quantize_weight(w, 32).packed))
    qw = quantize_weight(w, 32)
    with pytest.raises(ValueError, match="multiple of 64"):
        lay.pack_fields(qw.packed[:, :48], qw.scale[:, :48], qw.zero[:, :48])
    with pytest.raises(ValueError, match="float16"):
        lay.pack_fields(qw.packed, qw.scale.astype(jnp.float32), qw.zero)
    with pytest.raises(ValueError, match="uint8"):
        lay.pack_fields(qw.packed.astype(jnp.int32), qw.scale, qw.zero)
    with pytest.raises(ValueError, match="group size"):
        lay.pack_fields(qw.packed, jnp.tile(qw.scale, (2, 1)), jnp.tile(qw.zero, (2, 1)))  # G = 16
    with pytest.raises(ValueError, match="multiple of 64"):  # K = 96 at G = 32: half a k block
        lay.pack_fields(qw.packed[:48], qw.scale[:3], qw.zero[:3])


# --------------------------------------------------------------- the register path, replayed
def _wgmma_elements(cols: int = 64) -> dict[tuple[int, int, int, int], tuple[int, int]]:
    """(warp, lane, 8-column tile, row half) -> (row, col) of element 0 of a [64, cols] array in
    Mosaic's WGMMA layout, evaluated from the layout's own tiling (a Python mirror of
    TiledLayout.thread_idxs)."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    layout, shape = fa.WGMMA_LAYOUT, (64, cols)
    contig = (cols, 1)
    tile_strides = layout.tiling.tile_strides(contig)
    tts = layout.tiled_tiling_shape
    dyn = tile_strides[-len(tts):]

    def delin(idx, dims):
        sizes = [tts[d] for d in dims]
        out, rem = [0] * len(tts), idx
        for d, size in zip(reversed(dims), reversed(sizes)):
            out[d], rem = rem % size, rem // size
        return out

    regs = layout.registers_shape(shape)
    out = {}
    for w in range(4):
        for lane in range(32):
            off = sum(i * s for i, s in zip(delin(w, layout.warp_dims), dyn))
            off += sum(i * s for i, s in zip(delin(lane, layout.lane_dims), dyn))
            for ri in np.ndindex(regs):
                lin = off + sum(i * s for i, s in zip(ri, tile_strides))
                out[(w, lane, ri[1], ri[4])] = (lin // cols, lin % cols)
    return out


@pytest.mark.parametrize("g", [32, 64, 128])
def test_register_path_replay_matches_layout(g):
    """Replays the register kernel for one warpgroup and stage: its shared-memory addresses
    (word_offset / record_offset), its PTX (executed from the kernel's asm text by
    tests/helpers/ptx_emu.py) and its register placement (register_index, read through Mosaic's
    WGMMA layout) must rebuild the layout's bf16 dequantization bit for bit."""
    k, n = 2 * max(64, g), 64
    p = lay.pack_quantized(_qweight(11, (), k, n, g))
    want = np.asarray(lay.dequantize_bf16(p), np.float32).T  # W^T [64, K]
    w_stage = np.asarray(p.qw)[0].reshape(-1)  # one warpgroup's stage: all K/64 blocks
    s_stage = np.asarray(p.sz)[0].reshape(-1)
    elements = _wgmma_elements()
    got = np.full((64, k), np.nan, np.float32)
    for tid in range(128):
        warp, lane = tid // 32, tid % 32
        for kb in range(k // 64):
            kc, nrec, word_group = mg.block_plan(g, kb)
            words = [int(v) for v in w_stage[mg.word_offset(kb, tid) // 4:][:4]]
            recs = [int(v) for v in s_stage[mg.record_offset(kc, tid, nrec) // 4:][:nrec]]
            for j in range(4):
                i = word_group[j]
                ss0, zz0 = ptx_emu.run(mg._SCALE_ASM, [0, 0, recs[2 * i]])
                ss1, zz1 = ptx_emu.run(mg._SCALE_ASM, [0, 0, recs[2 * i + 1]])
                outs = ptx_emu.run(mg._CONVERT_ASM, [0, 0, 0, 0, words[j], ss0, zz0, ss1, zz1])
                for pp, v in enumerate(outs):
                    ct, half = mg.register_index(j, pp)
                    row, col = elements[(warp, lane, ct, half)]
                    pair = np.array([v & 0xFFFF, v >> 16], np.uint16).view(jnp.bfloat16).astype(np.float32)
                    got[row, 64 * kb + col: 64 * kb + col + 2] = pair
    np.testing.assert_array_equal(got, want)


def _swizzled_x_image(x: np.ndarray, kt: int) -> np.ndarray:
    """uint8 image of one stage's x tile [M_pad, KT] bf16 as TMA writes it for Mosaic's (8, 64)
    tiling with 128-byte swizzle: tiles row-major, and within a 1024-byte tile the 16-byte chunk
    index XOR the 128-byte row index (Mosaic's rule: offset ^ ((offset / 128) % 8) * 16)."""
    mp = x.shape[0]
    tiles = x.reshape(mp // 8, 8, kt // 64, 64).transpose(0, 2, 1, 3)  # [nt, kb, 8, 64]
    linear = np.ascontiguousarray(tiles).view(np.uint8).reshape(-1)
    out = np.empty_like(linear)
    off = np.arange(linear.size)
    out[off ^ (((off // 128) % 8) * 16)] = linear
    return out


@pytest.mark.parametrize("g,mp", [(32, 8), (128, 16)])
def test_mma_path_replay_matches_layout(g, mp):
    """Replays the mma.sync register kernel for one warpgroup and one stage: code words and
    scale records through the kernel's asm (ptx_emu), activation B fragments through ldmatrix
    addressing into a swizzled x tile (x_fragment_offset), m16n8k16 fragment semantics, and the
    accumulator's placement in the WGMMA layout; the result must equal x @ W_bf16 (float64
    products and sums, so only the order of float32 rounding could differ: none here)."""
    kt, n = 2 * max(64, g), 64
    p = lay.pack_quantized(_qweight(12, (), kt, n, g))
    wt = np.asarray(lay.dequantize_bf16(p), np.float64).T  # W^T [64, KT]
    x = np.asarray(_x(13, mp, kt).astype(jnp.float32), np.float32)
    x16 = x.astype(jnp.bfloat16)
    want = wt @ x.astype(np.float64).T  # [64, M_pad]
    ximg = _swizzled_x_image(np.asarray(x16), kt)
    w_stage = np.asarray(p.qw)[0].reshape(-1)
    s_stage = np.asarray(p.sz)[0].reshape(-1)
    bf = lambda v: np.array([v & 0xFFFF, v >> 16], np.uint16).view(jnp.bfloat16).astype(np.float64)  # noqa: E731
    elements = _wgmma_elements(mp)
    got = np.full((64, mp), np.nan)
    for warp in range(4):
        acc = np.zeros((32, mp // 8, 4))  # per lane: c0..c3 of each n tile
        for kb in range(kt // 64):
            kc, nrec, word_group = mg.block_plan(g, kb)
            a_regs = np.zeros((32, 4, 4), np.int64)  # lane, word j, pair p
            for lane in range(32):
                tid = 32 * warp + lane
                words = [int(v) for v in w_stage[mg.word_offset(kb, tid) // 4:][:4]]
                recs = [int(v) for v in s_stage[mg.record_offset(kc, tid, nrec) // 4:][:nrec]]
                for j in range(4):
                    i = word_group[j]
                    ss0, zz0 = ptx_emu.run(mg._SCALE_ASM, [0, 0, recs[2 * i]])
                    ss1, zz1 = ptx_emu.run(mg._SCALE_ASM, [0, 0, recs[2 * i + 1]])
                    a_regs[lane, j] = ptx_emu.run(mg._CONVERT_ASM, [0, 0, 0, 0, words[j], ss0, zz0, ss1, zz1])
            for ct in range(mp // 8):
                b_regs = np.zeros((32, 4, 2), np.int64)  # lane, k16 step j, (b0, b1)
                for j0 in (0, 2):  # ldmatrix.x4: lane l addresses row l % 8 of matrix l // 8
                    rows = [mg.x_fragment_offset(ct, kb, j0, lane, kt) for lane in range(32)]
                    for lane in range(32):
                        for q in range(4):
                            a = rows[8 * q + lane // 4] + 4 * (lane % 4)
                            b_regs[lane, j0 + q // 2, q % 2] = int(ximg[a:a + 4].view(np.uint32)[0])
                for j in range(4):  # mma.sync m16n8k16: gather the warp's fragments, multiply
                    A = np.zeros((16, 16))
                    B = np.zeros((16, 8))
                    for lane in range(32):
                        gg, c = lane // 4, lane % 4
                        for pp, (r, k) in enumerate(((gg, 2 * c), (gg + 8, 2 * c), (gg, 2 * c + 8), (gg + 8, 2 * c + 8))):
                            A[r, k:k + 2] = bf(int(a_regs[lane, j, pp]))
                        B[2 * c:2 * c + 2, gg] = bf(int(b_regs[lane, j, 0]))
                        B[2 * c + 8:2 * c + 10, gg] = bf(int(b_regs[lane, j, 1]))
                    D = A @ B
                    for lane in range(32):
                        gg, c = lane // 4, lane % 4
                        acc[lane, ct] += [D[gg, 2 * c], D[gg, 2 * c + 1], D[gg + 8, 2 * c], D[gg + 8, 2 * c + 1]]
        for lane in range(32):  # the accumulator registers as the kernel hands them to Mosaic
            for ct in range(mp // 8):
                for h in range(2):
                    row, col = elements[(warp, lane, ct, h)]
                    got[row, col: col + 2] = acc[lane, ct, 2 * h: 2 * h + 2]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ the twin, interpret mode
def _check_twin(seed: int, m: int, g: int, kt: int, splits: int, n: int = 64, tma_view: str = "thread") -> None:
    k = 2 * splits * max(kt, g)
    qw = _qweight(seed, (), k, n, g)
    p = lay.pack_quantized(qw)
    x = _x(seed + 1, m, k)
    cfg = mg.MgpuConfig(wgs=1, k_tile=max(kt, g), splits=splits, stages=2, tma_view=tma_view)
    # Interpret mode allocates outputs as NaN: a tile the kernel never writes stays NaN.
    y = mg.int4_matmul_mgpu(x, p, config=cfg, variant="smem", interpret=True, out_dtype=jnp.float32)
    y = np.asarray(y)
    assert y.shape == (m, n) and not np.isnan(y).any(), "unwritten output elements"
    assert _rel(y, _bf16_emulation(x, p)) < 1e-5  # the kernel's own arithmetic, float32 sums
    assert _rel(y, _oracle(x, qw)) < 2e-2  # vs U * s + z in float64 (weights rounded to bf16)


@pytest.mark.parametrize("m,g,kt,splits,view", [(5, 32, 64, 2, "thread"), (8, 64, 128, 1, "thread"),
                                                (11, 128, 128, 2, "thread"), (1, 32, 128, 1, "wide")])
def test_twin_matches_reference(m, g, kt, splits, view):
    _check_twin(7, m, g, kt, splits, tma_view=view)


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), m=st.integers(1, 24), g=st.sampled_from([32, 64, 128]),
       kt=st.sampled_from([64, 128, 256]), splits=st.sampled_from([1, 2, 3]))
def test_twin_matches_reference_random_shapes(seed, m, g, kt, splits):
    """Random shapes (~15 s per new shape: interpret mode compiles each one)."""
    _check_twin(seed, m, g, kt, splits)


@pytest.mark.parametrize("m,wgs,kg,splits,reduce,stages", [(3, 1, 2, 1, "gmem", 4), (5, 2, 2, 2, "sem", 4),
                                                            (1, 1, 4, 1, "gmem", 4), (9, 1, 2, 2, "gmem", 6)])
def test_k_groups_twin_matches_reference(m, wgs, kg, splits, reduce, stages):
    """`k_groups`: a CTA's k steps dealt round-robin to kg warpgroups per row tile, their partials
    added in the CTA (group order) before the split-K sum: the kernel's own arithmetic (float32
    sums; a lost group's partial is ~1/kg of the result), every element written, the pipeline
    rounded down to a multiple of kg stages (6 -> 4 at kg 2), and the rows independent bitwise."""
    k, n = 2 * 4 * splits * 64, 64 * wgs
    p = lay.pack_quantized(_qweight(61 + kg, (), k, n, 32))
    cfg = mg.MgpuConfig(wgs=wgs, k_tile=64, splits=splits, stages=stages, reduce=reduce, k_groups=kg)
    assert mg._stages_for("int4", cfg, 8, 32) == stages - stages % kg
    x = _x(62, m, k)
    y = np.asarray(mg.int4_matmul_mgpu(x, p, config=cfg, variant="smem", interpret=True, out_dtype=jnp.float32))
    assert y.shape == (m, n) and not np.isnan(y).any(), "unwritten output elements"
    assert _rel(y, _bf16_emulation(x, p)) < 1e-5
    if m == 3:
        f = jax.jit(lambda x: mg.int4_matmul_mgpu(x, p, config=cfg, variant="smem", interpret=True))
        _rows_are_independent(f, k)


def test_k_groups_bad_configs_raise():
    p = lay.pack_quantized(_qweight(63, (), 256, 64, 32))
    x = _x(64, 2, 256)
    with pytest.raises(ValueError, match="k_groups=3"):
        mg.int4_matmul_mgpu(x, p, config=mg.MgpuConfig(wgs=1, k_tile=64, k_groups=3), variant="smem")
    with pytest.raises(ValueError, match=r"k_groups=4: .* dividing the 2 k steps"):
        mg.int4_matmul_mgpu(x, p, config=mg.MgpuConfig(wgs=1, k_tile=64, splits=2, k_groups=4), variant="smem")


def test_twin_two_warpgroups_stacked_layer_bf16_out():
    qw = _qweight(5, (3,), 256, 128, 32)
    p = lay.pack_quantized(qw)
    x = _x(6, 3, 256)
    cfg = mg.MgpuConfig(wgs=2, k_tile=128, splits=1, stages=2)
    y = mg.int4_matmul_mgpu(x, p, layer=jnp.int32(2), config=cfg, variant="smem", interpret=True)
    assert y.dtype == jnp.bfloat16 and y.shape == (3, 128)
    p2 = lay.W4A16Packed(qw=p.qw[2], sz=p.sz[2], group_size=32)
    assert _rel(y, _oracle(x, jax.tree.map(lambda a: a[2], qw))) < 1e-2
    assert _rel(y, _bf16_emulation(x, p2)) < 5e-3  # bf16 output rounding only


def test_unwritten_output_is_detected(monkeypatch):
    """The NaN-initialized output catches a kernel that skips its stores (mutation check)."""
    p = lay.pack_quantized(_qweight(1, (), 128, 64, 64))
    monkeypatch.setattr(mg.plgpu, "copy_smem_to_gmem", lambda *a, **k: None)
    y = mg.int4_matmul_mgpu(_x(2, 2, 128), p, config=mg.MgpuConfig(wgs=1, k_tile=64, splits=1, stages=2),
                            variant="smem", interpret=True, out_dtype=jnp.float32)
    assert np.isnan(np.asarray(y)).all()


def test_bf16_kernel_interpret():
    rng = np.random.default_rng(9)
    w = jnp.asarray(rng.standard_normal((2, 256, 128)).astype(np.float32) * 0.05).astype(jnp.bfloat16)
    x = _x(10, 9, 256)
    cfg = mg.MgpuConfig(wgs=2, k_tile=64, splits=2, stages=2)
    y = np.asarray(mg.bf16_matmul_mgpu(x, w, layer=1, config=cfg, interpret=True, out_dtype=jnp.float32))
    assert not np.isnan(y).any()
    ref = np.asarray(x, np.float64) @ np.asarray(w[1], np.float64)
    assert _rel(y, ref) < 1e-5


def test_bf16_swiglu_epilogue_matches_reference():
    """The bf16 kernel's SiLU·up (the target's gate | up weight): warpgroup 0 streams gate tile nt,
    warpgroup 1 up tile nt + N / 128, and the pair's float32 products give silu(gate) * up
    [M, N / 2]; against `epilogue_reference` on the kernel's own weight (a stacked layer read in
    place), and `dense_linear`'s XLA form (from the bf16 products) within bf16 rounding. Rows stay
    independent bit for bit; the halves swapped give another result (the tiles are not mixed up)."""
    rng = np.random.default_rng(31)
    w = jnp.asarray(rng.standard_normal((2, 256, 256)).astype(np.float32) * 0.1).astype(jnp.bfloat16)
    cfg = mg.MgpuConfig(wgs=2, k_tile=64, splits=1, stages=2)
    x = _x(32, 5, 256)
    f = jax.jit(lambda x, w: mg.bf16_matmul_mgpu(x, w, layer=1, config=cfg, interpret=True, swiglu=True,
                                                 out_dtype=jnp.float32))
    y = np.asarray(f(x, w))
    ref = np.asarray(mg.epilogue_reference(x, w[1].astype(jnp.float32), mg.Epilogue(swiglu=True),
                                           out_dtype=jnp.float32))
    assert y.shape == (5, 128) and _rel(y, ref) < 1e-5
    swapped = jnp.concatenate([w[..., 128:], w[..., :128]], axis=-1)
    assert _rel(np.asarray(f(x, swapped)), ref) > 0.1
    xla = np.asarray(linear.dense_linear(x, w, layer=1, backend="xla", swiglu=True, out_dtype=jnp.float32))
    assert _rel(xla, ref) < 2e-2
    # rows independent in the kernel's bf16 output (the CPU twin's float32 exp is XLA's, vectorized by the tile's
    # width, so its float32 bits may move with M_pad; the GPU kernel's exp is per element)
    _rows_are_independent(jax.jit(lambda x: mg.bf16_matmul_mgpu(x, w, layer=1, config=cfg, interpret=True,
                                                                 swiglu=True)), 256)
    with pytest.raises(ValueError, match="must hold gate . up halves"):
        linear.dense_linear(x, w[..., :255], layer=1, backend="xla", swiglu=True)
    with pytest.raises(ValueError, match="swiglu: N=192 must be gate . up halves of a multiple of 64"):
        mg.bf16_matmul_mgpu(x, w[1, :, :192], swiglu=True, interpret=True)


# ------------------------------------------------------------------- row invariance (bitwise)
def _rows_are_independent(call, k: int) -> None:
    """Row i of a call with M rows == the same row computed alone, and == itself with the other
    rows replaced by fresh random rows: bitwise, for several M (one and two row tiles)."""
    singles = {}
    for m in (3, 13):
        x = _x(100 + m, m, k)
        y = np.asarray(call(x))
        y_other = np.asarray(call(x.at[1:].set(_x(200 + m, m - 1, k))))
        np.testing.assert_array_equal(y[0], y_other[0])
        for i in (0, m - 1):
            key = np.asarray(x[i]).tobytes()
            if key not in singles:
                singles[key] = np.asarray(call(x[i:i + 1]))[0]
            np.testing.assert_array_equal(y[i], singles[key])


def test_int4_twin_rows_are_independent_bitwise():
    p = lay.pack_quantized(_qweight(21, (), 128, 64, 32))
    cfg = mg.MgpuConfig(wgs=1, k_tile=64, splits=2, stages=2)
    f = jax.jit(lambda x: mg.int4_matmul_mgpu(x, p, config=cfg, variant="smem", interpret=True))
    _rows_are_independent(f, 128)


def test_bf16_kernel_rows_are_independent_bitwise():
    w = jnp.asarray(np.random.default_rng(22).standard_normal((128, 64)).astype(np.float32)).astype(jnp.bfloat16)
    cfg = mg.MgpuConfig(wgs=1, k_tile=64, splits=2, stages=2)
    f = jax.jit(lambda x: mg.bf16_matmul_mgpu(x, w, config=cfg, interpret=True))
    _rows_are_independent(f, 128)


# -------------------------------------------------------------------------- configs, dispatch
LLAMA = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)]
SMOL = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]


@pytest.mark.parametrize("k,n", LLAMA + SMOL)
@pytest.mark.parametrize("g", [32, 64, 128, None])
@pytest.mark.parametrize("reduce", ["gmem", "cluster"])
def test_default_config_is_valid(k, n, g, reduce):
    if g is not None and k % max(64, g):
        with pytest.raises(ValueError, match="launch shape"):
            mg.default_config(k, n, g, num_sms=132)
        return
    cfg = mg.default_config(k, n, g, num_sms=132, reduce=reduce)
    c = 64 if g is None else max(64, g)
    assert n % (64 * cfg.wgs) == 0 and cfg.k_tile % c == 0 and k % (cfg.k_tile * cfg.splits) == 0
    assert cfg.splits == 1 or (k // (cfg.k_tile * cfg.splits) >= 2 and k // cfg.splits >= 512)
    assert reduce == "gmem" or cfg.splits <= mg.MAX_CLUSTER
    ctas = n // (64 * cfg.wgs) * cfg.splits
    if k * n >= 4096 * 4096:  # the large shapes fill the machine
        assert ctas >= 96
    assert cfg == mg.default_config(k, n, g, num_sms=132, reduce=reduce)  # no hidden state


H100 = "NVIDIA H100 80GB HBM3"


def test_dense_linears_take_the_kernel_where_a_shape_was_measured(monkeypatch):
    """`qspec_jax.linear.dense_uses_kernel` under the config's default "auto": a stacked bf16 weight
    [L, K, N] goes to the Mosaic kernel on Hopper only where this device has a measured launch
    shape (`TUNED_SHAPES`: the 8B's q|k|v, o, gate_up and down on the H200, SmolLM2's on both),
    never on the CPU or another device kind, never a float32 or one-layer weight; "mosaic" always, "xla" never; the
    layer loop keeps exactly those weights stacked (`keep_stacked`) at passes of up to
    `DENSE_AUTO_MAX_ROWS` rows; and "auto" calls the kernel only up to those rows."""
    from qspec_jax import linear as qlinear

    stack = lambda k, n, dt=jnp.bfloat16: jax.ShapeDtypeStruct((32, k, n), dt)  # noqa: E731
    eight_b = [stack(4096, 6144), stack(4096, 4096), stack(4096, 28672), stack(14336, 4096)]
    smollm2 = stack(576, 1536)
    uses = lambda w, impl, rows=1: qlinear.dense_uses_kernel(w, impl, rows)  # noqa: E731
    assert not any(uses(w, "auto") for w in eight_b)  # the CPU
    assert all(uses(w, "mosaic") for w in [*eight_b, smollm2]) and not any(uses(w, "xla") for w in eight_b)
    monkeypatch.setattr(linear, "device_arch", lambda: ("gpu", 9))
    monkeypatch.setattr(mg._common, "device_kind", lambda: "NVIDIA H200")
    assert all(uses(w, "auto") for w in eight_b)
    assert not uses(smollm2, "auto")  # not measured: cuBLAS
    assert not any(uses(w, "auto", qlinear.DENSE_AUTO_MAX_ROWS + 1) for w in eight_b)  # more rows: cuBLAS
    assert not uses(stack(4096, 4096, jnp.float32), "auto") and not uses(jax.ShapeDtypeStruct((4096, 4096),
                                                                                             jnp.bfloat16), "auto")
    smol = [stack(576, 960), stack(576, 576), stack(576, 3072), stack(1536, 576)]  # SmolLM2's q|k|v, o, gate_up, down
    assert all(uses(w, "auto") for w in smol)  # SmolLM2's measured on the H200 too
    assert not any(uses(w, "auto", qlinear.DENSE_AUTO_MAX_ROWS + 1) for w in smol)
    monkeypatch.setattr(mg._common, "device_kind", lambda: "NVIDIA H100 80GB HBM3")  # no 8B bf16 entries there
    assert not any(uses(w, "auto") for w in eight_b)
    assert all(uses(w, "auto") for w in smol) and not uses(smollm2, "auto")  # SmolLM2's measured there
    assert not any(uses(w, "auto", qlinear.DENSE_AUTO_MAX_ROWS + 1) for w in smol)
    monkeypatch.setattr(linear, "device_arch", lambda: ("gpu", 8))
    monkeypatch.setattr(mg._common, "device_kind", lambda: "NVIDIA H200")
    assert not any(uses(w, "auto") for w in eight_b)
    # the layer loop: a measured shape stays stacked for the kernel, another is sliced for cuBLAS
    monkeypatch.setattr(linear, "device_arch", lambda: ("gpu", 9))
    monkeypatch.setitem(mg.TUNED_SHAPES, "H200", {**mg.TUNED_SHAPES["H200"], (256, 128, None): (1, 128, 1, "cluster")})
    measured, other = jnp.zeros((2, 256, 128), jnp.bfloat16), jnp.zeros((2, 256, 192), jnp.bfloat16)
    limit = qlinear.DENSE_AUTO_MAX_ROWS
    assert qlinear.keep_stacked(measured, "auto", limit) and not qlinear.keep_stacked(other, "auto", 1)
    assert not qlinear.keep_stacked(measured, "auto", limit + 1)  # above the rows (prefill too): sliced as for XLA
    assert not qlinear.keep_stacked(measured, "xla", 1) and qlinear.keep_stacked(other, "mosaic", 1)
    # the rows: "auto" takes the kernel up to DENSE_AUTO_MAX_ROWS (the verify's 40 rows at batch 8 measured slower)
    calls = []
    monkeypatch.setattr(linear, "dense_linear", lambda x, w, **kw: calls.append((x.shape[0], kw["backend"])) or
                        jnp.zeros((x.shape[0], w.shape[-1]), x.dtype))
    stacked = qlinear.StackedLayer(measured, jnp.int32(1))
    for rows in (1, limit, limit + 1):
        y = qlinear.linear(jnp.ones((rows, 256), jnp.bfloat16), stacked, dense_impl="auto")
        assert y.shape == (rows, 128)
    assert calls == [(1, "auto"), (limit, "auto")]  # limit + 1 rows: XLA on the layer's slice
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(
        jnp.ones((limit + 1, 256), jnp.bfloat16) @ measured[1], np.float32))


def test_dense_linear_runs_a_verifys_rows_in_row_blocks(monkeypatch):
    """The kernel backends of `dense_linear` take up to DENSE_BLOCKED_MAX_ROWS rows (a verify's B x T,
    e.g. SmolLM2's 32 x 3) in one launch of equal row blocks (`dense_blocks`): at 96 rows one kernel call,
    whose blocks of 48 rows are each the kernel's own 48-row call, in order, and within bf16 rounding of the
    reference (on the GPU each block's rows are also the rows alone, bitwise: the kernel's row invariance,
    tools/device/check_w4a16.py; the CPU interpreter's float32 sums follow M, so not here); a last block
    with padding rows (70 rows: 2 x 40), a split-K sum and SiLU·up take the same blocks; above the limit a
    clear error; `dense_supports` says so while `supports` (the INT4 kernel's too) keeps MAX_M; and the
    model's `linear` sends a stacked weight's 96-row pass to the kernel."""
    from qspec_jax import linear as qlinear

    rng = np.random.default_rng(51)
    w = jnp.asarray(rng.standard_normal((2, 128, 128)).astype(np.float32) / 8).astype(jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((32, 3, 128)).astype(np.float32)).astype(jnp.bfloat16)
    rows, kernel = [], mg.bf16_matmul_mgpu
    monkeypatch.setattr(mg, "bf16_matmul_mgpu", lambda x2, *a, **kw: rows.append(x2.shape[0]) or kernel(x2, *a, **kw))
    y = linear.dense_linear(x, w, layer=1, backend="interpret", out_dtype=jnp.float32)
    assert y.shape == (32, 3, 128) and rows == [96] and mg.dense_blocks(96) == (2, 48)
    ref = np.asarray(linear.dense_linear(x, w, layer=1, backend="reference", out_dtype=jnp.float32), np.float64)
    assert _rel(y, ref) < 1e-2
    flat, y2 = x.reshape(96, 128), np.asarray(y).reshape(96, 128)
    for lo, hi in ((0, 48), (48, 96)):  # the blocks, each as the kernel gives it alone
        block = kernel(flat[lo:hi], w, layer=1, out_dtype=jnp.float32, interpret=True)
        np.testing.assert_array_equal(y2[lo:hi], np.asarray(block))
    # 70 rows: blocks of 40, the last one 30 rows and 10 zero rows (never returned); split-K over global
    # memory (two float32 partials per block); SiLU·up (two warpgroups: gate | up)
    assert mg.dense_blocks(70) == (2, 40) and mg.dense_blocks(64) == (1, 64) and mg.dense_blocks(256) == (4, 64)
    x70 = flat[:70]
    split = mg.MgpuConfig(wgs=1, k_tile=64, splits=2, reduce="gmem", stages=2)
    swi = mg.MgpuConfig(wgs=2, k_tile=64, splits=1, reduce="gmem", stages=2)
    for cfg, swiglu, n_out in ((split, False, 128), (swi, True, 64)):
        y70 = np.asarray(kernel(x70, w, layer=0, out_dtype=jnp.float32, interpret=True, config=cfg, swiglu=swiglu))
        assert y70.shape == (70, n_out)
        r70 = np.asarray(mg.epilogue_reference(x70, w[0].astype(jnp.float32), mg.Epilogue(swiglu=swiglu),
                                               out_dtype=jnp.float32), np.float64)
        assert _rel(y70, r70) < 1e-2
        last = jnp.pad(x70[40:], ((0, 10), (0, 0)))  # the last block as the kernel runs it: 40 rows, 10 of zeros
        for lo, xb in ((0, x70[:40]), (40, last)):
            alone = np.asarray(kernel(xb, w, layer=0, out_dtype=jnp.float32, interpret=True, config=cfg,
                                      swiglu=swiglu))
            np.testing.assert_array_equal(y70[lo:lo + 40], alone[:min(40, 70 - lo)])
    limit = linear.DENSE_BLOCKED_MAX_ROWS
    assert linear.dense_supports("interpret", 96, 128, 128) and linear.dense_supports("mosaic", limit, 128, 128)
    assert not linear.dense_supports("mosaic", limit + 1, 128, 128) and not linear.supports("mosaic", 96, 128, 128)
    assert linear.dense_supports("xla", 10 * limit, 128, 128)
    with pytest.raises(ValueError, match=f"x has {limit + 1} rows; the interpret kernel takes at most {limit}"):
        linear.dense_linear(jnp.zeros((limit + 1, 128), jnp.bfloat16), w, layer=1, backend="interpret")
    calls = []
    monkeypatch.setattr(linear, "dense_linear", lambda x, w, **kw: calls.append((x.shape[0], kw["backend"])) or
                        jnp.zeros((x.shape[0], w.shape[-1]), x.dtype))
    qlinear.linear(flat, qlinear.StackedLayer(w, jnp.int32(1)), dense_impl="interpret")
    assert calls == [(96, "interpret")]


def test_tuned_shapes_apply_by_device_and_epilogue(monkeypatch):
    """A measured shape (`TUNED_SHAPES`) replaces the cost model's on the device it was measured
    on, only for its (K, N, G), only where it can run the call's epilogue and reduction, and never
    with QSPEC_W4A16_TUNED=0; every entry is a valid launch shape of its weight."""
    monkeypatch.delenv("QSPEC_W4A16_TUNED", raising=False)
    for kind, table in mg.TUNED_SHAPES.items():
        for (k, n, g), (wgs, kt, splits, red, *rest) in table.items():
            cfg = mg.tuned_config(k, n, g, device_kind=f"NVIDIA {kind} SXM")
            assert (cfg.wgs, cfg.k_tile, cfg.splits, cfg.reduce) == (wgs, kt, splits, red)
            assert (cfg.k_groups, cfg.stages) == (tuple(rest) or (1, 4))
            mg._check_cfg(cfg, k, n, lay.KB if g is None else lay.chunk_cols(g))  # G None: a bf16 weight
            assert cfg == mg.default_config(k, n, g, device_kind=f"NVIDIA {kind} SXM")
    down = (14336, 4096, 32)
    model = mg.default_config(*down, device_kind="", num_sms=132)
    tuned = mg.default_config(*down, device_kind=H100, num_sms=132)
    assert (tuned.wgs, tuned.splits, tuned.reduce) == (2, 4, "gmem") and tuned != model
    h200 = mg.default_config(*down, device_kind="NVIDIA H200", num_sms=132)
    assert (h200.wgs, h200.splits, h200.reduce, h200.k_groups, h200.stages) == (1, 2, "cluster", 2, 8)
    assert mg.default_config(*down, device_kind="NVIDIA L40S", num_sms=132) == model  # not measured there
    # a cluster entry where the call sums through global memory (M_pad > 24): the model's shape
    assert mg.default_config(*down, device_kind="NVIDIA H200", num_sms=132, reduce="gmem") == mg.default_config(
        *down, device_kind="", num_sms=132, reduce="gmem")
    assert mg.default_config(14336, 4096, 128, device_kind=H100, num_sms=132) == mg.default_config(
        14336, 4096, 128, device_kind="", num_sms=132)  # another group size: the model
    # a residual runs after a global-memory split sum; the norm and SiLU·up need the whole K in the kernel
    assert mg.default_config(*down, device_kind=H100, epilogue=mg.Epilogue(residual=True)) == tuned
    normed = mg.default_config(*down, device_kind=H100, epilogue=mg.Epilogue(norm=True))
    assert normed.splits == 1 or normed.reduce == "cluster"
    # SmolLM2's K 576 on the H200 and the H100: k_tile 192 with each call's epilogue (the norm in the consumers,
    # SiLU·up on warpgroup pairs, the residual); its lm_head (not measured faster) keeps the cost model's shape
    h200 = "NVIDIA H200"
    for kind in (h200, H100):
        for (k, n), epi in (((576, 3072), mg.Epilogue(norm=True, swiglu=True)),
                            ((576, 576), mg.Epilogue(residual=True)), ((576, 960), mg.Epilogue(norm=True))):
            cfg = mg.default_config(k, n, 32, device_kind=kind, num_sms=132, epilogue=epi)
            assert (cfg.k_tile, cfg.splits) == (192, 1) and cfg != mg.default_config(
                k, n, 32, device_kind="", num_sms=132, epilogue=epi)
        assert mg.default_config(576, 49152, 32, device_kind=kind, num_sms=132) == mg.default_config(
            576, 49152, 32, device_kind="", num_sms=132)
    # the 8B target's bf16 q|k|v with the qkv epilogue (its two warpgroups, the whole K in the kernel): k_tile 256,
    # 2 splits summed in the cluster; not the cost model's, and not on other devices
    qkv = mg.Epilogue(qkv=mg.QkvCache(num_heads=32, num_kv_heads=8, batch=1, ring=288, q_cols=32, layers=32,
                                      tokens=5))
    cfg = mg.default_config(4096, 6144, None, device_kind=h200, num_sms=132, epilogue=qkv)
    assert (cfg.wgs, cfg.k_tile, cfg.splits, cfg.reduce) == (2, 256, 2, "cluster")
    assert cfg != mg.default_config(4096, 6144, None, device_kind="", num_sms=132, epilogue=qkv)
    monkeypatch.setenv("QSPEC_W4A16_TUNED", "0")
    assert mg.default_config(*down, device_kind=H100, num_sms=132) == model


def test_layout_weights_never_go_to_triton(monkeypatch):
    """The layout holds the kernel's bf16 pair, not the fields the Triton kernel reads: "auto" on a
    GPU before Hopper sends it to "xla" (the layout's own weight), an explicit "triton" is refused."""
    monkeypatch.setattr(linear.api, "device_arch", lambda: ("gpu", 8))
    assert linear.pick_backend("int4", 1, 4096, 4096, jnp.bfloat16, hopper_layout=True) == "xla"
    assert linear.pick_backend("int4", 1, 4096, 4096, jnp.bfloat16, hopper_layout=False) == "triton"
    monkeypatch.setattr(linear.api, "device_arch", lambda: ("gpu", 9))
    assert linear.pick_backend("int4", 1, 4096, 4096, jnp.bfloat16, hopper_layout=True) == "mosaic"
    packed = lay.pack_quantized(_qweight(34, (), 128, 128, 32))
    with pytest.raises(ValueError, match="backend='triton' reads the QuantizedWeight fields"):
        linear.int4_linear(_x(35, 1, 128), packed, backend="triton")
    # "xla" / "reference" on the layout: the kernel's own weight, not U * s + z
    x = _x(36, 2, 128)
    y = linear.int4_linear(x, packed, backend="reference", out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x, np.float64) @ np.asarray(
        lay.dequantize_f32(packed), np.float64), rtol=1e-5, atol=1e-5)


def test_dispatch_backends_agree_on_cpu():
    qw = _qweight(31, (2,), 128, 128, 32)
    x = _x(32, 4, 128).reshape(2, 2, 128)
    ref = linear.int4_linear(x, qw, backend="reference", layer=1, out_dtype=jnp.float32)
    assert ref.shape == (2, 2, 128)
    assert linear.pick_backend("int4", 4, 128, 128, jnp.bfloat16) == "xla"  # CPU
    for backend, w, tol in (("auto", qw, 1e-2), ("xla", lay.pack_quantized(qw), 1e-2),
                            ("interpret", qw, 1e-2)):
        y = linear.int4_linear(x, w, backend=backend, layer=1, out_dtype=jnp.float32)
        assert _rel(y, np.asarray(ref, np.float64)) < tol, backend
    wd = jnp.asarray(np.random.default_rng(33).standard_normal((128, 64)).astype(np.float32)).astype(jnp.bfloat16)
    dref = np.asarray(linear.dense_linear(x, wd, backend="reference", out_dtype=jnp.float32), np.float64)
    for backend in ("auto", "xla", "interpret"):
        assert _rel(linear.dense_linear(x, wd, backend=backend, out_dtype=jnp.float32), dref) < 1e-2
    with pytest.raises(ValueError, match="backend="):
        linear.int4_linear(x, qw, backend="cuda", layer=1)
    with pytest.raises(ValueError, match="layer="):
        linear.int4_linear(x, qw)
    with pytest.raises(ValueError, match="no dense kernel"):
        linear.dense_linear(x, wd, backend="triton")


def test_bad_inputs_raise():
    p = lay.pack_quantized(_qweight(41, (), 256, 128, 64))
    x = _x(42, 2, 256)
    with pytest.raises(ValueError, match="bfloat16"):
        mg.int4_matmul_mgpu(x.astype(jnp.float32), p, variant="smem")
    with pytest.raises(ValueError, match="K=256"):
        mg.int4_matmul_mgpu(x[:, :128], p, variant="smem")
    with pytest.raises(ValueError, match="1..64"):
        mg.int4_matmul_mgpu(jnp.zeros((65, 256), jnp.bfloat16), p, variant="smem")
    with pytest.raises(ValueError, match="interpret mode"):
        mg.int4_matmul_mgpu(x, p, variant="mma", interpret=True)
    with pytest.raises(ValueError, match="variant"):
        mg.int4_matmul_mgpu(x, p, variant="regs")
    with pytest.raises(ValueError, match="layer="):
        mg.int4_matmul_mgpu(x, p, layer=0, variant="smem")
    with pytest.raises(TypeError, match="W4A16Packed"):
        mg.int4_matmul_mgpu(x, _qweight(41, (), 256, 128, 64), variant="smem")
    with pytest.raises(ValueError, match="k_tile"):
        mg.int4_matmul_mgpu(x, p, config=mg.MgpuConfig(wgs=1, k_tile=96), variant="smem")
    with pytest.raises(ValueError, match="wgs"):
        mg.int4_matmul_mgpu(x, lay.pack_quantized(_qweight(41, (), 256, 64, 64)),
                            config=mg.MgpuConfig(wgs=2, k_tile=64), variant="smem")
    with pytest.raises(ValueError, match="reduce"):
        mg.int4_matmul_mgpu(x, p, config=mg.MgpuConfig(wgs=1, k_tile=64, splits=2, reduce="atomic"),
                            variant="smem")
    with pytest.raises(ValueError, match="interpret mode"):
        mg.int4_matmul_mgpu(x, p, config=mg.MgpuConfig(wgs=1, k_tile=64, splits=2, reduce="cluster"),
                            variant="smem", interpret=True)
    with pytest.raises(ValueError, match="tma_view"):
        mg.int4_matmul_mgpu(x, p, config=mg.MgpuConfig(wgs=1, k_tile=64, tma_view="narrow"), variant="smem")
    with pytest.raises(ValueError, match="diag"):
        mg.int4_matmul_mgpu(x, p, config=mg.MgpuConfig(wgs=1, k_tile=64, diag="fast"), variant="smem")
    w = jnp.zeros((256, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 weights"):
        mg.bf16_matmul_mgpu(x, w.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"\[L, K, N\] with layer="):
        mg.bf16_matmul_mgpu(x, w[None])
    with pytest.raises(ValueError, match="multiple of 64"):
        mg.bf16_matmul_mgpu(x, w[:, :96])


# ---------------------------------------------------------------------------- CUDA lowering
def _lower(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("g,lead,cfg", [
    (32, (), None),
    (64, (3,), mg.MgpuConfig(wgs=2, k_tile=128, splits=2)),
    (128, (), mg.MgpuConfig(wgs=1, k_tile=256, splits=2, reduce="cluster")),
    (32, (2,), mg.MgpuConfig(wgs=4, k_tile=256, splits=2, reduce="cluster", tma_view="wide")),
    (32, (), mg.MgpuConfig(wgs=1, k_tile=256, splits=2, reduce="cluster", tma_view="wide", k_groups=2)),
])
@pytest.mark.parametrize("m", [1, 13])
@pytest.mark.parametrize("variant", ["mma", "wgmma"])
def test_register_kernel_lowers_for_cuda(g, lead, cfg, m, variant):
    """The GPU code paths (register operand, TMA, barriers, both split-K reductions) lower to a
    Mosaic GPU custom call without a GPU; run the same check under jax 0.11 by hand (docs)."""
    k, n = 1024, 256
    c = max(64, g)
    w = lay.W4A16Packed(qw=jax.ShapeDtypeStruct((*lead, n // 64, k // 64, 128, 4), jnp.uint32),
                        sz=jax.ShapeDtypeStruct((*lead, n // 64, k // c, 64 * c // g), jnp.uint32),
                        group_size=g)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    f = functools.partial(lambda x, w, layer: mg.int4_matmul_mgpu(
        x, w, layer=layer if lead else None, config=cfg, variant=variant, interpret=False))
    text = _lower(f, jax.ShapeDtypeStruct((m, k), jnp.bfloat16), w, layer)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("cfg,swiglu", [(None, False), (mg.MgpuConfig(wgs=1, k_tile=128, splits=4, reduce="cluster"),
                                                            False), (None, True)])
def test_bf16_kernel_lowers_for_cuda(cfg, swiglu):
    f = lambda x, w: mg.bf16_matmul_mgpu(x, w, config=cfg, interpret=False, swiglu=swiglu)  # noqa: E731
    text = _lower(f, jax.ShapeDtypeStruct((5, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16))
    assert "mosaic_gpu" in text


@pytest.mark.slow
def test_bench_quick_runs_the_mosaic_twins():
    """The benchmark harness end to end on the CPU (~35 s: each interpret-mode kernel in the timing
    loop compiles anew): Mosaic rows (the twins) are checked against the oracle, timed and
    reported next to the bf16 baseline."""
    from qspec_jax.bench import w4a16 as bench

    records = bench.run(quick=True, shapes={"tiny": (128, 64)}, m_values=(3,), groups=(32,),
                        impls=("bf16", "mosaic_bf16", "mosaic_int4"), log=lambda s: None)
    rows = {r["impl"]: r for r in records[1:]}
    assert set(rows) == {"bf16", "mosaic_bf16", "mosaic_int4"}
    for r in rows.values():
        assert r["status"] == "ok" and r["rel_err"] <= 2e-2 and r["ms"] > 0, r
        assert r["frac_ceiling"] > 0 and r["floor_ms"] > 0
    assert rows["mosaic_int4"]["G"] == 32 and rows["mosaic_int4"]["best"]
    assert rows["mosaic_int4"]["bytes"] == 128 * 64 // 2 + 2 * (128 // 32) * 64 * 2 + 2 * 3 * (128 + 64)
    summary = bench.summary_rows(records)
    assert len(summary) == 1 and summary[0][:4] == ["tiny", "128x64", 32, 3]
    with pytest.raises(ValueError, match="unknown impls"):
        bench.run(quick=True, impls=("cublas",), log=lambda s: None)


@pytest.mark.parametrize("chains", [2, 4])
@pytest.mark.parametrize("kt", [64, 256])
def test_mma_chains_split_the_accumulator(chains, kt, monkeypatch):
    """MgpuConfig(mma_chains=c): a stage's KT/16 k16 steps go round-robin into c accumulator chains
    (each the same number of steps; no two consecutive steps in one chain), and the kernel with
    them lowers for CUDA to a different module than with one chain. Two chains are the default
    (QSPEC_W4A16_CHAINS overrides it, a bad value is named). The numerics (a changed float32
    summation order) are checked on the GPU by tools/device/w4a16_chains_gpu.py."""
    plan = mg.mma_chain_plan(kt, chains)
    assert len(plan) == kt // 16 and sorted(set(plan)) == list(range(chains))
    assert all(plan.count(c) == kt // 16 // chains for c in range(chains))
    assert all(a != b for a, b in zip(plan, plan[1:]))
    assert mg.mma_chain_plan(kt, 1) == [0] * (kt // 16)
    k, n, g = 512, 128, 32
    w = lay.W4A16Packed(qw=jax.ShapeDtypeStruct((n // 64, k // 64, 128, 4), jnp.uint32),
                        sz=jax.ShapeDtypeStruct((n // 64, k // 64, 64 * 64 // g), jnp.uint32), group_size=g)

    def lowered(c):
        cfg = mg.MgpuConfig(wgs=1, k_tile=kt, splits=1, mma_chains=c)
        return _lower(lambda x, w: mg.int4_matmul_mgpu(x, w, config=cfg, interpret=False),
                      jax.ShapeDtypeStruct((1, k), jnp.bfloat16), w)

    one, text = lowered(1), lowered(chains)
    assert "mosaic_gpu" in text and text != one
    assert mg.default_config(k, n, g).mma_chains == mg.MgpuConfig().mma_chains == 2
    monkeypatch.setenv("QSPEC_W4A16_CHAINS", str(chains))
    assert mg.default_config(k, n, g).mma_chains == chains
    monkeypatch.setenv("QSPEC_W4A16_CHAINS", "3")
    with pytest.raises(ValueError, match="QSPEC_W4A16_CHAINS='3'"):
        mg.default_config(k, n, g)
    monkeypatch.delenv("QSPEC_W4A16_CHAINS")
    with pytest.raises(ValueError, match="mma_chains=3"):
        mg.int4_matmul_mgpu(jnp.zeros((1, k), jnp.bfloat16), w, config=mg.MgpuConfig(wgs=1, mma_chains=3),
                            interpret=False)


@pytest.mark.parametrize("pdl", [False, True])
def test_programmatic_dependent_launch_is_opt_in(pdl):
    """MgpuConfig(pdl=True) puts a grid-dependency wait (and the early trigger) into the kernel
    (jax >= 0.11 then launches it with the PDL attribute); the default kernel has neither. The
    interpret-mode twin never waits (the interpreter has no grid dependencies)."""
    k, n, g = 512, 128, 32
    w = lay.W4A16Packed(qw=jax.ShapeDtypeStruct((n // 64, k // 64, 128, 4), jnp.uint32),
                        sz=jax.ShapeDtypeStruct((n // 64, k // 64, 64 * 64 // g), jnp.uint32), group_size=g)
    cfg = mg.MgpuConfig(wgs=1, k_tile=128, splits=1, pdl=pdl)
    text = _lower(lambda x, w: mg.int4_matmul_mgpu(x, w, config=cfg, interpret=False),
                  jax.ShapeDtypeStruct((1, k), jnp.bfloat16), w)
    assert ("griddepcontrol.wait" in text) == pdl
    assert ("griddepcontrol.launch_dependents" in text) == pdl
    assert mg.default_config(k, n, g).pdl is False
    qw = _qweight(51, (), k, n, g)
    p = lay.pack_quantized(qw)
    x = _x(52, 3, k)
    twin = mg.int4_matmul_mgpu(x, p, config=cfg.replace(reduce="gmem"), variant="smem", interpret=True)
    assert _rel(twin, _oracle(x, qw)) < 2e-2
