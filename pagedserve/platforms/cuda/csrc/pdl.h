// Programmatic dependent launch (sm_90 and later) for the CUDA C++ kernels, as
// kernels/pdl.py does for the Triton ones: a kernel launched with it may start while the kernel
// before it in the stream still runs, and waits in pdl_gate() until that kernel has completed
// and its writes are visible. Whatever a kernel reads before its gate must be something no
// kernel writes (the packed weights, their scales and zero points).
#pragma once

#include <cuda_runtime.h>

#include <utility>

// Wait for the kernel before this one, then let the next one launch; without PDL (or before
// sm_90) it does nothing.
__device__ __forceinline__ void pdl_gate() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, bytes, stream>>>(args...), allowed to start early where `pdl`.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t bytes,
                          cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = pdl;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}
