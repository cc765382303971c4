"""The Triton mixture-of-experts kernel reading FP8 expert weights (W8A16, ``SCALES`` "row"
and "block" of ``kernels/fused_moe.py``) against a float64 loop over each token's top-k
experts, on weights dequantized here by indexing each element's scale (not by the forms'
``dequantize``).

Block scales come in grids with partial edge blocks (sizes no block divides) and in blocks
narrower than the config's K tile; the scales vary by a factor of 20 between blocks, so a grid
read the wrong way round, or a scale per row applied where it is per block, fails the same
check. Without an NVIDIA GPU the kernel runs under Triton's interpreter in float32 and float16;
with one, bf16 and model-sized shapes join.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.devices import HAS_NVIDIA, choose_triton_interpreter, interpreter_guards
from tests.models.test_moe import reference_moe

IMPORTED_TOO_LATE = choose_triton_interpreter()
pytest.importorskip("triton")

if not IMPORTED_TOO_LATE:
    from pagedserve.platforms.cuda.kernels import fused_moe as moe
    from pagedserve.quant.weights import BlockFp8Weight, Fp8Weight
    from tests.platforms.cuda.test_fused_moe import routing

_kernels_runnable, test_in_a_fresh_interpreter_process = interpreter_guards(
    __file__, IMPORTED_TOO_LATE)

DEVICE = torch.device("cuda" if HAS_NVIDIA else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def fp8_stack(experts: int, n: int, k: int, block: tuple[int, int] | None, seed: int):
    """Random FP8 experts ``[E, N, K]`` with scales per row (``block`` None) or per block, and
    the float64 weights they stand for, each element times the scale of its row or block."""
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(experts, n, k, generator=g) * 64).to(torch.float8_e4m3fn)
    if block is None:
        scales = (torch.rand(experts, n, generator=g) * 1.9 + 0.1) / (64 * math.sqrt(k))
        dense = values.double() * scales.double()[:, :, None]
        return Fp8Weight(values.to(DEVICE), scales.to(DEVICE)), dense
    grid = (experts, -(-n // block[0]), -(-k // block[1]))
    scales = (torch.rand(grid, generator=g) * 1.9 + 0.1) / (64 * math.sqrt(k))
    rows = torch.arange(n) // block[0]
    cols = torch.arange(k) // block[1]
    dense = values.double() * scales.double()[:, rows][:, :, cols]
    return BlockFp8Weight(values.to(DEVICE), scales.to(DEVICE), block), dense


def rounded_reference(x, dense13, dense2, ids, weights, dtype):
    """The layer in float64 with the values the kernels store rounded to ``dtype`` where they
    store them: each token's gate/up rows, SwiGLU's output, each expert's weighted down rows
    and their sum. Without these roundings 16-bit outputs of model-sized layers differ from
    float64 by more than any fixed tolerance that still catches a misread scale (float16 at
    the Qwen3-30B-A3B shape: 5.6e-3 on an output of 0.27)."""
    def rounded(t):
        return t.to(dtype).double()

    x, weights = x.double(), weights.double()
    rows = torch.zeros(*ids.shape, x.shape[1], dtype=torch.float64)
    for e in ids.unique().tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        gate, up = rounded(x[t] @ dense13[e].T).chunk(2, dim=1)
        act = rounded(torch.nn.functional.silu(gate) * up)
        rows[t, k] = rounded((act @ dense2[e].T) * weights[t, k, None])
    return rounded(rows.sum(dim=1))


def problem(tokens, experts, top_k, hidden, inter, kind, block, dtype):
    w13, dense13 = fp8_stack(experts, 2 * inter, hidden, block, seed=1)
    w2, dense2 = fp8_stack(experts, hidden, inter, block, seed=2)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3))
    ids, weights = routing(tokens, experts, top_k, kind)
    x = x.to(dtype)  # the reference starts from the kernel's input
    if dtype == torch.float32:
        expected = reference_moe(x.double(), dense13, dense2, ids.cpu(), weights.cpu())
    else:
        expected = rounded_reference(x, dense13, dense2, ids.cpu(), weights.cpu(), dtype)
    return (x.to(DEVICE), w13, w2, ids, weights), expected


def close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Within ``TOL``, and for 16-bit outputs two roundings of the largest output more: the
    kernels round each expert's row before the sum over k, and a row the float32 sums put on
    the other side of a rounding boundary than float64 moves its token by an ulp of that row
    (float16 at the Qwen3-30B-A3B shape: 4.3e-3 on an output of 0.06, rows up to 10)."""
    slack = 0.0 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * expected.abs().max()
    torch.testing.assert_close(got.double().cpu(), expected, atol=TOL[dtype] + float(slack),
                               rtol=TOL[dtype])


# (tokens, experts, top_k, hidden, intermediate, routing, block): 128 x 128 blocks with
# partial ones at every edge (H 160: 128 + 32; I 96: one partial block), blocks of 32 x 64
# (narrower than the K tile: it shrinks to them), one scale row per output row (the layout
# of a gate/up pair whose blocks straddle the seam).
SHAPES = [
    (1, 8, 2, 64, 48, "random", None),
    (17, 16, 4, 48, 40, "half_idle", None),
    (5, 8, 2, 160, 96, "random", (128, 128)),
    (33, 8, 2, 160, 96, "one_takes_all", (128, 128)),
    (9, 16, 8, 96, 80, "half_idle", (32, 64)),
    (3, 4, 1, 256, 64, "random", (1, 128)),
] + ([(1, 8, 2, 4096, 1000, "random", None), (300, 128, 8, 2048, 768, "random", (128, 128)),
      (2048, 8, 2, 1024, 1792, "one_takes_all", (128, 128))] if HAS_NVIDIA else [])
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_NVIDIA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,kind,block", SHAPES)
def test_fp8_experts_match_float64(tokens, experts, top_k, hidden, inter, kind, block, dtype):
    args, expected = problem(tokens, experts, top_k, hidden, inter, kind, block, dtype)
    got = moe.fused_moe(*args)
    assert got.dtype == dtype and got.shape == args[0].shape
    close(got, expected, dtype)


def test_fp8_bits_decoded_by_integer_ops_give_the_same_result(monkeypatch):
    """GPUs without an FP8 type (before sm_89, AMD before gfx950) read the e4m3fn bits."""
    args, expected = problem(17, 8, 2, 160, 96, "random", (128, 128), torch.float32)
    native = moe.fused_moe(*args)
    monkeypatch.setattr(moe, "converts_e4m3fn", lambda device: False)
    assert torch.equal(moe.fused_moe(*args), native)
    close(native, expected, torch.float32)


def test_a_block_grid_read_transposed_fails_the_comparison():
    """Square grids (256 x 256 in blocks of 128), so the transposed grid has their shape."""
    args, expected = problem(9, 4, 2, 256, 128, "random", (128, 128), torch.float32)
    close(moe.fused_moe(*args), expected, torch.float32)
    x, w13, w2, ids, weights = args
    w13 = BlockFp8Weight(w13.values, w13.scales.transpose(1, 2).contiguous(), w13.block)
    with pytest.raises(AssertionError):
        close(moe.fused_moe(x, w13, w2, ids, weights), expected, torch.float32)


def test_block_scales_taken_once_per_row_fail_the_comparison(monkeypatch):
    """The kernel's row variant given the block grid: each column's first block scale for all
    of K, where the check must see every K block's own."""
    args, expected = problem(9, 4, 2, 256, 64, "random", (64, 64), torch.float32)
    operand = moe._operand

    def first_block_only(w, hidden, cfg):
        op = operand(w, hidden, cfg)
        return op._replace(mode="row", block=(op.block[0], 1)) if op.mode == "block" else op

    monkeypatch.setattr(moe, "_operand", first_block_only)
    with pytest.raises(AssertionError):
        close(moe.fused_moe(*args), expected, torch.float32)


def test_fp8_blocks_no_tile_fits_are_refused():
    args, _ = problem(3, 4, 2, 48, 24, "random", (24, 24), torch.float32)
    with pytest.raises(ValueError, match="24 columns wide"):
        moe.fused_moe(*args)
