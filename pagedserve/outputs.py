"""What the engine hands back to users: one ``RequestOutput`` per request, vLLM-shaped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Logprob(NamedTuple):
    logprob: float
    rank: int
    decoded_token: str | None = None


# One entry per generated (or prompt) token: candidate token id -> its logprob.
TokenLogprobs = dict[int, Logprob]


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
    error: str | None = None
