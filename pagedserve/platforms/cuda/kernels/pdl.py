"""Programmatic dependent launch (PDL: Hopper and later NVIDIA GPUs) for a step's Triton kernels.

A kernel launched with PDL may start before the kernel ahead of it in the stream has finished:
its programs are placed on the multiprocessors and wait in ``griddepcontrol.wait`` until that
kernel has completed and its writes are visible. The launch and the programs' start-up then
overlap the previous kernel's last wave instead of following it, which is most of the cost of
a small kernel: a batch-1 decode step of the 8B model is some 350 kernels of 2 to 15 us, each
starting after the one before (CUDA graphs keep the host out of it, not the device's own
launch latency). Captured into a CUDA graph, the launches become programmatic edges.

The rule that keeps this exact: every kernel launched with ``launch_options`` calls
``gate(PDL)`` before it touches global memory. Past the wait the kernel before it has
completed, and that kernel, having passed its own wait, completed after the one before it, so
every read and write keeps the order of a serialized launch. ``gate`` then lets the next
kernel launch (``launch_dependents``) once all of this kernel's programs have started.

``PAGEDSERVE_PDL=1`` turns it on (``envs.pdl``): off by default until an H200 has run it
(``scripts/gpu_check.sh pdl-tests pdl``: its tests, then both timed in one call).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedserve import envs


@triton.jit
def gate(PDL: tl.constexpr):
    """A PDL-launched kernel's first statement: wait for the kernel before it, then let the
    next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def _supported(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or later, compiled kernels (not Triton's
    interpreter) and a Triton that has the grid-dependency intrinsics."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if not hasattr(getattr(tl.extra, "cuda", None), "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


@functools.lru_cache(maxsize=8)
def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a launch of a kernel that takes ``PDL: tl.constexpr`` and calls
    ``gate(PDL)`` first: the constant, and Triton's ``launch_pdl`` where it is on. Cached per
    device (a launch must not pay for the checks); the caller must not change the dict."""
    if envs.pdl() and _supported(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
