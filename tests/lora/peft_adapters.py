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


def write_adapter(base: Path, folder: Path, spec: dict, seed: int) -> Path:
    """PEFT's adapter of ``spec`` on the checkpoint ``base``, random A and B, saved."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
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
