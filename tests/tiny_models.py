"""Random-weight checkpoints of real architectures, written as Hugging Face folders."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 384

ARCH_CONFIGS = {
    # Llama-3 shape: GQA 4:1, llama3 rope scaling, untied embeddings.
    "llama3": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=1024, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=256),
    ),
    # Qwen2 shape: q/k/v biases, tied embeddings, GQA 2:1.
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64,
        intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=1024, tie_word_embeddings=True, use_sliding_window=False,
        sliding_window=None,
    ),
    # Mistral shape: GQA 4:1, head_dim 16, no sliding window in the tested range.
    "mistral": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=64,
        intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=1024, tie_word_embeddings=False, sliding_window=None,
    ),
}


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, paged attention",
              "naïve café – 日本語 テスト 🚀✨", "serving large language models fast"] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def write_tiny_model(folder: Path, arch: str, seed: int = 0) -> Path:
    """A random-weight float32 checkpoint plus a small byte-level BPE tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    cfg_dict = dict(ARCH_CONFIGS[arch], vocab_size=VOCAB, bos_token_id=0, eos_token_id=1)
    model_type = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger than the default init so greedy choices are decisive, not near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    _train_tokenizer().save_pretrained(folder)
    return folder
