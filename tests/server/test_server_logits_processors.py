"""vllm_xargs over HTTP: the request's arguments reach the engine as SamplingParams.extra_args,
and a value a custom logits processor refuses is a 400 naming the field, before anything is
sent to the engine. In process, over a stand-in engine that checks requests as the engine
client does."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from pagedserve.engine.input_processor import InputLimits

LIMITS = InputLimits(vocab_size=100, max_model_len=64, max_num_seqs=4,
                     eos_token_ids=frozenset({0}), num_kv_blocks=16, block_size=16,
                     max_grammar_bytes=1 << 16, max_logprobs=20,
                     logits_processors=("tests.sample.ban_token:BanToken",))
COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class _Tokenizer:
    chat_template = "any"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 100 for c in text]

    def apply_chat_template(self, messages: list[dict], **_) -> str:
        return "".join(m["content"] for m in messages)


def _post(path: str, body: dict) -> tuple[httpx.Response, list]:
    """One request to the app over an engine that checks it (as ``EngineCoreClient`` does),
    keeps it, and then refuses it; with the requests it kept."""
    from pagedserve.server.app import create_app

    kept = []

    def add_requests(requests):
        for r in requests:
            LIMITS.check(r.prompt_token_ids, r.params)
        kept.extend(requests)
        raise ValueError("refused by the test engine")

    engine = SimpleNamespace(
        facts=SimpleNamespace(model_name="model", limits=LIMITS, lora=None,
                              sampling_defaults={}, labels=()),
        tokenizer=_Tokenizer(), is_running=True, engine_stats=lambda: [None],
        add_requests=add_requests)

    async def call():
        transport = httpx.ASGITransport(app=create_app([engine]))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            return await c.post(path, json={"model": "model", **body})
    return asyncio.run(call()), kept


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
def test_vllm_xargs_reach_the_engine_as_extra_args(path, body):
    xargs = {"ban_token": 7, "label": "x", "scale": 0.5}
    _, kept = _post(path, {**body, "vllm_xargs": xargs})
    assert [r.params.extra_args for r in kept] == [xargs]


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("xargs, message", [
    ({"ban_token": -3}, "ban_token must be a token id"),  # the processor refuses it
    ({"ban_token": [1, 2]}, ""),  # strings and numbers only
])
def test_refused_vllm_xargs_are_a_400_naming_the_field(path, body, xargs, message):
    response, kept = _post(path, {**body, "vllm_xargs": xargs})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"].startswith("vllm_xargs") and message in error["message"]
    assert kept == []
