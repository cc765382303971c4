"""The types a step crosses the engine/worker boundary in: what the engine hands back for the
sampling half of a step (``Forward``), what a step returns (``StepResult``), and the previous
step's tokens that the next one may read (``InFlightTokens``). The engine holds them and reads
their host fields; the device tensors they carry it only passes back to the executor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from pagedserve.core.scheduler import SchedulerOutput
    from pagedserve.core.sequence import Sequence
    from pagedserve.platforms.interface import DeviceEvent
    from pagedserve.sample.sampler import SamplerOutput
    from pagedserve.structured.grammar_state import GrammarMask


@dataclass
class InFlightTokens:
    """The tokens sampled by the step before this one, still on the device: under async
    scheduling a stream's next input can be one of them, unknown to the host."""

    token_ids: torch.Tensor  # int64 [num_sampled * max_positions], on the device
    rows: dict[Sequence, int]  # stream -> the index of its last sampled token in token_ids


class SamplingInputs(NamedTuple):
    """What the engine adds to a step's sampling: the rest (each row's settings, generator
    and token history) rank 0's ``sampling_batch.SamplingBatch`` reads from the sequences."""

    grammar_mask: GrammarMask | None  # a row per sampling sequence with a grammar
    min_num_logprobs: int  # top-k logprobs the beams read their candidates from (0: none)


class PromptLogprobsChunk(NamedTuple):
    """Logprobs of prompt tokens ``first_position+1 ...`` computed in this step's chunk."""

    first_position: int
    result: tuple  # sampler.prompt_logprobs output


class Forward(NamedTuple):
    """A step whose forward pass is queued and whose sampling is not."""

    out: SchedulerOutput
    sample_logits: torch.Tensor | None  # rows of the sampling sequences, on the device
    prompt: dict[Sequence, PromptLogprobsChunk]


class StepResult(NamedTuple):
    sampled: list[Sequence]  # the streams that sampled, in sampler row order
    num_positions: list[int]  # how many positions each of them sampled at
    sampler_output: SamplerOutput | None  # on the device
    # The same, copied to the host without blocking; readable once ``ready`` has passed.
    host_output: SamplerOutput | None
    ready: DeviceEvent | None
    prompt_logprobs: dict[Sequence, PromptLogprobsChunk]

    def in_flight_tokens(self) -> InFlightTokens | None:
        if self.sampler_output is None:
            return None
        token_ids = self.sampler_output.token_ids  # [num_sampled, max_positions]
        width = token_ids.shape[1]
        return InFlightTokens(token_ids.view(-1), {
            seq: row * width + count - 1
            for row, (seq, count) in enumerate(zip(self.sampled, self.num_positions,
                                                   strict=True))})
