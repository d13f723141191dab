"""qspec-generate: generate text from a converted checkpoint, speculatively or autoregressively.

    qspec-generate --checkpoint DIR (--prompt TEXT | --prompt-file F) [--chat] [--json]
                   [--mode spec|ar] [--gamma N|auto] [--acceptance A] [--plan-cache F]
                   [--draft-policy fixed|bass] [--kv bf16|int8] [--max-new-tokens N]
                   [--temperature T] [--top-k K] [--top-p P] [--seed S] [--compare-ar [same|bf16|both]]
                   [--dtype auto|bfloat16|float32] [--tp N] [--stream] [--no-compile-cache]
                   [--draft-weights int4|bf16] [--draft-group G] [--draft-scope S] [--draft-method M]

tokens/s is measured on the run alone: the programs are compiled ahead of time first (and kept
on disk for the next run unless --no-compile-cache). Generation runs in chunks of rounds
(`generation.stream_chunks`): --stream prints the text as they commit, and Ctrl-C prints (or
keeps, with --stream) the text generated so far and exits with status 130. Both modes
decode the same target by default (the INT8 cache, in float32 on a CPU and bfloat16 on a GPU),
so --compare-ar checks the promise of exactness: speculative tokens == autoregressive tokens;
the speed lines name the device and say why speculation is or is not faster on it. Speculative
mode uses the checkpoint's stored INT4 draft as it is and says so on stderr; a --draft-* flag
that asks for another format quantizes the draft again, which stderr says too. --gamma auto
lets the planner (qspec_jax.planner.plan) pick gamma from step costs measured on this device
(cached) and a short calibration run's acceptance; it decodes autoregressively, and says so on
stderr, when no gamma is predicted faster.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from qspec_jax.cli import (DEFAULT_GAMMA_MAX, DEFAULT_GROUP_SIZE, HelpFormatter, Parser, add_compile_cache_arg, add_draft_format_args,
                           check_draft_flags, check_prompt, compile_cache, draft_fields, fail, positive_int_or, read_text,
                           require, require_tokenizer, require_writable_file, run_cli, tp_mesh, use_draft, write_failed)

PROG = "qspec-generate"
COMPARE_AR = ("same", "bf16", "both")
PROGRESS_MIN_TOKENS = 4096  # prompts at least this long show the prefill's progress on stderr


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, formatter_class=HelpFormatter,
               description="Generate text with QuantSpec self-speculative decoding (an INT4-weight draft over the INT8 "
                           "KV cache's upper nibbles, verified by the target); the output is exactly the target's.")
    p.add_argument("--checkpoint", required=True, type=Path, help="directory written by qspec-convert")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text itself")
    src.add_argument("--prompt-file", type=Path, help="UTF-8 text file holding the prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template (a user turn)")
    p.add_argument("--mode", choices=("spec", "ar"), default="spec",
                   help="spec: speculative decoding; ar: plain autoregressive decoding with the target")
    p.add_argument("--gamma", type=_gamma_arg, default=4,
                   help=f"draft tokens per round in spec mode, 1..{DEFAULT_GAMMA_MAX} (gamma_max, which sizes the "
                        f"cache's FP ring), or 'auto': the planner picks the fastest gamma from step costs measured "
                        f"on this device and the acceptance of a short calibration run, or autoregressive decoding "
                        f"when no gamma is predicted faster")
    p.add_argument("--acceptance", type=float, default=None,
                   help="with --gamma auto: the per-position acceptance rate alpha in [0, 1] to plan with (default: "
                        "measured by a 32-token speculative calibration run on the prompt)")
    p.add_argument("--plan-cache", type=Path, default=None,
                   help="with --gamma auto: JSON file caching measured step costs per model, device, context bucket "
                        "and batch (default: ~/.cache/qspec-jax/step_costs.json)")
    p.add_argument("--draft-policy", choices=("fixed", "bass"), default="fixed",
                   help=f"spec mode: draft length per round: fixed (gamma every round) or bass (starts at gamma and "
                        f"adapts to the acceptance, within 1..{DEFAULT_GAMMA_MAX}; BASS, Algorithm 1)")
    p.add_argument("--kv", choices=("bf16", "int8"), default="int8",
                   help="target KV cache, in both modes: int8 hierarchical or dense bf16 (in spec mode bf16 makes the "
                        "draft read the dense cache too)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="compute dtype of the target: auto is float32 on a CPU (no faster in bfloat16 there, and "
                        "bfloat16 rounding flips near-tied greedy choices) and bfloat16 on a GPU (half the bytes per "
                        "decode step)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (>= 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (>= 0; 0 = greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens only (>= 0; 0 = all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches p, in (0, 1] (1 = all)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument("--compare-ar", nargs="?", const="same", choices=COMPARE_AR, default=None,
                   help="spec mode: also decode autoregressively and print both speeds. same (the value when none is "
                        "given): the same target (weights and KV cache), whose tokens speculative decoding must equal "
                        "exactly; bf16: autoregressive decoding over a dense bf16 KV cache, a different target whose "
                        "tokens may differ; both: the two (default: no comparison)")
    p.add_argument("--prefill-chunk", type=positive_int_or(("auto", "whole"),
                                                           "'auto', 'whole' or a positive number of tokens"),
                   default="auto",
                   help="how the prompt is prefilled: auto (the whole prompt at once when its temporaries fit in the "
                        "device's free memory, else chunks of 8192 tokens), whole, or a chunk size N (a multiple of "
                        f"the cache's group size, {DEFAULT_GROUP_SIZE} with --kv int8): each chunk reads the earlier "
                        "ones from the KV cache, so peak memory grows with N, not with the prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--stream", action="store_true",
                   help="print the text as it is generated (every few rounds) instead of at the end")
    add_compile_cache_arg(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (a 1-D mesh over local devices)")
    p.add_argument("--draft-weights", choices=("int4", "bf16"), default="int4",
                   help="spec mode: the draft's weights, INT4 or the target's own bf16 weights (the KV-only "
                        "ablation: the draft then differs from the target only in reading the INT4 KV view)")
    add_draft_format_args(p)
    return p


def _gamma_arg(text: str) -> int | str:
    """--gamma: an integer or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer 1..{DEFAULT_GAMMA_MAX} or 'auto', got {text!r}") from None


def check_args(args: argparse.Namespace) -> None:
    """Refuses bad flag values before anything is loaded; messages name the flag."""
    require(PROG, args.max_new_tokens >= 1, "--max-new-tokens", args.max_new_tokens, ">= 1")
    auto = args.gamma == "auto"
    require(PROG, auto or 1 <= args.gamma <= DEFAULT_GAMMA_MAX, "--gamma", args.gamma,
            f"in 1..{DEFAULT_GAMMA_MAX} (gamma_max)")
    if args.acceptance is not None:
        require(PROG, auto, "--acceptance", args.acceptance, "given only with --gamma auto")
        require(PROG, 0.0 <= args.acceptance <= 1.0, "--acceptance", args.acceptance, "in [0, 1]")
    if args.plan_cache is not None:
        require(PROG, auto, "--plan-cache", args.plan_cache, "given only with --gamma auto")
        require_writable_file(PROG, args.plan_cache, "--plan-cache")  # before minutes of measuring, not after
    if auto and args.draft_policy != "fixed":
        fail(PROG, f"--draft-policy {args.draft_policy} with --gamma auto: the planner picks a fixed gamma; give "
                   "--gamma N to start the dynamic policy at N")
    require(PROG, math.isfinite(args.temperature) and args.temperature >= 0, "--temperature", args.temperature,
            ">= 0 (0 = greedy)")
    require(PROG, args.top_k >= 0, "--top-k", args.top_k, ">= 0 (0 = all tokens)")
    require(PROG, 0.0 < args.top_p <= 1.0, "--top-p", args.top_p, "in (0, 1]")
    require(PROG, args.tp >= 1, "--tp", args.tp, ">= 1")
    if isinstance(args.prefill_chunk, int) and args.kv == "int8":
        require(PROG, args.prefill_chunk % DEFAULT_GROUP_SIZE == 0, "--prefill-chunk", args.prefill_chunk,
                f"a multiple of the INT8 cache's group size {DEFAULT_GROUP_SIZE} (or auto / whole)")
    check_draft_flags(PROG, args)
    if args.mode == "ar" and args.compare_ar:
        fail(PROG, "--compare-ar compares against spec mode; drop it or use --mode spec")
    if args.prompt is not None:
        check_prompt(PROG, args.prompt, "--prompt")
    if args.stream and args.json:
        fail(PROG, "--stream prints text as it is generated and --json one object at the end; choose one")


def ar_config(args: argparse.Namespace, kv: str) -> Any:
    """The GenerationConfig of an autoregressive run over a `kv` cache."""
    from qspec_jax.generation import GenerationConfig

    return GenerationConfig(kv=kv, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, **prefill_options(args))


def compared_kvs(args: argparse.Namespace) -> list[str]:
    """The KV caches of the autoregressive runs --compare-ar adds to spec mode."""
    if args.mode != "spec" or args.compare_ar is None:
        return []
    kvs = [args.kv] * (args.compare_ar in ("same", "both")) + ["bf16"] * (args.compare_ar in ("bf16", "both"))
    return list(dict.fromkeys(kvs))


def check_fits(model: Any, ids: list[int], args: argparse.Namespace) -> None:
    """Every generation this command runs (spec or ar, and --compare-ar's) must fit the model's
    positions and this device's memory: refused (one line, exit status 2) before a draft is made,
    step costs are measured or anything compiles."""
    from qspec_jax.generation import check_fits as check_positions
    from qspec_jax.generation import checked_request, pad_prompts
    from qspec_jax.speculative import check_memory

    tokens, lengths = pad_prompts([ids], model.config.vocab_size)
    check_positions(model.config, lengths, args.max_new_tokens)
    if args.mode == "spec":
        gamma = 4 if args.gamma == "auto" else args.gamma
        check_memory(model, spec_config(model, args, gamma), tokens.shape, len(ids))
    for kv in [args.kv] if args.mode == "ar" else compared_kvs(args):
        checked_request(model.params, ar_config(args, kv), tokens.shape, len(ids))


def spec_config(model: Any, args: argparse.Namespace, gamma: int) -> Any:
    """The SpecConfig of spec mode (with the format of the draft the model carries)."""
    from qspec_jax.speculative import SpecConfig, draft_format_fields

    kv = dict(target_kv="bf16", draft_kv="bf16") if args.kv == "bf16" else {}
    draft = {}
    if args.draft_weights == "int4" and getattr(model, "draft_weights_config", None) is not None:
        draft = draft_format_fields(model.draft_weights_config)
    return SpecConfig(gamma=gamma, draft_weights=args.draft_weights, draft_policy=args.draft_policy,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, **kv, **draft, **prefill_options(args))


def prefill_options(args: argparse.Namespace) -> dict[str, Any]:
    """The prefill fields of either config: --prefill-chunk, and a progress line on stderr for a
    prompt of PROGRESS_MIN_TOKENS or more (not with --json, whose stdout is one object)."""
    long = getattr(args, "prompt_tokens", 0) >= PROGRESS_MIN_TOKENS
    return dict(prefill_chunk=args.prefill_chunk, prefill_progress=long and not args.json)


def plan_gamma(model: Any, ids: list[int], args: argparse.Namespace) -> str:
    """--gamma auto: sets args.gamma to the planner's choice, or args.mode to "ar" when no gamma
    is predicted faster; returns the planner's one-line summary."""
    from qspec_jax.planner import default_cost_cache, plan

    draft = model.draft_params if args.draft_weights == "int4" else model.params
    cache = args.plan_cache or default_cost_cache()
    try:
        chosen = plan(model, [ids], spec_config(model, args, 4), alpha=args.acceptance, draft_params=draft,
                      cost_cache=cache)
    except OSError as e:  # the cache could not be written (checked beforehand, yet a disk may fill up)
        if e.filename != str(cache):
            raise
        write_failed(PROG, "--plan-cache" if args.plan_cache else "the step-cost cache", cache, e)
    if chosen.spec is None:
        args.mode = "ar"
    else:
        args.gamma = chosen.spec.gamma
    return chosen.summary()


class Partial:
    """The tokens of the run in progress (what Ctrl-C prints); with `echo` (--stream) its text is
    printed as the tokens come."""

    def __init__(self, model: Any, echo: bool) -> None:
        from qspec_jax.streaming import TextDecoder

        self.model = model
        self.tokens: list[int] = []
        self.echo = echo
        self.text = TextDecoder(model.decode)

    def add(self, new: list[int]) -> None:
        self.tokens += new
        if self.echo:
            sys.stdout.write(self.text.push(new))
            sys.stdout.flush()

    def interrupted(self, as_json: bool) -> None:
        """Ctrl-C: the text so far on stdout (the rest of it with --stream, then a newline)."""
        if as_json:
            print(json.dumps({"text": self.model.decode(self.tokens), "tokens": self.tokens, "interrupted": True}))
        else:
            print(self.text.flush() if self.echo else self.model.decode(self.tokens), flush=True)


def _run(model: Any, ids: list[int], args: argparse.Namespace, mode: str, partial: Partial,
         kv: str | None = None) -> dict[str, Any]:
    """One generation (in a background thread, so that Ctrl-C reaches this one at once), its
    tokens passed to `partial` as they commit; `kv` overrides --kv (the labelled bf16-cache
    comparison)."""
    import jax
    import numpy as np

    from qspec_jax.generation import generate_autoregressive
    from qspec_jax.speculative import generate
    from qspec_jax.streaming import TokenStream

    key = jax.random.PRNGKey(args.seed)
    timings: dict[str, float] = {}
    out: dict[str, Any] = {"mode": mode}
    if mode == "ar":
        stream = TokenStream(generate_autoregressive, model, [ids], ar_config(args, kv or args.kv), key,
                             timings=timings)
    else:
        spec = spec_config(model, args, args.gamma)
        draft = model.draft_params if args.draft_weights == "int4" else model.params
        stream = TokenStream(generate, model, [ids], spec, key, draft_params=draft, timings=timings)
    for chunk in stream:
        partial.add(chunk[0])
    res = stream.result
    if mode == "spec":
        out.update(acceptance_rate=res.acceptance_rate, tokens_per_round=res.tokens_per_round,
                   mean_draft_length=res.mean_draft_length, rounds=int(np.sum(res.rounds)))
    tokens = res.to_lists()[0]
    out.update(text=model.decode(tokens), tokens=tokens, tokens_per_s=len(tokens) / timings["run_s"],
               compile_s=timings["compile_s"], run_s=timings["run_s"])
    return out


def device_label(n_devices: int = 1) -> str:
    """"CPU (2 cores)" or the accelerator's kind ("NVIDIA H200"), "3 x ..." under --tp 3."""
    import os

    import jax

    dev = jax.devices()[0]
    name = f"CPU ({os.cpu_count()} cores)" if dev.platform == "cpu" else getattr(dev, "device_kind", dev.platform)
    return name if n_devices == 1 else f"{n_devices} x {name}"


def explain_speed(platform: str, round_cost: float, draft_length: float, tokens_per_round: float,
                  speedup: float) -> str:
    """Why speculation is or is not faster on this device, from what was measured.

    round_cost: one speculative round's run time in autoregressive steps of the same target
    (run time per round / run time per AR token). A round emits tokens_per_round tokens, so
    speedup ~ tokens_per_round / round_cost. Its verify pass has an AR step's shape (both run
    gamma_max + 1 positions, which is what makes their logits bit-identical), so the
    draft_length draft steps cost about round_cost - 1 AR steps. The INT4 draft reads a quarter
    of the target's weight bytes: that saves time where a step is bound by memory traffic, not
    on a CPU, which is bound by arithmetic (and unpacking INT4 weights adds arithmetic).
    """
    draft_cost = max(0.0, round_cost - 1) / max(draft_length, 1e-9)
    measured = (f"a round cost {round_cost:.1f} autoregressive steps and emitted {tokens_per_round:.2f} tokens; "
                f"its verify pass costs one step (the same shape), so each of its {draft_length:.1f} INT4 draft "
                f"steps cost {draft_cost:.2f} steps")
    if platform == "cpu":
        verdict = "speculation does not pay on a CPU" if speedup < 1 else "yet speculation paid off here"
        return (f"why: {measured}. The draft reads a quarter of the weight bytes, which saves time where a step is "
                f"bound by memory traffic (a GPU with a large model or a long context); a CPU is bound by "
                f"arithmetic, and unpacking INT4 weights adds some: {verdict}.")
    if speedup >= 1:
        return (f"why: {measured}: a decode step here is bound by the bytes it reads, and the draft reads a quarter "
                "of the weight bytes.")
    return (f"why: {measured}. Speculation pays when draft steps are cheap, i.e. when a step is bound by reading "
            "weights and cache (large models, long contexts); a small model's steps are bound by kernel launches "
            "instead (docs/BENCHMARKS.md).")


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    if args.prompt_file is not None:
        args.prompt = read_text(args.prompt_file, "--prompt-file")
        check_prompt(PROG, args.prompt, f"--prompt-file {args.prompt_file}:")
    with compile_cache(args):
        return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    import qspec_jax

    model = qspec_jax.load(args.checkpoint, dtype=args.dtype, mesh=tp_mesh(args.tp, PROG))
    require_tokenizer(model)
    ids = model.encode(args.prompt, chat=args.chat)
    args.prompt_tokens = len(ids)
    check_fits(model, ids, args)
    if args.mode == "spec":
        if args.draft_weights == "int4":
            model = use_draft(PROG, model, draft_fields(args))
        else:
            if draft_fields(args):
                fail(PROG, "--draft-group/--draft-scope/--draft-method/--draft-lm-head set the INT4 draft's "
                           "format; they do not apply with --draft-weights bf16")
            print(f"{PROG}: draft: the target's own weights (--draft-weights bf16)", file=sys.stderr, flush=True)
    planned = None
    if args.mode == "spec" and args.gamma == "auto":
        planned = plan_gamma(model, ids, args)
        print(f"{PROG}: --gamma auto: {planned}", file=sys.stderr, flush=True)
    partial = Partial(model, echo=args.stream)
    try:
        result = _run(model, ids, args, args.mode, partial)
    except KeyboardInterrupt:
        partial.interrupted(args.json)
        raise
    if args.stream:
        print(partial.text.flush())
    elif not args.json:
        print(result["text"], flush=True)
    internal = {"mode", "run_s", "rounds"}
    try:
        ars = [(kv, _run(model, ids, args, "ar", Partial(model, echo=False), kv=kv)) for kv in compared_kvs(args)]
    except KeyboardInterrupt:
        if args.json:  # the comparison is cut short; the text is complete
            print(json.dumps({**{k: v for k, v in result.items() if k not in internal}, "interrupted": True}))
        raise
    exact_broken = False
    if args.json:
        for kv, ar in ars:
            prefix = "ar" if kv == args.kv else "ar_bf16"
            result[f"{prefix}_tokens_per_s"] = ar["tokens_per_s"]
            result[f"{prefix}_same_tokens"] = ar["tokens"] == result["tokens"]
        if planned is not None:
            result.update(gamma=args.gamma if args.mode == "spec" else None, plan=planned)
        result.update(device=device_label(args.tp), dtype=model.config.dtype)
        print(json.dumps({k: v for k, v in result.items() if k not in internal}))
    else:
        exact_broken = _print_speed(args, model.config.dtype, result, ars)
    if exact_broken:
        return 1
    return 0


def _print_speed(args: argparse.Namespace, dtype: str, result: dict[str, Any],
                 ars: list[tuple[str, dict[str, Any]]]) -> bool:
    """The speed lines on stderr: each run's tokens/s, the device, and with --compare-ar whether
    the tokens are the same and why speculation is or is not faster here. Returns True when
    greedy tokens of the same target differ (a broken promise: the exit status says so)."""
    import jax

    err = sys.stderr
    device = device_label(args.tp)
    line = f"{'[' + result['mode'] + ']':10}{len(result['tokens'])} tokens, {result['tokens_per_s']:.1f} tokens/s"
    if result["mode"] == "spec":
        policy = f" (bass: mean draft length {result['mean_draft_length']:.2f})" if args.draft_policy == "bass" else ""
        line += (f", gamma={args.gamma}{policy}, acceptance rate {result['acceptance_rate']:.2f}, "
                 f"{result['tokens_per_round']:.2f} tokens/round")
    print(line + f" ({device}, {dtype}, {args.kv} KV cache; compile {result['compile_s']:.1f} s)", file=err)
    broken = False
    greedy = args.temperature == 0
    for kv, ar in ars:
        same = ar["tokens"] == result["tokens"]
        speedup = result["tokens_per_s"] / ar["tokens_per_s"]
        if kv == args.kv:
            label = "[ar]"
            if not greedy:
                verdict = "the same target, sampled: the same distribution, not the same draws"
            elif same:
                verdict = "the same target: same tokens, as speculative decoding promises"
            else:
                verdict = ("the same target: TOKENS DIFFER, which greedy speculative decoding must never do; "
                           "please report it")
                broken = True
        else:
            label = "[ar bf16]"
            verdict = (f"a different target (a dense bf16 KV cache, not {args.kv}): tokens "
                       f"{'the same' if same else 'differ, as they may'}")
        print(f"{label:10}{len(ar['tokens'])} tokens, {ar['tokens_per_s']:.1f} tokens/s; {verdict}; speedup "
              f"{speedup:.2f}x", file=err)
    if ars and result["mode"] == "spec":
        kv, ar = ars[0]
        round_cost = (result["run_s"] / max(1, result["rounds"])) / (ar["run_s"] / len(ar["tokens"]))
        print(explain_speed(jax.devices()[0].platform, round_cost, result["mean_draft_length"],
                            result["tokens_per_round"], result["tokens_per_s"] / ar["tokens_per_s"]), file=err)
    return broken


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
