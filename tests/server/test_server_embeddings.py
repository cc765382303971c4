"""``POST /v1/embeddings`` on a ``--runner pooling`` server, through the OpenAI SDK, against
the offline engine's ``LLM.embed`` on the same model; the errors, and that the server keeps
serving after them. Matryoshka ``dimensions`` and ``priority`` on a second server (a
Matryoshka copy of the model, ``--scheduling-policy priority``), against transformers."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator

import numpy as np
import openai
import pytest

from tests.engine.test_pooling import _cut
from tests.server.conftest import Server, engine_kwargs, launch_server
from tests.tiny_models import hf_pooled, random_prompts


@pytest.fixture(scope="module")
def reference(chat_model):
    from pagedserve import LLM

    llm = LLM(model=str(chat_model), runner="pooling", **engine_kwargs())
    yield lambda prompts: [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    llm.shutdown()


def _check(got: list[float], want: list[float]) -> None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_float_and_base64(embed_server, reference):
    client = embed_server.client()
    ids = random_prompts("embed", [3, 150])  # 150 tokens: chunked by the 64-token budget
    texts = ["hello world", "the quick brown fox"]
    want = reference(texts + ids)
    out = client.embeddings.create(model="model", input=texts, encoding_format="float")
    assert [d.index for d in out.data] == [0, 1] and out.object == "list"
    assert out.model == "model"
    for d, w in zip(out.data, want[:2], strict=True):
        _check(d.embedding, w)
    out = client.embeddings.create(model="model", input=ids, encoding_format="base64")
    for d, w in zip(out.data, want[2:], strict=True):  # asked for, it comes as sent
        _check(np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist(), w)
    assert out.usage.prompt_tokens == out.usage.total_tokens == 153
    # Without encoding_format the SDK asks for base64 and decodes it itself.
    single = client.embeddings.create(model="model", input=ids[0])
    _check(single.data[0].embedding, want[2])


def test_base64_wire_format(embed_server, reference):
    r = embed_server.post("/v1/embeddings", json={"input": "hello", "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    data = r.json()["data"][0]
    assert data["object"] == "embedding" and isinstance(data["embedding"], str)
    vector = np.frombuffer(base64.b64decode(data["embedding"]), dtype="<f4")
    _check(vector.tolist(), reference(["hello"])[0])
    assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [1] * 4097}, "input"),
    ({"input": [5, 10**6]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": 5}, "input"),
])
def test_bad_requests_are_400(embed_server, body, param):
    r = embed_server.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or ""), error


def test_generation_on_a_pooling_server_is_400_and_it_keeps_serving(embed_server):
    client = embed_server.client()
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.completions.create(model="model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.chat.completions.create(model="model", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert client.models.list().data[0].id == "model"
    assert len(client.embeddings.create(model="model", input="ok").data[0].embedding) == 64
    values = embed_server.wait_for_metrics(lambda v: v.get("num_requests_running") == 0)
    assert values["kv_cache_usage_perc"] == 0


def test_embeddings_on_a_generating_server_is_400(server):
    with pytest.raises(openai.BadRequestError, match="runner pooling"):
        server.client().embeddings.create(model="model", input="hi")
    assert server.client().completions.create(model="model", prompt="hi", max_tokens=1)


def test_a_client_that_hangs_up_has_its_requests_aborted(embed_server):
    """Thousands of 64-token steps of work; the client leaves once they run, and every
    request is aborted and its blocks come back."""
    before, after = embed_server.hang_up_once_running(
        "/v1/embeddings", {"input": random_prompts("hang-up", [4000] * 32)})
    assert after["num_requests_waiting"] == 0
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] < 32 * 4000


@pytest.fixture(scope="module")
def matryoshka_model(chat_model, tmp_path_factory):
    """The chat model with vLLM's ``matryoshka_dimensions`` in its config.json."""
    folder = tmp_path_factory.mktemp("matryoshka") / "model"
    shutil.copytree(chat_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config,
                                                    "matryoshka_dimensions": [16, 32]}))
    return folder


@pytest.fixture(scope="module")
def matryoshka_server(matryoshka_model, tmp_path_factory) -> Iterator[Server]:
    with launch_server(matryoshka_model, tmp_path_factory.mktemp("logs"), "--runner",
                       "pooling", "--scheduling-policy", "priority") as s:
        yield s


def test_matryoshka_dimensions_against_transformers(matryoshka_server, matryoshka_model):
    client = matryoshka_server.client()
    ids = random_prompts("matryoshka", [4, 90])
    raw = hf_pooled(matryoshka_model, ids, "LAST", normalize=False)
    for dimensions in (16, 32, 64):  # 64: the model's own size, nothing cut
        out = client.embeddings.create(model="model", input=ids, dimensions=dimensions,
                                       encoding_format="float")
        for d, r in zip(out.data, raw, strict=True):
            assert len(d.embedding) == dimensions
            _check(d.embedding, _cut(r, dimensions, normalize=True).tolist())
    out = client.embeddings.create(model="model", input=ids[1], dimensions=16)  # base64
    _check(out.data[0].embedding, _cut(raw[1], 16, normalize=True).tolist())


@pytest.mark.parametrize("dimensions, message", [
    (8, "Matryoshka sizes are 16, 32"), (48, "Matryoshka sizes are 16, 32"),
    (65, "Matryoshka sizes are 16, 32"), (0, "greater than or equal to 1"),
])
def test_matryoshka_sizes_not_listed_are_400(matryoshka_server, dimensions, message):
    r = matryoshka_server.post("/v1/embeddings", json={"input": "hi", "dimensions": dimensions})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "dimensions"
    assert message in error["message"], error
    ok = matryoshka_server.client().embeddings.create(model="model", input="hi", dimensions=32)
    assert len(ok.data[0].embedding) == 32


def test_priority_embeddings_equal_transformers(matryoshka_server, matryoshka_model):
    ids = random_prompts("embed-priority", [7, 20])
    want = hf_pooled(matryoshka_model, ids, "LAST", normalize=True)
    for priority in (-5, 0, 7):
        out = matryoshka_server.client().embeddings.create(
            model="model", input=ids, encoding_format="float", extra_body={"priority": priority})
        for d, w in zip(out.data, want, strict=True):
            _check(d.embedding, w.tolist())


def test_fcfs_refuses_an_embedding_priority_and_keeps_serving(embed_server):
    client = embed_server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="model", input="hi", extra_body={"priority": 2})
    assert refused.value.body["param"] == "priority"
    assert "--scheduling-policy priority" in refused.value.body["message"]
    out = client.embeddings.create(model="model", input="hi", extra_body={"priority": 0})
    assert len(out.data[0].embedding) == 64
