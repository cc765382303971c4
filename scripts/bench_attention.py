"""Time the Triton paged-attention kernels on an NVIDIA GPU.

Decode: batch 1/32/128/256 at contexts 512..32k, reported as achieved bandwidth (KV bytes read
divided by time) next to the card's measured copy bandwidth. Prefill: a few prompt lengths, with
and without cached context, as TFLOP/s next to torch's SDPA where it applies.

Times are medians from ``triton.testing.do_bench_cudagraph`` (GPU time, as under CUDA graphs);
the ``eager`` column is ``do_bench`` and adds the Python and launch overhead of each call.

    python scripts/bench_attention.py --out benchmarks/results/attention_h200.json
    # an earlier decode kernel on the same shapes in the same run, and the tile sweep:
    git show HEAD~1:pagedserve/platforms/cuda/kernels/decode_attention.py > /tmp/base.py
    python scripts/bench_attention.py --kv-cache-dtype fp8 --base /tmp/base.py --sweep-decode
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

# Run as a plain script from anywhere: the package lives one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DECODE_BATCHES = (1, 32, 128, 256)
DECODE_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
# (batch, context) of the tile sweep: latency-bound, the issue-30 target (256 x 2,048), long.
SWEEP_SHAPES = ((1, 4096), (32, 4096), (256, 2048), (256, 8192))
# (block_n, warps, stages[, kv heads a program]); what each holds for sm_90:
# scripts/attention_resources.py. Four stages never beat three by more than noise, and 256 keys
# led only in an earlier fp8 kernel's sweep at 256 x 8,192, by 3%, so the sweep leaves them out.
SWEEP_TILES = [(n, w, st) for n in (32, 64, 128) for w in (2, 4) for st in (2, 3)]
# (query lengths, context lengths): fresh prompts, then chunks after a cached prefix.
PREFILL_CASES = (
    ([512], [0]), ([2048], [0]), ([8192], [0]), ([2048] * 4, [0] * 4),
    ([2048], [16384]), ([512] * 8, [4096] * 8),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--max-kv-gib", type=float, default=40.0,
                   help="skip decode shapes whose KV cache would exceed this")
    p.add_argument("--quick", action="store_true", help="fewer shapes, for a smoke run")
    p.add_argument("--base", type=Path,
                   help="another decode_attention.py (e.g. the commit before) to time on the "
                        "same decode shapes in the same run")
    p.add_argument("--sweep-decode", action="store_true",
                   help="time the decode tile configurations (block_n, warps, stages) on "
                        "SWEEP_SHAPES and report each against the default")
    p.add_argument("--sweep-shapes", nargs="+", type=_shape, default=list(SWEEP_SHAPES),
                   metavar="BATCHxCONTEXT",
                   help="the sweep's shapes (default: " + " ".join(
                       f"{b}x{c}" for b, c in SWEEP_SHAPES) + "); BATCHxLO-HI draws each "
                   "sequence's context uniformly from LO..HI: 1000x129-256 is a decode step of "
                   "the 1,000 x 128/128 throughput run")
    p.add_argument("--sweep-tiles", nargs="+", type=_tile, default=list(SWEEP_TILES),
                   metavar="N,WARPS,STAGES[,HEADS]",
                   help="the sweep's tiles (default: SWEEP_TILES); HEADS kv heads a program")
    p.add_argument("--grid-len", type=int,
                   help="max_seq_len given to the kernel (the grid's bound), as the engine's "
                        "CUDA graphs give max_model_len; default: the shape's longest context")
    p.add_argument("--decode-only", action="store_true", help="skip the prefill cases")
    return p.parse_args()


def _tile(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _shape(text: str) -> tuple[int, int | tuple[int, int]]:
    batch, ctx = text.split("x")
    if "-" in ctx:
        lo, hi = ctx.split("-")
        return int(batch), (int(lo), int(hi))
    return int(batch), int(ctx)


def _shape_name(batch: int, ctx: int | tuple[int, int]) -> str:
    return f"{batch}x{ctx[0]}-{ctx[1]}" if isinstance(ctx, tuple) else f"{batch}x{ctx}"


def _context_lens(batch: int, ctx: int | tuple[int, int]) -> list[int]:
    """Each sequence's context: ``ctx``, or drawn from ``ctx = (lo, hi)`` with a fixed seed, so
    every tile of a sweep sees the same lengths."""
    if not isinstance(ctx, tuple):
        return [ctx] * batch
    g = torch.Generator().manual_seed(batch * 65537 + ctx[1])
    return torch.randint(ctx[0], ctx[1] + 1, (batch,), generator=g).tolist()


class Setup:
    """Shapes and dtypes shared by every case."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.h, self.kvh, self.d = args.num_heads, args.num_kv_heads, args.head_size
        self.block_size = args.block_size
        self.dtype = DTYPES[args.dtype]
        self.fp8 = args.kv_cache_dtype == "fp8"
        self.cache_dtype = torch.float8_e4m3fn if self.fp8 else self.dtype
        self.scale = self.d**-0.5
        self.k_scale = torch.ones(1, device="cuda")
        self.v_scale = torch.ones(1, device="cuda")

    def kv_bytes(self, tokens: int) -> int:
        return 2 * tokens * self.kvh * self.d * self.cache_dtype.itemsize

    def paged(self, seq_lens: list[int]):
        """A cache holding ``seq_lens`` tokens per sequence in shuffled blocks, plus tables."""
        blocks = [math.ceil(s / self.block_size) for s in seq_lens]
        ids = torch.randperm(sum(blocks), device="cuda", dtype=torch.int64).to(torch.int32)
        tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
        start = 0
        for i, n in enumerate(blocks):
            tables[i, :n] = ids[start:start + n]
            start += n
        cache = torch.randn(2, sum(blocks), self.block_size, self.kvh, self.d, device="cuda",
                            dtype=self.dtype).to(self.cache_dtype)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        return cache, tables, lens


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy rate (bytes read + written), the practical bandwidth ceiling."""
    from triton.testing import do_bench

    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / ms / 1e6


def load_base(path: Path):
    """``decode_attention`` of another version of the module, imported from ``path`` (it may
    import this tree's helpers, e.g. prefill_attention's tiles)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("decode_attention_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.decode_attention


def time_decode(s: Setup, batch: int, ctx: int | tuple[int, int], decode=None,
                grid_len: int | None = None, **kwargs) -> tuple[float, float]:
    """(graph ms, eager ms) of one decode call at ``batch`` x ``ctx`` (``_context_lens``): this
    tree's kernel, or ``decode``; ``grid_len`` is the call's max_seq_len (default the longest
    context); ``kwargs`` go to the call (e.g. ``config``)."""
    from triton.testing import do_bench, do_bench_cudagraph

    from pagedserve.platforms.cuda.kernels.decode_attention import decode_attention

    decode = decode or decode_attention
    seq_lens = _context_lens(batch, ctx)
    cache, tables, lens = s.paged(seq_lens)
    q = torch.randn(batch, s.h, s.d, device="cuda", dtype=s.dtype)
    out = torch.empty_like(q)
    max_seq_len = grid_len or max(seq_lens)

    def run() -> None:
        decode(q, cache[0], cache[1], tables, lens, s.scale, max_seq_len, s.k_scale, s.v_scale,
               out=out, **kwargs)

    ms = do_bench_cudagraph(run, return_mode="median")
    return ms, do_bench(run, return_mode="median")


def bench_decode(s: Setup, batch: int, ctx: int, base=None) -> dict:
    from pagedserve.platforms.cuda.kernels.decode_attention import pick_partition_size
    from pagedserve.platforms.cuda.kernels.device import sm_count

    ms, eager = time_decode(s, batch, ctx)
    part = pick_partition_size(batch, s.kvh, ctx, sm_count(torch.device("cuda")), 64)
    nbytes = s.kv_bytes(batch * ctx)
    row = {"batch": batch, "context": ctx, "ms": ms, "eager_ms": eager, "kv_bytes": nbytes,
           "gbs": nbytes / ms / 1e6, "partition_size": part,
           "partitions": math.ceil(ctx / part)}
    if base is not None:
        row["base_ms"] = time_decode(s, batch, ctx, base)[0]
        row["base_gbs"] = nbytes / row["base_ms"] / 1e6
    torch.cuda.empty_cache()  # the next shape's cache may be larger
    return row


def sweep_decode(s: Setup, shapes: list[tuple[int, int | tuple[int, int]]],
                 grid_len: int | None = None, tiles=SWEEP_TILES) -> list[dict]:
    """Each of ``tiles`` at ``shapes``; ``None`` ms where it does not compile/fit."""
    from pagedserve.platforms.cuda.kernels.decode_attention import DecodeConfig

    rows = []
    for batch, ctx in shapes:
        nbytes = s.kv_bytes(sum(_context_lens(batch, ctx)))
        default = time_decode(s, batch, ctx, grid_len=grid_len)[0]
        for tile in tiles:
            try:
                ms = time_decode(s, batch, ctx, grid_len=grid_len, config=DecodeConfig(*tile))[0]
            except Exception as exc:  # out of shared memory or registers: a result here
                print(f"  tile {tile} at {_shape_name(batch, ctx)}: {type(exc).__name__}")
                ms = None
            gbs = ms and nbytes / ms / 1e6
            rows.append({"shape": _shape_name(batch, ctx), "batch": batch, "context": ctx,
                         "tile": tile, "ms": ms, "gbs": gbs, "default_ms": default,
                         "default_gbs": nbytes / default / 1e6, "grid_len": grid_len})
    return rows


def print_sweep(rows: list[dict], shapes: list[tuple[int, int | tuple[int, int]]],
                tiles=SWEEP_TILES) -> None:
    names = [_shape_name(*sh) for sh in shapes]
    print(f"\n{'tile (n, warps, stages)':>30} " + " ".join(f"{n:>12}" for n in names)
          + "   (GB/s; default first)")
    first = {r["shape"]: r for r in rows}
    print(f"{'default µs':>30} " + " ".join(
        f"{first[n]['default_ms'] * 1000:>12.1f}" for n in names))
    print(f"{'default GB/s':>30} " + " ".join(
        f"{first[n]['default_gbs']:>12.0f}" for n in names))
    for tile in tiles:
        cells = [next(r for r in rows if r["shape"] == n and r["tile"] == tile) for n in names]
        print(f"{str(tile):>30} " + " ".join(
            f"{c['gbs']:>12.0f}" if c["ms"] else f"{'-':>12}" for c in cells))


def bench_prefill(s: Setup, query_lens: list[int], context_lens: list[int]) -> dict:
    from triton.testing import do_bench_cudagraph

    from pagedserve.platforms.cuda.kernels.prefill_attention import prefill_attention

    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    cache, tables, lens = s.paged(seq_lens)
    n = sum(query_lens)
    q = torch.randn(n, s.h, s.d, device="cuda", dtype=s.dtype)
    loc = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def run() -> None:
        prefill_attention(q, cache[0], cache[1], tables, loc, lens, s.scale, max(query_lens),
                          s.k_scale, s.v_scale, out=out)

    ms = do_bench_cudagraph(run, return_mode="median")
    # Causal: query t of a chunk sees context + t + 1 keys; 2 matmuls of 2 flops per MAC.
    pairs = sum(ql * c + ql * (ql + 1) // 2 for ql, c in zip(query_lens, context_lens, strict=True))
    flops = 4 * pairs * s.h * s.d
    row = {"query_lens": query_lens, "context_lens": context_lens, "ms": ms,
           "tflops": flops / ms / 1e9, "sdpa_ms": None}
    if not any(context_lens) and len(set(query_lens)) == 1 and s.dtype != torch.float32:
        row["sdpa_ms"] = _sdpa_ms(s, len(query_lens), query_lens[0])
    return row


def _sdpa_ms(s: Setup, batch: int, length: int) -> float:
    """torch's fused causal attention on contiguous tensors: the dense baseline."""
    from triton.testing import do_bench_cudagraph

    q = torch.randn(batch, s.h, length, s.d, device="cuda", dtype=s.dtype)
    k = torch.randn(batch, s.kvh, length, s.d, device="cuda", dtype=s.dtype)
    v = torch.randn_like(k)
    f = torch.nn.functional.scaled_dot_product_attention
    return do_bench_cudagraph(lambda: f(q, k, v, is_causal=True, enable_gqa=True),
                              return_mode="median")


def print_tables(result: dict) -> None:
    peak = result["copy_gbs"]
    print(f"\n{result['device']}  copy bandwidth {peak:.0f} GB/s  {result['config']}")
    print(f"\n{'decode batch':>12} {'context':>8} {'ms':>9} {'GB/s':>8} {'% copy':>7} "
          f"{'part':>6} {'nparts':>6} {'eager ms':>9} {'base GB/s':>9} {'new/base':>8}")
    for r in result["decode"]:
        base = (f"{r['base_gbs']:>9.0f} {r['base_ms'] / r['ms']:>7.2f}x" if "base_ms" in r
                else "")
        print(f"{r['batch']:>12} {r['context']:>8} {r['ms']:>9.4f} {r['gbs']:>8.0f} "
              f"{100 * r['gbs'] / peak:>6.1f}% {r['partition_size']:>6} {r['partitions']:>6} "
              f"{r['eager_ms']:>9.4f} {base}")
    print(f"\n{'prefill queries':>22} {'context':>14} {'ms':>9} {'TFLOP/s':>8} {'sdpa ms':>8}")
    for r in result["prefill"]:
        sdpa = f"{r['sdpa_ms']:.4f}" if r["sdpa_ms"] is not None else "-"
        q = f"{len(r['query_lens'])}x{r['query_lens'][0]}"
        c = f"{len(r['context_lens'])}x{r['context_lens'][0]}"
        print(f"{q:>22} {c:>14} {r['ms']:>9.4f} {r['tflops']:>8.1f} {sdpa:>8}")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs an NVIDIA GPU: torch.cuda.is_available() is False")
    args = parse_args()
    torch.manual_seed(0)
    s = Setup(args)
    batches = DECODE_BATCHES[:2] if args.quick else DECODE_BATCHES
    contexts = DECODE_CONTEXTS[::3] if args.quick else DECODE_CONTEXTS
    base = load_base(args.base) if args.base else None
    decode = []
    for batch in batches:
        for ctx in contexts:
            if s.kv_bytes(batch * ctx) > args.max_kv_gib * 1024**3:
                continue
            decode.append(bench_decode(s, batch, ctx, base))
    cases = [] if args.decode_only else PREFILL_CASES[:3] if args.quick else PREFILL_CASES
    prefill = [bench_prefill(s, list(q), list(c)) for q, c in cases]
    result = {
        "device": torch.cuda.get_device_name(),
        "config": {k: getattr(args, k) for k in ("num_heads", "num_kv_heads", "head_size",
                                                 "block_size", "dtype", "kv_cache_dtype")},
        "copy_gbs": copy_bandwidth_gbs(),
        "decode": decode,
        "prefill": prefill,
        "base": str(args.base) if args.base else None,
    }
    print_tables(result)
    if args.sweep_decode:
        result["decode_sweep"] = sweep_decode(s, args.sweep_shapes, args.grid_len,
                                              args.sweep_tiles)
        print_sweep(result["decode_sweep"], args.sweep_shapes, args.sweep_tiles)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
