"""The elementwise and normalisation ops of a decoder layer, in plain torch.

This is the portable implementation and the numerical reference: RMSNorm in float32 as the
Hugging Face models compute it, SwiGLU, neox-style rotary embeddings, and the experts of a
mixture-of-experts block. A platform with fused
kernels subclasses ``LayerOps`` and overrides the methods (``Platform.layer_ops``); each of
these plain versions launches several kernels, which on a GPU costs more than the matmuls at
small batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F


class LayerOps:
    # ``fused_moe`` runs inside a captured graph (no host sync); False: decode steps of a
    # mixture-of-experts model run eagerly.
    fused_moe_in_graphs: ClassVar[bool] = False
    # ``fused_moe``'s contract with FP8 experts: ``w13`` and ``w2`` stacked ``Fp8Weight`` or
    # ``BlockFp8Weight`` (values ``[E, N, K]``), multiplied as they are; None: a platform
    # without it runs FP8 experts by dequantizing the routed ones each step.
    fused_moe_fp8: ClassVar[Callable[..., torch.Tensor] | None] = None
    # The same with integer experts: ``w13`` and ``w2`` stacked ``PackedIntWeight`` (4- or
    # 8-bit codes, a scale and an integer zero point per group); None: a platform without it
    # dequantizes the routed ones each step.
    fused_moe_int: ClassVar[Callable[..., torch.Tensor] | None] = None

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """``weight * normalise(x)``; with ``residual``, ``x + residual`` is normalised and also
        returned as the next residual: ``(out, x + residual)``. An override may write that
        sum into ``residual`` in place."""
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * h.to(x.dtype)
        return out if residual is None else (out, residual)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """SwiGLU on a fused gate/up projection ``[T, 2I]``: ``silu(gate) * up``, ``[T, I]``."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q ``[T, H, D]`` and k ``[T, Hkv, D]`` by each row's position ("rotate half"
        layout); ``cos``/``sin`` are float32 ``[max_positions, D/2]`` tables. An override may
        rotate q and k in place."""
        cos = cos[positions][:, None, :]
        sin = sin[positions][:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


    @classmethod
    def fused_moe(cls, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts of a mixture-of-experts block: token ``t`` gets
        ``sum_k topk_weights[t, k] * expert(topk_ids[t, k], hidden[t])``, each expert a SwiGLU
        MLP.

        Layout: ``hidden`` ``[T, H]``; ``w13`` ``[E, 2I, H]``, each expert's gate rows then its
        up rows; ``w2`` ``[E, H, I]``; ``topk_ids`` int64 ``[T, K]`` and ``topk_weights``
        ``[T, K]`` (float32 from the router). Returns ``[T, H]`` in ``hidden``'s dtype. Under
        tensor parallelism ``I`` is this rank's slice and the result a partial sum that the
        caller all-reduces.

        As vLLM's fused kernel lays its work out, the ``T * K`` (token, expert) pairs are
        sorted by expert so each expert's rows are one contiguous slice: one pair of matmuls
        per expert that has tokens (never one per token), then each row weighted and added
        back to its token (``index_add_``). A fused kernel does the same in one launch."""
        num_tokens, top_k = topk_ids.shape
        order = topk_ids.flatten().argsort(stable=True)
        tokens = order // top_k  # the token of each sorted pair
        counts = torch.bincount(topk_ids.flatten(), minlength=w13.shape[0])
        rows = hidden[tokens]
        out = torch.empty_like(rows)
        start = 0
        # The one host sync: the per-expert counts, to slice the sorted pairs in Python.
        for expert, count in enumerate(counts.tolist()):
            if count:
                end = start + count
                gate_up = rows[start:end] @ w13[expert].t()
                out[start:end] = cls.silu_and_mul(gate_up) @ w2[expert].t()
                start = end
        weighted = (out * topk_weights.flatten()[order, None]).to(hidden.dtype)
        return torch.zeros_like(hidden).index_add_(0, tokens, weighted)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)
