"""Ranks 1 .. N-1 as Ray actors, for tensor parallelism across the hosts of a Ray cluster.

The driver joins the cluster ``RAY_ADDRESS`` names (else Ray starts a local one), reserves one
device (``Platform.ray_resource``) per rank in a placement group, packed onto as few hosts as
possible, and starts an actor in each bundle. A Ray connection the engine opened is closed by
the last engine shut down on it, so a local cluster it started stops with it. Each step is put
in the object store once and queued on every actor without waiting. Every actor also runs a
``watch`` call that never returns, in a concurrency group of its own: when the actor dies,
that call fails, and the driver learns of the death even while idle.
"""

from __future__ import annotations

import os
import threading

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.logger import get_logger
from pagedserve.platforms import resolve_platform
from pagedserve.worker.model_runner import StepInput
from pagedserve.worker.worker import Worker, WorkerSpec

logger = get_logger(__name__)

_STOP_TIMEOUT_S = 5.0


# Whether this module opened the process's Ray connection (else its caller had), and how many
# ``RayRanks`` use it: the last to shut down closes a connection opened here, which also stops
# the local cluster ``ray.init`` started, if it started one; Ray is left as it was found.
_opened_here = False
_num_users = 0


def driver_ip() -> str:
    global _opened_here
    if not ray.is_initialized():
        ray.init()
        _opened_here = True
    return ray.util.get_node_ip_address()


def ranks_on_host(size: int) -> int:
    # Where Ray places the actors is not known yet: assume they could all share this host.
    return size


def start(config: EngineConfig, dist_address: str) -> RayRanks:
    global _num_users
    _num_users += 1
    try:
        return RayRanks(config, dist_address)
    except BaseException:
        _release_connection()
        raise


def _release_connection() -> None:
    global _num_users, _opened_here
    _num_users -= 1
    if _num_users == 0 and _opened_here:
        _opened_here = False
        ray.shutdown()


@ray.remote(concurrency_groups={"watch": 1})
class RankActor:
    """One rank. Steps run in the default group, one at a time in the order sent."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self._never = threading.Event()

    def placement(self, resource: str) -> tuple[str, list[str]]:
        """This actor's node and the ids of the devices Ray gave it there."""
        context = ray.get_runtime_context()
        return context.get_node_id(), context.get_accelerator_ids().get(resource, [])

    def build(self, spec: WorkerSpec) -> None:
        self.worker = Worker(spec)

    def follow(self, step: StepInput) -> None:
        try:
            self.worker.runner.follow(step)
        except BaseException:
            # Die, so the driver's collective breaks and ``watch`` reports it.
            logger.exception("tensor-parallel rank failed in a step")
            os._exit(1)

    def leave(self) -> None:
        """Leave the process group (queued after every step sent), then stop."""
        self.worker.leave()
        os._exit(0)

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        self._never.wait()


class RayRanks:
    def __init__(self, config: EngineConfig, dist_address: str) -> None:
        size = config.tensor_parallel_size
        resource = resolve_platform(config.device).ray_resource
        self.group = placement_group([{resource: 1}] * (size - 1), strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=envs.dist_timeout_s())
        if not ready:
            remove_placement_group(self.group)
            raise RuntimeError(f"the Ray cluster has no room for {size - 1} more ranks of one "
                               f"{resource} each")
        self.actors = [
            RankActor.options(**_reservation(resource), scheduling_strategy=(
                PlacementGroupSchedulingStrategy(self.group,
                                                 placement_group_bundle_index=i))).remote()
            for i in range(size - 1)]
        self.placements = ray.get([a.placement.remote(resource) for a in self.actors])
        # Ray shows each actor only its own device, so every rank's device is index 0.
        self._building = [a.build.remote(WorkerSpec(config, rank, dist_address, 0, size))
                          for rank, a in enumerate(self.actors, 1)]
        self._watches = [a.watch.remote() for a in self.actors]

    def driver_device_index(self) -> int:
        """The driver's rank runs outside the placement group: on its node it takes the
        first device no actor there was given."""
        here = ray.get_runtime_context().get_node_id()
        return first_free_device([ids for node, ids in self.placements if node == here])

    def wait_ready(self) -> None:
        for rank, ref in enumerate(self._building, 1):
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise RuntimeError(_build_failure(rank, exc)) from exc
        self._building = []  # all built: nothing more to learn from these calls

    def send(self, step: StepInput) -> None:
        ref = ray.put(step)
        for actor in self.actors:
            actor.follow.remote(ref)

    def dead_reason(self, wait_s: float = 0.0) -> str | None:
        if not ray.is_initialized():  # at exit, Ray's own exit hook may have come first
            return "the Ray connection was closed, which ends its actors"
        failed = self._failed_build()
        if failed is not None:
            return failed
        done, _ = ray.wait(self._watches, num_returns=1, timeout=wait_s)
        if not done:
            return None
        rank = self._watches.index(done[0]) + 1
        try:
            ray.get(done[0])
        except ray.exceptions.RayError as exc:
            return f"tensor-parallel rank {rank} (a Ray actor) died: {type(exc).__name__}"
        return f"tensor-parallel rank {rank} (a Ray actor) stopped"

    def _failed_build(self) -> str | None:
        """Until every rank is built, one whose ``build`` failed counts as gone (its actor
        lives on): the driver, waiting for that rank to join, hears its reason at once."""
        if not self._building:
            return None
        done, _ = ray.wait(self._building, num_returns=len(self._building), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                return _build_failure(self._building.index(ref) + 1, exc)
        return None

    def stop(self) -> None:
        for actor in self.actors:
            actor.leave.remote()

    def shutdown(self) -> None:
        if ray.is_initialized():
            # An actor that left exits; one still leaving after the grace period is killed.
            ray.wait(self._watches, num_returns=len(self._watches), timeout=_STOP_TIMEOUT_S)
            for actor in self.actors:
                ray.kill(actor)
            remove_placement_group(self.group)
        _release_connection()


def _build_failure(rank: int, exc: ray.exceptions.RayError) -> str:
    return f"tensor-parallel rank {rank} failed: {exc}"


def _reservation(resource: str) -> dict:
    """Actor options that take exactly one bundle's ``{resource: 1}``."""
    if resource == "CPU":
        return {"num_cpus": 1}
    if resource == "GPU":
        return {"num_cpus": 0, "num_gpus": 1}
    return {"num_cpus": 0, "resources": {resource: 1}}


def first_free_device(taken: list[list[str]]) -> int:
    used = {int(i) for ids in taken for i in ids}
    return next(i for i in range(len(used) + 1) if i not in used)
