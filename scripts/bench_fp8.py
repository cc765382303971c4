"""Time the FP8 linear layer (``Fp8LinearMethod``) on an NVIDIA GPU against bfloat16 cuBLAS.

Llama-3-8B's linear shapes (fused qkv, o, fused gate/up, down) with per-row FP8 weight scales and
dynamic per-token activation scales, M = 1 .. 8,192 rows: the method as the engine calls it (the
FP8 GEMV up to ``fp8_gemv.MAX_M`` rows, else activation quantization + ``torch._scaled_mm``),
the ``_scaled_mm`` path forced (with the fast accumulation the method uses, and without it), and
``torch.mm`` on a bfloat16 weight. Small M is reported as
the weight's bytes per second next to the device-to-device copy rate, large M as TFLOP/s next
to the dense FP8 peak (``_scaled_mm`` on 8192-cubed operands, fast accumulation), both measured
in the same run.

    python scripts/bench_fp8.py --out benchmarks/results/fp8_linear_h200.json [--sweep-gemv]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# Run as a plain script from anywhere: the package lives one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.bench.common import write_result  # noqa: E402
from scripts.bench_w4a16 import SHAPES, _time, copies_past_l2, copy_bandwidth_gbs, cycling  # noqa: E402

MS = (1, 2, 4, 16, 64, 256, 1024, 8192)
DEVICE = "cuda"


def fp8_peak_tflops(fast_accum: bool = True) -> float:
    one = torch.ones((), device=DEVICE)
    a = torch.randn(8192, 8192, device=DEVICE).to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device=DEVICE).to(torch.float8_e4m3fn).t()
    ms = _time(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast_accum))
    return 2 * 8192**3 / ms / 1e9


def layer(n: int, k: int):
    from torch import nn

    from pagedserve.platforms.cuda.fp8_linear import Fp8LinearMethod
    from pagedserve.quant.weights import Fp8Weight

    module = nn.Module()
    Fp8LinearMethod().create_weights(module, Fp8Weight.quantize(torch.randn(n, k) * 0.02),
                                     torch.bfloat16, torch.device(DEVICE))
    return module


def forced_scaled_mm(module, x: torch.Tensor, fast_accum: bool) -> torch.Tensor:
    """Quantize ``x`` (bfloat16) and ``_scaled_mm`` with row-wise scales, as the method does
    above the GEMV's rows, with or without fast accumulation."""
    from pagedserve.platforms.cuda.fp8_linear import scaled_mm
    from pagedserve.platforms.cuda.kernels.fp8_quant import quantize_per_token

    wq = module.fp8_weight
    xq, x_scale = quantize_per_token(x, wq.dtype, wq.shape[1])
    return scaled_mm(xq, wq.t(), x_scale, module.fp8_weight_scale, x.dtype, fast_accum)


def bench(args: argparse.Namespace, copy_gbs: float, peak: float) -> list[dict]:
    from pagedserve.platforms.cuda.fp8_linear import Fp8LinearMethod

    method, rows = Fp8LinearMethod(), []
    for name, n, k in SHAPES:
        module = layer(n, k)
        dense = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
        w_bytes = module.fp8_weight.numel()
        for m in args.ms:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            ms = _time(lambda x=x, mod=module: method.apply(mod, x))
            ms_scaled = _time(lambda x=x, mod=module: forced_scaled_mm(mod, x, True))
            ms_slow = _time(lambda x=x, mod=module: forced_scaled_mm(mod, x, False))
            ms_mm = _time(lambda x=x, w=dense: torch.mm(x, w.T))
            flops = 2 * m * n * k
            rows.append({"layer": name, "n": n, "k": k, "m": m, "fp8_ms": ms,
                         "scaled_mm_ms": ms_scaled, "slow_accum_ms": ms_slow,
                         "bf16_mm_ms": ms_mm,
                         "fp8_pct_copy": 100 * w_bytes / ms / 1e6 / copy_gbs,
                         "fp8_tflops": flops / ms / 1e9,
                         "fp8_pct_peak": 100 * flops / ms / 1e9 / peak,
                         "speedup_vs_bf16": ms_mm / ms})
            r = rows[-1]
            print(f"{name:>8} {n:>6} {k:>6} {m:>5} fp8 {ms * 1000:8.1f}us  scaled_mm "
                  f"{ms_scaled * 1000:8.1f}us (slow accum {ms_slow * 1000:8.1f})  bf16 "
                  f"{ms_mm * 1000:8.1f}us  "
                  f"{r['fp8_pct_copy']:5.1f}% copy  {r['fp8_tflops']:7.1f} TF/s "
                  f"({r['fp8_pct_peak']:4.1f}% peak)  x{r['speedup_vs_bf16']:.2f}", flush=True)
        torch.cuda.empty_cache()
    return rows


def sweep_gemv(copy_gbs: float) -> list[dict]:
    """The GEMV's configurations at M = 1 per layer, each call reading its weight from
    memory (copies past the L2 cache)."""
    from pagedserve.platforms.cuda.kernels import fp8_gemv

    layers = {name: copies_past_l2(lambda n=n, k=k: layer(n, k), n * k) for name, n, k in SHAPES}
    original, rows = fp8_gemv._config, []
    for cfg in [fp8_gemv._Config(bn, bk, w, 2) for bn in (2, 4, 8, 16)
                for bk in (512, 1024, 2048) for w in (4, 8)]:
        # Registers: a float32 accumulator per weight element of the tile.
        if not 8 <= cfg.block_n * cfg.block_k // (32 * cfg.num_warps) <= 128:
            continue
        fp8_gemv._config = lambda _m, cfg=cfg: cfg
        layer_ms = {}
        for name, _n, k in SHAPES:
            x = torch.ones(1, k, device=DEVICE, dtype=torch.bfloat16)
            layer_ms[name] = _time(cycling(lambda mod, x=x: fp8_gemv.matmul(
                x, mod.fp8_weight, mod.fp8_weight_scale, mod.fp8_out_features), layers[name]))
        pct = {name: 100 * n * k / layer_ms[name] / 1e6 / copy_gbs for name, n, k in SHAPES}
        total = 100 * sum(n * k for _, n, k in SHAPES) / sum(layer_ms.values()) / 1e6 / copy_gbs
        rows.append({"config": cfg._asdict(), "layer_ms": layer_ms, "layer_pct_copy": pct,
                     "pct_copy": total})
        print(f"fp8 gemv {tuple(cfg)}: " + " ".join(
            f"{name} {layer_ms[name] * 1000:6.1f}us {pct[name]:4.1f}%" for name in layer_ms)
            + f"  all {total:.1f}% of copy", flush=True)
    fp8_gemv._config = original
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON path (default benchmarks/results/fp8_linear.json)")
    p.add_argument("--ms", type=int, nargs="+", default=list(MS))
    p.add_argument("--sweep-gemv", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8.py needs an NVIDIA GPU: torch.cuda.is_available() is False")
    torch.manual_seed(0)
    copy_gbs, peak, slow_peak = copy_bandwidth_gbs(), fp8_peak_tflops(), fp8_peak_tflops(False)
    print(f"{torch.cuda.get_device_name()}  copy {copy_gbs:.0f} GB/s  dense FP8 peak "
          f"{peak:.0f} TFLOP/s ({slow_peak:.0f} without fast accumulation)")
    result = {"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs,
              "fp8_peak_tflops": peak, "fp8_peak_slow_accum_tflops": slow_peak,
              "rows": bench(args, copy_gbs, peak)}
    if args.sweep_gemv:
        result["gemv_sweep"] = sweep_gemv(copy_gbs)
    write_result("fp8_linear", result, args.out)


if __name__ == "__main__":
    main()
