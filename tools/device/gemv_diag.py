"""Where the AR-bf16 step loses bandwidth: the 8B layer's dense linears alone, as scanned / unrolled /
per-layer arrays / fused (docs/BENCHMARKS.md, "Where the time goes"; log: docs/bench/gemv_diag_h100.log).

    python tools/device/gemv_diag.py                                   # Triton GEMMs (XLA default)
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python tools/device/gemv_diag.py
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false MODE=f32acc SHORT=1 python tools/device/gemv_diag.py
MODE: bf16 | f32acc (float32-result dots, cast back) | f32acc_keep | einsum_bf16. SMALL=1: CPU smoke sizes.
Run it without importing qspec_jax (which would set the Triton flag itself).
"""
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

SMALL = os.environ.get("SMALL") == "1"
D, F, KV, L = (256, 512, 64, 4) if SMALL else (4096, 14336, 1024, 32)
N = 8
key = jax.random.PRNGKey(0)
def w(k, shape):
    return (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
ks = jax.random.split(key, 8)
stacked = {"q": w(ks[0], (L, D, D)), "k": w(ks[1], (L, D, KV)), "v": w(ks[2], (L, D, KV)), "o": w(ks[3], (L, D, D)),
           "g": w(ks[4], (L, D, F)), "u": w(ks[5], (L, D, F)), "d": w(ks[6], (L, F, D))}
nbytes = sum(a.size * 2 for a in stacked.values())
MODE = os.environ.get("MODE", "bf16")
def mm(x, w):
    if MODE == "bf16":
        return x @ w
    if MODE == "f32acc":
        return jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    if MODE == "f32acc_keep":
        return jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32)
    if MODE == "einsum_bf16":
        return jnp.einsum("...i,io->...o", x, w)
def layer(x, p):
    q, k, v = mm(x, p["q"]), mm(x, p["k"]), mm(x, p["v"])
    x = x + (mm(q.astype(x.dtype), p["o"])).astype(x.dtype) + (k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True)).astype(x.dtype)
    x = x + mm((jax.nn.silu(mm(x, p["g"])) * mm(x, p["u"])).astype(x.dtype), p["d"]).astype(x.dtype)
    return jnp.tanh(x.astype(jnp.float32)).astype(jnp.bfloat16)
def layer_fused(x, p):
    qkv = x @ p["qkv"]
    q, k, v = qkv[:, :D], qkv[:, D:D + KV], qkv[:, D + KV:]
    x = x + (q @ p["o"]) + (k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True)).astype(x.dtype)
    gu = x @ p["gu"]
    x = x + (jax.nn.silu(gu[:, :F]) * gu[:, F:]) @ p["d"]
    return jnp.tanh(x.astype(jnp.float32)).astype(jnp.bfloat16)
def scan_model(unroll, fn=layer):
    def step(params, x):
        def body(_, x):
            return jax.lax.scan(lambda x, p: (fn(x, p), None), x, params, unroll=unroll)[0]
        return jax.lax.fori_loop(0, N, body, x)
    return jax.jit(step)
def list_model(params_list, x):
    def body(_, x):
        for p in params_list:
            x = layer(x, p)
        return x
    return jax.lax.fori_loop(0, N, body, x)
res = {"bytes_per_step": nbytes}
def timeit(name, f, *args):
    t0 = time.perf_counter(); jax.block_until_ready(f(*args)); c = time.perf_counter() - t0
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t0)
    ms = statistics.median(ts) / N * 1e3
    res[name] = {"ms_per_step": ms, "TB_s": nbytes / (ms / 1e3) / 1e12, "compile_s": c}
    print(f"{name:34s} {ms:8.3f} ms/step  {res[name]['TB_s']:.2f} TB/s  (first call {c:.1f}s)", flush=True)
x = jnp.ones((1, 1, D) if os.environ.get("X3") else (1, D), jnp.bfloat16)
for u in ((1,) if os.environ.get("SHORT") else (1, 2, 8, True)):
    timeit(f"scan stacked, unroll={u}", scan_model(u), stacked, x)
if os.environ.get("SHORT"):
    json.dump(res, open(os.environ.get("OUT", "/tmp") + f"/gemv_diag_{MODE}.json", "w")); raise SystemExit
plist = [jax.tree.map(lambda a: a[i], stacked) for i in range(L)]
timeit("python loop, per-layer arrays", jax.jit(list_model), plist, x)
del plist
fused = {"qkv": jnp.concatenate([stacked["q"], stacked["k"], stacked["v"]], -1), "o": stacked["o"],
         "gu": jnp.concatenate([stacked["g"], stacked["u"]], -1), "d": stacked["d"]}
del stacked
timeit("scan stacked, fused qkv/gate-up", scan_model(1, layer_fused), fused, x)
timeit("scan stacked, fused, unroll=True", scan_model(True, layer_fused), fused, x)
out = os.environ.get("OUT", "/tmp")
json.dump(res, open(f"{out}/gemv_diag.json", "w"), indent=1)
