"""LoRA deltas on the CPU: a loop over the step's slots that have rows, each multiplying only
its own rows (the portable masked path multiplies every row by every slot). Reading the row
counts on the host costs nothing here, where the device is the host."""

from __future__ import annotations

from pagedserve.lora.ops import LoRAOps


class GroupedLoRAOps(LoRAOps):
    @classmethod
    def add_lora(cls, out, x, a, b, shards, rows) -> None:
        rank = b.shape[2]
        for slot, (start, count) in enumerate(zip(rows.starts.tolist(), rows.counts.tolist())):
            if not count:
                continue
            index = rows.sorted_rows[start:start + count].long()
            shrunk = x[index].to(a.dtype) @ a[slot].T
            for s, (off, n) in enumerate(shards):
                delta = shrunk[:, s * rank:(s + 1) * rank] @ b[slot, off:off + n].T
                out[index, off:off + n] += delta.to(out.dtype)
