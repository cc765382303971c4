"""Architecture name -> model class, imported on demand."""

from __future__ import annotations

import importlib

from pagedserve.models.config import UnsupportedModel

_MODELS = {
    "LlamaForCausalLM": "pagedserve.models.llama:LlamaForCausalLM",
    # Mistral, Qwen2, Qwen3, Phi-3 and Granite share Llama's layout; their differences live
    # in ModelArchConfig.
    "MistralForCausalLM": "pagedserve.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pagedserve.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "pagedserve.models.llama:LlamaForCausalLM",
    "Phi3ForCausalLM": "pagedserve.models.llama:LlamaForCausalLM",
    "GraniteForCausalLM": "pagedserve.models.llama:LlamaForCausalLM",
    # Mixture of experts on the same attention: the config picks each layer's MLP.
    "MixtralForCausalLM": "pagedserve.models.llama:LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "pagedserve.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "pagedserve.models.llama:LlamaForCausalLM",
    # Llama's attention and loading, Gemma's norms, MLP, embedding scale and windows.
    "Gemma2ForCausalLM": "pagedserve.models.gemma:GemmaForCausalLM",
    "Gemma3ForCausalLM": "pagedserve.models.gemma:GemmaForCausalLM",
}


def model_class(architecture: str):
    if architecture not in _MODELS:
        raise UnsupportedModel(f"unsupported architecture {architecture!r}; "
                               f"supported: {', '.join(_MODELS)}")
    module, cls = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), cls)
