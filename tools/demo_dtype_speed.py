"""The demo's speed in float32 and in bfloat16 compute, on this machine (README, "make demo").

    python tools/demo_dtype_speed.py [--checkpoint checkpoints/smollm2-135m-instruct] [--reps 5]

Loads the bf16-stored demo checkpoint twice (compute dtype float32 and bfloat16), then for each
prompt runs, alternating the two dtypes so that a busy machine slows both alike: speculative
decoding (gamma 4, INT8 cache, the stored INT4 draft) and autoregressive decoding of the same
target, 64 new tokens at most, as `make demo` does. Prints the median tokens/s (run time after
compilation) of --reps runs of each, and the answers (float32 and bfloat16 can answer differently
where two logits nearly tie).
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ("What is the capital of France?", "Name two planets of the solar system.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=REPO / "checkpoints" / "smollm2-135m-instruct")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()

    import jax

    import qspec_jax
    from qspec_jax.generation import GenerationConfig, generate_autoregressive
    from qspec_jax.speculative import SpecConfig, generate

    dev = jax.devices()[0]
    print(f"device: {dev.platform} ({getattr(dev, 'device_kind', '')}), {os.cpu_count()} cores; jax {jax.__version__}")
    models = {d: qspec_jax.load(args.checkpoint, dtype=d) for d in ("float32", "bfloat16")}
    speeds: dict[tuple[str, str, str], list[float]] = {}
    answers: dict[tuple[str, str], str] = {}
    for prompt in PROMPTS:
        for _ in range(args.reps):
            for dtype, model in models.items():
                ids = model.encode(prompt, chat=True)
                for mode in ("spec", "ar"):
                    t: dict[str, float] = {}
                    if mode == "spec":
                        res = generate(model, [ids], SpecConfig(gamma=4, max_new_tokens=64), jax.random.PRNGKey(0),
                                       timings=t)
                    else:
                        res = generate_autoregressive(model, [ids], GenerationConfig(max_new_tokens=64, kv="int8"),
                                                      jax.random.PRNGKey(0), timings=t)
                    tokens = res.to_lists()[0]
                    speeds.setdefault((prompt, dtype, mode), []).append(len(tokens) / t["run_s"])
                    answers[(prompt, dtype)] = model.decode(tokens)
    for (prompt, dtype, mode), v in speeds.items():
        print(f"{prompt[:32]:32} {dtype:9} {mode:4} {statistics.median(v):6.2f} tokens/s (median of {len(v)}; "
              f"min {min(v):.2f}, max {max(v):.2f})")
    for (prompt, dtype), text in answers.items():
        print(f"{prompt[:32]:32} {dtype:9} {text[:70]!r}")


if __name__ == "__main__":
    main()
