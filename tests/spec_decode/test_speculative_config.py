"""``speculative_config`` takes vLLM's fields from the Python API's dict and the command line's
JSON; bad combinations are one-line errors naming the field."""

from __future__ import annotations

import argparse

import pytest

from pagedserve import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.engine_args import add_engine_args, config_from_args
from pagedserve.errors import ConfigError
from pagedserve.sampling_params import InvalidSamplingParam
from pagedserve.spec_decode.config import SpeculativeConfig
from tests.tiny_models import make_llm


def test_the_dict_and_the_json_give_one_config():
    from_dict = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                 "prompt_lookup_max": 4})
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3, '
                              '"prompt_lookup_max": 4}'])
    from_cli = config_from_args(args)
    expected = SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=4)
    assert from_dict.speculative_config == from_cli.speculative_config == expected


# "~user/..." of a user this host lacks: Path.expanduser's RuntimeError was a traceback.
@pytest.mark.parametrize("fields, method", [({"model": "[ngram]"}, "ngram"),
                                            ({"model": "org/draft-1b"}, "draft_model"),
                                            ({"model": "~nosuchuser-ps/d"}, "draft_model")])
def test_the_method_is_inferred_from_the_model_as_vllm_does(fields, method):
    config = SpeculativeConfig.parse({**fields, "num_speculative_tokens": 2})
    assert config.method == method


def test_ngram_lookup_bounds_default_and_fill_each_other():
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}) \
        .prompt_lookup_min == 2
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                   "prompt_lookup_min": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram"', "not valid JSON"),
    ('[1, 2]', "must be a JSON object"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 2, "spec_tokens": 1}, "unknown field"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
    ({"num_speculative_tokens": 2}, "give method"),
    ({"model": "org/draft", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size 2 is not built"),
    # Values of the wrong type: TypeErrors naming nothing, or accepted (a float bound, a
    # number as the draft's path).
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "2"}',
     "prompt_lookup_min must be an integer, got '2'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2.5},
     "prompt_lookup_max must be an integer, got 2.5"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an "
                                                          "integer, got True"),
    ({"model": 5, "num_speculative_tokens": 2}, "model must be a string, got 5"),
    ({"method": "draft_model", "model": 5, "num_speculative_tokens": 2},
     "model must be a string, got 5"),
    ({"method": 1, "num_speculative_tokens": 2}, "method must be a string, got 1"),
    ({1: 2, "method": "ngram", "num_speculative_tokens": 2}, "unknown field"),
])
def test_bad_settings_are_one_line_errors_naming_the_field(value, message):
    with pytest.raises(ConfigError, match=message) as error:
        EngineConfig(speculative_config=value)
    assert "--speculative-config" in str(error.value) and "\n" not in str(error.value)


def test_speculation_refuses_beam_search(llama3_folder):
    llm = make_llm(llama3_folder, speculative_config={"method": "ngram",
                                                      "num_speculative_tokens": 2})
    with pytest.raises(InvalidSamplingParam, match="beam search"):
        llm.engine.add_request([5, 6, 7], SamplingParams(use_beam_search=True, n=2,
                                                          max_tokens=4))
