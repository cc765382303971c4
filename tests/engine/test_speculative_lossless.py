"""Sampling with drafts is lossless through the whole engine: over 1,500 seeded requests at
temperature 0.2 and top-p 0.9 on a random Llama, the tokens at each of the first positions
are distributed as without speculation (a two-sample chi-square test), while drafts are
verified and partly accepted; the same test rejects a lossy acceptance rule (accept every
draft the target gives any probability) by many orders of magnitude.

Seeded, so every run draws the same samples: the test cannot fail now and then, only on a
change of what the engine computes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from pagedserve import SamplingParams
from pagedserve.sample import rejection
from tests.tiny_models import make_llm, random_prompts

NUM_REQUESTS = 1500
NEW_TOKENS = 4
P_MIN = 1e-6  # a false alarm is a once-in-a-million draw, and the draws are fixed


class FixedDrafts:
    """Each row's drafts: the prompt's greedy continuation from where the row is, so a
    sampled row whose tokens follow it is offered the likely next ones."""

    def __init__(self, prompt_len: int, continuation: list[int]) -> None:
        self.prompt_len, self.continuation = prompt_len, continuation

    def propose(self, batch):
        return [np.asarray(self.continuation[len(t) - self.prompt_len:][:k], dtype=np.int64)
                for t, k in zip(batch.token_ids, batch.num_tokens, strict=True)]


class FreeDrafts:
    """A step-time model in which drafts cost nothing (``spec_decode/policy.py``)."""

    def record(self, num_tokens: int, verifies: bool, seconds: float) -> None:
        pass

    def coefficients(self) -> tuple[float, float, float]:
        return 1.0, 0.0, 0.0


def _samples(llm, prompt, first_seed: int) -> list[tuple[int, ...]]:
    """Seeds ``first_seed, first_seed + 1, ...``: the two engines' samples must be
    independent for the test (the same seed draws the same token where no draft is
    verified)."""
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.2, top_p=0.9,
                             seed=first_seed + i, ignore_eos=True)
              for i in range(NUM_REQUESTS)]
    outputs = llm.generate([prompt] * NUM_REQUESTS, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outputs]


def two_sample_p_value(a: list, b: list, min_count: int = 20) -> float:
    """Chi-square test that two equal-sized samples share one distribution; cells with fewer
    than ``min_count`` draws in both together are pooled into one."""
    ca, cb = Counter(a), Counter(b)
    big = [x for x in ca.keys() | cb.keys() if ca[x] + cb[x] >= min_count]
    rest_a, rest_b = len(a) - sum(ca[x] for x in big), len(b) - sum(cb[x] for x in big)
    cells = [(ca[x], cb[x]) for x in big] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)
    return float(chi2.sf(stat, len(cells) - 1))


def _p_values(plain, spec) -> list[float]:
    """Each position's marginal, and the first two positions jointly."""
    values = [two_sample_p_value([s[j] for s in plain], [s[j] for s in spec])
              for j in range(NEW_TOKENS)]
    return values + [two_sample_p_value([s[:2] for s in plain], [s[:2] for s in spec])]


@pytest.fixture(scope="module")
def setup(llama3_folder):
    prompt = random_prompts("lossless", [6])[0]
    plain_llm = make_llm(llama3_folder, max_num_seqs=256)
    greedy = plain_llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                         ignore_eos=True), use_tqdm=False)
    continuation = greedy[0].outputs[0].token_ids
    return llama3_folder, prompt, continuation, _samples(plain_llm, prompt, 0)


def _spec_llm(folder, prompt, continuation):
    llm = make_llm(folder, max_num_seqs=256,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.engine.speculation.proposer = FixedDrafts(len(prompt), continuation)
    # Every draft verified, whatever the steps take: the draws depend on nothing timed.
    llm.engine.speculation.step_times = FreeDrafts()
    return llm


def test_sampling_with_drafts_matches_sampling_without(setup):
    folder, prompt, continuation, plain = setup
    llm = _spec_llm(folder, prompt, continuation)
    spec = _samples(llm, prompt, NUM_REQUESTS)
    c = llm.engine.speculation.counters
    assert c.num_draft_tokens > 2000 and c.num_accepted_tokens > 100  # drafts are verified
    assert min(_p_values(plain, spec)) > P_MIN


def accept_every_draft(logits, meta, drafts, draft_probs=None, draws=None):
    """A lossy rule: the rejection sampler with every acceptance draw at 0, so every draft
    the target gives any probability is kept (and q > 0 always passes)."""
    width = meta.positions.max_positions if meta.positions is not None else 1
    zeros = torch.zeros(drafts.shape[0], width - 1)
    noise = torch.empty(drafts.shape[0], logits.shape[-1]).exponential_()
    return rejection.rejection_sample(logits, meta, drafts, draft_probs,
                                      rejection.Draws(zeros, noise))


def test_a_lossy_acceptance_rule_fails_the_same_test(setup, monkeypatch):
    folder, prompt, continuation, plain = setup
    monkeypatch.setattr("pagedserve.worker.model_runner.rejection_sample", accept_every_draft)
    spec = _samples(_spec_llm(folder, prompt, continuation), prompt, NUM_REQUESTS)
    assert min(_p_values(plain, spec)) < 1e-12
