"""One sequence's position in its grammar, and the batch's allowed-token bitmask.

Invariant: a sequence's matcher has accepted exactly its output tokens. The output stage
advances it with each token it appends, and the engine builds a step's mask only once the host
has applied every token sampled before it (under async scheduling, between the step's forward
pass and its sampling), so a forbidden token is never drawn. Swap and recompute keep the
sequence's output tokens, and with them the matcher, as they are.
"""

from __future__ import annotations

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

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


class GrammarMask(NamedTuple):
    """Allowed tokens of the constrained rows of a step: bit ``t % 32`` of
    ``bitmask[i, t // 32]`` says whether token ``t`` may follow in sampler row ``rows[i]``."""

    rows: torch.Tensor  # int64 [R]
    bitmask: torch.Tensor  # int32 [R, ceil(V / 32)]

    def to(self, device: torch.device) -> GrammarMask:
        """The mask on ``device``, without waiting for it."""
        return GrammarMask(self.rows.to(device, non_blocking=True),
                           self.bitmask.to(device, non_blocking=True))


def build_grammar_mask(states: list[GrammarState | None], vocab_size: int
                       ) -> GrammarMask | None:
    """The mask of the rows that have a grammar, on the host; None (no work at all) when none
    has."""
    rows = [row for row, state in enumerate(states) if state is not None]
    if not rows:
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    for i, row in enumerate(rows):
        states[row].fill(bitmask, i)
    return GrammarMask(torch.tensor(rows, dtype=torch.int64), bitmask)
