"""LoRA with two tensor-parallel CPU ranks over gloo: A and B cut with their base layers
(column-parallel B of q/k/v and gate/up, row-parallel A of o and down, whose partial deltas the
all-reduce sums) give PEFT's greedy tokens, adapters swapped through one slot mid-run; the
other rank runs the weights the engine read at admission, never reading the folder itself."""

from __future__ import annotations

import shutil

import pytest

from pagedserve import LoRARequest, SamplingParams
from tests.lora.peft_adapters import ADAPTER_SPECS, base_model, peft_model, write_adapter
from tests.tiny_models import hf_greedy, make_llm, random_prompts

NEW_TOKENS = 8


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "phi3", "granite"])
def test_two_ranks_equal_peft(tiny_model_folder, tmp_path, arch):
    base = tiny_model_folder(arch)
    names = ["all", "mixed"]
    requests = [LoRARequest(n, i + 1, str(write_adapter(base, tmp_path / n, ADAPTER_SPECS[n],
                                                        seed=20 + i)))
                for i, n in enumerate(names)]
    order = [requests[0], None, requests[1], requests[0]]
    prompts = random_prompts(f"lora-tp-{arch}", [7, 12, 9, 15])
    llm = make_llm(base, tensor_parallel_size=2, enable_lora=True, max_loras=1,
                   max_lora_rank=8)
    try:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                       ignore_eos=True),
                               use_tqdm=False, lora_request=order)
    finally:
        llm.engine.shutdown()
    for prompt, request, out in zip(prompts, order, outputs):
        ref = (base_model(base) if request is None
               else peft_model(base, tmp_path / request.lora_name))
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NEW_TOKENS), request


@pytest.mark.slow
def test_a_removed_adapter_is_forgotten_on_every_rank(tiny_model_folder, tmp_path):
    """The id of a removed adapter, reused for another: both ranks read the new one (a rank
    that kept the old one's slot would add its delta to its half)."""
    base = tiny_model_folder("llama3")
    first, second = (write_adapter(base, tmp_path / n, ADAPTER_SPECS[n], seed=30 + i)
                     for i, n in enumerate(["all", "mixed"]))
    prompt = random_prompts("lora-tp-remove", [9])[0]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm = make_llm(base, tensor_parallel_size=2, enable_lora=True, max_loras=1,
                   max_lora_rank=8)
    try:
        llm.generate([prompt], params, use_tqdm=False,
                     lora_request=LoRARequest("first", 1, str(first)))
        llm.engine.remove_lora(1)
        out = llm.generate([prompt], params, use_tqdm=False,
                           lora_request=LoRARequest("second", 1, str(second)))
    finally:
        llm.engine.shutdown()
    assert out[0].outputs[0].token_ids == hf_greedy(peft_model(base, second), prompt, NEW_TOKENS)


@pytest.mark.slow
def test_the_other_rank_runs_the_weights_read_at_admission(tiny_model_folder, tmp_path):
    """The folder is gone before the first step: a rank that read it in the step would fail
    (and end the engine)."""
    base = tiny_model_folder("llama3")
    folder = write_adapter(base, tmp_path / "all", ADAPTER_SPECS["all"], seed=40)
    prompt = random_prompts("lora-tp-vanished", [9])[0]
    expected = hf_greedy(peft_model(base, folder), prompt, NEW_TOKENS)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm = make_llm(base, tensor_parallel_size=2, enable_lora=True, max_loras=1,
                   max_lora_rank=8)
    try:
        llm.engine.add_request(prompt, params, "r", LoRARequest("all", 1, str(folder)))
        shutil.rmtree(folder)
        tokens = None
        while llm.engine.has_unfinished_requests():
            tokens = [o.outputs[0].token_ids for o in llm.engine.step() if o.finished] or tokens
    finally:
        llm.engine.shutdown()
    assert tokens == [expected]
