"""A tiny interpreter for the PTX instruction subset the W4A16 register kernel's inline asm uses.

It executes the asm *text* of `pallas_kernels.linear.mosaic_gpu` (operands $0.. bound to Python ints),
so a typo in a mask, a LUT, a shift or an operand order changes its results: the CPU test that
replays the register kernel's per-thread work against the layout's dequantization depends on it.
Semantics (PTX ISA): lop3 evaluates the 8-bit truth table on (a, b, c) = (0xF0, 0xCC, 0xAA);
prmt (default mode) builds byte i of d from selector nibble i of c: bits 0-2 pick a byte of the
8-byte value b:a (a bytes 0-3), bit 3 replicates that byte's sign bit; bf16x2 arithmetic rounds
to nearest even once (computed exactly in float64 first: exact for the operand widths used here).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

_BF16 = ml_dtypes.bfloat16


def _imm(tok: str) -> int:
    return int(tok, 0)


def _bf16_pair(u: int) -> tuple[float, float]:
    lo = np.array([u & 0xFFFF], np.uint16).view(_BF16)[0]
    hi = np.array([u >> 16], np.uint16).view(_BF16)[0]
    return float(lo), float(hi)


def _pack_bf16(lo: float, hi: float) -> int:
    b = np.array([lo, hi], np.float64).astype(np.float32).astype(_BF16).view(np.uint16)
    return int(b[0]) | (int(b[1]) << 16)


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
        elif op == "prmt.b32":
            a, b, c = (int(get(t)) & 0xFFFFFFFF for t in ops[1:4])
            src = a | (b << 32)
            r = 0
            for i in range(4):
                sel = (c >> (4 * i)) & 0xF
                byte = (src >> (8 * (sel & 7))) & 0xFF
                if sel & 8:
                    byte = 0xFF if byte & 0x80 else 0
                r |= byte << (8 * i)
            put(ops[0], r)
        elif op == "shr.u32":
            put(ops[0], (int(get(ops[1])) & 0xFFFFFFFF) >> int(get(ops[2])))
        elif op == "sub.bf16x2":
            a, b = _bf16_pair(int(get(ops[1]))), _bf16_pair(int(get(ops[2])))
            put(ops[0], _pack_bf16(a[0] - b[0], a[1] - b[1]))
        elif op == "fma.rn.bf16x2":
            a, b, c = (_bf16_pair(int(get(t))) for t in ops[1:4])
            put(ops[0], _pack_bf16(a[0] * b[0] + c[0], a[1] * b[1] + c[1]))
        else:
            raise NotImplementedError(f"ptx_emu: instruction {op!r}")
    return [outs[i] for i in sorted(outs)]
