"""Planning: what fits a device (memory) and what runs fastest on it (speed).

Memory: bytes of weights and caches, the longest context that fits a device, and what a
request needs (`request_bytes`: weights + cache + the larger of the prefill's and a decode
step's temporaries, modelled on what `model.prefill` / `model.decode` materialise and checked
against XLA's memory_analysis on the CPU); `check_request_fits` refuses one that does not fit
(`DoesNotFitError`, one line saying what would). All numbers come from array shapes
(`jax.eval_shape`), so nothing is allocated.

Speed: the gamma that maximises expected tokens/s, or autoregressive decoding when no gamma
wins. A round of speculative decoding costs d draft steps and one verify pass, and emits
E[tokens/round] tokens per row; with a per-position acceptance probability alpha (drafts
accepted i.i.d. until the first rejection; SpecResult.alpha_estimate measures it)

    E[tokens/round](alpha, gamma) = (1 - alpha^(gamma+1)) / (1 - alpha)
    tokens/s(gamma) = B * E / (gamma * c_draft + c_verify)        against  B / c_ar

with per-pass costs c measured on the device (`measure_step_costs`: a short calibration run,
cached as JSON per model / device / context bucket / batch). `plan_gamma` evaluates every fixed
gamma 1..gamma_max (and any policy whose tokens/round was measured, e.g. the dynamic "bass"
policy: under the i.i.d. model alone a dynamic length cannot beat the best fixed gamma, its gain
comes from acceptance that varies along the text) and picks the fastest, or autoregressive
decoding when no candidate is predicted faster. `plan(model, prompts, SpecConfig(...))` does the
measuring and returns the plan; `qspec-generate --gamma auto` uses it.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qspec_jax import model as M
from qspec_jax.attention import PREFILL_QUERY_CHUNK, prefill_impl, prefix_span, uses_kernels
from qspec_jax.cache import DEFAULT_GAMMA_MAX, DEFAULT_GROUP_SIZE, cache_bytes, ring_slots
from qspec_jax.compilation import programs, run_program, user_cache_dir
from qspec_jax.config import ModelConfig
from qspec_jax.weight_quant import DraftWeightsConfig, QuantizedWeight, make_draft_params

# Room left for activations, logits, compiler workspace and allocator slack.
DEFAULT_HEADROOM_BYTES = 4 << 30
COST_CACHE_FORMAT = 1
MIN_CONTEXT_BUCKET = 1024


# =========================================================================== memory planning
def tree_bytes(tree: Any) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


@functools.lru_cache(maxsize=64)
def _target_shapes(cfg: ModelConfig) -> M.Params:
    """cfg's target params as ShapeDtypeStructs (nothing allocated)."""
    return jax.eval_shape(lambda: M.init_random_params(cfg, jax.random.PRNGKey(0)))


@functools.lru_cache(maxsize=64)
def _draft_bytes(cfg: ModelConfig, draft: DraftWeightsConfig) -> int:
    target = _target_shapes(cfg)  # every method makes the same format: shapes from the data-free one
    d = jax.eval_shape(lambda p: make_draft_params(p, dataclasses.replace(draft, method="clip")), target)
    linears = [getattr(d.layers, n) for n in M.LINEAR_NAMES] + [d.lm_head]
    return tree_bytes([w for w in linears if isinstance(w, QuantizedWeight)])  # the rest is shared


def weight_bytes(cfg: ModelConfig, draft: DraftWeightsConfig | None = None) -> dict[str, int]:
    """Bytes of the target weights and (when `draft` is given) of the extra INT4 draft weights."""
    out = {"target": tree_bytes(_target_shapes(cfg))}
    if draft is not None:
        out["draft"] = _draft_bytes(cfg, draft)
    return out


# -------------------------------------------------------------------- what a request needs
# Every estimate below counts bytes from array shapes and is checked against XLA's own account
# (`memory_analysis()` of the compiled programs) on the CPU, by tests/test_memory.py: the
# workspaces within MEMORY_MODEL_MARGIN of it, the whole request within it as well.
MEMORY_MODEL_MARGIN = 0.25


class DoesNotFitError(ValueError):
    """A request that does not fit this device's memory, refused before anything is allocated
    for it (or, as `OutOfMemoryError`, after XLA ran out of memory running it). The message is
    one line: what was asked, the bytes needed and their parts, the bytes the device has, and
    what would fit. `needed` / `available` are those byte counts, `parts` the needed bytes by
    part ({"weights", "cache", "state", "prefill", "step", "total"})."""

    def __init__(self, message: str, *, needed: int, available: int, parts: Mapping[str, int] | None = None) -> None:
        super().__init__(message)
        self.needed, self.available, self.parts = int(needed), int(available), dict(parts or {})


class OutOfMemoryError(DoesNotFitError):
    """XLA ran out of memory (RESOURCE_EXHAUSTED) running a request the estimate let through."""


def format_bytes(n: float) -> str:
    """Bytes in decimal units with three significant digits: "1.20 TB", "23.2 GB", "512 B"."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.3g} {unit}" if v < 1000 else f"{v:.0f} {unit}"
    return f"{int(n)} B"


def available_ram_bytes() -> int:
    """The machine's available RAM: MemAvailable of /proc/meminfo (free memory plus what the
    kernel can reclaim), else free pages x page size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def device_memory_bytes(device: Any = None) -> int:
    """The bytes a request may use on `device` (default: the first local device): an
    accelerator's allocator limit (`memory_stats()["bytes_limit"]`, what XLA may hold in all,
    arrays already on it included), or on a CPU the machine's available RAM
    (`available_ram_bytes`: arrays this process already holds are not in it)."""
    dev = device if device is not None else jax.local_devices()[0]
    stats = None
    if dev.platform != "cpu":
        try:
            stats = dev.memory_stats()
        except Exception:  # noqa: BLE001 - a backend without statistics
            stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return available_ram_bytes()


def resource_exhausted(error: BaseException) -> bool:
    """Whether `error` is XLA running out of memory: a JaxRuntimeError with status
    RESOURCE_EXHAUSTED, or whose message is XLA's "Out of memory allocating N bytes" under
    another status (the CPU client reports a failed dispatch as INTERNAL), or a MemoryError."""
    return isinstance(error, MemoryError) or (isinstance(error, jax.errors.JaxRuntimeError) and (
        "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error)))


def xla_reason(error: BaseException) -> str:
    """XLA's words for running out of memory ("Out of memory allocating N bytes."), or the first
    line of its message without the status prefix."""
    text = str(error).strip()
    found = re.search(r"Out of memory[^\n]*", text)
    if found:
        return found.group(0)[:300]
    line = (text.splitlines() or [type(error).__name__])[0]
    return line.split("RESOURCE_EXHAUSTED:", 1)[-1].strip()[:300]


def _layer_weight_bytes(cfg: ModelConfig) -> tuple[int, int, int]:
    """(all target weights, the stacked layer weights, the lm_head or, tied, the embedding the
    logits read) of cfg in bytes, from array shapes."""
    target = _target_shapes(cfg)
    head = target.lm_head if target.lm_head is not None else target.embed
    return tree_bytes(target), tree_bytes(target.layers), tree_bytes(head)


def _platform(platform: str | None) -> str:
    return platform or jax.default_backend()


def weight_workspace_bytes(cfg: ModelConfig, platform: str | None = None) -> int:
    """Temporaries the weights cost a program that runs the layer loop: one layer's weights
    sliced out of the stack and, on a CPU with bfloat16 weights, the float32 copies XLA makes of
    every layer weight and of the lm_head, once per program run (hoisted out of the loops: the
    CPU has no bfloat16 matmul; measured, tests/test_memory.py)."""
    _, layers, head = _layer_weight_bytes(cfg)
    out = layers // cfg.num_layers if cfg.num_layers > 1 else 0
    a = jnp.dtype(cfg.dtype).itemsize
    if _platform(platform) == "cpu" and a < 4:
        out = 4 // a * (layers + head + out)
    return int(out)


def prefill_workspace_bytes(cfg: ModelConfig, batch: int, prompt_len: int, chunk: int | None = None, *,
                            all_logits: bool = False, platform: str | None = None) -> int:
    """Temporaries of `model.prefill` over `batch` prompts padded to `prompt_len` tokens, besides
    the weights and the cache it fills: what one layer of `model.layer_forward` holds at once.

    chunk None (or >= prompt_len) prefills the whole prompt in one pass; chunk C, C tokens at a
    time (`model._prefill_chunked`). With a = the model dtype's bytes and n = batch x T (T the
    tokens in flight: the prompt or C):
      held through the layer: the residual stream x and its update [B, T, D], and k, v
        [B, Hkv, T, Dh] (written to the cache at the layer's end);
      then the larger of the attention and of the MLP (its normed input, output, gate and up:
        [B, T, D] twice, [B, T, F] twice). The attention holds q and its output [B, T, Hq*Dh]
        and, by `attention.prefill_impl` on this platform:
        "reference" (the jnp code): float32 scores and probabilities
          [B, Hkv, min(T, PREFILL_QUERY_CHUNK), n_rep, S] (S = prompt_len keys; plus the keys in
          float32 when a < 4); a chunk also reads the whole cache dequantized to float32 and
          concatenated with its own K/V: four [B, Hkv, S, Dh] float32 arrays;
        the flash path ("cudnn", "xla"): nothing more for a whole prompt (flash attention keeps
          its tiles on chip); a chunk, float32 output and log-sum-exp accumulators [B, T, Hq]
          x (Dh + 1) twice and one dequantized prefix span, k and v [B, Hkv, L, Dh] with L =
          `attention.prefix_span` keys (at most max(C, PREFIX_SPAN_TOKENS / B));
      the float32 logits [B, V] ([B, T, V] with all_logits) and `weight_workspace_bytes`.
    So on the flash path a chunk's temporaries do not grow with the prompt.
    """
    a = jnp.dtype(cfg.dtype).itemsize
    chunked = chunk is not None and chunk < prompt_len
    t = chunk if chunked else prompt_len
    n = batch * t
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * dh, cfg.num_kv_heads * dh
    try:
        impl = prefill_impl(cfg.prefill_attention_impl, dh, cfg.dtype, cfg.sliding_window, chunked,
                            platform=_platform(platform))
    except ValueError:  # a forced impl this platform cannot run: the run will say so; estimate it as given
        impl = cfg.prefill_attention_impl
    attention = 2 * n * q * a
    if impl == "reference":
        scores = batch * cfg.num_kv_heads * min(t, PREFILL_QUERY_CHUNK) * cfg.n_rep * prompt_len * 4
        keys32 = batch * kv * prompt_len * 4 if a < 4 else 0
        attention += 2 * scores + keys32 + (4 * batch * kv * prompt_len * 4 if chunked else 0)
    elif chunked:
        span = prefix_span(chunk, batch, max_len=sys.maxsize)  # the cache's length caps it lower still
        attention += 2 * n * cfg.num_heads * (dh + 1) * 4 + 2 * batch * span * kv * a
    held = n * (2 * d + 2 * kv) * a
    mlp = n * (2 * d + 2 * f) * a
    logits = (n if all_logits else batch) * cfg.vocab_size * 4
    return int(held + max(attention, mlp) + logits + weight_workspace_bytes(cfg, platform))


def step_workspace_bytes(cfg: ModelConfig, batch: int, width: int, cache_len: int, *, kv: str = "int8",
                         view: str = "target", group_size: int = DEFAULT_GROUP_SIZE,
                         gamma_max: int = DEFAULT_GAMMA_MAX, platform: str | None = None) -> int:
    """Temporaries of one `model.decode` pass of `width` token columns per row over a cache of
    `cache_len` slots (besides the weights and the cache): the float32 logits [B, width, V], the
    activations, `weight_workspace_bytes` and, where attention runs the jnp code
    (`attention.uses_kernels` False: the CPU), what one layer of it materializes:
      a dense cache ("bf16"): the layer's keys in float32 and its values, [B, Hkv, S, Dh] each,
        and the float32 scores [B, Hkv, width, n_rep, S] (on a CPU with
        bfloat16 and more than one row XLA widens every layer's keys and values to float32 at
        once: measured);
      the hierarchical one ("int8"): every nibble plane the view reads (2 of the keys and 2 of
        the values for "target", 1 and 1 for "draft") unpacked to float32 codes [B, Hkv, S, Dh]
        (with head_dim >= 128 the values' int32 codes as well: measured on the CPU), and the
        scores over the quantized slots and the ring.
    The Pallas kernels read the cache in place (their scratch is a few tiles)."""
    a = jnp.dtype(cfg.dtype).itemsize
    d, f, dh, hkv = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_kv_heads
    n = batch * width
    activations = n * (2 * d + 2 * f + 2 * cfg.num_heads * dh) * a
    out = n * cfg.vocab_size * 4 + activations + weight_workspace_bytes(cfg, platform)
    if uses_kernels(cfg.attention_impl, platform):
        return int(out)
    slots = cache_len + (ring_slots(group_size, gamma_max) if kv == "int8" else 0)
    scores = batch * hkv * width * cfg.n_rep * slots * 4
    per_key = batch * hkv * cache_len * dh
    if kv == "bf16":
        if _platform(platform) == "cpu" and a < 4 and batch > 1:  # XLA widens every layer's K and V at once
            return int(out + 2 * cfg.num_layers * per_key * 4 + scores)
        return int(out + per_key * (4 + a) + scores)
    planes = 2 if view == "target" else 1  # of the keys, and as many of the values
    values = 8 if dh >= 128 else 4  # wide heads: the values' int32 codes stay too (measured)
    return int(out + per_key * planes * (4 + values) + scores)


def cache_capacity(prompt_len: int, extra: int, group_size: int) -> int:
    """Cache length covering the padded prompt plus `extra` tokens, a multiple of group_size."""
    return int(math.ceil((prompt_len + extra) / group_size) * group_size)


def decode_cache_len(prompt_len: int, max_new_tokens: int, width: int, group_size: int, kv: str = "int8") -> int:
    """The cache length autoregressive and speculative generation both use: the padded prompt,
    every new token, and one pass of `width` columns past them, rounded up to the quantization
    group for the hierarchical cache (`kv` "int8") and to DEFAULT_GROUP_SIZE for a dense one,
    whose length must not depend on a group size it does not use. Both use this one formula
    (and the same ring size) so that, at the same width, their caches have the same geometry
    and the attention's reductions the same shapes."""
    return cache_capacity(prompt_len, max_new_tokens + width, group_size if kv == "int8" else DEFAULT_GROUP_SIZE)


@dataclasses.dataclass(frozen=True)
class Request:
    """What a generation (or a teacher-forced evaluation) asks of a device: `batch` rows, prompts
    padded to `prompt_len` tokens (the longest is `longest` before padding; None: unpadded),
    `new_tokens` decoded after them through a cache of `kv` kind ("bf16" dense, "int8"
    hierarchical) in passes of `width` columns.

    speculative: the draft's passes too (one column, over the `draft_view` of the cache), with
    `draft_weights` extra bytes of draft weights; sampling: the draft's logits are kept for
    speculative sampling; return_logits: the logits of every new token are returned; caches: how
    many caches of this size exist at once (a teacher-forced evaluation with a draft prefills a
    second); chunk: the prefill's chunk (`prefill_workspace_bytes`); prefill False: the cache is
    filled otherwise (benchmarks fill theirs with random data), cache_slots: its length then."""

    batch: int
    prompt_len: int
    new_tokens: int
    kv: str = "int8"
    width: int = DEFAULT_GAMMA_MAX + 1
    group_size: int = DEFAULT_GROUP_SIZE
    gamma_max: int = DEFAULT_GAMMA_MAX
    longest: int | None = None
    speculative: bool = False
    draft_view: str = "draft"
    draft_weights: int = 0
    sampling: bool = False
    return_logits: bool = False
    caches: int = 1
    chunk: int | None = None
    prefill: bool = True
    cache_slots: int | None = None

    @property
    def cache_len(self) -> int:
        """The cache's length: `decode_cache_len`, or cache_slots where it is not generation's."""
        if self.cache_slots is not None:
            return self.cache_slots
        return decode_cache_len(self.prompt_len, self.new_tokens, self.width, self.group_size, self.kv)

    def resized(self, **sizes: int) -> "Request":
        """This request with another batch, prompt_len or new_tokens (cache_slots, when set,
        grows or shrinks with the tokens)."""
        r = dataclasses.replace(self, **sizes, longest=None if "prompt_len" in sizes else self.longest)
        if self.cache_slots is None:
            return r
        grown = r.prompt_len + r.new_tokens - self.prompt_len - self.new_tokens
        unit = self.group_size if self.kv == "int8" else 1  # the hierarchical cache holds whole groups
        return dataclasses.replace(r, cache_slots=max(1, -(-(self.cache_slots + grown) // unit)) * unit)

    def describe(self) -> str:
        """'batch 4096 x (prompt 6 tokens, padded to 256, + 4000 new tokens), decoding over a dense
        bf16 KV cache'."""
        def count(n: int, what: str) -> str:
            return f"{n} {what}{'' if n == 1 else 's'}"

        prompt = (f"prompt {count(self.prompt_len, 'token')}" if self.longest in (None, self.prompt_len) else
                  f"prompt {count(self.longest, 'token')}, padded to {self.prompt_len},")
        kind = "a dense bf16" if self.kv == "bf16" else "an INT8"
        what = "speculative decoding" if self.speculative else "decoding"
        return f"batch {self.batch} x ({prompt} + {count(self.new_tokens, 'new token')}), {what} over {kind} KV cache"


def request_bytes(cfg: ModelConfig, request: Request, *, weights: int | None = None,
                  platform: str | None = None) -> dict[str, int]:
    """Bytes `request` needs on one device, by part: "weights" (`weights`, default the target's
    from its shapes, plus request.draft_weights), "cache" (the cache(s) at request.cache_len),
    "state" (the loop's token buffer and, with return_logits, its float32 logits), "prefill"
    and "step" (`prefill_workspace_bytes`, `step_workspace_bytes`: the target's pass at
    request.width and, speculative, the draft's one-column pass, its kept logits and the
    acceptance's probabilities) and "total" = weights + cache + state + max(prefill, step): the
    prefill's temporaries are gone when the loop's begin."""
    r = request
    kw: dict[str, Any] = dict(group_size=r.group_size, gamma_max=r.gamma_max) if r.kv == "int8" else {}
    cache = r.caches * sum(cache_bytes(r.kv, cfg, r.batch, r.cache_len, **kw).values())
    w = (_layer_weight_bytes(cfg)[0] if weights is None else int(weights)) + r.draft_weights
    state = r.batch * r.new_tokens * (4 + (cfg.vocab_size * 4 if r.return_logits else 0))
    geometry = dict(kv=r.kv, group_size=r.group_size, gamma_max=r.gamma_max, platform=platform)
    step = step_workspace_bytes(cfg, r.batch, r.width, r.cache_len, view="target", **geometry)
    if r.speculative:
        draft = step_workspace_bytes(cfg, r.batch, 1, r.cache_len, view=r.draft_view, **geometry)
        probs = r.batch * r.width * cfg.vocab_size * 4 * (3 if r.sampling else 0)  # p, q, residual
        step = max(step, draft) + probs
    prefill = prefill_workspace_bytes(cfg, r.batch, r.prompt_len, r.chunk, platform=platform) if r.prefill else 0
    return {"weights": int(w), "cache": int(cache), "state": int(state), "prefill": int(prefill),
            "step": int(step), "total": int(w + cache + state + max(prefill, step))}


def _largest(fits: Any, low: int, high: int) -> int:
    """The largest x in [low, high] with fits(x) (fits is monotone: true, then false); low - 1
    when none."""
    if high < low or not fits(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def check_request_fits(cfg: ModelConfig, request: Request, *, weights: int | None = None,
                       device_bytes: int | None = None, resident_bytes: int = 0, devices: int = 1,
                       platform: str | None = None) -> dict[str, int]:
    """`request_bytes(cfg, request)` if it fits this device, else DoesNotFitError (a ValueError)
    with one line: what was asked, the bytes needed by part, the bytes the device has, and what
    would fit (the largest batch; the most new tokens at this batch, or when not even one fits
    the longest padded prompt; the INT8 cache for a dense one; chunked prefill when the prompt's
    temporaries are what does not fit).

    device_bytes: default `device_memory_bytes()`. On a CPU, arrays already allocated are no
    longer in the available RAM: `resident_bytes` (the loaded weights, typically) are added back.
    devices: a tensor-parallel request spreads its weights and cache over this many devices of
    one accelerator kind (a CPU's devices share its RAM)."""
    plat = _platform(platform)
    avail = device_memory_bytes() if device_bytes is None else int(device_bytes)
    if plat == "cpu":
        avail += int(resident_bytes)
    share = 1 if plat == "cpu" else max(1, devices)

    def need(r: Request) -> dict[str, int]:
        return request_bytes(cfg, r, weights=weights, platform=platform)

    def fits(r: Request) -> bool:
        return need(r)["total"] / share <= avail

    parts = need(request)
    if parts["total"] / share <= avail:
        return parts
    r = request
    options = []
    batch = _largest(lambda b: fits(r.resized(batch=b)), 1, r.batch - 1)
    if batch >= 1:
        options.append(f"batch <= {batch}")
    new = _largest(lambda n: fits(r.resized(new_tokens=n)), 1, r.new_tokens - 1)
    if new >= 1:
        options.append(f"new tokens <= {new} at batch {r.batch}")
    else:  # a shorter prompt (as padded) with a single new token
        prompt = _largest(lambda p: fits(r.resized(prompt_len=p, new_tokens=1)), 1, r.prompt_len - 1)
        if prompt >= 1:
            options.append(f"prompts of <= {prompt} tokens (as padded) and 1 new token at batch {r.batch}")
    if r.kv == "bf16" and not r.speculative and fits(dataclasses.replace(r, kv="int8")):
        options.append("the INT8 KV cache (--kv int8; GenerationConfig(kv='int8'))")
    if r.chunk is None and parts["prefill"] > parts["step"] and \
            (parts["total"] - parts["prefill"] + parts["step"]) / share <= avail:
        options.append(f"a prefill in chunks (--prefill-chunk N; prefill_chunk=N in the configs: its "
                       f"temporaries, {format_bytes(parts['prefill'])} for the whole prompt at once, are what does "
                       "not fit)")
    fix = "; fits: " + ", or ".join(options) if options else "; nothing smaller of it fits either"
    raise DoesNotFitError(f"does not fit in memory: {r.describe()}, needs {_needs(parts)} and "
                          f"{_device_has(avail * share, plat, share)}{fix}",
                          needed=parts["total"], available=avail * share, parts=parts)


PART_NAMES = {"weights": "weights", "cache": "KV cache", "state": "output buffers"}


def _needs(parts: Mapping[str, int]) -> str:
    """'335 GB (weights 16.1 GB + KV cache 138 GB + temporaries 181 GB)': parts of 1% or more."""
    shown = [(PART_NAMES[k], parts[k]) for k in PART_NAMES] + [("temporaries", max(parts["prefill"], parts["step"]))]
    return f"{format_bytes(parts['total'])} (" + " + ".join(
        f"{name} {format_bytes(v)}" for name, v in shown if v >= parts["total"] / 100) + ")"


def _device_has(avail: int, platform: str, devices: int = 1) -> str:
    """'the NVIDIA H200 has 127 GB' / 'this machine has 23.2 GB of available RAM'."""
    if platform == "cpu":
        return f"this machine has {format_bytes(avail)} of available RAM"
    kind = getattr(jax.local_devices()[0], "device_kind", platform) if jax.default_backend() == platform else platform
    return f"{devices} x {kind} have {format_bytes(avail)}" if devices > 1 else f"the {kind} has {format_bytes(avail)}"


def out_of_memory_line(error: BaseException) -> str:
    """One line for XLA out of memory outside any request the planner knows (loading weights,
    making a draft): what XLA could not allocate and what this device has."""
    plat = jax.default_backend()
    return (f"does not fit in memory: XLA ran out of memory ({xla_reason(error)}) and "
            f"{_device_has(device_memory_bytes(), plat)}")


def _extra_bytes(params: M.Params, draft: M.Params | None) -> int:
    """Bytes of `draft`'s arrays that are not `params`' own (a draft shares the embedding, the
    norms and whatever it does not quantize)."""
    if draft is None:
        return 0
    own = {id(x) for x in jax.tree.leaves(params)}
    return tree_bytes([x for x in jax.tree.leaves(draft) if id(x) not in own])


def check_params_fit(params: M.Params, request: Request, *, draft: M.Params | None = None,
                     draft_bytes: int = 0) -> dict[str, int]:
    """`check_request_fits` for a request run with these weights, already loaded: their bytes
    (and those of `draft`, or `draft_bytes` of a draft still to be made) are the request's
    weights, resident on a CPU, and a tensor-parallel mesh spreads it over its devices."""
    extra = _extra_bytes(params, draft) if draft is not None else int(draft_bytes)
    weights = tree_bytes(params)
    resident = weights + (extra if draft is not None else 0)
    devices = params.mesh.size if params.mesh is not None else 1
    return check_request_fits(params.config, dataclasses.replace(request, draft_weights=extra), weights=weights,
                              resident_bytes=resident, devices=devices)


DEFAULT_PREFILL_CHUNK = 8192  # tokens per chunk of a prompt whose whole prefill does not fit (`prefill_chunk_for`)


def prefill_chunk_for(params: M.Params, request: Request, requested: int | str, *, draft: M.Params | None = None,
                      draft_bytes: int = 0) -> int | None:
    """The chunk `model.prefill` runs `request`'s padded prompts with (None: the whole prompt at
    once), for a generation config's `prefill_chunk`:

      "auto": the whole prompt when the request fits this device with it (`check_params_fit`,
        its prefill temporaries at the whole prompt), else DEFAULT_PREFILL_CHUNK (a prompt of at
        most that many tokens is always whole);
      "whole": None; an int C: C (None when the prompt has no more than C tokens).
    Whether the chosen prefill fits is `check_params_fit`'s to say, with the request's chunk set."""
    if requested == "whole":
        return None
    if requested != "auto":
        return int(requested) if int(requested) < request.prompt_len else None
    if request.prompt_len <= DEFAULT_PREFILL_CHUNK:
        return None
    try:
        check_params_fit(params, dataclasses.replace(request, chunk=None), draft=draft, draft_bytes=draft_bytes)
        return None
    except DoesNotFitError:
        return DEFAULT_PREFILL_CHUNK


def out_of_memory(params: M.Params, request: Request, error: BaseException, *,
                  draft: M.Params | None = None) -> OutOfMemoryError:
    """The OutOfMemoryError for XLA's `error` (`resource_exhausted`) while running `request`
    with `params`: one line like DoesNotFitError's, with XLA's reason and the estimate that let
    the request through."""
    extra = _extra_bytes(params, draft)
    parts = request_bytes(params.config, dataclasses.replace(request, draft_weights=extra),
                          weights=tree_bytes(params))
    avail = device_memory_bytes() + (tree_bytes(params) + extra if jax.default_backend() == "cpu" else 0)
    plat = jax.default_backend()
    return OutOfMemoryError(
        f"does not fit in memory: {request.describe()} ran out of memory ({xla_reason(error)}), where "
        f"{_needs(parts)} was estimated and {_device_has(avail, plat)}; fits: a smaller batch, prompt or number of "
        "new tokens", needed=parts["total"], available=avail, parts=parts)


def max_context(cfg: ModelConfig, kind: str, device_bytes: int, *, batch: int = 1,
                draft: DraftWeightsConfig | None = None, group_size: int = DEFAULT_GROUP_SIZE,
                gamma_max: int = DEFAULT_GAMMA_MAX, headroom_bytes: int = DEFAULT_HEADROOM_BYTES) -> dict[str, int]:
    """Longest context (a multiple of group_size) whose weights + cache + headroom fit.

    kind: "bf16" (dense cache, AR) or "int8" (hierarchical cache; with `draft`, the INT4 draft
    weights are counted too). Returns {"context", "weights", "cache", "total"} in tokens/bytes.
    """
    weights = sum(weight_bytes(cfg, draft).values())
    kw = dict(group_size=group_size, gamma_max=gamma_max) if kind == "int8" else {}
    per_block = sum(cache_bytes(kind, cfg, batch, 2 * group_size, **kw).values()) - \
        sum(cache_bytes(kind, cfg, batch, group_size, **kw).values())
    fixed = sum(cache_bytes(kind, cfg, batch, group_size, **kw).values()) - per_block
    room = device_bytes - headroom_bytes - weights - fixed
    blocks = max(0, room // per_block)
    context = int(blocks * group_size)
    cache = sum(cache_bytes(kind, cfg, batch, max(context, group_size), **kw).values())
    return {"context": context, "weights": int(weights), "cache": int(cache), "total": int(weights + cache)}


# ============================================================================ speed planning
@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Measured seconds per pass of each phase, for one model / device / context / batch.

    draft_s: one draft step (one token per row, draft weights, the draft's KV view);
    verify_s: one verify pass of `verify_width` columns (SpecConfig.verify_width: gamma_max + 1);
    ar_s: one autoregressive step (one column), the baseline speculative decoding must beat.
    """

    draft_s: float
    verify_s: float
    ar_s: float
    verify_width: int
    batch: int = 1
    source: str = ""  # where the numbers come from (a cache file and key, a JSON, "synthetic")

    def __post_init__(self) -> None:
        for name in ("draft_s", "verify_s", "ar_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"StepCosts.{name}={v!r}: expected a positive number of seconds")
        if self.verify_width < 2 or self.batch < 1:
            raise ValueError(f"StepCosts: verify_width={self.verify_width} must be >= 2 and batch={self.batch} >= 1")

    def round_s(self, draft_steps: float) -> float:
        """Seconds of one round with `draft_steps` draft steps and one verify pass."""
        return draft_steps * self.draft_s + self.verify_s

    @property
    def ar_tokens_per_s(self) -> float:
        return self.batch / self.ar_s


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[tokens/round] = (1 - alpha^(gamma+1)) / (1 - alpha) (= gamma + 1 at alpha = 1): the
    accepted drafts (leading successes of gamma Bernoulli(alpha) trials) plus the correction or
    bonus token."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha}: expected a per-position acceptance probability in [0, 1]")
    return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One setting the planner weighed: `spec` None is autoregressive decoding."""

    label: str
    spec: Any  # SpecConfig | None
    tokens_per_round: float
    draft_steps: float  # mean draft-model steps per round
    tokens_per_s: float  # predicted, all rows together
    measured: bool  # tokens_per_round measured (True) or from the alpha model (False)


@dataclasses.dataclass(frozen=True)
class GammaPlan:
    """The planner's answer: `spec` to pass to `speculative.generate`, or None when
    autoregressive decoding is predicted at least as fast as every candidate."""

    spec: Any  # SpecConfig | None
    best: Candidate  # the fastest speculative candidate (chosen or not)
    candidates: tuple[Candidate, ...]  # every candidate, fastest first
    ar_tokens_per_s: float
    costs: StepCosts
    alpha: float | None
    alpha_trials: int | None = None  # verified drafts the alpha estimate rests on (None: given)

    @property
    def speedup(self) -> float:
        """Predicted speedup of the best speculative candidate over autoregressive decoding."""
        return self.best.tokens_per_s / self.ar_tokens_per_s

    def summary(self) -> str:
        """One line: what was chosen and why."""
        a = "" if self.alpha is None else f", alpha {self.alpha:.3f}" + (
            "" if self.alpha_trials is None else f" (measured over {self.alpha_trials} verified drafts)")
        if self.spec is None:
            return (f"no draft length is predicted faster than autoregressive decoding (best: {self.best.label}, "
                    f"{self.speedup:.2f}x of AR's {self.ar_tokens_per_s:.1f} tokens/s{a}); decoding autoregressively")
        return (f"{self.best.label}: predicted {self.best.tokens_per_s:.1f} tokens/s, {self.speedup:.2f}x "
                f"autoregressive ({self.ar_tokens_per_s:.1f} tokens/s){a}")


def _candidate(label: str, spec: Any, tpr: float, steps: float, costs: StepCosts, measured: bool) -> Candidate:
    return Candidate(label, spec, float(tpr), float(steps), costs.batch * tpr / costs.round_s(steps), measured)


def policy_label(spec: Any) -> str:
    """"gamma=4"; "bass 4..8 (+1, /4)" for BASS from 4 up to 8 with bass_increment 1, bass_mod 4."""
    if spec.draft_policy == "fixed":
        return f"gamma={spec.gamma}"
    tail = f" (+{spec.bass_increment}, /{spec.bass_mod})" if spec.draft_policy == "bass" else ""
    return f"{spec.draft_policy} {spec.gamma}..{spec.max_draft}{tail}"


def plan_gamma(costs: StepCosts, base: Any, alpha: float | None = None, *,
               measured: Mapping[Any, tuple[float, float]] | None = None, alpha_trials: int | None = None,
               min_speedup: float = 1.0) -> GammaPlan:
    """Picks the setting with the highest predicted tokens/s.

    base: the SpecConfig whose other fields (sampling, draft format, gamma_max) the plan keeps.
    alpha: per-position acceptance probability; every fixed gamma 1..base.gamma_max becomes a
    candidate with E[tokens/round](alpha, gamma) and gamma draft steps. measured: {SpecConfig:
    (tokens per round, mean draft steps per round)} from real runs (any policy). A candidate is
    chosen only if its predicted tokens/s exceeds min_speedup x autoregressive decoding's
    (costs.ar_s); otherwise the plan's spec is None: decode autoregressively.
    """
    if not base.exact:
        raise ValueError("plan_gamma: base.exact=False: the planner plans exact speculative decoding (the verify "
                         "pass at gamma_max + 1 columns, whose cost StepCosts.verify_s is)")
    if costs.verify_width != base.verify_width:
        raise ValueError(f"plan_gamma: the step costs were measured with verify passes of {costs.verify_width} "
                         f"columns; this SpecConfig verifies {base.verify_width} (gamma_max={base.gamma_max}): "
                         "measure the costs for it")
    if alpha is None and not measured:
        raise ValueError("plan_gamma: give alpha (per-position acceptance) or measured tokens/round, or both")
    if min_speedup <= 0:
        raise ValueError(f"plan_gamma: min_speedup={min_speedup} must be > 0")
    cands = []
    if alpha is not None:
        for g in range(1, base.gamma_max + 1):
            spec = dataclasses.replace(base, gamma=g, draft_policy="fixed", draft_limit=None)
            cands.append(_candidate(policy_label(spec), spec, expected_tokens_per_round(alpha, g), g, costs, False))
    for spec, (tpr, steps) in (measured or {}).items():
        if not (tpr >= 1 and 0 <= steps <= spec.max_draft):
            raise ValueError(f"plan_gamma: measured {policy_label(spec)}: tokens/round {tpr} must be >= 1 and draft "
                             f"steps {steps} in 0..{spec.max_draft}")
        cands.append(_candidate(policy_label(spec) + " (measured)", spec, tpr, steps, costs, True))
    cands.sort(key=lambda c: -c.tokens_per_s)
    best = cands[0]
    wins = best.tokens_per_s > min_speedup * costs.ar_tokens_per_s
    return GammaPlan(spec=best.spec if wins else None, best=best, candidates=tuple(cands),
                     ar_tokens_per_s=costs.ar_tokens_per_s, costs=costs, alpha=alpha, alpha_trials=alpha_trials)


# ------------------------------------------------------------------ measuring the step costs
def default_cost_cache() -> Path:
    """~/.cache/qspec-jax/step_costs.json (XDG_CACHE_HOME honoured: `compilation.user_cache_dir`)."""
    return user_cache_dir() / "step_costs.json"


def context_bucket(context: int) -> int:
    """The power of two nearest `context` in log scale (at least MIN_CONTEXT_BUCKET): costs are
    measured, and cached, at that context."""
    if context < 1:
        raise ValueError(f"context={context} must be >= 1")
    return max(MIN_CONTEXT_BUCKET, 2 ** int(round(math.log2(context))))


def _digest(obj: Any) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cost_key(cfg: ModelConfig, spec: Any, bucket: int, batch: int) -> str:
    """The cache key: model (its config, compute dtype and attention implementation included),
    draft (weights format and KV view), target KV, verify width, device, jax version, context
    bucket and batch."""
    draft = "bf16" if spec.draft_weights == "bf16" else spec.draft_weights_config.to_dict()
    dev = jax.devices()[0]
    device = f"{getattr(dev, 'device_kind', dev.platform)} x{jax.device_count()}"
    model = _digest(cfg.to_dict())
    what = _digest({"draft": draft, "draft_kv": spec.draft_kv, "target_kv": spec.target_kv,
                    "group": spec.group_size, "width": spec.verify_width})
    return f"model {model} | draft {what} | {device} | jax {jax.__version__} | ctx {bucket} | batch {batch}"


def _read_cost_cache(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"format": COST_CACHE_FORMAT, "entries": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"step-cost cache {path}: not readable JSON ({e}); delete it to measure again") from e
    if not isinstance(data, dict) or data.get("format") != COST_CACHE_FORMAT or not isinstance(data.get("entries"), dict):
        raise ValueError(f"step-cost cache {path}: expected {{'format': {COST_CACHE_FORMAT}, 'entries': {{...}}}}; "
                         "delete it to measure again")
    return data


def _write_cost_cache(path: Path, data: dict[str, Any]) -> None:
    """Writes the cache atomically (a temporary file beside it, renamed over it: a concurrent
    reader sees the old file or the new one). An OSError names `path`, never the temporary
    file, which is removed."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


@functools.partial(jax.jit, static_argnames=("n", "view", "width"))
def _passes(params: M.Params, cache: Any, toks: jax.Array, *, n: int, view: str, width: int) -> tuple[jax.Array, Any]:
    """n decode passes of toks [B, T] at `width` columns and a fixed context (rolled back after
    each); each pass's argmax feeds the next, so no pass can be hoisted."""
    committed = cache.total_lengths()

    def body(_, carry):
        toks, cache = carry
        logits, cache = M.decode(params, toks, cache, view=view, width=width)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache.rollback(committed)

    return jax.lax.fori_loop(0, n, body, (toks, cache))


def time_passes(params: M.Params, cache: Any, t: int, *, view: str, width: int, steps: int, trials: int) -> float:
    """Median seconds per decode pass of t tokens per row (SPEC §7: repetitions inside one
    jitted loop, median of trials; the first call compiles and is not timed)."""
    toks = jnp.full((cache.total_lengths().shape[0], t), 7, jnp.int32)
    run, _ = programs().compiled(_passes, (params, cache, toks), dict(n=steps, view=view, width=width))
    jax.block_until_ready(run(params, cache, toks))
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(run(params, cache, toks))
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def measure_step_costs(model: Any, spec: Any, *, context: int, batch: int = 1, draft_params: M.Params | None = None,
                       path: Path | str | None = None, refresh: bool = False, steps: int = 8, trials: int = 5,
                       progress: bool = True) -> StepCosts:
    """Per-phase step costs of `model` on this device at context_bucket(context) and `batch`:
    read from the JSON cache at `path` (default_cost_cache()) or, when missing or `refresh`,
    measured and stored there.

    Measured over caches holding a prefill of random tokens (a model with fewer positions than the
    bucket: its longest power of two): the draft step (draft weights,
    spec's draft view, one token), the verify pass (target, spec.verify_width columns) and the
    autoregressive step (target, one column) over a dense bf16 cache and over the INT8 cache;
    ar_s is the faster of the two, the baseline speculative decoding must beat.
    """
    from qspec_jax.generation import new_cache
    from qspec_jax.speculative import draft_params_for

    cfg = model.params.config
    width = spec.verify_width
    room = cfg.max_position_embeddings - 2 * width  # the passes timed go past the context
    if room < 1:
        raise ValueError(f"max_position_embeddings={cfg.max_position_embeddings} leaves no context for passes of "
                         f"{width} columns")
    bucket = min(context_bucket(context), 2 ** int(math.log2(room)))  # a short model: its longest power of two
    path = Path(path) if path is not None else default_cost_cache()
    key = cost_key(cfg, spec, bucket, batch)
    data = _read_cost_cache(path)
    hit = data["entries"].get(key)
    if hit is not None and not refresh:
        return StepCosts(hit["draft_s"], hit["verify_s"], hit["ar_s"], hit["verify_width"], hit["batch"],
                         source=f"{path} [{key}]")
    draft = draft_params if draft_params is not None else draft_params_for(model, spec)
    draft = draft.replace(config=cfg)
    max_len = -(-(bucket + 2 * width) // spec.group_size) * spec.group_size
    toks = jax.random.randint(jax.random.PRNGKey(0), (batch, bucket), 1, cfg.vocab_size, jnp.int32)
    lengths = jnp.full((batch,), bucket, jnp.int32)
    def filled(kind: str) -> Any:
        cache = new_cache(cfg, kind, batch, max_len, spec.group_size, spec.gamma_max, mesh=model.params.mesh)
        return run_program(M.prefill, (model.params, toks, lengths, cache), {})[1]

    timed = dict(steps=steps, trials=trials)
    say = (lambda m: print(f"[planner] {m}", file=sys.stderr, flush=True)) if progress else (lambda m: None)  # noqa: E731
    t0 = time.perf_counter()
    say(f"measuring step costs at context {bucket}, batch {batch} (cached in {path})")
    spec_cache = filled(spec.target_kv)
    out: dict[str, Any] = {
        "draft_s": time_passes(draft, spec_cache, 1, view=spec.draft_view, width=1, **timed),
        "verify_s": time_passes(model.params, spec_cache, width, view="target", width=width, **timed)}
    say(f"draft step {out['draft_s'] * 1e3:.2f} ms, verify ({width} columns) {out['verify_s'] * 1e3:.2f} ms")
    for kind in ("bf16", "int8"):
        cache = spec_cache if kind == spec.target_kv else filled(kind)
        out[f"ar_{kind}_s"] = time_passes(model.params, cache, 1, view="target", width=1, **timed)
        del cache
    del spec_cache
    out["ar_s"] = min(out["ar_bf16_s"], out["ar_int8_s"])
    say(f"autoregressive step {out['ar_s'] * 1e3:.2f} ms (bf16 KV {out['ar_bf16_s'] * 1e3:.2f}, INT8 KV "
        f"{out['ar_int8_s'] * 1e3:.2f}); {time.perf_counter() - t0:.0f} s")
    out.update(verify_width=width, batch=batch, context=bucket, jax=jax.__version__,
               device=getattr(jax.devices()[0], "device_kind", jax.devices()[0].platform),
               date=datetime.date.today().isoformat(), steps=steps, trials=trials)
    data = _read_cost_cache(path)  # re-read: another process may have added entries meanwhile
    data["entries"][key] = out
    _write_cost_cache(path, data)
    return StepCosts(out["draft_s"], out["verify_s"], out["ar_s"], width, batch, source=f"{path} [{key}] (measured)")


def estimate_alpha(model: Any, prompt_ids: Sequence[Sequence[int]] | np.ndarray, spec: Any, *, new_tokens: int = 32,
                   draft_params: M.Params | None = None, key: jax.Array | None = None) -> tuple[float, int]:
    """A short speculative calibration run (`new_tokens` per prompt at spec's gamma and sampling
    settings, fixed policy): (alpha, verified drafts it rests on), alpha =
    SpecResult.alpha_estimate."""
    from qspec_jax.speculative import generate

    cal = dataclasses.replace(spec, max_new_tokens=new_tokens, draft_policy="fixed", draft_limit=None,
                              return_logits=False)
    res = generate(model, prompt_ids, cal, key, draft_params=draft_params)
    return res.alpha_estimate, int(np.sum(res.accepted) + np.sum(res.rejected))


def plan(model: Any, prompt_ids: Sequence[Sequence[int]] | np.ndarray, base: Any = None, *,
         alpha: float | None = None, costs: StepCosts | None = None, draft_params: M.Params | None = None,
         cost_cache: Path | str | None = None, calibration_tokens: int = 32, refresh: bool = False,
         progress: bool = True) -> GammaPlan:
    """Chooses gamma for generating from `prompt_ids` with `base`'s other settings.

    Step costs: `costs`, else measured on this device at the decoding context (prompt + half the
    new tokens, bucketed) and batch, cached in `cost_cache`. alpha: given, else measured by a
    short speculative run on the prompts (`calibration_tokens` per prompt). Returns a GammaPlan:
    `plan.spec` is the SpecConfig for `speculative.generate`, or None: decode autoregressively.
    Generating from the prompts with `base` must fit this device (DoesNotFitError otherwise,
    before anything is measured).
    """
    from qspec_jax.generation import pad_prompts
    from qspec_jax.speculative import SpecConfig, check_memory

    base = SpecConfig() if base is None else base
    tokens, lengths = pad_prompts(prompt_ids, model.params.config.vocab_size)
    check_memory(model, base, tokens.shape, int(lengths.max()), draft_params)  # before anything is measured
    if costs is None:
        context = int(lengths.max()) + base.max_new_tokens // 2
        costs = measure_step_costs(model, base, context=context, batch=len(lengths), draft_params=draft_params,
                                   path=cost_cache, refresh=refresh, progress=progress)
    trials = None
    if alpha is None:
        alpha, trials = estimate_alpha(model, prompt_ids, base, new_tokens=calibration_tokens,
                                       draft_params=draft_params)
    return plan_gamma(costs, base, alpha, alpha_trials=trials)
