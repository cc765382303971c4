"""The Triton LoRA shrink/expand (SGMV and BGMV) against a float64 row-by-row reference: rows of
mixed slots in any order, ranks below the padded rank, rows of slot -1, empty slots, shards
adapted by some slots only. Without CUDA they run under Triton's interpreter (small shapes);
outputs of rows without an adapter must stay bit-identical.

Each element must lie within the bound the kernels' own roundings allow
(``layouts.rounding_bound``: float32 accumulation, the shrunk rows in 16 bits where SGMV
rounds them, the output's dtype), computed from the magnitudes of that element's products; the
reference computes on the weights as the kernels read them (rounded to the layout's dtype). A
fixed tolerance failed correct bf16 kernels at an 8B shape (the reference kept unrounded
weights, and large shrunk rows round by more than an absolute 1.0), and would pass a wrong one
on small values."""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch

from tests.devices import HAS_NVIDIA, NVIDIA_REASON, choose_triton_interpreter, interpreter_guards

IMPORTED_TOO_LATE = choose_triton_interpreter()
pytest.importorskip("triton")

from pagedserve.lora.ops import group_rows  # noqa: E402
from tests.lora.layouts import random_layout, reference, rounding_bound  # noqa: E402

if not IMPORTED_TOO_LATE:
    from pagedserve.platforms.cuda.kernels import lora
    from pagedserve.platforms.cuda.lora_ops import TritonLoRAOps

DEVICE = torch.device("cuda" if HAS_NVIDIA else "cpu")
needs_cuda = pytest.mark.skipif(not HAS_NVIDIA, reason=NVIDIA_REASON)

_kernels_runnable, test_in_a_fresh_interpreter_process = interpreter_guards(
    __file__, IMPORTED_TOO_LATE)


class Outcome(NamedTuple):
    got: torch.Tensor
    expected: torch.Tensor  # float64, over the inputs as the kernels read them
    bound: torch.Tensor  # the most the kernels' roundings may move an element (layouts.py)
    before: torch.Tensor
    slots: list[int]

    def assert_within_bound(self) -> None:
        err = (self.got.double() - self.expected).abs()
        over = err > self.bound
        assert not over.any(), (f"{int(over.sum())} of {over.numel()} elements beyond their "
                                f"rounding bound; worst error/bound "
                                f"{float((err / self.bound).max()):.2f}")


def _run(num_rows: int, dtype: torch.dtype, seed: int, shard_sizes=(40, 24, 24),
         max_rank: int = 8, k: int = 80) -> Outcome:
    layout = random_layout(5, max_rank, k, list(shard_sizes), seed, dtype, empty_slots=(4,))
    rng = random.Random(seed)
    # Slot 3 has no rows this step; slot 4 is empty; -1 rows get nothing.
    slots = [rng.choice([-1, 0, 1, 2, 2]) for _ in range(num_rows)]
    x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out = torch.randn(num_rows, sum(shard_sizes)).to(dtype)
    out_dev = out.to(DEVICE, copy=True)  # a copy on the CPU too: ``out`` stays the input
    rows = group_rows(torch.tensor(slots, dtype=torch.int32, device=DEVICE), 5)
    shrunk = TritonLoRAOps.shrink(x.to(DEVICE), layout.a.to(DEVICE), rows)
    TritonLoRAOps.expand(shrunk, layout.b.to(DEVICE), out_dev, layout.shards, rows)
    # SGMV's expand feeds the tensor cores the shrunk rows in the weights' 16-bit dtype (as
    # Punica's and vLLM's do); float32 runs IEEE dots, and BGMV reduces in float32.
    sgmv_16bit = num_rows > lora.BGMV_MAX_ROWS and dtype != torch.float32
    bound = rounding_bound(layout, x, slots, out, dtype if sgmv_16bit else None)
    return Outcome(out_dev.cpu(), reference(layout, x, slots, out), bound, out, slots)


@pytest.mark.parametrize("num_rows", [1, 5, lora.BGMV_MAX_ROWS if not IMPORTED_TOO_LATE else 32,
                                      45, 83])
def test_kernels_equal_reference_fp32(num_rows):
    outcome = _run(num_rows, torch.float32, seed=num_rows)
    outcome.assert_within_bound()
    untouched = [i for i, s in enumerate(outcome.slots) if s == -1]
    assert torch.equal(outcome.got[untouched], outcome.before[untouched])


# Triton's interpreter runs bf16 unlike a GPU (its dots multiply bf16's uint16 bit patterns,
# its casts from float32 truncate), so bf16 runs on GPUs only; float16 takes the same paths.
SIXTEEN_BIT = [torch.float16, pytest.param(torch.bfloat16, marks=(needs_cuda, pytest.mark.cuda))]


@pytest.mark.parametrize("dtype", SIXTEEN_BIT)
@pytest.mark.parametrize("num_rows", [3, 50])
def test_kernels_equal_reference_16bit(num_rows, dtype):
    _run(num_rows, dtype, seed=100 + num_rows).assert_within_bound()


@pytest.mark.parametrize("num_rows", [4, 40])
def test_rank_beyond_one_block_and_single_shard(num_rows):
    _run(num_rows, torch.float32, seed=7 + num_rows, shard_sizes=(72,), max_rank=20,
         k=130).assert_within_bound()


@pytest.mark.parametrize("dtype", SIXTEEN_BIT)
@pytest.mark.parametrize("num_rows", [8, 40])
def test_16bit_at_a_wide_k(num_rows, dtype):
    """K in the thousands, where the shrunk rows are large and SGMV's rounding of them between
    shrink and expand shows."""
    _run(num_rows, dtype, seed=3, shard_sizes=(256, 64, 64), max_rank=16,
         k=1024).assert_within_bound()


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("num_rows", [16, 600])
def test_bf16_at_8b_shapes(num_rows):
    _run(num_rows, torch.bfloat16, seed=3, shard_sizes=(4096, 1024, 1024), max_rank=16,
         k=4096).assert_within_bound()


@pytest.mark.parametrize("num_rows", [1, 6, 45])
def test_expand_adds_up_the_shrink_parts(num_rows):
    """K over five of BGMV's shrink parts (1 and 6 rows) or three of SGMV's (45 rows), the last
    one partial: each part's sums count once."""
    _run(num_rows, torch.float32, seed=11 + num_rows, shard_sizes=(48, 16), max_rank=8,
         k=1100).assert_within_bound()
