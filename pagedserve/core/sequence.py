"""What the core schedules: token streams (``Sequence``) and the user requests that own them
(``SequenceGroup``). Token ids, progress, status; no tensors, no device.

Vocabulary, used everywhere in the package: a *request* is what a user asked for (one prompt,
one ``request_id``, one ``SequenceGroup`` in the core, one ``RequestState`` in the engine); a
*sequence* is one token stream of it. ``n``/``best_of`` and beam search give a request several
sequences. A sequence knows its group by reference; ids are the caller's opaque strings and the
core never parses them."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.lora.request import LoRARequest
    from pagedserve.pooling_params import PoolingParams


# The finished statuses, by member name, and the reason each reports.
_FINISH_REASONS = {"FINISHED_STOPPED": "stop", "FINISHED_LENGTH": "length",
                   "FINISHED_ABORTED": "abort", "FINISHED_ERROR": "error"}


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def __init__(self, _value: int) -> None:
        # Plain attributes, not properties: ``finished`` is read for every stream every step,
        # and an enum member's hash (a dict lookup's) is a Python call.
        self.finish_reason: str | None = _FINISH_REASONS.get(self._name_)
        self.finished = self.finish_reason is not None


@dataclass(eq=False)
class Sequence:
    """One token stream, known by reference (equality and hashing are identity): the KV cache
    manager and the engine key their tables by the object. ``num_computed_tokens`` counts
    tokens whose keys and values are in the cache; every scheduling decision (prefill, chunk,
    decode, recompute) is "compute the next k tokens of ``all_token_ids``"."""

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
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: int | str | None = None
    group: SequenceGroup | None = field(default=None, repr=False)
    # Draft tokens proposed to follow ``all_token_ids`` (speculative decoding), verified by the
    # step that schedules them; the scheduler consumes them.
    draft_token_ids: list[int] = field(default_factory=list)
    # The stream's sampling seed (``sample.seeds.stream_seed`` of the request's), None when
    # unseeded: rank 0 makes the stream's generator from it once (``worker.sampling_batch``).
    seed: int | None = None
    # The stream's LoRA adapter (None: the base model), and the key its KV blocks are hashed
    # with: the adapter's content hash, so streams of different adapters never share blocks.
    lora_request: LoRARequest | None = None
    cache_key: str | None = None
    # Phi-3 longrope: the prompt is longer than original_max_position_embeddings, so every
    # position rotates by the long factors (models/rotary.py says why per sequence).
    long_rope: bool = False
    # A pooling (embedding) request's settings: the stream computes its prompt and samples
    # nothing; rank 0 pools its hidden states once the prompt is computed. None: it generates.
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def block_key(self) -> str | None:
        """The key the stream's KV blocks are hashed with: ``cache_key``, set apart for a
        long-prompt longrope stream, whose keys below the original length are rotated
        differently from a short-prompt stream's of the same tokens."""
        if not self.long_rope:
            return self.cache_key
        return f"{self.cache_key or ''}#long_rope"

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens the sequence has, counting sampled ones the host has not seen yet."""
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

    def fork(self) -> Sequence:
        """A new stream with this one's tokens and progress (its blocks are forked by the KV
        cache manager)."""
        child = dataclasses.replace(self, output_token_ids=list(self.output_token_ids),
                                    draft_token_ids=[])
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

    request_id: str
    seqs: list[Sequence]
    width: int = 1
    pending_forks: list[Sequence] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Preempted and resumed but not yet sampled since: not preempted again until it has.
    resumed: bool = False
    # The request's priority (``--scheduling-policy priority``: lower is served earlier) and
    # its arrival number, set by ``Scheduler.add_group``: the queues' order, ties by arrival.
    priority: int = 0
    arrival: int = 0

    def __post_init__(self) -> None:
        self.width = max(self.width, len(self.seqs) + len(self.pending_forks))
        for seq in self.seqs + self.pending_forks:
            seq.group = self

    @property
    def root(self) -> Sequence:
        return self.seqs[0]

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.pending_forks

    @property
    def ready_to_fork(self) -> bool:
        root = self.seqs[0] if self.seqs else None
        return bool(self.pending_forks) and root is not None and (
            root.num_computed_tokens == root.num_tokens - 1)

    def move_to(self, status: SequenceStatus) -> None:
        self.status = status
        for seq in self.seqs:
            seq.status = status
