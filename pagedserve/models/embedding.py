"""The token embedding table, dense or kept in its quantized form (GGUF's Q8_0 tables).

Under tensor parallelism each rank holds a slice of the vocabulary (the last one padded with
zero rows when the vocabulary does not divide evenly), looks up the tokens that fall in it,
writes zeros for the others, and an all-reduce sums the ranks' rows."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.distributed import TensorParallel
from pagedserve.quant.weights import GroupQuantWeight, LoadedWeight, dequantize, take_rows


class VocabEmbedding(nn.Module):
    """A lookup reads one row per token, so a quantized table is dequantized row by row as it
    is read, and the full table never exists in float."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.shape = (vocab_size, hidden_size)
        self.tp = tp
        self.part = tp.padded_part(vocab_size)
        self.dtype = dtype
        self.device = device
        self.weight: nn.Parameter | None = None
        self.quant_format: tuple[int, int] | None = None  # (bits, group_size) when quantized

    @property
    def loaded(self) -> bool:
        return self.weight is not None or self.quant_format is not None

    def load(self, weight: LoadedWeight) -> None:
        if tuple(weight.shape) != self.shape:
            raise ValueError(f"embedding has shape {tuple(weight.shape)}, expected {self.shape}")
        if not self.part.is_whole:
            weight = take_rows(weight, self.part.start, self.part.size)
        if isinstance(weight, GroupQuantWeight) and weight.input_perm is None:
            groups = weight.group_of_column().to(self.device)
            self.quant_format = (weight.bits, weight.group_size)
            # Parameters (never trained) so weight byte counts include them.
            for name in ("values", "scales", "offsets"):
                setattr(self, name, nn.Parameter(getattr(weight, name).to(self.device),
                                                 requires_grad=False))
            self.register_buffer("groups", groups)
        else:
            self.weight = nn.Parameter(dequantize(weight).to(self.device, self.dtype),
                                       requires_grad=False)

    def as_weight(self) -> LoadedWeight:
        """The table as a linear weight, for an LM head tied to it."""
        if self.weight is not None:
            return self.weight
        return GroupQuantWeight(self.values, self.scales, self.offsets, *self.quant_format)

    def gathered_to_first(self) -> torch.Tensor | None:
        """The whole table, dequantized, on rank 0 (None on the others): every rank calls
        it, as it is a collective under tensor parallelism."""
        rows = dequantize(self.as_weight()).to(self.device, self.dtype)
        if self.tp.size == 1:
            return rows
        full = self.tp.gather_to_first(rows.T)
        return None if full is None else full.T[:self.shape[0]].contiguous()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        local = ids - self.part.start
        outside = (local < 0) | (local >= self.part.size)
        rows = self._lookup(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(rows)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return nn.functional.embedding(ids, self.weight)
        values = self.values[ids].float()
        rows = values * self.scales[ids][:, self.groups] + self.offsets[ids][:, self.groups]
        return rows.to(self.dtype)
