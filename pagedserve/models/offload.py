"""CPU weight offload (``--cpu-offload-gb``): whole decoder layers held in host memory and
copied into a device staging slot just ahead of their turn, so a model larger than the device
serves.

Which layers: whole decoder layers, from the last one down, until N GiB are offloaded. Whole
layers, because every decoder layer of a model has one layout: two slots of one layer's size
serve all offloaded layers, and each layer crosses the bus as one contiguous copy (the
fastest unit of a host-to-device copy). From the end, because the first offloaded layer's copy
then runs while the resident layers compute in the same pass; offloaded from the start, the
first copy would have only the embedding to hide behind. The count is decided by the first
layer that finishes loading: ``ceil(N GiB / its bytes)``, at most all of them.

Which tensors: every parameter and buffer of the layer that no other layer shares (the rotary
tables are plain attributes and shared; they stay), whatever it is: a dense weight, a quant
method's packed values and scales, biases, norms. They are packed into one host buffer per
layer (pinned where the platform wants it, ``WeightStream.pin_memory``) and each tensor's
``.data`` becomes a view into the staging slot its layer runs from, so the modules and the
quant methods, which read ``layer.<name>``, run unchanged. A plain tensor attribute that is
neither (the CPU act-order permutation) stays resident. Each pass starts from the host copy,
so a buffer a kernel writes must be back to its value at load after each call (the W4A16
kernel's split-K counters return to zero).

The schedule of a forward pass, offloaded layers ``o_0 .. o_{M-1}``, ``o_k`` in slot ``k % S``
(``S = min(2, M)``): before the first decoder layer, ``begin`` and load ``o_0 .. o_{S-1}``;
before ``o_k``, wait for its slot; after ``o_k``, release its slot and load ``o_{k+S}`` into
it. So ``o_{k+1}`` crosses the bus while ``o_k`` computes (``WeightStream`` orders the two).

Loading: a layer is offloaded as soon as every tensor the checkpoint has for it is in place
(the model asks for the next tensor only once the last one is loaded), so the device holds the
resident layers and at most the layer being read; the views are bound when loading ends.

The device then holds the resident layers and ``S`` slots: offloading ``M`` layers saves
``M - S`` layers' bytes. No graphs are captured while layers are offloaded (the runner
refuses): the copies are issued by these hooks, per pass.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedserve.logger import get_logger

if TYPE_CHECKING:
    from pagedserve.platforms.interface import Platform, WeightStream
    from pagedserve.quant.weights import LoadedWeight

logger = get_logger(__name__)

_ALIGN = 256  # bytes: each tensor's offset in a layer's buffer, aligned for any dtype and copy
_SLOTS = 2


@dataclass(frozen=True, slots=True)
class _Placed:
    """One tensor of an offloaded layer at ``offset`` in its host buffer and its slot."""

    tensor: torch.Tensor  # the parameter or buffer object whose ``.data`` is moved
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True, slots=True)
class _HostLayer:
    host: torch.Tensor  # uint8, every tensor of the layer at its offset
    placed: list[_Placed]


class LayerOffload:
    """Offloads decoder layers of ``model`` (those of ``indices`` in the ``nn.ModuleList`` at
    ``prefix``: a pipeline stage's own), from the last one down, until ``budget_bytes`` are in
    host memory.

    Use: wrap the checkpoint's tensors in ``while_loading``, then call ``finish`` once."""

    def __init__(self, model: nn.Module, prefix: str, indices: range, budget_bytes: int,
                 platform: type[Platform]) -> None:
        self.layers: nn.ModuleList = model.get_submodule(prefix)
        self.indices = indices
        self.prefix = prefix
        self.budget_bytes = budget_bytes
        self.platform = platform
        self._expected: dict[int, set[str]] = {}
        for name in model.checkpoint_shapes():
            index = self._layer_of(name)
            if index is not None:
                self._expected.setdefault(index, set()).add(name)
        self._seen: dict[int, set[str]] = {}
        # A tensor that several layers hold stays resident. Counted before loading, when the
        # layers hold only what their modules made (norms, biases); weights arrive per layer.
        counts = Counter(id(t) for i in indices for t in _tensors(self.layers[i]))
        self._shared = {i for i, n in counts.items() if n > 1}
        self.chosen: range | None = None  # the offloaded layers' indices
        self.stream: WeightStream | None = None
        self._host: dict[int, _HostLayer] = {}
        self._held: set[int] = set()  # ids of the offloaded tensors
        self._order: list[_HostLayer] = []
        self.slots: list[torch.Tensor] = []

    def while_loading(self, weights: Iterable[tuple[str, LoadedWeight]]
                      ) -> Iterator[tuple[str, LoadedWeight]]:
        """``weights`` as they are, offloading each chosen layer once all of its are in."""
        for name, weight in weights:
            yield name, weight
            # The model asks for the next tensor only once this one is in place.
            self._arrived(name)

    def finish(self) -> None:
        """After loading: offload what was not yet, allocate the slots, bind every offloaded
        tensor to its slot, and install the schedule's hooks on the layers."""
        if self.chosen is None:
            self._choose(self.layers[self.indices[-1]])
        for index in self.chosen:
            if index not in self._host:
                self._offload(index)
        self._order = [self._host[i] for i in self.chosen]
        size = max(h.host.numel() for h in self._order)
        device = self.platform.device()
        self.slots = [torch.empty(size, dtype=torch.uint8, device=device)
                      for _ in range(self.stream.num_slots)]
        for k, layer in enumerate(self._order):
            for p in layer.placed:
                p.tensor.data = p.view(self.slots[k % len(self.slots)])
        self._install_hooks()
        logger.info("cpu offload: decoder layers %d-%d (%d of %d, %.2f GiB) in host memory%s, "
                    "%d staging slots of %.1f MiB on the device", self.chosen.start,
                    self.chosen.stop - 1, len(self.chosen), len(self.indices),
                    self.host_bytes / 2**30, " (pinned)" * self.stream.pin_memory,
                    len(self.slots), size / 2**20)

    @property
    def host_bytes(self) -> int:
        return sum(h.host.numel() for h in self._host.values())

    @property
    def staging_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (a parameter or buffer) belongs to an offloaded layer."""
        return id(tensor) in self._held

    def _layer_of(self, name: str) -> int | None:
        head = self.prefix + "."
        if not name.startswith(head):
            return None
        index = name[len(head):].split(".", 1)[0]
        return int(index) if index.isdigit() else None

    def _arrived(self, name: str) -> None:
        index = self._layer_of(name)
        expected = self._expected.get(index)
        if expected is None or name not in expected:
            return
        seen = self._seen.setdefault(index, set())
        seen.add(name)
        if len(seen) < len(expected):
            return
        if self.chosen is None:
            self._choose(self.layers[index])
        if index in self.chosen:
            self._offload(index)

    def _choose(self, layer: nn.Module) -> None:
        layer_bytes = sum(_nbytes(t) for t in self._own(layer))
        count = min(len(self.indices), math.ceil(self.budget_bytes / max(1, layer_bytes)))
        self.chosen = range(self.indices.stop - count, self.indices.stop)
        self.stream = self.platform.weight_stream(min(_SLOTS, count))

    def _own(self, layer: nn.Module) -> list[torch.Tensor]:
        return [t for t in _tensors(layer) if id(t) not in self._shared]

    def _offload(self, index: int) -> None:
        """Copy layer ``index``'s tensors into one host buffer and free their device memory."""
        placed, offset = [], 0
        for t in self._own(self.layers[index]):
            placed.append(_Placed(t, offset, _nbytes(t), t.dtype, t.shape))
            offset += -(-_nbytes(t) // _ALIGN) * _ALIGN
        host = self.stream.host_buffer(max(offset, _ALIGN))
        for p in placed:
            p.view(host).copy_(p.tensor)
            p.tensor.data = torch.empty(0, dtype=p.dtype, device=p.tensor.device)
        self._host[index] = _HostLayer(host, placed)
        self._held.update(id(p.tensor) for p in placed)

    def _install_hooks(self) -> None:
        # Registered first: when the first decoder layer is offloaded too, its slot is loaded
        # before its own hook waits for it.
        self.layers[self.indices[0]].register_forward_pre_hook(lambda *_: self._start())
        for k, index in enumerate(self.chosen):
            self.layers[index].register_forward_pre_hook(
                lambda *_, k=k: self.stream.wait(k % len(self.slots)))
            self.layers[index].register_forward_hook(lambda *_, k=k: self._done(k))

    def _start(self) -> None:
        self.stream.begin()
        for k in range(len(self.slots)):
            self._load(k)

    def _done(self, k: int) -> None:
        self.stream.release(k % len(self.slots))
        if k + len(self.slots) < len(self._order):
            self._load(k + len(self.slots))

    def _load(self, k: int) -> None:
        slot = k % len(self.slots)
        host = self._order[k].host
        self.stream.load(slot, self.slots[slot][:host.numel()], host)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return list(itertools.chain(module.parameters(), module.buffers()))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
