"""Rotary position embeddings (neox/"rotate half" layout, as Hugging Face Llama uses), on the
whole of each head or on its first ``rotary_dim`` features (Phi-4-mini's partial rotary).

Phi-3's longrope has two frequency sets, ``short_factor`` and ``long_factor``. transformers
picks one per forward: the long set for every position once the forward reaches past
``original_max_position_embeddings`` (a long prompt's whole prefill, each decode step
beyond it), keeping the cache of earlier tokens as it was rotated. vLLM concatenates a short
and a long table and reads the long one for a whole batch once any position is past the
original length, so a request's numbers depend on what it is batched with. We decide per
sequence, once, from its prompt (``Sequence.long_rope``): a sequence whose prompt is longer
than ``original_max_position_embeddings`` rotates every position by the long factors; any
other rotates positions within the original length by the short factors and positions
beyond by the long ones. That is transformers' rotary run on a prompt in one forward (our
chunked prefill keeps the sequence's choice for every chunk) and then one token a forward on
its cache, whose earlier keys stay short-rotated. Its Phi-3 ``generate`` differs for a
sequence that crosses the boundary while generating: ``prepare_inputs_for_generation`` drops
the cache there and recomputes the whole sequence by the long factors, which a paged cache
shared between requests does not do, so tokens past the crossing may differ from its.
Because a long-prompt sequence's keys below the original length differ from a short-prompt
one's, their KV blocks hash apart (``Sequence.block_key``).
"""

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


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                        long: bool = False) -> torch.Tensor:
    """``long``: longrope's long factors rather than its short ones."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float32)
    if kind != "default":
        raise ValueError(f"rope_scaling type {kind!r} is not supported "
                         "(supported: default, linear, llama3, longrope)")
    return inv_freq


def longrope_original_length(scaling: dict[str, Any] | None) -> int | None:
    """Under longrope, ``original_max_position_embeddings``: a sequence whose prompt is longer
    rotates all its positions by the long factors. None under any other scaling."""
    scaling = scaling or {}
    if scaling.get("rope_type") != "longrope":
        return None
    return scaling["original_max_position_embeddings"]


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: 1 except under longrope, whose factor (the
    context's growth over ``original_max_position_embeddings`` unless given) raises it, as
    transformers' ``_compute_longrope_parameters`` computes it, for both frequency sets."""
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
        self.max_positions = max_positions
        self.original = longrope_original_length(scaling)
        angles = _angles(self.rotary_dim, max_positions, theta, scaling, self.original)
        # Plain attributes, not buffers: the tables stay float32 when the model is cast to a
        # lower precision, as in the reference implementation.
        mscale = attention_factor(scaling)
        self.cos, self.sin = angles.cos() * mscale, angles.sin() * mscale
        self.ops = ops

    def rows(self, positions: torch.Tensor, long_rope: torch.Tensor | None) -> torch.Tensor:
        """The table row of each token: its position, except that under longrope a row of a
        long-prompt sequence (``long_rope``, bool per row; None: no such row) within the
        original length reads the long factors' rows past ``max_positions``."""
        if self.original is None or long_rope is None:
            return positions
        shift = long_rope & (positions < self.original)
        return positions + shift * self.max_positions

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                long_rope: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, H, D]``, k ``[T, Hkv, D]`` rotated by each row's position (possibly in
        place); ``long_rope``: ``ForwardContext.long_rope``."""
        rows = self.rows(positions, long_rope)
        if not self.partial:
            return self.ops.rotary(rows, q, k, self.cos, self.sin)
        # The platform's op sees whole heads of rotary_dim: contiguous copies of the rotated
        # part (kernels may assume packed heads), then the untouched rest appended.
        d = self.rotary_dim
        q_rot, k_rot = self.ops.rotary(rows, q[..., :d].contiguous(),
                                       k[..., :d].contiguous(), self.cos, self.sin)
        return torch.cat((q_rot, q[..., d:]), dim=-1), torch.cat((k_rot, k[..., d:]), dim=-1)


def _angles(rotary_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
            original: int | None) -> torch.Tensor:
    """Each table row's angles ``[rows, rotary_dim / 2]``: row p is position p. Under longrope
    (``original`` set) positions below ``original`` take the short factors and the others the
    long ones, and ``original`` rows more follow, positions 0 to ``original - 1`` by the long
    factors, which only long-prompt sequences read (``RotaryEmbedding.rows``). The rotary
    kernels index the tables by row and need no other change."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = torch.outer(positions, inverse_frequencies(rotary_dim, theta, scaling))
    if original is None:
        return angles  # longrope's short factors are inverse_frequencies' by default
    long = torch.outer(positions, inverse_frequencies(rotary_dim, theta, scaling, long=True))
    within = (positions < original)[:, None]
    return torch.cat((torch.where(within, angles, long), long[:original]))
