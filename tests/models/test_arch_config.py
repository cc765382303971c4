"""ModelArchConfig from config.json dicts, and the checkpoint shapes our model expects of each
architecture, checked against transformers' own models of the same configs."""

from __future__ import annotations

import copy

import pytest
import torch

from pagedserve.bench.dummy_model import SHAPES
from pagedserve.models.config import ModelArchConfig, UnsupportedModel
from pagedserve.models.llama import checkpoint_shapes
from tests.tiny_models import ARCH_CONFIGS, VOCAB

QWEN3 = {**ARCH_CONFIGS["qwen3"], "vocab_size": VOCAB}


def _hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The shapes of transformers' model of ``cfg``, built on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # A deep copy: transformers' config writes into the nested dicts it is given (longrope's
    # rope_scaling gains original_max_position_embeddings), which would change the shared
    # ARCH_CONFIGS and SHAPES for every later test of the process.
    cfg = copy.deepcopy(cfg)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # the embedding's table, not a tensor of its own
    return _saved_expert_names(shapes, cfg["architectures"][0] == "MixtralForCausalLM")


def _saved_expert_names(shapes: dict[str, tuple[int, ...]], mixtral: bool
                        ) -> dict[str, tuple[int, ...]]:
    """transformers 5 holds a layer's experts stacked (``mlp.experts.gate_up_proj``
    ``[E, 2I, H]``) and saves them one tensor per expert, as the published checkpoints are:
    Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2`` (its router
    ``block_sparse_moe.gate``), Qwen3-MoE's ``mlp.experts.{e}.gate_proj/up_proj/down_proj``."""
    block = ".block_sparse_moe." if mixtral else ".mlp."
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    saved = {}
    for name, shape in shapes.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            layer = name.removesuffix(".mlp.experts.gate_up_proj")
            experts, inter, hidden = shape[0], shape[1] // 2, shape[2]
            for e in range(experts):
                for proj in (gate, up):
                    saved[f"{layer}{block}experts.{e}.{proj}.weight"] = (inter, hidden)
                saved[f"{layer}{block}experts.{e}.{down}.weight"] = (hidden, inter)
        elif name.endswith(".mlp.experts.down_proj"):
            continue  # written with gate_up_proj's
        elif name.endswith(".mlp.gate.weight"):
            saved[name.replace(".mlp.", block)] = shape
        else:
            saved[name] = shape
    return saved


def test_qwen3_reads_its_head_dim_and_q_k_norms():
    arch = ModelArchConfig.from_hf_dict(QWEN3)
    assert (arch.architecture, arch.qk_norm, arch.attention_bias) == (
        "Qwen3ForCausalLM", True, False)
    assert arch.head_dim == 32 != arch.hidden_size // arch.num_heads
    # transformers' Qwen3Config defaults head_dim to 128, not hidden / heads.
    assert ModelArchConfig.from_hf_dict({**QWEN3, "head_dim": None}).head_dim == 128
    assert not ModelArchConfig.from_hf_dict({**ARCH_CONFIGS["qwen2"], "vocab_size": 8}).qk_norm


def test_qwen3_sliding_window_keeps_the_context_inside_it():
    """Only with use_sliding_window; then the context stays inside one window (whichever
    layers slide: transformers' rules differ), and no layer needs one."""
    arch = ModelArchConfig.from_hf_dict({**QWEN3, "sliding_window": 512})
    assert (arch.sliding_window, arch.max_position_embeddings) == (None, 1024)
    windowed = {**QWEN3, "sliding_window": 512, "use_sliding_window": True}
    arch = ModelArchConfig.from_hf_dict(windowed)
    assert (arch.sliding_window, arch.max_position_embeddings) == (None, 512)


def test_mistral_window_applies_to_every_layer():
    arch = ModelArchConfig.from_hf_dict({**ARCH_CONFIGS["mistral"], "vocab_size": VOCAB,
                                         "sliding_window": 4096})
    assert [arch.layer_window(i) for i in range(2)] == [4096, 4096]
    assert arch.max_position_embeddings == 1024  # not capped at the window


def _gemma(arch: str, **cfg) -> ModelArchConfig:
    return ModelArchConfig.from_hf_dict({**ARCH_CONFIGS[arch], "vocab_size": VOCAB, **cfg})


def _hf_saved(cfg: dict) -> dict:
    """``cfg`` as transformers 5 saves it (``layer_types``, rope settings by layer type)."""
    from transformers import AutoConfig

    cfg = copy.deepcopy(cfg)
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg).to_dict()


# The keys of Gemma 2 2B's and Gemma 3 4B's config.json as published (before transformers 5):
# no layer_types, tie_word_embeddings or rope_parameters; Gemma 3's rope_theta,
# rope_local_base_freq, rope_scaling and sliding_window_pattern.
GEMMA2_RELEASED = dict(
    architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=64,
    intermediate_size=128, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
    rope_theta=10000.0, query_pre_attn_scalar=32, sliding_window=4096,
    final_logit_softcapping=30.0, attn_logit_softcapping=50.0, vocab_size=VOCAB)
GEMMA3_RELEASED = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=64,
    intermediate_size=128, num_hidden_layers=13, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, rope_theta=1000000.0, rope_local_base_freq=10000.0,
    rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024,
    sliding_window_pattern=6, query_pre_attn_scalar=168, final_logit_softcapping=None,
    attn_logit_softcapping=None, vocab_size=VOCAB)


def _gemma_facts(arch: ModelArchConfig) -> tuple:
    scaling = arch.rope_scaling and (arch.rope_scaling["rope_type"], arch.rope_scaling["factor"])
    return (arch.sliding_window, arch.sliding_layers, arch.attention_scale,
            arch.attn_logit_softcap, arch.final_logit_softcap, arch.rope_theta,
            arch.rope_local_theta, scaling, arch.tie_word_embeddings, arch.qk_norm,
            arch.sandwich_norms)


@pytest.mark.parametrize("released", [GEMMA2_RELEASED, GEMMA3_RELEASED],
                         ids=["gemma2", "gemma3"])
def test_gemma_configs_read_alike_as_released_and_as_transformers_5_saves_them(released):
    """Each layer's window, the caps, the softmax scale and Gemma 3's two rotations: the
    same from the published keys and from transformers' own reading of them."""
    facts = _gemma_facts(ModelArchConfig.from_hf_dict(released))
    assert facts == _gemma_facts(ModelArchConfig.from_hf_dict(_hf_saved(released)))
    if released is GEMMA2_RELEASED:  # every other layer from the first
        assert facts == (4096, (0, 2, 4), 32 ** -0.5, 50.0, 30.0, 10000.0, None, None, True,
                         False, True)
    else:  # all but every sixth; Gemma 3 never applies attn_logit_softcapping
        assert facts == (1024, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12), 168 ** -0.5, None, None,
                         1e6, 1e4, ("linear", 8.0), True, True, True)


def test_gemma_configs_beyond_the_released_models_are_refused():
    with pytest.raises(UnsupportedModel, match="hidden_activation 'gelu'"):
        _gemma("gemma2", hidden_activation="gelu")
    with pytest.raises(UnsupportedModel, match="use_bidirectional_attention"):
        _gemma("gemma3", use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModel, match="layer_types"):
        _gemma("gemma3", layer_types=["sliding_attention", "chunked_attention",
                                      "full_attention"])


def test_qwen3_with_attention_biases_is_refused():
    with pytest.raises(UnsupportedModel, match="Qwen3 with attention_bias"):
        ModelArchConfig.from_hf_dict({**QWEN3, "attention_bias": True})


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_checkpoint_shapes_are_transformers_state_dict(arch):
    """What ``--load-format dummy`` makes and ``load_weights`` requires, tensor for tensor."""
    cfg = {**ARCH_CONFIGS[arch], "vocab_size": VOCAB}
    assert checkpoint_shapes(ModelArchConfig.from_hf_dict(cfg)) == _hf_shapes(cfg)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_benchmark_shapes_are_transformers_state_dict(shape):
    assert checkpoint_shapes(ModelArchConfig.from_hf_dict(SHAPES[shape])) == _hf_shapes(
        SHAPES[shape])


def test_phi3_config_as_released_checkpoints_write_it():
    """Phi-3-mini-128k's config.json, before transformers 5: ``su`` rope_scaling beside a
    top-level original_max_position_embeddings; Phi-4-mini's top-level partial factor."""
    cfg = {**ARCH_CONFIGS["phi3"], "vocab_size": VOCAB, "rope_theta": 10000.0,
           "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
           "rope_scaling": {"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}}
    arch = ModelArchConfig.from_hf_dict(cfg)
    assert (arch.fused_checkpoint, arch.rotary_dim, arch.sliding_window) == (True, 12, 2047)
    assert arch.rope_scaling["rope_type"] == "longrope"
    assert arch.rope_scaling["original_max_position_embeddings"] == 4096
    assert arch.attention_scale == 16 ** -0.5


def test_granite_scalars_and_mlp_bias_refused():
    arch = ModelArchConfig.from_hf_dict({**ARCH_CONFIGS["granite"], "vocab_size": VOCAB})
    assert (arch.embedding_multiplier, arch.residual_multiplier, arch.attention_scale,
            arch.logits_scaling) == (6.0, 0.3, 0.4, 5.0)
    with pytest.raises(UnsupportedModel, match="mlp_bias"):
        ModelArchConfig.from_hf_dict({**ARCH_CONFIGS["granite"], "vocab_size": VOCAB,
                                      "mlp_bias": True})


def test_gemma3_multimodal_config_is_its_language_model():
    """A Gemma3ForConditionalGeneration config shaped as Gemma 3 4B's: a text_config of the
    keys that differ from transformers' defaults, the stop tokens and dtype at the top. Served
    as its Gemma3ForCausalLM, the rest from transformers' Gemma3TextConfig defaults."""
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "eos_token_id": [1, 106], "torch_dtype": "bfloat16", "image_token_index": 262144,
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                           "model_type": "gemma3_text", "num_hidden_layers": 34,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}
    arch = ModelArchConfig.from_hf_dict(cfg)
    assert (arch.architecture, arch.vocab_size, arch.num_heads, arch.num_kv_heads,
            arch.head_dim, arch.num_layers, arch.eos_token_ids, arch.torch_dtype) == (
        "Gemma3ForCausalLM", 262208, 8, 4, 256, 34, (1, 106), "bfloat16")
    assert (arch.sliding_window, len(arch.sliding_layers), arch.rope_theta,
            arch.rope_local_theta, arch.rope_scaling["factor"]) == (1024, 29, 1e6, 1e4, 8.0)
    assert 5 not in arch.sliding_layers and arch.tie_word_embeddings
