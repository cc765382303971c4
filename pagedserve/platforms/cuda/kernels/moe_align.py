"""The (token, expert) pairs of a mixture-of-experts step grouped by expert, each expert's
rows padded to a multiple of ``block_m``: the row layout ``fused_moe``'s grouped GEMM reads.

Layout (``AlignedPairs``), for ``P = T * K`` pairs, pair ``p`` being token ``p // K``'s
``p % K``-th expert ``topk_ids.flatten()[p]``:

- ``sorted_ids`` int32 ``[rows]``: expert 0's pair ids in increasing order, then sentinels
  (``P``) up to a multiple of ``block_m``, then expert 1's, and so on; an expert without
  pairs takes no rows. Past the padded total every entry is the sentinel.
- ``block_experts`` int64 ``[rows // block_m]``: the expert of each block of ``block_m`` rows;
  ``E`` (no expert) past the padded total.
- ``total`` int64 ``[1]``: the padded total, on the device.

Everything is computed by torch ops on the device without reading anything back, so a CUDA
graph can capture it: ``rows`` (``max_rows``) is a bound that holds for every routing, and the
GEMM's programs past ``total`` return at once. The bound is ``P + min(E, P) * (block_m - 1)``:
every expert with pairs wastes at most ``block_m - 1`` rows, and at most ``min(E, P)`` experts
have pairs (vLLM sizes by ``P + E * (block_m - 1)``, which at decode launches mostly idle
programs: 121 blocks for the 8 of a Qwen3-30B-A3B token).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class AlignedPairs(NamedTuple):
    sorted_ids: torch.Tensor  # int32 [rows]
    block_experts: torch.Tensor  # int64 [rows // block_m]
    total: torch.Tensor  # int64 [1]


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The padded rows any routing of ``num_pairs`` pairs can need, rounded up to whole
    blocks."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """``topk_ids`` ``[T, K]`` (each token's experts, distinct or not) laid out as above."""
    experts = topk_ids.flatten()
    num_pairs = experts.numel()
    device = experts.device
    # A stable sort keeps each expert's pairs in pair order.
    sorted_experts, order = experts.sort(stable=True)
    # first[e]: the sorted position of expert e's first pair (first[E] = P); no bincount,
    # which reads its input's largest value back to the host.
    first = torch.searchsorted(
        sorted_experts, torch.arange(num_experts + 1, dtype=experts.dtype, device=device))
    counts = first[1:] - first[:-1]
    padded = torch.div(counts + (block_m - 1), block_m, rounding_mode="floor") * block_m
    padded_end = padded.cumsum(0)
    # A sorted pair's row: its expert's padded start plus its rank among the expert's pairs.
    shift = padded_end - padded - first[:-1]
    dest = shift[sorted_experts] + torch.arange(num_pairs, device=device)
    rows = max_rows(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, rows, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    return AlignedPairs(sorted_ids, block_experts, padded_end[-1:])
