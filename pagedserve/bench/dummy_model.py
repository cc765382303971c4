"""Checkpoint folders of real model shapes with no weights, for ``--load-format dummy``.

The tokenizer maps id ``i`` to the word ``<i>``: benchmarks send token ids, and this keeps
every id of any vocabulary decodable without shipping a real tokenizer.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

# What the members of a family share; each shape adds its sizes.
_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5)
_LLAMA3 = dict(_LLAMA, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
               tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
_QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rms_norm_eps=1e-6,
              rope_theta=1000000.0, max_position_embeddings=32768, bos_token_id=151643,
              eos_token_id=151643)
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rms_norm_eps=1e-6,
              rope_theta=1000000.0, max_position_embeddings=40960, vocab_size=151936,
              head_dim=128, attention_bias=False, use_sliding_window=False,
              bos_token_id=151643, eos_token_id=151645)

SHAPES: dict[str, dict] = {
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    # Llama-3.2-1B: the 8B's vocabulary, so it drafts for it (speculative decoding).
    "llama3-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    # Larger than one H200 in bf16 (141 GB of weights): tensor parallelism's shape.
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
    "smollm2-135m": dict(
        _LLAMA, vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
    # Compute-free: what is left of a step's time is the engine's host-side work.
    "tiny-llama": dict(
        _LLAMA, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    # Small enough for a CPU run, with two KV heads (tensor parallelism up to 2 ranks).
    "qwen2-0.5b": dict(_QWEN2, vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       tie_word_embeddings=True),
    "qwen2-7b": dict(_QWEN2, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     tie_word_embeddings=False),
    # q/k norms, and heads of 128 wider than hidden / heads (64): q is 2048 wide, not 1024.
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    # Phi-4 (14B): Phi-3's fused qkv_proj / gate_up_proj tensors, GQA 4:1, 40 layers.
    "phi-4": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=100352,
        hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=10, rms_norm_eps=1e-5,
        rope_theta=250000.0, max_position_embeddings=16384,
        original_max_position_embeddings=16384, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=100257, eos_token_id=100265,
        pad_token_id=100349,
    ),
    # Gemma 2 9B: windows of 4,096 in every other layer, heads of 256, score and logit caps.
    "gemma2-9b": dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000,
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=8192, query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    ),
    # Gemma 3 1B: windows of 512 in five layers of six, one kv head of 256, q/k norms.
    "gemma3-1b": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144,
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, max_position_embeddings=32768,
        query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    ),
    # Mixture of experts. Mixtral-8x7B: 8 experts of 14336, top 2 (47B parameters, 13B a
    # token; 94 GB in bf16, tensor parallelism's shape on 80 GB cards).
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False,
        sliding_window=None, num_local_experts=8, num_experts_per_tok=2, bos_token_id=1,
        eos_token_id=2,
    ),
    # Qwen3-30B-A3B: 128 experts of 768, top 8 renormalised, every layer sparse (30B
    # parameters, 3B a token).
    "qwen3-30b-a3b": dict(
        _QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    ),
}


def scratch_folder() -> Path:
    """A new temporary folder for a benchmark's dummy checkpoint, removed when the process
    exits (the engine reads it while it runs)."""
    folder = Path(tempfile.mkdtemp(prefix="pagedserve-dummy-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def write_dummy_folder(shape: str, folder: Path) -> Path:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = SHAPES[shape]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    vocab = {f"<{i}>": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = f"<{cfg['eos_token_id']}>"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos).save_pretrained(folder)
    return folder


# EAGLE-3's public Llama-3.1-8B head: one layer of the target's width, 32,000 draft tokens.
EAGLE3_DRAFT_VOCAB = 32000


def write_dummy_eagle3_folder(shape: str, folder: Path) -> Path:
    """The config of an EAGLE-3 head of the public layout for ``shape`` (its weights random,
    as ``--load-format dummy`` makes them)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")
    target = SHAPES[shape]
    cfg = {k: target[k] for k in ("model_type", "rms_norm_eps", "vocab_size", "rope_theta",
                                  "max_position_embeddings", "hidden_size",
                                  "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads")}
    # The public heads' layers (2, L / 2, L - 3), kept inside shallow test shapes.
    layers = target["num_hidden_layers"]
    aux = [min(max(i, 0), layers - 1) for i in (2, layers // 2, layers - 3)]
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
               draft_vocab_size=min(EAGLE3_DRAFT_VOCAB, target["vocab_size"]),
               eagle_config={"eagle_aux_hidden_state_layer_ids": aux})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder
