"""Turn a ``SchedulerOutput`` into the packed tensors one forward pass reads."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.core.sequence import Sequence
from pagedserve.models.forward_context import ForwardContext
from pagedserve.worker.shape_buckets import ShapeBuckets


@dataclass
class InFlightTokens:
    """The tokens sampled by the step before this one, still on the device: under async
    scheduling a stream's next input can be one of them, unknown to the host."""

    token_ids: torch.Tensor  # int64 [num_sampled * max_positions], on the device
    rows: dict[Sequence, int]  # stream -> the index of its last sampled token in token_ids

if TYPE_CHECKING:
    from pagedserve.lora.request import LoRARequest


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    ctx: ForwardContext  # the attention metadata and the per-row extras
    # Rows of each sampling sequence's sample positions, in scheduling order.
    logits_indices: torch.Tensor  # int64 [num_sample_positions]


@dataclass
class HostInputs:
    """One step's packed inputs as host arrays: plain data, so a driver builds them once and
    sends them to every tensor-parallel rank, which only moves them to its device."""

    input_ids: np.ndarray  # int64 [num_tokens]; 0 where a token is still in flight
    positions: np.ndarray  # int64 [num_tokens]
    query_start_loc: np.ndarray  # [num_seqs + 1]
    seq_lens: np.ndarray  # [num_seqs]
    context_lens: np.ndarray  # [num_seqs]
    block_tables: np.ndarray  # [num_seqs, max_blocks]
    slot_mapping: np.ndarray  # [num_tokens]
    query_lens: list[int]
    # The longest sequence; with bucketed shapes the table's capacity, so the shapes a
    # backend derives from it are bucketed too.
    max_seq_len: int
    block_size: int
    sample_rows: np.ndarray  # int64 [num_sample_positions]: rows of the sample positions
    sample_counts: np.ndarray  # int64 [num_sampling]: sample positions of each sequence
    # Rows whose token is row ``fill_sources[i]`` of the previous step's sampled tokens.
    fill_rows: np.ndarray
    fill_sources: np.ndarray
    # Each sequence's adapter (None: the base model; padded sequences have none), or None
    # when no sequence of the step has one.
    lora_requests: list[LoRARequest | None] | None = None
    decode_or_verify: bool = False  # AttentionMetadata.decode_or_verify
    decode: list[bool] | None = None  # AttentionMetadata.decode_cpu
    # Per row: its sequence rotates by longrope's long factors (ForwardContext.long_rope);
    # None when no sequence of the step does.
    long_rope: np.ndarray | None = None

    def to_device(self, device: torch.device,
                  in_flight_tokens: torch.Tensor | None = None) -> ModelInputs:
        def to_dev(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(array).to(device=device, dtype=dtype, non_blocking=True)

        meta = AttentionMetadata(
            num_seqs=len(self.query_lens),
            num_tokens=int(self.query_start_loc[-1]),
            max_query_len=max(self.query_lens),
            max_seq_len=self.max_seq_len,
            block_size=self.block_size,
            query_start_loc=to_dev(self.query_start_loc, torch.int32),
            seq_lens=to_dev(self.seq_lens, torch.int32),
            context_lens=to_dev(self.context_lens, torch.int32),
            block_tables=to_dev(self.block_tables, torch.int32),
            slot_mapping=to_dev(self.slot_mapping, torch.int64),
            query_lens_cpu=self.query_lens,
            seq_lens_cpu=self.seq_lens.tolist(),
            decode_or_verify=self.decode_or_verify,
            decode_cpu=self.decode,
        )
        input_ids = to_dev(self.input_ids, torch.int64)
        if len(self.fill_rows):
            input_ids[to_dev(self.fill_rows, torch.int64)] = in_flight_tokens[
                to_dev(self.fill_sources, torch.int64)]
        long_rope = None if self.long_rope is None else to_dev(self.long_rope, torch.bool)
        return ModelInputs(input_ids=input_ids, positions=to_dev(self.positions, torch.int64),
                           ctx=ForwardContext(meta, long_rope=long_rope),
                           logits_indices=to_dev(self.sample_rows, torch.int64))


def build_inputs(out: SchedulerOutput, block_size: int, device: torch.device,
                 in_flight: InFlightTokens | None = None, buckets: ShapeBuckets | None = None,
                 pad_block: int = 0) -> ModelInputs:
    return pack_inputs(out, block_size, in_flight and in_flight.rows, buckets,
                       pad_block).to_device(device, in_flight and in_flight.token_ids)


def pack_inputs(out: SchedulerOutput, block_size: int,
                in_flight_rows: dict[Sequence, int] | None = None,
                buckets: ShapeBuckets | None = None, pad_block: int = 0) -> HostInputs:
    """Pack every scheduled chunk back to back, a verify step's drafts after its known tokens.
    The loop is per sequence and only collects plain lists (flat token ids, one table list
    per sequence); everything per token or per block is a numpy array op. A chunk ending in
    a token still in flight gets it from row ``in_flight_rows[seq]`` of the previous step's
    output, on the device. With ``buckets`` the batch is padded to a bucketed shape with
    sequences whose keys and values go to block ``pad_block`` (shape_buckets.py states the
    invariants). ``tests/worker/reference_inputs.py`` builds the same arrays chunk by chunk."""
    ids, query_lens, context_lens, tables, sample_ends, sample_counts = [], [], [], [], [], []
    fill_rows, fill_sources, loras, decode, long_rope = [], [], [], [], []
    row = 0
    for item in out.scheduled:
        seq, start, n, drafts = (item.seq, item.num_computed_tokens, item.num_new_tokens,
                                 item.draft_token_ids)
        loras.append(seq.lora_request)
        long_rope.append(seq.long_rope)
        num_known = n - len(drafts)  # the drafts come last
        tokens = seq.all_token_ids[start:start + num_known]
        ids += tokens
        if len(tokens) < num_known:  # only the last token can be in flight
            fill_rows.append(row + num_known - 1)
            fill_sources.append(in_flight_rows[seq])
            ids.append(0)
        ids += drafts
        decode.append(num_known == 1 and start >= seq.num_prompt_tokens)
        query_lens.append(n)
        context_lens.append(start)
        tables.append(item.block_ids)
        row += n
        if item.num_sample_positions:
            sample_ends.append(row)
            sample_counts.append(item.num_sample_positions)
    max_blocks = max(map(len, tables))
    if buckets is not None:
        shape = buckets.pad(len(query_lens), row, max_blocks)
        max_blocks = shape.width
        for n in _pad_query_lens(shape.num_seqs - len(query_lens), shape.num_tokens - row):
            ids += [0] * n
            query_lens.append(n)
            context_lens.append(0)
            tables.append([pad_block] * max_blocks)
            loras.append(None)
            decode.append(False)
            long_rope.append(False)
    query_lens_np = np.asarray(query_lens, dtype=np.int64)
    context_np = np.asarray(context_lens, dtype=np.int64)
    seq_lens_np = context_np + query_lens_np
    starts = np.concatenate(([0], np.cumsum(query_lens_np)))
    # position of each row = its sequence's context length + its offset inside the chunk
    seq_of_row = np.repeat(np.arange(len(query_lens)), query_lens_np)
    positions = np.arange(starts[-1]) - starts[seq_of_row] + context_np[seq_of_row]
    # Padded rows sit at position 0, so they all write the pad block's first slot.
    positions[row:] = 0

    table_np = _block_table(tables, max_blocks)
    slots = table_np[seq_of_row, positions // block_size] * block_size + positions % block_size
    return HostInputs(
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=positions, query_start_loc=starts, seq_lens=seq_lens_np,
        context_lens=context_np, block_tables=table_np, slot_mapping=slots,
        query_lens=query_lens,
        max_seq_len=(int(seq_lens_np.max()) if buckets is None else max_blocks * block_size),
        block_size=block_size,
        sample_rows=_sample_rows(sample_ends, sample_counts),
        sample_counts=np.asarray(sample_counts, dtype=np.int64),
        fill_rows=np.asarray(fill_rows, dtype=np.int64),
        fill_sources=np.asarray(fill_sources, dtype=np.int64),
        lora_requests=loras if any(loras) else None,
        long_rope=np.repeat(long_rope, query_lens_np) if any(long_rope) else None,
        decode_or_verify=all(decode[:len(out.scheduled)]), decode=decode)


def _block_table(tables: list[list[int]], width: int) -> np.ndarray:
    """The tables as one zero-padded [num_seqs, width] array: one copy of all their ids, laid
    into the rows by a mask (row-major, so each row's ids land in order)."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    table = np.zeros((len(tables), width), dtype=np.int64)
    table[np.arange(width) < lens[:, None]] = np.fromiter(
        chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
    return table


def _sample_rows(ends: list[int], counts: list[int]) -> np.ndarray:
    """The last ``counts[i]`` rows before row ``ends[i]``, for each sampling sequence."""
    counts_np = np.asarray(counts, dtype=np.int64)
    offsets = np.arange(counts_np.sum()) - np.repeat(np.cumsum(counts_np) - counts_np, counts_np)
    return np.repeat(np.asarray(ends, dtype=np.int64) - counts_np, counts_np) + offsets


def _pad_query_lens(num_seqs: int, num_tokens: int) -> list[int]:
    """Query lengths of the padded sequences: one token each, the last one the rest."""
    if num_seqs == 0:
        return []
    return [1] * (num_seqs - 1) + [num_tokens - num_seqs + 1]
