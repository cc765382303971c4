"""The drafts' policy: the greedy choice of drafts equals the best allocation found by brute
force under the same cost model, the fit recovers a step's fixed and per-token time, and the
choice goes from every draft at batch 1 on a memory-bound step to none in a compute-bound
batch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pagedserve.spec_decode.policy import Acceptance, StepTimeModel, choose_num_drafts


def _rate(rates, ks, base_tokens, fixed, per_token):
    output = len(rates) + sum(sum(r ** (j + 1) for j in range(k)) for r, k in zip(rates, ks))
    return output / (fixed + per_token * (base_tokens + sum(ks)))


@pytest.mark.parametrize("seed", range(20))
def test_the_choice_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    rates = rng.uniform(0.05, 0.95, size=3)
    available = rng.integers(0, 4, size=3)
    fixed, per_token = rng.uniform(0.5, 2.0), rng.uniform(0.0, 0.3)
    chosen = choose_num_drafts(rates, available, 3, 3.0, fixed, per_token)
    best = max(_rate(rates, ks, 3, fixed, per_token)
               for ks in itertools.product(*(range(a + 1) for a in available)))
    assert np.all(chosen <= available)
    assert _rate(rates, chosen, 3, fixed, per_token) == pytest.approx(best, rel=1e-12)


def test_memory_bound_steps_take_every_likely_draft_and_compute_bound_ones_none():
    rates, available = np.full(1, 0.7), np.full(1, 4)
    assert choose_num_drafts(rates, available, 1, 1.0, 1.0, 0.01).tolist() == [4]
    rates, available = np.full(256, 0.7), np.full(256, 4)
    assert choose_num_drafts(rates, available, 256, 256.0, 1.0, 0.01).sum() == 0


def test_the_step_time_fit_recovers_fixed_and_per_token_time():
    model = StepTimeModel()
    assert model.coefficients() == (1.0, 0.0)  # untimed: drafts look free, so they are tried
    for tokens in [1, 5, 9, 64, 2, 33] * 10:
        model.record(tokens, 0.004 + 0.0002 * tokens)
    fixed, per_token = model.coefficients()
    assert fixed == pytest.approx(0.004, rel=1e-6) and per_token == pytest.approx(0.0002,
                                                                                 rel=1e-6)
    steady = StepTimeModel()
    for _ in range(10):
        steady.record(8, 0.01)
    assert steady.coefficients() == (pytest.approx(0.01), 0.0)  # one size: no slope to see


def test_acceptance_starts_from_the_batch_rate_and_learns_each_sequence():
    acceptance = Acceptance()
    a, b = object(), object()
    for _ in range(20):
        acceptance.record(a, 4, 4)
    assert acceptance.rate(a) > 0.9
    assert 0.8 < acceptance.rate(b) < acceptance.rate(a)  # the batch's rate, shrunk
    acceptance.forget(a)
    assert acceptance.rate(a) == acceptance.rate(b)
