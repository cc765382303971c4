"""The KV block-move kernel (``kernels.block_copy``) against plain indexing: blocks of every layer
move whole between the layer-major device pool and the block-major host pool, in both
directions, in any order, with pieces that are not a multiple of the kernel's chunk, more items
than programs (each program loops), 16-bit and 8-bit KV dtypes bit for bit; nothing else in
either pool changes (both are filled with random bits first). Without CUDA it runs under
Triton's interpreter on CPU tensors; on a GPU the host pool is page-locked, as the engine's is,
and the kernel reads and writes it through unified addressing."""

from __future__ import annotations

import pytest
import torch

from tests.devices import HAS_NVIDIA, choose_triton_interpreter, interpreter_guards

IMPORTED_TOO_LATE = choose_triton_interpreter()
pytest.importorskip("triton")

if not IMPORTED_TOO_LATE:
    from pagedserve.platforms.cuda.kernels import block_copy

DEVICE = torch.device("cuda" if HAS_NVIDIA else "cpu")

_kernels_runnable, test_in_a_fresh_interpreter_process = interpreter_guards(
    __file__, IMPORTED_TOO_LATE)


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int,
                 device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8,
                        generator=gen)
    return raw.view(dtype).to(device)


def _pools(layers: int, blocks: int, host_blocks: int, tail: tuple[int, ...],
           dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    pool = _random_bits((layers, 2, blocks, *tail), dtype, seed, DEVICE)
    host = _random_bits((host_blocks, layers, 2, *tail), dtype, seed + 1, torch.device("cpu"))
    return pool, host.pin_memory() if HAS_NVIDIA else host


def _ids(src: list[int], dst: list[int]) -> torch.Tensor:
    return torch.tensor([src, dst], dtype=torch.int64, device=DEVICE)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


# (layers, block size, heads, head dim): a piece of 4 x 2 x 8 float16 = 32 words (one partial
# chunk); one of 16 x 4 x 72 = 2,304 words in float16 (a chunk and a partial one), 1,152 in fp8.
SHAPES = [(3, 4, 2, 8), (2, 16, 4, 72)]
DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=["small", "chunked"])
def test_blocks_move_whole_both_ways(shape, dtype):
    layers, *tail = shape
    pool, host = _pools(layers, 10, 7, tuple(tail), dtype, seed=layers)
    pool_before, host_before = pool.clone(), host.clone()

    block_copy.to_host(pool, host, _ids([7, 1, 4], [5, 0, 6]))
    if HAS_NVIDIA:
        torch.cuda.synchronize()
    for src, dst in ((7, 5), (1, 0), (4, 6)):
        assert _same_bits(host[dst], pool_before[:, :, src])
    untouched = [b for b in range(7) if b not in (5, 0, 6)]
    assert _same_bits(host[untouched], host_before[untouched])

    block_copy.to_device(host, pool, _ids([0, 5, 2], [9, 2, 3]))
    if HAS_NVIDIA:
        torch.cuda.synchronize()
    assert _same_bits(pool[:, :, 9], pool_before[:, :, 1])
    assert _same_bits(pool[:, :, 2], pool_before[:, :, 7])
    assert _same_bits(pool[:, :, 3], host_before[2].to(DEVICE))
    untouched = [b for b in range(10) if b not in (9, 2, 3)]
    assert _same_bits(pool[:, :, untouched], pool_before[:, :, untouched])


def test_more_items_than_programs_and_an_empty_batch():
    """A batch of more (pair, piece, chunk) items than the kernel launches programs, so each
    program moves several; an empty batch moves nothing."""
    pool, host = _pools(4, 24, 40, (4, 2, 8), torch.float16, seed=5)
    pool_before = pool.clone()
    src, dst = list(range(20)), list(range(39, 19, -1))
    assert len(src) * 4 * 2 > block_copy._PROGRAMS
    block_copy.to_host(pool, host, _ids(src, dst))
    block_copy.to_host(pool, host, _ids([], []))
    if HAS_NVIDIA:
        torch.cuda.synchronize()
    for s, d in zip(src, dst):
        assert _same_bits(host[d], pool_before[:, :, s])
