"""``POST /classify`` on a sequence classifier served with ``--runner auto`` (which pools it),
against transformers' ``AutoModelForSequenceClassification`` in float64, and ``/v1/score`` and
``/v1/rerank`` with a one-label classifier (a cross-encoder) served beside it, and their raw
logits with ``use_activation: false``; the endpoints a
classifier refuses, ``/classify`` on an embedding and a generating server, and that the
server keeps serving after every refusal with no KV blocks held."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import MAX_MODEL_LEN, Server, launch_server
from tests.tiny_models import hf_classified, hf_logits, random_prompts, write_tiny_model

ATOL = 2e-5


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("classifier") / "model", "qwen2", seed=5,
                            num_labels=3, max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A classifier of one label, served as "cross"."""
    return write_tiny_model(tmp_path_factory.mktemp("cross") / "cross", "llama3", seed=6,
                            num_labels=1, max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def classify_server(classifier, cross_encoder, tmp_path_factory) -> Iterator[Server]:
    with launch_server(None, tmp_path_factory.mktemp("logs"), "--model", str(classifier),
                       "--model", str(cross_encoder), "--max-num-batched-tokens", "64") as s:
        yield s


def _assert_held_nothing(server: Server) -> None:
    values = server.wait_for_metrics(lambda v: v.get("num_requests_running") == 0)
    assert values["kv_cache_usage_perc"] == 0 and values["num_requests_waiting"] == 0


def test_classify_matches_transformers(classify_server, classifier):
    texts = ["hello world", "the quick brown fox jumps over the lazy dog " * 12]  # chunked
    r = classify_server.post("/classify", json={"model": "model", "input": texts})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "list" and out["model"] == "model"
    assert out["id"].startswith("classify-") and isinstance(out["created"], int)
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    want = hf_classified(classifier, prompts)
    assert [d["index"] for d in out["data"]] == [0, 1]
    for d, w in zip(out["data"], want, strict=True):
        assert d["num_classes"] == 3
        np.testing.assert_allclose(d["probs"], w.numpy(), atol=ATOL, rtol=0)
        assert d["label"] == f"label_{int(w.argmax())}"
    tokens = sum(map(len, prompts))
    assert out["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens,
                            "completion_tokens": 0}
    single = classify_server.post("/v1/classify", json={"model": "model",
                                                        "input": texts[0]}).json()
    np.testing.assert_allclose(single["data"][0]["probs"], want[0].numpy(), atol=ATOL, rtol=0)


def test_cross_encoder_score_and_rerank(classify_server, cross_encoder):
    """A one-label classifier scores each pair joined by the tokenizer's pair encoding (its
    sigmoid probability), as vLLM's cross-encoders; rerank orders by that score."""
    tokenizer = AutoTokenizer.from_pretrained(cross_encoder)
    query, docs = "what is paged attention", ["a kv cache in blocks", "hello world " * 9]
    joined = [tokenizer(query, d)["input_ids"] for d in docs]
    want = [float(p[0]) for p in hf_classified(cross_encoder, joined)]
    r = classify_server.post("/v1/score", json={"model": "cross", "text_1": query,
                                                "text_2": docs})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [d["score"] for d in out["data"]] == pytest.approx(want, abs=ATOL)
    assert out["usage"]["prompt_tokens"] == sum(map(len, joined))
    ranked = classify_server.post("/v1/rerank", json={"model": "cross", "query": query,
                                                      "documents": docs}).json()["results"]
    assert [d["index"] for d in ranked] == sorted(range(2), key=lambda i: -want[i])
    assert [d["relevance_score"] for d in ranked] == pytest.approx(sorted(want)[::-1],
                                                                   abs=ATOL)
    probs = classify_server.post("/classify", json={"model": "cross", "input": query}).json()
    assert probs["data"][0]["num_classes"] == 1


def test_use_activation_false_returns_raw_logits(classify_server, classifier):
    """vLLM's ``use_activation``: false returns transformers' raw logits as ``probs`` (the
    label still the largest); true and unset the probabilities."""
    texts = ["hello world", "paged attention keeps the kv cache in blocks " * 6]
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    logits, probs = hf_logits(classifier, prompts), hf_classified(classifier, prompts)
    for flag, want in ((False, logits), (True, probs), (None, probs)):
        r = classify_server.post("/v1/classify", json={"model": "model", "input": texts,
                                                       "use_activation": flag})
        assert r.status_code == 200, r.text
        for d, w in zip(r.json()["data"], want, strict=True):
            np.testing.assert_allclose(d["probs"], w.numpy(), atol=ATOL, rtol=0)
            assert d["label"] == f"label_{int(w.argmax())}" and d["num_classes"] == 3


def test_cross_encoder_raw_scores(classify_server, cross_encoder):
    """``use_activation: false`` on ``/v1/score`` and ``/v1/rerank``: each pair's raw logit,
    reranked by it."""
    tokenizer = AutoTokenizer.from_pretrained(cross_encoder)
    query, docs = "what is paged attention", ["a kv cache in blocks", "hello world " * 9]
    joined = [tokenizer(query, d)["input_ids"] for d in docs]
    want = [float(w[0]) for w in hf_logits(cross_encoder, joined)]
    assert want != pytest.approx([float(p[0]) for p in hf_classified(cross_encoder, joined)],
                                 abs=0.05)
    r = classify_server.post("/v1/score", json={"model": "cross", "text_1": query,
                                                "text_2": docs, "use_activation": False})
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=ATOL)
    ranked = classify_server.post("/v1/rerank", json={
        "model": "cross", "query": query, "documents": docs, "use_activation": False})
    assert ranked.status_code == 200, ranked.text
    results = ranked.json()["results"]
    assert [d["relevance_score"] for d in results] == pytest.approx(sorted(want)[::-1],
                                                                    abs=ATOL)


@pytest.mark.parametrize("path, body", [
    ("/classify", {"model": "model", "input": "hi"}),
    ("/v1/score", {"model": "cross", "text_1": "a", "text_2": ["b"]}),
    ("/v1/rerank", {"model": "cross", "query": "a", "documents": ["b"]}),
])
@pytest.mark.parametrize("value", ["false", 0, [False]])
def test_use_activation_of_a_wrong_type_is_400(classify_server, path, body, value):
    r = classify_server.post(path, json={**body, "use_activation": value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "use_activation"
    assert "use_activation" in error["message"] and "boolean" in error["message"], error


def test_vllms_removed_spellings_are_400(classify_server):
    """vLLM 0.15 removed ``activation`` and ``softmax``; they are unknown fields here."""
    for old in ("activation", "softmax"):
        r = classify_server.post("/classify", json={"model": "model", "input": "hi",
                                                    old: False})
        assert r.status_code == 400 and r.json()["error"]["param"] == old, r.text


@pytest.mark.parametrize("path, body, message", [
    ("/v1/embeddings", {"input": "hi"}, "sequence classifier.*/classify"),
    ("/v1/score", {"text_1": "a", "text_2": ["b"]}, "sequence classifier.*one label"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "--runner pooling"),
    ("/classify", {"input": [[5] * (MAX_MODEL_LEN + 1)]}, "context length"),
    ("/classify", {"input": ""}, "empty"),
])
def test_refusals_are_400_and_it_keeps_serving(classify_server, path, body, message):
    r = classify_server.post(path, json=body)
    assert r.status_code == 400, r.text
    assert re.search(message, r.json()["error"]["message"]), r.text
    ok = classify_server.post("/classify", json={"model": "model",
                                                 "input": random_prompts(1, [9])})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["probs"]) == 3
    _assert_held_nothing(classify_server)


def test_classify_on_an_embedding_server_is_400(embed_server):
    r = embed_server.post("/classify", json={"input": "hi"})
    assert r.status_code == 400, r.text
    assert "not a sequence classifier" in r.json()["error"]["message"]
    r = embed_server.post("/v1/score", json={"text_1": "a", "text_2": ["b"],
                                             "use_activation": False})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "use_activation"
    assert embed_server.post("/v1/embeddings", json={"input": "hi"}).status_code == 200
    _assert_held_nothing(embed_server)


def test_classify_on_a_generating_server_names_the_runner(server):
    r = server.post("/classify", json={"input": "hi"})
    assert r.status_code == 400, r.text
    assert "--runner pooling" in r.json()["error"]["message"]
    assert server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}
                       ).status_code == 200
