"""Async scheduling on the CPU (forced on): the engine schedules step N+1 before it has applied
step N's tokens, taking in-flight inputs from the device. Every output must equal a run one step
at a time, stops found a step late must drop the extra token, and the pools must come back full.
"""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from tests.kv_checks import assert_pools_full, run_checked
from tests.tiny_models import make_llm, random_prompts


def _llm(folder, async_scheduling: bool, **kwargs) -> LLM:
    llm = make_llm(folder, async_scheduling=async_scheduling, **kwargs)
    assert llm.engine.resolved.async_scheduling is async_scheduling
    return llm


class StepLog:
    """Runs an engine to completion, checking the pools after every step and recording
    whether each schedule ran ahead of the host (``schedule_pending``)."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.ran_ahead: list[bool] = []
        schedule = self.engine.scheduler.schedule

        def logged(schedule_pending: bool = False, **kwargs):
            self.ran_ahead.append(schedule_pending)
            return schedule(schedule_pending=schedule_pending, **kwargs)

        self.engine.scheduler.schedule = logged

    def run(self, prompts, params_list) -> list:
        return run_checked(self.engine, prompts, params_list)


def _summary(outputs) -> list:
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs]
            for o in outputs]


def _assert_same(got, expected) -> None:
    """Equal tokens and text; equal cumulative logprobs (where a request asked for
    logprobs) up to float32 rounding (a sequence recomputed after preemption sums logits of
    other batch shapes)."""
    assert _summary(got) == _summary(expected)
    for o, e in zip(got, expected, strict=True):
        for ours, ref in zip(o.outputs, e.outputs, strict=True):
            if ref.cumulative_logprob is None:
                assert ours.cumulative_logprob is None
            else:
                assert ours.cumulative_logprob == pytest.approx(ref.cumulative_logprob,
                                                                rel=1e-6)


def _compare(folder, prompts, params_list, **kwargs) -> StepLog:
    expected = StepLog(_llm(folder, False, **kwargs)).run(prompts, params_list)
    log = StepLog(_llm(folder, True, **kwargs))
    got = log.run(prompts, params_list)
    _assert_same(got, expected)
    return log


def _stop_tokens(folder, prompts, steps: int) -> list[int]:
    """Tokens each prompt's greedy continuation reaches at a different step, to stop on."""
    probe = _llm(folder, False).generate(
        prompts, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True),
        use_tqdm=False)
    return [o.outputs[0].token_ids[i % steps] for i, o in enumerate(probe)]


def test_stops_found_a_step_late_drop_the_extra_token(llama3_folder):
    prompts = random_prompts(0, (5, 17, 33, 2, 60, 9))
    stops = _stop_tokens(llama3_folder, prompts, 12)
    params = [SamplingParams(max_tokens=m, temperature=0.0, stop_token_ids=[stops[i]],
                             logprobs=2)
              for i, m in enumerate((12, 3, 20, 1, 12, 7))]
    log = _compare(llama3_folder, prompts, params)
    assert all(log.ran_ahead)
    assert {c.finish_reason for o in log.run(prompts, params) for c in o.outputs} == {
        "stop", "length"}


def test_chunked_prefill_and_prefix_cache_ahead(llama3_folder):
    shared = random_prompts(1, (70,))[0]
    prompts = [shared + p for p in random_prompts(2, (3, 40, 90))] + random_prompts(3, (130,))
    # Two of four ask for logprobs: their cumulative logprobs are compared too.
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                             logprobs=0 if n % 2 else None) for n in (9, 4, 15, 6)]
    _compare(llama3_folder, prompts, params, max_num_batched_tokens=32)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_tokens_in_flight(llama3_folder, mode):
    prompts = random_prompts(4, (30, 45, 20, 50, 38))
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                             logprobs=0)] * len(prompts)
    reference = _llm(llama3_folder, False).generate(prompts, params, use_tqdm=False)
    log = StepLog(_llm(llama3_folder, True, num_blocks=14, preemption_mode=mode))
    got = log.run(prompts, params)
    _assert_same(got, reference)
    assert log.engine.scheduler.num_preemptions > 0


def test_seeded_parallel_sampling_ahead(llama3_folder):
    prompts = random_prompts(5, (12, 25))
    params = [SamplingParams(n=3, max_tokens=10, temperature=0.9, top_p=0.9, seed=7,
                             logprobs=0),
              SamplingParams(n=2, best_of=3, max_tokens=8, temperature=1.0, seed=3)]
    _compare(llama3_folder, prompts, params)


def test_requests_needing_the_host_history_switch_to_synchronous_steps(llama3_folder):
    prompts = random_prompts(6, (10, 14, 20))
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3,
                             min_tokens=4),
              SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=2)]
    log = _compare(llama3_folder, prompts, params)
    assert not any(log.ran_ahead[:6])  # the penalised request holds the engine in step
    assert log.ran_ahead[-1]  # ... and once it is done the engine runs ahead again


def test_abort_with_a_step_in_flight_frees_everything_and_ids_can_return(llama3_folder):
    llm = _llm(llama3_folder, True)
    engine = llm.engine
    first, second, other = random_prompts(7, (20, 11, 9))
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine.add_request(other, greedy, request_id="other")
    engine.add_request(first, greedy, request_id="a")
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    engine.abort_request("a")
    # The same id again, while the aborted stream's step is still in flight.
    engine.add_request(second, greedy, request_id="a")
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    expected = _llm(llama3_folder, False).generate([second, other], greedy, use_tqdm=False)
    assert outputs["a"].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert outputs["other"].outputs[0].token_ids == expected[1].outputs[0].token_ids
    assert_pools_full(engine.kv)
    engine.add_request(first, greedy, request_id="b")
    engine.step()
    engine.abort_request("b")
    assert engine._in_flight is None and not engine.has_unfinished_requests()
    assert_pools_full(engine.kv)
