"""N-gram (prompt lookup) drafts: find the suffix of a row's tokens earlier in them, and
propose what followed it.

For each row, the n-gram is its last n tokens, n from ``prompt_lookup_max`` down to
``prompt_lookup_min``: the first n that occurred before (ending at least one token before the
end) wins, and of its occurrences the most recent one. The drafts are the up to k tokens after
that occurrence, fewer where the row ends first; an occurrence may overlap the suffix itself.

The search is a few numpy operations per row and per n, none per token: the earlier positions
holding the row's last token are the only places a match can end, and each round keeps those
whose match reaches one token further back.
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
    # A match ends where the last token occurs again, one token or more before the end; the
    # ends whose match goes on one token further back survive each round.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    matched = 1
    while len(ends) and matched < max_n:
        before = ends - matched
        longer = ends[(before >= 0) & (tokens[before.clip(min=0)] == tokens[-1 - matched])]
        if not len(longer):
            break
        ends, matched = longer, matched + 1
    if not len(ends) or matched < min_n:
        return _NONE
    end = ends[-1]
    return tokens[end + 1:end + 1 + k].astype(np.int64)  # a copy: buffers change
