"""Autoregressive generation in one jitted `lax.while_loop`, and the pieces generation shares.

Prompts are right-padded into a [B, T] batch with per-row lengths; every row stops on its own
(EOS or max_new_tokens) while shapes stay fixed. Emitted tokens past a row's length are
`PAD_ID`.

Length buckets. T is the longest prompt rounded up to `length_bucket`'s ladder (256, 384, 512,
768, ..., 4096, then steps of 1.25x), and the cache length follows from T, so a process that
sees many prompt lengths compiles one program per ladder step: the number of programs grows
with the log of the lengths (9 for any lengths up to 4096). Padding costs prefill compute on
the padded tokens and cache memory for them (at most 1.5x up to 4096 tokens, 1.25x beyond;
docs/BENCHMARKS.md, "Compile time, length buckets, streaming"). The padding never reaches a
valid token's attention (masks by position), but shapes decide how XLA and the GPU libraries sum (see `model.decode`),
so a logit may differ in its last bits from a run at other shapes; speculative and
autoregressive generation bucket alike, so greedy speculative output stays the target's own,
bit for bit.

Streaming. `on_tokens` runs the same loop in chunks of rounds (`stream_chunks`): one program
prefills and returns the loop's state, another runs at most k rounds from a state, and the
driver hands each chunk's new tokens to the caller while the next chunk runs. Chunks of 1, 2, 4
rounds first; then as many rounds as keep a chunk's fixed cost under 2% of its time
(`chunk_rounds`): on a GPU a round or a few, on a CPU with bfloat16 weights ~20 (XLA converts the
weights to float32 once per program run). Both programs can go to the persistent compilation
cache (a per-round host callback inside one program would forbid that), and a caller can stop
between chunks (Ctrl-C in qspec-generate).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qspec_jax import model as M
from qspec_jax.cache import DEFAULT_GAMMA_MAX, DEFAULT_GROUP_SIZE, DenseKVCache, QuantSpecCache
from qspec_jax.compilation import programs, run_program
from qspec_jax.planner import (Request, check_params_fit, decode_cache_len, out_of_memory, prefill_chunk_for,
                               resource_exhausted)
from qspec_jax.sampling import SamplingConfig, sample
from qspec_jax.sharding import constrain_cache

Array = jax.Array
KV_KINDS = ("bf16", "int8")
# Length buckets (module docstring): prompts are padded to at least MIN_LENGTH_BUCKET tokens, then
# to 2 ladder steps per octave (x1, x1.5) below FINE_BUCKETS_FROM and 4 (x1, x1.25, x1.5, x1.75) from it.
MIN_LENGTH_BUCKET = 256
FINE_BUCKETS_FROM = 4096
PAD_ID = 0


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Static settings of autoregressive generation.

    kv: "bf16" keeps a dense cache in the model dtype; "int8" uses the hierarchical cache with
    the target view and the FP-ring protocol of SPEC §4 (prefill placement, append, flush).
    eos_token_ids None means the model's own.

    width: token columns of each decode pass (`model.decode`'s `width`). The default,
    DEFAULT_GAMMA_MAX + 1, is the width of speculative verification with the default
    SpecConfig.gamma_max, so this decoding computes bit for bit what speculative decoding's
    target computes and greedy outputs are identical (set width = SpecConfig.gamma_max + 1 if
    you change gamma_max). width=1 is the fastest autoregressive decoding (the benchmarks'
    baseline); its logits can differ from the speculative target's in the last bf16 bit, since
    matmul libraries sum in another order for another shape.
    return_logits: also return the float32 logits each emitted token was chosen from.
    prefill_chunk: how the prompt is prefilled (`planner.prefill_chunk_for`): "auto" (the whole
    prompt when its temporaries fit in the device's free memory, else chunks of
    planner.DEFAULT_PREFILL_CHUNK tokens), "whole", or a chunk size (a multiple of group_size).
    prefill_progress: report the prefill's progress on stderr as it runs (`model.prefill`'s
    progress; the CLIs turn it on for long prompts).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_ids: tuple[int, ...] | None = None
    kv: str = "bf16"
    group_size: int = DEFAULT_GROUP_SIZE
    width: int = DEFAULT_GAMMA_MAX + 1
    return_logits: bool = False
    prefill_chunk: int | str = "auto"
    prefill_progress: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        check_prefill_chunk(self.prefill_chunk, self.group_size if self.kv == "int8" else 1)
        if self.kv not in KV_KINDS:
            raise ValueError(f"kv={self.kv!r}; expected one of {KV_KINDS}")
        if self.width < 1:
            raise ValueError(f"width={self.width} must be >= 1")
        if self.kv == "int8" and self.width - 1 >= self.group_size:
            raise ValueError(f"width={self.width} must be <= group_size={self.group_size} (SPEC §4 flush)")
        self.sampling  # validates the sampling fields

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    def memory_request(self, batch: int, prompt_len: int, longest: int | None = None) -> Request:
        """What generating with these settings from `batch` prompts padded to `prompt_len` tokens
        (the longest `longest` before padding) asks of a device (`planner.request_bytes`)."""
        return Request(batch, prompt_len, self.max_new_tokens, kv=self.kv, width=self.width, group_size=self.group_size,
                       gamma_max=ring_gamma_max(self.width), longest=longest, return_logits=self.return_logits)


@struct.dataclass
class GenerationResult:
    """tokens: int32[B, max_new_tokens] (PAD_ID past each row's length); lengths: int32[B];
    logits: float32[B, max_new_tokens, V] that each token was chosen from (zeros past each
    row's length), or None unless GenerationConfig.return_logits."""

    tokens: Array
    lengths: Array
    logits: Array | None = None

    def to_lists(self) -> list[list[int]]:
        toks, lens = np.asarray(self.tokens), np.asarray(self.lengths)
        return [toks[b, : lens[b]].tolist() for b in range(toks.shape[0])]


# ----------------------------------------------------------------------------------- prompts
def length_bucket(n: int) -> int:
    """The padded length of a batch whose longest prompt has `n` tokens: the smallest ladder step
    >= n. The ladder is MIN_LENGTH_BUCKET (256), then for n in (2^k, 2^(k+1)] the multiples of
    2^k / 2 (384, 512, 768, 1024, 1536, ...) below FINE_BUCKETS_FROM (4096) and of 2^k / 4 from
    it on (5120, 6144, 7168, 8192, 10240, ...): padding is at most 1.5x, and 1.25x for long
    prompts, and lengths 1..4096 fall into 9 buckets."""
    if n < 1:
        raise ValueError(f"length_bucket: n={n} must be >= 1")
    if n <= MIN_LENGTH_BUCKET:
        return MIN_LENGTH_BUCKET
    low = 1 << ((n - 1).bit_length() - 1)  # 2^k < n <= 2^(k+1)
    unit = low // (2 if low < FINE_BUCKETS_FROM else 4)
    return -(-n // unit) * unit


def pad_prompts(prompt_ids: Sequence[Sequence[int]] | np.ndarray, vocab_size: int,
                bucket: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts into (tokens int32[B, T], lengths int32[B]).

    T is `length_bucket` of the longest prompt, or with `bucket` the longest prompt rounded up to
    a multiple of `bucket` (1: no padding past the longest prompt). Accepts a list of token
    lists, one token list, or a 2-D array of equal-length prompts.
    """
    if isinstance(prompt_ids, np.ndarray | jax.Array):
        arr = np.asarray(prompt_ids)
        rows = [arr] if arr.ndim == 1 else list(arr)
    else:
        rows = list(prompt_ids)
        if rows and all(isinstance(t, (int, np.integer)) for t in rows):
            rows = [rows]
    if not rows:
        raise ValueError("prompt_ids is empty: expected at least one prompt")
    lengths = np.array([len(r) for r in rows], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"prompt {int(np.argmin(lengths))} is empty: every prompt needs >= 1 token")
    longest = int(lengths.max())
    if bucket is not None and bucket < 1:
        raise ValueError(f"bucket={bucket} must be >= 1 (or None: length_bucket)")
    t = length_bucket(longest) if bucket is None else int(math.ceil(longest / bucket) * bucket)
    tokens = np.full((len(rows), t), PAD_ID, np.int32)
    for b, r in enumerate(rows):
        ids = np.asarray(r, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"prompt {b} has shape {ids.shape}; expected a flat list of token ids")
        if (ids < 0).any() or (ids >= vocab_size).any():
            raise ValueError(f"prompt {b} has token ids outside [0, {vocab_size})")
        tokens[b, : len(ids)] = ids
    return tokens, lengths


def check_fits(cfg: M.ModelConfig, lengths: np.ndarray, new_tokens: int) -> None:
    """Refuses prompts that would run past the model's max positions."""
    need = int(lengths.max()) + new_tokens
    if need > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {int(lengths.max())} tokens + {new_tokens} new tokens = {need} exceeds the "
            f"model's max_position_embeddings={cfg.max_position_embeddings}")


def checked_request(params: M.Params, config: GenerationConfig, shape: tuple[int, int], longest: int) -> Request:
    """What `generate_autoregressive` with `config` from prompts padded to `shape` = (batch,
    tokens) asks of this device, its `chunk` the prefill's (`planner.prefill_chunk_for`);
    `planner.DoesNotFitError` (a ValueError) when it does not fit, before anything is compiled."""
    request = config.memory_request(*shape, longest=longest)
    request = dataclasses.replace(request, chunk=prefill_chunk_for(params, request, config.prefill_chunk))
    check_params_fit(params, request)
    return request


def check_prefill_chunk(chunk: Any, group_size: int) -> None:
    """A config's prefill_chunk: "auto", "whole" or a positive multiple of the cache's group size."""
    if chunk in ("auto", "whole"):
        return
    if not isinstance(chunk, (int, np.integer)) or isinstance(chunk, bool) or chunk < 1 or chunk % group_size:
        raise ValueError(f"prefill_chunk={chunk!r}: expected 'auto', 'whole' or a positive multiple of the cache's "
                         f"group size {group_size}")


def eos_array(eos_ids: tuple[int, ...]) -> Array:
    return jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)


def ring_gamma_max(width: int) -> int:
    """The hierarchical cache's gamma_max for passes of `width` columns (its ring holds 2G +
    gamma_max slots); speculative decoding uses width = gamma_max + 1, so at equal width both
    get the same ring."""
    return max(1, width - 1)


def new_cache(cfg: M.ModelConfig, kind: str, batch: int, max_len: int, group_size: int,
              gamma_max: int = 1, scale_dtype: Any = jnp.float16, mesh: Any = None) -> DenseKVCache | QuantSpecCache:
    """An empty cache: "bf16" dense (in the model dtype) or "int8" hierarchical; with a
    tensor-parallel `mesh`, laid out along KV heads."""
    if kind == "bf16":
        cache = DenseKVCache.init(cfg, batch, max_len)
    else:
        cache = QuantSpecCache.init(cfg, batch, max_len, group_size=group_size, gamma_max=gamma_max,
                                    scale_dtype=scale_dtype)
    return constrain_cache(cache, mesh)


def prng_key(key: Any, fn: str) -> Array:
    """`key` checked to be a JAX PRNG key (jax.random.PRNGKey(seed), uint32[2], or a typed
    jax.random.key(seed)); jax.random.PRNGKey(0) for None. A TypeError naming `fn` otherwise:
    an int seed would otherwise fail deep inside the jitted program."""
    if key is None:
        return jax.random.PRNGKey(0)
    if isinstance(key, (jax.Array, np.ndarray)):
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
            return key
        if key.shape == (2,) and key.dtype == jnp.uint32:
            return jnp.asarray(key)
    what = f"{type(key).__name__} {key!r}" if not hasattr(key, "shape") else f"{key.dtype}{list(key.shape)}"
    raise TypeError(f"{fn}: key must be a JAX PRNG key such as jax.random.PRNGKey(0), got {what}")


@struct.dataclass
class Progress:
    """What each program of a streamed run hands the host besides the loop state (copies, so the
    state can be donated to the next chunk): tokens int32[B, N], num_emitted int32[B], done bool[B]."""

    tokens: Array
    num_emitted: Array
    done: Array


def progress_of(state: Any) -> Progress:
    return Progress(tokens=state.tokens, num_emitted=state.num_emitted, done=state.done)


def loop_rounds(cond: Callable[[Any], Array], body: Callable[[Any], Any], state: Any,
                max_rounds: Array | None = None) -> Any:
    """`lax.while_loop(cond, body, state)`, stopped after `max_rounds` iterations (a traced int32
    scalar) when given: the streamed run's chunks. The body is the same either way."""
    if max_rounds is None:
        return jax.lax.while_loop(cond, body, state)
    _, s = jax.lax.while_loop(lambda c: (c[0] < max_rounds) & cond(c[1]), lambda c: (c[0] + 1, body(c[1])),
                              (jnp.int32(0), state))
    return s


# Streamed runs (stream_chunks): the first chunks run 1, 2 and 4 rounds; from then on each runs as
# many rounds as keep the fixed cost of a chunk below STREAM_OVERHEAD of its time, at most
# STREAM_MAX_ROUNDS.
STREAM_FIRST_ROUNDS = (1, 2, 4)
STREAM_OVERHEAD = 0.02
STREAM_MAX_ROUNDS = 1024


def chunk_rounds(history: Sequence[tuple[int, float]], previous: int) -> int:
    """Rounds of the next chunk of a streamed run, from the (rounds asked, seconds taken) of the
    chunks so far: the least-squares fit seconds = a + b * rounds gives a chunk's fixed cost a
    (what a program run costs besides its rounds: on a CPU, XLA converts every bf16 weight to
    float32 once per run, hoisted out of the loop; 0.45 rounds of SmolLM2) and a round's cost b;
    the next chunk runs the fewest rounds k with a / (a + b k) <= STREAM_OVERHEAD. Before two
    chunk lengths are known (or when the fit is noise), twice the previous length."""
    ks = np.asarray([k for k, _ in history], np.float64)
    if len(np.unique(ks)) < 2:
        return min(2 * previous, STREAM_MAX_ROUNDS)
    b, a = np.polyfit(ks, np.asarray([d for _, d in history], np.float64), 1)
    if not b > 0:
        return min(2 * previous, STREAM_MAX_ROUNDS)
    k = math.ceil(max(a, 0.0) * (1 - STREAM_OVERHEAD) / (STREAM_OVERHEAD * b))
    return int(min(max(k, 1), STREAM_MAX_ROUNDS))


def stream_chunks(start_fn: Callable, start_args: tuple, start_static: dict[str, Any], rounds_fn: Callable,
                  weights: tuple, rounds_static: dict[str, Any],
                  timings: dict[str, float] | None = None) -> Iterator[list[list[int]]]:
    """Runs a generation in chunks of rounds and yields each row's new tokens as they commit.

    `start_fn(*start_args, **start_static)` prefills and returns (loop state, Progress);
    `rounds_fn(*weights, state, max_rounds, **rounds_static)` runs at most max_rounds rounds from
    a state (which it is donated) and returns the same pair. Chunks run STREAM_FIRST_ROUNDS, then
    `chunk_rounds` of the times measured so far; each is dispatched before the previous chunk's
    tokens are read, so the device does not wait for the host (and a chunk's time is the time
    between two reads). Yields a list per row of the token ids committed since the last yield
    (the first yield holds the token sampled from the prefill); returns (StopIteration.value)
    the final loop state. Both programs are compiled before either runs; `timings` gets
    "compile_s" and "run_s" as `compilation.run_program` records them.
    """
    t0 = time.perf_counter()
    start, _ = programs().compiled(start_fn, start_args, start_static)
    state_info = start.out_info[0]
    rounds, _ = programs().compiled(rounds_fn, (*weights, state_info, jnp.int32(1)), rounds_static,
                                    donate_argnums=(len(weights),))
    t1 = time.perf_counter()
    # The prefill's outputs are waited for once, before the first chunk is queued behind them: on
    # a CPU, a prefill that fails (XLA out of memory) with a chunk queued on its donated state
    # never completes, and reading its tokens would wait forever (jaxlib 0.10.2, measured).
    state, progress = jax.block_until_ready(start(*start_args))
    emitted = None
    asked: list[int] = []  # rounds asked of each chunk dispatched
    history: list[tuple[int, float]] = []  # (rounds asked, seconds) of each chunk read
    last_read = None
    while True:
        k = STREAM_FIRST_ROUNDS[len(asked)] if len(asked) < len(STREAM_FIRST_ROUNDS) else chunk_rounds(history, asked[-1])
        nxt = rounds(*weights, state, jnp.int32(k))  # queued behind the program that makes `state`
        asked.append(k)
        tokens, num, done = (np.asarray(x) for x in (progress.tokens, progress.num_emitted, progress.done))
        now = time.perf_counter()
        if last_read is not None:  # the chunk just read ran between the two reads
            history.append((asked[len(history)], now - last_read))
        last_read = now
        if emitted is None:
            emitted = np.zeros_like(num)
        chunk = [tokens[b, emitted[b]: num[b]].tolist() for b in range(len(num))]
        emitted = num
        state, progress = nxt
        if any(chunk):
            yield chunk
        if done.all():  # `nxt` ran no round: its state is the final one
            break
    if timings is not None:
        jax.block_until_ready(state)
        timings.update(compile_s=t1 - t0, run_s=time.perf_counter() - t1)
    return state


def run_generation(whole_fn: Callable, start_fn: Callable, rounds_fn: Callable, weights: tuple, inputs: tuple,
                   static: dict[str, Any], rounds_static: dict[str, Any], result_of: Callable[[Any], Any],
                   timings: dict[str, float] | None,
                   on_tokens: Callable[[list[list[int]]], None] | None, time_prefill: bool = False) -> Any:
    """Runs a generation: `whole_fn(*weights, *inputs, **static)` in one program, or, with
    `on_tokens`, the chunked `stream_chunks(start_fn, ..., rounds_fn, ...)`, calling
    `on_tokens(new tokens per row)` for each chunk in this thread; returns `result_of(state)` then.

    time_prefill (with `timings`, without `on_tokens`): before the whole program, run
    `start_fn` (the same prefill, no decoding) alone once and record its seconds as
    timings["prefill_s"], so that a benchmark can report decoding alone as run_s - prefill_s
    (the prefill runs twice: for measurement only)."""
    if time_prefill and (timings is None or on_tokens is not None):
        raise ValueError("time_prefill: needs a `timings` dict and no `on_tokens` (it times the whole program)")
    if on_tokens is None:
        prefill: dict[str, float] = {}
        if time_prefill:  # the prefilled state is dropped before the whole program runs
            run_program(start_fn, (*weights, *inputs), static, prefill)
        out = run_program(whole_fn, (*weights, *inputs), static, timings)
        if time_prefill:
            timings["prefill_s"] = prefill["run_s"]
        return out
    chunks = stream_chunks(start_fn, (*weights, *inputs), static, rounds_fn, weights, rounds_static, timings)
    while True:
        try:
            chunk = next(chunks)
        except StopIteration as stop:
            return result_of(stop.value)
        on_tokens(chunk)


# ------------------------------------------------------------------------------ AR decoding
@struct.dataclass
class _ARState:
    tokens: Array  # int32[B, N]
    num_emitted: Array  # int32[B]
    done: Array  # bool[B]
    cache: Any
    key: Array
    step: Array  # int32[]
    logits: Array | None  # float32[B, N, V] with return_logits


def record_logits(buf: Array | None, cols: Array, rows: Array) -> Array | None:
    """Writes rows [B, n, V] into buf [B, N, V] at columns cols int32[B, n] (>= N are dropped)."""
    if buf is None:
        return None
    return buf.at[jnp.arange(buf.shape[0])[:, None], cols].set(rows, mode="drop")


def initial_logits(logits: Array, n: int, wanted: bool) -> Array | None:
    """The logits buffer [B, n, V] with the prefill logits [B, V] (token 0's) in column 0."""
    if not wanted:
        return None
    return jnp.zeros((logits.shape[0], n, logits.shape[-1]), jnp.float32).at[:, 0].set(logits)


def autoregressive_start(cache: Any, first: Array, key: Array, *, gen: GenerationConfig, eos_ids: tuple[int, ...],
                         first_logits: Array | None = None) -> _ARState:
    """The loop state before the first step: `cache` holds the prompts; `first` int32[B] is the
    token sampled from the prefill logits `first_logits` (emitted as token 0, its K/V not yet
    computed)."""
    n, b = gen.max_new_tokens, first.shape[0]
    eos = eos_array(eos_ids)
    return _ARState(
        tokens=jnp.full((b, n), PAD_ID, jnp.int32).at[:, 0].set(first),
        num_emitted=jnp.ones((b,), jnp.int32),
        done=jnp.isin(first, eos) | (n == 1),
        cache=cache.flush(), key=key, step=jnp.int32(0),
        logits=initial_logits(first_logits, n, gen.return_logits) if first_logits is not None else None)


def autoregressive_steps(params: M.Params, state: _ARState, *, gen: GenerationConfig, eos_ids: tuple[int, ...],
                         max_rounds: Array | None = None) -> _ARState:
    """Decoding steps from `state` until every row is done (or `max_rounds` steps: `loop_rounds`)."""
    n, b = gen.max_new_tokens, state.tokens.shape[0]
    eos = eos_array(eos_ids)

    def cond(s: _ARState) -> Array:
        return ~jnp.all(s.done)

    def body(s: _ARState) -> _ARState:
        last = jnp.take_along_axis(s.tokens, (s.num_emitted - 1)[:, None], axis=1)
        logits, cache = M.decode(params, last, s.cache, width=gen.width)
        tok = sample(jax.random.fold_in(s.key, s.step), logits[:, 0], gen.sampling)
        live = ~s.done
        col = jnp.where(live, s.num_emitted, n)  # n: out of range, dropped
        tokens = s.tokens.at[jnp.arange(b), col].set(tok, mode="drop")
        num = s.num_emitted + live
        done = s.done | (live & jnp.isin(tok, eos)) | (num >= n)
        return _ARState(tokens=tokens, num_emitted=num, done=done, cache=cache.flush(),
                        key=s.key, step=s.step + 1, logits=record_logits(s.logits, col[:, None], logits))

    return loop_rounds(cond, body, state, max_rounds)


def _ar_result(s: _ARState) -> GenerationResult:
    return GenerationResult(tokens=s.tokens, lengths=s.num_emitted, logits=s.logits)


def autoregressive_loop(params: M.Params, cache: Any, first: Array, key: Array, *, gen: GenerationConfig,
                        eos_ids: tuple[int, ...], first_logits: Array | None = None,
                        return_cache: bool = False) -> GenerationResult | tuple[GenerationResult, Any]:
    """Decodes from a cache that holds the prompts; `first` int32[B] is the token sampled from
    the prefill logits `first_logits` (emitted as token 0, its K/V not yet computed).

    return_cache: also return the final cache, as (result, cache), so that a jitted caller that
    donates `cache` has an output to alias it to (else XLA copies it into the loop's state)."""
    state = autoregressive_start(cache, first, key, gen=gen, eos_ids=eos_ids, first_logits=first_logits)
    state = autoregressive_steps(params, state, gen=gen, eos_ids=eos_ids)
    return (_ar_result(state), state.cache) if return_cache else _ar_result(state)


def _prefilled(params: M.Params, tokens: Array, lengths: Array, key: Array, *, gen: GenerationConfig,
               eos_ids: tuple[int, ...], max_len: int, chunk: int | None) -> _ARState:
    cache = new_cache(params.config, gen.kv, tokens.shape[0], max_len, gen.group_size,
                      gamma_max=ring_gamma_max(gen.width), mesh=params.mesh)
    logits, cache = M.prefill(params, tokens, lengths, cache, chunk=chunk, progress=gen.prefill_progress)
    key, sub = jax.random.split(key)
    first = sample(sub, logits, gen.sampling)
    return autoregressive_start(cache, first, key, gen=gen, eos_ids=eos_ids, first_logits=logits)


@functools.partial(jax.jit, static_argnames=("gen", "eos_ids", "max_len", "chunk"))
def autoregressive_program(params: M.Params, tokens: Array, lengths: Array, key: Array, *,
                           gen: GenerationConfig, eos_ids: tuple[int, ...], max_len: int,
                           chunk: int | None = None) -> GenerationResult:
    """The whole of `generate_autoregressive` (without on_tokens) as one jitted program: a cache of
    max_len slots, the prefill (in chunks of `chunk` tokens, or whole) and every decoding step
    (what `planner.request_bytes` models)."""
    state = _prefilled(params, tokens, lengths, key, gen=gen, eos_ids=eos_ids, max_len=max_len, chunk=chunk)
    return _ar_result(autoregressive_steps(params, state, gen=gen, eos_ids=eos_ids))


def _autoregressive_start(params: M.Params, tokens: Array, lengths: Array, key: Array, *, gen: GenerationConfig,
                          eos_ids: tuple[int, ...], max_len: int,
                          chunk: int | None = None) -> tuple[_ARState, Progress]:
    state = _prefilled(params, tokens, lengths, key, gen=gen, eos_ids=eos_ids, max_len=max_len, chunk=chunk)
    return state, progress_of(state)


def _autoregressive_chunk(params: M.Params, state: _ARState, max_rounds: Array, *, gen: GenerationConfig,
                          eos_ids: tuple[int, ...]) -> tuple[_ARState, Progress]:
    state = autoregressive_steps(params, state, gen=gen, eos_ids=eos_ids, max_rounds=max_rounds)
    return state, progress_of(state)


def generate_autoregressive(model: Any, prompt_ids: Sequence[Sequence[int]] | np.ndarray,
                            config: GenerationConfig = GenerationConfig(),
                            key: Array | None = None, *,
                            timings: dict[str, float] | None = None,
                            on_tokens: Callable[[list[list[int]]], None] | None = None,
                            bucket: int | None = None, time_prefill: bool = False) -> GenerationResult:
    """Generates up to `config.max_new_tokens` tokens per prompt with the target model.

    `model` is a `qspec_jax.Model` (or anything with `.params`). Returns a GenerationResult whose
    rows hold each prompt's generated tokens (EOS included when emitted). Pass a dict as
    `timings` to get compile and run seconds measured separately; with `time_prefill` also the
    prefill's own seconds ("prefill_s", from a second, prefill-only run: `run_generation`).

    on_tokens: streaming. Called in this thread with a list per prompt of the tokens committed
    since the previous call (the first call holds the token sampled from the prefill, the next
    one the first step's; `stream_chunks` says how often later ones come); the result is the same
    as without it, token for token. `qspec_jax.streaming.TokenStream` turns it into an iterator.
    bucket: the prompt padding (`pad_prompts`): None pads to `length_bucket`'s ladder, which
    bounds the compiled programs; an int pads to a multiple of it (1: none).

    A request that does not fit this device's memory (weights + KV cache + temporaries:
    `planner.request_bytes`) raises `planner.DoesNotFitError`, a ValueError, before anything is
    compiled; one XLA still finds out of memory while running (and raises before this returns:
    with `timings` or `on_tokens`) raises its subclass `planner.OutOfMemoryError`.
    """
    if not isinstance(config, GenerationConfig):
        raise TypeError(f"generate_autoregressive: config must be a GenerationConfig, got {type(config).__name__}"
                        + (" (SpecConfig is for speculative.generate)" if type(config).__name__ == "SpecConfig" else ""))
    key = prng_key(key, "generate_autoregressive")
    params: M.Params = M.for_device(model.params)  # a no-op for models from `load`
    cfg = params.config
    tokens, lengths = pad_prompts(prompt_ids, cfg.vocab_size, bucket)
    check_fits(cfg, lengths, config.max_new_tokens)
    request = checked_request(params, config, tokens.shape, int(lengths.max()))  # before anything is compiled
    eos = config.eos_token_ids if config.eos_token_ids is not None else cfg.eos_token_ids
    max_len = decode_cache_len(tokens.shape[1], config.max_new_tokens, config.width, config.group_size, config.kv)
    try:
        return run_generation(autoregressive_program, _autoregressive_start, _autoregressive_chunk, (params,),
                              (jnp.asarray(tokens), jnp.asarray(lengths), key),
                              dict(gen=config, eos_ids=tuple(eos), max_len=max_len, chunk=request.chunk),
                              dict(gen=config, eos_ids=tuple(eos)), _ar_result, timings, on_tokens, time_prefill)
    except Exception as e:
        if resource_exhausted(e):  # the estimate let it through: the same kind of line, from XLA's account
            raise out_of_memory(params, request, e) from e
        raise
