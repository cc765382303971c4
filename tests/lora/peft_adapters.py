"""Random PEFT LoRA adapters (``init_lora_weights=False``, so B is not zero) written as PEFT
folders, and PEFT's own model of an adapter as the reference."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_models import hf_model

# Adapters of different ranks, alphas and target sets; one rsLoRA, one with rank and alpha
# patterns.
ADAPTER_SPECS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp_rslora": dict(r=8, lora_alpha=16, use_rslora=True,
                       target_modules=["gate_proj", "up_proj", "down_proj"]),
    "mixed": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                  rank_pattern={"v_proj": 6}, alpha_pattern={"layers.1.mlp.down_proj": 3}),
    "all": dict(r=3, lora_alpha=5, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"]),
}


# Phi-3's modules: q/k/v and gate/up are one fused projection each in its checkpoint.
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _for_model(spec: dict, model) -> dict:
    """``spec`` with its module names as ``model`` has them (Phi-3's fused ones)."""
    if not hasattr(model.model.layers[0].self_attn, "qkv_proj"):
        return spec
    rename = lambda names: list(dict.fromkeys(_FUSED.get(n, n) for n in names))  # noqa: E731
    fused = dict(spec, target_modules=rename(spec["target_modules"]))
    if "rank_pattern" in spec:
        fused["rank_pattern"] = {_FUSED.get(k, k): v for k, v in spec["rank_pattern"].items()}
    return fused


def write_adapter(base: Path, folder: Path, spec: dict, seed: int) -> Path:
    """PEFT's adapter of ``spec`` on the checkpoint ``base``, random A and B, saved (Phi-3's
    targets its fused qkv_proj and gate_up_proj where ``spec`` names their parts)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    spec = _for_model(spec, model)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **spec))
    with torch.no_grad():  # PEFT's random init is small; make each delta visible
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    peft_model.save_pretrained(folder)
    return folder


def peft_model(base: Path, adapter: Path):
    """PEFT's float32 model of ``adapter`` over a fresh copy of the base checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).eval()


def base_model(base: Path):
    return hf_model(base)
