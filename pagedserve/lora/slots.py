"""Adapters on the device and in host memory.

``max_loras`` adapters sit in device slots (every LoRA layer's stacked A and B, rank padded to
``max_lora_rank``). Host memory holds the adapters the engine hands over (``add``) until it
says to drop them (``remove``); the engine reads and checks each one before any step may use
it (``host_adapters``), so nothing here reads a folder and a step finds every adapter it needs.

``slots_for`` is called once per step with the step's adapters (at most ``max_loras``: the
scheduler never schedules more) before the forward pass: each missing one is written into a
slot no adapter of this step needs, the least recently used first. Every rank makes the same
calls in the same order, so their slots agree without a message.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagedserve.errors import ConfigError
from pagedserve.lora.adapter import LoRAAdapter, LoRAWeights
from pagedserve.lora.layers import LoRALinear, StepRows, slot_bytes
from pagedserve.lora.ops import LoRAOps
from pagedserve.lora.request import LoRARequest

_PROJECTIONS = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp",
                "down_proj": "mlp"}


class LoRASlots:
    def __init__(self, layers: dict[tuple[int, str], LoRALinear], max_loras: int,
                 pin: bool = False) -> None:
        self.layers = layers
        self.max_loras = max_loras
        self.pin = pin  # keep host adapters in page-locked memory
        self.host: dict[int, LoRAAdapter] = {}
        # lora_int_id -> slot, least recently used first
        self.resident: OrderedDict[int, int] = OrderedDict()
        self.loads = 0  # adapters written into a slot so far

    def slots_for(self, requests: list[LoRARequest]) -> dict[int, int]:
        """The slot of each of the step's adapters (by ``lora_int_id``), loading those not in
        one."""
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step needs {len(wanted)} adapters, more than --max-loras "
                             f"{self.max_loras}")
        for lora_id in wanted:
            if lora_id in self.resident:
                self.resident.move_to_end(lora_id)
        for lora_id, request in wanted.items():
            if lora_id not in self.resident:
                self._load(request, self._free_slot(wanted))
        return {lora_id: self.resident[lora_id] for lora_id in wanted}

    def row_slots(self, requests: list[LoRARequest | None], query_lens: list[int],
                  device: torch.device) -> torch.Tensor:
        """``ForwardContext.lora_slots`` for a step of these sequences (their adapters, None
        for the base model, and their rows), loading what is missing."""
        slot_of = self.slots_for([r for r in requests if r is not None])
        per_seq = np.fromiter((-1 if r is None else slot_of[r.lora_int_id] for r in requests),
                              dtype=np.int32, count=len(requests))
        # Built on the host and copied without waiting: a blocking copy (as torch.tensor(...,
        # device=) or .to(device) make) would wait for the device to finish the queued steps.
        rows = torch.from_numpy(np.repeat(per_seq, query_lens))
        return rows.to(device, non_blocking=True)

    def add(self, lora_int_id: int, adapter: LoRAAdapter) -> None:
        """Hold an adapter in host memory until it is removed."""
        self.host[lora_int_id] = _pinned(adapter) if self.pin else adapter

    def remove(self, lora_ids: list[int]) -> None:
        """Forget these adapters: their host copies and their slots, which the next adapter
        to load may take (their weights stay there until then)."""
        for lora_id in lora_ids:
            self.host.pop(lora_id, None)
            self.resident.pop(lora_id, None)

    def _free_slot(self, wanted: dict[int, LoRARequest]) -> int:
        used = set(self.resident.values())
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next(i for i in self.resident if i not in wanted)
        return self.resident.pop(victim)

    def _load(self, request: LoRARequest, slot: int) -> None:
        adapter = self.host.get(request.lora_int_id)
        if adapter is None:
            raise RuntimeError(f"LoRA adapter {request.lora_name} is not in host memory: the "
                               "engine hands every adapter over before a step uses it")
        for (layer, projection), module in self.layers.items():
            module.set_slot(slot, {shard: w for (i, p, shard), w in adapter.shards.items()
                                   if (i, p) == (layer, projection)})
        self.resident[request.lora_int_id] = slot
        self.loads += 1


def add_lora_layers(model: nn.Module, ops: type[LoRAOps], max_loras: int, max_rank: int,
                    free_bytes: int, pin: bool = False) -> LoRASlots:
    """Wrap every q/k/v, o, gate/up and down projection of a loaded model in a ``LoRALinear``
    with ``max_loras`` empty slots; ``pin``: keep host adapters in page-locked memory. Slots
    that would not fit the device's ``free_bytes`` are refused before any is allocated."""
    bases = [(i, projection, getattr(model.model.layers[i], owner_name))
             for i in model.model.layer_range  # a pipeline stage's own layers
             for projection, owner_name in _PROJECTIONS.items()]
    needed = sum(slot_bytes(getattr(owner, projection), max_loras, max_rank)
                 for _, projection, owner in bases)
    if needed > free_bytes:
        raise ConfigError(f"--max-loras {max_loras} slots of --max-lora-rank {max_rank} take "
                          f"{needed / 2**30:.1f} GiB of device memory; "
                          f"{free_bytes / 2**30:.1f} GiB is free")
    rows = StepRows(max_loras)
    layers = {}
    for i, projection, owner in bases:
        wrapped = LoRALinear(getattr(owner, projection), max_loras, max_rank, ops, rows)
        setattr(owner, projection, wrapped)
        layers[(i, projection)] = wrapped
    return LoRASlots(layers, max_loras, pin)


def _pinned(adapter: LoRAAdapter) -> LoRAAdapter:
    """The adapter with its weights in one page-locked buffer: a slot load's copies from
    pageable memory each went through a staging buffer, synchronously (the LoRA engine's
    prefill profile on the H200: 3,152 pageable copies, 30 ms of a 267 ms step), and one
    buffer costs one page-locked allocation per adapter instead of one per tensor."""
    tensors = [t for w in adapter.shards.values() for t in (w.a, w.b)]
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype,
                       pin_memory=True)
    views, start = [], 0
    for t in tensors:
        views.append(flat[start:start + t.numel()].view(t.shape).copy_(t))
        start += t.numel()
    shards = {key: LoRAWeights(views[2 * i], views[2 * i + 1])
              for i, key in enumerate(adapter.shards)}
    return dataclasses.replace(adapter, shards=shards)
