"""How tensor parallelism splits heads, vocabularies and quantized weights, and how rank 0
waits for the other ranks to join."""

from __future__ import annotations

import errno
import socket

import pytest
import torch

from pagedserve import distributed
from pagedserve.config import ConfigError
from pagedserve.distributed import Part, TensorParallel, split_heads
from pagedserve.quant.weights import Fp8Weight, GroupQuantWeight, take_columns, take_rows


def test_kv_heads_split_or_replicate():
    # 8 query heads, 2 KV heads on 4 ranks: ranks 0-1 share KV head 0, ranks 2-3 KV head 1.
    splits = [split_heads(8, 2, TensorParallel(r, 4)) for r in range(4)]
    assert [(s.num_heads, s.num_kv_heads) for s in splits] == [(2, 1)] * 4
    assert [s.q.start for s in splits] == [0, 2, 4, 6]
    assert [s.kv.start for s in splits] == [0, 0, 1, 1]
    assert split_heads(8, 4, TensorParallel(1, 2)).kv == Part(4, 2, 2)


def test_an_odd_vocabulary_pads_the_last_slice():
    parts = [TensorParallel(r, 2).padded_part(385) for r in range(2)]
    assert parts == [Part(385, 0, 193), Part(385, 193, 193)]
    table = torch.arange(385.0)[:, None]
    last = take_rows(table, parts[1].start, parts[1].size)
    assert last[:-1, 0].tolist() == list(range(193, 385)) and last[-1, 0] == 0


@pytest.mark.parametrize("weight", [
    GroupQuantWeight.quantize(torch.randn(6, 128, generator=torch.Generator().manual_seed(0)),
                              4, 32),
    GroupQuantWeight.quantize(torch.randn(6, 128, generator=torch.Generator().manual_seed(2)),
                              8, 128),
    Fp8Weight.quantize(torch.randn(6, 128, generator=torch.Generator().manual_seed(1))),
], ids=["group", "per-channel", "fp8"])
def test_quantized_slices_dequantize_to_the_dense_slices(weight):
    dense = weight.dequantize(torch.float64)
    rows = take_rows(weight, 2, 6)  # two rows past the end: zeros
    assert torch.equal(rows.dequantize(torch.float64),
                       torch.cat([dense[2:], torch.zeros(2, 128, dtype=torch.float64)]))
    cols = take_columns(weight, 64, 64)
    assert torch.equal(cols.dequantize(torch.float64), dense[:, 64:])


def test_a_cut_inside_a_group_is_refused():
    weight = GroupQuantWeight.quantize(torch.randn(4, 128), 4, 64)
    with pytest.raises(ConfigError, match="groups of 64"):
        take_columns(weight, 32, 32)


def _init_driver(dead_peer: distributed.DeadPeer, timeout_s: float) -> None:
    """Rank 0 of 2 joining, its store bound at a port of the system's choosing."""
    store = distributed.host_store("127.0.0.1", 2, timeout_s)
    distributed.init("gloo", f"127.0.0.1:{store.port}", 0, 2, timeout_s,
                     distributed.Rendezvous(store, dead_peer))


def test_rank_0_stops_waiting_when_a_peer_is_reported_dead():
    """No rank 1 ever joins; the third look at the peers finds it dead, long before the
    600 s timeout."""
    waits: list[float] = []

    def dead_peer(wait_s: float) -> str | None:
        waits.append(wait_s)
        return "tensor-parallel rank 1 failed: no such class" if len(waits) == 3 else None

    with pytest.raises(RuntimeError, match="^tensor-parallel rank 1 failed: no such class$"):
        _init_driver(dead_peer, 600.0)
    assert len(waits) == 3 and max(waits) <= 0.1
    assert not torch.distributed.is_initialized()


def test_rank_0_gives_up_when_no_peer_joins_in_time():
    with pytest.raises(RuntimeError, match=r"0 of 1 other ranks joined within 0.3s "
                                           r"\(PAGEDSERVE_DIST_TIMEOUT_S\)"):
        _init_driver(lambda wait_s: None, 0.3)


def test_the_drivers_store_holds_its_port_before_any_other_rank_starts():
    """The port was found free and let go, and the store bound it only after the other ranks
    were started: a process binding meanwhile could take it."""
    store = distributed.host_store("127.0.0.1", 2, 5.0)
    with socket.socket() as rival:
        with pytest.raises(OSError) as exc:
            rival.bind(("127.0.0.1", store.port))
    assert exc.value.errno == errno.EADDRINUSE
