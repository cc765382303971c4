"""One step API (issue 26 item 2): rank 0 alone and rank 0 with followers are two
implementations of ``StepAPI``, and the executor forwards each step call to it once."""

from __future__ import annotations

import inspect

import pytest

from pagedserve.core.kv_cache_manager import BlockOps
from pagedserve.executor.executor import (
    Executor,
    MultiRankStep,
    WorkerDiedError,
    _RankGroup,
)
from pagedserve.worker.model_runner import StepInput
from pagedserve.worker.step_api import LocalStep, StepAPI


class Recorder:
    """Stands in for every collaborator: records each call by name, in order, in ``log``."""

    def __init__(self, log: list, name: str, fail: str | None = None) -> None:
        self._log, self._name, self._fail = log, name, fail

    def __getattr__(self, attr: str):
        def call(*args):
            self._log.append((f"{self._name}.{attr}", args))
            if attr == self._fail:
                raise RuntimeError("broken pipe")
            return (f"step of {args[0]}", "spans") if attr == "plan" else f"{attr} result"

        return call


class RecordingStep(StepAPI):
    def __init__(self, log: list) -> None:
        self.log = log

    def forward(self, out):
        self.log.append(("forward", (out,)))
        return "forward result"

    def sample(self, forward, sampling):
        self.log.append(("sample", (forward, sampling)))
        return "sample result"

    def move_blocks(self, ops):
        self.log.append(("move_blocks", (ops,)))

    def add_lora(self, lora_int_id, adapter):
        self.log.append(("add_lora", (lora_int_id, adapter)))

    def remove_lora(self, lora_int_id):
        self.log.append(("remove_lora", (lora_int_id,)))

    def control(self, c):
        self.log.append(("control", (c,)))


class FakeRemote:
    def __init__(self, log: list, dead: str | None = None) -> None:
        self.log, self.dead = log, dead

    def send(self, step) -> None:
        self.log.append(("remote.send", (step,)))

    def dead_reason(self, wait_s: float = 0.0) -> str | None:
        return self.dead


def test_both_implementations_are_the_one_interface():
    for cls in (LocalStep, MultiRankStep):
        assert issubclass(cls, StepAPI) and not inspect.isabstract(cls)
    assert sorted(StepAPI.__abstractmethods__) == ["add_lora", "control", "forward",
                                                   "move_blocks", "remove_lora", "sample"]


def test_the_executor_forwards_each_call_to_its_step_once():
    log: list = []
    executor = object.__new__(Executor)  # no ranks, no runner: only ``step`` can answer
    executor.step = RecordingStep(log)
    assert executor.forward("out") == "forward result"
    assert executor.sample("fwd", "meta") == "sample result"
    executor.apply_block_ops("ops")
    executor.add_lora(3, "adapter")
    executor.remove_lora(3)
    assert log == [("forward", ("out",)), ("sample", ("fwd", "meta")),
                   ("move_blocks", ("ops",)), ("add_lora", (3, "adapter")),
                   ("remove_lora", (3,))]
    log.clear()
    assert executor.execute("out", "meta") == "sample result"
    assert log == [("forward", ("out",)), ("sample", ("forward result", "meta"))]


def test_local_step_is_the_runner_alone():
    log: list = []
    step = LocalStep(Recorder(log, "runner"))
    step.runner.kv_cache = Recorder(log, "kv")
    assert step.execute("out", "meta") == "sample result"
    step.move_blocks("ops")
    assert step.fetch("result") == "fetch result"
    assert log == [("runner.plan", ("out",)),
                   ("runner.forward", ("out", "step of out", "spans")),
                   ("runner.sample", ("forward result", "meta")),
                   ("kv.apply_block_ops", ("ops",)),
                   ("runner.fetch", ("result",))]


def _tensor_parallel(log: list, dead: str | None = None, fail: str | None = None):
    runner = Recorder(log, "runner", fail)
    runner.kv_cache = Recorder(log, "kv")
    return MultiRankStep(runner, _RankGroup(FakeRemote(log, dead)))


def test_tensor_parallel_step_sends_the_plan_before_rank_0_runs_it():
    log: list = []
    step = _tensor_parallel(log)
    assert step.forward("out") == "forward result"
    assert step.sample("fwd", "meta") == "sample result"
    assert log == [("runner.plan", ("out",)), ("remote.send", ("step of out",)),
                   ("runner.forward", ("out", "step of out", "spans")),
                   ("runner.sample", ("fwd", "meta"))]
    log.clear()
    step.execute("out", "meta")
    assert [name for name, _ in log] == ["runner.plan", "remote.send", "runner.forward",
                                         "runner.sample"]
    log.clear()
    ops = BlockOps()
    step.move_blocks(ops)
    assert log == [("remote.send", (StepInput(ops, None, []),)), ("kv.apply_block_ops", (ops,))]
    log.clear()
    runner = step.runner
    runner.lora = Recorder(log, "lora")
    step.add_lora(3, "adapter")
    step.remove_lora(3)
    assert log == [("remote.send", (StepInput(BlockOps(), None, [],
                                              added_loras={3: "adapter"}),)),
                   ("lora.add", (3, "adapter")),
                   ("remote.send", (StepInput(BlockOps(), None, [], [3]),)),
                   ("lora.remove", ([3],))]


def test_tensor_parallel_step_refuses_to_start_once_a_rank_is_gone():
    log: list = []
    step = _tensor_parallel(log, dead="rank 1 exited")
    for call in (lambda: step.forward("out"), lambda: step.sample("fwd", "meta"),
                 lambda: step.move_blocks(BlockOps())):
        with pytest.raises(WorkerDiedError, match="rank 1 exited"):
            call()
    assert "remote.send" not in [name for name, _ in log]


def test_a_failed_tensor_parallel_step_ends_the_group():
    log: list = []
    step = _tensor_parallel(log, fail="forward")
    with pytest.raises(WorkerDiedError, match="RuntimeError: broken pipe"):
        step.execute("out", "meta")
    assert step.group.dead_reason() is not None
    with pytest.raises(WorkerDiedError):
        step.sample("fwd", "meta")


def test_tensor_parallel_control_reaches_the_other_ranks_before_rank_0():
    """Sleep, wake-up and weight loads run on every rank: sent as a step of their own."""
    from pagedserve.worker.model_runner import RankControl

    log: list = []
    step = _tensor_parallel(log)
    control = RankControl(sleep_level=1)
    step.control(control)
    assert [name for name, _ in log] == ["remote.send", "runner.control"]
    sent = log[0][1][0]
    assert sent.control is control and sent.inputs is None and log[1][1] == (control,)
