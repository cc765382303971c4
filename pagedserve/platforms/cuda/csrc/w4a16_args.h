// The arguments of both W4A16 libraries (w4a16_mma.cu and w4a16_wgmma.cu): one struct, passed
// by pointer from kernels/w4a16_mma.py's Args (ctypes), which mirrors it field for field.
#pragma once

#include <stdint.h>

extern "C" {

struct W4A16MmaArgs {
  const uint16_t* x;        // [M, K] bfloat16 or float16, rows `x_stride` apart
  const uint32_t* qweight;  // the packed weight: [16 * tiles, N]
  const uint16_t* scales;   // float16 [scale_rows, N]
  const uint16_t* zeros;    // float16 [scale_rows, N]: integer zero points
  uint16_t* out;            // [M, N], rows `out_stride` apart
  float* partial;           // [splits, M, N] when splits > 1
  int* counters;            // one per block of the output where splits > 1
  int m, n, k, x_stride, out_stride;
  int group_shift;  // log2 of the group size (a power of two from 32), 31 for one group
  int scale_rows;
  int tiles, tiles_per_split, splits;
  int bf16;        // x's type: bfloat16, else float16
  int variant;     // index into the library's compiled stage counts; 0 is the default
  int device;      // the CUDA device of every pointer above
  int block_rows;  // rows of x per block: 0 (few_rows_kernel), 16, 32 or 64 (many_rows_kernel);
                   // 64, 128 or 256 (the wgmma kernel)
  int pdl;         // launch with programmatic dependent launch (csrc/pdl.h)
};

}  // extern "C"
