"""The OpenAI wire format as pydantic models: requests in, responses and stream chunks out.

Request fields are optional where OpenAI allows ``null``; defaults are applied when the request
becomes ``SamplingParams``. vLLM's extra sampling fields (top_k, min_p, ...) are accepted too.

Requests are read as strictly as OpenAI reads them: ``"4"``, ``true`` or ``4.0`` is not an
integer, infinities and NaN are not numbers, and a field this server does not know is refused
with its name (a field it does not implement, such as ``suffix``, must not be silently ignored).
A few fields that change nothing in the output are accepted and ignored: ``user``, ``store``,
``metadata``, ``service_tier``, ``safety_identifier`` and ``prompt_cache_key``. OpenAI fields the
server does not implement are accepted as ``null``, their default (the openai SDK sends
``"suffix": null`` for ``suffix=None``), and refused with any other value.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)

from pagedserve.lora.request import MAX_LORA_INT_ID
from pagedserve.models.chat_template import render_options
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import (
    InvalidSamplingParam,
    SamplingParams,
    StructuredOutputsParams,
)

# OpenAI's stand-in for a logprob of -inf, which JSON cannot carry.
MIN_LOGPROB = -9999.0
# Messages in one conversation: far past real ones; the count is checked before any message
# is validated, so a body of 100k fails in milliseconds instead of seconds on the event loop.
MAX_MESSAGES = 8192
# A logit_bias key: at most 20 digits, as many as a 64-bit id has (int() raises past 4300;
# the engine checks the vocabulary's range).
_TOKEN_ID = re.compile(r"[0-9]{1,20}")


def json_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf (a token the sampler ruled out) and NaN (non-finite
    logits, from a broken checkpoint) become ``MIN_LOGPROB``; a NaN reached the encoder and
    failed the whole response with a 500."""
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # False for NaN


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


def _unicode_text(value):
    """JSON can escape a lone surrogate (``"\\ud800"``), which has no UTF-8 form and which
    the tokenizer fails on. Checked after the type, on every string inside ``value``, so that
    the error names the field."""
    for text in _strings(value):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"lone surrogate U+{ord(text[exc.start]):04X} at character "
                             f"{exc.start} is not Unicode text") from None
    return value


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, TextPart):
        yield value.text
    elif isinstance(value, list) and value and not isinstance(value[0], int):
        for item in value:  # token id lists are skipped whole, not walked id by id
            yield from _strings(item)


# A prompt: text, a list of texts, token ids, or a list of token id lists.
PromptInput = Annotated[str | list[str] | list[int] | list[list[int]],
                        AfterValidator(_unicode_text)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


# ---- requests ---------------------------------------------------------------------------
class StreamOptions(StrictModel):
    include_usage: bool = False


class JSONSchemaFormat(StrictModel):
    name: str
    description: str | None = None
    # ``schema`` would shadow a BaseModel method; the wire name stays "schema".
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # every schema is enforced exactly, strict or not


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(StrictModel):
    """vLLM's ``structured_outputs``: exactly one of the fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def to_params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice,
                                       grammar=self.grammar, json_object=bool(self.json_object))


# The older vLLM fields, each naming one field of ``structured_outputs``.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


class SamplingRequest(StrictModel):
    """Fields shared by completions and chat completions."""

    # OpenAI's fields that this server does not implement: refused unless null.
    unimplemented: ClassVar[frozenset[str]] = frozenset()

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False  # OpenAI allows null (as false) here and for echo, logprobs
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, AfterValidator(_unicode_text)] = None
    # OpenAI's range, which every torch generator accepts.
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted and ignored: who asks, and hints to OpenAI's storage and routing.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    # Checked, and capped, by SamplingParams (non-empty; at most 64 bad words) and, against
    # the vocabulary, by the engine's input limits.
    allowed_token_ids: list[int] | None = None
    bad_words: Annotated[list[str] | None, AfterValidator(_unicode_text)] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Keep the prompt's last k tokens (-1: as many as leave room for one more); SamplingParams
    # holds the rule, so a bad value is its 400.
    truncate_prompt_tokens: int | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and guided_*.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Arguments of the custom logits processors (--logits-processors), vLLM's field: the
    # engine's SamplingParams.extra_args, which each processor checks at admission.
    vllm_xargs: dict[str, str | int | float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_null_unimplemented(cls, data: Any) -> Any:
        """A null asks for nothing; a value is left for ``extra="forbid"`` to refuse."""
        if not isinstance(data, dict) or not cls.unimplemented.intersection(data):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls.unimplemented}

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_fields(self, defaults: dict[str, float | int]) -> dict:
        """The engine's sampling fields; ``defaults`` (the model's, ``--generation-config``)
        stand in for the API's own where the request leaves a field unset."""
        return dict(
            n=_default(self.n, 1), temperature=_default(self.temperature,
                                                        defaults.get("temperature", 1.0)),
            top_p=_default(self.top_p, defaults.get("top_p", 1.0)),
            top_k=_default(self.top_k, defaults.get("top_k", -1)),
            min_p=_default(self.min_p, defaults.get("min_p", 0.0)), seed=self.seed,
            presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            repetition_penalty=_default(self.repetition_penalty,
                                        defaults.get("repetition_penalty", 1.0)),
            logit_bias=_logit_bias(self.logit_bias), stop=_default(self.stop, []),
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self.structured_outputs_params(),
            extra_args=self.vllm_xargs,
        )

    def _structured_fields(self) -> list[str]:
        """The structured-output fields this request sets (at most one is allowed)."""
        named = ["structured_outputs", *_GUIDED_FIELDS]
        given = [name for name in named if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        return given

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        given = self._structured_fields()
        if len(given) > 1:
            raise InvalidSamplingParam(given[1], f"only one of {', '.join(given)} may be set")
        if not given:
            return None
        name = given[0]
        try:
            if name == "structured_outputs":
                return self.structured_outputs.to_params()
            if name == "response_format":
                return _response_format_params(self.response_format)
            return StructuredOutputsParams(**{_GUIDED_FIELDS[name]: getattr(self, name)})
        except InvalidSamplingParam as exc:
            raise InvalidSamplingParam(name, str(exc)) from None

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidSamplingParam("stream_options",
                                       "stream_options is only allowed when stream is true")

    def field_name(self, param: str) -> str:
        """The field of this request that an engine parameter came from."""
        if param == "structured_outputs":
            return next(iter(self._structured_fields()), param)
        if param == "lora_request":  # the adapter is the model the request named
            return "model"
        if param == "extra_args":
            return "vllm_xargs"
        return param


class CompletionRequest(SamplingRequest):
    unimplemented = frozenset({"suffix"})

    prompt: PromptInput
    # 0 with echo scores the prompt: its tokens and logprobs come back, nothing is generated.
    max_tokens: int | None = Field(default=16, ge=0)
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool | None = False

    def to_sampling_params(self, defaults: dict[str, float | int]) -> SamplingParams:
        self.check_stream_options()
        if self.max_tokens == 0 and not self.echo:
            raise InvalidSamplingParam("max_tokens", "max_tokens 0 is only allowed with echo "
                                       "(the prompt comes back and nothing is generated)")
        params = SamplingParams(
            **self._sampling_fields(defaults), best_of=self.best_of,
            max_tokens=_default(self.max_tokens, defaults.get("max_tokens")),
            logprobs=self.logprobs,
            # Echoed prompts carry logprobs too; they need the prompt's own.
            prompt_logprobs=self.logprobs if self.echo else None)
        if self.stream and params.best_of > params.n:
            raise InvalidSamplingParam("best_of", "best_of > n is not supported when streaming")
        return params


# What a JSON value is called, by the Python type json.loads gives it.
_JSON_KINDS = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1)  # "" made tool calls no client can dispatch
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _parameters_describe_an_object(cls, data: Any) -> Any:
        """A call's arguments are a JSON object, so OpenAI refuses a schema of anything else
        (a string's was accepted, and a named or required call then wrote a string). One
        without "type" (``{}``) is left alone. Checked before the fields are, so that a list
        or a string names the tool too."""
        parameters = data.get("parameters") if isinstance(data, dict) else None
        if parameters is None or isinstance(parameters, dict) \
                and parameters.get("type", "object") == "object":
            return data
        got = (f'"type": {json.dumps(parameters["type"])}' if isinstance(parameters, dict)
               else f"a JSON {_JSON_KINDS.get(type(parameters), 'value')}")
        raise ValueError(f"tool {data.get('name')!r}: parameters must be a JSON schema of "
                         f'"type": "object", got {got}')


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _text_parts_only(content: Any) -> Any:
    """Content parts other than text (images, audio, files) are named here; left to the
    union, they got "content.str: Input should be a valid string (and 3 more errors)"."""
    for i, part in enumerate(content if isinstance(content, list) else ()):
        kind = part.get("type", "text") if isinstance(part, dict) else "text"
        if kind != "text":
            raise ValueError(f"content part {i} is of type {kind!r}; this server reads text "
                             "parts only")
    return content


class ChatMessage(StrictModel):
    # "developer" is OpenAI's newer name for "system"; chat templates know only "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_text_parts_only),
                       AfterValidator(_unicode_text)] = None
    name: Annotated[str | None, AfterValidator(_unicode_text)] = None
    tool_calls: list[ToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages only

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only tool messages carry tool_call_id")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (HF's convention: a tool call's arguments
        as a dict, which templates render with ``tojson``)."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatTemplateFields(StrictModel):
    """How the chat template ends the conversation, vLLM's fields (``render_options``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The template's own variables (Qwen3's enable_thinking); any JSON values.
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self) -> dict[str, Any]:
        return render_options(self.add_generation_prompt, self.continue_final_message,
                              self.chat_template_kwargs)


class ChatCompletionRequest(ChatTemplateFields, SamplingRequest):
    unimplemented = frozenset({"functions", "function_call", "audio", "modalities", "prediction",
                               "reasoning_effort", "web_search_options", "verbosity"})

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    # At most the engine's --max-logprobs, which its input stage checks.
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[ChatTool] | None = None
    # Default as OpenAI's: "auto" with tools, "none" without.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @property
    def max_tokens_field(self) -> str:
        """OpenAI renamed max_tokens to max_completion_tokens; the new name wins."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None \
            else self.max_completion_tokens

    def field_name(self, param: str) -> str:
        return {"prompt": "messages", "max_tokens": self.max_tokens_field,
                "logprobs": "top_logprobs"}.get(
            param, super().field_name(param))

    def to_sampling_params(self, defaults: dict[str, float | int]) -> SamplingParams:
        self.check_stream_options()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidSamplingParam("top_logprobs", "top_logprobs requires logprobs: true")
        logprobs = _default(self.top_logprobs, 0) if self.logprobs else None
        try:
            return SamplingParams(
                **self._sampling_fields(defaults), logprobs=logprobs,
                max_tokens=_default(self.requested_max_tokens, defaults.get("max_tokens")))
        except InvalidSamplingParam as exc:  # named as the client sent it (max_completion_tokens)
            raise InvalidSamplingParam(self.field_name(exc.param), str(exc)) from None


class EmbeddingRequest(StrictModel):
    """OpenAI's ``POST /v1/embeddings`` body, plus vLLM's ``truncate_prompt_tokens``."""

    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # accepted and ignored, as OpenAI's other endpoints' is
    truncate_prompt_tokens: int | None = None

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)

    def field_name(self, param: str) -> str:
        """The field of this request that an engine parameter came from."""
        return "input" if param == "prompt" else param


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32 values


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class TokenizeCompletionRequest(StrictModel):
    """vLLM's ``POST /tokenize`` of a prompt."""

    model: str | None = None
    prompt: Annotated[str, AfterValidator(_unicode_text)]
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    """vLLM's ``POST /tokenize`` of a conversation, rendered by the chat template."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(StrictModel):
    """vLLM's ``POST /v1/load_lora_adapter``; ``base_model_name`` (ours) picks the base model
    where several serve LoRA."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    lora_int_id: int | None = Field(default=None, ge=1, le=MAX_LORA_INT_ID)
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(StrictModel):
    """vLLM's ``POST /v1/unload_lora_adapter``."""

    lora_name: str
    lora_int_id: int | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def _response_format_params(fmt: ResponseFormat) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidSamplingParam("response_format",
                                   "response_format json_schema needs json_schema.schema")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


def _default(value, default):
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON object keys are strings; OpenAI's are token ids written as strings."""
    if not bias:
        return None
    return {_token_id(key): value for key, value in bias.items()}


def _token_id(key: str) -> int:
    """A logit_bias key as a token id: ASCII digits only, where ``int`` alone would also read
    " 5", "+5", "1_0" and "٥"."""
    if not _TOKEN_ID.fullmatch(key):
        raise InvalidSamplingParam(
            "logit_bias", f"logit_bias key {key!r} is not a token id (decimal digits 0-9)")
    return int(key)


# ---- responses --------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy format: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ReasoningMessage(AssistantMessage):
    """An answer with its reasoning apart (``--reasoning-parser``), under both of vLLM's names:
    ``reasoning_content``, its first, and ``reasoning``, which replaced it."""

    reasoning_content: str | None
    reasoning: str | None

    @classmethod
    def of(cls, reasoning: str | None, **fields) -> ReasoningMessage:
        return cls(reasoning_content=reasoning, reasoning=reasoning, **fields)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage | ReasoningMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedserve"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's path (vLLM's)
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- server-sent events -----------------------------------------------------------------
SSE_DONE = "data: [DONE]\n\n"
_json = msgspec.json.Encoder()


def sse(event: BaseModel) -> str:
    """One stream event, every field written: an error event (chunks go through
    ``sse_chunk``) is the object a non-streamed error is, ``param`` and ``code`` null
    included; leaving out None dropped them."""
    return f"data: {event.model_dump_json()}\n\n"


def sse_chunk(kind: str, request_id: str, model: str, created: int, choices: list[dict],
              include_usage: bool, usage: UsageInfo | None = None) -> bytes:
    """A streamed chunk, ``{"id", "object": kind, "created", "model", "choices", "usage"?}``
    with choices from ``choice_dict`` (``kind`` "text_completion" or
    "chat.completion.chunk", whose choices hold a ``delta``), written as ``sse`` would:
    every token of every stream passes here, and building and dumping pydantic models for
    it cost three times as much (9 µs against 3 µs a chunk). ``include_usage`` (the
    request's): as in OpenAI, every chunk has ``usage``, null but in the last, ``usage``'s."""
    event = {"id": request_id, "object": kind, "created": created, "model": model,
             "choices": choices}
    if include_usage:
        event["usage"] = None if usage is None else usage.model_dump()
    return b"data: " + _json.encode(event) + b"\n\n"


def choice_dict(index: int, finish_reason: str | None, stop_reason: int | str | None,
                logprobs: BaseModel | None, **fields) -> dict:
    """One streamed choice. ``logprobs`` and ``finish_reason`` are null until set, as in
    OpenAI's chunks (and ``stop_reason``, as in vLLM's): a client that reads
    ``finish_reason !== null`` as "done" stopped at the first chunk when they were left out."""
    return {"index": index, **fields,
            "logprobs": None if logprobs is None else logprobs.model_dump(exclude_none=True),
            "finish_reason": finish_reason, "stop_reason": stop_reason}
