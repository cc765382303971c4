"""The server with n-gram speculative decoding on the default model, the openai SDK as the
client: a copy-heavy chat's greedy text equals the offline engine's without speculation,
streamed or not, and /metrics counts the drafts under vLLM's names."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from tests.server.conftest import HTTP_TIMEOUT_S, engine_kwargs, launch_server

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
KV_BYTES = 64 << 20  # the default model's KV takes more room than the tiny models'
MAX_MODEL_LEN = 1024  # what that cache holds: about 1,400 tokens
# Float activations: with int8 ones (the CPU's default on this GGUF) the default model answers
# this prompt with other code, so n-gram drafts from it are never accepted and the counters
# this test reads stay at zero.
PROMPT = ("Copy this code without changes:\ndef add(a, b):\n    return a + b\n\n"
          "def mul(a, b):\n    return a * b\n")


def _spec_server(folder, log_dir, spec: dict):
    return launch_server(folder, log_dir, "--speculative-config", json.dumps(spec),
                         "--kv-cache-memory-bytes", str(KV_BYTES), "--no-int8-activations",
                         "--max-model-len", str(MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def spec_server(default_model_folder, tmp_path_factory):
    with _spec_server(default_model_folder, tmp_path_factory.mktemp("spec"), SPEC) as server:
        yield server


def _plain_text(folder, messages, max_tokens: int) -> str:
    """The offline engine's greedy answer without speculation."""
    plain = LLM(model=str(folder), **{**engine_kwargs(), "kv_cache_memory_bytes": KV_BYTES,
                                     "max_model_len": MAX_MODEL_LEN, "int8_activations": False})
    text = plain.chat([messages], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                      use_tqdm=False)[0].outputs[0].text
    plain.shutdown()
    return text


def _served_texts(server, messages, max_tokens: int) -> tuple[str, str]:
    """The server's greedy answer, whole and streamed."""
    client = server.client()
    request = dict(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=max_tokens,
                   temperature=0)
    reply = client.chat.completions.create(**request).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in client.chat.completions.create(**request, stream=True)
                       if chunk.choices)
    return reply, streamed


def test_speculative_chat_equals_the_plain_engine_and_counts_its_drafts(default_model_folder,
                                                                        spec_server):
    messages = [{"role": "user", "content": PROMPT}]
    expected = _plain_text(default_model_folder, messages, 40)
    assert _served_texts(spec_server, messages, 40) == (expected, expected)
    metrics = spec_server.metrics()
    drafts = metrics["spec_decode_num_draft_tokens_total"]
    accepted = metrics["spec_decode_num_accepted_tokens_total"]
    assert metrics["spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafts
    text = httpx.get(f"{spec_server.url}/metrics", timeout=HTTP_TIMEOUT_S).text
    first = re.search(r'^pagedserve:spec_decode_num_accepted_tokens_per_pos_total\{'
                      r'engine="0",model_name="SmolLM2-135M-Instruct",position="0"\} (\S+)$',
                      text, re.M)
    assert first is not None and 0 < float(first.group(1)) <= accepted


@pytest.fixture(scope="module")
def eagle3_server(default_model_folder, tmp_path_factory):
    """The server with a random EAGLE-3 head for the default model (public layout, 2,000 draft
    tokens): its drafts are almost never right, so this checks the path, not the gain."""
    from tests.eagle3_heads import write_eagle3_head

    head = write_eagle3_head(tmp_path_factory.mktemp("eagle3-head"), default_model_folder,
                             draft_vocab_size=2000)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    with _spec_server(default_model_folder, tmp_path_factory.mktemp("eagle3"), spec) as server:
        yield server


def test_an_eagle3_head_keeps_the_text_and_serves_constrained_requests(default_model_folder,
                                                                       eagle3_server):
    """Greedy chat text equals the plain engine's, streamed or not; a JSON-schema request
    (no drafts: they are drawn on the device, where no grammar is) still parses; the head's
    drafts are counted."""
    messages = [{"role": "user", "content": PROMPT}]
    expected = _plain_text(default_model_folder, messages, 24)
    assert _served_texts(eagle3_server, messages, 24) == (expected, expected)
    client = eagle3_server.client()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"], "additionalProperties": False}
    constrained = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "Give a name as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "n", "schema": schema}})
    assert set(json.loads(constrained.choices[0].message.content)) == {"name"}
    assert eagle3_server.metrics()["spec_decode_num_draft_tokens_total"] > 0
