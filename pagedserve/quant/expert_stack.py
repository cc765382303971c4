"""One projection (gate, up or down) of every expert of a mixture-of-experts layer, held in its
checkpoint's quantized form: each tensor of a ``quant.weights`` form stacked along a leading
expert dimension, as parameters (so sleep mode and CPU offload move them as any weight).

The first expert's weight to arrive fixes the form, its dtypes and shapes; every expert's
weight is then copied into its row. ``take(ids)`` gives the same form over those experts
(tensors ``[len(ids), ...]``), whose ``dequantize`` is ``[len(ids), N, K]``; ``whole()`` the
form over every expert, its tensors the stack's own. ``holding(form)`` makes a stack of a form
whose tensors are stacked already (a kernel's layout made from other stacks at load, gate and
up in one stack: ``put_half`` writes one expert's half of its rows).

Two things differ from the loaded forms. 4-bit values are held two to a byte (a form holds
one a byte), so a 4-bit checkpoint's experts take about half a byte a weight with their scales.
An FP8 expert's static ``input_scale`` is dropped: experts multiply 16-bit activations.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from pagedserve.quant.weights import (
    Fp8Weight,
    GroupQuantWeight,
    LoadedWeight,
    PackedIntWeight,
    pack_nibbles,
    unpack_nibbles,
)

# What a stack holds: a checkpoint's form, or a kernel's layout made of such stacks at load.
Stacked = LoadedWeight | PackedIntWeight

_PACKED = "values"  # the field held two values a byte when the form's bits are 4 or fewer


class ExpertStack(nn.Module):
    def __init__(self, num_experts: int, device: torch.device) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.device = device
        self.form: type | None = None  # the quant.weights class every expert's weight is
        self.static: dict[str, Any] = {}  # the form's non-tensor fields (bits, block, ...)
        self.columns = 0  # K: unpacking 4-bit values drops the pad of an odd K

    @property
    def packs_nibbles(self) -> bool:
        return self.form is GroupQuantWeight and self.static["bits"] <= 4

    def put(self, expert: int, weight: Stacked) -> None:
        tensors = self._fields_of(expert, weight)
        if self.form is GroupQuantWeight:
            self._put_perm(expert, weight.input_perm)
        self._copy(expert, tensors, slice(None))

    def put_half(self, expert: int, weight: Stacked, second: bool) -> None:
        """One expert's gate (``second`` False) or up projection in a stack of both, made by
        ``holding``: each tensor of ``weight`` fills the first or the second half of that
        expert's rows of the stacked tensor (its rows, or its rows of scale blocks)."""
        if self.form is None:
            raise ValueError("put_half writes into a stack made by holding")
        for name, tensor in self._fields_of(expert, weight).items():
            rows = tensor.shape[0]
            self._copy(expert, {name: tensor}, slice(rows * second, rows * (second + 1)))

    def _fields_of(self, expert: int, weight: Stacked) -> dict[str, torch.Tensor]:
        """``weight``'s tensors as the stack holds them (4-bit values packed), after checking
        its form against the stack's (or, for the first, making the stack's tensors)."""
        if isinstance(weight, Fp8Weight):
            weight = dataclasses.replace(weight, input_scale=None)
        tensors, static = _fields(weight)
        if self.form is None:
            self._make(weight, tensors, static)
        elif type(weight) is not self.form or static != self.static:
            raise ValueError(f"expert {expert} is {_describe(type(weight), static)}, another "
                             f"expert of its layer {_describe(self.form, self.static)}")
        if self.packs_nibbles:
            tensors[_PACKED] = pack_nibbles(tensors[_PACKED])
        return tensors

    def _copy(self, expert: int, tensors: dict[str, torch.Tensor], rows: slice) -> None:
        for name, tensor in tensors.items():
            stacked = getattr(self, name)[expert, rows]
            if tensor.shape != stacked.shape:
                raise ValueError(f"expert {expert}'s {name} has shape {tuple(tensor.shape)}, "
                                 f"another expert's {tuple(stacked.shape)}")
            stacked.copy_(tensor)

    @classmethod
    def holding(cls, weight: Stacked) -> ExpertStack:
        """A stack of ``weight``, a form whose tensors have a leading expert dimension; the
        tensors become its parameters as they are (4-bit grouped values: packed, a copy)."""
        if isinstance(weight, torch.Tensor):
            raise ValueError("ExpertStack.holding takes a quantized form, not a tensor")
        tensors, static = _fields(weight)
        stack = cls(weight.shape[0], weight.values.device)
        stack.form, stack.static, stack.columns = type(weight), static, weight.shape[-1]
        if stack.packs_nibbles:
            tensors[_PACKED] = pack_nibbles(tensors[_PACKED])
        if getattr(weight, "input_perm", None) is not None:
            tensors["input_perm"] = weight.input_perm
        for name, tensor in tensors.items():
            stack.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        return stack

    def take(self, ids: torch.Tensor) -> Stacked:
        """The experts ``ids`` (an int64 tensor on the stack's device) in their form."""
        return self._form({name: p[ids] for name, p in self.named_parameters(recurse=False)})

    def whole(self) -> Stacked:
        """Every expert in the stack's form, the tensors its parameters (4-bit values are
        unpacked: a copy)."""
        return self._form(dict(self.named_parameters(recurse=False)))

    def _form(self, tensors: dict[str, torch.Tensor]) -> Stacked:
        if self.packs_nibbles:
            tensors[_PACKED] = unpack_nibbles(tensors[_PACKED], self.columns)
        return self.form(**tensors, **self.static)

    def _make(self, weight: Stacked, tensors: dict[str, torch.Tensor],
              static: dict[str, Any]) -> None:
        self.form, self.static, self.columns = type(weight), static, weight.shape[-1]
        for name, tensor in tensors.items():
            shape = tensor.shape
            if name == _PACKED and self.packs_nibbles:
                shape = (*shape[:-1], -(-shape[-1] // 2))
            self.register_parameter(name, nn.Parameter(
                torch.empty((self.num_experts, *shape), dtype=tensor.dtype, device=self.device),
                requires_grad=False))

    def _put_perm(self, expert: int, perm: torch.Tensor | None) -> None:
        """GPTQ act-order: every expert of a stack that has a permutation holds one, the
        identity for an expert whose columns came in order (made when the first arrives)."""
        has = "input_perm" in self._parameters
        if perm is None and not has:
            return
        identity = torch.arange(self.columns, device=self.device)
        if not has:
            self.register_parameter("input_perm", nn.Parameter(
                identity.repeat(self.num_experts, 1), requires_grad=False))
        self.input_perm[expert].copy_(identity if perm is None else perm)


def _fields(weight: Stacked) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A form's tensor fields (an absent act-order permutation left out, ``_put_perm`` holds
    that one) and its other fields."""
    tensors, static = {}, {}
    for field in dataclasses.fields(weight):
        value = getattr(weight, field.name)
        if field.name == "input_perm":
            continue
        (tensors if isinstance(value, torch.Tensor) else static)[field.name] = value
    return tensors, static


def _describe(form: type, static: dict[str, Any]) -> str:
    details = ", ".join(f"{k} {v}" for k, v in static.items() if v is not None)
    return f"{form.__name__} ({details})" if details else form.__name__
