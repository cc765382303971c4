"""Fake ``habana_frameworks.torch.core``: counts ``mark_step`` calls."""

from __future__ import annotations

mark_steps = 0


def mark_step(device_str: str = "", sync: bool = False) -> None:
    global mark_steps
    mark_steps += 1


def reset() -> None:
    global mark_steps
    mark_steps = 0
