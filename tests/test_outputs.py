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


def test_detokenize_false_leaves_the_logprob_tokens_undecoded(llama3_folder):
    """As in vLLM, ``detokenize=False`` decodes nothing: no text, and ``decoded_token`` None in
    the sampled and the prompt logprobs (it was each token's text)."""
    llm = make_llm(llama3_folder)
    prompt = random_prompts("undecoded", [6])[0]
    raw, text = (llm.generate([prompt], SamplingParams(
        max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=2, detokenize=d),
        use_tqdm=False)[0] for d in (False, True))
    assert raw.outputs[0].text == "" and raw.outputs[0].token_ids == text.outputs[0].token_ids
    for entries in (raw.outputs[0].logprobs, raw.prompt_logprobs[1:]):
        assert {lp.decoded_token for entry in entries for lp in entry.values()} == {None}
    decode = llm.get_tokenizer().decode
    for token, entry in zip(text.outputs[0].token_ids, text.outputs[0].logprobs, strict=True):
        assert entry[token].decoded_token == decode([token])
