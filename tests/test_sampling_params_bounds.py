"""SamplingParams refuses numbers the engine cannot carry: integers past 64 bits (the engine
core's msgpack wire and its tensors hold int64) and floats that are not finite or that overflow
float32, where the sampler computes; and more stop strings than every step can search."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.sample.sampler import Sampler
from pagedserve.sampling_params import MAX_STOP_STRINGS, InvalidSamplingParam, SamplingParams
from tests.sample.reference_metadata import build_metadata

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _refused(param: str, **kwargs) -> str:
    with pytest.raises(InvalidSamplingParam) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    return str(err.value)


@pytest.mark.parametrize("name", ["n", "best_of", "top_k", "max_tokens", "min_tokens", "seed"])
@pytest.mark.parametrize("value", [2**63, 2**64])
def test_integers_past_64_bits_are_refused(name, value):
    kwargs = {name: value}
    if name == "min_tokens":
        kwargs["max_tokens"] = None  # the case that had no bound at all
    assert str(value) in _refused(name, **kwargs)


def test_64_bit_extremes_are_accepted():
    SamplingParams(top_k=2**63 - 1, min_tokens=2**63 - 1, max_tokens=None, seed=2**63 - 1)
    SamplingParams(seed=-(2**63), max_tokens=2**63 - 1)
    _refused("seed", seed=-(2**63) - 1)


@pytest.mark.parametrize("value", [1e308, 3.5e38, math.inf, math.nan])
def test_temperature_beyond_float32_is_refused(value):
    assert "temperature" in _refused("temperature", temperature=value)


@pytest.mark.parametrize("name", ["top_p", "min_p", "presence_penalty", "frequency_penalty",
                                  "repetition_penalty", "length_penalty"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_floats_are_refused(name, value):
    _refused(name, **{name: value})


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_non_finite_logit_bias_is_refused(value):
    _refused("logit_bias", logit_bias={1: value})


def test_the_largest_temperature_samples_from_the_unmasked_tokens():
    """float32's maximum divides a masked (-inf) logit into -inf and the others into ~0: the
    row samples uniformly among the allowed tokens, with finite logprobs. 1e308 became inf in
    float32, and -inf / inf is NaN."""
    vocab = 8
    logits = torch.tensor([[3.0, -math.inf, 1.0, -math.inf, 0.5, -math.inf, 2.0, -math.inf]])
    params = [SamplingParams(temperature=FLOAT32_MAX, seed=0, logprobs=2)]
    generators = [torch.Generator().manual_seed(0)]
    meta = build_metadata(params, [[]], [[]], generators, vocab, torch.device("cpu"),
                                  [])
    out = Sampler()(logits, meta)
    assert out.token_ids[:, 0].tolist()[0] in (0, 2, 4, 6)
    assert torch.isfinite(out.logprobs).all()


def test_stop_strings_are_bounded():
    """Each is searched after every token in the loop all requests share."""
    assert len(SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]).stop) == 64
    assert "at most 64 stop strings, got 65" in _refused(
        "stop", stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
