"""Choosing a checkpoint format, and merging the shards of fused layers."""

from __future__ import annotations

import pytest
import torch

from pagedserve.quant.formats import QuantConfigError, checkpoint_format
from pagedserve.quant.formats.gguf import GgufFormat
from pagedserve.quant.weights import Fp8Weight, GroupQuantWeight, concat_shards
from tests.quant.group_weights import random_weight


@pytest.mark.parametrize("config, quantization, message", [
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "auto",
     "quantization_config.quant_method: 'bitsandbytes' is not supported"),
    ({"quantization_config": "awq"}, "auto", "quantization_config: expected an object"),
    ({}, "awq", "--quantization awq does not match the checkpoint, which is not quantized"),
    ({}, "gguf", "--quantization gguf does not match the checkpoint, which is not quantized"),
])
def test_bad_choices_are_one_line_errors(config, quantization, message) -> None:
    with pytest.raises(QuantConfigError, match=message) as err:
        checkpoint_format(config, quantization, gguf_blocks=False)
    assert "\n" not in str(err.value)


def test_gguf_blocks_refuse_another_method_and_fp8_at_load() -> None:
    assert isinstance(checkpoint_format({}, "auto", gguf_blocks=True), GgufFormat)
    with pytest.raises(QuantConfigError, match="--quantization gptq does not match"):
        checkpoint_format({}, "gptq", gguf_blocks=True)
    with pytest.raises(QuantConfigError, match="already quantized \\(gguf\\)"):
        checkpoint_format({}, "fp8", gguf_blocks=True)


def test_none_dequantizes_what_the_format_reads() -> None:
    raw = torch.zeros(4, 18, dtype=torch.uint8)  # two Q4_0 blocks per row
    raw[:, 1] = 0x3C  # d = 1.0 in float16 (0x3C00)
    raw[:, 2:18] = 0x9A  # low nibble 10, high nibble 9
    tensors = [("m.gguf_q4_0", raw), ("norm.weight", torch.ones(3))]
    (name, weight), norm = checkpoint_format({}, "none", gguf_blocks=True).read(tensors)
    assert name == "m.weight" and norm[0] == "norm.weight"
    expected = torch.tensor([2.0] * 16 + [1.0] * 16).expand(4, 32)  # (q - 8) * d
    assert torch.equal(weight, expected)


def test_shards_of_4_and_8_bits_meet_in_8_bit_values() -> None:
    q4, q8 = random_weight(16, 64, 4, 32, seed=1), random_weight(8, 64, 8, 32, seed=2)
    merged = concat_shards([q4, q8])
    assert isinstance(merged, GroupQuantWeight) and merged.bits == 8
    expected = torch.cat([q4.dequantize(torch.float64), q8.dequantize(torch.float64)])
    assert torch.equal(merged.dequantize(torch.float64), expected)


def test_shards_that_cannot_meet_are_dequantized() -> None:
    g32, g64 = random_weight(16, 64, 4, 32, seed=1), random_weight(8, 64, 4, 64, seed=2)
    dense = torch.randn(4, 64)
    fp8 = Fp8Weight.quantize(torch.randn(4, 64))
    for shards in ([g32, g64], [g32, dense], [g32, fp8]):
        merged = concat_shards(shards)
        assert isinstance(merged, torch.Tensor)
        expected = torch.cat([s if isinstance(s, torch.Tensor) else s.dequantize()
                              for s in shards])
        assert torch.equal(merged, expected)
    acts = [random_weight(8, 64, 4, 32, seed=s, act_order=True) for s in (3, 4)]
    assert isinstance(concat_shards(acts), torch.Tensor)  # different permutations


def test_symmetric_quantize_round_trips_within_half_a_step() -> None:
    dense = torch.randn(8, 100, dtype=torch.float64)
    w = GroupQuantWeight.quantize(dense, bits=8, group_size=32)
    error = (w.dequantize(torch.float64) - dense).abs()
    step = w.scales.double()[:, torch.arange(100) // 32]
    assert (error <= step / 2 + 1e-12).all()
    assert w.values.max() <= 255 and (w.values == 128).any()


@pytest.mark.parametrize("quantization, kind", [
    ("awq", GroupQuantWeight), ("gptq", GroupQuantWeight), ("gguf", GroupQuantWeight),
    ("fp8", Fp8Weight), ("none", None),
])
def test_dummy_weights_take_the_named_form(quantization, kind, llama3_folder) -> None:
    """``--load-format dummy --quantization X``: random weights of real shapes, held as X."""
    from pagedserve import LLM
    from pagedserve.models.linear import Linear

    llm = LLM(model=str(llama3_folder), device="cpu", load_format="dummy", dtype="float32",
              quantization=quantization, kv_cache_memory_bytes=1 << 20)
    model = llm.engine.executor.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    expected = {GroupQuantWeight: "NativeQuantLinearMethod", Fp8Weight: "DenseLinearMethod",
                None: "DenseLinearMethod"}[kind]
    assert type(qkv.method).__name__ == expected
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if kind is GroupQuantWeight:
        assert qkv.native.bits == 4 and qkv.native.group_size == (32 if quantization == "gguf"
                                                                   else 128)
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) > 0 and len(layers) == 2 * 4 + 1  # q/k/v, o, gate/up, down; LM head
