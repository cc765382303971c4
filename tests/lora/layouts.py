"""Random padded LoRA layouts (``pagedserve.lora.ops``), their float64 reference, computed row
by row from each slot's unpadded weights, and a bound on how far a kernel's roundings may take
it from the reference."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Layout(NamedTuple):
    a: torch.Tensor  # [L, S*R, K]
    b: torch.Tensor  # [L, R, N]
    shards: tuple[tuple[int, int], ...]
    # (slot, shard) -> (A [r, K], B [n, r]) float64, unpadded: the values ``a`` and ``b`` hold
    # (rounded to their dtype), so the reference computes on what a kernel reads
    weights: dict


def random_layout(num_slots: int, max_rank: int, k: int, shard_sizes: list[int], seed: int,
                  dtype: torch.dtype = torch.float32, empty_slots: tuple[int, ...] = ()
                  ) -> Layout:
    """Each slot adapts a random subset of shards (at least one) at random ranks up to
    ``max_rank``; ``empty_slots`` adapt nothing (an unused slot stays all zero)."""
    gen = torch.Generator().manual_seed(seed)
    offs = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
    shards = tuple(zip(offs, shard_sizes))
    a = torch.zeros(num_slots, len(shards) * max_rank, k, dtype=torch.float64)
    b = torch.zeros(num_slots, max_rank, sum(shard_sizes), dtype=torch.float64)
    weights = {}
    for slot in range(num_slots):
        if slot in empty_slots:
            continue
        chosen = torch.randperm(len(shards), generator=gen)[:1 + int(
            torch.randint(len(shards), (1,), generator=gen))]
        for s in chosen.tolist():
            r = int(torch.randint(1, max_rank + 1, (1,), generator=gen))
            off, n = shards[s]
            wa = torch.randn(r, k, generator=gen, dtype=torch.float64).to(dtype).double()
            wb = torch.randn(n, r, generator=gen, dtype=torch.float64).to(dtype).double()
            a[slot, s * max_rank:s * max_rank + r] = wa
            b[slot, :r, off:off + n] = wb.T
            weights[(slot, s)] = (wa, wb)
    return Layout(a.to(dtype), b.to(dtype), shards, weights)


def reference(layout: Layout, x: torch.Tensor, slots: list[int],
              base: torch.Tensor) -> torch.Tensor:
    out = base.double().clone()
    for row, slot in enumerate(slots):
        for s, (off, n) in enumerate(layout.shards):
            if slot >= 0 and (slot, s) in layout.weights:
                wa, wb = layout.weights[(slot, s)]
                out[row, off:off + n] += (x[row].double() @ wa.T) @ wb.T
    return out


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the spacing of ``dtype``'s numbers at 1: the relative error of rounding to it."""
    return torch.finfo(dtype).eps / 2


# fp32 accumulation: twice float32's unit roundoff, which also covers tensor cores that
# truncate while accumulating rather than round to nearest (Fasi et al., "Numerical behavior
# of NVIDIA tensor cores", 2021).
ACCUMULATE_UNIT = torch.finfo(torch.float32).eps


def rounding_bound(layout: Layout, x: torch.Tensor, slots: list[int], base: torch.Tensor,
                   shrunk_dtype: torch.dtype | None) -> torch.Tensor:
    """Per element of the output, the most a kernel may differ from ``reference`` when it
    reads ``x``, the layout's weights and ``base`` as given, accumulates each dot in float32,
    rounds the shrunk rows to ``shrunk_dtype`` (None: keeps them in float32) and rounds the
    result to ``base``'s dtype.

    The worst case to first order, in float64, with ``u`` a unit roundoff, ``|.|``
    elementwise and ``g(n) = n u_acc / (1 - n u_acc)``: the shrink's accumulation over K adds
    at most ``g(K + 1) (|x| |A|^T) |B|^T``, the shrunk rows' rounding ``u_s (|s| |B|^T)``, the
    expand's accumulation and the addition to the base ``g(r + 1) (|s| |B|^T + |base|)``, and
    the final rounding ``u_out`` times the result's magnitude. The 1% on top covers the
    second-order terms (products of two unit roundoffs)."""
    def g(n: int) -> float:
        return n * ACCUMULATE_UNIT / (1 - n * ACCUMULATE_UNIT)

    u_shrunk = unit_roundoff(shrunk_dtype) if shrunk_dtype is not None else 0.0
    k = x.shape[1]
    before_rounding = torch.zeros(base.shape, dtype=torch.float64)
    for row, slot in enumerate(slots):
        for s, (off, n) in enumerate(layout.shards):
            if slot >= 0 and (slot, s) in layout.weights:
                wa, wb = layout.weights[(slot, s)]
                xr, r = x[row].double(), wa.shape[0]
                before_rounding[row, off:off + n] = (
                    g(k + 1) * (xr.abs() @ wa.abs().T) @ wb.abs().T
                    + (u_shrunk + g(r + 1)) * (xr @ wa.T).abs() @ wb.abs().T
                    + g(r + 1) * base[row, off:off + n].double().abs())
    expected = reference(layout, x, slots, base)
    return 1.01 * (before_rounding + unit_roundoff(base.dtype)
                   * (expected.abs() + before_rounding))
