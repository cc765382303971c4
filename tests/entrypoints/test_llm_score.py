"""``LLM.score`` on a ``runner="pooling"`` engine: 1:N and N:N pairs of texts and token ids
against transformers' float64 hidden states pooled by hand, cosine taken in float64
(``hf_scores``), with the pooler normalizing and not; the errors, and that no KV block is
held after them."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedserve import PoolingParams, ScoringRequestOutput
from tests.tiny_models import hf_scores, make_llm, random_prompts, write_tiny_model

# float32 engine against a float64 reference, for numbers in [-1, 1].
ATOL = 2e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("score") / "m", "llama3", seed=7)


@pytest.fixture(scope="module")
def llm(model):
    return make_llm(model, runner="pooling", max_num_batched_tokens=32)


def _scores(outputs: list[ScoringRequestOutput]) -> list[float]:
    assert all(isinstance(o, ScoringRequestOutput) and o.finished for o in outputs)
    return [o.outputs.score for o in outputs]


def _assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    assert got == pytest.approx(want, abs=ATOL, rel=0), (got, want)


def _assert_all_blocks_free(llm) -> None:
    pool = llm.engine.kv.pool
    assert not llm.engine.has_unfinished_requests()
    assert pool.num_used == 0 and pool.num_free == pool.num_blocks


def test_one_against_many(model, llm):
    query = random_prompts("query", [9])[0]
    documents = random_prompts("docs", [4, 40, 17, 1])  # 40: chunked by the 32-token budget
    outputs = llm.score(query, documents, use_tqdm=False)
    _assert_close(_scores(outputs), hf_scores(model, [(query, d) for d in documents]))
    assert [o.prompt_token_ids for o in outputs] == [query + d for d in documents]
    # A one-item first list pairs the same way.
    _assert_close(_scores(llm.score([query], documents, use_tqdm=False)),
                  _scores(outputs))
    _assert_all_blocks_free(llm)


def test_pairwise_texts(model, llm):
    firsts = ["the quick brown fox", "hello world", "serving large language models"]
    seconds = ["the lazy dog", "paged attention", "hello world"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    want = hf_scores(model, [(tokenizer.encode(a), tokenizer.encode(b))
                             for a, b in zip(firsts, seconds, strict=True)])
    _assert_close(_scores(llm.score(firsts, seconds, use_tqdm=False)), want)
    # Swapped sides score the same (a cosine is symmetric), a text with itself scores 1.
    _assert_close(_scores(llm.score(seconds, firsts, use_tqdm=False)), want)
    assert _scores(llm.score("hello world", "hello world", use_tqdm=False)) == pytest.approx(
        [1.0], abs=1e-6)


@pytest.mark.parametrize("pooling_type, normalize", [("MEAN", False), ("LAST", True)])
def test_any_pooler_gives_a_cosine(model, pooling_type, normalize):
    """The cosine is taken of whatever the pooler returns, normalized or not."""
    llm = make_llm(model, runner="pooling",
                   pooler_config={"pooling_type": pooling_type, "normalize": normalize})
    firsts, seconds = random_prompts(pooling_type, [5, 23]), random_prompts(normalize, [12, 3])
    _assert_close(_scores(llm.score(firsts, seconds, use_tqdm=False)),
                  hf_scores(model, list(zip(firsts, seconds, strict=True)), pooling_type))


def test_truncation_and_pooling_params(model, llm):
    query, document = random_prompts("trunc", [30, 20])
    outputs = llm.score(query, [document], truncate_prompt_tokens=8, use_tqdm=False)
    _assert_close(_scores(outputs), hf_scores(model, [(query[-8:], document[-8:])]))
    raw = llm.score(query, [document], pooling_params=PoolingParams(normalize=False),
                    use_tqdm=False)
    _assert_close(_scores(raw), hf_scores(model, [(query, document)]))


@pytest.mark.parametrize("first, second, message", [
    ([[5, 6], [7, 8]], [[5, 6], [7, 8], [9]], "2 first texts against 3"),
    ([], [[5, 6]], "at least one"),
    ([[5, 6]], [], "at least one"),
    ([[5, 6]], [[5] * 1025], "context length"),
    ([[5, 6]], [[]], "empty"),
])
def test_errors_leave_no_blocks(llm, first, second, message):
    with pytest.raises(ValueError, match=message):
        llm.score(first, second, use_tqdm=False)
    _assert_all_blocks_free(llm)
    assert len(llm.score([5, 6], [[7]], use_tqdm=False)) == 1


def test_a_generating_engine_names_the_runner(model):
    with pytest.raises(ValueError, match="--runner pooling"):
        make_llm(model).score("a", ["b"], use_tqdm=False)
