"""Two different models behind one server, one engine core each: the request's ``model`` routes
it, each answers as its own offline engine does, and a core that dies fails only its model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import jinja2
import openai
import pytest

from pagedserve import SamplingParams
from tests.server.conftest import (
    CHAT_TEMPLATE,
    HTTP_TIMEOUT_S,
    KV_BYTES,
    LONG_TOKENS,
    MAX_MODEL_LEN,
    Server,
    launch_server,
)

# Every test here talks to a server of its own: an API server and two engine cores.
pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox"
# The second model's sampling defaults, from a generation_config.json the models config names.
QWEN_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 6}
# The second model's chat template, from the models config (replacing the folder's own).
QWEN_TEMPLATE = ("{% for m in messages %}## {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}## assistant:{% endif %}"
                 "{% if enable_thinking %} <think>{% endif %}")
QWEN_LEN = 2048  # the second model's own max_model_len, from the models config
CORE_ENV = "PAGEDSERVE_TEST_CORE_ENV"  # set for the second model's core alone


@pytest.fixture(scope="module")
def pair(chat_model, qwen_model, tmp_path_factory) -> Iterator[Server]:
    """"llama" (the default: listed first) and "qwen", each with options of its own."""
    folder = tmp_path_factory.mktemp("multi")
    (folder / "qwen.jinja").write_text(QWEN_TEMPLATE, encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps(QWEN_DEFAULTS))
    config = folder / "models.yaml"
    config.write_text(f"models:\n"
                      f"  - model: {chat_model}\n"
                      f"    served_model_name: llama\n"
                      f"  - model: {qwen_model}\n"
                      f"    served_model_name: qwen\n"
                      f"    max_model_len: {QWEN_LEN}\n"
                      f"    chat_template: {folder / 'qwen.jinja'}\n"
                      f"    generation_config: {folder}\n"
                      f"    kv_cache_memory_bytes: {KV_BYTES // 2}\n"
                      f"    env: {{{CORE_ENV}: qwen-only}}\n")
    with launch_server(None, folder, "--models-config", str(config)) as server:
        yield server


@pytest.fixture(scope="module")
def offline_qwen(qwen_model):
    from pagedserve import LLM

    return LLM(model=str(qwen_model), device="cpu", max_model_len=QWEN_LEN,
               kv_cache_memory_bytes=KV_BYTES // 2, chat_template=QWEN_TEMPLATE)


def _greedy(llm, prompt, max_tokens: int = 12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_models_lists_both_with_their_own_limits(pair):
    cards = pair.client().models.list().data
    assert [(c.id, c.max_model_len) for c in cards] == [("llama", MAX_MODEL_LEN),
                                                        ("qwen", QWEN_LEN)]


def test_each_core_runs_with_its_own_environment(pair):
    environs = [dict(item.split(b"=", 1) for item in
                     Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item)
                for pid in pair.core_pids()]
    assert [e.get(CORE_ENV.encode()) for e in environs] == [None, b"qwen-only"]


def test_each_model_answers_as_its_own_engine(pair, offline, offline_qwen):
    client = pair.client()
    outputs = {}
    for name, llm in (("llama", offline), ("qwen", offline_qwen)):
        expected = _greedy(llm, PROMPT)
        got = client.completions.create(model=name, prompt=PROMPT, max_tokens=12,
                                        temperature=0)
        assert got.model == name
        assert got.choices[0].text == expected.text
        assert got.usage.completion_tokens == len(expected.token_ids)
        outputs[name] = expected.token_ids
    # Else routing could be wrong unseen.
    assert outputs["llama"] != outputs["qwen"]


def test_a_request_without_a_model_goes_to_the_first(pair, offline):
    response = pair.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12,
                                                  "temperature": 0})
    assert response.status_code == 200
    assert response.json()["model"] == "llama"
    assert response.json()["choices"][0]["text"] == _greedy(offline, PROMPT).text


def test_chat_stream_and_tokenize_are_routed(pair, offline_qwen):
    messages = [{"role": "user", "content": "hello"}]
    expected = offline_qwen.chat(messages, SamplingParams(max_tokens=10, temperature=0.0),
                                 use_tqdm=False)[0].outputs[0]
    chunks = list(pair.client().chat.completions.create(
        model="qwen", messages=messages, max_tokens=10, temperature=0, stream=True))
    assert {c.model for c in chunks} == {"qwen"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    counted = pair.post("/tokenize", json={"model": "qwen", "prompt": PROMPT}).json()
    assert counted["max_model_len"] == QWEN_LEN


def test_each_model_renders_chat_with_its_own_template(pair):
    """"qwen" with the models config's chat_template file, "llama" with its folder's."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for name, template in (("qwen", QWEN_TEMPLATE), ("llama", CHAT_TEMPLATE)):
        text = jinja2.Template(template).render(messages=messages, add_generation_prompt=True)
        rendered = pair.post("/tokenize", json={"model": name, "messages": messages}).json()
        plain = pair.post("/tokenize", json={"model": name, "prompt": text,
                                             "add_special_tokens": False}).json()
        assert rendered["tokens"] == plain["tokens"], name


def test_the_template_fields_reach_the_template(pair):
    """vLLM's chat_template_kwargs (the template's own variables) and continue_final_message
    (the prompt ends inside the last message, for the model to continue it)."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "The answer is"}]

    def tokens(**fields) -> list[int]:
        response = pair.post("/tokenize", json={"model": "qwen", "messages": messages,
                                                **fields})
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    def text_tokens(text: str) -> list[int]:
        return pair.post("/tokenize", json={"model": "qwen", "prompt": text,
                                            "add_special_tokens": False}).json()["tokens"]

    thinking = jinja2.Template(QWEN_TEMPLATE).render(
        messages=messages, add_generation_prompt=True, enable_thinking=True)
    assert thinking.endswith("## assistant: <think>")
    assert tokens(chat_template_kwargs={"enable_thinking": True}) == text_tokens(thinking)
    continued = tokens(add_generation_prompt=False, continue_final_message=True)
    assert continued == text_tokens("## user: hi\n## assistant: The answer is")
    chat = pair.client().chat.completions.create(
        model="qwen", messages=messages, max_tokens=3,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert chat.usage.prompt_tokens == len(continued)


def test_unset_sampling_fields_take_the_models_defaults(pair, offline_qwen):
    """"qwen"'s generation config makes a request that sets nothing greedy and 6 tokens long;
    what a request sets wins."""
    messages = [{"role": "user", "content": "tell me more"}]
    client = pair.client()
    expected = offline_qwen.chat(messages, SamplingParams(max_tokens=6, temperature=0.0),
                                 use_tqdm=False)[0].outputs[0]
    got = client.chat.completions.create(model="qwen", messages=messages)
    assert got.choices[0].message.content == expected.text
    assert got.usage.completion_tokens == len(expected.token_ids) == 6
    shorter = client.chat.completions.create(model="qwen", messages=messages, max_tokens=3)
    assert shorter.usage.completion_tokens == 3
    completion = client.completions.create(model="qwen", prompt=PROMPT)  # OpenAI's 16 wins
    assert completion.usage.completion_tokens == 16
    # "llama"'s folder ships no sampling defaults: a request that sets none samples at 1.0.
    texts = {client.completions.create(model="llama", prompt=PROMPT, max_tokens=8,
                                       seed=seed).choices[0].text for seed in range(4)}
    assert len(texts) > 1


def test_an_unknown_model_is_a_404_naming_the_served_ones(pair):
    with pytest.raises(openai.NotFoundError) as exc:
        pair.client().completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    error = exc.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'llama', 'qwen'" in error["message"]
    health = httpx.get(f"{pair.url}/health", params={"model": "gpt-4"}, timeout=HTTP_TIMEOUT_S)
    assert health.status_code == 404


def test_metrics_are_labelled_by_model(pair):
    client = pair.client()
    client.completions.create(model="qwen", prompt=PROMPT, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    qwen = pair.metrics("qwen")
    assert qwen["generation_tokens_total"] >= 5
    assert qwen["e2e_request_latency_seconds_count"] >= 1
    # Each pool from its own budget: float32 blocks of 16 tokens, 2 layers, 2 KV heads of 8
    # dimensions (llama, 4 MiB) and of 16 (qwen, half the bytes): 4 KiB and 8 KiB a block.
    assert pair.metrics("llama")["kv_cache_blocks_total"] == KV_BYTES // 4096
    assert qwen["kv_cache_blocks_total"] == KV_BYTES // 2 // 8192


def _events(lines: Iterator[str], count: int | None = None) -> list[dict]:
    """The next ``count`` data events of a stream (None: all, up to [DONE])."""
    events = []
    for line in lines:
        if line == "data: [DONE]":
            break
        if line.startswith("data: {"):
            events.append(json.loads(line[6:]))
            if len(events) == count:
                break
    return events


def test_a_killed_core_fails_only_its_own_model(chat_model, qwen_model, offline, tmp_path):
    with launch_server(None, tmp_path, "--model", str(chat_model),
                       "--model", str(qwen_model)) as served:
        assert [c.id for c in served.client().models.list().data] == ["model", "qwen"]
        _, qwen_core = served.core_pids()
        expected = _greedy(offline, PROMPT, max_tokens=40)
        llama_body = {"model": "model", "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                      "stream": True}
        qwen_body = {"model": "qwen", "prompt": [5, 6, 7], "max_tokens": LONG_TOKENS,
                     "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=llama_body,
                          timeout=HTTP_TIMEOUT_S) as llama, \
                httpx.stream("POST", f"{served.url}/v1/completions", json=qwen_body,
                             timeout=HTTP_TIMEOUT_S) as qwen:
            llama_lines, qwen_lines = llama.iter_lines(), qwen.iter_lines()
            first = _events(llama_lines, 1)
            assert len(_events(qwen_lines, 3)) == 3
            os.kill(qwen_core, signal.SIGKILL)
            # Ends with an error event rather than hanging: a hang would hit the client's
            # timeout and fail here.
            qwen_rest = _events(qwen_lines)
            # The other model's stream, in flight throughout, ends as it would have.
            llama_events = first + _events(llama_lines)
        assert qwen_rest[-1]["error"]["type"] == "server_error"
        assert "'qwen'" in qwen_rest[-1]["error"]["message"]
        assert "".join(e["choices"][0]["text"] for e in llama_events) == expected.text
        _check_after_the_kill(served, offline)


def _check_after_the_kill(served: Server, offline) -> None:
    client = served.client()
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model="qwen", prompt=PROMPT, max_tokens=2)
    assert exc.value.status_code == 503
    assert exc.value.body["type"] == "server_error" and "'qwen'" in exc.value.body["message"]
    got = client.completions.create(model="model", prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == _greedy(offline, PROMPT).text
    health = httpx.get(f"{served.url}/health", timeout=HTTP_TIMEOUT_S)
    assert health.status_code == 503
    message = health.json()["error"]["message"]
    assert "the engine core process of 'qwen' exited with code -9" in message
    assert "(serving 'model')" in message
    for name, status in (("model", 200), ("qwen", 503)):
        one = httpx.get(f"{served.url}/health", params={"model": name}, timeout=HTTP_TIMEOUT_S)
        assert one.status_code == status, name
    assert [c.id for c in client.models.list().data] == ["model", "qwen"]


def test_a_model_that_cannot_start_fails_the_start_in_one_line(chat_model, tmp_path: Path):
    missing = tmp_path / "absent"
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "pagedserve.cli", "serve", "--device", "cpu",
             "--model", str(chat_model), "--model", str(missing),
             "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(KV_BYTES)],
            stdout=out, stderr=subprocess.STDOUT, timeout=180)
    assert done.returncode == 2
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("pagedserve: error: ") and str(missing) in last
