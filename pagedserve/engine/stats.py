"""A snapshot of the engine's queues, KV pool and counters, for logs, benchmarks and /metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    blocks_used: int
    blocks_free: int
    kv_usage: float
    kv_allocated_slots: int
    kv_filled_slots: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_swapped: int = 0  # requests whose KV blocks sit in the host swap pool
    blocks_shared: int = 0  # device blocks held by more than one sequence
    process_cpu_s: float = 0.0  # CPU time of the engine's process (the core's, under serve)
    # Speculative decoding (``engine/speculation.SpecDecodeCounters``); empty without it.
    spec_num_drafts: int = 0  # verify rows that carried drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()  # rows that accepted draft j, per j
    # The KV offloading tiers (--kv-offloading-size, --kv-offloading-disk), since start.
    prefix_host_hit_tokens: int = 0  # of prefix_hit_tokens, loaded from the host tier
    prefix_disk_hit_tokens: int = 0  # of those, blocks that had come back from disk
    offload_host_hits: int = 0  # prefix blocks found in the host tier after a device miss
    offload_host_misses: int = 0  # lookups past the device that the host tier missed
    offload_disk_hits: int = 0  # host hits on blocks read back from disk
    offload_disk_misses: int = 0  # host misses the disk missed too, and bad files
    offload_bytes_to_host: int = 0  # device -> host: offloads and swap-outs
    offload_bytes_to_device: int = 0  # host -> device: tier loads and swap-ins
    offload_bytes_to_disk: int = 0
    offload_bytes_from_disk: int = 0
    offload_copy_s: float = 0.0  # host time queuing and waiting on block moves (rank 0)

    @property
    def prefix_hit_rate(self) -> float:
        """Share of queried prompt tokens served by the prefix cache."""
        if not self.prefix_queried_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_queried_tokens

    def prefix_hit_rate_of(self, tier: str) -> float:
        """Share of queried prompt tokens served by one tier: device, host or disk (host
        hits on blocks that came back from disk count as disk)."""
        if not self.prefix_queried_tokens:
            return 0.0
        host = self.prefix_host_hit_tokens - self.prefix_disk_hit_tokens
        hits = {"device": self.prefix_hit_tokens - self.prefix_host_hit_tokens, "host": host,
                "disk": self.prefix_disk_hit_tokens}[tier]
        return hits / self.prefix_queried_tokens

    @property
    def kv_waste(self) -> float:
        """Share of allocated slots not holding a token (internal fragmentation)."""
        if not self.kv_allocated_slots:
            return 0.0
        return 1.0 - self.kv_filled_slots / self.kv_allocated_slots
