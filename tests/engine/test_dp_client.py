"""Data parallelism's client (``engine/dp_client.py``) over stand-in replicas: the balancing
rule, where requests and whole-engine calls go, a replica that is gone or asleep, the start of
all replicas at once, and which devices each replica is given."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import ClassVar

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine import core_messages as msg
from pagedserve.engine import dp_client
from pagedserve.engine.core_client import EngineCoreClient, EngineDeadError, EngineStartError
from pagedserve.engine.dp_client import (
    DataParallelClient,
    LeastInFlight,
    core_client,
    replica_envs,
)
from pagedserve.errors import ConfigError, EngineSleepingError
from pagedserve.platforms.cpu.platform import CpuPlatform
from pagedserve.platforms.interface import Platform
from pagedserve.sampling_params import SamplingParams


class FakeReplica:
    """An engine core's client that keeps its requests in flight until told to end them."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.in_flight: set[str] = set()
        self.is_running, self.sleeping = True, False
        self.dead_reason = "it has not started"
        self.removed: list[int] = []
        self.lora_ids: set[int] = set()
        self.answer = msg.ControlDone(0, True, False)
        self.stats = None

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.in_flight

    def add_requests(self, requests):
        if not self.is_running:
            raise EngineDeadError(self.dead_reason)
        if self.sleeping:
            raise EngineSleepingError(f"replica {self.index} is asleep")
        self.in_flight.update(r.request_id for r in requests)
        return [(self.index, r.request_id) for r in requests]

    def finish(self, request_id: str) -> None:
        self.in_flight.remove(request_id)

    def remove_lora(self, lora_int_id: int) -> None:
        self.removed.append(lora_int_id)

    def lora_in_use(self, lora_int_id: int) -> bool:
        return lora_int_id in self.lora_ids

    async def control(self, make):
        if not self.is_running:
            raise EngineDeadError(self.dead_reason)
        command = make(self.index)
        self.sleeping = isinstance(command, msg.Sleep) or self.sleeping and not isinstance(
            command, msg.WakeUp)
        return msg.ControlDone(command.call_id, self.answer.result, self.sleeping,
                               self.answer.error)

    def engine_stats(self):
        return [self.stats]

    def die(self) -> None:
        self.is_running = False
        self.dead_reason = f"the engine core process of replica {self.index} exited"


def _client(n: int = 2) -> tuple[DataParallelClient, list[FakeReplica]]:
    replicas = [FakeReplica(i) for i in range(n)]
    return DataParallelClient(replicas), replicas


def _new(request_id: str) -> msg.NewRequest:
    return msg.NewRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=2))


def _send(client: DataParallelClient, request_id: str) -> int:
    """The index of the replica that took the request."""
    ((replica, _),) = client.add_requests([_new(request_id)])
    return replica


# ---- the rule ------------------------------------------------------------------------------
def test_the_rule_picks_the_fewest_in_flight():
    rule = LeastInFlight(3)
    assert rule.pick([4, 1, 2]) == 1
    assert rule.pick([0, 5, 5]) == 0
    assert rule.pick([3, 3, 2]) == 2


def test_ties_go_round_robin():
    rule = LeastInFlight(3)
    assert [rule.pick([0, 0, 0]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    # Among the tied only, from the one past the last pick.
    rule = LeastInFlight(4)
    assert rule.pick([1, 0, 1, 0]) == 1
    assert rule.pick([1, 0, 1, 0]) == 3
    assert rule.pick([1, 0, 1, 0]) == 1


def test_a_replica_that_takes_none_is_passed_over():
    rule = LeastInFlight(3)
    assert [rule.pick([None, 5, 5]) for _ in range(3)] == [1, 2, 1]
    assert rule.pick([0, None, 9]) == 0


# ---- requests ------------------------------------------------------------------------------
def test_requests_go_to_the_replica_with_the_fewest_in_flight():
    client, replicas = _client(2)
    assert [_send(client, f"r{i}") for i in range(4)] == [0, 1, 0, 1]
    replicas[1].finish("r1")
    replicas[1].finish("r3")
    # Replica 1 is idle now: it takes the next two, then the turns resume.
    assert [_send(client, f"s{i}") for i in range(3)] == [1, 1, 0]


def test_one_api_requests_prompts_stay_together():
    client, replicas = _client(2)
    _send(client, "first")  # replica 0
    streams = client.add_requests([_new("b-0"), _new("b-1"), _new("b-2")])
    assert [replica for replica, _ in streams] == [1, 1, 1]
    assert _send(client, "next") == 0  # 1 in flight there, 3 on replica 1


def test_a_request_id_in_flight_on_any_replica_is_refused():
    client, replicas = _client(2)
    _send(client, "same")
    with pytest.raises(ValueError, match="already in use"):
        client.add_requests([_new("same")])  # would have gone to replica 1
    assert replicas[1].in_flight == set()


def test_a_dead_or_sleeping_replica_takes_no_requests_while_another_can():
    client, replicas = _client(3)
    replicas[0].die()
    replicas[2].sleeping = True
    assert {_send(client, f"r{i}") for i in range(4)} == {1}


def test_with_no_replica_able_the_error_says_why():
    client, replicas = _client(2)
    for replica in replicas:
        replica.sleeping = True
    with pytest.raises(EngineSleepingError):
        _send(client, "asleep")
    replicas[0].die()
    replicas[1].die()
    with pytest.raises(EngineDeadError, match="replica 0"):
        _send(client, "gone")


def test_health_needs_every_replica_and_names_the_dead():
    client, replicas = _client(3)
    assert client.is_running
    replicas[1].die()
    assert not client.is_running
    assert client.dead_reason == ("replica 1 of 3: the engine core process of replica 1 "
                                  "exited")


# ---- whole-engine calls --------------------------------------------------------------------
def test_control_reaches_every_replica_and_answers_for_all():
    client, replicas = _client(2)
    done = asyncio.run(client.control(lambda call_id: msg.Sleep(call_id, 1)))
    assert all(r.sleeping for r in replicas) and done.sleeping and client.sleeping
    asyncio.run(client.control(lambda call_id: msg.WakeUp(call_id, None)))
    assert not any(r.sleeping for r in replicas) and not client.sleeping
    replicas[1].answer = msg.ControlDone(0, False, False, "requests are in flight")
    done = asyncio.run(client.control(msg.ResetPrefixCache))
    assert not done.result and done.error == "replica 1: requests are in flight"
    replicas[0].die()
    with pytest.raises(EngineDeadError):
        asyncio.run(client.control(msg.ResetPrefixCache))


def test_adapters_are_removed_everywhere_and_in_use_anywhere():
    client, replicas = _client(2)
    client.remove_lora(7)
    assert [r.removed for r in replicas] == [[7], [7]]
    replicas[1].lora_ids.add(3)
    assert client.lora_in_use(3) and not client.lora_in_use(4)


def test_stats_come_per_replica_in_order():
    client, replicas = _client(2)
    replicas[1].stats = "replica 1's"
    assert client.engine_stats() == [None, "replica 1's"]


# ---- start-up ------------------------------------------------------------------------------
class StartingReplica(FakeReplica):
    """A replica whose engine takes ``load_s`` to come up (or until all replicas sharing
    ``together`` are loading at once), or fails after it."""

    config = EngineConfig(device="cpu")

    def __init__(self, index: int, load_s: float, fails: bool = False,
                 together: threading.Barrier | None = None) -> None:
        super().__init__(index)
        self.load_s, self.fails, self.together = load_s, fails, together
        self.facts = None
        self.killed = threading.Event()
        self.shut_down = False

    def spawn(self, core_config) -> None:
        self.spawned = core_config

    def wait_ready(self) -> None:
        if self.together is not None:
            self.together.wait()  # broken, and so raising, unless all load at once
        if self.killed.wait(self.load_s):
            raise EngineStartError("killed while starting")
        if self.fails:
            raise EngineStartError("out of memory")
        self.facts = "up"

    def kill(self) -> None:
        self.killed.set()

    async def shutdown(self) -> None:
        self.shut_down = True


class _Launch:
    def __init__(self, config) -> None:
        self.config = config

    @classmethod
    def of(cls, config):
        return cls(config)

    def load_tokenizer(self):
        return "tokenizer"


def test_replicas_load_side_by_side(monkeypatch):
    """Each replica's load waits until all three are loading: one after another, the first
    would wait for the others for ever (the barrier's timeout breaks it, and start fails)."""
    monkeypatch.setattr(dp_client, "CoreLaunch", _Launch)
    together = threading.Barrier(3, timeout=60)
    client = DataParallelClient([StartingReplica(i, 0.0, together=together) for i in range(3)])
    client.start()
    assert client.tokenizer == "tokenizer" and client.facts == "up"


def test_a_replica_that_cannot_start_stops_the_others(monkeypatch):
    monkeypatch.setattr(dp_client, "CoreLaunch", _Launch)
    replicas = [StartingReplica(0, 30.0), StartingReplica(1, 0.1, fails=True),
                StartingReplica(2, 0.0)]
    client = DataParallelClient(replicas)
    with pytest.raises(EngineStartError, match="^data-parallel replica 1: out of memory$"):
        client.start()
    # Replica 0 was stopped while loading, not waited for (it would have come up after 30 s).
    assert replicas[0].killed.is_set() and not replicas[2].killed.is_set()
    assert all(r.shut_down for r in replicas)


# ---- devices -------------------------------------------------------------------------------
class FourGpus(Platform):
    name: ClassVar[str] = "gpu"
    visible_devices_env: ClassVar[str | None] = "GPU_VISIBLE"

    @classmethod
    def device_count(cls) -> int:
        return 4


def test_each_replica_takes_its_own_group_of_devices():
    envs = replica_envs(FourGpus, 2, 2, {"OTHER": "x"}, environ={})
    assert envs == [{"OTHER": "x", "GPU_VISIBLE": "0,1"}, {"OTHER": "x", "GPU_VISIBLE": "2,3"}]
    assert replica_envs(FourGpus, 4, 1, {}, environ={}) == [
        {"GPU_VISIBLE": str(i)} for i in range(4)]
    # A replica's pipeline stages take consecutive devices too.
    assert replica_envs(FourGpus, 2, 1, {}, environ={}, pipeline_parallel_size=2) == [
        {"GPU_VISIBLE": "0,1"}, {"GPU_VISIBLE": "2,3"}]


def test_the_devices_are_those_the_server_or_the_model_sees():
    # The server's own variable, then the model's (--models-config env) over it.
    assert replica_envs(FourGpus, 2, 1, {}, environ={"GPU_VISIBLE": "5,7"}) == [
        {"GPU_VISIBLE": "5"}, {"GPU_VISIBLE": "7"}]
    assert replica_envs(FourGpus, 2, 1, {"GPU_VISIBLE": "2, 3"},
                        environ={"GPU_VISIBLE": "5,7"}) == [
        {"GPU_VISIBLE": "2"}, {"GPU_VISIBLE": "3"}]


def test_too_few_devices_is_a_config_error():
    with pytest.raises(ConfigError, match=r"--data-parallel-size 3 x --tensor-parallel-size 2 "
                                          r"needs 6 gpu devices; this host shows 4"):
        replica_envs(FourGpus, 3, 2, {}, environ={})
    with pytest.raises(ConfigError, match=r"shows 1 \(GPU_VISIBLE=6\)"):
        replica_envs(FourGpus, 2, 1, {}, environ={"GPU_VISIBLE": "6"})
    with pytest.raises(ConfigError, match=r"--data-parallel-size 2 x --tensor-parallel-size 2 "
                                          r"x --pipeline-parallel-size 2 needs 8 gpu devices"):
        replica_envs(FourGpus, 2, 2, {}, environ={}, pipeline_parallel_size=2)


def test_a_model_whose_replicas_do_not_fit_fails_before_anything_starts(monkeypatch):
    monkeypatch.setattr(dp_client, "resolve_platform", lambda device: FourGpus)
    monkeypatch.delenv("GPU_VISIBLE", raising=False)
    config = EngineConfig(data_parallel_size=3, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="needs 6 gpu devices"):
        core_client(config, {})
    client = core_client(dataclasses.replace(config, data_parallel_size=2), {})
    assert [r.env for r in client.replicas] == [{"GPU_VISIBLE": "0,1"}, {"GPU_VISIBLE": "2,3"}]


def test_on_the_cpu_the_replicas_share_the_host():
    assert replica_envs(CpuPlatform, 3, 2, {"A": "1"}) == [{"A": "1"}] * 3


def test_one_replica_is_a_plain_core_client():
    assert type(core_client(EngineConfig(device="cpu"), {})) is EngineCoreClient
    client = core_client(EngineConfig(device="cpu", data_parallel_size=2), {"A": "1"})
    assert isinstance(client, DataParallelClient)
    assert [(r.config.data_parallel_size, r.env) for r in client.replicas] == [
        (1, {"A": "1"}), (1, {"A": "1"})]


def test_the_offline_llm_points_at_the_server():
    from pagedserve import LLM

    with pytest.raises(ConfigError, match="pagedserve serve --data-parallel-size N"):
        LLM(device="cpu", data_parallel_size=2)
