"""Compile the W4A16 kernels' variants for sm_90 on the CPU and read their main loop's SASS.

No GPU is needed: ``triton.compile`` with a ``cuda`` target runs the whole pipeline with the
bundled ``ptxas``, and ``nvdisasm`` lists the cubin. Each variant is compiled as the launch at
the Llama-3-8B shapes would specialize it (pointers and N, K, strides, the slice of K and the
group size divisible by 16; M not specialized). The K loop is the kernel's largest loop that
ends in a backward branch; per iteration (one packed tile of 128 columns for the tiles, one
block of K for the GEMV) the script counts the instructions a warp issues, the global loads
copied ahead by the pipeliner (``LDGSTS``, cp.async) and the plain ones (``LDG``), the
shared-memory traffic and the tensor-core instructions. ``weights_per_sm_cycle`` is what the
loop could reach if issue were the only limit (four schedulers each issuing one instruction
a cycle), to set against the ~32 4-bit weights per SM cycle that the H200's copy rate brings
(4.2 TB/s over 132 SMs at 1.98 GHz).

    python scripts/w4a16_sass.py [--out FILE.json]   # every variant, a table
    python scripts/w4a16_sass.py --check             # what launches use, compiled (CPU suite)
    python scripts/w4a16_sass.py --wgmma [--out FILE.json]  # csrc/w4a16_wgmma.cu (nvcc)

``--wgmma`` builds the CUDA C++ Hopper kernel for sm_90a with the machine's ``nvcc`` (as the
engine would) and reads each instantiation's loop over the packed tiles the same way: one
iteration is a tile of 128 columns for the block's 128 features and all of its rows of x,
so ``weights_per_sm_cycle`` is not comparable with the Triton rows; ``mma_cycles`` is the
tensor-core time of the iteration's wgmmas at the dense bf16 rate (1,024 multiply-adds of
x's type per SM cycle, each m64nNk16 taking N / 2 cycles), to set against ``issue_cycles``.

Run with ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POINTERS = {"x_ptr": "ACT", "qw_ptr": "i32", "s_ptr": "SCALE", "z_ptr": "SCALE",
            "out_ptr": "ACT", "partial_ptr": "fp32", "counter_ptr": "i32"}
# Integer arguments that the launch at the 8B shapes finds divisible by 16 (Triton's
# specialization); the others (M, the split count) are plain i32.
DIVISIBLE = {"N", "K", "K_PAD", "group_size", "k_per_split", "stride_xm", "stride_om"}
SMEM_LIMIT = 227 * 1024
COUNTED = ("LDGSTS", "LDG", "LDS", "LDSM", "STS", "HMMA", "HGMMA", "HGMMA_A_REGS", "BAR",
           "PRMT", "LOP3", "HFMA2", "F2FP")


class Variant(NamedTuple):
    name: str
    kernel: str  # "tiles" or "gemv"
    act: str  # activation dtype: bf16, fp16, fp32
    scale: str  # fp16 (zero points) or fp32 (offsets)
    consts: dict
    num_warps: int
    num_stages: int
    k_per_iteration: int  # columns of K one loop iteration covers
    base: bool = False  # the --base file's kernel (its constexprs are those it takes)


def tile_variant(name: str, cfg, act: str = "bf16", scale: str = "fp16", slices: int = 8,
                 split: bool = True) -> Variant:
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_SLICES=slices,
                  ZERO_POINT=scale == "fp16", SPLIT=split, EVEN_K=True,
                  BIAS=cfg.bias and act != "fp32", PREFETCH=cfg.prefetch and slices == 8,
                  SWAP_AB=cfg.swap_ab, SCALE_A=cfg.scale_a,
                  PTX_DECODE=cfg.ptx_decode and act != "fp32")
    return Variant(name, "tiles", act, scale, consts, cfg.num_warps, cfg.num_stages, 128)


def gemv_variant(name: str, cfg, rows: int = 1, act: str = "bf16", scale: str = "fp16",
                 decode: str = "pairs", even: bool = True, split: bool = True) -> Variant:
    consts = dict(ROWS=rows, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  ZERO_POINT=scale == "fp16", SPLIT=split, EVEN=even, DECODE=decode,
                  PAIR_WORDS=rows >= cfg.pair_words_from and decode == "pairs")
    return Variant(name, "gemv", act, scale, consts, cfg.num_warps, 1, cfg.block_k)


def base_variants() -> list[Variant]:
    """The kernel of 2cbeaf3 (before the K-strided layout) at its M = 1 and M <= 16 settings,
    given as ``--base``."""
    gemv = dict(ROWS=1, BLOCK_N=256, BLOCK_K=64, ZERO_POINT=True, SPLIT=True, EVEN=True,
                DECODE="pairs")
    tiles = dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=128, ONE_GROUP_PER_BLOCK=True,
                 ZERO_POINT=True, SPLIT=True)
    return [Variant("base gemv 1 row", "gemv", "bf16", "fp16", gemv, 2, 1, 64, True),
            Variant("base tiles 16x256", "tiles", "bf16", "fp16", tiles, 4, 3, 128, True)]


def variants() -> list[Variant]:
    """The variants the H200 sweep times (``bench_w4a16.py --sweep-tiles``), each compiled."""
    from pagedserve.platforms.cuda.kernels import w4a16

    tile = w4a16._TileConfig(16, 128, 4, 3, 4, True)
    out = [tile_variant(f"tiles 16x128 bias={b:d} prefetch={p:d}",
                        tile._replace(bias=b, prefetch=p)) for b in (True, False)
           for p in (False, True)]
    big = w4a16._TileConfig(64, 128, 4, 3, 2, True)
    out += [tile_variant(f"tiles 64x128 bias={b:d} prefetch={p:d}",
                         big._replace(bias=b, prefetch=p), split=False)
            for b in (True, False) for p in (False, True)]
    # The transposed tiles (wgmma with the decoded weights in registers), two accumulators or
    # the scales on the weights (scale_a), the codes by _slice_ptx or not, and the
    # dequantize range's tile before them.
    out += [tile_variant(f"tiles {m}x{n}x{w}w swap={sw:d} scale_a={sa:d} ptx={ptx:d}",
                         w4a16._TileConfig(m, n, w, 3, 2, False, m < 128 or sw, sw, sa, ptx),
                         split=False)
            for m, n, w, sw, sa, ptx in [
                (64, 128, 4, False, False, True), (64, 128, 4, True, False, False),
                (64, 128, 4, True, False, True), (64, 128, 4, True, True, False),
                (64, 128, 4, True, True, True), (64, 256, 8, True, True, True),
                (64, 128, 8, True, True, True), (128, 128, 4, True, True, False),
                (128, 128, 4, True, True, True), (128, 256, 8, True, True, False),
                (128, 256, 8, True, True, True), (128, 128, 8, False, False, False),
                (128, 128, 8, False, False, True)]]
    gemv = w4a16._gemv_config()
    out += [gemv_variant(f"gemv {rows} row{'s' * (rows > 1)} pair_words={pw:d}",
                         gemv._replace(pair_words_from=1 if pw else 3), rows=rows)
            for rows in (1, 2) for pw in (False, True)]
    return out


def check_variants() -> list[Variant]:
    """What the launches can ask for, compiled only (what only the real compiler rejects):
    each tile configuration of ``_TILE_CONFIGS`` and the GEMV's, with the dtypes, offsets,
    groups per slice, masks and flags the launches use. The sweep's other tile shapes
    (``variants``) compile where the sweep runs."""
    from pagedserve.platforms.cuda.kernels import w4a16

    tiles = [("bf16", "fp16", 1, 2), ("bf16", "fp32", 30, 2), ("fp16", "fp32", 40, 1),
             ("fp16", "fp16", 100, 1), ("bf16", "fp16", 200, 8), ("fp32", "fp32", 1000, 4),
             ("fp16", "fp16", 16, 8)]
    missed = ({cfg for _, cfg in w4a16._TILE_CONFIGS}
              - {w4a16._config(m) for _, _, m, _ in tiles})
    assert not missed, f"no M of the check takes {missed}"
    out = [tile_variant(f"tiles m{m} {act} {scale} slices {slices}",
                        w4a16._config(m)._replace(prefetch=True), act, scale, slices,
                        split=m <= 16)
           for act, scale, m, slices in tiles]
    swapped = w4a16._TileConfig(64, 128, 4, 3, 2, False, False, True)
    out += [tile_variant(f"tiles swap {act} {scale} slices {slices} bias={b:d} scale_a={sa:d} "
                         f"ptx={ptx:d}", swapped._replace(bias=b, scale_a=sa, ptx_decode=ptx),
                         act, scale, slices, split=split)
            for act, scale, slices, b, sa, ptx, split in [
                ("bf16", "fp32", 8, False, True, True, True),
                ("fp16", "fp16", 1, False, True, True, False),
                ("fp16", "fp32", 2, True, False, True, True),
                ("bf16", "fp16", 2, True, False, False, True),
                ("fp32", "fp32", 4, False, True, False, False),
                ("fp32", "fp16", 8, False, False, True, True)]]
    gemv = w4a16._gemv_config()
    out += [gemv_variant(f"gemv {rows} {act} {scale} {decode} even={even:d} pw={pw:d}",
                         gemv._replace(pair_words_from=1 if pw else 3), rows, act, scale,
                         decode, even)
            for act, scale, rows, even, decode, pw in [
                ("bf16", "fp32", 2, False, "pairs", True),
                ("bf16", "fp32", 1, False, "pairs", True),
                ("bf16", "fp32", 2, False, "pairs", False),
                ("fp16", "fp32", 1, False, "subnormal", False),
                ("fp16", "fp16", 1, True, "exponent", False)]]
    return out


def compile_variant(v: Variant, base=None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedserve.platforms.cuda.kernels import w4a16

    module = base if v.base else w4a16
    fn = module._w4a16_kernel if v.kernel == "tiles" else module._w4a16_gemv_kernel
    # As the H200 launches them (kernels/pdl.py); a --base kernel may predate the constant.
    consts = {**v.consts, "PDL": True} if "PDL" in fn.arg_names else v.consts
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        kind = POINTERS.get(name)
        if name in consts:
            signature[name] = "constexpr"
        elif kind is not None:
            signature[name] = "*" + kind.replace("ACT", v.act).replace("SCALE", v.scale)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name in DIVISIBLE:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, consts, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": v.num_warps, "num_stages": v.num_stages})
    if kernel.metadata.shared > SMEM_LIMIT:
        raise ValueError(f"{v.name}: {kernel.metadata.shared} bytes of shared memory")
    return kernel


def _cubin_tool(kernel, tool: str, *flags: str) -> str:
    """The output of Triton's bundled ``tool`` (nvdisasm, cuobjdump) on the kernel's cubin."""
    import triton

    path = Path(triton.__file__).parent / "backends/nvidia/bin" / tool
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(path), *flags, f.name], capture_output=True, text=True,
                              check=True).stdout


def sass(kernel) -> str:
    return _cubin_tool(kernel, "nvdisasm", "-c")


def resources(kernel) -> dict:
    """Registers per thread and spill stack bytes (``cuobjdump -res-usage``)."""
    text = _cubin_tool(kernel, "cuobjdump", "-res-usage")
    found = dict(re.findall(r"(REG|STACK):(\d+)", text))
    return {"registers": int(found.get("REG", 0)), "stack": int(found.get("STACK", 0))}


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^\.(L_x_\d+):", re.M)


def main_loop(text: str) -> list[tuple[str, str]]:
    """The (opcode, operands) of the largest loop: from a label to the last backward branch to
    it."""
    addresses, opcodes, operands = [], [], []
    labels = {}
    for line in text.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(opcodes)
            continue
        m = _INSTRUCTION.search(line)
        if m:
            addresses.append(int(m.group(1), 16))
            opcodes.append(m.group(3))
            operands.append(m.group(4))
    best = (0, 0)
    for i, (op, args) in enumerate(zip(opcodes, operands)):
        target = re.search(r"`\(\.(L_x_\d+)\)", args)
        if op.startswith("BRA") and target and labels.get(target.group(1), i + 1) <= i:
            start = labels[target.group(1)]
            if i + 1 - start > best[1] - best[0]:
                best = (start, i + 1)
    return list(zip(opcodes, operands))[best[0]:best[1]]


def summarize(v: Variant, kernel) -> dict:
    loop = main_loop(sass(kernel))
    counts = Counter()
    for op, args in loop:
        base = op.split(".")[0]
        if base in COUNTED:
            counts[base] += 1
        # wgmma's A operand from registers: "HGMMA.64x64x16.F32.BF16 Rd, Ra, gdesc[..]" (from
        # shared memory: "Rd, gdesc[..], .."); the opcode's match ends at the shape's "x".
        if base == "HGMMA" and re.match(r"\S*\s+R\d+, R\d+,", args):
            counts["HGMMA_A_REGS"] += 1
    weights = v.consts["BLOCK_N"] * v.k_per_iteration
    # Issue-bound: the warps' instructions spread over the SM's four schedulers.
    per_cycle = weights / (len(loop) * v.num_warps / 4) if loop else float("nan")
    return {"name": v.name, "instructions_per_iteration": len(loop),
            "k_per_iteration": v.k_per_iteration, "num_warps": v.num_warps,
            "weights_per_sm_cycle": per_cycle, "shared_bytes": kernel.metadata.shared,
            **resources(kernel), **{k: counts[k] for k in COUNTED}}


_WGMMA_KERNEL = re.compile(r"wgmma_kernelILb([01])ELi(\d+)ELi(\d)ELi(\d)E")


def wgmma_rows() -> list[dict]:
    """Each instantiation of ``csrc/w4a16_wgmma.cu`` (sweep build): its tile loop's counts,
    registers and stack, from the library's cubin."""
    import os

    import triton

    from pagedserve.platforms.cuda.kernels import w4a16_wgmma

    tools = Path(triton.__file__).parent / "backends/nvidia/bin"

    def run(*cmd: str, cwd: str | None = None) -> str:
        return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=cwd).stdout

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PAGEDSERVE_CACHE_DIR"] = tmp
        lib = w4a16_wgmma.library(sweep=True)
        if lib is None:
            sys.exit("csrc/w4a16_wgmma.cu does not build here (no nvcc?)")
        found = re.findall(r"Function (\S+):\s+REG:(\d+) STACK:(\d+)",
                           run(str(tools / "cuobjdump"), "-res-usage", lib._name))
        usage = {f: (int(r), int(st)) for f, r, st in found}
        run(str(tools / "cuobjdump"), "-xelf", "all", lib._name, cwd=tmp)
        text = "".join(run(str(tools / "nvdisasm"), "-c", str(c))
                       for c in sorted(Path(tmp).glob("*.cubin")))
    rows = []
    for name, body in re.findall(r"\n\.text\.(\S+):\n(.*?)(?=\n\s*\.section|\Z)", text, re.S):
        m = _WGMMA_KERNEL.search(name)
        if not m:
            continue
        bf16, rows_x, gp, stages = (int(g) for g in m.groups())
        loop = main_loop(body)
        counts = Counter(op.split(".")[0] for op, _ in loop)
        registers, stack = usage[name]
        rows.append({"name": f"wgmma {'bf16' if bf16 else 'fp16'} {rows_x} rows, "
                             f"{4 // gp} groups/tile, {stages} stages",
                     "instructions_per_iteration": len(loop), "num_warps": 8,
                     "issue_cycles": len(loop) * 8 / 4, "mma_cycles": 2 * 8 * rows_x / 2,
                     "registers": registers, "stack": stack,
                     **{k: counts[k] for k in COUNTED if k != "HGMMA_A_REGS"},
                     "HGMMA_A_REGS": sum(1 for op, args in loop if op.startswith("HGMMA")
                                         and re.match(r"\S*\s+R\d+, R\d+,", args))})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="compile what the launches use, count nothing")
    p.add_argument("--wgmma", action="store_true",
                   help="read csrc/w4a16_wgmma.cu's instantiations instead (built by nvcc)")
    p.add_argument("--out", help="JSON of the table")
    p.add_argument("--base", help="an earlier kernels/w4a16.py (2cbeaf3's) to read beside")
    args = p.parse_args()
    if args.check:
        for v in check_variants():
            compile_variant(v)
        print("compiled")
        return
    if args.wgmma:
        rows = wgmma_rows()
        print(f"{'instantiation':<46} {'instr':>6} {'issue':>6} {'mma':>6} {'regs':>5} "
              f"{'stack':>5} " + " ".join(f"{k[:6]:>6}" for k in COUNTED))
        for r in rows:
            print(f"{r['name']:<46} {r['instructions_per_iteration']:>6} "
                  f"{r['issue_cycles']:>6.0f} {r['mma_cycles']:>6.0f} {r['registers']:>5} "
                  f"{r['stack']:>5} " + " ".join(f"{r[k]:>6}" for k in COUNTED))
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
        return
    rows = []
    print(f"{'variant':<44} {'instr':>6} {'w/cyc':>6} {'regs':>5} {'stack':>5} "
          + " ".join(f"{k[:6]:>6}" for k in COUNTED))
    base = None
    if args.base:
        from scripts.bench_w4a16 import load_base

        base = load_base(args.base)
    for v in (base_variants() if base else []) + variants():
        r = summarize(v, compile_variant(v, base))
        rows.append(r)
        print(f"{r['name']:<44} {r['instructions_per_iteration']:>6} "
              f"{r['weights_per_sm_cycle']:>6.1f} {r['registers']:>5} {r['stack']:>5} "
              + " ".join(f"{r[k]:>6}" for k in COUNTED), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
