/* Fused pointwise steps of a Llama-family layer, for float32 inference on the CPU: the
 * residual add with the RMSNorm that follows it, the rotary embedding with the cache write,
 * and SiLU times up.
 * Each replaces several torch ops (and their temporaries) with one pass over the rows.
 * Built and loaded with paged_attention.c by raycolo/executor/native.py; equal to the
 * model's own modules (transformers' LlamaRMSNorm and apply_rotary_pos_emb, the same in
 * Qwen2 and Mistral) in tests/engine/test_executor.py. */
#include <stdint.h>
#include <math.h>
#include <stddef.h>

/* Rows per thread below which a parallel region costs more than it saves. */
#define MIN_ROWS_PER_THREAD 8

/* residual += x (when x is not NULL), then out = weight * residual / rms(residual), with
 * rms = sqrt(mean(residual^2) + eps), per row of `dim` floats. */
void add_rms_norm_f32(float *residual, const float *x, const float *weight, int64_t rows,
                      int64_t dim, double eps, float *out, int threads) {
    const int n = rows >= (int64_t)MIN_ROWS_PER_THREAD * threads ? threads : 1;
    _Pragma("omp parallel for num_threads(n) schedule(static)")
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual + r * dim, *o = out + r * dim;
        float ss = 0;
        if (x != NULL) {
            const float *xr = x + r * dim;
            _Pragma("omp simd reduction(+:ss)")
            for (int64_t j = 0; j < dim; j++) { res[j] += xr[j]; ss += res[j] * res[j]; }
        } else {
            _Pragma("omp simd reduction(+:ss)")
            for (int64_t j = 0; j < dim; j++) ss += res[j] * res[j];
        }
        const float inv = 1.0f / sqrtf(ss / (float)dim + (float)eps);
        _Pragma("omp simd")
        for (int64_t j = 0; j < dim; j++) o[j] = weight[j] * (res[j] * inv);
    }
}

/* out = silu(gate) * up = gate * sigmoid(gate) * up, per row of `cols` floats; gate's and
 * up's rows lie g_row and u_row floats apart (the two column halves of one fused gate/up
 * product), out is contiguous (it may be gate itself, where gate is). The sigmoid takes
 * exp(-|x|), never above 1: under -ffast-math (no infinities assumed) exp(-x) of a large
 * negative x overflowed to NaN. */
void silu_mul_f32(const float *gate, const float *up, int64_t rows, int64_t cols, int64_t g_row,
                  int64_t u_row, float *out, int threads) {
    const int n = rows >= (int64_t)MIN_ROWS_PER_THREAD * threads ? threads : 1;
    _Pragma("omp parallel for num_threads(n) schedule(static)")
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * g_row, *u = up + r * u_row;
        float *o = out + r * cols;
        _Pragma("omp simd")
        for (int64_t j = 0; j < cols; j++) {
            const float x = g[j], e = expf(-fabsf(x)), inv = 1.0f / (1.0f + e);
            o[j] = x * (x >= 0.0f ? inv : e * inv) * u[j];
        }
    }
}

/* The rotary embedding, x * cos + rotate_half(x) * sin with rotate_half(x) =
 * (-x[d/2:], x[:d/2]) and cos, sin (tokens, d): in place on q (tokens, heads, d), and on k
 * (tokens, kv_heads, d) on its way into one layer's paged cache, with v: keys (blocks,
 * kv_heads, d, block_size), values (blocks, kv_heads, block_size, d), at slot = block *
 * block_size + offset; k itself is left as it was. A token's heads are contiguous; its
 * q, k and v rows lie q_row, k_row and v_row floats apart (column slices of one fused
 * q/k/v product). One pass for a rotary pass and two indexed torch copies. */
void rope_write_f32(float *q, const float *k, const float *v, const float *cos, const float *sin,
                    const int64_t *slots, float *keys, float *values, int64_t tokens, int64_t heads,
                    int64_t kv_heads, int64_t d, int64_t q_row, int64_t k_row, int64_t v_row,
                    int64_t block_size, int threads) {
    const int64_t half = d / 2;
    const int n = tokens >= (int64_t)MIN_ROWS_PER_THREAD * threads ? threads : 1;
    _Pragma("omp parallel for num_threads(n) schedule(static)")
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < heads; h++) {
            float *x = q + t * q_row + h * d;
            _Pragma("omp simd")
            for (int64_t j = 0; j < half; j++) {
                const float x1 = x[j], x2 = x[j + half];
                x[j] = x1 * c[j] - x2 * s[j];
                x[j + half] = x2 * c[j + half] + x1 * s[j + half];
            }
        }
        const int64_t block = slots[t] / block_size, off = slots[t] % block_size;
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *x = k + t * k_row + h * d, *vr = v + t * v_row + h * d;
            float *kc = keys + (block * kv_heads + h) * d * block_size + off;
            float *vc = values + ((block * kv_heads + h) * block_size + off) * d;
            for (int64_t j = 0; j < half; j++) {
                const float x1 = x[j], x2 = x[j + half];
                kc[j * block_size] = x1 * c[j] - x2 * s[j];
                kc[(j + half) * block_size] = x2 * c[j + half] + x1 * s[j + half];
            }
            _Pragma("omp simd")
            for (int64_t j = 0; j < d; j++) vc[j] = vr[j];
        }
    }
}
