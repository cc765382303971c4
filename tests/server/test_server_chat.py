"""/v1/chat/completions through the official OpenAI SDK, checked against ``LLM.chat``."""

from __future__ import annotations

import openai
import pytest

from pagedserve import SamplingParams
from tests.server.conftest import MAX_MODEL_LEN

MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "the quick"},
            {"role": "user", "content": "brown fox"}]


def _offline_chat(offline, messages=MESSAGES, **params):
    params.setdefault("temperature", 0.0)
    return offline.chat(messages, SamplingParams(**params), use_tqdm=False)[0]


def test_greedy_matches_llm_chat_with_exact_usage(server, offline):
    expected = _offline_chat(offline, max_tokens=12)
    got = server.client().chat.completions.create(model="model", messages=MESSAGES,
                                                  max_tokens=12, temperature=0)
    choice = got.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert got.object == "chat.completion"


def test_stream_starts_with_role_and_joins_to_full_text(server):
    client = server.client()
    kwargs = dict(model="model", messages=MESSAGES, max_tokens=20, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason
    assert chunks[-1].usage == full.usage and chunks[-1].object == "chat.completion.chunk"


def test_n_seeded_with_logprobs_matches_offline(server, offline):
    expected = _offline_chat(offline, n=2, temperature=1.0, seed=42, max_tokens=6, logprobs=3)
    got = server.client().chat.completions.create(
        model="model", messages=MESSAGES, n=2, temperature=1.0, seed=42, max_tokens=6,
        logprobs=True, top_logprobs=3)
    assert [c.index for c in got.choices] == [0, 1]
    for choice, out in zip(got.choices, expected.outputs, strict=True):
        assert choice.message.content == out.text
        content = choice.logprobs.content
        assert len(content) == len(out.token_ids)
        for item, token_id, entry in zip(content, out.token_ids, out.logprobs, strict=True):
            assert item.logprob == pytest.approx(entry[token_id].logprob, abs=1e-4)
            assert len(item.top_logprobs) == 3
            assert [t.logprob for t in item.top_logprobs] == sorted(
                (t.logprob for t in item.top_logprobs), reverse=True)


def test_streamed_n_choices_join_to_the_full_texts(server):
    client = server.client()
    kwargs = dict(model="model", messages=MESSAGES, n=3, max_tokens=8, temperature=0.9,
                  seed=5)
    full = client.chat.completions.create(**kwargs)
    streamed = {i: "" for i in range(3)}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert [streamed[i] for i in range(3)] == [c.message.content for c in full.choices]


def test_text_content_parts_equal_plain_text(server):
    client = server.client()
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                          {"type": "text", "text": "world"}]}]
    plain = [{"role": "user", "content": "hello\nworld"}]
    a = client.chat.completions.create(model="model", messages=parts, max_tokens=6,
                                       temperature=0)
    b = client.chat.completions.create(model="model", messages=plain, max_tokens=6,
                                       temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage == b.usage


def test_max_completion_tokens_and_stop(server, offline):
    got = server.client().chat.completions.create(model="model", messages=MESSAGES,
                                                  max_completion_tokens=3, temperature=0,
                                                  extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 3 and got.choices[0].finish_reason == "length"
    free_text = _offline_chat(offline, max_tokens=30).outputs[0].text
    stop = next(ch for ch in free_text[1:] if ch.isascii() and ch.isprintable())
    expected = _offline_chat(offline, max_tokens=30, stop=[stop]).outputs[0]
    got = server.client().chat.completions.create(model="model", messages=MESSAGES,
                                                  max_tokens=30, temperature=0, stop=stop)
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].message.content == expected.text


def test_developer_role_is_read_as_system(server):
    """Newer OpenAI clients send OpenAI's ``developer`` role where older ones sent
    ``system``; chat templates know only ``system``."""
    developer = [{**MESSAGES[0], "role": "developer"}, *MESSAGES[1:]]
    tokens = [server.post("/tokenize", json={"messages": m}).json()["tokens"]
              for m in (developer, MESSAGES)]
    assert tokens[0] == tokens[1]
    client = server.client()
    a, b = (client.chat.completions.create(model="model", messages=m, max_tokens=6,
                                           temperature=0) for m in (developer, MESSAGES))
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage == b.usage


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_a_conversation_too_long(server):
    messages = [{"role": "user", "content": "fox " * MAX_MODEL_LEN}]
    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="model", messages=messages, max_tokens=2)
    assert refused.value.body["code"] == "context_length_exceeded"
    got = client.chat.completions.create(model="model", messages=messages, max_tokens=2,
                                         extra_body={"truncate_prompt_tokens": 50})
    assert got.usage.prompt_tokens == 50
