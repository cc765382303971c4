"""A custom logits processor for the tests (docs/server.md shows the same one): it bans the
token id a request gives as ``extra_args["ban_token"]``."""

from __future__ import annotations

import numbers
import os
from pathlib import Path

import torch

from pagedserve import SamplingParams
from pagedserve.sample.logits_processor import LogitsProcessor


class BanToken(LogitsProcessor):
    def __init__(self, config, device: torch.device) -> None:
        super().__init__(config, device)
        # The banned token of each batch row; -1: none.
        self.banned = torch.full((64,), -1, dtype=torch.int64, device=device)

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        token = (params.extra_args or {}).get("ban_token")
        if token is not None and not (isinstance(token, numbers.Integral) and token >= 0):
            raise ValueError(f"ban_token must be a token id, got {token!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # banning the most likely token changes it

    def add(self, row: int, params: SamplingParams) -> bool:
        token = (params.extra_args or {}).get("ban_token")
        if row >= len(self.banned):
            self.banned = torch.cat([self.banned, torch.full_like(self.banned, -1)])
        self.banned[row] = -1 if token is None else token
        return token is not None

    def remove(self, row: int) -> None:
        self.banned[row] = -1

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        banned = self.banned[rows].unsqueeze(1)  # [P, 1]
        # validate_params cannot see the vocabulary: an id past it bans nothing.
        banning = (banned >= 0) & (banned < logits.shape[1])
        column = torch.where(banning, banned, 0)
        kept = logits.gather(1, column)
        return logits.scatter_(1, column, torch.where(banning, float("-inf"), kept))


class MarkedBanToken(BanToken):
    """BanToken that leaves a file named for its process next to the model's folder, so a test
    sees which processes made one (here, not in the test module: a rank process must import
    it by name)."""

    def __init__(self, config, device: torch.device) -> None:
        super().__init__(config, device)
        (Path(config.model).parent / f"constructed-{os.getpid()}").touch()
