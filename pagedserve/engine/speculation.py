"""Speculative decoding's engine stage: before each step, give the decoding sequences drafts
to verify; after it, learn from what they accepted.

The drafts come from a proposer (``spec_decode/``): n-gram lookup over each sequence's own
tokens, run on the host, or a draft model or an EAGLE-3 head, whose tokens rank 0 draws inside
the verify step itself (``worker/drafter.py``, ``worker/eagle_drafter.py``; here only their
slots are asked for). How many of them a step
verifies is the policy's choice (``spec_decode/policy.py``): per sequence, its measured
acceptance against the step time the engine measures, down to none. The scheduler takes what
it can fit (``Sequence.draft_token_ids``), rank 0 verifies them with the rejection sampler
(``sample/rejection.py``), the output stage appends the accepted tokens and gives the
rejected drafts' slots back.

Which sequences get drafts: those decoding (every known token but the last computed), with
room under max_tokens for more than one token, and, with a draft model, not constrained by a
grammar (its drafts are drawn on the device, where no matcher is). A constrained sequence's
n-gram drafts are cut at the first one its grammar refuses (or would end at) before the
policy counts them (``GrammarState.num_valid``, which leaves the matcher where it was); the
engine then masks each verified position with the grammar's state after the drafts before it.

Proposing needs the host's view of every token, so a step that may verify drafts runs one at
a time. When a step verifies no draft (none was found, or the batch is large enough that
they cost more than they save), speculation pauses: the engine schedules ahead as without it
(async scheduling, where the platform runs ahead) for 1 step, then 2, 4, ... up to
``_MAX_PAUSE`` while that goes on, and at once when the batch shrinks below half the size it
paused at, or, in a batch of at most ``_SMALL_BATCH``, when a new sequence starts decoding
(an interactive request must not inherit the pause of the one before it). The pauses start
again from 1 step only once a verify step accepts a draft: the policy's acceptance evidence
fades with the steps, so after a long pause a sequence it had stopped drafting is tried
again, and a try that is rejected must not bring the short pauses back. So a large batch
pays one step at a time in ``_MAX_PAUSE`` for speculation it does not use, a batch-1 stream
whose drafts are rejected one verify step in about ``_MAX_PAUSE``, and a batch-1 stream whose
text starts repeating finds it within a few steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pagedserve.core.sequence import Sequence, SequenceGroup
from pagedserve.errors import ConfigError
from pagedserve.models import loader
from pagedserve.spec_decode.config import DEVICE_METHODS, SpeculativeConfig
from pagedserve.spec_decode.ngram import NgramProposer
from pagedserve.spec_decode.policy import Acceptance, StepTimeModel, choose_num_drafts
from pagedserve.spec_decode.proposer import DraftModelSlots, ProposalBatch, Proposer
from pagedserve.structured.grammar_state import GrammarState
from pagedserve.worker.step import HostSamples, StepResult

GrammarOf = Callable[[Sequence], GrammarState | None]

# The longest pause, in steps, between proposals that verified nothing.
_MAX_PAUSE = 64
# Up to this many sequences, one that starts decoding ends a pause.
_SMALL_BATCH = 4


@dataclass
class SpecDecodeCounters:
    """vLLM's ``spec_decode_*`` counters: verify rows with drafts, their drafts, the drafts
    accepted, and how many rows accepted their draft at each position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify row outputs on average (accepted drafts plus the target's)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class _TokenBuffer:
    """A sequence's tokens as a growing numpy array, so a lookup reads a view instead of
    converting the whole list every step."""

    def __init__(self) -> None:
        self.array = np.zeros(256, dtype=np.int64)
        self.length = 0

    def view(self, tokens: list[int]) -> np.ndarray:
        """The array of ``tokens``, which extend the ones seen before."""
        if len(tokens) > len(self.array):
            grown = np.zeros(max(len(tokens), 2 * len(self.array)), dtype=np.int64)
            grown[:self.length] = self.array[:self.length]
            self.array = grown
        self.array[self.length:len(tokens)] = tokens[self.length:]
        self.length = len(tokens)
        return self.array[:self.length]


class Speculation:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.proposer: Proposer = (
            NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            if config.method == "ngram" else DraftModelSlots())
        self._drafts_on_device = config.method in DEVICE_METHODS
        self.max_drafts = config.num_speculative_tokens
        self.step_times = StepTimeModel()
        self.acceptance = Acceptance()
        self.counters = SpecDecodeCounters(accepted_per_position=[0] * self.max_drafts)
        self._buffers: dict[Sequence, _TokenBuffer] = {}
        self._paused_at = 0  # the batch size of the last proposal that verified nothing
        self._pause_left = 0  # steps to run ahead before proposing again
        self._next_pause = 1

    def proposes(self, running: list[SequenceGroup]) -> bool:
        """Whether the next step proposes drafts (and so runs one at a time); called once a
        step."""
        self.acceptance.tick()
        if self._new_in_small_batch(running):
            self._pause_left, self._next_pause = 0, 1  # a new request starts afresh
            return True
        if not self._pause_left:
            return True
        if 2 * sum(len(g.seqs) for g in running) < self._paused_at:
            self._pause_left = 0
            return True
        self._pause_left -= 1
        return False

    def _new_in_small_batch(self, running: list[SequenceGroup]) -> bool:
        return self._next_pause > 1 and self._paused_at <= _SMALL_BATCH and any(
            seq not in self._buffers for g in running for seq in g.seqs
            if seq.num_computed_tokens == seq.num_tokens - 1)

    def propose(self, running: list[SequenceGroup], budget: int, grammar_of: GrammarOf
                ) -> None:
        """Set the drafts each decoding sequence of ``running`` verifies next step;
        ``grammar_of`` gives a sequence's grammar (None: unconstrained)."""
        seqs, base_tokens = [], 0
        for group in running:
            for seq in group.seqs:
                num_left = seq.num_tokens - seq.num_computed_tokens
                base_tokens += num_left
                if num_left == 1 and self._may_draft(seq):
                    seqs.append(seq)
        self._buffers = {seq: self._buffers.get(seq) or _TokenBuffer() for seq in seqs}
        if not seqs:
            return
        room = [min(self.max_drafts, seq.max_tokens - seq.num_output_tokens - 1) for seq in seqs]
        drafts = self.proposer.propose(ProposalBatch(
            [self._buffers[seq].view(seq.all_token_ids) for seq in seqs], room))
        drafts = [_grammar_valid(draft, grammar_of(seq)) for seq, draft in zip(seqs, drafts,
                                                                                strict=True)]
        available = np.array([len(d) for d in drafts], dtype=np.int64)
        rates = np.array([self.acceptance.rate(seq) for seq in seqs])
        chosen = choose_num_drafts(rates, available, min(base_tokens, budget), len(seqs),
                                   *self.step_times.coefficients())
        for seq, draft, k in zip(seqs, drafts, chosen.tolist(), strict=True):
            seq.draft_token_ids = draft[:k].tolist()
        if not chosen.any():
            self._paused_at, self._pause_left = len(seqs), self._next_pause
            self._next_pause = min(2 * self._next_pause, _MAX_PAUSE)

    def _may_draft(self, seq: Sequence) -> bool:
        return (seq.num_pending_tokens == 0 and seq.max_tokens - seq.num_output_tokens > 1
                and not (self._drafts_on_device and seq.params.structured_outputs is not None))

    def record_step(self, num_tokens: int, verifies: bool, seconds: float) -> None:
        self.step_times.record(num_tokens, verifies, seconds)

    def record(self, result: StepResult, samples: HostSamples | None) -> None:
        """Count what each verify row of a step accepted."""
        if samples is None or samples.counts is None:
            return
        for seq, positions, emitted in zip(result.sampled, result.num_positions,
                                           samples.counts, strict=True):
            num_drafts = positions - 1
            if num_drafts == 0:
                continue
            accepted = emitted - 1
            self.acceptance.record(seq, num_drafts, accepted)
            c = self.counters
            c.num_drafts += 1
            c.num_draft_tokens += num_drafts
            c.num_accepted_tokens += accepted
            for j in range(accepted):
                c.accepted_per_position[j] += 1
            if accepted:
                self._next_pause = 1
        for seq in result.sampled:
            if seq.status.finished:
                self.acceptance.forget(seq)


def check_draft_tokenizer(config: SpeculativeConfig, tokenizer, load_format: str) -> None:
    """A draft's token ids must mean what the target's mean: where the draft checkpoint has a
    tokenizer, the tokens it shares with the target's must have the same ids (the worker
    checks the vocabulary sizes, which is all a checkpoint without tokenizer files can be
    checked for)."""
    if config.method != "draft_model":
        return
    source = loader.resolve_model(config.model, load_format != "dummy")
    try:
        draft = loader.load_tokenizer(source.path)
    except loader.ModelLoadError:
        return
    target_ids, draft_ids = tokenizer.get_vocab(), draft.get_vocab()
    target_tokens = {i: token for token, i in target_ids.items()}
    # A token both know must have one id, and an id one token; a special token only one of
    # them adds (transformers adds some per model type) is neither.
    if any(target_ids.get(token, i) != i or target_tokens.get(i, token) != token
           for token, i in draft_ids.items()):
        raise ConfigError(f"--speculative-config: the draft model's tokenizer ({source.name}) "
                          "differs from the target's; a draft must share its vocabulary")


def _grammar_valid(drafts: np.ndarray, grammar: GrammarState | None) -> np.ndarray:
    """The leading ``drafts`` that ``grammar`` allows (all of them without one)."""
    return drafts if grammar is None or not len(drafts) else \
        drafts[:grammar.num_valid(drafts.tolist())]
