"""/v1/completions through the official OpenAI SDK, checked against the offline engine."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedserve import SamplingParams
from tests.server.conftest import HTTP_TIMEOUT_S, MAX_MODEL_LEN

PROMPT = "the quick brown fox"


def _offline(offline, prompt, **params):
    params.setdefault("temperature", 0.0)
    return offline.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


@pytest.mark.parametrize("prompt", [PROMPT, [5, 17, 42, 99, 7]])
def test_greedy_matches_offline_with_exact_usage(server, offline, prompt):
    expected = _offline(offline, prompt, max_tokens=12).outputs[0]
    got = server.client().completions.create(model="model", prompt=prompt, max_tokens=12,
                                             temperature=0)
    choice = got.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    prompt_ids = offline.get_tokenizer().encode(prompt) if isinstance(prompt, str) else prompt
    assert got.usage.prompt_tokens == len(prompt_ids)
    assert got.usage.completion_tokens == len(expected.token_ids)
    assert got.usage.total_tokens == len(prompt_ids) + len(expected.token_ids)
    assert got.model == "model" and got.object == "text_completion"


def test_stream_chunks_join_to_the_full_text(server):
    client = server.client()
    kwargs = dict(model="model", prompt=PROMPT, max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_n3_seeded_sampling_matches_offline(server, offline):
    params = dict(n=3, temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    expected = _offline(offline, PROMPT, **params).outputs
    got = server.client().completions.create(model="model", prompt=PROMPT, **params)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [o.text for o in expected]
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in expected)


def test_n_streamed_with_several_prompts(server):
    client = server.client()
    kwargs = dict(model="model", prompt=["hello world", PROMPT], n=2, max_tokens=8,
                  temperature=0.7, seed=3)
    full = client.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    streamed = {i: "" for i in range(4)}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(4)] == [c.text for c in full.choices]


def test_logprobs_match_offline(server, offline):
    expected = _offline(offline, PROMPT, max_tokens=6, logprobs=2).outputs[0]
    got = server.client().completions.create(model="model", prompt=PROMPT, max_tokens=6,
                                             temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token_id, entry, value, top in zip(expected.token_ids, expected.logprobs,
                                           lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert 1 <= len(top) <= 3  # the sampled token plus the top 2
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_with_logprobs_covers_the_prompt(server, offline):
    prompt_ids = offline.get_tokenizer().encode(PROMPT)
    got = server.client().completions.create(model="model", prompt=PROMPT, max_tokens=4,
                                             temperature=0, echo=True, logprobs=1)
    choice = got.choices[0]
    expected = _offline(offline, PROMPT, max_tokens=4, prompt_logprobs=1)
    assert choice.text == PROMPT + expected.outputs[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, token in enumerate(prompt_ids[1:], start=1):
        want = expected.prompt_logprobs[i][token].logprob
        assert lp.token_logprobs[i] == pytest.approx(want, abs=1e-4)
    assert all(v is not None for v in lp.token_logprobs[len(prompt_ids):])


def test_stream_echo_and_logprobs(server):
    client = server.client()
    kwargs = dict(model="model", prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                  logprobs=1)
    full = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.logprobs.tokens] == full.logprobs.tokens
    assert [o for c in chunks for o in c.logprobs.text_offset] == full.logprobs.text_offset


def test_stop_string_matches_offline(server, offline):
    free_text = _offline(offline, PROMPT, max_tokens=30).outputs[0].text
    # The first plain ASCII character after the start makes a stop string that must fire.
    stop = next(ch for ch in free_text[1:] if ch.isascii() and ch.isprintable())
    expected = _offline(offline, PROMPT, max_tokens=30, stop=[stop]).outputs[0]
    got = server.client().completions.create(model="model", prompt=PROMPT, max_tokens=30,
                                             temperature=0, stop=[stop]).choices[0]
    assert got.finish_reason == "stop" == expected.finish_reason
    assert got.text == expected.text and stop not in got.text


def test_vllm_extras_match_offline(server, offline):
    extras = dict(top_k=5, min_p=0.05, repetition_penalty=1.3, ignore_eos=True, min_tokens=4,
                  stop_token_ids=[300])
    expected = _offline(offline, PROMPT, max_tokens=10, seed=9, temperature=0.8,
                        presence_penalty=0.5, frequency_penalty=0.2,
                        logit_bias={7: 5.0}, **extras).outputs[0]
    got = server.client().completions.create(
        model="model", prompt=PROMPT, max_tokens=10, seed=9, temperature=0.8,
        presence_penalty=0.5, frequency_penalty=0.2, logit_bias={"7": 5.0}, user="tester",
        extra_body=extras).choices[0]
    assert got.text == expected.text


def test_allowed_token_ids_and_bad_words_match_offline(server, offline):
    """Each changes the greedy text (checked offline), and the server's equals offline's."""
    free = _offline(offline, PROMPT, max_tokens=12, ignore_eos=True).outputs[0]
    ids = free.token_ids
    for extras in (dict(allowed_token_ids=sorted(set(range(3, 40)) - set(ids))),
                   dict(bad_words=[offline.get_tokenizer().decode(ids[2:4]).strip()])):
        expected = _offline(offline, PROMPT, max_tokens=12, ignore_eos=True, **extras).outputs[0]
        assert expected.text != free.text
        got = server.client().completions.create(
            model="model", prompt=PROMPT, max_tokens=12, temperature=0,
            extra_body=dict(ignore_eos=True, **extras)).choices[0]
        assert got.text == expected.text


def test_models_health_version(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["model"]
    import httpx

    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_retrieve_a_model_as_listed_and_an_unknown_one_is_a_404(server):
    import openai

    client = server.client()
    listed = client.models.list().data[0]
    assert client.models.retrieve("model") == listed
    assert listed.model_dump()["max_model_len"] == MAX_MODEL_LEN
    for name in ("nope", "org/nope"):  # a hub id's "/" stays in the name
        with pytest.raises(openai.NotFoundError) as exc:
            client.models.retrieve(name)
        assert exc.value.body["code"] == "model_not_found"
        assert exc.value.body["param"] == "model"
        assert exc.value.body["type"] == "invalid_request_error"
        assert f"the model {name!r} does not exist" in exc.value.body["message"]


def test_seed_uses_all_its_bits_and_each_choice_its_own_stream(server):
    client = server.client()

    def texts(seed: int, n: int = 1) -> list[str]:
        got = client.completions.create(model="model", prompt=PROMPT, max_tokens=12,
                                        temperature=1.0, seed=seed, n=n)
        return [c.text for c in got.choices]

    assert texts(5) == texts(5)
    assert texts(5) != texts(2**32 + 5)
    pair = texts(77, n=2)
    assert pair[0] == texts(77)[0]
    assert pair[1] != texts(78)[0]


def test_echo_with_max_tokens_0_scores_the_prompt(server, offline):
    """What evaluation harnesses send for log-likelihoods: the prompt back with its logprobs,
    nothing generated."""
    prompts = [PROMPT, "hello world"]
    tokenizer = offline.get_tokenizer()
    expected = offline.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=2,
                                                        temperature=0), use_tqdm=False)
    got = server.client().completions.create(model="model", prompt=prompts, max_tokens=0,
                                             echo=True, logprobs=2, temperature=0)
    assert [c.index for c in got.choices] == [0, 1]
    for choice, prompt, want in zip(got.choices, prompts, expected, strict=True):
        ids = tokenizer.encode(prompt)
        assert choice.text == prompt and choice.finish_reason == "length"
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i, token in enumerate(ids[1:], start=1):
            assert lp.token_logprobs[i] == pytest.approx(want.prompt_logprobs[i][token].logprob,
                                                         abs=1e-4)
            assert 1 <= len(lp.top_logprobs[i]) <= 3
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
    assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == prompt_tokens


def test_echo_with_max_tokens_0_streamed_and_as_token_ids(server):
    client = server.client()
    ids = [5, 17, 42, 99, 7]
    full = client.completions.create(model="model", prompt=ids, max_tokens=0, echo=True,
                                     logprobs=0)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and len(choice.logprobs.tokens) == len(ids)
    assert all(v is not None and v <= 0 for v in choice.logprobs.token_logprobs[1:])
    chunks = [c for c in client.completions.create(model="model", prompt=ids, max_tokens=0,
                                                   echo=True, logprobs=0, stream=True)]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.choices[0].logprobs.token_logprobs] == \
        choice.logprobs.token_logprobs
    assert chunks[-1].choices[0].finish_reason == "length"
    # Without logprobs it is just the prompt back.
    plain = client.completions.create(model="model", prompt=PROMPT, max_tokens=0, echo=True)
    assert plain.choices[0].text == PROMPT and plain.usage.completion_tokens == 0


def test_usage_counts_every_generated_token_with_best_of(server):
    """OpenAI bills best_of's discarded choices too: usage counts every token generated."""
    client = server.client()
    kwargs = dict(model="model", max_tokens=5, temperature=1.0, seed=1, n=2,
                  extra_body={"ignore_eos": True})
    got = client.completions.create(**kwargs, prompt=PROMPT, best_of=4)
    assert len(got.choices) == 2
    assert got.usage.completion_tokens == 4 * 5
    got = client.completions.create(**kwargs, prompt=[PROMPT, "hello"], best_of=3)
    assert len(got.choices) == 4 and got.usage.completion_tokens == 2 * 3 * 5


def test_streamed_choices_that_end_first_send_their_held_back_text(server):
    """With a stop string, a choice holds back its last characters until they cannot begin
    one. n > 1: a choice that ends (here at a stop token) while the others run on sends them
    with its finish, as the whole response has them; they were never streamed."""
    client = server.client()
    stop_tokens = list(range(3, 384, 9))
    kwargs = dict(model="model", prompt=PROMPT, n=4, max_tokens=40, temperature=1.0, seed=3,
                  stop=["NOT-IN-ANY-TEXT"], extra_body={"stop_token_ids": stop_tokens})
    full = client.completions.create(**kwargs).choices
    lengths = {len(c.text) for c in full}
    assert len(lengths) > 1 and min(lengths) > 0  # they end at different steps
    streamed = {c.index: "" for c in full}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[c.index] for c in full] == [c.text for c in full]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_asked_for(server, offline, include):
    """As in vLLM: the token that stops the stream (stop_token_ids, or EOS) is among the
    output's tokens, but its text is not in the output's text unless
    include_stop_str_in_output; the text held back for a stop string comes out whole."""
    free = _offline(offline, PROMPT, max_tokens=30).outputs[0].token_ids
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    before = _offline(offline, PROMPT, max_tokens=k).outputs[0].text
    through = _offline(offline, PROMPT, max_tokens=k + 1).outputs[0].text
    assert through != before  # the stop token has text of its own
    extra = {"stop_token_ids": [free[k]], "include_stop_str_in_output": include}
    client = server.client()
    kwargs = dict(model="model", prompt=PROMPT, max_tokens=30, temperature=0, logprobs=0,
                  stop=["NOT-IN-ANY-TEXT"], extra_body=extra)
    got = client.completions.create(**kwargs).choices[0]
    assert (got.finish_reason, got.stop_reason) == ("stop", free[k])
    assert got.text == (through if include else before)
    assert len(got.logprobs.tokens) == k + 1  # the stop token is an output token all the same
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs,
                                                                             stream=True))
    assert streamed == got.text


STREAMS = [("/v1/completions", {"prompt": ["hello", PROMPT], "n": 2}),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2})]


def _stream_chunks(server, path: str, body: dict) -> list[dict]:
    """The JSON of a stream's chunks, [DONE] checked and left out."""
    body = {**body, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + path, json=body, timeout=HTTP_TIMEOUT_S) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events.pop() == "[DONE]"
    return [json.loads(event) for event in events]


@pytest.mark.parametrize(("path", "body"), STREAMS)
def test_stream_with_usage_has_a_null_usage_in_every_chunk_but_the_last(server, path, body):
    """OpenAI: with include_usage, "all other chunks will also include a usage field, but
    with a null value"; they had none."""
    chunks = _stream_chunks(server, path, {**body, "stream_options": {"include_usage": True}})
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize(("path", "body"), STREAMS)
def test_streamed_choices_carry_null_finish_reason_and_logprobs_until_set(server, path, body):
    """As OpenAI's and vLLM's chunks do: a client that reads ``finish_reason !== null`` as
    "this choice is done" stopped at its first chunk, where the key was left out."""
    choices = [c for chunk in _stream_chunks(server, path, body) for c in chunk["choices"]]
    assert all("finish_reason" in c and c["logprobs"] is None for c in choices), choices
    for index in range(4 if path == "/v1/completions" else 2):
        finishes = [c["finish_reason"] for c in choices if c["index"] == index]
        assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}, choices


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_a_prompt_too_long(server, offline):
    """vLLM's extra field: a prompt longer than the context runs on its last k tokens (-1: as
    many as leave room for one), and usage counts those; without it, it is refused."""
    prompt = [5 + i % 200 for i in range(MAX_MODEL_LEN + 50)]
    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="model", prompt=prompt, max_tokens=1)
    assert refused.value.body["code"] == "context_length_exceeded"
    expected = _offline(offline, prompt[-100:], max_tokens=4).outputs[0]
    got = client.completions.create(model="model", prompt=prompt, max_tokens=4, temperature=0,
                                    echo=True, extra_body={"truncate_prompt_tokens": 100})
    assert got.usage.prompt_tokens == 100
    assert got.choices[0].text == offline.get_tokenizer().decode(prompt[-100:]) + expected.text
    whole = client.completions.create(model="model", prompt=prompt, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == MAX_MODEL_LEN - 1
