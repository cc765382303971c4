"""One rank's KV pool: the device pool every layer of its pipeline stage attends over, the host
pool that preempted sequences swap to and the offloading tier keeps evicted prefix blocks in,
the tier's files on disk, and the block moves between them that a step's ``BlockOps`` ask
for."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedserve.core.kv_cache_manager import BlockOps
from pagedserve.models.config import ModelArchConfig
from pagedserve.platforms.interface import Platform
from pagedserve.worker.disk_tier import DiskTier


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    dtype: torch.dtype

    def bytes_per_block(self, arch: ModelArchConfig, num_kv_heads: int,
                        num_layers: int | None = None) -> int:
        """Keys and values of ``num_layers`` layers (default: all; a pipeline stage's own)
        for ``num_kv_heads`` heads (one rank's)."""
        layers = arch.num_layers if num_layers is None else num_layers
        return (2 * layers * num_kv_heads * arch.head_dim * self.block_size
                * torch.empty(0, dtype=self.dtype).element_size())


class KVCache:
    """One tensor ``[layers, 2, blocks, block_size, kv_heads, head_dim]`` (``pool``) so block
    copies and swaps move every layer at once; each layer attends over its own view
    (``layers``). The host pool (swap and the offloading tier, ``BlockOps.num_host_blocks``
    blocks) is block-major, ``[blocks, layers, 2, ...]``, so that a block of all layers is one
    contiguous unit for the bus and for its file; it is allocated at the first move, in
    page-locked memory where the platform wants it. ``disk`` writes and reads the tier's
    files."""

    def __init__(self, platform: type[Platform], arch: ModelArchConfig, num_kv_heads: int,
                 spec: KVCacheSpec, num_layers: int | None = None) -> None:
        """``num_layers``: the layers this rank runs (default: all; a pipeline stage's own)."""
        self.platform = platform
        layers = arch.num_layers if num_layers is None else num_layers
        self.pool = platform.allocate_kv_cache(
            (layers, 2, spec.num_blocks, spec.block_size, num_kv_heads, arch.head_dim),
            spec.dtype)
        self.layers = list(self.pool.unbind(0))
        self.host_pool: torch.Tensor | None = None
        self.copier = platform.block_copier()
        self.disk: DiskTier | None = None
        self.copy_seconds = 0.0  # host time spent queuing and waiting on block moves
        self._ahead_pending = False  # copies ahead of eviction queued by the last step

    def host_block_shape(self) -> tuple[int, ...]:
        shape = list(self.pool.shape)
        del shape[2]
        return tuple(shape)

    @torch.inference_mode()
    def apply_block_ops(self, ops: BlockOps) -> None:
        """Move and copy whole blocks in the order the scheduler relies on (see
        ``core/kv_cache_manager``): disk writes, device to host, disk reads, host to device,
        copy-on-write copies; then the copies ahead of eviction, which the forward pass does
        not wait for (the blocks stay in place this step; the next step's moves wait for
        them first, before any of its writes). Nothing here waits for the device but for
        what the CPU itself reads or writes in the host pool (disk writes and reads)."""
        start = time.perf_counter()
        if self._ahead_pending:
            self.copier.wait_device()
            self._ahead_pending = False
        to_host, to_device = ops.swap_out + ops.offload, ops.swap_in + ops.load
        if (to_host or to_device or ops.offload_ahead or ops.disk) and self.host_pool is None:
            self.host_pool = torch.empty((ops.num_host_blocks, *self.host_block_shape()),
                                         dtype=self.pool.dtype,
                                         pin_memory=self.platform.pin_swap_memory)
        if ops.disk.spill or ops.disk.read:
            self.copier.wait_host()
        for host_block, block_hash in ops.disk.spill:
            self.disk.write(block_hash, self.host_pool[host_block])
        if to_host:
            self.copier.to_host(self.pool, self.host_pool, *_unzip(to_host))
        for block_hash, host_block in ops.disk.read:
            self.disk.read(block_hash, self.host_pool[host_block])
        for block_hash in ops.disk.delete:
            self.disk.delete(block_hash)
        if to_device:
            self.copier.to_device(self.host_pool, self.pool, *_unzip(to_device))
        if to_host or to_device:
            self.copier.wait_device()
            self.copy_seconds += time.perf_counter() - start
        if ops.copies:
            # Not torch.tensor(..., device=): that waits for the device's queued work.
            src, dst = torch.tensor(ops.copies, dtype=torch.int64).to(
                self.pool.device, non_blocking=True).unbind(1)
            self.platform.copy_blocks(self.pool, src, dst)
        if ops.offload_ahead:
            ahead = time.perf_counter()
            self.copier.to_host(self.pool, self.host_pool, *_unzip(ops.offload_ahead))
            self._ahead_pending = True
            self.copy_seconds += time.perf_counter() - ahead


def _unzip(pairs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [a for a, _ in pairs], [b for _, b in pairs]
