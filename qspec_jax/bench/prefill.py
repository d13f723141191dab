"""qspec-bench e2e --parts prefill: how long a user waits for the first token of a long prompt.

Four measurements on the Llama-3.1-8B shape (random bf16 weights, batch 1; --quick: a tiny model):

  attention  One layer's causal prompt attention (32 query heads, 8 KV heads, D 128, bf16) at each
             --prefill-contexts T: ours as `model.prefill` runs it (the whole prompt through
             `attention.prefill_attention`, and a chunked prefill's attention summed over its chunks,
             `attention.chunk_attention` over a hierarchical cache), cuDNN through
             `jax.nn.dot_product_attention` and torch SDPA (flash) as peers. TFLOP/s count the causal
             half: 2 T^2 D Hq.
  ttft       Time to first token: `model.prefill` of a T-token prompt into the hierarchical cache,
             whole and chunked (--prefill-chunks), compiled once, median of --trials; prompt tokens/s
             and the model's effective TFLOP/s (2 x linear weights x T + the attention's); the
             compiled program's temporary bytes. Peer: the same prompt's forward in PyTorch (bf16,
             SDPA), in a child process.
  request    One request end to end at --request-context (+ --request-new-tokens): prefill, then the
             decode loop on that cache, for AR-bf16 (dense cache) and QuantSpec (forced acceptance
             --request-alpha, gamma --request-gamma); the PyTorch peer is its prefill plus as many
             CUDA-graph int4 (tinygemm) decode steps at that context.
  smollm     SmolLM2-135M's shape (random weights), --prefill-smollm-batch prompts of
             --prefill-smollm-context tokens: time to first token of the batch.
  longest    (--prefill-max-context) the planner's longest QuantSpec context on this device
             (`planner.max_context`), prefilled chunked from a random prompt and decoded for a few
             tokens; time and the device's peak memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax import model as M
from qspec_jax.attention import chunk_attention, prefill_attention, prefill_impl
from qspec_jax.cache import DenseKVCache, QuantSpecCache, prefill_quantized_len
from qspec_jax.config import ModelConfig
from qspec_jax.generation import GenerationConfig, autoregressive_loop, decode_cache_len, length_bucket
from qspec_jax.planner import max_context, prefill_chunk_for
from qspec_jax.speculative import SpecConfig, speculative_loop
from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params

Array = jax.Array
# SmolLM2-135M-Instruct's architecture (SPEC §9; the shape of the project's real model): its prefill time
# at batch 32 depends on the shapes, not on the weights' values.
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                      max_position_embeddings=8192, dtype="bfloat16")


def log(msg: str) -> None:
    print(f"[prefill] {msg}", file=sys.stderr, flush=True)


def attention_flops(cfg: ModelConfig, t: int) -> float:
    """FLOPs of one layer's causal attention over t tokens: the causal half of 4 t^2 D Hq."""
    return 2.0 * t * t * cfg.head_dim * cfg.num_heads


def model_flops(cfg: ModelConfig, t: int) -> float:
    """FLOPs of a t-token prefill: 2 x (linear weights of all layers + lm_head for one row) x t
    plus every layer's causal attention."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    qkv = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer = qkv + cfg.num_heads * cfg.head_dim * d + 3 * d * f
    return 2.0 * per_layer * cfg.num_layers * t + 2.0 * d * cfg.vocab_size + cfg.num_layers * attention_flops(cfg, t)


def median_s(call: Callable[[], Any], trials: int) -> float:
    """Median wall seconds of `call()` (blocked until ready) over `trials` runs after one warm-up."""
    jax.block_until_ready(call())
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def torch_records(mode: str, contexts: Sequence[int], out: Path) -> list[dict[str, Any]]:
    """`torch_decode --mode MODE` at each context in a child process (JAX keeps its GPU memory
    here); its records, or one error record."""
    path = out / f"torch_{mode}.json"
    cmd = [sys.executable, "-m", "qspec_jax.bench.torch_decode", "--mode", mode,
           "--contexts", ",".join(map(str, contexts)), "--out", str(path)]
    if mode == "decode":
        cmd += ["--weights", "int4"]
    log(" ".join(cmd[1:]))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not path.exists():
        return [{"mode": mode, "status": f"failed: exit {r.returncode}: {r.stderr.strip()[-600:]}"}]
    records = json.loads(path.read_text())
    for rec in records:
        log(json.dumps(rec))
    return records


# ------------------------------------------------------------------------------ attention
def attention_rows(cfg: ModelConfig, contexts: Sequence[int], chunks: Sequence[int], trials: int,
                   group: int) -> list[dict[str, Any]]:
    """Per-layer prompt attention: ours (whole and chunked) and cuDNN through JAX, ms and TFLOP/s."""
    one = cfg.replace(num_layers=1)
    dtype = jnp.dtype(cfg.dtype)
    whole_impl = prefill_impl(cfg.prefill_attention_impl, cfg.head_dim, dtype)
    chunk_impl = prefill_impl(cfg.prefill_attention_impl, cfg.head_dim, dtype, chunked=True)
    rows = []
    for t in contexts:
        key = jax.random.PRNGKey(t)
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (1, t, cfg.num_heads, cfg.head_dim), jnp.float32).astype(dtype)
        k = jax.random.normal(kk, (1, cfg.num_kv_heads, t, cfg.head_dim), jnp.float32).astype(dtype)
        v = jax.random.normal(kv, (1, cfg.num_kv_heads, t, cfg.head_dim), jnp.float32).astype(dtype)
        pos = jnp.arange(t, dtype=jnp.int32)[None]
        row: dict[str, Any] = {"context": t, "flops": attention_flops(cfg, t), "impl": whole_impl,
                               "chunk_impl": chunk_impl}

        def record(name: str, fn: Callable[[], Any]) -> None:
            try:
                row[f"{name}_ms"] = median_s(fn, trials) * 1e3
                row[f"{name}_tflops"] = row["flops"] / (row[f"{name}_ms"] * 1e-3) / 1e12
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: a result of this row
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            log(f"T={t} {name}: " + json.dumps({kk_: v_ for kk_, v_ in row.items() if kk_.startswith(name)}))

        whole = jax.jit(lambda q, k, v: prefill_attention(q, k, v, pos, cfg.sliding_window, whole_impl))
        record("ours_whole", lambda: whole(q, k, v))
        if jax.default_backend() == "gpu":
            cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), is_causal=True, implementation="cudnn"))
            record("cudnn", lambda: cudnn(q, k, v))
        for c in chunks:
            if c >= t or c % group:
                continue
            # The attention work of a chunked prefill of this layer: every chunk over the cache's
            # prefix plus itself. The cache holds the whole prompt (a chunk reads only positions
            # before it), placed as the chunks would place it.
            lengths = jnp.array([t], jnp.int32)
            cache = QuantSpecCache.init(one, 1, t, group_size=group).prefill_layer(0, k, v, lengths)
            qlen = prefill_quantized_len(lengths, group)

            def chunked(q, k, v, cache, c=c):
                def body(i, acc):
                    s = i * c
                    qc = jax.lax.dynamic_slice_in_dim(q, s, c, axis=1)
                    kc, vc = (jax.lax.dynamic_slice_in_dim(x, s, c, axis=2) for x in (k, v))
                    o = chunk_attention(qc, kc, vc, s + jnp.arange(c, dtype=jnp.int32)[None], cache, 0, s, c, qlen,
                                        cfg.sliding_window, chunk_impl)
                    return acc + o[0, 0, 0, 0].astype(jnp.float32)  # keeps each chunk's work live
                return jax.lax.fori_loop(0, t // c, body, jnp.float32(0))

            fn = jax.jit(chunked)
            record(f"ours_chunk{c}", lambda fn=fn, cache=cache: fn(q, k, v, cache))
            del cache
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------- ttft
def _prefill_program(chunk: int | None) -> Any:
    return jax.jit(lambda p, toks, lengths, cache: M.prefill(p, toks, lengths, cache, chunk=chunk), donate_argnums=(3,))


def ttft_rows(params: M.Params, contexts: Sequence[int], chunks: Sequence[int | None], trials: int,
              group: int, batch: int = 1) -> list[dict[str, Any]]:
    """Time to first token of `batch` prompts of T tokens each into the hierarchical cache, whole
    and chunked. The batch is padded as generation pads it (`length_bucket`)."""
    cfg = params.config
    rows = []
    for t in contexts:
        padded = length_bucket(t)
        toks = jax.random.randint(jax.random.PRNGKey(t), (batch, padded), 0, cfg.vocab_size, jnp.int32)
        lengths = jnp.full((batch,), t, jnp.int32)
        max_len = decode_cache_len(padded, 256, 8, group)
        new_cache = lambda: QuantSpecCache.init(cfg, batch, max_len, group_size=group)  # noqa: E731
        for chunk in chunks:
            if chunk is not None and chunk >= padded:
                continue
            row: dict[str, Any] = {"context": t, "batch": batch, "padded": padded, "chunk": chunk,
                                   "flops": batch * model_flops(cfg, t)}
            try:
                fn = _prefill_program(chunk)
                t0 = time.perf_counter()
                exe = fn.lower(params, toks, lengths, jax.eval_shape(new_cache)).compile()
                row["compile_s"] = time.perf_counter() - t0
                ma = exe.memory_analysis()
                row["temp_bytes"] = int(ma.temp_size_in_bytes) if ma is not None else None
                times = []
                for _ in range(trials + 1):  # the first run warms up
                    cache = new_cache()
                    jax.block_until_ready(cache)
                    t0 = time.perf_counter()
                    logits, cache = exe(params, toks, lengths, cache)
                    jax.block_until_ready(logits)
                    times.append(time.perf_counter() - t0)
                    del cache
                row["s"] = float(np.median(times[1:]))
                row["tok_s"] = batch * t / row["s"]
                row["tflops"] = row["flops"] / row["s"] / 1e12
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: a result of this row
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            log(json.dumps(row))
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------- request
def request_rows(params: M.Params, draft: M.Params, t: int, new: int, alpha: float, gamma: int,
                 group: int) -> list[dict[str, Any]]:
    """One request of t prompt tokens + `new` tokens: prefill (chunked or whole as `generate`'s
    "auto" decides here) then the decode loop, AR-bf16 and QuantSpec, each program compiled first;
    seconds of each phase (wall, one run after a warm-up)."""
    cfg = params.config
    toks = jax.random.randint(jax.random.PRNGKey(1), (1, t), 0, cfg.vocab_size, jnp.int32)
    lengths = jnp.array([t], jnp.int32)
    key = jax.random.PRNGKey(0)
    rows = []
    ar = GenerationConfig(max_new_tokens=new, kv="bf16", width=1, eos_token_ids=())
    spec = SpecConfig(gamma=gamma, max_new_tokens=new, forced_acceptance=alpha, eos_token_ids=(), group_size=group)
    for name in ("ar_bf16", "quantspec"):
        row: dict[str, Any] = {"mode": name, "context": t, "new_tokens": new}
        if name == "quantspec":
            row.update(alpha=alpha, gamma=gamma)
        try:
            if name == "ar_bf16":
                max_len = decode_cache_len(t, new, ar.width, group, "bf16")
                new_cache = lambda: DenseKVCache.init(cfg, 1, max_len)  # noqa: E731
                # The cache is donated and returned, so that it is updated in place (as in generate's
                # program, which makes its cache inside) rather than copied into the loop's state.
                loop = jax.jit(lambda p, c, first, k: autoregressive_loop(p, c, first, k, gen=ar, eos_ids=(),
                                                                          return_cache=True),
                               donate_argnums=(1,))
                weights: tuple = (params,)
                row["chunk"] = prefill_chunk_for(params, ar.memory_request(1, t), "auto")
            else:
                max_len = decode_cache_len(t, new, spec.verify_width, group, "int8")
                new_cache = lambda: QuantSpecCache.init(cfg, 1, max_len, group_size=group,  # noqa: E731
                                                        gamma_max=spec.gamma_max)
                loop = jax.jit(lambda p, d, c, first, k: speculative_loop(p, d, c, first, k, spec=spec, eos_ids=(),
                                                                          return_cache=True),
                               donate_argnums=(2,))
                weights = (params, draft)
                row["chunk"] = prefill_chunk_for(params, spec.memory_request(1, t), "auto", draft=draft)
            pre = _prefill_program(row["chunk"])

            def run() -> tuple[float, float, Any]:
                cache = new_cache()
                jax.block_until_ready(cache)
                t0 = time.perf_counter()
                logits, cache = pre(params, toks, lengths, cache)
                first = jnp.argmax(logits, -1).astype(jnp.int32)
                jax.block_until_ready(first)
                t1 = time.perf_counter()
                res, _ = jax.block_until_ready(loop(*weights, cache, first, key))
                return t1 - t0, time.perf_counter() - t1, res

            run()  # compiles and warms up
            row["prefill_s"], row["decode_s"], res = run()
            row["total_s"] = row["prefill_s"] + row["decode_s"]
            row["tokens"] = int(np.asarray(res.lengths)[0])
            if name == "quantspec":
                row["tokens_per_round"] = float(np.asarray(res.tokens_per_round).mean())
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: a result of this row
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        log(json.dumps(row))
        rows.append(row)
    return rows


def longest_row(cfg: ModelConfig, dcfg: DraftWeightsConfig, chunk: int, new: int, group: int) -> dict[str, Any]:
    """The planner's longest QuantSpec context here, prefilled chunked from a random prompt and
    decoded for `new` tokens (forced acceptance 0.9, gamma 4).

    Run first in its process, and the cache first of all: its four nibble planes (~20 GB each at
    1.3M tokens) need contiguous room, which the freed temporaries of making weights fragment
    (measured: out of memory with 24 GB free in pieces). The weights are made, fused and
    quantized on the host and copied over (fusing them on the device next to the cache ran out
    of memory), so the device holds only the cache, the target and the draft, as the planner
    counts them."""
    dev = jax.devices()[0]
    device_bytes = int((dev.memory_stats() or {}).get("bytes_limit", 0))
    plan = max_context(cfg, "int8", device_bytes, draft=dcfg, group_size=group)
    spec = SpecConfig(gamma=4, max_new_tokens=new, forced_acceptance=0.9, eos_token_ids=(), group_size=group)
    max_len = plan["context"]
    t = max_len - (new + spec.verify_width)  # the prompt, leaving room for the new tokens
    t -= t % group
    row: dict[str, Any] = {"device_bytes": device_bytes, "planned_context": plan["context"], "prompt": t,
                           "chunk": chunk, "new_tokens": new}
    log(f"longest: {json.dumps(row)}")
    try:
        cache = jax.block_until_ready(QuantSpecCache.init(cfg, 1, max_len, group_size=group, gamma_max=spec.gamma_max))
        with jax.default_device(jax.devices("cpu")[0]):
            raw = jax.jit(lambda k: M.init_random_params(cfg, k))(jax.random.PRNGKey(0))
            draft = M.for_device(make_draft_params(raw, dcfg))
            params = M.for_device(raw)
            del raw
        draft = jax.block_until_ready(jax.device_put(draft, dev))
        params = jax.block_until_ready(jax.device_put(params, dev))
        log("longest: cache, weights and draft on the device; prefilling")
        toks = jax.random.randint(jax.random.PRNGKey(2), (1, t), 0, cfg.vocab_size, jnp.int32)
        pre = _prefill_program(chunk)
        # The cache is donated to the loop and returned by it: a cache that no output aliases is
        # copied into the loop's state (measured: an 81.6 GiB copy at this length, out of memory
        # after the prefill had run, donated or not).
        loop = jax.jit(lambda p, d, c, first, k: speculative_loop(p, d, c, first, k, spec=spec, eos_ids=(),
                                                                  return_cache=True),
                       donate_argnums=(2,))
        t0 = time.perf_counter()
        logits, cache = pre(params, toks, jnp.array([t], jnp.int32), cache)
        first = jax.block_until_ready(jnp.argmax(logits, -1).astype(jnp.int32))
        t1 = time.perf_counter()
        row["prefill_s_incl_compile"] = t1 - t0
        log(f"longest: prefilled in {t1 - t0:.1f} s (compilation included)")
        res, cache = jax.block_until_ready(loop(params, draft, cache, first, jax.random.PRNGKey(0)))
        t2 = time.perf_counter()
        stats = dev.memory_stats() or {}
        row.update(decode_s_incl_compile=t2 - t1, tokens=int(np.asarray(res.lengths)[0]),
                   peak_bytes_in_use=int(stats.get("peak_bytes_in_use", -1)), ok=True)
        del cache, params, draft, res
    except Exception as e:  # noqa: BLE001 - an out-of-memory here is the measurement
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
    log(json.dumps(row))
    return row


# -------------------------------------------------------------------------------------- part
def torch_peers(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """The PyTorch peers of the prefill part, each in a child process. Call it before this process
    touches the GPU: JAX takes most of its memory at its first allocation."""
    return {"torch_sdpa": torch_records("sdpa", args.prefill_contexts, args.out),
            "torch_prefill": torch_records("prefill", args.prefill_contexts, args.out),
            "torch_decode_int4": torch_records("decode", [args.request_context], args.out)}


def part_prefill(args: argparse.Namespace, cfg: ModelConfig, peers: dict[str, Any] | None = None) -> dict[str, Any]:
    """The prefill part of `qspec-bench e2e` (module docstring). `cfg`: the bench's model;
    `peers`: `torch_peers(args)`, measured before JAX took the GPU (None: no peers)."""
    group = 64 if args.quick else 128
    chunks = [c for c in args.prefill_chunks if c % group == 0]
    out: dict[str, Any] = {"config": "Llama-3.1-8B shape, random bf16 weights, batch 1" if not args.quick else "quick",
                           "chunks": chunks, **(peers or {})}
    dcfg = DraftWeightsConfig(group_size=args.draft_group, method="clip")  # random weights: the format, data-free
    if args.prefill_max_context and chunks:  # first: see longest_row
        out["longest"] = longest_row(cfg, dcfg, chunks[0], 8, group)
    out["attention"] = attention_rows(cfg, args.prefill_contexts, chunks, args.trials, group)
    key = jax.random.PRNGKey(0)
    log("random weights" + (" (8B shape)" if not args.quick else ""))
    params = jax.block_until_ready(M.for_device(jax.jit(lambda k: M.init_random_params(cfg, k))(key)))
    out["ttft"] = ttft_rows(params, args.prefill_contexts, [None, *chunks], max(1, min(args.trials, 3)), group)
    draft = jax.block_until_ready(M.for_device(make_draft_params(M.unfuse_projections(params), dcfg)))
    out["request"] = request_rows(params, draft, args.request_context, args.request_new_tokens,
                                  args.request_alpha, args.request_gamma, group)
    del params, draft
    if args.prefill_smollm_batch:
        small = (SMOLLM2 if not args.quick else cfg).replace(prefill_attention_impl=cfg.prefill_attention_impl)
        p = jax.block_until_ready(M.for_device(jax.jit(lambda k: M.init_random_params(small, k))(key)))
        out["smollm"] = ttft_rows(p, [args.prefill_smollm_context], [None], max(1, min(args.trials, 3)), group,
                                  batch=args.prefill_smollm_batch)
    return out
