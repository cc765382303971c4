"""vLLM's ``/v1/score`` (``/score``) and ``/v1/rerank`` (``/rerank``, ``/v2/rerank``) on a
``--runner pooling`` server, against transformers' float64 hidden states pooled by hand with
the cosine taken in float64 (``hf_scores``); ``top_n``, ``return_documents``, the order; the
errors as OpenAI error bodies, after which the server keeps serving and holds no KV block."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.tiny_models import hf_scores

ATOL = 2e-5
QUERY = "the quick brown fox"
DOCUMENTS = ["the lazy dog", "hello world", "the quick brown fox jumps", "paged attention"]
RERANK_PATHS = ["/v1/rerank", "/rerank", "/v2/rerank"]


@pytest.fixture(scope="module")
def reference(chat_model):
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    return lambda pairs: hf_scores(chat_model, [(tokenizer.encode(a), tokenizer.encode(b))
                                                for a, b in pairs])


@pytest.fixture(scope="module")
def num_tokens(chat_model):
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    return lambda texts: sum(len(tokenizer.encode(t)) for t in texts)


def _post(server, path: str, body: dict) -> dict:
    r = server.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
def test_score_one_to_many_and_pairwise(embed_server, reference, num_tokens, path):
    out = _post(embed_server, path, {"model": "model", "text_1": QUERY, "text_2": DOCUMENTS})
    assert out["object"] == "list" and out["model"] == "model"
    assert out["id"].startswith("score-") and isinstance(out["created"], int)
    assert [(d["index"], d["object"]) for d in out["data"]] == [(i, "score") for i in range(4)]
    want = reference([(QUERY, d) for d in DOCUMENTS])
    assert [d["score"] for d in out["data"]] == pytest.approx(want, abs=ATOL, rel=0)
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == num_tokens(
        [QUERY, *DOCUMENTS])
    pairwise = _post(embed_server, path, {"text_1": DOCUMENTS[::-1], "text_2": DOCUMENTS})
    want = reference(list(zip(DOCUMENTS[::-1], DOCUMENTS, strict=True)))
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(want, abs=ATOL, rel=0)


@pytest.mark.parametrize("path", RERANK_PATHS)
def test_rerank_orders_by_score(embed_server, reference, num_tokens, path):
    want = reference([(QUERY, d) for d in DOCUMENTS])
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    out = _post(embed_server, path, {"model": "model", "query": QUERY, "documents": DOCUMENTS})
    assert out["model"] == "model" and out["id"].startswith("rerank-")
    assert out["usage"] == {"total_tokens": num_tokens([QUERY, *DOCUMENTS])}
    assert [r["index"] for r in out["results"]] == order
    assert [r["relevance_score"] for r in out["results"]] == pytest.approx(
        [want[i] for i in order], abs=ATOL, rel=0)
    assert [r["document"] for r in out["results"]] == [{"text": DOCUMENTS[i]} for i in order]
    top = _post(embed_server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                     "return_documents": False})
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all(r["document"] is None for r in top["results"])


LONG = " hello world" * 3000  # past the 4096-token context


@pytest.mark.parametrize("path, body, param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": 5}, "text_2"),
    ("/v1/score", {"text_1": LONG, "text_2": ["a"]}, "text_1"),
    ("/score", {"text_1": "a", "text_2": ["b", LONG]}, "text_2"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b", ""]}, "documents"),
    ("/rerank", {"query": "a", "documents": ["b", LONG]}, "documents"),
    ("/v2/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/v2/rerank", {"query": "a", "documents": "b"}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "model": "nope"}, "model"),
    # A priority other than 0 needs --scheduling-policy priority, as for every request.
    ("/v1/score", {"text_1": "a", "text_2": ["b"], "priority": 2}, "priority"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "priority": -1}, "priority"),
])
def test_bad_requests_are_400(embed_server, path, body, param):
    r = embed_server.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_the_server_keeps_serving_and_holds_no_blocks(embed_server, reference):
    for body in ({"text_1": "a", "text_2": ["b", LONG]}, {"text_1": ["a"] * 3, "text_2": ["b"]}):
        assert embed_server.post("/v1/score", json=body).status_code == 400
    out = _post(embed_server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[0]})
    assert out["data"][0]["score"] == pytest.approx(reference([(QUERY, DOCUMENTS[0])])[0],
                                                    abs=ATOL)
    values = embed_server.wait_for_metrics(lambda v: v.get("num_requests_running") == 0)
    assert values["kv_cache_usage_perc"] == 0 and values["num_requests_waiting"] == 0


@pytest.mark.parametrize("path, body", [("/v1/score", {"text_1": "a", "text_2": ["b"]}),
                                        ("/v1/rerank", {"query": "a", "documents": ["b"]})])
def test_a_generating_server_names_the_runner(server, path, body):
    r = server.post(path, json=body)
    assert r.status_code == 400, r.text
    assert "--runner pooling" in r.json()["error"]["message"]
