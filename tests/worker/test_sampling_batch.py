"""Rank 0's persistent sampling batch: a step's metadata gathered from rows kept across steps
equals the metadata built from scratch, and a seeded row's generator persists (same object,
same draws) while other rows come and go."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pagedserve.core.sequence import Sequence, SequenceStatus
from pagedserve.sample.logits_processor import LogitsProcessor
from pagedserve.sample.metadata import SamplingMetadata
from pagedserve.sample.sampler import Sampler
from pagedserve.sample.seeds import stream_seed
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.sampling_batch import SamplingBatch
from tests.sample.reference_metadata import build_metadata
from tests.sample.test_sampler import random_params

CPU = torch.device("cpu")
EOS = frozenset({2, 9})
VOCAB = 48
sampler = Sampler()


def _seq(params: SamplingParams, seed: int | None = None, rng: random.Random | None = None):
    rng = rng or random.Random(0)
    seq = Sequence([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 10))], params, 100,
                   EOS, seed=seed)
    for _ in range(rng.randrange(6)):
        seq.append_output(rng.randrange(VOCAB))
    return seq


def _assert_same(got: SamplingMetadata, want: SamplingMetadata) -> None:
    for field in dataclasses.fields(SamplingMetadata):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if field.name == "generators":
            assert a.keys() == b.keys() and all(a[k] is b[k] for k in a)
        else:
            assert _flat(a) == _flat(b), field.name


def _flat(value):
    """Tensors (also inside tuples and dataclasses) as (dtype, shape, values)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape), value.tolist()
    if isinstance(value, tuple):
        return tuple(_flat(v) for v in value)
    if dataclasses.is_dataclass(value):
        return tuple(_flat(getattr(value, f.name)) for f in dataclasses.fields(value))
    return value


@pytest.mark.parametrize("seed", range(6))
def test_gathered_metadata_equals_a_rebuilt_one_as_rows_come_and_go(seed):
    rng = random.Random(seed)
    batch = SamplingBatch(VOCAB, CPU, capacity=2)  # grows and reclaims rows on the way
    live: list[Sequence] = []
    for _ in range(8):
        for _ in range(rng.randrange(4)):
            params = random_params(rng, VOCAB, seed=rng.choice([None, 3]))
            live.append(_seq(params, None if params.seed is None else rng.randrange(2**63), rng))
        for seq in rng.sample(live, k=min(len(live), rng.randrange(3))):
            seq.status = SequenceStatus.FINISHED_STOPPED
            live.remove(seq)
        if not live:
            continue
        seqs = rng.sample(live, k=rng.randrange(1, len(live) + 1))
        counts = [rng.choice([1, 1, 2, 3]) for _ in seqs]
        got = batch.metadata(seqs, counts)
        want = build_metadata(
            [s.params for s in seqs], [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [batch.generators[batch.rows[s]] for s in seqs], VOCAB, CPU, sorted(EOS),
            num_positions=counts)
        _assert_same(got, want)
    assert len(batch.rows) <= len(batch.generators)


def _target_logits(step: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(100 + step)) * 2


def _run_target(crowd: bool, steps: int = 14) -> tuple[list[int], list[torch.Generator]]:
    """The seeded target's tokens, sampled alone or among rows that are added, finish and are
    preempted (here: skip steps) around it; and the generator it drew from at each step."""
    rng = random.Random(1)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    target = Sequence([1, 2, 3], params, 100, EOS, seed=stream_seed(11, 0))
    batch = SamplingBatch(VOCAB, CPU, capacity=1)
    others: list[Sequence] = []
    tokens, generators = [], []
    for step in range(steps):
        preempted = crowd and step in (4, 5, 9)
        target.status = SequenceStatus.WAITING if preempted else SequenceStatus.RUNNING
        seqs = [] if preempted else [target]
        if crowd:  # the last step's others finish, new ones take their rows
            for seq in others:
                seq.status = SequenceStatus.FINISHED_STOPPED
            others = [_seq(random_params(rng, VOCAB, seed=7), seed=rng.randrange(2**63),
                           rng=rng) for _ in range(1 + step % 2)]
            seqs += others
            rng.shuffle(seqs)
        logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(step))
        if target in seqs:
            logits[seqs.index(target)] = _target_logits(len(tokens))
        out = sampler(logits, batch.metadata(seqs, [1] * len(seqs)))
        if target in seqs:
            tokens.append(int(out.token_ids[seqs.index(target), 0]))
            generators.append(batch.generators[batch.rows[target]])
    return tokens, generators


def test_a_seeded_row_samples_the_same_tokens_alone_or_among_rows_that_come_and_go():
    alone, _ = _run_target(crowd=False, steps=11)
    among, generators = _run_target(crowd=True)
    assert len(among) == 11 and among == alone
    # One generator object throughout, preemptions included.
    assert all(g is generators[0] for g in generators)


def test_a_row_keeps_its_generator_until_its_sequence_finishes():
    batch = SamplingBatch(VOCAB, CPU, capacity=1)
    seeded = Sequence([1], SamplingParams(temperature=1.0, seed=4), 10, EOS, seed=5)
    batch.metadata([seeded], [1])
    generator = batch.generators[batch.rows[seeded]]
    seeded.status = SequenceStatus.SWAPPED  # preempted: the row and its generator stay
    other = Sequence([1], SamplingParams(temperature=1.0), 10, EOS)
    batch.metadata([other], [1])
    seeded.status = SequenceStatus.RUNNING
    assert batch.metadata([seeded, other], [1, 1]).generators == {0: generator}
    seeded.status = SequenceStatus.FINISHED_LENGTH  # finished: its row is taken back
    third = Sequence([1], SamplingParams(temperature=1.0), 10, EOS)
    batch.metadata([third], [1])
    assert seeded not in batch.rows and len(batch.generators) == 2


class _RefusesSecond(LogitsProcessor):
    """Raises in ``add`` for a request with extra_args {"boom": ...}."""

    def is_argmax_invariant(self) -> bool:
        return False

    def add(self, row: int, params: SamplingParams) -> bool:
        if (params.extra_args or {}).get("boom"):
            raise RuntimeError("boom")
        return False

    def remove(self, row: int) -> None:
        pass

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return logits


def test_a_processor_failing_in_add_loses_no_row():
    """A processor's exception fails the step and its requests (docs/server.md); the rows
    handed out before it must all come back, or each failure keeps the rest of the step's rows
    forever and the batch grows without end."""
    batch = SamplingBatch(VOCAB, CPU, capacity=4, processors=[_RefusesSecond(None, CPU)])
    seqs = [Sequence([1], SamplingParams(extra_args={"boom": 1} if i == 1 else None), 10, EOS)
            for i in range(4)]
    with pytest.raises(RuntimeError, match="boom"):
        batch.metadata(seqs, [1] * 4)
    for seq in seqs:  # the engine aborts the step's requests
        seq.status = SequenceStatus.FINISHED_ABORTED
    fresh = [Sequence([1], SamplingParams(), 10, EOS) for _ in range(4)]
    batch.metadata(fresh, [1] * 4)
    assert len(batch.generators) == 4, "rows lost to the failed add"
