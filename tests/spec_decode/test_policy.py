"""The drafts' policy: the greedy choice of drafts equals the best allocation found by brute
force under the same cost model, the fit recovers a step's fixed and per-token time, and the
choice goes from every draft at batch 1 on a memory-bound step to none in a compute-bound
batch; each LoRA adapter's acceptance is its own prior; a sequence whose drafts were dropped
is tried again."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest

from pagedserve.core.sequence import Sequence, SequenceGroup
from pagedserve.engine.speculation import Speculation
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.policy import Acceptance, StepTimeModel, choose_num_drafts
from pagedserve.worker.step import HostSamples, StepResult


def _rate(rates, ks, base_tokens, fixed, per_token, verify):
    output = len(rates) + sum(sum(r ** (j + 1) for j in range(k)) for r, k in zip(rates, ks))
    return output / (fixed + per_token * (base_tokens + sum(ks)) + verify * (sum(ks) > 0))


@pytest.mark.parametrize("seed", range(20))
def test_the_choice_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    rates = rng.uniform(0.05, 0.95, size=3)
    available = rng.integers(0, 4, size=3)
    fixed, per_token = rng.uniform(0.5, 2.0), rng.uniform(0.0, 0.3)
    verify = rng.uniform(0.0, 1.0) if seed % 2 else 0.0
    chosen = choose_num_drafts(rates, available, 3, 3.0, fixed, per_token, verify)
    best = max(_rate(rates, ks, 3, fixed, per_token, verify)
               for ks in itertools.product(*(range(a + 1) for a in available)))
    assert np.all(chosen <= available)
    assert _rate(rates, chosen, 3, fixed, per_token, verify) == pytest.approx(best, rel=1e-12)


def test_memory_bound_steps_take_every_likely_draft_and_compute_bound_ones_none():
    rates, available = np.full(1, 0.7), np.full(1, 4)
    assert choose_num_drafts(rates, available, 1, 1.0, 1.0, 0.01).tolist() == [4]
    rates, available = np.full(256, 0.7), np.full(256, 4)
    assert choose_num_drafts(rates, available, 256, 256.0, 1.0, 0.01).sum() == 0
    # A verify step's own overhead: worth it for likely drafts, not for unlikely ones.
    assert choose_num_drafts(np.full(1, 0.9), available[:1], 1, 1.0, 1.0, 0.0, 1.5).sum() == 4
    assert choose_num_drafts(np.full(1, 0.3), available[:1], 1, 1.0, 1.0, 0.0, 1.5).sum() == 0


def test_the_step_time_fit_recovers_fixed_per_token_and_verify_time():
    model = StepTimeModel()
    assert model.coefficients() == (1.0, 0.0, 0.0)  # untimed: drafts look free: tried
    for tokens, verifies in [(1, False), (5, True), (9, True), (64, False), (2, True),
                             (33, False)] * 10:
        model.record(tokens, verifies, 0.004 + 0.0002 * tokens + 0.003 * verifies)
    fixed, per_token, verify = model.coefficients()
    assert fixed == pytest.approx(0.004, rel=1e-6)
    assert per_token == pytest.approx(0.0002, rel=1e-6)
    assert verify == pytest.approx(0.003, rel=1e-6)
    steady = StepTimeModel()
    for _ in range(10):
        steady.record(8, False, 0.01)
    fixed, per_token, verify = steady.coefficients()  # one size: the time is shared out
    assert fixed + 8 * per_token == pytest.approx(0.01) and verify == 0.0


@dataclass(eq=False)
class _Seq:
    lora_request: LoRARequest | None = None


def test_acceptance_starts_from_the_batch_rate_and_learns_each_sequence():
    acceptance = Acceptance()
    a, b = _Seq(), _Seq()
    for _ in range(20):
        acceptance.record(a, 4, 4)
    assert acceptance.rate(a) > 0.9
    assert 0.8 < acceptance.rate(b) < acceptance.rate(a)  # the batch's rate, shrunk
    acceptance.forget(a)
    assert acceptance.rate(a) == acceptance.rate(b)


def test_each_lora_adapter_has_its_own_prior():
    """The drafter has no adapter: an adapter's rejections leave the base model's prior."""
    acceptance = Acceptance()
    base, adapter = _Seq(), _Seq(LoRARequest("a", 1, "/a"))
    for _ in range(20):
        acceptance.record(base, 4, 4)
        acceptance.record(adapter, 4, 0)
    assert acceptance.rate(_Seq()) > 0.8
    assert acceptance.rate(_Seq(LoRARequest("a", 1, "/a"))) < 0.2


class _CostlyTokens:
    """A step-time model in which a draft costs a fifth of a step: drafts pay only at
    acceptance rates above about 0.2."""

    def record(self, num_tokens: int, verifies: bool, seconds: float) -> None:
        pass

    def coefficients(self) -> tuple[float, float, float]:
        return 1.0, 0.2, 0.0


def test_a_sequence_whose_drafts_were_dropped_is_tried_again():
    """A batch-1 stream whose n-gram drafts are all rejected stops being drafted; its text may
    start repeating later, so the old evidence fades and drafts are tried again: a few verify
    steps in a few hundred (each try costs one), and once they are accepted, every step."""
    speculation = Speculation(SpeculativeConfig("ngram", 4, prompt_lookup_max=2,
                                                prompt_lookup_min=2))
    speculation.step_times = _CostlyTokens()
    seq = Sequence([1, 2, 3] * 4, SamplingParams(), max_tokens=10_000)
    seq.num_computed_tokens = seq.num_tokens - 1  # decoding; "3 1 2" always has a match
    running = [SequenceGroup("a", [seq])]
    verified_at = []
    for step in range(500):
        if speculation.proposes(running) and (
                speculation.propose(running, 64, lambda _: None) or seq.draft_token_ids):
            verified_at.append(step)
            num_drafts = len(seq.draft_token_ids)
            result = StepResult(step, [seq], [num_drafts + 1])
            accepted = num_drafts if step >= 400 else 0  # the text turns repetitive at 400
            speculation.record(result, HostSamples([], None, None, None, None, [accepted + 1]))
            seq.draft_token_ids = []
    rejected = [s for s in verified_at if 100 <= s < 400]
    assert 2 <= len(rejected) <= 12, verified_at
    first = min(s for s in verified_at if s >= 400)
    assert first < 470 and set(range(first, 500)) <= set(verified_at), verified_at
