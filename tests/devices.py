"""Which accelerators the tests can use.

ROCm's torch answers ``torch.cuda.is_available()`` too, and the cuda platform refuses it, so
NVIDIA-only tests ask ``HAS_NVIDIA``, never ``torch.cuda.is_available()`` alone.
"""

from __future__ import annotations

import torch

HAS_NVIDIA = torch.cuda.is_available() and torch.version.hip is None
HAS_ROCM = torch.cuda.is_available() and torch.version.hip is not None
NVIDIA_REASON = "needs an NVIDIA GPU (torch.cuda without ROCm)"


def choose_triton_interpreter() -> bool:
    """Without an NVIDIA GPU, run Triton kernels in its interpreter: Triton picks interpreter
    or compiler for each @jit function as it is defined, its own standard library included,
    so ``TRITON_INTERPRET=1`` must be set before the process first imports triton. Call it at
    the top of a kernel test module; True when triton was imported too early (then
    ``interpreter_guards`` runs the module in a fresh process instead)."""
    import os
    import sys

    too_late = (not HAS_NVIDIA and "triton" in sys.modules
                and os.environ.get("TRITON_INTERPRET") != "1")
    if not HAS_NVIDIA and not too_late:
        os.environ["TRITON_INTERPRET"] = "1"
    return too_late


def interpreter_guards(path: str, imported_too_late: bool):
    """For a test module of Triton kernels: an autouse fixture that skips its tests when triton
    was imported before ``TRITON_INTERPRET=1`` could take effect, and a test that then runs
    the module (``path``) in a fresh process. Assign both at module level."""
    import os
    import subprocess
    import sys

    import pytest

    @pytest.fixture(autouse=True)
    def _kernels_runnable(request: pytest.FixtureRequest) -> None:
        if imported_too_late and request.node.originalname != "test_in_a_fresh_interpreter_process":
            pytest.skip("triton was imported before TRITON_INTERPRET=1; run in a fresh process")

    @pytest.mark.skipif(not imported_too_late, reason="the kernels run in this process")
    def test_in_a_fresh_interpreter_process():
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]

    return _kernels_runnable, test_in_a_fresh_interpreter_process
