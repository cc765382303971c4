"""Flags of ``pagedserve serve`` that concern HTTP, not the engine."""

from __future__ import annotations

import argparse
import json
from typing import NamedTuple

from pagedserve.arg_types import non_empty, port, positive
from pagedserve.server.reasoning_parsers import REASONING_PARSERS
from pagedserve.server.tls import CERT_REQS
from pagedserve.server.tool_parsers import TOOL_PARSERS

# uvicorn's levels: another failed in uvicorn with a KeyError once the models had loaded.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class LoRAModule(NamedTuple):
    """An adapter ``--lora-modules`` serves from the start; ``base_model_name`` None: the one
    served model with --enable-lora."""

    name: str
    path: str
    base_model_name: str | None = None


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback only; 0.0.0.0 exposes the server)")
    g.add_argument("--port", type=port, default=8000,
                   help="TCP port to listen on (bound before any model loads and held while they "
                        "load; 0 picks a free one, which the log names)")
    g.add_argument("--models-config", default=None, metavar="FILE",
                   help="a YAML or JSON file of the models to serve, one engine core each: "
                        "'models:', a list of entries of engine options by their names with "
                        "underscores (model, served_model_name, device, max_model_len, "
                        "gpu_memory_utilization, kv_cache_memory_bytes, ...) and env, variables "
                        "for that model's core process alone (CUDA_VISIBLE_DEVICES); the "
                        "engine flags given on the command line are every entry's defaults. "
                        "Not with --model, which serves several models too when repeated, all "
                        "with the same flags")
    g.add_argument("--api-key", type=non_empty, default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health and "
                        "/metrics (default: $PAGEDSERVE_API_KEY, which the process list does "
                        "not show)")
    g.add_argument("--allowed-origins", type=_names, action="extend", default=[],
                   metavar="ORIGIN[,ORIGIN...]",
                   help="web origins (scheme://host[:port], or *) whose pages may call the "
                        "API from a browser (CORS; repeat or comma-separate). Default none: "
                        "browsers keep other sites' pages from reading the answers")
    g.add_argument("--allowed-hosts", type=_names, action="extend", default=[],
                   metavar="NAME[,NAME...]",
                   help="Host header names answered besides localhost, 127.0.0.1 and [::1], "
                        "any port (repeat or comma-separate). Without an API key, a server on "
                        "a loopback --host answers only those names, so that a web page cannot "
                        "reach it through a domain resolving to 127.0.0.1 (DNS rebinding); on "
                        "another --host, the check is on when this flag is given")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="serve HTTPS with this certificate (PEM; its chain may follow it, and "
                        "its private key too, without --ssl-keyfile)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help="the --ssl-certfile certificate's private key (PEM, unencrypted)")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="CA certificates (PEM) that client certificates are checked against, "
                        "with --ssl-cert-reqs")
    g.add_argument("--ssl-cert-reqs", type=int, choices=CERT_REQS, default=CERT_REQS[0],
                   help="client certificates over HTTPS: 0 not asked for, 1 checked if sent, "
                        "2 required (Python's ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)")
    g.add_argument("--root-path", type=_root_path, default="", metavar="PREFIX",
                   help="the URL path a reverse proxy serves the API under and strips before "
                        "passing requests on (e.g. /llm): the generated /docs and "
                        "/openapi.json name it; routes stay where they are")
    g.add_argument("--max-request-bytes", type=positive(int), default=4 * 1024 * 1024,
                   help="reject request bodies larger than this with 413")
    g.add_argument("--request-read-timeout", type=positive(float), default=30.0,
                   help="seconds a client has to send a whole request (head and body) from "
                        "its first byte; then 408 and the connection is closed")
    g.add_argument("--response-write-timeout", type=positive(float), default=60.0,
                   help="seconds a response may wait, its buffers full, for a client that "
                        "stopped reading it; then the connection is closed and the request "
                        "aborted")
    g.add_argument("--max-concurrent-connections", type=positive(int), default=1024,
                   help="connections served at once; requests on any further ones get 503")
    g.add_argument("--enable-docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json (the pages load scripts from a "
                        "public CDN)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="answer every request with an X-Request-Id header: the client's own "
                        "(up to 128 printable ASCII characters; else 400), which also names "
                        "the completion (cmpl-ID), or else the id the server made")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log a line per HTTP request (uvicorn's access log; off by default, "
                        "it costs the API server time under load)")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto": the model\'s output is parsed for tool calls '
                        "by --tool-call-parser")
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the tool-call format of the model family, with vLLM's names "
                        "(hermes: <tool_call> JSON blocks, as Hermes, Qwen and SmolLM use; "
                        "llama3_json: Llama 3.1+ JSON calls; pythonic: Llama 3.2 / 4's Python "
                        "list of calls, [f(a=1)]; mistral: [TOOL_CALLS] and a JSON list, or "
                        "name[ARGS]{...} per call (tokenizer v11+); granite: Granite 3.x's "
                        "<|tool_call|> or <tool_call> and a JSON list; phi4_mini_json: "
                        "Phi-4-mini's functools[...] JSON list)")
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="return a chat answer's reasoning apart, as message.reasoning_content "
                        "and .reasoning (streamed: delta.reasoning_content and .reasoning), "
                        "with content the answer alone (deepseek_r1: the output starts in "
                        "the reasoning, which ends at </think>, as with DeepSeek-R1 distills "
                        "and Qwen3 thinking models whose template opens <think>; qwen3: only "
                        "an output that opens with <think> reasons; granite: Granite 3.2/3.3 "
                        "with thinking on, from 'Here is my thought process:' (or 'Here's') "
                        "to 'Here is my response:'; mistral: Magistral's [THINK] ... "
                        "[/THINK] special tokens, which requests then keep). Tool calls are "
                        "parsed from the answer; structured output applies after the "
                        "reasoning")
    g.add_argument("--lora-modules", type=_lora_module, nargs="+", action="extend", default=[],
                   metavar="NAME=PATH",
                   help="LoRA adapters served from the start (needs --enable-lora), each as "
                        "NAME=PATH (a PEFT folder or Hugging Face id) or as JSON, "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a "
                        "request's model NAME runs the adapter. With several models served, "
                        "the adapters belong to the one with LoRA on, else base_model_name "
                        "must name it")
    g.add_argument("--enable-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on "
                        "with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 or true); anyone who can "
                        "reach the server can then make it read any folder it can")
    g.add_argument("--enable-server-dev-mode", action="store_true",
                   help="serve vLLM's development endpoints POST /reset_prefix_cache, /sleep, "
                        "/wake_up and GET /is_sleeping (also on with VLLM_SERVER_DEV_MODE=1 or "
                        "true); /sleep needs --enable-sleep-mode; anyone who can reach the "
                        "server can then put it to sleep")
    g.add_argument("--enable-responses-store", action="store_true",
                   help="keep the /v1/responses answers of requests with store true (OpenAI's "
                        "default) in memory, for previous_response_id, background: true, and "
                        "GET, DELETE, input_items and cancel of /v1/responses/ID (also on with "
                        "VLLM_ENABLE_RESPONSES_API_STORE=1 or "
                        "true); kept until --responses-store-max newer ones push them out or "
                        "the server stops")
    g.add_argument("--responses-store-max", type=positive(int), default=1000,
                   help="responses kept with --enable-responses-store; the oldest created is "
                        "dropped first (a background one still running is stopped)")


def _lora_module(text: str) -> LoRAModule:
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
            module = LoRAModule(entry.pop("name"), entry.pop("path"),
                                entry.pop("base_model_name", None))
        except (ValueError, KeyError, AttributeError, TypeError):
            raise argparse.ArgumentTypeError(
                f"expected JSON with name, path and optionally base_model_name, got {text}"
            ) from None
        if entry or not all(isinstance(v, str) for v in module if v is not None):
            raise argparse.ArgumentTypeError(
                f"expected the strings name, path and base_model_name alone, got {text}")
        return module
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or JSON, got {text!r}")
    return LoRAModule(name, path)


def _root_path(text: str) -> str:
    if text and not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"must be a URL path starting with /, got {text!r}")
    return text.rstrip("/")


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]
