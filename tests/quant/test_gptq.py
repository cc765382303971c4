"""GPTQ checkpoints (v1 and v2, 4- and 8-bit, act-order): unpacking, the engine against
transformers on the dequantized weights, and the configs we refuse."""

from __future__ import annotations

import pytest
import torch

from pagedserve.quant.formats import checkpoint_format
from pagedserve.quant.formats.base import QuantConfigError
from pagedserve.quant.formats.gptq import GptqFormat
from tests.quant.packers import (
    PROMPT_LENS,
    Quantized,
    assert_refused_before_weights,
    linear_methods,
    pack_gptq,
    quantize,
    spec_values,
    spec_zeros,
    write_quantized_pair,
)
from tests.tiny_models import assert_greedy_matches, hf_model, make_llm, random_prompts

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
        "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True,
        "static_groups": False}  # the last three: harmless fields, ignored

# AutoGPTQ 0.7.1's QuantLinear.pack (qlinear_cuda, v1 zeros) of q[n, k] = (5n + 3k + 1) % 2**b
# and z[n] = (7n + 2) % (2**b - 1) + 1 for N = K = 32, group_size -1: output columns 0 and 1
# of qweight (all its rows), and qzeros.
AUTOGPTQ = {
    4: ([[1661839169, -343593015, 1661839169, -343593015],
         [-1202520938, 819622942, -1202520938, 819622942]],
        [[1852866962, 708529245, -689502183, -1834765115]]),
    8: ([[168231937, 370348045, 572464153, 774580261, 976696369, 1178812477, 1380928585,
          1583044693],
         [252446982, 454563090, 656679198, 858795306, 1060911414, 1263027522, 1465143630,
          1667259738]],
        [[386926850, 858531102, 1330135354, 1801739606, -2021623438, -1550019186, -1078414934,
          -606810682]]),
}


@pytest.mark.parametrize("bits", [4, 8])
def test_packer_and_unpacker_agree_with_autogptq_words(bits):
    n = k = 32
    q = torch.tensor([[(5 * i + 3 * j + 1) % (1 << bits) for j in range(k)] for i in range(n)])
    z = torch.tensor([[(7 * i + 2) % ((1 << bits) - 1) + 1] for i in range(n)])
    scales = torch.full((n, 1), 0.5, dtype=torch.float16)
    packed = pack_gptq(Quantized(q, z, scales, torch.zeros(k, dtype=torch.int64), bits))
    columns, qzeros = AUTOGPTQ[bits]
    assert packed["qweight"][:, :2].T.tolist() == columns
    assert packed["qzeros"].tolist() == qzeros
    # Our unpacker on AutoGPTQ's words (output columns 0 and 1 only: zeros of the first
    # 32 / bits columns) and the plain-integer reader on them.
    per_word = 32 // bits
    golden = {"qweight": torch.tensor(columns, dtype=torch.int32).T.contiguous(),
              "qzeros": torch.tensor(qzeros, dtype=torch.int32)[:, :1].contiguous(),
              "scales": scales[:per_word].T.contiguous()}
    golden["qweight"] = golden["qweight"].repeat(1, per_word // 2)  # columns 0, 1, 0, 1, ...
    weight = GptqFormat(bits, -1, v1_zeros=True).unpack("m", golden)
    assert torch.equal(weight.values.long(), q[[0, 1] * (per_word // 2)])
    assert torch.equal(weight.offsets, -0.5 * z[:per_word].float())
    assert spec_values("gptq", golden["qweight"], bits) == q[[0, 1] * (per_word // 2)].tolist()
    assert spec_zeros("gptq", torch.tensor(qzeros), bits, v1=True) == z.tolist()


CASES = [  # bits, n, k, group_size, sym, act_order
    (4, 32, 64, 32, True, False), (4, 96, 128, 64, False, True), (4, 16, 160, 64, False, True),
    (4, 24, 128, -1, False, False), (8, 32, 64, 32, False, False), (8, 8, 256, 128, True, True),
    (8, 40, 96, -1, True, False),
]


@pytest.mark.parametrize("v1", [True, False], ids=["gptq", "gptq_v2"])
@pytest.mark.parametrize("bits,n,k,group,sym,act_order", CASES)
def test_unpack_is_exact(bits, n, k, group, sym, act_order, v1):
    torch.manual_seed(n * k + group + bits)
    perm = torch.randperm(k) if act_order else None
    qz = quantize(torch.randn(n, k) * 0.1, bits, group, sym, perm)
    if not sym:
        qz.zeros[0, 0] = 0  # v1 stores -1 for it: wrapped to all ones in its field
    packed = pack_gptq(qz, v1)
    weight = GptqFormat(bits, group, v1).unpack("m", packed)
    assert weight.group_size == (k if group == -1 else group) and weight.bits == bits
    assert (weight.input_perm is None) == (not act_order)
    assert torch.equal(weight.dequantize().double(), qz.dequantized())
    assert spec_values("gptq", packed["qweight"], bits) == qz.q.tolist()
    assert spec_zeros("gptq", packed["qzeros"], bits, v1) == qz.zeros.tolist()


def test_act_order_groups_are_contiguous_after_the_permutation():
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(0))
    qz = quantize(torch.randn(16, 128), 4, 32, sym=True, perm=perm)
    weight = GptqFormat(4, 32, True).unpack("m", pack_gptq(qz))
    assert torch.equal(qz.g_idx[weight.input_perm], torch.arange(128) // 32)
    assert torch.equal(weight.values.long(), qz.q[:, weight.input_perm])


def test_non_uniform_g_idx_is_refused():
    qz = quantize(torch.randn(16, 128), 4, 32, sym=True, perm=torch.randperm(128))
    packed = pack_gptq(qz)
    packed["g_idx"][packed["g_idx"] == 1] = 0  # group 0 now has 64 columns, group 1 none
    fmt = checkpoint_format({"quantization_config": dict(GPTQ, desc_act=True)}, "auto", False)
    with pytest.raises(QuantConfigError, match=r"^quantization_config\.desc_act: "
                                                r"m\.g_idx does not put 32 columns"):
        list(fmt.read((f"m.{p}", t) for p, t in packed.items()))


def test_missing_qzeros_names_the_tensor():
    packed = pack_gptq(quantize(torch.randn(16, 64), 4, 32, sym=True))
    del packed["qzeros"]
    fmt = checkpoint_format({"quantization_config": GPTQ}, "auto", False)
    with pytest.raises(QuantConfigError, match=r"^gptq checkpoint: m has no m\.qzeros tensor$"):
        list(fmt.read((f"m.{p}", t) for p, t in packed.items()))


# Each engine case covers several options at once; each runs on Llama, on Qwen2 (biases, tied
# embeddings, intermediate size 160: a partial last group for group_size 64) and on Qwen3 (q/k
# norms, intermediate size 96: a partial last group too).
ENGINE_CASES = {
    "4bit-sym-act_order-v1": dict(bits=4, group_size=32, sym=True, desc_act=True),
    "4bit-asym-per_channel-v2": dict(bits=4, group_size=-1, sym=False,
                                     checkpoint_format="gptq_v2"),
    "8bit-asym-v1": dict(bits=8, group_size=64, sym=False),
}


@pytest.fixture(scope="module")
def quantized_pairs(tiny_model_folder, tmp_path_factory):
    """``pairs(case, arch)``: the quantized folder and its dequantized float32 twin."""
    made = {}

    def pair(case: str, arch: str):
        if (case, arch) not in made:
            root = tmp_path_factory.mktemp(f"{case}-{arch}")
            write_quantized_pair(tiny_model_folder(arch), root / "gptq", root / "float",
                                 dict(GPTQ, **ENGINE_CASES[case]))
            made[case, arch] = root / "gptq", root / "float"
        return made[case, arch]

    return pair


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_engine_matches_transformers_on_dequantized_weights(case, arch, quantized_pairs,
                                                            cpu_quant_kernel):
    quantized, dequantized = quantized_pairs(case, arch)
    # int8 activations would move greedy tokens off HF's (docs/platforms.md)
    llm = make_llm(quantized, dtype="float32", int8_activations=False)
    methods = linear_methods(llm)
    assert methods["model.layers.0.self_attn.qkv_proj"] == cpu_quant_kernel
    assert methods["model.layers.1.mlp.down_proj"] == cpu_quant_kernel
    if ENGINE_CASES[case].get("desc_act"):  # q/k/v share one act-order: fused, still packed
        qkv = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.input_perm is not None
    assert_greedy_matches(llm, hf_model(dequantized), random_prompts(case + arch, PROMPT_LENS))


def test_quantization_none_matches_transformers(quantized_pairs):
    quantized, dequantized = quantized_pairs("4bit-sym-act_order-v1", "qwen2")
    llm = make_llm(quantized, dtype="float32", quantization="none")
    assert set(linear_methods(llm).values()) == {"DenseLinearMethod"}
    assert_greedy_matches(llm, hf_model(dequantized), random_prompts("none", PROMPT_LENS))


@pytest.mark.parametrize("change,field", [
    ({"bits": 3}, "bits"),
    ({"group_size": 48}, "group_size"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"format": "bitblas"}, "format"),
    ({"is_marlin_format": True}, "is_marlin_format"),
    ({"sym": "yes"}, "sym"),
    ({"desc_act": None}, "desc_act"),
])
def test_bad_config_is_refused_before_any_weight_is_read(change, field, llama3_folder,
                                                         tmp_path):
    qc = dict(GPTQ, **change)
    if "format" in change:
        del qc["checkpoint_format"]
    assert_refused_before_weights(llama3_folder, tmp_path / "bad", qc, field)
