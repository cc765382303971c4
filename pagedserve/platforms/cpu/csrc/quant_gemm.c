/* Grouped-quantized linear layers on the CPU: y = x @ W^T with W[n, k] = v * scale + offset.
 *
 * Packed layout (pagedserve/platforms/cpu/native_quant.py builds it):
 *   Rows come in blocks of 8, one row per SIMD lane, so the kernel broadcasts one x[k] and
 *   multiplies it with 8 rows' weights at once: no horizontal sums, and each block's 8 outputs
 *   are one vector store. N is padded with zero rows to a multiple of 8.
 *   Along K, every group is padded with zero weights to a multiple of 4 (KSTEP) so the inner
 *   loop needs no tail; group g starts at padded column g * round_up(group_size, 4), and only
 *   the last group may be shorter. kp is the padded K; x is copied into the same padded
 *   layout (zeros in the gaps) before the product.
 *   4 bits: block b holds kp / 2 * 8 bytes; byte (k / 2) * 8 + r holds row r's weight k in
 *           its low nibble and weight k + 1 in its high nibble (k even).
 *   8 bits: block b holds kp * 8 bytes; byte k * 8 + r holds row r's weight k.
 *   scales, offsets: float32 [n_blocks, n_groups, 8].
 *
 * Offsets cost nothing per weight: sum_k (v s + o) x_k = s sum_k v x_k + o sum_k x_k, and the
 * per-group sums of x are computed once per row of x. Activations stay float32.
 *
 * Written with GCC vector extensions, so one source becomes AVX2/FMA code under
 * -march=native on x86 (and SSE or NEON code elsewhere, as pairs of 4-float vectors); only
 * the byte widening needs an intrinsic.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define LANES 8
#define KSTEP 4
#define MR 4 /* rows of x that share one unpacking of the weights */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8b __attribute__((vector_size(8)));

typedef struct {
    int n, k, bits, group_size;
    int n_groups, group_stride, kp, block_bytes;
} Shape;

static Shape shape_of(int n, int k, int bits, int group_size) {
    Shape s = {.n = n, .k = k, .bits = bits, .group_size = group_size};
    s.n_groups = (k + group_size - 1) / group_size;
    s.group_stride = (group_size + KSTEP - 1) / KSTEP * KSTEP;
    int last = k - (s.n_groups - 1) * group_size;
    s.kp = (s.n_groups - 1) * s.group_stride + (last + KSTEP - 1) / KSTEP * KSTEP;
    s.block_bytes = s.kp * LANES * bits / 8;
    return s;
}

static inline int min3(int a, int b, int c) {
    return a < b ? (a < c ? a : c) : (b < c ? b : c);
}

static inline int group_len(const Shape *s, int g) {
    return g < s->n_groups - 1 ? s->group_stride : s->kp - g * s->group_stride;
}

/* 8 bytes widened to 8 int32 lanes. GCC 12 turns the portable conversion into 8 scalar byte
 * extractions, a few times slower than the whole kernel's budget, so AVX2 gets vpmovzxbd. */
static inline v8i load_bytes(const uint8_t *p) {
#ifdef __AVX2__
    return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    v8b b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, v8i);
#endif
}

/* The 4 weight vectors (8 rows each) of padded columns k .. k + 3 starting at byte p. */
static inline void unpack(const uint8_t *p, int bits, v8f w[KSTEP]) {
    for (int j = 0; j < KSTEP; j += 2) {
        if (bits == 4) {
            v8i pair = load_bytes(p + j / 2 * LANES);
            w[j] = __builtin_convertvector(pair & 15, v8f);
            w[j + 1] = __builtin_convertvector(pair >> 4, v8f);
        } else {
            w[j] = __builtin_convertvector(load_bytes(p + j * LANES), v8f);
            w[j + 1] = __builtin_convertvector(load_bytes(p + (j + 1) * LANES), v8f);
        }
    }
}

/* Rows [0, mr) of x against one block of 8 weight rows; x rows are padded, stride s->kp.
 * Each group's dot products gather in `chains` independent accumulators per row of x (FMA
 * latency would otherwise bound a single row), then fold in scale and offset. Inlined with
 * constant mr, bits and chains so every loop unrolls into registers. */
static inline __attribute__((always_inline)) void block_rows(
    const Shape *s, const uint8_t *wq, const float *sc, const float *of, const float *xp,
    const float *xs, int mr, int bits, int chains, v8f out[MR]) {
    for (int m = 0; m < mr; m++) out[m] = (v8f){0};
    for (int g = 0, k0 = 0; g < s->n_groups; g++, k0 += s->group_stride) {
        v8f acc[KSTEP][MR];
        for (int c = 0; c < chains; c++)
            for (int m = 0; m < mr; m++) acc[c][m] = (v8f){0};
        int len = group_len(s, g);
        for (int k = k0; k < k0 + len; k += KSTEP) {
            v8f w[KSTEP];
            unpack(wq + (size_t)k * LANES * bits / 8, bits, w);
            for (int j = 0; j < KSTEP; j++)
                for (int m = 0; m < mr; m++)
                    acc[j % chains][m] += w[j] * xp[(size_t)m * s->kp + k + j];
        }
        v8f scale, offset;
        memcpy(&scale, sc + g * LANES, sizeof scale);
        memcpy(&offset, of + g * LANES, sizeof offset);
        for (int m = 0; m < mr; m++) {
            v8f dot = acc[0][m];
            for (int c = 1; c < chains; c++) dot += acc[c][m];
            out[m] += scale * dot + offset * xs[(size_t)m * s->n_groups + g];
        }
    }
}

static void store_block(const v8f v, float *y, int valid) {
    if (valid == LANES) {
        memcpy(y, &v, sizeof v);
    } else {
        for (int r = 0; r < valid; r++) y[r] = v[r];
    }
}

#define BLOCK_CASE(MRC, BITS, CHAINS)                                                      \
    block_rows(s, wq, sc, of, xp + (size_t)m0 * s->kp, xs + (size_t)m0 * s->n_groups, MRC, \
               BITS, CHAINS, out)

/* One block of weight rows against all m rows of x, MR rows of x at a time. */
static void block_all_rows(const Shape *s, const uint8_t *wq, const float *sc,
                           const float *of, const float *xp, const float *xs, int m,
                           float *y, int n0) {
    int valid = s->n - n0 < LANES ? s->n - n0 : LANES;
    for (int m0 = 0; m0 < m; m0 += MR) {
        int mr = m - m0 < MR ? m - m0 : MR;
        v8f out[MR];
        /* One accumulator chain per row of x suffices from 4 rows up; fewer rows need more. */
        if (s->bits == 4) {
            if (mr == 4) BLOCK_CASE(4, 4, 1);
            else if (mr == 3) BLOCK_CASE(3, 4, 2);
            else if (mr == 2) BLOCK_CASE(2, 4, 2);
            else BLOCK_CASE(1, 4, 4);
        } else {
            if (mr == 4) BLOCK_CASE(4, 8, 1);
            else if (mr == 3) BLOCK_CASE(3, 8, 2);
            else if (mr == 2) BLOCK_CASE(2, 8, 2);
            else BLOCK_CASE(1, 8, 4);
        }
        for (int r = 0; r < mr; r++) store_block(out[r], y + (size_t)(m0 + r) * s->n + n0, valid);
    }
}

/* x [m, k] into the padded layout (zeros in the gaps), and its per-group sums. */
static void pad_x(const Shape *s, const float *x, int m, float *xp, float *xs) {
    for (int i = 0; i < m; i++) {
        const float *row = x + (size_t)i * s->k;
        float *prow = xp + (size_t)i * s->kp;
        memset(prow, 0, sizeof(float) * s->kp);
        for (int g = 0; g < s->n_groups; g++) {
            int start = g * s->group_size;
            int len = s->k - start < s->group_size ? s->k - start : s->group_size;
            float sum = 0;
            for (int j = 0; j < len; j++) sum += row[start + j];
            memcpy(prow + g * s->group_stride, row + start, sizeof(float) * len);
            xs[(size_t)i * s->n_groups + g] = sum;
        }
    }
}

/* y [m, n] = x [m, k] @ W^T. Returns 0, or -1 if scratch memory could not be allocated. */
int pq_matmul(const uint8_t *wq, const float *scales, const float *offsets, int n, int k,
              int bits, int group_size, const float *x, int m, float *y, int threads) {
    Shape s = shape_of(n, k, bits, group_size);
    float *xp = malloc(sizeof(float) * ((size_t)m * s.kp + (size_t)m * s.n_groups));
    if (!xp) return -1;
    float *xs = xp + (size_t)m * s.kp;
    pad_x(&s, x, m, xp, xs);
    int blocks = (n + LANES - 1) / LANES;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < blocks; b++) {
        size_t meta = (size_t)b * s.n_groups * LANES;
        block_all_rows(&s, wq + (size_t)b * s.block_bytes, scales + meta, offsets + meta, xp,
                       xs, m, y, b * LANES);
    }
    free(xp);
    return 0;
}

/* Blocks [b0, b1) of W, transposed, into out (row stride ld, block b0 at column col0).
 * Each row of out gets one contiguous run of stores per group, not a vector per block. */
static void dequant_blocks(const Shape *s, const uint8_t *wq, const float *scales,
                           const float *offsets, int b0, int b1, int n1, float *out, int ld,
                           int col0) {
    for (int g = 0; g < s->n_groups; g++) {
        int kg = g * s->group_size, len = group_len(s, g);
        for (int j = 0; j < len; j += KSTEP) {
            /* Padding columns (past the group or past k) are dropped here. */
            int cols = min3(KSTEP, s->group_size - j, s->k - kg - j);
            for (int b = b0; b < b1; b++) {
                size_t meta = ((size_t)b * s->n_groups + g) * LANES;
                v8f scale, offset, w[KSTEP];
                memcpy(&scale, scales + meta, sizeof scale);
                memcpy(&offset, offsets + meta, sizeof offset);
                unpack(wq + (size_t)b * s->block_bytes
                           + (size_t)(g * s->group_stride + j) * LANES * s->bits / 8,
                       s->bits, w);
                int valid = n1 - b * LANES < LANES ? n1 - b * LANES : LANES;
                float *dst = out + (size_t)(kg + j) * ld + col0 + (b - b0) * LANES;
                if (cols == KSTEP && valid == LANES) { /* constant trip count: no spills */
                    for (int i = 0; i < KSTEP; i++) {
                        v8f v = w[i] * scale + offset;
                        memcpy(dst + (size_t)i * ld, &v, sizeof v);
                    }
                } else {
                    for (int i = 0; i < cols; i++)
                        store_block(w[i] * scale + offset, dst + (size_t)i * ld, valid);
                }
            }
        }
    }
}

/* Rows [n0, n1) of W, transposed, as float32 into out [k, n1 - n0]; n0 is a multiple of 8.
 * Transposed because a block's 8 rows then make one vector store, and torch.mm multiplies
 * x [m, k] by it as readily as by W^T. */
void pq_dequant_t(const uint8_t *wq, const float *scales, const float *offsets, int n, int k,
                  int bits, int group_size, int n0, int n1, float *out, int threads) {
    Shape s = shape_of(n, k, bits, group_size);
    int b0 = n0 / LANES, b1 = (n1 + LANES - 1) / LANES;
    /* Chunks of 8 blocks: 256-byte runs of each row, whole cache lines per thread. */
    int chunks = (b1 - b0 + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int c = 0; c < chunks; c++) {
        int cb0 = b0 + c * 8, cb1 = cb0 + 8 < b1 ? cb0 + 8 : b1;
        dequant_blocks(&s, wq, scales, offsets, cb0, cb1, n1, out, n1 - n0, c * 8 * LANES);
    }
}
