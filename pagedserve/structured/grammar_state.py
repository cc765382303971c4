"""One sequence's position in its grammar, and the batch's allowed-token bitmask.

Invariant: a sequence's matcher has accepted exactly its output tokens. The output stage
advances it with each token it appends, and the engine builds a step's mask only once the host
has applied every token sampled before it (under async scheduling, between the step's forward
pass and its sampling), so a forbidden token is never drawn. Swap and recompute keep the
sequence's output tokens, and with them the matcher, as they are.

Speculative drafts are walked through the matcher and taken back before the walk returns
(``num_valid``, ``fill_after``): the matcher only ever holds the tokens the sequence does.

A grammar may wait for the output's reasoning to end (``ReasoningGate``): while the output is
inside it, the grammar masks nothing and its matcher takes no token; the token that ends the
reasoning is the last one it skips. The gate is walked and taken back with the drafts too, so
a reasoning that ends inside a draft run (or a step run ahead) turns the grammar on at the
right position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class ReasoningGate:
    """When a grammar starts to apply (``StructuredOutputsParams.reasoning_*``): once the
    output's tokens end with ``end_ids``. With ``start_id`` None the output begins inside its
    reasoning (``deepseek_r1``); otherwise it reasons only if its first token is ``start_id``,
    and the grammar applies from the start if it is not (``qwen3``), that first token being
    allowed besides the grammar's."""

    end_ids: tuple[int, ...]
    start_id: int | None = None


class _GateState(NamedTuple):
    num_seen: int  # output tokens the gate has seen
    reasoning: bool
    tail: tuple[int, ...]  # the last tokens of the reasoning, up to len(end_ids)


class GrammarState:
    def __init__(self, compiled, gate: ReasoningGate | None = None) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._gate = gate
        self._state = _GateState(0, gate is not None and gate.start_id is None, ())
        self._num_matched = 0  # tokens the matcher holds, for walks to take back

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False if the grammar does not allow it (then the state is
        unchanged). Inside the reasoning every token is allowed."""
        if self._gate is None:
            return self._match(token_id)
        num_seen, reasoning, tail = self._state
        if self._may_open() and token_id == self._gate.start_id:
            self._state = _GateState(1, True, ())
            return True
        if reasoning:
            tail = (*tail, token_id)[-len(self._gate.end_ids):]
            self._state = _GateState(num_seen + 1, tail != self._gate.end_ids, tail)
            return True
        if not self._match(token_id):
            return False
        self._state = _GateState(num_seen + 1, False, ())
        return True

    def _match(self, token_id: int) -> bool:
        accepted = self._matcher.accept_token(token_id)
        self._num_matched += accepted
        return accepted

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing may follow."""
        return not self._state.reasoning and self._matcher.is_terminated()

    def _may_open(self) -> bool:
        """The next token may open the reasoning (``ReasoningGate.start_id``)."""
        return (self._gate is not None and self._gate.start_id is not None
                and self._state.num_seen == 0)

    def num_valid(self, drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` the grammar allows after the accepted tokens, stopping
        before one that would end it (no mask exists after it, and the target may emit it
        itself). The state is unchanged."""
        accepted = 0
        saved = self._walk_start()
        try:
            for token in drafts:
                if not self.accept(token):
                    break
                accepted += 1
                if self.terminated:
                    break
            ends = accepted > 0 and self.terminated
        finally:
            self._walk_back(saved)
        return accepted - ends

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of ``bitmask``: the tokens allowed next (all of them inside the
        reasoning)."""
        if self._state.reasoning:
            bitmask[row] = -1
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
        start = self._gate.start_id if self._may_open() else None
        if start is not None and start < bitmask.shape[1] * 32:
            word, bit = divmod(start, 32)
            bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)

    def fill_after(self, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int) -> None:
        """Rows ``first_row + j`` for j = 0 .. len(drafts): the mask after the accepted
        tokens and the first j drafts, which must be valid (``num_valid``). The state is
        unchanged."""
        accepted = 0
        saved = self._walk_start()
        try:
            for token in drafts:
                self.fill(bitmask, first_row + accepted)
                if not self.accept(token):
                    raise RuntimeError(f"draft {accepted} ({token}) is outside the grammar; "
                                       "drafts must be cut to their valid prefix first")
                accepted += 1
            self.fill(bitmask, first_row + accepted)
        finally:
            self._walk_back(saved)

    def _walk_start(self) -> tuple[_GateState, int]:
        """What ``_walk_back`` restores after tokens that are only tried."""
        return self._state, self._num_matched

    def _walk_back(self, saved: tuple[_GateState, int]) -> None:
        self._state, num_matched = saved
        if self._num_matched > num_matched:
            self._matcher.rollback(self._num_matched - num_matched)
        self._num_matched = num_matched


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
