"""Fixtures of the native CPU kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every float tensor torch.empty hands out starts as NaN, so an output element a kernel
    leaves unwritten shows."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", nan_empty)
