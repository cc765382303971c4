"""Run one of the scripts that compile Triton kernels for an H100/H200 (sm_90) with Triton's
bundled toolchain, no GPU needed, in its own process (away from the interpreter the kernel
tests switch on), and check that it finished."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run_check(script: str) -> None:
    """``scripts/<script> --check`` must exit 0 and print "compiled"."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPTS / script), "--check"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stdout + done.stderr[-4000:]
