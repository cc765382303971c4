"""The OpenAI wire format as pydantic models: requests in, responses and stream chunks out.

Request fields are optional where OpenAI allows ``null``; defaults are applied when the request
becomes ``SamplingParams``. vLLM's extra sampling fields (top_k, min_p, ...) are accepted too.

Requests are read as strictly as OpenAI reads them: ``"4"``, ``true`` or ``4.0`` is not an
integer, infinities and NaN are not numbers, and a field this server does not know is refused
with its name (a field it does not implement, such as ``suffix``, must not be silently ignored).
A few fields that change nothing in the output are accepted and ignored: ``user``, ``store``
(but by the Responses API's store), ``metadata``, ``service_tier``, ``safety_identifier`` and
``prompt_cache_key``. OpenAI fields the
server does not implement are accepted as ``null``, their default (the openai SDK sends
``"suffix": null`` for ``suffix=None``), and refused with any other value.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
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


def random_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex}"


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


class IgnoredFields(StrictModel):
    """Accepted and ignored: who asks, and hints to OpenAI's storage and routing."""

    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class SamplingRequest(IgnoredFields):
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
    # vLLM's: lower is served earlier; other than 0 only with --scheduling-policy priority
    # (the engine's input limits check it).
    priority: int = 0

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


class _PoolingInputRequest(StrictModel):
    """The fields of a pooling request over ``input`` (embeddings, classification): vLLM's
    ``truncate_prompt_tokens`` and ``priority`` (a completion's)."""

    model: str | None = None
    input: PromptInput
    user: str | None = None  # accepted and ignored, as OpenAI's other endpoints' is
    truncate_prompt_tokens: int | None = None
    priority: int = 0

    def field_name(self, param: str) -> str:
        """The field of this request that an engine parameter came from."""
        return "input" if param == "prompt" else param


class EmbeddingRequest(_PoolingInputRequest):
    """OpenAI's ``POST /v1/embeddings`` body; ``dimensions`` needs a Matryoshka model (the
    engine's input limits check it)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)


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


# ---- classification with a sequence classifier (vLLM's) -----------------------------------
class _ActivationField(StrictModel):
    """vLLM's switch on classification and scoring requests: false returns a classifier's raw
    logits (as ``probs``, or as a cross-encoder's score), None or true its probabilities.
    Only this name: vLLM removed the older ``activation`` and ``softmax`` in v0.15."""

    use_activation: bool | None = None


class ClassificationRequest(_PoolingInputRequest, _ActivationField):
    """vLLM's ``POST /classify`` body: each input's label probabilities."""

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens,
                             use_activation=self.use_activation, task="classify")


class ClassificationData(BaseModel):
    index: int
    label: str  # the most probable label's name (config.json's id2label)
    probs: list[float]
    num_classes: int


class ClassificationUsage(EmbeddingUsage):
    completion_tokens: int = 0


class _ListResponse(BaseModel):
    """The head of vLLM's pooling responses that list their results in ``data``."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str


class ClassificationResponse(_ListResponse):
    data: list[ClassificationData]
    usage: ClassificationUsage


# ---- scoring and reranking with an embedding model (vLLM's) -------------------------------
# One text, or a list of at least one.
ScoreTexts = Annotated[str | Annotated[list[str], Field(min_length=1)],
                       AfterValidator(_unicode_text)]


class _ScoringRequest(_ActivationField):
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0  # vLLM's, as an embedding request's

    def to_pooling_params(self) -> PoolingParams:
        """``use_activation`` is a cross-encoder's: the engine refuses it on embeddings."""
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens,
                             use_activation=self.use_activation)


class ScoreRequest(_ScoringRequest):
    """vLLM's ``POST /v1/score`` body: ``text_1`` against each of ``text_2`` (1:N), or the
    i-th against the i-th when both are lists of one length (N:N)."""

    text_1: ScoreTexts
    text_2: ScoreTexts

    def field_name(self, param: str) -> str:
        return "text_2" if param == "prompt" else param


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_ListResponse):
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankRequest(_ScoringRequest):
    """``POST /v1/rerank`` (Jina's and Cohere's form, as vLLM serves it): the ``documents``
    by their score against ``query``, best first; ``top_n`` (None or 0: all) of them."""

    query: Annotated[str, AfterValidator(_unicode_text)]
    documents: Annotated[list[str], Field(min_length=1), AfterValidator(_unicode_text)]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True

    def field_name(self, param: str) -> str:
        return "documents" if param == "prompt" else param


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None  # None: return_documents was false
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
# ---- the Responses API -------------------------------------------------------------------
# Text as the Responses API sends it: checked for lone surrogates, as chat's is.
_Text = Annotated[str, AfterValidator(_unicode_text)]
# The input items and tools this server reads; any other type is refused by name.
_INPUT_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


class InputText(StrictModel):
    """A text part of an input message: ``input_text``, or ``output_text`` of an assistant
    message replayed from an earlier response (whose ``annotations`` and ``logprobs`` are
    ignored)."""

    type: Literal["input_text", "output_text"]
    text: _Text
    annotations: list | None = None
    logprobs: list | None = None


class _ReplayedItem(StrictModel):
    """An input item; ``id`` and ``status`` come with items replayed from a response's
    ``output`` and are ignored."""

    id: str | None = None
    status: str | None = None


class InputMessage(_ReplayedItem):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: _Text | list[InputText]

    def text(self) -> str:
        return _joined(self.content)


def _joined(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


class FunctionCallItem(_ReplayedItem):
    """A call the model made in an earlier turn: an assistant message's tool call."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: _Text


class FunctionCallOutputItem(_ReplayedItem):
    """A call's result: a tool message."""

    type: Literal["function_call_output"]
    call_id: str
    output: _Text | list[InputText]


class ReasoningItem(_ReplayedItem):
    """An earlier turn's reasoning, replayed: read and dropped, as chat templates drop it."""

    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


def _item_kind(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else "message"


def _known_items(items: Any) -> Any:
    """Items of other types (images, files, item references) are named here; left to the
    union, each got a line per member."""
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if _item_kind(item) not in _INPUT_ITEMS:
            raise ValueError(f"input item {i} is of type {_item_kind(item)!r}; this server "
                             f"reads {', '.join(_INPUT_ITEMS)} items")
        content = item.get("content") if _item_kind(item) == "message" else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text"):
                raise ValueError(f"input item {i}: content part {j} is of type {kind!r}; "
                                 "this server reads input_text parts only")
    return items


InputItem = Annotated[Annotated[InputMessage, Tag("message")]
                      | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")],
                      Discriminator(_item_kind)]


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses API's flat form: chat's ``function`` with ``type``."""

    type: Literal["function"]

    def to_chat(self) -> ChatTool:
        return ChatTool(type="function", function=FunctionDefinition(
            **self.model_dump(exclude={"type"})))


def _function_tools_only(tools: Any) -> Any:
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(f"tool {i} is of type {kind!r}; this server runs function tools "
                             "only (built-in tools such as web_search are not supported)")
    return tools


class FunctionToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """``text.format``: chat's ``response_format``, with the json_schema's fields flat."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _json_schema_has_its_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs name and schema")
        return self

    def to_chat(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
            name=self.name, description=self.description, schema=self.schema_,
            strict=self.strict))


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted and ignored


class ReasoningConfig(StrictModel):
    """Accepted and ignored: the model reasons as its chat template has it."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(IgnoredFields):
    """``POST /v1/responses``, read into the chat request it runs as (``to_chat``), after the
    conversation of ``previous_response_id`` where one is named (``responses_store.py``).
    ``store`` is read there too."""

    # OpenAI's fields that this server does not implement: refused unless null.
    unimplemented: ClassVar[frozenset[str]] = frozenset({
        "conversation", "prompt", "max_tool_calls", "top_logprobs", "include",
        "stream_options"})
    # Accepted only with these values, their defaults.
    _DEFAULTS: ClassVar[dict[str, Any]] = {"include": [], "top_logprobs": 0}

    model: str | None = None
    input: Annotated[_Text | list[InputItem], BeforeValidator(_known_items)] = Field(
        max_length=MAX_MESSAGES)
    instructions: _Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: Annotated[list[FunctionTool] | None, BeforeValidator(_function_tools_only)] = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    truncation: Literal["disabled"] | None = None
    previous_response_id: str | None = None
    background: bool | None = False  # runs on once answered; needs the store
    priority: int = 0  # vLLM's, as chat's

    @model_validator(mode="before")
    @classmethod
    def _drop_defaults_and_nulls(cls, data: Any) -> Any:
        """A null (or the default value) of an unimplemented field asks for nothing; any other
        value is left for ``extra="forbid"`` to refuse."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if k not in cls.unimplemented
                or (v is not None and v != cls._DEFAULTS.get(k, None))}

    def to_chat(self, earlier: Sequence[InputItem] = ()) -> ChatOfResponse:
        """``earlier``: the items of the conversation before this input (a stored response's)."""
        fmt = self.text.format if self.text is not None else None
        return ChatOfResponse(
            model=self.model, messages=self.messages(earlier), stream=self.stream,
            max_completion_tokens=self.max_output_tokens, temperature=self.temperature,
            top_p=self.top_p, tools=[t.to_chat() for t in self.tools] if self.tools else None,
            tool_choice=_chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=None if fmt is None else fmt.to_chat(), priority=self.priority)

    def items(self) -> list[InputItem]:
        """The input as items: a string is one user message."""
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return self.input

    def messages(self, earlier: Sequence[InputItem] = ()) -> list[ChatMessage]:
        """The conversation as chat has it: ``instructions`` as a system message first, then
        ``earlier`` and the input; consecutive function calls (after any text of the same turn)
        one assistant message."""
        messages = [] if self.instructions is None else [
            ChatMessage(role="system", content=self.instructions)]
        for item in [*earlier, *self.items()]:  # a reasoning item is dropped
            if isinstance(item, FunctionCallItem):
                if not messages or messages[-1].role != "assistant":
                    messages.append(ChatMessage(role="assistant"))
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), ToolCall(
                    id=item.call_id, function=FunctionCall(name=item.name,
                                                           arguments=item.arguments))]
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(ChatMessage(role="tool", content=_joined(item.output),
                                            tool_call_id=item.call_id))
            elif isinstance(item, InputMessage):
                messages.append(ChatMessage(role=item.role, content=item.text()))
        if not messages:
            raise InvalidSamplingParam("input", "input holds no message")
        return messages


_OUTPUT_ITEMS = TypeAdapter(list[InputItem])
# The prefix of an item's id, by its type: output items, and input items sent without one.
ITEM_ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc",
                  "function_call_output": "fco"}


def replayed(output: list[dict[str, Any]]) -> list[InputItem]:
    """A response's output items as input items, as a client replays them."""
    return _OUTPUT_ITEMS.validate_python(output)


def listed(items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """Input items as ``GET /v1/responses/{id}/input_items`` lists them, in OpenAI's shape:
    each with its ``id`` (a new one where the request gave none) and a ``status``, a message's
    text as one part."""
    out = []
    for item in items:
        data = item.model_dump(exclude_none=True)
        if isinstance(item, InputMessage) and isinstance(item.content, str):
            part = "output_text" if item.role == "assistant" else "input_text"
            data["content"] = [{"type": part, "text": item.content}]
        data.setdefault("id", f"{ITEM_ID_PREFIX[item.type]}_{uuid.uuid4().hex}")
        data.setdefault("status", "completed")
        out.append(data)
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, FunctionToolChoice):
        return NamedToolChoice(type="function", function=FunctionName(name=choice.name))
    return choice


class ChatOfResponse(ChatCompletionRequest):
    """The chat request a Responses request runs as; its errors name the Responses fields."""

    _RESPONSES_FIELDS: ClassVar[dict[str, str]] = {
        "max_completion_tokens": "max_output_tokens", "response_format": "text",
        "messages": "input"}

    @property
    def max_tokens_field(self) -> str:
        return "max_output_tokens"

    def field_name(self, param: str) -> str:
        name = super().field_name(param)
        return self._RESPONSES_FIELDS.get(name, name)


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
class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # With --reasoning-parser: the output tokens up to and including the reasoning's end.
    completion_tokens_details: CompletionTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int,
           reasoning_tokens: int | None = None) -> UsageInfo:
        details = None if reasoning_tokens is None \
            else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   completion_tokens_details=details)


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


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]  # {"cached_tokens"}: the prefix cache's
    output_tokens: int
    output_tokens_details: dict[str, int]  # {"reasoning_tokens"}
    total_tokens: int

    @classmethod
    def of(cls, usage: UsageInfo, cached_tokens: int) -> ResponsesUsage:
        details = usage.completion_tokens_details
        return cls(input_tokens=usage.prompt_tokens,
                   input_tokens_details={"cached_tokens": cached_tokens},
                   output_tokens=usage.completion_tokens,
                   output_tokens_details={"reasoning_tokens": details.reasoning_tokens
                                          if details else 0},
                   total_tokens=usage.total_tokens)


class ResponseError(BaseModel):
    code: str  # OpenAI's: "server_error", or "invalid_prompt" for what the request asked
    message: str


class ResponseObject(BaseModel):
    """A response of ``POST /v1/responses``: its output items (dicts, as the stream's events
    carry them) and the request's parameters echoed, as OpenAI's are."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: ResponseError | None = None  # why a background response failed
    incomplete_details: dict[str, str] | None = None
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    usage: ResponsesUsage | None = None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    reasoning: dict[str, Any] | None
    metadata: dict[str, str] | None
    user: str | None
    store: bool = False  # whether the response was stored (--enable-responses-store)
    previous_response_id: str | None = None
    truncation: Literal["disabled"] = "disabled"
    background: bool = False


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class ResponseItemList(BaseModel):
    """``GET /v1/responses/{id}/input_items``: a page of a response's input items."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


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
