"""Tensor parallelism on the CPU: two ranks over gloo give the tokens one rank gives."""

from __future__ import annotations

import pytest

from pagedserve import SamplingParams
from tests.tiny_models import make_llm, random_prompts, write_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts("tp", [5, 17, 40, 3])

# (architecture, config overrides): KV heads per rank 1 (llama3: 2 of 8 heads; qwen2: 2 of 4,
# with q/k/v biases and a tied head), and fewer KV heads than ranks (mistral: 1, replicated);
# the odd vocabularies pad the last rank's slice of the embedding and the LM head.
CASES = {
    "llama3": ("llama3", {}),
    "qwen2-bias-tied-odd-vocab": ("qwen2", {"vocab_size": 385}),
    "mistral-one-kv-head-odd-vocab": ("mistral", {"vocab_size": 387}),
}


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [c.token_ids for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_give_one_ranks_greedy_tokens(tmp_path, case):
    arch, overrides = CASES[case]
    folder = write_tiny_model(tmp_path / arch, arch, **overrides)
    expected = _tokens(make_llm(folder), PROMPTS, GREEDY)
    llm = make_llm(folder, tensor_parallel_size=2)
    try:
        assert _tokens(llm, PROMPTS, GREEDY) == expected
    finally:
        llm.engine.shutdown()
