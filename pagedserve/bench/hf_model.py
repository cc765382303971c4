"""transformers' model of a checkpoint, the baseline and reference the benchmarks compare with."""

from __future__ import annotations

from typing import Any


def load_hf_model(source, dtype, device, random_weights: bool = False) -> Any:
    """transformers' model of ``source`` (a ``ModelSource``). A converted GGUF keeps block
    tensors transformers cannot read, so its weights come dequantized through pagedserve's
    reader (which tests/models/test_gguf_convert.py checks against the gguf package)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedserve.models.loader import iter_weights, load_arch_config
    from pagedserve.quant.formats import checkpoint_format

    if not (source.gguf or random_weights):
        return AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype).to(device).eval()
    config = AutoConfig.from_pretrained(source.path)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if random_weights:
        return model
    fmt = checkpoint_format(load_arch_config(source).raw, "none", gguf_blocks=True)
    state = {name: weight.to(dtype) for name, weight in fmt.read(iter_weights(source))}
    model.load_state_dict(state, strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model
