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

    @property
    def prefix_hit_rate(self) -> float:
        """Share of queried prompt tokens served by the prefix cache."""
        if not self.prefix_queried_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_queried_tokens

    @property
    def kv_waste(self) -> float:
        """Share of allocated slots not holding a token (internal fragmentation)."""
        if not self.kv_allocated_slots:
            return 0.0
        return 1.0 - self.kv_filled_slots / self.kv_allocated_slots
