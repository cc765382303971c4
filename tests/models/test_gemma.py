"""Gemma 2, Gemma 3 and the Mistral and Phi-3 sliding windows through the engine, against
transformers' float64 model of the same random weights (tests/tiny_models.py). Windows of 8
under prompts of up to 77 tokens, run in chunks of 16 over blocks of 8, so chunks start
mid-window and windows mid-block; with a cached prefix, and decode steps reading the window
out of the paged cache. The engine computes in float32: within 1e-4 of float64 in every
logprob, where the same model without its window is off by far more. And the language model
of a Gemma3ForConditionalGeneration checkpoint, as transformers saves it and as Gemma 3
4B-27B are published."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.tiny_models import (
    ARCH_CONFIGS,
    REFERENCE_ATTENTION,
    VOCAB,
    assert_greedy_matches,
    decode_logprob_error,
    hf_model_float64,
    make_llm,
    prompt_logprob_error,
    random_prompts,
    save_tokenizer,
    write_tiny_model,
)

# Architecture -> config overrides: Gemma's own windows of 8 (tiny_models), and Mistral's and
# Phi-3's (every layer) cut down to 8.
WINDOWED = {"gemma2": {}, "gemma3": {}, "mistral": {"sliding_window": 8},
            "phi3": {"sliding_window": 8}}
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed(request, tiny_model_folder, tmp_path_factory):
    arch, overrides = request.param, WINDOWED[request.param]
    if not overrides:
        return tiny_model_folder(arch)
    return write_tiny_model(tmp_path_factory.mktemp(f"{arch}-window"), arch, **overrides)


@pytest.fixture(scope="module")
def hf64(windowed):
    return hf_model_float64(windowed)


def _engine(folder, **options):
    return make_llm(folder, block_size=8, max_num_batched_tokens=16, **options)


def test_prompt_logprobs_match_float64_and_need_the_window(windowed, hf64):
    """Prompts of 30 and 77 tokens in chunks of 16: every prompt logprob within TOL of
    float64; transformers with the window opened past the prompt differs by over 1e-2, so the
    comparison sees the window."""
    from transformers import AutoModelForCausalLM

    llm = _engine(windowed)
    prompts = random_prompts("window-prompts", [30, 77])
    for prompt in prompts:
        assert prompt_logprob_error(llm, hf64, prompt) < TOL
    unwindowed = AutoModelForCausalLM.from_pretrained(
        windowed, dtype=torch.float64, attn_implementation=REFERENCE_ATTENTION,
        sliding_window=1024).eval()
    assert prompt_logprob_error(llm, unwindowed, prompts[1]) > 1e-2


def test_decode_past_the_window_from_a_cached_prefix(windowed, hf64):
    """Two prompts sharing 37 tokens, the second's prefix from the cache: 20 greedy tokens
    each equal transformers' (float64) and their logprobs are within TOL."""
    shared = random_prompts("window-shared", [37])[0]
    first, second = (shared + tail for tail in random_prompts("window-tails", [5, 12]))
    llm = _engine(windowed)
    assert decode_logprob_error(llm, hf64, first, 20) < TOL
    assert decode_logprob_error(llm, hf64, second, 20) < TOL
    assert llm.engine.kv.prefix_stats.hit_tokens >= 32
    assert assert_greedy_matches(llm, hf64, [first, second], new_tokens=20) == 2


def _write_multimodal_gemma3(folder, published: bool):
    """A random Gemma3ForConditionalGeneration (a tiny SigLIP vision tower, tiny_models'
    gemma3 as its language model) saved by transformers; ``published``: rewritten as the
    Gemma 3 4B-27B checkpoints are published, their ``text_config`` listing only what differs
    from transformers' defaults and their tensors named ``language_model.model.*``,
    ``vision_tower.*``, ``multi_modal_projector.*``."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig

    text = {**copy.deepcopy(ARCH_CONFIGS["gemma3"]), "vocab_size": VOCAB, "bos_token_id": 0,
            "eos_token_id": 1}
    del text["architectures"], text["model_type"]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=16)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                          eoi_token_index=VOCAB - 2, eos_token_id=1, bos_token_id=0)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    if published:
        cfg = json.loads((folder / "config.json").read_text())
        defaults = Gemma3TextConfig().to_dict()
        text = {k: v for k, v in cfg["text_config"].items()
                if k == "model_type" or defaults.get(k) != v}
        del text["layer_types"], text["rope_parameters"]  # transformers 5's forms
        cfg["text_config"] = {**text, "sliding_window_pattern": 2,
                              "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
        (folder / "config.json").write_text(json.dumps(cfg))
        tensors = load_file(folder / "model.safetensors")
        renamed = {(name.replace("model.language_model.", "language_model.model.")
                    .replace("model.vision_tower.", "vision_tower.")
                    .replace("model.multi_modal_projector.", "multi_modal_projector.")): t
                   for name, t in tensors.items()}
        assert any(n.startswith("language_model.model.layers.") for n in renamed)
        save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    save_tokenizer(folder)
    return folder


@pytest.mark.parametrize("published", [False, True], ids=["saved", "published"])
def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path, published):
    """The text part of a Gemma3ForConditionalGeneration checkpoint: prompt and decode
    logprobs within TOL of transformers' multimodal model (float64) on text alone, its
    vision tensors never loaded."""
    from transformers import Gemma3ForConditionalGeneration

    folder = _write_multimodal_gemma3(tmp_path / "gemma3-mm", published)
    hf = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float64).eval()
    llm = _engine(folder)
    arch = llm.engine.executor.runner.arch
    assert (arch.architecture, arch.sliding_layers, arch.rope_local_theta) == (
        "Gemma3ForCausalLM", (0, 2), 1e4)
    prompt = random_prompts("multimodal", [45])[0]
    assert prompt_logprob_error(llm, hf, prompt) < TOL
    assert decode_logprob_error(llm, hf, prompt, 8) < TOL
