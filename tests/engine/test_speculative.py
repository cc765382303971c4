"""Speculative decoding through the engine (n-gram drafts, verified by the rejection sampler):
greedy output equals transformers' own greedy output on random Llama, Qwen2, Qwen3 and Gemma
models, with drafts that are partly right, whatever else the engine does meanwhile
(prefix-cache hits, chunked prefill, preemption by swap and by recompute, n=3, stop strings
inside an accepted run); on the default model with real copy-heavy prompts the n-gram
drafts are accepted and the text equals the engine's without speculation."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.spec_decode.proposer import ProposalBatch
from tests.engine.test_speculative_lossless import FreeDrafts
from tests.kv_checks import assert_pools_full
from tests.tiny_models import assert_greedy_matches, hf_model, make_llm, random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


class OracleProposer:
    """Drafts from known continuations (the reference's greedy tokens), every third one wrong,
    so verify steps accept some drafts and reject others."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations
        self.proposed = 0

    def propose(self, batch: ProposalBatch) -> list[np.ndarray]:
        drafts = []
        for tokens, k in zip(batch.token_ids, batch.num_tokens, strict=True):
            draft = []
            for prompt, ref in self.continuations.items():
                if len(tokens) > len(prompt) and tuple(tokens[:len(prompt)]) == prompt:
                    done = len(tokens) - len(prompt)
                    draft = list(ref[done:done + k])
                    if len(tokens) % 3 == 0 and draft:
                        draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 300
            self.proposed += len(draft)
            drafts.append(np.asarray(draft, dtype=np.int64))
        return drafts


def _oracle_llm(folder, prompts, new_tokens, **options):
    reference = make_llm(folder, **{k: v for k, v in options.items() if k != "num_blocks"})
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs = reference.generate(prompts, params, use_tqdm=False)
    reference.shutdown()  # a tensor-parallel engine holds the process's one process group
    llm = make_llm(folder, speculative_config=NGRAM, **options)
    oracle = OracleProposer({tuple(p): o.outputs[0].token_ids
                             for p, o in zip(prompts, outputs, strict=True)})
    llm.engine.speculation.proposer = oracle
    llm.engine.speculation.step_times = FreeDrafts()  # what is drafted depends on no timing
    return llm, oracle


def _counters(llm):
    return llm.engine.speculation.counters


# Gemma 2 and 3: verify steps past the sliding window (of 8) of their local layers.
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_greedy_with_drafts_equals_transformers(tiny_model_folder, arch):
    folder = tiny_model_folder(arch)
    prompts = random_prompts(arch, [5, 17, 33, 9])
    llm, oracle = _oracle_llm(folder, prompts, 24)
    assert assert_greedy_matches(llm, hf_model(folder), prompts, new_tokens=24) == len(prompts)
    c = _counters(llm)
    assert oracle.proposed > 0 and 0 < c.num_accepted_tokens < c.num_draft_tokens
    assert_pools_full(llm.engine.kv)


MECHANISMS = ["prefix_hits", "chunked_prefill", "swap", "recompute"]


def mechanism_options(case: str, num_blocks: int = 8) -> dict:
    """Engine options under which ``case`` happens to the prompts of ``mechanism_prompts``."""
    return {
        "prefix_hits": {},
        "chunked_prefill": {"max_num_batched_tokens": 16},
        "swap": {"num_blocks": num_blocks, "preemption_mode": "swap", "swap_space": 0.01,
                 "enable_prefix_caching": False},
        "recompute": {"num_blocks": num_blocks, "preemption_mode": "recompute",
                      "enable_prefix_caching": False},
    }[case]


def mechanism_prompts(seed: str) -> list[list[int]]:
    shared = random_prompts(f"{seed}-shared", [40])[0]
    return [shared + p for p in random_prompts(seed, [3, 9, 6, 12])] + [shared]


def assert_greedy_through_mechanism(llm, folder, prompts, case: str) -> None:
    """Greedy output equals transformers' while ``case`` happens (checked in the stats)."""
    if case == "prefix_hits":  # the prefixes are cached by a first run
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert assert_greedy_matches(llm, hf_model(folder), prompts, new_tokens=20) == len(prompts)
    stats = llm.engine.stats()
    if case == "prefix_hits":
        assert stats.prefix_hit_tokens > 0
    if case in ("swap", "recompute"):
        assert stats.num_preemptions > 0
    assert_pools_full(llm.engine.kv)


@pytest.mark.parametrize("case", MECHANISMS)
def test_greedy_with_drafts_through_the_engine_s_other_mechanisms(llama3_folder, case):
    prompts = mechanism_prompts(case)
    llm, _ = _oracle_llm(llama3_folder, prompts, 20, **mechanism_options(case))
    assert_greedy_through_mechanism(llm, llama3_folder, prompts, case)
    assert _counters(llm).num_accepted_tokens > 0


def assert_n_3_greedy_equals_one_and_seeded_repeats(llm, folder, prompts) -> None:
    """Greedy n=3 gives the plain engine's one greedy text three times; seeded n=3 sampling
    gives the same three texts twice."""
    greedy = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, n=3,
                                                  ignore_eos=True), use_tqdm=False)[0]
    single = make_llm(folder).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    assert [c.token_ids for c in greedy.outputs] == [single] * 3
    params = SamplingParams(max_tokens=12, temperature=0.8, n=3, seed=5, ignore_eos=True)
    sampled = llm.generate(prompts, params, use_tqdm=False)[0]
    again = llm.generate(prompts, params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in sampled.outputs] == [12] * 3
    assert [c.token_ids for c in sampled.outputs] == [c.token_ids for c in again.outputs]
    assert_pools_full(llm.engine.kv)


def test_n_3_seeded_sampling_runs_and_greedy_n_3_equals_one(llama3_folder):
    prompts = random_prompts("n3", [7])
    llm, _ = _oracle_llm(llama3_folder, prompts, 12)
    assert_n_3_greedy_equals_one_and_seeded_repeats(llm, llama3_folder, prompts)


COPY_PROMPTS = [
    "Repeat this text exactly: The quick brown fox jumps over the lazy dog. Pack my box with "
    "five dozen liquor jugs.",
    "Copy this code without changes:\ndef add(a, b):\n    return a + b\n\ndef mul(a, b):\n"
    "    return a * b\n",
]


@pytest.fixture(scope="module")
def default_spec_llm(default_model_folder):
    # float32 activations: the plain engine it is compared with is dense float32, which int8
    # activations would move greedy tokens away from (docs/platforms.md)
    llm = LLM(model=str(default_model_folder), device="cpu", kv_cache_memory_bytes=64 << 20,
              speculative_config=NGRAM, int8_activations=False)
    llm.engine.speculation.step_times = FreeDrafts()  # what is drafted depends on no timing
    yield llm
    llm.shutdown()


def test_default_model_ngram_drafts_are_accepted_and_the_text_is_unchanged(default_llm,
                                                                           default_spec_llm):
    messages = [[{"role": "user", "content": p}] for p in COPY_PROMPTS]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = default_llm.chat(messages, params, use_tqdm=False)
    spec = default_spec_llm.chat(messages, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    c = _counters(default_spec_llm)
    assert c.num_drafts > 0 and c.mean_acceptance_length > 1.5


def test_a_stop_string_inside_an_accepted_run_ends_the_text_there(default_llm,
                                                                  default_spec_llm):
    messages = [[{"role": "user", "content": COPY_PROMPTS[0]}]]
    full = default_llm.chat(messages, SamplingParams(max_tokens=48, temperature=0.0),
                            use_tqdm=False)[0].outputs[0].text
    stop = " over"
    assert stop in full
    before = _counters(default_spec_llm).num_accepted_tokens
    params = SamplingParams(max_tokens=48, temperature=0.0, stop=[stop])
    plain = default_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    spec = default_spec_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert spec.text == plain.text == full[:full.index(stop)]
    assert spec.finish_reason == "stop" and spec.token_ids == plain.token_ids
    assert _counters(default_spec_llm).num_accepted_tokens > before
    assert_pools_full(default_spec_llm.engine.kv)


class CostlyDrafts:
    """A step-time model under which every token costs as much as the step: no draft pays."""

    def record(self, num_tokens: int, verifies: bool, seconds: float) -> None:
        pass

    def coefficients(self) -> tuple[float, float, float]:
        return 1.0, 1.0, 0.0


def test_speculation_pauses_and_runs_ahead_while_drafts_do_not_pay(llama3_folder):
    """With async scheduling on, steps that may verify drafts run one at a time; once the
    policy verifies none although drafts were proposed, the engine schedules ahead again
    (a step left in flight), and the greedy tokens stay transformers'."""
    prompts = random_prompts("pause", [6, 11])
    llm, oracle = _oracle_llm(llama3_folder, prompts, 16, async_scheduling=True)
    engine = llm.engine
    engine.speculation.step_times = CostlyDrafts()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    ran_ahead = False
    while engine.has_unfinished_requests():
        engine.step()
        ran_ahead |= engine._in_flight is not None
    assert oracle.proposed > 0 and _counters(llm).num_drafts == 0 and ran_ahead
    assert assert_greedy_matches(llm, hf_model(llama3_folder), prompts, new_tokens=16) \
        == len(prompts)


@pytest.mark.slow
def test_greedy_with_drafts_under_tensor_parallelism(llama3_folder):
    """TP=2 over gloo: the planned verify chunks reach rank 1 as host data and the ranks
    stay in step through verify steps and take-backs."""
    prompts = random_prompts("tp", [5, 17, 9])
    llm, _ = _oracle_llm(llama3_folder, prompts, 16, tensor_parallel_size=2)
    assert_greedy_with_accepted_drafts_then_shut_down(llm, llama3_folder, prompts)


def assert_greedy_with_accepted_drafts_then_shut_down(llm, folder, prompts) -> None:
    """For a tensor-parallel engine, which holds the process's one process group."""
    try:
        assert assert_greedy_matches(llm, hf_model(folder), prompts, new_tokens=16) \
            == len(prompts)
        assert _counters(llm).num_accepted_tokens > 0
    finally:
        llm.shutdown()
