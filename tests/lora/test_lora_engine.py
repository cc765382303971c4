"""The offline API with LoRA: greedy tokens of a mixed batch (the base model and more adapters
than ``max_loras``, so slots are swapped mid-run) equal PEFT's own ``generate`` for each
adapter; no step runs more adapters than there are slots; the prefix cache is keyed by the
adapter's content."""

from __future__ import annotations

import pytest

from pagedserve import LoRARequest, SamplingParams
from pagedserve.errors import ConfigError
from tests.devices import HAS_NVIDIA, NVIDIA_REASON
from tests.lora.peft_adapters import ADAPTER_SPECS, base_model, peft_model, write_adapter
from tests.tiny_models import assert_greedy_matches, hf_greedy, make_llm, random_prompts

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_folder, tmp_path_factory):
    base = tiny_model_folder("llama3")
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(base, root / name, spec, seed=10 + i)
            for i, (name, spec) in enumerate(ADAPTER_SPECS.items())}


def _requests(adapters) -> list[LoRARequest]:
    return [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]


def _record_steps(llm) -> list[set[int]]:
    """The adapters of every step that ran any."""
    slots = llm.engine.executor.runner.lora
    steps, row_slots = [], slots.row_slots

    def recording(requests, *args):
        steps.append({r.lora_int_id for r in requests if r is not None})
        return row_slots(requests, *args)

    slots.row_slots = recording
    return steps


def test_mixed_batch_equals_peft_generate(llama3_folder, adapters):
    requests = _requests(adapters)
    llm = make_llm(llama3_folder, enable_lora=True, max_loras=2, max_lora_rank=8,
                   max_cpu_loras=3, max_num_seqs=4)
    steps = _record_steps(llm)
    order = [None, *requests, None, *requests[::-1]]
    prompts = random_prompts("lora-engine", [11, 6, 14, 9, 7, 12, 5, 10, 8, 13])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=order)
    for prompt, request, out in zip(prompts, order, outputs):
        ref = (base_model(llama3_folder) if request is None
               else peft_model(llama3_folder, adapters[request.lora_name]))
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NEW_TOKENS), request
    assert steps and max(len(s) for s in steps) <= 2
    assert llm.engine.executor.runner.lora.loads > 2  # slots were reused mid-run


def test_prefix_cache_is_keyed_by_adapter_content(llama3_folder, adapters):
    llm = make_llm(llama3_folder, enable_lora=True, max_loras=2, max_lora_rank=8,
                   enable_prefix_caching=True)
    prompt = random_prompts("lora-prefix", [40])[0]
    attn, other = _requests(adapters)[:2]
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=attn)
    stats = llm.engine.kv.prefix_stats
    hits = stats.hit_tokens
    # The same prompt under another adapter: no block of the first is reused.
    second = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=other)
    assert stats.hit_tokens == hits
    assert second[0].outputs[0].token_ids == hf_greedy(
        peft_model(llama3_folder, adapters[other.lora_name]), prompt, NEW_TOKENS)
    # The first adapter again under another name and id: its blocks are hit.
    renamed = LoRARequest("attn-again", 99, attn.lora_path)
    third = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=renamed)
    assert stats.hit_tokens > hits
    assert third[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    # The base model shares nothing with the adapters either.
    base_hits = stats.hit_tokens
    base = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert stats.hit_tokens == base_hits
    assert base[0].outputs[0].token_ids == hf_greedy(base_model(llama3_folder), prompt,
                                                     NEW_TOKENS)


def test_lora_errors(llama3_folder, adapters):
    attn = _requests(adapters)[0]
    plain = make_llm(llama3_folder)
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.generate(["hi"], GREEDY, use_tqdm=False, lora_request=attn)
    small = make_llm(llama3_folder, enable_lora=True, max_lora_rank=2)
    with pytest.raises(ValueError, match="above --max-lora-rank 2"):
        small.generate(["hi"], GREEDY, use_tqdm=False, lora_request=attn)
    with pytest.raises(ValueError, match="2 prompts but 1 LoRA"):
        small.generate(["a", "b"], GREEDY, use_tqdm=False, lora_request=[attn])
    with pytest.raises(ConfigError, match="--max-cpu-loras"):
        make_llm(llama3_folder, enable_lora=True, max_loras=3, max_cpu_loras=2)
    # Slots past the device's memory: named before allocating (it was the allocator's error).
    with pytest.raises(ConfigError, match="--max-lora-rank 10000000000000 take"):
        make_llm(llama3_folder, enable_lora=True, max_lora_rank=10**13)
    with pytest.raises(TypeError, match="lora_request must be"):
        small.generate(["a"], GREEDY, use_tqdm=False, lora_request="attn")


def test_an_id_in_use_for_another_folder_is_refused(llama3_folder, adapters):
    """The ranks keep adapters by id: the second folder under the first's id would run the
    first adapter. After remove_lora the id may name another folder."""
    first, second = _requests(adapters)[:2]
    llm = make_llm(llama3_folder, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompt = random_prompts("lora-reuse", [9])
    llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=first)
    reused = LoRARequest(second.lora_name, first.lora_int_id, second.lora_path)
    with pytest.raises(ValueError, match=f"lora_int_id {first.lora_int_id} is in use"):
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=reused)
    llm.engine.remove_lora(first.lora_int_id)
    out = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=reused)
    assert out[0].outputs[0].token_ids == hf_greedy(
        peft_model(llama3_folder, adapters[second.lora_name]), prompt[0], NEW_TOKENS)


def test_an_adapter_of_another_model_is_refused_before_it_runs(llama3_folder, tiny_model_folder,
                                                               tmp_path):
    qwen_adapter = write_adapter(tiny_model_folder("qwen2"), tmp_path / "q",
                                 ADAPTER_SPECS["all"], seed=1)
    llm = make_llm(llama3_folder, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match=r"layer 0 down_proj shard 0 is \(64, 160\), the "
                                         r"model's \(64, 128\)"):
        llm.generate(["hi"], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("qwen", 1, str(qwen_adapter)))
    assert not llm.engine.scheduler.has_unfinished


class _CostlyDrafts:
    """A step-time model in which a draft of a sequence decoding alone pays only at an
    acceptance rate above 1/3 (each token costs half a step's fixed time)."""

    def record(self, num_tokens: int, verifies: bool, seconds: float) -> None:
        pass

    def coefficients(self) -> tuple[float, float, float]:
        return 1.0, 0.5, 0.0


def test_an_adapter_rejecting_drafts_leaves_the_base_model_drafting(llama3_folder, adapters):
    """The draft model runs without adapters: an adapter's requests reject its drafts, which
    must not stop the base model's requests, whose drafts the target accepts, from drafting."""
    llm = make_llm(llama3_folder, enable_lora=True, max_lora_rank=8,
                   speculative_config={"model": str(llama3_folder), "num_speculative_tokens": 3})
    speculation = llm.engine.speculation
    speculation.step_times = _CostlyDrafts()
    prompts = random_prompts("lora-spec", [9, 12, 7, 10])
    for prompt in prompts:
        llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=_requests(adapters)[0])
    counters = speculation.counters
    drafted, accepted = counters.num_draft_tokens, counters.num_accepted_tokens
    base = base_model(llama3_folder)
    for prompt in prompts:
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(base, prompt, NEW_TOKENS)
    assert counters.num_draft_tokens - drafted > 0
    assert counters.num_accepted_tokens - accepted == counters.num_draft_tokens - drafted


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_NVIDIA, reason=NVIDIA_REASON)
def test_cuda_with_graphs_equals_peft(llama3_folder, adapters):
    """On a GPU the Triton kernels run, and decode steps with adapters replay CUDA graphs
    (slots are a graph input): each adapter against PEFT, and a mixed batch against the same
    prompts run one adapter at a time."""
    requests = _requests(adapters)
    llm = make_llm(llama3_folder, device="cuda", dtype="float32",
                   kv_cache_memory_bytes=64 << 20, enable_lora=True, max_loras=2,
                   max_lora_rank=8, max_cpu_loras=4)
    prompts = random_prompts("lora-cuda", [11, 6, 14, 9])
    alone = []
    for request in requests:
        ref = peft_model(llama3_folder, adapters[request.lora_name])
        assert_greedy_matches(llm, ref, prompts, NEW_TOKENS, lora_request=request)
        alone.append(llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=request))
    mixed = llm.generate(prompts[:1] * len(requests), GREEDY, use_tqdm=False,
                         lora_request=requests)
    assert [o.outputs[0].token_ids for o in mixed] == [
        a[0].outputs[0].token_ids for a in alone]
