"""``pagedserve bench quant-kernels``: the native CPU quant kernels against torch's CPU ops on
the linear shapes of SmolLM2-135M.

Each shape gets distinct random weights (30, or fewer where that many would pass 256 MB of
float32) and the calls cycle through them, so every call reads its weight from memory rather
than from a cache. Times are medians of calls. At m=1 the weight bytes each kernel reads per
second are set beside the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from pagedserve.arg_types import non_negative, positive

# (n, k) of SmolLM2-135M: q/k/v-o projections, attention out, MLP up/gate, MLP down, lm_head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
MAX_FLOAT_BYTES = 256 << 20


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", type=_shape, nargs="+", default=SHAPES,
                        help="N x K of the weights, as 960x576")
    parser.add_argument("--batch-sizes", type=positive(int), nargs="+",
                        default=[1, 4, 16, 64, 256])
    parser.add_argument("--group-size", type=positive(int), default=64)
    parser.add_argument("--weights", type=positive(int), default=30,
                        help="distinct weights per shape")
    parser.add_argument("--threads", type=positive(int), default=None,
                        help="default: torch's count")
    parser.add_argument("--min-time", type=non_negative(float), default=0.2,
                        help="seconds of calls per measurement")
    parser.add_argument("--out", default=None)


def _shape(text: str) -> tuple[int, int]:
    """``NxK`` as (n, k), both positive."""
    dims = text.lower().split("x")
    if len(dims) != 2 or not all(d.strip().isdigit() and int(d) > 0 for d in dims):
        raise argparse.ArgumentTypeError(f"must be N x K of positive integers, as 960x576, "
                                         f"got {text}")
    return int(dims[0]), int(dims[1])


def copy_bandwidth(nbytes: int = 1 << 29) -> float:
    """Bytes moved (read + written) per second by a large tensor copy."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 2 * nbytes * 5 / (time.perf_counter() - start)


def median_call(fn: Callable, x, weights: list, min_time: float) -> float:
    """Median seconds of fn(x, w), cycling through the weights for about min_time."""
    fn(x, weights[0])
    times: list[float] = []
    deadline = time.perf_counter() + min_time
    while len(times) < 3 or time.perf_counter() < deadline:
        w = weights[len(times) % len(weights)]
        start = time.perf_counter()
        fn(x, w)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_variants(n: int, k: int, group_size: int, count: int) -> dict[str, tuple]:
    """name -> (call taking (x float32, weight), weights, weight bytes read per call)."""
    import torch
    import torch.nn.functional as F

    from pagedserve.platforms.cpu import native_quant

    groups = -(-k // group_size)

    def ours(bits: int):
        packed = [native_quant.pack(torch.randint(0, 2**bits, (n, k), dtype=torch.uint8),
                                    torch.rand(n, groups), torch.randn(n, groups), bits,
                                    group_size) for _ in range(count)]
        size = sum(t.nbytes for t in packed[0].tensors().values())
        return native_quant.matmul, packed, size

    def int4pack():
        ws = [(torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                   torch.randint(0, 16, (n, k), dtype=torch.int32), 1),
               torch.randn(groups, n, 2, dtype=torch.bfloat16)) for _ in range(count)]
        call = lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(  # noqa: E731
            x.bfloat16(), w[0], group_size, w[1])
        return call, ws, ws[0][0].nbytes + ws[0][1].nbytes

    def int8pack():
        ws = [(torch.randint(-128, 128, (n, k), dtype=torch.int8),
               torch.rand(n, dtype=torch.bfloat16)) for _ in range(count)]
        call = lambda x, w: torch.ops.aten._weight_int8pack_mm(  # noqa: E731
            x.bfloat16(), w[0], w[1])
        return call, ws, ws[0][0].nbytes + ws[0][1].nbytes

    def linear(dtype: torch.dtype):
        ws = [torch.randn(n, k, dtype=dtype) for _ in range(count)]
        return (lambda x, w: F.linear(x.to(dtype), w)), ws, ws[0].nbytes

    return {"ours_int4": ours(4), "ours_int8": ours(8), "torch_int4pack_bf16": int4pack(),
            "torch_int8pack_bf16": int8pack(), "linear_fp32": linear(torch.float32),
            "linear_bf16": linear(torch.bfloat16)}


def bench_shape(n: int, k: int, args: argparse.Namespace) -> list[dict]:
    import torch

    count = max(1, min(args.weights, MAX_FLOAT_BYTES // (4 * n * k)))
    variants = make_variants(n, k, args.group_size, count)
    rows = []
    for m in args.batch_sizes:
        x = torch.randn(m, k)
        row: dict = {"shape": f"{n}x{k}", "m": m, "weights": count}
        for name, (call, weights, nbytes) in variants.items():
            seconds = median_call(call, x, weights, args.min_time)
            row[f"{name}_us"] = seconds * 1e6
            if m == 1:
                row[f"{name}_GBps"] = nbytes / seconds / 1e9
        rows.append(row)
    return rows


def main(args: argparse.Namespace) -> None:
    import torch

    from pagedserve.bench.common import print_table, write_result
    from pagedserve.platforms.cpu import native_quant

    if args.threads:
        torch.set_num_threads(args.threads)
    if not native_quant.available():
        raise SystemExit("the native quant kernels did not build (see the log)")
    bandwidth = copy_bandwidth()
    rows = []
    for n, k in args.shapes:
        rows += bench_shape(n, k, args)
    names = ["ours_int4", "ours_int8", "torch_int4pack_bf16", "torch_int8pack_bf16",
             "linear_fp32", "linear_bf16"]
    print_table(f"microseconds per call, {torch.get_num_threads()} threads, group size "
                f"{args.group_size} (torch int8pack: per channel)", rows,
                ["shape", "m", *(f"{n}_us" for n in names)])
    print_table(f"weight GB/s at m=1 (copy: {bandwidth / 1e9:.1f} GB/s read + write)",
                [r for r in rows if r["m"] == 1], ["shape", *(f"{n}_GBps" for n in names)])
    write_result("quant_kernels", {"threads": torch.get_num_threads(),
                                   "group_size": args.group_size,
                                   "copy_GBps": bandwidth / 1e9,
                                   "crossover_gemv_max_rows": native_quant.GEMV_MAX_ROWS,
                                   "rows": rows}, args.out)
