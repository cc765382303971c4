"""Greedy output of our engine equals Hugging Face transformers with the same weights."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.tiny_models import ARCH_CONFIGS, VOCAB, write_tiny_model

PROMPT_LENS = [3, 17, 40, 77]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=sorted(ARCH_CONFIGS))
def tiny_model(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def _prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


def hf_greedy(folder, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run the full length, like ignore_eos
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_batched(tiny_model):
    prompts = _prompts()
    llm = LLM(model=str(tiny_model), device="cpu", block_size=8,
              kv_cache_memory_bytes=4 << 20)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_model, prompt, NEW_TOKENS)
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_requests_joining_mid_run_match_solo_runs(tiny_model):
    prompts = _prompts(seed=2)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tiny_model), device="cpu", block_size=4,
              kv_cache_memory_bytes=4 << 20, enable_prefix_caching=False)
    solo = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    engine = llm.engine
    results, seqs = {}, {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request joins every third step
            i, p = pending.pop(0)
            engine.add_request(p, params, request_id=str(i))
            seqs[str(i)] = [s.seq for s in engine.outputs.requests[str(i)].seqs]
        for out in engine.step():
            if out.finished:
                results[int(out.request_id)] = out.outputs[0].token_ids
                # A finished request holds no blocks any more.
                assert not any(seq in engine.kv.tables for seq in seqs[out.request_id])
        step += 1
    assert [results[i] for i in range(len(prompts))] == solo
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_preemption_under_tiny_pool_matches_large_pool(tiny_model):
    prompts = _prompts(seed=3)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    big = LLM(model=str(tiny_model), device="cpu", block_size=4, kv_cache_memory_bytes=4 << 20)
    expected = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    # Room for about 1.2 of the longest requests at once: preemption is unavoidable.
    per_block = big.engine.kv_bytes_per_block
    num_blocks = int(1.2 * (max(PROMPT_LENS) + NEW_TOKENS) / 4) + 1
    small = LLM(model=str(tiny_model), device="cpu", block_size=4,
                kv_cache_memory_bytes=num_blocks * per_block)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert small.engine.stats().num_preemptions > 0
    assert small.engine.kv.pool.num_free == small.engine.kv.num_blocks


def test_request_that_can_never_fit_is_rejected(tiny_model):
    probe = LLM(model=str(tiny_model), device="cpu", block_size=4, kv_cache_memory_bytes=1 << 20)
    llm = LLM(model=str(tiny_model), device="cpu", block_size=4,
              kv_cache_memory_bytes=4 * probe.engine.kv_bytes_per_block)
    with pytest.raises(ValueError, match="pool holds 16"):
        llm.generate([list(range(3, 40))], SamplingParams(max_tokens=8), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
