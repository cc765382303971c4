/* A decoder layer's small float32 ops on the CPU, one call each where torch runs several.

   Strides are in elements. Every row's last dimension is contiguous; other dimensions may be
   strided (q, k and v are views of the fused qkv projection).

   The paged KV cache of one layer is [2, num_blocks, block_size, num_kv_heads, head_dim]
   contiguous: token j of sequence i sits in slot
   s = block_tables[i * bt_stride + j / block_size] * block_size + j % block_size,
   its key at key_cache + (s * num_kv_heads + kv_head) * head_dim, its value likewise. Its
   elements are float32 or bfloat16 (the upper half of a float32: the same exponent range);
   bfloat16 rows are widened to float32 as a chunk of them is read, so attention runs in
   float32 either way.

   The attention kernels take a layer's window and score cap (pagedserve/attention/backend.py):
   window > 0 lets a query at position p see keys p - window + 1 .. p only (0: every key up
   to p); softcap > 0 replaces each scaled score s by softcap * tanh(s / softcap) before the
   softmax (0: none). */

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

/* s[c] = softcap * tanh(scale * s[c] / softcap): Gemma 2's attention score cap. libm's
   tanhf, which does not vectorise, but only capped layers pay for it. */
static inline void cap_scores(float *s, int n, float scale, float softcap) {
    for (int c = 0; c < n; c++) s[c] = softcap * tanhf(scale * s[c] / softcap);
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
   reading kv head kv_head: online softmax over keys start .. seq_len - 1 (start > 0: the
   row's window begins there), CHUNK keys per rescale. Each chunk's
   keys and values serve every head of the group while they are in L1. Always inlined, so
   the calls below with a constant dim unroll the loops over it, and a constant bf16 picks
   how chunk_rows reads the cache. */
static ALWAYS_INLINE void attend_heads(
        const float *q, long q_s1, int nh, const void *key_cache, const void *value_cache,
        const int32_t *table, int start, int seq_len, int block_size, int kv_heads,
        int kv_head, int dim, int bf16, float scale, float softcap, float *out) {
    float acc[nh * dim], m[nh], l[nh], scores[CHUNK], widened[bf16 ? 2 * CHUNK * dim : 1];
    const float *krow[CHUNK], *vrow[CHUNK];
    for (int d = 0; d < nh * dim; d++) acc[d] = 0.f;
    for (int h = 0; h < nh; h++) m[h] = -INFINITY, l[h] = 0.f;
    for (int j0 = start; j0 < seq_len; j0 += CHUNK) {
        int n = seq_len - j0 < CHUNK ? seq_len - j0 : CHUNK;
        chunk_rows(key_cache, value_cache, table, j0, n, block_size, kv_heads, kv_head, dim,
                   bf16, widened, krow, vrow);
        for (int h = 0; h < nh; h++) {
            float *a = acc + h * dim;
            chunk_scores(q + h * q_s1, krow, n, dim, scale, scores);
            if (softcap > 0.f) cap_scores(scores, n, 1.f, softcap);
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
                             const void *value_cache, const int32_t *table, int start,
                             int seq_len, int block_size, int kv_heads, int kv_head, int dim,
                             int bf16, float scale, float softcap, float *out) {
#define ATTEND(D, B)                                                                         \
    attend_heads(q, q_s1, nh, key_cache, value_cache, table, start, seq_len, block_size,     \
                 kv_heads, kv_head, D, B, scale, softcap, out)
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
   sequence's seq_lens[i] cached tokens. Query head h reads kv head h / (heads / kv_heads).
   With `rows` (else NULL), sequence i's row of q, k, v, slot_mapping and out is rows[i]
   instead of i: the one-row sequences of a step whose other rows lo_paged_prefill takes. A
   row's arithmetic depends on its sequence alone, never on the others of the call. Its
   query sits at position seq_lens[i] - 1; window and softcap as at the top of this file. */
void lo_paged_decode(const float *q, long q_s0, long q_s1, const float *k, long k_s0,
                     long k_s1, const float *v, long v_s0, long v_s1, void *kv_cache,
                     int kv_bf16, long num_blocks, const int64_t *slot_mapping,
                     const int32_t *block_tables, long bt_stride, const int32_t *seq_lens,
                     const int64_t *rows, int seqs, int heads, int kv_heads, int dim,
                     int block_size, float scale, int window, float softcap, float *out,
                     int threads) {
    void *key_cache = kv_cache;
    void *value_cache = (char *)kv_cache
                        + num_blocks * block_size * kv_heads * dim * (kv_bf16 ? 2 : 4);
    for (int i = 0; i < seqs; i++) {
        long r = rows ? rows[i] : i;
        for (int h = 0; h < kv_heads; h++) {
            long row = (slot_mapping[r] * kv_heads + h) * dim;
            store_row(key_cache, row, k + r * k_s0 + h * k_s1, dim, kv_bf16);
            store_row(value_cache, row, v + r * v_s0 + h * v_s1, dim, kv_bf16);
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
        long r = rows ? rows[i] : i;
        int start = window > 0 && seq_lens[i] > window ? seq_lens[i] - window : 0;
        attend_heads_any(q + r * q_s0 + h0 * q_s1, q_s1, nh, key_cache, value_cache,
                         block_tables + i * bt_stride, start, seq_lens[i], block_size, kv_heads,
                         g, dim, kv_bf16, scale, softcap, out + (r * heads + h0) * dim);
    }
}

/* Prefill attention, blocked: a work item is one sequence's kv head and a tile of its query
   tokens, whose (token, query head of the group) rows, PREFILL_ROWS or so, attend together
   over the sequence's keys KV_TILE at a time: each tile of keys and values is read (and, if
   bf16, widened) once for all the rows, the scores are a small matrix product, and each row
   keeps its own online softmax. Key tiles start at multiples of KV_TILE from position 0 and a
   row's arithmetic never depends on the other rows of its tile, so a row's result is the
   same however its prompt was chunked or whether its prefix came from the cache. With a
   window the walk starts at the tile holding the first row's first key; a tile a row sees
   nothing of adds exactly nothing to it, so that still holds. */
#define KV_TILE 32
/* 96 rows ran ~10% faster than 48 and as fast as 192 (4 x 512 tokens, 9 / 3 heads of 64,
   2 threads); fewer rows re-read each key tile more often, more grow the stack buffers. */
#define PREFILL_ROWS 96

/* Keys j0 .. j0 + n - 1 of one kv head, transposed into kt [dim][KV_TILE] (columns n.. zero,
   so the score kernel always runs KV_TILE wide), and their value rows (chunk_rows': into the
   cache, or if bf16 into `widened` [n][2][dim]). */
static ALWAYS_INLINE void load_kv_tile(const void *key_cache, const void *value_cache,
                                       const int32_t *table, int j0, int n, int block_size,
                                       int kv_heads, int kv_head, int dim, int bf16,
                                       float *restrict kt, float *widened, const float **vrow) {
    const float *krow[KV_TILE];
    chunk_rows(key_cache, value_cache, table, j0, n, block_size, kv_heads, kv_head, dim, bf16,
               widened, krow, vrow);
    for (int d = 0; d < dim; d++) {
        float *kd = kt + d * KV_TILE;
        for (int c = 0; c < n; c++) kd[c] = krow[c][d];
        for (int c = n; c < KV_TILE; c++) kd[c] = 0.f;
    }
}

/* The prefill micro-kernels are written in GCC's vector extensions rather than intrinsics, so
   one source runs 8 lanes wide on AVX2 (CI's CPUs) and 16 where the build has AVX-512; with
   FMA in the build the multiply-adds contract to FMAs (GCC's default -ffp-contract=fast). */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vec __attribute__((vector_size(LANES * 4)));
/* For loads and stores at any float address, allowed to alias the float arrays, as the
   intrinsics' own unaligned types (__m256_u) are. */
typedef float vec_u __attribute__((vector_size(LANES * 4), aligned(4), may_alias));
#define LOAD(p) (*(const vec_u *)(p))
#define STORE(p, x) (*(vec_u *)(p) = (x))

/* s [R][KV_TILE] = qs [R][dim] . kt: R (at most 6) rows by 2 * LANES keys in 12
   accumulators, each step one broadcast of a query element against two vectors of keys, as
   a GEMM micro-kernel does. R is a constant at every call, so the accumulators stay in
   registers. */
static ALWAYS_INLINE void scores_rows(const float *qs, int R, const float *kt, int dim,
                                      float *s) {
    for (int c0 = 0; c0 < KV_TILE; c0 += 2 * LANES) {
        vec a[6][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = (vec){0};
        for (int d = 0; d < dim; d++) {
            vec k0 = LOAD(kt + d * KV_TILE + c0), k1 = LOAD(kt + d * KV_TILE + c0 + LANES);
            for (int r = 0; r < R; r++) {
                vec b = (vec){0} + qs[r * dim + d];
                a[r][0] += b * k0;
                a[r][1] += b * k1;
            }
        }
        for (int r = 0; r < R; r++) {
            STORE(s + r * KV_TILE + c0, a[r][0]);
            STORE(s + r * KV_TILE + c0 + LANES, a[r][1]);
        }
    }
}

/* acc [R][dim] += p [R][KV_TILE] . the tile's first n value rows, 2 * LANES columns of R
   rows at a time in registers across the n keys. dim is a multiple of 2 * LANES here. */
static ALWAYS_INLINE void values_rows(float *acc, int R, const float *p,
                                      const float *const *vrow, int n, int dim) {
    for (int d0 = 0; d0 < dim; d0 += 2 * LANES) {
        vec a[6][2];
        for (int r = 0; r < R; r++) {
            a[r][0] = LOAD(acc + r * dim + d0);
            a[r][1] = LOAD(acc + r * dim + d0 + LANES);
        }
        for (int c = 0; c < n; c++) {
            vec v0 = LOAD(vrow[c] + d0), v1 = LOAD(vrow[c] + d0 + LANES);
            for (int r = 0; r < R; r++) {
                vec b = (vec){0} + p[r * KV_TILE + c];
                a[r][0] += b * v0;
                a[r][1] += b * v1;
            }
        }
        for (int r = 0; r < R; r++) {
            STORE(acc + r * dim + d0, a[r][0]);
            STORE(acc + r * dim + d0 + LANES, a[r][1]);
        }
    }
}

/* The M rows six at a time, the remainder through a switch so R stays a constant. */
#define SIX_ROWS(CALL, M)                                                                    \
    do {                                                                                     \
        int r0_ = 0;                                                                         \
        for (; r0_ + 6 <= (M); r0_ += 6) CALL(r0_, 6);                                       \
        switch ((M) - r0_) {                                                                 \
        case 5: CALL(r0_, 5); break;                                                         \
        case 4: CALL(r0_, 4); break;                                                         \
        case 3: CALL(r0_, 3); break;                                                         \
        case 2: CALL(r0_, 2); break;                                                         \
        case 1: CALL(r0_, 1); break;                                                         \
        }                                                                                    \
    } while (0)

/* Head dims that are not a multiple of 2 * LANES take plain loops. */
static ALWAYS_INLINE void tile_scores(const float *qs, int M, const float *kt, int dim,
                                      float *s) {
    if (dim % (2 * LANES) == 0) {
#define SCORES(R0, R) scores_rows(qs + (R0) * dim, R, kt, dim, s + (R0) * KV_TILE)
        SIX_ROWS(SCORES, M);
#undef SCORES
        return;
    }
    for (int r = 0; r < M; r++) {
        float *sr = s + r * KV_TILE;
        for (int c = 0; c < KV_TILE; c++) sr[c] = 0.f;
        for (int d = 0; d < dim; d++) {
            float x = qs[r * dim + d];
#pragma omp simd
            for (int c = 0; c < KV_TILE; c++) sr[c] += x * kt[d * KV_TILE + c];
        }
    }
}

static ALWAYS_INLINE void tile_values(float *acc, int M, const float *p,
                                      const float *const *vrow, int n, int dim) {
    if (dim % (2 * LANES) == 0) {
#define VALUES(R0, R) values_rows(acc + (R0) * dim, R, p + (R0) * KV_TILE, vrow, n, dim)
        SIX_ROWS(VALUES, M);
#undef VALUES
        return;
    }
    for (int r = 0; r < M; r++)
        for (int c = 0; c < n; c++) {
            float pc = p[r * KV_TILE + c];
#pragma omp simd
            for (int d = 0; d < dim; d++) acc[r * dim + d] += pc * vrow[c][d];
        }
}
#undef SIX_ROWS

/* One work item: tokens t0 .. t0 + tokens - 1 of a sequence (q and out point at token t0's
   first query head of the group, out rows heads * dim apart), the first of them at position
   p0, and the `group` query heads that read kv head kv_head. Row r is token r / group, head
   r % group; it sees keys 0 .. p0 + r / group (with a window, the last `window` of them).
   Always inlined with a constant dim and bf16, as attend_heads is. */
static ALWAYS_INLINE void prefill_tile(
        const float *q, long q_s0, long q_s1, int tokens, int group, int p0,
        const void *key_cache, const void *value_cache, const int32_t *table, int block_size,
        int kv_heads, int kv_head, int dim, int bf16, float scale, int window, float softcap,
        float *out, long out_s0) {
    int M = tokens * group, kv_end = p0 + tokens;
    float qs[M * dim], acc[M * dim], s[M * KV_TILE], kt[dim * KV_TILE], m[M], l[M];
    float widened[bf16 ? 2 * KV_TILE * dim : 1];
    const float *vrow[KV_TILE];
    for (int r = 0; r < M; r++) {
        memcpy(qs + r * dim, q + r / group * q_s0 + r % group * q_s1, sizeof(float) * dim);
        m[r] = -INFINITY, l[r] = 0.f;
    }
    for (int d = 0; d < M * dim; d++) acc[d] = 0.f;
    int first_key = window > 0 && p0 >= window ? p0 - window + 1 : 0;
    for (int j0 = first_key / KV_TILE * KV_TILE; j0 < kv_end; j0 += KV_TILE) {
        int n = kv_end - j0 < KV_TILE ? kv_end - j0 : KV_TILE;
        load_kv_tile(key_cache, value_cache, table, j0, n, block_size, kv_heads, kv_head, dim,
                     bf16, kt, widened, vrow);
        tile_scores(qs, M, kt, dim, s);
        for (int r = 0; r < M; r++) {
            /* Keys past the row's position (or past the tile's n), and before its window, get
               probability 0: exp_approx never returns 0, so the mask cannot be a score of
               -inf. Columns from..seen - 1 are the row's. */
            float *sr = s + r * KV_TILE, row_max = -INFINITY, sum = 0.f;
            int seen = p0 + r / group - j0 + 1;
            seen = seen < n ? seen : n;
            int from = window > 0 ? p0 + r / group - window + 1 - j0 : 0;
            if (softcap > 0.f) cap_scores(sr, KV_TILE, scale, softcap);
            float mul = softcap > 0.f ? 1.f : scale;  /* capped scores are scaled already */
            /* All KV_TILE lanes with a select, not a loop to `seen`: that one stays scalar,
               and was as slow as the two matrix products together. */
#pragma omp simd reduction(max : row_max)
            for (int c = 0; c < KV_TILE; c++) {
                sr[c] *= mul;
                float x = c >= from && c < seen ? sr[c] : -INFINITY;
                row_max = x > row_max ? x : row_max;
            }
            if (row_max > m[r]) {  /* never on a tile the row sees nothing of */
                float correction = exp_approx(m[r] - row_max);  /* ~0 on the first tile */
                l[r] *= correction;
                for (int d = 0; d < dim; d++) acc[r * dim + d] *= correction;
                m[r] = row_max;
            }
            float mr = m[r];
#pragma omp simd reduction(+ : sum)
            for (int c = 0; c < KV_TILE; c++) {
                sr[c] = c >= from && c < seen ? exp_approx(sr[c] - mr) : 0.f;
                sum += sr[c];
            }
            l[r] += sum;
        }
        tile_values(acc, M, s, vrow, n, dim);
    }
    for (int r = 0; r < M; r++) {
        float inv = 1.f / l[r], *o = out + r / group * out_s0 + r % group * dim;
        for (int d = 0; d < dim; d++) o[d] = acc[r * dim + d] * inv;
    }
}

static void prefill_tile_any(const float *q, long q_s0, long q_s1, int tokens, int group,
                             int p0, const void *key_cache, const void *value_cache,
                             const int32_t *table, int block_size, int kv_heads, int kv_head,
                             int dim, int bf16, float scale, int window, float softcap,
                             float *out, long out_s0) {
#define TILE(D, B)                                                                           \
    prefill_tile(q, q_s0, q_s1, tokens, group, p0, key_cache, value_cache, table,            \
                 block_size, kv_heads, kv_head, D, B, scale, window, softcap, out, out_s0)
#define CASE(D)                                                                              \
    case D:                                                                                  \
        if (bf16) TILE(D, 1);                                                                \
        else TILE(D, 0);                                                                     \
        return;
    switch (dim) {
        CASE(64)
        CASE(128)
    default:
        if (bf16) TILE(dim, 1);
        else TILE(dim, 0);
    }
#undef CASE
#undef TILE
}

/* The last c in [0, count) with starts[c] <= n (starts ascending, starts[0] <= n). */
static int last_at_most(const int *starts, int count, int n) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (starts[mid] <= n) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Any step: sequence i owns query rows query_start_loc[i] .. query_start_loc[i + 1] - 1, the
   last of its seq_lens[i] tokens (those before them are cached). q/k/v [rows, heads or
   kv_heads, dim], kv_cache and block tables as in lo_paged_decode. Writes every row's key and
   value to slot_mapping[row], then out [rows, heads, dim] (contiguous) is causal attention:
   a row at position p sees the sequence's keys 0 .. p (window and softcap as at the top of
   this file). With `seq_ids` (else NULL), only sequences seq_ids[0 .. count - 1] are
   written and attended (their rows of out alone). */
void lo_paged_prefill(const float *q, long q_s0, long q_s1, const float *k, long k_s0,
                      long k_s1, const float *v, long v_s0, long v_s1, void *kv_cache,
                      int kv_bf16, long num_blocks, const int64_t *slot_mapping,
                      const int32_t *block_tables, long bt_stride,
                      const int32_t *query_start_loc, const int32_t *seq_lens, int seqs,
                      const int32_t *seq_ids, int count, int heads, int kv_heads, int dim,
                      int block_size, float scale, int window, float softcap, float *out,
                      int threads) {
    void *key_cache = kv_cache;
    void *value_cache = (char *)kv_cache
                        + num_blocks * block_size * kv_heads * dim * (kv_bf16 ? 2 : 4);
    if (!seq_ids) count = seqs;
    /* first_row[c]: the step's rows of the first c chosen sequences (contiguous when all are
       chosen); first[c]: their work items, which go kv head fastest, then a sequence's tiles
       last to first, so the dynamic schedule starts the longest (latest) tiles first. */
    int group = heads / kv_heads, tile = PREFILL_ROWS / group > 1 ? PREFILL_ROWS / group : 1;
    int first[count + 1], first_row[count + 1];
    first[0] = first_row[0] = 0;
    for (int c = 0; c < count; c++) {
        int i = seq_ids ? seq_ids[c] : c, len = query_start_loc[i + 1] - query_start_loc[i];
        first[c + 1] = first[c] + (len + tile - 1) / tile * kv_heads;
        first_row[c + 1] = first_row[c] + len;
    }
    int rows = first_row[count];
#pragma omp parallel for num_threads(threads) if ((long)rows * kv_heads * dim >= PARALLEL_MIN)
    for (int n = 0; n < rows; n++) {
        long t = n;
        if (seq_ids) {  /* in the chosen sequence that holds the n-th chosen row */
            int c = last_at_most(first_row, count, n);
            t = query_start_loc[seq_ids[c]] + n - first_row[c];
        }
        for (int h = 0; h < kv_heads; h++) {
            long row = (slot_mapping[t] * kv_heads + h) * dim;
            store_row(key_cache, row, k + t * k_s0 + h * k_s1, dim, kv_bf16);
            store_row(value_cache, row, v + t * v_s0 + h * v_s1, dim, kv_bf16);
        }
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int w = 0; w < first[count]; w++) {
        int c = last_at_most(first, count, w);  /* the chosen sequence */
        int i = seq_ids ? seq_ids[c] : c, start = query_start_loc[i];
        int len = query_start_loc[i + 1] - start;
        int tiles = (len + tile - 1) / tile, g = (w - first[c]) % kv_heads;
        int t0 = (tiles - 1 - (w - first[c]) / kv_heads) * tile;
        int tokens = len - t0 < tile ? len - t0 : tile;
        long r0 = start + t0;
        prefill_tile_any(q + r0 * q_s0 + (long)g * group * q_s1, q_s0, q_s1, tokens, group,
                         seq_lens[i] - len + t0, key_cache, value_cache,
                         block_tables + i * bt_stride, block_size, kv_heads, g, dim, kv_bf16,
                         scale, window, softcap, out + (r0 * heads + (long)g * group) * dim,
                         (long)heads * dim);
    }
}
