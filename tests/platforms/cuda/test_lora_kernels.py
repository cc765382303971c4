"""The Triton LoRA shrink/expand (SGMV and BGMV) against a float64 row-by-row reference: rows of
mixed slots in any order, ranks below the padded rank, rows of slot -1, empty slots, shards
adapted by some slots only. Without CUDA they run under Triton's interpreter (tiny shapes);
outputs of rows without an adapter must stay bit-identical."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from tests.devices import HAS_NVIDIA, NVIDIA_REASON, interpreter_guards

# As in test_triton_kernels: the interpreter must be chosen before triton is first imported.
IMPORTED_TOO_LATE = (not HAS_NVIDIA and "triton" in sys.modules
                     and os.environ.get("TRITON_INTERPRET") != "1")
if not HAS_NVIDIA and not IMPORTED_TOO_LATE:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from pagedserve.lora.ops import group_rows  # noqa: E402
from tests.lora.layouts import random_layout, reference  # noqa: E402

if not IMPORTED_TOO_LATE:
    from pagedserve.platforms.cuda.kernels import lora
    from pagedserve.platforms.cuda.lora_ops import TritonLoRAOps

DEVICE = torch.device("cuda" if HAS_NVIDIA else "cpu")
needs_cuda = pytest.mark.skipif(not HAS_NVIDIA, reason=NVIDIA_REASON)

_kernels_runnable, test_in_a_fresh_interpreter_process = interpreter_guards(
    __file__, IMPORTED_TOO_LATE)


def _run(num_rows: int, dtype: torch.dtype, seed: int, shard_sizes=(40, 24, 24),
         max_rank: int = 8, k: int = 80):
    layout = random_layout(5, max_rank, k, list(shard_sizes), seed, dtype, empty_slots=(4,))
    rng = random.Random(seed)
    # Slot 3 has no rows this step; slot 4 is empty; -1 rows get nothing.
    slots = [rng.choice([-1, 0, 1, 2, 2]) for _ in range(num_rows)]
    x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out = torch.randn(num_rows, sum(shard_sizes)).to(dtype)
    expected = reference(layout, x, slots, out)
    out_dev = out.to(DEVICE)
    TritonLoRAOps.add_lora(out_dev, x.to(DEVICE), layout.a.to(DEVICE), layout.b.to(DEVICE),
                           layout.shards,
                           group_rows(torch.tensor(slots, dtype=torch.int32, device=DEVICE), 5))
    return out_dev.cpu(), expected, out, slots


@pytest.mark.parametrize("num_rows", [1, 5, lora.BGMV_MAX_ROWS if not IMPORTED_TOO_LATE else 32,
                                      45, 83])
def test_kernels_equal_reference_fp32(num_rows):
    got, expected, before, slots = _run(num_rows, torch.float32, seed=num_rows)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    untouched = [i for i, s in enumerate(slots) if s == -1]
    assert torch.equal(got[untouched], before[untouched])


@pytest.mark.parametrize("num_rows", [3, 50])
def test_kernels_equal_reference_fp16(num_rows):
    got, expected, _, _ = _run(num_rows, torch.float16, seed=100 + num_rows)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("num_rows", [4, 40])
def test_rank_beyond_one_block_and_single_shard(num_rows):
    got, expected, _, _ = _run(num_rows, torch.float32, seed=7 + num_rows, shard_sizes=(72,),
                               max_rank=20, k=130)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("num_rows", [16, 600])
def test_bf16_at_8b_shapes(num_rows):
    got, expected, _, _ = _run(num_rows, torch.bfloat16, seed=3, shard_sizes=(4096, 1024, 1024),
                               max_rank=16, k=4096)
    torch.testing.assert_close(got.double(), expected, rtol=3e-2, atol=1.0)
