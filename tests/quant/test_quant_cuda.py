"""Every grouped-int and FP8 format loads on an NVIDIA GPU (4-bit weights packed for the W4A16
Triton kernel, FP8 kept in FP8, 8-bit dequantized at load) and matches transformers on the
dequantized weights."""

from __future__ import annotations

import pytest

from tests.devices import HAS_NVIDIA, NVIDIA_REASON
from tests.quant.fp8_ct_checkpoints import write_fp8
from tests.quant.packers import PROMPT_LENS, linear_methods, write_quantized_pair
from tests.tiny_models import assert_greedy_matches, hf_model, random_prompts

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_NVIDIA, reason=NVIDIA_REASON),
]

CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
            "version": "gemm"},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                       "desc_act": True, "checkpoint_format": "gptq"},
    "gptq-8bit": {"quant_method": "gptq", "bits": 8, "group_size": 64, "sym": False,
                  "desc_act": False, "checkpoint_format": "gptq_v2"},
}


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("fmt", [*CONFIGS, "fp8-static"])
def test_format_loads_on_cuda(fmt, arch, tiny_model_folder, tmp_path, monkeypatch):
    from pagedserve import LLM
    from pagedserve.platforms.cuda.platform import CudaPlatform

    if fmt == "fp8-static":
        # As on a GPU without FP8 matmuls (W8A8 is tests/platforms/cuda/test_fp8_linear.py).
        monkeypatch.setattr(CudaPlatform, "supports_fp8_matmul", classmethod(lambda c: False))
        ckpt = write_fp8(tiny_model_folder(arch), tmp_path / "fp8", static=True)
        quantized, reference = ckpt.quantized, ckpt.reference
    else:
        quantized, reference = tmp_path / "q", tmp_path / "float"
        write_quantized_pair(tiny_model_folder(arch), quantized, reference, CONFIGS[fmt])
    llm = LLM(model=str(quantized), device="cuda", dtype="float32",
              kv_cache_memory_bytes=64 << 20)
    methods = set(linear_methods(llm).values())
    if fmt in ("awq", "gptq-act-order"):
        assert "W4A16LinearMethod" in methods
    elif fmt == "fp8-static":  # FP8 stays FP8, decoded in the matmul (the LM head is dense)
        assert methods == {"Fp8WeightOnlyLinearMethod", "DenseLinearMethod"}
    else:
        assert methods == {"DenseLinearMethod"}
    prompts = random_prompts(fmt + arch, PROMPT_LENS)
    assert assert_greedy_matches(llm, hf_model(reference), prompts) >= 1
