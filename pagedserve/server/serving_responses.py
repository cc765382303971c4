"""``POST /v1/responses``, OpenAI's Responses API, run as the chat request it reads as
(``ResponsesRequest.to_chat``): the same chat template, tools, structured output and
reasoning split. The answer goes through chat's stream regrouping (``RegroupedStream``), which
holds back tool-call markup and tags, and comes out as output items: ``reasoning``,
``message`` and ``function_call``. A whole response is its stream's items, fed the text at
once.

With ``--enable-responses-store``, a finished response of a request with ``store`` true is
kept (``responses_store.py``): ``previous_response_id`` continues its conversation, and it can
be read and deleted by id. Without it, nothing is stored, as in vLLM by default: ``store`` is
answered ``false`` and ``previous_response_id`` is a 400.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi.responses import StreamingResponse

from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import InvalidSamplingParam
from pagedserve.server.errors import APIError, stream_error
from pagedserve.server.protocol import (
    InputItem,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponsesUsage,
    replayed,
)
from pagedserve.server.request_ids import RequestIds
from pagedserve.server.responses_store import ResponsesStore, StoredResponse
from pagedserve.server.serving_chat import ChatRun, ChatServing, RegroupedStream

_json = msgspec.json.Encoder()
# A text item's part, and its events, by the item's type.
_PART = {"message": "output_text", "reasoning": "reasoning_text"}
_TEXT_EVENT = {"message": "response.output_text", "reasoning": "response.reasoning_text"}
_ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc"}


@dataclass
class ResponsesServing:
    chat: ChatServing
    store: ResponsesStore | None = None  # None: --enable-responses-store is off

    async def create(self, request: ResponsesRequest,
                     ids: RequestIds) -> ResponseObject | StreamingResponse:
        earlier = self._earlier(request.previous_response_id)
        run = await self.chat.submit(request.to_chat(earlier), ids)
        shell = _Shell(request, run, ids.response, int(time.time()),
                       self.store is not None and request.store is not False, earlier)
        if request.stream:
            return StreamingResponse(self._stream(shell, run), media_type="text/event-stream")
        final = await run.final()
        items = OutputItems(self.chat.regrouped(run.plan))
        (out,) = final.outputs
        items.update(out.text, out.finish_reason)
        return await self._finished(shell, run, items, final)

    def retrieve(self, response_id: str) -> ResponseObject:
        return self._stored(response_id, "response_id").response

    def delete(self, response_id: str) -> ResponseDeleted:
        self._stored(response_id, "response_id")
        self.store.delete(response_id)
        return ResponseDeleted(id=response_id)

    def _earlier(self, previous_id: str | None) -> list[InputItem]:
        """The conversation a request continues: that of its ``previous_response_id``."""
        if previous_id is None:
            return []
        if self.store is None:
            raise InvalidSamplingParam(
                "previous_response_id", "previous_response_id needs stored responses: start "
                "the server with --enable-responses-store, or send the earlier turns in input")
        return self._stored(previous_id, "previous_response_id").conversation

    def _stored(self, response_id: str, param: str) -> StoredResponse:
        """The stored response, else OpenAI's 404 (also where nothing is stored)."""
        entry = None if self.store is None else self.store.get(response_id)
        if entry is None:
            raise APIError(HTTPStatus.NOT_FOUND, f"Response with id {response_id!r} not found.",
                           param=param, code="not_found")
        return entry

    async def _stream(self, shell: _Shell, run: ChatRun) -> AsyncIterator[bytes]:
        numbers = itertools.count()

        def event(fields: dict[str, Any]) -> bytes:
            fields["sequence_number"] = next(numbers)
            return b"event: %s\ndata: %s\n\n" % (fields["type"].encode(), _json.encode(fields))

        try:
            for kind in ("response.created", "response.in_progress"):
                yield event({"type": kind, "response": shell.response("in_progress").model_dump()})
            items, final = OutputItems(self.chat.regrouped(run.plan)), None
            async for final in run.stream:
                (out,) = final.outputs
                for fields in items.update(out.text, out.finish_reason):
                    yield event(fields)
            response = await self._finished(shell, run, items, final)
            yield event({"type": f"response.{response.status}", "response": response.model_dump()})
        except Exception as exc:  # OpenAI's error event; the stream ends with it
            error = stream_error(exc).error
            yield event({"type": "error", "code": error.code or error.type,
                         "message": error.message, "param": error.param})
        finally:
            run.stream.close()

    async def _finished(self, shell: _Shell, run: ChatRun, items: OutputItems,
                        final: RequestOutput) -> ResponseObject:
        usage = await self.chat.usage(run, final.outputs, final.metrics.num_generated_tokens)
        response = shell.response(items.status, items.items,
                                  ResponsesUsage.of(usage, final.metrics.num_cached_tokens))
        if shell.stored:
            self.store.put(StoredResponse(response, [
                *shell.earlier, *shell.request.items(), *replayed(response.output)]))
        return response


@dataclass(frozen=True)
class _Shell:
    """What a response says besides its output: ids and the request's parameters."""

    request: ResponsesRequest
    run: ChatRun
    id: str
    created_at: int
    stored: bool  # kept once finished
    earlier: list[InputItem]  # the conversation of previous_response_id

    def response(self, status: str, output: list[dict] | None = None,
                 usage: ResponsesUsage | None = None) -> ResponseObject:
        request, params = self.request, self.run.params
        choice = request.tool_choice or "auto"
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, model=self.run.name,
            output=output or [], usage=usage,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            temperature=params.temperature, top_p=params.top_p,
            tools=[t.model_dump(exclude_none=True) for t in request.tools or []],
            tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
            parallel_tool_calls=request.parallel_tool_calls is not False,
            text=request.text.model_dump(exclude_none=True, by_alias=True)
            if request.text and request.text.format else {"format": {"type": "text"}},
            reasoning=None if request.reasoning is None
            else request.reasoning.model_dump(exclude_none=True),
            metadata=request.metadata or {}, user=request.user, store=self.stored,
            previous_response_id=request.previous_response_id)


@dataclass
class OutputItems:
    """A response's output items, written as the answer comes. Each ``update`` takes the text
    so far and returns the stream's events it makes, in OpenAI's order: an item is added (a
    text item then adds its one part), its text or arguments come in deltas, then it is done
    (part, then item) when the next begins or the answer ends. The events carry copies: an
    item still grows after its event is made."""

    regrouped: RegroupedStream
    items: list[dict[str, Any]] = field(default_factory=list)
    status: str = "in_progress"  # completed or incomplete once the answer has ended
    _open: dict[str, Any] | None = None  # the item being written

    def update(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        delta = self.regrouped.delta(text, finish_reason is not None)
        events = []
        if "reasoning" in delta:
            events += self._text("reasoning", delta["reasoning"])
        if "content" in delta:
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            events += self._call(call)
        if finish_reason is not None:  # an output cut by max_tokens is an incomplete response
            self.status = "incomplete" if finish_reason == "length" else "completed"
            events += self._close(self.status)
        return events

    def _text(self, kind: str, piece: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            item = {"type": kind, "role": "assistant", "content": []} if kind == "message" \
                else {"type": kind, "summary": [], "content": []}
            events += self._add(item)
            part = {"type": _PART[kind], "text": ""} | (
                {"annotations": [], "logprobs": []} if kind == "message" else {})
            item["content"].append(part)
            events.append(self._event("response.content_part.added", content_index=0,
                                      part=dict(part)))
        self._open["content"][0]["text"] += piece
        return [*events, self._event(f"{_TEXT_EVENT[kind]}.delta", content_index=0, delta=piece,
                                     **self._logprobs())]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool-call delta as chat streams it: one with an ``id`` begins a call."""
        events = []
        if "id" in call:
            events += self._close("completed")
            events += self._add({"type": "function_call", "call_id": call["id"],
                                 "name": call["function"]["name"], "arguments": ""})
        piece = call["function"]["arguments"]
        if piece:
            self._open["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta", delta=piece))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        item |= {"id": f"{_ID_PREFIX[item['type']]}_{uuid.uuid4().hex}",
                 "status": "in_progress"}
        self._open = item
        self.items.append(item)
        return [self._event("response.output_item.added", item={**item, "content": []}
                            if "content" in item else dict(item))]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, events = self._open, []
        if item is None:
            return events
        item["status"] = status
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done",
                                      name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            events += [self._event(f"{_TEXT_EVENT[item['type']]}.done", content_index=0,
                                   text=part["text"], **self._logprobs()),
                       self._event("response.content_part.done", content_index=0, part=part)]
        events.append(self._event("response.output_item.done", item=item))
        self._open = None
        return events

    def _event(self, kind: str, **fields) -> dict[str, Any]:
        """An event of the open item (``item_id`` and ``output_index`` for all but the item's
        own)."""
        where = {"output_index": len(self.items) - 1}
        if not kind.startswith("response.output_item."):
            where["item_id"] = self._open["id"]
        return {"type": kind, **where, **fields}

    def _logprobs(self) -> dict[str, list]:
        return {"logprobs": []} if self._open["type"] == "message" else {}
