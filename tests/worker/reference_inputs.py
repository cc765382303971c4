"""A step's packed inputs built chunk by chunk, each chunk's tokens and block table an array of
its own: the reference ``worker/input_batch.pack_inputs`` (which collects flat lists and lays
the tables out in one copy) is checked against."""

from __future__ import annotations

import numpy as np

from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.core.sequence import Sequence
from pagedserve.worker import input_batch
from pagedserve.worker.input_batch import HostInputs
from pagedserve.worker.shape_buckets import ShapeBuckets


def pack_inputs_by_chunk(out: SchedulerOutput, block_size: int,
                         in_flight_rows: dict[Sequence, int] | None = None,
                         buckets: ShapeBuckets | None = None, pad_block: int = 0) -> HostInputs:
    """``input_batch.pack_inputs`` as it was first written: a numpy row per chunk and per
    block table."""
    ids, query_lens, context_lens, tables, sample_ends, sample_counts = [], [], [], [], [], []
    fill_rows, fill_sources, loras = [], [], []
    row = 0
    for item in out.scheduled:
        loras.append(item.seq.lora_request)
        start, n = item.num_computed_tokens, item.num_new_tokens
        num_known = n - len(item.draft_token_ids)  # the drafts come last
        tokens = item.seq.all_token_ids[start:start + num_known]
        if len(tokens) < num_known:  # only the last token can be in flight
            fill_rows.append(row + num_known - 1)
            fill_sources.append(in_flight_rows[item.seq])
            tokens = [*tokens, 0]
        ids.append([*tokens, *item.draft_token_ids])
        query_lens.append(n)
        context_lens.append(start)
        tables.append(item.block_ids)
        row += n
        if item.num_sample_positions:
            sample_ends.append(row)
            sample_counts.append(item.num_sample_positions)
    max_blocks = max(len(t) for t in tables)
    if buckets is not None:
        shape = buckets.pad(len(query_lens), row, max_blocks)
        max_blocks = shape.width
        num_padded = shape.num_seqs - len(query_lens)
        for n in input_batch._pad_query_lens(num_padded, shape.num_tokens - row):
            ids.append([0] * n)
            query_lens.append(n)
            context_lens.append(0)
            tables.append([pad_block] * max_blocks)
            loras.append(None)
    query_lens_np = np.asarray(query_lens, dtype=np.int64)
    context_np = np.asarray(context_lens, dtype=np.int64)
    seq_lens_np = context_np + query_lens_np
    starts = np.concatenate(([0], np.cumsum(query_lens_np)))
    # Row by row: a chunk's rows sit at its context length onwards and write the slot its
    # block table gives; padded rows sit at position 0 (the pad block's first slot).
    positions, slots = [], []
    for i, (n, context) in enumerate(zip(query_lens, context_lens, strict=True)):
        for position in (range(context, context + n) if i < len(out.scheduled) else [0] * n):
            positions.append(position)
            slots.append(tables[i][position // block_size] * block_size
                         + position % block_size)
    table_np = np.zeros((len(tables), max_blocks), dtype=np.int64)
    for i, t in enumerate(tables):
        table_np[i, :len(t)] = t
    return HostInputs(
        input_ids=np.concatenate([np.asarray(i, dtype=np.int64) for i in ids]),
        positions=np.asarray(positions, dtype=np.int64), query_start_loc=starts,
        seq_lens=seq_lens_np, context_lens=context_np, block_tables=table_np,
        slot_mapping=np.asarray(slots, dtype=np.int64),
        query_lens=query_lens,
        max_seq_len=(int(seq_lens_np.max()) if buckets is None else max_blocks * block_size),
        block_size=block_size,
        sample_rows=input_batch._sample_rows(sample_ends, sample_counts),
        sample_counts=np.asarray(sample_counts, dtype=np.int64),
        fill_rows=np.asarray(fill_rows, dtype=np.int64),
        fill_sources=np.asarray(fill_sources, dtype=np.int64),
        lora_requests=loras if any(loras) else None,
        decode_or_verify=all(_decodes(out)),
        decode=_decodes(out) + [False] * (len(query_lens) - len(out.scheduled)))


def _decodes(out: SchedulerOutput) -> list[bool]:
    """Per scheduled sequence: one known token after its prompt, and its drafts."""
    return [item.num_new_tokens - len(item.draft_token_ids) == 1
            and item.num_computed_tokens >= item.seq.num_prompt_tokens for item in out.scheduled]
