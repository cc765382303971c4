"""A stand-in engine that generates scripted text, a token per scripted piece, served by the
app in this process and read through the openai SDK: the exact outputs of reasoning and
tool-calling models (tags split across deltas anywhere, no end tag, calls after the
reasoning) without a model that writes them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import openai

from pagedserve.engine.input_processor import InputLimits
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.server.reasoning_parsers import REASONING_PARSERS

LIMITS = InputLimits(vocab_size=100, max_model_len=4096, max_num_seqs=4,
                     eos_token_ids=frozenset({0}), num_kv_blocks=16, block_size=16,
                     max_grammar_bytes=1 << 16, max_logprobs=20)
# The scripted pieces' token ids: piece i is token FIRST_PIECE + i.
FIRST_PIECE = 10


class ScriptedTokenizer:
    """A token a character, but for ``tags``, each one token; decodes the scripted pieces'
    tokens."""

    chat_template = "any"
    tags = {"<think>": [7], "</think>": [8]}

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def apply_chat_template(self, messages: list[dict], **_) -> str:
        return "".join(m["content"] for m in messages)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tags.get(text, [1] * len(text))

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self.pieces[t - FIRST_PIECE] for t in token_ids)


class ScriptedStream:
    """A request's cumulative outputs: the scripted pieces one after another, a token each;
    the last ends it with ``finish_reason``."""

    def __init__(self, request, pieces: list[str], finish_reason: str) -> None:
        self.request, self.pieces, self.finished = request, pieces, False
        self.finish_reason = finish_reason

    async def __aiter__(self):
        for i in range(len(self.pieces)):
            self.finished = i == len(self.pieces) - 1
            out = CompletionOutput(0, "".join(self.pieces[:i + 1]),
                                   list(range(FIRST_PIECE, FIRST_PIECE + i + 1)), None, None,
                                   self.finish_reason if self.finished else None)
            yield RequestOutput(self.request.request_id, None, self.request.prompt_token_ids,
                                None, [out], self.finished,
                                RequestMetrics(0.0, num_generated_tokens=i + 1))

    def close(self) -> None:
        self.finished = True


class ScriptedEngine:
    """Writes ``pieces`` for every request, ending with ``finish_reason``."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.finish_reason = "stop"
        self.facts = SimpleNamespace(model_name="r1", limits=LIMITS, lora=None,
                                     sampling_defaults={}, labels=())
        self.tokenizer, self.is_running = ScriptedTokenizer(self.pieces), True

    def engine_stats(self) -> list:
        return [None]  # no engine reports to /metrics

    def script(self, pieces: list[str], finish_reason: str = "stop") -> None:
        self.pieces[:] = pieces
        self.finish_reason = finish_reason

    def add_requests(self, requests):
        self.requests = requests
        return [ScriptedStream(r, self.pieces, self.finish_reason) for r in requests]


def scripted_app(engine: ScriptedEngine, reasoning: str | None = "deepseek_r1", **options):
    from pagedserve.server.app import create_app

    parser = REASONING_PARSERS[reasoning] if reasoning else None
    return create_app([engine], reasoning_parser=parser, **options)


def run_with_client(app, work):
    """``work(client)`` with an openai client of the in-process ``app``."""
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            return await work(openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="-",
                                                 http_client=http, max_retries=0))
    return asyncio.run(run())
