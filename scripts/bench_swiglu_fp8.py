"""Time SwiGLU before a W8A8 FP8 down projection on an NVIDIA GPU: ``silu_and_mul`` then
``quantize_per_token`` (two kernels, the bf16 product written and read back) against the fused
``silu_and_mul_fp8``, at Llama-3-8B's intermediate size and the row counts of a decode step
and a prefill step. Each is reported as bytes moved per second (the fused kernel's bytes:
the [M, 2I] input read once, the FP8 output and its scales written) beside the copy rate
measured in the same run. ``--base FILE``: an earlier ``kernels/activation.py`` whose
``silu_and_mul_fp8`` is timed beside this tree's.

    python scripts/bench_swiglu_fp8.py --out benchmarks/results/swiglu_fp8_h200.json
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

# Run as a plain script from anywhere: the package lives one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.bench.common import write_result  # noqa: E402
from scripts.bench_w4a16 import _time, copy_bandwidth_gbs  # noqa: E402

MS = (16, 256, 1000, 8192)
INTER = 14336  # Llama-3-8B


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON path (default benchmarks/results/swiglu_fp8.json)")
    p.add_argument("--ms", type=int, nargs="+", default=list(MS))
    p.add_argument("--base", type=Path, help="an earlier kernels/activation.py")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_swiglu_fp8.py needs an NVIDIA GPU: torch.cuda.is_available() is False")
    from pagedserve.platforms.cuda.kernels.activation import silu_and_mul, silu_and_mul_fp8
    from pagedserve.platforms.cuda.kernels.fp8_quant import quantize_per_token

    base = None
    if args.base:
        spec = importlib.util.spec_from_file_location("activation_base", args.base)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
    copy_gbs, fp8 = copy_bandwidth_gbs(), torch.float8_e4m3fn
    print(f"{torch.cuda.get_device_name()}  copy {copy_gbs:.0f} GB/s  intermediate {INTER}")
    rows = []
    for m in args.ms:
        x = torch.randn(m, 2 * INTER, device="cuda", dtype=torch.bfloat16)
        nbytes = m * (2 * INTER * 2 + INTER + 4)
        row = {"m": m, "bytes": nbytes,
               "unfused_ms": _time(lambda x=x: quantize_per_token(silu_and_mul(x), fp8, INTER)),
               "fused_ms": _time(lambda x=x: silu_and_mul_fp8(x, fp8, INTER))}
        if base is not None:
            row["base_ms"] = _time(lambda x=x: base.silu_and_mul_fp8(x, fp8, INTER))
        row.update({f"{k[:-3]}_pct_copy": 100 * nbytes / v / 1e6 / copy_gbs
                    for k, v in list(row.items()) if k.endswith("_ms")})
        rows.append(row)
        print(f"M {m:>5}: " + "  ".join(f"{k[:-3]} {row[k] * 1000:8.1f} us "
                                        f"({row[k[:-3] + '_pct_copy']:4.1f}% copy)"
                                        for k in row if k.endswith("_ms")), flush=True)
    write_result("swiglu_fp8", {"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs,
                                "intermediate": INTER, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
