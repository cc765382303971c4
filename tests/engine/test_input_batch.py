"""Packing a scheduled step into model inputs: every tensor against values worked out by hand
from the block tables, including a token still in flight."""

from __future__ import annotations

import torch

from pagedserve.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedserve.core.sequence import Sequence
from pagedserve.engine.input_batch import InFlightTokens, build_inputs
from pagedserve.sampling_params import SamplingParams


def _sequence(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), max_tokens=8)


def test_mixed_step_packs_chunks_positions_slots_and_tables():
    block = 4
    prefill = _sequence([11, 12, 13, 14, 15, 16])  # chunk of tokens 2..5, cached 0..1
    decode = _sequence([21, 22, 23])
    decode.num_pending_tokens = 1  # its 4th token is still being sampled
    out = SchedulerOutput([
        ScheduledSequence(prefill, 2, 4, [7, 3], samples=True),
        ScheduledSequence(decode, 3, 1, [5], samples=True),
    ])
    in_flight = InFlightTokens(torch.tensor([90, 91]), {decode: 1})
    inputs = build_inputs(out, block, torch.device("cpu"), in_flight)
    assert inputs.input_ids.tolist() == [13, 14, 15, 16, 91]
    assert inputs.positions.tolist() == [2, 3, 4, 5, 3]
    # token j of a sequence sits at block_table[j // 4] * 4 + j % 4
    assert inputs.meta.slot_mapping.tolist() == [30, 31, 12, 13, 23]
    assert inputs.meta.block_tables.tolist() == [[7, 3], [5, 0]]
    assert inputs.meta.query_start_loc.tolist() == [0, 4, 5]
    assert inputs.meta.seq_lens.tolist() == [6, 4]
    assert inputs.meta.context_lens.tolist() == [2, 3]
    assert inputs.logits_indices.tolist() == [3, 4]
    assert inputs.meta.max_query_len == 4 and inputs.meta.max_seq_len == 6
    assert inputs.meta.block_tables.dtype == torch.int32
    assert inputs.input_ids.dtype == inputs.meta.slot_mapping.dtype == torch.int64
