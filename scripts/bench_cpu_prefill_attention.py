"""The CPU prefill attention kernel alone: ``CpuPagedAttention`` (``lo_paged_prefill``) against
the same step through ``TorchPagedAttention`` (gather + SDPA per sequence, the CPU's prompt
path before the kernel), one layer of the default model's shape (9 query / 3 kv heads of 64)
and of an 8B-like one (32 / 8 of 128), float32 and bfloat16 pools, block size 16.

    .venv/bin/python scripts/bench_cpu_prefill_attention.py [--threads N] [--out JSON]

Times are the best of 3 rounds of 5 calls (each call writes the step's keys and values, then
attends); GFLOP/s counts 4 * head_dim FLOPs per (query row, visible key, query head).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# Run as a plain script from anywhere: the package lives one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.attention.metadata import AttentionMetadata  # noqa: E402
from pagedserve.attention.torch_paged import TorchPagedAttention  # noqa: E402
from pagedserve.platforms.cpu.attention import CpuPagedAttention  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "8b-like": (32, 8, 128)}
# (sequences, new tokens each, cached tokens each)
CASES = [(4, 512, 0), (2, 512, 1536), (16, 128, 0)]
BLOCK = 16


def step(heads: int, kv_heads: int, dim: int, seqs: int, new: int, cached: int,
         dtype: torch.dtype):
    """A pool holding each sequence's cached tokens, the step's q/k/v and its metadata."""
    per_seq = -(-(cached + new) // BLOCK)
    cache = torch.randn(2, seqs * per_seq, BLOCK, kv_heads, dim).to(dtype)
    tables = torch.randperm(seqs * per_seq).to(torch.int32).view(seqs, per_seq)
    positions = torch.arange(cached, cached + new)
    slots = (tables[:, positions // BLOCK].long() * BLOCK + positions % BLOCK).flatten()
    rows = seqs * new
    meta = AttentionMetadata(
        num_seqs=seqs, num_tokens=rows, max_query_len=new, max_seq_len=cached + new,
        block_size=BLOCK, query_start_loc=torch.arange(0, rows + 1, new, dtype=torch.int32),
        seq_lens=torch.full((seqs,), cached + new, dtype=torch.int32),
        context_lens=torch.full((seqs,), cached, dtype=torch.int32), block_tables=tables,
        slot_mapping=slots, query_lens_cpu=[new] * seqs, seq_lens_cpu=[cached + new] * seqs)
    q, k, v = torch.randn(rows, heads, dim), torch.randn(rows, kv_heads, dim), \
        torch.randn(rows, kv_heads, dim)
    return q, k, v, cache, meta


def best_ms(backend, args) -> float:
    backend.forward(*args)
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(5):
            backend.forward(*args)
        rounds.append((time.perf_counter() - start) / 5 * 1e3)
    return min(rounds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for name, (heads, kv_heads, dim) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            for seqs, new, cached in CASES:
                inputs = step(heads, kv_heads, dim, seqs, new, cached, dtype)
                scale = dim ** -0.5
                native = best_ms(CpuPagedAttention(heads, dim, kv_heads, scale), inputs)
                torch_ms = best_ms(TorchPagedAttention(heads, dim, kv_heads, scale), inputs)
                pairs = seqs * (new * cached + new * (new + 1) // 2)
                gflop = 4 * dim * heads * pairs / 1e9
                row = {"shape": name, "kv_dtype": str(dtype).removeprefix("torch."),
                       "seqs": seqs, "new": new, "cached": cached, "native_ms": native,
                       "torch_ms": torch_ms, "native_gflop_s": gflop / native * 1e3,
                       "speedup": torch_ms / native}
                results.append(row)
                print(f"{name:8s} {row['kv_dtype']:8s} {seqs:2d} x {new:3d} after {cached:4d}: "
                      f"native {native:7.2f} ms ({row['native_gflop_s']:5.1f} GFLOP/s), "
                      f"torch {torch_ms:7.2f} ms, {row['speedup']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
