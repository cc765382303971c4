"""One sequence's position in its grammar, and the batch's allowed-token bitmask.

Invariant: a sequence's matcher has accepted exactly its output tokens. The output stage
advances it with each token it appends, and the engine builds a step's mask only once the host
has applied every token sampled before it (under async scheduling, between the step's forward
pass and its sampling), so a forbidden token is never drawn. Swap and recompute keep the
sequence's output tokens, and with them the matcher, as they are.

Speculative drafts are walked through the matcher and taken back before the walk returns
(``num_valid``, ``fill_after``): the matcher only ever holds the tokens the sequence does.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple

import torch


class GrammarState:
    def __init__(self, compiled) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False if the grammar does not allow it (then the state is
        unchanged)."""
        return self._matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    def num_valid(self, drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` the grammar allows after the accepted tokens, stopping
        before one that would end it (no mask exists after it, and the target may emit it
        itself). The state is unchanged."""
        accepted = 0  # tokens the matcher took, to take back
        for token in drafts:
            if not self._matcher.accept_token(token):
                break
            accepted += 1
            if self._matcher.is_terminated():
                break
        ends = accepted > 0 and self._matcher.is_terminated()
        self._rollback(accepted)
        return accepted - ends

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def fill_after(self, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int) -> None:
        """Rows ``first_row + j`` for j = 0 .. len(drafts): the mask after the accepted
        tokens and the first j drafts, which must be valid (``num_valid``). The state is
        unchanged."""
        accepted = 0
        try:
            for token in drafts:
                self.fill(bitmask, first_row + accepted)
                if not self._matcher.accept_token(token):
                    raise RuntimeError(f"draft {accepted} ({token}) is outside the grammar; "
                                       "drafts must be cut to their valid prefix first")
                accepted += 1
            self.fill(bitmask, first_row + accepted)
        finally:
            self._rollback(accepted)

    def _rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)


class GrammarMask(NamedTuple):
    """Allowed tokens of the constrained rows of a step: bit ``t % 32`` of
    ``bitmask[i, t // 32]`` says whether token ``t`` may follow at logits row ``rows[i]`` (a
    position row: a sequence verifying d drafts has d + 1 of them, ``sample/rejection.py``)."""

    rows: torch.Tensor  # int64 [R]
    bitmask: torch.Tensor  # int32 [R, ceil(V / 32)]

    def to(self, device: torch.device) -> GrammarMask:
        """The mask on ``device``, without waiting for it."""
        return GrammarMask(self.rows.to(device, non_blocking=True),
                           self.bitmask.to(device, non_blocking=True))


def build_grammar_mask(states: list[GrammarState | None], vocab_size: int,
                       drafts: Sequence[Sequence[int]] | None = None) -> GrammarMask | None:
    """The mask of the sampling sequences that have a grammar, on the host; None (no work at
    all) when none has. Sequence i samples after each of its ``drafts[i]`` (none when
    ``drafts`` is None) and the known tokens: ``len(drafts[i]) + 1`` position rows, in order."""
    if all(state is None for state in states):
        return None
    import xgrammar as xgr

    counts = [1] * len(states) if drafts is None else [len(d) + 1 for d in drafts]
    first_rows = [0, *accumulate(counts)]
    constrained = [i for i, state in enumerate(states) if state is not None]
    rows = [first_rows[i] + j for i in constrained for j in range(counts[i])]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    at = 0  # the bitmask row of the next sequence's position 0
    for i in constrained:
        states[i].fill_after(() if drafts is None else drafts[i], bitmask, at)
        at += counts[i]
    return GrammarMask(torch.tensor(rows, dtype=torch.int64), bitmask)
