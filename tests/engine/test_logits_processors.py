"""Custom logits processors (--logits-processors) through the engine: a processor that bans a
token chosen per request (``tests/sample/ban_token.py``) gives transformers' greedy tokens with
that token's logit at -inf; rows that come and go keep each request's own state; a request it
refuses, and a name that does not import, fail at once."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.errors import ConfigError
from pagedserve.worker.sampling_batch import SamplingBatch
from tests.sample.ban_token import BanToken
from tests.tiny_models import hf_model, make_llm, random_prompts

NEW_TOKENS = 10
BAN_TOKEN = "tests.sample.ban_token:BanToken"


def _greedy(ban: int | None = None, max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          extra_args=None if ban is None else {"ban_token": ban})


def _hf_greedy_banning(hf, prompt: list[int], banned: int, new_tokens: int) -> list[int]:
    out: list[int] = []
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].double()
        logits[banned] = -math.inf
        out.append(int(logits.argmax()))
    return out


@pytest.fixture(scope="module")
def llm(llama3_folder):
    # By qualified name, as the command line gives it.
    return make_llm(llama3_folder, logits_processors=[BAN_TOKEN])


@pytest.fixture(scope="module")
def prompts():
    return random_prompts("logits-processors", [5, 9, 7])


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_banned_token_equals_transformers_masked(llm, llama3_folder, prompts):
    free = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False))
    # Each request bans the first token it picks freely, so the ban acts on its first step.
    bans = [out[0] for out in free]
    banned = _tokens(llm.generate(prompts, [_greedy(b) for b in bans], use_tqdm=False))
    hf = hf_model(llama3_folder)
    for prompt, ban, out in zip(prompts, bans, banned, strict=True):
        assert ban not in out
        assert out == _hf_greedy_banning(hf, prompt, ban, NEW_TOKENS)


def test_rows_coming_and_going_keep_their_own_state(llm, llama3_folder, prompts):
    """Requests with different bans (and some without) arrive while others finish, so later
    ones take the freed rows of earlier ones: each gives what it gives alone."""
    free = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False))
    requests = [(prompts[i % 3], _greedy(ban=None if i % 4 == 3 else free[i % 3][i % 2],
                                         max_tokens=2 + 3 * (i % 3))) for i in range(9)]
    alone = [_tokens(llm.generate([p], [sp], use_tqdm=False))[0] for p, sp in requests]
    engine = make_llm(llama3_folder, logits_processors=[BAN_TOKEN]).engine
    # A batch of one row to start with: it grows, and takes back finished rows for newcomers.
    runner = engine.executor.runner
    batch = runner.sampling = SamplingBatch(runner.arch.vocab_size, runner.device, capacity=1,
                                            processors=runner.sampling.processors)
    ids, done = [], {}
    while len(ids) < len(requests) or engine.has_unfinished_requests():
        if len(ids) < len(requests):  # one arrives each step while others finish
            ids.append(engine.add_request(*requests[len(ids)]))
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    assert len(batch.generators) < len(requests)  # rows were taken back and given again
    assert [done[i].outputs[0].token_ids for i in ids] == alone


def test_bad_extra_args_are_refused_at_admission(llm, prompts):
    with pytest.raises(ValueError, match="ban_token must be a token id") as info:
        llm.generate(prompts[:1], [_greedy(ban=-3)], use_tqdm=False)
    assert info.value.param == "extra_args"
    # The engine still serves after the refusal.
    assert llm.generate(prompts[:1], [_greedy()], use_tqdm=False)


def test_classes_are_taken_as_given(llama3_folder, prompts):
    llm = make_llm(llama3_folder, logits_processors=[BanToken])
    ban = _tokens(llm.generate(prompts[:1], [_greedy()], use_tqdm=False))[0][0]
    assert ban not in _tokens(llm.generate(prompts[:1], [_greedy(ban)], use_tqdm=False))[0]


@pytest.mark.parametrize("name, why", [
    # `pagedserve serve` (the console script) does not put the working folder on sys.path.
    ("tests.sample.no_such_module:BanToken", "cannot import it.*on PYTHONPATH"),
    ("tests.sample.ban_token:NoSuchClass", "cannot import it"),
    ("tests.sample.ban_token.torch", "not a subclass"),
])
def test_unimportable_names_are_config_errors(llama3_folder, name, why):
    with pytest.raises(ConfigError, match=f"--logits-processors {name}.*{why}"):
        make_llm(llama3_folder, logits_processors=[name])


def test_refused_with_speculative_decoding(llama3_folder):
    with pytest.raises(ConfigError, match="--logits-processors does not combine with "
                                          "--speculative-config"):
        make_llm(llama3_folder, logits_processors=[BAN_TOKEN],
                 speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_none_is_no_processors_as_in_vllm(llama3_folder, prompts):
    """vLLM's ``LLM(logits_processors=None)`` is its default: here too, not a ConfigError."""
    llm = make_llm(llama3_folder, logits_processors=None)
    assert llm.engine.limits.logits_processors == ()
    assert len(llm.generate(prompts[:1], _greedy(), use_tqdm=False)[0].outputs[0].token_ids) \
        == NEW_TOKENS
