"""``y = x @ W.T`` with a 4-bit grouped weight, dequantized in registers (W4A16).

Layout the kernel reads (built once at load by ``pack``):

- ``qweight`` int32 ``[16 * ceil(K / 128), N]``: K in tiles of ``TILE_K = 128`` columns (the
  last padded with zero codes); word ``r`` of tile ``T`` (row ``16 T + r``) holds
  ``W[n, 128 T + 16 t + r]`` for ``t = 0 .. 7`` at bits ``nibble_shift(t) = 4 * (t // 2) +
  16 * (t % 2)``. So nibble t of a tile's 16 words (slice t) is the block of weight rows
  ``128 T + 16 t ..`` that ``tl.dot`` takes with 16 contiguous columns of x, as decoded, with no
  reshape of the tile; and the GEMV's mask lifts slices ``2p`` and ``2p + 1`` (bits ``4p``
  and ``16 + 4p``) into the two halves of a register (its packed bfloat16 pairs). N is the
  contiguous dimension, so a tile of words is read coalesced along the output features.
- ``scales``, ``shifts`` ``[ceil(K / G), N]``: with ``zero_point``,
  ``W[n, k] = (q[n, k] - shifts[g, n]) * scales[g, n]`` (``g = k // G``), which keeps AWQ's and
  GPTQ's integer zero points exact in float16; otherwise ``q * scales + shifts`` (GGUF's
  ``q * d + m``). Float16 where that form is exact in it (checkpoints store float16 scales),
  else float32, so packing never rounds the weight.

Paths, chosen by the number of rows M (the CUDA C++ mma kernels of ``w4a16_mma.py`` take
``MMA_ROWS`` where they are built):

- **GEMV** (one row, or two bfloat16 rows on NVIDIA: decode at batch 1-2; groups holding whole
  tiles, a multiple of 128 or one group): CUDA cores, with codes decoded by bit tricks rather
  than converted (``_w4a16_gemv_kernel``), and K cut into slices as short as one block so that
  the smaller weights are read all at once. With ``PAIR_WORDS`` (from
  ``_GemvConfig.pair_words_from`` rows) it decodes word rows r and r + 1 together, so that
  each packed pair of codes meets two adjacent columns of x.
- **Tiles** (up to ``DEQUANT_MIN_M``; groups of a multiple of 16, so that each slice lies in
  one group): a ``BLOCK_M x BLOCK_N`` tile of ``y`` per program over one of ``SPLIT_K`` slices
  of K, decoding each tile of W once for all its rows, a slice at a time into ``tl.dot``
  (``_w4a16_kernel``). Decode (small M) uses one block of rows and splits K so that enough
  programs stream the weight. Both split paths end in ``split_k.finish``: deterministic, and
  one launch. Groups that cut slices (24, say) are dequantized at every M. With ``swap_ab``
  the tile is computed transposed, so that on Hopper the decoded weights are wgmma's register
  operand instead of being written to shared memory each slice (Machete's operand order).
- **Dequantize** (M from ``DEQUANT_MIN_M``, prefill and large decode batches): the weight is
  expanded to a dense ``[K, N]`` copy in the activation dtype and multiplied by ``torch.mm``.
  There the matmul is compute-bound and the tiles reach a fifth to a third of cuBLAS, while
  the extra pass over the weight costs about what reading it in bfloat16 would.
- **wgmma** (sm_90, ``WGMMA_ROWS``: 64 to 511 rows, where the H200 measured it faster;
  ``PAGEDSERVE_W4A16_WGMMA=0`` turns it off): the CUDA C++ kernel of
  ``kernels/w4a16_wgmma.py`` in place of the tiles and dequantize.

Measured on the H200 on 2026-12-01 (``scripts/gpu_check.sh w4a16-tiles-sweep`` with
``W4A16_BASE`` the kernel before this layout, ``benchmarks/results/issue30/``; the four
Llama-3-8B layers summed, bf16, groups of 128), against the earlier layout whose tiles
unpacked ``[BK / 8, BN]`` words into a ``[BK, BN]`` tile: M = 16, 32, 64 take 117, 192, 240 µs
(1.09x, 1.33x, 1.08x faster; 0.64x and 0.53x cuBLAS bf16 at 32 and 64, 23% of the copy rate at
16); the GEMV at M = 1 takes 84 µs, 0.73x the earlier layout's 61 (its x pairs are now two
loads 16 columns apart); from 128 rows nothing changed (dequantize). Per layer the tiles read
14-28% of the copy rate at M <= 16 (the GEMV at M = 1 20-40%), far from the target of 80%.

Variants are fields of the configurations (``_GemvConfig.pair_words_from``, ``_TileConfig.bias``,
``.prefetch``, ``.swap_ab`` and ``.scale_a``), so ``scripts/bench_w4a16.py --sweep-gemv
--sweep-tiles`` times them against each other in one call, and ``scripts/w4a16_sass.py``
counts their sm_90 main loops on the CPU. Configurations are fixed per range of M (no
autotuning) and M is not specialized on, so a new batch size compiles nothing; nothing in
``matmul`` synchronizes with the host or allocates but the output, the partial sums and the
dense copy, so CUDA graphs capture it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedserve import envs
from pagedserve.platforms.cuda.kernels import w4a16_mma, w4a16_wgmma
from pagedserve.platforms.cuda.kernels.device import gpu_arch, sm_count
from pagedserve.platforms.cuda.kernels.pdl import gate, launch_options
from pagedserve.platforms.cuda.kernels.split_k import finish, split_count

# The narrowest BLOCK_N of the configurations whose rows fit one block (split K): the split
# counters are sized for it, so wider tiles use a prefix of them.
_SPLIT_BLOCK_N = 64


class PackedW4(NamedTuple):
    qweight: torch.Tensor  # int32 [ceil(K / 8), N]
    scales: torch.Tensor  # float16 or float32 [ceil(K / G), N]
    shifts: torch.Tensor  # same dtype and shape as scales
    counters: torch.Tensor  # int32 [ceil(N / SPLIT_BLOCK_N)], zero between calls
    in_features: int
    group_size: int
    zero_point: bool


class _GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    programs_per_sm: int  # the split of K aims at this many: enough loads in flight
    # The fewest rows at which the kernel pairs word rows (PAIR_WORDS, with the packed PTX): 1
    # always, 2 at two rows only, 3 never. (No num_stages: Triton pipelines no load of the
    # GEMV's loop, which has no dot; its sm_90 SASS has no LDGSTS with 3 stages.)
    pair_words_from: int


def pack(values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
         device: torch.device) -> PackedW4:
    """From ``GroupQuantWeight`` fields (values ``[N, K]`` in 0..15, float32 scales and offsets
    ``[N, ceil(K / G)]``) to the kernel's layout on ``device``."""
    n, k = values.shape
    tiles = -(-k // TILE_K)
    v = torch.nn.functional.pad(values.to(device), (0, tiles * TILE_K - k))
    v = v.view(n, tiles, 8, SLICE_K)  # [N, tile, slice t, word r]
    packed = torch.zeros((n, tiles, SLICE_K), dtype=torch.int64, device=device)
    for t in range(8):  # a nibble at a time: int64 of [N, K / 8], not of [N, K]
        packed |= v[:, :, t].to(torch.int64) << nibble_shift(t)
    packed = packed.view(n, tiles * SLICE_K)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    s = scales.to(device=device, dtype=torch.float64)
    o = offsets.to(device=device, dtype=torch.float64)
    z = -o / s  # inf or nan where a scale is 0: not exact in half, so the offset form
    # The kernels subtract z from the code as a small integer (``(128 + q) - (128 + z)`` in
    # bfloat16, ``(2**23 + q) - (2**23 + z)`` in float32), exact only for such z.
    if _exact_in_half(s) and _exact_in_half(z) and _small_integers(z):
        zero_point, shifts, dtype = True, z, torch.float16
    else:  # float32 is exact for the inputs as they are
        zero_point, shifts = False, o
        dtype = torch.float16 if _exact_in_half(s) and _exact_in_half(o) else torch.float32
    counters = torch.zeros(-(-n // _SPLIT_BLOCK_N), dtype=torch.int32, device=device)
    return PackedW4(packed.T.contiguous(), s.T.to(dtype).contiguous(),
                    shifts.T.to(dtype).contiguous(), counters, k, group_size, zero_point)


# K per packed tile: nibble ``t`` of word ``r`` of a tile holds its column ``SLICE_K * t + r``.
TILE_K = 128
SLICE_K = TILE_K // 8
_TILE_K = tl.constexpr(TILE_K)


def nibble_shift(t):
    """The bit at which slice ``t`` of a tile (its columns ``SLICE_K * t ..``) starts in a word."""
    return ((t >> 1) << 2) | ((t & 1) << 4)


def _exact_in_half(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all() and torch.equal(t.half().double(), t))


def _small_integers(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.round(), t) and t.abs().max() <= 64)


@triton.jit
def _group_row(s_ptr, z_ptr, k, K, group_size, N, offs_n, mask_n):
    """The scales and shifts (float32) of the group of column ``k``; columns past K (where x
    is zero) read the last group."""
    g_ptrs = (tl.minimum(k, K - 1) // group_size) * N + offs_n
    s = tl.load(s_ptr + g_ptrs, mask=mask_n, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g_ptrs, mask=mask_n, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _dequant(q, s, z, ZERO_POINT: tl.constexpr):
    """Float codes to weights: ``(q - z) * s`` with zero points, else ``q * s + z``."""
    if ZERO_POINT:
        return (q - z) * s
    else:
        return q * s + z


def _slice_ptx(t: int, bias: int) -> str:
    """PTX for slice ``t`` of two words (``$1``, ``$2``) as their biased codes: the pair
    ``(bias | q, bias | q')`` of 16-bit values (``$0``), ``q`` the word's code at
    ``nibble_shift(t)``. Elementwise (each half of the output reads one word), so whichever two
    elements Triton packs give the right codes; where they are the K-adjacent words of an
    output feature (wgmma's register operand) ``prmt`` sets their half-words side by side
    once for the four slices of a half and one ``lop3`` lifts both codes."""
    half = "0x7632" if t % 2 else "0x5410"  # the words' high or low half-words
    lines = ["{", ".reg .b32 p;", f"prmt.b32 p, $1, $2, {half};"]
    if t // 2:
        lines.append(f"shr.b32 p, p, {4 * (t // 2)};")
    lines += [f"lop3.b32 $0, p, 0x000F000F, {bias:#010x}, 0xEA;", "}"]
    return "\n".join(lines)


# Slice t's PTX for float16 codes at t, for bfloat16 at 8 + t.
_SLICE_PTX = tl.constexpr(tuple(_slice_ptx(t, 0x43004300 if bf16 else 0x64006400)
                                for bf16 in (False, True) for t in range(8)))


@triton.jit
def _per_n(v, SWAP_AB: tl.constexpr):
    """A vector over the tile's output features against the accumulator: its columns, or with
    ``SWAP_AB`` (the accumulator is ``y``'s tile transposed) its rows."""
    if SWAP_AB:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def _per_m(v, SWAP_AB: tl.constexpr):
    """A vector over the tile's rows of ``x`` against the accumulator (see ``_per_n``)."""
    if SWAP_AB:
        return v[None, :]
    else:
        return v[:, None]


@triton.jit
def _decode_slice(words, T: tl.constexpr, z, DTYPE: tl.constexpr, BIAS: tl.constexpr,
                  ZERO_POINT: tl.constexpr, SWAP_AB: tl.constexpr, PTX: tl.constexpr):
    """Slice ``T`` of a tile's words (``[SLICE_K, BLOCK_N]``, or transposed with ``SWAP_AB``)
    as the dot's weights in ``DTYPE``: the biased code (``BIAS``), ``q - z``, or ``q`` (less
    nothing: offsets), as ``_w4a16_kernel`` describes. With ``PTX`` (16-bit x on NVIDIA) the
    biased codes come from ``_slice_ptx``."""
    BF16: tl.constexpr = DTYPE == tl.bfloat16
    BIAS_BITS: tl.constexpr = 0x4300 if BF16 else 0x6400
    BIAS_VALUE: tl.constexpr = 128.0 if BF16 else 1024.0
    if DTYPE != tl.float32:
        if PTX:
            w = tl.inline_asm_elementwise(_SLICE_PTX[8 * BF16 + T], "=r,r,r", [words],
                                          dtype=tl.bfloat16 if BF16 else tl.float16,
                                          is_pure=True, pack=2)
        else:
            q = (words >> (4 * (T // 2) + 16 * (T % 2))) & 0xF  # nibble_shift(T)
            w = (q | BIAS_BITS).to(tl.int16).to(DTYPE, bitcast=True)
        if not BIAS:
            if ZERO_POINT:
                w -= _per_n((z + BIAS_VALUE).to(DTYPE), SWAP_AB)
            else:
                w -= BIAS_VALUE
    else:
        # The code under the exponent of 2**23 reads 2**23 + q: no int-to-float conversion (a
        # quarter-rate instruction).
        q = (words >> (4 * (T // 2) + 16 * (T % 2))) & 0xF
        f = (q | 0x4B000000).to(tl.float32, bitcast=True)
        if ZERO_POINT:
            w = f - _per_n(8388608.0 + z, SWAP_AB)
        else:
            w = f - 8388608.0
    return w


@triton.jit
def _dot(a, b, acc):
    """``acc + a @ b``; float32 operands in full precision (no TF32)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, group_size, k_per_split, num_splits,
    stride_xm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SLICES: tl.constexpr,
    ZERO_POINT: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, BIAS: tl.constexpr,
    PREFETCH: tl.constexpr, SWAP_AB: tl.constexpr, SCALE_A: tl.constexpr,
    PTX_DECODE: tl.constexpr, PDL: tl.constexpr,
):
    """A ``BLOCK_M x BLOCK_N`` tile of ``y`` over one slice of K (``k_per_split``, whole tiles
    of ``TILE_K``). Slice t of a tile's words is the ``[SLICE_K, BLOCK_N]`` block of weight
    rows ``k0 + SLICE_K * t ..``, so each goes into ``tl.dot`` as it is decoded: no reshape.
    The dot takes ``q - z`` (exact in any float type) or, with ``BIAS``, the code's bits under
    the exponent of ``BIAS`` (bf16 ``0x4300`` reads ``128 + q``, fp16 ``0x6400`` ``1024 + q``:
    no float arithmetic per weight), whose excess is taken off per output as the bias times
    the row's sum of x. The group's scale multiplies the dot's sum once per output every
    ``GROUP_SLICES`` slices, not every weight; offsets (``q * s + m``) add ``m`` times the
    row's sum of x. Without ``BIAS``, 16-bit x takes the biased code less ``BIAS + z`` in its
    own type (exact: both are integers below 2**8 apart), one packed subtraction per two
    weights.

    ``PREFETCH`` (one group per tile, ``GROUP_SLICES == 8``): the next tile's scale and shift
    rows are loaded while this tile is decoded and carried into the next iteration. Triton's
    pipeliner copies ahead only the loads that feed ``tl.dot`` (words, x); a plain load at
    the top of the tile would otherwise stall the tile's epilogue on its full latency.

    ``SWAP_AB`` (Machete's operand order): the tile is computed transposed, ``y^T = W x^T``,
    with the decoded weight ``[BLOCK_N, SLICE_K]`` as the dot's first operand. On Hopper wgmma
    reads only its first operand from registers, so the decoded weights stay there, where as
    the second operand they are written to shared memory each slice; x^T, the second
    operand, is copied to shared memory as it is loaded. The words are read as a
    ``[BLOCK_N, SLICE_K]`` tile (a ``tl.trans`` of the loaded tile is not carried through to
    the dot's layout), and Triton 3.6 decodes them in the dot's layout only where each warp
    has 32 or more of the BLOCK_N rows (``BLOCK_N >= 32 * num_warps``); with fewer the
    decoded slices go through shared memory again. The accumulator is transposed back at
    the end.

    ``SCALE_A``: the group's scale and offset are applied to the decoded weights in x's type,
    ``(q - z) * s`` or ``q * s + m`` (a packed multiply more per two weights, and the scale
    rounded to bfloat16), so that one accumulator takes the dot instead of two (the group's
    sum and the total): the transposed tiles of 128 rows of x then fit in registers."""
    gate(PDL)
    SLICE: tl.constexpr = _TILE_K // 8
    BIAS_VALUE: tl.constexpr = 128.0 if x_ptr.dtype.element_ty == tl.bfloat16 else 1024.0
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, SLICE)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        s_next, z_next = _group_row(s_ptr, z_ptr, k_start, K, group_size, N, offs_n, mask_n)
    for k0 in range(k_start, k_end, _TILE_K):
        # Whole tiles: pack padded K with zero codes, which meet zero columns of x.
        word_rows = (k0 // 8 + offs_r).to(tl.int64) * N
        if SWAP_AB:  # [BLOCK_N, SLICE]: the words transposed as they are read
            words = tl.load(qw_ptr + word_rows[None, :] + offs_n[:, None], mask=mask_n[:, None],
                            other=0)
        else:
            words = tl.load(qw_ptr + word_rows[:, None] + offs_n[None, :], mask=mask_n[None, :],
                            other=0)
        if PREFETCH:
            s, z = s_next, z_next
            # Past the slice's end this reads the last group again, unused.
            s_next, z_next = _group_row(s_ptr, z_ptr, k0 + _TILE_K, K, group_size, N, offs_n,
                                        mask_n)
        for t in tl.static_range(8):
            k_t = k0 + SLICE * t
            if t % GROUP_SLICES == 0:
                if not PREFETCH:
                    s, z = _group_row(s_ptr, z_ptr, k_t, K, group_size, N, offs_n, mask_n)
                if SCALE_A:  # the group's scale and shift in the dot's type, once a group
                    s_w = _per_n(s.to(x_ptr.dtype.element_ty), SWAP_AB)
                    z_w = _per_n(z.to(x_ptr.dtype.element_ty), SWAP_AB)
                else:
                    part = tl.zeros_like(acc)
                    # Summed over the group's slices elementwise, reduced across columns once.
                    x_cols = tl.zeros((BLOCK_M, SLICE), dtype=tl.float32)
            offs_k = k_t + offs_r
            if EVEN_K:
                x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            else:
                x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :],
                            other=0.0)
            w = _decode_slice(words, t, z, x.dtype, BIAS and not SCALE_A, ZERO_POINT, SWAP_AB,
                              PTX_DECODE)
            if SCALE_A:  # the weight itself: (q - z) * s, or q * s + m
                w = w * s_w + z_w if not ZERO_POINT else w * s_w
            if SWAP_AB:
                a, b = w.to(x.dtype), tl.trans(x)
            else:
                a, b = x, w.to(x.dtype)
            if SCALE_A:
                acc = _dot(a, b, acc)
            else:
                part = _dot(a, b, part)
                if BIAS or not ZERO_POINT:
                    x_cols += x.to(tl.float32)
                if (t + 1) % GROUP_SLICES == 0:
                    x_sum = _per_m(tl.sum(x_cols, axis=1), SWAP_AB)
                    if BIAS:
                        if ZERO_POINT:
                            part -= x_sum * _per_n(z + BIAS_VALUE, SWAP_AB)
                        else:
                            part -= x_sum * BIAS_VALUE
                    acc += part * _per_n(s, SWAP_AB)
                    if not ZERO_POINT:
                        acc += x_sum * _per_n(z, SWAP_AB)
    if SWAP_AB:
        acc = tl.trans(acc)
    finish(acc, out_ptr, partial_ptr, counter_ptr, offs_m, offs_n, mask_m, mask_n,
           M, N, stride_om, pid_n, pid_s, num_splits, SPLIT, 1)


# The slices whose codes the low and the high nibble of byte b of a word hold (nibble_shift).
_BYTE_SLICES = ((0, 2), (4, 6), (1, 3), (5, 7))
_LIFT = "0x000F000F, 0x43004300, 0xEA"  # lop3's (a & 0x000F000F) | 0x43004300


def _pairs_ptx(rows: int, words: int) -> str:
    """PTX for ``words`` words of codes (one, or those of word rows r and r + 1) against
    ``rows`` rows of bfloat16 activations: outputs ``$0 .. $(rows - 1)`` (float32), then the
    words, the pair ``(128 + z, 128 + z)`` (or ``(128, 128)`` for offsets), and per row
    ``4 * words`` activation pairs (int32 of two bfloat16: ``_x_pairs``, ``_x_word_pairs``).

    Each ``lop3`` lifts two codes into the mantissas of the pair (128, 128), which then reads
    ``(128 + q, 128 + q')`` exactly; less the zero pair it is ``(q - z, q' - z)``, exact too.
    Which two codes:

    - one word: the word shifted by 4p, slices 2p and 2p + 1 of its row (bits 4p and
      16 + 4p), 16 columns apart, so x pair p is two loads merged;
    - two words: ``prmt`` puts byte b of each word in one half, so a mask lifts the same
      slice of both rows, two adjacent columns: x pair t (slice t) is one int32 load, for one
      ``prmt`` per two masks.

    Decoded once for all rows; each row then takes packed multiply-adds, four to a bfloat16
    chain (so their rounding stays below the output's), the chains summed in float32."""
    word = [f"${rows + i}" for i in range(words)]
    zero = f"${rows + words}"
    lines = [".reg .b32 w, u, v<8>, acc, lo, hi;"]
    if words == 1:
        for p in range(4):  # v_p meets x pair p
            if p:
                lines.append(f"shr.b32 w, {word[0]}, {4 * p};")
            lines.append(f"lop3.b32 v{p}, {'w' if p else word[0]}, {_LIFT};")
        x_of_v = list(range(4))
    else:
        for b in range(4):  # v_(2b), v_(2b + 1): the low and high nibble of byte b
            selector = b | b << 4 | (4 + b) << 8 | (4 + b) << 12
            lines += [f"prmt.b32 u, {word[0]}, {word[1]}, {selector:#06x};",
                      f"lop3.b32 v{2 * b}, u, {_LIFT};", "shr.b32 w, u, 4;",
                      f"lop3.b32 v{2 * b + 1}, w, {_LIFT};"]
        x_of_v = [_BYTE_SLICES[i // 2][i % 2] for i in range(8)]
    lines += [f"sub.rn.bf16x2 v{i}, v{i}, {zero};" for i in range(4 * words)]
    for r in range(rows):
        first_x = rows + words + 1 + 4 * words * r
        for chain in range(words):
            v = range(4 * chain, 4 * chain + 4)
            x = [f"${first_x + x_of_v[i]}" for i in v]
            lines.append(f"mul.rn.bf16x2 acc, v{v[0]}, {x[0]};")
            lines += [f"fma.rn.bf16x2 acc, v{i}, {xi}, acc;" for i, xi in zip(v[1:], x[1:])]
            lines += ["shl.b32 lo, acc, 16;", "and.b32 hi, acc, 0xFFFF0000;"]
            lines += ([f"add.f32 ${r}, lo, hi;"] if chain == 0
                      else [f"add.f32 ${r}, ${r}, lo;", f"add.f32 ${r}, ${r}, hi;"])
    return "{\n" + "\n".join(lines) + "\n}"


def _pairs_constraints(rows: int, words: int) -> str:
    return ",".join(["=f"] * rows + ["r"] * (words + 1 + 4 * words * rows))


# By (rows, words).
_PTX = {(r, w): tl.constexpr(_pairs_ptx(r, w)) for r in (1, 2) for w in (1, 2)}
_CONSTRAINTS = {(r, w): tl.constexpr(_pairs_constraints(r, w)) for r in (1, 2) for w in (1, 2)}
_PTX_1, _PTX_2, _PTX_1W2, _PTX_2W2 = _PTX[1, 1], _PTX[2, 1], _PTX[1, 2], _PTX[2, 2]
_CONSTRAINTS_1, _CONSTRAINTS_2 = _CONSTRAINTS[1, 1], _CONSTRAINTS[2, 1]
_CONSTRAINTS_1W2, _CONSTRAINTS_2W2 = _CONSTRAINTS[1, 2], _CONSTRAINTS[2, 2]


@triton.jit
def _x_pair(x16_ptrs, cols, p: tl.constexpr, K, EVEN: tl.constexpr):
    """The columns of slices ``2p`` and ``2p + 1`` of each word row (``cols`` is its column of
    slice 0) of a 16-bit row, as one int32 per word row: the pair that the word's bits
    ``4p`` and ``16 + 4p`` meet."""
    lo_k = cols + 2 * p * (_TILE_K // 8)
    hi_k = lo_k + _TILE_K // 8
    if EVEN:
        lo = tl.load(x16_ptrs + lo_k)
        hi = tl.load(x16_ptrs + hi_k)
    else:
        lo = tl.load(x16_ptrs + lo_k, mask=lo_k < K, other=0)
        hi = tl.load(x16_ptrs + hi_k, mask=hi_k < K, other=0)
    return (lo.to(tl.int32) & 0xFFFF) | (hi.to(tl.int32) << 16)


@triton.jit
def _slice0_cols(rows, BLOCK_KW: tl.constexpr):
    """The columns that slice 0 of word rows ``rows`` holds: ``BLOCK_KW`` consecutive rows of
    one tile (it divides ``SLICE_K``; the first is a multiple of it), so contiguous columns."""
    cols = (rows // (_TILE_K // 8)) * _TILE_K + rows % (_TILE_K // 8)
    return tl.max_contiguous(tl.multiple_of(cols, BLOCK_KW), BLOCK_KW)


@triton.jit
def _slice0_pairs(rows, PAIRS: tl.constexpr):
    """For ``PAIRS`` even word rows ``r`` (rows r and r + 1 of one tile, the first a multiple
    of ``2 * PAIRS``): the int32 index of the column pair (``c``, ``c + 1``) that slice 0 of
    rows r and r + 1 holds, contiguous."""
    pairs = ((rows // (_TILE_K // 8)) * _TILE_K + rows % (_TILE_K // 8)) // 2
    return tl.max_contiguous(tl.multiple_of(pairs, PAIRS), PAIRS)


@triton.jit
def _pair_sum(xp):
    """The two bfloat16 of each int32, added in float32."""
    return (xp << 16).to(tl.float32, bitcast=True) + (xp & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _x_pairs(x_ptr, row, M, K, stride_xm, cols, EVEN: tl.constexpr, ZERO_POINT: tl.constexpr):
    """Row ``row`` of x (the last row in its place past M: its output is masked) as the four
    int32 pairs of each word's columns, and, for offsets, each word's sum of x."""
    x16_ptrs = (x_ptr.to(tl.pointer_type(tl.int16), bitcast=True)
                + tl.minimum(row, M - 1) * stride_xm)
    x01 = _x_pair(x16_ptrs, cols, 0, K, EVEN)
    x23 = _x_pair(x16_ptrs, cols, 1, K, EVEN)
    x45 = _x_pair(x16_ptrs, cols, 2, K, EVEN)
    x67 = _x_pair(x16_ptrs, cols, 3, K, EVEN)
    x_sum = tl.zeros(cols.shape, dtype=tl.float32)
    if not ZERO_POINT:
        x_sum = _pair_sum(x01) + _pair_sum(x23) + _pair_sum(x45) + _pair_sum(x67)
    return x01[:, None], x23[:, None], x45[:, None], x67[:, None], x_sum


@triton.jit
def _x_word_pair(x32_ptrs, pairs, t: tl.constexpr, K, EVEN: tl.constexpr):
    """Slice ``t``'s columns of each pair of word rows: one int32 (two bfloat16) per pair."""
    k = pairs + t * (_TILE_K // 16)
    if EVEN:
        return tl.load(x32_ptrs + k)[:, None]
    return tl.load(x32_ptrs + k, mask=2 * k < K, other=0)[:, None]  # K is even


@triton.jit
def _x_word_pairs(x_ptr, row, M, K, stride_xm, pairs, EVEN: tl.constexpr,
                  ZERO_POINT: tl.constexpr):
    """Row ``row`` of x as the eight int32 pairs that two word rows' slices meet (slice order;
    ``pairs`` from ``_slice0_pairs``), and, for offsets, each pair of rows' sum of x. Rows
    are int32-aligned (``_gemv_decode`` checks)."""
    x32_ptrs = (x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
                + tl.minimum(row, M - 1) * (stride_xm // 2))
    x0 = _x_word_pair(x32_ptrs, pairs, 0, K, EVEN)
    x1 = _x_word_pair(x32_ptrs, pairs, 1, K, EVEN)
    x2 = _x_word_pair(x32_ptrs, pairs, 2, K, EVEN)
    x3 = _x_word_pair(x32_ptrs, pairs, 3, K, EVEN)
    x4 = _x_word_pair(x32_ptrs, pairs, 4, K, EVEN)
    x5 = _x_word_pair(x32_ptrs, pairs, 5, K, EVEN)
    x6 = _x_word_pair(x32_ptrs, pairs, 6, K, EVEN)
    x7 = _x_word_pair(x32_ptrs, pairs, 7, K, EVEN)
    x_sum = tl.zeros(pairs.shape, dtype=tl.float32)
    if not ZERO_POINT:
        x_sum = tl.sum(_pair_sum(x0) + _pair_sum(x1) + _pair_sum(x2) + _pair_sum(x3)
                       + _pair_sum(x4) + _pair_sum(x5) + _pair_sum(x6) + _pair_sum(x7), axis=1)
    return x0, x1, x2, x3, x4, x5, x6, x7, x_sum


@triton.jit
def _add_scaled(acc, qx, s, z, x_sum, ZERO_POINT: tl.constexpr):
    """One block of K into the accumulator: its scale times ``sum (q - z) * x``, and for
    offsets (``q * s + m``) ``m`` times the block's sum of x."""
    if ZERO_POINT:
        return acc + s[None, :] * qx
    return acc + s[None, :] * qx + z[None, :] * x_sum[:, None]


@triton.jit(do_not_specialize=["M"])
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, K, K_PAD, group_size, k_per_split, num_splits, stride_xm, stride_om,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ZERO_POINT: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr, DECODE: tl.constexpr,
    PAIR_WORDS: tl.constexpr, PDL: tl.constexpr,
):
    """One or two rows (``ROWS``) of ``x`` by CUDA cores (two only with ``"pairs"``, which
    decodes a word's codes once for both). Each block of K lies in one group, so its scale
    multiplies a sum of ``(q - z) * x`` per output once rather than every weight. No code goes
    through an int-to-float conversion (a quarter-rate instruction that held the tiles to a
    fifth of the copy rate); ``DECODE`` picks how they become floats:

    - ``"pairs"`` (NVIDIA, bfloat16 ``x``): ``_pairs_ptx``, two codes per instruction, eight
      multiply-adds in four packed ones per row (in the sm_90 SASS about 3 instructions per
      code at one row and 4 at two, against 4.8 below at one). The bfloat16 sums span four
      products; their rounding is below the output's.
    - ``"subnormal"`` (NVIDIA): the masked nibble alone reads as the subnormal
      ``q * 2**(4j - 149)``; an FMA with the immediate ``2**127`` and ``z * 2**(4j - 22)``
      makes it ``(q - z) * 2**(4j - 22)`` exactly, and x carries the ``2**(22 - 4j)``.
    - ``"exponent"`` (AMD, whose float32 subnormals may flush): the nibble is or-ed into the
      exponent of ``2**(23 - 4j)``, whose mantissa unit is then ``16**-j``, so the bits read
      ``2**(23 - 4j) + q`` exactly; subtracting ``2**(23 - 4j) + z`` leaves ``q - z``.

    ``PAIR_WORDS`` (``"pairs"`` only): decode word rows r and r + 1 together, so that each
    packed pair holds one slice's code of both rows, two adjacent columns: x pairs are then
    single int32 loads (``_x_word_pairs``) instead of two 16-bit loads merged, which the
    K-strided layout otherwise costs the GEMV (it took 17-45% longer than the earlier layout,
    where a word's pairs were adjacent columns)."""
    gate(PDL)
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    # With PAIR_WORDS each accumulator row takes two word rows.
    ACC_ROWS: tl.constexpr = BLOCK_KW // 2 if PAIR_WORDS else BLOCK_KW
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # Word rows (as 8 * row) of this slice; the padded tiles make every one exist.
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K_PAD)
    # One accumulator per row; the second is never read at one row, so it costs nothing.
    acc0 = tl.zeros((ACC_ROWS, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((ACC_ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PAIR_WORDS:  # the even rows; their odd neighbours are one row of N further
            rows = k0 // 8 + 2 * tl.arange(0, ACC_ROWS)
        else:
            rows = k0 // 8 + tl.arange(0, BLOCK_KW)
        w_ptrs = qw_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
        g_ptrs = ((k0 // _TILE_K) * _TILE_K // group_size) * N + offs_n  # the tile's group
        if EVEN:
            words = tl.load(w_ptrs)
            if PAIR_WORDS:
                words1 = tl.load(w_ptrs + N)
            s = tl.load(s_ptr + g_ptrs).to(tl.float32)
            z = tl.load(z_ptr + g_ptrs).to(tl.float32)
        else:
            words = tl.load(w_ptrs, mask=mask_n[None, :], other=0)
            if PAIR_WORDS:
                words1 = tl.load(w_ptrs + N, mask=mask_n[None, :], other=0)
            s = tl.load(s_ptr + g_ptrs, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g_ptrs, mask=mask_n, other=0.0).to(tl.float32)
        if DECODE == "pairs":
            if ZERO_POINT:
                c = (z + 128.0).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                c = (c | (c << 16))[None, :]
            else:
                c = tl.full((1, BLOCK_N), 0x43004300, tl.int32)
            if PAIR_WORDS:
                pairs = _slice0_pairs(rows, ACC_ROWS)
                a0, a1, a2, a3, a4, a5, a6, a7, a_sum = _x_word_pairs(
                    x_ptr, 0, M, K, stride_xm, pairs, EVEN, ZERO_POINT)
                if ROWS == 1:
                    q0 = tl.inline_asm_elementwise(
                        _PTX_1W2, _CONSTRAINTS_1W2, [words, words1, c, a0, a1, a2, a3, a4, a5,
                                                     a6, a7],
                        dtype=tl.float32, is_pure=True, pack=1)
                else:
                    b0, b1, b2, b3, b4, b5, b6, b7, b_sum = _x_word_pairs(
                        x_ptr, 1, M, K, stride_xm, pairs, EVEN, ZERO_POINT)
                    q0, q1 = tl.inline_asm_elementwise(
                        _PTX_2W2, _CONSTRAINTS_2W2,
                        [words, words1, c, a0, a1, a2, a3, a4, a5, a6, a7,
                         b0, b1, b2, b3, b4, b5, b6, b7],
                        dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
                    acc1 = _add_scaled(acc1, q1, s, z, b_sum, ZERO_POINT)
            else:
                cols = _slice0_cols(rows, BLOCK_KW)
                a01, a23, a45, a67, a_sum = _x_pairs(x_ptr, 0, M, K, stride_xm, cols, EVEN,
                                                     ZERO_POINT)
                if ROWS == 1:
                    q0 = tl.inline_asm_elementwise(_PTX_1, _CONSTRAINTS_1,
                                                   [words, c, a01, a23, a45, a67],
                                                   dtype=tl.float32, is_pure=True, pack=1)
                else:
                    b01, b23, b45, b67, b_sum = _x_pairs(x_ptr, 1, M, K, stride_xm, cols, EVEN,
                                                         ZERO_POINT)
                    q0, q1 = tl.inline_asm_elementwise(
                        _PTX_2, _CONSTRAINTS_2,
                        [words, c, a01, a23, a45, a67, b01, b23, b45, b67],
                        dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
                    acc1 = _add_scaled(acc1, q1, s, z, b_sum, ZERO_POINT)
            acc0 = _add_scaled(acc0, q0, s, z, a_sum, ZERO_POINT)
        else:
            cols = _slice0_cols(rows, BLOCK_KW)
            high = words >> 16
            qx = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
            x_sum = tl.zeros((BLOCK_KW,), dtype=tl.float32)
            for i in tl.static_range(8):
                j = i // 2  # nibble_shift(i): nibble j of the low (even i) or high half-word
                half = words if i % 2 == 0 else high
                k = cols + (_TILE_K // 8) * i
                if EVEN:
                    x = tl.load(x_ptr + k).to(tl.float32)
                else:
                    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                if not ZERO_POINT:
                    x_sum += x
                if DECODE == "subnormal":
                    f = (half & (0xF << (4 * j))).to(tl.float32, bitcast=True)
                    q = f * 1.7014118346046923e38  # 2**127
                    if ZERO_POINT:
                        q -= (z * (1.0 / (1 << (22 - 4 * j))))[None, :]
                    qx += q * (x * (1 << (22 - 4 * j)))[:, None]
                else:
                    bits = (half & (0xF << (4 * j))) | ((150 - 4 * j) << 23)
                    q = bits.to(tl.float32, bitcast=True) - (1 << (23 - 4 * j))
                    if ZERO_POINT:
                        q -= z[None, :]
                    qx += q * x[:, None]
            acc0 = _add_scaled(acc0, qx, s, z, x_sum, ZERO_POINT)
    if ROWS == 1:
        y = tl.sum(acc0, axis=0)[None, :]
    else:
        y = tl.permute(tl.join(tl.sum(acc0, axis=0), tl.sum(acc1, axis=0)), (1, 0))
    offs_m = tl.arange(0, ROWS)
    finish(y, out_ptr, partial_ptr, counter_ptr, offs_m, offs_n, offs_m < M, mask_n, M, N,
           stride_om, pid_n, pid_s, num_splits, SPLIT, 16)


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, K_WORDS, group_size,
                    BLOCK_KW: tl.constexpr, BLOCK_N: tl.constexpr, ZERO_POINT: tl.constexpr,
                    PDL: tl.constexpr):
    """The dense ``[K, N]`` weight, ``8 * BLOCK_KW`` rows by ``BLOCK_N`` columns a program."""
    gate(PDL)
    rows = tl.program_id(0) * BLOCK_KW + tl.arange(0, BLOCK_KW)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    words = tl.load(qw_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :],
                    mask=(rows < K_WORDS)[:, None] & mask_n[None, :], other=0)
    cols = _slice0_cols(rows, BLOCK_KW)
    for i in tl.static_range(8):
        k = cols + (_TILE_K // 8) * i
        mask = (k < K)[:, None] & mask_n[None, :]
        g_ptrs = (k // group_size)[:, None] * N + offs_n[None, :]
        s = tl.load(s_ptr + g_ptrs, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_ptrs, mask=mask, other=0.0).to(tl.float32)
        w = _dequant(((words >> (4 * (i // 2) + 16 * (i % 2))) & 0xF).to(tl.float32), s, z,
                     ZERO_POINT)  # nibble_shift(i)
        tl.store(out_ptr + k[:, None].to(tl.int64) * N + offs_n[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=mask)


# Rows up to which the CUDA-core GEMV runs (one where its decode is not the packed PTX's), and
# from which the weight is dequantized for cuBLAS (written with _TILE_CONFIGS); the tiles in
# between.
GEMV_MAX_M = 2
DEQUANT_MIN_M = 129
PATHS = ("mma", "gemv", "tiles", "wgmma", "dequant")


class _TileConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int  # the split of K aims at this many (where one block holds every row)
    bias: bool  # the kernel's BIAS for 16-bit activations
    prefetch: bool = False  # the kernel's PREFETCH, where a tile lies in one group
    swap_ab: bool = False  # the kernel's SWAP_AB: the tile computed transposed
    scale_a: bool = False  # the kernel's SCALE_A: the scales applied to the weights
    ptx_decode: bool = False  # the kernel's PTX_DECODE, where _tile_ptx allows it


# The tiles' configuration for M up to each bound (None: any M), fixed (no autotuning): for each
# bound, the candidate fastest over the four Llama-3-8B layers summed over the swept M in its
# range (`scripts/bench_w4a16.py --sweep-tiles`, which with --write-choice rewrites this
# table). From the H200 sweep of 2026-12-01 (benchmarks/results/issue30/w4a16_variants_*):
# q - z in 16 bits (bias False) and the scale row a tile ahead (prefetch) won at every M up to
# 64 (M = 16: 92 us against 117 with neither; M = 32: 114 against 191). The large-M sweep
# (w4a16_large_sweep_h200.*): from 64 rows the transposed tiles (swap_ab, the decoded weights
# wgmma's register operand) with the PTX decode: 141 us at M = 64 against 190 for the tiles
# before; 272 at M = 128 against 329 for dequantize + cuBLAS; at 256 dequantize + cuBLAS
# (333 against 410). The sweep put the dequantize bound at 256 (its first losing M);
# DEQUANT_MIN_M is 129 instead, so no M between the swept 128 and 256 takes unmeasured tiles.
_TILE_CONFIGS = (
    (16, _TileConfig(16, 128, 4, 3, 4, False, True, False, False, False)),
    (32, _TileConfig(32, 128, 4, 3, 2, False, True, False, False, False)),
    (64, _TileConfig(64, 128, 4, 3, 2, False, True, True, False, True)),
    (128, _TileConfig(128, 128, 4, 3, 2, False, True, True, True, True)),
    (None, _TileConfig(64, 128, 4, 3, 2, False, True, True, False, True)),
)


def _config(m: int) -> _TileConfig:
    return next(cfg for bound, cfg in _TILE_CONFIGS if bound is None or m <= bound)


def _gemv_config() -> _GemvConfig:
    # Swept on the H200 over the 8B layers (BLOCK_N 128-512, BLOCK_K 64-128, 2 or 4 warps,
    # 4-32 programs per SM; scripts/bench_w4a16.py --sweep-gemv): 256 x 64, 2 warps, 8 per SM
    # read them at 47% of the copy rate with the earlier layout, the best within noise.
    # Pairing word rows loses at one row and wins at two, in both sweeps: 58 against 55 us and
    # 75 against 87 (H200, 2026-12-01); 65.4 against 62.3 and 83.5 against 91.6 (H100,
    # 2026-12-05, w4a16_gemv_prefetch_sweep_h100.json). Two rows take the GEMV only where the
    # mma kernels are not built.
    return _GemvConfig(256, 64, 2, 8, 2)


# Slices of K at most: each leaves a partial sum of N floats to write and read back.
GEMV_MAX_SPLITS = 64


def _config_for(m: int, dtype: torch.dtype, arch: str | None) -> _TileConfig:
    """``_config``, on AMD GPUs (``arch``; None on NVIDIA) with the tiles before the transposed
    form (which is for Hopper's wgmma) in its place, and those that pass the 64 KiB of LDS of
    AMD GPUs other than gfx950 cut to 2 stages: fp32 ones, and 128-row ones whose dot takes
    ``q - z`` (its 16-bit copy of the decoded tile; 80 KiB on gfx1100). Chosen by compiling
    for gfx90a/gfx942/gfx1100 on the CPU (``scripts/amd_compile_sweep.py``); never run on an
    AMD GPU."""
    cfg = _config(m)
    if arch is None:
        return cfg
    if cfg.swap_ab:
        cfg = _TileConfig(min(cfg.block_m, 128), 128, 4 if cfg.block_m <= 64 else 8, 3,
                          cfg.programs_per_sm, False, cfg.prefetch)
    large = dtype == torch.float32 or (cfg.block_m >= 128 and not cfg.bias)
    if not large or arch.startswith("gfx950"):
        return cfg
    return cfg._replace(num_stages=min(cfg.num_stages, 2))


def _gemv_block_k(w: PackedW4, block_k: int) -> int | None:
    """The GEMV's block of K: a block's codes span its tile's ``TILE_K`` columns, and its
    scale multiplies their sum, so None unless each tile lies in one group."""
    if w.scales.shape[0] == 1 or w.group_size % TILE_K == 0:
        return block_k
    return None


def _group_slices(w: PackedW4) -> int | None:
    """The tiles' ``GROUP_SLICES``: slices of ``SLICE_K`` columns between scales, one where
    groups cut tiles unevenly (each slice finds its group), None where they cut slices."""
    if w.scales.shape[0] == 1 or w.group_size % TILE_K == 0:
        return 8
    if w.group_size % SLICE_K:
        return None
    return w.group_size // SLICE_K if TILE_K % w.group_size == 0 else 1


# The rows for which the CUDA C++ kernels (where they are built) beat the Triton paths on the
# H200 (the four 8B layers summed, scripts/bench_w4a16.py --sweep-mma, 2026-12-01 and -02):
# from 2 rows against the GEMV (66 against 75 us), up to 16 against the tiles (88 against 90
# us at 8; with blocks of 16 rows 81 against 91 at 9, 89 against 94 at 16); at 32 the tiles
# win (115 against 121), at 64 (141 against 176) and 128 (272 against 277) too. The kernels
# themselves take any M.
MMA_ROWS = range(2, 17)


# The rows for which the Hopper kernel (where it is built) takes over from the tiles and the
# dequantize path. Its first H200 sweep (2026-12-05, ``scripts/gpu_check.sh w4a16-wgmma``;
# benchmarks/results/issue30/w4a16_wgmma_sweep_h200.*), the four 8B layers summed: 129 against
# 140 us for the tiles at 64 rows, 202 against 273 at 128, 306 against 339 for dequantize +
# cuBLAS at 256, and even at 512 (497 against 487), which dequantize + cuBLAS keeps. At 64 rows
# the tiles still win on the two smaller layers (qkv 20 against 26 us, o 17 against 20; the
# larger: gate_up 66 against 47, down 39 against 36), so weights of fewer than
# ``WGMMA_MIN_CODES_AT_64`` codes keep them there. Taken by default since its whole H200 test
# file and the engine's AWQ/GPTQ checkpoint tests passed with it (2026-12-05);
# PAGEDSERVE_W4A16_WGMMA=0 turns it off.
WGMMA_ROWS = range(64, 512)
WGMMA_MIN_CODES_AT_64 = 32 * 2**20


@functools.lru_cache(maxsize=1)
def _wgmma_on() -> bool:
    """PAGEDSERVE_W4A16_WGMMA, read once (every 4-bit layer of every step asks)."""
    return envs.w4a16_wgmma()


def _wgmma_rows(m: int, w: PackedW4) -> bool:
    if m not in WGMMA_ROWS or not _wgmma_on():
        return False
    return m > WGMMA_ROWS.start or w.qweight.shape[1] * w.in_features >= WGMMA_MIN_CODES_AT_64


def _choose_path(x: torch.Tensor, w: PackedW4) -> str:
    m = x.shape[0]
    if m in MMA_ROWS and w4a16_mma.usable(x, w):
        return "mma"
    if _wgmma_rows(m, w) and w4a16_wgmma.usable(x, w):
        return "wgmma"
    if m <= _gemv_max_rows(_gemv_decode(x)) and _gemv_block_k(w, _gemv_config().block_k):
        return "gemv"
    return "tiles" if m < DEQUANT_MIN_M and _group_slices(w) else "dequant"


def matmul(x: torch.Tensor, w: PackedW4, split_k: int | None = None,
           out: torch.Tensor | None = None, path: str | None = None) -> torch.Tensor:
    """``x [M, K]`` (float16, bfloat16 or float32) times the packed weight: ``[M, N]`` in
    ``x``'s dtype, written into ``out`` (contiguous) if given. ``split_k`` and ``path`` (one
    of ``PATHS``) override the choices (tests, benchmarks)."""
    m, k = x.shape
    n = w.qweight.shape[1]
    if k != w.in_features:
        raise ValueError(f"x has {k} columns, the weight {w.in_features}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    path = path or _choose_path(x, w)
    if path == "dequant":
        return torch.mm(x, dequantize(w, x.dtype), out=out)
    if path == "mma":
        if not w4a16_mma.eligible(x, w):
            raise ValueError("the mma kernels take 16-bit x on NVIDIA, zero points and groups "
                             "of a power of two from 32")
        return w4a16_mma.matmul(x, w, out, split_k)
    if path == "wgmma":
        if not w4a16_wgmma.eligible(x, w):
            raise ValueError("the wgmma kernel takes 16-bit x on an sm_90 GPU, zero points and "
                             "groups of a power of two from 32")
        return w4a16_wgmma.matmul(x, w, out)
    if path == "gemv":
        return _gemv(x, w, split_k, out)
    group_slices = _group_slices(w)
    if group_slices is None:
        raise ValueError(f"the tiles take groups of a multiple of {SLICE_K}, not "
                         f"{w.group_size}")
    cfg = _config_for(m, x.dtype, gpu_arch(x.device))
    grid_m, grid_n = triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)
    tiles = w.qweight.shape[0] // SLICE_K
    splits = 1
    if grid_m == 1:  # the counters are per block of N
        splits = split_k or split_count(grid_n, tiles,
                                        cfg.programs_per_sm * sm_count(x.device), 1)
    k_per_split = triton.cdiv(tiles, splits) * TILE_K
    splits = triton.cdiv(k, k_per_split)
    # Where the slices leave their partial sums (not written when there is one slice).
    partial = torch.empty((splits, m, n) if splits > 1 else (1,), dtype=torch.float32,
                          device=x.device)
    _w4a16_kernel[(grid_m, grid_n, splits)](
        x, w.qweight, w.scales, w.shifts, out, partial, w.counters,
        m, n, k, w.group_size, k_per_split, splits, x.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_SLICES=group_slices,
        ZERO_POINT=w.zero_point, SPLIT=splits > 1, EVEN_K=k % TILE_K == 0,
        BIAS=cfg.bias and x.dtype != torch.float32, PREFETCH=cfg.prefetch and group_slices == 8,
        SWAP_AB=cfg.swap_ab, SCALE_A=cfg.scale_a, PTX_DECODE=cfg.ptx_decode and _tile_ptx(x),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device))
    return out


def _gemv_decode(x: torch.Tensor) -> str:
    """``_w4a16_gemv_kernel``'s DECODE for ``x``: the packed PTX needs NVIDIA (not the
    interpreter), bfloat16 and int32-aligned rows."""
    if x.device.type != "cuda" or gpu_arch(x.device) is not None:
        return "exponent" if x.device.type == "cuda" else "subnormal"
    if (x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0 and x.shape[1] % 8 == 0
            and (x.shape[0] == 1 or x.stride(0) % 2 == 0)):
        return "pairs"
    return "subnormal"


def _tile_ptx(x: torch.Tensor) -> bool:
    """Whether the tiles may decode with ``_slice_ptx``: 16-bit x on NVIDIA (not ROCm, not the
    interpreter)."""
    return (x.device.type == "cuda" and gpu_arch(x.device) is None
            and x.dtype in (torch.bfloat16, torch.float16))


def _gemv_max_rows(decode: str) -> int:
    return GEMV_MAX_M if decode == "pairs" else 1


def _gemv(x: torch.Tensor, w: PackedW4, split_k: int | None, out: torch.Tensor) -> torch.Tensor:
    """``matmul``'s few-row path: ``_w4a16_gemv_kernel``, K split for enough programs."""
    (m, k), n = x.shape, w.qweight.shape[1]
    cfg = _gemv_config()
    block_k = _gemv_block_k(w, cfg.block_k)
    decode = _gemv_decode(x)
    if m > _gemv_max_rows(decode) or block_k is None:
        raise ValueError(f"the GEMV takes up to {GEMV_MAX_M} bfloat16 rows on NVIDIA (else "
                         f"one) and groups of a multiple of {TILE_K}, not {m} {x.dtype} rows "
                         f"and groups of {w.group_size}")
    k_pad = w.qweight.shape[0] * 8
    grid_n, k_blocks = triton.cdiv(n, cfg.block_n), triton.cdiv(k_pad, block_k)
    # Slices as short as one block: a decode step's smaller weights (8 MB) must be nearly all
    # in flight at once to be read at the copy rate, which few long slices cannot do.
    splits = split_k or split_count(grid_n, k_blocks, cfg.programs_per_sm * sm_count(x.device),
                                    1)
    splits = min(splits, GEMV_MAX_SPLITS)
    k_per_split = triton.cdiv(k_blocks, splits) * block_k
    splits = triton.cdiv(k_pad, k_per_split)
    partial = torch.empty((splits, m, n) if splits > 1 else (1,), dtype=torch.float32,
                          device=x.device)
    _w4a16_gemv_kernel[(grid_n, splits)](
        x, w.qweight, w.scales, w.shifts, out, partial, w.counters,
        m, n, k, k_pad, w.group_size, k_per_split, splits, x.stride(0), out.stride(0),
        ROWS=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        ZERO_POINT=w.zero_point, SPLIT=splits > 1,
        # No masks where every block is whole: they cost as much as the arithmetic.
        EVEN=n % cfg.block_n == 0 and k % TILE_K == 0, DECODE=decode,
        PAIR_WORDS=m >= cfg.pair_words_from and decode == "pairs",
        num_warps=cfg.num_warps, num_stages=1, **launch_options(x.device))
    return out


def dequantize(w: PackedW4, dtype: torch.dtype) -> torch.Tensor:
    """The packed weight as a dense ``[K, N]`` tensor of ``dtype`` (rounded once)."""
    n, k = w.qweight.shape[1], w.in_features
    dense = torch.empty((k, n), dtype=dtype, device=w.qweight.device)
    block_kw, block_n = 8, 128
    _dequant_kernel[(triton.cdiv(w.qweight.shape[0], block_kw), triton.cdiv(n, block_n))](
        w.qweight, w.scales, w.shifts, dense, n, k, w.qweight.shape[0], w.group_size,
        BLOCK_KW=block_kw, BLOCK_N=block_n, ZERO_POINT=w.zero_point, num_warps=4,
        **launch_options(dense.device))
    return dense
