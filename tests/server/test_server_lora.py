"""LoRA through the OpenAI server: the request's ``model`` picks an adapter or the base model,
and each answers as PEFT's own ``generate`` does over the same random adapter; /v1/models lists
the adapters; adapters load and unload at run time, each refusal an OpenAI error; a request in
flight on an adapter being unloaded finishes with its whole output."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.lora.peft_adapters import ADAPTER_SPECS, base_model, peft_model, write_adapter
from tests.server.conftest import HTTP_TIMEOUT_S, Server, launch_server
from tests.tiny_models import hf_greedy, random_prompts

pytestmark = pytest.mark.slow  # a server of its own

BASE = "model"  # the served name of the chat model's folder
MAX_RANK = 8
NEW_TOKENS = 8
PROMPT = random_prompts("server-lora", [40])[0]  # a few whole KV blocks, cached


@pytest.fixture(scope="module")
def adapters(chat_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    folders = {name: write_adapter(chat_model, root / name, ADAPTER_SPECS[spec], seed=20 + i)
               for i, (name, spec) in enumerate([("attn", "attn"), ("mlp", "mlp_rslora"),
                                                 ("mixed", "mixed"), ("all", "all")])}
    folders["too_big"] = write_adapter(chat_model, root / "too_big",
                                       {**ADAPTER_SPECS["attn"], "r": MAX_RANK * 2}, seed=30)
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(
        (folders["attn"] / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00not safetensors at all")
    folders["corrupt"] = corrupt
    return folders


@pytest.fixture(scope="module")
def lora_server(chat_model, adapters, tmp_path_factory) -> Iterator[Server]:
    """"attn" as NAME=PATH and "mlp" in the JSON form; runtime updating through vLLM's
    environment variable."""
    mlp = f'{{"name": "mlp", "path": "{adapters["mlp"]}", "base_model_name": "{BASE}"}}'
    with launch_server(chat_model, tmp_path_factory.mktemp("lora"), "--enable-lora",
                       "--max-loras", "2", "--max-lora-rank", str(MAX_RANK),
                       "--max-cpu-loras", "3", "--lora-modules", f"attn={adapters['attn']}", mlp,
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}) as server:
        yield server


def _reference(chat_model, adapter: Path | None, new_tokens: int = NEW_TOKENS,
               prompt: list[int] = PROMPT) -> str:
    """PEFT's greedy text (the base model's with no adapter), decoded as the server does."""
    from transformers import AutoTokenizer

    model = base_model(chat_model) if adapter is None else peft_model(chat_model, adapter)
    tokens = hf_greedy(model, prompt, new_tokens)
    return AutoTokenizer.from_pretrained(chat_model).decode(tokens, skip_special_tokens=True)


def _complete(server: Server, model: str, max_tokens: int = NEW_TOKENS) -> str:
    return server.client().completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].text


def _load(server: Server, **body) -> httpx.Response:
    return server.post("/v1/load_lora_adapter", json=body)


def _unload(server: Server, **body) -> httpx.Response:
    return server.post("/v1/unload_lora_adapter", json=body)


def test_base_and_adapters_concurrently_equal_peft(lora_server, chat_model, adapters):
    expected = {BASE: _reference(chat_model, None), "attn": _reference(chat_model,
                adapters["attn"]), "mlp": _reference(chat_model, adapters["mlp"])}
    assert len(set(expected.values())) == 3  # else a wrong route could pass unseen

    async def round_of_all() -> dict[str, str]:
        client = lora_server.async_client()
        names = [*expected, *expected]  # each twice, all in flight at once
        responses = await asyncio.gather(*(client.completions.create(
            model=name, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"ignore_eos": True}) for name in names))
        assert [r.model for r in responses] == names
        return [(n, r.choices[0].text) for n, r in zip(names, responses)]

    # The second round finds the first's KV blocks in the prefix cache: each adapter's own.
    for _ in range(2):
        for name, text in asyncio.run(round_of_all()):
            assert text == expected[name], name


def test_a_streamed_chat_runs_its_adapter(lora_server, chat_model, adapters):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "hello there"}]
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    chunks = list(lora_server.client().chat.completions.create(
        model="mlp", messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert {c.model for c in chunks} == {"mlp"}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _reference(chat_model, adapters["mlp"], prompt=prompt)


def test_models_lists_the_adapters_with_their_parent(lora_server, adapters):
    cards = {c.id: c for c in lora_server.client().models.list().data}
    assert list(cards)[:3] == [BASE, "attn", "mlp"]
    assert cards[BASE].parent is None
    for name in ("attn", "mlp"):
        assert (cards[name].parent, cards[name].root) == (BASE, str(adapters[name]))
    client = lora_server.client()
    assert [client.models.retrieve(name) for name in cards] == list(cards.values())


def test_an_unknown_model_is_a_404(lora_server):
    with pytest.raises(openai.NotFoundError) as exc:
        _complete(lora_server, "no-such-adapter")
    assert exc.value.body["code"] == "model_not_found"
    assert "'attn', 'mlp'" in exc.value.body["message"]


def test_runtime_load_serve_unload(lora_server, chat_model, adapters):
    loaded = _load(lora_server, lora_name="mixed", lora_path=str(adapters["mixed"]),
                   lora_int_id=7)
    assert (loaded.status_code, loaded.text) == (
        200, "Success: LoRA adapter 'mixed' added successfully.")
    assert _complete(lora_server, "mixed") == _reference(chat_model, adapters["mixed"])
    assert "mixed" in [c.id for c in lora_server.client().models.list().data]
    unloaded = _unload(lora_server, lora_name="mixed")
    assert (unloaded.status_code, unloaded.text) == (
        200, "Success: LoRA adapter 'mixed' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        _complete(lora_server, "mixed")
    # The id again, for another adapter: the core forgot the first one's weights.
    assert _load(lora_server, lora_name="again", lora_path=str(adapters["all"]),
                 lora_int_id=7).status_code == 200
    assert _complete(lora_server, "again") == _reference(chat_model, adapters["all"])
    assert _unload(lora_server, lora_name="again", lora_int_id=7).status_code == 200


@pytest.mark.parametrize(("body", "status", "param", "says"), [
    ({"lora_name": "x", "lora_path": "/no/such/folder"}, 400, "lora_path", "no such folder"),
    ({"lora_name": "x", "lora_path": "{corrupt}"}, 400, "lora_path", "cannot read its weights"),
    ({"lora_name": "x", "lora_path": "{too_big}"}, 400, "lora_path",
     f"rank 16 is above --max-lora-rank {MAX_RANK}"),
    ({"lora_name": "attn", "lora_path": "{mixed}"}, 400, "lora_name", "already been loaded"),
    ({"lora_name": BASE, "lora_path": "{mixed}"}, 400, "lora_name", "a served model's"),
    ({"lora_name": "x", "lora_path": "{mixed}", "base_model_name": "other"}, 404, "model",
     "does not exist"),
])
def test_load_refusals(lora_server, adapters, body, status, param, says):
    body = {k: v.format(**{n: str(p) for n, p in adapters.items()}) for k, v in body.items()}
    response = _load(lora_server, **body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"]
    assert "x" not in [c.id for c in lora_server.client().models.list().data]


def test_unload_refusals_and_the_core_still_serves(lora_server):
    for body in ({"lora_name": "nope"}, {"lora_name": "attn", "lora_int_id": 99}):
        response = _unload(lora_server, **body)
        assert response.status_code == 404, response.text
        assert "cannot be found" in response.json()["error"]["message"]
    assert httpx.get(f"{lora_server.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    assert _complete(lora_server, "attn")


def test_a_request_in_flight_finishes_through_an_unload(lora_server, chat_model, adapters):
    long = 256
    assert _load(lora_server, lora_name="drain", lora_path=str(adapters["mlp"]),
                 lora_int_id=9).status_code == 200
    stream = iter(lora_server.client().completions.create(
        model="drain", prompt=PROMPT, max_tokens=long, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    text = next(stream).choices[0].text
    with lora_server.core_paused():
        assert lora_server.metrics()["num_requests_running"] == 1  # it is still running
        assert _unload(lora_server, lora_name="drain").status_code == 200
        with pytest.raises(openai.NotFoundError):
            _complete(lora_server, "drain")
        # Its id stays taken until the request ends.
        busy = _load(lora_server, lora_name="next", lora_path=str(adapters["all"]),
                     lora_int_id=9)
        assert busy.status_code == 400 and busy.json()["error"]["param"] == "lora_int_id"
    text += "".join(chunk.choices[0].text for chunk in stream)
    assert text == _reference(chat_model, adapters["mlp"], long)
    assert _load(lora_server, lora_name="next", lora_path=str(adapters["all"]),
                 lora_int_id=9).status_code == 200
    assert _complete(lora_server, "next") == _reference(chat_model, adapters["all"])


def test_an_adapter_whose_folder_vanished_fails_alone(lora_server, chat_model, adapters,
                                                      tmp_path):
    """The audit's case: an adapter out of host memory (three others since, --max-cpu-loras
    3) whose folder is gone is a 400 of its own; the streams in flight finish whole."""
    gone = tmp_path / "gone"
    shutil.copytree(adapters["all"], gone)
    for name, path in (("gone", gone), ("third", adapters["mixed"])):
        assert _load(lora_server, lora_name=name, lora_path=str(path)).status_code == 200
    for name in ("gone", "attn", "mlp", "third"):
        assert _complete(lora_server, name, max_tokens=2)
    shutil.rmtree(gone)
    long = 128
    streams = {name: iter(lora_server.client().completions.create(
        model=name, prompt=PROMPT, max_tokens=long, temperature=0, stream=True,
        extra_body={"ignore_eos": True})) for name in (BASE, "attn")}
    texts = {name: next(stream).choices[0].text for name, stream in streams.items()}
    with pytest.raises(openai.BadRequestError, match="no such folder") as refused:
        _complete(lora_server, "gone")
    assert refused.value.body["param"] == "model"
    for name, stream in streams.items():
        texts[name] += "".join(chunk.choices[0].text for chunk in stream)
    assert texts == {BASE: _reference(chat_model, None, long),
                     "attn": _reference(chat_model, adapters["attn"], long)}
    for name in ("gone", "third"):
        assert _unload(lora_server, lora_name=name).status_code == 200


def test_without_runtime_updating_the_routes_are_404s(server):
    response = server.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "Not Found"


def test_the_core_refuses_a_bad_adapter_alone(chat_model, adapters):
    """An adapter that reaches the core unchecked (the folder changed after the server read
    it) fails its own request; the core keeps serving the others."""
    from pagedserve import LoRARequest, SamplingParams
    from pagedserve.config import EngineConfig
    from pagedserve.engine.core_client import EngineCoreClient
    from pagedserve.engine.core_messages import NewRequest
    from tests.server.conftest import engine_kwargs

    client = EngineCoreClient(EngineConfig(model=str(chat_model), enable_lora=True,
                                           max_lora_rank=MAX_RANK, **engine_kwargs()))
    client.start()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            output_kind="delta")

    async def run() -> str:
        client.run_in(asyncio.get_running_loop())
        try:
            bad, good = client.add_requests([
                NewRequest("bad", PROMPT, params, LoRARequest("c", 1, str(adapters["corrupt"]))),
                NewRequest("good", PROMPT, params, LoRARequest("a", 2, str(adapters["attn"])))])
            with pytest.raises(ValueError, match="cannot read its weights"):
                async for _ in bad:
                    pass
            outputs = [output async for output in good]
            assert client.is_running
            return outputs[-1].outputs[0].text
        finally:
            await client.shutdown()

    assert asyncio.run(run()) == _reference(chat_model, adapters["attn"])


def test_with_several_models_adapters_go_to_the_one_with_lora(chat_model, qwen_model, adapters,
                                                             tmp_path):
    config = tmp_path / "models.yaml"
    config.write_text(f"models:\n"
                      f"  - model: {qwen_model}\n"
                      f"    served_model_name: qwen\n"
                      f"  - model: {chat_model}\n"
                      f"    enable_lora: true\n"
                      f"    max_lora_rank: {MAX_RANK}\n")
    with launch_server(None, tmp_path, "--models-config", str(config),
                       "--lora-modules", f"attn={adapters['attn']}") as served:
        cards = served.client().models.list().data
        assert [(c.id, c.parent) for c in cards] == [("qwen", None), (BASE, None),
                                                     ("attn", BASE)]
        assert _complete(served, "attn") == _reference(chat_model, adapters["attn"])
