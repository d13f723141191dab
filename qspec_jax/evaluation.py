"""Teacher-forced evaluation over real text: perplexity and draft/target agreement.

The cache evolves exactly as in decoding: the context is prefilled, then every evaluated token
is appended one at a time (and the hierarchical cache flushed after each), so each evaluated
token sees a quantized past and an FP ring, as it would during generation.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from tqdm.auto import tqdm

from qspec_jax import model as M
from qspec_jax.cache import DEFAULT_GROUP_SIZE
from qspec_jax.compilation import run_program
from qspec_jax.generation import new_cache
from qspec_jax.planner import Request, check_params_fit, out_of_memory, resource_exhausted

Array = jax.Array
KV_EVAL_KINDS = {"bf16": ("bf16", "target"), "int8": ("int8", "target"), "int4": ("int8", "draft")}
STEP_CHUNK = 64  # evaluated tokens per jitted call (one progress tick each)


def read_text_file(path: str | Path, what: str = "text file") -> str:
    """The UTF-8 text of `path`. ValueError naming `what` (e.g. the flag "--text") and the file
    for a missing file, a directory, an empty file, or a binary one (a NUL byte, or not UTF-8):
    tokenizing binary data would silently evaluate garbage."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path}: is a directory; expected a text file")
    if not path.is_file():
        raise ValueError(f"{what} {path}: no such file")
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"{what} {path}: the file is empty")
    try:
        if b"\x00" in data:
            i = data.index(b"\x00")
            raise UnicodeDecodeError("utf-8", data, i, i + 1, "NUL byte")
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path}: not a UTF-8 text file ({e.reason} at byte {e.start}); "
                         "expected plain text") from None


def read_text_tokens(model: Any, path: str | Path, needed: int, offset: int = 0, *,
                     what: str = "text file") -> np.ndarray:
    """Token ids [needed] of a UTF-8 text file (`read_text_file`), from token `offset`; a clear
    error (naming `what`, e.g. "--text") when the file is not text or too short."""
    tok = model.require_tokenizer()
    text = read_text_file(path, what)
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < offset + needed:
        raise ValueError(f"{what} {path}: {len(ids)} tokens, but {offset + needed} are needed "
                         f"({offset} skipped + {needed} read); use a longer text or fewer tokens")
    return np.asarray(ids[offset: offset + needed], np.int32)


@struct.dataclass
class _Predictions:
    nll: Array  # float32[B, c]: -log p_target(true next token)
    target_top: Array  # int32[B, c]
    draft_top: Array  # int32[B, c] (target_top when there is no draft)


@functools.partial(jax.jit, static_argnames=("view", "draft_view"))
def _steps(target: M.Params, draft: M.Params | None, cache: Any, last_logits: Array, tokens: Array,
           last_draft: Array, *, view: str, draft_view: str) -> tuple[_Predictions, Any, Array, Array]:
    """Feeds tokens [B, c] one at a time. Predictions for token i come from the logits before it.

    With a draft, each position is also decoded by the draft over the same committed cache
    (its K/V write is rolled back), as the first draft step of a round would see it.
    """

    def step(carry, tok):
        logits, draft_top, cache = carry
        logp = jax.nn.log_softmax(logits, axis=-1)
        pred = _Predictions(nll=-jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0],
                            target_top=jnp.argmax(logits, -1).astype(jnp.int32), draft_top=draft_top)
        committed = cache.total_lengths()
        if draft is not None:
            d_logits, cache = M.decode(draft, tok[:, None], cache, view=draft_view)
            draft_top = jnp.argmax(d_logits[:, 0], -1).astype(jnp.int32)
            cache = cache.rollback(committed)
        logits, cache = M.decode(target, tok[:, None], cache, view=view)
        if draft is None:
            draft_top = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        return (logits[:, 0], draft_top, cache.flush()), pred

    (logits, d_top, cache), preds = jax.lax.scan(step, (last_logits, last_draft, cache), tokens.T)
    return jax.tree.map(lambda x: x.T, preds), cache, logits, d_top


def eval_request(batch: int, context: int, eval_tokens: int, kv: str = "int8", group_size: int = DEFAULT_GROUP_SIZE,
                 with_draft: bool = False, chunk: int | None = None) -> Request:
    """What `teacher_forced` asks of a device (`planner.request_bytes`): `batch` windows of
    `context` tokens prefilled (in chunks of `chunk`, or whole) and `eval_tokens` fed one at a
    time through a cache of `kv`'s kind; with a draft, a second cache for its prefill."""
    return Request(batch, context, eval_tokens, kv=KV_EVAL_KINDS[kv][0], width=1, group_size=group_size,
                   gamma_max=1, caches=2 if with_draft else 1, chunk=chunk)


def teacher_forced(target: M.Params, tokens: np.ndarray, context: int, *, kv: str = "int8",
                   draft: M.Params | None = None, draft_kv: str = "int4",
                   group_size: int = DEFAULT_GROUP_SIZE, scale_dtype: Any = jnp.float16,
                   progress: bool = True, prefill_chunk: int | None = None) -> dict[str, np.ndarray]:
    """Evaluates tokens[:, context:] given tokens[:, :context] under teacher forcing.

    tokens: int32[B, context + M]. kv: "bf16" | "int8" | "int4" (the target's view of the cache).
    Returns {"nll": [B, M], "target_top": [B, M], "draft_top": [B, M]} (numpy); draft_top is the
    draft's argmax when `draft` is given (viewing the cache as `draft_kv`). `scale_dtype` is the
    hierarchical cache's scale/zero dtype. `prefill_chunk`: prefill the context in chunks of this
    many tokens (`model.prefill`'s chunk; None: the whole context at once).

    An evaluation that does not fit this device's memory (the cache, with a draft a second one
    for its prefill, and the passes' temporaries: `planner.request_bytes`) raises
    `planner.DoesNotFitError`, a ValueError, before anything is allocated for it; XLA out of
    memory while running it, `planner.OutOfMemoryError`.
    """
    if kv not in KV_EVAL_KINDS:
        raise ValueError(f"kv={kv!r}; expected one of {tuple(KV_EVAL_KINDS)}")
    b, total = tokens.shape
    n_eval = total - context
    if context < 1 or n_eval < 1:
        raise ValueError(f"need context >= 1 and >= 1 evaluated token; got context={context}, total={total}")
    request = eval_request(b, context, n_eval, kv, group_size, with_draft=draft is not None, chunk=prefill_chunk)
    check_params_fit(target, request, draft=draft)  # before anything is allocated
    try:
        return _teacher_forced(target, tokens, context, kv, draft, draft_kv, group_size, scale_dtype, progress,
                               prefill_chunk)
    except Exception as e:
        if resource_exhausted(e):  # the estimate let it through: the same kind of line, from XLA's account
            raise out_of_memory(target, request, e, draft=draft) from e
        raise


def _teacher_forced(target: M.Params, tokens: np.ndarray, context: int, kv: str, draft: M.Params | None,
                    draft_kv: str, group_size: int, scale_dtype: Any, progress: bool,
                    prefill_chunk: int | None) -> dict[str, np.ndarray]:
    """`teacher_forced` of checked arguments."""
    cfg = target.config
    b, total = tokens.shape
    cache_kind, view = KV_EVAL_KINDS[kv]
    draft_view = KV_EVAL_KINDS[draft_kv][1]
    max_len = int(np.ceil((total + 1) / group_size) * group_size)
    cache = new_cache(cfg, cache_kind, b, max_len, group_size, scale_dtype=scale_dtype)
    toks = jnp.asarray(tokens)
    lengths = jnp.full((b,), context, jnp.int32)
    # The bar counts positions (the prefilled context, then the evaluated tokens) and advances
    # only when a step's results are ready, so it ends when the work ends: compilation and
    # the device's queue included (JAX dispatches asynchronously; without the waits the bar
    # reached 100% at dispatch and minutes of computing followed it).
    with tqdm(total=total, desc=f"teacher-forced ({kv})", unit="tok", disable=not progress) as bar:
        bar.set_postfix_str("prefill (compiling)")
        logits, cache = run_program(M.prefill, (target, toks[:, :context], lengths, cache), dict(chunk=prefill_chunk))
        cache = cache.flush()
        d_top = jnp.zeros((b,), jnp.int32)
        if draft is not None:
            d_logits, _ = run_program(M.prefill, (draft, toks[:, :context], lengths, new_cache(
                cfg, cache_kind, b, max_len, group_size, scale_dtype=scale_dtype)), dict(chunk=prefill_chunk))
            d_top = jnp.argmax(d_logits, -1).astype(jnp.int32)
        jax.block_until_ready((logits, cache, d_top))
        bar.update(context)
        out: list[_Predictions] = []
        for i, s in enumerate(range(context, total, STEP_CHUNK)):
            bar.set_postfix_str("compiling" if i == 0 else "")
            chunk = toks[:, s: min(s + STEP_CHUNK, total)]
            pred, cache, logits, d_top = run_program(_steps, (target, draft, cache, logits, chunk, d_top),
                                                     dict(view=view, draft_view=draft_view))
            jax.block_until_ready(pred)
            out.append(pred)
            bar.update(chunk.shape[1])
    return {k: np.concatenate([np.asarray(getattr(p, k)) for p in out], axis=1)
            for k in ("nll", "target_top", "draft_top")}


def perplexity(nll: np.ndarray) -> float:
    return float(np.exp(np.mean(nll)))


def simulate_rounds(agree: np.ndarray, gamma: int) -> dict[str, float]:
    """Greedy speculative rounds over a per-position draft/target agreement sequence.

    A round at position t accepts the leading run of agreements among the next gamma
    positions (n), emits n + 1 tokens and moves to t + n + 1. Metrics follow SPEC §7.
    """
    drafted = accepted = rounds = emitted = 0
    for row in np.atleast_2d(agree):
        t, m = 0, len(row)
        while t < m:
            window = row[t: t + gamma]
            n = int(np.argmin(window)) if not window.all() else len(window)
            n = min(n, m - t - 1)  # the last position can only be emitted, not accepted
            rounds, drafted, accepted, emitted = rounds + 1, drafted + gamma, accepted + n, emitted + n + 1
            t += n + 1
    return {"acceptance_rate": accepted / max(1, drafted), "tokens_per_round": emitted / max(1, rounds),
            "rounds": rounds}
