"""Fake ``habana_frameworks.torch.hpu``: one device with a fixed memory size, a peak-memory
counter the test sets, and a graph wrapper that records what it wrapped and runs it eagerly."""

from __future__ import annotations

import torch

TOTAL_BYTES = 8 << 30
peak_bytes = 0
peak_resets = 0
wrapped: list[torch.nn.Module] = []


def is_available() -> bool:
    return True


def mem_get_info() -> tuple[int, int]:
    return TOTAL_BYTES - peak_bytes, TOTAL_BYTES


def reset_peak_memory_stats() -> None:
    global peak_resets
    peak_resets += 1


def max_memory_allocated() -> int:
    return peak_bytes


def synchronize() -> None:
    pass


def wrap_in_hpu_graph(module: torch.nn.Module) -> torch.nn.Module:
    wrapped.append(module)
    return module


def reset() -> None:
    global peak_bytes, peak_resets
    peak_bytes = peak_resets = 0
    wrapped.clear()
