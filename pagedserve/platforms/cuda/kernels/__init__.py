"""Triton kernels for paged attention on NVIDIA GPUs.

Importing this package imports triton, so only the CUDA platform does it (lazily). Each
``@triton.jit`` decorator reads ``TRITON_INTERPRET`` when its module is first imported; tests set
it before that to run the kernels on the CPU.
"""

from pagedserve.platforms.cuda.kernels.decode_attention import decode_attention
from pagedserve.platforms.cuda.kernels.prefill_attention import prefill_attention
from pagedserve.platforms.cuda.kernels.reshape_and_cache import reshape_and_cache

__all__ = ["decode_attention", "prefill_attention", "reshape_and_cache"]
