"""A request as the core sees it: token ids, progress, status. No tensors, no device."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS  # a dict lookup: checked for every stream every step

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One token stream. ``num_computed_tokens`` counts tokens whose keys and values are in the
    cache; every scheduling decision (prefill, chunk, decode, recompute) is "compute the next k
    tokens of ``all_token_ids``"."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    # Tokens sampled by steps that ran but not yet appended: with async scheduling the next
    # step is scheduled (and reads its input token on the device) before the host sees them.
    num_pending_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    group: SequenceGroup | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens the request has, counting sampled ones the host has not seen yet."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        if self.num_pending_tokens:
            self.num_pending_tokens -= 1
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def fork(self, request_id: str) -> Request:
        """This stream's tokens and progress under a new id (its blocks are forked by the KV
        cache manager)."""
        child = dataclasses.replace(self, request_id=request_id,
                                    output_token_ids=list(self.output_token_ids))
        child.all_token_ids = list(self.all_token_ids)
        return child


@dataclass(eq=False)
class SequenceGroup:
    """The streams of one user request, scheduled, preempted and resumed as one unit, so the
    blocks they share never end up split between the device pool and the swap pool.

    A group starts with one stream holding the prompt. Parallel sampling (``n``/``best_of``)
    lists the other streams in ``pending_forks``: they fork from the first once all but the
    prompt's last token are in the cache, then each computes that last token itself and draws
    its first sample from its own logits row. Beam search forks and drops streams as the engine
    picks beams. ``width`` is the most streams the group will hold at once.
    """

    seqs: list[Request]
    width: int = 1
    pending_forks: list[Request] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Preempted and resumed but not yet sampled since: not preempted again until it has.
    resumed: bool = False

    def __post_init__(self) -> None:
        self.width = max(self.width, len(self.seqs) + len(self.pending_forks))
        for request in self.seqs + self.pending_forks:
            request.group = self

    @property
    def root(self) -> Request:
        return self.seqs[0]

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.pending_forks

    @property
    def ready_to_fork(self) -> bool:
        root = self.seqs[0] if self.seqs else None
        return bool(self.pending_forks) and root is not None and (
            root.num_computed_tokens == root.num_tokens - 1)

    def move_to(self, status: RequestStatus) -> None:
        self.status = status
        for request in self.seqs:
            request.status = status
