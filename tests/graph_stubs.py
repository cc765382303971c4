"""A stand-in for a platform's graph runner on the CPU: it records each capture and never
replays, so tests can see when the runner captures graphs and over which KV tensors."""

from __future__ import annotations

import pytest

from pagedserve.platforms.cpu.platform import CpuPlatform


class RecordingGraphs:
    """Built as ``GraphRunner`` is: ``(model, kv_caches, *sizes)``."""

    def __init__(self, made: list, model, kv_caches, *sizes) -> None:
        self.kv_caches = kv_caches
        self.args = (model, kv_caches, *sizes)
        made.append(self)

    def capture(self) -> None:
        pass

    def can_run(self, ctx) -> bool:
        return False  # every step runs eagerly


def record_graphs(monkeypatch: pytest.MonkeyPatch, platform=CpuPlatform) -> list:
    """Give ``platform`` the recording graph runner; the list of those made."""
    made: list = []
    monkeypatch.setattr(platform, "graph_runner", classmethod(
        lambda cls: lambda *args: RecordingGraphs(made, *args)))
    return made
