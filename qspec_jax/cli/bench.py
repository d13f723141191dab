"""qspec-bench NAME [options]: benchmarks that write JSON and PNG plots to --out (the user's cache
by default) and, with --doc, their docs/BENCHMARKS.md / docs/QUALITY.md section (never from
--quick); `qspec-bench NAME --help` lists a benchmark's options."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Sequence

PROG = "qspec-bench"
DESCRIPTION = ("Benchmarks that write JSON and PNG plots to --out (default: ~/.cache/qspec-jax/bench/NAME) and, only "
               "with --doc, their section of docs/BENCHMARKS.md or docs/QUALITY.md (never from --quick); arguments are "
               "checked before anything is measured (exit status 2), a failed part exits 1. `make bench` runs the GPU "
               "ones.")
# name -> (module with main(argv), one line on what it measures)
BENCHMARKS = {
    "kernel": ("qspec_jax.bench.kernel",
               "decode-attention kernels on one layer (INT4 draft, INT8 verify, dense bf16) against XLA, cuDNN, "
               "Pallas and FlashAttention baselines; GPU (--quick: tiny sizes, interpret mode on a CPU)"),
    "w4a16": ("qspec_jax.bench.w4a16",
              "the INT4-weight matmul (Pallas W4A16) against XLA's dequantize-then-dot and the bf16 matmul, on "
              "Llama-3.1-8B linear shapes; GPU (--quick: CPU smoke test)"),
    "e2e": ("qspec_jax.bench.e2e",
            "whole decode steps: per-phase step times, projected and measured speedups, peak memory, longest "
            "context, tensor parallelism; GPU (--quick: tiny sizes)"),
    "profile": ("qspec_jax.bench.profile",
                "where a decode step's time goes: GPU kernel time of the AR, draft and verify steps and of the "
                "generation loops, by category (each linear, attention, glue, copies) against its byte floor; GPU "
                "(--quick: tiny sizes on a CPU, no kernel events)"),
    "quality": ("qspec_jax.bench.quality",
                "perplexity and acceptance rate of SmolLM2 on Shakespeare for each KV / draft variant "
                "(docs/QUALITY.md); CPU or GPU"),
    "fidelity": ("qspec_jax.bench.fidelity",
                 "whether speculative decoding emits exactly the target's own tokens on long real prompts, "
                 "and the logit gap at any divergence (docs/QUALITY.md); CPU or GPU"),
    "gamma": ("qspec_jax.bench.gamma",
              "draft length: tokens/round and acceptance of every fixed gamma and the BASS-style dynamic policy "
              "on SmolLM2 real text, expected speed under measured step costs and the planner's choice "
              "(docs/QUALITY.md); CPU or GPU"),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [f"usage: {PROG} NAME [options]   ({PROG} NAME --help lists NAME's options and their defaults)", "",
             DESCRIPTION, "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {line}" for name, (_, line) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    in_process = argv is not None  # called with an argv (tests): never os._exit
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"{PROG}: error: unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}\n\n{usage()}",
              file=sys.stderr)
        return 2
    from qspec_jax.cli import import_jax, interrupted

    try:  # importing a benchmark imports jax: an early Ctrl-C is one line, not a traceback (nor a crash)
        import_jax()
        module = importlib.import_module(BENCHMARKS[name][0])
    except KeyboardInterrupt:
        return interrupted(f"{PROG} {name}", in_process=in_process)
    rc = module.main(rest)
    if rc == 130 and not in_process:  # the benchmark was interrupted and said so (exit status 130)
        os._exit(130)  # without the interpreter's shutdown, which can crash under XLA's threads
    return rc


if __name__ == "__main__":
    sys.exit(main())
