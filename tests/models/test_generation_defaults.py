"""``--generation-config``: the sampling defaults of a model's generation_config.json (the keys
vLLM reads, transformers' top_k 0 as no top-k, unusable values left out), none under ``vllm``,
another folder's by path; ``LLM.generate`` without sampling params samples with them."""

from __future__ import annotations

import json

import pytest

from pagedserve import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.errors import ConfigError
from pagedserve.models.generation_defaults import sampling_defaults
from tests.tiny_models import make_llm, random_prompts

SHIPPED = {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "min_p": 0.05,
           "repetition_penalty": 1.1, "max_new_tokens": 512, "do_sample": True,
           "bos_token_id": 0, "eos_token_id": [1, 2]}


def _folder(tmp_path, name, content):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(
        content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return folder


def test_the_shipped_defaults_are_read(tmp_path):
    model = _folder(tmp_path, "model", SHIPPED)
    assert sampling_defaults("auto", model) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": -1, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_tokens": 512}
    assert sampling_defaults("vllm", model) == {}
    other = _folder(tmp_path, "other", {"temperature": 0.2})
    assert sampling_defaults(str(other), model) == {"temperature": 0.2}
    assert sampling_defaults("auto", tmp_path) == {}  # no file: the API's defaults


@pytest.mark.parametrize("key, value", [
    ("temperature", "hot"), ("temperature", -1.0), ("temperature", True), ("top_p", 3.0),
    ("top_k", 2.5), ("top_k", -7), ("max_new_tokens", 0), ("min_p", float("nan")),
    ("repetition_penalty", 0.0),
])
def test_an_unusable_value_is_left_out_and_the_rest_kept(tmp_path, key, value):
    model = _folder(tmp_path, "model", json.dumps({key: value, "top_p": 0.5}
                                                  if key != "top_p" else {key: value}))
    assert sampling_defaults("auto", model) == ({} if key == "top_p" else {"top_p": 0.5})


def test_an_unreadable_file_keeps_the_api_defaults(tmp_path):
    assert sampling_defaults("auto", _folder(tmp_path, "bad", "{not json")) == {}
    assert sampling_defaults("auto", _folder(tmp_path, "list", "[1, 2]")) == {}


def test_overrides_go_over_the_file_or_stand_alone(tmp_path):
    model = _folder(tmp_path, "model", SHIPPED)
    overrides = {"temperature": 0.3, "max_new_tokens": 7, "top_k": 0}
    assert sampling_defaults("auto", model, overrides) == {
        "temperature": 0.3, "top_p": 0.9, "top_k": -1, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_tokens": 7}
    assert sampling_defaults("vllm", model, overrides) == {
        "temperature": 0.3, "top_k": -1, "max_tokens": 7}


@pytest.mark.parametrize("overrides, says", [
    ({"temp": 0.5}, "'temp' is not one of temperature, top_p"),
    ({"do_sample": True}, "'do_sample' is not one of"),
    ({"temperature": -1.0}, "temperature -1.0 is not a usable sampling default"),
    ({"max_new_tokens": 0}, "max_new_tokens 0 is not a usable"),
    ({"top_p": "high"}, "top_p 'high' is not a usable"),
    ("[1]", "must be a JSON object"),
    ("{temperature: 1}", "not JSON"),
])
def test_an_override_unusable_as_a_default_fails_at_start(overrides, says):
    """Unlike a model's file, the user's own words: refused, not left out."""
    with pytest.raises(ConfigError, match=f"^--override-generation-config.*{says}"):
        EngineConfig(model="m", override_generation_config=overrides)


def test_a_setting_that_names_nothing_fails_at_start(tmp_path):
    with pytest.raises(ConfigError, match="^--generation-config: .* is neither auto, vllm nor "
                                          "a folder holding a generation_config.json"):
        EngineConfig(model="m", generation_config=str(tmp_path))


def test_llm_generate_without_params_samples_with_the_model_defaults(tmp_path, llama3_folder):
    """Greedy and 5 tokens from the file: the same tokens as asking for them; under vllm the
    API's defaults (16 tokens)."""
    defaults = _folder(tmp_path, "gen", {"temperature": 0.0, "max_new_tokens": 5})
    prompt = random_prompts("generation-defaults", [9])
    llm = make_llm(llama3_folder, generation_config=str(defaults))
    assert llm.get_default_sampling_params().max_tokens == 5
    got = llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids
    asked = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert got == asked and len(got) == 5
    plain = make_llm(llama3_folder, generation_config="vllm")
    assert plain.get_default_sampling_params().max_tokens == 16
    assert plain.get_default_sampling_params().temperature == 1.0
    overridden = make_llm(llama3_folder, generation_config=str(defaults),
                          override_generation_config='{"max_new_tokens": 3}')
    assert overridden.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids == got[:3]
