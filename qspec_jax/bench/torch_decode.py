"""The PyTorch peer of the end-to-end benchmark: one decode step of the Llama-3.1-8B shape (or
SmolLM2-135M's, `--shape smollm2`, at `--batches` rows) in PyTorch, captured in a CUDA graph, with
bf16 weights or int4 tinygemm weights; and (--mode prefill / sdpa) the prompt's side: a
whole-prompt forward with bf16 weights and SDPA's causal flash attention, or that attention alone
for one layer.

What a user would write without our library (gpt-fast's structure without torch.compile): fused
q|k|v and gate|up projections, RoPE, the new K/V copied into a static bf16 cache, SDPA (flash,
GQA) over the cache up to the current position, RMSNorm and SwiGLU as eager ops, the lm_head and
the greedy token, all replayed from one CUDA graph so launch overhead does not count. Every step
decodes at the same position (as `e2e.decode_steps` rolls back), so the shapes are static.

    python -m qspec_jax.bench.torch_decode --contexts 4096,131072 --weights bf16,int4 --out FILE.json
    python -m qspec_jax.bench.torch_decode --shape smollm2 --batches 1,32 --contexts 8000 --group 32
    python -m qspec_jax.bench.torch_decode --mode prefill --contexts 8192,131072 --out FILE.json
    python -m qspec_jax.bench.torch_decode --mode sdpa --contexts 8192,32768 --out FILE.json

Runs in its own process (e2e starts it with subprocess): JAX and PyTorch each want the GPU's
memory. Prints one JSON line per (weights, context); exits 0 with a "skipped" record where torch
or CUDA is missing (`torch_status`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Any, Sequence

# Llama-3.1-8B (e2e.LLAMA31_8B) and SmolLM2-135M (prefill.SMOLLM2); kept literal so this process never imports
# JAX (tests/test_profile.py checks them against those configs).
SHAPE = dict(hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256,
             rope_theta=500000.0, eps=1e-5)
SMOLLM2 = dict(hidden=576, inter=1536, layers=30, heads=9, kv_heads=3, head_dim=64, vocab=49152,
               rope_theta=100000.0, eps=1e-5)
SHAPES = {"llama3-8b": SHAPE, "smollm2": SMOLLM2}


def torch_status() -> str | None:
    """None when torch with CUDA is usable here, else why not (the torch peers are then skipped;
    `qspec-bench w4a16` shares this check)."""
    try:
        import torch
    except ImportError:
        return "torch not installed"
    if not torch.cuda.is_available():
        return "torch has no CUDA device here"
    return None


def tinygemm_inner_k_tiles(k: int) -> int:
    """tinygemm's `innerKTiles` for a weight of K input channels: the largest of 8, 4, 2 whose k tile
    (16 columns each) divides K (SmolLM2's K 576 takes 4; 8 needs K a multiple of 128)."""
    for tiles in (8, 4, 2):
        if k % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"tinygemm needs K a multiple of 32; got K={k}")


def tinygemm_pack(packed_u8: Any) -> Any:
    """`torch.ops.aten._convert_weight_to_int4pack` of codes packed [N, K/2] uint8 (even k in the
    high nibble), with the inner k tiles K allows."""
    import torch

    return torch.ops.aten._convert_weight_to_int4pack(packed_u8, tinygemm_inner_k_tiles(2 * packed_u8.shape[1]))


def build(weights: str, context: int, group: int, seed: int = 0, shape: dict[str, Any] = SHAPE,
          device: str = "cuda", batch: int = 1) -> dict[str, Any]:
    """Random weights (never zeros) and a random static cache of `context` + 1 slots for each of
    `batch` rows. (`device` "cpu" with bf16 weights: the CPU smoke test of the step's code; tinygemm
    needs CUDA.)"""
    import torch

    torch.manual_seed(seed)
    dev, bf = device, torch.bfloat16
    h, f, nl = shape["hidden"], shape["inter"], shape["layers"]
    hq, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    dims = {"qkv": (h, (hq + 2 * hkv) * d), "o": (hq * d, h), "gate_up": (h, 2 * f), "down": (f, h)}

    def linear(k: int, n: int):
        if weights == "bf16":
            return (torch.randn(n, k, device=dev, dtype=bf) * 0.02,)  # [N, K]: x @ W.T (nn.Linear)
        codes = torch.randint(0, 16, (n, k), device=dev, dtype=torch.int32)
        packed = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()
        w = tinygemm_pack(packed)
        scale = torch.rand(k // group, n, device=dev) * 0.01 + 0.005
        zero = (torch.rand(k // group, n, device=dev) - 0.5) * 0.01
        return w, torch.stack([scale, zero + 8 * scale], dim=-1).to(bf).contiguous()  # tinygemm: (s, z + 8 s)

    layers = [{name: linear(*kn) for name, kn in dims.items()} for _ in range(nl)]
    cache_shape = (nl, batch, hkv, context + 1, d)  # [L, B, Hkv, S, D]
    return {
        "layers": layers, "lm_head": linear(h, shape["vocab"]),
        "norms": torch.ones(nl, 2, h, device=dev, dtype=bf), "final_norm": torch.ones(h, device=dev, dtype=bf),
        "embed": torch.randn(shape["vocab"], h, device=dev, dtype=bf) * 0.02,
        "k": torch.randn(cache_shape, device=dev, dtype=bf), "v": torch.randn(cache_shape, device=dev, dtype=bf),
        "weights": weights, "group": group, "context": context, "shape": shape, "device": dev, "batch": batch,
    }


def step_fn(m: dict[str, Any]):
    """The decode step at position `context` for every row (the cache holds positions 0..context - 1):
    tokens int64[B] -> next tokens int64[B]. Static shapes throughout (capturable)."""
    import torch
    import torch.nn.functional as F

    s = m["shape"]
    hq, hkv, d, eps = s["heads"], s["kv_heads"], s["head_dim"], s["eps"]
    pos, b = m["context"], m["batch"]
    inv = 1.0 / (s["rope_theta"] ** (torch.arange(0, d, 2, device=m["device"], dtype=torch.float32) / d))
    ang = pos * inv
    cos, sin = torch.cos(ang).to(torch.bfloat16), torch.sin(ang).to(torch.bfloat16)
    group = m["group"]

    def mm(x, w):
        if m["weights"] == "bf16":
            return x @ w[0].T
        return torch.ops.aten._weight_int4pack_mm(x, w[0], group, w[1])

    def norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    def rope(x):  # [B, H, 1, D], rotate-half
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def step(tok):
        x = m["embed"][tok]  # [B, hidden]
        for i, lw in enumerate(m["layers"]):
            qkv = mm(norm(x, m["norms"][i, 0]), lw["qkv"])
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = rope(q.view(b, 1, hq, d).transpose(1, 2))
            k = rope(k.view(b, 1, hkv, d).transpose(1, 2))
            m["k"][i, :, :, pos:pos + 1] = k
            m["v"][i, :, :, pos:pos + 1] = v.view(b, 1, hkv, d).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, m["k"][i, :, :, :pos + 1], m["v"][i, :, :, :pos + 1],
                                               enable_gqa=True)
            x = x + mm(a.transpose(1, 2).reshape(b, hq * d), lw["o"])
            gate, up = mm(norm(x, m["norms"][i, 1]), lw["gate_up"]).chunk(2, dim=-1)
            x = x + mm(F.silu(gate) * up, lw["down"])
        logits = mm(norm(x, m["final_norm"]), m["lm_head"])
        return torch.argmax(logits, dim=-1)

    return step


def time_step(weights: str, context: int, group: int = 128, steps: int = 32, trials: int = 5, batch: int = 1,
              shape: str = "llama3-8b") -> dict[str, Any]:
    """Median milliseconds per decode step of `batch` rows, replaying a CUDA graph of `steps` chained
    steps."""
    import torch

    m = build(weights, context, group, shape=SHAPES[shape], batch=batch)
    step = step_fn(m)
    tok = torch.zeros(batch, dtype=torch.long, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (cuBLAS handles, SDPA backend choice) outside the graph
        for _ in range(3):
            step(tok)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t = tok
        for _ in range(steps):  # each step feeds the next: nothing can run ahead
            t = step(t)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(trials):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    times.sort()
    out = {"weights": weights, "context": context, "ms": times[len(times) // 2], "trials": trials,
           "steps": steps, "torch": torch.__version__, "device": torch.cuda.get_device_name(), "batch": batch,
           "shape": shape}
    if weights == "int4":
        out["group"] = group
    del graph, m
    torch.cuda.empty_cache()
    return out


def _median_ms(fn: Any, trials: int) -> float:
    """Median milliseconds of `fn()` over `trials` runs after one warm-up, timed with CUDA events."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def time_sdpa(context: int, trials: int = 5, shape: dict[str, Any] = SHAPE) -> dict[str, Any]:
    """One layer's causal prompt attention through SDPA (flash, GQA), bf16, batch 1."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    hq, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    q = torch.randn(1, hq, context, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, context, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, hkv, context, d, device="cuda", dtype=torch.bfloat16)
    ms = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), trials)
    flops = 2.0 * context * context * d * hq  # causal: half of 4 T^2 D H
    return {"mode": "sdpa", "context": context, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "trials": trials,
            "torch": torch.__version__, "device": torch.cuda.get_device_name()}


def prefill_fn(m: dict[str, Any]):
    """The whole-prompt forward of the model `build` made (bf16 weights): tokens int64[1, T] ->
    the greedy next token, writing every layer's K/V into the static cache. Eager PyTorch with
    SDPA's causal flash attention: what a user without a serving engine would run."""
    import torch
    import torch.nn.functional as F

    s = m["shape"]
    hq, hkv, d, eps = s["heads"], s["kv_heads"], s["head_dim"], s["eps"]
    inv = 1.0 / (s["rope_theta"] ** (torch.arange(0, d, 2, device=m["device"], dtype=torch.float32) / d))

    def norm(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    def forward(tok):
        t = tok.shape[1]
        ang = torch.arange(t, device=m["device"], dtype=torch.float32)[:, None] * inv
        cos, sin = torch.cos(ang).to(torch.bfloat16), torch.sin(ang).to(torch.bfloat16)

        def rope(x):  # [1, H, T, D], rotate-half
            x1, x2 = x[..., : d // 2], x[..., d // 2:]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

        x = m["embed"][tok]  # [1, T, hidden]
        for i, lw in enumerate(m["layers"]):
            qkv = norm(x, m["norms"][i, 0]) @ lw["qkv"][0].T
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = rope(q.view(1, t, hq, d).transpose(1, 2))
            k = rope(k.view(1, t, hkv, d).transpose(1, 2))
            v = v.view(1, t, hkv, d).transpose(1, 2)
            m["k"][i, :, :, :t] = k
            m["v"][i, :, :, :t] = v
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(1, t, hq * d) @ lw["o"][0].T
            gate, up = (norm(x, m["norms"][i, 1]) @ lw["gate_up"][0].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ lw["down"][0].T
        logits = norm(x[:, -1], m["final_norm"]) @ m["lm_head"][0].T
        return torch.argmax(logits, dim=-1)

    return forward


def time_prefill(context: int, trials: int = 2) -> dict[str, Any]:
    """Median milliseconds of a `context`-token prompt's forward (bf16 weights, batch 1)."""
    import torch

    m = build("bf16", context, 128)
    forward = prefill_fn(m)
    tok = torch.randint(0, SHAPE["vocab"], (1, context), device="cuda")
    with torch.no_grad():
        ms = _median_ms(lambda: forward(tok), trials)
    out = {"mode": "prefill", "weights": "bf16", "context": context, "ms": ms, "trials": trials,
           "peak_bytes": int(torch.cuda.max_memory_allocated()), "torch": torch.__version__,
           "device": torch.cuda.get_device_name()}
    del m
    torch.cuda.empty_cache()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qspec_jax.bench.torch_decode", description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="decode", choices=("decode", "prefill", "sdpa"),
                   help="decode: one CUDA-graph decode step; prefill: a whole prompt's forward (bf16); "
                        "sdpa: one layer's causal prompt attention (default: decode)")
    p.add_argument("--contexts", default="4096,131072", help="comma-separated contexts (default: 4096,131072)")
    p.add_argument("--weights", default="bf16,int4", help="bf16, int4 or both (decode; default: bf16,int4)")
    p.add_argument("--group", type=int, default=128, help="int4 group size, a tinygemm size (default: 128)")
    p.add_argument("--shape", default="llama3-8b", choices=tuple(SHAPES), help="decode: the model's shape")
    p.add_argument("--batches", default="1", help="decode: comma-separated rows per step (default: 1)")
    p.add_argument("--out", default=None, help="also write the records to this JSON file")
    args = p.parse_args(argv)

    def positive_ints(flag: str, text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v]
        except ValueError:
            p.error(f"{flag}: expected comma-separated integers, got {text!r}")
        if not values or min(values) < 1:
            p.error(f"{flag}: expected positive integers, got {text!r}")
        return values

    contexts = positive_ints("--contexts", args.contexts)
    kinds = [w for w in args.weights.split(",") if w]
    if not kinds or any(w not in ("bf16", "int4") for w in kinds):
        p.error(f"--weights: expected bf16 and/or int4, got {args.weights!r}")
    if args.group not in (32, 64, 128, 256):
        p.error(f"--group: tinygemm takes 32, 64, 128 or 256, got {args.group}")
    batches = positive_ints("--batches", args.batches)
    sh = SHAPES[args.shape]
    ks = (sh["hidden"], sh["inter"], sh["heads"] * sh["head_dim"])
    if "int4" in kinds and args.mode == "decode" and any(k % args.group for k in ks):
        p.error(f"--group {args.group}: the {args.shape} shape's linears have K = {', '.join(map(str, ks))}, "
                "which the group must divide (e.g. --group 32 or 64 for smollm2)")
    if args.mode != "decode":
        kinds = [args.mode]
    status = torch_status()

    def record(w: str, c: int, b: int) -> dict[str, Any]:
        """One measurement's record: its numbers, or why there are none."""
        if status:
            return {"weights": w, "context": c, "batch": b, "status": f"skipped: {status}"}
        t0 = time.perf_counter()
        try:
            if w == "sdpa":
                rec = time_sdpa(c)
            elif w == "prefill":
                rec = time_prefill(c)
            else:
                rec = time_step(w, c, args.group, batch=b, shape=args.shape)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at a long context: a result
            return {"weights": w, "context": c, "batch": b, "status": f"failed: {type(e).__name__}: {e}"[:300]}
        return {**rec, "status": "ok", "wall_s": time.perf_counter() - t0}

    records = []
    for w, c, b in itertools.product(kinds, contexts, batches if args.mode == "decode" else [1]):
        records.append(record(w, c, b))
        print(json.dumps(records[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
