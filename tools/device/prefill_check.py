"""GPU check of the prefill attention paths (issue 30), on fresh random inputs.

1. `attention.prefill_attention` (whole prompt) and `attention.chunk_attention` (a chunk over a
   hierarchical or dense cache's prefix + itself) through cuDNN against the jnp reference in
   float32: norm-relative error, NaN check, every output element written (poisoned first).
2. `model.prefill` of a small 8B-headed model, whole vs chunked, cuDNN vs reference: logits.
3. Greedy speculative decoding equals autoregressive decoding of the same target, token for
   token, after a chunked prefill (both share it).

    python tools/device/prefill_check.py [--quick]

Prints one line per check and `ALL OK` / `FAILED: n` last; exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax import model as M
from qspec_jax.attention import chunk_attention, prefill_attention
from qspec_jax.cache import DenseKVCache, QuantSpecCache, prefill_quantized_len
from qspec_jax.config import ModelConfig

FAILED: list[str] = []
IMPL = "cudnn"  # --impl: "xla" dry-runs this script on a CPU


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def attention_checks(seed: int, t: int, c: int, heads: tuple[int, int, int], group: int) -> None:
    hq, hkv, d = heads
    cfg = ModelConfig(vocab_size=64, hidden_size=hq * d, intermediate_size=128, num_layers=1, num_heads=hq,
                      num_kv_heads=hkv, head_dim=d)
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    b = 2
    q = jax.random.normal(ks[0], (b, t, hq, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, hkv, t, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, hkv, t, d), jnp.float32).astype(jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    lengths = jnp.array([t, t - c - group // 2 - 3], jnp.int32)  # a shorter second row: another Q

    ref = prefill_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), pos, None, "reference")
    got = jax.jit(lambda q, k, v: prefill_attention(q, k, v, pos, None, IMPL))(q, k, v)
    check(f"whole T={t} heads={heads}", rel(got, ref) < 2e-2 and bool(jnp.isfinite(got).all()),
          f"rel err {rel(got, ref):.2e}")

    for kind in ("int8", "bf16"):
        if kind == "int8":
            cache = QuantSpecCache.init(cfg, b, t, group_size=group).prefill_layer(0, k, v, lengths)
            qlen = prefill_quantized_len(lengths, group)
        else:
            cache = DenseKVCache.init(cfg, b, t).prefill_layer(0, k, v, lengths)
            qlen = jnp.zeros_like(lengths)
        # Prefix spans (keys per cuDNN call): the default (the whole cache here), one chunk, two
        # chunks (at start 3C: [C, 3C) and [0, C), the lower read as [0, 2C) with its upper half masked).
        for start, keys in sorted({(0, None), (c, None), (t - c, None), (t - c, c), (t - c, 2 * c)}, key=str):
            sl = lambda x, ax: jax.lax.dynamic_slice_in_dim(x, start, c, axis=ax)  # noqa: E731
            qc, kc, vc, pc = sl(q, 1), sl(k, 2), sl(v, 2), sl(pos, 1)
            fn = jax.jit(lambda qc, kc, vc, cache: chunk_attention(qc, kc, vc, pc, cache, 0, start, c, qlen, None, IMPL,
                                                                   keys))
            got = fn(qc, kc, vc, cache)
            ref = chunk_attention(qc.astype(jnp.float32), kc, vc, pc, cache, 0, start, c, qlen, None, "reference")
            # Row 1's queries past its length see garbage by design: compare valid rows only.
            valid = (pc < lengths[:, None])[:, :, None, None]
            err = rel(jnp.where(valid, got, 0), jnp.where(valid, ref, 0))
            check(f"chunk {kind} T={t} start={start} C={c} prefix_keys={keys} heads={heads}",
                  err < 2e-2 and bool(jnp.isfinite(got).all()), f"rel err {err:.2e}")


def model_checks(quick: bool) -> None:
    cfg = ModelConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_layers=2, num_heads=8,
                      num_kv_heads=2, head_dim=128, max_position_embeddings=1 << 16)
    params = M.for_device(M.init_random_params(cfg, jax.random.PRNGKey(3)))
    t, c, g = (2048, 512, 128) if quick else (8192, 2048, 128)
    toks = jax.random.randint(jax.random.PRNGKey(4), (2, t), 0, cfg.vocab_size, jnp.int32)
    lengths = jnp.array([t, t - 700], jnp.int32)
    mk = lambda: QuantSpecCache.init(cfg, 2, t + 256, group_size=g)  # noqa: E731
    out = {}
    for impl in ("reference", IMPL):
        p = params.replace(config=cfg.replace(prefill_attention_impl=impl))
        for chunk in (None, c):
            fn = jax.jit(lambda p, toks, lengths, cache, chunk=chunk: M.prefill(p, toks, lengths, cache, chunk=chunk)[0])
            out[(impl, chunk)] = np.asarray(fn(p, toks, lengths, mk()), np.float32)
    for chunk in (None, c):
        err = rel(out[(IMPL, chunk)], out[("reference", chunk)])
        check(f"model prefill {IMPL} vs reference, chunk={chunk}", err < 3e-2, f"rel err of logits {err:.2e}")
    err = rel(out[(IMPL, c)], out[(IMPL, None)])
    check(f"model prefill chunked vs whole ({IMPL})", err < 1e-1, f"rel err of logits {err:.2e} (INT8 prefix)")
    agree = float((out[(IMPL, c)].argmax(-1) == out[(IMPL, None)].argmax(-1)).mean())
    print(f"     argmax agreement chunked vs whole: {agree:.2f}")


def exactness_check(quick: bool) -> None:
    from qspec_jax.generation import GenerationConfig, autoregressive_loop
    from qspec_jax.speculative import SpecConfig, speculative_loop
    from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

    cfg = ModelConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_layers=2, num_heads=8,
                      num_kv_heads=2, head_dim=128, max_position_embeddings=1 << 16)
    raw = M.init_random_params(cfg, jax.random.PRNGKey(5), scale=0.05)
    params = M.for_device(raw)
    draft = M.for_device(make_draft_params(raw, DraftWeightsConfig(method="clip")))
    t, c = (2048, 512) if quick else (6144, 2048)
    toks = jax.random.randint(jax.random.PRNGKey(6), (1, t), 0, cfg.vocab_size, jnp.int32)
    lengths = jnp.array([t - 77], jnp.int32)
    spec = SpecConfig(gamma=4, max_new_tokens=64, eos_token_ids=())
    gen = GenerationConfig(max_new_tokens=64, kv="int8", eos_token_ids=(), width=spec.verify_width)
    max_len = t + 256

    def prefilled():
        cache = QuantSpecCache.init(cfg, 1, max_len, gamma_max=spec.gamma_max)
        p = params.replace(config=cfg.replace(prefill_attention_impl=IMPL))
        return jax.jit(lambda p, toks, lengths, cache: M.prefill(p, toks, lengths, cache, chunk=c))(
            p, toks, lengths, cache)

    logits, cache = prefilled()
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    ar = jax.jit(lambda p, cache, f, k: autoregressive_loop(p, cache, f, k, gen=gen, eos_ids=()))(
        params, cache, first, jax.random.PRNGKey(0))
    logits, cache = prefilled()
    sp = jax.jit(lambda p, d, cache, f, k: speculative_loop(p, d, cache, f, k, spec=spec, eos_ids=()))(
        params, draft, cache, first, jax.random.PRNGKey(0))
    a, s = np.asarray(ar.tokens), np.asarray(sp.tokens)
    check("spec == AR after a chunked prefill", bool((a == s).all()),
          f"{int((a == s).sum())}/{a.size} tokens equal, acceptance {float(np.asarray(sp.acceptance_rate).mean()):.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes")
    p.add_argument("--impl", default="cudnn", choices=("cudnn", "xla"), help="the flash path checked")
    args = p.parse_args()
    global IMPL
    IMPL = args.impl
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    t = 2048 if args.quick else 8192
    for seed, heads in enumerate(((32, 8, 128), (9, 3, 64))):
        attention_checks(seed, t, t // 4, heads, 128)
    model_checks(args.quick)
    exactness_check(args.quick)
    print("ALL OK" if not FAILED else f"FAILED: {len(FAILED)}: {FAILED}", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
