"""Time the Triton fused mixture-of-experts kernel against the portable torch loop on an NVIDIA
GPU, at the expert shapes of Mixtral-8x7B (8 experts, top 2, hidden 4,096, intermediate
14,336) and Qwen3-30B-A3B (128, top 8, 2,048, 768), bf16, T = 1 .. 8,192 tokens.

The Triton path is timed under CUDA graphs (``do_bench_cudagraph``: it reads its routing on
the device); the torch loop reads its per-expert counts on the host, so it is timed with
events (``do_bench``), host gaps included, as an eager step runs it. Routing: a softmax over
random router logits, its top k renormalised. The lower bound beside them is the larger of the
bytes of the experts the routing touches over the device-to-device copy rate and the layer's
FLOPs over a large bf16 ``torch.mm``'s (cuBLAS) rate, both measured in the same run.
``--sweep`` also times candidate tile configurations at each point and prints the fastest (the
table in ``kernels/fused_moe.py`` came from such a run).

``--weights fp8`` times, at the same shapes and routings, the kernel reading FP8 experts
(W8A16; scales per row, as ``--quantization fp8`` makes them, and in 128 x 128 blocks, as
Qwen3-30B-A3B-FP8 stores them) against the bf16 kernel and against the per-step dequantize
path those experts took before (``QuantizedExperts``: the routed experts dequantized to bf16,
a host sync, then the bf16 kernel; timed with events). The weights are the bf16 ones quantized.
``--weights awq`` does the same for 4-bit integer experts with AWQ's zero points (W4A16; groups
of 128, as most AWQ and GPTQ checkpoints, and of 32, whose K tiles are a quarter as long),
read by the kernel as ``IntExperts`` holds them.

    python scripts/bench_fused_moe.py --out benchmarks/results/fused_moe_h100.json [--sweep]
    python scripts/bench_fused_moe.py --weights fp8 --out benchmarks/results/fused_moe_fp8.json
    python scripts/bench_fused_moe.py --weights awq --out benchmarks/results/fused_moe_int.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

import torch

# Run as a plain script from anywhere: the package lives one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.bench.common import write_result  # noqa: E402
from scripts.bench_w4a16 import copy_bandwidth_gbs  # noqa: E402


class MoeShape(NamedTuple):
    experts: int
    top_k: int
    hidden: int
    inter: int


SHAPES = {"mixtral-8x7b": MoeShape(8, 2, 4096, 14336),
          "qwen3-30b-a3b": MoeShape(128, 8, 2048, 768)}
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
# (block_m, block_n, block_k, group_m, num_warps, num_stages) that --sweep times.
CANDIDATES = ((16, 64, 128, 1, 4, 4), (16, 64, 256, 1, 8, 5), (16, 128, 128, 1, 4, 3),
              (32, 128, 128, 8, 8, 4), (32, 256, 128, 1, 8, 3), (64, 128, 128, 1, 8, 4),
              (64, 128, 64, 8, 8, 4), (64, 256, 64, 1, 8, 5), (128, 128, 64, 1, 4, 5),
              (128, 256, 64, 8, 8, 4))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON path (default benchmarks/results/fused_moe.json)")
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--sweep", action="store_true", help="time the candidate tiles too")
    p.add_argument("--weights", choices=("bf16", *VARIANTS), default="bf16",
                   help="fp8, awq: the quantized kernel against bf16 and the dequantize path")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fused_moe.py needs an NVIDIA GPU: torch.cuda.is_available() is False")
    if args.weights != "bf16":
        return quantized_main(args)
    copy_gbs, mm_tflops = copy_bandwidth_gbs(), dense_tflops()
    print(f"{torch.cuda.get_device_name()}  copy {copy_gbs:.0f} GB/s  "
          f"bf16 mm {mm_tflops:.0f} TFLOP/s")
    print(f"{'shape':<14} {'T':>5} {'triton ms':>10} {'torch ms':>10} {'bound ms':>9} "
          f"{'x torch':>8} {'% bound':>8}  tiles")
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        w13, w2 = weights(shape)
        for tokens in args.tokens:
            row = time_point(name, shape, tokens, w13, w2, copy_gbs, mm_tflops, args.sweep)
            rows.append(row)
            print(f"{name:<14} {tokens:>5} {row['triton_ms']:>10.4f} {row['torch_ms']:>10.4f} "
                  f"{row['bound_ms']:>9.4f} {row['speedup']:>8.2f} "
                  f"{100 * row['bound_ms'] / row['triton_ms']:>8.1f}  {row['tiles']}"
                  + (f"  fastest {row['fastest']}" if args.sweep else ""), flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    write_result("fused_moe", {"device": torch.cuda.get_device_name(), "dtype": "bf16",
                               "copy_gbs": copy_gbs, "mm_tflops": mm_tflops, "rows": rows},
                 args.out)


def weights(shape: MoeShape) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device="cuda",
                      dtype=torch.bfloat16) / shape.hidden ** 0.5
    w2 = torch.randn(shape.experts, shape.hidden, shape.inter, device="cuda",
                     dtype=torch.bfloat16) / shape.inter ** 0.5
    return w13, w2


def time_point(name: str, shape: MoeShape, tokens: int, w13: torch.Tensor, w2: torch.Tensor,
               copy_gbs: float, mm_tflops: float, sweep: bool) -> dict:
    from triton.testing import do_bench, do_bench_cudagraph

    from pagedserve.models.layer_ops import LayerOps
    from pagedserve.platforms.cuda.kernels import fused_moe as moe

    x = torch.randn(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
    probs = torch.randn(tokens, shape.experts, device="cuda").softmax(-1)
    topk_weights, topk_ids = probs.topk(shape.top_k, dim=-1)
    topk_weights /= topk_weights.sum(-1, keepdim=True)
    operands = (x, w13, w2, topk_ids, topk_weights)
    cfg = moe.step_config(tokens * shape.top_k / shape.experts, torch.bfloat16, x.device)
    moe.fused_moe(*operands)  # compile outside the timing
    triton_ms = do_bench_cudagraph(lambda: moe.fused_moe(*operands), return_mode="median")
    torch_ms = do_bench(lambda: LayerOps.fused_moe(*operands), return_mode="median")
    touched = topk_ids.unique().numel()
    weight_bytes = touched * (w13[0].numel() + w2[0].numel()) * 2
    flops = 2 * tokens * shape.top_k * 3 * shape.hidden * shape.inter
    bound_ms = max(weight_bytes / copy_gbs / 1e6, flops / mm_tflops / 1e9)
    row = {"shape": name, **shape._asdict(), "tokens": tokens, "experts_touched": touched,
           "triton_ms": triton_ms, "torch_ms": torch_ms, "bound_ms": bound_ms,
           "speedup": torch_ms / triton_ms, "tiles": _tiles(cfg)}
    if sweep:
        swept = {}
        for c in CANDIDATES:
            candidate = moe.MoeConfig(*c)
            moe.fused_moe_with(candidate, *operands)
            swept[_tiles(candidate)] = do_bench_cudagraph(
                lambda cfg=candidate: moe.fused_moe_with(cfg, *operands), return_mode="median")
        row["sweep_ms"] = swept
        row["fastest"] = min(swept, key=swept.get)
    return row


def quantized_main(args: argparse.Namespace) -> None:
    kind = args.weights
    print(f"{torch.cuda.get_device_name()}")
    print(f"{'shape':<14} {'T':>5} {'scales':>6} {kind + ' ms':>9} {'bf16 ms':>9} "
          f"{'dequant ms':>10} {'x bf16':>7} {'x dequant':>9}")
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        w13, w2 = weights(shape)
        for variant in VARIANTS[kind]:
            per_step, fused = quantized_experts(kind, variant, w13, w2)
            for tokens in args.tokens:
                row = time_quantized_point(name, shape, tokens, w13, w2, per_step, fused)
                rows.append({**row, "scales": variant})
                ms = row["quantized_ms"]
                print(f"{name:<14} {tokens:>5} {variant:>6} {ms:>9.4f} {row['bf16_ms']:>9.4f} "
                      f"{row['dequant_ms']:>10.4f} {row['bf16_ms'] / ms:>7.2f} "
                      f"{row['dequant_ms'] / ms:>9.2f}", flush=True)
            del per_step, fused
        del w13, w2
        torch.cuda.empty_cache()
    for row in rows:  # the key earlier FP8 results have
        row[f"{kind}_ms"] = row.pop("quantized_ms")
    write_result(f"fused_moe_{'int' if kind == 'awq' else kind}",
                 {"device": torch.cuda.get_device_name(), "activations": "bf16", "rows": rows},
                 args.out)


# The quantized forms --weights times: FP8 scales per row and in 128 x 128 blocks; AWQ's
# 4-bit groups of 128 and 32 columns.
VARIANTS = {"fp8": ("row", "block"), "awq": ("g128", "g32")}


def quantized_experts(kind: str, variant: str, w13: torch.Tensor, w2: torch.Tensor):
    """The experts quantized (``kind`` fp8 or awq, ``variant`` of ``VARIANTS``) as the engine
    holds them: ``QuantizedExperts`` stacks (the dequantize path) and the ``Fp8Experts`` or
    ``IntExperts`` made of them (the kernel's layout)."""
    from pagedserve.models.fp8_experts import Fp8Experts
    from pagedserve.models.int_experts import IntExperts
    from pagedserve.models.quantized_experts import QuantizedExperts
    from pagedserve.quant.expert_stack import ExpertStack

    inter = w2.shape[2]
    if kind == "fp8":
        quantize = _fp8_rows if variant == "row" else _fp8_blocks
    else:
        def quantize(w):
            return _awq(w, int(variant[1:]))
    stacks = QuantizedExperts(w13.shape[0], w13.device)
    stacks.gate = ExpertStack.holding(quantize(w13[:, :inter]))
    stacks.up = ExpertStack.holding(quantize(w13[:, inter:]))
    stacks.down = ExpertStack.holding(quantize(w2))
    layout = Fp8Experts if kind == "fp8" else IntExperts
    if not layout.takes(stacks):
        raise ValueError(f"{layout.__name__} does not take the {kind} {variant} experts")
    return stacks, layout(stacks)


def _awq(w: torch.Tensor, group: int):
    """AWQ's asymmetric round-to-nearest per group of ``group`` columns (K a multiple of it):
    scale ``(max - min) / 15`` in float16, zero point ``round(-min / scale)``."""
    from pagedserve.quant.weights import GroupQuantWeight

    e, n, k = w.shape
    blocks = w.float().reshape(e, n, k // group, group)
    lo = blocks.amin(-1).clamp(max=0)
    hi = blocks.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-5).half().float()
    zeros = (-lo / scales).round().clamp(0, 15)
    codes = (blocks / scales[..., None]).round() + zeros[..., None]
    values = codes.clamp(0, 15).to(torch.uint8).view(e, n, k)
    return GroupQuantWeight(values, scales, -zeros * scales, 4, group)


def _fp8_rows(w: torch.Tensor):
    from pagedserve.quant.weights import Fp8Weight

    fmax = torch.finfo(torch.float8_e4m3fn).max
    scales = w.float().abs().amax(dim=-1) / fmax
    return Fp8Weight((w.float() / scales[..., None]).to(torch.float8_e4m3fn), scales)


def _fp8_blocks(w: torch.Tensor, block: int = 128):
    from pagedserve.quant.weights import BlockFp8Weight

    e, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    tiles = padded.view(e, nb, block, kb, block)
    scales = tiles.abs().amax(dim=(2, 4)) / torch.finfo(torch.float8_e4m3fn).max
    values = (tiles / scales[:, :, None, :, None]).view(e, nb * block, kb * block)[:, :n, :k]
    return BlockFp8Weight(values.to(torch.float8_e4m3fn).contiguous(), scales,
                          (block, block))


def time_quantized_point(name: str, shape: MoeShape, tokens: int, w13: torch.Tensor,
                         w2: torch.Tensor, per_step, fused) -> dict:
    from triton.testing import do_bench, do_bench_cudagraph

    from pagedserve.platforms.cuda.kernels import fused_moe as moe
    from pagedserve.platforms.cuda.layer_ops import TritonLayerOps

    x = torch.randn(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
    probs = torch.randn(tokens, shape.experts, device="cuda").softmax(-1)
    topk_weights, topk_ids = probs.topk(shape.top_k, dim=-1)
    topk_weights /= topk_weights.sum(-1, keepdim=True)
    routing = (topk_ids, topk_weights)
    timed = {"quantized_ms": lambda: fused(TritonLayerOps, x, *routing),
             "bf16_ms": lambda: moe.fused_moe(x, w13, w2, *routing)}
    out = {key: _graph_ms(fn, do_bench_cudagraph) for key, fn in timed.items()}
    per_step(TritonLayerOps, x, *routing)  # compile outside the timing
    out["dequant_ms"] = do_bench(lambda: per_step(TritonLayerOps, x, *routing),
                                 return_mode="median")
    return {"shape": name, **shape._asdict(), "tokens": tokens,
            "experts_touched": topk_ids.unique().numel(), **out}


def _graph_ms(fn, do_bench_cudagraph) -> float:
    fn()  # compile outside the capture
    return do_bench_cudagraph(fn, return_mode="median")


def dense_tflops() -> float:
    """A large bf16 matmul's rate through cuBLAS: the compute side of the bound."""
    from triton.testing import do_bench

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ a, return_mode="median")
    return 2 * 8192**3 / ms / 1e9


def _tiles(cfg) -> str:
    return (f"m{cfg.block_m}n{cfg.block_n}k{cfg.block_k}g{cfg.group_m}"
            f"w{cfg.num_warps}s{cfg.num_stages}")


if __name__ == "__main__":
    main()
