"""KV sharing on a random-weight Llama-3-shaped model: prefix caching, parallel sampling with
copy-on-write, best_of, swap and recompute preemption and chunked prefill give the outputs of
runs without them, and the pools stay exact."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.kv_checks import run_checked
from tests.tiny_models import VOCAB, hf_model, make_llm, random_tokens

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_second_request_with_the_same_prefix_reuses_its_blocks(llama3_folder):
    rng = random.Random(0)
    prefix = random_tokens(rng, 300)
    first, second = prefix + random_tokens(rng, 5), prefix + random_tokens(rng, 7)
    expected = make_llm(llama3_folder, enable_prefix_caching=False).generate(
        [second], GREEDY, use_tqdm=False)
    llm = make_llm(llama3_folder)
    llm.generate([first], GREEDY, use_tqdm=False)
    out = llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[0].outputs[0].token_ids
    # 18 full blocks of 16 tokens are the shared prefix; the 19th mixes in the suffix.
    assert out.metrics.num_cached_tokens == 288
    stats = llm.engine.stats()
    assert stats.prefix_hit_tokens == 288
    assert stats.prefix_hit_rate == pytest.approx(288 / (len(first) + len(second)))


def test_eviction_under_pressure_never_frees_a_block_in_use(llama3_folder):
    rng = random.Random(1)
    common = random_tokens(rng, 64)
    prompts = [common + random_tokens(rng, rng.randint(10, 60)) for _ in range(6)]
    prompts += [random_tokens(rng, rng.randint(30, 90)) for _ in range(4)]
    expected = make_llm(llama3_folder, enable_prefix_caching=False).generate(
        prompts, GREEDY, use_tqdm=False)
    llm = make_llm(llama3_folder, num_blocks=16)  # 256 tokens for ten requests
    got = run_checked(llm.engine, prompts, [GREEDY] * len(prompts))
    assert _token_ids(got) == _token_ids(expected)
    stats = llm.engine.stats()
    assert stats.prefix_hit_tokens > 0 and stats.num_preemptions > 0


def _hf_logprobs(model, prompt: list[int], sample: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + sample])).logits[0].float()
    logprobs = logits.log_softmax(-1)[len(prompt) - 1:-1]
    return logprobs.gather(1, torch.tensor(sample)[:, None])[:, 0].tolist()


def _blocks_used_mid_run(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple:
    engine = llm.engine
    engine.add_request(prompt, params, "mid")
    seq = engine.outputs.requests["mid"].seqs[0].seq
    while seq.num_output_tokens < 8:
        engine.step()
    used, shared = engine.kv.pool.num_used, engine.stats().blocks_shared
    while engine.has_unfinished_requests():
        engine.step()
    return used, shared


def test_parallel_sampling_shares_the_prompt_blocks(llama3_folder):
    prompt = random_tokens(random.Random(2), 200)
    sampled = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True,
                             logprobs=0)
    llm = make_llm(llama3_folder, enable_prefix_caching=False)  # all sharing comes from the fork
    single, _ = _blocks_used_mid_run(llm, prompt, SamplingParams(max_tokens=24, seed=7))
    used, shared = _blocks_used_mid_run(llm, prompt, sampled)
    # 12 full prompt blocks shared, plus each stream's own copy of the partial last block.
    assert used <= 1.5 * single < 4 * single
    assert shared == 12
    first = llm.generate([prompt], sampled, use_tqdm=False)[0]
    again = llm.generate([prompt], sampled, use_tqdm=False)[0]
    assert _token_ids([first]) == _token_ids([again])  # seeded: reproducible
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    hf = hf_model(llama3_folder)
    for sample in first.outputs:
        assert len(sample.token_ids) == 24 and all(0 <= t < VOCAB for t in sample.token_ids)
        ours = [entry[t].logprob for t, entry in zip(sample.token_ids, sample.logprobs)]
        # Every stream's keys and values were right: HF scores its tokens the same way.
        assert ours == pytest.approx(_hf_logprobs(hf, prompt, sample.token_ids), abs=1e-4)
        assert sample.cumulative_logprob == pytest.approx(sum(ours), abs=1e-3)


def test_best_of_returns_the_n_most_likely_samples(llama3_folder):
    prompt = random_tokens(random.Random(3), 40)
    llm = make_llm(llama3_folder)
    # logprobs=0: the cumulative logprobs best_of ranks by are reported.
    every = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12,
                                                  ignore_eos=True, logprobs=0),
                         use_tqdm=False)[0]
    best = llm.generate([prompt], SamplingParams(n=2, best_of=4, temperature=1.0, seed=11,
                                                 max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0]
    ranked = sorted(every.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]


def _mixed_workload(rng: random.Random) -> tuple[list, list[SamplingParams]]:
    prompts = [random_tokens(rng, n) for n in (3, 17, 40, 77, 25, 33)]
    beam = SamplingParams(n=2, best_of=2, use_beam_search=True, max_tokens=24,
                          ignore_eos=True)
    pair = SamplingParams(n=2, max_tokens=24, temperature=0.0, ignore_eos=True)
    return prompts, [GREEDY, GREEDY, GREEDY, GREEDY, pair, beam]


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preemption_under_a_tiny_pool_matches_an_unconstrained_run(llama3_folder, mode):
    prompts, params = _mixed_workload(random.Random(4))
    expected = make_llm(llama3_folder, block_size=4).generate(prompts, params, use_tqdm=False)
    # 36 blocks of 4 tokens: the largest request (77 + 24 tokens) fits, two of them do not.
    llm = make_llm(llama3_folder, num_blocks=36, block_size=4, preemption_mode=mode,
                   swap_space=0.001)
    swaps = _count_swaps(llm)
    got = run_checked(llm.engine, prompts, params)
    assert _token_ids(got) == _token_ids(expected)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_swapped == 0
    assert (swaps["out"] > 0) == (mode != "recompute")
    assert swaps["out"] == swaps["in"]


def _count_swaps(llm: LLM) -> dict[str, int]:
    kv, counts = llm.engine.kv, {"out": 0, "in": 0}
    swap_out, swap_in = kv.swap_out, kv.swap_in

    def counted_out(requests):
        counts["out"] += 1
        swap_out(requests)

    def counted_in(requests):
        counts["in"] += 1
        swap_in(requests)

    kv.swap_out, kv.swap_in = counted_out, counted_in
    return counts


def test_chunked_prefill_matches_whole_prompts(llama3_folder):
    rng = random.Random(5)
    prompts = [random_tokens(rng, n) for n in (40, 77, 120, 5, 9)]
    whole = make_llm(llama3_folder, enable_chunked_prefill=False, max_model_len=256,
                     max_num_batched_tokens=256)
    chunked = make_llm(llama3_folder, max_num_batched_tokens=32)
    batches = []
    schedule = chunked.engine.scheduler.schedule

    def recording_schedule(**kwargs):
        out = schedule(**kwargs)
        batches.append([s.num_new_tokens for s in out.scheduled])
        return out

    chunked.engine.scheduler.schedule = recording_schedule
    expected = whole.generate(prompts, GREEDY, use_tqdm=False)
    got = chunked.generate(prompts, GREEDY, use_tqdm=False)
    assert _token_ids(got) == _token_ids(expected)
    assert max(sum(b) for b in batches) <= 32
    # Decodes run in the same steps as prompt chunks that fill the rest of the budget.
    assert any(1 in b and sum(b) == 32 for b in batches)
