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
