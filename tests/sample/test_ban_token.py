"""The example logits processor of docs/server.md (tests/sample/ban_token.py): an id past the
vocabulary bans nothing. ``validate_params`` cannot see the vocabulary, so ``apply`` must not
index past a row; it did, and a request's ``vllm_xargs {"ban_token": 1000000}`` failed the
engine step (a 500, with every request in that step aborted)."""

from __future__ import annotations

import torch

from pagedserve.sampling_params import SamplingParams
from tests.sample.ban_token import BanToken


def test_a_token_past_the_vocabulary_bans_nothing():
    processor = BanToken(None, torch.device("cpu"))
    processor.add(0, SamplingParams(extra_args={"ban_token": 1_000_000}))
    processor.add(1, SamplingParams(extra_args={"ban_token": 2}))
    logits = torch.zeros(2, 8)
    out = processor.apply(logits.clone(), torch.tensor([0, 1]))
    assert torch.equal(out[0], logits[0])
    assert out[1, 2] == float("-inf") and torch.isfinite(out[1, [0, 1, *range(3, 8)]]).all()
