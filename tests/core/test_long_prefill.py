"""Concurrent partial prefills: a long prompt mid-prefill does not hold back newer requests
(issue 25, defect 6), yet keeps progressing, and every step stays inside the token budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedserve.config import ConfigError, EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.sequence import Sequence, SequenceGroup
from pagedserve.platforms.cpu.platform import CpuPlatform
from pagedserve.sampling_params import SamplingParams
from tests.kv_checks import sample_without_model

BLOCK = 4
BUDGET = 64


def _scheduler(partial=4, long_partial=1, threshold=32, budget=BUDGET, chunked=True):
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=budget, max_model_len=1024,
                          enable_chunked_prefill=chunked, preemption_mode="auto", watermark=0.0,
                          max_num_partial_prefills=partial,
                          max_long_partial_prefills=long_partial,
                          long_prefill_token_threshold=threshold)
    return Scheduler(cfg, KVCacheManager(1024, BLOCK, enable_caching=False))


def _add(sched, n, max_tokens=4):
    seq = Sequence(list(range(1, n + 1)), SamplingParams(), max_tokens=max_tokens)
    sched.add_group(SequenceGroup(f"request-{id(seq)}", [seq]))
    return seq


def _step(sched):
    """One engine step without a model: each sampling stream gets token 7."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    sample_without_model(sched, out)
    return {item.seq: item for item in out.scheduled}


def test_a_short_request_prefills_in_the_step_after_it_arrives_during_a_long_prefill():
    sched = _scheduler()
    long = _add(sched, 600, max_tokens=1)
    assert _step(sched)[long].num_new_tokens == BUDGET  # alone it takes the whole budget
    short = _add(sched, 5)
    step = _step(sched)
    assert (step[short].num_new_tokens, step[short].num_sample_positions) == (5, True)
    # Work-conserving: the long prompt takes what the short one leaves.
    assert step[long].num_new_tokens == BUDGET - 5
    assert short.num_output_tokens == 1 and not long.output_token_ids


def test_the_long_prefill_progresses_every_step_while_short_requests_keep_arriving():
    sched = _scheduler()
    long = _add(sched, 1000, max_tokens=1)
    waited = []
    for _ in range(200):
        if long.num_output_tokens:
            break
        shorts = [_add(sched, 6, max_tokens=2) for _ in range(3)]
        num_left = long.num_tokens - long.num_computed_tokens
        step = _step(sched)
        # With three prefills and the decodes of the last step's requests, the long one's
        # fair share of what the decodes leave is at least a quarter of the budget.
        assert step[long].num_new_tokens >= min(BUDGET // 4, num_left)
        waited += [s for s in shorts if s not in step]
    assert long.num_output_tokens == 1
    assert not waited  # every short request started in the step after it arrived


def test_a_second_long_prompt_waits_while_short_ones_go_ahead_of_it():
    sched = _scheduler(long_partial=1, threshold=32)
    first = _add(sched, 300, max_tokens=1)
    _step(sched)
    second, short = _add(sched, 300, max_tokens=1), _add(sched, 4)
    step = _step(sched)
    assert short in step and second not in step  # budget: 4 for short, 60 for first
    for _ in range(20):
        if second in step:
            break
        # The second long prompt only starts once the first is no longer long.
        assert first.num_tokens - first.num_computed_tokens > 32
        step = _step(sched)
    assert second in step


def test_a_held_back_long_prompt_takes_what_the_step_leaves():
    """Long prompts only: the second starts at once with the budget the first leaves."""
    sched = _scheduler(long_partial=1)
    first, second = _add(sched, 40, max_tokens=1), _add(sched, 300, max_tokens=1)
    step = _step(sched)
    assert (step[first].num_new_tokens, step[second].num_new_tokens) == (40, BUDGET - 40)


def test_threshold_0_counts_no_prompt_as_long():
    sched = _scheduler(long_partial=1, threshold=0)
    first = _add(sched, 300, max_tokens=1)
    _step(sched)
    second = _add(sched, 300, max_tokens=1)
    step = _step(sched)
    assert step[first].num_new_tokens == step[second].num_new_tokens == BUDGET // 2


def test_one_partial_prefill_is_strict_order():
    """max_num_partial_prefills 1 turns it off: the oldest prefill takes all it can."""
    sched = _scheduler(partial=1)
    long = _add(sched, 200, max_tokens=1)
    _step(sched)
    short = _add(sched, 5)
    steps = [_step(sched) for _ in range(3)]
    assert [short in s for s in steps] == [False, False, True]
    assert [s[long].num_new_tokens for s in steps] == [BUDGET, BUDGET, 200 - 3 * BUDGET]


@pytest.mark.parametrize("budget, num_requests, width", [
    (1, 1, 1), (4, 4, 1), (4, 8, 1), (2, 1, 4)])
def test_every_step_runs_a_stream_when_streams_outnumber_the_budget(budget, num_requests,
                                                                     width):
    """With as many decodes or prefills as the budget has tokens, the fair share of a
    prefill is 0 tokens: that cap held back every stream, decodes too, and the engine stepped
    forever without running any (`LLM(max_num_batched_tokens=4)`, 4 requests). With more
    decodes than that (n=4 under a budget of 2), sharing the budget failed the step."""
    sched = _scheduler(budget=budget)
    seqs = []
    for i in range(num_requests):
        streams = [Sequence([1, 2, 3], SamplingParams(), max_tokens=4) for _ in range(width)]
        sched.add_group(SequenceGroup(f"request-{i}", streams[:1], width=width,
                                      pending_forks=streams[1:]))
        seqs += streams
    for _ in range(100):
        if not sched.has_unfinished:
            break
        _step(sched)
    assert [s.num_output_tokens for s in seqs] == [4] * len(seqs)


# ---- the options ------------------------------------------------------------------------
_ARCH = SimpleNamespace(max_position_embeddings=8192, sliding_window=None, num_experts=0,
                        fused_checkpoint=False, rope_scaling=None)


def test_defaults_turn_it_on_with_vllms_threshold():
    config = EngineConfig()
    sched = config.scheduler_config(config.resolve(_ARCH, CpuPlatform))
    assert (sched.max_num_partial_prefills, sched.max_long_partial_prefills,
            sched.long_prefill_token_threshold) == (4, 1, 327)  # 4% of the context
    explicit = EngineConfig(long_prefill_token_threshold=0, max_num_partial_prefills=2)
    sched = explicit.scheduler_config(explicit.resolve(_ARCH, CpuPlatform))
    assert (sched.max_num_partial_prefills, sched.long_prefill_token_threshold) == (2, 0)


def test_without_chunked_prefill_prefills_do_not_share_a_step():
    """A whole prompt or nothing: the budget is not split (it would fit no prompt)."""
    sched = _scheduler(budget=8, chunked=False)
    a = _add(sched, 8)
    _add(sched, 8)  # a second whole prompt, which must wait
    assert list(_step(sched)) == [a]
    assert list(_step(sched)) == [a]  # b needs all 8 tokens, and a's decode takes one


@pytest.mark.parametrize("kwargs, flag", [
    ({"max_num_partial_prefills": 0}, "--max-num-partial-prefills"),
    ({"max_long_partial_prefills": 0}, "--max-long-partial-prefills"),
    ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3},
     "--max-long-partial-prefills"),
    ({"long_prefill_token_threshold": -1}, "--long-prefill-token-threshold"),
])
def test_bad_values_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=f"^{flag} "):
        EngineConfig(**kwargs)


def test_threshold_above_the_context_length_is_rejected():
    with pytest.raises(ConfigError, match="^--long-prefill-token-threshold 9000 exceeds"):
        EngineConfig(long_prefill_token_threshold=9000).resolve(_ARCH, CpuPlatform)


def test_prompts_sharing_a_prefix_take_it_from_the_cache_while_others_start_at_once():
    """A burst of prompts behind one system prompt: the first computes the shared blocks,
    the others start once those are cached (not all computing them side by side), and an
    unrelated short prompt is not held back by either."""
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=BUDGET, max_model_len=1024,
                          enable_chunked_prefill=True, preemption_mode="auto", watermark=0.0,
                          max_num_partial_prefills=4, max_long_partial_prefills=1,
                          long_prefill_token_threshold=0)  # none is long: not why they wait
    sched = Scheduler(cfg, KVCacheManager(1024, BLOCK, enable_caching=True))
    system = list(range(100, 196))  # 96 tokens: 24 blocks, a step and a half of budget
    shared = [Sequence(system + [i, i + 1], SamplingParams(), max_tokens=1) for i in (1, 3, 5)]
    for seq in shared:
        sched.add_group(SequenceGroup(f"shared-{seq.prompt_token_ids[-1]}", [seq]))
    other = _add(sched, 6, max_tokens=1)
    first = _step(sched)
    assert other in first and shared[0] in first
    assert shared[1] not in first and shared[2] not in first
    while shared[0].num_computed_tokens < len(system):
        _step(sched)
    for _ in range(3):
        _step(sched)
    assert all(s.num_output_tokens == 1 for s in shared)
    # Each follower took the system prompt's blocks from the cache.
    assert [s.num_cached_tokens for s in shared[1:]] == [len(system)] * 2
