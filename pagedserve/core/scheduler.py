"""Iteration-level scheduler: at every step, decide which tokens of which requests to compute.

There are no prefill and decode phases. Each request has ``num_computed_tokens``; a step gives
it the next ``k`` tokens of its stream under a token budget. A new prompt, a chunk of a long
prompt, one decode token and a recompute after preemption are all the same operation. Running
requests are served first (oldest first), then waiting ones are admitted while the budget,
``max_num_seqs`` and the KV pool allow. When the pool runs dry, the newest running request is
preempted: its blocks are freed and it waits at the head of the queue to be recomputed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # Free blocks kept back when admitting new requests, so running ones can grow a step or
    # two without immediately preempting the newcomer.
    watermark: float = 0.01


class ScheduledRequest(NamedTuple):
    request: Request
    num_computed_tokens: int  # tokens already in the cache before this step
    num_new_tokens: int
    block_ids: list[int]
    # The chunk reaches the end of the known tokens, so the step samples a new one.
    samples: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._watermark_blocks = int(config.watermark * kv.num_blocks)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._make_room(request, num_new, out):
                break  # the request itself was preempted; it was the newest, so nothing follows
            self._emit(out, request, num_new)
            budget -= num_new
            i += 1
        return budget

    def _make_room(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate for ``request``, preempting the newest running requests until it fits."""
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV blocks and requeue at the front."""
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            # Prompt logprobs need every prompt position computed, so they bypass the cache.
            wants_prompt_logprobs = request.params.prompt_logprobs is not None
            cached = [] if wants_prompt_logprobs else self.kv.find_cached_prefix(request)
            num_cached = len(cached) * self.kv.block_size
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.kv.allocate_slots(request, num_new, cached, self._watermark_blocks):
                break
            self.waiting.popleft()
            if request.num_preemptions == 0:
                self.kv.record_prefix_lookup(request.num_prompt_tokens, num_cached)
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._emit(out, request, num_new)
            budget -= num_new

    def _emit(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        computed = request.num_computed_tokens
        out.scheduled.append(ScheduledRequest(
            request, computed, num_new, self.kv.block_table(request.request_id),
            samples=computed + num_new == request.num_tokens,
        ))

    def advance(self, out: SchedulerOutput) -> None:
        """Mark the scheduled tokens computed; call once the step's forward pass ran."""
        for item in out.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Stop a request wherever it is and return its blocks at once."""
        if request.status.finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request.request_id)

    def finish_many(self, requests: Iterable[Request], status: RequestStatus) -> None:
        for request in list(requests):
            self.finish(request, status)

    def kv_waste_slots(self) -> tuple[int, int]:
        """(allocated slots, slots holding computed tokens) over running requests."""
        allocated = filled = 0
        for request in self.running:
            allocated += len(self.kv.block_table(request.request_id)) * self.kv.block_size
            filled += request.num_computed_tokens
        return allocated, filled
