"""Packing a scheduled step into model inputs: every tensor against values worked out by hand
from the block tables, including a token still in flight."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedserve.core.scheduler import ScheduledSequence, SchedulerOutput
from pagedserve.core.sequence import Sequence
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.input_batch import InFlightTokens, build_inputs, pack_inputs


def _sequence(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), max_tokens=8)


def test_mixed_step_packs_chunks_positions_slots_and_tables():
    block = 4
    prefill = _sequence([11, 12, 13, 14, 15, 16])  # chunk of tokens 2..5, cached 0..1
    decode = _sequence([21, 22, 23])
    decode.num_pending_tokens = 1  # its 4th token is still being sampled
    out = SchedulerOutput([
        ScheduledSequence(prefill, 2, 4, [7, 3], num_sample_positions=1),
        ScheduledSequence(decode, 3, 1, [5], num_sample_positions=1),
    ])
    in_flight = InFlightTokens(torch.tensor([90, 91]), {decode: 1})
    inputs = build_inputs(out, block, torch.device("cpu"), in_flight)
    assert inputs.input_ids.tolist() == [13, 14, 15, 16, 91]
    assert inputs.positions.tolist() == [2, 3, 4, 5, 3]
    # token j of a sequence sits at block_table[j // 4] * 4 + j % 4
    assert inputs.ctx.attn.slot_mapping.tolist() == [30, 31, 12, 13, 23]
    assert inputs.ctx.attn.block_tables.tolist() == [[7, 3], [5, 0]]
    assert inputs.ctx.attn.query_start_loc.tolist() == [0, 4, 5]
    assert inputs.ctx.attn.seq_lens.tolist() == [6, 4]
    assert inputs.ctx.attn.context_lens.tolist() == [2, 3]
    assert inputs.logits_indices.tolist() == [3, 4]
    assert inputs.ctx.attn.max_query_len == 4 and inputs.ctx.attn.max_seq_len == 6
    assert inputs.ctx.attn.block_tables.dtype == torch.int32
    assert inputs.input_ids.dtype == inputs.ctx.attn.slot_mapping.dtype == torch.int64


def test_bucketed_mixed_step_pads_into_the_pad_block_only():
    """The same step as above, padded: the real rows are unchanged, one padded sequence owns
    every padded token, and padded tokens write only the pad block's first slot."""
    from pagedserve.worker.shape_buckets import ShapeBuckets

    block, pad_block = 4, 9
    prefill = _sequence([11, 12, 13, 14, 15, 16])
    decode = _sequence([21, 22, 23, 24])
    out = SchedulerOutput([
        ScheduledSequence(prefill, 2, 4, [7, 3], num_sample_positions=1),
        ScheduledSequence(decode, 3, 1, [5], num_sample_positions=1),
    ])
    buckets = ShapeBuckets.for_limits(max_num_seqs=4, max_num_batched_tokens=16,
                                      max_blocks_per_seq=8)
    inputs = build_inputs(out, block, torch.device("cpu"), buckets=buckets,
                          pad_block=pad_block)
    # 2 sequences + the padded one -> 4; 5 tokens + 2 padded sequences -> 8; 2 blocks -> 2.
    meta = inputs.ctx.attn
    assert (meta.num_seqs, meta.num_tokens, meta.block_tables.shape[1]) == (4, 8, 2)
    assert inputs.input_ids.tolist() == [13, 14, 15, 16, 24, 0, 0, 0]
    assert inputs.positions.tolist() == [2, 3, 4, 5, 3, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [30, 31, 12, 13, 23, 36, 36, 36]
    assert meta.block_tables.tolist() == [[7, 3], [5, 0], [9, 9], [9, 9]]
    assert meta.query_start_loc.tolist() == [0, 4, 5, 6, 8]
    assert meta.seq_lens.tolist() == [6, 4, 1, 2]
    assert inputs.logits_indices.tolist() == [3, 4]
    assert meta.max_seq_len == 2 * block  # the table's capacity


def test_bucketed_decode_step_stays_decode_only():
    from pagedserve.worker.shape_buckets import ShapeBuckets

    seqs = [_sequence([1, 2, 3]) for _ in range(3)]
    out = SchedulerOutput([ScheduledSequence(s, 2, 1, [i], num_sample_positions=1)
                           for i, s in enumerate(seqs)])
    buckets = ShapeBuckets.for_limits(8, 64, 8)
    inputs = build_inputs(out, 4, torch.device("cpu"), buckets=buckets, pad_block=20)
    assert inputs.ctx.attn.is_decode_only
    assert inputs.ctx.attn.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert inputs.ctx.attn.slot_mapping.tolist() == [2, 6, 10, 80]
    assert inputs.logits_indices.tolist() == [0, 1, 2]


def test_bucket_ladders_and_budget():
    from pagedserve.worker.shape_buckets import ShapeBuckets, ladder

    assert ladder(1) == (1,) and ladder(8) == (1, 2, 4, 8) and ladder(9) == (1, 2, 4, 8, 9)
    buckets = ShapeBuckets.for_limits(max_num_seqs=8, max_num_batched_tokens=64,
                                      max_blocks_per_seq=8)
    assert buckets.seqs == (1, 2, 4, 8, 9)
    assert buckets.tokens == (1, 2, 4, 8, 16, 32, 64, 73)
    assert buckets.widths == (1, 2, 4, 8)
    # Every (seqs, tokens, width) a step can have maps into the ladders.
    shapes = {buckets.pad(s, t, w) for s in range(1, 9) for t in range(s, 65)
              for w in range(1, 9)}
    assert all(p.num_seqs in buckets.seqs and p.num_tokens in buckets.tokens
               and p.width in buckets.widths for p in shapes)
    assert len(shapes) <= buckets.num_shapes == 5 * 4 * 9


def _random_step(rng: random.Random, block: int) -> tuple[SchedulerOutput, dict[Sequence, int]]:
    """A step of prefill chunks, decodes (some with their token in flight) and verify
    chunks with drafts, over random block tables; some sequences have an adapter."""
    from pagedserve.lora.request import LoRARequest

    items, in_flight = [], {}
    for i in range(rng.randint(1, 12)):
        seq = _sequence([rng.randrange(1, 500) for _ in range(rng.randint(1, 40))])
        if rng.random() < 0.2:
            seq.lora_request = LoRARequest(f"a{i}", i + 1, "unused")
        kind = rng.choice(["prefill", "decode", "in_flight", "verify"])
        drafts = ()
        if kind == "prefill":
            start = rng.randrange(seq.num_tokens)
            n = rng.randint(1, seq.num_tokens - start)
        elif kind == "verify":
            drafts = tuple(rng.randrange(1, 500) for _ in range(rng.randint(1, 4)))
            start, n = seq.num_tokens - 1, 1 + len(drafts)
        else:
            start, n = seq.num_tokens - 1, 1
            if kind == "in_flight":
                seq.num_pending_tokens, start = 1, seq.num_tokens
                in_flight[seq] = rng.randrange(16)
        table = rng.sample(range(200), -(-(start + n) // block))
        reaches_end = start + n - len(drafts) >= seq.num_tokens
        items.append(ScheduledSequence(seq, start, n, table, reaches_end + len(drafts), drafts))
    return SchedulerOutput(items), in_flight


@pytest.mark.parametrize("bucketed", [False, True])
def test_packing_equals_the_chunk_by_chunk_build(bucketed):
    """``pack_inputs`` (flat lists, one copy of the tables) builds exactly the arrays of the
    chunk-by-chunk reference, over random mixed steps, padded to buckets or not."""
    from pagedserve.worker.shape_buckets import ShapeBuckets
    from tests.worker.reference_inputs import pack_inputs_by_chunk

    rng, block = random.Random(0), 4
    buckets = ShapeBuckets.for_limits(16, 256, 16) if bucketed else None
    for _ in range(200):
        out, in_flight = _random_step(rng, block)
        got = pack_inputs(out, block, in_flight, buckets, pad_block=250)
        want = pack_inputs_by_chunk(out, block, in_flight, buckets, pad_block=250)
        for name, value in vars(want).items():
            if isinstance(value, np.ndarray):
                assert np.array_equal(getattr(got, name), value), name
                assert getattr(got, name).dtype == value.dtype, name
            else:
                assert getattr(got, name) == value, name
