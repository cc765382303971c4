"""A numpy reading of the few PTX instructions that our inline assembly uses, so that the
Triton interpreter (which cannot run inline assembly) can run kernels that carry it.

``run(asm, n_out, inputs)`` executes an ``inline_asm_elementwise`` block with ``pack=1`` over
whole arrays: ``$0 .. $(n_out - 1)`` are the outputs, the inputs follow. Registers are uint32
arrays; bfloat16 pairs round to nearest even, as ``.rn`` does.
"""

from __future__ import annotations

import numpy as np


def _u32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).view(np.uint32) if np.asarray(a).dtype.itemsize == 4 \
        else np.asarray(a).astype(np.int64).astype(np.uint32)


def _halves(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two bfloat16 of each register, as float64 (low half first)."""
    lo = (r << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    hi = (r & 0xFFFF0000).astype(np.uint32).view(np.float32).astype(np.float64)
    return lo, hi


def _to_bf16_bits(v: np.ndarray) -> np.ndarray:
    bits = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32) & 0xFFFF


def _pair(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return _to_bf16_bits(lo) | (_to_bf16_bits(hi) << 16)


def _prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    data = a.astype(np.uint64) | (b.astype(np.uint64) << 32)
    out = np.zeros_like(a)
    for i in range(4):
        index = (selector >> (4 * i)) & 0xF
        if index & 8:
            raise NotImplementedError("prmt's sign replication")
        out |= (((data >> (8 * index)) & 0xFF) << (8 * i)).astype(np.uint32)
    return out


_BF16X2 = {"sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
           "fma": lambda a, b, c: a * b + c}  # exact in float64, rounded once


def _bf16x2(op: str, *regs: np.ndarray) -> np.ndarray:
    halves = [_halves(r) for r in regs]
    return _pair(*(_BF16X2[op](*(x[h] for x in halves)) for h in (0, 1)))


def run(asm: str, n_out: int, inputs: list[np.ndarray]) -> list[np.ndarray]:
    shape = np.broadcast_shapes(*(np.shape(a) for a in inputs))
    regs = {f"${n_out + i}": np.broadcast_to(_u32(a), shape).copy()
            for i, a in enumerate(inputs)}

    def value(token: str) -> np.ndarray:
        if token in regs:
            return regs[token]
        return np.full(shape, int(token, 0) & 0xFFFFFFFF, dtype=np.uint32)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *args = [t.strip() for t in rest.split(",")]
        a = [value(t) for t in args]
        if op == "shr.b32":
            out = a[0] >> a[1]
        elif op == "shl.b32":
            out = a[0] << a[1]
        elif op == "and.b32":
            out = a[0] & a[1]
        elif op == "lop3.b32":
            if int(args[3], 0) != 0xEA:
                raise NotImplementedError(line)
            out = (a[0] & a[1]) | a[2]
        elif op == "prmt.b32":
            out = _prmt(a[0], a[1], int(args[2], 0))
        elif op in ("sub.rn.bf16x2", "mul.rn.bf16x2", "fma.rn.bf16x2"):
            out = _bf16x2(op.split(".")[0], *a)
        elif op == "add.f32":
            out = (a[0].view(np.float32) + a[1].view(np.float32)).view(np.uint32)
        else:
            raise NotImplementedError(line)
        regs[dst] = out.astype(np.uint32)
    return [regs[f"${i}"].view(np.float32) for i in range(n_out)]
