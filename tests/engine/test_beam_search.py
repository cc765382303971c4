"""Beam search equals Hugging Face transformers' ``generate(num_beams=...)`` token for token."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.kv_checks import assert_pools_full
from tests.tiny_models import VOCAB, write_tiny_model

WIDTH = 4
NEW_TOKENS = 20
# (length_penalty, early_stopping, num_return_sequences)
CASES = [(1.0, False, 4), (0.0, True, 1), (2.0, "never", 4), (-1.0, False, 1),
         (1.0, True, 4), (0.5, "never", 1)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama3"), "llama3")


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_beams(model, prompt: list[int], eos: int, new_tokens: int, length_penalty: float,
             early_stopping: bool | str, n: int) -> list[list[int]]:
    """HF's returned beams, best first, each cut after its stop token (the padding is eos)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), num_beams=WIDTH, num_return_sequences=n, do_sample=False,
            max_new_tokens=new_tokens, length_penalty=length_penalty,
            early_stopping=early_stopping, eos_token_id=eos, pad_token_id=eos)
    beams = [row[len(prompt):] for row in out.tolist()]
    return [b[:b.index(eos) + 1] if eos in b else b for b in beams]


def _beam_params(n: int, length_penalty: float, early_stopping, stop: int) -> SamplingParams:
    return SamplingParams(n=n, best_of=WIDTH, use_beam_search=True, max_tokens=NEW_TOKENS,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          ignore_eos=True, stop_token_ids=[stop])


@pytest.mark.parametrize(("length_penalty", "early_stopping", "n"), CASES)
def test_beam_search_matches_transformers_on_a_random_llama(llama, length_penalty,
                                                              early_stopping, n):
    hf = _hf(llama)
    rng = random.Random(f"{length_penalty}-{early_stopping}-{n}")
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 30))] for _ in range(2)]
    # A stop token the beams actually produce, so hypotheses finish at different lengths.
    stops = [hf_beams(hf, p, 1, NEW_TOKENS, 1.0, False, WIDTH)[rng.randrange(WIDTH)]
             [rng.randrange(2, 10)] for p in prompts]
    llm = LLM(model=str(llama), device="cpu", block_size=4, kv_cache_memory_bytes=4 << 20)
    outputs = llm.generate(prompts, [_beam_params(n, length_penalty, early_stopping, s)
                                     for s in stops], use_tqdm=False)
    for prompt, stop, out in zip(prompts, stops, outputs):
        expected = hf_beams(hf, prompt, stop, NEW_TOKENS, length_penalty, early_stopping, n)
        assert [c.token_ids for c in out.outputs] == expected
        assert all(c.finish_reason == ("stop" if c.token_ids[-1] == stop else "length")
                   for c in out.outputs)
    assert_pools_full(llm.engine.kv)


def test_beam_search_matches_transformers_on_the_default_model(default_model_folder):
    # All four beams, best first (num_return_sequences only slices HF's finished list).
    hf = _hf(default_model_folder)
    llm = LLM(model=str(default_model_folder), device="cpu", kv_cache_memory_bytes=64 << 20)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in ("The capital of France is",
                                                   "def fibonacci(n):")]
    outputs = llm.beam_search(prompts, WIDTH, 16, use_tqdm=False)
    eos = hf.generation_config.eos_token_id
    for prompt, out in zip(prompts, outputs):
        expected = hf_beams(hf, prompt, eos, 16, 1.0, False, WIDTH)
        assert [c.token_ids for c in out.outputs] == expected
        assert out.outputs[0].text == tokenizer.decode(expected[0], skip_special_tokens=True)
    assert_pools_full(llm.engine.kv)
