"""Bucketed step shapes, for devices that compile a graph per distinct input shape (Gaudi).

A step's packed inputs have three sizes that change from step to step: the number of
sequences, the number of tokens and the block-table width (blocks of the longest context).
With bucketing each is padded up to the next entry of a ladder (powers of two, then the
maximum), so a whole run sees at most ``num_shapes`` distinct shapes, and warm-up can run
each of them once before the first request.

Padding invariants (``input_batch.build_inputs``): real sequences and tokens come first, in
scheduling order, so sampled rows and prompt-logprob rows are where they are unpadded. Padded
sequences and tokens write keys and values only into a reserved pad block that no request
owns, read nothing else, and are never sampled. A step with a prompt chunk always gets at
least one padded sequence, and the padded sequences own the padded tokens (one each, the last
one the rest), so the number of tokens can be padded independently of the number of
sequences; a decode-only step pads both equally (one token per padded sequence), so it stays
decode-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


def ladder(maximum: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``maximum``, then ``maximum``."""
    steps = []
    size = 1
    while size < maximum:
        steps.append(size)
        size *= 2
    return (*steps, maximum)


def _round_up(n: int, steps: tuple[int, ...]) -> int:
    # A size past the ladder (a block table longer than max_model_len needs) stays as it is.
    return next((s for s in steps if s >= n), n)


class BatchShape(NamedTuple):
    num_seqs: int
    num_tokens: int
    width: int  # block-table columns


@dataclass(frozen=True)
class ShapeBuckets:
    seqs: tuple[int, ...]
    tokens: tuple[int, ...]
    widths: tuple[int, ...]

    @classmethod
    def for_limits(cls, max_num_seqs: int, max_num_batched_tokens: int,
                   max_blocks_per_seq: int) -> ShapeBuckets:
        # One sequence more than the scheduler's limit: the padded one of a prefill step.
        seqs = ladder(max_num_seqs + 1)
        return cls(seqs, ladder(max_num_batched_tokens + seqs[-1]), ladder(max_blocks_per_seq))

    def pad(self, num_seqs: int, num_tokens: int, width: int) -> BatchShape:
        """The bucketed shape of a step; ``num_tokens == num_seqs`` means decode-only."""
        if num_tokens == num_seqs:
            padded = _round_up(num_seqs, self.seqs)
            return BatchShape(padded, padded, _round_up(width, self.widths))
        padded = _round_up(num_seqs + 1, self.seqs)
        return BatchShape(padded, _round_up(num_tokens + padded - num_seqs, self.tokens),
                          _round_up(width, self.widths))

    @property
    def num_shapes(self) -> int:
        """How many distinct shapes ``pad`` can return, at most: decode-only steps (as many
        tokens as sequences) and steps with prompt chunks."""
        return len(self.seqs) * len(self.widths) * (1 + len(self.tokens))
