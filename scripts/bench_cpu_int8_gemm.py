"""GFLOP/s of the CPU's grouped-quantized matmul kernels on the default model's linear shapes
(SmolLM2-135M, Q4_1: 4-bit, groups of 32), against torch.mm on float32 weights of the same
shape in the same run (the machine's float32 GEMM peak for that shape).

    .venv/bin/python scripts/bench_cpu_int8_gemm.py [--out JSON]

Kernels (``native_quant.KERNELS``): the packed float32 GEMV, the int8-activation kernel, and
float32 tiles dequantized for torch.mm. Each time is the median of calls cycling through a few
distinct weights; the table's last column is the kernel ``native_quant.kernel_for`` picks.
"""

from __future__ import annotations

import argparse
import json

import torch

from pagedserve.bench.common import print_table
from pagedserve.bench.quant_kernels import median_call
from pagedserve.platforms.cpu import native_quant

# (name, n, k): q/o, k/v, gate/up, down, and the engine's fused q/k/v and gate/up.
SHAPES = [("q, o", 576, 576), ("k, v", 192, 576), ("gate, up", 1536, 576),
          ("down", 576, 1536), ("qkv fused", 960, 576), ("gate_up fused", 3072, 576)]
ROWS = [8, 16, 24, 32, 64, 128, 256, 512]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="*", default=ROWS)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--weights", type=int, default=4, help="distinct weights per shape")
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("--out", default="benchmarks/results/cpu_int8_gemm.json")
    args = parser.parse_args()
    if not native_quant.available():
        raise SystemExit("the native CPU quant kernels do not build here")
    kernels = [k for k in native_quant.KERNELS
               if k != "int8" or native_quant.int8_supported(args.bits)]
    rows = [row for name, n, k in SHAPES for row in bench_shape(name, n, k, args, kernels)]
    print_table(f"GFLOP/s, {args.bits}-bit groups of {args.group_size}, "
                f"{torch.get_num_threads()} threads", rows,
                ["shape", "m", *kernels, "torch.mm float32", "picked"])
    with open(args.out, "w") as f:
        json.dump({"bits": args.bits, "group_size": args.group_size,
                   "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
    print(f"\nwrote {args.out}")


def bench_shape(name: str, n: int, k: int, args: argparse.Namespace,
                kernels: list[str]) -> list[dict]:
    groups = -(-k // args.group_size)
    weights = [native_quant.pack(torch.randint(0, 2**args.bits, (n, k), dtype=torch.uint8),
                                 torch.rand(n, groups) * 0.02, torch.randn(n, groups) * 0.1,
                                 args.bits, args.group_size) for _ in range(args.weights)]
    dense = [torch.randn(k, n) for _ in range(args.weights)]
    out = []
    for m in args.rows:
        x = torch.randn(m, k)
        gflops = {kernel: 2 * m * n * k / 1e9 / median_call(
            lambda x, w, kernel=kernel: native_quant.run(kernel, x, w), x, weights,
            args.min_time) for kernel in kernels}
        gflops["torch.mm float32"] = 2 * m * n * k / 1e9 / median_call(torch.mm, x, dense,
                                                                       args.min_time)
        out.append({"shape": f"{name} (N={n}, K={k})", "m": m,
                    **{key: round(v, 1) for key, v in gflops.items()},
                    "picked": native_quant.kernel_for(m, weights[0])})
    return out


if __name__ == "__main__":
    main()
