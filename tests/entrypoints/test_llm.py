"""LLM(model, **options) takes exactly EngineConfig's fields."""

from __future__ import annotations

import pytest

from pagedserve.config import EngineConfig
from pagedserve.entrypoints import llm as llm_module


class _Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config


def test_options_become_the_engine_config(monkeypatch):
    monkeypatch.setattr(llm_module, "LLMEngine", _Engine)
    llm = llm_module.LLM("/models/x", device="cpu", dtype="float32", block_size=8,
                         max_num_seqs=4, enforce_eager=True)
    assert llm.engine.config == EngineConfig(model="/models/x", device="cpu", dtype="float32",
                                             block_size=8, max_num_seqs=4, enforce_eager=True)


def test_unknown_option_lists_the_valid_ones(monkeypatch):
    monkeypatch.setattr(llm_module, "LLMEngine", _Engine)
    with pytest.raises(TypeError, match="unknown option.*max_num_seq\\b.*valid options: "
                                        "model, revision, tokenizer, tokenizer_revision, gguf"):
        llm_module.LLM(max_num_seq=4)


def test_bad_option_value_is_a_config_error(monkeypatch):
    from pagedserve.config import ConfigError

    monkeypatch.setattr(llm_module, "LLMEngine", _Engine)
    with pytest.raises(ConfigError, match="--dtype"):
        llm_module.LLM(dtype="float64")
