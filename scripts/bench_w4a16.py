"""Time the W4A16 Triton kernel against bf16 ``torch.mm`` (cuBLAS) on an NVIDIA GPU.

Llama-3-8B's linear shapes (fused qkv, o, fused gate/up, down) with 4-bit weights in groups of
128 (AWQ-style float16 scales and integer zero points), M = 1 .. 1024 rows. Small M is reported
as the packed weight's bytes (values, scales, zero points) per second next to the card's
device-to-device copy rate measured in the same run; large M as TFLOP/s.

Times are medians from ``triton.testing.do_bench_cudagraph`` (GPU time, as under CUDA graphs).
The calls cycle through copies of the weight that together pass four times the L2 cache, so
each call reads its weight from memory, as a decode step does. ``--sweep-gemv`` times the
one-row kernel's configurations.

    python scripts/bench_w4a16.py --out benchmarks/results/w4a16_h200.json [--sweep-gemv]
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
    p.add_argument("--sweep-gemv", action="store_true")
    return p.parse_args()


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy rate (bytes read + written), the practical bandwidth ceiling."""
    from triton.testing import do_bench

    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / ms / 1e6


def copies_past_l2(make, nbytes: int) -> list:
    """``make()`` called until the results pass four times the L2 cache (at least two)."""
    l2 = torch.cuda.get_device_properties(DEVICE).L2_cache_size
    return [make() for _ in range(max(2, -(-4 * l2 // nbytes)))]


def cycling(fn, weights: list):
    """A function of no arguments that calls ``fn(w)`` on the next of ``weights`` each time."""
    state = {"i": 0}

    def call():
        state["i"] += 1
        return fn(weights[state["i"] % len(weights)])
    return call


def packed_bytes(packed) -> int:
    return sum(t.numel() * t.element_size() for t in (packed.qweight, packed.scales,
                                                      packed.shifts))


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
    packed = copies_past_l2(lambda: random_packed(n, k, args.group_size), n * k // 2)
    w_bytes = packed_bytes(packed[0])
    dense = copies_past_l2(lambda: torch.randn(n, k, device=DEVICE, dtype=dtype) * 0.02,
                           2 * n * k)
    rows = []
    for m in args.ms:
        ms_w4, ms_mm, paths = time_all(m, packed, dense)
        flops = 2 * m * n * k
        rows.append({
            "layer": name, "n": n, "k": k, "m": m, "w4a16_ms": ms_w4,
            "torch_mm_ms": ms_mm, "path_ms": paths,
            "speedup": ms_mm / ms_w4, "packed_bytes": w_bytes,
            "w4a16_weight_gbs": w_bytes / ms_w4 / 1e6,
            "w4a16_pct_copy": 100 * w_bytes / ms_w4 / 1e6 / copy_gbs,
            "torch_mm_weight_gbs": 2 * n * k / ms_mm / 1e6,
            "w4a16_tflops": flops / ms_w4 / 1e9, "torch_mm_tflops": flops / ms_mm / 1e9,
        })
        print(_row(rows[-1]) + "  " + " ".join(f"{p} {t * 1000:.1f}us"
                                                 for p, t in paths.items()), flush=True)
    return rows


def time_all(m: int, packed: list, dense: list) -> tuple[float, float, dict]:
    """Milliseconds of the W4A16 matmul as the engine runs it, of ``torch.mm`` on the dense
    weight, and of each of the W4A16 paths that take M rows forced; NaN for one that fails."""
    from pagedserve.platforms.cuda.kernels import w4a16

    n, k = dense[0].shape
    x = torch.randn(m, k, device=DEVICE, dtype=dense[0].dtype)
    out = torch.empty(m, n, device=DEVICE, dtype=dense[0].dtype)
    paths = {path: _time(cycling(lambda w, path=path: w4a16.matmul(x, w, out=out, path=path),
                                 packed))
             for path in w4a16.PATHS if path != "gemv" or m <= w4a16.GEMV_MAX_M}
    return (_time(cycling(lambda w: w4a16.matmul(x, w, out=out), packed)),
            _time(cycling(lambda w: torch.mm(x, w.T, out=out), dense)), paths)


def sweep_gemv(args: argparse.Namespace, copy_gbs: float) -> list[dict]:
    """The one-row kernel's configurations over the four layers, each from memory."""
    from pagedserve.platforms.cuda.kernels import w4a16

    weights = {name: copies_past_l2(lambda n=n, k=k: random_packed(n, k, args.group_size),
                                    n * k // 2) for name, n, k in SHAPES}
    original = (w4a16._gemv_config, w4a16.GEMV_PROGRAMS_PER_SM, w4a16._gemv_decode)
    rows = []
    variants = [(c, p, "pairs") for c in ((128, 128, 4), (256, 64, 4), (256, 128, 4),
                                          (512, 64, 4), (256, 64, 2), (128, 64, 2))
                for p in (4, 8, 16, 32)]
    variants += [((256, 64, 4), p, "subnormal") for p in (4, 8)]
    for (block_n, block_k, warps), per_sm, decode in variants:
        cfg = w4a16._Config(1, block_n, block_k, warps, 1)
        w4a16._gemv_config, w4a16.GEMV_PROGRAMS_PER_SM = (lambda cfg=cfg: cfg), per_sm
        w4a16._gemv_decode = lambda _x, decode=decode: decode
        layer_ms = {}
        for name, _n, k in SHAPES:
            x = torch.randn(1, k, device=DEVICE, dtype=DTYPES[args.dtype])
            layer_ms[name] = _time(cycling(lambda w, x=x: w4a16.matmul(x, w, path="gemv"),
                                           weights[name]))
        total_bytes = sum(packed_bytes(w[0]) for w in weights.values())
        pct = 100 * total_bytes / sum(layer_ms.values()) / 1e6 / copy_gbs
        rows.append({"config": cfg._asdict(), "programs_per_sm": per_sm, "decode": decode,
                     "layer_ms": layer_ms, "pct_copy": pct})
        print(f"gemv {block_n:>5} x {block_k:>3} {warps} warps {per_sm}/SM {decode:>9}: "
              + " ".join(f"{k} {v * 1000:6.1f}us" for k, v in layer_ms.items())
              + f"  {pct:5.1f}% of copy", flush=True)
    w4a16._gemv_config, w4a16.GEMV_PROGRAMS_PER_SM, w4a16._gemv_decode = original
    return rows


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
    if args.sweep_gemv:
        result["gemv_sweep"] = sweep_gemv(args, copy_gbs)
    write_result("w4a16", result, args.out)


if __name__ == "__main__":
    main()
