"""--max-logprobs: the most logprobs and prompt_logprobs a request may ask for is the engine's
option (vLLM's default 20; -1: the vocabulary), checked by its input stage, and the sampler
returns as many as it allows, equal to transformers' log_softmax."""

from __future__ import annotations

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.sampling_params import InvalidSamplingParam
from tests.tiny_models import VOCAB, hf_model, make_llm, random_prompts

PROMPT = random_prompts("max-logprobs", [12])[0]
NEW_TOKENS = 4


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_default_refuses_21_naming_the_option(llama3_folder, name):
    llm = make_llm(llama3_folder, num_blocks=8)
    with pytest.raises(InvalidSamplingParam, match="--max-logprobs") as info:
        llm.generate([PROMPT], SamplingParams(max_tokens=2, **{name: 21}), use_tqdm=False)
    assert info.value.param == name
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, **{name: 20}), use_tqdm=False)
    assert out[0].finished


def _reference(folder, tokens: list[int]) -> torch.Tensor:
    """transformers' float64 log_softmax at each position, predicting the next token."""
    with torch.no_grad():
        logits = hf_model(folder)(torch.tensor([tokens])).logits[0]
    return logits.double().log_softmax(-1)


def _assert_top_k(got: dict, reference: torch.Tensor, chosen: int, k: int) -> None:
    """``got`` holds the chosen token and the top ``k``: each logprob is the reference's, and
    the top k are the reference's k most likely (up to rounding at the k-th place)."""
    for token_id, logprob in got.items():
        assert logprob.logprob == pytest.approx(reference[token_id].item(), abs=1e-4)
    top = [t for t, lp in got.items() if lp.rank <= k]
    assert len(top) == k and chosen in got
    kth = reference.sort(descending=True).values[k - 1].item()
    assert all(reference[t].item() >= kth - 1e-4 for t in top)


def test_50_allowed_by_the_option_match_transformers(llama3_folder):
    llm = make_llm(llama3_folder, num_blocks=8, max_logprobs=50)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=50, prompt_logprobs=50)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    sample = out.outputs[0].token_ids
    reference = _reference(llama3_folder, PROMPT + sample)
    for i, token_id in enumerate(sample):
        _assert_top_k(out.outputs[0].logprobs[i], reference[len(PROMPT) - 1 + i], token_id, 50)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(PROMPT)):
        _assert_top_k(out.prompt_logprobs[i], reference[i - 1], PROMPT[i], 50)


def test_minus_one_allows_the_vocabulary(llama3_folder):
    llm = make_llm(llama3_folder, num_blocks=8, max_logprobs=-1)
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=VOCAB)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    reference = _reference(llama3_folder, PROMPT + out.outputs[0].token_ids)
    _assert_top_k(out.outputs[0].logprobs[0], reference[len(PROMPT) - 1],
                  out.outputs[0].token_ids[0], VOCAB)
    with pytest.raises(InvalidSamplingParam, match="--max-logprobs"):
        llm.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=VOCAB + 1), use_tqdm=False)
