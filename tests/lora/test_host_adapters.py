"""An adapter's weights are read when its request is admitted, and stay in host memory while
any request runs with it: an adapter whose folder vanishes fails its own new requests alone
(the audit's case: it had dropped out of host memory, and the step that re-read its folder
failed every request in flight), and one whose folder vanishes after admission still runs.
At most --max-cpu-loras adapters are in host memory: requests of others wait their turn."""

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
    """Queued behind other adapters (one sequence at a time), within --max-cpu-loras: its
    weights stay in host memory until its request ends."""
    llm = make_llm(llama3_folder, enable_lora=True, max_loras=2, max_lora_rank=8,
                   max_cpu_loras=3, max_num_seqs=1)
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


def test_an_adapter_queued_past_the_limit_whose_folder_vanishes_fails_alone(llama3_folder,
                                                                             adapters):
    """Admitted past --max-cpu-loras, it is read again when it can start; its folder gone by
    then, its request ends with an error and the others run."""
    llm = make_llm(llama3_folder, enable_lora=True, max_loras=2, max_lora_rank=8,
                   max_cpu_loras=2, max_num_seqs=1)
    engine = llm.engine
    gone, mlp, mixed = (adapters[n] for n in ("all", "mlp_rslora", "mixed"))
    prompt = random_prompts("vanished-past-limit", [7])[0]
    for request_id, lora in (("m", mlp), ("x", mixed), ("g", gone)):
        engine.add_request(prompt, GREEDY, request_id, lora)
    shutil.rmtree(gone.lora_path)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["g"].outputs[0].finish_reason == "error"
    assert [len(finished[r].outputs[0].token_ids) for r in "mx"] == [GREEDY.max_tokens] * 2
    assert_pools_full(engine.kv)


@pytest.fixture
def six_adapters(llama3_folder, tmp_path) -> list[LoRARequest]:
    specs = list(ADAPTER_SPECS.values())
    return [LoRARequest(f"a{i}", i + 1, str(write_adapter(
                llama3_folder, tmp_path / f"a{i}", specs[i % len(specs)], seed=40 + i)))
            for i in range(6)]


def _watch_host(engine, limit: int) -> list[int]:
    """Rank 0's count of adapters in host memory after each one is handed over, asserted
    within ``limit`` as it happens."""
    slots = engine.executor.step.runner.lora
    counts, add = [], slots.add

    def counted_add(lora_int_id, adapter):
        add(lora_int_id, adapter)
        counts.append(len(slots.host))
        assert len(slots.host) <= limit, f"{len(slots.host)} adapters in host memory"

    slots.add = counted_add
    return counts


def test_queued_adapters_past_max_cpu_loras_wait_their_turn(llama3_folder, six_adapters):
    """Six requests of six adapters queued at once with --max-cpu-loras 2: never more than two
    in host memory, and each request's output is PEFT's."""
    llm = make_llm(llama3_folder, enable_lora=True, max_loras=2, max_lora_rank=8,
                   max_cpu_loras=2, max_num_seqs=4)
    engine = llm.engine
    counts = _watch_host(engine, limit=2)
    prompts = random_prompts("six-adapters", [5, 9, 6, 8, 7, 10])
    tokens = _run(engine, {f"r{i}": (prompt, GREEDY, lora)
                           for i, (prompt, lora) in enumerate(zip(prompts, six_adapters))})
    assert len(counts) >= 6 and max(counts) == 2
    for i, (prompt, lora) in enumerate(zip(prompts, six_adapters)):
        assert tokens[f"r{i}"] == hf_greedy(peft_model(llama3_folder, lora.lora_path), prompt,
                                            GREEDY.max_tokens), lora.lora_name
    assert_pools_full(engine.kv)


def test_a_waiting_adapter_is_not_starved_by_busy_ones(llama3_folder, six_adapters):
    """Requests of the two held adapters keep coming while a third adapter's request waits:
    it still starts, once one of them drains, and the others keep running meanwhile."""
    llm = make_llm(llama3_folder, enable_lora=True, max_loras=2, max_lora_rank=8,
                   max_cpu_loras=2, max_num_seqs=4)
    engine = llm.engine
    _watch_host(engine, limit=2)
    busy, waiting = six_adapters[:2], six_adapters[2]
    prompt = random_prompts("starve", [6])[0]
    for i, lora in enumerate(busy):
        engine.add_request(prompt, LONG, f"busy{i}", lora)
    engine.step()
    engine.add_request(prompt, GREEDY, "waiting", waiting)
    finished, steps = set(), 0
    while "waiting" not in finished:
        steps += 1
        assert steps < 200, "the waiting adapter's request never started"
        if steps % 3 == 0:  # a request of each busy adapter every few steps
            for i, lora in enumerate(busy):
                engine.add_request(prompt, LONG, f"busy{i}-{steps}", lora)
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert any(r.startswith("busy1-") or r.startswith("busy0-") for r in finished)
    _drain(engine)
    assert_pools_full(engine.kv)
