"""A tiny interpreter for the PTX instruction subset the W4A16 register kernel's inline asm uses.

It executes the asm *text* of `pallas_kernels.linear.mosaic_gpu` (operands $0.. bound to Python ints),
so a typo in a mask, a LUT, a shift or an operand order changes its results: the CPU test that
replays the register kernel's per-thread work against the layout's dequantization depends on it.
Semantics (PTX ISA): lop3 evaluates the 8-bit truth table on (a, b, c) = (0xF0, 0xCC, 0xAA);
bf16x2 / f32 arithmetic rounds to nearest even once (computed exactly in float64 first: exact
for the operand widths used here); `cvt.rn.bf16x2.f32 d, a, b` puts a in the upper half.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

_BF16 = ml_dtypes.bfloat16


def _imm(tok: str) -> int | float:
    if tok.startswith("0f"):
        return float(np.frombuffer(int(tok[2:], 16).to_bytes(4, "little"), np.float32)[0])
    return int(tok, 0)


def _bf16_pair(u: int) -> tuple[float, float]:
    lo = np.array([u & 0xFFFF], np.uint16).view(_BF16)[0]
    hi = np.array([u >> 16], np.uint16).view(_BF16)[0]
    return float(lo), float(hi)


def _pack_bf16(lo: float, hi: float) -> int:
    b = np.array([lo, hi], np.float64).astype(np.float32).astype(_BF16).view(np.uint16)
    return int(b[0]) | (int(b[1]) << 16)


def _f32(v: float) -> float:
    return float(np.float32(v))


def run(asm: str, args: list[int]) -> list[int]:
    """Executes `asm` with $i = args[i] for inputs; returns the values of the $ outputs, in order
    of first assignment (the asm's output operands come first, as in the kernel's constraints)."""
    regs: dict[str, object] = {}
    outs: dict[int, int] = {}

    def get(tok: str):
        tok = tok.strip()
        if tok.startswith("$"):
            return args[int(tok[1:])]
        if tok in regs:
            return regs[tok]
        return _imm(tok)

    def put(tok: str, val) -> None:
        tok = tok.strip()
        if tok.startswith("$"):
            outs[int(tok[1:])] = int(val) & 0xFFFFFFFF
        else:
            regs[tok] = val

    body = asm.strip().strip("{}")
    for line in body.split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.lstrip().startswith("{"):
            m = re.match(r"\{(\w+),\s*(\w+)\},\s*(\S+)", rest.strip())
            v = int(get(m.group(3)))
            put(m.group(1), v & 0xFFFF)
            put(m.group(2), v >> 16)
            continue
        ops = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            put(ops[0], int(get(ops[1])) & 0xFFFFFFFF)
        elif op == "lop3.b32":
            a, b, c, lut = (int(get(t)) for t in ops[1:5])
            r = 0
            for bit in range(32):
                idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
                r |= ((lut >> idx) & 1) << bit
            put(ops[0], r)
        elif op == "shr.u32":
            put(ops[0], (int(get(ops[1])) & 0xFFFFFFFF) >> int(get(ops[2])))
        elif op == "sub.bf16x2":
            a, b = _bf16_pair(int(get(ops[1]))), _bf16_pair(int(get(ops[2])))
            put(ops[0], _pack_bf16(a[0] - b[0], a[1] - b[1]))
        elif op == "fma.rn.bf16x2":
            a, b, c = (_bf16_pair(int(get(t))) for t in ops[1:4])
            put(ops[0], _pack_bf16(a[0] * b[0] + c[0], a[1] * b[1] + c[1]))
        elif op == "cvt.f32.f16":
            put(ops[0], float(np.array([int(get(ops[1]))], np.uint16).view(np.float16)[0]))
        elif op == "fma.rn.f32":
            put(ops[0], _f32(float(get(ops[1])) * float(get(ops[2])) + float(get(ops[3]))))
        elif op == "cvt.rn.bf16x2.f32":
            put(ops[0], _pack_bf16(float(get(ops[2])), float(get(ops[1]))))
        else:
            raise NotImplementedError(f"ptx_emu: instruction {op!r}")
    return [outs[i] for i in sorted(outs)]
