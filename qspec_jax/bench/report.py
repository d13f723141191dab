"""Benchmark reporting: environment stamp, docs/BENCHMARKS.md sections, PNG plots.

Each benchmark owns one section of docs/BENCHMARKS.md, delimited by `<!-- NAME:begin -->` and
`<!-- NAME:end -->`, and rewrites only that section, so the kernel and e2e benchmarks can be
regenerated independently. The benchmarks call these writers only with --doc (see
`qspec_jax.bench.options`).
"""

from __future__ import annotations

import datetime
import os
import platform
import re
from pathlib import Path
from typing import Any, Sequence

import jax

BENCHMARKS_MD = Path(__file__).resolve().parents[2] / "docs" / "BENCHMARKS.md"  # the checkout's
HEADER = """# Benchmarks

GPU numbers measured by `qspec-bench`. Every section names its device, date, jax version and
the exact command; `make bench` on a GPU machine regenerates all of them. Definitions follow
SPEC §7 (acceptance rate, tokens per round, speedup; medians of repeated device loops).
"""


def environment() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {"date": datetime.date.today().isoformat(), "device": getattr(dev, "device_kind", str(dev)),
            "backend": jax.default_backend(), "jax": jax.__version__, "python": platform.python_version(),
            "num_devices": jax.device_count(), "xla_flags": os.environ.get("XLA_FLAGS", "")}


def env_line(env: dict[str, Any], command: str) -> str:
    return (f"Device: {env['device']} ({env['backend']}, {env['num_devices']} device(s)); date {env['date']}; "
            f"jax {env['jax']}; XLA_FLAGS `{env.get('xla_flags') or '(none)'}`; command: `{command}`")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    fmt = lambda v: ("–" if v != v else f"{v:.3g}") if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def update_section(name: str, text: str, path: Path = BENCHMARKS_MD, header: str = HEADER) -> None:
    """Replaces (or appends) the `name` section of a generated document (`header` starts a new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = path.read_text() if path.exists() else header
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{text.strip()}\n{end}"
    if begin in doc:
        doc = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, doc, flags=re.S)
    else:
        doc = doc.rstrip() + "\n\n" + block + "\n"
    path.write_text(doc)


def _plot(path: Path, series: dict[str, tuple[list[float], list[float]]], title: str, ylabel: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, (x, y) in series.items():
        ax.plot(x, y, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _kept(part: dict[str, Any]) -> str:
    """The line under a part's heading when it was kept from an earlier run (`e2e --keep-parts`)."""
    k = part.get("kept_from")
    return f"\nMeasured by an earlier run ({k['date']}): `{k['command']}`.\n" if k else ""


def write_e2e(results: dict[str, Any], out: Path, doc: Path | None = None) -> None:
    """Plots into `out`, and with a `doc` the markdown sections "e2e" and "tp" of that file, from
    `qspec-bench e2e` results."""
    env, bw = results["environment"], results.get("copy_bandwidth_bytes_per_s", float("nan"))
    parts = [f"## End to end\n\n{env_line(env, results['command'])}\n\n"
             f"Device-to-device copy, same run: {bw / 1e12:.2f} TB/s (bytes read + written)."]
    p8 = results.get("8b")
    if p8 and "rows" in p8:
        rows = [r for r in p8["rows"] if "error" not in r]  # contexts that did not fit: listed after the tables
        gammas = sorted({int(k.split('_g')[1].split('_')[0]) for r in rows for k in r if k.startswith("verify_g")})
        alphas = sorted({float(k.split("_a")[1].split("_")[0]) for r in rows for k in r if k.startswith("proj_g")})
        parts.append(
            f"### {p8['config']}\n{_kept(p8)}\nPer-step times (median over repeated in-device loops), bytes each step must "
            "read, and the fraction of copy bandwidth that represents. Draft weights: "
            f"INT4 g{p8['draft']['group_size']} ({p8['draft']['scope']}, lm_head {'INT4' if p8['draft']['lm_head'] else 'bf16'}).\n")
        mosaic = any("ar_bf16_mosaic_ms" in r for r in rows)  # `--dense-mosaic`: the target's linears on Mosaic
        parts.append(table(
            ["context", "AR-bf16 ms", "AR-bf16 % copy BW"] + (["AR-bf16 ms, Mosaic dense"] if mosaic else [])
            + ["AR-int8 ms", "AR-int8 % BW", "draft step ms", "draft % BW", "draft ms, XLA int4"]
            + [f"verify γ={g} ms" for g in gammas],
            [[r["context"], r["ar_bf16_ms"], 100 * r["ar_bf16_bw_frac"]]
             + ([r.get("ar_bf16_mosaic_ms", float("nan"))] if mosaic else [])
             + [r["ar_int8_ms"], 100 * r["ar_int8_bw_frac"], r["draft_ms"], 100 * r["draft_bw_frac"],
                r.get("draft_xla_int4_ms", float("nan"))]
             + [r[f"verify_g{g}_ms"] for g in gammas] for r in rows]))
        peer = {(r["weights"], r["context"]): r for r in results.get("torch_decode", {}).get("records", [])}
        if peer:
            g = results["torch_decode"].get("group")
            parts.append(f"\nPyTorch peer, same run: one decode step of the same shape in PyTorch "
                         f"({next(iter(peer.values())).get('torch', '?')}; fused q|k|v and gate|up, SDPA over a "
                         f"static cache, CUDA graph), bf16 weights and int4 tinygemm weights (group {g}), ms per "
                         "step; against our AR-bf16 step and our draft step:\n")
            parts.append(table(
                ["context", "PyTorch bf16 ms", "PyTorch int4 ms", "our AR-bf16 ms", "our draft ms"],
                [[r["context"], peer.get(("bf16", r["context"]), {}).get("ms", float("nan")),
                  peer.get(("int4", r["context"]), {}).get("ms", float("nan")), r["ar_bf16_ms"], r["draft_ms"]]
                 for r in rows]))
        parts.append(f"\nCompile time of `generate` (prefill + speculative loop) for this {p8.get('layers', 32)}-layer "
                     f"model: {p8.get('compile_generate_s', float('nan')):.1f} s.")
        for a in alphas:
            parts.append(f"\nProjected speedup at acceptance α = {a}: E[tokens/round]·t_AR / (γ·t_draft + t_verify)\n")
            parts.append(table(
                ["context"] + [f"γ={g} vs AR-bf16" for g in gammas] + [f"γ={g} vs AR-int8" for g in gammas],
                [[r["context"]] + [r[f"proj_g{g}_a{a}_vs_bf16"] for g in gammas]
                 + [r[f"proj_g{g}_a{a}_vs_int8"] for g in gammas] for r in rows]))
        loop_rows = [r for r in rows if "ar_bf16_loop_tok_s" in r]
        if loop_rows:
            lg = [k for k in loop_rows[0] if k.startswith("loop_g") and k.endswith("_vs_bf16")]
            parts.append("\nMeasured generation loops, 128 tokens each (" + p8.get("note", "") + "):\n")
            parts.append(table(
                ["context", "AR-bf16 tok/s", "AR-int8 tok/s"] + [k.replace("_vs_bf16", " speedup vs AR-bf16") for k in lg]
                + [k.replace("_vs_bf16", " / projection") for k in lg],
                [[r["context"], r["ar_bf16_loop_tok_s"], r["ar_int8_loop_tok_s"]] + [r[k] for k in lg]
                 + [r[k.replace("_vs_bf16", "_vs_projection")] for k in lg] for r in loop_rows]))
        series = {}
        for a in alphas:
            best = [max(r[f"proj_g{g}_a{a}_vs_bf16"] for g in gammas) for r in rows]
            series[f"projected, best γ, α={a}"] = ([r["context"] for r in rows], best)
        for k in (lg if loop_rows else []):
            series[k.replace("_vs_bf16", " measured")] = ([r["context"] for r in loop_rows], [r[k] for r in loop_rows])
        if rows and _plot(out / "e2e_speedup.png", series, "QuantSpec speedup over AR-bf16 (8B shape)", "speedup"):
            parts.append(f"\n![speedup vs context]({_rel(out / 'e2e_speedup.png', doc)})")
        parts += [f"\n- context {r['context']}: {r['error']}" for r in p8["rows"] if "error" in r]
    elif p8:
        parts.append(f"### 8B shape\n\nFailed: `{p8.get('error')}`")
    bt = results.get("batch")
    if bt and bt.get("rows"):
        nan = float("nan")
        alphas = ([str(a) for a in bt["alphas"]] if "alphas" in bt else  # (results of older runs: from the keys)
                  sorted({k.split("_a")[1].split("_")[0] for r in bt["rows"] for k in r if k.startswith("spec_a")}))
        parts.append(f"\n### Batch {bt['rows'][0]['batch']} (8B shape, rows of different prompt lengths, "
                     f"γ={bt['gamma']}, forced per-row acceptance, {bt['tokens']}-token loops)\n" + _kept(bt))
        parts.append(table(
            ["context", "row lengths", "AR-bf16 tok/s"] + [f"QuantSpec α={a} tok/s" for a in alphas]
            + [f"speedup α={a}" for a in alphas] + ["note"],
            [[r["context"], f"{min(r['lengths'])}..{max(r['lengths'])}", r.get("ar_bf16_tok_s", nan)]
             + [r.get(f"spec_a{a}_tok_s", nan) for a in alphas] + [r.get(f"spec_a{a}_vs_ar", nan) for a in alphas]
             + [r.get("error", "")] for r in bt["rows"]]))
    elif bt:
        parts.append(f"\n### Batch\n\nFailed: `{bt.get('error')}`")
    sm = results.get("smollm")
    if sm and "rows" in sm:
        gammas = sm["gamma"] if isinstance(sm["gamma"], list) else [sm["gamma"]]  # a list since 2026-11-30
        head = f"γ={gammas[0]}" if len(gammas) == 1 else f"the fastest of γ={','.join(map(str, gammas))}"
        parts.append(f"\n### SmolLM2-135M-Instruct, real Shakespeare prompts (greedy, {head})\n" + _kept(sm))
        rows = [r for r in sm["rows"] if "error" not in r]
        decode = bool(rows) and "spec_decode_tok_s" in rows[0]  # since 2026-11-30: decoding alone, then end to end
        if decode:
            parts.append("\nDecoding alone (SPEC's and the issues' measure): each method's run less its own "
                         "prefill, timed alone; end to end: the same runs with the prefill in."
                         + (" AR at width 1 (the fastest AR loop), QuantSpec at gamma_max = γ (verify passes of "
                            "γ + 1 columns); its tokens compared with AR-int8 at that verify width."
                            if sm.get("ar_width") == 1 else
                            " AR at GenerationConfig's default width (the verify width, 8 columns per pass; before "
                            "2026-12-01), not the fastest AR loop.") + "\n")
            parts.append(table(
                ["batch", "context", "γ", "AR-bf16 decode tok/s", "AR-int8 decode tok/s", "QuantSpec decode tok/s",
                 "decode speedup vs AR-bf16", "vs AR-int8", "prefill s (AR-bf16 / QuantSpec)",
                 "end to end speedup vs AR-bf16", "acceptance", "tokens/round", "tokens equal to AR-int8"],
                [[r["batch"], r["context"], r["gamma"], r["ar_bf16_decode_tok_s"], r["ar_int8_decode_tok_s"],
                  r["spec_decode_tok_s"], r["decode_speedup_vs_ar_bf16"], r["decode_speedup_vs_ar_int8"],
                  f"{r['ar_bf16_prefill_s']:.3f} / {r['spec_prefill_s']:.3f}", r["speedup_vs_ar_bf16"],
                  r["acceptance_rate"], r["tokens_per_round"], r["match_ar_int8"]] for r in rows]))
        else:
            parts.append(table(
                ["batch", "context", "γ", "AR-bf16 tok/s", "AR-int8 tok/s", "QuantSpec tok/s", "speedup vs AR-bf16",
                 "speedup vs AR-int8", "acceptance", "tokens/round", "tokens equal to AR-int8"],
                [[r["batch"], r["context"], r.get("gamma", gammas[0]), r["ar_bf16_tok_s"], r["ar_int8_tok_s"],
                  r["spec_tok_s"], r["speedup_vs_ar_bf16"], r["speedup_vs_ar_int8"], r["acceptance_rate"],
                  r["tokens_per_round"], r["match_ar_int8"]] for r in rows]))
        peer = [r for r in sm.get("torch_decode", {}).get("records", []) if r.get("status") == "ok"]
        if peer and rows and decode:
            by = {(r["weights"], r["batch"]): r for r in peer}
            parts.append(f"\nPyTorch peer, same run: one decode step of SmolLM2's shape in PyTorch "
                         f"({peer[0].get('torch', '?')}; the 8B peer's code: fused q|k|v and gate|up, SDPA over a "
                         f"static cache, CUDA graph; random weights) at {peer[0]['context']} cached tokens, bf16 "
                         f"weights and int4 tinygemm weights (group {sm['torch_decode'].get('group')}), in decode "
                         "tok/s (rows / step time) against ours:\n")
            parts.append(table(
                ["batch", "PyTorch bf16 tok/s", "PyTorch int4 tok/s", "our AR-bf16 decode tok/s",
                 "our QuantSpec decode tok/s"],
                [[r["batch"]] + [r["batch"] / (by[(w, r["batch"])]["ms"] * 1e-3) if (w, r["batch"]) in by
                                 else float("nan") for w in ("bf16", "int4")]
                 + [r["ar_bf16_decode_tok_s"], r["spec_decode_tok_s"]] for r in rows]))
        if len(gammas) > 1:
            key = "decode_tok_s" if decode else "tok_s"
            parts.append(f"\nQuantSpec {'decode ' if decode else ''}tok/s by γ (tokens equal to "
                         "AR-int8 at every γ in the table's last column):\n")
            parts.append(table(["batch"] + [f"γ={g}" for g in gammas],
                               [[r["batch"]] + [next(b[key] for b in r["by_gamma"] if b["gamma"] == g)
                                                for g in gammas] for r in rows]))
        parts += [f"\n- batch {r['batch']}: {r['error']}" for r in sm["rows"] if "error" in r]
    elif sm:
        parts.append(f"\n### SmolLM2\n\nFailed: `{sm.get('error')}`")
    mem = results.get("memory")
    if mem and "rows" in mem:
        parts.append("\n### Memory (8B shape, batch 1)\n" + _kept(mem) + "\nPeak = arguments + outputs + temporaries of the compiled "
                     "generation loop (XLA memory analysis).\n")
        parts.append(table(["context", "mode", "peak GB", "arguments GB", "temporaries GB"],
                           [[r["context"], r["kind"], r["peak_bytes"] / 1e9, r["arguments"] / 1e9, r["temp"] / 1e9]
                            if "error" not in r else [r["context"], r["kind"], "failed", r["error"][:80], ""]
                            for r in mem["rows"]]))
        plan = mem["plan"]
        parts.append(f"\nLongest context on this device ({plan['device_bytes'] / 2**30:.1f} GiB) by the cache-bytes "
                     f"planner: AR-bf16 {plan['ar_bf16']['context']:,} tokens, QuantSpec {plan['quantspec']['context']:,} "
                     f"tokens ({plan['ratio']:.2f}x).")
        for kind, c in mem.get("confirm", {}).items():
            parts.append(f"- confirmed by a run, {kind} at {c['context']:,} tokens: "
                         + (f"ok, step {c['step_ms']:.2f} ms, peak in use {c['peak_bytes_in_use'] / 1e9:.1f} GB"
                            if c["ok"] else f"FAILED: {c['error']}"))
    elif mem:
        parts.append(f"\n### Memory\n\nFailed: `{mem.get('error')}`")
    if doc is None:
        return
    if any(k in results for k in ("8b", "batch", "smollm", "memory")):
        update_section("e2e", "\n".join(parts), doc)
    pf = results.get("prefill")
    if pf and "kept_from" not in pf:  # its own section: `--parts prefill` runs on its own (the longest prompt takes minutes)
        update_section("prefill", prefill_section(pf, env, results["command"]), doc)
    tp = results.get("tp")  # its own section: it runs on a multi-GPU machine, apart from the rest
    if tp and "kept_from" not in tp:  # a kept one (--keep-parts): its section stays as that run wrote it
        update_section("tp", tp_section(tp, env, results["command"], bw) if "rows" in tp
                       else f"## Tensor parallelism\n\nFailed: `{tp.get('error')}`", doc)


def _cell(row: dict[str, Any], key: str) -> Any:
    """row[key], or the row's error (shortened) where the measurement failed."""
    if key in row:
        return row[key]
    err = row.get("error") or next((v for k, v in row.items() if k.endswith("_error") and k.startswith(key[:6])), "")
    return f"failed: {str(err)[:60]}" if err else float("nan")


def prefill_section(pf: dict[str, Any], env: dict[str, Any], command: str) -> str:
    """The "prefill" section: prompt attention per layer, time to first token, one long request."""
    if "error" in pf:
        return f"## Prefill\n\nFailed: `{pf['error']}`"
    parts = [f"## Prefill (time to first token)\n\n{env_line(env, command)}\n\n{pf['config']}."]
    sdpa = {r.get("context"): r for r in pf.get("torch_sdpa", [])}
    att = pf.get("attention", [])
    if att:
        chunk_keys = sorted({k[:-3] for r in att for k in r if k.startswith("ours_chunk") and k.endswith("_ms")},
                            key=lambda k: int(k[len("ours_chunk"):]))
        parts.append("\n### Prompt attention, one layer (32 q / 8 kv heads, D 128, bf16; ms and causal TFLOP/s)\n\n"
                     "Ours whole: `attention.prefill_attention` as `model.prefill` runs a whole prompt. Ours chunk C: "
                     "the attention of a chunked prefill summed over its chunks (each over the hierarchical cache's "
                     "prefix through the INT8 view, split and merged by log-sum-exp, plus itself). Peers in the same "
                     "run: cuDNN through `jax.nn.dot_product_attention(implementation='cudnn')` and torch SDPA.\n")
        heads = ["T", "ours whole ms", "TFLOP/s"]
        for k in chunk_keys:
            heads += [f"ours chunk {k[len('ours_chunk'):]} ms", "TFLOP/s"]
        heads += ["cuDNN (JAX) ms", "TFLOP/s", "torch SDPA ms", "TFLOP/s"]
        rows = []
        for r in att:
            row = [r["context"], _cell(r, "ours_whole_ms"), _cell(r, "ours_whole_tflops")]
            for k in chunk_keys:
                row += [_cell(r, f"{k}_ms"), _cell(r, f"{k}_tflops")]
            peer = sdpa.get(r["context"], {})
            row += [_cell(r, "cudnn_ms"), _cell(r, "cudnn_tflops"), peer.get("ms", float("nan")),
                    peer.get("tflops", float("nan"))]
            rows.append(row)
        parts.append(table(heads, rows))
    torch_pre = {r.get("context"): r for r in pf.get("torch_prefill", [])}
    ttft = pf.get("ttft", [])
    if ttft:
        parts.append("\n### Time to first token (`model.prefill` of one prompt into the hierarchical cache)\n\n"
                     "Compiled once; median of runs. TFLOP/s: 2 x linear weights x T plus the causal attention, "
                     "over the time. Temporaries: the compiled program's (XLA memory analysis). PyTorch peer: the "
                     "same prompt's forward in eager PyTorch, bf16 weights, SDPA flash attention.\n")
        parts.append(table(
            ["T", "chunk", "seconds", "prompt tok/s", "TFLOP/s", "temporaries GB", "PyTorch s"],
            [[r["context"], r["chunk"] or "whole", _cell(r, "s"), _cell(r, "tok_s"), _cell(r, "tflops"),
              (r.get("temp_bytes") or float("nan")) / 1e9 if "temp_bytes" in r else float("nan"),
              torch_pre.get(r["context"], {}).get("ms", float("nan")) / 1e3] for r in ttft]))
    sm = pf.get("smollm", [])
    if sm:
        r = sm[0]
        parts.append(f"\nSmolLM2-135M's shape (random weights), {r['batch']} prompts of {r['context']:,} tokens (padded to "
                     f"{r['padded']:,} as generation pads them), whole: " + (
                         f"{r['s']:.3f} s to the first token ({r['tok_s']:,.0f} prompt tok/s)." if "s" in r
                         else f"failed: {r.get('error')}"))
    req = pf.get("request", [])
    if req:
        t = req[0]["context"]
        peer_pre = torch_pre.get(t, {}).get("ms", float("nan")) / 1e3
        peer_step = next((r.get("ms", float("nan")) for r in pf.get("torch_decode_int4", [])
                          if r.get("context") == t), float("nan")) / 1e3
        n = req[0]["new_tokens"]
        spec = next((r for r in req if r["mode"] == "quantspec"), {})
        forced = (f"α = {spec['alpha']}, γ = {spec['gamma']}" if "alpha" in spec
                  else "α = 0.9, γ = 4 (the bench's defaults)")
        parts.append(f"\n### One request: {t:,}-token prompt + {n} new tokens\n\n"
                     "Prefill (whole or chunked as `generate`'s default `prefill_chunk=\"auto\"` decides on this "
                     "device), then the decode loop on its cache (each program compiled and warmed up first; one "
                     f"timed run). QuantSpec at forced acceptance ({forced}; random weights); the PyTorch peer is "
                     "its bf16 prefill plus as many CUDA-graph int4 (tinygemm) decode steps at this context.\n")
        rows = [[r["mode"], r.get("chunk") or "whole", _cell(r, "prefill_s"), _cell(r, "decode_s"),
                 _cell(r, "total_s")] for r in req]
        rows.append(["PyTorch (SDPA + CUDA-graph int4)", "whole", peer_pre, n * peer_step, peer_pre + n * peer_step])
        parts.append(table(["mode", "prefill chunk", "prefill s", "decode s", "total s"], rows))
    lg = pf.get("longest")
    if lg:
        parts.append(f"\n### The longest prompt\n\nPlanner's QuantSpec maximum context on this device "
                     f"({lg['device_bytes'] / 2**30:.1f} GiB): {lg['planned_context']:,} tokens; a {lg['prompt']:,}-token "
                     f"random prompt prefilled in chunks of {lg['chunk']} and decoded for {lg['new_tokens']} tokens: "
                     + (f"prefill {lg['prefill_s_incl_compile']:.1f} s, decode {lg['decode_s_incl_compile']:.1f} s "
                        f"(both including compilation), peak memory in use {lg['peak_bytes_in_use'] / 1e9:.1f} GB."
                        if lg.get("ok") else f"FAILED: {lg.get('error')}")
                     + (f" Command: `{lg['command']}` (its own run; the tables above are from the command at the top)."
                        if "command" in lg else ""))
    return "\n".join(parts)


def tp_section(tp: dict[str, Any], env: dict[str, Any], command: str, bandwidth: float) -> str:
    """The "tp" section: tokens/s and scaling on 1 vs N devices, each row's AR-bf16 step floor
    (`collectives.step_floor_s`: bytes per device at the copy bandwidth plus two all-reduces
    per layer at one row), and the all-reduce latencies it uses."""
    from qspec_jax.bench.collectives import step_floor_s

    one_row = {c["devices"]: c["collective_s"] for c in tp.get("collectives", []) if c["rows"] == 1}
    nan = float("nan")

    def floor_tok_s(r: dict[str, Any]) -> float:
        latency = 0.0 if r["devices"] == 1 else one_row.get(r["devices"])
        if latency is None or "ar_bf16_bytes_per_device" not in r or not bandwidth > 0:
            return nan
        return 1.0 / step_floor_s(r["ar_bf16_bytes_per_device"], bandwidth, tp["layers"], latency)

    parts = [f"## Tensor parallelism (8B shape, batch 1, γ={tp['gamma']}, forced α={tp['alpha']})\n",
             f"{env_line(env, command)}\n",
             f"Tokens/s of {tp.get('tokens', '?')}-token generation loops; scaling efficiency = tokens/s on N devices / "
             "(N × tokens/s on one). Peak per device from XLA's memory analysis of each compiled loop. AR floor: "
             "1 / (bytes per device of an AR-bf16 step / copy bandwidth of this run + layers × 2 × the one-row "
             "all-reduce below).\n",
             table(["devices", "context", "AR-bf16 tok/s", "AR floor tok/s", "QuantSpec tok/s", "AR scaling eff.",
                    "QuantSpec scaling eff.", "AR peak GB/device", "QuantSpec peak GB/device", "note"],
                   [[r["devices"], r["context"], r.get("ar_bf16_tok_s", nan), floor_tok_s(r), r.get("spec_tok_s", nan),
                     r.get("ar_bf16_scaling_eff", nan), r.get("spec_scaling_eff", nan),
                     r.get("ar_bf16_peak_bytes_per_device", nan) / 1e9,
                     r.get("spec_peak_bytes_per_device", nan) / 1e9, r.get("error", "")[:60]]
                    for r in tp["rows"]])]
    if tp.get("collectives"):
        parts.append("\nThe per-layer all-reduce alone (psum of [rows, hidden] bf16, back to back in a device loop; "
                     "collective = that loop's time per iteration less an elementwise kernel of the same shape):\n")
        parts.append(table(["devices", "rows", "KB", "psum + kernel µs", "kernel µs", "collective µs"],
                           [[c["devices"], c["rows"], c["bytes"] / 1e3, c["allreduce_s"] * 1e6,
                             c["elementwise_s"] * 1e6, c["collective_s"] * 1e6] for c in tp["collectives"]]))
    return "\n".join(parts)


def _rel(p: Path, doc: Path | None) -> str:
    try:
        return str(p.resolve().relative_to((doc or BENCHMARKS_MD).parent.resolve()))
    except ValueError:
        return str(p)
