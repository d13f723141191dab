"""QuantSpecCache: layout (SPEC §3) and the FP buffer protocol (SPEC §4), checked against a model.

The stateful test drives a 3-row, 2-layer cache through prefill, draft/verify appends, per-row
commits (advance / rollback) and flushes, and keeps a numpy model of every row's committed K/V.
After every step it checks, per row:

- lengths: q_len + fp_len == committed tokens, q_len a multiple of G and as predicted, fp_start
  as predicted, fp_len < 2G after a flush and >= G once the row holds >= G tokens;
- no token lost: position t < q_len is quantized (dequantizes within the SPEC §2 bounds of the
  stored scales, draft and target views), position t >= q_len sits exactly (float32 ring) in slot
  (fp_start + t - q_len) mod R;
- no token quantized twice: the quantized region below the previous q_len stays bit-identical;
- rows never disturb each other: every operation changes only what it must (bit-identical
  elsewhere, including the rows a flush masks off).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from qspec_jax import quant
from qspec_jax.cache import (
    RING_ALIGN,
    DenseKVCache,
    QuantSpecCache,
    cache_bytes,
    prefill_quantized_len,
    ring_slots,
)
from qspec_jax.config import ModelConfig

NUM_LAYERS, BATCH, HKV, HEAD_DIM = 2, 3, 2, 8
MAX_LEN = 512
GAMMA_MAX = 3  # < G: a round (<= gamma_max + 1 tokens) then one flush restores fp_len < 2G
GAMMA_MAX_FOR = {4: 3, 8: 7}  # state machine: the largest gamma_max < G (ring of 32 slots either way)
PROMPT_PAD = {4: 21, 8: 40}  # padded prompt lengths: a partial last block, and a whole number of blocks
CFG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=NUM_LAYERS,
                  num_heads=2 * HKV, num_kv_heads=HKV, head_dim=HEAD_DIM, dtype="float32")
SCALE_DTYPES = {"float16": jnp.float16, "float32": jnp.float32}
FIELDS = ("k_hi", "k_lo", "v_hi", "v_lo", "k_scale", "k_zero", "v_scale", "v_zero", "k_fp", "v_fp",
          "q_len", "fp_len", "fp_start")


# ------------------------------------------------------------------------------ jitted cache ops
@jax.jit
def _prefill(cache, k, v, lengths):
    """k, v: [L, B, H, T, D]."""
    for layer in range(k.shape[0]):
        cache = cache.prefill_layer(jnp.asarray(layer, jnp.int32), k[layer], v[layer], lengths)
    return cache.finish_prefill(lengths)


@jax.jit
def _append(cache, k, v):
    for layer in range(k.shape[0]):
        cache = cache.append_layer(jnp.asarray(layer, jnp.int32), k[layer], v[layer])
    return cache


_advance = jax.jit(lambda c, t: c.advance(t))
_rollback = jax.jit(lambda c, lengths: c.rollback(lengths))
_flush = jax.jit(lambda c: c.flush())


_qkeys = jax.jit(quant.quantize_keys, static_argnums=(1, 2))
_qvalues = jax.jit(quant.quantize_values, static_argnums=(1,))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _dequant(cache, layer, view):
    return cache.dequantized_layer(layer, view)


@jax.jit
def _dequant_all(cache):
    """{(layer, view): (K, V)} for every layer and both views, in one compiled call."""
    return {(layer, view): cache.dequantized_layer(layer, view)
            for layer in range(cache.k_hi.shape[0]) for view in ("draft", "target")}


@functools.lru_cache(maxsize=None)
def _init(group, scale_dtype_name):
    return QuantSpecCache.init(CFG, BATCH, MAX_LEN, group_size=group, gamma_max=GAMMA_MAX_FOR[group],
                               scale_dtype=SCALE_DTYPES[scale_dtype_name], fp_dtype=jnp.float32)


# ------------------------------------------------------------------------------------- helpers
def snapshot(cache) -> dict[str, np.ndarray]:
    return {name: np.array(getattr(cache, name)) for name in FIELDS}


def _bits(x: np.ndarray) -> np.ndarray:
    """Bitwise view, so that "unchanged" means bit-identical (also for -0.0 and NaN)."""
    return x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.dtype.kind == "f" else x


def assert_changes_only(before: dict, after: dict, allowed: dict[str, np.ndarray], what: str) -> None:
    """Every field is bit-identical outside its `allowed` mask (absent: no change allowed)."""
    for name in FIELDS:
        changed = _bits(before[name]) != _bits(after[name])
        mask = allowed.get(name)
        if mask is not None:
            changed &= ~np.broadcast_to(mask, changed.shape)
        if changed.any():
            idx = np.argwhere(changed)[:5]
            raise AssertionError(f"{what}: {name} changed where it must not, e.g. at {idx.tolist()}")


def np_unpack(packed) -> np.ndarray:
    p = np.asarray(packed).astype(np.int64)
    return np.concatenate([p & 0xF, p >> 4], axis=-1)


def np_logical_bytes(plane) -> np.ndarray:
    """Undoes the cache's byte order (SPEC §3): in each whole 16-byte group of a row, stored byte
    4j + i is logical byte 2j + i // 2 + 8 (i % 2)."""
    p = np.asarray(plane)
    n = p.shape[-1] - p.shape[-1] % 16
    out = p.copy()
    for q in range(n):
        j, i = (q % 16) // 4, q % 4
        out[..., q - q % 16 + 2 * j + i // 2 + 8 * (i % 2)] = p[..., q]
    return out


def np_key_codes(plane) -> np.ndarray:
    """Cache key plane [..., S, D/2] -> codes [..., S, D] (split halves per token)."""
    return np_unpack(np_logical_bytes(plane))


def np_value_codes(plane, G: int) -> np.ndarray:
    """Cache value plane [..., S, D/2] -> codes [..., S, D]: each block of G tokens is a [D, G/2]
    byte array (channel c, token t low nibble, token t + G/2 high nibble)."""
    p = np.asarray(plane).astype(np.int64)
    *lead, s, dh = p.shape
    blocks = np_logical_bytes(p.reshape(*lead, s // G, 2 * dh, G // 2))
    tok = np.concatenate([blocks & 0xF, blocks >> 4], axis=-1)  # [..., n, D, G]
    return np.swapaxes(tok, -1, -2).reshape(*lead, s, 2 * dh)


def check_dequant_bounds(x, draft, target, upper, lower_b, s, z, what: str) -> None:
    """SPEC §2 bounds of the cache's dequantized draft/target values against its stored s, z,
    and the views are the formulas of the stored codes (draft: upper plane only)."""
    x, draft, target, u, lb, s, z = (np.asarray(a, np.float64) for a in (x, draft, target, upper, lower_b, s, z))
    mag = np.maximum(np.abs(x), np.abs(z) + 15 * s)
    eps = 8 * np.spacing(mag.astype(np.float32)).astype(np.float64) + 1e-6 * s
    np.testing.assert_array_less(np.abs(draft - (u * s + z)), eps + 1e-30, err_msg="draft view " + what)
    np.testing.assert_array_less(np.abs(target - (u * s + (lb - 8) * s / 16 + z)), eps + 1e-30,
                                 err_msg="target view " + what)
    assert np.all(np.isfinite(draft)) and np.all(np.isfinite(target)), what
    assert np.all(z <= x + eps), what
    err_d = np.abs(x - draft)
    bad = err_d > s / 2 + eps
    assert not bad.any(), f"{what}: draft error {err_d[bad][:4]} > s/2 ({s[bad][:4] / 2})"
    err_t = np.abs(x - target)
    over = err_t > s / 32 + eps
    # Only a clamped lower nibble (L = +7, stored 15) may exceed s/32, by at most s/32.
    bad = over & ~((lb == 15) & (err_t <= s / 16 + eps))
    assert not bad.any(), f"{what}: target error {err_t[bad][:4]} > s/32 ({s[bad][:4] / 32})"
    # Constant groups (s == 0) are exact.
    zs = s == 0
    assert np.array_equal(target[zs], x[zs]) and np.array_equal(draft[zs], x[zs]), what


def random_kv(rng: np.random.Generator, n: int, key_const: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K, V of n tokens: [n, L, H, D] float32 with outliers and constant groups.

    Key channel 0 of each (layer, head) is a per-row constant `key_const` ([L, H]), so every
    key block has a constant channel (s = 0, must be exact). Some value tokens are constant.
    """
    shape = (n, NUM_LAYERS, HKV, HEAD_DIM)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k[rng.random(shape) < 0.02] *= 100
    v[rng.random(shape) < 0.02] *= 100
    k[..., 0] = key_const
    const_v = rng.random(shape[:3]) < 0.1
    v[const_v] = (np.round(rng.standard_normal((int(const_v.sum()), 1)) * 8) / 8).astype(np.float32)
    return k, v


def to_cache_layout(x: np.ndarray) -> np.ndarray:
    """[B][T, L, H, D] per-row token lists (same T) -> [L, B, H, T, D]."""
    return np.ascontiguousarray(np.transpose(np.stack(x), (2, 0, 3, 1, 4)))


# ------------------------------------------------------------------------------ state machine
class QuantSpecCacheMachine(RuleBasedStateMachine):
    """Model: per row, the committed K/V tokens; plus the appended-but-uncommitted ones."""

    # --------------------------------------------------------------------------- setup
    # (G, scale dtype): two cache structures only, since every structure costs ~20 compiles
    # (test_quant.py covers both scale dtypes for every group size).
    @initialize(config=st.sampled_from([(4, "float16"), (8, "float32")]), seed=st.integers(0, 2**32 - 1),
                data=st.data())
    def setup(self, config, seed, data):
        group, sd = config
        self.G = group
        self.sd = sd
        self.rng = np.random.default_rng(seed)
        self.cache = _init(group, sd)
        self.R = self.cache.ring_size
        self.gmax = GAMMA_MAX_FOR[group]
        self.gammas = sorted({1, 2, self.gmax})  # few append shapes: each one is a compile
        assert self.R == ring_slots(group, self.gmax) and self.R >= 2 * group + self.gmax
        # Multiples of 1/4: exact in float16 too, so constant key channels get s = 0.
        self.key_const = (np.round(self.rng.standard_normal((BATCH, NUM_LAYERS, HKV)) * 4) / 4).astype(np.float32)
        self.K = [np.zeros((0, NUM_LAYERS, HKV, HEAD_DIM), np.float32) for _ in range(BATCH)]
        self.V = [np.zeros((0, NUM_LAYERS, HKV, HEAD_DIM), np.float32) for _ in range(BATCH)]
        self.pending_k: list[np.ndarray] | None = None
        self.pending_v: list[np.ndarray] | None = None
        self.q = np.zeros(BATCH, np.int64)
        self.start = np.zeros(BATCH, np.int64)
        self.snap = snapshot(self.cache)
        self._frozen = None
        if data.draw(st.booleans(), label="prefill first"):
            self._prefill(data, fresh=True)
        self.check_all()

    # --------------------------------------------------------------------------- model helpers
    def lengths(self) -> np.ndarray:
        return np.array([len(k) for k in self.K], np.int64)

    def _set_and_check(self, new_cache, allowed: dict, what: str) -> None:
        after = snapshot(new_cache)
        assert_changes_only(self.snap, after, allowed, what)
        self.cache, self.snap = new_cache, after

    def _prefill(self, data, fresh: bool) -> None:
        G = self.G
        t_pad = PROMPT_PAD[G]  # one padded length per G (each shape is a compile); P varies per row
        p = np.array(data.draw(st.lists(st.integers(0, t_pad), min_size=BATCH, max_size=BATCH), label="P"))
        kv = [random_kv(self.rng, t_pad, self.key_const[b]) for b in range(BATCH)]
        ks = [kv[b][0].copy() for b in range(BATCH)]
        vs = [kv[b][1].copy() for b in range(BATCH)]
        for b in range(BATCH):  # padding: loud garbage that must never be seen
            ks[b][p[b]:] = 1e4
            vs[b][p[b]:] = -1e4
        base = _init(G, self.sd) if fresh else self.cache
        cache = _prefill(base, jnp.asarray(to_cache_layout(ks)), jnp.asarray(to_cache_layout(vs)),
                         jnp.asarray(p, jnp.int32))
        self.K = [ks[b][: p[b]] for b in range(BATCH)]
        self.V = [vs[b][: p[b]] for b in range(BATCH)]
        self.pending_k = self.pending_v = None
        self._frozen = None
        q_expect = G * np.maximum(0, p // G - 1)
        np.testing.assert_array_equal(np.asarray(prefill_quantized_len(jnp.asarray(p), G)), q_expect)
        self.q = q_expect.astype(np.int64)
        self.start = np.zeros(BATCH, np.int64)
        fp = p - q_expect
        # SPEC §4: fp_len in [G, 2G) when P >= G, == P when P < G.
        assert np.all(np.where(p >= G, (fp >= G) & (fp < 2 * G), fp == p))
        self.cache, self.snap = cache, snapshot(cache)

    # ------------------------------------------------------------------------------ rules
    @precondition(lambda self: int(self.lengths().max()) == 0 or int(self.lengths().max()) > 96)
    @rule(data=st.data(), fresh=st.booleans())
    def reprefill(self, data, fresh):
        """A new batch: prefill either a fresh cache or the used one (its stale data must not leak)."""
        self._prefill(data, fresh)

    @precondition(lambda self: self._can_append())
    @rule(data=st.data())
    def append(self, data):
        """Writes t new tokens after every row's committed ones (a verify pass over earlier drafts
        overwrites the same slots)."""
        self._append(data.draw(st.sampled_from([1] + [g + 1 for g in self.gammas]), label="t"))

    def _append(self, t: int) -> None:
        new = [random_kv(self.rng, t, self.key_const[b]) for b in range(BATCH)]
        cache = _append(self.cache, jnp.asarray(to_cache_layout([n[0] for n in new])),
                        jnp.asarray(to_cache_layout([n[1] for n in new])))
        lens, fp = self.lengths(), self.snap["fp_len"]
        ring_mask = np.zeros((1, BATCH, 1, self.R, 1), bool)
        for b in range(BATCH):
            slots = (self.start[b] + fp[b] + np.arange(t)) % self.R
            assert fp[b] + t <= self.R  # protocol: the ring never overflows
            ring_mask[0, b, 0, slots] = True
        self._set_and_check(cache, {"k_fp": ring_mask, "v_fp": ring_mask}, f"append {t}")
        if self.pending_k is None:
            self.pending_k = [np.zeros((0, NUM_LAYERS, HKV, HEAD_DIM), np.float32) for _ in range(BATCH)]
            self.pending_v = [np.zeros((0, NUM_LAYERS, HKV, HEAD_DIM), np.float32) for _ in range(BATCH)]
        for b in range(BATCH):  # the new tokens overwrite the first t pending slots
            self.pending_k[b] = np.concatenate([new[b][0], self.pending_k[b][t:]])
            self.pending_v[b] = np.concatenate([new[b][1], self.pending_v[b][t:]])
        # The ring holds exactly the new values in the slots after the committed ones.
        kfp = self.snap["k_fp"]
        for b in range(BATCH):
            slots = (self.start[b] + fp[b] + np.arange(t)) % self.R
            np.testing.assert_array_equal(np.transpose(kfp[:, b][:, :, slots], (2, 0, 1, 3)), new[b][0])
        assert np.array_equal(self.snap["q_len"] + self.snap["fp_len"], lens)

    @precondition(lambda self: self.pending_k is None and self._can_append())
    @rule(data=st.data())
    def draft_then_verify(self, data):
        """A protocol round up to acceptance: gamma draft steps (append 1 + advance 1 each),
        rollback to the round's start, then a verify append of gamma + 1 tokens over them."""
        self._draft_then_verify(data.draw(st.sampled_from(self.gammas), label="gamma"), check=True)

    def _draft_then_verify(self, gamma: int, check: bool) -> None:
        old = self.lengths()
        for _ in range(gamma):
            self._append(1)
            self._commit(np.array([len(p) for p in self.pending_k]), how="advance")
            if check:
                self.check_all()
        self._commit(old - self.lengths(), how="rollback")  # back to the round's start (model: truncate)
        if check:
            self.check_all()
        self._append(gamma + 1)

    @precondition(lambda self: self.pending_k is None and self._can_append())
    @rule(data=st.data(), rounds=st.integers(1, 6))
    def full_rounds(self, data, rounds):
        """Whole rounds: (draft +) verify append, per-row acceptance, flush; checked after each."""
        for _ in range(rounds):
            if not self._can_append():
                break
            gamma = data.draw(st.sampled_from(self.gammas), label="gamma")
            if data.draw(st.booleans(), label="with draft steps"):
                self._draft_then_verify(gamma, check=False)
            else:
                self._append(gamma + 1)
            n = np.array(data.draw(st.lists(st.integers(0, gamma + 1), min_size=BATCH, max_size=BATCH),
                                   label="accepted + 1"))
            self._commit(n, how="rollback")
            self.pending_k = self.pending_v = None
            self.flush()
            self.check_all()

    @precondition(lambda self: self.pending_k is not None)
    @rule(data=st.data(), how=st.sampled_from(["rollback", "advance_then_rollback", "advance_array"]))
    def commit(self, data, how):
        """Accept n_b of the pending tokens in row b (n_b in 0..T)."""
        t = len(self.pending_k[0])
        n = np.array(data.draw(st.lists(st.integers(0, t), min_size=BATCH, max_size=BATCH), label="n"))
        if how == "advance_then_rollback":
            self._commit(np.full(BATCH, t), how="advance")
            self.check_all()
            self._commit(n - t, how="rollback")
        else:
            self._commit(n, how="rollback" if how == "rollback" else "advance")
        self.pending_k = self.pending_v = None

    @rule()
    def flush(self):
        G, R = self.G, self.R
        before = self.snap
        flushing = before["fp_len"] >= 2 * G
        cache = _flush(self.cache)
        allowed = {name: np.zeros(before[name].shape, bool) for name in FIELDS}
        for b in np.flatnonzero(flushing):
            q = int(before["q_len"][b])
            assert q + G <= MAX_LEN
            for name in ("k_hi", "k_lo", "v_hi", "v_lo", "v_scale", "v_zero"):
                allowed[name][:, b, :, q : q + G] = True
            for name in ("k_scale", "k_zero"):
                allowed[name][:, b, :, q // G] = True
            for name in ("q_len", "fp_len", "fp_start"):
                allowed[name][b] = True
        self._set_and_check(cache, allowed, "flush")
        after = self.snap
        np.testing.assert_array_equal(after["q_len"], np.where(flushing, before["q_len"] + G, before["q_len"]))
        np.testing.assert_array_equal(after["fp_len"], np.where(flushing, before["fp_len"] - G, before["fp_len"]))
        np.testing.assert_array_equal(after["fp_start"],
                                      np.where(flushing, (before["fp_start"] + G) % R, before["fp_start"]))
        self.q = np.where(flushing, self.q + G, self.q)
        event(f"flush rows={int(flushing.sum())}")
        if np.any(flushing & (after["fp_start"] < before["fp_start"])):
            event("ring wrapped")
        self.start = np.where(flushing, (self.start + G) % R, self.start)
        # After a flush: fp_len < 2G, and >= G once the row holds >= G tokens.
        assert np.all(after["fp_len"] < 2 * G), after["fp_len"]
        assert np.all((self.lengths() < G) | (after["fp_len"] >= G)), after["fp_len"]
        # The flushed block was quantized from exactly the oldest G ring tokens of the row.
        for b in np.flatnonzero(flushing):
            q = int(before["q_len"][b])
            toks_k = np.transpose(self.K[b][q : q + G], (1, 2, 0, 3))  # [L, H, G, D]
            toks_v = np.transpose(self.V[b][q : q + G], (1, 2, 0, 3))
            ring_slots_b = (before["fp_start"][b] + np.arange(G)) % R
            np.testing.assert_array_equal(before["k_fp"][:, b][:, :, ring_slots_b], toks_k)
            _, _, k_s, k_z = _qkeys(jnp.asarray(toks_k), G, SCALE_DTYPES[self.sd])
            _, _, v_s, v_z = _qvalues(jnp.asarray(toks_v), SCALE_DTYPES[self.sd])
            for name, want in (("k_scale", k_s[:, :, 0]), ("k_zero", k_z[:, :, 0])):
                np.testing.assert_array_equal(after[name][:, b, :, q // G], np.asarray(want), err_msg=name)
            for name, want in (("v_scale", v_s), ("v_zero", v_z)):
                np.testing.assert_array_equal(after[name][:, b, :, q : q + G], np.asarray(want), err_msg=name)

    # ------------------------------------------------------------------------- rule helpers
    def _can_append(self) -> bool:
        """Protocol: a round starts from a flushed state (fp_len < 2G) and never runs past max_len."""
        fp = self.snap["fp_len"]
        return bool(np.all(fp < 2 * self.G)) and int(self.lengths().max()) + 2 * (self.gmax + 1) <= MAX_LEN

    def _commit(self, n: np.ndarray, how: str) -> None:
        """Row b's committed length moves by n[b] (n may be negative only to undo own advances)."""
        old = self.lengths()
        new_len = old + n
        if how == "advance":
            if np.all(n == n[0]) and self.rng.random() < 0.5:
                cache = _advance(self.cache, int(n[0]))
            else:
                cache = _advance(self.cache, jnp.asarray(n, jnp.int32))
        else:
            cache = _rollback(self.cache, jnp.asarray(new_len, jnp.int32))
        allowed = {"fp_len": np.ones(BATCH, bool)}
        self._set_and_check(cache, allowed, how)
        for b in range(BATCH):
            if n[b] >= 0:
                self.K[b] = np.concatenate([self.K[b], self.pending_k[b][: n[b]]])
                self.V[b] = np.concatenate([self.V[b], self.pending_v[b][: n[b]]])
                self.pending_k[b] = self.pending_k[b][n[b]:]
                self.pending_v[b] = self.pending_v[b][n[b]:]
            else:  # un-commit: tokens go back to the front of the pending window
                self.pending_k[b] = np.concatenate([self.K[b][n[b]:], self.pending_k[b]])
                self.pending_v[b] = np.concatenate([self.V[b][n[b]:], self.pending_v[b]])
                self.K[b], self.V[b] = self.K[b][: n[b]], self.V[b][: n[b]]
        assert np.all(self.lengths() >= self.q)

    # --------------------------------------------------------------------------- invariants
    @invariant()
    def invariants(self):
        self.check_all()

    def check_all(self) -> None:
        snap, G, R = self.snap, self.G, self.R
        lens = self.lengths()
        q, fp, start = snap["q_len"], snap["fp_len"], snap["fp_start"]
        np.testing.assert_array_equal(q, self.q)
        np.testing.assert_array_equal(start, self.start)
        np.testing.assert_array_equal(q + fp, lens)
        np.testing.assert_array_equal(np.asarray(self.cache.total_lengths()), lens)
        assert np.all(q % G == 0) and np.all(q >= 0) and np.all(fp >= 0) and np.all(fp <= R)
        assert np.all((start >= 0) & (start < R))
        assert np.all((lens < G) | (fp >= G)), (lens, fp)  # the G most recent tokens are FP
        assert np.all(fp < 2 * G + self.gmax + 1)
        # ring_positions: committed slot j holds position q + j.
        pos = np.asarray(self.cache.ring_positions())
        for b in range(BATCH):
            slots = (start[b] + np.arange(fp[b])) % R
            np.testing.assert_array_equal(pos[b, slots], q[b] + np.arange(fp[b]))
            assert np.all(np.delete(pos[b], slots) >= lens[b])  # the other slots lie past the end

        deq = jax.tree.map(np.asarray, _dequant_all(self.cache))
        for layer in range(NUM_LAYERS):
            kd, vd = deq[(layer, "draft")]
            kt, vt = deq[(layer, "target")]
            for b in range(BATCH):
                qb, nb = int(q[b]), int(lens[b])
                k_true = np.transpose(self.K[b][:, layer], (1, 0, 2))  # [H, n, D]
                v_true = np.transpose(self.V[b][:, layer], (1, 0, 2))
                where = f"G={G} {self.sd} layer {layer} row {b}"
                if qb:
                    ks = np.repeat(snap["k_scale"][layer, b][:, : qb // G], G, axis=1)
                    kz = np.repeat(snap["k_zero"][layer, b][:, : qb // G], G, axis=1)
                    ku, klb = np_key_codes(snap["k_hi"][layer, b][:, :qb]), np_key_codes(snap["k_lo"][layer, b][:, :qb])
                    check_dequant_bounds(k_true[:, :qb], kd[b, :, :qb], kt[b, :, :qb], ku, klb, ks, kz,
                                         "K " + where)
                    vs = np.repeat(snap["v_scale"][layer, b][:, :qb], HEAD_DIM, axis=-1)
                    vz = np.repeat(snap["v_zero"][layer, b][:, :qb], HEAD_DIM, axis=-1)
                    vu = np_value_codes(snap["v_hi"][layer, b][:, :qb], G)
                    vlb = np_value_codes(snap["v_lo"][layer, b][:, :qb], G)
                    check_dequant_bounds(v_true[:, :qb], vd[b, :, :qb], vt[b, :, :qb], vu, vlb, vs, vz,
                                         "V " + where)
                slots = (start[b] + np.arange(nb - qb)) % R
                np.testing.assert_array_equal(snap["k_fp"][layer, b][:, slots], k_true[:, qb:], err_msg=where)
                np.testing.assert_array_equal(snap["v_fp"][layer, b][:, slots], v_true[:, qb:], err_msg=where)

        # No token quantized twice: the quantized region below the last q_len is frozen.
        prev = self._frozen
        if prev is not None and np.all(q >= prev["q"]):
            for b in range(BATCH):
                qb = int(prev["q"][b])
                for name in ("k_hi", "k_lo", "v_hi", "v_lo", "v_scale", "v_zero"):
                    assert np.array_equal(_bits(snap[name][:, b, :, :qb]), _bits(prev[name][:, b, :, :qb])), name
                for name in ("k_scale", "k_zero"):
                    assert np.array_equal(_bits(snap[name][:, b, :, : qb // G]),
                                          _bits(prev[name][:, b, :, : qb // G])), name
        self._frozen = {"q": q.copy(), **{n: snap[n] for n in FIELDS}}

    def teardown(self):
        if hasattr(self, "q"):
            event(f"max q_len blocks >= {min(int(self.q.max()) // self.G, 8)}")


QuantSpecCacheMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestQuantSpecCacheProtocol = QuantSpecCacheMachine.TestCase
TestQuantSpecCacheProtocol.pytestmark = [pytest.mark.slow]  # a long hypothesis state machine


# ------------------------------------------------------------------------ protocol edge cases
def test_gamma_max_must_be_below_group_size():
    """With gamma_max >= G a round could leave fp_len >= 3G, and one flush (G tokens) would not
    restore G <= fp_len < 2G (SPEC §4); the cache refuses such a configuration."""
    with pytest.raises(ValueError, match="gamma_max=8 must be >= 1 and < group_size=4"):
        QuantSpecCache.init(CFG, 1, 64, group_size=4, gamma_max=8, fp_dtype=jnp.float32)
    G, gamma_max = 8, 7  # the largest allowed: full acceptance every round keeps the invariant
    cache = QuantSpecCache.init(CFG, 1, 128, group_size=G, gamma_max=gamma_max, fp_dtype=jnp.float32)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((NUM_LAYERS, 1, HKV, 2 * G - 1, HEAD_DIM)), jnp.float32)
    cache = _prefill(cache, k, k, jnp.asarray([2 * G - 1], jnp.int32))  # fp_len = 2G - 1 < 2G
    for _ in range(6):  # full acceptance every round: fp_len += gamma_max + 1, then flush
        new = jnp.asarray(rng.standard_normal((NUM_LAYERS, 1, HKV, gamma_max + 1, HEAD_DIM)), jnp.float32)
        cache = _flush(_advance(_append(cache, new, new), gamma_max + 1))
        assert G <= int(cache.fp_len[0]) < 2 * G, int(cache.fp_len[0])


def test_prefill_lengths_spec_table():
    G = 8
    p = jnp.arange(0, 6 * G, dtype=jnp.int32)
    q = np.asarray(prefill_quantized_len(p, G))
    for pp, qq in zip(np.asarray(p), q):
        assert qq == G * max(0, pp // G - 1) and qq % G == 0
        fp = pp - qq
        assert (G <= fp < 2 * G) if pp >= G else fp == pp


def test_prefill_rows_independent_and_padding_invisible():
    """Rows of one prefill with different P do not see each other's or the padding's values."""
    G = 4
    cache = QuantSpecCache.init(CFG, BATCH, 32, group_size=G, gamma_max=GAMMA_MAX, scale_dtype=jnp.float32,
                                fp_dtype=jnp.float32)
    rng = np.random.default_rng(3)
    t = 13
    k = rng.standard_normal((NUM_LAYERS, BATCH, HKV, t, HEAD_DIM)).astype(np.float32)
    p = np.array([13, 5, 0])
    lone = []
    for b in range(BATCH):
        kb = k.copy()
        kb[:, [x for x in range(BATCH) if x != b]] = 7e3  # other rows: garbage
        kb[:, b, :, p[b]:] = -7e3  # own padding: garbage
        lone.append(_prefill(cache, jnp.asarray(kb), jnp.asarray(kb), jnp.asarray(p, jnp.int32)))
    full = _prefill(cache, jnp.asarray(k), jnp.asarray(k), jnp.asarray(p, jnp.int32))
    for b in range(BATCH):
        q, fp = int(full.q_len[b]), int(full.fp_len[b])
        assert q + fp == p[b]
        for layer in range(NUM_LAYERS):
            for view in ("draft", "target"):
                a = np.asarray(_dequant(full, layer, view)[0])[b, :, :q]
                c = np.asarray(_dequant(lone[b], layer, view)[0])[b, :, :q]
                np.testing.assert_array_equal(a, c)
            np.testing.assert_array_equal(np.asarray(full.k_fp)[layer, b, :, :fp],
                                          np.asarray(lone[b].k_fp)[layer, b, :, :fp])


# ----------------------------------------------------------------------------- init and sizes
def test_init_rejects_bad_arguments():
    with pytest.raises(ValueError, match="multiple"):
        QuantSpecCache.init(CFG, 1, 100, group_size=32)
    with pytest.raises(ValueError):
        QuantSpecCache.init(CFG, 1, 96, group_size=32, gamma_max=0)
    cache = QuantSpecCache.init(CFG, 1, 16, group_size=8, gamma_max=2)
    with pytest.raises(ValueError):
        x = jnp.zeros((1, HKV, 24, HEAD_DIM))
        cache.prefill_layer(0, x, x, jnp.asarray([24]))


@pytest.mark.parametrize("group,gamma_max", [(4, 1), (8, 3), (32, 8), (128, 8), (128, 40), (64, 63)])
def test_ring_slots(group, gamma_max):
    r = ring_slots(group, gamma_max)
    assert r >= 2 * group + gamma_max and r % RING_ALIGN == 0 and r - RING_ALIGN < 2 * group + gamma_max
    cache = jax.eval_shape(lambda: QuantSpecCache.init(CFG, 2, 4 * group, group_size=group, gamma_max=gamma_max))
    assert cache.k_fp.shape == (NUM_LAYERS, 2, HKV, r, HEAD_DIM)


@pytest.mark.parametrize("sd,fp", [(jnp.float16, jnp.bfloat16), (jnp.float32, jnp.float32)])
def test_layout_shapes_and_dtypes(sd, fp):
    cfg = CFG.replace(head_dim=256, num_heads=2, num_kv_heads=1)
    c = jax.eval_shape(lambda: QuantSpecCache.init(cfg, 3, 512, group_size=128, scale_dtype=sd, fp_dtype=fp))
    L, B, H, S, D = NUM_LAYERS, 3, 1, 512, 256
    for name in ("k_hi", "k_lo", "v_hi", "v_lo"):
        assert getattr(c, name).shape == (L, B, H, S, D // 2) and getattr(c, name).dtype == jnp.uint8
    for name in ("k_scale", "k_zero"):
        assert getattr(c, name).shape == (L, B, H, S // 128, D) and getattr(c, name).dtype == jnp.dtype(sd)
    for name in ("v_scale", "v_zero"):
        assert getattr(c, name).shape == (L, B, H, S, D // 128) and getattr(c, name).dtype == jnp.dtype(sd)
    for name in ("k_fp", "v_fp"):
        assert getattr(c, name).shape == (L, B, H, ring_slots(128, 8), D) and getattr(c, name).dtype == jnp.dtype(fp)
    for name in ("q_len", "fp_len", "fp_start"):
        assert getattr(c, name).shape == (B,) and getattr(c, name).dtype == jnp.int32


@pytest.mark.parametrize("sd", [jnp.float16, jnp.float32])
def test_nbytes_by_component_sums_to_all_arrays(sd):
    cache = QuantSpecCache.init(CFG, 2, 64, group_size=16, gamma_max=4, scale_dtype=sd)
    parts = cache.nbytes_by_component()
    assert sum(parts.values()) == sum(x.nbytes for x in jax.tree.leaves(cache))
    assert parts["upper_planes"] == parts["lower_planes"] == cache.k_hi.nbytes * 2
    assert parts == cache_bytes("int8", CFG, 2, 64, group_size=16, gamma_max=4, scale_dtype=sd)
    dense = DenseKVCache.init(CFG, 2, 64)
    assert sum(dense.nbytes_by_component().values()) == sum(x.nbytes for x in jax.tree.leaves(dense))
    assert dense.nbytes_by_component() == cache_bytes("bf16", CFG, 2, 64)


def test_cache_bytes_int8_smaller_than_bf16():
    cfg = ModelConfig(vocab_size=32, hidden_size=1024, intermediate_size=2048, num_layers=4, num_heads=32,
                      num_kv_heads=8, head_dim=128, dtype="bfloat16")
    for max_len in (8192, 32768):
        bf16 = cache_bytes("bf16", cfg, 1, max_len)
        int8 = cache_bytes("int8", cfg, 1, max_len)
        kv_bf16 = bf16["k"] + bf16["v"]
        assert kv_bf16 == 2 * cfg.num_layers * cfg.num_kv_heads * max_len * cfg.head_dim * 2
        assert int8["upper_planes"] * 4 == kv_bf16  # the draft reads a quarter of bf16
        assert sum(int8.values()) < 0.6 * sum(bf16.values())  # SPEC §8: INT8 ~0.53x of bf16 KV
    with pytest.raises(ValueError):
        cache_bytes("fp8", cfg, 1, 1024)


def test_single_row_writes_match_the_batched_scatter():
    """One row's appends take a dynamic-update-slice path (dense cache: any T; ring: T = 1); they
    place K/V exactly where the batched scatter places the same row's."""
    rng = np.random.default_rng(5)
    cfg = ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=NUM_LAYERS, num_heads=HKV,
                      num_kv_heads=HKV, head_dim=HEAD_DIM, dtype="float32")
    for t in (1, 3):
        k = jnp.asarray(rng.standard_normal((2, HKV, t, HEAD_DIM)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((2, HKV, t, HEAD_DIM)), jnp.float32)
        dense = DenseKVCache.init(cfg, 2, 32).rollback(jnp.array([5, 9], jnp.int32))
        both = dense.append_layer(1, k, v)
        one = DenseKVCache.init(cfg, 1, 32).rollback(jnp.array([9], jnp.int32)).append_layer(1, k[1:], v[1:])
        np.testing.assert_array_equal(np.asarray(one.k[:, 0]), np.asarray(both.k[:, 1]))
        np.testing.assert_array_equal(np.asarray(one.v[1, 0, :, 9:9 + t]), np.asarray(v[1]))
        ring = QuantSpecCache.init(cfg, 2, 256, group_size=32, gamma_max=4).replace(
            fp_len=jnp.array([3, 35], jnp.int32), fp_start=jnp.array([7, 60], jnp.int32))
        rb = ring.append_layer(0, k, v)
        r1 = QuantSpecCache.init(cfg, 1, 256, group_size=32, gamma_max=4).replace(
            fp_len=jnp.array([35], jnp.int32), fp_start=jnp.array([60], jnp.int32)).append_layer(0, k[1:], v[1:])
        np.testing.assert_array_equal(np.asarray(r1.k_fp[:, 0]), np.asarray(rb.k_fp[:, 1]))
        slots = [(60 + 35 + j) % ring.ring_size for j in range(t)]  # slot 95 of 96, then 0, 1: T = 3 wraps
        np.testing.assert_array_equal(np.asarray(r1.v_fp[0, 0][:, slots]), np.asarray(v[1]))


def test_flush_form():
    """QSPEC_FLUSH unset or "all": every row quantized under one cond; "rows": a while loop over
    the flushing rows; a bad value is named."""
    from qspec_jax.cache import flush_form

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("QSPEC_FLUSH", raising=False)
        assert flush_form() == "all"
        mp.setenv("QSPEC_FLUSH", "rows")
        assert flush_form() == "rows"
        mp.setenv("QSPEC_FLUSH", "auto")
        with pytest.raises(ValueError, match="QSPEC_FLUSH='auto'"):
            flush_form()


@pytest.mark.parametrize("flushing", [(), (4,), (0, 5), (1, 2, 3), (0, 1, 2, 3, 4, 5)])
def test_row_loop_flush_equals_the_all_rows_flush(flushing, monkeypatch):
    """QSPEC_FLUSH=rows (a while loop quantizing one flushing row per trip) writes every field bit
    for bit as the all-rows flush does, for rows at random ring offsets (the oldest G slots
    wrapping around the ring or not), a flushing row whose block lies past max_len (dropped by
    both) and no flushing row at all; rows that do not flush are untouched."""
    B, G, S = 6, 8, 128
    rng = np.random.default_rng(len(flushing))
    cache = QuantSpecCache.init(CFG, B, S, group_size=G, gamma_max=3, scale_dtype="float32")
    mask = np.isin(np.arange(B), flushing)
    fp_len = np.where(mask, rng.integers(2 * G, 2 * G + 3, B), rng.integers(G, 2 * G, B))
    q_len = G * rng.integers(0, S // G, B)
    if flushing:
        q_len[flushing[0]] = S  # a block past max_len: dropped
    cache = cache.replace(
        k_hi=jnp.asarray(rng.integers(0, 256, cache.k_hi.shape), jnp.uint8),
        v_lo=jnp.asarray(rng.integers(0, 256, cache.v_lo.shape), jnp.uint8),
        k_scale=jnp.asarray(rng.standard_normal(cache.k_scale.shape), cache.k_scale.dtype),
        v_zero=jnp.asarray(rng.standard_normal(cache.v_zero.shape), cache.v_zero.dtype),
        k_fp=jnp.asarray(rng.standard_normal(cache.k_fp.shape), cache.k_fp.dtype),
        v_fp=jnp.asarray(rng.standard_normal(cache.v_fp.shape), cache.v_fp.dtype),
        q_len=jnp.asarray(q_len, jnp.int32), fp_len=jnp.asarray(fp_len, jnp.int32),
        fp_start=jnp.asarray(rng.integers(0, cache.ring_size, B), jnp.int32))
    jaxpr = lambda: str(jax.make_jaxpr(lambda c: c.flush())(cache))  # noqa: E731
    monkeypatch.setenv("QSPEC_FLUSH", "rows")
    rows = jax.jit(lambda c: c.flush())(cache)
    assert "while[" in jaxpr() and "cond[" not in jaxpr()
    monkeypatch.setenv("QSPEC_FLUSH", "all")
    every = jax.jit(lambda c: c.flush())(cache)
    assert "while[" not in jaxpr() and "cond[" in jaxpr()
    for name in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(rows, name)), np.asarray(getattr(every, name)),
                                      err_msg=name)
    np.testing.assert_array_equal(np.asarray(rows.q_len), q_len + G * mask)
    np.testing.assert_array_equal(np.asarray(rows.fp_len), fp_len - G * mask)
    for name in ("k_hi", "v_lo", "k_scale", "v_zero"):  # untouched: other rows, and the block past S
        before, after = np.asarray(getattr(cache, name)), np.asarray(getattr(rows, name))
        np.testing.assert_array_equal(after[:, ~mask], before[:, ~mask], err_msg=name)
        if flushing:
            np.testing.assert_array_equal(after[:, flushing[0]], before[:, flushing[0]], err_msg=name)
    for r in flushing[1:]:  # the other flushing rows' blocks were written
        q = q_len[r]
        assert np.any(np.asarray(rows.k_hi)[:, r, :, q:q + G] != np.asarray(cache.k_hi)[:, r, :, q:q + G])
        assert np.any(np.asarray(rows.k_scale)[:, r, :, q // G] != np.asarray(cache.k_scale)[:, r, :, q // G])
