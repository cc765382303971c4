"""``POST /v1/chat/completions``: the conversation goes through the model's chat template (as
``LLM.chat`` does), then runs as one engine request with n choices.

Streams open with a chunk per choice that carries only the role, as OpenAI's do.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from pagedserve.outputs import CompletionOutput, TokenLogprobs
from pagedserve.server.errors import bad_request, stream_error
from pagedserve.server.protocol import (
    MIN_LOGPROB,
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    TopLogprob,
    UsageInfo,
    choice_dict,
    random_id,
    sse,
    sse_chunk,
)
from pagedserve.server.serving_models import (
    ChoiceProgress,
    EngineClient,
    ServedModel,
    TimedStream,
)

_CHUNK = "chat.completion.chunk"  # the ``object`` of a streamed chunk


@dataclass
class ChatServing:
    model: ServedModel
    client: EngineClient

    async def create(self, request: ChatCompletionRequest,
                     ) -> ChatCompletionResponse | StreamingResponse:
        arrival = time.perf_counter()
        self.model.check_name(request.model)
        token_ids = self._render(request)
        self.model.check_max_tokens(len(token_ids), request.requested_max_tokens,
                                    param=request.max_tokens_field)
        params = request.to_sampling_params()
        self.model.check_params(params)
        request_id = random_id("chatcmpl")
        stream = self.client.submit(request_id, token_ids, params, arrival, request.field_name)
        if request.stream:
            return StreamingResponse(self._stream(request, request_id, len(token_ids), stream),
                                     media_type="text/event-stream")
        try:
            final = await stream.final()
        finally:
            stream.close()
        choices = [ChatChoice(index=o.index, message=AssistantMessage(content=o.text),
                              logprobs=self._logprobs(request, o.token_ids, o.logprobs),
                              finish_reason=o.finish_reason, stop_reason=o.stop_reason)
                   for o in final.outputs]
        completion_tokens = final.metrics.num_generated_tokens
        return ChatCompletionResponse(id=request_id, model=self.model.name, choices=choices,
                                      usage=UsageInfo.of(len(token_ids), completion_tokens))

    def _render(self, request: ChatCompletionRequest) -> list[int]:
        tokenizer = self.model.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions",
                              param="messages")
        messages = [m.for_template() for m in request.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=request.add_generation_prompt)
        except Exception as exc:  # the template's own raise_exception(), or a Jinja error
            raise bad_request(f"the chat template rejected the messages: {exc}",
                              param="messages") from exc
        # The template already holds any BOS token; tokenize without adding another.
        return self.model.encode(text, add_special_tokens=False)

    def _logprobs(self, request: ChatCompletionRequest, token_ids: list[int],
                  entries: list[TokenLogprobs] | None) -> ChatLogprobs | None:
        if not request.logprobs:
            return None
        k = request.top_logprobs or 0
        return ChatLogprobs(content=[_token_logprob(t, e, k)
                                     for t, e in zip(token_ids, entries or [], strict=False)])

    async def _stream(self, request: ChatCompletionRequest, request_id: str,
                      num_prompt_tokens: int, stream: TimedStream) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[dict], usage: UsageInfo | None = None) -> bytes:
            return sse_chunk(_CHUNK, request_id, self.model.name, created, choices, usage)

        n = request.n or 1
        sent = [ChoiceProgress() for _ in range(n)]
        completion_tokens = 0
        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}}
                         for i in range(n)])
            async for output in stream:
                for out in output.outputs:
                    choice = self._delta(request, out, sent[out.index])
                    if choice is not None:
                        yield chunk([choice])
                if output.finished:
                    completion_tokens = output.metrics.num_generated_tokens
            if request.include_usage_in_stream:
                yield chunk([], UsageInfo.of(num_prompt_tokens, completion_tokens))
        except Exception as exc:
            yield sse(stream_error(exc))
        finally:
            stream.close()
        yield SSE_DONE

    def _delta(self, request: ChatCompletionRequest, out: CompletionOutput,
               sent: ChoiceProgress) -> dict | None:
        if sent.done:
            return None
        text = out.text[sent.num_chars:]
        token_ids = out.token_ids[sent.num_tokens:]
        if not text and not out.finished and not (token_ids and request.logprobs):
            return None
        # The engine may have appended entries past this snapshot's tokens already.
        entries = (out.logprobs or [])[sent.num_tokens:len(out.token_ids)]
        sent.advance(out)
        return choice_dict(out.index, out.finish_reason, out.stop_reason,
                           self._logprobs(request, token_ids, entries),
                           delta={"content": text} if text else {})


def _token_logprob(token: int, entry: TokenLogprobs, k: int) -> ChatTokenLogprob:
    top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)[:k]
    sampled = entry[token]
    return ChatTokenLogprob(**_top(sampled).model_dump(), top_logprobs=[_top(lp) for lp in top])


def _top(lp) -> TopLogprob:
    text = lp.decoded_token or ""
    return TopLogprob(token=text, logprob=max(lp.logprob, MIN_LOGPROB),
                      bytes=list(text.encode("utf-8")))
