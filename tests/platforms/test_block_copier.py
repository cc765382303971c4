"""The default block copier (CPU, HPU) against plain indexing (the CUDA copier's kernel:
``tests/platforms/cuda/test_block_copy_kernel.py``)."""

import torch

from pagedserve.platforms.cpu.platform import CpuPlatform


def test_blocks_move_whole_between_the_device_layout_and_the_block_major_host_pool():
    pool = torch.randn(3, 2, 10, 4, 2, 8)  # layers, k/v, blocks, block size, heads, head dim
    host = torch.zeros(6, 3, 2, 4, 2, 8)
    copier = CpuPlatform.block_copier()
    copier.to_host(pool, host, [7, 1, 4], [5, 0, 1])
    copier.wait_host()
    for src, dst in ((7, 5), (1, 0), (4, 1)):
        assert torch.equal(host[dst], pool[:, :, src])
        assert host[dst].is_contiguous()  # one unit per block, all layers
    before = pool.clone()
    copier.to_device(host, pool, [0, 5], [9, 2])
    copier.wait_device()
    assert torch.equal(pool[:, :, 9], before[:, :, 1])
    assert torch.equal(pool[:, :, 2], before[:, :, 7])
    untouched = [b for b in range(10) if b not in (2, 9)]
    assert torch.equal(pool[:, :, untouched], before[:, :, untouched])

