"""Iteration-level scheduler: at every step, decide which tokens of which streams to compute.

There are no prefill and decode phases. Each stream has ``num_computed_tokens``; a step gives
it the next ``k`` tokens of its stream under a token budget. A new prompt, a chunk of a long
prompt, one decode token and a recompute after preemption are all the same operation.

The unit of scheduling is a ``SequenceGroup`` (the streams of one request). A step serves the
running groups first, oldest first, then brings back swapped-out groups, then admits waiting
ones, while the budget, ``max_num_seqs`` and the KV pool allow. Swapped groups come back
before anything new is admitted, and only in a step that preempted nothing.

Preemption policy
    When a running stream needs blocks and none are free, the newest running group is
    preempted whole, by swap (its blocks move to the host pool) or by recompute (its blocks are
    dropped and it waits at the head of the queue to be computed again). ``auto`` swaps groups
    of several streams, whose shared blocks a recompute would duplicate, and recomputes single
    streams; when the swap pool is full, swap falls back to recompute. A group that was resumed
    is not preempted again before it has sampled (no thrashing): the stream that needs room
    waits a step instead, unless it belongs to the oldest group and nothing else is left. A
    group is never preempted after any of its streams was given blocks in the step, so every
    queued block copy belongs to a stream that runs.

Partial prefills (vLLM's ``max_num_partial_prefills``, ``max_long_partial_prefills``)
    Served oldest first, a long prompt mid-prefill would take the whole budget every step and
    leave nothing for a request that arrives behind it. Instead, each step caps every prefill
    chunk at one level: the max-min fair split, among the running prefills and the first
    ``max_num_partial_prefills`` waiting ones, of what the running decodes leave of the
    budget. A prefill alone still takes the whole budget, and one that needs less than its
    share leaves the rest to the others. A prompt with more than
    ``long_prefill_token_threshold`` tokens left is long: while ``max_long_partial_prefills``
    long ones run, waiting long prompts are passed over so shorter ones behind them start
    first, and only take the budget that is left once those are admitted. So is a prompt
    whose next block a prefill under way is about to compute (a shared system prompt): it
    starts once that block is in the prefix cache instead of computing it a second time.

Priority scheduling (vLLM's ``--scheduling-policy priority``)
    Each group has a ``priority`` (lower is served earlier) and an arrival number; the key
    (priority, arrival) orders the waiting and swapped queues (``_PriorityQueue``: a sorted
    list, a binary search per insertion) and the running list, so "oldest first" above reads
    "most urgent first" and the newest running group, the one preempted first, is the least
    urgent one (vLLM's ``max(running, key=(priority, arrival))``). A preempted group goes back
    to its place in its queue, not to the head. When the most urgent waiting group cannot
    start for want of blocks or sequence slots, less urgent running groups are preempted for
    it at the start of the step (as vLLM's V0 scheduler did; V1 preempts only for running
    requests), and it starts in a later step, once no running group needs those blocks. A
    swapped group resumes only if no waiting one is more urgent, and waiting groups more
    urgent than every swapped one start even while some are swapped out. With ``fcfs`` every
    group has the same priority and the queues are plain deques, as before.

Offloading tiers
    A prefix lookup walks the device pool, then the host tier (``KVCacheManager.lookup_prefix``);
    host hits are loaded in the step's block ops. A waiting request whose prefix continues on
    disk is passed over, as a held-back one is, until those reads have landed in the host tier.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Set
from dataclasses import dataclass, field
from itertools import chain, count, islice
from typing import TYPE_CHECKING, NamedTuple

from pagedserve.core.kv_cache_manager import BlockOps, CachedPrefix, KVCacheManager
from pagedserve.core.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pagedserve.lora.request import LoRARequest

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Built by ``EngineConfig.scheduler_config`` from resolved values; the options' defaults
    and help live on ``EngineConfig``."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    preemption_mode: str  # auto | swap | recompute
    # Free blocks kept back when admitting new requests, so running ones can grow a step or
    # two without immediately preempting the newcomer.
    watermark: float = 0.01
    # Partial prefills (see the module doc), with chunked prefill; 1 lets the oldest prefill
    # take all it can.
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0  # 0: no prompt counts as long
    # Distinct LoRA adapters the running groups may use (a step runs a subset of them);
    # 0: no limit (LoRA off).
    max_loras: int = 0
    # fcfs: by arrival; priority: by (priority, arrival), preempting the least urgent first.
    scheduling_policy: str = "fcfs"


class ScheduledSequence(NamedTuple):
    seq: Sequence
    num_computed_tokens: int  # tokens already in the cache before this step
    num_new_tokens: int
    block_ids: list[int]
    # Positions the step samples at: the last ``num_sample_positions`` of the chunk's tokens.
    # 1 when the chunk reaches the end of the known tokens (the next token), else 0 (and 0 for
    # a pooling stream's last chunk); plus one per draft.
    num_sample_positions: int
    # Drafts the chunk verifies, after the known tokens: its last ``len(draft_token_ids)``
    # tokens (speculative decoding).
    draft_token_ids: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Swaps and copy-on-write copies to apply before the forward pass.
    block_ops: BlockOps = field(default_factory=BlockOps)
    num_prompt_tokens: int = 0  # of the scheduled tokens, those that are prompt tokens

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class _Chunk(NamedTuple):
    cached_blocks: CachedPrefix  # prefix-cache hits taken before computing
    num_new_tokens: int  # the drafts among them
    num_drafts: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self._by_priority = config.scheduling_policy == "priority"
        queue = _PriorityQueue if self._by_priority else deque
        self.waiting: deque[SequenceGroup] | _PriorityQueue = queue()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] | _PriorityQueue = queue()
        self._arrivals = count()
        self.num_preemptions = 0
        self._watermark_blocks = int(config.watermark * kv.num_blocks)
        self._schedule_pending = False
        self._startable_loras: Set[int] | None = None
        # Prefills share a step only as chunks.
        self._shares_prefills = config.enable_chunked_prefill and \
            config.max_num_partial_prefills > 1
        self._prefill_cap = config.max_num_batched_tokens  # tokens one prefill chunk may take
        self._num_long = 0  # long prompts mid-prefill, counting those admitted this step
        self._prefilling = _PrefillIndex(kv.block_size)  # their roots: the shared-prefix rule

    def add_group(self, group: SequenceGroup) -> None:
        group.arrival = next(self._arrivals)
        self.waiting.append(group)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self, schedule_pending: bool = False,
                 startable_loras: Set[int] | None = None) -> SchedulerOutput:
        """The next step. With ``schedule_pending`` a stream whose last sampled token is still
        in flight computes it (async scheduling: the runner takes that input token from the
        previous step's output on the device); otherwise such a stream waits. A waiting
        request of an adapter not in ``startable_loras`` (None: any) stays waiting: its
        adapter is not in host memory (``lora/host_adapters.py``)."""
        self._schedule_pending = schedule_pending
        self._startable_loras = startable_loras
        out = SchedulerOutput()
        if self._by_priority and self.waiting and self.running:
            self._preempt_for_waiting(out)
        if self._shares_prefills:
            self._plan_prefills()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            budget = self._resume_swapped(out, budget)
            if not self.swapped:
                self._admit_waiting(out, budget)
            elif self._by_priority:  # those more urgent than every swapped group
                self._admit_waiting(out, budget, before=_order(self.swapped[0]))
        out.block_ops = self.kv.take_block_ops()
        return out

    # ---- running groups -----------------------------------------------------------------
    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            group = self.running[i]
            if self._decode_in_place(group, out):
                budget -= 1
                i += 1
                continue
            budget = self._schedule_group(group, i, out, budget, may_preempt=True)
            if i < len(self.running) and self.running[i] is group:
                i += 1  # otherwise the group was preempted and the next one moved up
        return budget

    def _decode_in_place(self, group: SequenceGroup, out: SchedulerOutput) -> bool:
        """Schedule the common step of a running group, decided without building a chunk: one
        stream, no forks pending, whose next chunk is the one token after its computed ones
        (no drafts, not past max_tokens) and lands in a block it alone holds without filling
        it (nothing to look up, allocate, copy or hash). ``_schedule_group`` would schedule it
        the same way; False, scheduling nothing, for anything else, which it handles."""
        if group.pending_forks or len(group.seqs) != 1:
            return False
        seq = group.seqs[0]
        computed = seq.num_computed_tokens
        num_tokens = self._num_tokens(seq)
        num_prompt = len(seq.prompt_token_ids)
        if not (computed and num_tokens - computed == 1 and not seq.draft_token_ids
                and num_tokens - num_prompt < max(seq.max_tokens, 1)):
            return False
        table = self.kv.table_if_it_fits(seq, 1)
        if table is None:
            return False
        # A pooling prompt's last token samples nothing (a chunk stopped one short of it).
        samples = int(seq.pooling is None)
        out.scheduled.append(ScheduledSequence(seq, computed, 1, table, samples))
        out.num_prompt_tokens += computed < num_prompt  # a prefill that stopped one short
        return True

    def _schedule_group(self, group: SequenceGroup, index: int, out: SchedulerOutput,
                        budget: int, may_preempt: bool) -> int:
        """Give each stream of ``group`` its next chunk; returns the budget left."""
        if group.ready_to_fork:
            self._fork_pending(group)
        allocated = False
        for seq in list(group.seqs):
            chunk = self._next_chunk(group, seq, budget) if budget else None
            if chunk is None:
                continue
            if not self._make_room(group, index, seq, chunk, out, may_preempt, allocated):
                break
            allocated = True
            seq.num_computed_tokens += len(chunk.cached_blocks) * self.kv.block_size
            if chunk.num_new_tokens:
                self._emit(out, seq, chunk.num_new_tokens, chunk.num_drafts)
                budget -= chunk.num_new_tokens
        return budget

    def _next_chunk(self, group: SequenceGroup, seq: Sequence, budget: int) -> _Chunk | None:
        """The tokens ``seq`` computes next under ``budget``, or None if it has none to run.
        The root of pending forks stops one token short: each fork computes the last one."""
        num_tokens = self._num_tokens(seq)
        # With max_tokens 0 the prompt still runs, once: its sample is dropped by the engine.
        if num_tokens - seq.num_prompt_tokens >= max(seq.max_tokens, 1):
            return None  # the token in flight is its last
        cached = self._cached_prefix(seq)
        start = seq.num_computed_tokens + len(cached) * self.kv.block_size
        num_left = num_tokens - start - (1 if group.pending_forks else 0)
        num_new = min(num_left, budget, self._prefill_cap)
        if num_new < num_left and not self.config.enable_chunked_prefill:
            return None
        if num_new == 0 and not cached:
            return None
        if num_new == num_left == 1 and seq.draft_token_ids and not self._schedule_pending:
            num_drafts = self._num_drafts(seq, budget - num_new)
            return _Chunk(cached, num_new + num_drafts, num_drafts)
        return _Chunk(cached, num_new)

    @staticmethod
    def _num_drafts(seq: Sequence, budget: int) -> int:
        """Drafts a decode step verifies: what the budget allows, and never more than would
        take the stream past max_tokens (a verify step outputs up to one token more)."""
        return max(0, min(len(seq.draft_token_ids), budget,
                          seq.max_tokens - seq.num_output_tokens - 1))

    def _num_tokens(self, seq: Sequence) -> int:
        return seq.num_known_tokens if self._schedule_pending else seq.num_tokens

    def _num_left(self, group: SequenceGroup) -> int:
        return self._num_tokens(group.root) - group.root.num_computed_tokens

    # ---- partial prefills ---------------------------------------------------------------
    def _plan_prefills(self) -> None:
        """Set this step's prefill cap and count the long prompts mid-prefill."""
        decodes, demands, self._num_long = 0, [], 0
        self._prefilling = _PrefillIndex(self.kv.block_size)
        for group in self.running:
            num_left = self._num_left(group) if group.seqs else 0  # else: only forks pending
            if num_left > 1:
                demands.append(num_left)
                self._num_long += self._is_long(num_left)
                self._prefilling.add(group.root)
            else:
                decodes += len(group.seqs)
        if not self.swapped:  # waiting requests start only once nothing is swapped out
            demands += self._waiting_demands()
        # At least a token: with more decodes or prefills than the budget has tokens, the fair
        # share is 0, and a cap of 0 let no stream run, step after step.
        self._prefill_cap = max(1, _fair_level(demands,
                                               self.config.max_num_batched_tokens - decodes))

    def _waiting_demands(self) -> list[int]:
        """Tokens left of the waiting prompts that may start this step, at most
        ``max_num_partial_prefills`` of them."""
        demands, num_long, starting = [], self._num_long, self._prefilling.copy()
        for group in self._scan_waiting():
            num_left = self._num_left(group)
            if self._follows_a_prefill(group.root, starting):
                continue
            if self._is_long(num_left):
                if num_long >= self.config.max_long_partial_prefills:
                    continue
                num_long += 1
            demands.append(num_left)
            starting.add(group.root)
            if len(demands) == self.config.max_num_partial_prefills:
                break
        return demands

    def _scan_waiting(self) -> islice[SequenceGroup]:
        # A step admits at most max_num_seqs groups: looking further, past long prompts
        # held back, would cost time on every step of a long queue for nothing.
        return islice(self.waiting, self.config.max_num_seqs)

    def _is_long(self, num_left: int) -> bool:
        threshold = self.config.long_prefill_token_threshold
        return 0 < threshold < num_left

    def _held_back(self, group: SequenceGroup) -> bool:
        return (self._shares_prefills
                and self._num_long >= self.config.max_long_partial_prefills
                and self._is_long(self._num_left(group)))

    def _follows_a_prefill(self, seq: Sequence, prefilling: _PrefillIndex) -> bool:
        """One of ``prefilling`` computes the next block of ``seq``'s prompt this step (the
        same tokens from the start up to that block's end, under the same adapter), which
        ``seq`` can take from the prefix cache a step later instead of computing it too."""
        if (not self._shares_prefills or not self.kv.enable_caching
                or seq.params.prompt_logprobs is not None):
            return False
        return prefilling.computes_next_block_of(seq)

    def _cached_prefix(self, seq: Sequence) -> CachedPrefix:
        return self.kv.lookup_prefix(seq) if self._looks_up(seq) else CachedPrefix([])

    def _looks_up(self, seq: Sequence) -> bool:
        # Prompt logprobs need every prompt position computed, so they bypass the cache.
        return not (seq.num_computed_tokens or seq in self.kv.tables
                    or seq.params.prompt_logprobs is not None)

    def _loading_from_disk(self, group: SequenceGroup) -> bool:
        return self._looks_up(group.root) and self.kv.fetch_from_disk(group.root)

    def _make_room(self, group: SequenceGroup, index: int, seq: Sequence, chunk: _Chunk,
                   out: SchedulerOutput, may_preempt: bool, allocated: bool) -> bool:
        """Allocate ``chunk`` for ``seq``, preempting newer groups while it does not fit.
        False if it cannot run this step (the group itself may have been preempted)."""
        while not self.kv.allocate_slots(seq, chunk.num_new_tokens, chunk.cached_blocks):
            victim = self._pick_victim(index, include_self=not allocated) if may_preempt \
                else None
            if victim is None:
                return False
            self._preempt(victim, out)
            if victim is group:
                return False
        return True

    def _pick_victim(self, index: int, include_self: bool) -> SequenceGroup | None:
        """The newest group from ``index`` on that has sampled since it last resumed. Only the
        oldest group, with nothing scheduled yet, falls back to the newest resumed one: if
        every group waited for a resumed one, none might move again."""
        candidates = self.running[index if include_self else index + 1:]
        for group in reversed(candidates):
            if not group.resumed:
                return group
        return candidates[-1] if candidates and index == 0 and include_self else None

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.running.remove(group)
        self.num_preemptions += 1
        out.preempted.extend(group.seqs)
        for seq in group.seqs:
            seq.num_preemptions += 1
        if self._swaps(group) and self.kv.can_swap_out(group.seqs):
            self.kv.swap_out(group.seqs)
            group.move_to(SequenceStatus.SWAPPED)
            self.swapped.appendleft(group)
            return
        for seq in group.seqs:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
        group.move_to(SequenceStatus.WAITING)
        self.waiting.appendleft(group)

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Priority policy: while the most urgent waiting group cannot start for want of
        blocks or sequence slots, preempt the least urgent running group less urgent than it.
        A head that could not start anyway (its adapter not startable or over ``max_loras``,
        its prefix on its way from disk) preempts nothing."""
        head = self.waiting[0]
        if (self._loading_from_disk(head) or not self._lora_startable(head)
                or not self._lora_fits(head, self._running_loras())):
            return
        budget = self.config.max_num_batched_tokens
        while not self._can_admit(head, budget, self._free_seq_slots()):
            victim = self._outranked_by(head)
            if victim is None:
                return
            self._preempt(victim, out)

    def _outranked_by(self, head: SequenceGroup) -> SequenceGroup | None:
        """The least urgent running group less urgent than ``head`` that has sampled since
        it last resumed, or None."""
        key = _order(head)
        for group in reversed(self.running):
            if _order(group) <= key:
                return None
            if not group.resumed:
                return group
        return None

    def _swaps(self, group: SequenceGroup) -> bool:
        mode = self.config.preemption_mode
        return mode == "swap" or (mode == "auto" and len(group.seqs) > 1)

    def _fork_pending(self, group: SequenceGroup) -> None:
        root = group.root
        for child in group.pending_forks:
            child.num_computed_tokens = root.num_computed_tokens
            self.kv.fork(root, child)
            group.seqs.append(child)
        group.pending_forks = []
        group.move_to(group.status)

    # ---- swapped and waiting groups -----------------------------------------------------
    # Both loops only add running groups, so they count free sequence slots down themselves
    # instead of summing the running widths for every group they look at, and keep the running
    # adapters in a set instead of collecting them from every running group for every group.
    def _resume_swapped(self, out: SchedulerOutput, budget: int) -> int:
        free_slots, loras = self._free_seq_slots(), self._running_loras()
        while self.swapped and budget > 0 and self._can_resume(self.swapped[0], free_slots,
                                                                 loras):
            if self._by_priority and self.waiting and \
                    _order(self.waiting[0]) < _order(self.swapped[0]):
                break  # a more urgent group waits: it starts first
            group = self.swapped.popleft()
            free_slots -= group.width
            _add_lora(loras, group)
            self.kv.swap_in(group.seqs)
            budget = self._start(group, out, budget, resumed=True)
        return budget

    def _can_resume(self, group: SequenceGroup, free_slots: int, loras: set[int]) -> bool:
        return (free_slots >= group.width and self._lora_fits(group, loras)
                and self.kv.can_swap_in(group.seqs, self._watermark_blocks))

    def _admit_waiting(self, out: SchedulerOutput, budget: int,
                       before: tuple[int, int] | None = None) -> None:
        """In order, passing over long prompts held back; then, with what budget is left, in
        order again with none held back. ``before``: only groups ordered before this key."""
        free_slots = self._free_seq_slots()
        budget, free_slots, passed_over = self._admit_in_order(out, budget, free_slots, True,
                                                               before)
        if passed_over:
            self._admit_in_order(out, budget, free_slots, False, before)

    def _admit_in_order(self, out: SchedulerOutput, budget: int, free_slots: int,
                        hold_back: bool, before: tuple[int, int] | None
                        ) -> tuple[int, int, bool]:
        """Start waiting groups until one does not fit; returns the budget and sequence slots
        left, and whether a held-back long prompt was passed over."""
        i, passed_over, loras = 0, False, self._running_loras()
        while i < min(len(self.waiting), self.config.max_num_seqs) and budget > 0:
            group = self.waiting[i]
            if before is not None and _order(group) >= before:
                break
            if self._follows_a_prefill(group.root, self._prefilling):
                i += 1
                continue
            if hold_back and self._held_back(group):
                i, passed_over = i + 1, True
                continue
            # Reading its prefix from disk, or waiting for its adapter: others go first.
            if (self._loading_from_disk(group) or not self._lora_fits(group, loras)
                    or not self._lora_startable(group)):
                i += 1
                continue
            if not self._can_admit(group, budget, free_slots):
                break
            del self.waiting[i]
            free_slots -= group.width
            _add_lora(loras, group)
            self._num_long += self._is_long(self._num_left(group))
            budget = self._start_waiting(group, out, budget)
            if self._shares_prefills:  # indexed once its chunk (prefix hits too) is final
                self._prefilling.add(group.root)
        return budget, free_slots, passed_over

    def _start_waiting(self, group: SequenceGroup, out: SchedulerOutput, budget: int) -> int:
        root = group.root
        budget = self._start(group, out, budget, resumed=root.num_preemptions > 0)
        if root.num_preemptions == 0:
            root.num_cached_tokens = root.num_computed_tokens
            self.kv.record_prefix_lookup(root.num_prompt_tokens, root.num_cached_tokens)
        return budget

    def _can_admit(self, group: SequenceGroup, budget: int, free_slots: int) -> bool:
        """The group's first chunk fits the budget and leaves the watermark free."""
        if free_slots < group.width:
            return False
        chunk = self._next_chunk(group, group.root, budget)
        if chunk is None:
            return group.ready_to_fork  # a one-token prompt: the forks compute it
        needed = self.kv.blocks_needed(group.root, chunk.num_new_tokens, chunk.cached_blocks)
        return needed + self._watermark_blocks <= self.kv.pool.num_free

    def _start(self, group: SequenceGroup, out: SchedulerOutput, budget: int,
               resumed: bool) -> int:
        group.move_to(SequenceStatus.RUNNING)
        group.resumed = resumed
        return self._schedule_group(group, self._add_running(group), out, budget,
                                    may_preempt=False)

    def _add_running(self, group: SequenceGroup) -> int:
        """Append ``group`` to the running list, or under the priority policy insert it in
        (priority, arrival) order; returns its index."""
        if not self._by_priority:
            self.running.append(group)
            return len(self.running) - 1
        index = bisect.bisect_right(self.running, _order(group), key=_order)
        self.running.insert(index, group)
        return index

    def _lora_fits(self, group: SequenceGroup, running: set[int]) -> bool:
        """Running ``group`` keeps the running groups' distinct adapters (``running``) within
        ``max_loras``, so no step ever needs more adapters than there are device slots."""
        lora = _lora_of(group)
        if lora is None or not self.config.max_loras:
            return True
        return lora.lora_int_id in running or len(running) < self.config.max_loras

    def _lora_startable(self, group: SequenceGroup) -> bool:
        lora = _lora_of(group)
        return lora is None or self._startable_loras is None or \
            lora.lora_int_id in self._startable_loras

    def waiting_loras(self) -> list[LoRARequest]:
        """The adapters of the waiting groups a step may start, in queue order."""
        return [r for r in map(_lora_of, self._scan_waiting()) if r is not None]

    def loras_in_use(self) -> set[int]:
        """The adapters of the running and swapped groups, which must stay in host memory."""
        return {r.lora_int_id for r in map(_lora_of, chain(self.running, self.swapped))
                if r is not None}

    def waiting_of(self, lora_int_id: int) -> list[SequenceGroup]:
        """The waiting groups of an adapter."""
        return [g for g in self.waiting
                if (lora := _lora_of(g)) is not None and lora.lora_int_id == lora_int_id]

    def _running_loras(self) -> set[int]:
        return {r.lora_int_id for r in map(_lora_of, self.running) if r is not None}

    def _free_seq_slots(self) -> int:
        return self.config.max_num_seqs - sum(g.width for g in self.running)

    def _emit(self, out: SchedulerOutput, seq: Sequence, num_new: int, num_drafts: int) -> None:
        computed = seq.num_computed_tokens
        drafts = tuple(seq.draft_token_ids[:num_drafts])
        seq.draft_token_ids = []  # verified by this step, or proposed again after it
        # A pooling stream samples nothing: rank 0 pools its prompt's last chunk instead.
        reaches_end = computed + num_new - num_drafts == self._num_tokens(seq) \
            and seq.pooling is None
        out.num_prompt_tokens += max(0, min(num_new, len(seq.prompt_token_ids) - computed))
        out.scheduled.append(ScheduledSequence(
            seq, computed, num_new, self.kv.block_table(seq),
            num_sample_positions=reaches_end + num_drafts, draft_token_ids=drafts,
        ))

    # ---- after the step -----------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """Mark the scheduled tokens computed, and each sampled token pending until the engine
        appends it; call once the step's forward pass is queued."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.num_sample_positions:
                item.seq.num_pending_tokens += item.num_sample_positions
                item.seq.group.resumed = False

    def take_back(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` computed tokens of a running stream: the drafts a
        verify step rejected, whose sampled positions output nothing. Their slots go back to
        the KV cache (``KVCacheManager.trim``); none of them was ever hashed."""
        seq.num_pending_tokens -= num_tokens
        seq.num_computed_tokens -= num_tokens
        self.kv.trim(seq, seq.num_computed_tokens)

    def fork(self, parent: Sequence) -> Sequence:
        """A new stream continuing ``parent`` (beam search), sharing all its blocks."""
        child = parent.fork()
        self.kv.fork(parent, child)
        parent.group.seqs.append(child)
        return child

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Stop a stream wherever it is and return its blocks at once."""
        if seq.status.finished:
            return
        group = seq.group
        if seq in group.pending_forks:
            group.pending_forks.remove(seq)
        else:
            group.seqs.remove(seq)
            self.kv.free(seq)
        seq.status = status
        if group.is_empty:
            self._queue_of(group).remove(group)

    def _queue_of(self, group: SequenceGroup
                  ) -> list[SequenceGroup] | deque[SequenceGroup] | _PriorityQueue:
        return {SequenceStatus.WAITING: self.waiting, SequenceStatus.RUNNING: self.running,
                SequenceStatus.SWAPPED: self.swapped}[group.status]

    def kv_waste_slots(self) -> tuple[int, int]:
        """(allocated slots, slots holding computed tokens) over running streams."""
        allocated = filled = 0
        for group in self.running:
            for seq in group.seqs:
                allocated += len(self.kv.block_table(seq)) * self.kv.block_size
                filled += seq.num_computed_tokens
        return allocated, filled


class _PrefillIndex:
    """The roots of the prompts prefilling in a step, by the block each computes next: its
    prompt from the start to that block's end, under its adapter's cache key. Asking whether
    a prompt follows one of them is a lookup per distinct block end instead of a comparison
    per root, which in the first step of a burst of requests compared every pair of them.

    A root is added once its progress in the step is final (running, or admitted with its
    chunk scheduled); nothing moves it within the step after that, since admission stops at
    the first preemption."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_end: dict[int, set[tuple[str | None, tuple[int, ...]]]] = {}

    def add(self, root: Sequence) -> None:
        end = (root.num_computed_tokens // self.block_size + 1) * self.block_size
        if end <= len(root.prompt_token_ids):
            self._by_end.setdefault(end, set()).add(_prefix_key(root, end))

    def computes_next_block_of(self, seq: Sequence) -> bool:
        return any(end <= len(seq.prompt_token_ids) and _prefix_key(seq, end) in keys
                   for end, keys in self._by_end.items())

    def copy(self) -> _PrefillIndex:
        twin = _PrefillIndex(self.block_size)
        twin._by_end = {end: set(keys) for end, keys in self._by_end.items()}
        return twin


class _PriorityQueue:
    """Groups in (priority, arrival) order, read and changed as the scheduler reads and
    changes a deque: by index from the front, deleting at any index. A sorted list: an
    insertion is a binary search (O(log n) comparisons) and one move of the pointers after
    it; nothing is sorted again. ``appendleft`` inserts in order too: a preempted group goes
    back to its place, not to the head."""

    def __init__(self) -> None:
        self._groups: list[SequenceGroup] = []

    def append(self, group: SequenceGroup) -> None:
        bisect.insort_right(self._groups, group, key=_order)

    appendleft = append

    def popleft(self) -> SequenceGroup:
        return self._groups.pop(0)

    def remove(self, group: SequenceGroup) -> None:
        self._groups.remove(group)

    def __getitem__(self, index: int) -> SequenceGroup:
        return self._groups[index]

    def __delitem__(self, index: int) -> None:
        del self._groups[index]

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[SequenceGroup]:
        return iter(self._groups)


def _order(group: SequenceGroup) -> tuple[int, int]:
    """The priority policy's key: lower priority values first, then arrival."""
    return group.priority, group.arrival


def _prefix_key(seq: Sequence, end: int) -> tuple[str | None, tuple[int, ...]]:
    return seq.block_key, tuple(seq.prompt_token_ids[:end])


def _lora_of(group: SequenceGroup) -> LoRARequest | None:
    """The group's adapter (every stream of a request has the same), or None."""
    streams = group.seqs or group.pending_forks
    return streams[0].lora_request if streams else None


def _add_lora(loras: set[int], group: SequenceGroup) -> None:
    lora = _lora_of(group)
    if lora is not None:
        loras.add(lora.lora_int_id)


def _fair_level(demands: list[int], supply: int) -> int:
    """The max-min fair cap: the largest ``c`` with ``sum(min(d, c) for d in demands)`` at
    most ``supply`` (all of ``supply`` when the demands fit in it); 0 when the decodes took
    the whole budget, or more (``supply`` is negative)."""
    if supply <= 0:
        return 0
    if sum(demands) <= supply:
        return supply
    for i, demand in enumerate(sorted(demands)):
        share = supply // (len(demands) - i)
        if demand > share:
            return share
        supply -= demand
    raise AssertionError("unreachable: the demands exceed the supply")
