"""Every rank but the driver's as a Ray actor, for tensor and pipeline parallelism across the
hosts of a Ray cluster.

The driver joins the cluster ``RAY_ADDRESS`` names (else Ray starts a local one), reserves one
device (``Platform.ray_resource``) per rank in a placement group, packed onto as few hosts as
possible, and starts an actor in each bundle. Ranks are given out once Ray has placed the
actors (``assign_ranks``): the driver's own stage first to the actors on its host, then the
other stages host by host, so that each stage's tensor-parallel all-reduces stay on one host
where the devices allow it. A Ray connection the engine opened is closed by
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
from pagedserve.distributed import Layout
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


def start(config: EngineConfig, dist_address: str, layer_split: tuple[int, ...]) -> RayRanks:
    global _num_users
    _num_users += 1
    try:
        return RayRanks(config, dist_address, layer_split)
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
            logger.exception("a rank failed in a step")
            os._exit(1)

    def leave(self) -> None:
        """Leave the process group (queued after every step sent), then stop."""
        self.worker.leave()
        os._exit(0)

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        self._never.wait()


class RayRanks:
    def __init__(self, config: EngineConfig, dist_address: str,
                 layer_split: tuple[int, ...]) -> None:
        self.layout = layout = Layout(config.tensor_parallel_size,
                                      config.pipeline_parallel_size)
        count = layout.size - 1
        resource = resolve_platform(config.device).ray_resource
        self.group = placement_group([{resource: 1}] * count, strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=envs.dist_timeout_s())
        if not ready:
            remove_placement_group(self.group)
            raise RuntimeError(f"the Ray cluster has no room for {count} more ranks of one "
                               f"{resource} each")
        self.actors = [
            RankActor.options(**_reservation(resource), scheduling_strategy=(
                PlacementGroupSchedulingStrategy(self.group,
                                                 placement_group_bundle_index=i))).remote()
            for i in range(count)]
        self.placements = ray.get([a.placement.remote(resource) for a in self.actors])
        here = ray.get_runtime_context().get_node_id()
        self.ranks = assign_ranks(layout, [node for node, _ in self.placements], here)
        # Ray shows each actor only its own device, so every rank's device is index 0.
        self._building = [a.build.remote(WorkerSpec(config, rank, dist_address, 0, layout.size,
                                                    layer_split))
                          for rank, a in zip(self.ranks, self.actors)]
        self._watches = [a.watch.remote() for a in self.actors]

    def driver_device_index(self) -> int:
        """The driver's rank runs outside the placement group: on its node it takes the
        first device no actor there was given."""
        here = ray.get_runtime_context().get_node_id()
        return first_free_device([ids for node, ids in self.placements if node == here])

    def wait_ready(self) -> None:
        for rank, ref in zip(self.ranks, self._building):
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise RuntimeError(self._build_failure(rank, exc)) from exc
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
        name = self.layout.name(self.ranks[self._watches.index(done[0])])
        try:
            ray.get(done[0])
        except ray.exceptions.RayError as exc:
            return f"{name} (a Ray actor) died: {type(exc).__name__}"
        return f"{name} (a Ray actor) stopped"

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
                return self._build_failure(self.ranks[self._building.index(ref)], exc)
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

    def _build_failure(self, rank: int, exc: ray.exceptions.RayError) -> str:
        return f"{self.layout.name(rank)} failed: {exc}"


def assign_ranks(layout: Layout, nodes: list[str], driver_node: str) -> list[int]:
    """The rank of each actor, given the node each was placed on: the driver's stage's other
    ranks go to the actors on the driver's node first, then every other rank in order to the
    actors node by node (the nodes in the order their first actor came)."""
    stage = layout.driver // layout.tp_size
    ranks = sorted(layout.others(), key=lambda r: r // layout.tp_size != stage)
    order = {node: i for i, node in enumerate(dict.fromkeys(nodes))}
    actors = sorted(range(len(nodes)),
                    key=lambda i: (nodes[i] != driver_node, order[nodes[i]]))
    assigned = [0] * len(nodes)
    for actor, rank in zip(actors, ranks):
        assigned[actor] = rank
    return assigned


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
