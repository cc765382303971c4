"""Turn a ``SchedulerOutput`` into the packed tensors one forward pass reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.request import Request
from pagedserve.core.scheduler import SchedulerOutput


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
    arrays each go to the device in one non-blocking copy, into persistent device buffers
    that grow to the largest step seen (the memory profile's, at start-up). A step's inputs
    are views of those buffers, valid until the next ``build``; the device reads them in
    stream order, before the next step's copy lands. The host side is
    staged in page-locked memory where the platform copies asynchronously: torch's caching
    host allocator hands such a block out again only after the copy that read it has run, so
    the host can pack step N+1 while step N's copy is still queued.
    """

    def __init__(self, block_size: int, device: torch.device, pin_memory: bool) -> None:
        self.block_size = block_size
        self.device = device
        self.pin_memory = pin_memory
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

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
        """The arrays back to back in one host tensor, copied to the device at once; returns
        a device view of each."""
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        host = torch.empty(total, dtype=dtype, pin_memory=self.pin_memory)
        host_np = host.numpy()
        offset = 0
        for part, size in zip(parts, sizes):
            host_np[offset:offset + size] = part
            offset += size
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < total:
            grown = 2 * buffer.numel() if buffer is not None else 0
            buffer = self._buffers[dtype] = torch.empty(max(total, grown), dtype=dtype,
                                                        device=self.device)
        packed = buffer[:total]
        packed.copy_(host, non_blocking=True)
        return list(packed.split(sizes))
