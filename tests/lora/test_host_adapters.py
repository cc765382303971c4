"""An adapter's weights are read when its request is admitted, and stay in host memory while
any request runs with it: an adapter whose folder vanishes fails its own new requests alone
(the audit's case: it had dropped out of host memory, and the step that re-read its folder
failed every request in flight), and one whose folder vanishes after admission still runs."""

from __future__ import annotations

import shutil

import pytest

from pagedserve import LoRARequest, SamplingParams
from tests.kv_checks import assert_pools_full
from tests.lora.peft_adapters import ADAPTER_SPECS, peft_model, write_adapter
from tests.tiny_models import hf_greedy, make_llm, random_prompts

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture
def adapters(llama3_folder, tmp_path) -> dict[str, LoRARequest]:
    """A fresh folder per test, since the tests delete them."""
    return {name: LoRARequest(name, i + 1, str(write_adapter(
                llama3_folder, tmp_path / name, spec, seed=20 + i)))
            for i, (name, spec) in enumerate(ADAPTER_SPECS.items())}


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams, LoRARequest | None]]
         ) -> dict[str, list[int]]:
    """Queue the requests, step until all are done; each one's tokens."""
    for request_id, (prompt, params, lora) in requests.items():
        engine.add_request(prompt, params, request_id, lora)
    return _drain(engine)


def _drain(engine) -> dict[str, list[int]]:
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens


def test_a_vanished_adapter_fails_alone(llama3_folder, adapters):
    llm = make_llm(llama3_folder, enable_lora=True, max_loras=2, max_lora_rank=8,
                   max_cpu_loras=2)
    engine = llm.engine
    gone, attn, mlp, mixed = (adapters[n] for n in ("all", "attn", "mlp_rslora", "mixed"))
    short = random_prompts("vanished", [6])[0]
    _run(engine, {"g": (short, GREEDY, gone)})
    # Two other adapters push it out of host memory (max_cpu_loras 2).
    _run(engine, {"m": (short, GREEDY, mlp), "x": (short, GREEDY, mixed)})
    shutil.rmtree(gone.lora_path)
    prompts = random_prompts("vanished-long", [9, 11])
    engine.add_request(prompts[0], LONG, "base", None)
    engine.add_request(prompts[1], LONG, "attn", attn)
    first = engine.step()  # both are running when the vanished adapter's request comes
    with pytest.raises(ValueError, match="no such folder"):
        engine.add_request(short, GREEDY, "gone", gone)
    tokens = _drain(engine)
    assert not first or not any(o.finished for o in first)
    assert set(tokens) == {"base", "attn"}
    assert tokens["attn"] == hf_greedy(peft_model(llama3_folder, attn.lora_path), prompts[1],
                                       LONG.max_tokens)
    assert len(tokens["base"]) == LONG.max_tokens
    assert_pools_full(engine.kv)


def test_an_adapter_read_at_admission_runs_after_its_folder_vanishes(llama3_folder, adapters):
    """Queued behind other adapters (one sequence at a time), past --max-cpu-loras adapters
    admitted after it: its weights stay in host memory until its request ends."""
    llm = make_llm(llama3_folder, enable_lora=True, max_loras=2, max_lora_rank=8,
                   max_cpu_loras=2, max_num_seqs=1)
    engine = llm.engine
    gone, mlp, mixed = (adapters[n] for n in ("all", "mlp_rslora", "mixed"))
    prompt = random_prompts("vanished-queued", [7])[0]
    reference = hf_greedy(peft_model(llama3_folder, gone.lora_path), prompt, GREEDY.max_tokens)
    engine.add_request(prompt, GREEDY, "m", mlp)
    engine.add_request(prompt, GREEDY, "x", mixed)
    engine.add_request(prompt, GREEDY, "g", gone)
    shutil.rmtree(gone.lora_path)
    tokens = _drain(engine)
    assert tokens["g"] == reference
    assert_pools_full(engine.kv)
