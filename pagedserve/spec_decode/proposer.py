"""What every drafter implements: a step's rows in, draft tokens per row out, as host data
(the worker moves them to the device with the step's other inputs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np


class ProposalBatch(NamedTuple):
    """The rows that may get drafts this step."""

    # Per row: its prompt then its output so far, int [L_i] (views of a persistent buffer do).
    token_ids: Sequence[np.ndarray]
    num_tokens: Sequence[int]  # per row: the most drafts it may get (0: none)


class Proposer(Protocol):
    def propose(self, batch: ProposalBatch) -> list[np.ndarray]:
        """Per row, int64 drafts: at most ``num_tokens[i]``, possibly fewer or none."""
        ...


# The token of a draft slot that the worker's draft model fills during the step itself.
DRAFTED_ON_DEVICE = -1


class DraftModelSlots:
    """The engine's half of ``method: draft_model`` and ``eagle3``: every row may get as many
    drafts as it has room for, and their tokens are drawn on the device by the draft model or
    the head inside the step that verifies them (``worker/drafter.py``,
    ``worker/eagle_drafter.py``), so the host never waits for a drafting pass."""

    def propose(self, batch: ProposalBatch) -> list[np.ndarray]:
        return [np.full(k, DRAFTED_ON_DEVICE, dtype=np.int64) for k in batch.num_tokens]
