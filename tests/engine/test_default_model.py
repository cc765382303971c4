"""The default model (SmolLM2-135M-Instruct from its GGUF) through our engine and through HF
transformers on the same converted weights: greedy tokens equal, prompts batched together."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged attention and memory blocks that never fragment.",
    "1, 2, 3, 4,",
    "In the beginning of the twentieth century, physicists were puzzled by several "
    "experimental results that classical mechanics could not explain. Among them was",
]
NEW = 16


@pytest.fixture(scope="module")
def llm(default_model_folder):
    return LLM(model=str(default_model_folder), device="cpu", kv_cache_memory_bytes=256 << 20)


def test_greedy_matches_transformers_on_default_model(llm, default_model_folder):
    from transformers import AutoModelForCausalLM

    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(default_model_folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(PROMPTS, outputs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                              pad_token_id=tok.eos_token_id)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids,
                                                 skip_special_tokens=True)


def test_chat_template_answers(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")
