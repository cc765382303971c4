/* Grouped-quantized linear layers on the CPU: y = x @ W^T with W[n, k] = v * scale + offset.
 *
 * Packed layout (pagedserve/platforms/cpu/native_quant.py builds it):
 *   Rows come in blocks of 8, one row per SIMD lane, so the kernel broadcasts one x[k] and
 *   multiplies it with 8 rows' weights at once: no horizontal sums, and each block's 8 outputs
 *   are one vector store. N is padded with zero rows to a multiple of 8.
 *   Along K, every group is padded with zero weights to a multiple of 8 (KSTEP) so the inner
 *   loop needs no tail; group g starts at padded column g * round_up(group_size, 8), and only
 *   the last group may be shorter. kp is the padded K; x is copied into the same padded
 *   layout (zeros in the gaps) before the product.
 *   A block is a run of chunks of 8 padded columns. In a chunk, int32 lane r holds row r's
 *   bytes, so a shift and a mask give one column of all 8 rows (float path), and the lane's
 *   4 bytes are the 4 consecutive columns that one u8 x s8 dot-product step takes (int8 path):
 *   4 bits: 32 bytes; byte 4 r + j holds row r's column j in its low nibble and column 4 + j
 *           in its high nibble (j < 4).
 *   8 bits: 64 bytes; byte 32 h + 4 r + j holds row r's column 4 h + j.
 *   scales, offsets: float32 [n_blocks, n_groups, 8].
 *
 * Offsets cost nothing per weight: sum_k (v s + o) x_k = s sum_k v x_k + o sum_k x_k, and the
 * per-group sums of x are computed once per row of x. pq_matmul keeps activations float32;
 * pq_matmul_i8 quantizes them to int8 first (see there).
 *
 * Written with GCC vector extensions, so one source becomes AVX2/FMA code under
 * -march=native on x86 (and SSE or NEON code elsewhere, as pairs of 4-float vectors); only
 * the int8 dot-product step has intrinsics (VNNI, else AVX2), with a portable twin.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define LANES 8
#define KSTEP 8
#define MR 4 /* rows of x that share one unpacking of the weights */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

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

/* The chunk of 8 padded columns at p: columns 0-3 of the 8 rows as a byte each per int32
 * lane in *lo, columns 4-7 in *hi. */
static inline void load_chunk(const uint8_t *p, int bits, v8i *lo, v8i *hi) {
    memcpy(lo, p, sizeof *lo);
    if (bits == 4) {
        *hi = (*lo >> 4) & 0x0F0F0F0F;
        *lo &= 0x0F0F0F0F;
    } else {
        memcpy(hi, p + sizeof *lo, sizeof *hi);
    }
}

/* The 8 weight vectors (8 rows each) of padded columns k .. k + 7 starting at byte p. */
static inline void unpack(const uint8_t *p, int bits, v8f w[KSTEP]) {
    v8i lo, hi;
    load_chunk(p, bits, &lo, &hi);
    for (int j = 0; j < 4; j++) {
        w[j] = __builtin_convertvector((lo >> (8 * j)) & 255, v8f);
        w[j + 4] = __builtin_convertvector((hi >> (8 * j)) & 255, v8f);
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

/* ---- int8 activations ----
 * pq_matmul_i8 quantizes each row of x per weight group to int8, symmetric: d = max|x| / 127,
 * q = round(x / d) (as x * (127 / max|x|), to nearest even), and keeps xs = d * sum q. Then
 *   y[i, n] = sum_g s[n, g] d[i, g] sum_{k in g} v[n, k] q[i, k] + o[n, g] xs[i, g],
 * the inner sums exact in int32 (u8 weights x s8 activations), as llama.cpp's Q4_1 x Q8_1.
 * Using d * sum q, not sum x, for the offset term makes the error sum_k w_k (x_k - d q_k),
 * of the centred weights w rather than of the unsigned values v. */

/* VNNI sums 4 u8 x s8 products into each int32 lane without intermediate saturation, for
 * 4- and 8-bit weights; AVX2's maddubs saturates pairs at int16, safe for 4 bits only
 * (2 * 15 * 127 = 3810), so without VNNI 8-bit weights keep the float kernels. The portable
 * dot product is exact for both (its speed against the float kernels is unmeasured). */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define I8_VNNI 1
#else
#define I8_VNNI 0
#endif
#if defined(__AVX2__) && !I8_VNNI
#define I8_BITS_MASK 4
#else
#define I8_BITS_MASK (4 | 8)
#endif

#define I8_MR 4 /* rows of x per micro-tile */
/* Blocks of 8 weight rows per micro-tile. With AVX-512VL's 32 vector registers, 3 (mean 586
 * GFLOP/s on the default model's shapes against 515 for 2); with 16, 3 spill and fall to 125
 * while 2 keep 531 (AVX-VNNI) or 394 (maddubs). */
#ifdef __AVX512VL__
#define I8_NB 3
#else
#define I8_NB 2
#endif
/* Quantized rows of x per M tile: they stream from L2 once per micro-tile of weight blocks
 * (whose few KiB stay in L1), so a tile takes half of a conservative 256 KiB L2. */
#define I8_X_TILE_BYTES (128 * 1024)

/* Bit b set: this build's pq_matmul_i8 takes b-bit weights. */
int pq_i8_bits_mask(void) { return I8_BITS_MASK; }

/* acc + in each int32 lane, the dot product of lo's 4 bytes (u8) with xlo's (s8) plus hi's
 * with xhi's. */
static inline v8i dot8(v8i acc, v8i lo, v8i xlo, v8i hi, v8i xhi) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    acc = (v8i)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)lo, (__m256i)xlo);
    return (v8i)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)hi, (__m256i)xhi);
#elif I8_VNNI
    acc = (v8i)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)lo, (__m256i)xlo);
    return (v8i)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)hi, (__m256i)xhi);
#elif defined(__AVX2__)
    /* Each maddubs pair is at most 3810 with 4-bit weights, so two add in int16. */
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16((__m256i)lo, (__m256i)xlo),
                                     _mm256_maddubs_epi16((__m256i)hi, (__m256i)xhi));
    return acc + (v8i)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#else
    for (int j = 0; j < 4; j++) {
        int sh = 8 * j;
        acc += ((lo >> sh) & 255) * ((xlo << (24 - sh)) >> 24);
        acc += ((hi >> sh) & 255) * ((xhi << (24 - sh)) >> 24);
    }
    return acc;
#endif
}

/* Row i of x quantized into q (padded layout, zeros in the gaps), d and xs per group. */
static void quantize_row(const Shape *s, const float *row, int8_t *q, float *d, float *xs) {
    memset(q, 0, s->kp);
    for (int g = 0; g < s->n_groups; g++) {
        int start = g * s->group_size;
        int len = s->k - start < s->group_size ? s->k - start : s->group_size;
        /* max|x| as the largest of the sign-cleared bit patterns, which order as the floats
         * do: an integer max reduction vectorizes, a float one (NaN rules) does not. */
        uint32_t abits = 0;
        for (int j = 0; j < len; j++) {
            uint32_t b;
            memcpy(&b, row + start + j, sizeof b);
            b &= 0x7fffffffu;
            abits = b > abits ? b : abits;
        }
        float amax;
        memcpy(&amax, &abits, sizeof amax);
        float inv = amax > 0 ? 127.0f / amax : 0.0f;
        int8_t *qg = q + g * s->group_stride;
        int sum = 0;
        for (int j = 0; j < len; j++) {
            qg[j] = (int8_t)__builtin_rintf(row[start + j] * inv);
            sum += qg[j];
        }
        d[g] = amax / 127.0f;
        xs[g] = d[g] * (float)sum;
    }
}

/* Rows [0, mr) of q against blocks [0, nb) starting at wq (their scales and offsets at sc,
 * of); q rows have stride kp, d and xs rows n_groups. Inlined with constant mr, nb and bits
 * so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void i8_tile(
    const Shape *s, const uint8_t *wq, const float *sc, const float *of, const int8_t *q,
    const float *d, const float *xs, int mr, int nb, int bits, v8f out[I8_MR][I8_NB]) {
    size_t meta_stride = (size_t)s->n_groups * LANES;
    for (int m = 0; m < mr; m++)
        for (int b = 0; b < nb; b++) out[m][b] = (v8f){0};
    for (int g = 0, k0 = 0; g < s->n_groups; g++, k0 += s->group_stride) {
        v8i acc[I8_MR][I8_NB];
        for (int m = 0; m < mr; m++)
            for (int b = 0; b < nb; b++) acc[m][b] = (v8i){0};
        for (int k = k0; k < k0 + group_len(s, g); k += KSTEP) {
            v8i lo[I8_NB], hi[I8_NB];
            for (int b = 0; b < nb; b++)
                load_chunk(wq + (size_t)b * s->block_bytes + (size_t)k * bits, bits, &lo[b],
                           &hi[b]);
            for (int m = 0; m < mr; m++) {
                int32_t x4[2];
                memcpy(x4, q + (size_t)m * s->kp + k, sizeof x4);
                v8i xlo = (v8i){0} + x4[0], xhi = (v8i){0} + x4[1];
                for (int b = 0; b < nb; b++) acc[m][b] = dot8(acc[m][b], lo[b], xlo, hi[b], xhi);
            }
        }
        for (int b = 0; b < nb; b++) {
            v8f scale, offset;
            memcpy(&scale, sc + b * meta_stride + g * LANES, sizeof scale);
            memcpy(&offset, of + b * meta_stride + g * LANES, sizeof offset);
            for (int m = 0; m < mr; m++) {
                const float *dm = d + (size_t)m * s->n_groups, *xm = xs + (size_t)m * s->n_groups;
                out[m][b] += __builtin_convertvector(acc[m][b], v8f) * (scale * dm[g])
                             + offset * xm[g];
            }
        }
    }
}

#define I8_CASE(MRC, NBC, BITS)                                                             \
    i8_tile(s, wq, sc, of, q + (size_t)m0 * s->kp, d + (size_t)m0 * s->n_groups,            \
            xs + (size_t)m0 * s->n_groups, MRC, NBC, BITS, out)
#define I8_MR_CASES(NBC, BITS)                                                              \
    do {                                                                                    \
        if (mr == 4) I8_CASE(4, NBC, BITS);                                                 \
        else if (mr == 3) I8_CASE(3, NBC, BITS);                                            \
        else if (mr == 2) I8_CASE(2, NBC, BITS);                                            \
        else I8_CASE(1, NBC, BITS);                                                         \
    } while (0)

/* nb is I8_NB but in the last tile of blocks, where 1 or 2 remain. */
#define I8_NB_CASES(BITS)                                                                   \
    do {                                                                                    \
        if (nb == I8_NB) I8_MR_CASES(I8_NB, BITS);                                          \
        else if (nb == 2) I8_MR_CASES(2, BITS);                                             \
        else I8_MR_CASES(1, BITS);                                                          \
    } while (0)

/* Blocks [b0, b0 + nb) of W against rows [m0, m1) of x, I8_MR rows at a time. */
static void i8_blocks(const Shape *s, const uint8_t *wq_all, const float *scales,
                      const float *offsets, int b0, int nb, const int8_t *q, const float *d,
                      const float *xs, int m0, int m1, float *y) {
    const uint8_t *wq = wq_all + (size_t)b0 * s->block_bytes;
    const float *sc = scales + (size_t)b0 * s->n_groups * LANES;
    const float *of = offsets + (size_t)b0 * s->n_groups * LANES;
    for (; m0 < m1; m0 += I8_MR) {
        int mr = m1 - m0 < I8_MR ? m1 - m0 : I8_MR;
        v8f out[I8_MR][I8_NB];
        if (s->bits == 4) I8_NB_CASES(4);
        else I8_NB_CASES(8);
        for (int r = 0; r < mr; r++)
            for (int b = 0; b < nb; b++) {
                int n0 = (b0 + b) * LANES;
                store_block(out[r][b], y + (size_t)(m0 + r) * s->n + n0,
                            s->n - n0 < LANES ? s->n - n0 : LANES);
            }
    }
}

/* y [m, n] = x [m, k] @ W^T through int8 activations (see above); bits must be in
 * pq_i8_bits_mask(). Returns 0, or -1 if scratch memory could not be allocated. */
int pq_matmul_i8(const uint8_t *wq, const float *scales, const float *offsets, int n, int k,
                 int bits, int group_size, const float *x, int m, float *y, int threads) {
    Shape s = shape_of(n, k, bits, group_size);
    size_t metas = (size_t)m * s.n_groups;
    float *d = malloc(sizeof(float) * 2 * metas + (size_t)m * s.kp);
    if (!d) return -1;
    float *xs = d + metas;
    int8_t *q = (int8_t *)(xs + metas);
    int blocks = (n + LANES - 1) / LANES, tiles = (blocks + I8_NB - 1) / I8_NB;
    int mt = I8_X_TILE_BYTES / s.kp / I8_MR * I8_MR;
    mt = mt < I8_MR ? I8_MR : mt;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int i = 0; i < m; i++)
            quantize_row(&s, x + (size_t)i * k, q + (size_t)i * s.kp, d + (size_t)i * s.n_groups,
                         xs + (size_t)i * s.n_groups);
        for (int m0 = 0; m0 < m; m0 += mt) {
            int m1 = m0 + mt < m ? m0 + mt : m;
#pragma omp for schedule(static)
            for (int t = 0; t < tiles; t++) {
                int b0 = t * I8_NB, nb = blocks - b0 < I8_NB ? blocks - b0 : I8_NB;
                i8_blocks(&s, wq, scales, offsets, b0, nb, q, d, xs, m0, m1, y);
            }
        }
    }
    free(d);
    return 0;
}
