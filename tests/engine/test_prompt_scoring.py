"""``max_tokens=0``: the engine computes the prompt (and its logprobs) and generates nothing,
which is how evaluation harnesses score text; and the count of generated tokens that usage
reports, discarded best_of streams included."""

from __future__ import annotations

import pytest

from pagedserve import LLM, BeamSearchParams, SamplingParams
from tests.kv_checks import assert_pools_full
from tests.tiny_models import write_tiny_model

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 8], [9, 10], list(range(20, 60))]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama3"), "llama3")


@pytest.fixture(scope="module", params=[False, True], ids=["step-by-step", "ahead"])
def llm(llama, request):
    # A small budget chunks the long prompt, so scoring spans several steps.
    return LLM(model=str(llama), device="cpu", kv_cache_memory_bytes=2 << 20,
               max_num_batched_tokens=16, async_scheduling=request.param)


def test_max_tokens_0_gives_prompt_logprobs_and_no_tokens(llm):
    reference = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=3,
                                                     temperature=0), use_tqdm=False)
    scored = llm.generate(PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=3),
                          use_tqdm=False)
    for got, want in zip(scored, reference, strict=True):
        out = got.outputs[0]
        assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
        assert got.metrics.num_generated_tokens == 0
        assert len(got.prompt_logprobs) == len(got.prompt_token_ids)
        assert got.prompt_logprobs == want.prompt_logprobs
    assert_pools_full(llm.engine.kv)


def test_max_tokens_0_without_logprobs_and_with_n(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=0, n=3, temperature=1.0, seed=1),
                        use_tqdm=False)
    for out in outs:
        assert [(o.token_ids, o.finish_reason) for o in out.outputs] == [([], "length")] * 3
    assert_pools_full(llm.engine.kv)


def test_generated_tokens_count_every_stream(llm):
    params = SamplingParams(n=2, best_of=5, max_tokens=6, temperature=1.0, seed=3,
                            ignore_eos=True)
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert len(out.outputs) == 2 and out.metrics.num_generated_tokens == 5 * 6
    beams = llm.generate(PROMPTS[:1], BeamSearchParams(3, 4, ignore_eos=True).to_sampling_params(),
                         use_tqdm=False)[0]
    assert beams.metrics.num_generated_tokens == 1 + 3 * 3  # the search starts from one beam
