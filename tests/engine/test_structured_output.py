"""Constrained decoding in the engine on the default model: outputs match their schema,
regex or choice at n > 1; free requests batched with constrained ones are untouched; and
preemption (recompute and swap), async scheduling and aborts keep both valid and leak nothing.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve import SamplingParams, StructuredOutputsParams
from pagedserve.structured.spec import grammar_spec
from tests.kv_checks import assert_pools_full
from tests.tiny_models import make_llm

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
             "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
DATE = r"\d{4}-(0[1-9]|1[0-2])-[0-3]\d"
COLORS = ["red", "green", "light blue"]
PROMPTS = ["Describe a person as JSON:", "Today's date is", "My favourite colour is",
           "Write a poem about the sea."]


def _constrained() -> list[SamplingParams]:
    common = dict(max_tokens=48, temperature=0.9, seed=7, n=3)
    return [SamplingParams(**common, structured_outputs=StructuredOutputsParams(json=PERSON)),
            SamplingParams(**common, structured_outputs=StructuredOutputsParams(regex=DATE)),
            SamplingParams(**common, structured_outputs=StructuredOutputsParams(choice=COLORS))]


def _assert_valid(outputs) -> None:
    for output, check in zip(outputs, (_valid_person, _valid_date, _valid_choice)):
        assert len(output.outputs) == 3
        for choice in output.outputs:
            assert choice.finish_reason == "stop", choice
            check(choice.text)


def _valid_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def _valid_date(text: str) -> None:
    assert re.fullmatch(DATE, text), text


def _valid_choice(text: str) -> None:
    assert text in COLORS, text


def test_constrained_outputs_match_at_n3(default_llm):
    outputs = default_llm.generate(PROMPTS[:3], _constrained(), use_tqdm=False)
    _assert_valid(outputs)
    # n = 3 seeded streams are three draws, not one copied.
    assert len({c.text for c in outputs[0].outputs}) > 1


@pytest.mark.slow
def test_free_requests_are_untouched_by_constrained_neighbours(default_llm):
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = default_llm.generate(PROMPTS, free, use_tqdm=False)
    mixed = default_llm.generate(PROMPTS + PROMPTS[:3], [free] * 4 + _constrained(),
                                 use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == \
        [o.outputs[0].token_ids for o in alone]
    _assert_valid(mixed[4:])
    assert_pools_full(default_llm.engine.kv)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_chunking_and_async_scheduling_keep_outputs_valid(default_model_folder,
                                                                    mode):
    """A pool of 14 blocks cannot hold the batch: groups are preempted and come back, with
    async scheduling on, which constrained requests turn to one step at a time. A budget of
    16 tokens a step splits the constrained requests' longer prompts into chunks, and only
    their last chunk samples (and is masked)."""
    llm = make_llm(default_model_folder, num_blocks=14, async_scheduling=True,
                   preemption_mode=mode, swap_space=0.05, max_num_batched_tokens=16)
    free = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    long_prompts = [f"Answer carefully, briefly and exactly in the format that is asked for, "
                    f"with nothing before or after it. {p}"
                    for p in PROMPTS[:3]]
    assert all(len(llm.get_tokenizer().encode(p)) > 16 for p in long_prompts)
    # Compiled beforehand, so the constrained requests join the batch at once, however long
    # the compile worker takes to start.
    for params in _constrained():
        llm.engine.grammars.get(grammar_spec(params.structured_outputs)).result()
    outputs = llm.generate(PROMPTS + long_prompts, [free] * 4 + _constrained(),
                           use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_valid(outputs[4:])
    assert all(len(o.outputs[0].token_ids) == 32 for o in outputs[:4])
    assert_pools_full(llm.engine.kv)


def test_async_scheduling_runs_ahead_with_the_same_tokens(default_llm, default_model_folder):
    """Constrained requests do not stop the engine from running ahead: their masks are built
    between a step's forward pass and its sampling. Greedy outputs, constrained and free,
    equal those of the engine running one step at a time."""
    llm = make_llm(default_model_folder, async_scheduling=True,
                   kv_cache_memory_bytes=64 << 20)
    engine, ran_ahead = llm.engine, []
    schedule = engine.scheduler.schedule

    def logged(schedule_pending: bool = False, **kwargs):
        ran_ahead.append(schedule_pending)
        return schedule(schedule_pending=schedule_pending, **kwargs)

    engine.scheduler.schedule = logged
    greedy = [SamplingParams(max_tokens=40, temperature=0, structured_outputs=s)
              for s in (StructuredOutputsParams(json=PERSON),
                        StructuredOutputsParams(regex=DATE),
                        StructuredOutputsParams(choice=COLORS))]
    free = SamplingParams(max_tokens=24, temperature=0)
    params = greedy + [free] * 3
    prompts = PROMPTS[:3] + PROMPTS[1:]
    ahead = llm.generate(prompts, params, use_tqdm=False)
    assert all(ran_ahead[1:]) and len(ran_ahead) > 10
    one_at_a_time = default_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ahead] == \
        [o.outputs[0].token_ids for o in one_at_a_time]
    _valid_person(ahead[0].outputs[0].text)
    _valid_date(ahead[1].outputs[0].text)
    _valid_choice(ahead[2].outputs[0].text)
    assert_pools_full(engine.kv)


def test_abort_while_the_grammar_compiles(default_llm):
    engine = default_llm.engine
    schema = {"type": "object", "properties": {"abort_me": {"type": "boolean"}}}
    request_id = engine.add_request("x", SamplingParams(
        structured_outputs=StructuredOutputsParams(json=schema)))
    engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert_pools_full(engine.kv)


def test_a_request_whose_grammar_compiles_counts_as_waiting(default_llm):
    """It waits outside the scheduler's queues; /metrics' num_requests_waiting (vLLM counts
    such requests as waiting) showed nothing running and nothing waiting meanwhile."""
    engine = default_llm.engine
    schema = {"type": "object", "properties": {"count_me": {"type": "boolean"}}}
    request_id = engine.add_request("x", SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema)))
    stats = engine.stats()  # the grammar is admitted by a step, none has run
    assert (stats.num_waiting, stats.num_running) == (1, 0)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_running) == (0, 0)
    assert request_id not in engine.outputs.requests


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(default_llm, monkeypatch):
    from pagedserve.structured import compiler

    real = compiler.to_grammar

    def to_grammar(spec):
        if spec.text == "fail(s)?":
            raise RuntimeError("compiler on fire")
        return real(spec)

    monkeypatch.setattr(compiler, "to_grammar", to_grammar)
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        regex="fail(s)?"))
    good = SamplingParams(max_tokens=8, temperature=0)
    failed, served = default_llm.generate(PROMPTS[:2], [bad, good], use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert len(served.outputs[0].token_ids) == 8
    assert_pools_full(default_llm.engine.kv)


@pytest.mark.parametrize("structured", [
    StructuredOutputsParams(regex="[^\\s\\S]"),
    StructuredOutputsParams(json={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
], ids=["regex-of-nothing", "self-referring-schema"])
def test_a_grammar_that_accepts_nothing_is_refused(default_llm, structured):
    """No first token, not even a stop, satisfies it: the request is refused (the server's
    400) instead of sampling from an empty mask."""
    engine = default_llm.engine
    request_id = engine.add_request("x", SamplingParams(max_tokens=8,
                                                        structured_outputs=structured))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        if request_id in engine.refused:
            break
    refusal = engine.refused[request_id]
    assert refusal.param == "structured_outputs" and "accepts no output" in str(refusal)
    assert [o.outputs[0].finish_reason for o in outputs] == ["error"]
    assert not engine.has_unfinished_requests()
    assert_pools_full(engine.kv)


def test_grammar_ends_the_output_without_eos(default_llm):
    """With ignore_eos the grammar still ends the stream once it is complete."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=COLORS))
    out = default_llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0]
    assert out.text in COLORS and out.finish_reason == "stop"
