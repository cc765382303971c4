"""LoRA deltas on the CPU: a loop over the step's slots that have rows, each multiplying only
its own rows (the portable masked path multiplies every row by every slot). Reading the row
counts on the host costs nothing here, where the device is the host."""

from __future__ import annotations

import torch

from pagedserve.lora.ops import LoRAOps, LoRARows


class GroupedLoRAOps(LoRAOps):
    @classmethod
    def shrink(cls, x, a, rows) -> torch.Tensor:
        """The adapted rows' ``x @ a[slot].T`` in slot order (rows of slot -1 are left out)."""
        index, groups = _groups(rows)
        xs = x[index].to(a.dtype)
        shrunk = torch.empty(len(index), a.shape[1], dtype=a.dtype)
        for slot, part in groups:
            shrunk[part] = xs[part] @ a[slot].T
        return shrunk

    @classmethod
    def expand(cls, shrunk, b, out, shards, rows) -> None:
        # The deltas in slot order, landing in one index_add_.
        index, groups = _groups(rows)
        if not groups:
            return
        delta = torch.empty(len(index), out.shape[1], dtype=b.dtype)
        rank = b.shape[1]
        for slot, part in groups:
            for s, (off, n) in enumerate(shards):
                delta[part, off:off + n] = shrunk[part, s * rank:(s + 1) * rank] \
                    @ b[slot, :, off:off + n]
        out.index_add_(0, index, delta.to(out.dtype))


def _groups(rows: LoRARows) -> tuple[torch.Tensor, list[tuple[int, slice]]]:
    """The adapted rows in slot order (slot -1's come first in ``sorted_rows`` and are left
    out), and each slot's slice of them."""
    counts = rows.counts.tolist()
    first = len(rows.sorted_rows) - sum(counts)
    groups = [(slot, slice(start - first, start - first + count))
              for slot, (start, count) in enumerate(zip(rows.starts.tolist(), counts)) if count]
    return rows.sorted_rows[first:].long(), groups
