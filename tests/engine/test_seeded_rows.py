"""A seeded request through the engine: its generator lives in rank 0's sampling batch for the
request's whole life, so its tokens do not depend on the requests that come, go and preempt it
around it."""

from __future__ import annotations

import pytest

from pagedserve import SamplingParams
from pagedserve.worker.sampling_batch import SamplingBatch
from tests.kv_checks import assert_pools_full, check_pools
from tests.tiny_models import make_llm, random_prompts

TARGET = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=123, ignore_eos=True)


def _crowd(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=12 + 8 * (i % 4), temperature=0.8, seed=i,
                          ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_seeded_request_samples_the_same_tokens_alone_or_in_a_changing_crowd(
        llama3_folder, async_scheduling):
    prompts = random_prompts(9, [30] + [24] * 8)
    alone = make_llm(llama3_folder).generate(prompts[:1], [TARGET], use_tqdm=False)
    llm = make_llm(llama3_folder, num_blocks=10, preemption_mode="swap", swap_space=0.001,
                   async_scheduling=async_scheduling)
    engine = llm.engine
    target_id = engine.add_request(prompts[0], TARGET)
    target_seq = engine.outputs.requests[target_id].seqs[0].seq
    # A batch of one row to start with: it grows, and takes back finished rows for newcomers.
    runner = engine.executor.runner
    batch = runner.sampling = SamplingBatch(runner.arch.vocab_size, runner.device, capacity=1)
    generators, done, step = [], {}, 0
    while engine.has_unfinished_requests():
        if step < 8:  # requests keep arriving while others finish
            engine.add_request(prompts[1 + step], _crowd(step))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if target_seq in batch.rows and not target_seq.status.finished:
            generators.append(batch.generators[batch.rows[target_seq]])
        check_pools(engine.kv)
        step += 1
    assert_pools_full(engine.kv)
    assert engine.stats().num_preemptions > 0
    assert done[target_id].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert generators and all(g is generators[0] for g in generators)  # never made anew
