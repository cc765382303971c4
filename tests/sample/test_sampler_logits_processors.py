"""Where the sampler runs custom logits processors: those that may change the argmax after the
built-in processing (logit_bias here) and before temperature, for every row, their edits in
the logprobs; argmax-invariant ones before temperature for random rows only, never in the
logprobs nor in an all-greedy batch. Each gets the batch row of every logits row."""

from __future__ import annotations

import dataclasses

import torch

from pagedserve.sample.logits_processor import LogitsProcessor, StepProcessors
from pagedserve.sampling_params import SamplingParams
from tests.sample.test_sampler import build, sampler

VOCAB = 8


class Recorder(LogitsProcessor):
    """Records what it is given; bans token 0 (may change the argmax) or, argmax-invariant,
    keeps each row's largest logit alone."""

    def __init__(self, invariant: bool) -> None:
        super().__init__(None, torch.device("cpu"))
        self.invariant = invariant
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def is_argmax_invariant(self) -> bool:
        return self.invariant

    def add(self, row: int, params: SamplingParams) -> bool:
        return True

    def remove(self, row: int) -> None:
        pass

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.seen.append((logits.clone(), rows))
        if self.invariant:
            return logits.masked_fill_(logits < logits.amax(dim=1, keepdim=True), float("-inf"))
        return logits.index_fill_(1, torch.tensor([0]), float("-inf"))


def _with(meta, processor: Recorder, rows: list[int]):
    changing, invariant = ([], [processor]) if processor.invariant else ([processor], [])
    return dataclasses.replace(meta, processors=StepProcessors(changing, invariant,
                                                               torch.tensor(rows)))


def _logits() -> torch.Tensor:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[:, 0] = 10.0  # the argmax, until banned
    return logits


def test_a_processor_that_may_change_the_argmax_runs_after_logit_bias_before_temperature():
    params = [SamplingParams(temperature=0.0, logit_bias={3: 5.0}, logprobs=2),
              SamplingParams(temperature=2.0, seed=1, logit_bias={3: 5.0}, logprobs=2)]
    processor = Recorder(invariant=False)
    logits = _logits()
    out = sampler(logits, _with(build(params, vocab_size=VOCAB), processor, [5, 2]))
    (given, rows), = processor.seen
    assert rows.tolist() == [5, 2]
    expected = logits.clone()
    expected[:, 3] += 5.0  # biased, not yet tempered
    torch.testing.assert_close(given, expected)
    assert out.token_ids[0] == expected[0, 1:].argmax() + 1  # greedy row: the ban holds
    assert 0 not in out.token_ids.tolist()
    assert (out.top_ids[:, 0] != 0).all()  # the logprobs see the ban


def test_an_argmax_invariant_processor_shapes_only_random_draws():
    processor = Recorder(invariant=True)
    logits = _logits()
    greedy = [SamplingParams(temperature=0.0, logprobs=1)] * 2
    sampler(logits, _with(build(greedy, vocab_size=VOCAB), processor, [0, 1]))
    assert processor.seen == []  # an all-greedy batch skips it
    mixed = [SamplingParams(temperature=0.0, logprobs=1),
             SamplingParams(temperature=5.0, seed=3, logprobs=1)]
    plain = sampler(logits, build(mixed, vocab_size=VOCAB))
    out = sampler(logits, _with(build(mixed, vocab_size=VOCAB), processor, [0, 1]))
    (given, _), = processor.seen
    torch.testing.assert_close(given, logits)  # not yet tempered
    assert out.token_ids.tolist() == [0, 0]  # the random row can draw nothing but the max
    # Reported before it: the drawn tokens' logprobs and the top ones are the untouched
    # logits' (the plain run may draw another token at temperature 5, so compare with float64).
    reference = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(out.logprobs.view(-1).double(), reference[:, 0], rtol=0,
                               atol=1e-5)
    torch.testing.assert_close(out.top_logprobs, plain.top_logprobs)
