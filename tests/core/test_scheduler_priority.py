"""``--scheduling-policy priority``: the queues in (priority, arrival) order, and the least
urgent running group preempted for a more urgent one. Driven step by step, with no model."""

from __future__ import annotations

import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.sequence import Sequence, SequenceGroup
from pagedserve.sampling_params import SamplingParams
from tests.kv_checks import assert_pools_full, check_pools, sample_without_model

BLOCK = 4


def _scheduler(policy="priority", num_blocks=64, max_seqs=8, mode="auto", host_blocks=0):
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=True, num_host_blocks=host_blocks)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64,
                          max_model_len=256, enable_chunked_prefill=True,
                          preemption_mode=mode, watermark=0.0, scheduling_policy=policy)
    return Scheduler(cfg, kv)


def _group(name, priority, prompt_len=4, max_tokens=8, n=1):
    # Distinct prompts: no prefix-cache hits between requests.
    prompt = [100 + 10 * ord(name[0]) + i for i in range(prompt_len)]
    seqs = [Sequence(list(prompt), SamplingParams(), max_tokens=max_tokens) for _ in range(n)]
    return SequenceGroup(name, seqs[:1], width=n, pending_forks=seqs[1:], priority=priority)


def _step(sched):
    """One engine step without a model: every sampled position appends token 7."""
    out = sched.schedule()
    sample_without_model(sched, out)
    check_pools(sched.kv)
    return out


def _names(groups):
    return [g.request_id for g in groups]


def _run_to_end(sched, max_steps=500):
    """Step until nothing is left; the request ids in the order they first ran."""
    started = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            break
        for item in _step(sched).scheduled:
            if item.seq.group.request_id not in started:
                started.append(item.seq.group.request_id)
    assert not sched.has_unfinished
    assert_pools_full(sched.kv)
    return started


@pytest.mark.parametrize("policy,order", [
    ("priority", ["b", "c", "a", "e", "d"]),  # lower first; b before c and a before e: arrival
    ("fcfs", ["a", "b", "c", "d", "e"]),  # the priorities are not read
])
def test_admission_by_priority_then_arrival(policy, order):
    sched = _scheduler(policy, max_seqs=1)
    for name, priority in [("a", 0), ("b", -1), ("c", -1), ("d", 5), ("e", 0)]:
        sched.add_group(_group(name, priority, max_tokens=2))
    assert _names(sched.waiting) == order
    assert _run_to_end(sched) == order


def test_a_late_urgent_arrival_takes_the_seat_of_a_running_one_first():
    """With one sequence slot, an urgent arrival preempts the running request; that one goes
    back ahead of the requests that arrived after it."""
    sched = _scheduler(max_seqs=1)
    for name in "abc":
        sched.add_group(_group(name, 3, max_tokens=2))
    _step(sched)  # a runs
    sched.add_group(_group("u", 1, max_tokens=2))
    assert _names(sched.waiting) == ["u", "b", "c"]
    out = _step(sched)
    assert _names({s.group: None for s in out.preempted}) == ["a"]
    assert _names(sched.waiting) == ["u", "a", "b", "c"]
    assert _run_to_end(sched) == ["u", "a", "b", "c"]


def _fill_pool(policy, priorities=(1, 2)):
    """Two running requests of three-block prompts in an eight-block pool; after a decode
    step each holds four blocks and none is free."""
    sched = _scheduler(policy, num_blocks=8)
    low = [_group(name, p, prompt_len=12, max_tokens=20) for name, p in zip("lm", priorities)]
    for group in low:
        sched.add_group(group)
    _step(sched)
    _step(sched)
    assert _names(sched.running) == ["l", "m"] and sched.kv.pool.num_free == 0
    return sched, low


def test_an_urgent_arrival_preempts_the_least_urgent_running_request():
    sched, (l_group, m_group) = _fill_pool("priority")
    sched.add_group(_group("h", 0, prompt_len=8, max_tokens=4))
    out = _step(sched)
    assert [s.group for s in out.preempted] == [m_group]  # priority 2, not 1
    assert _names(sched.running) == ["l"]
    assert _names(sched.waiting) == ["h", "m"]  # back in its place, behind the urgent one
    out = _step(sched)
    assert "h" in {item.seq.group.request_id for item in out.scheduled}
    assert _names(sched.running) == ["h", "l"]
    _run_to_end(sched)
    assert all(s.num_output_tokens == s.max_tokens for g in (l_group, m_group) for s in g.seqs)


def test_equal_priorities_preempt_the_later_arrival():
    sched, (l_group, m_group) = _fill_pool("priority", priorities=(1, 1))
    sched.add_group(_group("h", 0, prompt_len=8, max_tokens=4))
    assert [s.group for s in _step(sched).preempted] == [m_group]


def test_no_preemption_for_a_waiting_request_that_is_not_more_urgent():
    sched, _ = _fill_pool("priority", priorities=(1, 1))
    sched.add_group(_group("h", 1, prompt_len=8, max_tokens=4))
    for _ in range(3):  # l and m fill their fourth blocks: nothing needs a new one
        assert not _step(sched).preempted
        assert _names(sched.running) == ["l", "m"] and _names(sched.waiting) == ["h"]


def test_fcfs_does_not_preempt_for_a_waiting_request():
    sched, _ = _fill_pool("fcfs", priorities=(0, 0))
    sched.add_group(_group("h", -5, prompt_len=8, max_tokens=4))  # not read under fcfs
    out = _step(sched)
    assert not out.preempted
    assert _names(sched.running) == ["l", "m"] and _names(sched.waiting) == ["h"]


@pytest.mark.parametrize("policy,victim", [("priority", "a"), ("fcfs", "b")])
def test_a_running_request_short_of_blocks_preempts_the_least_urgent(policy, victim):
    """``a`` arrived first but matters less: under priority it is preempted although it is
    the older one; fcfs preempts the newer ``b``."""
    sched = _scheduler(policy, num_blocks=8)
    sched.add_group(_group("a", 5, prompt_len=12, max_tokens=20))
    sched.add_group(_group("b", 0, prompt_len=12, max_tokens=20))
    _step(sched)
    out = _step(sched)
    while not out.preempted:
        out = _step(sched)
    assert {s.group.request_id for s in out.preempted} == {victim}
    _run_to_end(sched)


def test_sequence_slots_are_freed_for_an_urgent_group_of_several_streams():
    """max_num_seqs=2 holds two single-stream requests; an urgent request with n=2 needs both
    slots, so both are preempted (the later arrival first) and it forks once it starts."""
    sched = _scheduler(max_seqs=2)
    low = [_group(name, 3, max_tokens=10) for name in "lm"]
    for group in low:
        sched.add_group(group)
    _step(sched)
    urgent = _group("h", 0, max_tokens=3, n=2)
    sched.add_group(urgent)
    out = _step(sched)
    assert [s.group.request_id for s in out.preempted] == ["m", "l"]
    _step(sched)
    _step(sched)
    assert _names(sched.running) == ["h"] and len(urgent.seqs) == 2
    assert _run_to_end(sched)[:1] == ["h"]


def test_a_swapped_out_group_waits_for_more_urgent_waiting_ones():
    """A preempted group of two streams is swapped out; the urgent request it made room for
    starts while it is swapped out (fcfs would resume it first), and it resumes after."""
    sched = _scheduler(num_blocks=8, host_blocks=16)
    pair = _group("p", 2, prompt_len=8, max_tokens=12, n=2)
    sched.add_group(pair)
    for _ in range(8):  # until the urgent request's three blocks are not free
        if sched.kv.pool.num_free < 3:
            break
        _step(sched)
    assert len(pair.seqs) == 2 and sched.kv.pool.num_free < 3
    sched.add_group(_group("h", 0, prompt_len=12, max_tokens=3))
    out = _step(sched)
    assert {s.group.request_id for s in out.preempted} == {"p"}
    assert _names(sched.swapped) == ["p"]
    out = _step(sched)
    assert _names(sched.running) == ["h"] and _names(sched.swapped) == ["p"]
    _run_to_end(sched)
    assert all(s.num_output_tokens == 12 for s in pair.seqs)


def test_priority_requests_under_pressure_all_finish_with_every_block_back():
    """Many requests of mixed priorities through a small pool, both preemption modes: each
    finishes with all its tokens, the pools are consistent after every step."""
    for mode in ("recompute", "swap"):
        sched = _scheduler(num_blocks=12, max_seqs=4, mode=mode, host_blocks=32)
        groups = [_group(chr(ord("a") + i), (i * 7) % 5 - 2, prompt_len=5 + i % 4,
                         max_tokens=6 + i % 5, n=1 + (i % 3 == 0)) for i in range(10)]
        for group in groups[:5]:
            sched.add_group(group)
        for _ in range(3):
            _step(sched)
        for group in groups[5:]:
            sched.add_group(group)
        _run_to_end(sched)
        assert sched.num_preemptions > 0
        assert all(s.num_output_tokens == s.max_tokens
                   for g in groups for s in g.seqs + g.pending_forks)


def test_an_urgent_request_whose_adapter_cannot_start_preempts_nothing():
    """Its adapter is not in host memory yet (``startable_loras``): it would not start this
    step, so preempting for it would only throw work away."""
    from pagedserve.lora.request import LoRARequest

    sched, _ = _fill_pool("priority")
    urgent = _group("h", 0, prompt_len=8, max_tokens=4)
    urgent.root.lora_request = LoRARequest("a1", 1, "/none")
    sched.add_group(urgent)
    out = sched.schedule(startable_loras=set())
    assert not out.preempted and _names(sched.running) == ["l", "m"]
    sample_without_model(sched, out)
    assert [s.group for s in sched.schedule(startable_loras={1}).preempted] == [sched.waiting[1]]
