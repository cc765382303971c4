"""The n-gram proposer against a plain Python search, n from max down to min and start from
the most recent, on hand-written and random histories."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedserve.spec_decode.ngram import NgramProposer, lookup
from pagedserve.spec_decode.proposer import ProposalBatch


def reference(tokens, k, min_n, max_n):
    tokens = list(tokens)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        # Occurrences start at s, with a token after them: s + n <= len - 1.
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


@pytest.mark.parametrize("tokens, k, min_n, max_n, want", [
    ([1, 2, 3, 4], 3, 1, 3, []),  # no match
    ([], 3, 1, 3, []),
    ([5], 3, 1, 3, []),
    ([5, 5], 3, 1, 3, [5]),
    ([5, 7, 7], 3, 1, 2, [7]),  # the match ends just before the suffix
    ([1, 2, 3, 1, 2], 3, 1, 2, [3, 1, 2]),  # the drafts run into the suffix
    ([1, 2, 3, 1, 2], 2, 1, 2, [3, 1]),  # k caps them
    ([1, 2, 3, 9, 2, 3], 4, 1, 3, [9, 2, 3]),  # n = 2
    ([1, 2, 3, 9, 2, 3], 4, 3, 3, []),  # min_n = 3 finds nothing
    ([7, 1, 2, 50, 9, 2, 60, 7, 1, 2], 3, 1, 3, [50, 9, 2]),  # the longer n wins ...
    ([7, 1, 2, 50, 9, 2, 60, 7, 1, 2], 3, 1, 1, [60, 7, 1]),  # ... over a more recent shorter
    ([3, 8, 0, 3, 8, 1, 3, 8], 5, 2, 2, [1, 3, 8]),  # the most recent occurrence
    ([4, 4, 4, 4], 3, 1, 2, [4]),  # overlapping occurrences: the most recent
    ([4, 4, 4, 4, 4], 3, 1, 9, [4]),  # max_n beyond the history
    ([1, 2, 3, 1, 2], 0, 1, 2, []),  # k = 0
])
def test_hand_written_histories(tokens, k, min_n, max_n, want):
    assert reference(tokens, k, min_n, max_n) == want  # the reference reads the rule right
    got = lookup(np.array(tokens, dtype=np.int64), k, min_n, max_n)
    assert got.dtype == np.int64 and got.tolist() == want


@pytest.mark.parametrize("seed", range(4))
def test_random_histories_match_the_reference(seed):
    rng = random.Random(seed)
    proposals = 0
    for _ in range(500):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(40))]
        if tokens and rng.random() < 0.5:  # a copied span makes long matches
            start = rng.randrange(len(tokens))
            tokens += tokens[start:start + rng.randrange(1, 8)]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(0, 6)
        want = reference(tokens, k, min_n, max_n)
        assert lookup(np.array(tokens, dtype=np.int32), k, min_n, max_n).tolist() == want
        proposals += bool(want)
    assert proposals > 100


def test_batch_rows_get_their_own_k_and_copies():
    buffer = np.array([[1, 2, 3, 1, 2, 0], [6, 6, 6, 6, 6, 6]], dtype=np.int32)
    batch = ProposalBatch([buffer[0, :5], buffer[1, :4]], [2, 0])
    drafts = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3).propose(batch)
    assert [d.tolist() for d in drafts] == [[3, 1], []]
    buffer[0, 2] = 9  # the caller's buffer moves on; the drafts are its own
    assert drafts[0].tolist() == [3, 1] and drafts[0].dtype == np.int64


@pytest.mark.parametrize("low, high, field", [(0, 3, "prompt_lookup_min"),
                                              (3, 2, "prompt_lookup_max")])
def test_bad_lookup_bounds_name_the_field(low, high, field):
    with pytest.raises(ValueError, match=field):
        NgramProposer(prompt_lookup_min=low, prompt_lookup_max=high)
