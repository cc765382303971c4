"""The types a step crosses the engine/worker boundary in, all of them plain host data: what
the engine hands back for the sampling half of a step (``Forward``), what a step returns
(``StepResult``: which sequences sampled, and a ticket for the tokens), and the tokens
themselves once they have reached the host (``StepOutput``). What a step leaves on the device
(its logits between the halves, its sampled tokens, which the next step may read as inputs
under async scheduling) stays in the driver's runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pagedserve.core.scheduler import SchedulerOutput
    from pagedserve.core.sequence import Sequence
    from pagedserve.structured.grammar_state import GrammarMask


class SamplingInputs(NamedTuple):
    """What the engine adds to a step's sampling: the rest (each row's settings, generator
    and token history) the driver's ``sampling_batch.SamplingBatch`` reads from the sequences."""

    grammar_mask: GrammarMask | None  # a row per sampling sequence with a grammar, on the host
    min_num_logprobs: int  # top-k logprobs the beams read their candidates from (0: none)


class Forward(NamedTuple):
    """A step whose forward pass is queued and whose sampling is not."""

    out: SchedulerOutput
    step_id: int


class StepResult(NamedTuple):
    """A queued step: ``StepAPI.fetch`` turns it into its ``StepOutput``."""

    step_id: int
    sampled: list[Sequence]  # the streams that sampled, in sampler row order
    num_positions: list[int]  # how many positions each of them sampled at


class HostSamples(NamedTuple):
    """A step's sampler output as host lists, ``[row][position]``: one transfer per tensor
    for the whole batch."""

    tokens: list[list[int]]
    logprobs: list[list[float]] | None  # None where no row of the step needed logprobs
    ranks: list[list[int]] | None
    top_ids: list[list[list[int]]] | None
    top_logprobs: list[list[list[float]]] | None
    # Tokens each row output, where a verify step's rejected drafts make it fewer than the
    # positions it sampled at (None: every row output one token per position).
    counts: list[int] | None = None


class PromptLogprobsChunk(NamedTuple):
    """Logprobs of prompt tokens ``first_position+1 ...`` computed in this step's chunk: one
    entry per scored token (top-k lists empty where none were asked for)."""

    first_position: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class StepOutput(NamedTuple):
    samples: HostSamples | None  # None: nothing sampled
    prompt_logprobs: dict[Sequence, PromptLogprobsChunk]
    # Pooling streams whose prompt this step finished, and their pooled vectors (float32).
    pooled: dict[Sequence, list[float]] = {}
