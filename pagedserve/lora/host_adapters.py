"""The engine's view of adapters: which ones every rank holds in host memory, and each one's
content hash, which keys the prefix cache.

An adapter is read from its folder (and checked against ``--max-lora-rank`` and the model's
shapes) when a request of it is admitted and the ranks do not hold it; the engine hands the
weights to every rank then, before any step can use them. So a step never reads a folder: one
that vanished or went bad fails the request being admitted (a ``ValueError``), never a step
that other requests share. An adapter stays held while any unfinished request runs with it;
of the idle ones, at most ``max_cpu_loras`` are kept, the least recently admitted dropped
first (``trim``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set
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
    adapter: LoRAAdapter | None  # read now: every rank must be handed it; None: they hold it


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
        adapter = load_adapter(request.lora_path)
        check_fits(request.lora_name, adapter, self.max_rank, self.num_layers, self.shapes)
        self._owners.setdefault(request.lora_int_id, request)
        # Read again, the folder may hold other weights than before: the key follows them.
        self._held[request.lora_int_id] = adapter.content_hash
        return Admitted(adapter.content_hash, adapter)

    @property
    def over_budget(self) -> bool:
        return len(self._held) > self.max_cpu_loras

    def trim(self, in_use: Set[int]) -> list[int]:
        """The adapters the ranks should drop from host memory: idle ones (not ``in_use`` by
        an unfinished request) beyond ``max_cpu_loras``, least recently admitted first."""
        dropped = []
        for lora_id in list(self._held):
            if len(self._held) <= self.max_cpu_loras:
                break
            if lora_id not in in_use:
                del self._held[lora_id]
                dropped.append(lora_id)
        return dropped

    def forget(self, lora_int_id: int) -> None:
        """Drop what is remembered of the adapter of this id (it is read again if it returns,
        so an id reused for another folder never takes the old one's key)."""
        self._owners.pop(lora_int_id, None)
        self._held.pop(lora_int_id, None)
