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

import time
from collections.abc import Callable
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


# Why a peer rank is gone, or None while all run, after waiting up to the given seconds for
# one to be reported gone: the driver's ``RemoteRanks.dead_reason``.
DeadPeer = Callable[[float], str | None]

_JOINED = "pagedserve/joined"  # how many of ranks 1 .. N-1 have reached the rendezvous
_POLL_S = 0.1


def init(backend: str, address: str, rank: int, size: int, timeout_s: float,
         dead_peer: DeadPeer | None = None) -> None:
    """Join the default process group through rank 0's store at ``address`` (``host:port``).
    ``timeout_s`` bounds every collective, so a rank whose peer died stops waiting. Rank 0
    passes ``dead_peer``: while it waits for the others to join, a rank that died first
    (it could not read its options, its setup failed) fails this at once with its reason,
    rather than after ``timeout_s``."""
    timeout = timedelta(seconds=timeout_s)
    host, port = address.rsplit(":", 1)
    store = torch.distributed.TCPStore(host, int(port), size, is_master=rank == 0,
                                       timeout=timeout, wait_for_workers=False)
    if rank == 0:
        _wait_for_peers(store, size, timeout_s, dead_peer)
    else:
        store.add(_JOINED, 1)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=size,
                                         timeout=timeout)


def _wait_for_peers(store: torch.distributed.Store, size: int, timeout_s: float,
                    dead_peer: DeadPeer | None) -> None:
    """Rank 0: wait until ranks 1 .. N-1 have all reached the store, asking between short
    polls whether one has died instead (``init_process_group`` would wait ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (joined := store.add(_JOINED, 0)) < size - 1:
        if dead_peer is None:  # no one to ask: wait as init_process_group would
            time.sleep(_POLL_S)
        elif (reason := dead_peer(_POLL_S)) is not None:
            raise RuntimeError(reason)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{joined} of {size - 1} tensor-parallel ranks joined within "
                               f"{timeout_s:g}s (PAGEDSERVE_DIST_TIMEOUT_S)")


def shutdown(peers_alive: bool = True) -> None:
    """Leave the default process group. With NCCL, leaving is itself collective (its
    finalize waits for every rank), so every live rank calls this at about the same time;
    with a peer gone, the communicator is aborted instead, which waits for nobody."""
    if not torch.distributed.is_initialized():
        return
    if peers_alive:
        torch.distributed.destroy_process_group()
    else:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
