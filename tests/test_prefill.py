"""Prefill: the flash path's split-and-merge, chunked prefill into both caches, the chunk policy.

The oracle of the attention is the jnp reference (`prefill_impl` "reference"); the flash path runs
here through jax.nn's XLA attention ("xla"), the same code that runs cuDNN on a GPU
(tools/device/prefill_check.py checks cuDNN there). Exactness after a chunked prefill is checked
against the target's own autoregressive output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qspec_jax import model as M
from qspec_jax import planner as P
from qspec_jax.attention import (PREFIX_SPAN_TOKENS, chunk_attention, dense_attention, merge_attention, prefill_attention,
                                 prefill_impl, prefix_span)
from qspec_jax.cache import DenseKVCache, QuantSpecCache, prefill_quantized_len
from qspec_jax.config import ConfigError, ModelConfig
from qspec_jax.generation import GenerationConfig, generate_autoregressive
from qspec_jax.speculative import SpecConfig, generate

CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=16, dtype="float32", max_position_embeddings=1024)
G = 16


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_kv(key, b, t, h=CFG.num_kv_heads, d=CFG.head_dim):
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, (b, h, t, d)), jax.random.normal(k2, (b, h, t, d))


@pytest.fixture(scope="module")
def params() -> M.Params:
    return M.init_random_params(CFG, jax.random.PRNGKey(0), scale=0.1)


# ------------------------------------------------------------------------------- attention
def test_merge_of_two_parts_is_attention_over_their_union() -> None:
    """merge_attention of the parts over two disjoint key sets = attention over both, and an
    empty part (lse = -1e30, o = 0) weighs nothing."""
    q = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 6, 16))
    k, v = random_kv(jax.random.PRNGKey(2), 2, 40)
    bsnh = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    whole, lse = jax.nn.dot_product_attention(q, bsnh(k), bsnh(v), implementation="xla", return_residual=True)
    a = jax.nn.dot_product_attention(q, bsnh(k[:, :, :13]), bsnh(v[:, :, :13]), implementation="xla",
                                     return_residual=True)
    b = jax.nn.dot_product_attention(q, bsnh(k[:, :, 13:]), bsnh(v[:, :, 13:]), implementation="xla",
                                     return_residual=True)
    o, lse_m = merge_attention(a, b)
    assert rel(o, whole) < 1e-6 and rel(lse_m, lse) < 1e-6
    empty = (jnp.zeros_like(whole), jnp.full(lse.shape, -1e30))
    o2, lse2 = merge_attention(empty, (whole, lse))
    np.testing.assert_allclose(o2, whole, rtol=1e-6)
    np.testing.assert_allclose(lse2, lse, rtol=1e-6)


@pytest.mark.parametrize("window", [None, 24])
def test_whole_prompt_flash_matches_reference(window: int | None) -> None:
    q = jax.random.normal(jax.random.PRNGKey(3), (2, 70, 6, 16))
    k, v = random_kv(jax.random.PRNGKey(4), 2, 70)
    pos = jnp.broadcast_to(jnp.arange(70, dtype=jnp.int32), (2, 70))
    ref = prefill_attention(q, k, v, pos, window, "reference")
    got = prefill_attention(q, k, v, pos, window, "xla")
    assert rel(got, ref) < 1e-5


@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("start,prefix_keys", [(0, None), (64, None), (128, None), (192, None), (192, 64),
                                               (192, 128), (128, 128)])
def test_chunk_attention_flash_matches_reference(kind: str, start: int, prefix_keys: int | None) -> None:
    """A chunk's split-and-merge (prefix spans, ring, itself) = the reference over the same cache,
    for rows whose prefix lies in the quantized planes, in the ring, or both (row lengths 256, 150
    and 77: Q = 240, 128, 48); the prefix read in one span (the default here: the cache is short),
    in spans of one chunk, or in spans of two chunks (at start 192: [64, 192) and [0, 64), the
    lower one read as [0, 128) with its upper half masked off)."""
    b, t, c = 3, 256, 64
    k, v = random_kv(jax.random.PRNGKey(start + 5), b, t)
    lengths = jnp.array([256, 150, 77], jnp.int32)
    if kind == "int8":
        cache = QuantSpecCache.init(CFG, b, t, group_size=G, gamma_max=3).prefill_layer(0, k, v, lengths)
        qlen = prefill_quantized_len(lengths, G)
    else:
        cache = DenseKVCache.init(CFG, b, t).prefill_layer(0, k, v, lengths)
        qlen = jnp.zeros_like(lengths)
    q = jax.random.normal(jax.random.PRNGKey(start + 6), (b, c, 6, 16))
    pos = jnp.broadcast_to(start + jnp.arange(c, dtype=jnp.int32), (b, c))
    kc, vc = k[:, :, start:start + c], v[:, :, start:start + c]
    ref = chunk_attention(q, kc, vc, pos, cache, 0, start, c, qlen, None, "reference")
    got = chunk_attention(q, kc, vc, pos, cache, 0, start, c, qlen, None, "xla", prefix_keys)
    assert rel(got, ref) < 1e-5
    if kind == "int8" and start == 192 and prefix_keys is None:
        # Row 1 (Q = 128) reads positions 128..191 from the ring: leaving the ring out must show.
        no_ring = chunk_attention(q, kc, vc, pos, cache.replace(k_fp=jnp.zeros_like(cache.k_fp)), 0, start, c, qlen,
                                  None, "xla")
        assert rel(no_ring[1], ref[1]) > 1e-2


def test_prefix_span_policy() -> None:
    """Prefix spans: multiples of the chunk, batch x span within PREFIX_SPAN_TOKENS unless one
    chunk is already more, never longer than the cache; a bad explicit span is refused."""
    assert prefix_span(8192, 1, 2**21) == PREFIX_SPAN_TOKENS
    assert prefix_span(8192, 8, 2**21) == 8192
    assert prefix_span(8192, 32, 2**21) == 8192  # one chunk at least
    assert prefix_span(4096, 3, 2**21) == 4096 * (PREFIX_SPAN_TOKENS // (3 * 4096))
    assert prefix_span(8192, 1, 20000) == 16384  # capped by the cache
    k, v = random_kv(jax.random.PRNGKey(3), 1, 128)
    cache = DenseKVCache.init(CFG, 1, 128).prefill_layer(0, k, v, jnp.array([128], jnp.int32))
    q = jnp.zeros((1, 32, 6, 16))
    pos = 64 + jnp.arange(32, dtype=jnp.int32)[None]
    for bad in (48, 160):
        with pytest.raises(ValueError, match=f"prefix_keys={bad}: expected a multiple of the chunk"):
            chunk_attention(q, k[:, :, 64:96], v[:, :, 64:96], pos, cache, 0, 64, 32, jnp.zeros(1, jnp.int32), None,
                            "xla", bad)


def test_chunk_attention_reads_the_quantized_prefix_as_the_target_view() -> None:
    """The reference chunk attention over the hierarchical cache equals plain attention over the
    target view's dequantized keys/values (positions < Q) and the ring's (positions >= Q)."""
    b, t, c, start = 1, 128, 32, 96
    k, v = random_kv(jax.random.PRNGKey(9), b, t)
    lengths = jnp.array([t], jnp.int32)  # Q = 112: positions 96..111 quantized, 112.. in the ring
    cache = QuantSpecCache.init(CFG, b, t, group_size=G, gamma_max=3).prefill_layer(0, k, v, lengths)
    kq, vq = cache.dequantized_layer(0, "target")
    qlen = prefill_quantized_len(lengths, G)
    keys = jnp.concatenate([kq[:, :, :start], k[:, :, start:]], axis=2)  # start < Q: the whole prefix quantized
    vals = jnp.concatenate([vq[:, :, :start], v[:, :, start:]], axis=2)
    q = jax.random.normal(jax.random.PRNGKey(10), (b, c, 6, 16))
    pos = start + jnp.arange(c, dtype=jnp.int32)[None]
    ref = dense_attention(q, keys, vals, pos, jnp.arange(t, dtype=jnp.int32)[None])
    got = chunk_attention(q, k[:, :, start:], v[:, :, start:], pos, cache, 0, start, c, qlen, None, "reference")
    assert rel(got, ref) < 1e-5


# ------------------------------------------------------------------------------- the cache
@pytest.mark.parametrize("chunk", [32, 48, 96])
def test_chunked_placement_equals_whole_placement(chunk: int) -> None:
    """prefill_chunk_layer chunk by chunk places what prefill_layer places at once: every
    quantized position below each row's Q and every ring slot below P - Q, bit for bit."""
    b, t = 3, 200
    k, v = random_kv(jax.random.PRNGKey(11), b, t)
    lengths = jnp.array([200, 131, 77], jnp.int32)
    whole = QuantSpecCache.init(CFG, b, 256, group_size=G, gamma_max=3).prefill_layer(1, k, v, lengths)
    part = QuantSpecCache.init(CFG, b, 256, group_size=G, gamma_max=3)
    for s in range(0, t, chunk):
        part = part.prefill_chunk_layer(1, k[:, :, s:s + chunk], v[:, :, s:s + chunk], s, lengths)
    q = np.asarray(prefill_quantized_len(lengths, G))
    for name in ("k_hi", "k_lo", "v_hi", "v_lo", "v_scale", "v_zero"):
        a, p = np.asarray(getattr(whole, name)[1]), np.asarray(getattr(part, name)[1])
        for r in range(b):
            np.testing.assert_array_equal(p[r, :, : q[r]], a[r, :, : q[r]], err_msg=f"{name} row {r}")
    for name in ("k_scale", "k_zero"):
        a, p = np.asarray(getattr(whole, name)[1]), np.asarray(getattr(part, name)[1])
        for r in range(b):
            np.testing.assert_array_equal(p[r, :, : q[r] // G], a[r, :, : q[r] // G], err_msg=f"{name} row {r}")
    for name in ("k_fp", "v_fp"):
        a, p = np.asarray(getattr(whole, name)[1]), np.asarray(getattr(part, name)[1])
        for r in range(b):
            n = int(lengths[r]) - q[r]
            np.testing.assert_array_equal(p[r, :, :n], a[r, :, :n], err_msg=f"{name} row {r}")
    untouched = np.asarray(part.k_hi[0])
    assert not untouched.any(), "a chunk wrote into another layer"


def test_chunk_past_the_cache_is_refused() -> None:
    cache = QuantSpecCache.init(CFG, 1, 64, group_size=G, gamma_max=3)
    k, v = random_kv(jax.random.PRNGKey(12), 1, 32)
    with pytest.raises(ValueError, match="position 80 does not fit a cache of max_len=64"):
        cache.prefill_chunk_layer(0, k, v, 48, jnp.array([80], jnp.int32))


# ------------------------------------------------------------------------------- prefill
@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_chunk_at_least_the_prompt_is_the_whole_prefill(params: M.Params, kind: str) -> None:
    toks = jax.random.randint(jax.random.PRNGKey(13), (2, 96), 0, 64)
    lengths = jnp.array([96, 50], jnp.int32)
    mk = (lambda: QuantSpecCache.init(CFG, 2, 128, group_size=G, gamma_max=3)) if kind == "int8" else \
        (lambda: DenseKVCache.init(CFG, 2, 128))
    ref, c0 = M.prefill(params, toks, lengths, mk())
    for chunk in (96, 128):
        out, c1 = M.prefill(params, toks, lengths, mk(), chunk=chunk)
        np.testing.assert_array_equal(out, ref)
        for a, b in zip(jax.tree.leaves(c0), jax.tree.leaves(c1)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("chunk", [32, 48])
def test_chunked_prefill_over_a_dense_cache_matches_whole(params: M.Params, impl: str, chunk: int) -> None:
    """Over a dense cache a chunk reads its prefix exactly as stored: chunking changes only the
    order of float32 sums (all positions' logits, every row)."""
    toks = jax.random.randint(jax.random.PRNGKey(14), (3, 200), 0, 64)
    lengths = jnp.array([200, 131, 77], jnp.int32)
    p = params.replace(config=CFG.replace(prefill_attention_impl=impl))
    ref, _ = M.prefill(params, toks, lengths, DenseKVCache.init(CFG, 3, 256), all_logits=True)
    out, cache = M.prefill(p, toks, lengths, DenseKVCache.init(CFG, 3, 256), all_logits=True, chunk=chunk)
    for r, n in enumerate(np.asarray(lengths)):
        assert rel(out[r, :n], ref[r, :n]) < 1e-5
    last, _ = M.prefill(p, toks, lengths, DenseKVCache.init(CFG, 3, 256), chunk=chunk)
    np.testing.assert_allclose(last, out[jnp.arange(3), lengths - 1], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(cache.lengths, lengths)


@pytest.mark.parametrize("chunk", [32, 64])
def test_chunked_prefill_over_the_hierarchical_cache(params: M.Params, chunk: int) -> None:
    """Over the hierarchical cache a chunk reads positions below Q through the INT8 view: the
    logits move by the cache's quantization error, within 3% (norm-relative, this model; the
    real model's perplexity change is in docs/QUALITY.md), and every row equals the same prompt
    prefilled alone (rows are independent) within 2e-3: the batch's shape changes float32 sums in
    their last bits, which can flip an INT8 code (one step, s/16, of one key); a row reading
    another row's Q or ring is off by the quantization error itself (~1e-2)."""
    toks = jax.random.randint(jax.random.PRNGKey(15), (3, 200), 0, 64)
    lengths = jnp.array([200, 131, 77], jnp.int32)
    mk = lambda b=3: QuantSpecCache.init(CFG, b, 256, group_size=G, gamma_max=3)  # noqa: E731
    ref, _ = M.prefill(params, toks, lengths, mk())
    out, cache = M.prefill(params, toks, lengths, mk(), chunk=chunk)
    assert 0 < rel(out, ref) < 3e-2
    np.testing.assert_array_equal(cache.q_len, prefill_quantized_len(lengths, G))
    np.testing.assert_array_equal(cache.fp_len, lengths - prefill_quantized_len(lengths, G))
    for r in range(3):
        alone, _ = M.prefill(params, toks[r:r + 1], lengths[r:r + 1], mk(1), chunk=chunk)
        assert rel(alone[0], out[r]) < 2e-3, r


def test_bad_chunk_is_refused(params: M.Params) -> None:
    toks = jnp.zeros((1, 64), jnp.int32)
    cache = QuantSpecCache.init(CFG, 1, 64, group_size=G, gamma_max=3)
    with pytest.raises(ValueError, match="chunk=24 must be a positive multiple of the cache's group size 16"):
        M.prefill(params, toks, jnp.array([64]), cache, chunk=24)
    with pytest.raises(ValueError, match="chunk=0"):
        M.prefill(params, toks, jnp.array([64]), cache, chunk=0)


# --------------------------------------------------------------------------- generation
class _Model:
    def __init__(self, params: M.Params) -> None:
        self.params, self.config = params, params.config


@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_spec_equals_ar_after_a_chunked_prefill(params: M.Params, kv: str) -> None:
    """Greedy speculative output equals the target's own autoregressive output when both prefill
    a prompt of several chunks (they share the prefill); and the chunked prefill is what ran: its
    output differs from the whole prompt's where the INT8 prefix moves a near-tie."""
    model = _Model(params)
    prompts = [list(np.asarray(jax.random.randint(jax.random.PRNGKey(16 + i), (n,), 0, 64))) for i, n in
               enumerate((300, 180))]
    spec = SpecConfig(gamma=3, gamma_max=3, group_size=G, max_new_tokens=24, eos_token_ids=(), prefill_chunk=64,
                      target_kv=kv, draft_kv="int4" if kv == "int8" else "bf16", draft_weights="bf16")
    gen = GenerationConfig(max_new_tokens=24, kv=kv, group_size=G, width=spec.verify_width, eos_token_ids=(),
                           prefill_chunk=64)
    s = generate(model, prompts, spec, draft_params=params)
    a = generate_autoregressive(model, prompts, gen)
    assert s.to_lists() == a.to_lists()


def test_generation_configs_check_prefill_chunk() -> None:
    with pytest.raises(ValueError, match="prefill_chunk=100: expected 'auto', 'whole' or a positive multiple"):
        GenerationConfig(kv="int8", group_size=128, prefill_chunk=100)
    with pytest.raises(ValueError, match="prefill_chunk='big'"):
        SpecConfig(prefill_chunk="big")
    GenerationConfig(kv="bf16", prefill_chunk=100)  # a dense cache has no group
    with pytest.raises(ConfigError, match="prefill_attention_impl='flash'"):
        CFG.replace(prefill_attention_impl="flash")


@pytest.mark.parametrize("whole_fits", [True, False])
def test_prefill_chunk_policy(params: M.Params, monkeypatch: pytest.MonkeyPatch, whole_fits: bool) -> None:
    """"auto" prefills whole when the request fits with the whole prompt's temporaries
    (`check_params_fit` of it, the byte model tests/test_memory.py checks), else in
    DEFAULT_PREFILL_CHUNK chunks; a short prompt is always whole; "whole" and sizes are as asked."""
    asked = []

    def fake_check(p: M.Params, request: P.Request, **kw: object) -> dict:
        asked.append(request.chunk)
        if request.chunk is None and not whole_fits:
            raise P.DoesNotFitError("too big", needed=2, available=1, parts={})
        return {}

    monkeypatch.setattr(P, "check_params_fit", fake_check)
    t = 4 * P.DEFAULT_PREFILL_CHUNK
    request = GenerationConfig(kv="int8", group_size=G, width=4, max_new_tokens=8).memory_request(1, t)
    assert P.prefill_chunk_for(params, request, "auto") == (None if whole_fits else P.DEFAULT_PREFILL_CHUNK)
    assert asked == [None]
    short = dataclasses.replace(request, prompt_len=P.DEFAULT_PREFILL_CHUNK)
    assert P.prefill_chunk_for(params, short, "auto") is None
    assert P.prefill_chunk_for(params, request, "whole") is None
    assert P.prefill_chunk_for(params, request, 64) == 64
    assert P.prefill_chunk_for(params, dataclasses.replace(request, prompt_len=64), 64) is None
    assert asked == [None]  # only "auto" on a long prompt asks


def test_prefill_progress_reports_every_layer(params: M.Params, capfd: pytest.CaptureFixture) -> None:
    toks = jnp.ones((1, 100), jnp.int32)
    cache = QuantSpecCache.init(CFG, 1, 128, group_size=G, gamma_max=3)
    out, _ = jax.jit(lambda p, t, c: M.prefill(p, t, jnp.array([100]), c, chunk=32, progress=True))(params, toks, cache)
    jax.block_until_ready(out)
    jax.effects_barrier()
    err = capfd.readouterr().err
    steps = [line for line in err.split("\r") if line.startswith("prefill:")]
    assert len(steps) == 4 * CFG.num_layers  # 3 full chunks and a tail, every layer
    assert steps[-1].startswith("prefill: 100% of 100 tokens x 2 layers, in 4 chunks of 32") and err.endswith("\n")


def test_prefill_impl_dispatch_on_this_machine() -> None:
    """On a CPU "auto" is the jnp reference and "cudnn" is refused with the reason."""
    if jax.default_backend() == "gpu":
        pytest.skip("CPU dispatch")
    assert prefill_impl("auto", 128, jnp.bfloat16) == "reference"
    assert prefill_impl("xla", 128, jnp.bfloat16) == "xla"
    with pytest.raises(ValueError, match="prefill_attention_impl='cudnn' cannot run here: no GPU"):
        prefill_impl("cudnn", 128, jnp.bfloat16)


@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("chunk", [None, 32])
def test_prefill_pins_the_cache_to_the_decode_layout(params: M.Params, kind: str, chunk: int | None) -> None:
    """Every per-token cache array a prefill writes leaves its layer loop row-major, the layout the
    decode kernels read. Unpinned, XLA on a GPU lays the loop's cache out like the projections'
    [B, T, Hkv, D] output and transposes the whole cache before decoding (`cache._row_major`);
    the CPU picks row-major either way, so this reads the lowered program's constraints."""
    toks = jnp.zeros((2, 64), jnp.int32)
    lengths = jnp.array([64, 40], jnp.int32)
    cache = (QuantSpecCache.init(CFG, 2, 128, group_size=G, gamma_max=3) if kind == "int8"
             else DenseKVCache.init(CFG, 2, 128))
    text = jax.jit(lambda c: M.prefill(params, toks, lengths, c, chunk=chunk)).lower(cache).as_text()
    pinned = set()
    for line in text.splitlines():
        if "@LayoutConstraint" not in line:
            continue
        layout = line.split("result_layouts = [dense<[")[1].split("]")[0]
        *dims, elt = line.rsplit("-> tensor<", 1)[1].split(">")[0].split("x")
        assert [int(i) for i in layout.split(",")] == list(range(len(dims)))[::-1], line
        pinned.add((*(int(n) for n in dims), elt))
    # the cache's dtypes as MLIR spells them: f32, f16, bf16, ui8
    written = {(*a.shape, str(a.dtype).replace("float", "f").replace("uint", "ui"))
               for a in jax.tree.leaves(cache) if a.ndim == 5}
    assert written and written <= pinned, (written, pinned)
