"""Check, on the CPU, that every kernel launched with programmatic dependent launch waits for
the kernel before it before it touches global memory that a kernel may write.

``platforms/cuda/kernels/pdl.py`` (Triton) and ``csrc/pdl.h`` (CUDA C++) launch a step's
kernels so that they may start while the previous kernel still runs; that is exact only if
nothing of theirs reads or writes such memory before ``griddepcontrol.wait``. Each Triton
kernel is compiled for sm_90 as the H200 runs it (``PDL=True``; the shapes and settings of
``amd_compile_sweep.py``'s cases, which list every kernel of ours), each CUDA C++ kernel by
the machine's ``nvcc`` to PTX for sm_90a (skipped without one), and the PTX is read: the
first global load, store, atomic or async copy must come after the wait, but for the few-rows
W4A16 kernel's weight copies (``cp.async``), and the kernel must release its dependents. The
checker itself is checked on a kernel that loads before its gate, which it must refuse.

    python scripts/pdl_check.py            # a line per kernel
    python scripts/pdl_check.py --check    # the same, for the CPU test suite: exit 1 on a miss

No GPU is needed; run with ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pagedserve.platforms.cuda.kernels.pdl import gate  # noqa: E402
from scripts.amd_compile_sweep import KERNELS, Spec, compile_spec  # noqa: E402

# A PTX instruction that reaches global memory (generic addressing included); kernel
# parameters, shared and local memory are not.
_MEMORY = re.compile(r"^\s*(@!?%p\d+\s+)?(ld|st|atom|red|cp\.async|prefetch)"
                     r"(?!\.param|\.shared\b|\.shared::cta|\.local|\.const)[.\s]")


# CUDA C++ kernels that may copy something before their gate: the weights, which no kernel
# writes, by cp.async (the copies' sources are checked by reading the kernel, not here).
_EARLY_COPIES = {"few_rows_kernel": re.compile(r"^\s*(@!?%p\d+\s+)?cp\.async\.")}


def ptx_problem(ptx: str, allowed: re.Pattern | None = None) -> str | None:
    """Why ``ptx`` (one kernel) is not safe to launch with PDL, or None; ``allowed``: the
    memory instructions it may run before the wait."""
    lines = ptx.splitlines()
    wait = next((i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln), None)
    if wait is None:
        return "no griddepcontrol.wait"
    if not any("griddepcontrol.launch_dependents" in ln for ln in lines):
        return "no griddepcontrol.launch_dependents"
    early = next((ln.strip() for ln in lines[:wait] if _MEMORY.match(ln)
                  and not (allowed and allowed.match(ln))), None)
    return None if early is None else f"global memory before the wait: {early}"


def compile_ptx(spec: Spec) -> str:
    """``spec``'s kernel as the H200 runs it: sm_90, bfloat16, ``PDL=True``."""
    from triton.backends.compiler import GPUTarget

    return compile_spec(spec, "bf16", GPUTarget("cuda", 90, 32), pdl=True).asm["ptx"]


@triton.jit
def _early_load(x_ptr, out_ptr, PDL: tl.constexpr):
    """Reads its input before its gate: the checker must refuse it."""
    x = tl.load(x_ptr + tl.arange(0, 128))
    gate(PDL)
    tl.store(out_ptr + tl.arange(0, 128), x)


def cuda_kernels_ptx() -> dict[str, str] | None:
    """Each CUDA C++ W4A16 kernel's PTX for sm_90a by its (mangled) name, as the engine
    builds them (the benchmarks' sweep builds more instantiations of the same templates, at
    three times the compile time); None without ``nvcc``."""
    import shutil
    import subprocess
    import tempfile

    from pagedserve.platforms.cuda import native_build
    from pagedserve.platforms.cuda.kernels import w4a16_mma, w4a16_wgmma

    if shutil.which(native_build.nvcc()) is None:
        return None
    kernels = {}
    for source in (w4a16_mma.SOURCE, w4a16_wgmma.SOURCE):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "kernels.ptx"
            subprocess.run([native_build.nvcc(), "-ptx", "-O3", "-std=c++17",
                            "-arch=compute_90a", str(source), "-o", str(out)],
                           check=True, capture_output=True)
            ptx = out.read_text()
        for entry in re.split(r"(?m)^(?:\.visible )?\.entry ", ptx)[1:]:
            kernels[entry.split("(", 1)[0]] = entry
    return kernels


def pdl_kernels() -> set[str]:
    """Every ``@triton.jit`` kernel under ``platforms/cuda/kernels`` that takes ``PDL``."""
    from pagedserve.platforms.cuda import kernels

    names = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if (isinstance(obj, triton.runtime.JITFunction) and "PDL" in obj.arg_names
                    and obj.__module__ == module.__name__ and name != "gate"):
                names.add(f"{info.name}.{name}")
    return names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 unless every kernel passes")
    args = p.parse_args()
    failed = False
    checked = set()
    for case in sorted(KERNELS):
        spec = KERNELS[case]("bf16", "gfx950")
        checked.add(f"{spec.fn.__module__.rsplit('.', 1)[-1]}.{spec.fn.__name__}")
        problem = ptx_problem(compile_ptx(spec))
        failed |= problem is not None
        print(f"{case}: {problem or 'waits before its first global access'}")
    cuda = cuda_kernels_ptx()
    if cuda is None:
        print("no nvcc: the CUDA C++ kernels are not checked")
    for name, ptx in sorted((cuda or {}).items()):
        allowed = next((rule for kernel, rule in _EARLY_COPIES.items() if kernel in name), None)
        problem = ptx_problem(ptx, allowed)
        failed |= problem is not None
        short = re.search(r"[a-z_]+_kernel\w*", name)
        print(f"{short.group() if short else name}: "
              f"{problem or 'waits before its first global access'}")
    missing = pdl_kernels() - checked
    if missing:
        failed = True
        print(f"kernels that take PDL but have no case here: {sorted(missing)}")
    if ptx_problem(compile_ptx(Spec(_early_load, {"x_ptr": "ACT", "out_ptr": "ACT"}, {}, 4))
                   ) is None:
        failed = True
        print("the checker passed a kernel that loads before its gate")
    if failed:
        sys.exit(1 if args.check else 0)
    print("compiled")


if __name__ == "__main__":
    main()
