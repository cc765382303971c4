"""``SamplingParams.truncate_prompt_tokens`` (vLLM's): a request keeps only the last k tokens of
its prompt (-1: as many as the context window leaves room for), and runs exactly as the request
whose prompt was those tokens."""

from __future__ import annotations

import pytest

from pagedserve import SamplingParams
from pagedserve.sampling_params import InvalidSamplingParam
from tests.kv_checks import assert_pools_full
from tests.tiny_models import make_llm, random_prompts

PROMPT = random_prompts("truncate", [40])[0]


@pytest.fixture(scope="module")
def llm(llama3_folder):
    return make_llm(llama3_folder, max_model_len=64)


def _run(llm, prompt, **params):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2,
                            **params)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return out.prompt_token_ids, out.prompt_logprobs, out.outputs[0].token_ids


@pytest.mark.parametrize("k", [1, 7, 40, 100])
def test_the_last_k_prompt_tokens_run_as_that_prompt(llm, k):
    assert _run(llm, PROMPT, truncate_prompt_tokens=k) == _run(llm, PROMPT[-k:])
    assert_pools_full(llm.engine.kv)


def test_a_text_prompt_is_truncated_after_tokenizing_and_keeps_its_text(llm):
    text = llm.get_tokenizer().decode(PROMPT)
    ids = llm.get_tokenizer().encode(text)
    params = SamplingParams(max_tokens=3, temperature=0.0, truncate_prompt_tokens=5)
    out = llm.generate(text, params, use_tqdm=False)[0]
    assert out.prompt == text and out.prompt_token_ids == ids[-5:]
    assert out.outputs[0].token_ids == _run(llm, ids[-5:])[2][:3]


def test_minus_one_fits_a_prompt_longer_than_the_context(llm):
    """A prompt of 100 tokens is refused in a window of 64; -1 keeps the last 63 (one token
    of room to generate)."""
    long = random_prompts("truncate-long", [100])[0]
    with pytest.raises(InvalidSamplingParam, match="context length is 64"):
        _run(llm, long)
    prompt_ids, _, tokens = _run(llm, long, truncate_prompt_tokens=-1)
    assert prompt_ids == long[-63:] and len(tokens) == 1
    assert_pools_full(llm.engine.kv)


@pytest.mark.parametrize("value, message", [
    (0, "truncate_prompt_tokens must be -1 or at least 1, got 0"),
    (-2, "truncate_prompt_tokens must be -1 or at least 1, got -2"),
    (2.5, "truncate_prompt_tokens must be an integer"),
])
def test_bad_values_are_named(value, message):
    with pytest.raises(InvalidSamplingParam, match=message) as error:
        SamplingParams(truncate_prompt_tokens=value)
    assert error.value.param == "truncate_prompt_tokens"
