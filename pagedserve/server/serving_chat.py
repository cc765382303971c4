"""``POST /v1/chat/completions``: the conversation goes through the model's chat template (as
``LLM.chat`` does), then runs as one engine request with n choices.

Streams open with a chunk per choice that carries only the role, as OpenAI's do. With
``--reasoning-parser``, the reasoning comes apart from the answer (``reasoning_parsers.py``);
with tools, ``tool_choice`` decides how the answer becomes tool calls (``tool_choice.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi.responses import StreamingResponse

from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from pagedserve.sampling_params import InvalidSamplingParam, SamplingParams
from pagedserve.server.errors import bad_request, stream_error
from pagedserve.server.protocol import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    FunctionCall,
    ReasoningMessage,
    ToolCall,
    TopLogprob,
    UsageInfo,
    choice_dict,
    json_logprob,
    sse,
    sse_chunk,
)
from pagedserve.server.reasoning_parsers import ReasoningStream, ThinkParser
from pagedserve.server.request_ids import RequestIds
from pagedserve.server.serving_models import (
    ChoiceProgress,
    ServedModel,
    ServingModels,
    TimedStream,
)
from pagedserve.server.token_bytes import TokenBytes
from pagedserve.server.tool_choice import ToolCallStream, ToolPlan, call_id
from pagedserve.server.tool_parsers import ToolParser

_CHUNK = "chat.completion.chunk"  # the ``object`` of a streamed chunk


@dataclass
class ChatServing:
    models: ServingModels
    # The --tool-call-parser when --enable-auto-tool-choice is on, else None.
    tool_parser: ToolParser | None = None
    reasoning_parser: ThinkParser | None = None  # --reasoning-parser's

    async def create(self, request: ChatCompletionRequest,
                     ids: RequestIds) -> ChatCompletionResponse | StreamingResponse:
        run = await self.submit(request, ids)
        if request.stream:
            return StreamingResponse(self._stream(request, run, ids.response),
                                     media_type="text/event-stream")
        final = await run.final()
        choices = [self._choice(request, run.plan, o, run.token_bytes) for o in final.outputs]
        usage = await self.usage(run, final.outputs, final.metrics.num_generated_tokens)
        return ChatCompletionResponse(id=ids.response, model=run.name, choices=choices,
                                      usage=usage)

    async def submit(self, request: ChatCompletionRequest, ids: RequestIds) -> ChatRun:
        """Render, check and submit ``request``: all but the answer, which chat and the
        Responses API each write in their own shape."""
        arrival = time.perf_counter()
        route = self.models.resolve(request.model)
        model = route.model
        plan = ToolPlan.of(request, self.tool_parser)
        token_ids = await model.off_loop(_render, model, request, plan)
        params = _with_markers(_with_tool_constraint(
            request.to_sampling_params(model.sampling_defaults), plan), plan,
            self.reasoning_parser)
        if self.reasoning_parser is not None and params.structured_outputs is not None:
            params = await self._after_reasoning(model, params, request, plan)
        token_ids = model.truncate(token_ids, params)
        model.check_max_tokens(len(token_ids), request.requested_max_tokens,
                               param=request.max_tokens_field)
        model.check_min_tokens(len(token_ids), request.min_tokens)
        model.check_params(params)
        token_bytes = await model.token_bytes() if request.logprobs else None

        def field_name(param: str) -> str:  # a bad tool schema is the tools' fault
            if param == "structured_outputs" and plan.constraint() is not None:
                return "tools"
            return request.field_name(param)

        stream = await model.client.submit(ids.engine, token_ids, params, arrival,
                                           field_name, route.lora, request.priority)
        return ChatRun(model, route.name, plan, params, len(token_ids), stream, token_bytes)

    async def usage(self, run: ChatRun, outputs: list[CompletionOutput],
                    completion_tokens: int) -> UsageInfo:
        """With ``--reasoning-parser``, ``completion_tokens_details.reasoning_tokens`` counts
        every choice's tokens up to and including its reasoning's end."""
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = 0
            for out in outputs:
                reasoning += await run.model.off_loop(
                    self.reasoning_parser.num_reasoning_tokens, out.token_ids, run.model.decode)
        return UsageInfo.of(run.num_prompt_tokens, completion_tokens, reasoning)

    async def _after_reasoning(self, model: ServedModel, params: SamplingParams,
                               request: ChatCompletionRequest, plan: ToolPlan) -> SamplingParams:
        """``params`` whose grammar applies once the reasoning has ended (vLLM's), told by
        the tags' token ids in this model's tokenizer."""
        ids = await model.off_loop(self.reasoning_parser.tag_ids,
                                   partial(model.encode, add_special_tokens=False))
        if ids is None:
            raise InvalidSamplingParam(
                "tools" if plan.constraint() is not None else
                request.field_name("structured_outputs"),
                "structured output (response_format, structured_outputs, guided_*, or a "
                "required or named tool_choice) with this --reasoning-parser needs "
                f"{' or '.join(self.reasoning_parser.starts)} to be one token of the model's "
                "tokenizer, and one end marker")
        structured = dataclasses.replace(params.structured_outputs,
                                         reasoning_end_token_ids=ids.end,
                                         reasoning_start_token_id=ids.start)
        return dataclasses.replace(params, structured_outputs=structured)

    def _choice(self, request: ChatCompletionRequest, plan: ToolPlan, out: CompletionOutput,
                token_bytes: TokenBytes | None) -> ChatChoice:
        split = None if self.reasoning_parser is None else self.reasoning_parser.split(out.text)
        parsed = plan.parse(out.text if split is None else split.content or "")
        calls = [ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in parsed.calls]
        if split is None:
            message = AssistantMessage(content=parsed.content, tool_calls=calls)
        else:  # vLLM's: null, not "", for a part the output lacks
            message = ReasoningMessage.of(split.reasoning or None, content=parsed.content or None,
                                          tool_calls=calls)
        return ChatChoice(index=out.index, message=message,
                          logprobs=_logprobs(request, out.token_ids, out.logprobs, token_bytes),
                          finish_reason=_finish_reason(plan, out, bool(calls)),
                          stop_reason=out.stop_reason)

    async def _stream(self, request: ChatCompletionRequest, run: ChatRun,
                      request_id: str) -> AsyncIterator[str]:
        created = int(time.time())
        plan, token_bytes = run.plan, run.token_bytes

        def chunk(choices: list[dict], usage: UsageInfo | None = None) -> bytes:
            return sse_chunk(_CHUNK, request_id, run.name, created, choices,
                             request.include_usage_in_stream, usage)

        n = request.n or 1
        sent = [ChoiceProgress() for _ in range(n)]
        regrouped = [self.regrouped(plan) for _ in range(n)] \
            if plan.mode != "none" or self.reasoning_parser is not None else None
        completion_tokens, last = 0, {}  # the choices' latest outputs, by index
        try:
            yield chunk([choice_dict(i, None, None, None,
                                     delta={"role": "assistant", "content": ""})
                         for i in range(n)])
            async for output in run.stream:
                for out in output.outputs:
                    last[out.index] = out
                    if regrouped is None:
                        choice = _delta(request, out, sent[out.index], token_bytes)
                    else:
                        choice = _regrouped_delta(request, plan, out, sent[out.index],
                                                  regrouped[out.index], token_bytes)
                    if choice is not None:
                        yield chunk([choice])
                if output.finished:
                    completion_tokens = output.metrics.num_generated_tokens
            if request.include_usage_in_stream:
                yield chunk([], await self.usage(run, list(last.values()), completion_tokens))
        except Exception as exc:
            yield sse(stream_error(exc))
        finally:
            run.stream.close()
        yield SSE_DONE

    def regrouped(self, plan: ToolPlan) -> RegroupedStream:
        """A streamed choice's regrouping: its reasoning apart, its answer parsed for calls."""
        return RegroupedStream(
            None if self.reasoning_parser is None else ReasoningStream(self.reasoning_parser),
            None if plan.mode == "none" else ToolCallStream(plan))


@dataclass(frozen=True)
class ChatRun:
    """A chat request submitted to its engine: what its answer is written from."""

    model: ServedModel
    name: str  # the model as the request named it (an adapter's name, for one)
    plan: ToolPlan
    params: SamplingParams
    num_prompt_tokens: int
    stream: TimedStream
    token_bytes: TokenBytes | None  # set when the request asks for logprobs

    async def final(self) -> RequestOutput:
        try:
            return await self.stream.final()
        finally:
            self.stream.close()


@dataclass
class RegroupedStream:
    """A streamed choice whose text is regrouped before it is sent: the reasoning apart
    (``reasoning``), then the answer, parsed for tool calls (``tools``) or else passed on as
    it comes."""

    reasoning: ReasoningStream | None
    tools: ToolCallStream | None
    num_content_sent: int = 0  # characters of the answer passed on (without ``tools``)

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        delta = {}
        if self.reasoning is not None:
            piece, text = self.reasoning.update(text, finished)
            if piece:  # under both of vLLM's names, as a whole response has it
                delta = {"reasoning_content": piece, "reasoning": piece}
            if text is None:
                return delta
        if self.tools is not None:
            return delta | self.tools.delta(text, finished)
        piece, self.num_content_sent = text[self.num_content_sent:], len(text)
        return (delta | {"content": piece}) if piece else delta


def _delta(request: ChatCompletionRequest, out: CompletionOutput, sent: ChoiceProgress,
           token_bytes: TokenBytes | None) -> dict | None:
    if sent.done:
        return None
    text = out.text[sent.num_chars:]
    new_tokens = len(out.token_ids) > sent.num_tokens
    if not text and not out.finished and not (new_tokens and request.logprobs):
        return None
    return choice_dict(out.index, out.finish_reason, out.stop_reason,
                       _logprobs_since(request, out, sent, token_bytes),
                       delta={"content": text} if text else {})


def _logprobs_since(request: ChatCompletionRequest, out: CompletionOutput,
                    sent: ChoiceProgress, token_bytes: TokenBytes | None) -> ChatLogprobs | None:
    """The logprobs of the tokens past ``sent``'s mark, which then moves to the end of
    ``out``."""
    token_ids = out.token_ids[sent.num_tokens:]
    # The engine may have appended entries past this snapshot's tokens already.
    entries = (out.logprobs or [])[sent.num_tokens:len(out.token_ids)]
    sent.advance(out)
    return _logprobs(request, token_ids, entries, token_bytes)


def _logprobs(request: ChatCompletionRequest, token_ids: list[int],
              entries: list[TokenLogprobs] | None,
              token_bytes: TokenBytes | None) -> ChatLogprobs | None:
    """``token_bytes`` is set whenever the request asks for logprobs."""
    if not request.logprobs:
        return None
    k = request.top_logprobs or 0
    return ChatLogprobs(content=[_token_logprob(t, e, k, token_bytes)
                                 for t, e in zip(token_ids, entries or [], strict=False)])


def render_chat(model: ServedModel, messages: list[ChatMessage],
                tools: list[dict] | None, options: dict[str, Any]) -> str:
    """The conversation as the model's chat template writes it (``tools`` in OpenAI's form,
    ``options`` a request's ``template_options``)."""
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template (the server takes one with "
                          "--chat-template); use /v1/completions",
                          param="messages")
    try:
        return tokenizer.apply_chat_template(
            [m.for_template() for m in messages], tools=tools, tokenize=False, **options)
    except Exception as exc:  # the template's own raise_exception(), or a Jinja error
        raise bad_request(f"the chat template rejected the messages: {exc}",
                          param="messages") from exc


def _render(model: ServedModel, request: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
    text = render_chat(model, request.messages, plan.template_tools(),
                       request.template_options())
    # The template already holds any BOS token; tokenize without adding another.
    return model.encode(text, add_special_tokens=False)


def _regrouped_delta(request: ChatCompletionRequest, plan: ToolPlan, out: CompletionOutput,
                     sent: ChoiceProgress, stream: RegroupedStream,
                     token_bytes: TokenBytes | None) -> dict | None:
    """A streamed choice with tools or reasoning. The text is regrouped (what may start a tag
    or a call is held back, calls may come whole at the end), so a chunk's logprobs are those
    of every token since the choice's last chunk; all the chunks' add up to a whole
    response's."""
    if sent.done:
        return None
    delta = stream.delta(out.text, out.finished)
    if not delta and not out.finished:
        return None
    return choice_dict(out.index, _finish_reason(plan, out, stream.called),
                       out.stop_reason, _logprobs_since(request, out, sent, token_bytes),
                       delta=delta)


def _finish_reason(plan: ToolPlan, out: CompletionOutput, called: bool) -> str | None:
    """"tool_calls" for an output with calls that ended by itself. A stop string that ended a
    grammar-enforced one (named, required) cut its calls short, as ``max_tokens`` does: that
    stays "stop", with the string as ``stop_reason``."""
    cut = isinstance(out.stop_reason, str) and plan.mode in ("named", "required")
    return "tool_calls" if called and out.finish_reason == "stop" and not cut else out.finish_reason


def _with_markers(params: SamplingParams, plan: ToolPlan,
                  reasoning: ThinkParser | None) -> SamplingParams:
    """Special tokens kept in the text where a parser reads markers that are special tokens
    (an auto tool call's, or the reasoning's), as vLLM's parsers have them."""
    if (plan.mode == "auto" and plan.parser.keeps_special_tokens) or \
            (reasoning is not None and reasoning.keeps_special_tokens):
        return dataclasses.replace(params, skip_special_tokens=False)
    return params


def _with_tool_constraint(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    constraint = plan.constraint()
    if constraint is None:
        return params
    if params.structured_outputs is not None:
        raise InvalidSamplingParam(
            "tool_choice", f"tool_choice {plan.mode!r} constrains the output itself; it cannot "
            "be combined with response_format or structured outputs")
    return dataclasses.replace(params, structured_outputs=constraint)


def _token_logprob(token: int, entry: TokenLogprobs, k: int,
                   token_bytes: TokenBytes) -> ChatTokenLogprob:
    top = sorted((item for item in entry.items() if item[1].rank <= k),
                 key=lambda item: item[1].rank)[:k]
    return ChatTokenLogprob(**_top(token, entry[token], token_bytes).model_dump(),
                            top_logprobs=[_top(t, lp, token_bytes) for t, lp in top])


def _top(token: int, lp: Logprob, token_bytes: TokenBytes) -> TopLogprob:
    """``bytes`` are the token's own, not the UTF-8 of its text: a token that holds part
    of a character decodes to U+FFFD."""
    text = lp.decoded_token or ""
    return TopLogprob(token=text, logprob=json_logprob(lp.logprob),
                      bytes=token_bytes.of(token, text))
