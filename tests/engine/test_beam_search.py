"""Beam search equals Hugging Face transformers' ``generate(num_beams=...)`` token for token."""

from __future__ import annotations

import random

import pytest

from pagedserve import SamplingParams
from tests.kv_checks import assert_pools_full
from tests.tiny_models import hf_beams, hf_model, make_llm, random_tokens

WIDTH = 4
NEW_TOKENS = 20
# (length_penalty, early_stopping, num_return_sequences)
CASES = [(1.0, False, 4), (0.0, True, 1), (2.0, "never", 4), (-1.0, False, 1),
         (1.0, True, 4), (0.5, "never", 1)]


def _beam_params(n: int, length_penalty: float, early_stopping, stop: int) -> SamplingParams:
    return SamplingParams(n=n, best_of=WIDTH, use_beam_search=True, max_tokens=NEW_TOKENS,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          ignore_eos=True, stop_token_ids=[stop])


@pytest.mark.parametrize(("length_penalty", "early_stopping", "n"), CASES)
def test_beam_search_matches_transformers_on_a_random_llama(llama3_folder, length_penalty,
                                                              early_stopping, n):
    hf = hf_model(llama3_folder)
    rng = random.Random(f"{length_penalty}-{early_stopping}-{n}")
    prompts = [random_tokens(rng, rng.randint(3, 30)) for _ in range(2)]
    # A stop token the beams actually produce, so hypotheses finish at different lengths.
    stops = [hf_beams(hf, p, WIDTH, WIDTH, NEW_TOKENS, eos=1)[rng.randrange(WIDTH)]
             [rng.randrange(2, 10)] for p in prompts]
    llm = make_llm(llama3_folder, block_size=4)
    outputs = llm.generate(prompts, [_beam_params(n, length_penalty, early_stopping, s)
                                     for s in stops], use_tqdm=False)
    for prompt, stop, out in zip(prompts, stops, outputs):
        expected = hf_beams(hf, prompt, WIDTH, n, NEW_TOKENS, eos=stop,
                            length_penalty=length_penalty, early_stopping=early_stopping)
        assert [c.token_ids for c in out.outputs] == expected
        assert all(c.finish_reason == ("stop" if c.token_ids[-1] == stop else "length")
                   for c in out.outputs)
    assert_pools_full(llm.engine.kv)

