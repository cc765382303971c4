"""The sampler at several positions per sequence: a row per position, folded back into
[sequences, max_positions] with a count per sequence."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.sample.sampler import Sampler, process_logits
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.grammar_state import GrammarMask
from tests.sample.reference_metadata import build_metadata
from tests.sample.test_sampler import random_batch

CPU = torch.device("cpu")
COUNTS = [3, 1, 2, 4]
sampler = Sampler()


def _build(params, prompts, outputs, generators, vocab, counts, eos=(2,)):
    return build_metadata(params, prompts, outputs, generators, vocab, CPU, list(eos),
                                  num_positions=counts)


def _position_rows(counts):
    """(sequence, position) of each logits row, in row order."""
    return [(i, j) for i, c in enumerate(counts) for j in range(c)]


def test_greedy_ids_are_the_argmax_of_each_position():
    logits = torch.randn(sum(COUNTS), 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * len(COUNTS)
    n = len(COUNTS)
    out = sampler(logits, _build(params, [[]] * n, [[]] * n, [None] * n, 50, COUNTS))
    assert out.token_ids.shape == (n, max(COUNTS)) and out.logprobs is None
    argmax = logits.argmax(dim=-1)
    for p, (i, j) in enumerate(_position_rows(COUNTS)):
        assert out.token_ids[i, j] == argmax[p]


@pytest.mark.parametrize("seed", range(4))
def test_logprobs_equal_a_float64_reference_of_the_processed_logits(seed):
    params, prompts, outputs, _ = random_batch(seed, len(COUNTS), 64, logprobs=4)
    logits = torch.randn(sum(COUNTS), 64, generator=torch.Generator().manual_seed(seed))
    n = len(COUNTS)
    meta = _build(params, prompts, outputs, [None] * n, 64, COUNTS)
    out = sampler(logits, meta)
    ref = torch.log_softmax(process_logits(logits, meta).double(), dim=-1)
    assert out.top_ids.shape == (n, max(COUNTS), 4)
    for p, (i, j) in enumerate(_position_rows(COUNTS)):
        token = out.token_ids[i, j]
        assert torch.isfinite(ref[p, token])  # never a masked token
        torch.testing.assert_close(out.logprobs[i, j].double(), ref[p, token], atol=1e-5, rtol=0)
        assert out.ranks[i, j] == (ref[p] > ref[p, token]).sum() + 1
        top = ref[p].topk(4)
        assert torch.equal(out.top_ids[i, j], top.indices)
        torch.testing.assert_close(out.top_logprobs[i, j].double(), top.values, atol=1e-5,
                                   rtol=0)


def test_each_position_samples_as_a_one_position_row_with_its_outputs_so_far():
    """Penalties, logit_bias and min_tokens per position: position j of a sequence is the
    sequence sampled alone once j more tokens are out (min_tokens counts them), its seeded
    generator drawing for its positions in order."""
    params, prompts, outputs, _ = random_batch(7, len(COUNTS), 64, min_tokens=6,
                                               temperature=0.8, top_k=-1, top_p=1.0,
                                               min_p=0.0, logprobs=2)
    params = [dataclasses.replace(p, seed=100 + i) for i, p in enumerate(params)]
    outputs = [[5] * 4 for _ in COUNTS]  # 4 out: min_tokens=6 holds for positions 0 and 1
    logits = torch.randn(sum(COUNTS), 64, generator=torch.Generator().manual_seed(1))
    gens = [torch.Generator().manual_seed(100 + i) for i in range(len(COUNTS))]
    out = sampler(logits, _build(params, prompts, outputs, gens, 64, COUNTS))
    alone = [torch.Generator().manual_seed(100 + i) for i in range(len(COUNTS))]
    for p, (i, j) in enumerate(_position_rows(COUNTS)):
        one = dataclasses.replace(params[i], min_tokens=params[i].min_tokens - j)
        ref = sampler(logits[p:p + 1], _build([one], [prompts[i]], [outputs[i]], [alone[i]],
                                              64, None))
        assert out.token_ids[i, j] == ref.token_ids[0, 0]
        assert torch.equal(out.logprobs[i, j], ref.logprobs[0, 0])
        assert torch.equal(out.top_logprobs[i, j], ref.top_logprobs[0, 0])


def test_the_grammar_mask_has_a_row_per_position():
    vocab = 64
    logits = torch.zeros(sum(COUNTS), vocab)
    logits[:, 9] = 5.0  # every position prefers token 9 ...
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 3  # ... but position row 4 (sequence 2's first) allows only 3
    n = len(COUNTS)
    meta = _build([SamplingParams(temperature=0.0)] * n, [[]] * n, [[]] * n, [None] * n,
                  vocab, COUNTS)
    meta.grammar_mask = GrammarMask(torch.tensor([4]), bitmask)
    out = sampler(logits, meta)
    assert out.token_ids[2, :2].tolist() == [3, 9]
    assert out.token_ids[0, :3].tolist() == [9, 9, 9]


@pytest.mark.parametrize("seed", range(3))
def test_one_position_per_row_is_the_one_row_path_bit_for_bit(seed):
    """Counts of 1 are today's batch: the same tokens, seeded draws and logprobs as the
    sampler's row-per-sequence path, read as [N, 1]."""
    n = 6
    params, prompts, outputs, logits = random_batch(seed, n, 64)
    params = [dataclasses.replace(p, seed=seed * 10 + i) for i, p in enumerate(params)]

    def run(counts, sample):
        torch.manual_seed(seed)  # the unseeded rows' shared draw
        gens = [torch.Generator().manual_seed(seed * 10 + i) for i in range(n)]
        meta = _build(params, prompts, outputs, gens, 64, counts)
        return meta, sample(logits, meta)

    meta, ones = run([1] * n, sampler)
    assert meta.positions is None
    flat = run(None, Sampler._sample)[1]
    for got, want in zip(ones, flat, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got.squeeze(1), want)
