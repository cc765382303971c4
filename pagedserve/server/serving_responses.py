"""``POST /v1/responses``, OpenAI's Responses API, run as the chat request it reads as
(``ResponsesRequest.to_chat``): the same chat template, tools, structured output and
reasoning split. The answer goes through chat's stream regrouping (``RegroupedStream``), which
holds back tool-call markup and tags and sends calls as they are written, and comes out as
output items: ``reasoning``, ``message`` and ``function_call``. A whole response is its
stream's items, fed the text at once.

With ``--enable-responses-store``, a finished response of a request with ``store`` true is
kept (``responses_store.py``): ``previous_response_id`` continues its conversation, and it can
be read, deleted and its input items listed by id. Without it, nothing is stored, as in vLLM
by default: ``store`` is answered ``false``, and ``previous_response_id`` and ``background``
are 400s.

A ``background`` request is answered at once, ``queued``, and runs on in a task
(``responses_background.py``) that replaces the stored response as it goes: ``in_progress``,
then ``completed``, ``incomplete`` or ``failed``; ``cancel`` stops it (``cancelled``). The
invariant the cancel and delete paths lean on: a stored response is ``queued`` or
``in_progress`` exactly while its task runs, and a task that was stopped writes nothing more.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal

import msgspec
from fastapi.responses import StreamingResponse

from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import InvalidSamplingParam
from pagedserve.server.errors import SERVER_ERROR, APIError, bad_request, stream_error
from pagedserve.server.protocol import (
    ITEM_ID_PREFIX,
    InputItem,
    ResponseDeleted,
    ResponseError,
    ResponseItemList,
    ResponseObject,
    ResponsesRequest,
    ResponsesUsage,
    listed,
    replayed,
)
from pagedserve.server.request_ids import RequestIds
from pagedserve.server.responses_background import BackgroundRun, EventLog
from pagedserve.server.responses_store import ResponsesStore, StoredResponse
from pagedserve.server.serving_chat import ChatRun, ChatServing, RegroupedStream

_json = msgspec.json.Encoder()
# A text item's part, and its events, by the item's type.
_PART = {"message": "output_text", "reasoning": "reasoning_text"}
_TEXT_EVENT = {"message": "response.output_text", "reasoning": "response.reasoning_text"}
_RUNNING = ("queued", "in_progress")  # a background response's statuses while its task runs
_SSE = "text/event-stream"


@dataclass
class ResponsesServing:
    chat: ChatServing
    store: ResponsesStore | None = None  # None: --enable-responses-store is off
    # The background responses whose task has not ended, by id; each task removes its own.
    _running: dict[str, BackgroundRun] = field(default_factory=dict)

    async def create(self, request: ResponsesRequest,
                     ids: RequestIds) -> ResponseObject | StreamingResponse:
        self._check_background(request)
        earlier = self._earlier(request.previous_response_id)
        run = await self.chat.submit(request.to_chat(earlier), ids)
        stored = self.store is not None and request.store is not False
        shell = _Shell(request, run, ids.response, int(time.time()), stored, earlier,
                       listed(request.items()) if stored else [],
                       EventLog() if request.background and request.stream else None)
        if request.background:
            return self._start(shell, run)
        if request.stream:
            return StreamingResponse(self._stream(shell, run), media_type=_SSE)
        return await self._whole(shell, run)

    def retrieve(self, response_id: str, stream: bool = False,
                 starting_after: int | None = None) -> ResponseObject | StreamingResponse:
        """The response as it stands, or (``stream``) a background stream's events past
        ``starting_after``, as they come."""
        entry = self._stored(response_id, "response_id")
        if not stream:
            return entry.response
        if entry.events is None:
            raise bad_request("stream=true replays the events of a response created with "
                              "background and stream true; this one was not", param="stream")
        return StreamingResponse(
            entry.events.after(-1 if starting_after is None else starting_after), media_type=_SSE)

    def input_items(self, response_id: str, limit: int, order: Literal["asc", "desc"],
                    after: str | None) -> ResponseItemList:
        """A page of the response's own input items (not those of earlier turns), OpenAI's
        list: ``limit`` of them in ``order``, from past the item ``after``."""
        items = self._stored(response_id, "response_id").input_items
        items = items if order == "asc" else items[::-1]
        if after is not None:
            item_ids = [item["id"] for item in items]
            if after not in item_ids:
                raise bad_request(f"after: {after!r} is not an input item of response "
                                  f"{response_id!r}", param="after")
            items = items[item_ids.index(after) + 1:]
        page = items[:limit]
        return ResponseItemList(data=page, first_id=page[0]["id"] if page else None,
                                last_id=page[-1]["id"] if page else None,
                                has_more=len(items) > limit)

    async def cancel(self, response_id: str) -> ResponseObject:
        """Stop a background response that runs (its engine request aborted): ``cancelled``.
        Cancelling it again returns it, as OpenAI's does; any other is a 400."""
        entry = self._stored(response_id, "response_id")
        response = entry.response
        if not response.background:
            raise bad_request("Cannot cancel a synchronous response: only a response created "
                              "with background true can be cancelled", param="response_id")
        if response.status == "cancelled":
            return response
        if response.status not in _RUNNING:
            raise bad_request(f"Cannot cancel a response that is already {response.status}",
                              param="response_id")
        cancelled = response.model_copy(update={"status": "cancelled"})
        self._keep(entry._replace(response=cancelled))
        await self._stop(response_id)
        return cancelled

    async def delete(self, response_id: str) -> ResponseDeleted:
        """Delete a stored response; a background one that runs is stopped first."""
        self._stored(response_id, "response_id")
        self.store.delete(response_id)
        await self._stop(response_id)
        return ResponseDeleted(id=response_id)

    async def shutdown(self) -> None:
        """Stop the background responses that run, before the engines stop: their requests
        are aborted, and their streams' readers end."""
        await asyncio.gather(*(run.stopped() for run in list(self._running.values())))

    def _check_background(self, request: ResponsesRequest) -> None:
        """A background response is read back by its id, so it needs the store (vLLM's and
        OpenAI's rule)."""
        if not request.background:
            return
        if self.store is None:
            raise InvalidSamplingParam(
                "background", "background responses are kept in the responses store: start "
                "the server with --enable-responses-store (or VLLM_ENABLE_RESPONSES_API_STORE=1)")
        if request.store is False:
            raise InvalidSamplingParam(
                "background", "background can only be used when store is true: a background "
                "response is read back by its id")

    def _earlier(self, previous_id: str | None) -> list[InputItem]:
        """The conversation a request continues: that of its ``previous_response_id``."""
        if previous_id is None:
            return []
        if self.store is None:
            raise InvalidSamplingParam(
                "previous_response_id", "previous_response_id needs stored responses: start "
                "the server with --enable-responses-store, or send the earlier turns in input")
        entry = self._stored(previous_id, "previous_response_id")
        if entry.response.status in _RUNNING:
            raise InvalidSamplingParam(
                "previous_response_id", f"response {previous_id!r} is still "
                f"{entry.response.status}: continue it once it has finished")
        return entry.conversation

    def _stored(self, response_id: str, param: str) -> StoredResponse:
        """The stored response, else OpenAI's 404 (also where nothing is stored)."""
        entry = None if self.store is None else self.store.get(response_id)
        if entry is None:
            raise APIError(HTTPStatus.NOT_FOUND, f"Response with id {response_id!r} not found.",
                           param=param, code="not_found")
        return entry

    def _keep(self, entry: StoredResponse) -> None:
        """Store ``entry``; a background response the store drops for it is stopped, as no
        one can read or cancel it any more."""
        for dropped in self.store.put(entry):
            run = self._running.get(dropped.response.id)
            if run is not None:
                run.stop()

    async def _stop(self, response_id: str) -> None:
        run = self._running.get(response_id)
        if run is not None:
            await run.stopped()

    def _start(self, shell: _Shell, run: ChatRun) -> ResponseObject | StreamingResponse:
        """Answer a background request: store it queued and start its task (with no await
        between, so the client's leaving cannot part the run from its task)."""
        queued = shell.response("queued")
        self._keep(shell.entry(queued))
        older = self._running.get(shell.id)
        if older is not None:  # a client's X-Request-Id again: the newer response has the id
            older.stop()
        task = asyncio.create_task(self._background(shell, run))
        started = self._running[shell.id] = BackgroundRun(task, run.stream, shell.events)
        task.add_done_callback(lambda _: self._forget(shell.id, started))
        if shell.events is None:
            return queued
        return StreamingResponse(shell.events.after(-1), media_type=_SSE)

    def _forget(self, response_id: str, run: BackgroundRun) -> None:
        if self._running.get(response_id) is run:
            del self._running[response_id]

    async def _background(self, shell: _Shell, run: ChatRun) -> None:
        self._keep(shell.entry(shell.response("in_progress")))
        try:
            if shell.events is None:
                await self._whole(shell, run)
            else:  # the stream records its own failure
                async for event in self._stream(shell, run):
                    shell.events.append(event)
        except Exception as exc:
            self._fail(shell, exc)
        finally:
            if shell.events is not None:
                shell.events.close()

    def _fail(self, shell: _Shell, exc: Exception) -> None:
        """A background response that failed: stored ``failed``, with the error."""
        error = stream_error(exc).error
        code = "server_error" if error.type == SERVER_ERROR else "invalid_prompt"
        self._keep(shell.entry(shell.response(
            "failed", error=ResponseError(code=code, message=error.message))))

    async def _whole(self, shell: _Shell, run: ChatRun) -> ResponseObject:
        final = await run.final()
        items = OutputItems(self.chat.regrouped(run.plan))
        (out,) = final.outputs
        items.update(out.text, out.finish_reason)
        return await self._finished(shell, run, items, final)

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
            if shell.request.background:
                self._fail(shell, exc)
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
            self._keep(shell.entry(response))
        return response


@dataclass(frozen=True)
class _Shell:
    """What a response says besides its output: ids and the request's parameters; and what
    is stored with it."""

    request: ResponsesRequest
    run: ChatRun
    id: str
    created_at: int
    stored: bool  # kept in the store (once finished, or from the start in the background)
    earlier: list[InputItem]  # the conversation of previous_response_id
    input_items: list[dict[str, Any]]  # the request's input as listed, once stored
    events: EventLog | None  # a background stream's events

    def entry(self, response: ResponseObject) -> StoredResponse:
        return StoredResponse(
            response, [*self.earlier, *self.request.items(), *replayed(response.output)],
            self.input_items, self.events)

    def response(self, status: str, output: list[dict] | None = None,
                 usage: ResponsesUsage | None = None,
                 error: ResponseError | None = None) -> ResponseObject:
        request, params = self.request, self.run.params
        choice = request.tool_choice or "auto"
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, error=error,
            model=self.run.name, output=output or [], usage=usage,
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
            previous_response_id=request.previous_response_id,
            background=bool(request.background))


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
        # The text as written, then (a second delta) its end, which sends the text after the
        # calls: so that is a message after the calls even when they come in the last output.
        events = self._events(self.regrouped.delta(text, False))
        if finish_reason is not None:  # an output cut by max_tokens is an incomplete response
            events += self._events(self.regrouped.delta(text, True))
            self.status = "incomplete" if finish_reason == "length" else "completed"
            events += self._close(self.status)
        return events

    def _events(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if "reasoning" in delta:
            events += self._text("reasoning", delta["reasoning"])
        # A delta's text comes before its calls; but while a call is open, it is the text
        # after the calls, and the rest of them come first.
        after = self._open is not None and self._open["type"] == "function_call"
        if "content" in delta and not after:
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            events += self._call(call)
        if "content" in delta and after:
            events += self._text("message", delta["content"])
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
        item |= {"id": f"{ITEM_ID_PREFIX[item['type']]}_{uuid.uuid4().hex}",
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
