"""The step as the driver drives it, defined once: the executor forwards each call to one
``StepAPI``, whichever ranks stand behind it.

A step is ``forward`` (plan the packed inputs, apply the block moves, run the forward pass,
compute the logits of the sampling rows and the prompt spans' logprobs), then ``sample``
(sample those rows, copy the tokens to the host in the background), then ``fetch`` (wait for
that copy). ``execute`` is the first two at once; the engine splits them only where it builds
grammar masks while the device computes. ``move_blocks`` is a step that computes nothing but
the swaps and copies of preempted blocks; ``add_lora`` and ``remove_lora`` change which
adapters the ranks hold in host memory, between steps; ``control`` puts every rank to sleep,
wakes it, or loads new weights (sleep mode, ``worker/sleep.py``). What crosses back to the
engine is host data (``step``'s types); a step's device tensors stay in the driver's runner.

``LocalStep`` is the driver alone. The implementation for several ranks (``executor``) is the
same calls with the planned step sent to the other ranks first; they follow it
(``ModelRunner.follow``) so that every collective of the forward pass, every pipeline stage's
hand-over, and the broadcast of the sampled tokens, has all its ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedserve.core.kv_cache_manager import BlockOps
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.lora.adapter import LoRAAdapter
from pagedserve.worker.model_runner import ModelRunner, RankControl
from pagedserve.worker.step import Forward, SamplingInputs, StepOutput, StepResult


class StepAPI(ABC):
    """The driver's step. Each call queues device work and returns without waiting for it."""

    runner: ModelRunner  # the driver's

    @abstractmethod
    def forward(self, out: SchedulerOutput) -> Forward:
        """Everything up to the sampling. A chunk whose input is a token the previous step
        sampled reads it on the device."""

    @abstractmethod
    def sample(self, forward: Forward, sampling: SamplingInputs | None) -> StepResult:
        """The sampling half of a step ``forward`` queued."""

    @abstractmethod
    def move_blocks(self, ops: BlockOps) -> None:
        """Block moves of a step that computes nothing."""

    @abstractmethod
    def add_lora(self, lora_int_id: int, adapter: LoRAAdapter) -> None:
        """Every rank holds the adapter in host memory (``LoRASlots.add``)."""

    @abstractmethod
    def remove_lora(self, lora_int_id: int) -> None:
        """Every rank forgets the adapter (``LoRASlots.remove``)."""

    @abstractmethod
    def control(self, c: RankControl) -> None:
        """Every rank sleeps, wakes up or loads weights (``ModelRunner.control``)."""

    def execute(self, out: SchedulerOutput, sampling: SamplingInputs | None) -> StepResult:
        """A whole step: ``forward`` then ``sample``."""
        return self.sample(self.forward(out), sampling)

    def fetch(self, result: StepResult) -> StepOutput:
        """A step's samples and prompt logprobs on the host (the driver alone holds them)."""
        return self.runner.fetch(result)


class LocalStep(StepAPI):
    """The step of one rank, in the driver's process: the model runner's, nothing added."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def forward(self, out: SchedulerOutput) -> Forward:
        step, spans = self.runner.plan(out)
        return self.runner.forward(out, step, spans)

    def sample(self, forward: Forward, sampling: SamplingInputs | None) -> StepResult:
        return self.runner.sample(forward, sampling)

    def move_blocks(self, ops: BlockOps) -> None:
        self.runner.kv_cache.apply_block_ops(ops)

    def add_lora(self, lora_int_id: int, adapter: LoRAAdapter) -> None:
        self.runner.lora.add(lora_int_id, adapter)

    def remove_lora(self, lora_int_id: int) -> None:
        self.runner.lora.remove([lora_int_id])

    def control(self, c: RankControl) -> None:
        self.runner.control(c)
