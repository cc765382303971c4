"""Turn a ``SchedulerOutput`` into the packed tensors one forward pass reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.request import Request
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.platforms.interface import DeviceEvent, Platform


@dataclass
class InFlightTokens:
    """The tokens sampled by the step before this one, still on the device: under async
    scheduling a stream's next input can be one of them, unknown to the host."""

    token_ids: torch.Tensor  # int64 [num_sampled], on the device
    rows: dict[Request, int]  # stream -> its row in token_ids


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    meta: AttentionMetadata
    # Row of each sampling sequence's last token, in scheduling order.
    logits_indices: torch.Tensor  # int64 [num_sampling]


class InputBuilder:
    """Packs a ``SchedulerOutput`` into the tensors one forward pass reads.

    The loop is per sequence; everything per token is a numpy op. The int64 and the int32
    arrays each go to the device in one non-blocking copy, from persistent host staging
    buffers (page-locked where the platform copies asynchronously) into persistent device
    buffers; both grow to the largest step seen, the memory profile's at start-up, so a
    running engine allocates nothing here (allocating page-locked memory stalls the device).
    A step's inputs are views of the device buffers, valid until the next ``build``: the
    device reads them in stream order, before the next step's copy lands. Two staging
    buffers alternate, and one is refilled only once the copy that last read it has run
    (its event), so the host packs step N+1 while step N's copy may still be queued.
    """

    def __init__(self, platform: type[Platform], block_size: int) -> None:
        self.platform = platform
        self.block_size = block_size
        self.device = platform.device()
        self._device_buffers: dict[torch.dtype, torch.Tensor] = {}
        # per dtype: two (host buffer, event of the copy that last read it) slots
        self._staging: dict[torch.dtype, list[tuple[torch.Tensor, DeviceEvent | None]]] = {}
        self._turn = 0

    def build(self, out: SchedulerOutput, in_flight: InFlightTokens | None = None) -> ModelInputs:
        """``in_flight``: the previous step's sampled tokens; a chunk ending in one of them
        gets it copied from the previous step's output on the device."""
        block_size = self.block_size
        ids, query_lens, context_lens, tables, sample_rows = [], [], [], [], []
        fill_rows, fill_sources = [], []
        row = 0
        for item in out.scheduled:
            start, n = item.num_computed_tokens, item.num_new_tokens
            tokens = item.request.all_token_ids[start:start + n]
            if len(tokens) < n:  # only the last token can be in flight
                fill_rows.append(row + n - 1)
                fill_sources.append(in_flight.rows[item.request])
                tokens = [*tokens, 0]
            ids.extend(tokens)
            query_lens.append(n)
            context_lens.append(start)
            tables.append(item.block_ids)
            row += n
            if item.samples:
                sample_rows.append(row - 1)
        query_lens_np = np.asarray(query_lens, dtype=np.int64)
        context_np = np.asarray(context_lens, dtype=np.int64)
        seq_lens_np = context_np + query_lens_np
        starts = np.concatenate(([0], np.cumsum(query_lens_np)))
        # position of each row = its sequence's context length + its offset inside the chunk
        seq_of_row = np.repeat(np.arange(len(query_lens)), query_lens_np)
        positions = np.arange(starts[-1]) - starts[seq_of_row] + context_np[seq_of_row]

        table_np = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
        for i, t in enumerate(tables):
            table_np[i, :len(t)] = t
        slots = (table_np[seq_of_row, positions // block_size] * block_size
                 + positions % block_size)

        input_ids, positions_t, slot_mapping, logits_indices, fill_dst, fill_src = self._stage(
            torch.int64, ids, positions, slots, sample_rows, fill_rows, fill_sources)
        query_start_loc, seq_lens, context_lens_t, table_flat = self._stage(
            torch.int32, starts, seq_lens_np, context_np, table_np.ravel())
        if fill_rows:
            input_ids[fill_dst] = in_flight.token_ids[fill_src]
        meta = AttentionMetadata(
            num_seqs=len(query_lens),
            num_tokens=int(starts[-1]),
            max_query_len=int(query_lens_np.max()),
            max_seq_len=int(seq_lens_np.max()),
            block_size=block_size,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            context_lens=context_lens_t,
            block_tables=table_flat.view(table_np.shape),
            slot_mapping=slot_mapping,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens_np.tolist(),
        )
        return ModelInputs(input_ids=input_ids, positions=positions_t, meta=meta,
                           logits_indices=logits_indices)

    def _stage(self, dtype: torch.dtype, *parts) -> list[torch.Tensor]:
        """The arrays back to back in a staging buffer, copied to the device at once; returns
        a device view of each."""
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        slot = self._turn % 2
        if dtype not in self._staging or self._staging[dtype][slot][0].numel() < total:
            self._grow(dtype, total)
        slots = self._staging[dtype]
        host, event = slots[slot]
        if event is not None:
            event.synchronize()
        host_np = host.numpy()
        offset = 0
        for part, size in zip(parts, sizes):
            host_np[offset:offset + size] = part
            offset += size
        packed = self._device_buffers[dtype][:total]
        packed.copy_(host[:total], non_blocking=self.platform.pin_host_memory)
        slots[slot] = (host, self.platform.record_event())
        if dtype == torch.int32:  # the last region of a step: the next step takes turns
            self._turn += 1
        return list(packed.split(sizes))

    def _grow(self, dtype: torch.dtype, total: int) -> None:
        """Room for ``total`` elements (at least double the old), after every copy from the
        old staging buffers has run."""
        self.platform.synchronize()
        device = self._device_buffers.get(dtype)
        size = max(total, 2 * device.numel() if device is not None else 0)
        self._device_buffers[dtype] = torch.empty(size, dtype=dtype, device=self.device)
        self._staging[dtype] = [
            (torch.empty(size, dtype=dtype, pin_memory=self.platform.pin_host_memory), None)
            for _ in range(2)]
