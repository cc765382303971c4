"""One rank's KV pool: the device pool every layer attends over, the host pool that preempted
sequences swap to, and the block moves between them that a step's ``BlockOps`` ask for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.core.kv_cache_manager import BlockOps
from pagedserve.models.config import ModelArchConfig
from pagedserve.platforms.interface import Platform


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    dtype: torch.dtype

    def bytes_per_block(self, arch: ModelArchConfig, num_kv_heads: int) -> int:
        """Keys and values of every layer for ``num_kv_heads`` heads (one rank's)."""
        return (2 * arch.num_layers * num_kv_heads * arch.head_dim * self.block_size
                * torch.empty(0, dtype=self.dtype).element_size())


class KVCache:
    """One tensor ``[layers, 2, blocks, block_size, kv_heads, head_dim]`` (``pool``) so block
    copies and swaps move every layer at once; each layer attends over its own view
    (``layers``). The host swap pool has the same layout, with the scheduler's number of host
    blocks; it is allocated at the first swap, in page-locked memory where the platform wants
    it."""

    def __init__(self, platform: type[Platform], arch: ModelArchConfig, num_kv_heads: int,
                 spec: KVCacheSpec) -> None:
        self.platform = platform
        self.pool = platform.allocate_kv_cache(
            (arch.num_layers, 2, spec.num_blocks, spec.block_size, num_kv_heads, arch.head_dim),
            spec.dtype)
        self.layers = list(self.pool.unbind(0))
        self.swap_pool: torch.Tensor | None = None

    @torch.inference_mode()
    def apply_block_ops(self, ops: BlockOps) -> None:
        """Swap and copy whole blocks (all layers, keys and values) in the order the scheduler
        relies on: swap-outs, swap-ins, then copy-on-write copies."""
        if (ops.swap_out or ops.swap_in) and self.swap_pool is None:
            shape = list(self.pool.shape)
            shape[2] = ops.num_host_blocks
            self.swap_pool = torch.empty(shape, dtype=self.pool.dtype,
                                         pin_memory=self.platform.pin_swap_memory)
        for pairs, src_cache, dst_cache in ((ops.swap_out, self.pool, self.swap_pool),
                                            (ops.swap_in, self.swap_pool, self.pool)):
            if pairs:
                src, dst = torch.tensor(pairs, dtype=torch.int64).unbind(1)
                self.platform.swap_blocks(src_cache, dst_cache, src, dst)
                # The host side of a swap is read or reused as soon as this returns.
                self.platform.synchronize()
        if ops.copies:
            src, dst = torch.tensor(ops.copies, dtype=torch.int64,
                                    device=self.pool.device).unbind(1)
            self.platform.copy_blocks(self.pool, src, dst)
