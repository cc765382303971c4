"""The served models as the API sees them (names, limits, tokenizers), the routing of a
request's ``model`` to one of them or to a LoRA adapter of one, and how the serving layers hand
each model's engine core requests and read them back."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from http import HTTPStatus
from typing import Any, NamedTuple, TypeVar

from pagedserve.engine.core_client import (
    CoreClient,
    EngineDeadError,
    EngineStepError,
    RequestStream,
)
from pagedserve.engine.core_messages import LoRAFacts, NewRequest
from pagedserve.engine.input_processor import POOLING_SAMPLING, PromptTooLong, truncate_prompt
from pagedserve.errors import ConfigError, EngineSleepingError
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import InvalidSamplingParam, SamplingParams
from pagedserve.server.errors import SERVER_ERROR, APIError, bad_request
from pagedserve.server.metrics import ModelMetrics, RequestTimer, ServerMetrics
from pagedserve.server.protocol import ModelCard, ModelList
from pagedserve.server.token_bytes import TokenBytes
from pagedserve.structured.spec import check as check_grammar
from pagedserve.structured.spec import grammar_spec

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
# Sequences one API request may start (prompts x best_of): a 4 MB body of one-token prompts
# would otherwise queue a million of them.
MAX_SEQUENCES_PER_REQUEST = 1024
T = TypeVar("T")


@dataclass
class ServedModel:
    """A base model and the engine core that runs it."""

    name: str
    max_model_len: int
    tokenizer: Any
    client: EngineClient
    lora: LoRAFacts | None = None  # what its adapters must fit; None: LoRA is off
    # --generation-config's: what a request's unset sampling fields take.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    labels: tuple[str, ...] = ()  # a sequence classifier's label names, in label order
    card: ModelCard = field(init=False)
    _tokenizer_thread: ThreadPoolExecutor = field(init=False, repr=False)
    _token_bytes: TokenBytes | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.card = ModelCard(id=self.name, max_model_len=self.max_model_len)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """Runs ``work`` (tokenizing, a chat template, the JSON of a million token ids) on the
        tokenizer's thread: a 4 MB prompt takes seconds, during which the event loop would
        answer nothing, not even /health. One thread, so that calls never overlap: an HF fast
        tokenizer is not safe to share between threads (tokenizers' "Already borrowed")."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_thread, partial(work, *args))

    async def token_bytes(self) -> TokenBytes:
        """The vocabulary's raw bytes (chat logprobs), built by the first request that asks,
        on the tokenizer's thread."""
        if self._token_bytes is None:
            self._token_bytes = await self.off_loop(TokenBytes, self.tokenizer)
        return self._token_bytes

    @classmethod
    def of(cls, engine: CoreClient, metrics: ServerMetrics) -> ServedModel:
        """The model a started engine core serves."""
        facts = engine.facts
        return cls(facts.model_name, facts.limits.max_model_len, engine.tokenizer,
                   EngineClient(engine, metrics.of(facts.model_name)), facts.lora,
                   facts.sampling_defaults, facts.labels)

    def check_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None,
                         param: str = "max_tokens") -> None:
        """OpenAI refuses a max_tokens that does not fit in the context with the prompt,
        where the engine would shorten it. Prompts too long by themselves are left to the
        engine, which checks every prompt (length, token ids) and names the prompt."""
        limit = self.max_model_len
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit > num_prompt_tokens:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens, but {num_prompt_tokens}"
                f" prompt tokens plus {param}={max_tokens} make "
                f"{num_prompt_tokens + max_tokens}; lower {param} or shorten the prompt",
                param=param, code=CONTEXT_LENGTH_EXCEEDED)

    def check_min_tokens(self, num_prompt_tokens: int, min_tokens: int) -> None:
        """min_tokens past the room the prompt leaves in the context is refused, as vLLM
        refuses it against the max_tokens it defaults to that room; with max_tokens unset, the
        choice ran to the context's end and came back short of min_tokens."""
        room = self.max_model_len - num_prompt_tokens
        if min_tokens > room > 0:
            raise bad_request(
                f"min_tokens={min_tokens} is more than the {room} tokens this model's maximum "
                f"context length of {self.max_model_len} leaves after {num_prompt_tokens} "
                "prompt tokens; lower min_tokens or shorten the prompt",
                param="min_tokens", code=CONTEXT_LENGTH_EXCEEDED)

    def check_params(self, params: SamplingParams, num_prompts: int = 1) -> None:
        if num_prompts * params.num_sequences > MAX_SEQUENCES_PER_REQUEST:
            raise bad_request(
                f"{num_prompts} prompt(s) x best_of/n {params.num_sequences} would start more "
                f"than {MAX_SEQUENCES_PER_REQUEST} sequences; split the request",
                param="n" if num_prompts == 1 else "prompt")

    def truncate(self, token_ids: list[int], params: SamplingParams | PoolingParams
                 ) -> list[int]:
        """The prompt as the engine will run it (``truncate_prompt_tokens``): what the
        length checks and the usage count."""
        return truncate_prompt(token_ids, params.truncate_prompt_tokens, self.max_model_len,
                               pooling=isinstance(params, PoolingParams))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


@dataclass(frozen=True)
class ServedAdapter:
    """A LoRA adapter served under its own name over one base model."""

    request: LoRARequest
    base: ServedModel
    # Made once, so that every listing and retrieval shows the same ``created``.
    card: ModelCard = field(init=False, compare=False)

    def __post_init__(self) -> None:
        card = ModelCard(id=self.name, max_model_len=self.base.max_model_len,
                         root=self.request.lora_path, parent=self.base.name)
        object.__setattr__(self, "card", card)  # frozen

    @property
    def name(self) -> str:
        return self.request.lora_name


class Route(NamedTuple):
    """Where a request's ``model`` leads: the name its responses carry, the served model
    (tokenizer, limits, engine core) that runs it, and the adapter it runs with (None: the
    base model)."""

    name: str
    model: ServedModel
    lora: LoRARequest | None = None


class ServingModels:
    """Every model the server serves, each known by a name of its own, in the order given,
    and the LoRA adapters over them, each known by a name no model has; vLLM's
    ``OpenAIServingModels``. A request that names no model goes to the first, and one
    that names a model not served is a 404, as in OpenAI."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        self._by_name: dict[str, ServedModel] = {}
        for model in models:
            if model.name in self._by_name:
                raise ConfigError(f"two models are served as {model.name!r}; give each its own "
                                  "served_model_name")
            self._by_name[model.name] = model
        self._first = models[0]
        self._adapters: dict[str, ServedAdapter] = {}

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._by_name.values())

    def resolve(self, requested: str | None) -> Route:
        if requested in self._adapters:
            adapter = self._adapters[requested]
            return Route(adapter.name, adapter.base, adapter.request)
        model = self._first if requested is None else self.base(requested)
        return Route(model.name, model)

    def base(self, name: str) -> ServedModel:
        """The base model of this name; 404 if none is served."""
        model = self._by_name.get(name)
        if model is None:
            served = ", ".join(repr(n) for n in [*self._by_name, *self._adapters])
            raise APIError(HTTPStatus.NOT_FOUND, f"the model {name!r} does not exist; "
                           f"this server serves {served}", param="model",
                           code="model_not_found")
        return model

    def models(self) -> ModelList:
        return ModelList(data=[m.card for m in self] + [a.card for a in self.adapters()])

    def card(self, name: str) -> ModelCard:
        """The card ``models`` lists for the model or adapter ``name``; 404 if none."""
        adapter = self._adapters.get(name)
        return adapter.card if adapter is not None else self.base(name).card

    def adapters(self) -> list[ServedAdapter]:
        return list(self._adapters.values())

    def adapter(self, name: str) -> ServedAdapter | None:
        return self._adapters.get(name)

    def name_in_use(self, name: str) -> bool:
        return name in self._by_name or name in self._adapters

    def add_adapter(self, adapter: ServedAdapter) -> None:
        """Serve ``adapter`` under its name, which no model or adapter may have already."""
        if self.name_in_use(adapter.name):
            raise ValueError(f"the name {adapter.name!r} is in use")
        self._adapters[adapter.name] = adapter

    def remove_adapter(self, name: str) -> None:
        """Requests naming it are 404s from now on; those in flight go on."""
        del self._adapters[name]

    def unhealthy(self, requested: str | None = None) -> str | None:
        """Why the model named (with none: some model) cannot serve; None if it (each) can.
        A dead engine core stays dead, and fails only its own model's requests."""
        models = list(self) if requested is None else [self.resolve(requested).model]
        down = [m for m in models if not m.client.engine.is_running]
        if not down:
            return None
        why = "; ".join(m.client.engine.dead_reason for m in down)
        up = [m for m in self if m.client.engine.is_running]
        return f"the engine is not running: {why}" + \
            (f" (serving {self._names(up)})" if up and requested is None else "")

    @staticmethod
    def _names(models) -> str:
        return ", ".join(repr(m.name) for m in models)


@dataclass
class EngineClient:
    """Submits requests to one model's engine (a core, or its data-parallel replicas) and
    maps its failures to API errors."""

    engine: CoreClient
    metrics: ModelMetrics

    async def submit(self, request_id: str, token_ids: list[int], params: SamplingParams,
                     arrival: float, field_name: Callable[[str], str],
                     lora: LoRARequest | None = None, priority: int = 0) -> TimedStream:
        streams = await self._submit(
            [NewRequest(request_id, token_ids, _from_core(params), lora, priority=priority)],
            arrival, field_name)
        return streams[0]

    async def submit_all(self, request_id: str, prompts: list[list[int]],
                         params: SamplingParams | PoolingParams, arrival: float,
                         field_name: Callable[[str], str],
                         lora: LoRARequest | None = None,
                         priority: int = 0) -> list[TimedStream]:
        """One engine request per prompt (each with the adapter ``lora``, None: the base
        model), all entering the same engine step; if one is refused, none of them runs.
        ``PoolingParams`` make them embedding requests."""
        pooling = params if isinstance(params, PoolingParams) else None
        params = POOLING_SAMPLING if pooling is not None else _from_core(params)
        requests = [NewRequest(f"{request_id}-{i}", token_ids, params, lora, pooling, priority)
                    for i, token_ids in enumerate(prompts)]
        return await self._submit(requests, arrival, field_name)

    async def _submit(self, requests: list[NewRequest], arrival: float,
                      field_name: Callable[[str], str]) -> list[TimedStream]:
        """``field_name`` maps the engine's parameter names to the API request's fields (a
        chat request's prompt is its ``messages``). The requests share their params."""
        try:
            await self._check_grammar(requests[0].params)
            streams = self.engine.add_requests(requests)
        except (EngineDeadError, EngineSleepingError) as exc:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), type=SERVER_ERROR) from exc
        except ValueError as exc:
            param = getattr(exc, "param", None)
            code = CONTEXT_LENGTH_EXCEEDED if isinstance(exc, PromptTooLong) else None
            raise bad_request(str(exc), param=field_name(param) if param else None,
                              code=code) from exc
        return [TimedStream(s, RequestTimer(self.metrics, start=arrival), field_name)
                for s in streams]

    async def _check_grammar(self, params: SamplingParams) -> None:
        """Convert the request's schema, regex or grammar on a worker thread: a slow one
        (seconds, for a deep schema) on the event loop would hold up every other connection,
        /health included (xgrammar lets go of the GIL while it converts). ``add_requests``
        checks it again, on the loop, and finds the success in ``check_grammar``'s cache; a
        bad one raises here, ``InvalidSamplingParam``."""
        if params.structured_outputs is None:
            return
        await asyncio.to_thread(check_grammar, grammar_spec(params.structured_outputs),
                                self.engine.facts.limits.max_grammar_bytes)


def _from_core(params: SamplingParams) -> SamplingParams:
    """The core sends what each step added and the client adds it up (``add_delta``); the n
    best of best_of are known only at the end, so those come once, finished."""
    kind = "delta" if params.best_of == params.n else "final_only"
    return dataclasses.replace(params, output_kind=kind)


@dataclass
class TimedStream:
    """A request's outputs, timed for the metrics. Leaving the loop early aborts it."""

    stream: RequestStream
    timer: RequestTimer
    field_name: Callable[[str], str]  # as ``_submit``'s, for a refusal that comes later

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            async for output in self.stream:
                self.timer.tokens(max((len(o.token_ids) for o in output.outputs), default=0))
                if output.finished:
                    reasons = [o.finish_reason for o in output.outputs if o.finish_reason]
                    self.timer.finish(reasons[0] if reasons else "stop")
                yield output
        except InvalidSamplingParam as exc:  # the core refused it (its adapter, its grammar)
            self.timer.finish("error")
            raise InvalidSamplingParam(self.field_name(exc.param), str(exc)) from exc
        except EngineStepError as exc:
            self.timer.finish("error")
            raise APIError(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc), type=SERVER_ERROR) from exc
        except (EngineDeadError, EngineSleepingError) as exc:
            self.timer.finish("error")
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), type=SERVER_ERROR) from exc
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


async def finals(streams: list[TimedStream]) -> list[RequestOutput]:
    """Every stream's final output; a failure (or a cancel: the client left) stops, and so
    aborts, the others too."""
    tasks = [asyncio.ensure_future(s.final()) for s in streams]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


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
