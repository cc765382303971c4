"""The mixture-of-experts block: the router's choice of experts, the platform op that runs
them (``LayerOps.fused_moe``, the portable torch version and the CPU platform's, which uses
its native SwiGLU) against a float64 loop over tokens, Qwen2-MoE's shared expert against
transformers in float64, and what MoE models refuse."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedserve.config import ConfigError, EngineConfig
from pagedserve.models.config import ModelArchConfig
from pagedserve.models.layer_ops import LayerOps
from pagedserve.models.moe import expert_weight, route
from pagedserve.platforms.cpu.platform import CpuPlatform
from tests.tiny_models import (
    ARCH_CONFIGS,
    VOCAB,
    assert_greedy_matches,
    hf_model_float64,
    make_llm,
    prompt_logprob_error,
    random_prompts,
)

OPS = [LayerOps, CpuPlatform.layer_ops()]


def reference_moe(hidden, w13, w2, ids, weights) -> torch.Tensor:
    """Token by token, each of its k experts in float64."""
    h, w13, w2, weights = hidden.double(), w13.double(), w2.double(), weights.double()
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for k in range(ids.shape[1]):
            gate, up = (w13[ids[t, k]] @ h[t]).chunk(2)
            out[t] += weights[t, k] * (w2[ids[t, k]] @ (F.silu(gate) * up))
    return out


def expert_weights(experts: int, hidden: int, inter: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(experts)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / math.sqrt(hidden)
    w2 = torch.randn(experts, hidden, inter, generator=g) / math.sqrt(inter)
    return w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("ops", OPS, ids=lambda o: o.__name__)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fused_moe_equals_a_per_token_reference(ops, dtype, tol):
    """Experts 0, 3 and 5 of 8 get no token; expert 2 gets most; the router's logits tie
    (two experts of equal score in a token's top-k) in rows 1 and 2, as do their weights."""
    torch.manual_seed(0)
    tokens, hidden, inter = 13, 48, 40
    w13, w2 = expert_weights(8, hidden, inter, dtype)
    x = torch.randn(tokens, hidden).to(dtype)
    logits = torch.full((tokens, 8), -30.0)
    for t in range(tokens):  # a token picks expert 2 and one of 1, 4, 6, 7
        logits[t, 2] = 1.0 + t / tokens
        logits[t, [1, 4, 6, 7][t % 4]] = 0.5
    logits[1, 4] = logits[1, 2] = logits[2, 6] = logits[2, 2] = 2.0  # ties
    routed = route(logits, top_k=2, renormalize=True)
    assert set(routed.ids.flatten().tolist()) == {1, 2, 4, 6, 7}
    assert routed.weights[1].tolist() == [0.5, 0.5]
    got = ops.fused_moe(x, w13, w2, routed.ids, routed.weights)
    assert got.dtype == dtype and got.shape == x.shape
    expected = reference_moe(x, w13, w2, routed.ids, routed.weights)
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("ops", OPS, ids=lambda o: o.__name__)
def test_fused_moe_of_no_tokens_and_of_one(ops):
    w13, w2 = expert_weights(4, 16, 8, torch.float32)
    none = ops.fused_moe(torch.empty(0, 16), w13, w2, torch.empty(0, 2, dtype=torch.int64),
                         torch.empty(0, 2))
    assert none.shape == (0, 16)
    x = torch.randn(1, 16)
    ids, weights = torch.tensor([[3, 0]]), torch.tensor([[0.75, 0.25]])
    torch.testing.assert_close(ops.fused_moe(x, w13, w2, ids, weights).double(),
                               reference_moe(x, w13, w2, ids, weights), atol=1e-5, rtol=1e-5)


def test_route_takes_the_softmax_top_k_and_renormalises_where_asked():
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().to(torch.bfloat16)
    plain = route(logits, top_k=2, renormalize=False)
    assert plain.ids.tolist() == [[3, 2]] and plain.weights.dtype == torch.float32
    torch.testing.assert_close(plain.weights, torch.tensor([[0.4, 0.3]]), atol=2e-3, rtol=0)
    norm = route(logits, top_k=2, renormalize=True)
    torch.testing.assert_close(norm.weights, torch.tensor([[4 / 7, 3 / 7]]), atol=2e-3, rtol=0)


def test_expert_names_of_both_checkpoint_layouts():
    mixtral = expert_weight("model.layers.3.block_sparse_moe.experts.7.w3.weight")
    qwen = expert_weight("model.layers.3.mlp.experts.7.up_proj.weight")
    assert mixtral == qwen == ("model.layers.3.mlp.experts", 7, "up")
    assert expert_weight("model.layers.3.mlp.up_proj.weight") is None
    assert expert_weight("model.layers.3.mlp.gate.weight") is None


def _arch(name: str, **overrides) -> ModelArchConfig:
    return ModelArchConfig.from_hf_dict({**ARCH_CONFIGS[name], "vocab_size": VOCAB,
                                         **overrides})


def test_config_fields_and_sparse_layers():
    mixtral = _arch("mixtral")
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size,
            mixtral.norm_topk_prob, mixtral.moe_layers) == (6, 2, 48, True, (0, 1))
    assert _arch("qwen3-moe-dense1").moe_layers == (0,)
    stepped = _arch("qwen3-moe", num_hidden_layers=4, decoder_sparse_step=2)
    assert stepped.moe_layers == (1, 3) and stepped.qk_norm
    # Published Qwen3-MoE configs say num_experts; transformers 5 saves num_local_experts.
    assert _arch("qwen3-moe", num_experts=16).num_experts == 16
    assert _arch("qwen3-moe", head_dim=None).head_dim == 16  # hidden / heads, not 128
    assert _arch("llama3").num_experts == 0 and not _arch("llama3").moe_layers


@pytest.mark.parametrize("arch,overrides,kind", [
    ("qwen3-moe", dict(moe_intermediate_size=30), "expert"),
    ("qwen2-moe", dict(shared_expert_intermediate_size=30), "shared expert")])
def test_tensor_parallelism_needs_the_expert_sizes_divisible(arch, overrides, kind):
    """Heads, KV heads and the dense intermediate size split 4 ways; 30 expert rows (routed
    or shared) do not."""
    arch = _arch(arch, **overrides)
    with pytest.raises(ConfigError, match=f"--tensor-parallel-size 4: the model's {kind} "
                                          "intermediate size 30 does not divide into 4"):
        EngineConfig(tensor_parallel_size=4).resolve(arch, CpuPlatform)
    assert EngineConfig(tensor_parallel_size=2).resolve(arch, CpuPlatform)


def test_qwen2_moe_config_fields():
    """Qwen2's q/k/v biases (unless transformers 5's qkv_bias says not), the shared expert's
    size, norm_topk_prob false unless set, and the Qwen sparse-layer rules."""
    arch = _arch("qwen2-moe")
    assert (arch.attention_bias, arch.qk_norm, arch.shared_expert_intermediate_size,
            arch.norm_topk_prob, arch.num_experts_per_tok, arch.moe_layers) == (
        True, False, 48, False, 3, (0, 1))
    assert not _arch("qwen2-moe", qkv_bias=False).attention_bias
    assert _arch("qwen2-moe", num_hidden_layers=4, decoder_sparse_step=2,
                 mlp_only_layers=[3]).moe_layers == (1,)
    assert _arch("qwen3-moe").shared_expert_intermediate_size == 0


class _OpenGate(torch.nn.Module):
    """A shared-expert gate of +inf logits: sigmoid 1, as if the model had no gate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((x.shape[0], 1), torch.inf, dtype=x.dtype)


def test_qwen2_moe_matches_transformers_in_float64(tiny_model_folder):
    """The engine in float32 (prefill in chunks of 16 tokens over blocks of 8) against
    transformers' Qwen2MoeForCausalLM in float64: prompt logprobs and greedy tokens. With the
    shared expert's gate dropped (its output added unscaled) the logprobs are far off, so the
    comparison sees the gate."""
    folder = tiny_model_folder("qwen2-moe")
    hf = hf_model_float64(folder)
    llm = make_llm(folder, block_size=8, max_num_batched_tokens=16,
                   enable_prefix_caching=False)
    prompts = random_prompts("qwen2-moe", [45, 9])
    assert max(prompt_logprob_error(llm, hf, p) for p in prompts) < 1e-4
    assert assert_greedy_matches(llm, hf, prompts, new_tokens=12) == len(prompts)
    for layer in llm.engine.executor.runner.model.model.layers:
        layer.mlp.shared_expert_gate = _OpenGate()
    assert prompt_logprob_error(llm, hf, prompts[0]) > 1e-2


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe"])
def test_lora_is_refused_for_moe_models(tiny_model_folder, arch):
    with pytest.raises(ConfigError, match="--enable-lora is not supported for "
                                          "mixture-of-experts"):
        make_llm(tiny_model_folder(arch), enable_lora=True)


def test_quantized_phi3_checkpoint_is_refused(tiny_model_folder, tmp_path: Path):
    """Phi-3's fused q/k/v and gate/up tensors are cut into parts as float rows only.
    (Quantized mixture-of-experts checkpoints load: tests/models/test_quantized_moe.py.)"""
    folder = shutil.copytree(tiny_model_folder("phi3"), tmp_path / "awq")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"quantized checkpoints \(awq\) of fused q/k/v and "
                                          r"gate/up tensors"):
        make_llm(folder)
