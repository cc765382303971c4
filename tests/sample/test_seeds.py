"""Per-stream seeds: every bit of the request's seed counts, and streams are unrelated."""

from __future__ import annotations

import pytest
import torch

from pagedserve.sample.seeds import stream_seed

# torch's CPU generator keeps only the low 32 bits of its seed, so that is where seeds must
# differ.
LOW_BITS = 2**32


def test_the_high_bits_of_a_seed_count():
    for seed in (5, 0, 123456789):
        assert stream_seed(seed, 0) % LOW_BITS != stream_seed(seed + 2**32, 0) % LOW_BITS
        assert stream_seed(seed, 0) % LOW_BITS != stream_seed(seed + 2**62, 0) % LOW_BITS


def test_choice_i_is_not_the_first_choice_of_seed_plus_i():
    for seed in range(200):
        for index in range(1, 4):
            assert stream_seed(seed, index) != stream_seed(seed + index, 0)


def test_no_two_of_many_streams_share_a_generator_state():
    seeds = {stream_seed(s, i) % LOW_BITS for s in range(-500, 500) for i in range(8)}
    assert len(seeds) == 1000 * 8


@pytest.mark.parametrize("seed", [0, -1, -(2**63), 2**63 - 1, 2**100])
def test_same_inputs_same_seed_and_torch_accepts_it(seed):
    value = stream_seed(seed, 3)
    assert value == stream_seed(seed, 3)
    assert 0 <= value < 2**63
    torch.Generator().manual_seed(value)
