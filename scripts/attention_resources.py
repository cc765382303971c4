"""Compile the decode-attention kernel's tiles for sm_90 on the CPU and report what each
holds: registers and spilled stack bytes per thread (``cuobjdump -res-usage``), shared memory,
the programs a multiprocessor can then run at once (by registers and by shared memory), and
how many of its loads the pipeliner copies ahead (``async_copy_global_to_local`` in the TTGIR).

No GPU is needed (``triton.compile`` with a ``cuda`` target, as ``w4a16_sass.py``). The
kernel is specialized as the Llama-3-8B launch would be (head 128, GQA 4, blocks of 16, one
partition, pointers aligned). Register pressure depends on Triton's version; for the H200's
(3.6), install it beside the project's: ``pip install --no-deps --target /tmp/t36
triton==3.6.0`` and run with ``PYTHONPATH=/tmp/t36``.

    python scripts/attention_resources.py [--out FILE.json]
    python scripts/attention_resources.py --check   # the defaults only (the CPU test suite)

Run with ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_attention import SWEEP_TILES  # noqa: E402
from scripts.w4a16_sass import resources  # noqa: E402

# The launch's integer arguments as Triton specializes them at the 8B shapes: the unit
# strides become the constant 1, the others are divisible by 16 (which lets the loads be
# vectorized and copied ahead), but for the kernel's do_not_specialize.
UNIT = {"stride_qd", "stride_od", "stride_cd", "stride_btn"}
POINTERS = {"q_ptr": "bf16", "k_cache_ptr": "CACHE", "v_cache_ptr": "CACHE", "out_ptr": "bf16",
            "part_out_ptr": "fp32", "part_lse_ptr": "fp32", "block_tables_ptr": "i32",
            "seq_lens_ptr": "i32", "k_scale_ptr": "fp32", "v_scale_ptr": "fp32"}
FLOATS = {"sm_scale", "softcap"}
# An H100/H200 multiprocessor: 64k 32-bit registers, 228 KB of shared memory.
REGISTERS, SHARED = 65536, 228 * 1024


def compile_tile(cache: str, block_n: int, warps: int, stages: int, heads: int = 1):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedserve.platforms.cuda.kernels import decode_attention

    fn = decode_attention._decode_partition_kernel
    plain = {param.name for param in fn.params if param.do_not_specialize}
    consts = dict(GROUP=4, GROUP_PAD=max(16, 4 * heads), HEAD_SIZE=128, HEAD_PAD=128,
                  BLOCK_SIZE=16, BLOCK_N=block_n, HEADS=heads, SINGLE_PARTITION=True,
                  HAS_SCALES=cache == "fp8e4nv", SLIDING=False, SOFTCAP=False,
                  DOT_PREC="tf32", PTX=True, PDL=True, **{name: 1 for name in UNIT})
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = "*" + POINTERS[name].replace("CACHE", cache)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
            if name not in plain and name not in FLOATS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, consts, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def default_tiles() -> list[tuple[str, tuple[int, int, int, int]]]:
    """The tiles ``decode_attention`` picks on an H200 (132 SMs) for each cache type, with many
    programs (a large batch) and with few (batch 1, one partition's worth)."""
    import torch

    from pagedserve.platforms.cuda.kernels import decode_attention as da

    tiles = []
    for cache, dtype in (("bf16", torch.bfloat16), ("fp8e4nv", torch.float8_e4m3fn)):
        # A large batch (four kv heads a program), a medium one; one sequence over many
        # partitions; one sequence, one partition.
        for seq_heads, programs in ((8 * 1024, 8 * 1024), (8 * 64, 8 * 64), (8, 8 * 64), (8, 8)):
            tile = tuple(da._decode_config(128, torch.bfloat16, dtype, 4, 8, seq_heads, programs,
                                           132))
            if (cache, tile) not in tiles:
                tiles.append((cache, tile))
    return tiles


def check() -> None:
    """Exit non-zero unless every default tile compiles without spilling and with its loads
    copied ahead: a launch that stopped specializing its strides loses both."""
    for cache, tile in default_tiles():
        kernel = compile_tile(cache, *tile)
        r = resources(kernel)
        copies = kernel.asm["ttgir"].count("async_copy_global_to_local")
        print(f"{cache} {tile}: {r['registers']} registers, {r['stack']} bytes spilled, "
              f"{copies} async copies")
        if r["stack"] or not copies:
            sys.exit(f"{cache} {tile} spills or copies nothing ahead")
    print("compiled")


def main() -> None:
    import triton

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--check", action="store_true", help="the default tiles only; fail if one "
                   "spills or copies nothing ahead")
    args = p.parse_args()
    if args.check:
        return check()
    rows = []
    print(f"Triton {triton.__version__}, sm_90, decode attention (head 128, GQA 4)")
    print(f"{'cache':>6} {'tile (n, warps, stages)':>24} {'regs':>5} {'spill B':>8} "
          f"{'smem KB':>8} {'programs/SM by regs':>20} {'by smem':>8} {'async copies':>13}")
    for cache in ("bf16", "fp8e4nv"):
        for tile in SWEEP_TILES:
            try:
                kernel = compile_tile(cache, *tile)
            except Exception as exc:  # a tile that does not compile is a result here
                print(f"{cache:>6} {str(tile):>24} {type(exc).__name__}")
                continue
            r = resources(kernel)
            row = {"cache": cache, "tile": tile, **r, "shared": kernel.metadata.shared,
                   "async_copies": kernel.asm["ttgir"].count("async_copy_global_to_local"),
                   "programs_by_registers": REGISTERS // (r["registers"] * 32 * tile[1]),
                   "programs_by_shared": SHARED // max(kernel.metadata.shared, 1)}
            rows.append(row)
            print(f"{cache:>6} {str(tile):>24} {r['registers']:>5} {r['stack']:>8} "
                  f"{row['shared'] / 1024:>8.1f} {row['programs_by_registers']:>20} "
                  f"{row['programs_by_shared']:>8} {row['async_copies']:>13}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
