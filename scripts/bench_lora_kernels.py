"""Time the Triton LoRA shrink and expand (``platforms/cuda/kernels/lora.py``) on an NVIDIA GPU,
over their tile sizes, at Llama-3-8B's projections with rank 16 and 32 slots.

Rows come as a 1,000-row decode step (rows take turns over 8 adapters, so a slot's rows are
scattered) and as an 8,192-row prefill step (runs of 128 rows per adapter). Each variant is
timed from CUDA graphs (``triton.testing.do_bench_cudagraph``) against the bytes it must move:
the expand reads and writes the projection's output (T x N, 16-bit), the shrink reads x (T x K);
``% copy`` is that traffic over the device-to-device copy rate measured in the same run. A
variant sets the module's tile constants before its calls (the kernels take them as
compile-time constants), so each is compiled once; the constants the module ships with are
marked ``*``.

    python scripts/bench_lora_kernels.py --out benchmarks/results/issue28/lora_kernels_h200.json
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

# Run as a plain script from anywhere: the package lives one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.bench.common import write_result  # noqa: E402
from pagedserve.lora.ops import group_rows  # noqa: E402
from pagedserve.platforms.cuda.kernels import lora  # noqa: E402
from scripts.bench_w4a16 import _time, copy_bandwidth_gbs  # noqa: E402

RANK, SLOTS, ADAPTERS = 16, 32, 8
# (name, K, output shards)
PROJECTIONS = (("qkv", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)),
               ("gate_up", 4096, (14336, 14336)), ("down", 14336, (4096,)))
STEPS = (("decode", 1000, 1), ("prefill", 8192, 128))  # (name, rows, rows per adapter run)
# (_EXPAND_M, _EXPAND_N, _EXPAND_WARPS) and (_SHRINK_M, _SHRINK_K, _SHRINK_WARPS)
EXPANDS = ((16, 64, 4), (32, 64, 4), (16, 128, 4), (32, 128, 4), (64, 64, 4), (64, 128, 8),
           (32, 256, 8), (64, 256, 8))
SHRINKS = ((16, 64, 4), (32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 8), (16, 128, 4))


def step_rows(num_rows: int, run: int) -> torch.Tensor:
    """Each row's slot: runs of ``run`` rows taking turns over the adapters' slots."""
    return ((torch.arange(num_rows) // run) % ADAPTERS).to(torch.int32).cuda()


def operands(k: int, shards: tuple[int, ...], rows: int) -> dict:
    n = sum(shards)
    offs = [sum(shards[:i]) for i in range(len(shards))]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    return {"x": rand(rows, k), "a": rand(SLOTS, len(shards) * RANK, k) * 0.01,
            "b": rand(SLOTS, RANK, n) * 0.01, "out": rand(rows, n),
            "shards": tuple(zip(offs, shards))}


def set_tiles(expand: tuple[int, int, int], shrink: tuple[int, int, int]) -> None:
    lora._EXPAND_M, lora._EXPAND_N, lora._EXPAND_WARPS = expand
    lora._SHRINK_M, lora._SHRINK_K, lora._SHRINK_WARPS = shrink
    lora._SGMV_MIN_PART = 4 * lora._SHRINK_K


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shipped = ((lora._EXPAND_M, lora._EXPAND_N, lora._EXPAND_WARPS),
               (lora._SHRINK_M, lora._SHRINK_K, lora._SHRINK_WARPS))
    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy {copy_gbs:.0f} GB/s")
    rows_out = []
    for step, num_rows, run in STEPS:
        slots = step_rows(num_rows, run)
        grouped = group_rows(slots, SLOTS)
        for name, k, shards in PROJECTIONS:
            ops = operands(k, shards, num_rows)
            shrunk = lora.shrink(ops["x"], ops["a"], grouped,
                                 lora.shrink_buffer(ops["x"], ops["a"]))
            for tiles in EXPANDS:
                set_tiles(tiles, shipped[1])
                ms = _time(functools.partial(lora.expand, shrunk, ops["b"], ops["out"],
                                             ops["shards"], grouped))
                moved = 2 * ops["out"].numel() * ops["out"].element_size()
                rows_out.append(_row(step, name, "expand", tiles, ms, moved, copy_gbs,
                                     tiles == shipped[0]))
            for tiles in SHRINKS:
                set_tiles(shipped[0], tiles)
                buffer = lora.shrink_buffer(ops["x"], ops["a"])  # this variant's parts
                ms = _time(functools.partial(lora.shrink, ops["x"], ops["a"], grouped, buffer))
                moved = ops["x"].numel() * ops["x"].element_size()
                rows_out.append(_row(step, name, "shrink", tiles, ms, moved, copy_gbs,
                                     tiles == shipped[1]))
    set_tiles(*shipped)
    write_result("lora_kernels_h200", {"copy_gbs": copy_gbs, "rank": RANK, "slots": SLOTS,
                                       "adapters": ADAPTERS, "rows": rows_out}, args.out)


def _row(step: str, name: str, kernel: str, tiles: tuple[int, int, int], ms: float,
         moved: int, copy_gbs: float, shipped: bool) -> dict:
    row = {"step": step, "projection": name, "kernel": kernel, "block_m": tiles[0],
           "block_nk": tiles[1], "warps": tiles[2], "us": ms * 1e3,
           "gbs": moved / ms / 1e6, "pct_copy": 100 * moved / ms / 1e6 / copy_gbs,
           "shipped": shipped}
    print(f"{step:>8} {name:>8} {kernel:>7} {tiles[0]:>3} x {tiles[1]:>3} w{tiles[2]} "
          f"{row['us']:>9.1f} us {row['gbs']:>7.0f} GB/s {row['pct_copy']:>5.1f}% copy"
          f"{' *' if shipped else ''}", flush=True)
    return row


if __name__ == "__main__":
    main()
