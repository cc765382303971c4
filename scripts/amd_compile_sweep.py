"""Compile every Triton kernel of ours for AMD GPUs on the CPU, through Triton's AMD backend.

No GPU is needed: ``triton.compile`` with a ``hip`` target runs the whole pipeline down to a
code object for the named ``gfx`` architecture. Each case compiles one kernel in one activation
dtype for one target with the launch settings and dot precision the platform would choose, and
checks the kernel's shared memory (LDS) against the target's limit. Shapes are Llama-3-8B's
(head 128, GQA 4, hidden 4096, block size 16).

    python scripts/amd_compile_sweep.py              # the full sweep, JSON to benchmarks/results
    python scripts/amd_compile_sweep.py --subset     # the CI subset (tests/platforms/rocm)

Run with ``TRITON_INTERPRET`` unset. Exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUT = Path(__file__).resolve().parents[1] / "benchmarks/results/amd_compile_sweep.json"
# (architecture, wavefront size, LDS bytes per workgroup): MI200, MI300, MI350, Radeon RDNA3.
TARGETS = {"gfx90a": (64, 64 << 10), "gfx942": (64, 64 << 10), "gfx950": (64, 160 << 10),
           "gfx1100": (32, 64 << 10)}
DTYPES = ("fp16", "bf16", "fp32")
HEAD, GROUP, BLOCK_SIZE, HIDDEN = 128, 4, 16, 4096


class Case(NamedTuple):
    kernel: str
    dtype: str
    target: str


class Result(NamedTuple):
    kernel: str
    dtype: str
    target: str
    ok: bool
    shared_bytes: int | None
    seconds: float
    error: str | None


class Spec(NamedTuple):
    fn: object  # a triton JITFunction
    pointers: dict[str, str]  # argument -> element type; "ACT" is the activation dtype
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int = 1
    floats: tuple[str, ...] = ()  # fp32 scalar arguments; other scalars are i32


def _torch_dtype(name: str):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def _attention_pointers(decode: bool) -> dict[str, str]:
    ptrs = {"q_ptr": "ACT", "k_cache_ptr": "ACT", "v_cache_ptr": "ACT", "out_ptr": "ACT",
            "block_tables_ptr": "i32", "seq_lens_ptr": "i32", "k_scale_ptr": "i32",
            "v_scale_ptr": "i32"}
    if decode:
        ptrs.update(part_out_ptr="fp32", part_lse_ptr="fp32")
    else:
        ptrs.update(query_start_loc_ptr="i32", seq_ids_ptr="i32")
    return ptrs


def _prefill(windowed: bool = False):
    """``windowed``: a Gemma 2 local layer's form (a sliding window and capped scores)."""
    def spec(dtype: str, arch: str) -> Spec:
        from pagedserve.platforms.cuda.kernels import prefill_attention as pa

        block_m, block_n, warps, stages = pa._prefill_config(HEAD, _torch_dtype(dtype))
        consts = dict(GROUP=GROUP, GROUP_PAD=GROUP, HEAD_SIZE=HEAD, HEAD_PAD=HEAD,
                      BLOCK_SIZE=BLOCK_SIZE, BLOCK_M=block_m, BLOCK_N=block_n,
                      HAS_SCALES=False,
                      HAS_SEQ_IDS=True,  # a mixed step's form: the decode rows go elsewhere
                      DOT_PREC=pa.dot_precision(_torch_dtype(dtype), arch),
                      SLIDING=windowed, SOFTCAP=windowed)
        return Spec(pa._prefill_kernel, _attention_pointers(False), consts, warps, stages,
                    ("sm_scale", "softcap"))

    return spec


def _decode(fills: int, windowed: bool = False):
    def spec(dtype: str, arch: str) -> Spec:
        from pagedserve.platforms.cuda.kernels import decode_attention as da

        t = _torch_dtype(dtype)
        # The fp8 cache is NVIDIA's only (RocmPlatform refuses it): a 16-bit cache's tiles, for
        # a batch whose (sequence, kv head) pairs fill a 304-CU MI300X ``fills`` times (12: the
        # tile of four kv heads a program), or one pair.
        pairs = fills * 304 or 1
        block_n, warps, stages, heads = da._decode_config(HEAD, t, t, GROUP, 8, pairs, pairs,
                                                          304)
        consts = dict(GROUP=GROUP, GROUP_PAD=max(16, GROUP * heads), HEAD_SIZE=HEAD,
                      HEAD_PAD=HEAD, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=block_n, HEADS=heads,
                      SINGLE_PARTITION=False,
                      HAS_SCALES=False, DOT_PREC=da.dot_precision(t, arch), PTX=False,
                      SLIDING=windowed, SOFTCAP=windowed)
        return Spec(da._decode_partition_kernel, _attention_pointers(True), consts, warps,
                    stages, ("sm_scale", "softcap"))

    return spec


def _decode_reduce(dtype: str, arch: str) -> Spec:
    from pagedserve.platforms.cuda.kernels import decode_attention as da

    ptrs = {"out_ptr": "ACT", "part_out_ptr": "fp32", "part_lse_ptr": "fp32",
            "seq_lens_ptr": "i32", "v_scale_ptr": "i32"}
    consts = dict(HEAD_SIZE=HEAD, HEAD_PAD=HEAD, BLOCK_P=32, HAS_SCALES=False, SLIDING=False)
    return Spec(da._decode_reduce_kernel, ptrs, consts, 4)


def _reshape_and_cache(dtype: str, arch: str) -> Spec:
    from pagedserve.platforms.cuda.kernels import reshape_and_cache as rc

    ptrs = {"key_ptr": "ACT", "value_ptr": "ACT", "k_cache_ptr": "ACT", "v_cache_ptr": "ACT",
            "slot_mapping_ptr": "i64", "k_scale_ptr": "i64", "v_scale_ptr": "i64"}
    consts = dict(NUM_KV_HEADS=HIDDEN // HEAD // GROUP, HEAD_SIZE=HEAD, BLOCK_H=8,
                  HEAD_PAD=HEAD, BLOCK_SIZE=BLOCK_SIZE, HAS_SCALES=False)
    return Spec(rc._reshape_and_cache_kernel, ptrs, consts, 4)


def _fp8_out(arch: str) -> tuple[str, dict]:
    """The FP8 activation type RocmPlatform picks on ``arch`` (gfx94x: e4m3fnuz) and the
    constexprs of a kernel that writes it."""
    fnuz = arch.startswith("gfx94")
    return ("fp8e4b8" if fnuz else "fp8e4nv",
            dict(STATIC=False, FNUZ=fnuz, SOFTWARE_ROUNDING=False))


def _rms_norm(fp8_out: bool):
    def spec(dtype: str, arch: str) -> Spec:
        from pagedserve.platforms.cuda.kernels import rms_norm

        fp8, consts = _fp8_out(arch) if fp8_out else ("ACT", dict(
            STATIC=False, FNUZ=False, SOFTWARE_ROUNDING=False))
        ptrs = dict.fromkeys(("x_ptr", "residual_ptr", "weight_ptr"), "ACT")
        ptrs.update(out_ptr=fp8, scale_ptr="fp32")
        return Spec(rms_norm._rms_norm_kernel, ptrs,
                    dict(HAS_RESIDUAL=True, FP8_OUT=fp8_out, BLOCK=HIDDEN, **consts),
                    HIDDEN // 512, floats=("eps", "fmax", "min_scale"))
    return spec


def _rotary(dtype: str, arch: str) -> Spec:
    from pagedserve.platforms.cuda.kernels import rotary

    ptrs = {"positions_ptr": "i64", "q_ptr": "ACT", "k_ptr": "ACT", "cos_ptr": "fp32",
            "sin_ptr": "fp32"}
    heads = HIDDEN // HEAD
    consts = dict(NUM_Q_HEADS=heads, NUM_K_HEADS=heads // GROUP, Q_HEADS_PAD=heads,
                  K_HEADS_PAD=heads // GROUP, HALF=HEAD // 2, HALF_PAD=HEAD // 2)
    return Spec(rotary._rotary_kernel, ptrs, consts, 4)


def _activation(dtype: str, arch: str) -> Spec:
    from pagedserve.platforms.cuda.kernels import activation

    return Spec(activation._silu_and_mul_kernel, {"x_ptr": "ACT", "out_ptr": "ACT"},
                dict(BLOCK=activation._BLOCK), 4)


def _activation_fp8(dtype: str, arch: str) -> Spec:
    from pagedserve.platforms.cuda.kernels import activation

    fp8, consts = _fp8_out(arch)
    ptrs = {"x_ptr": "ACT", "q_ptr": fp8, "scale_ptr": "fp32"}
    # Llama-3-8B's 14,336 columns, a row held in registers, as silu_and_mul_fp8 launches it.
    block = 16384
    return Spec(activation._silu_and_mul_fp8_kernel, ptrs, dict(BLOCK=block, **consts),
                min(16, max(4, block // 512)), floats=("fmax", "min_scale"))


def _w4a16(m: int):
    def spec(dtype: str, arch: str) -> Spec:
        from pagedserve.platforms.cuda.kernels import w4a16

        cfg = w4a16._config_for(m, _torch_dtype(dtype), arch)
        scale = "fp16" if dtype != "fp32" else "fp32"
        ptrs = {"x_ptr": "ACT", "qw_ptr": "i32", "s_ptr": scale, "z_ptr": scale,
                "out_ptr": "ACT", "partial_ptr": "fp32", "counter_ptr": "i32"}
        consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_SLICES=8,
                      ZERO_POINT=scale == "fp16", SPLIT=m <= 16, EVEN_K=True,
                      BIAS=cfg.bias and dtype != "fp32", PREFETCH=cfg.prefetch,
                      SWAP_AB=cfg.swap_ab, SCALE_A=cfg.scale_a, PTX_DECODE=False)
        return Spec(w4a16._w4a16_kernel, ptrs, consts, cfg.num_warps, cfg.num_stages)
    return spec


def _w4a16_gemv(dtype: str, arch: str) -> Spec:
    from pagedserve.platforms.cuda.kernels import w4a16

    cfg = w4a16._gemv_config()
    ptrs = {"x_ptr": "ACT", "qw_ptr": "i32", "s_ptr": "fp16", "z_ptr": "fp16",
            "out_ptr": "ACT", "partial_ptr": "fp32", "counter_ptr": "i32"}
    # AMD decodes through the exponent (the packed PTX is NVIDIA's).
    consts = dict(ROWS=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ZERO_POINT=True,
                  SPLIT=True, EVEN=True, DECODE="exponent", PAIR_WORDS=False)
    return Spec(w4a16._w4a16_gemv_kernel, ptrs, consts, cfg.num_warps, 1)


def _w4a16_dequant(dtype: str, arch: str) -> Spec:
    from pagedserve.platforms.cuda.kernels import w4a16

    ptrs = {"qw_ptr": "i32", "s_ptr": "fp16", "z_ptr": "fp16", "out_ptr": "ACT"}
    return Spec(w4a16._dequant_kernel, ptrs,
                dict(BLOCK_KW=8, BLOCK_N=128, ZERO_POINT=True), 4)


def _fp8_gemv(dtype: str, arch: str) -> Spec:
    from pagedserve.platforms.cuda.kernels import fp8_gemv

    cfg = fp8_gemv._config(1)
    # W8A8's GEMV reads FP8 on gfx94x/gfx95x; elsewhere the weight-only path reads the bits.
    fp8 = ("fp8e4b8" if arch.startswith("gfx94") else "fp8e4nv"
           if arch.startswith("gfx95") else "u8")
    ptrs = {"x_ptr": "ACT", "w_ptr": fp8, "scale_ptr": "fp32", "out_ptr": "ACT"}
    return Spec(fp8_gemv._fp8_gemv_kernel, ptrs,
                dict(PER_TENSOR=False, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k),
                cfg.num_warps, cfg.num_stages)


def _fp8_dequant(dtype: str, arch: str) -> Spec:
    from pagedserve.platforms.cuda.kernels import fp8_gemv

    ptrs = {"w_ptr": "u8", "scale_ptr": "fp32", "out_ptr": "ACT"}
    return Spec(fp8_gemv._fp8_dequant_kernel, ptrs,
                dict(PER_TENSOR=False, BLOCK_N=16, BLOCK_K=256), 4)


def _fp8_quant(dtype: str, arch: str) -> Spec:
    from pagedserve.platforms.cuda.kernels import fp8_quant

    fp8, consts = _fp8_out(arch)
    ptrs = {"x_ptr": "ACT", "q_ptr": fp8, "scale_ptr": "fp32"}
    return Spec(fp8_quant._fp8_quant_kernel, ptrs, dict(BLOCK=fp8_quant._BLOCK, **consts), 4,
                floats=("fmax", "min_scale"))


def _fused_moe(rows_per_expert: int, scales: str = "none", int_bits: int = 0,
               group: int = 128):
    """``scales``: "none" (16-bit experts), "row" or "block" (FP8 experts, W8A16; 128 x 128
    blocks as Qwen3-30B-A3B-FP8's). ``int_bits`` 4 or 8: integer experts (W4A16, W8A16) with
    zero points, "block" their groups of ``group`` columns, "row" one group a row."""
    def spec(dtype: str, arch: str) -> Spec:
        from pagedserve.platforms.cuda.kernels import fused_moe
        from pagedserve.platforms.cuda.kernels.prefill_attention import dot_precision

        t = _torch_dtype(dtype)
        cfg = fused_moe.moe_config(rows_per_expert, t, arch)
        # FP8 experts as the launch passes them: e4m3fn where Triton converts it, else bits.
        weight = "ACT" if scales == "none" else "fp8e4nv" if arch.startswith("gfx95") else "u8"
        scale = "fp32" if scales != "none" else "ACT"
        ptrs = {"a_ptr": "ACT", "w_ptr": "u8" if int_bits else weight, "c_ptr": "ACT",
                "route_ptr": "fp32", "sorted_ids_ptr": "i32", "block_experts_ptr": "i64",
                "total_ptr": "i64", "scale_ptr": scale, "zero_ptr": "u8" if int_bits else scale}
        block = (1, group) if int_bits else (128, 128) if scales == "block" else (1, 1)
        # The down projection's form (it multiplies the routing weights in).
        consts = dict(ROUTE_WEIGHT=True, EVEN_K=True, DOT_PREC=dot_precision(t, arch),
                      SCALES=scales, SCALE_ROWS=block[0], SCALE_COLS=block[1],
                      INT_BITS=int_bits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=min(cfg.block_k, block[1] if scales == "block" else 128),
                      GROUP_M=cfg.group_m)
        return Spec(fused_moe._expert_gemm_kernel, ptrs, consts, cfg.num_warps, cfg.num_stages)
    return spec


KERNELS = {
    "prefill_attention": _prefill(), "decode_attention": _decode(0),
    # A Gemma 2 local layer's: a sliding window and capped scores.
    "prefill_attention_window": _prefill(windowed=True),
    "decode_attention_window": _decode(0, windowed=True),
    "decode_attention_large_batch": _decode(3), "decode_attention_packed_heads": _decode(12),
    "decode_reduce": _decode_reduce, "reshape_and_cache": _reshape_and_cache,
    "rms_norm": _rms_norm(False), "rotary": _rotary, "silu_and_mul": _activation,
    "silu_and_mul_fp8": _activation_fp8,
    "w4a16_gemv": _w4a16_gemv, "w4a16_m16": _w4a16(16), "w4a16_m64": _w4a16(64),
    "w4a16_m256": _w4a16(256), "w4a16_m1024": _w4a16(1024), "w4a16_dequant": _w4a16_dequant,
    "fp8_quant": _fp8_quant, "rms_norm_fp8": _rms_norm(True), "fp8_gemv": _fp8_gemv,
    "fp8_dequant": _fp8_dequant,
    # A decode step's tiles (2 rows an expert) and a prefill step's (1,024).
    "fused_moe_decode": _fused_moe(2), "fused_moe_prefill": _fused_moe(1024),
    # FP8 experts (W8A16): scales per row at decode, 128 x 128 blocks at decode and prefill.
    "fused_moe_fp8_rows_decode": _fused_moe(2, "row"),
    "fused_moe_fp8_block_decode": _fused_moe(2, "block"),
    "fused_moe_fp8_block_prefill": _fused_moe(1024, "block"),
    # Integer experts: AWQ/GPTQ 4-bit in groups of 128 at decode and prefill and of 32 at
    # decode (K tiles of 32), GPTQ 8-bit one group a row at decode.
    "fused_moe_int4_g128_decode": _fused_moe(2, "block", 4),
    "fused_moe_int4_g128_prefill": _fused_moe(1024, "block", 4),
    "fused_moe_int4_g32_decode": _fused_moe(2, "block", 4, 32),
    "fused_moe_int8_rows_decode": _fused_moe(2, "row", 8),
}
# The CI subset leaves out the middle W4A16 configurations (m16 and m1024 bracket them).
NOT_IN_SUBSET = ("w4a16_m64", "w4a16_m256")
# RocmPlatform runs W8A8 FP8 matmuls (and so quantizes activations to FP8) only on
# gfx94x/gfx95x; FP8 weights run weight-only (the fp8_gemv and fp8_dequant kernels) elsewhere.
ONLY_ON = dict.fromkeys(("fp8_quant", "rms_norm_fp8", "silu_and_mul_fp8"), ("gfx94", "gfx95"))


def applies(case: Case) -> bool:
    return case.target.startswith(ONLY_ON.get(case.kernel, ("gfx",)))


def compile_spec(spec: Spec, dtype: str, target, pdl: bool = False):
    """``spec``'s kernel compiled for ``target`` (a Triton ``GPUTarget``) with ``dtype``
    activations; ``pdl``: its programmatic-dependent-launch constant (``kernels/pdl.py``,
    NVIDIA's only)."""
    import triton
    from triton.compiler import ASTSource

    fn = spec.fn
    constexprs = {**spec.constexprs, "PDL": pdl}
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in spec.pointers:
            sig[name] = "*" + spec.pointers[name].replace("ACT", dtype)
        else:
            sig[name] = "fp32" if name in spec.floats else "i32"
    consts = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    return triton.compile(ASTSource(fn, sig, consts), target=target,
                          options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})


def compile_case(case: Case) -> Result:
    from triton.backends.compiler import GPUTarget

    start = time.perf_counter()
    warp_size, lds = TARGETS[case.target]
    try:
        spec = KERNELS[case.kernel](case.dtype, case.target)
        kernel = compile_spec(spec, case.dtype, GPUTarget("hip", case.target, warp_size))
        shared = kernel.metadata.shared
        error = None if shared <= lds else f"{shared} bytes of LDS, the target has {lds}"
    except Exception as exc:  # a compile error is a result here, not a crash
        shared, error = None, _one_line(exc)
    return Result(*case, error is None, shared, round(time.perf_counter() - start, 3), error)


def _one_line(exc: BaseException) -> str:
    """A compile error's cause in one line (Triton's own message ends with a source excerpt)."""
    cause = exc.__cause__ or exc
    lines = [ln for ln in str(cause).splitlines() if ln.strip().strip("^")]
    return f"{type(cause).__name__}: {lines[-1].strip() if lines else ''}"[:300]


def cases(subset: bool) -> list[Case]:
    """The full sweep, or the CI subset: each kernel once, in fp16 or bf16 by turns and on the
    four targets by turns, so every target and both dtypes are compiled; half the cases of one
    kernel in each dtype, for a test suite's time (the full sweep takes every pairing)."""
    if not subset:
        every = [Case(k, d, t) for k in KERNELS for d in DTYPES for t in TARGETS]
        return [c for c in every if applies(c)]
    targets, picked = list(TARGETS), []
    for i, kernel in enumerate(k for k in KERNELS if k not in NOT_IN_SUBSET):
        dtype = ("fp16", "bf16")[i % 2]
        options = [t for t in targets if applies(Case(kernel, dtype, t))]
        picked.append(Case(kernel, dtype, options[(i // 2) % len(options)]))
    return picked


def print_table(results: list[Result]) -> None:
    print(f"{'kernel':<20} {'dtype':<5} {'target':<8} {'result':<7} {'shared':>7} {'s':>6}")
    for r in results:
        shared = "-" if r.shared_bytes is None else str(r.shared_bytes)
        print(f"{r.kernel:<20} {r.dtype:<5} {r.target:<8} {'ok' if r.ok else 'FAILED':<7} "
              f"{shared:>7} {r.seconds:>6.2f}" + (f"  {r.error}" if r.error else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subset", action="store_true", help="the CI subset only")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON results (default: {OUT} for the full sweep, none for "
                             "the subset)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    # A fresh cache, so every case really compiles and the times mean something; removed
    # after, as each `make test` runs the subset.
    with tempfile.TemporaryDirectory(prefix="amd-sweep-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        start = time.perf_counter()
        results = [compile_case(c) for c in cases(args.subset)]
        total = time.perf_counter() - start
    print_table(results)
    failed = sum(not r.ok for r in results)
    print(f"{len(results) - failed} compiled, {failed} failed, {total:.1f} s")
    out = args.out or (None if args.subset else OUT)
    if out is not None:
        import triton

        out.write_text(json.dumps({
            "triton": triton.__version__, "targets": {t: {"warp_size": w, "lds_bytes": b}
                                                      for t, (w, b) in TARGETS.items()},
            "compiled": len(results) - failed, "failed": failed,
            "seconds": round(total, 1), "results": [r._asdict() for r in results],
        }, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
