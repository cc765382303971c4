"""Run a CUDA C++ W4A16 kernel (the mma kernels, or with ``--kernel wgmma`` the Hopper one) on
one 8B layer a few times, for ``ncu`` (no timing of its own; scripts/ncu_w4a16_mma.sh runs it
under ncu).

    ncu --clock-control none -k regex:rows_kernel --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight python3 scripts/profile_w4a16_mma.py --m 1 --layer gate_up
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    from pagedserve.platforms.cuda.kernels import w4a16, w4a16_mma, w4a16_wgmma

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--layer", choices=SHAPES, default="gate_up")
    p.add_argument("--variant", type=int, default=0)
    p.add_argument("--rows", type=int, help="rows per block (w4a16_mma.Plan.block_rows, or "
                   "w4a16_wgmma.block_rows)")
    p.add_argument("--kernel", choices=("mma", "wgmma"), default="mma")
    p.add_argument("--calls", type=int, default=5)
    args = p.parse_args()
    n, k = SHAPES[args.layer]
    values = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, k // 128, device="cuda") * 0.02 + 0.002).half().float()
    offsets = -torch.randint(0, 16, (n, k // 128), device="cuda").float() * scales
    packed = w4a16.pack(values, scales, offsets, 128, torch.device("cuda"))
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(args.m, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(args.calls):
        if args.kernel == "wgmma":
            w4a16_wgmma.matmul(x, packed, out, args.rows, args.variant)
        else:
            w4a16_mma.matmul(x, packed, out, None, args.variant, args.rows)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
