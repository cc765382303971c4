"""Our Triton kernels compile for AMD GPUs, checked on the CPU through Triton's AMD backend.

The CI subset of ``scripts/amd_compile_sweep.py`` (each kernel once, in fp16 or bf16 by turns,
on gfx90a, gfx942, gfx950 and gfx1100 by turns) runs in its own process, away from the
interpreter that the CUDA kernel tests switch on; the script checks each kernel's LDS use
against the target's limit.
The full sweep is ``python scripts/amd_compile_sweep.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.rocm
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_every_kernel_compiles_for_amd_targets():
    pytest.importorskip("triton.backends.amd")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, str(ROOT / "scripts/amd_compile_sweep.py"),
                           "--subset"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " 0 failed" in done.stdout


@pytest.mark.parametrize("dtype,arch,expected", [
    (torch.bfloat16, None, "tf32"),  # NVIDIA: unchanged
    (torch.float16, "gfx942:sramecc+:xnack-", "tf32"),
    (torch.bfloat16, "gfx90a", "ieee"),
    (torch.float16, "gfx950", "ieee"),
    (torch.bfloat16, "gfx1100", "ieee"),
    (torch.float32, None, "ieee"),
    (torch.float32, "gfx942", "ieee"),
])
def test_dot_precision_by_architecture(dtype, arch, expected):
    pytest.importorskip("triton")
    from pagedserve.platforms.cuda.kernels.prefill_attention import dot_precision

    assert dot_precision(dtype, arch) == expected
