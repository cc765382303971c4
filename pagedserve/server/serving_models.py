"""The served model as the API sees it (its name, its limits, a tokenizer of its own) and
how the serving layers hand it requests and read them back."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from pagedserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStepError,
    RequestStream,
)
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sample.metadata import check_token_ids
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import SERVER_ERROR, APIError, bad_request, from_value_error
from pagedserve.server.metrics import RequestTimer, ServerMetrics
from pagedserve.server.protocol import ModelCard, ModelList

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# Sequences one API request may start (prompts x best_of): a 4 MB body of one-token prompts
# would otherwise queue a million of them.
MAX_SEQUENCES_PER_REQUEST = 1024


@dataclass
class ServedModel:
    name: str
    max_model_len: int
    vocab_size: int
    # A copy: the engine thread decodes with the engine's tokenizer while handlers encode, and
    # a Rust tokenizer used from two threads at once can fail with "Already borrowed".
    tokenizer: Any
    card: ModelCard = field(init=False)

    def __post_init__(self) -> None:
        self.card = ModelCard(id=self.name, max_model_len=self.max_model_len)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> ServedModel:
        return cls(engine.model_name, engine.max_model_len, engine.arch.vocab_size,
                   copy.deepcopy(engine.tokenizer))

    def models(self) -> ModelList:
        return ModelList(data=[self.card])

    def check_name(self, requested: str | None) -> None:
        """A request may leave ``model`` out; naming another model is a 404 as in OpenAI."""
        if requested is not None and requested != self.name:
            raise APIError(HTTPStatus.NOT_FOUND, f"the model {requested!r} does not exist; "
                           f"this server serves {self.name!r}", param="model",
                           code="model_not_found")

    def check_prompt(self, num_prompt_tokens: int, max_tokens: int | None,
                     prompt_param: str = "prompt") -> int:
        """Reject prompts that leave no room within the context; return the max_tokens to use
        (all the room left when the request gave none)."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"the prompt has {num_prompt_tokens} tokens but this model's maximum context "
                f"length is {limit} tokens; shorten the prompt", param=prompt_param,
                code=CONTEXT_LENGTH_EXCEEDED)
        if max_tokens is None:
            return limit - num_prompt_tokens
        if max_tokens >= 1 and num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens, but {num_prompt_tokens}"
                f" prompt tokens plus max_tokens={max_tokens} make "
                f"{num_prompt_tokens + max_tokens}; lower max_tokens or shorten the prompt",
                param="max_tokens", code=CONTEXT_LENGTH_EXCEEDED)
        return max_tokens

    def check_params(self, params: SamplingParams, num_prompts: int = 1) -> None:
        """Token ids in logit_bias and stop_token_ids must exist, or the batched sampler step
        that applies them would fail for every request in the batch."""
        check_token_ids(params, self.vocab_size)
        if num_prompts * params.num_sequences > MAX_SEQUENCES_PER_REQUEST:
            raise bad_request(
                f"{num_prompts} prompt(s) x best_of/n {params.num_sequences} would start more "
                f"than {MAX_SEQUENCES_PER_REQUEST} sequences; split the request",
                param="n" if num_prompts == 1 else "prompt")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


@dataclass
class EngineClient:
    """Submits requests to the engine thread and maps its failures to API errors."""

    engine: AsyncLLMEngine
    metrics: ServerMetrics

    async def submit(self, request_id: str, token_ids: list[int], params: SamplingParams,
                     arrival: float) -> TimedStream:
        try:
            stream = await self.engine.add_request(request_id, token_ids, params)
        except EngineDeadError as exc:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), type=SERVER_ERROR) from exc
        except ValueError as exc:
            raise from_value_error(exc) from exc
        return TimedStream(stream, RequestTimer(self.metrics, start=arrival))

    async def submit_all(self, request_id: str, prompts: list[list[int]],
                         params: list[SamplingParams], arrival: float) -> list[TimedStream]:
        """One engine request per prompt; if one is refused, none of them runs."""
        streams: list[TimedStream] = []
        try:
            for i, (token_ids, p) in enumerate(zip(prompts, params, strict=True)):
                streams.append(await self.submit(f"{request_id}-{i}", token_ids, p, arrival))
        except BaseException:
            close_all(streams)
            raise
        return streams


@dataclass
class TimedStream:
    """A request's outputs, timed for the metrics. Leaving the loop early aborts it."""

    stream: RequestStream
    timer: RequestTimer

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            async for output in self.stream:
                self.timer.tokens(max((len(o.token_ids) for o in output.outputs), default=0))
                if output.finished:
                    reasons = [o.finish_reason for o in output.outputs if o.finish_reason]
                    self.timer.finish(reasons[0] if reasons else "stop")
                yield output
        except EngineStepError as exc:
            self.timer.finish("error")
            raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc), type=SERVER_ERROR) from exc
        finally:
            self.close()

    async def final(self) -> RequestOutput:
        last = None
        async for output in self:
            last = output
        return last

    def close(self) -> None:
        if not self.stream.finished:
            self.timer.finish("abort")
            self.stream.close()


def close_all(streams: list[TimedStream]) -> None:
    for stream in streams:
        stream.close()


@dataclass
class ChoiceProgress:
    """What one streamed choice has sent so far; engine outputs are cumulative, so the next
    chunk is whatever lies past these marks."""

    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0  # legacy completion logprobs: where the next token's text starts
    started: bool = False
    done: bool = False

    def advance(self, out: CompletionOutput) -> None:
        self.num_chars, self.num_tokens = len(out.text), len(out.token_ids)
        self.started, self.done = True, out.finish_reason is not None
