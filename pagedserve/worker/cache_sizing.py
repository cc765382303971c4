"""How many KV blocks the device pool and the host swap pool get, from the memory the platform
reports once weights and the largest step's activations are in place."""

from __future__ import annotations

from typing import NamedTuple

from pagedserve.config import EngineConfig, ResolvedConfig, flag_name
from pagedserve.errors import ConfigError
from pagedserve.logger import get_logger
from pagedserve.platforms import host_memory
from pagedserve.platforms.interface import Platform
from pagedserve.worker.disk_tier import HEADER_BYTES
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.warm_up import profile_peak_memory

logger = get_logger(__name__)


class CacheSizes(NamedTuple):
    num_blocks: int  # device pool
    num_host_blocks: int  # swap's share of the host pool
    bytes_per_block: int
    num_offload_blocks: int = 0  # the offloading tier's share of the host pool
    num_disk_blocks: int = 0  # block files the disk tier keeps


def size_kv_cache(config: EngineConfig, resolved: ResolvedConfig, platform: type[Platform],
                  runner: ModelRunner) -> CacheSizes:
    per_block = runner.kv_bytes_per_block(resolved.block_size)
    # Never reserve more than every sequence at full length could use.
    useful_blocks = config.max_num_seqs * (resolved.max_model_len // resolved.block_size + 1)
    budget = config.kv_cache_memory_bytes
    if budget is not None:
        _check_fits_the_device(budget, platform)
    else:
        peak = _peak_memory_bytes(config, resolved, platform, runner)
        budget = platform.kv_cache_budget_bytes(config.gpu_memory_utilization, peak)
        budget = min(budget, useful_blocks * per_block)
    # Bucketed shapes take one block more, for padded rows (ModelRunner.allocate_kv_cache).
    num_blocks = budget // per_block - resolved.shape_bucketing
    if num_blocks < 1:
        raise ConfigError(
            f"KV cache budget of {budget} bytes holds no block of {per_block} bytes; "
            "raise --kv-cache-memory-bytes or --gpu-memory-utilization")
    num_host_blocks = min(int(config.swap_space * 2**30) // per_block, useful_blocks)
    num_offload_blocks = _tier_blocks(config, "kv_offloading_size", per_block)
    _check_host_pools(config, (num_host_blocks + num_offload_blocks) * per_block)
    return CacheSizes(int(num_blocks), num_host_blocks, per_block, num_offload_blocks,
                      _tier_blocks(config, "kv_offloading_disk_size", per_block + HEADER_BYTES))


def _tier_blocks(config: EngineConfig, option: str, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` in the offloading tier's ``option`` GiB; a size asked for
    that holds none would serve without the tier, unsaid."""
    gib = getattr(config, option)
    num_blocks = int(gib * 2**30) // block_bytes
    if gib and not num_blocks:
        raise ConfigError(f"{flag_name(option)} {gib} GiB holds no KV block of {block_bytes} "
                          "bytes: raise it, or 0 for none")
    return num_blocks


def _check_fits_the_device(budget: int, platform: type[Platform]) -> None:
    """A pool larger than the device's whole memory failed in the allocator, with its
    traceback (or, on the CPU, overcommitted until the out-of-memory killer came)."""
    total = platform.memory_info().total_bytes
    if budget > total:
        raise ConfigError(f"--kv-cache-memory-bytes {budget} exceeds the device's "
                          f"{total / 2**30:.1f} GiB of memory: lower it")


def _check_host_pools(config: EngineConfig, rank_bytes: int) -> None:
    """Refuse host pools (swap's, the offloading tier's) that every rank on this host cannot
    have at once: pinned ones fail to allocate, and pageable ones would be filled until the
    kernel's out-of-memory killer stopped the process mid-serving."""
    needed = rank_bytes * config.world_size
    available = host_memory.available_bytes()
    if needed > available:
        raise ConfigError(
            f"the host pools need {needed / 2**30:.1f} GiB of host memory "
            f"(--swap-space {config.swap_space} and --kv-offloading-size "
            f"{config.kv_offloading_size} GiB per rank, {config.world_size} "
            f"rank(s)), but {available / 2**30:.1f} GiB is available: lower them")


def _peak_memory_bytes(config: EngineConfig, resolved: ResolvedConfig,
                       platform: type[Platform], runner: ModelRunner) -> int:
    """Weights plus the activations of the largest step, measured where the platform can.
    Weights offloaded to host memory count only through their staging slots (a measured peak
    counts what is on the device, which is the same)."""
    if not platform.profiles_memory:
        return runner.resident_weight_bytes()
    peak = profile_peak_memory(runner, resolved.max_num_batched_tokens, config.max_num_seqs,
                               resolved.block_size)
    logger.info("memory profile: weights %.2f GiB on the device, peak with activations "
                "%.2f GiB", runner.resident_weight_bytes() / 2**30, peak / 2**30)
    return peak
