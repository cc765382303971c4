"""The engine's view of adapters: which ones every rank holds in host memory, and each one's
content hash, which keys the prefix cache.

An adapter is read from its folder (and checked against ``--max-lora-rank`` and the model's
shapes) when a request of it is admitted and the ranks do not hold it; the engine hands the
weights to every rank then, before any step can use them. So a step never reads a folder: one
that vanished or went bad fails the request being admitted (a ``ValueError``), never a step
that other requests share.

At most ``max_cpu_loras`` adapters are held. An adapter admitted past that is read to check it
and key its request, then let go; the request waits (the scheduler starts only requests of
held adapters) until ``plan`` makes room for it before a step, by dropping an idle adapter (one
no running or swapped request uses), the least recently admitted first, and the engine reads it
again. Requests of held adapters start meanwhile, except those of one adapter, ``draining``:
when every held adapter is in use, the first waiting request that cannot be held would wait as
long as new requests kept them busy, so one of them takes no new requests until it is idle.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence, Set
from typing import NamedTuple

from pagedserve.lora.adapter import LoRAAdapter, ShardShapes, check_fits, load_adapter
from pagedserve.lora.request import LoRARequest
from pagedserve.models.config import ModelArchConfig


def shard_shapes(arch: ModelArchConfig) -> ShardShapes:
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {("qkv_proj", 0): (q, hidden), ("qkv_proj", 1): (kv, hidden),
            ("qkv_proj", 2): (kv, hidden), ("o_proj", 0): (hidden, q),
            ("gate_up_proj", 0): (inter, hidden), ("gate_up_proj", 1): (inter, hidden),
            ("down_proj", 0): (hidden, inter)}


class Admitted(NamedTuple):
    key: str  # the adapter's content hash
    # Held now: every rank must be handed it; None: they hold it already, or it waits for room
    adapter: LoRAAdapter | None


class HostPlan(NamedTuple):
    drop: list[int]  # idle adapters the ranks drop from host memory, making room for...
    load: list[LoRARequest]  # ...these, which ``hold`` reads before the step


class HostAdapters:
    def __init__(self, max_rank: int, arch: ModelArchConfig, max_cpu_loras: int) -> None:
        self.max_rank = max_rank
        self.num_layers = arch.num_layers
        self.shapes = shard_shapes(arch)
        self.max_cpu_loras = max_cpu_loras
        # lora_int_id -> the request that first named it, until the id is forgotten
        self._owners: dict[int, LoRARequest] = {}
        # lora_int_id -> content hash of the adapters the ranks hold, least recently admitted
        # first
        self._held: OrderedDict[int, str] = OrderedDict()
        # The held adapter whose waiting requests may not start (see the module doc), or None.
        self.draining: int | None = None

    def admit(self, request: LoRARequest) -> Admitted:
        """The adapter's key, reading it unless the ranks hold it; ``ValueError`` (one line)
        for an adapter the engine cannot serve."""
        owner = self._owners.get(request.lora_int_id)
        if owner is not None and owner.lora_path != request.lora_path:
            # The ranks keep adapters by id: another folder under it would run the one held.
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is in use by adapter {owner.lora_name!r} "
                f"({owner.lora_path}); give {request.lora_name!r} another id, or remove the "
                "first (engine.remove_lora) before reusing it")
        if request.lora_int_id in self._held:
            self._held.move_to_end(request.lora_int_id)
            return Admitted(self._held[request.lora_int_id], None)
        adapter = self._read(request)
        self._owners.setdefault(request.lora_int_id, request)
        if len(self._held) >= self.max_cpu_loras:
            return Admitted(adapter.content_hash, None)  # read again once there is room
        self._held[request.lora_int_id] = adapter.content_hash
        return Admitted(adapter.content_hash, adapter)

    def plan(self, waiting: Sequence[LoRARequest], in_use: Set[int]) -> HostPlan:
        """Room for the adapters of ``waiting`` (the waiting requests' adapters, in queue
        order) that are not held, taken in order from idle adapters: neither ``in_use`` by a
        running or swapped request nor wanted by a waiting request ahead. Sets ``draining``
        when one cannot be made room for."""
        ahead: set[int] = set()
        drop: list[int] = []
        load: list[LoRARequest] = []
        room = self.max_cpu_loras - len(self._held)
        for request in waiting:
            lora_id = request.lora_int_id
            if lora_id not in self._held and lora_id not in ahead:
                if not room:
                    idle = next((i for i in self._held if i not in in_use and i not in ahead
                                 and i not in drop), None)
                    if idle is None:
                        self.draining = self._next_draining(ahead.union(drop))
                        return HostPlan(drop, load)
                    drop.append(idle)
                    room += 1
                load.append(request)
                room -= 1
            ahead.add(lora_id)
        self.draining = None
        return HostPlan(drop, load)

    def _next_draining(self, spared: set[int]) -> int | None:
        """The adapter kept draining while it may (so the room it makes is not lost to
        another), else the least recently admitted held one not ``spared`` (wanted by a
        request ahead, or dropped already); None when all are."""
        if self.draining in self._held and self.draining not in spared:
            return self.draining
        return next((i for i in self._held if i not in spared), None)

    def drop(self, lora_ids: list[int]) -> None:
        for lora_id in lora_ids:
            del self._held[lora_id]

    def hold(self, request: LoRARequest) -> LoRAAdapter:
        """Read an adapter ``plan`` made room for (``ValueError`` if it cannot be served any
        more); every rank must be handed it."""
        adapter = self._read(request)
        self._held[request.lora_int_id] = adapter.content_hash
        return adapter

    def startable(self) -> frozenset[int]:
        """The adapters whose waiting requests may start: the held ones, but ``draining``."""
        return frozenset(self._held.keys() - {self.draining})

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        adapter = load_adapter(request.lora_path)
        check_fits(request.lora_name, adapter, self.max_rank, self.num_layers, self.shapes)
        return adapter

    def forget(self, lora_int_id: int) -> None:
        """Drop what is remembered of the adapter of this id (it is read again if it returns,
        so an id reused for another folder never takes the old one's key)."""
        self._owners.pop(lora_int_id, None)
        self._held.pop(lora_int_id, None)
