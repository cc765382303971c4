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

Where it is used (``PAGEDSERVE_PDL``, ``envs.pdl``): by default (``auto``) in the CUDA graphs
of steps of up to ``AUTO_MAX_ROWS`` tokens (decode batches up to 8), captured inside
``graph_scope``; ``1``
everywhere, eager steps included; ``0`` nowhere. On the H200 (2026-12-05, 8B decode steps,
``scripts/gpu_check.sh pdl``) it took 2-7% off the step at batch 1 with AWQ, FP8 and bf16
weights, made no difference at 8 or 128, and added 2-3% at 32 in every run; the likely cost
there is the next kernel's programs held waiting on multiprocessors the running kernel's
later waves could use.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

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


@functools.lru_cache(maxsize=8)
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


# The most tokens (rows) a step's CUDA graph may run and launch with PDL under
# PAGEDSERVE_PDL=auto: a decode batch of 8, measured even; 32 measured slower.
AUTO_MAX_ROWS = 8

_ON = {"PDL": True, "launch_pdl": True}
_OFF = {"PDL": False}
_in_small_graph = False  # set by graph_scope while a small batch's graph is captured


@contextlib.contextmanager
def graph_scope(rows: int) -> Iterator[None]:
    """Around a CUDA graph's warm-up and capture: under ``auto``, the graph's kernels launch
    with PDL where its step has at most ``AUTO_MAX_ROWS`` tokens (the launch attributes are
    fixed at capture, so each graph keeps its own choice when replayed)."""
    global _in_small_graph
    before = _in_small_graph
    _in_small_graph = rows <= AUTO_MAX_ROWS
    try:
        yield
    finally:
        _in_small_graph = before


def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a launch of a kernel that takes ``PDL: tl.constexpr`` and calls
    ``gate(PDL)`` first: the constant, and Triton's ``launch_pdl`` where it is on. The caller
    must not change the dict."""
    mode = _mode()
    wanted = mode == "1" or (mode == "auto" and _in_small_graph)
    return _ON if wanted and _supported(device) else _OFF


@functools.lru_cache(maxsize=1)
def _mode() -> str:
    """PAGEDSERVE_PDL, read once: a launch must not pay for the environment lookup."""
    return envs.pdl()
