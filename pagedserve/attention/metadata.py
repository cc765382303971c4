"""The batch description every attention backend reads.

A step's tokens are packed without padding: sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]``. Its keys are the ``context_lens[i]`` tokens already
in the paged cache followed by the new rows, ``seq_lens[i]`` in all. Token ``j`` of a sequence
lives in cache slot ``block_tables[i, j // block_size] * block_size + j % block_size``;
``slot_mapping`` gives that slot for each new row, so backends write keys and values first and
then attend over the cache alone.

Where the platform buckets shapes, padded sequences follow the real ones (with padded tokens
after the real tokens) and write only a reserved pad block; ``max_seq_len`` is then the block
table's capacity rather than the longest sequence (worker/shape_buckets.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int  # at least every real sequence's length
    block_size: int
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    context_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    # Host copies, so loops over sequences never read device memory.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Every sequence's query is one known token and its drafts (a decode or a speculative
    # verify chunk), no prompt chunk: a backend may then attend row by row as decode steps
    # do, and a prompt's numbers never depend on whether its prefix was cached.
    decode_or_verify: bool = False
    # Per sequence, whether its query is one known token after its prompt and its drafts (a
    # decode or a verify chunk; ``decode_or_verify`` is all of them); None: not known, as in
    # a captured graph's metadata. A backend that attends these row by row and prompt chunks
    # otherwise picks each sequence's kernel by this, never by the rest of its step.
    decode_cpu: list[bool] | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
