"""Sleep mode on one rank (``--enable-sleep-mode``): the model's tensors leave the device
between RL training steps and come back.

Every parameter and buffer of the model keeps its ``nn.Parameter`` object (modules, a tied LM
head and the loader hold those) while its storage is swapped: ``.data`` becomes an empty
tensor, so the device memory is free once nothing else holds it, and on wake-up a new
device tensor of the same shape takes its place. Level 1 keeps a host copy of each (in
page-locked memory where the platform pins its swap space) and copies it back; level 2
keeps none of the parameters (buffers, such as rotary tables the checkpoint does not hold,
are kept either way), so their values after wake-up are garbage until ``load_weights``.

The new storage has new addresses: graphs captured before sleep read the old ones, so the
runner drops its graphs when it sleeps and captures them again once it is fully awake.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.platforms.interface import Platform

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")


@dataclass
class _Stored:
    tensor: torch.Tensor  # the parameter or buffer object, its ``.data`` swapped
    host: torch.Tensor | None  # its values (level 1, and buffers), or None: discarded
    shape: torch.Size
    device: torch.device


class SleepingWeights:
    """The model's parameters and buffers while the rank sleeps (see the module doc)."""

    def __init__(self, model: nn.Module, platform: type[Platform], discard: bool) -> None:
        self.stored: list[_Stored] = []
        seen: set[int] = set()
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) in seen or tensor.numel() == 0:
                continue
            seen.add(id(tensor))
            keep = not (discard and isinstance(tensor, nn.Parameter))
            self.stored.append(_Stored(tensor, _host_copy(tensor, platform) if keep else None,
                                       tensor.shape, tensor.device))
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    def restore(self) -> None:
        """Give every tensor device storage again: its saved values, or uninitialised."""
        for s in self.stored:
            s.tensor.data = (torch.empty(s.shape, dtype=s.tensor.dtype, device=s.device)
                             if s.host is None else s.host.to(s.device))
        self.stored = []


def _host_copy(tensor: torch.Tensor, platform: type[Platform]) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                       pin_memory=platform.pin_swap_memory)
    host.copy_(tensor)
    return host


def check_level(level: int) -> None:
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 1 (offload the weights) or 2 (discard them), "
                         f"got {level!r}")


def wake_tags(tags: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """``tags`` checked (None: all of them)."""
    if tags is None:
        return WAKE_TAGS
    wrong = [t for t in tags if t not in WAKE_TAGS]
    if wrong or not tags:
        raise ValueError(f"wake_up tags must be among {list(WAKE_TAGS)}, got {tags!r}")
    return tuple(dict.fromkeys(tags))
