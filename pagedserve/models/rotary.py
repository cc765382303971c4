"""Rotary position embeddings (neox/"rotate half" layout, as Hugging Face Llama uses), on the
whole of each head or on its first ``rotary_dim`` features (Phi-4-mini's partial rotary)."""

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
    if kind == "longrope":
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
    if kind != "default":
        raise ValueError(f"rope_scaling type {kind!r} is not supported "
                         "(supported: default, linear, llama3, longrope)")
    return inv_freq


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: 1 except under longrope, whose factor (the
    context's growth over ``original_max_position_embeddings`` unless given) raises it, as
    transformers' ``_compute_longrope_parameters`` computes it.

    Longrope has two frequency sets. transformers picks ``long_factor`` for a whole forward
    once the sequence is longer than ``original_max_position_embeddings`` (keeping the cache
    of earlier tokens as the short set rotated them), vLLM for a whole batch once any position
    is; neither is one table per position. We keep the short set and the engine caps the
    context at ``original_max_position_embeddings`` (``EngineConfig``), where all three
    agree."""
    scaling = scaling or {}
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, ops: type[LayerOps],
                 rotary_dim: int | None = None) -> None:
        """``rotary_dim``: rotate only the first that many features of each head (the
        frequencies then are those of a head of ``rotary_dim``, as transformers computes
        them); the whole head unless given."""
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self.partial = self.rotary_dim < head_dim
        inv_freq = inverse_frequencies(self.rotary_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # Plain attributes, not buffers: the tables stay float32 when the model is cast to a
        # lower precision, as in the reference implementation.
        mscale = attention_factor(scaling)
        self.cos, self.sin = angles.cos() * mscale, angles.sin() * mscale
        self.ops = ops

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]``, k ``[T, Hkv, D]`` rotated by each row's position (possibly in
        place)."""
        if not self.partial:
            return self.ops.rotary(positions, q, k, self.cos, self.sin)
        # The platform's op sees whole heads of rotary_dim: contiguous copies of the rotated
        # part (kernels may assume packed heads), then the untouched rest appended.
        d = self.rotary_dim
        q_rot, k_rot = self.ops.rotary(positions, q[..., :d].contiguous(),
                                       k[..., :d].contiguous(), self.cos, self.sin)
        return torch.cat((q_rot, q[..., d:]), dim=-1), torch.cat((k_rot, k[..., d:]), dim=-1)
