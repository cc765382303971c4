"""Time the W4A16 Triton kernel against bf16 ``torch.mm`` (cuBLAS) on an NVIDIA GPU.

Llama-3-8B's linear shapes (fused qkv, o, fused gate/up, down) with 4-bit weights in groups of
128 (AWQ-style float16 scales and integer zero points), M = 1 .. 1024 rows. Small M is reported
as the packed weight's bytes (values, scales, zero points) per second next to the card's
device-to-device copy rate measured in the same run; large M as TFLOP/s.

Times are medians from ``triton.testing.do_bench_cudagraph`` (GPU time, as under CUDA graphs).
The calls cycle through copies of the weight that together pass four times the L2 cache, so
each call reads its weight from memory, as a decode step does. ``--sweep-gemv`` times the
one- and two-row kernel's configurations (blocks, warps, split-K target, one word's pairs or
two words'), ``--sweep-mma`` the CUDA C++ kernel's compiled variants and split targets,
``--sweep-wgmma`` the Hopper kernel's blocks of rows and stages against cuBLAS,
``--sweep-tiles`` the tiles' (block sizes, warps, stages, split-K target, biased
codes or ``q - z``, the scale row a tile ahead or not) at each M and picks the fastest per
range of M (``--write-choice`` writes both choices into the kernel's source, for the runs
that follow and to commit). Each swept variant's output is checked against dequantize +
``torch.mm`` first; a wrong one is timed as NaN and never chosen. ``--base FILE``
times an earlier copy of ``kernels/w4a16.py`` (its own ``pack`` and ``matmul``) beside this
one, on the same values.

    git show REV:pagedserve/platforms/cuda/kernels/w4a16.py > /tmp/w4a16_base.py
    python scripts/bench_w4a16.py --out benchmarks/results/w4a16_h200.json \
        [--base /tmp/w4a16_base.py] [--sweep-gemv] [--sweep-tiles]
"""

from __future__ import annotations

import argparse
import importlib.util
import re
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
    p.add_argument("--sweep-tiles", action="store_true")
    p.add_argument("--sweep-mma", action="store_true",
                   help="time the CUDA C++ mma kernels' blocks, compiled variants and split "
                        "targets")
    p.add_argument("--sweep-wgmma", action="store_true",
                   help="time the Hopper wgmma kernel's blocks of rows and compiled variants "
                        "against cuBLAS, dequantize + cuBLAS and the tiles")
    p.add_argument("--no-table", action="store_true",
                   help="after the sweeps, skip the table of every path at each M")
    p.add_argument("--mma-variants", type=int, nargs="+",
                   help="the compiled variants --sweep-mma times (default: all)")
    p.add_argument("--write-choice", action="store_true",
                   help="with --sweep-tiles / --sweep-gemv: write their choices into the "
                   "kernel's source")
    p.add_argument("--base", help="an earlier kernels/w4a16.py to time beside this one")
    return p.parse_args()


def load_base(path: str):
    """The module at ``path`` (an earlier ``kernels/w4a16.py``), imported under its own name."""
    spec = importlib.util.spec_from_file_location("w4a16_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def random_packed(n: int, k: int, group: int, modules: tuple) -> tuple:
    """One random weight packed by each of ``modules`` (this kernel, and the base's)."""
    groups = -(-k // group)
    values = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=DEVICE)
    scales = (torch.rand(n, groups, device=DEVICE) * 0.02 + 0.002).half().float()
    offsets = -torch.randint(0, 16, (n, groups), device=DEVICE).float() * scales
    return tuple(m.pack(values, scales, offsets, group, torch.device(DEVICE)) for m in modules)


def bench_shape(name: str, n: int, k: int, args: argparse.Namespace, copy_gbs: float,
                base) -> list[dict]:
    from pagedserve.platforms.cuda.kernels import w4a16

    dtype = DTYPES[args.dtype]
    modules = (w4a16,) if base is None else (w4a16, base)
    pairs = copies_past_l2(lambda: random_packed(n, k, args.group_size, modules), n * k // 2)
    packed = [p[0] for p in pairs]
    w_bytes = packed_bytes(packed[0])
    dense = copies_past_l2(lambda: torch.randn(n, k, device=DEVICE, dtype=dtype) * 0.02,
                           2 * n * k)
    rows = []
    for m in args.ms:
        x = torch.randn(m, k, device=DEVICE, dtype=dtype)
        out = torch.empty(m, n, device=DEVICE, dtype=dtype)
        ms_w4, ms_mm, paths = time_all(w4a16, x, out, packed, dense)
        flops = 2 * m * n * k
        row = {
            "layer": name, "n": n, "k": k, "m": m, "w4a16_ms": ms_w4,
            "torch_mm_ms": ms_mm, "path_ms": paths,
            "speedup": ms_mm / ms_w4, "packed_bytes": w_bytes,
            "w4a16_weight_gbs": w_bytes / ms_w4 / 1e6,
            "w4a16_pct_copy": 100 * w_bytes / ms_w4 / 1e6 / copy_gbs,
            "torch_mm_weight_gbs": 2 * n * k / ms_mm / 1e6,
            "w4a16_tflops": flops / ms_w4 / 1e9, "torch_mm_tflops": flops / ms_mm / 1e9,
        }
        if base is not None:
            ms_base = _time(cycling(lambda w, x=x, out=out: base.matmul(x, w, out=out),
                                    [p[1] for p in pairs]))
            row.update(base_ms=ms_base, base_over_w4a16=ms_base / ms_w4)
        rows.append(row)
        print(_row(row) + "  " + " ".join(f"{p} {t * 1000:.1f}us" for p, t in paths.items())
              + (f"  base {row['base_ms'] * 1000:.1f}us ({row['base_over_w4a16']:.2f}x)"
                 if base is not None else ""), flush=True)
    return rows


def time_all(module, x: torch.Tensor, out: torch.Tensor, packed: list,
             dense: list) -> tuple[float, float, dict]:
    """Milliseconds of ``module``'s W4A16 matmul as the engine runs it, of ``torch.mm`` on the
    dense weight, and of each of the paths that take M rows forced; NaN for one that fails."""
    m = x.shape[0]
    paths = {path: _time(cycling(lambda w, path=path: module.matmul(x, w, out=out, path=path),
                                 packed))
             for path in module.PATHS
             if m <= {"gemv": module.GEMV_MAX_M}.get(path, m)}
    ms_mm = _time(cycling(lambda w: torch.mm(x, w.T, out=out), dense))
    return _time(cycling(lambda w: module.matmul(x, w, out=out), packed)), ms_mm, paths


# The GEMV's candidates: (BLOCK_N, BLOCK_K, warps, programs per SM), each with word rows
# paired at every row count and never (pair_words_from 1 and 3), timed at M = 1 and 2.
# Tried and dropped on 2026-12-05 (docs/benchmarks.md): the next block's loads issued a block
# ahead, with 2 to 8 programs per SM.
GEMV_CANDIDATES = [(256, 64, 2, 8), (256, 64, 2, 16), (128, 64, 2, 8), (256, 128, 4, 8)]


def sweep_gemv(args: argparse.Namespace, copy_gbs: float) -> list[dict]:
    """The one- and two-row kernel's configurations over the four layers, each from memory;
    a configuration whose output is wrong is reported as NaN."""
    from pagedserve.platforms.cuda.kernels import w4a16

    weights = _sweep_weights(args)
    total_bytes = sum(packed_bytes(w[0]) for w in weights.values())
    original = w4a16._gemv_config
    rows = []
    for m in (1, 2):
        xs = _sweep_inputs(m, args)
        refs = _references(w4a16, weights, xs)
        for block_n, block_k, warps, per_sm in GEMV_CANDIDATES:
            for pair_words_from in (3, 1):
                cfg = w4a16._GemvConfig(block_n, block_k, warps, per_sm, pair_words_from)
                w4a16._gemv_config = lambda cfg=cfg: cfg
                layer_ms = _layers(w4a16, "gemv", weights, xs, refs)
                rows.append(_sweep_row(m, "gemv", cfg, layer_ms, total_bytes, copy_gbs))
    w4a16._gemv_config = original
    return rows


def choose_gemv(sweep: list[dict]):
    """The GEMV candidate with the least time summed over M = 1 and 2 (each timed with word
    rows paired and not), word rows paired from the row count where that was faster."""
    from pagedserve.platforms.cuda.kernels import w4a16

    times: dict = {}  # (block fields, M) -> {paired: ms}
    for r in sweep:
        cfg = w4a16._GemvConfig(**r["config"])
        if r["total_ms"] == r["total_ms"]:  # not NaN: failed or wrong
            times.setdefault((cfg[:4], r["m"]), {})[cfg.pair_words_from == 1] = r["total_ms"]
    best = None
    for fields in {f for f, _m in times}:
        one, two = times.get((fields, 1), {}), times.get((fields, 2), {})
        # pair_words_from 1 (paired at both), 2 (at two rows), 3 (never); 1 row then paired
        # and 2 not cannot be chosen.
        options = {1: (one.get(True), two.get(True)), 2: (one.get(False), two.get(True)),
                   3: (one.get(False), two.get(False))}
        for start, (t1, t2) in options.items():
            if t1 is not None and t2 is not None and (best is None or t1 + t2 < best[0]):
                best = (t1 + t2, w4a16._GemvConfig(*fields, start))
    return best[1] if best else None


def _sweep_weights(args: argparse.Namespace) -> dict:
    from pagedserve.platforms.cuda.kernels import w4a16

    return {name: [p[0] for p in copies_past_l2(
        lambda n=n, k=k: random_packed(n, k, args.group_size, (w4a16,)), n * k // 2)]
        for name, n, k in SHAPES}


def _sweep_inputs(m: int, args: argparse.Namespace) -> dict:
    return {name: (torch.randn(m, k, device=DEVICE, dtype=DTYPES[args.dtype]),
                   torch.empty(m, n, device=DEVICE, dtype=DTYPES[args.dtype]))
            for name, n, k in SHAPES}


def _references(module, weights: dict, xs: dict) -> dict:
    """Each layer's output on its first weight copy, by dequantize + torch.mm."""
    return {name: module.matmul(x, weights[name][0], path="dequant").float()
            for name, (x, _out) in xs.items()}


def _layers(module, path: str, weights: dict, xs: dict, refs: dict) -> dict:
    """Milliseconds per layer of ``path`` as ``module`` is now configured; NaN where its output
    on the first weight copy is wrong (a broken variant must not win the sweep)."""
    times = {}
    for name, (x, out) in xs.items():
        try:
            got = module.matmul(x, weights[name][0], out=out, path=path).float()
        except Exception as exc:  # one failing variant must not hide the others' numbers
            print(f"failed: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
            got = torch.full_like(refs[name], float("nan"))
        ref = refs[name]
        if not (got - ref).abs().max() <= 2e-2 * ref.abs().max() + 1e-3:
            print(f"wrong output: {path} {name} M {x.shape[0]}", flush=True)
            times[name] = float("nan")
            continue
        times[name] = _time(cycling(lambda w, x=x, out=out: module.matmul(x, w, out=out,
                                                                           path=path),
                                    weights[name]))
    return times


# The tiles' candidates by the bound of M they are for: (BLOCK_M, BLOCK_N, warps, stages, the
# fields timed), each with split-K targets (programs per SM; they matter only where BLOCK_M
# holds every row). The fields are (bias, prefetch, swap_ab, scale_a, ptx_decode): biased codes
# or q - z, the scale row a tile ahead or not, the tile computed transposed (the decoded
# weights as wgmma's register operand), the scales applied to the weights (one accumulator;
# the transposed tiles of 128 rows need it to fit in registers) and the codes decoded by
# _slice_ptx. 1 program per SM, 16 x 256 with 8 warps or 4 stages and BLOCK_N 64 at M = 32
# and 64 were slower in the sweep of 2026-12-01 and are not timed again, nor are the fields
# that lost there from 64 rows (so that the sweep fits one device call). The transposed tiles
# keep the decoded weights in registers only where BLOCK_N >= 32 * warps
# (scripts/w4a16_sass.py), so only those are timed.
BIAS_PREFETCH = tuple((bias, prefetch, False, False, False) for bias in (True, False)
                      for prefetch in (False, True))
SWAPPED = tuple((False, True, True, scale_a, ptx) for scale_a in (False, True)
                for ptx in (False, True))
SCALED = ((False, True, True, True, False), (False, True, True, True, True))
SCALED_PTX = ((False, True, True, True, True),)
_LARGE = [(128, 128, 8, 3, ((False, False, False, False, False),
                            (False, False, False, False, True))),
          (64, 128, 4, 3, SWAPPED), (64, 256, 8, 3, SCALED_PTX), (128, 128, 4, 3, SCALED_PTX),
          (128, 256, 8, 3, SCALED)]
TILE_CANDIDATES = {
    16: [(16, 128, 4, 3, BIAS_PREFETCH), (16, 256, 4, 3, BIAS_PREFETCH)],
    32: [(32, 128, 4, 3, BIAS_PREFETCH)],
    64: [(64, 128, 4, 3, ((False, True, False, False, False), (False, True, False, False, True))),
         (64, 128, 4, 3, SWAPPED), (64, 256, 8, 3, ((False, True, True, False, True),
                                                   (False, True, True, True, True)))],
    128: _LARGE,
    None: _LARGE,
}
SPLIT_TARGETS = (2, 4)


def _bound(m: int):
    return next(b for b in TILE_CANDIDATES if b is None or m <= b)


def tile_variants(m: int) -> list:
    """The ``_TileConfig``s timed at M = ``m``: every candidate of its range by each of its
    fields."""
    from pagedserve.platforms.cuda.kernels import w4a16

    return [w4a16._TileConfig(*c[:4], per_sm, *fields) for c in TILE_CANDIDATES[_bound(m)]
            for per_sm in (SPLIT_TARGETS if c[0] >= m else SPLIT_TARGETS[:1])
            for fields in c[4]]


def sweep_tiles(args: argparse.Namespace, copy_gbs: float) -> list[dict]:
    """The tiles' candidate configurations at each M of ``--ms`` over the four layers, and the
    dequantize path there; a configuration whose output is wrong is reported as NaN."""
    from pagedserve.platforms.cuda.kernels import w4a16

    weights = _sweep_weights(args)
    total_bytes = sum(packed_bytes(w[0]) for w in weights.values())
    original = w4a16._TILE_CONFIGS
    rows = []
    for m in args.ms:
        xs = _sweep_inputs(m, args)
        refs = _references(w4a16, weights, xs)
        for cfg in tile_variants(m):
            w4a16._TILE_CONFIGS = ((None, cfg),)
            layer_ms = _layers(w4a16, "tiles", weights, xs, refs)
            rows.append(_sweep_row(m, "tiles", cfg, layer_ms, total_bytes, copy_gbs))
        layer_ms = _layers(w4a16, "dequant", weights, xs, refs)
        rows.append(_sweep_row(m, "dequant", None, layer_ms, total_bytes, copy_gbs))
    w4a16._TILE_CONFIGS = original
    return rows


class _MmaVariant:
    """``matmul`` for ``_layers``: the mma kernels' compiled variant ``variant`` with blocks of
    ``rows`` rows (``w4a16_mma.Plan.block_rows``)."""

    def __init__(self, variant: int, rows: int):
        self.variant, self.rows = variant, rows

    def matmul(self, x, w, out=None, path=None):
        from pagedserve.platforms.cuda.kernels import w4a16_mma

        return w4a16_mma.matmul(x, w, out, None, self.variant, self.rows)


MMA_SPLIT_TARGETS = (1, 2, 4)
MMA_BLOCK_ROWS = (0, 16, 32, 64)  # 0: the few-rows kernel (up to w4a16_mma.FEW_ROWS)


def sweep_mma(args: argparse.Namespace, copy_gbs: float) -> list[dict]:
    """The mma kernels (rows per block, ``MMA_BLOCK_ROWS``) and their variants (stages; built
    with ``W4A16_MMA_SWEEP``; ``--mma-variants``) by split-K target (blocks per
    multiprocessor) at each M of ``--ms``; the dequantize path and the engine's choice
    alongside."""
    from pagedserve.platforms.cuda.kernels import w4a16, w4a16_mma

    lib = w4a16_mma.library(torch.cuda.get_device_capability(), sweep=True)
    if lib is None:
        sys.exit("the mma kernel does not build here (see the log line above)")
    weights = _sweep_weights(args)
    total_bytes = sum(packed_bytes(w[0]) for w in weights.values())
    original = w4a16_mma.PROGRAMS_PER_SM, w4a16_mma.MANY_ROWS_PROGRAMS_PER_SM
    variants = args.mma_variants or range(lib.w4a16_mma_variants())
    rows = []
    for m in args.ms:
        xs = _sweep_inputs(m, args)
        refs = _references(w4a16, weights, xs)
        for block_rows in MMA_BLOCK_ROWS:
            # Too many rows for the few-rows kernel, or half a block's rows or more wasted.
            if (block_rows == 0 and m > w4a16_mma.FEW_ROWS
                    or block_rows > 16 and m <= block_rows // 2):
                continue
            for variant in variants:
                for per_sm in MMA_SPLIT_TARGETS:
                    w4a16_mma.PROGRAMS_PER_SM = w4a16_mma.MANY_ROWS_PROGRAMS_PER_SM = per_sm
                    layer_ms = _layers(_MmaVariant(variant, block_rows), "mma", weights, xs, refs)
                    row = _sweep_row(m, f"mma r{block_rows} v{variant}", None, layer_ms,
                                     total_bytes, copy_gbs)
                    rows.append({**row, "block_rows": block_rows, "variant": variant,
                                 "programs_per_sm": per_sm})
        w4a16_mma.PROGRAMS_PER_SM, w4a16_mma.MANY_ROWS_PROGRAMS_PER_SM = original
        for path in ("dequant", None):
            layer_ms = _layers(w4a16, path, weights, xs, refs)
            rows.append(_sweep_row(m, path or "chosen", None, layer_ms, total_bytes, copy_gbs))
    return rows


class _WgmmaVariant:
    """``matmul`` for ``_layers``: the wgmma kernel's compiled variant ``variant`` with blocks
    of ``rows`` rows of x."""

    def __init__(self, variant: int, rows: int):
        self.variant, self.rows = variant, rows

    def matmul(self, x, w, out=None, path=None):
        from pagedserve.platforms.cuda.kernels import w4a16_wgmma

        return w4a16_wgmma.matmul(x, w, out, self.rows, self.variant)


def sweep_wgmma(args: argparse.Namespace, copy_gbs: float) -> list[dict]:
    """The wgmma kernel by rows per block (``w4a16_wgmma.BLOCK_ROWS``) and compiled variant
    (stages; built with ``W4A16_WGMMA_SWEEP``) at each M of ``--ms``, with cuBLAS on the bf16
    weight, the dequantize path, the tiles and the engine's choice alongside."""
    from pagedserve.platforms.cuda.kernels import w4a16, w4a16_wgmma

    lib = w4a16_wgmma.library(sweep=True)
    if lib is None:
        sys.exit("the wgmma kernel does not build here (see the log line above)")
    weights = _sweep_weights(args)
    total_bytes = sum(packed_bytes(w[0]) for w in weights.values())
    dense = {name: copies_past_l2(lambda n=n, k=k: torch.randn(n, k, device=DEVICE,
                                                                dtype=DTYPES[args.dtype]),
                                  2 * n * k) for name, n, k in SHAPES}
    rows = []
    for m in args.ms:
        xs = _sweep_inputs(m, args)
        refs = _references(w4a16, weights, xs)
        for block_rows in w4a16_wgmma.BLOCK_ROWS:
            if block_rows > 64 and m <= block_rows // 2:  # half a block or more wasted
                continue
            for variant in range(lib.w4a16_wgmma_variants()):
                layer_ms = _layers(_WgmmaVariant(variant, block_rows), "wgmma", weights, xs,
                                   refs)
                row = _sweep_row(m, f"wgmma r{block_rows} v{variant}", None, layer_ms,
                                 total_bytes, copy_gbs)
                rows.append({**row, "block_rows": block_rows, "variant": variant})
        for path in ("tiles", "dequant", None):
            if path == "tiles" and m >= w4a16.DEQUANT_MIN_M:
                continue
            layer_ms = _layers(w4a16, path, weights, xs, refs)
            rows.append(_sweep_row(m, path or "chosen", None, layer_ms, total_bytes, copy_gbs))
        layer_ms = {name: _time(cycling(lambda w, x=xs[name][0], out=xs[name][1]:
                                        torch.mm(x, w.T, out=out), dense[name]))
                    for name, _n, _k in SHAPES}
        rows.append(_sweep_row(m, "cublas", None, layer_ms, total_bytes, copy_gbs))
    return rows


def _sweep_row(m: int, path: str, cfg, layer_ms: dict, total_bytes: int,
               copy_gbs: float) -> dict:
    total = sum(layer_ms.values())
    pct = 100 * total_bytes / total / 1e6 / copy_gbs
    print(f"{path:>7} M {m:>4} {str(tuple(cfg)) if cfg else '':<36}: "
          + " ".join(f"{k} {v * 1000:6.1f}us" for k, v in layer_ms.items())
          + f"  sum {total * 1000:6.1f}us {pct:5.1f}% of copy", flush=True)
    return {"m": m, "path": path, "config": cfg._asdict() if cfg else None,
            "layer_ms": layer_ms, "total_ms": total, "pct_copy": pct}


def choose(sweep: list[dict]) -> tuple[tuple, int]:
    """From ``sweep_tiles``'s rows: per bound of M, the candidate with the least time summed
    over the swept M in its range, and the smallest swept M from which dequantizing was faster
    than the best tiles (at it and every larger swept M)."""
    from pagedserve.platforms.cuda.kernels import w4a16

    totals, counts, best_at, dequant_at = {}, {}, {}, {}
    for r in sweep:
        if r["total_ms"] != r["total_ms"]:  # NaN: failed or wrong
            continue
        if r["path"] == "dequant":
            dequant_at[r["m"]] = r["total_ms"]
            continue
        cfg = w4a16._TileConfig(**r["config"])
        # Where one block does not hold every row, K is not split: that time stands for every
        # split-K target.
        targets = SPLIT_TARGETS if cfg.block_m < r["m"] else (cfg.programs_per_sm,)
        for per_sm in targets:
            key = (_bound(r["m"]), cfg._replace(programs_per_sm=per_sm))
            totals[key] = totals.get(key, 0.0) + r["total_ms"]
            counts[key] = counts.get(key, 0) + 1
        best_at[r["m"]] = min(best_at.get(r["m"], float("inf")), r["total_ms"])
    table = []
    for bound in TILE_CANDIDATES:
        # Only candidates timed at every swept M of the range; a range with none swept keeps
        # the configuration it has now.
        mine = {cfg: t for (b, cfg), t in totals.items() if b == bound}
        if mine:
            most = max(counts[bound, cfg] for cfg in mine)
            table.append((bound, min((c for c in mine if counts[bound, c] == most),
                                     key=mine.get)))
        else:
            table.append((bound, w4a16._config(bound or 1 << 30)))
    if table[-1][0] is not None:
        table[-1] = (None, table[-1][1])
    dequant_min = max(dequant_at) + 1 if dequant_at else w4a16.DEQUANT_MIN_M
    for m in sorted(dequant_at, reverse=True):
        if dequant_at[m] >= best_at.get(m, float("inf")):
            break
        dequant_min = m
    return tuple(table), dequant_min


def write_gemv_choice(cfg) -> None:
    """Rewrite ``_gemv_config``'s configuration in the kernel's source (and in this process)."""
    from pagedserve.platforms.cuda.kernels import w4a16

    path = Path(w4a16.__file__)
    text, n = re.subn(r"^    return _GemvConfig\(.*\)$",
                      f"    return _GemvConfig{tuple(cfg)}", path.read_text(), flags=re.M)
    if n != 1:
        sys.exit(f"cannot find _gemv_config's return in {path}")
    path.write_text(text)
    w4a16._gemv_config = lambda: cfg
    print(f"wrote {path}: _GemvConfig{tuple(cfg)}", flush=True)


def write_choice(table: tuple, dequant_min: int) -> None:
    """Rewrite ``_TILE_CONFIGS`` and ``DEQUANT_MIN_M`` in the kernel's source (and in this
    process)."""
    from pagedserve.platforms.cuda.kernels import w4a16

    path = Path(w4a16.__file__)
    text = path.read_text()
    rows = "".join(f"    ({bound}, _TileConfig{tuple(cfg)}),\n" for bound, cfg in table)
    text, n1 = re.subn(r"^_TILE_CONFIGS = \(\n.*?^\)\n", f"_TILE_CONFIGS = (\n{rows})\n",
                       text, flags=re.M | re.S)
    text, n2 = re.subn(r"^DEQUANT_MIN_M = \d+$", f"DEQUANT_MIN_M = {dequant_min}", text,
                       flags=re.M)
    if (n1, n2) != (1, 1):
        sys.exit(f"cannot find _TILE_CONFIGS or DEQUANT_MIN_M in {path}")
    path.write_text(text)
    w4a16._TILE_CONFIGS, w4a16.DEQUANT_MIN_M = table, dequant_min
    print(f"wrote {path}: DEQUANT_MIN_M = {dequant_min}\n{rows}", flush=True)


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
    base = load_base(args.base) if args.base else None
    result = {"device": torch.cuda.get_device_name(), "dtype": args.dtype,
              "group_size": args.group_size, "copy_gbs": copy_gbs, "base": args.base}
    if args.sweep_gemv:  # first, so that the table below runs the chosen GEMV
        result["gemv_sweep"] = sweep_gemv(args, copy_gbs)
        gemv = choose_gemv(result["gemv_sweep"])
        result["gemv_choice"] = gemv._asdict() if gemv else None
        if args.write_choice and gemv:
            write_gemv_choice(gemv)
        torch.cuda.empty_cache()
    if args.sweep_tiles:
        result["tiles_sweep"] = sweep_tiles(args, copy_gbs)
        table, dequant_min = choose(result["tiles_sweep"])
        result["choice"] = {"tile_configs": [[b, c._asdict()] for b, c in table],
                            "dequant_min_m": dequant_min}
        if args.write_choice:
            write_choice(table, dequant_min)
        torch.cuda.empty_cache()
    if args.sweep_mma:
        result["mma_sweep"] = sweep_mma(args, copy_gbs)
        torch.cuda.empty_cache()
    if args.sweep_wgmma:
        result["wgmma_sweep"] = sweep_wgmma(args, copy_gbs)
        torch.cuda.empty_cache()
    rows = []
    for name, n, k in () if args.no_table else SHAPES:
        rows += bench_shape(name, n, k, args, copy_gbs, base)
        torch.cuda.empty_cache()
    result["rows"] = rows
    write_result("w4a16", result, args.out)


if __name__ == "__main__":
    main()
