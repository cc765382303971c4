"""The driver's handle on every rank.

The driver's rank (``distributed.Layout.driver``: the last pipeline stage's first rank) runs in
the driver's process. With ``--tensor-parallel-size`` or ``--pipeline-parallel-size`` above 1,
a backend (``mp``: processes on this host, ``ray``: actors of a Ray cluster) starts the other
ranks; each step the driver plans the step once (plain data), sends it to them, and runs its
own share. With one rank there is no backend and a step is the model runner's, nothing added.
Either way the step is one ``worker.step_api.StepAPI`` (``LocalStep``, ``MultiRankStep``),
and the executor forwards each call to it once.

A rank that dies makes the step in flight fail with ``WorkerDiedError`` (its peers see the
collective break, or time out after ``PAGEDSERVE_DIST_TIMEOUT_S``), and ``dead_reason`` says
so from then on; the executor is not usable after that. Any other error inside a step with
several ranks ends it the same way: the ranks may be waiting in different collectives.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from pagedserve import distributed, envs
from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import BlockOps
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.distributed import Layout
from pagedserve.errors import ConfigError
from pagedserve.lora.adapter import LoRAAdapter
from pagedserve.platforms import resolve_platform
from pagedserve.worker.cache_sizing import CacheSizes
from pagedserve.worker.model_runner import ModelRunner, PromptSpan, RankControl, StepInput
from pagedserve.worker.sleep import check_level, wake_tags
from pagedserve.worker.step import Forward, SamplingInputs, StepOutput, StepResult
from pagedserve.worker.step_api import LocalStep, StepAPI
from pagedserve.worker.worker import Worker, WorkerSpec

_BACKENDS = {"mp": "pagedserve.executor.mp", "ray": "pagedserve.executor.ray_actors"}


class WorkerDiedError(RuntimeError):
    """A rank is gone, or a step failed part-way through its collectives; the engine cannot
    run another step."""


class RemoteRanks(Protocol):
    """Every rank but the driver's, started by a backend module's ``start(config,
    dist_address, layer_split)``; the module also says which address the driver listens on
    (``driver_ip``) and how many ranks share a host with it (``ranks_on_host``)."""

    def driver_device_index(self) -> int:
        """Which of its host's devices the driver's rank takes."""

    def wait_ready(self) -> None:
        """Block until every rank has built its model; raise if one could not."""

    def send(self, step: StepInput) -> None:
        """Queue a step on every rank, without waiting for it."""

    def dead_reason(self, wait_s: float = 0.0) -> str | None:
        """Why a rank is gone, or None while all run (after waiting up to ``wait_s`` for
        one to be reported gone). A rank that failed to start counts as gone: the driver asks
        this while it waits for the others to join the process group."""

    def stop(self) -> None:
        """Ask every rank to leave the process group and exit, without waiting."""

    def shutdown(self) -> None:
        """Wait for the ranks to exit (stopping them first if ``stop`` was not called), and
        end those that do not."""


class _RankGroup:
    """The other ranks and the driver's membership of their process group: what must be torn
    down together, once. Held by the executor's finalizer (which must not hold the executor),
    so that ``Executor.shutdown``, the executor's collection and the interpreter's exit all
    come here."""

    def __init__(self, remote: RemoteRanks) -> None:
        self.remote = remote
        self.driver: Worker | None = None
        self.dead: str | None = None  # why no further step can run

    def dead_reason(self) -> str | None:
        if self.dead is None:
            self.dead = self.remote.dead_reason()
        return self.dead

    def close(self) -> None:
        """The driver leaves the process group while the ranks leave it (NCCL's teardown
        waits for every rank), then waits for them to exit."""
        alive = self.dead_reason() is None
        if alive:
            self.remote.stop()
        if self.driver is None:  # failed while building the driver's rank
            distributed.shutdown(peers_alive=alive)
        else:
            self.driver.leave(peers_alive=alive)
        self.remote.shutdown()
        self.dead = self.dead or "the engine was shut down"


class MultiRankStep(StepAPI):
    """The driver's step with the other ranks following: each call that runs the model sends
    the planned step to them first (they run it as ``ModelRunner.follow``), then runs the
    driver's share, in the same collectives (as the last pipeline stage, after the stages
    before it)."""

    def __init__(self, runner: ModelRunner, group: _RankGroup) -> None:
        self.runner = runner
        self.group = group

    def forward(self, out: SchedulerOutput) -> Forward:
        step, spans = self.runner.plan(out)
        with self._watching():
            return self._send_and_forward(out, step, spans)

    def sample(self, forward: Forward, sampling: SamplingInputs | None) -> StepResult:
        with self._watching():
            return self.runner.sample(forward, sampling)

    def execute(self, out: SchedulerOutput, sampling: SamplingInputs | None) -> StepResult:
        step, spans = self.runner.plan(out)
        with self._watching():  # around both halves: one look at the ranks per step
            return self.runner.sample(self._send_and_forward(out, step, spans), sampling)

    def move_blocks(self, ops: BlockOps) -> None:
        with self._watching():
            self.group.remote.send(StepInput(ops, None, []))
            self.runner.kv_cache.apply_block_ops(ops)

    def add_lora(self, lora_int_id: int, adapter: LoRAAdapter) -> None:
        with self._watching():
            self.group.remote.send(StepInput(BlockOps(), None, [],
                                             added_loras={lora_int_id: adapter}))
            self.runner.lora.add(lora_int_id, adapter)

    def remove_lora(self, lora_int_id: int) -> None:
        with self._watching():
            self.group.remote.send(StepInput(BlockOps(), None, [], [lora_int_id]))
            self.runner.lora.remove([lora_int_id])

    def control(self, c: RankControl) -> None:
        with self._watching():
            self.group.remote.send(StepInput(BlockOps(), None, [], control=c))
            self.runner.control(c)

    def _send_and_forward(self, out: SchedulerOutput, step: StepInput, spans: list[PromptSpan]
                          ) -> Forward:
        self.group.remote.send(step)
        return self.runner.forward(out, step, spans)

    @contextlib.contextmanager
    def _watching(self) -> Iterator[None]:
        """Around a step: refuse to start one once a rank is gone, and turn the error a broken
        collective or pipe raises into ``WorkerDiedError`` naming the rank."""
        reason = self.group.dead_reason()
        if reason is not None:
            raise WorkerDiedError(reason)
        try:
            yield
        except Exception as exc:
            # Whatever failed, the ranks no longer agree on which collective comes next, so
            # the executor is done. The peer's socket closes before its exit is reaped: give
            # that a moment, to name the rank that died.
            self.group.dead = (
                self.group.remote.dead_reason(wait_s=5.0)
                or f"a step of several ranks failed: {type(exc).__name__}: {exc}")
            raise WorkerDiedError(self.group.dead) from exc


class Executor:
    def __init__(self, config: EngineConfig, layer_split: tuple[int, ...]) -> None:
        """``layer_split``: each pipeline stage's decoder layers (``EngineConfig.layer_split``,
        decided in the driver)."""
        self.remote: RemoteRanks | None = None
        self.driver: Worker | None = None
        self._group: _RankGroup | None = None
        self.step: StepAPI  # every step call goes to it, whichever ranks are behind it
        layout = Layout(config.tensor_parallel_size, config.pipeline_parallel_size)
        if layout.size == 1:
            self.driver = Worker(WorkerSpec(config, 0, "", 0, 1, layer_split))
            self.step = LocalStep(self.driver.runner)
            return
        timeout_s = envs.dist_timeout_s()  # a bad value fails here, not in every rank
        if config.distributed_executor_backend == "mp":
            _check_devices(config, layout)
        backend = _backend(config.distributed_executor_backend)
        host = backend.driver_ip()
        store = distributed.host_store(host, layout.size, timeout_s)
        address = f"{host}:{store.port}"
        self.remote = backend.start(config, address, layer_split)
        self._group = _RankGroup(self.remote)
        # The ranks must leave the process group together, also when the engine is dropped or
        # the driver just exits (a finalizer runs at exit too).
        self._finalizer = weakref.finalize(self, self._group.close)
        try:
            self.driver = self._group.driver = Worker(WorkerSpec(
                config, layout.driver, address, self.remote.driver_device_index(),
                backend.ranks_on_host(layout.size), layer_split),
                distributed.Rendezvous(store, self.remote.dead_reason))
            self.remote.wait_ready()
            self.step = MultiRankStep(self.driver.runner, self._group)
        except Exception as exc:
            # A bad setting fails every rank alike; anything else may be a peer that failed
            # first, whose own reason says more than the broken collective here.
            reason = None if isinstance(exc, ValueError) else self.remote.dead_reason(5.0)
            self.shutdown()
            if reason is None:
                raise
            raise WorkerDiedError(reason) from exc

    @property
    def runner(self) -> ModelRunner:
        """The driver's model runner (the whole model where there is one rank), for benchmarks
        and tests that look inside it; the engine goes through the step calls only."""
        return self.driver.runner

    def execute(self, out: SchedulerOutput, sampling: SamplingInputs | None) -> StepResult:
        return self.step.execute(out, sampling)

    def forward(self, out: SchedulerOutput) -> Forward:
        """``execute`` up to its sampling (``sample``), so that the sampling metadata can be
        built while the ranks compute; the other ranks wait for the sampled tokens."""
        return self.step.forward(out)

    def sample(self, forward: Forward, sampling: SamplingInputs | None) -> StepResult:
        return self.step.sample(forward, sampling)

    def fetch(self, result: StepResult) -> StepOutput:
        """The step's sampled tokens and prompt logprobs on the host, waiting for the device
        if need be."""
        return self.step.fetch(result)

    def apply_block_ops(self, ops: BlockOps) -> None:
        """Block moves of a step that computes nothing, on every rank."""
        self.step.move_blocks(ops)

    def add_lora(self, lora_int_id: int, adapter: LoRAAdapter) -> None:
        """Every rank holds the adapter in host memory (its weights sent to the other ranks,
        which never read its folder)."""
        self.step.add_lora(lora_int_id, adapter)

    def remove_lora(self, lora_int_id: int) -> None:
        """Every rank forgets the adapter: its host copy and its device slot."""
        self.step.remove_lora(lora_int_id)

    def sleep(self, level: int) -> None:
        """Every rank frees its graphs, KV pool and weights (``worker/sleep.py``)."""
        check_level(level)
        self.step.control(RankControl(sleep_level=level))

    def wake_up(self, tags: Sequence[str] | None) -> tuple[str, ...]:
        """Every rank brings back what ``tags`` name (None: all); the tags, checked."""
        tags = wake_tags(tags)
        self.step.control(RankControl(wake_tags=tags))
        return tags

    def load_weights(self, weights: list[tuple[str, Any]]) -> None:
        """Every rank loads the checkpoint tensors (each keeps its slice)."""
        self.step.control(RankControl(weights=weights))

    def stored_disk_blocks(self) -> list[bytes]:
        """Hashes of the KV offloading tier's block files found at start (one rank only, so
        the driver's are all)."""
        disk = self.runner.kv_cache.disk
        return disk.stored_hashes() if disk is not None else []

    def finished_disk_reads(self, wait_s: float = 0.0) -> list[tuple[bytes, bool]]:
        disk = self.runner.kv_cache.disk
        return disk.finished_reads(wait_s) if disk is not None else []

    @property
    def kv_sizes(self) -> CacheSizes:
        """The KV pools' sizes every rank agreed on at start-up."""
        return self.driver.sizes

    def kv_copy_seconds(self) -> float:
        """Host time the driver has spent queuing and waiting on KV block moves."""
        return self.runner.kv_cache.copy_seconds

    def dead_reason(self) -> str | None:
        return self._group.dead_reason() if self._group is not None else None

    def shutdown(self) -> None:
        """Stop the other ranks and leave their process group (idempotent); no step runs
        after this."""
        if self._group is not None:
            self._finalizer()


def _backend(name: str):
    try:
        return importlib.import_module(_BACKENDS[name])
    except ImportError as exc:
        if exc.name != name:
            raise
        raise ConfigError(f"--distributed-executor-backend {name} needs the {name} package: "
                          f"pip install 'pagedserve[{name}]'") from exc


def _check_devices(config: EngineConfig, layout: Layout) -> None:
    """The mp backend runs every rank on this host, rank r on device r: refuse more ranks
    than the host shows before any starts (a rank past them failed to bind its device)."""
    platform = resolve_platform(config.device)
    devices = platform.visible_devices(os.environ)
    if devices is not None and len(devices) < layout.size:
        raise ConfigError(f"{config.ranks_flags()} needs {layout.size} {platform.name} devices "
                          f"on this host (--distributed-executor-backend mp); it shows "
                          f"{len(devices)}: lower them, make more devices visible, or spread "
                          "the ranks over hosts with --distributed-executor-backend ray")

