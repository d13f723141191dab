"""GPU check of the residual kernels' row sums (`mosaic_gpu.Epilogue.row_sums`) and of the norm kernels that
take them (`Epilogue.sums`). Not in CI.

    PYTHONPATH=. python3 tools/device/row_sums_gpu.py [--ms 1,8,32] [--shapes s_o,s_down,o,down]

Producers (the o / down shapes, residual; each at the model's launch shape, `default_config` with the
epilogue): on fresh random inputs, the output with `row_sums=True` bit for bit the output without (the sums
only read the stored tile), the sums twice the same bits (a race between the warps would differ), each row's
sums against the row alone (bit for bit: a row's order does not depend on M), against `chunk_row_sums` of the
output on the host CPU (float32 summation order only: relative 1e-6) and zero past M.
Consumers (SmolLM2's q|k|v and gate_up, K 576, where the norm runs in the consumers): the kernel given
`chunk_row_sums(x)` against `epilogue_reference` given the same sums (the check's TOL_BF16) and against the
kernel that sums x^2 itself (the same function: TOL_BF16).
Model (--model-batches): a SmolLM2-shaped draft's decode step with the sums (`LayerFusion.sums`) and without
(QSPEC_NORM_SUMS=1 against 0): logits within 2e-2 (bf16 roundings the norms' float32 scale moves).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.linear import layout as lay  # noqa: E402
from pallas_kernels.linear import mosaic_gpu as mg  # noqa: E402
from qspec_jax.bench.w4a16 import TOL_BF16  # noqa: E402

PRODUCERS = {"s_o": (576, 576), "s_down": (1536, 576), "o": (4096, 4096), "down": (14336, 4096)}
CONSUMERS = {"s_qkv": (576, 960, False), "s_gate_up": (576, 3072, True)}


def _weight(key, k: int, n: int) -> lay.W4A16Packed:
    kw, kg = jax.random.split(key)
    q = jax.random.randint(kw, (k, n), 0, 16).astype(jnp.uint8)
    packed = (q[0::2] | (q[1::2] << 4)).astype(jnp.uint8)
    scale = jax.random.uniform(kg, (k // 32, n), jnp.float32, 0.005, 0.02).astype(jnp.float16)
    return lay.pack_fields(packed, scale, jnp.full((k // 32, n), -0.08, jnp.float16))


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype == jnp.bfloat16 else a.view(np.uint32)


def check_producer(name: str, m: int, key) -> bool:
    k, n = PRODUCERS[name]
    kw, kx, kr = jax.random.split(key, 3)
    p = _weight(kw, k, n)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    res = jax.random.normal(kr, (m, n), jnp.float32).astype(jnp.bfloat16)
    cfg = mg.default_config(k, n, 32, reduce=mg.reduce_mode(m, False), epilogue=mg.Epilogue(residual=True))
    with_sums = jax.jit(lambda x, p, r: mg.int4_matmul_mgpu(x, p, residual=r, row_sums=True, config=cfg))
    plain = jax.jit(lambda x, p, r: mg.int4_matmul_mgpu(x, p, residual=r, config=cfg))
    (y, s), (_, s2), y0 = with_sums(x, p, res), with_sums(x, p, res), plain(x, p, res)
    out_bad = int((_bits(y) != _bits(y0)).sum())
    det = int((_bits(s) != _bits(s2)).sum())
    rows_bad = 0
    for i in range(min(m, 3)):  # a row alone: M 1's launch (its own reduce mode), the same order
        c1 = mg.default_config(k, n, 32, reduce=mg.reduce_mode(1, False), epilogue=mg.Epilogue(residual=True))
        _, s1 = jax.jit(lambda x, p, r: mg.int4_matmul_mgpu(x, p, residual=r, row_sums=True, config=c1))(
            x[i:i + 1], p, res[i:i + 1])
        rows_bad += int(c1 == cfg and not np.array_equal(_bits(s1)[:, 0], _bits(s)[:, i]))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        ref = np.asarray(mg.chunk_row_sums(jax.device_put(y, cpu), mg.rows_for(m)))
    sums = np.asarray(s)
    rel = float(np.abs(sums - ref).max() / max(np.abs(ref).max(), 1e-30))
    pad = int(np.count_nonzero(sums[:, m:]))
    ok = out_bad == 0 and det == 0 and rows_bad == 0 and rel <= 1e-6 and pad == 0 and sums.shape == ref.shape
    where = "kernel" if cfg.splits == 1 or cfg.reduce in ("cluster", "sem") else "XLA"
    print(f"producer {name:7s} M={m:2d} wgs {cfg.wgs} kt {cfg.k_tile} s {cfg.splits} {cfg.reduce} (sums in {where}): "
          f"{out_bad} output elements differ from row_sums=False, {det} sums differ between runs, {rows_bad} rows "
          f"differ alone, rel {rel:.1e} to chunk_row_sums, {pad} nonzero past M: {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def check_consumer(name: str, m: int, key) -> bool:
    k, n, swiglu = CONSUMERS[name]
    kw, kx, kg = jax.random.split(key, 3)
    p = _weight(kw, k, n)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    gw = (1.0 + 0.3 * jax.random.normal(kg, (k,), jnp.float32)).astype(jnp.bfloat16)
    if not mg.takes_norm_sums(k, n, 32, m, swiglu=swiglu, interpret=False):
        print(f"consumer {name} M={m}: the launch does not take norm_sums (norm_in_consumers false): FAIL")
        return False
    sums = mg.chunk_row_sums(x, mg.rows_for(m))
    given = jax.jit(lambda x, p, g, s: mg.int4_matmul_mgpu(x, p, norm_weight=g, norm_sums=s, swiglu=swiglu))
    own = jax.jit(lambda x, p, g: mg.int4_matmul_mgpu(x, p, norm_weight=g, swiglu=swiglu))
    a, a2, b = given(x, p, gw, sums), given(x, p, gw, sums), own(x, p, gw)
    det = int((_bits(a) != _bits(a2)).sum())
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        xc, pc, gc, sc = jax.device_put((x, p, gw, sums), cpu)
        epi = mg.Epilogue(norm=True, sums=True, swiglu=swiglu)
        ref = np.asarray(mg.epilogue_reference(xc, lay.dequantize_bf16(pc).astype(jnp.float32), epi, norm_weight=gc,
                                               norm_sums=sc), np.float32)
    af, bf = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(np.abs(ref).max(), 1e-30)
    rel, rel_own = float(np.abs(af - ref).max() / scale), float(np.abs(af - bf).max() / scale)
    ok = det == 0 and rel <= TOL_BF16 and rel_own <= TOL_BF16
    print(f"consumer {name:9s} M={m:2d}: rel {rel:.2e} to the reference given the sums, {rel_own:.2e} to the kernel "
          f"summing x^2 itself, {det} elements differ between runs: {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def check_model(b: int, n_layers: int = 4) -> bool:
    """One draft decode step of a SmolLM2-shaped model (random weights and cache) with the norms' sums
    from the residual kernels (`LayerFusion.sums`, QSPEC_NORM_SUMS=1) and without (0): logits close."""
    from qspec_jax import linear as qlinear
    from qspec_jax import model as M
    from qspec_jax.bench import synthetic
    from qspec_jax.bench.e2e import LLAMA31_8B
    from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

    cfg = LLAMA31_8B.replace(num_layers=n_layers, vocab_size=4096, hidden_size=576, intermediate_size=1536,
                             num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rope_scaling=None)
    params = M.init_random_params(cfg, jax.random.PRNGKey(int.from_bytes(os.urandom(4), "little")))
    draft = M.for_device(make_draft_params(params, DraftWeightsConfig(group_size=32, method="minmax")))
    cache = synthetic.random_quant_cache(cfg, b, 4096, jax.random.PRNGKey(1), group=128, gamma_max=8, fp_start=5)
    toks = jnp.arange(b, dtype=jnp.int32)[:, None] + 7
    out, fused = {}, {}
    for flag in ("1", "0"):
        os.environ[qlinear.NORM_SUMS_ENV] = flag
        fused[flag] = M._draft_fusion(draft, b).sums
        out[flag] = np.asarray(jax.jit(lambda c: M.decode(draft, toks, c, view="draft")[0])(cache), np.float32)
        jax.clear_caches()
    os.environ.pop(qlinear.NORM_SUMS_ENV)
    rel = float(np.linalg.norm(out["1"] - out["0"]) / np.linalg.norm(out["0"]))
    agree = float((out["1"].argmax(-1) == out["0"].argmax(-1)).mean())
    ok = fused["1"] and not fused["0"] and rel < 2e-2 and np.isfinite(out["1"]).all()
    print(f"model smollm2 B={b}: sums on {fused['1']} / off {not fused['0']}, draft logits rel {rel:.2e}, argmax "
          f"agree {agree:.2f}: {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,32")
    ap.add_argument("--shapes", default="s_o,s_down,o,down,s_qkv,s_gate_up")
    ap.add_argument("--model-batches", default="1,32", help="draft decode with / without the sums ('' : none)")
    args = ap.parse_args()
    key = jax.random.PRNGKey(int.from_bytes(os.urandom(4), "little"))  # fresh inputs every run
    fails = 0
    for name in args.shapes.split(","):
        for m in map(int, args.ms.split(",")):
            key, sub = jax.random.split(key)
            check = check_producer if name in PRODUCERS else check_consumer
            try:
                fails += not check(name, m, sub)
            except Exception as e:  # noqa: BLE001 (a launch that fails is a FAIL line, the rest still runs)
                print(f"{name} M={m}: {type(e).__name__}: {str(e)[:400]}: FAIL", flush=True)
                fails += 1
    for b in [int(v) for v in args.model_batches.split(",") if v]:
        try:
            fails += not check_model(b)
        except Exception as e:  # noqa: BLE001
            print(f"model B={b}: {type(e).__name__}: {str(e)[:400]}: FAIL", flush=True)
            fails += 1
    print("ALL OK" if not fails else f"{fails} FAILED")
    return int(bool(fails))


if __name__ == "__main__":
    sys.exit(main())
