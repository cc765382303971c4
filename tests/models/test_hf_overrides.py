"""``--hf-overrides``: keys that replace config.json's before the engine reads it, on every rank
(vLLM's option). The reference is transformers on a copy of the checkpoint whose config.json
was edited the same way."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedserve.config import EngineConfig
from pagedserve.errors import ConfigError
from tests.tiny_models import make_llm, prompt_logprob_error, random_prompts


def _edited_copy(folder, tmp_path, **changes):
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | changes))
    return copy


def test_an_override_runs_the_model_its_edited_config_describes(llama3_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    rope = json.loads((llama3_folder / "config.json").read_text())["rope_parameters"]
    changes = {"rope_parameters": rope | {"rope_theta": 50.0}, "max_position_embeddings": 320}
    edited = AutoModelForCausalLM.from_pretrained(_edited_copy(llama3_folder, tmp_path, **changes))
    prompt = random_prompts("hf-overrides", [40])[0]
    llm = make_llm(llama3_folder, hf_overrides=changes)
    assert llm.engine.resolved.max_model_len == 320
    assert prompt_logprob_error(llm, edited.eval(), prompt) < 1e-4
    # The override is what made them agree: the checkpoint as it is runs another model.
    assert prompt_logprob_error(make_llm(llama3_folder), edited, prompt) > 1e-2


@pytest.mark.parametrize(("value", "says"), [
    ("[1, 2]", "--hf-overrides must be a JSON object"),
    ("{rope_theta: 5}", "--hf-overrides: not JSON"),
    (3, "--hf-overrides must be a JSON object"),
])
def test_an_override_that_is_no_object_fails_at_start(value, says):
    with pytest.raises(ConfigError, match=says):
        EngineConfig(model="m", hf_overrides=value)


def test_the_flag_and_a_models_config_entry_take_json(tmp_path):
    from pagedserve.cli import parse_args
    from pagedserve.engine_args import config_from_args
    from pagedserve.server.models_config import serve_configs

    args = parse_args(["serve", "m", "--hf-overrides", '{"rope_theta": 5.0}'])
    assert config_from_args(args).hf_overrides == {"rope_theta": 5.0}
    entries = tmp_path / "models.yaml"
    entries.write_text("models:\n  - model: a\n    hf_overrides: {rope_theta: 7.0}\n"
                       "  - model: b\n    hf_overrides: '{\"rope_theta\": 8.0}'\n")
    args = parse_args(["serve", "--models-config", str(entries)])
    assert [spec.config.hf_overrides for spec in serve_configs(args)] == [
        {"rope_theta": 7.0}, {"rope_theta": 8.0}]
