"""Batched LoRA matmuls: add each row's adapter delta to a projection's output.

Layout (built by ``lora.slots``): for a projection of ``S`` output shards (3 for q/k/v, 2 for
gate/up, 1 for o and down) over ``L`` device slots with ranks padded to ``R``,

- ``a [L, S * R, K]``: shard ``s``'s A in rank rows ``s*R .. s*R + R - 1``, zero beyond the
  adapter's own rank, and all zero for a shard (or a slot) the adapter does not adapt;
- ``b [L, R, N]``: B of every shard, transposed, along the projection's output columns,
  scaling folded in, zero in padded rank rows. Transposed so that a rank's row of output
  columns is contiguous: an expand reads B along N, and B [L, N, R] made every read of a tile
  of columns 16-element pieces at a stride of R.

So for a row of slot ``l``, shard ``s`` covering output columns ``off .. off + n - 1``:
``out[:, off:off+n] += (x @ a[l, s*R:(s+1)*R].T) @ b[l, :, off:off+n]``. Rows of slot -1 get
nothing. Zero padding makes every rank below ``R`` exact, so kernels never read a rank.

``LoRARows`` is built once per step from the per-row slots (on the device, without a host
sync) and read by every layer. The platform chooses the implementation
(``Platform.lora_ops``); ``LoRAOps`` here is the portable one (Gaudi's dense fallback): a
matmul against every slot at once with the other slots' rows masked to zero, so its shapes
never depend on which slots a step uses. The CPU multiplies each slot's rows alone instead
(``platforms/cpu/lora_ops.py``), CUDA and ROCm run Triton kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# (first output column, number of columns) of each shard of a projection
Shards = tuple[tuple[int, int], ...]


class LoRARows(NamedTuple):
    """A step's token rows grouped by slot: rows of slot ``l`` are
    ``sorted_rows[starts[l] : starts[l] + counts[l]]`` (rows of slot -1 come first and belong
    to no slot)."""
    slots: torch.Tensor  # int32 [T], -1: no adapter
    sorted_rows: torch.Tensor  # int32 [T]
    starts: torch.Tensor  # int32 [L]
    counts: torch.Tensor  # int32 [L]


def group_rows(slots: torch.Tensor, num_slots: int) -> LoRARows:
    order = torch.argsort(slots, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, slots.long() + 1, torch.ones_like(slots, dtype=torch.int64))
    starts = torch.cumsum(counts, 0) - counts
    return LoRARows(slots, order, starts[1:].to(torch.int32), counts[1:].to(torch.int32))


class LoRAOps:
    """The portable implementation; platforms subclass it with kernels. A projection calls
    ``shrink`` before its base matmul (which it may run beside) and ``expand`` after it."""

    @classmethod
    def shrink(cls, x: torch.Tensor, a: torch.Tensor, rows: LoRARows) -> torch.Tensor:
        """Each row's ``x @ a[slot].T``, in the form this class's ``expand`` reads: here
        ``[T, L, S*R]``, zero but in the row's own slot."""
        num_slots, shard_ranks, k = a.shape
        mask = (rows.slots[:, None] == torch.arange(num_slots, device=x.device)).to(a.dtype)
        shrunk = (x.to(a.dtype) @ a.reshape(-1, k).T).view(-1, num_slots, shard_ranks)
        return shrunk * mask[:, :, None]

    @classmethod
    def expand(cls, shrunk: torch.Tensor, b: torch.Tensor, out: torch.Tensor, shards: Shards,
               rows: LoRARows) -> None:
        """``out [T, N] += `` each row's delta (module docstring), in place."""
        num_slots, rank = b.shape[:2]
        for s, (off, n) in enumerate(shards):
            part = shrunk[:, :, s * rank:(s + 1) * rank].reshape(-1, num_slots * rank)
            b_s = b[:, :, off:off + n].reshape(num_slots * rank, n)
            out[:, off:off + n] += (part @ b_s).to(out.dtype)
