"""All-reduce bus bandwidth between the GPUs of one host, at the sizes tensor parallelism sends.

Each row-parallel layer (o_proj, down_proj) sums a ``[tokens, hidden]`` bfloat16 tensor over the
ranks with ``torch.distributed.all_reduce`` (NCCL). This times that call two ways, for Llama-3's
hidden sizes (8B: 4,096; 70B: 8,192) and the token counts of decode batches and prefill chunks:

- ``eager``: the call as NCCL runs it on its own (what nccl-tests' all_reduce_perf times);
- ``graph``: captured in a CUDA graph and replayed, as the engine's decode steps run it.

Bus bandwidth is NCCL's definition: ``bytes / time * 2 (n - 1) / n``.

    python scripts/bench_allreduce.py --out benchmarks/results/allreduce_h200x2.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = (4096, 8192)
TOKENS = (1, 8, 32, 128, 256, 1024, 8192)
ITERS = 50


def _time_ms(fn, iters: int = ITERS) -> float:
    """Median of ``iters`` timed calls, each between CUDA events, after a warm-up."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _rank(rank: int, size: int, port: int, out: str | None) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    rows = []
    for hidden in HIDDEN:
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            eager = _time_ms(lambda x=x: dist.all_reduce(x))
            graph = torch.cuda.CUDAGraph()
            dist.all_reduce(x)  # NCCL's communicator set up outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                dist.all_reduce(x)
            replay = _time_ms(graph.replay)
            nbytes = x.numel() * x.element_size()
            factor = 2 * (size - 1) / size
            rows.append({"hidden": hidden, "tokens": tokens, "bytes": nbytes,
                         "eager_us": eager * 1e3, "graph_us": replay * 1e3,
                         "eager_busbw_gbs": nbytes / eager / 1e6 * factor,
                         "graph_busbw_gbs": nbytes / replay / 1e6 * factor})
            if rank == 0:
                r = rows[-1]
                print(f"hidden {hidden:5d} tokens {tokens:5d} {nbytes / 2**20:8.3f} MiB  "
                      f"eager {r['eager_us']:8.1f} us {r['eager_busbw_gbs']:7.1f} GB/s  "
                      f"graph {r['graph_us']:8.1f} us {r['graph_busbw_gbs']:7.1f} GB/s",
                      flush=True)
    if rank == 0 and out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "world_size": size, "rows": rows}, indent=2))
        print(f"wrote {out}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args()
    if torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"bench_allreduce.py needs {args.ranks} GPUs, "
                         f"this machine has {torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (device notes)
    mp.spawn(_rank, args=(args.ranks, 29533, args.out), nprocs=args.ranks)


if __name__ == "__main__":
    main()
