"""``pagedserve bench kv-copy-rate``: how fast the KV offloading tier moves blocks, against the
bus's own rate measured in the same call.

The tier's real path: a ``KVCache`` of the model's shape (the device pool ``[layers, 2,
blocks, ...]``, the block-major host pool, page-locked where the platform pins swap memory)
and its ``apply_block_ops``, which hands the batch to the platform's ``BlockCopier`` (on CUDA
and ROCm a copy stream of its own), then ``wait_host`` for the copies to land. The reference
moves the same bytes as one contiguous buffer with one ``copy_(non_blocking=True)`` between a
host buffer of the same kind and device memory (a pinned ``cudaMemcpyAsync`` on GPUs, a plain
memcpy on the CPU). Each batch size is timed over ``--repeats`` rounds, the tier's copy and
the reference alternating within a round so a drift of the machine shows in both; the medians'
ratio is the tier's share of the bus (issue 29's target: 80%).

Host block ids are ``scattered`` (every other block, as LRU-allocated tier blocks mostly are)
or ``consecutive``; device block ids are scattered in both, as a pool's are. After the timed
rounds each batch's bytes are compared with their source, so a fast copy that moved the wrong
blocks cannot pass.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import TYPE_CHECKING, NamedTuple

from pagedserve.arg_types import positive
from pagedserve.bench.common import print_table, write_result

if TYPE_CHECKING:
    import torch

    from pagedserve.models.config import ModelArchConfig
    from pagedserve.platforms.interface import Platform

LAYOUTS = ("scattered", "consecutive")


class KVLayout(NamedTuple):
    """The KV pool's geometry for a config, found without starting an engine."""

    platform: type[Platform]
    arch: ModelArchConfig
    kv_dtype: torch.dtype
    block_size: int
    bytes_per_block: int  # one rank's (tensor parallelism splits the KV heads)
    num_kv_heads: int


def kv_layout(config) -> KVLayout:
    from pagedserve.distributed import TensorParallel, split_heads
    from pagedserve.models import loader
    from pagedserve.platforms import resolve_platform
    from pagedserve.worker.kv_cache import KVCacheSpec

    platform = resolve_platform(config.device)
    source = loader.resolve_model(config.model, config.load_format != "dummy",
                                  revision=config.revision, gguf_file=config.gguf_file)
    arch = loader.load_arch_config(source)
    resolved = config.resolve(arch, platform)
    kv_dtype = platform.kv_cache_torch_dtype(config.kv_cache_dtype, resolved.dtype)
    heads = split_heads(arch.num_heads, arch.num_kv_heads,
                        TensorParallel(0, config.tensor_parallel_size))
    per_block = KVCacheSpec(1, resolved.block_size, kv_dtype).bytes_per_block(
        arch, heads.num_kv_heads)
    return KVLayout(platform, arch, kv_dtype, resolved.block_size, per_block,
                    heads.num_kv_heads)


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.engine_args import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--shape", default=None,
                        help="a real model shape's KV blocks (no weights are made), e.g. "
                             "llama3-8b: 2 MiB blocks in bf16")
    parser.add_argument("--batch-blocks", type=positive(int), nargs="+", default=[1, 8, 64, 512],
                        help="blocks moved by one batch (one step's loads or offloads)")
    parser.add_argument("--repeats", type=positive(int), default=20)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")


def _timed(platform, fn) -> float:
    platform.synchronize()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Bench:
    """A KV pool and host pool of ``2 * max(batch)`` blocks each, and a contiguous pair of
    reference buffers the size of the largest batch."""

    def __init__(self, layout: KVLayout, max_blocks: int) -> None:
        import torch

        from pagedserve.core.kv_cache_manager import BlockOps
        from pagedserve.worker.kv_cache import KVCache, KVCacheSpec

        self.platform, self.layout = layout.platform, layout
        self.num_blocks = 2 * max_blocks
        self.kv = KVCache(self.platform, layout.arch, layout.num_kv_heads,
                          KVCacheSpec(self.num_blocks, layout.block_size, layout.kv_dtype))
        # The first move allocates the host pool, as in a serving engine's first offload.
        self.kv.apply_block_ops(BlockOps(offload=[(0, 0)], num_host_blocks=self.num_blocks))
        nbytes = max_blocks * layout.bytes_per_block
        pinned = self.kv.host_pool.is_pinned()
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=self.platform.device())
        self.non_blocking = pinned

    def pairs(self, n: int, layout: str, rng: random.Random) -> tuple[list[int], list[int]]:
        """(device blocks, host blocks) of one batch of ``n``."""
        device = rng.sample(range(self.num_blocks), n)
        host = list(range(0, 2 * n, 2)) if layout == "scattered" else list(range(n))
        return device, host

    def tier(self, direction: str, device: list[int], host: list[int]) -> float:
        from pagedserve.core.kv_cache_manager import BlockOps

        ops = (BlockOps(offload=list(zip(device, host)), num_host_blocks=self.num_blocks)
               if direction == "device_to_host" else
               BlockOps(load=list(zip(host, device)), num_host_blocks=self.num_blocks))

        def move() -> None:
            self.kv.apply_block_ops(ops)
            self.kv.copier.wait_host()

        return _timed(self.platform, move)

    def reference(self, direction: str, n: int) -> float:
        nbytes = n * self.layout.bytes_per_block
        host, device = self.host[:nbytes], self.device[:nbytes]
        src, dst = (device, host) if direction == "device_to_host" else (host, device)

        def move() -> None:
            dst.copy_(src, non_blocking=self.non_blocking)
            self.platform.synchronize()

        return _timed(self.platform, move)

    def check(self, direction: str, device: list[int], host: list[int]) -> bool:
        """Whether one more batch, its source and destination blocks filled with different
        random values first, arrives whole where it was sent."""
        import torch

        pool, host_pool = self.kv.pool, self.kv.host_pool
        on_device = torch.tensor(device, device=pool.device)
        on_host = torch.tensor(host)
        pool[:, :, on_device] = _random_like(pool[:, :, on_device])
        host_pool[on_host] = _random_like(host_pool[on_host])
        self.tier(direction, device, host)
        return bool(torch.equal(pool[:, :, on_device].cpu(),
                                host_pool[on_host].movedim(0, 2).cpu()))


def _random_like(t):
    """Values in [0, 1) of ``t``'s dtype (fp8 included) and device."""
    import torch

    return torch.rand(t.shape, device=t.device).to(t.dtype)


def measure(bench: _Bench, direction: str, n: int, layout: str, repeats: int,
            rng: random.Random) -> dict:
    """One row: ``n`` blocks moved ``direction`` with host blocks laid out ``layout``."""
    import torch

    with torch.inference_mode():  # the host pool is an inference tensor, as in the engine
        return _measure(bench, direction, n, layout, repeats, rng)


def _measure(bench: _Bench, direction: str, n: int, layout: str, repeats: int,
             rng: random.Random) -> dict:
    device, host = bench.pairs(n, layout, rng)
    for _ in range(2):  # warm-up: kernels, the caching allocators' staging blocks
        bench.tier(direction, device, host)
        bench.reference(direction, n)
    tier, reference = [], []
    for _ in range(repeats):
        tier.append(bench.tier(direction, device, host))
        reference.append(bench.reference(direction, n))
    nbytes = n * bench.layout.bytes_per_block
    t, r = statistics.median(tier), statistics.median(reference)
    return {"direction": direction, "blocks": n, "host_blocks": layout, "bytes": nbytes,
            "tier_s": t, "reference_s": r, "tier_gb_s": nbytes / t / 1e9,
            "reference_gb_s": nbytes / r / 1e9, "ratio": r / t,
            "correct": bench.check(direction, device, host)}


def main(args: argparse.Namespace) -> None:
    from pagedserve.bench.throughput import bench_config

    layout = kv_layout(bench_config(args))
    bench = _Bench(layout, max(args.batch_blocks))
    rng = random.Random(args.seed)
    rows = [measure(bench, direction, n, host_layout, args.repeats, rng)
            for direction in ("host_to_device", "device_to_host")
            for host_layout in LAYOUTS for n in args.batch_blocks]
    reference = ("pinned copy_(non_blocking=True)" if bench.non_blocking
                 else "copy_ (memcpy)")
    print_table(f"KV block moves through {type(bench.kv.copier).__name__} against one "
                f"contiguous {reference} of the same bytes ({layout.platform.name}, "
                f"{layout.bytes_per_block / 2**20:.2f} MiB blocks)", rows,
                ["direction", "host_blocks", "blocks", "tier_gb_s", "reference_gb_s", "ratio",
                 "correct"])
    name = args.shape or "model"
    write_result(f"kv_copy_rate_{layout.platform.name}_{name}", {
        "shape": args.shape, "model": args.model, "device": layout.platform.name,
        "kv_dtype": str(layout.kv_dtype), "block_size": layout.block_size,
        "bytes_per_block": layout.bytes_per_block, "copier": type(bench.kv.copier).__name__,
        "host_pinned": bench.non_blocking, "reference": reference, "repeats": args.repeats,
        "target_ratio": 0.8, "min_ratio": min(r["ratio"] for r in rows),
        "all_correct": all(r["correct"] for r in rows), "rows": rows}, args.out)
