"""Tensor parallelism: which slice of each weight a rank holds, and the collectives between
ranks.

Megatron's split: column-parallel layers (q/k/v, gate/up, the LM head) give each rank a slice
of their output rows; row-parallel layers (o_proj, down_proj) take the matching slice of their
input columns and sum their partial outputs with one all-reduce. A ``TensorParallel`` of size 1
is the single-device engine: nothing is sliced and no collective is ever called.

Collectives run in ``torch.distributed``'s default group, which every rank joins once at start
(``init``) with the backend the platform names (``Platform.dist_backend``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class Part:
    """Rows ``[start, start + size)`` of a checkpoint dimension of ``full`` rows. Rows past
    ``full`` (a padded vocabulary partition) are zeros."""

    full: int
    start: int
    size: int

    @classmethod
    def whole(cls, full: int) -> Part:
        return cls(full, 0, full)

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.size == self.full


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def even_part(self, full: int) -> Part:
        """This rank's slice of a dimension the config check found divisible by ``size``."""
        each = full // self.size
        return Part(full, self.rank * each, each)

    def padded_part(self, full: int) -> Part:
        """A slice of ``ceil(full / size)`` rows, zero-padded past ``full`` (vocabularies)."""
        each = -(-full // self.size)
        return Part(full, self.rank * each, each)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(x)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's ``x`` concatenated along the last dimension; the others
        get None."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        torch.distributed.broadcast(x, src=0)
        return x

    def min_over_ranks(self, values: list[int], device: torch.device) -> list[int]:
        """Element-wise minimum over ranks, so every rank settles on sizes all can hold."""
        t = torch.tensor(values, dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return t.tolist()


class HeadSplit(NamedTuple):
    """The attention heads one rank computes. With fewer KV heads than ranks each KV head is
    replicated on ``size / num_kv_heads`` ranks (GQA)."""

    num_heads: int
    num_kv_heads: int
    q: Part  # of the checkpoint's q_proj rows, in heads
    kv: Part  # of k_proj's and v_proj's rows, in heads


def split_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadSplit:
    q = tp.even_part(num_heads)
    if num_kv_heads >= tp.size:
        kv = tp.even_part(num_kv_heads)
    else:
        kv = Part(num_kv_heads, tp.rank // (tp.size // num_kv_heads), 1)
    return HeadSplit(q.size, kv.size, q, kv)


def check_divisible(num_heads: int, num_kv_heads: int, intermediate: int, size: int) -> str | None:
    """Why the model cannot be split ``size`` ways, or None."""
    if num_heads % size:
        return f"the model's {num_heads} attention heads do not divide into {size}"
    if num_kv_heads >= size and num_kv_heads % size:
        return f"the model's {num_kv_heads} KV heads do not divide into {size}"
    if num_kv_heads < size and size % num_kv_heads:
        return f"{size} ranks cannot share the model's {num_kv_heads} KV heads evenly"
    if intermediate % size:
        return f"the model's intermediate size {intermediate} does not divide into {size}"
    return None


def init(backend: str, address: str, rank: int, size: int, timeout_s: float) -> None:
    """Join the default process group (``address``: ``host:port`` of rank 0's store).
    ``timeout_s`` bounds every collective, so a rank whose peer died stops waiting."""
    torch.distributed.init_process_group(
        backend, init_method=f"tcp://{address}", rank=rank, world_size=size,
        timeout=timedelta(seconds=timeout_s))


def shutdown() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
