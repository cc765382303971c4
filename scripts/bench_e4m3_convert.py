"""Where the fp8-cache decode kernel's time goes: the e4m3 -> fp16 widening timed against
integer arithmetic that does the same, and against no widening at all (timing only).

Each variant is ``decode_attention.py`` with its ``split_e4m3_pairs`` calls replaced:

- ``cvt``: the module as it is (``prmt`` + ``cvt.rn.f16x2.e4m3x2``, the conversion pipe).
- ``int``: the byte's bits placed where fp16 keeps them by ``and``/``add``/``shift``/``sub``
  (the integer pipe); the value comes out 2**-8 times too small, which the variant folds into
  ``qk_scale`` and the output's scale, so its output should equal ``cvt``'s.
- ``int_v``: ``cvt`` for the keys, ``int`` for the values (both pipes busy).
- ``skip_v`` / ``skip``: the words bit-cast to fp16 with no widening of the values / of either
  (wrong outputs; the time a free conversion would leave).

    python scripts/bench_e4m3_convert.py --out benchmarks/results/issue30/e4m3_convert_h200.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_attention import Setup, _context_lens, _shape, _shape_name, time_decode  # noqa: E402

SOURCE = (Path(__file__).resolve().parents[1]
          / "pagedserve/platforms/cuda/kernels/decode_attention.py")

PRELUDE = '''
_INT_PTX = tl.constexpr("""{
    .reg .b32 u, s;
    and.b32 u, $2, 0x00FF00FF;
    and.b32 s, $2, 0x00800080;
    add.u32 u, u, s;
    shl.b32 $0, u, 7;
    and.b32 u, $2, 0xFF00FF00;
    and.b32 s, $2, 0x7F007F00;
    shr.u32 s, s, 1;
    sub.u32 $1, u, s;
}""")


@triton.jit
def _split_int(words, PTX: tl.constexpr):
    return tl.inline_asm_elementwise(_INT_PTX, "=r,=r,r", [words],
                                     dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _split_skip(words, PTX: tl.constexpr):
    half = words.to(tl.float16, bitcast=True)
    return half, half
'''

VARIANTS = {"cvt": ("split_e4m3_pairs", "split_e4m3_pairs"),
            "int": ("_split_int", "_split_int"),
            "int_v": ("split_e4m3_pairs", "_split_int"),
            "skip_v": ("split_e4m3_pairs", "_split_skip"),
            "skip": ("_split_skip", "_split_skip"),
            "v_early": ("split_e4m3_pairs", "split_e4m3_pairs")}


def variant_source(name: str) -> str:
    k_fn, v_fn = VARIANTS[name]
    text = SOURCE.read_text()
    anchor = "# Shortest partition the heuristic picks"
    text = text.replace(anchor, PRELUDE + "\n\n" + anchor, 1)
    for old, new in (("split_e4m3_pairs(k_words, PTX)", f"{k_fn}(k_words, PTX)"),
                     ("split_e4m3_pairs(v_words, PTX)", f"{v_fn}(v_words, PTX)")):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    if k_fn == "_split_int":
        old = "qk_scale = qk_scale * tl.load(k_scale_ptr)"
        assert text.count(old) == 1
        text = text.replace(old, old + " * 256.0")
    if name == "v_early":  # the values' loads and widening before the keys' dot
        start = text.index("    s = (tl.dot(q_even, k_even)")
        v_start = text.index("    if MASKED:\n        v_words")
        v_end = text.index("    p = p.to(tl.float16)")
        text = text[:start] + text[v_start:v_end] + text[start:v_start] + text[v_end:]
    if v_fn == "_split_int":
        old = "out = out * tl.load(v_scale_ptr)"
        assert text.count(old) == 2
        text = text.replace(old, old + " * 256.0")
    return text


def load_variant(name: str, folder: Path):
    path = folder / f"decode_attention_{name}.py"
    path.write_text(variant_source(name))
    spec = importlib.util.spec_from_file_location(f"decode_attention_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", type=_shape,
                   default=[_shape(s) for s in ("1000x129-256", "1024x256", "256x2048")])
    p.add_argument("--grid-len", type=int, default=8192)
    p.add_argument("--tiles", nargs="+", default=["default", "64,2,3", "128,2,3"])
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    setup = Setup(argparse.Namespace(num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                                     dtype="bf16", kv_cache_dtype="fp8"))
    folder = Path(tempfile.mkdtemp())
    modules = {name: load_variant(name, folder) for name in VARIANTS}

    # The integer widening must give the conversion's output (the 2**-8 folds are exact).
    batch, ctx = 64, (129, 700)
    cache, tables, lens = setup.paged(_context_lens(batch, ctx))
    q = torch.randn(batch, setup.h, setup.d, device="cuda", dtype=setup.dtype)
    outs = {name: m.decode_attention(q, cache[0], cache[1], tables, lens, setup.scale, 8192,
                                     setup.k_scale, setup.v_scale)
            for name, m in modules.items() if not name.startswith("skip")}
    exact = {name: float((o.float() - outs["cvt"].float()).abs().max()) for name, o in outs.items()}
    print("max |variant - cvt|:", exact)

    rows = []
    for batch, ctx in args.shapes:
        nbytes = setup.kv_bytes(sum(_context_lens(batch, ctx)))
        for tile in args.tiles:
            kwargs = {}
            if tile != "default":
                kwargs["config"] = modules["cvt"].DecodeConfig(*map(int, tile.split(",")))
            cells = {}
            for name, m in modules.items():
                if "config" in kwargs:
                    kwargs["config"] = m.DecodeConfig(*kwargs["config"])
                ms = time_decode(setup, batch, ctx, m.decode_attention, args.grid_len,
                                 **kwargs)[0]
                cells[name] = ms
                rows.append({"shape": _shape_name(batch, ctx), "tile": tile, "variant": name,
                             "us": ms * 1000, "gbs": nbytes / ms / 1e6})
            print(f"{_shape_name(batch, ctx):>14} {tile:>8} " + " ".join(
                f"{n} {cells[n] * 1000:7.1f} us ({nbytes / cells[n] / 1e6:5.0f} GB/s)"
                for n in VARIANTS), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "max_abs_diff_vs_cvt": exact, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
