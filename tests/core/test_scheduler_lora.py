"""The scheduler under ``max_loras``: a group starts (or resumes) only while the running groups'
distinct adapters fit, so no step needs more adapters than the device has slots; the base
model's requests never wait for adapters."""

from __future__ import annotations

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams


def _scheduler(max_loras: int, preemption_mode: str = "recompute",
               num_blocks: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_caching=False)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                     max_model_len=256, enable_chunked_prefill=True,
                                     preemption_mode=preemption_mode, watermark=0.0,
                                     max_loras=max_loras), kv)


def _add(sched: Scheduler, lora_id: int | None, max_tokens: int) -> Sequence:
    lora = None if lora_id is None else LoRARequest(f"a{lora_id}", lora_id, "/none")
    seq = Sequence([5, 6, 7], SamplingParams(), max_tokens=max_tokens, lora_request=lora)
    sched.add_group(SequenceGroup(str(id(seq)), [seq]))
    return seq


def _run(sched: Scheduler) -> list[set[int]]:
    """Step to the end; the adapters of each step."""
    steps = []
    while sched.has_unfinished:
        out = sched.schedule()
        sched.advance(out)
        steps.append({s.seq.lora_request.lora_int_id for s in out.scheduled
                      if s.seq.lora_request is not None})
        for item in out.scheduled:
            if item.num_sample_positions:
                item.seq.append_output(9)
                if item.seq.num_output_tokens >= item.seq.max_tokens:
                    sched.finish(item.seq, SequenceStatus.FINISHED_LENGTH)
    return steps


def test_no_step_runs_more_adapters_than_slots():
    sched = _scheduler(max_loras=2)
    seqs = [_add(sched, lora, max_tokens=2 + i) for i, lora in
            enumerate([1, 2, 3, None, 1, 4, None, 3])]
    steps = _run(sched)
    assert max(len(s) for s in steps) == 2
    assert {i for s in steps for i in s} == {1, 2, 3, 4}
    assert all(s.status == SequenceStatus.FINISHED_LENGTH for s in seqs)


def test_a_request_waiting_for_a_slot_holds_back_no_other():
    sched = _scheduler(max_loras=1)
    _add(sched, 1, max_tokens=5)
    sched.advance(sched.schedule())
    other = _add(sched, 2, max_tokens=5)  # waits: the only slot is adapter 1's
    base, same = _add(sched, None, 5), _add(sched, 1, 5)
    scheduled = {s.seq for s in sched.schedule().scheduled}
    assert base in scheduled and same in scheduled and other not in scheduled
    assert list(sched.waiting) == [other.group]


def test_without_a_limit_every_adapter_runs_at_once():
    sched = _scheduler(max_loras=0)
    for lora in (1, 2, 3):
        _add(sched, lora, max_tokens=3)
    assert len(_run(sched)[0]) == 3


def test_a_shared_prompt_under_another_adapter_is_not_held_back_for_the_cache():
    """With shared prefills a prompt whose next block another prefill computes waits a step to
    take it from the prefix cache; under another adapter that block is never its own."""
    kv = KVCacheManager(64, 4, enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                      max_model_len=256, enable_chunked_prefill=True,
                                      preemption_mode="recompute", watermark=0.0,
                                      max_num_partial_prefills=4, max_loras=2), kv)
    prompt = list(range(3, 23))
    seqs = []
    for lora_id, key in ((1, "k1"), (2, "k2"), (1, "k1")):
        lora = LoRARequest(f"a{lora_id}", lora_id, "/none")
        seqs.append(Sequence(list(prompt), SamplingParams(), max_tokens=2, lora_request=lora,
                             cache_key=key))
        sched.add_group(SequenceGroup(str(lora_id) + key + str(len(seqs)), [seqs[-1]]))
    scheduled = {s.seq for s in sched.schedule().scheduled}
    # The second runs beside the first; the third (same adapter as the first) waits for its
    # blocks.
    assert scheduled == {seqs[0], seqs[1]}


def test_a_request_of_an_adapter_not_startable_waits_and_holds_back_no_other():
    """The engine names the adapters in host memory; a request of another waits for it."""
    sched = _scheduler(max_loras=2)
    other, held, base = _add(sched, 2, max_tokens=2), _add(sched, 1, max_tokens=2), \
        _add(sched, None, max_tokens=2)
    out = sched.schedule(startable_loras={1})
    assert {s.seq for s in out.scheduled} == {held, base}
    assert other.status == SequenceStatus.WAITING
    assert [r.lora_int_id for r in sched.waiting_loras()] == [2]
    assert sched.loras_in_use() == {1}
    sched.advance(out)
    out = sched.schedule(startable_loras={1, 2})
    assert other in {s.seq for s in out.scheduled}
