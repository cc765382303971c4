"""A grammar that waits for the reasoning (``StructuredOutputsParams.reasoning_*``), on the
default model. The end tag is two tokens the greedy model emits anyway, so the output up to it
is the unconstrained one, token for token, and the text after it matches the grammar: one
step at a time, running ahead (async scheduling) and with n-gram drafts (where the tag may
arrive inside a verified draft run)."""

from __future__ import annotations

import re

import pytest

from pagedserve import SamplingParams, StructuredOutputsParams
from tests.engine.test_structured_output import DATE
from tests.tiny_models import make_llm

PROMPT = "Write a poem about the sea."
NEW_TOKENS = 40


@pytest.fixture(scope="module", params=["sync", "async", "ngram"])
def llm(request, default_llm, default_model_folder):
    if request.param == "sync":
        return default_llm
    options = ({"async_scheduling": True} if request.param == "async" else
               {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}})
    return make_llm(default_model_folder, kv_cache_memory_bytes=64 << 20,
                    quantization="none", **options)


def _greedy(llm, structured=None):
    """Ignoring EOS: the model ends this prompt at once (the grammar still ends the output,
    with the stop token it accepts)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            structured_outputs=structured)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


def _end_tag(tokens: list[int], first: int) -> int:
    """Where a two-token tag taken from ``tokens`` at ``first`` or later ends, it being the
    first place ``tokens[first:]`` ends with it."""
    for k in range(first + 3, len(tokens) - 10):
        pair = tokens[k:k + 2]
        if all(tokens[j:j + 2] != pair for j in range(first, k)):
            return k + 2
    raise AssertionError(f"no usable tag in {tokens}")


def _check(llm, free: list[int], out, reasoned: int) -> None:
    """The first ``reasoned`` tokens are the free output's; the rest match DATE."""
    assert out.token_ids[:reasoned] == free[:reasoned]
    answer = llm.get_tokenizer().decode(out.token_ids[reasoned:], skip_special_tokens=True)
    assert re.fullmatch(DATE, answer), answer
    assert out.finish_reason == "stop"


def test_grammar_applies_once_the_output_ends_with_the_end_ids(llm):
    free = _greedy(llm).token_ids
    end = _end_tag(free, 0)
    out = _greedy(llm, StructuredOutputsParams(regex=DATE,
                                               reasoning_end_token_ids=free[end - 2:end]))
    _check(llm, free, out, end)


def test_grammar_waits_only_for_an_output_that_opens_with_the_start_id(llm):
    free = _greedy(llm).token_ids
    end = _end_tag(free, 1)
    out = _greedy(llm, StructuredOutputsParams(regex=DATE, reasoning_start_token_id=free[0],
                                               reasoning_end_token_ids=free[end - 2:end]))
    _check(llm, free, out, end)
    # An output that does not open with the start id is constrained from its first token.
    plain = _greedy(llm, StructuredOutputsParams(regex=DATE))
    never = len(llm.get_tokenizer()) - 1
    assert never not in plain.token_ids
    out = _greedy(llm, StructuredOutputsParams(regex=DATE, reasoning_start_token_id=never,
                                               reasoning_end_token_ids=free[end - 2:end]))
    assert out.token_ids == plain.token_ids
    _check(llm, free, out, 0)


def test_reasoning_ids_are_checked():
    with pytest.raises(ValueError, match="reasoning_end_token_ids"):
        StructuredOutputsParams(regex=DATE, reasoning_end_token_ids=[])
    with pytest.raises(ValueError, match="reasoning_start_token_id"):
        StructuredOutputsParams(regex=DATE, reasoning_start_token_id=3)
