"""Adapters on the device and in host memory.

``max_loras`` adapters sit in device slots (every LoRA layer's stacked A and B, rank padded to
``max_lora_rank``); up to ``max_cpu_loras`` adapters are kept read in host memory, least
recently used dropped first (it is read from its folder again when next needed).

``slots_for`` is called once per step with the step's adapters (at most ``max_loras``: the
scheduler never schedules more) before the forward pass: each missing one is written into a
slot no adapter of this step needs, the least recently used first. Every rank makes the same
calls in the same order, so their slots agree without a message.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pagedserve.errors import ConfigError
from pagedserve.lora.adapter import (
    LoRAAdapter,
    LoRAWeights,
    ShardShapes,
    check_fits,
    load_adapter,
)
from pagedserve.lora.layers import LoRALinear, StepRows, slot_bytes
from pagedserve.lora.ops import LoRAOps
from pagedserve.lora.request import LoRARequest

_PROJECTIONS = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp",
                "down_proj": "mlp"}


class LoRASlots:
    def __init__(self, layers: dict[tuple[int, str], LoRALinear], max_loras: int,
                 max_rank: int, max_cpu_loras: int,
                 loader: Callable[[str], LoRAAdapter] = load_adapter) -> None:
        self.layers = layers
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.loader = loader
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
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

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, read from host memory or from its folder (checked against the model)."""
        adapter = self.host.pop(request.lora_int_id, None)
        if adapter is None:
            adapter = self.loader(request.lora_path)
            num_layers = 1 + max(layer for layer, _ in self.layers)
            check_fits(request.lora_name, adapter, self.max_rank, num_layers, self._shapes())
        self.host[request.lora_int_id] = adapter
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

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
        adapter = self.adapter(request)
        for (layer, projection), module in self.layers.items():
            module.set_slot(slot, {shard: w for (i, p, shard), w in adapter.shards.items()
                                   if (i, p) == (layer, projection)})
        self.resident[request.lora_int_id] = slot
        self.loads += 1

    def _shapes(self) -> ShardShapes:
        """The whole (unsplit) shape of each shard of the first layer's projections."""
        return {(p, shard): (part.full, m.base.in_part.full)
                for (layer, p), m in self.layers.items() if layer == 0
                for shard, part in enumerate(m.base.out_parts)}


def add_lora_layers(model: nn.Module, ops: type[LoRAOps], max_loras: int, max_rank: int,
                    max_cpu_loras: int, free_bytes: int, pin: bool = False) -> LoRASlots:
    """Wrap every q/k/v, o, gate/up and down projection of a loaded model in a ``LoRALinear``
    with ``max_loras`` empty slots; ``pin``: keep host adapters in page-locked memory. Slots
    that would not fit the device's ``free_bytes`` are refused before any is allocated."""
    bases = [(i, projection, getattr(decoder, owner_name))
             for i, decoder in enumerate(model.model.layers)
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
    return LoRASlots(layers, max_loras, max_rank, max_cpu_loras,
                     loader=_pinned_loader if pin else load_adapter)


def _pinned_loader(path: str) -> LoRAAdapter:
    """The adapter with its weights in one page-locked buffer: a slot load's copies from
    pageable memory each went through a staging buffer, synchronously (the LoRA engine's
    prefill profile on the H200: 3,152 pageable copies, 30 ms of a 267 ms step), and one
    buffer costs one page-locked allocation per adapter instead of one per tensor."""
    adapter = load_adapter(path)
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
