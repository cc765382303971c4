"""The HTTP server: routes and start-up.

Request logic lives in ``serving_*.py``; the wire format in ``protocol.py``; what refuses a
request before a route sees it (Host, API key, body size and type, read deadline, connection
cap) in ``guards.py``. One engine core process serves each model (``--model`` repeated, or
``--models-config``), or ``--data-parallel-size`` of them (``engine/dp_client.py``); a
request's ``model`` picks it, or a LoRA adapter of one (``serving_lora.py``).
FastAPI and uvicorn are imported only here and below, so ``import pagedserve`` works without
them.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from collections.abc import Awaitable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from http import HTTPStatus
from typing import Annotated, Literal

from fastapi import FastAPI, Query, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from pagedserve import __version__, envs
from pagedserve.engine.core_client import CoreClient, EngineStartError
from pagedserve.engine.dp_client import core_client
from pagedserve.errors import ConfigError
from pagedserve.logger import get_logger
from pagedserve.server.args import LoRAModule
from pagedserve.server.errors import APIError, install_error_handlers
from pagedserve.server.guards import (
    LOOPBACK_HOSTS,
    AllowedHosts,
    BearerAuth,
    BodySizeLimit,
    GuardedH11Protocol,
    JSONBodies,
)
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.models_config import ModelSpec, serve_configs
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RerankRequest,
    ResponsesRequest,
    ScoreRequest,
    UnloadLoRAAdapterRequest,
)
from pagedserve.server.reasoning_parsers import REASONING_PARSERS, ThinkParser
from pagedserve.server.request_ids import RequestIdHeaders, RequestIds
from pagedserve.server.responses_store import ResponsesStore
from pagedserve.server.serving_chat import ChatServing
from pagedserve.server.serving_classification import ClassificationServing
from pagedserve.server.serving_completion import CompletionServing
from pagedserve.server.serving_dev import DevServing
from pagedserve.server.serving_embedding import EmbeddingServing
from pagedserve.server.serving_lora import LoRAServing
from pagedserve.server.serving_models import ServedModel, ServingModels
from pagedserve.server.serving_responses import ResponsesServing
from pagedserve.server.serving_score import ScoreServing
from pagedserve.server.serving_tokenization import TokenizationServing
from pagedserve.server.tls import tls_options
from pagedserve.server.tool_parsers import ToolParser, tool_parser

logger = get_logger(__name__)

# nginx's code for "the client closed the connection"; nobody reads it, but logs show it.
CLIENT_CLOSED = 499
# What --api-key leaves open: load balancers and Prometheus probe these without a key.
PUBLIC_PATHS = ("/health", "/metrics")
# The read routes answer HEAD as GET does, without the body; FastAPI's get() alone answers
# HEAD with 405, and probes and link checkers send it.
READ_METHODS = ["GET", "HEAD"]


def create_app(engines: Sequence[CoreClient], api_key: str | None = None,
               max_request_bytes: int = 4 << 20, enable_docs: bool = False,
               tool_parser: ToolParser | None = None,
               allowed_hosts: list[str] | None = None,
               lora_modules: Sequence[LoRAModule] = (),
               runtime_lora_updating: bool = False,
               allowed_origins: Sequence[str] = (),
               request_id_headers: bool = False,
               reasoning_parser: ThinkParser | None = None,
               dev_mode: bool = False, responses_store: int = 0) -> FastAPI:
    """An app serving started engine cores, one per model (the first serves requests that
    name none); the app's lifespan reads their outputs and stops them at the end.
    ``enable_docs`` serves FastAPI's /docs, /redoc and /openapi.json, whose pages load their
    scripts from a public CDN. ``tool_parser`` enables ``tool_choice: "auto"``.
    ``allowed_hosts``, if given, are the only Host names answered. ``lora_modules`` are
    served from the start (``ConfigError`` for one that cannot be); ``runtime_lora_updating``
    adds the routes that load and unload adapters (without it they are 404s, as in vLLM).
    ``allowed_origins`` are the web origins answered with CORS headers (none by default, where
    vLLM allows every origin: a page of any site could read a local server's answers).
    ``request_id_headers`` echoes each request's id in an ``X-Request-Id`` header, and a
    completion takes its id from the client's header (``request_ids.py``).
    ``reasoning_parser`` returns chat answers' reasoning apart. ``dev_mode`` adds vLLM's
    development routes (``serving_dev.py``: sleep mode, the prefix-cache reset).
    ``responses_store`` is how many Responses API answers are kept (``responses_store.py``);
    0 keeps none."""
    # Each engine's latest stats, read at every scrape.
    metrics = ServerMetrics({e.facts.model_name: e.engine_stats for e in engines})
    models = ServingModels([ServedModel.of(e, metrics) for e in engines])
    loras = LoRAServing(models)
    loras.add_modules(lora_modules)
    completions = CompletionServing(models)
    chat = ChatServing(models, tool_parser, reasoning_parser)
    responses = ResponsesServing(
        chat, ResponsesStore(responses_store) if responses_store else None)
    tokenization = TokenizationServing(models)
    embeddings = EmbeddingServing(models)
    classifications = ClassificationServing(models)
    scores = ScoreServing(models)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        for engine in engines:
            engine.run_in(asyncio.get_running_loop())
        yield
        await responses.shutdown()  # first: their aborts go to running engines
        await _shutdown_all(engines)

    app = FastAPI(title="pagedserve", version=__version__, lifespan=lifespan,
                  docs_url="/docs" if enable_docs else None,
                  redoc_url="/redoc" if enable_docs else None,
                  openapi_url="/openapi.json" if enable_docs else None)
    install_error_handlers(app)
    # The last added runs first: the request's id, the Host, a browser's preflight (which
    # carries no key), the key, then the body's size, then its type.
    app.add_middleware(JSONBodies)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key, public=PUBLIC_PATHS)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    if allowed_hosts is not None:
        app.add_middleware(AllowedHosts, hosts=allowed_hosts)
    if request_id_headers:  # outermost: every answer carries the id, refusals included
        app.add_middleware(RequestIdHeaders)

    @app.api_route("/health", methods=READ_METHODS)
    async def health(model: str | None = None) -> Response:
        """200 while every model's engine core runs (``?model=NAME``: that model's); 503
        naming the ones that do not."""
        why = models.unhealthy(model)
        if why is not None:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, why, type="server_error")
        return Response(status_code=HTTPStatus.OK)

    @app.api_route("/version", methods=READ_METHODS)
    async def version() -> dict:
        return {"version": __version__}

    @app.api_route("/metrics", methods=READ_METHODS)
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.api_route("/v1/models", methods=READ_METHODS)
    async def list_models() -> dict:
        return models.models().model_dump()

    @app.api_route("/v1/models/{model_id:path}", methods=READ_METHODS)  # a hub id holds a "/"
    async def retrieve_model(model_id: str) -> dict:
        return models.card(model_id).model_dump()

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        ids = RequestIds.of(raw, "cmpl")
        return _to_response(await _unless_disconnected(raw, completions.create(body, ids)))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        ids = RequestIds.of(raw, "chatcmpl")
        return _to_response(await _unless_disconnected(raw, chat.create(body, ids)))

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
        ids = RequestIds.of(raw, "embd")
        return _to_response(await _unless_disconnected(raw, embeddings.create(body, ids)))

    @app.post("/classify")
    @app.post("/v1/classify")
    async def create_classification(body: ClassificationRequest, raw: Request) -> Response:
        ids = RequestIds.of(raw, "classify")
        return _to_response(await _unless_disconnected(raw, classifications.create(body, ids)))

    @app.post("/v1/score")
    @app.post("/score")
    async def create_score(body: ScoreRequest, raw: Request) -> Response:
        ids = RequestIds.of(raw, "score")
        return _to_response(await _unless_disconnected(raw, scores.score(body, ids)))

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, raw: Request) -> Response:
        ids = RequestIds.of(raw, "rerank")
        return _to_response(await _unless_disconnected(raw, scores.rerank(body, ids)))

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        ids = RequestIds.of(raw, "resp", sep="_")
        return _to_response(await _unless_disconnected(raw, responses.create(body, ids)))

    @app.api_route("/v1/responses/{response_id}", methods=READ_METHODS)
    async def retrieve_response(response_id: str, stream: bool = False,
                                starting_after: Annotated[int | None, Query(ge=0)] = None
                                ) -> Response:
        return _to_response(responses.retrieve(response_id, stream, starting_after))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        return (await responses.delete(response_id)).model_dump()

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict:
        return (await responses.cancel(response_id)).model_dump()

    @app.api_route("/v1/responses/{response_id}/input_items", methods=READ_METHODS)
    async def list_input_items(response_id: str,
                               limit: Annotated[int, Query(ge=1, le=100)] = 20,
                               order: Literal["asc", "desc"] = "desc",
                               after: str | None = None) -> dict:
        return responses.input_items(response_id, limit, order, after).model_dump()

    if runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            return await loras.load(body)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            return await loras.unload(body)

    if dev_mode:
        dev = DevServing(models)

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(model: str | None = None) -> dict:
            return await dev.reset_prefix_cache(model)

        @app.post("/sleep")
        async def sleep(level: int = 1, model: str | None = None) -> dict:
            return await dev.sleep(level, model)

        @app.post("/wake_up")
        async def wake_up(tags: Annotated[list[str] | None, Query()] = None,
                          model: str | None = None) -> dict:
            return await dev.wake_up(tags, model)

        @app.api_route("/is_sleeping", methods=READ_METHODS)
        async def is_sleeping(model: str | None = None) -> dict:
            return dev.is_sleeping(model)

    @app.post("/tokenize")
    async def tokenize(body: dict) -> Response:  # which of two requests: see tokenization
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await tokenization.detokenize(body)

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


def run_server(args: argparse.Namespace) -> None:
    import uvicorn


    if args.enable_auto_tool_choice and not args.tool_call_parser:
        print("pagedserve: error: --enable-auto-tool-choice needs --tool-call-parser",
              file=sys.stderr)
        sys.exit(2)
    parser = tool_parser(args.tool_call_parser) if args.enable_auto_tool_choice else None
    specs = serve_configs(args)
    if args.lora_modules and not any(config.enable_lora for config, _ in specs):
        # Before any model loads, not after.
        print(f"pagedserve: error: --lora-modules {args.lora_modules[0].name}: LoRA is off; "
              "start the server with --enable-lora", file=sys.stderr)
        sys.exit(2)
    listeners = _bind_listen_address(args.host, args.port)
    try:
        tls = tls_options(args)
    except ConfigError as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    # The environment keeps the key out of the process list, where --api-key shows it.
    api_key = args.api_key or envs.api_key()
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    hosts = [*LOOPBACK_HOSTS, *args.allowed_hosts] \
        if not api_key and (loopback or args.allowed_hosts) else None
    engines: list[CoreClient] = []
    try:
        _start_engines(specs, engines)
        app = create_app(engines, api_key, args.max_request_bytes, args.enable_docs, parser,
                         hosts, args.lora_modules,
                         args.enable_runtime_lora_updating or envs.allow_runtime_lora_updating(),
                         args.allowed_origins, args.enable_request_id_headers,
                         REASONING_PARSERS.get(args.reasoning_parser),
                         args.enable_server_dev_mode or envs.server_dev_mode(),
                         args.responses_store_max
                         if args.enable_responses_store or envs.responses_store() else 0)
    except (EngineStartError, ConfigError) as exc:  # one line, as the CLI does
        _stop(engines)
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except BaseException:
        _stop(engines)
        raise
    if not loopback and not api_key:
        logger.warning("listening on %s without an API key: anyone who can reach this address "
                       "can use the model", args.host)
    logger.info("serving %s at %s://%s:%d%s/v1", ", ".join(e.facts.model_name for e in engines),
                "https" if tls else "http", args.host, listeners[0].getsockname()[1],
                args.root_path)
    server = uvicorn.Server(uvicorn.Config(
        app, log_level=args.log_level, access_log=args.enable_log_requests,
        root_path=args.root_path, **tls, timeout_graceful_shutdown=5,
        http=partial(GuardedH11Protocol, read_timeout=args.request_read_timeout,
                     write_timeout=args.response_write_timeout,
                     max_connections=args.max_concurrent_connections)))
    try:
        server.run(sockets=listeners)
    except KeyboardInterrupt:
        pass
    if not server.started:
        sys.exit(1)


def _bind_listen_address(host: str, port: int) -> list[socket.socket]:
    """The sockets the server will listen on, bound before any model loads, or an exit in one
    line if ``host:port`` is taken. Holding them through the load keeps the port ours: a
    port free when the server started could otherwise go to any process that binds during
    the minutes a model takes (the engine's own sockets among them). Bound as asyncio's
    ``create_server`` binds an address; not yet listening, so a client is refused, not
    kept waiting, until the server can answer."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:  # socket.gaierror for a name that does not resolve
        for sock in sockets:
            sock.close()
        print(f"pagedserve: error: cannot listen at --host {host} --port {port}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        sys.exit(2)
    return sockets


def _start_engines(specs: Sequence[ModelSpec], started: list[CoreClient]) -> None:
    """Start each model's engine (a core, or its data-parallel replicas side by side), each
    once the one before is up, appending each to ``started`` as it starts. One after another,
    so that each sizes its KV cache with the memory of the ones before already taken (the GPU
    platforms count other processes' memory against ``gpu_memory_utilization``). Every
    model's replicas are checked to have their devices before any model loads."""
    clients = [core_client(config, env) for config, env in specs]
    for (config, _), engine in zip(specs, clients, strict=True):
        try:
            engine.start()
        except EngineStartError as exc:  # a bad model, device or flag
            name = config.served_model_name or config.model or "the default model"
            raise EngineStartError(f"{name}: {exc}" if len(specs) > 1 else str(exc)) from None
        started.append(engine)


def _stop(engines: Sequence[CoreClient]) -> None:
    """Stop the cores that started when another could not (the server never ran)."""
    asyncio.run(_shutdown_all(engines))


async def _shutdown_all(engines: Sequence[CoreClient]) -> None:
    await asyncio.gather(*(engine.shutdown() for engine in engines))
