"""AWQ (AutoAWQ GEMM) checkpoints: unpacking, the engine against transformers on the
dequantized weights, and the configs we refuse."""

from __future__ import annotations

import pytest
import torch

from pagedserve.quant.formats import checkpoint_format
from pagedserve.quant.formats.awq import AwqFormat
from pagedserve.quant.formats.base import QuantConfigError
from tests.quant.packers import (
    PROMPT_LENS,
    Quantized,
    assert_refused_before_weights,
    linear_methods,
    pack_awq,
    quantize,
    spec_values,
    spec_zeros,
    write_quantized_pair,
)
from tests.tiny_models import assert_greedy_matches, hf_model, make_llm, random_prompts

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
       "version": "gemm", "modules_to_not_convert": None}

# AutoAWQ 0.2.9's WQLinear_GEMM.from_linear packing q[n, k] = (5n + 3k + 1) % 16 and
# z[n] = (7n + 2) % 15 + 1 for N = K = 32, one group: rows k = 0, 1 of qweight, and qzeros.
AUTOAWQ_QWEIGHT = [[1241970097, -1030849223, 1241970097, -1030849223],
                   [2100898020, -172908436, 2100898020, -172908436]]
AUTOAWQ_QZEROS = [[2023420195, 878099678, -284002150, -1412615082]]


def _known_weights():
    n = k = 32
    q = torch.tensor([[(5 * i + 3 * j + 1) % 16 for j in range(k)] for i in range(n)])
    z = torch.tensor([[(7 * i + 2) % 15 + 1] for i in range(n)])
    return q, z


def test_packer_and_unpacker_agree_with_autoawq_words():
    q, z = _known_weights()
    packed = pack_awq(Quantized(q, z, torch.full((32, 1), 0.5, dtype=torch.float16),
                                torch.zeros(32, dtype=torch.int64), 4))
    assert packed["qweight"][:2].tolist() == AUTOAWQ_QWEIGHT
    assert packed["qzeros"].tolist() == AUTOAWQ_QZEROS
    # Our unpacker on AutoAWQ's words (the first two input rows, one group).
    golden = {"qweight": torch.tensor(AUTOAWQ_QWEIGHT, dtype=torch.int32),
              "qzeros": torch.tensor(AUTOAWQ_QZEROS, dtype=torch.int32),
              "scales": torch.full((1, 32), 0.5, dtype=torch.float16)}
    weight = AwqFormat(32).unpack("m", golden)
    assert torch.equal(weight.values.long(), q[:, :2])
    assert torch.equal(weight.offsets, -0.5 * z.float())
    # And the plain-integer reader on them.
    assert spec_values("awq", golden["qweight"], 4) == q[:, :2].tolist()
    assert spec_zeros("awq", golden["qzeros"], 4) == z.tolist()


@pytest.mark.parametrize("n,k,group", [(32, 64, 32), (96, 128, 64), (64, 256, 128),
                                       (40, 128, 128), (8, 96, 32)])
def test_unpack_is_exact(n, k, group):
    torch.manual_seed(n * k + group)
    qz = quantize(torch.randn(n, k) * 0.1, 4, group, sym=False)
    packed = pack_awq(qz)
    weight = AwqFormat(group).unpack("m", packed)
    assert weight.bits == 4 and weight.group_size == group and weight.input_perm is None
    assert torch.equal(weight.dequantize().double(), qz.dequantized())
    assert spec_values("awq", packed["qweight"], 4) == qz.q.tolist()
    assert spec_zeros("awq", packed["qzeros"], 4) == qz.zeros.tolist()


@pytest.mark.parametrize("arch,group", [("llama3", 64), ("qwen2", 32), ("qwen3", 32)])
def test_engine_matches_transformers_on_dequantized_weights(arch, group, tiny_model_folder,
                                                            tmp_path, cpu_quant_kernel):
    skip = ["model.layers.1.mlp.down_proj"]  # stored dense, as modules_to_not_convert says
    config = dict(AWQ, group_size=group, modules_to_not_convert=skip)
    write_quantized_pair(tiny_model_folder(arch), tmp_path / "awq", tmp_path / "float", config,
                         skip=tuple(skip))
    # int8 activations would move greedy tokens off HF's (docs/platforms.md)
    llm = make_llm(tmp_path / "awq", dtype="float32", int8_activations=False)
    methods = linear_methods(llm)
    assert methods["model.layers.0.self_attn.qkv_proj"] == cpu_quant_kernel
    assert methods["model.layers.1.mlp.down_proj"] == "DenseLinearMethod"
    assert_greedy_matches(llm, hf_model(tmp_path / "float"), random_prompts(arch, PROMPT_LENS))


@pytest.mark.parametrize("change,field", [
    ({"bits": 3}, "bits"),
    ({"group_size": 48}, "group_size"),
    ({"version": "gemv"}, "version"),
    ({"version": "GEMV"}, "version"),
    ({"zero_point": False}, "zero_point"),
    ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
])
def test_bad_config_is_refused_before_any_weight_is_read(change, field, llama3_folder,
                                                         tmp_path):
    assert_refused_before_weights(llama3_folder, tmp_path / "bad", dict(AWQ, **change), field)


def test_missing_qzeros_names_the_tensor():
    qz = quantize(torch.randn(32, 64), 4, 32, sym=False)
    packed = pack_awq(qz)
    del packed["qzeros"]
    fmt = checkpoint_format({"quantization_config": AWQ}, "auto", False)
    with pytest.raises(QuantConfigError, match=r"^awq checkpoint: m\.q_proj has no "
                                                r"m\.q_proj\.qzeros tensor$"):
        list(fmt.read((f"m.q_proj.{p}", t) for p, t in packed.items()))


def test_autoawq_field_names_and_upper_case_version():
    fmt = AwqFormat.from_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 128,
                                 "zero_point": True, "version": "GEMM"})
    assert fmt.group_size == 128
