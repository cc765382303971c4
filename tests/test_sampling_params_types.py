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
