"""What the engine hands back to users: one ``RequestOutput`` per request, vLLM-shaped."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, NamedTuple, Protocol, Self, TypeVar


class Logprob(NamedTuple):
    logprob: float
    rank: int
    decoded_token: str | None = None


# One entry per generated (or prompt) token: candidate token id -> its logprob.
TokenLogprobs = dict[int, Logprob]
PooledT = TypeVar("PooledT")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class BeamSearchSequence:
    """One finished beam, as vLLM's ``LLM.beam_search`` gives it: ``tokens`` the prompt's and
    the beam's, ``text`` the beam's alone. The beams keep no per-token logprobs (``logprobs``
    is None); ``cum_logprob`` is the beam's sum."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: None = None


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    # Every token sampled for the request, best_of's discarded streams and beam search's
    # dropped beams included (one per running beam per step): what OpenAI's usage counts.
    num_generated_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # A pooling request's embedding (float32 values), set once it has finished.
    embedding: list[float] | None = None

    @property
    def num_cached_tokens(self) -> int | None:
        """vLLM's field: the prompt tokens the prefix cache served."""
        return None if self.metrics is None else self.metrics.num_cached_tokens

    def add_delta(self, delta: OutputDelta) -> None:
        """Extend this output with a later "delta" output of the same request, so that it
        reads as the "cumulative" one would."""
        by_index = {o.index: o for o in self.outputs}
        for new in delta.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(CompletionOutput(
                    new.index, new.text, list(new.token_ids), new.cumulative_logprob,
                    None if new.logprobs is None else list(new.logprobs), new.finish_reason,
                    new.stop_reason))
                continue
            old.text += new.text
            old.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                old.logprobs = old.logprobs if old.logprobs is not None else []
                old.logprobs.extend(new.logprobs)
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.metrics is not None:
            self.metrics = delta.metrics
        if delta.embedding is not None:
            self.embedding = delta.embedding
        self.finished = delta.finished


class OutputDelta(Protocol):
    """What ``RequestOutput.add_delta`` reads: a "delta" ``RequestOutput``, or the wire form
    the engine-core process sends."""

    outputs: Sequence[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None
    metrics: RequestMetrics | None
    embedding: list[float] | None


@dataclass
class EmbeddingOutput:
    """vLLM's: the pooled vector of one prompt."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput(Generic[PooledT]):
    """vLLM's: one prompt's pooled result, ``outputs`` of the task's type (``OUTPUT``)."""

    request_id: str
    outputs: PooledT
    prompt_token_ids: list[int]
    finished: bool = True
    OUTPUT: ClassVar[Callable[[list[float]], Any]]

    @classmethod
    def of(cls, output: RequestOutput) -> Self:
        # The engine's pooled vector: an embedding, or a classifier's probabilities
        # (worker/pooler.py).
        return cls(output.request_id, cls.OUTPUT(output.embedding), output.prompt_token_ids,
                   output.finished)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """vLLM's ``LLM.embed`` result for one prompt."""

    OUTPUT = EmbeddingOutput


@dataclass
class ClassificationOutput:
    """vLLM's: one prompt's label probabilities (softmax over the labels; sigmoid for one),
    or its raw logits where the request's ``use_activation`` was false."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """vLLM's ``LLM.classify`` result for one prompt."""

    OUTPUT = ClassificationOutput


@dataclass
class ScoringOutput:
    """vLLM's: the score of one text pair (the cosine similarity of their embeddings)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's ``LLM.score`` result for one pair: ``prompt_token_ids`` are both texts' tokens,
    the first's then the second's, as vLLM's; ``request_id`` joins their requests' ids."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
