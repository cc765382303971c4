"""Data parallelism (``--data-parallel-size N``): N engine cores of one model, each on devices
of its own, behind the face of one (``CoreClient``), so the server's endpoints do not change.

Routing rules:
  * a new request (or the prompts of one API request, which are admitted together) goes to the
    replica with the fewest engine requests in flight; ties go round robin (``LeastInFlight``);
    a replica that is gone or asleep takes none while another can;
  * everything later about a request (its outputs, its abort when the client leaves) goes to
    the replica that took it: its ``RequestStream`` belongs to that replica's client;
  * whole-engine calls go to every replica: sleep, wake-up and the prefix-cache reset
    (``control``, answered once all have answered), and an adapter's removal;
  * a replica that dies fails its own requests (as a single core does) and turns
    ``is_running`` False, so ``/health`` answers 503 naming it; the others go on serving.

Devices: replica r runs with the platform's visible-devices variable (``CUDA_VISIBLE_DEVICES``
and its kin) set to the r-th group of ``--tensor-parallel-size`` devices of those the server
sees (``replica_envs``); its ranks then take devices 0 .. TP-1 of its own group, as a single
core's do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from pagedserve.config import EngineConfig, parallel_flags
from pagedserve.engine import core_messages as msg
from pagedserve.engine.core_client import (
    CoreClient,
    CoreLaunch,
    EngineCoreClient,
    EngineStartError,
    RequestStream,
)
from pagedserve.engine.stats import EngineStats
from pagedserve.errors import ConfigError
from pagedserve.platforms import Platform, PlatformUnavailable, resolve_platform


def core_client(config: EngineConfig, env: Mapping[str, str]) -> CoreClient:
    """The client of one model's engine: a single core, or ``--data-parallel-size`` replicas.
    A ``ConfigError`` if the replicas' devices are not there, before anything starts."""
    if config.data_parallel_size == 1:
        return EngineCoreClient(config, env)
    try:
        platform = resolve_platform(config.device)
    except PlatformUnavailable as exc:
        raise EngineStartError(str(exc)) from None
    one = dataclasses.replace(config, data_parallel_size=1)
    envs = replica_envs(platform, config.data_parallel_size, config.tensor_parallel_size, env,
                        pipeline_parallel_size=config.pipeline_parallel_size)
    return DataParallelClient([EngineCoreClient(one, e) for e in envs])


def replica_envs(platform: type[Platform], num_replicas: int, tensor_parallel_size: int,
                 env: Mapping[str, str], environ: Mapping[str, str] = os.environ, *,
                 pipeline_parallel_size: int = 1) -> list[dict[str, str]]:
    """Each replica's additions to its core's environment: ``env`` (the model's own, from
    ``--models-config``), and the devices it takes of those the server sees (``environ`` with
    ``env`` over it), TP x PP consecutive ones each; on a platform whose processes share the
    device (the CPU), ``env`` alone."""
    var = platform.visible_devices_env
    devices = platform.visible_devices({**environ, **env})
    if var is None or devices is None:
        return [dict(env) for _ in range(num_replicas)]
    ranks = tensor_parallel_size * pipeline_parallel_size
    needed = num_replicas * ranks
    if len(devices) < needed:
        listed = f" ({var}={','.join(devices)})" if var in {**environ, **env} else ""
        raise ConfigError(
            f"--data-parallel-size {num_replicas} x "
            f"{parallel_flags(tensor_parallel_size, pipeline_parallel_size)} needs {needed} "
            f"{platform.name} devices; this host shows {len(devices)}{listed}: lower them, or "
            "make more devices visible")
    return [{**env, var: ",".join(devices[r * ranks:(r + 1) * ranks])}
            for r in range(num_replicas)]


class LeastInFlight:
    """The balancing rule: the replica with the fewest requests in flight; among those tied,
    the first at or after the one past the last pick (round robin), so that requests that
    come one at a time take turns."""

    def __init__(self, num_replicas: int) -> None:
        self._num = num_replicas
        self._next = 0

    def pick(self, loads: Sequence[int | None]) -> int:
        """The replica to take the next request, given each one's requests in flight (None:
        it takes none); at least one is a number."""
        order = [(self._next + i) % self._num for i in range(self._num)]
        choice = min((r for r in order if loads[r] is not None), key=lambda r: loads[r])
        self._next = (choice + 1) % self._num
        return choice


class DataParallelClient:
    """``len(replicas)`` engine cores of one model, as one ``CoreClient`` (see the module's
    rules). The replicas share the tokenizer and the facts (the same model and flags)."""

    def __init__(self, replicas: Sequence[EngineCoreClient]) -> None:
        self.replicas = list(replicas)
        self.tokenizer = None
        self._balancer = LeastInFlight(len(self.replicas))

    @property
    def facts(self) -> msg.EngineFacts | None:
        return self.replicas[0].facts

    # ---- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Spawn every replica, then wait for all of them at once, so that their loads
        overlap (the tokenizer loads meanwhile). The first to fail stops the others, and its
        ``EngineStartError`` names it."""
        launch = CoreLaunch.of(self.replicas[0].config)
        try:
            for replica in self.replicas:
                replica.spawn(launch.config)
            with ThreadPoolExecutor(len(self.replicas) + 1) as pool:
                loading = pool.submit(launch.load_tokenizer)
                self._wait_all(pool)
            self.tokenizer = loading.result()
        except BaseException:
            for replica in self.replicas:
                if replica.facts is None:  # still starting: its load is of no use now
                    replica.kill()
            asyncio.run(self.shutdown())
            raise

    def _wait_all(self, pool: ThreadPoolExecutor) -> None:
        """Return once every replica is up; else raise the first failure, once the replicas
        still starting have been killed and their waits have ended."""
        waits = [pool.submit(r.wait_ready) for r in self.replicas]
        wait(waits, return_when=FIRST_EXCEPTION)
        # The first to fail, not one of those killed below.
        failed = next((i for i, w in enumerate(waits) if w.done() and w.exception()), None)
        if failed is None:
            return
        for replica, waiting in zip(self.replicas, waits, strict=True):
            if not waiting.done():
                replica.kill()
        wait(waits)
        raise EngineStartError(f"data-parallel replica {failed}: {waits[failed].exception()}")

    def run_in(self, loop: asyncio.AbstractEventLoop) -> None:
        for replica in self.replicas:
            replica.run_in(loop)

    async def shutdown(self) -> None:
        await _shutdown_all(self.replicas)

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def dead_reason(self) -> str:
        return "; ".join(f"replica {i} of {len(self.replicas)}: {r.dead_reason}"
                         for i, r in enumerate(self.replicas) if not r.is_running)

    @property
    def sleeping(self) -> bool:
        return any(r.sleeping for r in self.replicas)

    # ---- requests -----------------------------------------------------------------------
    def add_requests(self, requests: Sequence[msg.NewRequest]) -> list[RequestStream]:
        """All of ``requests`` to one replica (they are admitted together); the id check is
        the server's, across replicas, as a single core's is across its requests."""
        for r in requests:
            if any(replica.has_request(r.request_id) for replica in self.replicas):
                raise ValueError(f"request id {r.request_id!r} is already in use")
        return self._choose().add_requests(requests)

    def _choose(self) -> EngineCoreClient:
        loads = [r.num_in_flight if r.is_running and not r.sleeping else None
                 for r in self.replicas]
        if all(load is None for load in loads):
            # None can take it: a running one refuses it as asleep, else the first as gone.
            return next((r for r in self.replicas if r.is_running), self.replicas[0])
        return self.replicas[self._balancer.pick(loads)]

    def remove_lora(self, lora_int_id: int) -> None:
        for replica in self.replicas:
            replica.remove_lora(lora_int_id)

    def lora_in_use(self, lora_int_id: int) -> bool:
        return any(r.lora_in_use(lora_int_id) for r in self.replicas)

    async def control(self, make: Callable[[int], msg.Control]) -> msg.ControlDone:
        """The command on every replica, one answer for all: its result holds where every
        replica's does, the first refusal is the error (naming its replica)."""
        dones = await asyncio.gather(*(r.control(make) for r in self.replicas))
        error = next((f"replica {i}: {d.error}" for i, d in enumerate(dones) if d.error),
                     None)
        return msg.ControlDone(dones[0].call_id, all(d.result for d in dones),
                               any(d.sleeping for d in dones), error)

    def engine_stats(self) -> list[EngineStats | None]:
        return [s for replica in self.replicas for s in replica.engine_stats()]


async def _shutdown_all(replicas: Sequence[EngineCoreClient]) -> None:
    await asyncio.gather(*(r.shutdown() for r in replicas))
