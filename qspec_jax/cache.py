"""KV caches as immutable pytrees: a plain dense cache and the hierarchical QuantSpec cache.

Both stack all layers on a leading L axis so the model can `lax.scan` over layers with the
cache in the scan carry; each layer step writes its new K/V in place and reads its slice.

Both follow one masking rule: a query at logical position p sees every cached position <= p
(plus, for the quantized region, only t < q_len). Slots past the committed length are garbage
that a later write overwrites before any query can see it, so rollback only moves a length.

QuantSpecCache layout and buffer protocol are SPEC §3-§4:

    k_hi, k_lo, v_hi, v_lo : uint8[L, B, Hkv, S_max, D/2]  nibble planes in the kernel layout
                             (quant.py: keys split halves per token, values transposed per block)
    k_scale, k_zero        : f16|f32[L, B, Hkv, S_max/G, D] per channel per G-token block
    v_scale, v_zero        : f16|f32[L, B, Hkv, S_max, D/Gv] per token per Gv-channel group
    k_fp, v_fp             : bf16|f32[L, B, Hkv, R, D]     FP ring, R >= 2G + gamma_max
    q_len, fp_len, fp_start: int32[B]

Quantized token t sits at position t (t < q_len); ring entry j < fp_len sits at position
q_len + j, in slot (fp_start + j) mod R.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental.layout import Layout, with_layout_constraint

from qspec_jax import quant
from qspec_jax.config import ModelConfig

Array = jax.Array

DEFAULT_GROUP_SIZE = 128
DEFAULT_GAMMA_MAX = 7  # verify width 8: fills the attention kernels' 32-row tile at n_rep 4 (docs/QUALITY.md, Exactness)
RING_ALIGN = 32  # ring slots are a multiple of this so kernels can tile the ring
UNBOUNDED = 2**30  # "no limit" for tokens_until_flush
BLOCK_FIELDS = ("k_scale", "k_zero")  # the quantized fields indexed by G-token block; the others by token


def _dtype(name_or_dtype: Any) -> Any:
    return jnp.dtype(name_or_dtype)


def _nbytes(x: Any) -> int:
    """Bytes of an array or of a ShapeDtypeStruct (so accounting works under eval_shape)."""
    return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def _scatter_rows(buf: Array, layer: Array, slots: Array, new: Array, *, contiguous: bool) -> Array:
    """Writes new[b, :, t] into buf[layer, b, :, slots[b, t]].

    buf: [L, B, H, S, X]; slots: int32[B, T], each in [0, S) (the caller's invariant: ring slots
    are taken mod R, and generation sizes dense caches for every column it writes,
    `generation.decode_cache_len`); new: [B, H, T, X].

    The indices are clamped, not dropped: a dropping scatter reads the old value and selects
    (two more kernels per layer on a GPU), a clamped one is a plain dynamic-update-slice at
    B = T = 1. Clamping keeps a broken invariant memory-safe; it never triggers in generation.
    `contiguous`: slots[b] are consecutive (slots[b, t] = slots[b, 0] + t); with one row the
    write is then a dynamic-update-slice: XLA cannot prove a clamped scatter index in bounds
    and still emits the read-and-select of a dropping scatter for it.
    """
    if contiguous and buf.shape[1] == 1:
        # One row of consecutive slots: a dynamic-update-slice (its start is clamped like "clip").
        start = (jnp.asarray(layer, jnp.int32), 0, 0, slots[0, 0], 0)
        return jax.lax.dynamic_update_slice(buf, new[None].astype(buf.dtype), start)
    b = jnp.arange(buf.shape[1])[:, None]
    # Advanced indices on axes 0, 1, 3 are separated by a slice, so numpy rules put the
    # broadcast index dims [B, T] first: the update is [B, T, H, X].
    return buf.at[layer, b, :, slots].set(jnp.swapaxes(new, 1, 2).astype(buf.dtype), mode="clip")


def _check_chunk(start: Array | int, length: int, max_len: int) -> None:
    """A prefill chunk must end inside the cache (a traced start is the caller's invariant:
    dynamic_update_slice would clamp it and overwrite earlier positions)."""
    end = length + (start if isinstance(start, (int, np.integer)) else 0)
    if end > max_len:
        raise ValueError(f"prompt chunk ending at position {end} does not fit a cache of max_len={max_len}")


def _row_major(x: Array) -> Array:
    """x, pinned to the row-major layout every decode kernel reads, inside a prefill's layer loop.

    The prompt's K/V come out of the projections as [B, T, Hkv, D] in memory (cuDNN's prefill
    attention reads them so); left to itself, XLA lays the loop-carried cache out the same way, as
    [L, B, S, Hkv, D], and transposes the whole cache once before decoding (H200, SmolLM2 batch 32
    at 8k: two whole-cache transposes in the AR program, a second copy of a 3.1 GB cache array live
    at once). Pinned, each layer's write does the transpose of its own tokens."""
    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


# ------------------------------------------------------------------------------------ dense
@struct.dataclass
class DenseKVCache:
    """Plain KV cache. k, v: [L, B, Hkv, S_max, D]; lengths: int32[B] committed tokens."""

    k: Array
    v: Array
    lengths: Array

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> "DenseKVCache":
        dtype = _dtype(dtype or cfg.dtype)
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def next_positions(self, t: int) -> Array:
        """int32[B, t]: logical positions of the next t tokens."""
        return self.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]

    def prefill_layer(self, layer: Array, k: Array, v: Array, lengths: Array) -> "DenseKVCache":
        """Stores a right-padded prompt's K/V [B, Hkv, T, D] at positions 0..T-1 of `layer`."""
        return self.prefill_chunk_layer(layer, k, v, 0, lengths)

    def prefill_chunk_layer(self, layer: Array, k: Array, v: Array, start: Array | int,
                            lengths: Array) -> "DenseKVCache":
        """Stores K/V [B, Hkv, C, D] of prompt positions start..start+C-1 (a chunked prefill's
        chunk; start + C <= max_len) in `layer`."""
        del lengths  # padding positions are masked by position at read time
        _check_chunk(start, k.shape[2], self.max_len)
        idx = (layer, 0, 0, start, 0)
        return self.replace(
            k=_row_major(jax.lax.dynamic_update_slice(self.k, k[None].astype(self.k.dtype), idx)),
            v=_row_major(jax.lax.dynamic_update_slice(self.v, v[None].astype(self.v.dtype), idx)),
        )

    def span(self, layer: Array, start: Array | int, length: int) -> tuple[Array, Array]:
        """K, V [B, Hkv, length, D] of positions start..start+length-1 of `layer` (as stored)."""
        b, h, _, d = self.k.shape[1:]
        take = lambda x: jax.lax.dynamic_slice(x, (layer, 0, 0, start, 0), (1, b, h, length, d))[0]  # noqa: E731
        return take(self.k), take(self.v)

    def append_slots(self, t: int) -> Array:
        """int32[B, T]: the rows of `append_buffers` that T new tokens go to (their positions)."""
        return self.next_positions(t)

    @property
    def append_buffers(self) -> tuple[Array, Array]:
        """(k, v) [L, B, Hkv, S, D]: where `append_layer` writes new tokens, at `append_slots`
        (a kernel that writes them itself returns them through `with_append_buffers`)."""
        return self.k, self.v

    def with_append_buffers(self, k: Array, v: Array) -> "DenseKVCache":
        return self.replace(k=k, v=v)

    def append_layer(self, layer: Array, k: Array, v: Array) -> "DenseKVCache":
        """Writes K/V [B, Hkv, T, D] of T new tokens after each row's committed tokens."""
        slots = self.append_slots(k.shape[2])
        return self.replace(k=_scatter_rows(self.k, layer, slots, k, contiguous=True),
                            v=_scatter_rows(self.v, layer, slots, v, contiguous=True))

    def finish_prefill(self, lengths: Array) -> "DenseKVCache":
        return self.replace(lengths=lengths.astype(jnp.int32))

    def advance(self, t: int | Array) -> "DenseKVCache":
        return self.replace(lengths=self.lengths + t)

    def total_lengths(self) -> Array:
        return self.lengths

    def tokens_until_flush(self) -> Array:
        """int32[B]: new tokens the cache can take before a flush changes what a query sees.
        A dense cache never requantizes: a large number."""
        return jnp.full_like(self.lengths, UNBOUNDED)

    def rollback(self, lengths: Array) -> "DenseKVCache":
        """Sets each row's committed length (only moves a length; nothing is copied)."""
        return self.replace(lengths=lengths.astype(jnp.int32))

    def flush(self) -> "DenseKVCache":
        return self

    def nbytes_by_component(self) -> dict[str, int]:
        return {"k": _nbytes(self.k), "v": _nbytes(self.v), "lengths": _nbytes(self.lengths)}


# ------------------------------------------------------------------------------ hierarchical
def ring_slots(group_size: int, gamma_max: int) -> int:
    """Ring size R: at least 2G + gamma_max, rounded up to RING_ALIGN."""
    need = 2 * group_size + gamma_max
    return int(math.ceil(need / RING_ALIGN) * RING_ALIGN)


def prefill_quantized_len(lengths: Array, group_size: int) -> Array:
    """Q = G * max(0, floor(P/G) - 1): how many prompt tokens prefill quantizes (SPEC §4)."""
    return group_size * jnp.maximum(0, lengths // group_size - 1)


FLUSH_ENV = "QSPEC_FLUSH"


def flush_form() -> str:
    """How a QuantSpecCache flushes (QSPEC_FLUSH): unset or "all" (the default): one 2-way cond on
    "any row flushes", inside it all rows' oldest G ring tokens quantized and the rows that do not
    flush dropped at the write; "rows": a while loop over the flushing rows, one row's
    [L, Hkv, G, D] quantized and written per trip (no trip when no row flushes), for batches of
    ragged rows. Both give the same bits."""
    form = os.environ.get(FLUSH_ENV, "all")
    if form not in ("all", "rows"):
        raise ValueError(f"{FLUSH_ENV}={form!r}: expected 'all' or 'rows'")
    return form


def _put_block(buf: Array, val: Array, row: Array, at: Array) -> Array:
    """buf [L, B, H, N, X] with val [L, 1, H, m, X] written at row `row`, positions at..at+m-1 of
    axis 3: one scatter window, dropped whole if it does not fit (at + m > N; XLA scatter
    semantics, as the all-rows flush drops a block past max_len)."""
    idx = jnp.stack([row, at]).astype(jnp.int32)[None]  # [1, 2]: (row, first position)
    dnums = jax.lax.ScatterDimensionNumbers(update_window_dims=(1, 2, 3, 4, 5), inserted_window_dims=(),
                                            scatter_dims_to_operand_dims=(1, 3))
    return jax.lax.scatter(buf, idx, val[None].astype(buf.dtype), dnums, indices_are_sorted=True,
                           unique_indices=True, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


@struct.dataclass
class QuantSpecCache:
    """Hierarchical INT8 KV cache (shared by the INT4 draft view and the INT8 target view)."""

    k_hi: Array
    k_lo: Array
    v_hi: Array
    v_lo: Array
    k_scale: Array
    k_zero: Array
    v_scale: Array
    v_zero: Array
    k_fp: Array
    v_fp: Array
    q_len: Array
    fp_len: Array
    fp_start: Array
    group_size: int = struct.field(pytree_node=False, default=DEFAULT_GROUP_SIZE)
    gamma_max: int = struct.field(pytree_node=False, default=DEFAULT_GAMMA_MAX)

    @classmethod
    def init(
        cls,
        cfg: ModelConfig,
        batch: int,
        max_len: int,
        group_size: int = DEFAULT_GROUP_SIZE,
        gamma_max: int = DEFAULT_GAMMA_MAX,
        scale_dtype: Any = jnp.float16,
        fp_dtype: Any = None,
    ) -> "QuantSpecCache":
        """An empty cache for `batch` rows of up to `max_len` tokens (a multiple of group_size).

        group_size: tokens per quantized key block, a power of two (the decode kernels tile the
        sequence by it and take 16..256; smaller powers serve the jnp reference path's tests)."""
        if not isinstance(group_size, (int, np.integer)) or group_size < 1 or group_size & (group_size - 1):
            raise ValueError(f"group_size={group_size!r} must be a power of two (16, 32, 64, 128 or 256 for the "
                             f"decode kernels; default {DEFAULT_GROUP_SIZE})")
        if max_len % group_size:
            raise ValueError(f"max_len={max_len} must be a multiple of group_size={group_size}")
        if not 1 <= gamma_max < group_size:
            # A round commits up to gamma_max + 1 tokens onto fp_len < 2G; one flush removes G, so
            # G <= fp_len < 2G after it needs gamma_max < G (SPEC §4).
            raise ValueError(f"gamma_max={gamma_max} must be >= 1 and < group_size={group_size}")
        L, B, H, D = cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim
        gv = quant.value_group_size(D)
        r = ring_slots(group_size, gamma_max)
        sd, fd = _dtype(scale_dtype), _dtype(fp_dtype or cfg.dtype)
        plane = lambda: jnp.zeros((L, B, H, max_len, D // 2), jnp.uint8)  # noqa: E731
        zeros_i = lambda: jnp.zeros((B,), jnp.int32)  # noqa: E731
        return cls(
            k_hi=plane(), k_lo=plane(), v_hi=plane(), v_lo=plane(),
            k_scale=jnp.zeros((L, B, H, max_len // group_size, D), sd),
            k_zero=jnp.zeros((L, B, H, max_len // group_size, D), sd),
            v_scale=jnp.zeros((L, B, H, max_len, D // gv), sd),
            v_zero=jnp.zeros((L, B, H, max_len, D // gv), sd),
            k_fp=jnp.zeros((L, B, H, r, D), fd),
            v_fp=jnp.zeros((L, B, H, r, D), fd),
            q_len=zeros_i(), fp_len=zeros_i(), fp_start=zeros_i(),
            group_size=group_size, gamma_max=gamma_max,
        )

    # ---------------------------------------------------------------------------- geometry
    @property
    def max_len(self) -> int:
        return self.k_hi.shape[3]

    @property
    def ring_size(self) -> int:
        return self.k_fp.shape[3]

    def total_lengths(self) -> Array:
        """int32[B]: committed tokens per row (quantized + ring)."""
        return self.q_len + self.fp_len

    def next_positions(self, t: int) -> Array:
        return self.total_lengths()[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]

    def tokens_until_flush(self) -> Array:
        """int32[B]: how many new tokens (positions from total_lengths() on) a query can add before
        the next flush is due, i.e. 2G - fp_len (>= 1 after a flush).

        Autoregressive decoding flushes as soon as fp_len reaches 2G, so the query at position p
        sees positions < G * max(0, p // G - 1) quantized and the rest at full precision. A
        speculative round flushes only after it ends; its rows at or past this horizon would see
        the next block at full precision where autoregressive decoding sees it quantized, so a
        round accepts no token past it (speculative.speculative_loop).
        """
        return (2 * self.group_size - self.fp_len).astype(jnp.int32)

    def ring_positions(self) -> Array:
        """int32[B, R]: logical position of every ring slot (garbage slots lie past the rows' ends)."""
        slot = jnp.arange(self.ring_size, dtype=jnp.int32)[None, :]
        return self.q_len[:, None] + (slot - self.fp_start[:, None]) % self.ring_size

    # ------------------------------------------------------------------------------ writes
    def prefill_layer(self, layer: Array, k: Array, v: Array, lengths: Array) -> "QuantSpecCache":
        """Places a right-padded prompt's K/V [B, Hkv, T, D] for one layer (SPEC §4 prefill):
        `prefill_chunk_layer` of the whole prompt."""
        return self.prefill_chunk_layer(layer, k, v, 0, lengths)

    def prefill_chunk_layer(self, layer: Array, k: Array, v: Array, start: Array | int,
                            lengths: Array) -> "QuantSpecCache":
        """Places K/V [B, Hkv, C, D] of prompt positions start..start+C-1 for one layer (a chunk of
        a chunked prefill, or the whole prompt with start 0), as SPEC §4's prefill places them.

        Every full G-block of the chunk is quantized at its position (`start` is a multiple of G);
        row b's positions Q_b..Q_b+R-1 that fall in the chunk go to ring slots 0..R-1, where
        Q_b = G*max(0, P_b//G - 1) (`prefill_quantized_len`), so after the last chunk the ring holds
        positions Q_b..P_b-1. Blocks at or past Q_b and ring slots past P_b - Q_b hold values that
        no query sees (later flushes overwrite the blocks). `finish_prefill` sets the lengths.
        """
        G, c = self.group_size, k.shape[2]
        _check_chunk(start, c, self.max_len)
        n_blocks = c // G
        new = {}
        if n_blocks:
            kb, vb = k[:, :, : n_blocks * G], v[:, :, : n_blocks * G]
            k_hi, k_lo, k_s, k_z = quant.quantize_keys_cache(kb, G, self.k_scale.dtype)
            v_hi, v_lo, v_s, v_z = quant.quantize_values_cache(vb, G, self.v_scale.dtype)
            for name, val in dict(k_hi=k_hi, k_lo=k_lo, v_hi=v_hi, v_lo=v_lo, k_scale=k_s, k_zero=k_z,
                                  v_scale=v_s, v_zero=v_z).items():
                at = start // G if name in BLOCK_FIELDS else start
                new[name] = jax.lax.dynamic_update_slice(getattr(self, name), val[None], (layer, 0, 0, at, 0))
        src = (prefill_quantized_len(lengths, G)[:, None] + jnp.arange(self.ring_size)[None, :]
               - start)  # [B, R]: index into the chunk of the position each ring slot holds
        inside = ((src >= 0) & (src < c))[:, None, :, None]
        idx = jnp.clip(src, 0, c - 1)[:, None, :, None]
        for name, x in (("k_fp", k), ("v_fp", v)):
            buf = getattr(self, name)
            b, h, r, d = buf.shape[1:]
            old = jax.lax.dynamic_slice(buf, (layer, 0, 0, 0, 0), (1, b, h, r, d))[0]
            ring = jnp.where(inside, jnp.take_along_axis(x, idx, axis=2).astype(buf.dtype), old)
            new[name] = jax.lax.dynamic_update_slice(buf, ring[None], (layer, 0, 0, 0, 0))
        return self.replace(**{name: _row_major(x) for name, x in new.items()})

    def finish_prefill(self, lengths: Array) -> "QuantSpecCache":
        q = prefill_quantized_len(lengths, self.group_size)
        return self.replace(q_len=q.astype(jnp.int32), fp_len=(lengths - q).astype(jnp.int32),
                            fp_start=jnp.zeros_like(self.fp_start))

    def append_slots(self, t: int) -> Array:
        """int32[B, T]: the ring slots of T new tokens after each row's committed ones."""
        j = self.fp_len[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        return ((self.fp_start[:, None] + j) % self.ring_size).astype(jnp.int32)

    @property
    def append_buffers(self) -> tuple[Array, Array]:
        """(k_fp, v_fp) [L, B, Hkv, R, D]: the FP rings `append_layer` writes new tokens to, at
        `append_slots` (a kernel that writes them itself returns them through `with_append_buffers`)."""
        return self.k_fp, self.v_fp

    def with_append_buffers(self, k: Array, v: Array) -> "QuantSpecCache":
        return self.replace(k_fp=k, v_fp=v)

    def append_layer(self, layer: Array, k: Array, v: Array) -> "QuantSpecCache":
        """Writes K/V [B, Hkv, T, D] of T new tokens into the ring slots after the committed ones
        (`append_slots`)."""
        t = k.shape[2]
        slots = self.append_slots(t)
        one = t == 1  # a single slot never wraps around the ring
        return self.replace(k_fp=_scatter_rows(self.k_fp, layer, slots, k, contiguous=one),
                            v_fp=_scatter_rows(self.v_fp, layer, slots, v, contiguous=one))

    def advance(self, t: int | Array) -> "QuantSpecCache":
        """Commits the t most recently appended tokens of every row."""
        return self.replace(fp_len=self.fp_len + t)

    def rollback(self, lengths: Array) -> "QuantSpecCache":
        """Sets each row's committed total length; only fp_len moves (tokens stay in the ring).

        `lengths` must be >= q_len: quantized tokens are never un-committed.
        """
        return self.replace(fp_len=(lengths - self.q_len).astype(jnp.int32))

    def flush(self) -> "QuantSpecCache":
        """Quantizes the oldest G ring tokens of every row with fp_len >= 2G (SPEC §4 flush).

        Afterwards G <= fp_len < 2G for every flushed row. Rows that do not flush are untouched.
        The caller sizes max_len for every token it will commit (generation does): a flush past
        max_len cannot raise inside jit, and its block is dropped.

        `flush_form` picks how: the all-rows flush under one cond (default), or the row loop (a
        while loop, one flushing row per trip). On the H200 at SmolLM2's batch 32: with ragged rows
        (a flush mostly one row's) the all-rows flush costs ~75 us a token of kernels and the row
        loop ~10 plus ~6 of its loop checks' syncs (profile: 2.320 against 2.379 ms a token); the
        real model's prompts of equal length flush in near lock-step, where the row loop's trips add
        up (QuantSpec decoding 12,949 against 13,249 tok/s); at batch 8 the all-rows flush is ahead
        (1.353 / 1.368 ms). A cond choosing between the two at run time cost ~1.3 ms a token of
        cache-sized copies, like quantizing only the flushing rows under conds (a chain of 2-way
        conds +1.2 ms; a `lax.switch` over row buckets +130 us of idle); docs/kernel_notes.md,
        43rd-45th sessions.
        """
        mask = self.fp_len >= 2 * self.group_size  # [B]
        if flush_form() == "rows":
            return self._flush_rows(mask)
        return jax.lax.cond(jnp.any(mask), lambda c: c._flush_all(mask), lambda c: c, self)

    def _oldest_quantized(self, slots: Array, row: Array | None = None) -> dict[str, Array]:
        """The ring tokens at `slots` (int32[n, G]) quantized as one block per row: the 8 quantized
        fields, each [L, n, H, ., .]; the ring's rows 0..n-1, or only `row` (n = 1)."""
        G = self.group_size
        ring = lambda x: x if row is None else jax.lax.dynamic_slice_in_dim(x, row, 1, axis=1)  # noqa: E731
        take = lambda x: jnp.take_along_axis(ring(x), slots[None, :, None, :, None], axis=3)  # noqa: E731
        k_old, v_old = take(self.k_fp), take(self.v_fp)  # [L, n, H, G, D]
        k_hi, k_lo, k_s, k_z = quant.quantize_keys_cache(k_old, G, self.k_scale.dtype)  # k_s: [L,n,H,1,D]
        v_hi, v_lo, v_s, v_z = quant.quantize_values_cache(v_old, G, self.v_scale.dtype)  # one block
        return dict(k_hi=k_hi, k_lo=k_lo, v_hi=v_hi, v_lo=v_lo, k_scale=k_s, k_zero=k_z, v_scale=v_s, v_zero=v_z)

    def _oldest_slots(self) -> Array:
        """int32[B, G]: each row's oldest G ring slots (wrapping around the ring)."""
        return (self.fp_start[:, None] + jnp.arange(self.group_size)[None, :]) % self.ring_size

    def _flushed(self, mask: Array, **planes: Array) -> "QuantSpecCache":
        """The cache with `planes` written and the rows in `mask` (bool[B]) advanced by one block."""
        G = self.group_size
        return self.replace(
            **planes,
            q_len=jnp.where(mask, self.q_len + G, self.q_len),
            fp_start=jnp.where(mask, (self.fp_start + G) % self.ring_size, self.fp_start),
            fp_len=jnp.where(mask, self.fp_len - G, self.fp_len),
        )

    def _flush_all(self, mask: Array) -> "QuantSpecCache":
        """The flush of the rows in `mask` (bool[B]): every row quantized, the others dropped."""
        G, S = self.group_size, self.max_len
        new = self._oldest_quantized(self._oldest_slots())
        b = jnp.arange(mask.shape[0])[:, None]  # [B, 1]
        tok = jnp.where(mask[:, None], self.q_len[:, None] + jnp.arange(G)[None, :], S)  # [B, G]; S drops
        blk = jnp.where(mask, self.q_len // G, S // G)[:, None]  # [B, 1]

        def put(name: str) -> Array:
            # buf [L, B, H, N, X]; idx [B, m]; val [L, B, H, m, X] -> update laid out [B, m, L, H, X].
            buf, idx = getattr(self, name), blk if name in BLOCK_FIELDS else tok
            upd = jnp.transpose(new[name], (1, 3, 0, 2, 4)).astype(buf.dtype)
            return buf.at[:, b, :, idx].set(upd, mode="drop")

        return self._flushed(mask, **{name: put(name) for name in new})

    def _flush_rows(self, mask: Array) -> "QuantSpecCache":
        """The flush of the rows in `mask` (bool[B]) as a while loop, one row per trip: the row's
        oldest G ring tokens ([L, 1, H, G, D]) quantized and written as one window per field."""
        G, slots = self.group_size, self._oldest_slots()

        def trip(carry: tuple["QuantSpecCache", Array]) -> tuple["QuantSpecCache", Array]:
            cache, todo = carry
            b = jnp.argmax(todo).astype(jnp.int32)  # the first row still to flush
            new = cache._oldest_quantized(jax.lax.dynamic_slice_in_dim(slots, b, 1), row=b)
            q = self.q_len[b]
            planes = {name: _put_block(getattr(cache, name), val, b, q // G if name in BLOCK_FIELDS else q)
                      for name, val in new.items()}
            return cache.replace(**planes), todo.at[b].set(False)

        cache, _ = jax.lax.while_loop(lambda c: jnp.any(c[1]), trip, (self, mask))
        return cache._flushed(mask)

    # ------------------------------------------------------------------------------- reads
    def dequantized_layer(self, layer: Array | int, view: str = "target") -> tuple[Array, Array]:
        """float32 K, V [B, Hkv, S_max, D] of the quantized planes of one layer (tests, tools, the
        reference chunked prefill)."""
        return self.dequantized_span(layer, 0, self.max_len, view, jnp.float32)

    def dequantized_span(self, layer: Array | int, start: Array | int, length: int, view: str = "target",
                         dtype: Any = jnp.float32) -> tuple[Array, Array]:
        """K, V [B, Hkv, length, D] in `dtype` of quantized positions start..start+length-1 of one
        layer, through the draft ("draft": upper nibble) or target ("target": both) view. `start`
        and `length` are multiples of G (values are stored per G-token block)."""
        G = self.group_size
        _, b, h, _, _ = self.k_hi.shape

        def take(x: Array, at: Array | int, n: int) -> Array:
            return jax.lax.dynamic_slice(x, (layer, 0, 0, at, 0), (1, b, h, n, x.shape[-1]))[0]

        lo = view == "target"
        tok = lambda x: take(x, start, length)  # noqa: E731
        k = quant.dequantize_keys_cache(tok(self.k_hi), tok(self.k_lo) if lo else None,
                                        take(self.k_scale, start // G, length // G),
                                        take(self.k_zero, start // G, length // G))
        v = quant.dequantize_values_cache(tok(self.v_hi), tok(self.v_lo) if lo else None,
                                          tok(self.v_scale), tok(self.v_zero), G)
        return k.astype(dtype), v.astype(dtype)

    def nbytes_by_component(self) -> dict[str, int]:
        """Bytes held by each part of the cache."""
        n = lambda *xs: sum(_nbytes(x) for x in xs)  # noqa: E731
        parts = {
            "upper_planes": n(self.k_hi, self.v_hi),
            "lower_planes": n(self.k_lo, self.v_lo),
            "scales_zeros": n(self.k_scale, self.k_zero, self.v_scale, self.v_zero),
            "fp_ring": n(self.k_fp, self.v_fp),
            "lengths": n(self.q_len, self.fp_len, self.fp_start),
        }
        return parts


def cache_bytes(kind: str, cfg: ModelConfig, batch: int, max_len: int, **kwargs: Any) -> dict[str, int]:
    """Bytes by component of a cache of `kind` ("bf16" dense or "int8" hierarchical), without
    allocating it. Used by benchmarks and by the max-context planner."""
    if kind == "bf16":
        shapes = jax.eval_shape(lambda: DenseKVCache.init(cfg, batch, max_len, **kwargs))
    elif kind == "int8":
        shapes = jax.eval_shape(lambda: QuantSpecCache.init(cfg, batch, max_len, **kwargs))
    else:
        raise ValueError(f"cache kind {kind!r}; expected 'bf16' or 'int8'")
    return {k: int(v) for k, v in shapes.nbytes_by_component().items()}


