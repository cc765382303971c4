"""N-gram (prompt lookup) drafts: find the suffix of a row's tokens earlier in them, and
propose what followed it.

For each row, the n-gram is its last n tokens, n from ``prompt_lookup_max`` down to
``prompt_lookup_min``: the first n that occurred before (ending at least one token before the
end) wins, and of its occurrences the most recent one. The drafts are the up to k tokens after
that occurrence, fewer where the row ends first; an occurrence may overlap the suffix itself.

The search is a few numpy operations per row, none per token: the earlier positions holding
the row's last token are the only places a match can end, and each one's match length is
read off a [candidates, max_n] comparison.
"""

from __future__ import annotations

import numpy as np

from pagedserve.spec_decode.proposer import ProposalBatch

_NONE = np.zeros(0, dtype=np.int64)


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be at least 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({prompt_lookup_max}) must be at least "
                             f"prompt_lookup_min ({prompt_lookup_min})")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, batch: ProposalBatch) -> list[np.ndarray]:
        return [lookup(tokens, k, self.min_n, self.max_n)
                for tokens, k in zip(batch.token_ids, batch.num_tokens, strict=True)]


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """int64 [<= k]: the tokens after the most recent earlier occurrence of the longest suffix
    of ``tokens`` of min_n..max_n tokens that occurred before; empty when none did."""
    length = len(tokens)
    if k <= 0 or length <= min_n:
        return _NONE
    # A match ends where the last token occurs again, one token or more before the end.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if len(ends) == 0:
        return _NONE
    back = np.arange(min(max_n, length - 1))
    before = ends[:, None] - back  # [C, n]: the tokens before each end, nearest first
    agree = (before >= 0) & (tokens[before.clip(min=0)] == tokens[length - 1 - back])
    matched = np.cumprod(agree, axis=1).sum(axis=1)  # each end's match length, up to max_n
    longest = matched.max()
    if longest < min_n:
        return _NONE
    end = ends[np.flatnonzero(matched == longest)[-1]]
    return tokens[end + 1:end + 1 + k].astype(np.int64)  # a copy: buffers change
