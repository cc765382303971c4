// y = x @ W^T for a 4-bit grouped weight and 16-bit x on Hopper's warpgroup MMA (wgmma,
// sm_90a only), for many rows of x: decode batches of a hundred and more, and prefill. It reads
// the layout that kernels/w4a16.py packs (csrc/w4a16_mma.cu describes it), so one packed
// weight serves every path.
//
// The weight is wgmma's A operand, taken from registers: the decode writes the fragments that
// the instruction reads, and no decoded weight goes through shared memory. x is its B operand
// (x^T, K by rows), copied by cp.async into shared memory in the 128-byte swizzled layout that
// a wgmma descriptor names, so the block's rows of x are B's N: one m64nNk16 per warpgroup and
// 16 columns of K, N = 64, 128 or 256 rows of x. The result is y^T, stored transposed.
//
// A block is two warpgroups, 128 output features (64 each) by N rows of x, over all of K, a
// packed tile (128 columns of K) at a time. Which feature each A row stands for is free: row
// g of warp w's 16 is feature 16 w + 2 g and row g + 8 is 16 w + 2 g + 1, so that a thread's
// two features are adjacent in the packed words, their scales and the output. The mma steps
// take 16 adjacent columns, as in w4a16_mma.cu's many_rows_kernel: byte permutes of word rows
// r and r + 1 put their codes of a slice side by side, and step s = 2 p + h is pair p of the
// even slices (h = 0) or the odd ones (h = 1).
//
// Each weight is decoded to x's type rounded once, as the dequantize path writes it:
// (q - z) exactly (one lop3 lifts two codes to 128 + q, a packed fma takes 128 + z off), then
// times the group's float16 scale. In bfloat16 the scale is split into s_hi + s_lo, both
// exact, and (q - z) * s_lo is exact too, so fma(q - z, s_hi, (q - z) * s_lo) rounds the
// product once. So the dot is cuBLAS's on the dequantized weight, summed in another order.
//
// Where the blocks of the output are too few to fill the GPU (up to a few hundred rows), K is
// split over blockIdx.z: each split leaves fp32 partial sums, and the last block of an output
// block to finish (counted in `counters`, zero between calls, which it zeroes again) adds
// them in split order, so the result does not depend on timing.
//
// Pipeline: the tiles stream through STAGES shared-memory buffers, STAGES - 2 ahead; each
// warpgroup decodes step s + 1 while the wgmma of step s runs (wait_group 1 keeps one in
// flight), and a stage is refilled only two tiles after it was read, when every wgmma that
// read it is known to be done. (Two blocks a multiprocessor at 128 rows, 2 stages each, was
// timed and dropped: docs/benchmarks.md.)

#include <cuda_runtime.h>
#include <stdint.h>

#include "pdl.h"
#include "w4a16_args.h"

namespace {

constexpr int kTileK = 128;  // columns of K per packed tile: 16 word rows
constexpr int kBlockN = 128;  // output features per block: two warpgroups of 64
constexpr int kThreads = 256;
constexpr int kWordBytes = 16 * kBlockN * 4;  // a tile's words for the block: 8 KB
// Blocks of rows that run through the features together (see block_of).
constexpr int kGroupM = 8;


// The wgmma m64nNk16 instructions with A from registers (four 32-bit fragments per thread)
// and B from shared memory by descriptor, accumulating into d (scale-d true); T is the
// 16-bit type's PTX name.
#define W4A16_WGMMA_N64(T)                                                          \
  asm volatile(                                                                          \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                    \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {"                            \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17,"   \
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"              \
    "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                     \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
    "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),          \
    "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),       \
    "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),       \
    "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),       \
    "+f"(d[31])                                                                         \
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1))

#define W4A16_WGMMA_N128(T)                                                          \
  asm volatile(                                                                          \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                    \
    "wgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T " {"                            \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17,"   \
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33,"   \
    "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49,"   \
    "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"              \
    "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"                     \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
    "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),          \
    "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),       \
    "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),       \
    "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),       \
    "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),       \
    "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),       \
    "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),       \
    "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),       \
    "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),       \
    "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                                               \
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1))

#define W4A16_WGMMA_N256(T)                                                          \
  asm volatile(                                                                          \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                    \
    "wgmma.mma_async.sync.aligned.m64n256k16.f32." T "." T " {"                            \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17,"   \
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33,"   \
    "%34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49,"   \
    "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65,"   \
    "%66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81,"   \
    "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97,"   \
    "%98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125,"\
    "%126, %127"                                                                        \
    "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"                     \
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
    "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),          \
    "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),       \
    "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),       \
    "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),       \
    "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),       \
    "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),       \
    "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),       \
    "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),       \
    "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),       \
    "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]),       \
    "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]),       \
    "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]),       \
    "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]),       \
    "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),       \
    "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]),       \
    "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]),    \
    "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), \
    "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), \
    "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), \
    "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), \
    "+f"(d[127])                                                                        \
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(1))


template <int N, bool BF16>
__device__ __forceinline__ void wgmma(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (N == 64) {
    if constexpr (BF16) W4A16_WGMMA_N64("bf16"); else W4A16_WGMMA_N64("f16");
  } else if constexpr (N == 128) {
    if constexpr (BF16) W4A16_WGMMA_N128("bf16"); else W4A16_WGMMA_N128("f16");
  } else {
    if constexpr (BF16) W4A16_WGMMA_N256("bf16"); else W4A16_WGMMA_N256("f16");
  }
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads of the accumulators above the last wait.
template <int R>
__device__ __forceinline__ void fence_registers(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// A wgmma shared-memory descriptor: a K-major operand in the 128-byte swizzle, whose 8-row
// atoms (8 rows of 64 16-bit values) lie 1,024 bytes apart; `addr` is the step's first row's
// 16 columns (the atom itself 1,024-byte aligned, so the swizzle's phase is 0). The low word
// holds the address / 16 (14 bits: shared memory is below 256 KB) and the leading-byte offset
// (16 bytes, unused in this layout), the high word the stride (1,024 bytes) and the swizzle,
// so a step's descriptor is a tile's low word plus the step's offset / 16.
constexpr uint32_t kDescriptorHigh = (1024 >> 4) | (1u << 30);
__device__ __forceinline__ uint32_t descriptor_low(uint32_t addr) {
  return (addr >> 4) | ((16 >> 4) << 16);
}
__device__ __forceinline__ uint64_t descriptor(uint32_t low) {
  return (uint64_t(kDescriptorHigh) << 32) | low;
}

__device__ __forceinline__ void cp_async16(uint32_t smem, const void* global, bool ok) {
  // Zeros in place of the source where !ok (rows past M, columns past K, features past N).
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(global),
               "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

__device__ __forceinline__ uint32_t fma2(bool bf16, uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  if (bf16) asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  else asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ float half_to_float(uint32_t bits) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(uint16_t(bits)));
  return f;
}

// A 16-bit value of x's type in both halves of a register, rounded to nearest even.
template <bool BF16>
__device__ __forceinline__ uint32_t both_halves(float v) {
  uint16_t h;
  if constexpr (BF16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return uint32_t(h) | (uint32_t(h) << 16);
}

template <bool BF16>
__device__ __forceinline__ float to_float(uint32_t half_bits) {
  if constexpr (BF16) return __uint_as_float(half_bits << 16);
  else return half_to_float(half_bits);
}

// One feature's group: the scale as hi + lo (lo zero in float16, whose scale is exact) and
// -(bias + z), each in both halves of a register.
template <bool BF16>
struct GroupParams {
  uint32_t s_hi, s_lo, neg_zero;

  __device__ GroupParams(uint32_t scale_bits, uint32_t zero_bits) {
    const float s = half_to_float(scale_bits);
    s_hi = both_halves<BF16>(s);
    // Exact: s has 11 significant bits, s_hi the first 8 of them.
    s_lo = BF16 ? both_halves<BF16>(s - to_float<BF16>(s_hi & 0xFFFF)) : 0u;
    neg_zero = both_halves<BF16>(-((BF16 ? 128.f : 1024.f) + half_to_float(zero_bits)));
  }
};

// Pair p of a register of codes (two word rows' slice, side by side) as two weights of x's
// type: (bias + q) by one lop3, q - z exactly by one fma, then times the scale, rounded once.
template <bool BF16>
__device__ __forceinline__ uint32_t decode(uint32_t codes, int p, const GroupParams<BF16>& g) {
  constexpr uint32_t kBias = BF16 ? 0x43004300u : 0x64006400u;  // (128, 128) / (1024, 1024)
  constexpr uint32_t kOne = BF16 ? 0x3F803F80u : 0x3C003C00u;
  constexpr uint32_t kNegZero = 0x80008000u;  // -0 + v = v, also for v = +0
  uint32_t biased;
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(biased) : "r"(codes >> (4 * p)),
      "n"(kBias));
  const uint32_t diff = fma2(BF16, biased, kOne, g.neg_zero);
  if constexpr (BF16) return fma2(true, diff, g.s_hi, fma2(true, diff, g.s_lo, kNegZero));
  else return fma2(false, diff, g.s_hi, kNegZero);
}

__device__ __forceinline__ void store_pair(bool bf16, uint16_t* dst, float lo, float hi) {
  uint32_t v;
  if (bf16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(hi), "f"(lo));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(hi), "f"(lo));
  *reinterpret_cast<uint32_t*>(dst) = v;
}

template <int BM, int GP>
struct StageLayout {
  static constexpr int kXHalf = BM * 128;  // one 64-column half of x: BM rows of 128 bytes
  static constexpr int kWords = 2 * kXHalf;
  static constexpr int kScales = kWords + kWordBytes;  // NG x (scale row, zero row)
  static constexpr int kBytes = (kScales + (4 / GP) * 2 * kBlockN * 2 + 1023) / 1024 * 1024;
};

// Block blockIdx.x's rows and features. In launch order, kGroupM blocks of rows take a block
// of features together (they read its weights from L2 about together), then the next block
// of features: so while a group of rows runs through all the features, its rows of x (8 MB
// for 1,024 rows of the 8B's 4,096 columns) stay in L2, rather than every block of features
// reading all of x again, as it would at 8,192 rows of a prefill.
__device__ __forceinline__ int2 block_of(int id, int m_blocks, int n_blocks) {
  const int per_group = kGroupM * n_blocks;
  const int first_m = id / per_group * kGroupM;
  const int rows = min(m_blocks - first_m, kGroupM);
  const int in_group = id % per_group;
  return make_int2(first_m + in_group % rows, in_group / rows);
}

// A block of BM rows of x by 128 features over one split of K. GP: pairs of slices per group,
// 1 (groups of 32), 2 (64) or 4 (128 and more, or one group).
template <bool BF16, int BM, int GP, int STAGES>
__global__ void __launch_bounds__(kThreads) wgmma_kernel(const W4A16MmaArgs a) {
  using L = StageLayout<BM, GP>;
  constexpr int kAhead = STAGES - 2;  // tiles copied ahead of the one read
  constexpr int NG = 4 / GP;
  pdl_gate();  // x goes through the stages with the weights
  extern __shared__ uint8_t smem_raw[];
  __shared__ int is_last;
  // The swizzle atoms must be 1,024-byte aligned.
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023) & ~1023u;
  const uint8_t* base_ptr = smem_raw + (base - raw);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int f_local = (warp >> 2) * 64 + (warp & 3) * 16 + 2 * g;  // A rows g, g + 8
  const int m_blocks = (a.m + BM - 1) / BM;
  const int2 block = block_of(blockIdx.x, m_blocks, (a.n + kBlockN - 1) / kBlockN);
  const int m0 = block.x * BM;
  const int n_block = block.y * kBlockN;
  const int t_lo = blockIdx.z * a.tiles_per_split;
  const int tiles = min(a.tiles_per_split, a.tiles - t_lo);

  // What a thread copies of each tile, fixed but for the tile's offset: x's chunk c16 (8
  // values) of rows row0 + 16 i, each 16-byte chunk c of a 64-column half at c ^ (row % 8);
  // word rows (tid / 32) + 8 i of chunk c = tid % 32 (4 features), at c ^ 2 ((row / 2) % 4)
  // so that the 8-byte reads below (rows 2 tig + .., features 2 g + ..) miss each other; and
  // for the first NG * 32 threads one 16-byte chunk of group q's scale row or zero row.
  const int c16 = tid & 15, row0 = tid >> 4;
  const uint16_t* x_src[BM / 16];
  uint32_t x_dst[BM / 16];
  bool x_ok[BM / 16];
#pragma unroll
  for (int i = 0; i < BM / 16; ++i) {
    const int row = row0 + 16 * i;
    x_ok[i] = m0 + row < a.m;
    x_src[i] = a.x + size_t(x_ok[i] ? m0 + row : 0) * a.x_stride;  // row 0 stands in
    x_dst[i] = (c16 >> 3) * L::kXHalf + row * 128 + (((c16 & 7) ^ (row & 7)) << 4);
  }
  const int wc = tid & 31;
  const bool w_ok = n_block + 4 * wc < a.n;
  const uint32_t* w_src = a.qweight + size_t(tid >> 5) * a.n + (w_ok ? n_block + 4 * wc : 0);
  uint32_t w_dst[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = (tid >> 5) + 8 * i;
    w_dst[i] = L::kWords + row * 512 + ((wc ^ (2 * ((row >> 1) & 3))) << 4);
  }
  const int sq = tid >> 5, sc = tid & 15;
  const bool s_ok = tid < NG * 32 && n_block + 8 * sc < a.n;
  const uint16_t* s_src = ((tid >> 4) & 1 ? a.zeros : a.scales) + (s_ok ? n_block + 8 * sc : 0);
  const uint32_t s_dst = L::kScales + (tid >> 4) * 256 + 16 * sc;  // (2 q + which) * 256

  // The split's tile j (tile t_lo + j) into stage j % STAGES, one commit per call (none
  // copied past the split's last tile), so that the wait below counts tiles.
  auto issue = [&](int j) {
    if (j < tiles) {
      const int t = t_lo + j;
      const uint32_t st = base + (j % STAGES) * L::kBytes;
      const int col = t * kTileK + 8 * c16;
      const bool col_ok = col < a.k;
#pragma unroll
      for (int i = 0; i < BM / 16; ++i)
        cp_async16(st + x_dst[i], x_src[i] + (col_ok ? col : 0), x_ok[i] && col_ok);
      const size_t tile_words = size_t(16 * t) * a.n;
#pragma unroll
      for (int i = 0; i < 2; ++i)
        cp_async16(st + w_dst[i], w_src + tile_words + size_t(8 * i) * a.n, w_ok);
      if (tid < NG * 32) {
        const int group = min((t * kTileK + sq * (kTileK / NG)) >> a.group_shift,
                              a.scale_rows - 1);
        cp_async16(st + s_dst, s_src + size_t(group) * a.n, s_ok);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int j = 0; j < kAhead; ++j) issue(j);

  float acc[BM / 2];
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) acc[i] = 0.f;
  uint32_t frag[2][4];
  const int w_swizzle = ((f_local >> 2) ^ (2 * tig)) << 4 | (f_local & 2) * 4;
  for (int i = 0; i < tiles; ++i) {
    cp_async_wait<kAhead - 1>();
    // cp.async writes through the generic proxy, wgmma reads through the async one: each
    // thread's copies of tile i are made visible to it before the barrier publishes them.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    // Tile i is in for every thread, and every wgmma of tile i + kAhead - STAGES is done
    // (each warpgroup waited for all but its latest before passing here, or for all of them
    // with 2 stages): its stage may be refilled.
    __syncthreads();
    issue(i + kAhead);
    const uint32_t st = base + (i % STAGES) * L::kBytes;
    const uint8_t* st_ptr = base_ptr + (i % STAGES) * L::kBytes;
    const uint32_t x_descriptor = descriptor_low(st);
    // [rows 2 tig, + 1 or 2 tig + 8, + 9][feature f_local + e]: even slices (lo), odd (hi).
    uint32_t lo[2][2], hi[2][2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 2 * tig + 8 * r;
      const uint2 w0 = *reinterpret_cast<const uint2*>(st_ptr + L::kWords + row * 512 + w_swizzle);
      const uint2 w1 =
          *reinterpret_cast<const uint2*>(st_ptr + L::kWords + (row + 1) * 512 + w_swizzle);
      lo[r][0] = __byte_perm(w0.x, w1.x, 0x5410), hi[r][0] = __byte_perm(w0.x, w1.x, 0x7632);
      lo[r][1] = __byte_perm(w0.y, w1.y, 0x5410), hi[r][1] = __byte_perm(w0.y, w1.y, 0x7632);
    }
#pragma unroll
    for (int q = 0; q < NG; ++q) {
      const uint32_t sv = *reinterpret_cast<const uint32_t*>(st_ptr + L::kScales + 2 * q * 256 +
                                                             2 * f_local);
      const uint32_t zv = *reinterpret_cast<const uint32_t*>(
          st_ptr + L::kScales + (2 * q + 1) * 256 + 2 * f_local);
      const GroupParams<BF16> gp[2] = {GroupParams<BF16>(sv & 0xFFFF, zv & 0xFFFF),
                                       GroupParams<BF16>(sv >> 16, zv >> 16)};
#pragma unroll
      for (int p = q * GP; p < (q + 1) * GP; ++p)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int s = 2 * p + h;
          const uint32_t(&codes)[2][2] = h ? hi : lo;
          uint32_t(&f)[4] = frag[s & 1];
          f[0] = decode<BF16>(codes[0][0], p, gp[0]);  // row g: columns 2 tig, + 1
          f[1] = decode<BF16>(codes[0][1], p, gp[1]);  // row g + 8
          f[2] = decode<BF16>(codes[1][0], p, gp[0]);  // row g: columns 2 tig + 8, + 9
          f[3] = decode<BF16>(codes[1][1], p, gp[1]);
          wgmma_fence();
          wgmma<BM, BF16>(acc, f, descriptor(x_descriptor +
                                             (((s >> 2) * L::kXHalf + (s & 3) * 32) >> 4)));
          wgmma_commit();
          wgmma_wait<1>();
        }
    }
  }
  wgmma_wait<0>();
  fence_registers(acc);

  // acc[4 j + e] and acc[4 j + 2 + e]: column 8 j + 2 tig + e of B (row m0 + 8 j + 2 tig + e
  // of x), rows g and g + 8 of A (features f_local and f_local + 1). each_pair calls fn(row,
  // j, e) for those in the output.
  const int feature = n_block + f_local;
  auto each_pair = [&](auto fn) {
    if (feature >= a.n) return;
#pragma unroll
    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (m0 + 8 * j + 2 * tig + e < a.m) fn(m0 + 8 * j + 2 * tig + e, j, e);
  };
  auto store = [&](int row, float lo, float hi) {
    store_pair(BF16, a.out + size_t(row) * a.out_stride + feature, lo, hi);
  };
  if (a.splits == 1) {
    each_pair([&](int row, int j, int e) { store(row, acc[4 * j + e], acc[4 * j + 2 + e]); });
    return;
  }
  float* part = a.partial + size_t(blockIdx.z) * a.m * a.n;
  each_pair([&](int row, int j, int e) {
    *reinterpret_cast<float2*>(part + size_t(row) * a.n + feature) =
        make_float2(acc[4 * j + e], acc[4 * j + 2 + e]);
  });
  __threadfence();  // the partial sums are visible before the count says so
  __syncthreads();
  const int counter = blockIdx.x;
  if (tid == 0) is_last = atomicAdd(a.counters + counter, 1) == a.splits - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  each_pair([&](int row, int, int) {
    float2 sum = make_float2(0.f, 0.f);
    for (int sp = 0; sp < a.splits; ++sp) {  // L2, not this multiprocessor's L1
      const float2 v = __ldcg(reinterpret_cast<const float2*>(
          a.partial + (size_t(sp) * a.m + row) * a.n + feature));
      sum.x += v.x, sum.y += v.y;
    }
    store(row, sum.x, sum.y);
  });
  if (tid == 0) a.counters[counter] = 0;
}

template <bool BF16, int BM, int GP, int STAGES>
cudaError_t launch(const W4A16MmaArgs& a, cudaStream_t stream) {
  const auto kernel = wgmma_kernel<BF16, BM, GP, STAGES>;
  const int bytes = STAGES * StageLayout<BM, GP>::kBytes + 1024;  // + the alignment
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       bytes);
  if (e != cudaSuccess) return e;
  // The blocks of the output in block_of's order, by the splits of K.
  const dim3 grid(((a.m + BM - 1) / BM) * ((a.n + kBlockN - 1) / kBlockN), 1, a.splits);
  return launch_kernel(kernel, grid, dim3(kThreads), bytes, stream, a.pdl != 0, a);
}

// The compiled stage counts: variant 0 is the default for each block of rows.
template <bool BF16, int BM, int GP>
cudaError_t by_variant(const W4A16MmaArgs& a, cudaStream_t stream) {
  constexpr int kMostStages = BM == 256 ? 3 : 4;  // what fits in 227 KB
  switch (a.variant) {
    case 0: return launch<BF16, BM, GP, kMostStages>(a, stream);
#ifdef W4A16_WGMMA_SWEEP
    case 1: return launch<BF16, BM, GP, 3>(a, stream);
#endif
    default: return cudaErrorInvalidValue;
  }
}

template <bool BF16, int BM>
cudaError_t by_group(const W4A16MmaArgs& a, cudaStream_t stream) {
  const int shift = a.group_shift;
  if (shift < 5) return cudaErrorInvalidValue;
  return shift >= 7 ? by_variant<BF16, BM, 4>(a, stream)
         : shift == 6 ? by_variant<BF16, BM, 2>(a, stream)
                      : by_variant<BF16, BM, 1>(a, stream);
}

template <bool BF16>
cudaError_t by_rows(const W4A16MmaArgs& a, cudaStream_t stream) {
  switch (a.block_rows) {
    case 64: return by_group<BF16, 64>(a, stream);
    case 128: return by_group<BF16, 128>(a, stream);
    case 256: return by_group<BF16, 256>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" {

// 0, or the CUDA error code of the launch. The caller checks the shapes (kernels/w4a16_wgmma.py).
int w4a16_wgmma(const W4A16MmaArgs* a, void* stream) {
  // This library links its own CUDA runtime, whose current device is not torch's.
  cudaError_t e = cudaSetDevice(a->device);
  if (e != cudaSuccess) return e;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return a->bf16 ? by_rows<true>(*a, s) : by_rows<false>(*a, s);
}

// Variants compiled in: 1 normally, 2 with W4A16_WGMMA_SWEEP (benchmarks).
int w4a16_wgmma_variants() {
#ifdef W4A16_WGMMA_SWEEP
  return 2;
#else
  return 1;
#endif
}

}  // extern "C"
