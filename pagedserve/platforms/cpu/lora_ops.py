"""LoRA deltas on the CPU: a loop over the step's slots that have rows, each multiplying only
its own rows (the portable masked path multiplies every row by every slot). Reading the row
counts on the host costs nothing here, where the device is the host."""

from __future__ import annotations

import torch

from pagedserve.lora.ops import LoRAOps


class GroupedLoRAOps(LoRAOps):
    @classmethod
    def add_lora(cls, out, x, a, b, shards, rows) -> None:
        # The adapted rows, gathered once in slot order (rows of slot -1 come first and are
        # left out), so each slot's rows are one slice and the deltas land in one index_add_.
        counts = rows.counts.tolist()
        first = len(rows.sorted_rows) - sum(counts)
        if first == len(rows.sorted_rows):
            return
        index = rows.sorted_rows[first:].long()
        xs = x[index].to(a.dtype)
        delta = torch.empty(len(index), out.shape[1], dtype=a.dtype)
        rank = b.shape[1]
        for slot, (start, count) in enumerate(zip(rows.starts.tolist(), counts)):
            if not count:
                continue
            part = slice(start - first, start - first + count)
            shrunk = xs[part] @ a[slot].T
            for s, (off, n) in enumerate(shards):
                shrunk_s = shrunk[:, s * rank:(s + 1) * rank]
                delta[part, off:off + n] = shrunk_s @ b[slot, :, off:off + n]
        out.index_add_(0, index, delta.to(out.dtype))
