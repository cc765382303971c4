/* A decoder layer's small float32 ops on the CPU, one call each where torch runs several.

   Strides are in elements. Every row's last dimension is contiguous; other dimensions may be
   strided (q, k and v are views of the fused qkv projection).

   The paged KV cache of one layer is [2, num_blocks, block_size, num_kv_heads, head_dim]
   contiguous: token j of sequence i sits in slot
   s = block_tables[i * bt_stride + j / block_size] * block_size + j % block_size,
   its key at key_cache + (s * num_kv_heads + kv_head) * head_dim, its value likewise. */

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Below this many elements an op runs on one thread: waking the pool costs more. */
#define PARALLEL_MIN 32768
/* Keys scored per softmax rescale in decode attention. */
#define CHUNK 32

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

/* x [rows, 2 * inter] (gate | up) -> out [rows, inter] = silu(gate) * up. */
void lo_silu_and_mul(const float *x, long x_stride, float *out, long o_stride, int rows,
                     int inter, int threads) {
#pragma omp parallel for num_threads(threads) if ((long)rows * inter >= PARALLEL_MIN)
    for (int t = 0; t < rows; t++) {
        const float *g = x + t * x_stride, *u = g + inter;
        float *o = out + t * o_stride;
        for (int i = 0; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
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

/* One sequence, one query head: online softmax over the keys, CHUNK keys per rescale. */
static void attend_head(const float *q, const float *key_cache, const float *value_cache,
                        const int32_t *table, int seq_len, int block_size, int kv_heads,
                        int kv_head, int dim, float scale, float *out) {
    float acc[dim], scores[CHUNK];
    memset(acc, 0, sizeof(float) * dim);
    float m = -INFINITY, l = 0.f;
    for (int j0 = 0; j0 < seq_len; j0 += CHUNK) {
        int n = seq_len - j0 < CHUNK ? seq_len - j0 : CHUNK;
        const float *vrow[CHUNK];
        float chunk_max = -INFINITY;
        for (int c = 0; c < n; c++) {
            int j = j0 + c;
            long slot = (long)table[j / block_size] * block_size + j % block_size;
            long row = (slot * kv_heads + kv_head) * dim;
            const float *kr = key_cache + row;
            vrow[c] = value_cache + row;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < dim; d++) dot += q[d] * kr[d];
            scores[c] = dot * scale;
            if (scores[c] > chunk_max) chunk_max = scores[c];
        }
        if (chunk_max > m) {
            float correction = expf(m - chunk_max);  /* 0 on the first chunk */
            l *= correction;
#pragma omp simd
            for (int d = 0; d < dim; d++) acc[d] *= correction;
            m = chunk_max;
        }
        for (int c = 0; c < n; c++) {
            float p = expf(scores[c] - m);
            const float *vr = vrow[c];
            l += p;
#pragma omp simd
            for (int d = 0; d < dim; d++) acc[d] += p * vr[d];
        }
    }
    float inv = 1.f / l;
    for (int d = 0; d < dim; d++) out[d] = acc[d] * inv;
}

/* A decode-only step: q/k/v [seqs, heads or kv_heads, dim], one row per sequence. Writes
   each row's key and value to slot_mapping[i], then out [seqs, heads, dim] (contiguous) is
   attention of q over the sequence's seq_lens[i] cached tokens. Query head h reads kv head
   h / (heads / kv_heads). */
void lo_paged_decode(const float *q, long q_s0, long q_s1, const float *k, long k_s0,
                     long k_s1, const float *v, long v_s0, long v_s1, float *key_cache,
                     float *value_cache, const int64_t *slot_mapping,
                     const int32_t *block_tables, long bt_stride, const int32_t *seq_lens,
                     int seqs, int heads, int kv_heads, int dim, int block_size, float scale,
                     float *out, int threads) {
    for (int i = 0; i < seqs; i++) {
        for (int h = 0; h < kv_heads; h++) {
            long row = (slot_mapping[i] * kv_heads + h) * dim;
            memcpy(key_cache + row, k + i * k_s0 + h * k_s1, sizeof(float) * dim);
            memcpy(value_cache + row, v + i * v_s0 + h * v_s1, sizeof(float) * dim);
        }
    }
    int group = heads / kv_heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int w = 0; w < seqs * heads; w++) {
        int i = w / heads, h = w % heads;
        attend_head(q + i * q_s0 + h * q_s1, key_cache, value_cache,
                    block_tables + i * bt_stride, seq_lens[i], block_size, kv_heads,
                    h / group, dim, scale, out + ((long)i * heads + h) * dim);
    }
}
