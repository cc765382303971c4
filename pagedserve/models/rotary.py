"""Rotary position embeddings (neox/"rotate half" layout, as Hugging Face Llama uses)."""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedserve.models.layer_ops import LayerOps


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are divided by ``factor``,
    short ones kept, and the band between blended smoothly."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "default":
        raise ValueError(f"rope_scaling type {kind!r} is not supported "
                         "(supported: default, linear, llama3)")
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, ops: type[LayerOps]) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # Plain attributes, not buffers: the tables stay float32 when the model is cast to a
        # lower precision, as in the reference implementation.
        self.cos, self.sin = angles.cos(), angles.sin()
        self.ops = ops

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]``, k ``[T, Hkv, D]`` rotated by each row's position (possibly in
        place)."""
        return self.ops.rotary(positions, q, k, self.cos, self.sin)
