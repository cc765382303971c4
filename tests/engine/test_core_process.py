"""The engine core's loop, run in this process over stand-in sockets: what arrives during a
step enters the next one together, failures stay contained, and KV blocks come back."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import zmq

from pagedserve.config import EngineConfig
from pagedserve.engine import core_messages as msg
from pagedserve.engine.core_process import EngineCore
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import (
    InvalidSamplingParam,
    SamplingParams,
    StructuredOutputsParams,
)
from tests.tiny_models import write_tiny_model

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, output_kind="delta")
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, output_kind="delta")


class ScriptedCommands:
    """A PULL socket whose commands arrive in batches: batch i is what came in while the
    core's step i ran (the core drains a batch, then steps). After the script: Shutdown."""

    def __init__(self, batches: list[list[msg.Command]]) -> None:
        self.batches = [[msg.encode(c) for c in batch] for batch in batches]
        self.current: list[bytes] = []
        self.drained = True

    def poll(self, timeout: int) -> int:
        return 1

    def recv(self, flags: int = 0) -> bytes:
        if self.drained:  # a new receive: the next batch has arrived
            self.drained = False
            self.current = self.batches.pop(0) if self.batches else [msg.encode(msg.Shutdown())]
        if not self.current:
            self.drained = True
            raise zmq.Again()
        return self.current.pop(0)


class Outputs:
    def __init__(self) -> None:
        self.messages: list[msg.CoreOutputs] = []

    def send(self, data: bytes) -> None:
        self.messages.append(msg.decode_core_message(data))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama3"), "llama3")


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", max_model_len=256,
                                  kv_cache_memory_bytes=1 << 20))


def _run(engine: LLMEngine, batches) -> tuple[list[int], list[msg.CoreOutputs]]:
    """Run the loop over the script; returns how many requests were waiting at each step."""
    waiting, real_step = [], engine.step

    def counting_step():
        waiting.append(len(engine.scheduler.waiting))
        return real_step()

    engine.step = counting_step
    outputs = Outputs()
    try:
        EngineCore(engine, ScriptedCommands(batches), outputs).run()
    finally:
        del engine.step
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished_requests()
    return waiting, outputs.messages


def _add(*requests: tuple[str, list[int], SamplingParams]) -> msg.AddRequests:
    return msg.AddRequests([msg.NewRequest(*r) for r in requests])


def _finished(messages: list[msg.CoreOutputs]) -> dict[str, int]:
    """Tokens each finished request produced in all."""
    tokens: dict[str, int] = {}
    for m in messages:
        for delta in m.outputs:
            tokens[delta.request_id] = tokens.get(delta.request_id, 0) + len(
                delta.outputs[0].token_ids)
    return tokens


def test_one_add_command_enters_one_step(engine):
    batch = _add(*((f"r{i}", [5, 6, 7 + i], ONE) for i in range(64)))
    waiting, messages = _run(engine, [[batch]])
    assert waiting == [64]  # one step found all 64 waiting
    assert _finished(messages) == {f"r{i}": 1 for i in range(64)}


def test_commands_queued_during_a_step_all_enter_the_next_one(engine):
    first = _add(("first", [5, 6, 7], SamplingParams(max_tokens=2, output_kind="delta")))
    during = [_add((f"r{i}", [5, 6, 8 + i], ONE)) for i in range(16)]
    waiting, _ = _run(engine, [[first], during])
    assert waiting[:2] == [1, 16]  # "first" alone, then all 16 at once


def test_a_refused_request_fails_alone(engine):
    batch = _add(("good", [5, 6, 7], ONE), ("bad", [10**6], ONE), ("good2", [5, 6], ONE))
    _, messages = _run(engine, [[batch]])
    failures = [f for m in messages for f in m.failures]
    assert [(f.request_id, f.kind, f.param) for f in failures] == [("bad", "invalid", "prompt")]
    assert _finished(messages) == {"good": 1, "good2": 1}


def test_step_failure_fails_requests_in_flight_then_serving_resumes(engine):
    real_forward, failed = engine.executor.runner.forward, []

    def forward_failing_once(out, *rest):
        if not failed and len(out.scheduled) == 2:
            failed.append(True)
            raise RuntimeError("device on fire")
        return real_forward(out, *rest)

    engine.executor.runner.forward = forward_failing_once
    try:
        _, messages = _run(engine, [[_add(("a", [5, 6, 7], LONG), ("b", [5, 6, 9], LONG))],
                                    [], [_add(("c", [5, 6, 7], ONE))]])
    finally:
        del engine.executor.runner.forward
    failures = {f.request_id: f for m in messages for f in m.failures}
    assert set(failures) == {"a", "b"} and "device on fire" in failures["a"].message
    assert failures["a"].kind == "step"
    assert _finished(messages)["c"] == 1


def test_abort_frees_the_blocks_and_the_id(engine):
    _, messages = _run(engine, [[_add(("a", [5, 6, 7], LONG))],
                                [msg.AbortRequests(["a"])],
                                [_add(("a", [5, 6, 7], ONE))]])
    # The last delta of the re-used id is that of the new, one-token request.
    last = [d for m in messages for d in m.outputs if d.request_id == "a"][-1]
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert messages[-1].stats.blocks_used == 0


class _RefusingGrammars:
    """A grammar compiler whose every grammar is over its budget (as ``GrammarTooSlow``)."""

    def get(self, spec) -> Future:
        future = Future()
        future.set_exception(InvalidSamplingParam("structured_outputs", "too slow"))
        return future

    def release(self, future: Future) -> None:
        pass


def test_a_grammar_refused_in_a_step_that_fails_still_gets_its_failure(engine):
    """The step that refuses a grammar (a 400) is the step that fails: the request had left
    the engine's requests in flight already, so the failures of that step passed it by and
    its client waited for ever."""
    real_forward, calls = engine.executor.runner.forward, []

    def forward_failing_second(out, *rest):  # step 1 prefills "a"; step 2 refuses "g"
        calls.append(out)
        if len(calls) == 2:
            raise RuntimeError("device on fire")
        return real_forward(out, *rest)

    engine.executor.runner.forward = forward_failing_second
    engine._grammars = _RefusingGrammars()
    constrained = SamplingParams(max_tokens=4, output_kind="delta",
                                 structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    try:
        _, messages = _run(engine, [[_add(("a", [5, 6, 7], LONG))],
                                    [_add(("g", [5, 6, 8], constrained))], []])
    finally:
        del engine.executor.runner.forward
        engine._grammars = None
    failures = {f.request_id: f for m in messages for f in m.failures}
    assert set(failures) == {"a", "g"}
    assert (failures["g"].kind, failures["g"].param) == ("invalid", "structured_outputs")
    assert failures["a"].kind == "step"
