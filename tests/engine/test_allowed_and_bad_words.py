"""allowed_token_ids and bad_words through the engine: greedy output equals transformers'
greedy decoding with the same tokens masked, step by step, with and without drafts to verify."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve import SamplingParams
from tests.engine.test_speculative import NGRAM, OracleProposer
from tests.engine.test_speculative_lossless import FreeDrafts
from tests.tiny_models import hf_model, make_llm, random_prompts

NEW_TOKENS = 12


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def _hf_greedy_banning(hf, prompt: list[int], banned) -> list[int]:
    """transformers' greedy tokens with ``banned(output so far)`` set to -inf at each step."""
    out: list[int] = []
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].double()
        logits[sorted(banned(out))] = -math.inf
        out.append(int(logits.argmax()))
    return out


def _ends_with(tokens: list[int], prefix: list[int]) -> bool:
    return tokens[len(tokens) - len(prefix):] == prefix


@pytest.fixture(scope="module")
def llm(llama3_folder):
    return make_llm(llama3_folder)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts("bad-words", [5, 11, 8])


def test_allowed_token_ids_equal_transformers_masked(llm, llama3_folder, prompts):
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]
    # Every token greedy picks freely is left out, so the mask must act at every step.
    allowed = sorted(set(range(3, 80)) - {t for out in free for t in out})
    outputs = llm.generate(prompts, _greedy(allowed_token_ids=allowed), use_tqdm=False)
    forbidden = set(range(llm.engine.limits.vocab_size)) - set(allowed)
    hf = hf_model(llama3_folder)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert set(out.outputs[0].token_ids) <= set(allowed)
        assert out.outputs[0].token_ids == _hf_greedy_banning(hf, prompt, lambda _: forbidden)


def _variants(tokenizer, word: str) -> list[list[int]]:
    """vLLM's token sequences of a bad word: as typed, and after a space where that folds the
    space into the first token."""
    plain, spaced = (tokenizer.encode(text, add_special_tokens=False)
                     for text in (word.lstrip(), " " + word.lstrip()))
    return [plain] + ([spaced] if len(spaced) == len(plain) and spaced[0] != plain[0] else [])


def _two_token_bad_word(tokenizer, outputs: list[list[int]]) -> tuple[int, str, list[int]]:
    """A word whose tokens are two consecutive tokens of a free greedy output (most pairs of
    a random model's tokens decode to text that tokenizes otherwise), with that output's
    index."""
    for i, out in enumerate(outputs):
        for j in range(len(out) - 1):
            word = tokenizer.decode(out[j:j + 2])
            if word.strip() and out[j:j + 2] in _variants(tokenizer, word):
                return i, word, out[j:j + 2]
    raise AssertionError("no two output tokens make a word that tokenizes back to them")


@pytest.mark.parametrize("speculative", [False, True])
def test_a_bad_word_never_appears_and_greedy_equals_transformers(llama3_folder, prompts,
                                                                 speculative):
    """With drafts from the free output (which holds the word), verification must reject
    the draft that completes it, as plain decoding bans it."""
    plain = make_llm(llama3_folder)
    candidates = random_prompts("bad-word-candidates", [6] * 24)
    free = [o.outputs[0].token_ids
            for o in plain.generate(candidates, _greedy(), use_tqdm=False)]
    tokenizer = plain.get_tokenizer()
    found, word, pair = _two_token_bad_word(tokenizer, free)
    prompts = [candidates[found], *prompts]
    free = [free[found], *(o.outputs[0].token_ids
                           for o in plain.generate(prompts[1:], _greedy(), use_tqdm=False))]
    llm = plain
    if speculative:
        llm = make_llm(llama3_folder, speculative_config=NGRAM)
        llm.engine.speculation.proposer = OracleProposer(
            {tuple(p): out for p, out in zip(prompts, free, strict=True)})
        llm.engine.speculation.step_times = FreeDrafts()
    outputs = [o.outputs[0].token_ids
               for o in llm.generate(prompts, _greedy(bad_words=[word]), use_tqdm=False)]
    variants = _variants(tokenizer, word)
    hf = hf_model(llama3_folder)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert all(out[j:j + 2] != pair for j in range(len(out) - 1))
        assert out == _hf_greedy_banning(
            hf, prompt, lambda so_far: {v[-1] for v in variants if _ends_with(so_far, v[:-1])})
    assert outputs != free
    if speculative:
        counters = llm.engine.speculation.counters
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens


def test_bad_words_are_tokenized_once_as_typed_and_after_a_space(llm):
    """"fox" mid-text is " fox", one token of its own in a byte-level BPE: both forms are
    banned. A word's leading spaces are dropped before its forms are made."""
    encode = llm.get_tokenizer().encode
    state = llm.engine.inputs.process("tokenized", [5, 6],
                                      _greedy(bad_words=["fox", "  quick brown"]))
    plain, spaced = encode("fox", add_special_tokens=False), encode(" fox",
                                                                    add_special_tokens=False)
    assert len(spaced) == len(plain) and spaced[0] != plain[0]
    assert state.params.bad_words_token_ids == [
        plain, spaced, *_variants(llm.get_tokenizer(), "quick brown")]
    assert state.group.seqs[0].params.bad_words_token_ids == state.params.bad_words_token_ids


def test_bad_words_token_ids_given_by_the_caller_are_refused(llm):
    """The field is the engine's, made from ``bad_words`` at admission: a value the caller
    sets used to be replaced without a word (``[[5]]`` banned nothing), so it is refused."""
    prompt = random_prompts("given-ids", [6])[0]
    with pytest.raises(ValueError, match="bad_words_token_ids") as refused:
        llm.generate([prompt], _greedy(bad_words_token_ids=[[5]]), use_tqdm=False)
    assert refused.value.param == "bad_words_token_ids"
    assert "bad_words" in str(refused.value)
    # The same params object may go to engines of different tokenizers: it is never changed.
    params = _greedy(bad_words=["fox"])
    llm.generate([prompt], params, use_tqdm=False)
    assert params.bad_words_token_ids is None
    llm.generate([prompt], params, use_tqdm=False)
