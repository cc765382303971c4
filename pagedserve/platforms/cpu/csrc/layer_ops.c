/* A decoder layer's small float32 ops on the CPU, one call each where torch runs several.

   Strides are in elements. Every row's last dimension is contiguous; other dimensions may be
   strided (q, k and v are views of the fused qkv projection).

   The paged KV cache of one layer is [2, num_blocks, block_size, num_kv_heads, head_dim]
   contiguous: token j of sequence i sits in slot
   s = block_tables[i * bt_stride + j / block_size] * block_size + j % block_size,
   its key at key_cache + (s * num_kv_heads + kv_head) * head_dim, its value likewise. Its
   elements are float32 or bfloat16 (the upper half of a float32: the same exponent range);
   bfloat16 rows are widened to float32 as a chunk of them is read, so attention runs in
   float32 either way. */

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Below this many elements an op runs on one thread: waking the pool costs more. */
#define PARALLEL_MIN 32768
/* Keys scored per softmax rescale in decode attention. */
#define CHUNK 32

/* exp(x) to within a few float32 ulps (Cephes' expf): x = n ln2 + r, |r| <= ln2 / 2, and a
   degree-6 polynomial for exp(r). Unlike libm's expf it inlines, so loops over it vectorise.
   Inputs are clamped to [-87.3, 88.3], which keeps 2^n a normal float: exp(-inf) is ~1e-38,
   not 0, which every caller tolerates. */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.3f ? 88.3f : x;
    /* Round to nearest by adding 1.5 * 2^23: floorf is a libm call, which stops vectorising. */
    float n = (x * 1.44269504f + 12582912.f) - 12582912.f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* residual != NULL: residual += x, out = weight * normalise(residual).
   residual == NULL: out = weight * normalise(x). */
void lo_rms_norm(const float *x, long x_stride, float *residual, long r_stride,
                 const float *weight, float eps, float *out, long o_stride, int rows,
                 int hidden, int threads) {
#pragma omp parallel for num_threads(threads) if ((long)rows * hidden >= PARALLEL_MIN)
    for (int t = 0; t < rows; t++) {
        const float *xr = x + t * x_stride;
        float *o = out + t * o_stride;
        const float *h = xr;
        if (residual) {
            float *r = residual + t * r_stride;
#pragma omp simd
            for (int i = 0; i < hidden; i++) r[i] += xr[i];
            h = r;
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < hidden; i++) sum += h[i] * h[i];
        float inv = 1.f / sqrtf(sum / hidden + eps);
#pragma omp simd
        for (int i = 0; i < hidden; i++) o[i] = weight[i] * (h[i] * inv);
    }
}

static void silu_mul_row(const float *restrict g, const float *restrict u,
                         float *restrict o, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
}

/* x [rows, 2 * inter] (gate | up) -> out [rows, inter] = silu(gate) * up. */
void lo_silu_and_mul(const float *x, long x_stride, float *out, long o_stride, int rows,
                     int inter, int threads) {
#pragma omp parallel for num_threads(threads) if ((long)rows * inter >= PARALLEL_MIN)
    for (int t = 0; t < rows; t++) {
        const float *g = x + t * x_stride;
        silu_mul_row(g, g + inter, out + t * o_stride, inter);
    }
}

static void rotate_heads(float *x, long s1, int heads, int half, const float *c,
                         const float *s) {
    for (int h = 0; h < heads; h++) {
        float *a = x + h * s1, *b = a + half;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            float x1 = a[i], x2 = b[i];
            a[i] = x1 * c[i] - x2 * s[i];
            b[i] = x2 * c[i] + x1 * s[i];
        }
    }
}

/* In place, "rotate half" layout: q [rows, heads, dim], k [rows, kv_heads, dim];
   cos/sin [max_positions, dim / 2] contiguous. */
void lo_rotary(const int64_t *positions, float *q, long q_s0, long q_s1, int heads, float *k,
               long k_s0, long k_s1, int kv_heads, const float *cos_t, const float *sin_t,
               int rows, int dim, int threads) {
    int half = dim / 2;
#pragma omp parallel for num_threads(threads) \
    if ((long)rows * (heads + kv_heads) * dim >= PARALLEL_MIN)
    for (int t = 0; t < rows; t++) {
        const float *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;
        rotate_heads(q + t * q_s0, q_s1, heads, half, c, s);
        rotate_heads(k + t * k_s0, k_s1, kv_heads, half, c, s);
    }
}

#define ALWAYS_INLINE inline __attribute__((always_inline))

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Round to nearest even, as torch's .to(torch.bfloat16) does, NaN included (its vectorised
   conversion writes 0xffff). Not AVX512-BF16's vcvtneps2bf16: that flushes subnormals to
   zero. Only the step's new rows are converted, so a scalar loop is cheap enough. */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (x != x) return 0xffff;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Row `row` (an element offset) of a float32 or bfloat16 cache := src, rounded. */
static inline void store_row(void *cache, long row, const float *src, int dim, int bf16) {
    if (!bf16) {
        memcpy((float *)cache + row, src, sizeof(float) * dim);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + row;
    for (int d = 0; d < dim; d++) dst[d] = f32_to_bf16(src[d]);
}

static ALWAYS_INLINE void widen_row(float *restrict dst, const uint16_t *restrict src,
                                    int dim) {
#pragma omp simd
    for (int d = 0; d < dim; d++) dst[d] = bf16_to_f32(src[d]);
}

/* Key and value row pointers of tokens j0 .. j0 + n - 1 of one sequence's kv head: into the
   cache if it is float32; if bf16, into `widened` ([n][2][dim]), where the rows are widened
   once for every query head of the group that reads them. Always inlined with a constant
   bf16, so the float32 path is the plain pointer walk. */
static ALWAYS_INLINE void chunk_rows(const void *key_cache, const void *value_cache,
                                     const int32_t *table, int j0, int n, int block_size,
                                     int kv_heads, int kv_head, int dim, int bf16,
                                     float *widened, const float **krow, const float **vrow) {
    int block = j0 / block_size, offset = j0 % block_size;
    long base = (long)table[block] * block_size;
    for (int c = 0; c < n; c++) {
        long row = ((base + offset) * kv_heads + kv_head) * dim;
        if (bf16) {
            float *k = widened + 2L * c * dim;
            widen_row(k, (const uint16_t *)key_cache + row, dim);
            widen_row(k + dim, (const uint16_t *)value_cache + row, dim);
            krow[c] = k;
            vrow[c] = k + dim;
        } else {
            krow[c] = (const float *)key_cache + row;
            vrow[c] = (const float *)value_cache + row;
        }
        if (++offset == block_size && c + 1 < n) {
            offset = 0;
            base = (long)table[++block] * block_size;
        }
    }
}

static inline float dot(const float *a, const float *b, int dim) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int d = 0; d < dim; d++) sum += a[d] * b[d];
    return sum;
}

#ifdef __AVX2__
#include <immintrin.h>

/* The eight horizontal sums of a[0..7], as one vector. */
static inline __m256 sum8x8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                         _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* scores[c] = scale * q . krow[c]: eight keys at a time, each into its own accumulator, so
   the FMAs do not wait on each other and one transpose-add reduces all eight. */
static inline void chunk_scores(const float *q, const float *const *krow, int n, int dim,
                                float scale, float *scores) {
    int c = 0;
    if (dim % 8 == 0) {
        for (; c + 8 <= n; c += 8) {
            __m256 a[8];
            for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
            for (int d = 0; d < dim; d += 8) {
                __m256 qd = _mm256_loadu_ps(q + d);
                for (int t = 0; t < 8; t++)
                    a[t] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(krow[c + t] + d), a[t]);
            }
            _mm256_storeu_ps(scores + c, _mm256_mul_ps(sum8x8(a), _mm256_set1_ps(scale)));
        }
    }
    for (; c < n; c++) scores[c] = scale * dot(q, krow[c], dim);
}

/* acc += sum over c of p[c] * vrow[c], 64 columns of acc at a time in eight registers, so
   the FMAs of one key are independent. Written out because GCC otherwise vectorises across
   c with gathers, which are several times slower. */
static inline void chunk_values(float *acc, const float *const *vrow, const float *p, int n,
                                int dim) {
    if (dim % 8) {
        for (int c = 0; c < n; c++) {
#pragma omp simd
            for (int d = 0; d < dim; d++) acc[d] += p[c] * vrow[c][d];
        }
        return;
    }
    for (int d0 = 0; d0 < dim; d0 += 64) {
        int w = dim - d0 < 64 ? (dim - d0) / 8 : 8;
        __m256 a[8];
        for (int t = 0; t < w; t++) a[t] = _mm256_loadu_ps(acc + d0 + 8 * t);
        for (int c = 0; c < n; c++) {
            __m256 pc = _mm256_set1_ps(p[c]);
            const float *vr = vrow[c] + d0;
            for (int t = 0; t < w; t++)
                a[t] = _mm256_fmadd_ps(pc, _mm256_loadu_ps(vr + 8 * t), a[t]);
        }
        for (int t = 0; t < w; t++) _mm256_storeu_ps(acc + d0 + 8 * t, a[t]);
    }
}
#else
static inline void chunk_scores(const float *q, const float *const *krow, int n, int dim,
                                float scale, float *scores) {
    for (int c = 0; c < n; c++) scores[c] = scale * dot(q, krow[c], dim);
}

static inline void chunk_values(float *acc, const float *const *vrow, const float *p, int n,
                                int dim) {
    for (int c = 0; c < n; c++) {
#pragma omp simd
        for (int d = 0; d < dim; d++) acc[d] += p[c] * vrow[c][d];
    }
}
#endif

/* One sequence, query heads h0 .. h0 + nh - 1 (q rows q_s1 apart, out rows dim apart), all
   reading kv head kv_head: online softmax over the keys, CHUNK keys per rescale. Each chunk's
   keys and values serve every head of the group while they are in L1. Always inlined, so
   the calls below with a constant dim unroll the loops over it, and a constant bf16 picks
   how chunk_rows reads the cache. */
static ALWAYS_INLINE void attend_heads(
        const float *q, long q_s1, int nh, const void *key_cache, const void *value_cache,
        const int32_t *table, int seq_len, int block_size, int kv_heads, int kv_head, int dim,
        int bf16, float scale, float *out) {
    float acc[nh * dim], m[nh], l[nh], scores[CHUNK], widened[bf16 ? 2 * CHUNK * dim : 1];
    const float *krow[CHUNK], *vrow[CHUNK];
    for (int d = 0; d < nh * dim; d++) acc[d] = 0.f;
    for (int h = 0; h < nh; h++) m[h] = -INFINITY, l[h] = 0.f;
    for (int j0 = 0; j0 < seq_len; j0 += CHUNK) {
        int n = seq_len - j0 < CHUNK ? seq_len - j0 : CHUNK;
        chunk_rows(key_cache, value_cache, table, j0, n, block_size, kv_heads, kv_head, dim,
                   bf16, widened, krow, vrow);
        for (int h = 0; h < nh; h++) {
            float *a = acc + h * dim;
            chunk_scores(q + h * q_s1, krow, n, dim, scale, scores);
            float chunk_max = -INFINITY, sum = 0.f;
            for (int c = 0; c < n; c++) chunk_max = scores[c] > chunk_max ? scores[c] : chunk_max;
            if (chunk_max > m[h]) {
                float correction = exp_approx(m[h] - chunk_max);  /* ~0 on the first chunk */
                l[h] *= correction;
                for (int d = 0; d < dim; d++) a[d] *= correction;
                m[h] = chunk_max;
            }
            float mh = m[h];
#pragma omp simd reduction(+ : sum)
            for (int c = 0; c < n; c++) {
                scores[c] = exp_approx(scores[c] - mh);
                sum += scores[c];
            }
            l[h] += sum;
            chunk_values(a, vrow, scores, n, dim);
        }
    }
    for (int h = 0; h < nh; h++) {
        float inv = 1.f / l[h];
        for (int d = 0; d < dim; d++) out[h * dim + d] = acc[h * dim + d] * inv;
    }
}

static void attend_heads_any(const float *q, long q_s1, int nh, const void *key_cache,
                             const void *value_cache, const int32_t *table, int seq_len,
                             int block_size, int kv_heads, int kv_head, int dim, int bf16,
                             float scale, float *out) {
#define ATTEND(D, B)                                                                         \
    attend_heads(q, q_s1, nh, key_cache, value_cache, table, seq_len, block_size, kv_heads,  \
                 kv_head, D, B, scale, out)
#define CASE(D)                                                                              \
    case D:                                                                                  \
        if (bf16) ATTEND(D, 1);                                                              \
        else ATTEND(D, 0);                                                                   \
        return;
    switch (dim) {
        CASE(64)
        CASE(128)
    default:
        if (bf16) ATTEND(dim, 1);
        else ATTEND(dim, 0);
    }
#undef CASE
#undef ATTEND
}

/* A decode-only step: q/k/v [seqs, heads or kv_heads, dim], one row per sequence; kv_cache
   is one layer's [2, num_blocks, block_size, kv_heads, dim], float32, or bfloat16 if
   kv_bf16 (k and v rounded to it on the way in). Writes each row's key and value to
   slot_mapping[i], then out [seqs, heads, dim] (contiguous) is attention of q over the
   sequence's seq_lens[i] cached tokens. Query head h reads kv head h / (heads / kv_heads). */
void lo_paged_decode(const float *q, long q_s0, long q_s1, const float *k, long k_s0,
                     long k_s1, const float *v, long v_s0, long v_s1, void *kv_cache,
                     int kv_bf16, long num_blocks, const int64_t *slot_mapping,
                     const int32_t *block_tables, long bt_stride, const int32_t *seq_lens,
                     int seqs, int heads, int kv_heads, int dim, int block_size, float scale,
                     float *out, int threads) {
    void *key_cache = kv_cache;
    void *value_cache = (char *)kv_cache
                        + num_blocks * block_size * kv_heads * dim * (kv_bf16 ? 2 : 4);
    for (int i = 0; i < seqs; i++) {
        for (int h = 0; h < kv_heads; h++) {
            long row = (slot_mapping[i] * kv_heads + h) * dim;
            store_row(key_cache, row, k + i * k_s0 + h * k_s1, dim, kv_bf16);
            store_row(value_cache, row, v + i * v_s0 + h * v_s1, dim, kv_bf16);
        }
    }
    /* Work items are (sequence, kv head, slice of its query heads): whole groups share
       their key and value reads, but groups are split when there are too few to keep every
       thread busy. */
    int group = heads / kv_heads, items = seqs * kv_heads, per = group;
    if (items < 2 * threads) {
        int splits = (2 * threads + items - 1) / items;
        per = (group + splits - 1) / (splits < group ? splits : group);
    }
    int splits = (group + per - 1) / per;
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int w = 0; w < items * splits; w++) {
        int i = w / (kv_heads * splits), g = w / splits % kv_heads, part = w % splits;
        int h0 = g * group + part * per, nh = group - part * per < per ? group - part * per : per;
        attend_heads_any(q + i * q_s0 + h0 * q_s1, q_s1, nh, key_cache, value_cache,
                         block_tables + i * bt_stride, seq_lens[i], block_size, kv_heads, g,
                         dim, kv_bf16, scale, out + ((long)i * heads + h0) * dim);
    }
}
