"""Compiled (non-interpret) correctness check of the Pallas kernels against the jnp references.

Run on the GPU before timing: python -m qspec_jax.bench.kernel_check. Exits non-zero on a
failure. Tolerances: float32 1e-5 (IEEE float32 dots, Triton), bf16 2e-2 relative (Frobenius; Triton
and the Mosaic GPU kernel). tools/device/check_attention.py adds the register-operand mapping
check, poisoned outputs and the bitwise T-invariance checks.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax import attention as A
from qspec_jax import model as M
from qspec_jax.bench.synthetic import attention_config, random_quant_cache
from qspec_jax.cache import DenseKVCache, QuantSpecCache
from qspec_jax.config import ModelConfig


def relerr(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def main(argv=None) -> int:
    import pallas_kernels as pk

    jax.config.update("jax_default_matmul_precision", "highest")  # the references in true float32

    interpret = jax.default_backend() != "gpu"
    fails = 0
    key = jax.random.PRNGKey(0)
    small = bool(argv) and "--small" in argv  # CPU smoke run
    quick = bool(argv) and "--quick" in argv  # GPU: Llama shape, bf16, T in (1, 7) only
    sizes = ((8, 2, 128, 512 + 200, 2), (3, 1, 64, 256 + 77, 3)) if small else \
        ((32, 8, 128, 8192 + 200, 2),) if quick else ((32, 8, 128, 8192 + 200, 2), (9, 3, 64, 4096 + 77, 3))
    for hq, hkv, d, ctx, b in sizes:
        cfg = attention_config(hq, hkv, d, layers=2)
        cache = random_quant_cache(cfg, b, ctx, key, layers=2, fp_start=3)
        # mixed rows: row 1 has no quantized tokens, row 2 (if any) half the context
        q_len = np.asarray(cache.q_len).copy()
        fp_len = np.asarray(cache.fp_len).copy()
        q_len[1], fp_len[1] = 0, 37
        if b > 2:
            q_len[2] = (ctx // 2) // 128 * 128
        cache = cache.replace(q_len=jnp.asarray(q_len), fp_len=jnp.asarray(fp_len))
        for view in ("draft", "target"):
            for t in ((1,) if small else (1, 7) if quick else (1, 5, 7)):
                for dtype in ((jnp.bfloat16,) if quick else (jnp.bfloat16, jnp.float32)):
                    qk = jax.random.fold_in(key, t)
                    q = jax.random.normal(qk, (b, t, hq, d)).astype(dtype)
                    tot = cache.q_len + cache.fp_len
                    q_pos = tot[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
                    ref = jax.jit(lambda q, p, c, l: A.quantized_cache_attention(q, p, c, l, view))(
                        q, q_pos, cache, jnp.int32(1))
                    # Triton always; the Mosaic GPU kernel (float16 operands) for 16-bit queries
                    for impl in ("triton", "mosaic") if dtype != jnp.float32 else ("triton",):
                        f = jax.jit(lambda q, p, c, l, impl=impl: pk.cache_attention(q, p, c, l, view=view,
                                                                                   interpret=interpret, impl=impl))
                        out = f(q, q_pos, cache, jnp.int32(1))
                        err = relerr(out, ref)
                        tol = 1e-5 if dtype == jnp.float32 else 2e-2
                        ok = err <= tol
                        fails += not ok
                        print(f"quant {impl:6s} {view:6s} Hq={hq} Hkv={hkv} D={d} T={t} {jnp.dtype(dtype).name:8s} "
                              f"relerr={err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
        # dense kernel
        kd, vd = jax.random.split(key)
        S = 512 if small else 4096
        shape = (2, b, hkv, S, d)
        k = jax.random.normal(kd, shape).astype(jnp.bfloat16)
        v = jax.random.normal(vd, shape).astype(jnp.bfloat16)
        lens = jnp.asarray([S, 1, S // 2][:b], jnp.int32)
        for t in (1, 5):
            q = jax.random.normal(key, (b, t, hq, d)).astype(jnp.bfloat16)
            q_pos = jnp.maximum(lens[:, None] - t + jnp.arange(t)[None, :], 0).astype(jnp.int32)
            out = jax.jit(lambda q, p, k, v: pk.dense_decode_attention(q, p, k, v, jnp.int32(1), interpret=interpret))(
                q, q_pos, k, v)
            k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (b, S))
            ref = jax.jit(A.dense_attention)(q, k[1], v[1], q_pos, k_pos)
            err = relerr(out, ref)
            fails += err > 2e-2
            print(f"dense Hq={hq} D={d} T={t} relerr={err:.2e} {'ok' if err <= 2e-2 else 'FAIL'}", flush=True)
    if quick:
        print(f"kernel_check: {fails} failure(s)", flush=True)
        return 1 if fails else 0
    # through the model
    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, dtype="float32", attention_impl="reference")
    params = M.init_random_params(cfg, jax.random.PRNGKey(1), scale=0.2)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 300), 0, 64)
    lengths = jnp.asarray([300, 170], jnp.int32)
    step = jax.random.randint(jax.random.PRNGKey(3), (2, 5), 0, 64)
    for cache in (QuantSpecCache.init(cfg, 2, 512), DenseKVCache.init(cfg, 2, 512)):
        _, cache = jax.jit(M.prefill)(params, tokens, lengths, cache)
        views = ("draft", "target") if isinstance(cache, QuantSpecCache) else ("target",)
        for view in views:
            logits = {}
            for impl in ("reference", "pallas"):
                p = M.Params(params.embed, params.layers, params.final_norm, params.lm_head,
                             cfg.replace(attention_impl=impl))
                logits[impl] = jax.jit(lambda p, s, c: M.decode(p, s, c, view=view)[0])(p, step, cache)
            err = relerr(logits["pallas"], logits["reference"])
            fails += err > 1e-4
            print(f"model decode {type(cache).__name__} {view} relerr={err:.2e} {'ok' if err <= 1e-4 else 'FAIL'}",
                  flush=True)
    print(f"kernel_check: {fails} failure(s)", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
