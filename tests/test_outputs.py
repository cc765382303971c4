"""``RequestOutput`` and ``CompletionOutput`` read as vLLM's do."""

from __future__ import annotations

from pagedserve import SamplingParams
from tests.tiny_models import make_llm, random_prompts


def test_num_cached_tokens_is_a_field_as_in_vllm(llama3_folder):
    """vLLM's ``RequestOutput.num_cached_tokens``: the prompt tokens the prefix cache served
    (here also ``metrics.num_cached_tokens``)."""
    llm = make_llm(llama3_folder, enable_prefix_caching=True, block_size=16)
    prompt = random_prompts("cached", [40])[0]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == second.metrics.num_cached_tokens == 32  # 2 full blocks
