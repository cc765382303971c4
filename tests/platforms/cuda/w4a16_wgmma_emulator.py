"""A numpy reading of ``csrc/w4a16_wgmma.cu``'s data movement, so that its index arithmetic
runs on the CPU: each thread's cp.async copies into a stage's bytes, its shared-memory reads
and decode into wgmma's A fragments, B read through the kernel's descriptors with the 128-byte
swizzle, and the epilogue's stores. Each expression follows the kernel's, so a wrong swizzle,
fragment slot, column order or output index there (or here) shows as a wrong product.

What it takes on trust is PTX's documented side: the m64nNk16 A and D fragment layouts (those
of mma.m16n8k16, a warp per 16 rows) and the K-major SWIZZLE_128B layout a descriptor names
(16-byte chunk ``c`` of row ``r`` of an 8-row atom at ``c ^ r``). Only the H200 tests check
those.
"""

from __future__ import annotations

import numpy as np

from tests.platforms.cuda.ptx_emulator import _to_bf16_bits

TILE_K = 128
BLOCK_N = 128
THREADS = 256
WORD_BYTES = 16 * BLOCK_N * 4
_TID = np.arange(THREADS)


GROUP_M = 8


def block_of(block_id: int, m_blocks: int, n_blocks: int) -> tuple[int, int]:
    """The kernel's ``block_of``: (block of rows, block of features) of launch index
    ``block_id``."""
    per_group = GROUP_M * n_blocks
    first_m = block_id // per_group * GROUP_M
    rows = min(m_blocks - first_m, GROUP_M)
    in_group = block_id % per_group
    return first_m + in_group % rows, in_group // rows


def _layout(bm: int, gp: int) -> tuple[int, int, int, int]:
    x_half = bm * 128
    words = 2 * x_half
    scales = words + WORD_BYTES
    nbytes = -(-(scales + (4 // gp) * 2 * BLOCK_N * 2) // 1024) * 1024
    return x_half, words, scales, nbytes


def _copy16(stage: np.ndarray, dst: np.ndarray, src: np.ndarray, ok: np.ndarray) -> None:
    """cp.async of 16 bytes per thread: ``src`` [threads, 16] uint8, zeros where not ``ok``."""
    for d, s, o in zip(dst, src, ok):
        stage[d:d + 16] = s if o else 0


def _fill_stage(stage, t, a, bm, gp, m0, n_block):
    """The kernel's ``issue(t)``: x, the words, and the groups' scale and zero rows."""
    x_half, words, scales, _ = _layout(bm, gp)
    ng = 4 // gp
    c16, row0 = _TID & 15, _TID >> 4
    col = t * TILE_K + 8 * c16
    col_ok = col < a["k"]
    for i in range(bm // 16):
        row = row0 + 16 * i
        ok = (m0 + row < a["m"]) & col_ok
        dst = (c16 >> 3) * x_half + row * 128 + (((c16 & 7) ^ (row & 7)) << 4)
        src = [a["x"][m0 + r, c:c + 8].view(np.uint8) if o else None
               for r, c, o in zip(row, col, ok)]
        _copy16(stage, dst, src, ok)
    wc = _TID & 31
    w_ok = n_block + 4 * wc < a["n"]
    for i in range(2):
        row = (_TID >> 5) + 8 * i
        dst = words + row * 512 + ((wc ^ (2 * ((row >> 1) & 3))) << 4)
        src = [a["qweight"][16 * t + r, n_block + 4 * c:n_block + 4 * c + 4].view(np.uint8)
               if o else None for r, c, o in zip(row, wc, w_ok)]
        _copy16(stage, dst, src, w_ok)
    # The first NG * 32 threads copy (zeros past N); the others none.
    copies = _TID < ng * 32
    sq, which, sc = _TID >> 5, (_TID >> 4) & 1, _TID & 15
    s_ok = n_block + 8 * sc < a["n"]
    group = np.minimum((t * TILE_K + sq * (TILE_K // ng)) >> a["group_shift"],
                       a["scale_rows"] - 1)
    dst = scales + (_TID >> 4) * 256 + 16 * sc
    src = [(a["zeros"] if w else a["scales"])[gr, n_block + 8 * c:n_block + 8 * c + 8]
           .view(np.uint8) if o else None for w, gr, c, o in zip(which, group, sc, s_ok)]
    _copy16(stage, dst[copies], [s for s, c in zip(src, copies) if c], s_ok[copies])


def _u32(stage: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return np.stack([stage[o:o + 4].view(np.uint32)[0] for o in offsets]).astype(np.uint64)


def _round(v: np.ndarray, bf16: bool) -> np.ndarray:
    """float64 to the 16-bit type's bits, nearest even."""
    return _to_bf16_bits(v) if bf16 else v.astype(np.float16).view(np.uint16).astype(np.uint32)


def _value(bits: np.ndarray, bf16: bool) -> np.ndarray:
    bits = np.asarray(bits, dtype=np.uint32) & 0xFFFF
    if bf16:
        return (bits << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    return bits.astype(np.uint16).view(np.float16).astype(np.float64)


def _halves(reg, bf16):
    return _value(reg & 0xFFFF, bf16), _value(reg >> 16, bf16)


def _fma2(a, b, c, bf16):
    """fma.rn.{bf16x2,f16x2}: exact in float64 for these operands, rounded once."""
    out = [_round(x * y + z, bf16) for x, y, z in zip(_halves(a, bf16), _halves(b, bf16),
                                                        _halves(c, bf16))]
    return out[0].astype(np.uint64) | (out[1].astype(np.uint64) << 16)


def _both(v, bf16):
    h = _round(np.asarray(v, dtype=np.float64), bf16).astype(np.uint64)
    return h | (h << 16)


def _group_params(scale_bits, zero_bits, bf16):
    s = _value(scale_bits, False)  # float16 scales
    s_hi = _both(s, bf16)
    s_lo = _both(s - _value(s_hi, bf16), bf16) if bf16 else np.zeros_like(s_hi)
    neg_zero = _both(-((128.0 if bf16 else 1024.0) + _value(zero_bits, False)), bf16)
    return s_hi, s_lo, neg_zero


def _decode(codes, p, params, bf16):
    bias = 0x43004300 if bf16 else 0x64006400
    one = 0x3F803F80 if bf16 else 0x3C003C00
    s_hi, s_lo, neg_zero = params
    biased = ((codes >> (4 * p)) & 0x000F000F) | bias
    diff = _fma2(biased, np.uint64(one), neg_zero, bf16)
    if bf16:
        return _fma2(diff, s_hi, _fma2(diff, s_lo, np.uint64(0x80008000), bf16), bf16)
    return _fma2(diff, s_hi, np.uint64(0x80008000), bf16)


def _b_operand(stage, start, bm, bf16):
    """B (16 columns of K by bm rows of x) as a K-major SWIZZLE_128B descriptor at ``start``
    names it: 8-row atoms 1,024 bytes apart, rows 128 bytes apart, chunk c of row r at c ^ r."""
    k, n = np.meshgrid(np.arange(16), np.arange(bm), indexing="ij")
    addr = start + (n // 8) * 1024 + (n % 8) * 128 + 2 * k
    addr = addr ^ (((addr >> 7) & 7) << 4)
    bits = stage[addr].astype(np.uint32) | (stage[addr + 1].astype(np.uint32) << 8)
    return _value(bits, bf16)


def run_block(a: dict, bm: int, gp: int, m0: int, n_block: int, split: int = 0,
              stages: int = 4) -> dict:
    """One block's outputs over split ``split`` of K (of ``a["tiles_per_split"]`` tiles),
    ``{(row, feature): float64 value}``, as the kernel computes them (before the output's
    rounding or the splits' sum). ``a`` holds the kernel's arguments as numpy arrays and
    ints."""
    bf16 = a["bf16"]
    x_half, words, scales, nbytes = _layout(bm, gp)
    ng = 4 // gp
    lane, warp = _TID & 31, _TID >> 5
    g, tig = lane >> 2, lane & 3
    f_local = (warp >> 2) * 64 + (warp & 3) * 16 + 2 * g
    w_swizzle = (((f_local >> 2) ^ (2 * tig)) << 4) | ((f_local & 2) * 4)
    buffers = np.full((stages, nbytes), 0xFF, dtype=np.uint8)  # poison: NaN as x
    acc = np.zeros((2, 64, bm))  # per warpgroup: A rows (features) by B columns (rows of x)
    t_lo = split * a["tiles_per_split"]
    for j in range(min(a["tiles_per_split"], a["tiles"] - t_lo)):
        t = t_lo + j
        stage = buffers[j % stages]
        stage[:] = 0xFF
        _fill_stage(stage, t, a, bm, gp, m0, n_block)
        lo, hi = {}, {}
        for r in range(2):
            row = 2 * tig + 8 * r
            for e in range(2):
                w0 = _u32(stage, words + row * 512 + w_swizzle + 4 * e)
                w1 = _u32(stage, words + (row + 1) * 512 + w_swizzle + 4 * e)
                lo[r, e] = (w0 & 0xFFFF) | ((w1 & 0xFFFF) << 16)  # prmt 0x5410
                hi[r, e] = (w0 >> 16) | (w1 & 0xFFFF0000)  # prmt 0x7632
        for q in range(ng):
            sv = _u32(stage, scales + 2 * q * 256 + 2 * f_local)
            zv = _u32(stage, scales + (2 * q + 1) * 256 + 2 * f_local)
            params = [_group_params(sv & 0xFFFF, zv & 0xFFFF, bf16),
                      _group_params(sv >> 16, zv >> 16, bf16)]
            for p in range(q * gp, (q + 1) * gp):
                for h in range(2):
                    s = 2 * p + h
                    codes = hi if h else lo
                    frag = [_decode(codes[0, 0], p, params[0], bf16),
                            _decode(codes[0, 1], p, params[1], bf16),
                            _decode(codes[1, 0], p, params[0], bf16),
                            _decode(codes[1, 1], p, params[1], bf16)]
                    b = _b_operand(stage, (s >> 2) * x_half + (s & 3) * 32, bm, bf16)
                    for wg in range(2):
                        mask = (warp >> 2) == wg
                        a_op = np.full((64, 16), np.nan)
                        wq, gg, tt = (warp & 3)[mask], g[mask], tig[mask]
                        for reg, (dr, dc) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
                            v0, v1 = _halves(frag[reg][mask], bf16)
                            a_op[16 * wq + gg + dr, 2 * tt + dc] = v0
                            a_op[16 * wq + gg + dr, 2 * tt + dc + 1] = v1
                        acc[wg] += a_op @ b
    out = {}
    for tid in range(THREADS):
        wg, wq = warp[tid] >> 2, warp[tid] & 3
        feature = n_block + f_local[tid]
        if feature >= a["n"]:
            continue
        for j in range(bm // 8):
            for e in range(2):
                row = m0 + 8 * j + 2 * tig[tid] + e
                if row < a["m"]:
                    col = 8 * j + 2 * tig[tid] + e
                    out[row, feature] = acc[wg, 16 * wq + g[tid], col]
                    out[row, feature + 1] = acc[wg, 16 * wq + g[tid] + 8, col]
    return out
