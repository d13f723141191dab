"""Does a batch decoded as two independent half-batches in one program run faster than the whole? (47th session)

Issue 31's SmolLM2 batch-32 draft call pays a fixed part of ~10-13 us a layer that no per-call change has moved
(kernel_notes, "Forty-sixth session"). The rows of a batch are independent sequences: decoded as two halves, each
with a cache of its own (XLA orders commands by the buffers they touch, so one shared cache would serialize them),
one half's attention could run beside the other half's small linears, if XLA runs the two chains concurrently.
`overlap_probe.py` asks whether XLA overlaps anything with stand-in kernels; this probe asks it of the real step
programs, SmolLM2's shape with random weights, `--batch` rows of `--context`/2 .. `--context` tokens:

  whole   n steps over all rows (the program `qspec-bench profile` times)
  half    n steps over one half's rows alone (its own cache; the halves take alternate rows, so their lengths match)
  layers  one loop of n trips, each one `decode_sub_batches` pass over both halves (each layer of the two halves in
          one loop body: the form XLA's command buffers can overlap without while loops as graph nodes)
  pair    one loop of n trips, each a step of each half (two independent layer loops in one body)
  loops   each half's n-step loop, side by side in one program (two independent while loops)

for the draft (INT4 weights, QuantSpec cache, draft view) and AR-bf16 (bf16 weights, dense cache): the split serves
both, so issue 31's ratio gains only the difference. `--loops` adds the generation loops (AR, and QuantSpec at
forced acceptance) over the whole batch, over the halves as sub-batches (one loop over a `SubBatchCache`: what
`sub_batches=2` runs) and as two loops side by side in one program. Per program: the wall per step (per
token for the loops; with `--trace`, also the kernels' summed and busy time: the union of their intervals, less than
the sum only where kernels ran at the same time, in a traced run, which has no command buffers). The share of a half
a two-half program hid: (2 t_half - t_two) / t_half.
Run once per XLA setting (flags are read when the backend starts); `$QSPEC_MGPU_FLAT_CTAS` below the SM count
leaves SMs free beside the draft's attention. On the CPU it checks that the programs build and that each half's
result in the pair equals the half alone (times meaningless there). Not in CI.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.getcwd())

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from qspec_jax import model as M  # noqa: E402
from qspec_jax.bench import e2e  # noqa: E402
from qspec_jax.bench.prefill import SMOLLM2  # noqa: E402
from qspec_jax.bench.profile import kernel_events, restarted  # noqa: E402
from qspec_jax.cache import SubBatchCache  # noqa: E402
from qspec_jax.generation import GenerationConfig, autoregressive_loop  # noqa: E402
from qspec_jax.speculative import speculative_loop  # noqa: E402
from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params  # noqa: E402


def busy_us(events: list[dict]) -> float:
    """The union of the kernel events' intervals, in us (the sum of their durations where none overlap)."""
    total, end = 0.0, -1e30
    for e in sorted(events, key=lambda e: e["ts_us"]):
        s, t = e["ts_us"], e["ts_us"] + e["dur_us"]
        if t > end:
            total += t - max(s, end)
            end = t
    return total


def measure(call, per: int, trials: int, trace_dir: Path | None) -> dict[str, float]:
    """Wall per step (median of `trials` calls after a warm-up); with `trace_dir`, also the kernels' summed and
    busy time per step from one traced call (the profiler runs a program op by op, without command buffers: its
    busy time shows what overlaps without them, not what the untraced run overlaps)."""
    jax.block_until_ready(call())
    out = {"wall": e2e.median_seconds(call, trials) / per * 1e6, "sum": 0.0, "busy": 0.0, "launches": 0.0}
    if trace_dir is not None:
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            jax.block_until_ready(call())
        ev = kernel_events(trace_dir)
        out.update(sum=sum(e["dur_us"] for e in ev) / per, busy=busy_us(ev) / per, launches=len(ev) / per)
    return out


def step_programs(params, caches: dict, toks: dict, view: str, n: int) -> dict:
    """name -> call (donating and keeping `caches`' entries) for the whole / half / layers / pair / loops programs."""
    def steps(p, c, t):
        return e2e.decode_steps(p, c, t, n=n, view=view)

    def halves(step):
        """n trips of `step(p, (ta, tb), (ca, cb)) -> ((la, lb), (ca, cb))`, each pass's argmax fed back and its
        caches rolled back (as `decode_steps` does for one)."""
        def run(p, ca, cb, ta, tb):
            ra, rb = ca.total_lengths(), cb.total_lengths()

            def body(_, carry):
                (ta, ca), (tb, cb) = carry
                (la, lb), (ca, cb) = step(p, (ta, tb), (ca, cb))
                nxt = lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32)  # noqa: E731
                return (nxt(la), ca.rollback(ra)), (nxt(lb), cb.rollback(rb))

            return jax.lax.fori_loop(0, n, body, ((ta, ca), (tb, cb)))
        return jax.jit(run, donate_argnums=(1, 2))

    def each(p, ts, cs):  # a decode per half: two layer loops
        (la, ca), (lb, cb) = (M.decode(p, t, c, view=view) for t, c in zip(ts, cs))
        return (la, lb), (ca, cb)

    one = jax.jit(steps, donate_argnums=1)
    programs = {"layers": halves(lambda p, ts, cs: M.decode_sub_batches(p, ts, cs, view=view)),
                "pair": halves(each),
                "loops": jax.jit(lambda p, ca, cb, ta, tb: (steps(p, ca, ta), steps(p, cb, tb)), donate_argnums=(1, 2))}

    def call_one(k):
        def call():
            out, caches[k] = one(params, caches[k], toks[k])
            return out
        return call

    def call_two(fn):
        def call():
            (oa, caches["a"]), (ob, caches["b"]) = fn(params, caches["a"], caches["b"], toks["a"], toks["b"])
            return oa, ob
        return call

    return {"whole": call_one("whole"), "half": call_one("a"), **{k: call_two(f) for k, f in programs.items()}}


def loop_programs(params, draft, caches: dict, kind: str, tokens: int, gamma: int, alpha: float) -> dict:
    """name -> call for the generation loop of `kind` ("ar" / "spec") over the whole batch and over two halves."""
    key = jax.random.PRNGKey(0)

    def loop(cache, p, d, first):
        if kind == "ar":
            return autoregressive_loop(p, cache, first, key, eos_ids=(), return_cache=True,
                                       gen=GenerationConfig(max_new_tokens=tokens, kv="bf16", width=1))
        return speculative_loop(p, d, cache, first, key, eos_ids=(), return_cache=True,
                                spec=e2e.loop_spec(gamma, max_new_tokens=tokens, forced_acceptance=alpha,
                                                   eos_token_ids=()))

    def pair(cache, p, d, fa, fb):  # `restarted` threads the halves' caches as one tuple
        ra, ca = loop(cache[0], p, d, fa)
        rb, cb = loop(cache[1], p, d, fb)
        return (ra, rb), (ca, cb)

    def sub(cache, p, d, first):  # one loop over a SubBatchCache of the halves: their layers in one loop body
        r, c = loop(SubBatchCache(parts=cache), p, d, first)
        return r, c.parts

    b = caches["whole"].total_lengths().shape[0]
    first = jnp.full((b,), 7, jnp.int32)
    return {"whole": restarted(caches, "whole", loop, (params, draft, first)),
            "sub-batches": restarted(caches, "pair", sub, (params, draft, first)),
            "two loops": restarted(caches, "pair", pair, (params, draft, first[: b // 2], first[b // 2:]))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192, help="rows of context/2 .. context tokens (ragged)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--kinds", default="draft,ar", help="step programs: draft, ar (comma-separated; empty: none)")
    ap.add_argument("--loops", default="", help="generation loops: ar, spec (comma-separated)")
    ap.add_argument("--loop-tokens", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=2)
    ap.add_argument("--alpha", type=float, default=0.9)
    ap.add_argument("--trace", action="store_true", help="also trace each program once: kernels summed and busy")
    ap.add_argument("--quick", action="store_true", help="tiny sizes of the shape (a CPU smoke test)")
    args = ap.parse_args(argv)
    cfg = SMOLLM2
    if args.quick:
        cfg = cfg.replace(vocab_size=512, num_layers=2, intermediate_size=512)
    B, c, h = args.batch, args.context, args.batch // 2
    if B < 2 or B % 2:
        ap.error(f"--batch must be even and >= 2, got {B}")
    key = jax.random.PRNGKey(0)
    params = jax.jit(lambda k: M.init_random_params(cfg, k))(key)
    draft = jax.block_until_ready(M.for_device(make_draft_params(params, DraftWeightsConfig(method="clip"))))
    params = jax.block_until_ready(M.for_device(params))
    lengths = e2e.batch_lengths(B, c)
    halves = {"whole": lengths, "a": lengths[0::2], "b": lengths[1::2]}  # alternate rows: halves of like lengths
    print(f"device {jax.devices()[0].device_kind}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
          f"QSPEC_MGPU_FLAT_CTAS={os.environ.get('QSPEC_MGPU_FLAT_CTAS', '')!r}; SmolLM2 shape{' (quick)' * args.quick}, "
          f"batch {B} (halves of {h}), rows {lengths.min()}..{lengths.max()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="halves-")) if args.trace else None
    ok = True
    for kind in filter(None, args.kinds.split(",")):
        p, view = (draft, "draft") if kind == "draft" else (params, "target")
        make = e2e.random_quant_cache if kind == "draft" else e2e.random_dense_cache
        caches = {k: make(cfg, len(v), c, jax.random.fold_in(key, i), v) for i, (k, v) in enumerate(halves.items())}
        toks = {k: jnp.full((len(v), 1), 7, jnp.int32) for k, v in halves.items()}
        progs = step_programs(p, caches, toks, view, args.steps)
        res, outs = {}, {}
        for name, call in progs.items():
            res[name] = measure(call, args.steps, args.trials, tmp and tmp / f"{kind}_{name}")
            outs[name] = jax.device_get(call())
            r = res[name]
            print(f"  {kind:5s} {name:6s} wall {r['wall']:8.1f} us/step; kernels {r['sum']:8.1f} summed, "
                  f"{r['busy']:8.1f} busy, {r['launches']:6.1f} launches", flush=True)
        two = ("layers", "pair", "loops")
        same = [bool(np.array_equal(outs[n][0], outs["half"])) for n in two]
        ok &= all(same)
        th = res["half"]["wall"]
        for n in two:
            print(f"== {kind} {n}: {res[n]['wall']:.1f} us against two halves' {2 * th:.1f} (hidden "
                  f"{(2 * th - res[n]['wall']) / th:.2f} of a half) and the whole's {res['whole']['wall']:.1f} "
                  f"({res[n]['wall'] / res['whole']['wall']:.3f}x its time)", flush=True)
        print(f"== {kind}: the first half's tokens in layers / pair / loops equal the half alone: {same}", flush=True)
        del caches, progs
    for kind in filter(None, args.loops.split(",")):
        make = e2e.random_dense_cache if kind == "ar" else e2e.random_quant_cache
        caches = {"whole": make(cfg, B, c, key, lengths),
                  "pair": tuple(make(cfg, h, c, jax.random.fold_in(key, i), v)
                                for i, v in enumerate((halves["a"], halves["b"])))}
        res = {}
        for name, call in loop_programs(params, draft, caches, kind, args.loop_tokens, args.gamma,
                                        args.alpha).items():
            res[name] = measure(call, args.loop_tokens, args.trials, tmp and tmp / f"loop_{kind}_{name.replace(' ', '_')}")
            r = res[name]
            print(f"  {kind}_loop {name:11s} wall {r['wall']:8.1f} us/token; kernels {r['sum']:8.1f} summed, "
                  f"{r['busy']:8.1f} busy", flush=True)
        print(f"== {kind}_loop: the halves as sub-batches {res['sub-batches']['wall'] / res['whole']['wall']:.3f}x "
              f"the whole's time, as two loops {res['two loops']['wall'] / res['whole']['wall']:.3f}x", flush=True)
        del caches
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
