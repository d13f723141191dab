"""The persistent layer-tail kernel (pallas_kernels/linear/tail_mgpu.py) on the CPU: GPU interpret
mode (one CTA; the jnp twin of the register MMA) against `layer_tail_reference`, stacked weights,
bitwise row invariance, the launch-shape choice, bad inputs and CUDA lowering of the GPU kernel.

The interpret-mode runs happen in a child process with 8 host devices (`_child`;
`tests/helpers/subproc.run_in_child` says why: with one host device the simulation of the kernel's
four or five warpgroups (now four or six) deadlocked on a 2-core machine, seen here). ~2-6 s per kernel call: the
child compiles each traced kernel's program once for all its warpgroups and calls
(`subproc.reuse_interpreter_programs`; ~7-15 s a call when every warpgroup compiled its own).
The GPU kernel (its grid-wide flags, chunk counters, register MMA, inline loads and stores) runs
in tools/device/check_tail.py against the same reference on the H200.
"""

import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear import layout as lay
from pallas_kernels.linear import tail_mgpu as tm

_spec = importlib.util.spec_from_file_location("subproc", Path(__file__).parent / "helpers" / "subproc.py")
subproc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(subproc)


def _child(fn: str, *args) -> None:
    """`fn(*args)` of this module in a child with 8 host devices (the module docstring says why), which
    compiles each interpreted kernel's program once (`subproc.reuse_interpreter_programs`)."""
    subproc.run_in_child(__file__, fn, *args)


def _packed(key: jax.Array, k: int, n: int, lead: tuple[int, ...] = (), g: int = 32) -> lay.W4A16Packed:
    k1, k2, k3 = jax.random.split(key, 3)
    # W = U s + z with codes U in 0..15: z ~ -8 s centres them, and s gives each product's outputs a
    # std near 1 (U - 8 has std ~4.6), so the residual and the MLP carry comparable shares of the output
    scale = jax.random.uniform(k2, (*lead, k // g, n), jnp.float32, 0.5, 1.5) / (4.6 * k ** 0.5)
    zero = scale * (-8.0 + 0.5 * jax.random.normal(k3, scale.shape))
    return lay.pack_fields(jax.random.bits(k1, (*lead, k // 2, n), jnp.uint8), scale.astype(jnp.float16),
                           zero.astype(jnp.float16))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))  # one compile, not one per eager op (~4 s a call)
def _inputs(seed: int, m: int, kq: int, d: int, f: int, lead: tuple[int, ...] = ()):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    ws = _packed(ks[0], kq, d, lead), _packed(ks[1], d, 2 * f, lead), _packed(ks[2], f, d, lead)
    attn = jax.random.normal(ks[3], (m, kq)).astype(jnp.bfloat16)
    x = jax.random.normal(ks[4], (m, d)).astype(jnp.bfloat16)
    gw = (1.0 + 0.3 * jax.random.normal(ks[5], (*lead, d))).astype(jnp.bfloat16)
    return attn, x, ws, gw


def _reference(attn, x, ws, gw, layer=None):
    pick = (lambda w: w) if layer is None else (lambda w: jax.tree.map(lambda a: a[layer], w))
    wo, wgu, wd = (lay.dequantize_bf16(pick(w)).astype(jnp.float32) for w in ws)
    return tm.layer_tail_reference(attn, x, wo, gw if layer is None else gw[layer], wgu, wd)


# The kernel and the reference differ only in float32 summation order (chunks, k groups, MMA
# chains against one HIGHEST dot) before each bf16 rounding: a near-tie may round to the other
# neighbour, one bf16 ulp (2^-8 relative) of an element, and carry into act and the down product.
# Relative to the output's norm that stays well under one ulp; the MLP's part of the output
# (out - x1) is ~20% of its norm here, so a missing or wrong linear, norm or SiLU fails by far.
TOL = 2.0 ** -8


def _rel(y: jax.Array, ref: jax.Array) -> float:
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def _cfg(chunks: tuple[int, int, int], stages: int, k_groups: int, k_tile: int = tm.KT) -> tm.TailConfig:
    return tm.TailConfig(chunks=chunks, ctas=1, stages=stages, k_groups=k_groups, k_tile=k_tile)


def check_reference(m: int, shape: tuple[int, int, int], cfg: tuple) -> None:
    attn, x, ws, gw = _inputs(m, m, *shape)
    y = tm.int4_layer_tail_mgpu(attn, x, ws[0], gw, ws[1], ws[2], config=_cfg(*cfg), interpret=True)
    ref = _reference(attn, x, ws, gw)
    assert y.shape == (m, shape[1]) and y.dtype == jnp.bfloat16
    assert _rel(y, ref) <= TOL, _rel(y, ref)
    x1 = tm.mg.epilogue_reference(attn, lay.dequantize_bf16(ws[0]).astype(jnp.float32),
                                  tm.mg.Epilogue(residual=True), residual=x)
    assert _rel(x1, ref) > 20 * TOL  # the MLP's share is far above the tolerance


@pytest.mark.parametrize("m,shape,cfg", [
    # M 9: M_pad 16, attn padded to it; one k group, o and down summed over two K chunks
    (9, (1024, 256, 512), ((2, 1, 2), 4, 1)),
    # two k groups (steps dealt round robin, partials added in group order), the ring reused (2 stages)
    (5, (1024, 512, 512), ((2, 1, 1), 2, 2)),
    # 32 rows (SmolLM2's batch 32; on the GPU the hand-off buffers are swizzled above 24)
    (32, (512, 256, 512), ((1, 1, 2), 2, 1)),
    # SmolLM2's tiles in small: k steps of 192 columns, D / 64 odd (o's and down's last pair its last tile twice)
    (3, (384, 192, 384), ((2, 1, 2), 2, 1, 192)),
])
def test_tail_matches_reference(m: int, shape: tuple[int, int, int], cfg: tuple) -> None:
    _child("check_reference", m, shape, cfg)


def check_stacked_rows() -> None:
    m, shape = 2, (512, 256, 512)
    attn, x, ws, gw = _inputs(7, m, *shape, lead=(3,))
    cfg = _cfg((2, 1, 2), 2, 1)
    run = jax.jit(lambda a, x, layer: tm.int4_layer_tail_mgpu(a, x, ws[0], gw, ws[1], ws[2], layer=layer, config=cfg,
                                                              interpret=True))
    y1 = np.asarray(run(attn, x, jnp.int32(1)))
    one = [jax.tree.map(lambda a: a[1], w) for w in ws]
    alone = np.asarray(tm.int4_layer_tail_mgpu(attn, x, one[0], gw[1], one[1], one[2], config=cfg, interpret=True))
    assert np.array_equal(y1.view(np.uint16), alone.view(np.uint16))
    assert _rel(y1, _reference(attn, x, ws, gw, layer=1)) <= TOL
    y2 = np.asarray(run(attn, x, jnp.int32(2)))
    assert not np.array_equal(y1, y2)  # another layer's weights
    assert np.array_equal(np.asarray(run(attn, x, jnp.int32(7))), y2)  # clamped to L - 1
    row = np.asarray(run(attn[1:], x[1:], jnp.int32(1)))  # the last row alone (M 1)
    assert np.array_equal(y1[1].view(np.uint16), row[0].view(np.uint16))
    # TailConfig.cluster changes only the GPU grid's phase ends: interpret mode (one CTA) computes the same bits
    yc = tm.int4_layer_tail_mgpu(attn, x, ws[0], gw, ws[1], ws[2], layer=1, config=cfg.replace(cluster=True),
                                 interpret=True)
    assert np.array_equal(np.asarray(yc).view(np.uint16), y1.view(np.uint16))


def test_stacked_weights_at_the_layer_and_rows_alone_bit_for_bit() -> None:
    """Stacks [L, ...] (weights and norm) at a traced layer give the layer's own result, bit for bit
    (the same kernel on the same data), the layer index is clamped like the linear kernels', and
    row i of an M-row call == the row computed alone (issue 11: a row's bits never depend on M); the
    cluster form's interpret run is the same kernel (its phase ends are GPU-only).
    One test for both: each interpret-mode kernel call costs seconds on a 2-core CPU."""
    _child("check_stacked_rows")


def check_sync_ref_serves_a_layer_loop(ready: bool) -> None:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, (kq, d, f), n_layers = 2, (512, 256, 512), 3
    attn, x, ws, gw = _inputs(11, m, kq, d, f, lead=(n_layers,))
    cfg = _cfg((2, 1, 2), 2, 1).replace(chunk_ready=ready)

    def call(layer, **kw):
        return tm.int4_layer_tail_mgpu(attn, x, ws[0], gw, ws[1], ws[2], layer=layer, config=cfg, interpret=True,
                                       **kw)

    @jax.jit
    def loop():
        sync = jax.new_ref(tm.sync_zeros(d, f), memory_space=plgpu.GMEM)

        def body(carry):  # a while loop, as the model's layer loop (jax 0.11 makes a static fori_loop a scan, whose
            i, ys, ss = carry  # carry drops a ref's memory space: H200, 2026-12-02)
            y, sums = call(i, row_sums=True, sync=sync, ordinal=i)
            return i + 1, ys.at[i].set(y), ss.at[i].set(sums)

        _, *outs = jax.lax.while_loop(lambda c: c[0] < n_layers, body, (
            jnp.int32(0), jnp.zeros((n_layers, m, d), jnp.bfloat16), jnp.zeros((n_layers, d // 64, 8), jnp.float32)))
        after = sync[...]
        call(0, sync=sync, ordinal=0)  # a call that says it is the ref's first: every wait finds another count
        return outs, after, sync[...]

    (ys, sums), after, wrong = loop()
    ys, sums, after, wrong = np.asarray(ys), np.asarray(sums), np.asarray(after), np.asarray(wrong)
    # each call of the loop: its layer's output, bit for bit the call made alone (a fresh ref), and its rows' sums
    np.testing.assert_array_equal(ys[1].view(np.uint16), np.asarray(call(1)).view(np.uint16))
    for i in range(n_layers):
        assert _rel(ys[i], _reference(attn, x, ws, gw, layer=i)) <= TOL
        np.testing.assert_allclose(sums[i], tm.mg.chunk_row_sums(jnp.asarray(ys[i]), 8), rtol=1e-5)
    # what the calls added: ctas (1) per flag, chunks - 1 per pair's chunk counter; with ready counters flag 1
    # has no arrivals and each K chunk of gate_up (one: 256 columns) counts its 2 o pairs, each of down's two
    # chunks (256 act columns) its 4 gate_up pairs
    o = tm.sync_offsets(d, f)
    want = np.zeros(tm.sync_words(d, f), np.uint32)
    want[tm.SYNC_FLAGS:tm.SYNC_FLAGS + (1 if ready else 2)] = n_layers
    want[o[0]:o[0] + d // 128] = n_layers * (2 - 1)
    want[o[2]:o[2] + d // 128] = n_layers * (2 - 1)
    if ready:
        r0 = tm.ready_offsets(d, f)
        assert tm.ready_pairs(cfg, d, f) == (2, 4)
        want[r0[0]] = n_layers * 2
        want[r0[1]:r0[1] + 2] = n_layers * 4
        # the same math as the flags' protocol, bit for bit
        flags = tm.int4_layer_tail_mgpu(attn, x, ws[0], gw, ws[1], ws[2], layer=1,
                                        config=cfg.replace(chunk_ready=False), interpret=True)
        np.testing.assert_array_equal(ys[1].view(np.uint16), np.asarray(flags).view(np.uint16))
    np.testing.assert_array_equal(after, want)  # the last two words: no wait found a count but its target
    assert wrong[-2] > 0 and wrong[-1] > 0  # the producer's and the finisher's waits saw the wrong ordinal


@pytest.mark.parametrize("ready", [False, True])
def test_one_sync_ref_serves_a_layer_loop(ready: bool) -> None:
    """One zeroed sync ref (`sync_words`) shared by a loop of calls, the loop's index as the ordinal:
    each call waits for its own counts ((ordinal + 1) x what a call adds; the interpret twin checks
    that every wait finds exactly that; each output the call's alone, bit for bit) and leaves the
    sums a call adds; a wrong ordinal shows in the twin's error words. The down epilogue's row sums (`row_sums`) are
    out's per 64-column tile. With `TailConfig.chunk_ready` the producer's waits are per K chunk: each ready
    counter holds its chunk's pairs, and the output is the flags' one bit for bit."""
    _child("check_sync_ref_serves_a_layer_loop", ready)


def test_default_config_balances_units_over_the_ctas() -> None:
    """The 8B tail on 132 SMs: each linear's K chunks minimise the most k steps one CTA streams,
    units a multiple of the k groups, the ring within the shared-memory budget."""
    kq, d, f = 4096, 4096, 14336
    cfg = tm.default_tail_config(kq, d, f, 32, 1, num_sms=132)
    assert cfg.ctas == 132 and cfg.k_groups == 2 and cfg.stages % 2 == 0
    assert cfg.stages * tm.ring_stage_bytes(8, 32) + tm.hand_bytes(8, 2, cfg.hand_bufs) <= tm.mg.SMEM_BUDGET
    # the deepest such ring: one more stage would not fit beside the hand-off buffers
    assert (cfg.stages + 2) * tm.ring_stage_bytes(8, 32) + tm.hand_bytes(8, 2, cfg.hand_bufs) > tm.mg.SMEM_BUDGET
    for (k, pairs), ch in zip(((kq, d // 128), (d, f // 64), (f, d // 128)), cfg.chunks):
        steps = k // tm.KT
        assert steps % ch == 0 and (steps // ch) % cfg.k_groups == 0

        def most(c: int, steps: int = steps, pairs: int = pairs) -> int:
            return -(-(pairs * c) // cfg.ctas) * (steps // c)

        assert all(most(ch) <= most(c) for c in range(1, steps + 1) if steps % c == 0 and (steps // c) % 2 == 0)
    assert tm.linear_units(cfg, d, f) == tuple(p * c for p, c in zip((32, 224, 32), cfg.chunks))
    # two CTAs per SM: a shallower ring that two of fit on one SM
    two = tm.default_tail_config(kq, d, f, 32, 16, num_sms=132, ctas_per_sm=2)
    assert two.ctas == 264 and 2 * two.stages * tm.ring_stage_bytes(16, 32) <= 2 * tm.TAIL_SMEM


def test_bad_inputs_name_the_problem() -> None:
    attn, x, ws, gw = _inputs(0, 2, 512, 256, 512)
    call = lambda **kw: tm.int4_layer_tail_mgpu(**{**dict(attn=attn, x=x, wo=ws[0], norm_weight=gw,  # noqa: E731
                                                          w_gate_up=ws[1], w_down=ws[2], interpret=True), **kw})
    with pytest.raises(ValueError, match=r"attn must be bfloat16 \[M, 512\]"):
        call(attn=attn.astype(jnp.float32))
    with pytest.raises(ValueError, match="same M"):
        call(x=x[:1])
    with pytest.raises(ValueError, match=r"the same M in 1\.\.32 rows; got 33 and 33"):
        call(attn=jnp.zeros((33, 512), jnp.bfloat16), x=jnp.zeros((33, 256), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"w_gate_up must be \[D, 2F\]"):
        call(w_gate_up=ws[2])
    with pytest.raises(TypeError, match="w_down must be a W4A16Packed"):
        call(w_down=lay.dequantize_bf16(ws[2]))
    with pytest.raises(ValueError, match=r"norm_weight must be bfloat16 \[D=256\]"):
        call(norm_weight=gw[:128])
    with pytest.raises(ValueError, match="need layer= exactly when stacked"):
        call(layer=0)
    with pytest.raises(ValueError, match="chunk count 0 must divide"):
        call(config=tm.TailConfig(chunks=(3, 1, 1), ctas=1, stages=2, k_groups=1))
    with pytest.raises(ValueError, match="k_groups must be 1 or 2"):
        call(config=tm.TailConfig(chunks=(1, 1, 1), ctas=1, stages=3, k_groups=2))
    with pytest.raises(ValueError, match="only on the GPU"):
        call(config=tm.TailConfig(chunks=(1, 1, 1), ctas=1, stages=2, k_groups=1, diag="stream"))
    with pytest.raises(ValueError, match="only on the GPU"):
        call(config=tm.TailConfig(chunks=(1, 1, 1), ctas=1, stages=2, k_groups=1, timeline=True))
    with pytest.raises(ValueError, match=r"a cluster holds 1..16 CTAs \(ctas\)"):
        call(config=tm.TailConfig(chunks=(1, 1, 1), ctas=17, stages=2, k_groups=1, cluster=True), interpret=False)
    with pytest.raises(ValueError, match="no chunk_ready"):
        call(config=tm.TailConfig(chunks=(1, 1, 1), ctas=8, stages=2, k_groups=1, cluster=True, chunk_ready=True),
             interpret=False)
    with pytest.raises(ValueError, match="no diag noflag0 / noflag1"):
        call(config=tm.TailConfig(chunks=(1, 1, 1), ctas=8, stages=2, k_groups=1, cluster=True, diag="noflag1"),
             interpret=False)
    with pytest.raises(ValueError, match="l2_prefetch >= 0"):
        call(config=tm.TailConfig(chunks=(1, 1, 1), ctas=1, stages=2, k_groups=1, l2_prefetch=-1))
    with pytest.raises(ValueError, match="ordinal=2 counts the earlier calls on a shared sync ref: pass sync="):
        call(ordinal=2)
    with pytest.raises(ValueError, match=r"sync must be a uint32 \[28\] ref \(sync_words\(D=256, F=512\)\), got "
                                         r"int32 \(28,\)"):
        call(sync=jnp.zeros((28,), jnp.int32), ordinal=1)


def test_smollm2_tiles_are_taken_with_192_column_k_steps() -> None:
    """SmolLM2's layer (Kq = D = 576, F = 1536, group 32): no 256-column k tile divides 576, 192 does
    (`k_tile_for`), D / 64 = 9 row tiles make 5 pairs of o and down (the last its last tile twice), and
    the GPU kernel lowers for CUDA at 32 rows as one cluster of 16 CTAs; a K no k tile divides, or a D
    that is not a multiple of 64, is refused by name."""
    kq, d, f = 576, 576, 1536
    assert tm.k_tile_for(kq, d, f, 32) == 192 and tm.k_tile_for(4096, 4096, 14336, 32) == 256
    assert tm.k_tile_for(kq, d, f, 256) is None  # records of 256 columns: no k tile of 576 holds whole ones
    assert tm.takes(kq, d, f, 32) and not tm.takes(kq, d, f, 33) and not tm.takes(kq, 544, f, 1)
    assert tm.linear_pairs(d, f) == (5, 24, 5)
    assert [int(t) for t in tm.pair_tiles(0, 4, d, f)] == [8, 8] and tm.pair_tiles(2, 3, d, f) == [6, 7]
    cfg = tm.default_tail_config(kq, d, f, 32, 32, num_sms=16).replace(cluster=True)
    assert cfg.k_tile == 192 and cfg.ctas == 16

    def packed(k: int, n: int) -> lay.W4A16Packed:
        return lay.pack_fields(jnp.zeros((2, k // 2, n), jnp.uint8), jnp.ones((2, k // 32, n), jnp.float16),
                               jnp.zeros((2, k // 32, n), jnp.float16))

    wo, wgu, wd = packed(kq, d), packed(d, 2 * f), packed(f, d)
    args = (jnp.zeros((32, kq), jnp.bfloat16), jnp.zeros((32, d), jnp.bfloat16), jnp.ones((2, d), jnp.bfloat16),
            jnp.int32(1))
    text = jax.jit(lambda a, x, g, layer: tm.int4_layer_tail_mgpu(a, x, wo, g, wgu, wd, layer=layer, config=cfg,
                                                                  interpret=False)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "barrier.cluster.wait.acquire.aligned" in text
    with pytest.raises(ValueError, match=r"k_tile=256: must be a multiple of 64 \(group 32\) dividing Kq=576"):
        tm.int4_layer_tail_mgpu(*args[:2], wo, args[2], wgu, wd, layer=1, config=cfg.replace(k_tile=256),
                                interpret=False)


@pytest.mark.parametrize("m,cfg", [(1, None), (16, tm.TailConfig(chunks=(4, 2, 7), ctas=264, stages=4, k_groups=1)),
                                   (1, tm.TailConfig(chunks=(4, 4, 4), ctas=132, stages=6, timeline=True,
                                                     l2_prefetch=2)),
                                   (1, tm.TailConfig(chunks=(4, 4, 4), ctas=132, stages=6, diag="stream")),
                                   (1, tm.TailConfig(chunks=(4, 4, 4), ctas=132, stages=6, diag="raw")),
                                   (1, tm.TailConfig(chunks=(4, 4, 4), ctas=132, stages=6, chunk_ready=True)),
                                   (1, tm.TailConfig(chunks=(1, 1, 1), ctas=132, stages=6)),
                                   (8, tm.TailConfig(chunks=(1, 1, 1), ctas=16, stages=6, cluster=True)),
                                   (1, tm.TailConfig(chunks=(2, 2, 2), ctas=8, stages=6, cluster=True)),
                                   (32, tm.TailConfig(chunks=(4, 4, 4), ctas=132, stages=2, k_groups=2))])
def test_gpu_kernel_lowers_for_cuda(m: int, cfg: tm.TailConfig | None) -> None:
    """The GPU kernel (register MMA, flags, chunk counters, inline loads / stores and column sums; with
    two CTAs per SM, the timeline's stamps and the L2 prefetch; the ring-alone diagnostic with its
    store of x back into place; the MMA on raw codes; the ready counters' per-unit waits; one cluster
    whose phase ends are the cluster barrier, with and without chunk counters; 32 rows, whose hand-off
    buffers are swizzled) at the 8B shape,
    stacked weights, lowers to a Mosaic GPU custom call on the CPU; at M 1, with the down epilogue's
    row sums and a sync ref made under jit with a traced ordinal (a layer loop's)."""
    def packed(k: int, n: int) -> lay.W4A16Packed:
        return lay.pack_fields(jnp.zeros((2, k // 2, n), jnp.uint8), jnp.ones((2, k // 32, n), jnp.float16),
                               jnp.zeros((2, k // 32, n), jnp.float16))

    kq, d, f = 4096, 4096, 14336
    wo, wgu, wd = packed(kq, d), packed(d, 2 * f), packed(f, d)

    def fn(attn, x, g, layer):
        if cfg is None:
            from jax.experimental.pallas import mosaic_gpu as plgpu

            sync = jax.new_ref(tm.sync_zeros(d, f), memory_space=plgpu.GMEM)
            return tm.int4_layer_tail_mgpu(attn, x, wo, g, wgu, wd, layer=layer, row_sums=True, sync=sync,
                                           ordinal=layer, interpret=False)
        return tm.int4_layer_tail_mgpu(attn, x, wo, g, wgu, wd, layer=layer, config=cfg, interpret=False)

    args = (jnp.zeros((m, kq), jnp.bfloat16), jnp.zeros((m, d), jnp.bfloat16), jnp.ones((2, d), jnp.bfloat16),
            jnp.int32(1))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    cluster = cfg is not None and cfg.cluster  # its phase ends: every thread arrives (the finisher releasing), waits
    assert ("barrier.cluster.arrive.release.aligned" in text) == cluster
    assert ("barrier.cluster.arrive.relaxed.aligned" in text) == cluster
    assert ("barrier.cluster.wait.acquire.aligned" in text) == cluster
    if cfg is not None and cfg.chunks == (1, 1, 1):  # no chunk counters: only grid-wide flags count / poll in gmem
        assert ("red.release.gpu.global.add" in text) == (not cluster)
        assert ("ld.acquire.gpu.global" in text) == (not cluster)
    if cfg is None:  # out and its rows' sums
        out, sums = jax.eval_shape(fn, *args)
        assert (out.shape, sums.shape, sums.dtype) == ((m, d), (d // 64, 8), jnp.float32)
    if cfg is not None and cfg.timeline:  # the output and the per-CTA timeline
        out, tl = jax.eval_shape(fn, *args)
        assert (out.shape, tl.shape, tl.dtype) == ((m, d), (cfg.ctas, len(tm.TIMELINE_COLUMNS)), jnp.uint32)
