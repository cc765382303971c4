"""Request priorities through the engine: a preempted low-priority request resumes and ends with
the tokens of an uninterrupted run; fcfs refuses a priority and keeps serving."""

from __future__ import annotations

import pytest

from pagedserve import SamplingParams
from tests.kv_checks import assert_pools_full, check_pools
from tests.tiny_models import make_llm

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LOW_PROMPT = [(7 * i) % 90 + 5 for i in range(16)]  # one block of 16
HIGH_PROMPT = [(11 * i) % 90 + 5 for i in range(40)]  # three blocks


@pytest.fixture(scope="module")
def reference(llama3_folder):
    """Each prompt alone on an fcfs engine: no preemption."""
    llm = make_llm(llama3_folder, num_blocks=16)
    outs = llm.generate([LOW_PROMPT, HIGH_PROMPT], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("options", [
    {}, {"async_scheduling": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
], ids=["sync", "async", "ngram"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_request_resumes_with_the_tokens_of_an_uninterrupted_run(
        llama3_folder, reference, mode, options):
    """Four blocks: the low-priority request holds two when the urgent one arrives needing
    three, so it is preempted for it, and again whenever they both grow."""
    llm = make_llm(llama3_folder, num_blocks=4, scheduling_policy="priority",
                   preemption_mode=mode, swap_space=0.001, **options)
    engine = llm.engine
    low = engine.add_request(LOW_PROMPT, GREEDY, priority=5)
    done = {}
    while engine.kv.pool.num_free > 2:
        for out in engine.step():
            assert not out.finished
    high = engine.add_request(HIGH_PROMPT, GREEDY, priority=-1)
    finished_order = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
                finished_order.append(out.request_id)
        check_pools(engine.kv)
    assert_pools_full(engine.kv)
    assert engine.scheduler.num_preemptions > 0
    assert finished_order == [high, low]
    assert [done[low], done[high]] == reference


def test_generate_takes_a_priority_per_prompt(llama3_folder, reference):
    """One request slot: the prompts run one after the other, most urgent first."""
    llm = make_llm(llama3_folder, num_blocks=16, scheduling_policy="priority", max_num_seqs=1)
    outs = llm.generate([LOW_PROMPT, HIGH_PROMPT], GREEDY, use_tqdm=False, priority=[3, -3])
    assert [o.outputs[0].token_ids for o in outs] == reference
    low, high = (o.metrics for o in outs)
    assert high.first_token_time < low.first_token_time
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate([LOW_PROMPT, HIGH_PROMPT], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(TypeError, match="priority"):
        llm.generate([LOW_PROMPT], GREEDY, use_tqdm=False, priority=["1"])


def test_fcfs_refuses_a_priority_and_keeps_serving(llama3_folder, reference):
    llm = make_llm(llama3_folder, num_blocks=16)
    engine = llm.engine
    with pytest.raises(ValueError, match="--scheduling-policy priority") as err:
        engine.add_request(LOW_PROMPT, GREEDY, priority=1)
    assert err.value.param == "priority"
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        llm.generate([LOW_PROMPT, HIGH_PROMPT], GREEDY, use_tqdm=False, priority=[0, -1])
    assert not engine.has_unfinished_requests()
    assert_pools_full(engine.kv)
    outs = llm.generate([LOW_PROMPT], GREEDY, use_tqdm=False, priority=[0])
    assert outs[0].outputs[0].token_ids == reference[0]


@pytest.mark.parametrize("priority", [True, 1.5, 2**63])
def test_a_priority_that_is_not_a_64_bit_int_is_refused(llama3_folder, priority):
    llm = make_llm(llama3_folder, num_blocks=16, scheduling_policy="priority")
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.engine.add_request(LOW_PROMPT, GREEDY, priority=priority)
