"""Triton kernels for paged attention on NVIDIA GPUs.

- ``reshape_and_cache``: write a step's new keys and values into the paged cache.
- ``prefill_attention``: causal varlen attention for chunks with cached context.
- ``decode_attention``: one query token per sequence, split along the context.

Import the functions from their modules. The package re-exports nothing on purpose: a function
named like its module would shadow the module as a package attribute, and ``import
...kernels.decode_attention as m`` would then hand back the function.

Importing a kernel module imports triton, so only the CUDA platform does it (lazily). Each
``@triton.jit`` decorator reads ``TRITON_INTERPRET`` when its module is first imported; tests set
it before that to run the kernels on the CPU.
"""
