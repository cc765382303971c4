"""Requests the engine cannot serve are rejected when added, and leave nothing behind."""

from __future__ import annotations

import pytest

from pagedserve import SamplingParams
from pagedserve.engine.input_processor import PromptTooLong
from tests.tiny_models import VOCAB, make_llm


@pytest.fixture(scope="module")
def llm(llama3_folder):
    return make_llm(llama3_folder, kv_cache_memory_bytes=1 << 20, max_model_len=64)


@pytest.mark.parametrize("prompt,params,error", [
    ([5, 6], SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
    ([5, 6], SamplingParams(stop_token_ids=[VOCAB + 3]), "stop_token_ids"),
    ([5, VOCAB], SamplingParams(), "prompt token ids"),
    ([], SamplingParams(), "empty"),
    (list(range(3, 67)), SamplingParams(), "context length is 64"),
])
def test_bad_request_is_rejected_and_engine_keeps_serving(llm, prompt, params, error):
    engine = llm.engine
    with pytest.raises(ValueError, match=error):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1


def test_prompt_too_long_names_both_numbers(llm):
    with pytest.raises(PromptTooLong, match="70 tokens.*64"):
        llm.engine.add_request(list(range(3, 73)), SamplingParams())


@pytest.mark.parametrize("max_tokens", [None, 100])
def test_min_tokens_past_the_room_the_prompt_leaves_is_refused(llm, max_tokens):
    """62 tokens fit after a 2-token prompt in a window of 64: min_tokens=63 came back as 62
    tokens finished by "length", short of min_tokens (the server refused it already)."""
    with pytest.raises(PromptTooLong, match="min_tokens=63 is more than the 62 tokens") as err:
        llm.generate([[5, 6]], SamplingParams(min_tokens=63, max_tokens=max_tokens),
                     use_tqdm=False)
    assert err.value.param == "min_tokens"
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks
    out = llm.generate([[5, 6]], SamplingParams(min_tokens=62, max_tokens=max_tokens,
                                                temperature=0.0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 62
def test_an_id_the_engine_picks_never_takes_one_a_caller_gave(llm):
    """Ids the engine picks are a counter; a caller's id may be one it has not reached yet.
    The engine's next id skips it, instead of replacing the caller's request (which ran on,
    unreported, holding its KV blocks for good) or refusing a request that named no id."""
    engine = llm.engine
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    taken = [str(engine._next_id + i) for i in range(3)]
    for request_id in taken[::2]:
        engine.add_request([5, 6, 7], params, request_id=request_id)
    ids = [engine.add_request([5, 6], params), *engine.add_requests([[7, 8]], [params])]
    assert not set(ids) & set(taken[::2])
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert sorted(finished) == sorted(taken[::2] + ids)
    assert all(len(o.outputs[0].token_ids) == 4 for o in finished.values())
    assert not engine.scheduler.running and engine.kv.pool.num_free == engine.kv.num_blocks


def _one_token_word(llm) -> tuple[str, int]:
    tokenizer = llm.get_tokenizer()
    for token in range(10, 384):
        word = tokenizer.decode([token]).strip()
        if word and tokenizer.encode(word, add_special_tokens=False) == [token]:
            return word, token
    raise AssertionError("no word of one token")


@pytest.mark.parametrize("case", ["bad_words", "min_tokens"])
def test_a_request_that_leaves_no_token_to_sample_is_refused(llm, case):
    """allowed_token_ids whose every id a bad word bans, or that holds only stop tokens while
    min_tokens forbids them: every logit of the row was -inf, and the sampler drew token 0
    (logprob -9999) step after step instead of anything the request allows."""
    word, token = _one_token_word(llm)
    params = (SamplingParams(allowed_token_ids=[token], bad_words=[word]) if case == "bad_words"
              else SamplingParams(allowed_token_ids=[1, token], stop_token_ids=[token],
                                  min_tokens=2))
    with pytest.raises(ValueError, match="no token") as err:
        llm.engine.add_request([5, 6], params)
    assert err.value.param == case
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks
