"""SamplingParams refuses values of the wrong type with an ``InvalidSamplingParam`` that names
the parameter and the type it needs, where a comparison would have raised a TypeError that
names neither, or a float count would have gone on to the sampler."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.sampling_params import InvalidSamplingParam, SamplingParams


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": "5"}, "max_tokens must be an integer, got '5' (str)"),
    ({"max_tokens": 5.0}, "max_tokens must be an integer, got 5.0 (float)"),
    ({"n": True}, "n must be an integer, got True (bool)"),
    ({"seed": "1"}, "seed must be an integer, got '1' (str)"),
    ({"logprobs": 1.5}, "logprobs must be an integer, got 1.5 (float)"),
    ({"temperature": "0.5"}, "temperature must be a number, got '0.5' (str)"),
    ({"top_p": False}, "top_p must be a number, got False (bool)"),
    ({"ignore_eos": 1}, "ignore_eos must be a boolean, got 1 (int)"),
    ({"output_kind": 1}, "output_kind must be a string, got 1 (int)"),
])
def test_a_value_of_the_wrong_type_is_refused_by_name(kwargs, message):
    with pytest.raises(InvalidSamplingParam) as err:
        SamplingParams(**kwargs)
    assert err.value.param == next(iter(kwargs))
    assert str(err.value) == message


def test_numbers_of_any_kind_of_their_type_are_accepted():
    """Ints where floats go, and numpy's scalars (a caller's arrays), are numbers as well."""
    params = SamplingParams(temperature=1, top_p=np.float32(0.5), max_tokens=np.int64(5),
                            top_k=np.int32(3), seed=None, logprobs=None)
    assert params.max_tokens == 5 and params.top_k == 3


@pytest.mark.parametrize(("kwargs", "param", "message"), [
    ({"stop": 123}, "stop", "stop must be a string or a list of strings, got 123"),
    ({"stop": [1]}, "stop", "stop must be a string or a list of strings, got [1]"),
    ({"stop": [b"x"]}, "stop", "stop must be a string or a list of strings, got [b'x']"),
    ({"stop_token_ids": 5}, "stop_token_ids", "stop_token_ids must be a list of integers, got 5"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids", "stop_token_ids must be a list of integers"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids", "stop_token_ids must be a list of integers"),
    ({"logit_bias": [1]}, "logit_bias", "logit_bias must be a dict of token ids to numbers"),
    ({"logit_bias": {"a": 1}}, "logit_bias", "logit_bias key 'a' is not a token id"),
    ({"logit_bias": {1.7: 1}}, "logit_bias", "logit_bias key 1.7 is not a token id"),
    ({"logit_bias": {"1" * 5000: 1}}, "logit_bias", "logit_bias key '1111"),
    ({"logit_bias": {True: 1}}, "logit_bias", "logit_bias key True is not a token id"),
    ({"logit_bias": {1: "x"}}, "logit_bias", "logit_bias value 'x' of token 1 is not a number"),
    ({"structured_outputs": 5}, "structured_outputs", "structured_outputs must be "
                                                      "StructuredOutputsParams or a dict"),
    ({"structured_outputs": {"foo": 1}}, "structured_outputs",
     "structured_outputs has no field foo"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs",
     "structured_outputs regex must be a string, got 5"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs",
     "structured_outputs choice must be a list of strings, got 'ab'"),
    ({"structured_outputs": {"choice": [1, 2]}}, "structured_outputs",
     "structured_outputs choice must be a list of strings"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs",
     "structured_outputs json_object must be a boolean"),
])
def test_lists_and_dicts_of_the_wrong_form_are_refused_by_name(kwargs, param, message):
    """Each failed with a TypeError, ValueError or AttributeError that named nothing (some
    only once the request reached the detokenizer or the grammar compiler), or was read as
    something else: a float stop token id, 1.7 as token 1, a string as a list of choices."""
    with pytest.raises(InvalidSamplingParam) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    assert str(err.value).startswith(message)


def test_lists_and_dicts_in_their_other_forms_are_accepted():
    params = SamplingParams(stop=("a", "b"), stop_token_ids=(np.int64(3),),
                            logit_bias={"5": 1, np.int32(6): np.float32(-2)},
                            structured_outputs={"choice": ("yes", "no")})
    assert params.stop == ["a", "b"] and params.stop_token_ids == [3]
    assert params.logit_bias == {5: 1.0, 6: -2.0}
    assert params.structured_outputs.choice == ("yes", "no")
    assert SamplingParams(stop="x", stop_token_ids=None).stop == ["x"]


@pytest.mark.parametrize("param", ["logprobs", "prompt_logprobs"])
def test_beam_search_refuses_logprobs(param):
    """Beams kept no per-token logprobs (logprobs came back None), and prompt_logprobs failed
    the engine step of the whole batch with an AttributeError."""
    with pytest.raises(InvalidSamplingParam, match="beam search") as err:
        SamplingParams(use_beam_search=True, n=2, best_of=2, temperature=0, **{param: 1})
    assert err.value.param == param


def test_stop_strings_need_detokenize():
    """Stop strings are searched for in the text, which ``detokenize=False`` does not make: the
    output ran past them to max_tokens. vLLM refuses the pair too."""
    with pytest.raises(InvalidSamplingParam, match="stop strings need detokenize=True") as err:
        SamplingParams(stop=["x"], detokenize=False)
    assert err.value.param == "stop"
    assert SamplingParams(stop_token_ids=[5], detokenize=False).stop_token_ids == [5]
