"""Tensor and pipeline parallelism: which slice of each weight and which decoder layers a rank
holds, and the messages between ranks.

Megatron's split: column-parallel layers (q/k/v, gate/up, the LM head) give each rank a slice
of their output rows; row-parallel layers (o_proj, down_proj) take the matching slice of their
input columns and sum their partial outputs with one all-reduce. A ``TensorParallel`` of size 1
is the single-device engine: nothing is sliced and no collective is ever called.

Pipeline parallelism splits the decoder layers into contiguous stages (``split_layers``), each
a group of tensor-parallel ranks (``Layout``: rank = stage * tp_size + tp_rank, as vLLM lays
them out). The first stage embeds the tokens, each stage hands its hidden states and residual
to the same tensor-parallel rank of the next (``PipelineStage``), and the last applies the
final norm and the LM head; its first rank is the driver, which samples.

Every rank joins ``torch.distributed``'s default group once at start (``init``) with the
backend the platform names (``Platform.dist_backend``). Tensor-parallel collectives run in it
when there is one stage, else in a group per stage; the driver's broadcasts, the agreement on
sizes and the stages' point-to-point messages run in the default group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch

from pagedserve.errors import ConfigError


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
    """A rank's place among its stage's ``size`` ranks. ``group`` None: the default group
    (one stage); ``first``: the global rank of the group's rank 0, where gathers land."""

    rank: int = 0
    size: int = 1
    group: torch.distributed.ProcessGroup | None = None
    first: int = 0

    def even_part(self, full: int) -> Part:
        """This rank's slice of a dimension the config check found divisible by ``size``."""
        each = full // self.size
        return Part(full, self.rank * each, each)

    def padded_part(self, full: int) -> Part:
        """A slice of ``ceil(full / size)`` rows, zero-padded past ``full`` (vocabularies)."""
        each = -(-full // self.size)
        return Part(full, self.rank * each, each)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """The group's rank 0 gets every rank's ``x`` concatenated along the last dimension;
        the others get None."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(x, parts, dst=self.first, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None


@dataclass(frozen=True)
class Layout:
    """The engine's ``tp_size * pp_size`` ranks: rank ``stage * tp_size + tp_rank``, so that a
    stage's tensor-parallel ranks are adjacent (on one host, where the backend packs them).
    The driver, the rank in the engine's own process, is the last stage's first rank: the
    logits are there, so it samples and only sampled tokens travel back."""

    tp_size: int = 1
    pp_size: int = 1

    @property
    def size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def driver(self) -> int:
        return (self.pp_size - 1) * self.tp_size

    def others(self) -> list[int]:
        """Every rank but the driver's, in order: those a backend starts."""
        return [r for r in range(self.size) if r != self.driver]

    def name(self, rank: int) -> str:
        """How errors name a rank."""
        if self.pp_size == 1:
            return f"tensor-parallel rank {rank}"
        return (f"rank {rank} (pipeline stage {rank // self.tp_size}, tensor-parallel rank "
                f"{rank % self.tp_size})")

    def stage(self, rank: int, layer_split: tuple[int, ...]) -> PipelineStage:
        """Rank ``rank``'s stage, given each stage's layer count (``split_layers``)."""
        index = rank // self.tp_size
        start = sum(layer_split[:index])
        return PipelineStage(self, rank, range(start, start + layer_split[index]))

    def tensor_parallel(self, rank: int) -> TensorParallel:
        """Rank ``rank``'s tensor-parallel place. With several stages every rank makes every
        stage's group, in the same order (``new_group`` is collective), and keeps its own."""
        if self.pp_size == 1 or self.tp_size == 1:
            return TensorParallel(rank % self.tp_size, self.tp_size)
        groups = [torch.distributed.new_group(list(range(s * self.tp_size,
                                                         (s + 1) * self.tp_size)))
                  for s in range(self.pp_size)]
        stage = rank // self.tp_size
        return TensorParallel(rank % self.tp_size, self.tp_size, groups[stage],
                              stage * self.tp_size)

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        torch.distributed.broadcast(x, src=self.driver)
        return x

    def min_over_ranks(self, values: list[int], device: torch.device) -> list[int]:
        """Element-wise minimum over every rank, so that all settle on sizes all can hold."""
        t = torch.tensor(values, dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return t.tolist()


class Intermediate(NamedTuple):
    """What one stage hands the next: the hidden states of the last layer it ran and the
    residual stream before them, both ``[num_tokens, hidden]`` (the next layer's first norm
    adds them)."""

    hidden: torch.Tensor
    residual: torch.Tensor


@dataclass(frozen=True)
class PipelineStage:
    """One rank's stage: the decoder layers it runs, and the ranks it receives from and sends
    to (the same tensor-parallel rank of the stages before and after, each of which holds the
    whole hidden states once its all-reduces are done). The default is the whole model on one
    rank: no neighbour, nothing sent."""

    layout: Layout = Layout()
    rank: int = 0
    layers: range | None = None  # None: every layer

    @property
    def index(self) -> int:
        return self.rank // self.layout.tp_size

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.layout.pp_size - 1

    def layer_range(self, num_layers: int) -> range:
        return range(num_layers) if self.layers is None else self.layers

    def send(self, out: Intermediate) -> None:
        """One message (hidden and residual stacked), so each step pays one latency."""
        torch.distributed.send(torch.stack(out), dst=self.rank + self.layout.tp_size)

    def recv(self, num_tokens: int, width: int, dtype: torch.dtype,
             device: torch.device) -> Intermediate:
        """The previous stage's ``send`` of a step of ``num_tokens`` rows (every rank knows
        the count from the step's inputs)."""
        both = torch.empty((2, num_tokens, width), dtype=dtype, device=device)
        torch.distributed.recv(both, src=self.rank - self.layout.tp_size)
        return Intermediate(*both.unbind(0))


def split_layers(num_layers: int, pp_size: int,
                 partition: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Each stage's number of decoder layers: ``partition`` where given (checked against the
    model), else vLLM's even split. Its remainder goes one layer each to the stages before
    the last, from the second-to-last backwards: the last stage already holds the final norm
    and the LM head, and with a small remainder the first (the embedding) is spared too."""
    if num_layers < pp_size:
        raise ConfigError(f"--pipeline-parallel-size {pp_size}: the model has only "
                          f"{num_layers} decoder layers")
    if partition is not None:
        shown = ",".join(map(str, partition))
        if len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
            raise ConfigError(
                f"the layer partition {shown} (PAGEDSERVE_PP_LAYER_PARTITION or "
                f"VLLM_PP_LAYER_PARTITION) must give each of the --pipeline-parallel-size "
                f"{pp_size} stages at least one layer, {num_layers} in all")
        return partition
    counts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        counts[-i] += 1
    return tuple(counts)


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

_JOINED = "pagedserve/joined"  # how many ranks but the driver have reached the rendezvous
_POLL_S = 0.1


@dataclass(frozen=True)
class Rendezvous:
    """The driver's side of the rendezvous: its store, and ``dead_peer``, its way to learn
    that a rank died before joining."""

    store: torch.distributed.TCPStore
    dead_peer: DeadPeer


def host_store(host: str, size: int, timeout_s: float) -> torch.distributed.TCPStore:
    """The driver's rendezvous store for ``size`` ranks, bound at ``host`` on a port the system
    picks (its ``port``), before any other rank starts: a port found free and let go could
    be bound by another process before the store took it."""
    return torch.distributed.TCPStore(host, 0, size, is_master=True,
                                      timeout=timedelta(seconds=timeout_s),
                                      wait_for_workers=False)


def init(backend: str, address: str, rank: int, size: int, timeout_s: float,
         rendezvous: Rendezvous | None = None) -> None:
    """Join the default process group through the driver's store at ``address``
    (``host:port``). ``timeout_s`` bounds every collective, so a rank whose peer died stops
    waiting. The driver passes its ``rendezvous`` (its store already serves ``address``):
    while it waits for the others to join, a rank that died first (it could not read its
    options, its setup failed) fails this at once with its reason, rather than after
    ``timeout_s``."""
    timeout = timedelta(seconds=timeout_s)
    if rendezvous is not None:
        store = rendezvous.store
        _wait_for_peers(store, size, timeout_s, rendezvous.dead_peer)
    else:
        host, port = address.rsplit(":", 1)
        store = torch.distributed.TCPStore(host, int(port), size, is_master=False,
                                           timeout=timeout, wait_for_workers=False)
        store.add(_JOINED, 1)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=size,
                                         timeout=timeout)


def _wait_for_peers(store: torch.distributed.Store, size: int, timeout_s: float,
                    dead_peer: DeadPeer) -> None:
    """The driver: wait until the other ranks have all reached the store, asking between
    short polls whether one has died instead (``init_process_group`` would wait
    ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (joined := store.add(_JOINED, 0)) < size - 1:
        if (reason := dead_peer(_POLL_S)) is not None:
            raise RuntimeError(reason)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{joined} of {size - 1} other ranks joined within "
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
