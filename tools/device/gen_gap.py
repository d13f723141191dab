"""Where a whole generation's decode time goes, the way part smollm times it, by kernel label.

Runs the public calls part smollm times (`generate_autoregressive`, `speculative.generate`, with
`time_prefill=True`) on random weights of a model shape, then traces one whole run and one run with
its prefill-alone program and prints, per decode step (new tokens - 1), the wall time, the kernels'
time (whole program less prefill alone) by category and label with launch counts, and the idle rest.
Labels of the prefill's own fusions can differ between the two programs (XLA names them per
module): a label with 30 launches and none "in the prefill" is a prefill kernel of the whole
program, not decode work; the totals are exact. How the twenty-seventh session found that part
smollm's AR baselines ran at the 8-column verify width (3.39 against 2.72 ms per step at SmolLM2
batch 32 on the H200).

  python3 tools/device/gen_gap.py --shape smollm2 --batch 32 --context 8000 --new 128 \
      --methods ar_bf16,ar_bf16:8,spec:2,spec:2:2
"""
from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax import model as M
from qspec_jax.bench import profile as P
from qspec_jax.cache import DEFAULT_GAMMA_MAX
from qspec_jax.checkpoint import Model
from qspec_jax.generation import GenerationConfig, generate_autoregressive
from qspec_jax.speculative import SpecConfig, generate
from qspec_jax.weight_quant import DraftWeightsConfig, make_draft_params


def gaps(events: list[dict], top: int) -> None:
    """Idle stretches of the GPU in a trace's kernel `events` (`profile.kernel_events`): gaps between
    consecutive kernels (all GPU streams merged) by the kernel before them, the 'where does the device
    wait' view (a while loop's predicate copy, a conditional's branch index, a host round trip)."""
    ks = sorted(events, key=lambda e: e["ts_us"])
    if not ks:  # a CPU run: no GPU kernels
        return
    by_prev: dict[str, list[float]] = collections.defaultdict(list)
    end, prev = ks[0]["ts_us"], ks[0]["name"]
    for e in ks:
        if e["ts_us"] - end > 2.0:  # microseconds
            by_prev[prev].append(e["ts_us"] - end)
        if e["ts_us"] + e["dur_us"] >= end:
            end, prev = e["ts_us"] + e["dur_us"], e["name"]
    total = sum(sum(v) for v in by_prev.values())
    print(f"   gaps > 2 us: {sum(len(v) for v in by_prev.values())}, {total / 1e3:.1f} ms in all; "
          "by the kernel before:")
    for name, v in sorted(by_prev.items(), key=lambda x: -sum(x[1]))[:top]:
        print(f"   {sum(v) / 1e3:8.2f} ms in {len(v):5d} gaps (median {statistics.median(v):6.1f} us) "
              f"after {name[:90]}")


def by_label(events: list[dict]) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], int]]:
    """Microseconds and launches by (category, label) of a trace's GPU kernels."""
    us: dict[tuple[str, str], float] = collections.defaultdict(float)
    n: dict[tuple[str, str], int] = collections.defaultdict(int)
    for e in events:
        cat, label, _ = P.classify(e["name"])
        us[(cat, label)] += e["dur_us"]
        n[(cat, label)] += 1
    return us, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=tuple(P.SHAPES), default="smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8000, help="prompt tokens per row")
    ap.add_argument("--new", type=int, default=128, help="new tokens per row")
    ap.add_argument("--methods", default="ar_bf16,ar_bf16:8,spec:2,spec:2:2",
                    help=f"ar_bf16[:WIDTH], ar_int8[:WIDTH] (default width 1), spec:GAMMA[:GAMMA_MAX] "
                         f"(default {DEFAULT_GAMMA_MAX})")
    ap.add_argument("--alpha", type=float, default=0.95, help="the speculative run's forced acceptance")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--no-trace", action="store_true",
                    help="the untraced wall times only (XLA runs op by op under the profiler, without its command "
                         "buffers: an A/B of XLA flags reads the walls)")
    args = ap.parse_args()

    cfg, _ = P.SHAPES[args.shape]
    if args.quick:
        cfg = cfg.replace(vocab_size=512, num_layers=2, intermediate_size=512)
    key = jax.random.PRNGKey(0)
    params = jax.jit(lambda k: M.init_random_params(cfg, k))(key)
    draft = jax.block_until_ready(M.for_device(make_draft_params(params, DraftWeightsConfig(method="clip"))))
    model = Model(config=cfg, params=jax.block_until_ready(M.for_device(params)))
    rng = np.random.default_rng(0)
    prompts = rng.integers(10, cfg.vocab_size, size=(args.batch, args.context), dtype=np.int64)

    def run_of(method: str):
        """ar_bf16[:W] / ar_int8[:W] (W: the pass width, default 1) or spec:G[:GMAX] (GMAX default
        DEFAULT_GAMMA_MAX, SpecConfig's)."""
        kind, *nums = method.split(":")
        if kind.startswith("ar_"):
            gen = GenerationConfig(max_new_tokens=args.new, kv=kind[3:], eos_token_ids=(),
                                   width=int(nums[0]) if nums else 1)
            return lambda tm, tp=True: generate_autoregressive(model, prompts, gen, timings=tm, time_prefill=tp)
        g = int(nums[0]) if nums else 2
        spec = SpecConfig(gamma=g, gamma_max=int(nums[1]) if len(nums) > 1 else DEFAULT_GAMMA_MAX,
                          max_new_tokens=args.new, eos_token_ids=(), forced_acceptance=args.alpha)
        return lambda tm, tp=True: generate(model, prompts, spec, draft_params=draft, timings=tm, time_prefill=tp)

    for name in args.methods.split(","):
        fn = run_of(name)
        ts = []
        for _ in range(args.trials + 1):  # the first compiles
            tm: dict[str, float] = {}
            res = fn(tm)
            ts.append(tm)
        ts = ts[1:]
        run_s = statistics.median(t["run_s"] for t in ts)
        pre_s = statistics.median(t["prefill_s"] for t in ts)
        steps = args.new - 1  # the first token is the prefill's
        rounds = getattr(res, "tokens_per_round", None)
        per_step = sorted((t["run_s"] - t["prefill_s"]) / steps * 1e3 for t in ts)
        print(f"== {name}: run {run_s * 1e3:.1f} ms, prefill alone {pre_s * 1e3:.1f} ms, decode "
              f"{(run_s - pre_s) / steps * 1e3:.3f} ms per token step (trials {per_step[0]:.3f}-{per_step[-1]:.3f}; "
              f"{steps} steps"
              + (f", {rounds:.2f} tokens per round" if rounds else "") + ")", flush=True)
        if args.no_trace:
            continue
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(f"{d}/whole", create_perfetto_trace=True):
                fn({}, False)  # the whole program alone
            whole = P.kernel_events(Path(d) / "whole")
        gaps(whole, args.top // 2)
        with tempfile.TemporaryDirectory() as d:  # prefill alone: the run's first half, for the difference
            with jax.profiler.trace(f"{d}/whole", create_perfetto_trace=True):
                t2: dict[str, float] = {}
                fn(t2)  # time_prefill runs the prefill program alone first, then the whole one
            both = P.kernel_events(Path(d) / "whole")
        (w, wn), (b, bn) = by_label(whole), by_label(both)
        # `both` = prefill alone + whole; whole's decode = 2 whole - both (= whole - prefill alone)
        dec = {k: (2 * w.get(k, 0.0) - b.get(k, 0.0)) / steps for k in set(w) | set(b)}
        busy = sum(dec.values())
        print(f"   kernels in decoding {busy / 1e3:.3f} ms per token step; idle "
              f"{(run_s - pre_s) / steps * 1e3 - busy / 1e3:.3f} ms; prefill kernels "
              f"{(sum(b.values()) - sum(w.values())) / 1e3:.1f} ms", flush=True)
        cats = collections.defaultdict(float)
        for (cat, _), v in dec.items():
            cats[cat] += v
        print("   " + ", ".join(f"{c} {v:.1f} us" for c, v in sorted(cats.items(), key=lambda x: -x[1])))
        for k, v in sorted(dec.items(), key=lambda x: -x[1])[: args.top]:
            # launches in the whole program and in the prefill alone (a one-off kernel of the whole
            # program shows as 1 and 0: its time is per run, not per step)
            print(f"   {v:9.1f} us  [{k[0]}] {k[1][:100]}  ({wn.get(k, 0)} launches, "
                  f"{bn.get(k, 0) - wn.get(k, 0)} in the prefill)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
