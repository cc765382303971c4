"""Greedy output of our engine equals Hugging Face transformers with the same weights."""

from __future__ import annotations

import pytest
import torch

from pagedserve import SamplingParams
from tests.tiny_models import ARCH_CONFIGS, hf_greedy, hf_model, make_llm, random_prompts

PROMPT_LENS = [3, 17, 40, 77]
NEW_TOKENS = 24


@pytest.fixture(params=sorted(ARCH_CONFIGS))
def tiny_model(request, tiny_model_folder):
    return tiny_model_folder(request.param)


def _prompts(seed: int = 1) -> list[list[int]]:
    return random_prompts(seed, PROMPT_LENS)


def test_greedy_matches_transformers_batched(tiny_model):
    prompts = _prompts()
    llm = make_llm(tiny_model, block_size=8)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model(tiny_model), prompt, NEW_TOKENS)
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def _assert_logprobs(got: dict, reference: torch.Tensor) -> None:
    """Every logprob an engine position reports (its token and the top ones) equals
    transformers' log-softmax at that position."""
    for token_id, logprob in got.items():
        assert logprob.logprob == pytest.approx(reference[token_id].item(), abs=1e-4)


def test_logprobs_match_transformers_through_chunks_and_a_cached_prefix(tiny_model):
    """Logits, not just argmaxes, in float32: prompt logprobs of a prefill run in chunks of
    16 tokens across blocks of 8, the decode steps' logprobs (each step reading the paged
    cache), and a second prompt whose first 32 tokens are a prefix-cache hit."""
    prefix = random_prompts("logits-prefix", [37])[0]
    first, second = (prefix + tail for tail in random_prompts("logits-tails", [6, 11]))
    llm = make_llm(tiny_model, block_size=8, max_num_batched_tokens=16)
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    for prompt, extra in ((first, {"prompt_logprobs": 3}), (second, {})):
        out = llm.generate([prompt], SamplingParams(**greedy, **extra), use_tqdm=False)[0]
        tokens = prompt + out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf_model(tiny_model)(torch.tensor([tokens[:-1]])).logits[0]
        reference = logits.double().log_softmax(-1)  # [i]: the next token after tokens[i]
        assert len(out.prompt_logprobs or prompt) == len(prompt)
        for i, got in enumerate(out.prompt_logprobs or []):
            if got is not None:  # the first position has none
                _assert_logprobs(got, reference[i - 1])
        for j, got in enumerate(out.outputs[0].logprobs):
            _assert_logprobs(got, reference[len(prompt) - 1 + j])
    assert llm.engine.kv.prefix_stats.hit_tokens >= 32


def test_requests_joining_mid_run_match_solo_runs(tiny_model):
    prompts = _prompts(seed=2)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm = make_llm(tiny_model, block_size=4, enable_prefix_caching=False)
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
    big = make_llm(tiny_model, block_size=4)
    expected = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    # Room for about 1.2 of the longest requests at once: preemption is unavoidable.
    num_blocks = int(1.2 * (max(PROMPT_LENS) + NEW_TOKENS) / 4) + 1
    small = make_llm(tiny_model, num_blocks=num_blocks, block_size=4)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert small.engine.stats().num_preemptions > 0
    assert small.engine.kv.pool.num_free == small.engine.kv.num_blocks


def test_request_that_can_never_fit_is_rejected(tiny_model):
    """A pool of 16 tokens: the context length is lowered to it (requests that leave
    max_tokens unset still run), a longer prompt is refused by it, and so is a request whose
    best_of copies could not all fit."""
    llm = make_llm(tiny_model, num_blocks=4, block_size=4)
    assert llm.engine.max_model_len == 16
    with pytest.raises(ValueError, match="context length is 16"):
        llm.generate([list(range(3, 40))], SamplingParams(max_tokens=8), use_tqdm=False)
    with pytest.raises(ValueError, match="pool holds 16"):
        llm.generate([list(range(3, 11))], SamplingParams(max_tokens=4, n=3), use_tqdm=False)
    out = llm.generate([list(range(3, 11))], SamplingParams(max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8  # to the lowered context length
    assert not llm.engine.has_unfinished_requests()


def test_a_context_length_the_cache_cannot_hold_is_refused(tiny_model):
    with pytest.raises(ValueError, match="--max-model-len 64 does not fit in the KV cache, "
                                         "which holds 16 tokens"):
        make_llm(tiny_model, num_blocks=4, block_size=4, max_model_len=64)


def test_greedy_matches_transformers_with_shape_bucketing(tiny_model_folder):
    """Padded steps (the HPU default, here on the CPU's own kernels): requests joining while
    others decode, so steps mix prompt chunks and decodes, all padded."""
    folder = tiny_model_folder("llama3")
    llm = make_llm(folder, block_size=8, shape_bucketing=True, max_num_seqs=3,
                   max_num_batched_tokens=32)
    assert llm.engine.executor.runner.buckets is not None
    prompts = _prompts(seed=4)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model(folder), prompt, NEW_TOKENS)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks
