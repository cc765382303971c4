"""``POST /v1/completions``: one engine request per prompt, n choices each.

Choice ``i`` of prompt ``p`` has index ``p * n + i``, as in OpenAI. Logprobs use the legacy
format (parallel lists of tokens, token_logprobs, top_logprobs and text_offset); with ``echo``
the prompt's tokens come first, the very first one without a logprob.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from pagedserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from pagedserve.server.errors import bad_request, stream_error
from pagedserve.server.protocol import (
    SSE_DONE,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptInput,
    UsageInfo,
    choice_dict,
    json_logprob,
    sse,
    sse_chunk,
)
from pagedserve.server.request_ids import RequestIds
from pagedserve.server.serving_models import (
    MAX_SEQUENCES_PER_REQUEST,
    ChoiceProgress,
    Route,
    ServedModel,
    ServingModels,
    TimedStream,
    close_all,
    finals,
)

_CHUNK = "text_completion"  # the ``object`` of a streamed chunk


@dataclass(frozen=True)
class Prompt:
    text: str | None  # None when the client sent token ids
    token_ids: list[int]

    def truncated(self, kept: list[int]) -> Prompt:
        """The prompt cut to its last tokens ``kept``; echo then shows the kept tokens'
        text, not the whole text sent."""
        return self if len(kept) == len(self.token_ids) else Prompt(None, kept)


@dataclass
class CompletionServing:
    models: ServingModels

    async def create(self, request: CompletionRequest,
                     ids: RequestIds) -> CompletionResponse | StreamingResponse:
        arrival = time.perf_counter()
        route = self.models.resolve(request.model)
        model = route.model
        prompts = await model.off_loop(tokenized_prompts, model, request.prompt, "prompt")
        params = request.to_sampling_params(model.sampling_defaults)
        prompts = [p.truncated(model.truncate(p.token_ids, params)) for p in prompts]
        for prompt in prompts:
            model.check_max_tokens(len(prompt.token_ids), request.max_tokens)
            model.check_min_tokens(len(prompt.token_ids), request.min_tokens)
        model.check_params(params, num_prompts=len(prompts))
        request_id = ids.response
        streams = await model.client.submit_all(
            ids.engine, [p.token_ids for p in prompts], params, arrival, request.field_name,
            route.lora, request.priority)
        if request.stream:
            return StreamingResponse(self._stream(route, request, request_id, prompts, streams),
                                     media_type="text/event-stream")
        return self._response(route, request, request_id, prompts, await finals(streams))

    # ---- whole responses ----------------------------------------------------------------
    def _response(self, route: Route, request: CompletionRequest, request_id: str,
                  prompts: list[Prompt], finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for p, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            for out in final.outputs:
                choices.append(self._choice(route.model, request, p * (request.n or 1)
                                            + out.index, prompt, final, out))
        completion_tokens = sum(f.metrics.num_generated_tokens for f in finals)
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return CompletionResponse(id=request_id, model=route.name, choices=choices,
                                  usage=UsageInfo.of(prompt_tokens, completion_tokens))

    def _choice(self, model: ServedModel, request: CompletionRequest, index: int,
                prompt: Prompt, final: RequestOutput, out: CompletionOutput) -> CompletionChoice:
        text = out.text
        builder = _LogprobsBuilder() if request.logprobs is not None else None
        if request.echo:
            text = _prompt_text(model, prompt) + text
            if builder is not None:
                builder.add_prompt(prompt.token_ids, final.prompt_logprobs, model.decode)
        if builder is not None:
            builder.add_output(out.token_ids, out.logprobs or [])
        return CompletionChoice(index=index, text=text,
                                logprobs=builder.logprobs if builder else None,
                                finish_reason=out.finish_reason, stop_reason=out.stop_reason)

    # ---- streams ------------------------------------------------------------------------
    async def _stream(self, route: Route, request: CompletionRequest, request_id: str,
                      prompts: list[Prompt], streams: list[TimedStream]) -> AsyncIterator[str]:
        n = request.n or 1
        progress: dict[int, ChoiceProgress] = {}
        completion_tokens = 0
        created = int(time.time())
        with_usage = request.include_usage_in_stream
        try:
            async for p, output in _merge(streams):
                for out in output.outputs:
                    state = progress.setdefault(p * n + out.index, ChoiceProgress())
                    chunk = self._delta(route.model, request, p * n + out.index, prompts[p],
                                        output, out, state)
                    if chunk is not None:
                        yield sse_chunk(_CHUNK, request_id, route.name, created, [chunk],
                                        with_usage)
                if output.finished:
                    completion_tokens += output.metrics.num_generated_tokens
            if with_usage:
                prompt_tokens = sum(len(p.token_ids) for p in prompts)
                yield sse_chunk(_CHUNK, request_id, route.name, created, [], with_usage,
                                UsageInfo.of(prompt_tokens, completion_tokens))
        except Exception as exc:
            yield sse(stream_error(exc))
        finally:
            close_all(streams)
        yield SSE_DONE

    def _delta(self, model: ServedModel, request: CompletionRequest, index: int,
               prompt: Prompt, output: RequestOutput, out: CompletionOutput,
               state: ChoiceProgress) -> dict | None:
        """The chunk for what this choice gained since the last one, or None if nothing."""
        if state.done:
            return None
        text = out.text[state.num_chars:]
        token_ids = out.token_ids[state.num_tokens:]
        finish = out.finish_reason
        if not text and not finish and not (token_ids and request.logprobs is not None):
            return None
        builder = None
        if request.logprobs is not None:
            builder = _LogprobsBuilder(offset=state.text_offset)
        if request.echo and not state.started:
            text = _prompt_text(model, prompt) + text
            if builder is not None:
                builder.add_prompt(prompt.token_ids, output.prompt_logprobs, model.decode)
        if builder is not None:
            # The engine may have appended entries past this snapshot's tokens already.
            entries = (out.logprobs or [])[state.num_tokens:len(out.token_ids)]
            builder.add_output(token_ids, entries)
            state.text_offset = builder.offset
        state.advance(out)
        return choice_dict(index, finish, out.stop_reason,
                           builder.logprobs if builder else None, text=text)


def tokenized_prompts(model: ServedModel, prompt: PromptInput, param: str) -> list[Prompt]:
    """A request's prompts (text, token ids, or a list of either), tokenized; ``param``
    names the request's field in errors."""
    # An empty list is one empty prompt, which the engine refuses as it refuses "".
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = prompt
    if len(items) > MAX_SEQUENCES_PER_REQUEST:
        raise bad_request(f"at most {MAX_SEQUENCES_PER_REQUEST} prompts per request",
                          param=param)
    return [Prompt(p, model.encode(p)) if isinstance(p, str) else Prompt(None, p)
            for p in items]


def _prompt_text(model: ServedModel, prompt: Prompt) -> str:
    return prompt.text if prompt.text is not None else model.decode(prompt.token_ids)


async def _merge(streams: list[TimedStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, each tagged with its stream's position."""
    if len(streams) == 1:  # the common case needs no task per output
        async for output in streams[0]:
            yield 0, output
        return
    iterators = [aiter(s) for s in streams]
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                yield i, output
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
    finally:
        for task in pending:
            task.cancel()


@dataclass
class _LogprobsBuilder:
    """Appends tokens to legacy logprobs; a token's text_offset is where the previous token's
    text ended, counted over every token sent so far for the choice."""

    logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    offset: int = 0

    def add(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.logprobs.tokens.append(token)
        self.logprobs.token_logprobs.append(logprob)
        self.logprobs.top_logprobs.append(top)
        self.logprobs.text_offset.append(self.offset)
        self.offset += len(token)

    def add_entry(self, token: int, entry: TokenLogprobs) -> None:
        """The sampled token and its top alternatives (the entry holds both)."""
        top = {lp.decoded_token or "": json_logprob(lp.logprob) for lp in entry.values()}
        self.add(entry[token].decoded_token or "", json_logprob(entry[token].logprob), top)

    def add_prompt(self, token_ids: list[int], entries: list[TokenLogprobs | None] | None,
                   decode) -> None:
        """The first prompt token (and any the engine could not score) has no logprob."""
        entries = entries or []
        for i, token in enumerate(token_ids):
            entry = entries[i] if i < len(entries) else None
            if entry is None or token not in entry:
                self.add(decode([token]), None, None)
            else:
                self.add_entry(token, entry)

    def add_output(self, token_ids: list[int], entries: list[TokenLogprobs]) -> None:
        for token, entry in zip(token_ids, entries, strict=False):
            self.add_entry(token, entry)
