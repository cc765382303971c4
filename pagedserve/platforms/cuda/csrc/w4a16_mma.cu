// y = x @ W^T for a 4-bit grouped weight and 16-bit x, on the tensor cores (mma.sync
// m16n8k16, sm_80 and later), reading the layout that kernels/w4a16.py packs. Two kernels:
// few_rows_kernel (up to 16 rows) stages a split's x once; many_rows_kernel (blocks of 16 to
// 64 rows, any M) streams x with the weights. Both are described below, the first here.
//
// The packed layout: qweight int32 [16 * tiles, N], N contiguous; word r of tile T (row
// 16 T + r) holds W[n, 128 T + 16 t + r] for t = 0..7, slice t at bit 4 (t / 2) + 16 (t % 2).
// So (word >> 4 p) & 0x000F000F lifts pair p: columns 128 T + 32 p + r and + 16 into the two
// halves of a register, and OR-ing in the exponent bits of 128 (bfloat16) or 1024 (float16)
// makes them the packed 16-bit values 128 + q, one lop3 per two weights with no conversion.
//
// The weight is the mma's A operand (16 output features by 16 columns of K), x^T its B
// operand (16 columns by 8 rows of x), so a decode step's one row wastes 7 of B's 8 columns
// rather than 15 of A's 16 rows, and the weight is read once whatever M is. Which actual
// feature and column each mma row and column stands for is free, as long as A and B agree:
//   - mma rows g and g + 8 of thread (g, tig) are features nc + 2 i and nc + 2 i + 1
//     (nc = n0 + 4 g, i = 0, 1 the warp's two row tiles), so a thread reads its four
//     features' words with one 128-bit load, and writes their four outputs with one store;
//   - mma step (p, h0) of a tile takes pair p of word rows h0 + tig (its columns 2 tig, +1)
//     and h0 + 4 + tig (columns 2 tig + 8, +9), h0 = 0 or 8: all 16 of its columns then lie
//     in one group of 32, so a group's scale multiplies the fp32 accumulator once per group
//     instead of every weight, and the dot sees q - z exactly (two integers < 2^8 apart).
// x is staged in shared memory in that column order ([row][tile][word row][pair][half]), so
// a thread's B fragments for a tile are four 128-bit loads per 8 rows of x.
//
// Work (few_rows_kernel): a block is 4 warps across N (32 features each) over one split of
// K, whose x it stages once; the weights stream through shared memory by cp.async, several
// tiles ahead. Splits of K leave fp32 partial sums; the last block of a column to finish
// (counted in `counters`, which are zero between calls and which it zeroes again) adds them
// in split order, so the result does not depend on timing.

#include <cuda_runtime.h>
#include <stdint.h>

#include "pdl.h"
#include "w4a16_args.h"

namespace {

constexpr int kTileK = 128;  // columns of K per packed tile: 16 word rows
constexpr int kRowPad = 32;  // elements after each staged row of x: 64 bytes, so that the
                             // two rows a quarter-warp reads fall in different banks

__device__ __forceinline__ float half_to_float(uint32_t bits) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(uint16_t(bits)));
  return f;
}

template <bool BF16>
struct Dtype;

template <>
struct Dtype<true> {
  static constexpr uint32_t kBias = 0x43004300u;  // bfloat16 pair (128, 128)
  static constexpr uint32_t kOne = 0x3F803F80u;   // (1, 1)
  static constexpr float kBiasValue = 128.f;
  __device__ static float to_float(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }
  __device__ static uint32_t pair(float v) {
    uint32_t bits = __float_as_uint(v) >> 16;  // exact: v is a small integer
    return bits | (bits << 16);
  }
  __device__ static void store4(uint16_t* dst, const float (&v)[4]) {
    uint32_t lo, hi;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(v[1]), "f"(v[0]));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(v[3]), "f"(v[2]));
    *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
  }
};

template <>
struct Dtype<false> {
  static constexpr uint32_t kBias = 0x64006400u;  // float16 pair (1024, 1024)
  static constexpr uint32_t kOne = 0x3C003C00u;
  static constexpr float kBiasValue = 1024.f;
  __device__ static float to_float(uint16_t v) { return half_to_float(v); }
  __device__ static uint32_t pair(float v) {
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return uint32_t(h) | (uint32_t(h) << 16);
  }
  __device__ static void store4(uint16_t* dst, const float (&v)[4]) {
    uint32_t lo, hi;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(v[1]), "f"(v[0]));
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(v[3]), "f"(v[2]));
    *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
  }
};

// Pair p of a word as its biased codes, bias + q: what the dot takes where the group's
// bias + z is taken off once per output (groups of a whole tile: see the kernel).
template <bool BF16>
__device__ __forceinline__ uint32_t biased_codes(uint32_t word, int p) {
  uint32_t biased;
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(biased) : "r"(word >> (4 * p)),
      "n"(Dtype<BF16>::kBias));
  return biased;
}

// Pair p of a word as q - z in x's type: the biased codes (one lop3) plus -(bias + z), exact.
template <bool BF16>
__device__ __forceinline__ uint32_t weights(uint32_t word, int p, uint32_t neg_zero) {
  const uint32_t biased = biased_codes<BF16>(word, p);
  uint32_t out;
  if constexpr (BF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(biased), "r"(Dtype<true>::kOne),
        "r"(neg_zero));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(biased), "r"(Dtype<false>::kOne),
        "r"(neg_zero));
  }
  return out;
}

template <bool BF16>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}


}  // namespace

namespace {

constexpr int kBlockN = 128;                   // features per block: 4 warps of 32
constexpr int kWordBytes = 16 * kBlockN * 4;  // a tile's words for the block: 8 KB

__device__ __forceinline__ void cp_async16(void* smem, const void* global) {
  const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(global));
}

// Zeros in place of x past its rows or past K (ok false; the padded weights are not zero).
__device__ __forceinline__ void cp_async16_or_zeros(uint32_t smem, const void* global, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(global),
               "r"(ok ? 16 : 0));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// A block's weights into the cp.async stages, a tile per call in order: 16 word rows of 512
// bytes, thread (wn, lane) copying 16-byte chunk `lane` (4 features) of rows wn + 4 c to
// chunk lane ^ swizzle(row) (each kernel swizzles for the word rows it reads together, so
// that a quarter-warp's reads hit eight different bank groups), then warp q < NG copies
// group q's scale (lanes 0-15) and zero (16-31) rows after the words.
template <int GP>
struct WeightCopy {
  const uint32_t* w_src;
  const uint16_t* s_src;
  size_t four_rows;
  int wn, lane, s_dst;
  bool w_ok, s_ok;

  __device__ WeightCopy(const W4A16MmaArgs& a, int n_block, int t_lo)
      : w_src(a.qweight + (16 * (size_t)t_lo + (threadIdx.x >> 5)) * a.n + n_block +
              4 * (threadIdx.x & 31)),
        s_src((((threadIdx.x & 31) / 16) ? a.zeros : a.scales) + n_block +
              8 * (threadIdx.x & 15)),
        four_rows(4 * (size_t)a.n),
        wn(threadIdx.x >> 5),
        lane(threadIdx.x & 31),
        s_dst(kWordBytes + (2 * wn + lane / 16) * 256 + 16 * (lane % 16)),
        w_ok(n_block + 4 * lane < a.n),
        s_ok(wn < 4 / GP && n_block + 8 * (lane % 16) < a.n) {}

  template <typename Swizzle>
  __device__ __forceinline__ void tile(char* st, int tile, const W4A16MmaArgs& a,
                                       Swizzle swizzle) {
#pragma unroll
    for (int c = 0; c < 4; ++c)
      if (w_ok)
        cp_async16(st + (wn + 4 * c) * 512 + ((lane ^ swizzle(wn + 4 * c)) * 16),
                   w_src + c * four_rows);
    if (s_ok) {
      const int group = min((tile * kTileK + wn * 32 * GP) >> a.group_shift, a.scale_rows - 1);
      cp_async16(st + s_dst, s_src + (size_t)group * a.n);
    }
    w_src += 4 * four_rows;
  }
};

// Group q's scales and bias + zero points of a thread's four features (`feature` .. + 3 of
// the block), from a stage that WeightCopy filled.
template <bool BF16>
__device__ __forceinline__ void group_params(const char* st, int q, int feature,
                                             float (&scale)[4], float (&bias)[4]) {
  const uint2 sv = *reinterpret_cast<const uint2*>(st + kWordBytes + 2 * q * 256 + feature * 2);
  const uint2 zv =
      *reinterpret_cast<const uint2*>(st + kWordBytes + (2 * q + 1) * 256 + feature * 2);
  const uint32_t sw[2] = {sv.x, sv.y}, zw[2] = {zv.x, zv.y};
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    scale[c] = half_to_float(sw[c / 2] >> (16 * (c % 2)));
    bias[c] = Dtype<BF16>::kBiasValue + half_to_float(zw[c / 2] >> (16 * (c % 2)));
  }
}

// acc += a group's fp32 sums, scaled: accumulator (t, m, e) is feature 2 t + e / 2 of the
// thread's four.
template <int MT>
__device__ __forceinline__ void add_scaled(float (&acc)[2][MT][4], const float (&scale)[4],
                                           const float (&part)[2][MT][4]) {
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][m][e] += scale[2 * t + e / 2] * part[t][m][e];
}

// The top of both main loops: tile i is in for every thread, and tile i - 1's stage is free,
// so issue() may copy tile i + STAGES - 1 into it.
template <int STAGES, typename Issue>
__device__ __forceinline__ void next_tile(Issue& issue) {
  cp_async_wait<STAGES - 2>();
  __syncthreads();
  issue();
}

// The end of both kernels: thread (g, tig) holds rows m0 + 8 m + 2 tig (+1) of y at
// features nc .. nc + 3 (sums(m, hh)); each_row calls fn(row, m, hh) for those below M.
// With one split they are stored; else they go to `partial` at `split`, and the last block
// of the output block `counter` to finish adds the splits in order and resets the counter.
// Every thread of the block calls it (it holds barriers).
template <bool BF16, int MT>
__device__ __forceinline__ void write_out(const W4A16MmaArgs& a, const float (&acc)[2][MT][4],
                                          int m0, int nc, bool active, int split, int counter,
                                          int& is_last) {
  const int tig = threadIdx.x & 3;
  auto sums = [&](int m, int hh) {
    return make_float4(acc[0][m][hh], acc[0][m][2 + hh], acc[1][m][hh], acc[1][m][2 + hh]);
  };
  auto each_row = [&](auto fn) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        if (m0 + 8 * m + 2 * tig + hh < a.m) fn(m0 + 8 * m + 2 * tig + hh, m, hh);
  };
  auto store = [&](int b, float4 v) {
    const float four[4] = {v.x, v.y, v.z, v.w};
    Dtype<BF16>::store4(a.out + (size_t)b * a.out_stride + nc, four);
  };
  if (a.splits == 1) {
    if (active) each_row([&](int b, int m, int hh) { store(b, sums(m, hh)); });
    return;
  }
  if (active)
    each_row([&](int b, int m, int hh) {
      *reinterpret_cast<float4*>(a.partial + ((size_t)split * a.m + b) * a.n + nc) = sums(m, hh);
    });
  __threadfence();  // the partial sums are visible before the count says so
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(a.counters + counter, 1) == a.splits - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  if (active)
    each_row([&](int b, int, int) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int sp = 0; sp < a.splits; ++sp) {  // L2, not this multiprocessor's L1
        const float4 p = __ldcg(
            reinterpret_cast<const float4*>(a.partial + ((size_t)sp * a.m + b) * a.n + nc));
        v.x += p.x, v.y += p.y, v.z += p.z, v.w += p.w;
      }
      store(b, v);
    });
  if (threadIdx.x == 0) a.counters[counter] = 0;
}

// GP: pairs per group, 1 (groups of 32), 2 (64) or 4 (128 and more, or one group). With one
// group per tile the dot takes the biased codes as they are (one lop3 per two weights) and
// the group's (bias + z) times the sum of x over the tile comes off per output, where
// smaller groups take q - z (a packed fma more per two weights). The
// weights stream through STAGES shared-memory buffers by cp.async, so STAGES - 1 tiles are in
// flight per block without holding registers: the loads' latency, not the arithmetic, is
// what bounds a kernel that reads each byte once.
template <bool BF16, int MT, int GP, int STAGES>
__global__ void __launch_bounds__(128) few_rows_kernel(W4A16MmaArgs a) {
  constexpr int NG = 4 / GP;  // groups per tile
  constexpr bool kBiased = GP == 4;
  constexpr int kStageBytes = kWordBytes + NG * 2 * kBlockN * 2;  // + scale and zero rows
  extern __shared__ uint4 smem[];
  char* stages = reinterpret_cast<char*>(smem);
  __shared__ int is_last;

  const int lane = threadIdx.x & 31, wn = threadIdx.x >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int n_block = blockIdx.x * kBlockN;
  const int nc = n_block + wn * 32 + 4 * g;  // this thread's four features
  const bool active = nc < a.n;              // N is a multiple of 32
  const int t_lo = blockIdx.y * a.tiles_per_split;
  const int block_tiles = min(a.tiles_per_split, a.tiles - t_lo);
  const int rows = min(a.m, 8 * MT);
  const int row_stride = a.tiles_per_split * kTileK + kRowPad;
  uint16_t* xs = reinterpret_cast<uint16_t*>(stages + STAGES * kStageBytes);
  float* x_sums = reinterpret_cast<float*>(xs + rows * row_stride);  // [row][tile] (biased)

  // The slice's tiles into their stages in order, one per call and always one commit, so
  // that the wait below counts tiles; the reads below take word rows tig + 4 j together.
  WeightCopy<GP> weight_copy(a, n_block, t_lo);
  int next = 0;
  auto issue = [&]() {
    if (next < block_tiles)
      weight_copy.tile(stages + (next % STAGES) * kStageBytes, t_lo + next, a,
                   [](int row) { return (row & 3) << 1; });
    ++next;
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue();
  // The first tiles of weights are on their way (no kernel writes them) while the kernel
  // before this one finishes; x may be its output.
  pdl_gate();

  // Stage x while the weights are in flight: 16 lanes per tile of a row, 8 columns each,
  // scattered into the mma's column order; for the biased codes the tile's sum, added across
  // the 16 lanes in a fixed order. The bound is rounded up to whole warps for the shuffles.
  const int items = rows * block_tiles * 16;
  for (int item = threadIdx.x; item < (items + 127) / 128 * 128; item += 128) {
    const int b = item / 16 / block_tiles, tl = item / 16 % block_tiles, kl = item % 16 * 8;
    const int col = (t_lo + tl) * kTileK + kl;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (item < items && col < a.k)
      v = *reinterpret_cast<const uint4*>(a.x + (size_t)b * a.x_stride + col);
    const uint16_t* e = reinterpret_cast<const uint16_t*>(&v);
    float sum = 0.f;
    if (item < items) {
      const int p = kl / 32, h = (kl / 16) % 2, r = kl % 16;
      uint16_t* dst = xs + b * row_stride + tl * kTileK + r * 8 + p * 2 + h;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        dst[c * 8] = e[c];
        if constexpr (kBiased) sum += Dtype<BF16>::to_float(e[c]);
      }
    }
    if constexpr (kBiased) {
#pragma unroll
      for (int o = 8; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (item < items && kl == 0) x_sums[b * a.tiles_per_split + tl] = sum;
    }
  }

  float acc[2][MT][4] = {};
  for (int i = 0; i < block_tiles; ++i) {
    next_tile<STAGES>(issue);
    if (!active) continue;
    const char* st = stages + (i % STAGES) * kStageBytes;
    uint32_t w[4][4];  // [word row j][feature c]
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 v = *reinterpret_cast<const uint4*>(
          st + (4 * j + tig) * 512 + ((wn * 8 + g) ^ (tig << 1)) * 16);
      w[j][0] = v.x, w[j][1] = v.y, w[j][2] = v.z, w[j][3] = v.w;
    }
    uint32_t xf[MT][4][4];  // [8 rows of x][word row j][pair p]
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // rows past M repeat the last: their columns are unused
        const uint4 v = *reinterpret_cast<const uint4*>(
            xs + min(8 * m + g, rows - 1) * row_stride + i * kTileK + (4 * j + tig) * 8);
        xf[m][j][0] = v.x, xf[m][j][1] = v.y, xf[m][j][2] = v.z, xf[m][j][3] = v.w;
      }
#pragma unroll
    for (int q = 0; q < NG; ++q) {
      float scale[4], bias[4], bias_scaled[4];
      uint32_t neg_zero[4];
      group_params<BF16>(st, q, wn * 32 + 4 * g, scale, bias);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if constexpr (kBiased) bias_scaled[c] = scale[c] * bias[c];
        else neg_zero[c] = Dtype<BF16>::pair(-bias[c]);
      }
      float part[2][MT][4] = {};
#pragma unroll
      for (int p = q * GP; p < (q + 1) * GP; ++p)
#pragma unroll
        for (int j = 0; j < 4; j += 2)
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            uint32_t frag[4];
            if constexpr (kBiased) {
              frag[0] = biased_codes<BF16>(w[j][2 * t], p);
              frag[1] = biased_codes<BF16>(w[j][2 * t + 1], p);
              frag[2] = biased_codes<BF16>(w[j + 1][2 * t], p);
              frag[3] = biased_codes<BF16>(w[j + 1][2 * t + 1], p);
            } else {
              frag[0] = weights<BF16>(w[j][2 * t], p, neg_zero[2 * t]);
              frag[1] = weights<BF16>(w[j][2 * t + 1], p, neg_zero[2 * t + 1]);
              frag[2] = weights<BF16>(w[j + 1][2 * t], p, neg_zero[2 * t]);
              frag[3] = weights<BF16>(w[j + 1][2 * t + 1], p, neg_zero[2 * t + 1]);
            }
#pragma unroll
            for (int m = 0; m < MT; ++m) mma<BF16>(part[t][m], frag, xf[m][j][p], xf[m][j + 1][p]);
          }
      if constexpr (kBiased) {  // part - (bias + z) * sum(x), scaled
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          float sums[2];
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
            sums[hh] = x_sums[min(8 * m + 2 * tig + hh, rows - 1) * a.tiles_per_split + i];
#pragma unroll
          for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              acc[t][m][e] += scale[2 * t + e / 2] * part[t][m][e] -
                              bias_scaled[2 * t + e / 2] * sums[e % 2];
        }
      } else {
        add_scaled(acc, scale, part);
      }
    }
  }

  write_out<BF16, MT>(a, acc, 0, nc, active, blockIdx.y, blockIdx.x, is_last);
}

// many_rows_kernel: a block takes 8 MT rows of x (MT = 2, 4 or 8) by 128 features over a split
// of K and streams each tile's x through the cp.async stages with its weights; x is staged as
// it is in memory, a row of 16 chunks of 16 bytes XOR-swizzled by the row, so that cp.async
// copies it whole and ldmatrix reads the B fragments (8 rows of 16 columns without bank
// conflicts). For that, mma step s of a tile takes its 16 adjacent columns 16 s .. 16 s + 15:
// byte permutes of word rows r and r + 1 (r even) give a word of their even slices (`lo`,
// row r's in the low half and r + 1's in the high half) and one of their odd slices (`hi`),
// so pair p of `lo` is columns 32 p + r and 32 p + r + 1, side by side. Thread (g, tig) takes
// word rows 2 tig, 2 tig + 1 (its A columns 2 tig, + 1) and 2 tig + 8, + 9 (2 tig + 8, + 9),
// and step s = 2 p + h is pair p of `lo` (h = 0) or `hi` (h = 1). Features are as in
// few_rows_kernel. The dot takes q - z, and each group's scale multiplies the fp32 sums of
// its steps (part) into acc, as there.
template <bool BF16, int MT, int GP, int STAGES>
__global__ void __launch_bounds__(128, 2) many_rows_kernel(W4A16MmaArgs a) {
  pdl_gate();  // x goes through the stages with the weights
  constexpr int NG = 4 / GP;
  constexpr int kScaleBytes = NG * 2 * kBlockN * 2;
  constexpr int kXRowBytes = kTileK * 2;
  constexpr int kStageBytes = kWordBytes + kScaleBytes + 8 * MT * kXRowBytes;
  extern __shared__ uint4 smem[];
  char* stages = reinterpret_cast<char*>(smem);
  const uint32_t stages_at = static_cast<uint32_t>(__cvta_generic_to_shared(stages));
  __shared__ int is_last;

  const int lane = threadIdx.x & 31, wn = threadIdx.x >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int m0 = blockIdx.x * 8 * MT;
  const int n_block = blockIdx.y * kBlockN;
  const int nc = n_block + wn * 32 + 4 * g;
  const bool active = nc < a.n;
  const int t_lo = blockIdx.z * a.tiles_per_split;
  const int block_tiles = min(a.tiles_per_split, a.tiles - t_lo);

  // A tile per call (one commit each): its weights, swizzled for the reads below (word rows
  // 2 tig and the like together), then x's chunk `xc` of rows x_row + 8 i, zeros past M:
  // reading the last row in their place put every block's reads of it on the same addresses
  // (the 8B gate/up at 9 rows: 52 us, with zeros 31).
  WeightCopy<GP> weight_copy(a, n_block, t_lo);
  const int x_row = threadIdx.x >> 4, xc = threadIdx.x & 15;
  const int x_dst = kWordBytes + kScaleBytes + x_row * kXRowBytes + ((xc ^ (x_row & 7)) * 16);
  int next = 0;
  auto issue = [&]() {
    if (next < block_tiles) {
      const int tile = t_lo + next;
      weight_copy.tile(stages + (next % STAGES) * kStageBytes, tile, a,
                   [](int row) { return ((row >> 1) & 3) << 1; });
      const int col = tile * kTileK + 8 * xc;
      const uint32_t x_at = stages_at + (next % STAGES) * kStageBytes + x_dst;
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const int row = m0 + x_row + 8 * i;
        const bool ok = row < a.m && col < a.k;
        cp_async16_or_zeros(x_at + 8 * i * kXRowBytes,
                            a.x + (ok ? (size_t)row * a.x_stride + col : 0), ok);
      }
    }
    ++next;
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue();

  // ldmatrix.x4 of rows 8 j .. 8 j + 15 and columns 16 s .. + 15: lanes 0-7 address the
  // first 8 rows' left halves (b0 of j), 8-15 their right halves (b1), 16-31 the next 8 rows'.
  const uint32_t x_lane = (8 * (lane >> 4) + (lane & 7)) * kXRowBytes;
  const int x_half = (lane >> 3) & 1, x_swizzle = lane & 7;
  const int w_chunk = ((wn * 8 + g) ^ (tig << 1)) * 16;  // swizzle(2 tig + ...) = 2 tig
  float acc[2][MT][4] = {};
  for (int i = 0; i < block_tiles; ++i) {
    next_tile<STAGES>(issue);
    if (!active) continue;
    const char* st = stages + (i % STAGES) * kStageBytes;
    const uint32_t xs = stages_at + (i % STAGES) * kStageBytes + kWordBytes + kScaleBytes + x_lane;
    uint32_t lo[2][4], hi[2][4];  // [word rows 2 tig (+1), or 2 tig + 8 (+9)][feature c]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint4 v0 = *reinterpret_cast<const uint4*>(st + (2 * tig + 8 * r) * 512 + w_chunk);
      const uint4 v1 = *reinterpret_cast<const uint4*>(st + (2 * tig + 8 * r + 1) * 512 + w_chunk);
      const uint32_t w0[4] = {v0.x, v0.y, v0.z, v0.w}, w1[4] = {v1.x, v1.y, v1.z, v1.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        lo[r][c] = __byte_perm(w0[c], w1[c], 0x5410);
        hi[r][c] = __byte_perm(w0[c], w1[c], 0x7632);
      }
    }
#pragma unroll
    for (int q = 0; q < NG; ++q) {
      float scale[4], bias[4];
      uint32_t neg_zero[4];
      group_params<BF16>(st, q, wn * 32 + 4 * g, scale, bias);
#pragma unroll
      for (int c = 0; c < 4; ++c) neg_zero[c] = Dtype<BF16>::pair(-bias[c]);
      float part[2][MT][4] = {};
#pragma unroll
      for (int p = q * GP; p < (q + 1) * GP; ++p)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t(&w)[2][4] = h ? hi : lo;
          uint32_t frag[2][4];
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            frag[t][0] = weights<BF16>(w[0][2 * t], p, neg_zero[2 * t]);
            frag[t][1] = weights<BF16>(w[0][2 * t + 1], p, neg_zero[2 * t + 1]);
            frag[t][2] = weights<BF16>(w[1][2 * t], p, neg_zero[2 * t]);
            frag[t][3] = weights<BF16>(w[1][2 * t + 1], p, neg_zero[2 * t + 1]);
          }
#pragma unroll
          for (int j = 0; j < MT; j += 2) {
            uint32_t b[4];
            const int chunk = (2 * (2 * p + h) + x_half) ^ x_swizzle;
            ldmatrix_x4(b, xs + j * 8 * kXRowBytes + chunk * 16);
#pragma unroll
            for (int t = 0; t < 2; ++t) {
              mma<BF16>(part[t][j], frag[t], b[0], b[1]);
              mma<BF16>(part[t][j + 1], frag[t], b[2], b[3]);
            }
          }
        }
      add_scaled(acc, scale, part);
    }
  }
  write_out<BF16, MT>(a, acc, m0, nc, active, blockIdx.z, blockIdx.y * gridDim.x + blockIdx.x,
                      is_last);
}

// Each kernel's launch: all of L1 that shared memory may take, so that blocks are limited by
// registers, and the dynamic shared memory the stages (and few_rows_kernel's x) take.
template <typename Kernel>
cudaError_t launch(Kernel kernel, dim3 grid, size_t bytes, const W4A16MmaArgs& a,
                   cudaStream_t stream) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                       cudaSharedmemCarveoutMaxShared);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
  if (e != cudaSuccess) return e;
  return launch_kernel(kernel, grid, dim3(128), bytes, stream, a.pdl != 0, a);
}

template <bool BF16, int MT, int GP, int STAGES>
cudaError_t launch_few(const W4A16MmaArgs& a, cudaStream_t stream) {
  constexpr int NG = 4 / GP;
  const int rows = a.m < 8 * MT ? a.m : 8 * MT;
  const size_t bytes = (size_t)STAGES * (kWordBytes + NG * 2 * kBlockN * 2) +
                       (size_t)rows * (a.tiles_per_split * kTileK + kRowPad) * 2 +
                       (GP == 4 ? (size_t)rows * a.tiles_per_split * 4 : 0);  // x's sums
  return launch(few_rows_kernel<BF16, MT, GP, STAGES>,
                dim3((a.n + kBlockN - 1) / kBlockN, a.splits), bytes, a, stream);
}

template <bool BF16, int MT, int GP, int STAGES>
cudaError_t launch_many(const W4A16MmaArgs& a, cudaStream_t stream) {
  constexpr int NG = 4 / GP;
  const size_t bytes = (size_t)STAGES * (kWordBytes + NG * 2 * kBlockN * 2 + 8 * MT * kTileK * 2);
  // Blocks of the same features are adjacent in launch order, so they read the weights
  // from L2 about together.
  const dim3 grid((a.m + 8 * MT - 1) / (8 * MT), (a.n + kBlockN - 1) / kBlockN, a.splits);
  return launch(many_rows_kernel<BF16, MT, GP, STAGES>, grid, bytes, a, stream);
}

template <bool FEW, bool BF16, int MT, int GP, int STAGES>
cudaError_t launch_one(const W4A16MmaArgs& a, cudaStream_t stream) {
  if constexpr (FEW) return launch_few<BF16, MT, GP, STAGES>(a, stream);
  else return launch_many<BF16, MT, GP, STAGES>(a, stream);
}

// The compiled stage counts: variant 0 is each kernel's choice, 3 (the sweeps of 2026-12-01
// and -02: for the many-rows kernel, 4 stages were within 2% at every M).
template <bool FEW, bool BF16, int MT, int GP>
cudaError_t by_variant(const W4A16MmaArgs& a, cudaStream_t stream) {
  switch (a.variant) {
    case 0: return launch_one<FEW, BF16, MT, GP, 3>(a, stream);
#ifdef W4A16_MMA_SWEEP
    case 1: return launch_one<FEW, BF16, MT, GP, 4>(a, stream);
    case 2: return launch_one<FEW, BF16, MT, GP, FEW ? 6 : 2>(a, stream);
    case 3: return launch_one<FEW, BF16, MT, GP, FEW ? 8 : 5>(a, stream);
#endif
    default: return cudaErrorInvalidValue;
  }
}

template <bool FEW, int MT>
cudaError_t by_type(const W4A16MmaArgs& a, cudaStream_t stream) {
  const int shift = a.group_shift;
  if (shift < 5) return cudaErrorInvalidValue;
  if (a.bf16)
    return shift >= 7 ? by_variant<FEW, true, MT, 4>(a, stream)
           : shift == 6 ? by_variant<FEW, true, MT, 2>(a, stream)
                        : by_variant<FEW, true, MT, 1>(a, stream);
  return shift >= 7 ? by_variant<FEW, false, MT, 4>(a, stream)
         : shift == 6 ? by_variant<FEW, false, MT, 2>(a, stream)
                      : by_variant<FEW, false, MT, 1>(a, stream);
}

}  // namespace

extern "C" {

// 0, or the CUDA error code of the launch. The caller checks the shapes (kernels/w4a16_mma.py).
int w4a16_mma(const W4A16MmaArgs* a, void* stream) {
  // This library links its own CUDA runtime, whose current device is not torch's.
  cudaError_t e = cudaSetDevice(a->device);
  if (e != cudaSuccess) return e;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a->block_rows) {
    case 0: return a->m <= 8 ? by_type<true, 1>(*a, s)
                   : a->m <= 16 ? by_type<true, 2>(*a, s) : cudaErrorInvalidValue;
    case 16: return by_type<false, 2>(*a, s);
    case 32: return by_type<false, 4>(*a, s);
    case 64: return by_type<false, 8>(*a, s);
    default: return cudaErrorInvalidValue;
  }
}

// Variants compiled in: 1 normally, 4 with W4A16_MMA_SWEEP (benchmarks).
int w4a16_mma_variants() {
#ifdef W4A16_MMA_SWEEP
  return 4;
#else
  return 1;
#endif
}

}  // extern "C"
