"""The HTTP server: routes, two guards (API key, body size) and start-up.

Request logic lives in ``serving_*.py``; the wire format in ``protocol.py``. FastAPI and uvicorn
are imported only here and below, so ``import pagedserve`` works without them.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve import __version__
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.logger import get_logger
from pagedserve.server.errors import REQUEST_TOO_LARGE, APIError, install_error_handlers
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.server.serving_chat import ChatServing
from pagedserve.server.serving_completion import CompletionServing
from pagedserve.server.serving_models import EngineClient, ServedModel

logger = get_logger(__name__)

# nginx's code for "the client closed the connection"; nobody reads it, but logs show it.
CLIENT_CLOSED = 499


def create_app(engine: AsyncLLMEngine, api_key: str | None = None,
               max_request_bytes: int = 4 << 20) -> FastAPI:
    """An app serving ``engine``; the engine thread runs while the app's lifespan does."""
    model = ServedModel.from_engine(engine.engine)
    metrics = ServerMetrics(lambda: engine.stats)
    client = EngineClient(engine, metrics)
    completions = CompletionServing(model, client)
    chat = ChatServing(model, client)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="pagedserve", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key, prefix="/v1")

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine is not running",
                           type="server_error")
        return Response(status_code=HTTPStatus.OK)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return model.models().model_dump()

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return _to_response(await _unless_disconnected(raw, completions.create(body)))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return _to_response(await _unless_disconnected(raw, chat.create(body)))

    return app


def _to_response(result) -> Response:
    if isinstance(result, Response):
        return result
    return JSONResponse(result.model_dump())


async def _unless_disconnected(raw: Request, work: Awaitable):
    """Run a handler; if the client hangs up first, cancel it, which aborts its engine
    requests and returns their KV blocks. (Streams are cancelled by Starlette itself.)"""
    handler = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not handler.done():
            handler.cancel()
            await asyncio.wait({handler})  # let its clean-up (the aborts) run
    if handler.cancelled():
        return Response(status_code=CLIENT_CLOSED)
    return handler.result()


async def _disconnected(raw: Request) -> None:
    # The body was read already, so the only message left to receive is the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class BearerAuth:
    """Requires ``Authorization: Bearer <key>`` on paths under ``prefix``."""

    def __init__(self, app: ASGIApp, api_key: str, prefix: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix) \
                and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            # Constant-time comparison: response timing must not reveal the key's prefix.
            if not hmac.compare_digest(given, self.expected):
                error = APIError(HTTPStatus.UNAUTHORIZED, "missing or incorrect API key; send "
                                 "'Authorization: Bearer <key>'", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimit:
    """Answers 413 to a body over ``max_bytes``: at once when Content-Length says so, else as
    soon as the bytes read pass the cap (chunked uploads declare no length)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # FastAPI re-raises HTTPExceptions from body reading; our handler formats it.
                raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._message())
            return message

        await self.app(scope, counting_receive, send)

    def _message(self) -> str:
        return f"the request body is larger than the server's limit of {self.max_bytes} bytes"

    def _too_large(self) -> APIError:
        return APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._message(),
                        code=REQUEST_TOO_LARGE)


def run_server(args: argparse.Namespace) -> None:
    import uvicorn

    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.engine_args import config_from_args

    engine = AsyncLLMEngine(LLMEngine(config_from_args(args)))
    app = create_app(engine, args.api_key, args.max_request_bytes)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("listening on %s without --api-key: anyone who can reach this address "
                       "can use the model", args.host)
    logger.info("serving %s at http://%s:%d/v1", engine.engine.model_name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
