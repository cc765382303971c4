"""LoRA on AWQ and GPTQ bases: the base matmul stays the checkpoint's (the platform's 4-bit
kernel), the adapter's delta is added to it; greedy tokens equal PEFT's over the dequantized
model."""

from __future__ import annotations

import pytest

from pagedserve import LoRARequest
from tests.lora.peft_adapters import ADAPTER_SPECS, peft_model, write_adapter
from tests.quant.packers import linear_methods, write_quantized_pair
from tests.tiny_models import assert_greedy_matches, make_llm, random_prompts

QUANT = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
             "desc_act": False, "checkpoint_format": "gptq"},
}


@pytest.mark.parametrize("method,arch", [("awq", "llama3"), ("gptq", "qwen2")])
def test_lora_on_a_quantized_base_equals_peft_on_the_dequantized(method, arch,
                                                                 tiny_model_folder, tmp_path):
    write_quantized_pair(tiny_model_folder(arch), tmp_path / "q", tmp_path / "float",
                         QUANT[method])
    adapter = write_adapter(tmp_path / "float", tmp_path / "lora", ADAPTER_SPECS["all"], seed=3)
    # int8 activations would move greedy tokens off PEFT's (docs/platforms.md)
    llm = make_llm(tmp_path / "q", dtype="float32", enable_lora=True, max_lora_rank=8,
                   int8_activations=False)
    methods = linear_methods(llm)
    assert methods["model.layers.0.self_attn.qkv_proj.base"] != "DenseLinearMethod"
    exact = assert_greedy_matches(llm, peft_model(tmp_path / "float", adapter),
                                  random_prompts(f"lora-{method}", [6, 17, 30]),
                                  lora_request=LoRARequest("all", 1, str(adapter)))
    assert exact >= 2
