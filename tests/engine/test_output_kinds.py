"""Output kinds: "delta" outputs, added up with ``RequestOutput.add_delta``, must equal the
"cumulative" outputs of the same run at every step, and "final_only" must equal the last."""

from __future__ import annotations

import copy
import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import InvalidSamplingParam
from tests.tiny_models import VOCAB, write_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("llama3"), "llama3")
    return LLM(model=str(folder), device="cpu", kv_cache_memory_bytes=4 << 20)


def _run(llm: LLM, prompts, params: SamplingParams) -> dict[str, list]:
    """Every output of every request, in the order the engine gave them."""
    engine, seen = llm.engine, {}
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(copy.deepcopy(out))
    return {i: seen[i] for i in ids}


def _fields(out) -> tuple:
    return (out.finished, out.prompt_logprobs, [
        (o.index, o.text, o.token_ids, o.logprobs, o.cumulative_logprob, o.finish_reason,
         o.stop_reason) for o in out.outputs])


@pytest.mark.parametrize("params", [
    SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, logprobs=2, stop=["a"]),
    SamplingParams(temperature=0.0, max_tokens=9, prompt_logprobs=1, logprobs=0),
])
def test_deltas_add_up_to_the_cumulative_outputs(llm, params):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 17, 30)]
    cumulative = _run(llm, prompts, params)
    deltas = _run(llm, prompts, SamplingParams(**{**vars(params), "output_kind": "delta"}))
    for cum_outs, delta_outs in zip(cumulative.values(), deltas.values(), strict=True):
        assert len(cum_outs) == len(delta_outs) > 1
        total = None
        for cum, delta in zip(cum_outs, delta_outs, strict=True):
            if total is None:
                total = delta
            else:
                # A delta holds only the new part: never the tokens of an earlier output.
                assert sum(len(o.token_ids) for o in delta.outputs) < sum(
                    len(o.token_ids) for o in cum.outputs)
                total.add_delta(delta)
            assert _fields(total) == _fields(cum)


def test_final_only_is_the_last_cumulative_output(llm):
    params = SamplingParams(n=3, best_of=4, temperature=1.0, seed=5, max_tokens=10, logprobs=1)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    cumulative = _run(llm, prompts, params)
    final = _run(llm, prompts, SamplingParams(**{**vars(params), "output_kind": "final_only"}))
    for cum_outs, final_outs in zip(cumulative.values(), final.values(), strict=True):
        assert len(final_outs) == 1
        assert _fields(final_outs[0]) == _fields(cum_outs[-1])


def test_delta_refuses_best_of_above_n():
    with pytest.raises(InvalidSamplingParam) as err:
        SamplingParams(n=1, best_of=2, output_kind="delta")
    assert err.value.param == "best_of"
