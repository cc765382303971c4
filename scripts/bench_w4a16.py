"""Time the W4A16 Triton kernel against bf16 ``torch.mm`` (cuBLAS) on an NVIDIA GPU.

Llama-3-8B's linear shapes (fused qkv, o, fused gate/up, down) with 4-bit weights in groups of
128 (AWQ-style float16 scales and integer zero points), M = 1 .. 1024 rows. Small M is reported
as the packed weight's bytes (values, scales, zero points) per second next to the card's
device-to-device copy rate measured in the same run; large M as TFLOP/s.

Times are medians from ``triton.testing.do_bench_cudagraph`` (GPU time, as under CUDA graphs).

    python scripts/bench_w4a16.py --out benchmarks/results/w4a16_h200.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# Run as a plain script from anywhere: the package lives one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.bench.common import write_result  # noqa: E402

# (name, N, K) of Llama-3-8B's linear layers.
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336))
MS = (1, 2, 4, 8, 16, 64, 128, 256, 1024)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = "cuda"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON path (default benchmarks/results/w4a16.json)")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--ms", type=int, nargs="+", default=list(MS))
    return p.parse_args()


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy rate (bytes read + written), the practical bandwidth ceiling."""
    from triton.testing import do_bench

    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / ms / 1e6


def random_packed(n: int, k: int, group: int):
    from pagedserve.platforms.cuda.kernels import w4a16

    groups = -(-k // group)
    values = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=DEVICE)
    scales = (torch.rand(n, groups, device=DEVICE) * 0.02 + 0.002).half().float()
    offsets = -torch.randint(0, 16, (n, groups), device=DEVICE).float() * scales
    return w4a16.pack(values, scales, offsets, group, torch.device(DEVICE))


def bench_shape(name: str, n: int, k: int, args: argparse.Namespace,
                copy_gbs: float) -> list[dict]:
    dtype = DTYPES[args.dtype]
    packed = random_packed(n, k, args.group_size)
    packed_bytes = sum(t.numel() * t.element_size()
                       for t in (packed.qweight, packed.scales, packed.shifts))
    dense = torch.randn(n, k, device=DEVICE, dtype=dtype) * 0.02
    rows = []
    for m in args.ms:
        ms_w4, ms_mm, paths = time_all(m, packed, dense)
        flops = 2 * m * n * k
        rows.append({
            "layer": name, "n": n, "k": k, "m": m, "w4a16_ms": ms_w4,
            "torch_mm_ms": ms_mm, "path_ms": paths,
            "speedup": ms_mm / ms_w4, "packed_bytes": packed_bytes,
            "w4a16_weight_gbs": packed_bytes / ms_w4 / 1e6,
            "w4a16_pct_copy": 100 * packed_bytes / ms_w4 / 1e6 / copy_gbs,
            "torch_mm_weight_gbs": dense.numel() * dense.element_size() / ms_mm / 1e6,
            "w4a16_tflops": flops / ms_w4 / 1e9, "torch_mm_tflops": flops / ms_mm / 1e9,
        })
        print(_row(rows[-1]) + "  " + " ".join(f"{p} {t * 1000:.1f}us"
                                                 for p, t in paths.items()), flush=True)
    return rows


def time_all(m: int, packed, dense: torch.Tensor) -> tuple[float, float, dict]:
    """Milliseconds of the W4A16 matmul as the engine runs it, of ``torch.mm`` on the dense
    weight, and of each of the W4A16 paths forced, for M rows; NaN for one that fails."""
    from pagedserve.platforms.cuda.kernels import w4a16

    x = torch.randn(m, dense.shape[1], device=DEVICE, dtype=dense.dtype)
    out = torch.empty(m, dense.shape[0], device=DEVICE, dtype=dense.dtype)
    paths = {path: _time(lambda path=path: w4a16.matmul(x, packed, out=out, path=path))
             for path in w4a16.PATHS}
    return (_time(lambda: w4a16.matmul(x, packed, out=out)),
            _time(lambda: torch.mm(x, dense.T, out=out)), paths)


def _time(fn) -> float:
    from triton.testing import do_bench_cudagraph

    try:
        fn()  # compile outside the timing
        return do_bench_cudagraph(fn, return_mode="median")
    except Exception as exc:  # one failing variant must not hide the others' numbers
        print(f"failed: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
        return float("nan")


_HEADER = (f"{'layer':>8} {'N':>6} {'K':>6} {'M':>5} {'w4 ms':>8} {'mm ms':>8} "
           f"{'x':>5} {'w4 GB/s':>8} {'% copy':>6} {'mm GB/s':>8} {'w4 TF/s':>8} {'mm TF/s':>8}")


def _row(r: dict) -> str:
    return (f"{r['layer']:>8} {r['n']:>6} {r['k']:>6} {r['m']:>5} {r['w4a16_ms']:>8.4f} "
            f"{r['torch_mm_ms']:>8.4f} "
            f"{r['speedup']:>5.2f} {r['w4a16_weight_gbs']:>8.0f} "
            f"{r['w4a16_pct_copy']:>6.1f} {r['torch_mm_weight_gbs']:>8.0f} "
            f"{r['w4a16_tflops']:>8.1f} {r['torch_mm_tflops']:>8.1f}")


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_w4a16.py needs an NVIDIA GPU: torch.cuda.is_available() is False")
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {copy_gbs:.0f} GB/s  "
          f"{args.dtype}, 4-bit groups of {args.group_size}")
    print("x: mm ms / w4 ms")
    print("GB/s: the weight's bytes read (packed for w4, dense for mm) per second; % copy: "
          "of the copy rate (bytes read + written)\n" + _HEADER)
    rows = []
    for name, n, k in SHAPES:
        rows += bench_shape(name, n, k, args, copy_gbs)
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "dtype": args.dtype,
              "group_size": args.group_size, "copy_gbs": copy_gbs, "rows": rows}
    write_result("w4a16", result, args.out)


if __name__ == "__main__":
    main()
