/* Fused pointwise steps of a Llama-family layer, for float32 inference on the CPU: the
 * residual add with the RMSNorm that follows it, and the rotary embedding applied in place.
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

/* In place on q (tokens, heads, d) and k (tokens, kv_heads, d), with cos and sin (tokens, d):
 * x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x[d/2:], x[:d/2]). A token's
 * heads are contiguous; tokens lie q_row and k_row floats apart (column slices of one
 * fused q/k/v product). */
void rotary_f32(float *q, float *k, const float *cos, const float *sin, int64_t tokens,
                int64_t heads, int64_t kv_heads, int64_t d, int64_t q_row, int64_t k_row,
                int threads) {
    const int64_t half = d / 2;
    const int n = tokens >= (int64_t)MIN_ROWS_PER_THREAD * threads ? threads : 1;
    _Pragma("omp parallel for num_threads(n) schedule(static)")
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *x = h < heads ? q + t * q_row + h * d : k + t * k_row + (h - heads) * d;
            _Pragma("omp simd")
            for (int64_t j = 0; j < half; j++) {
                const float x1 = x[j], x2 = x[j + half];
                x[j] = x1 * c[j] - x2 * s[j];
                x[j + half] = x2 * c[j + half] + x1 * s[j + half];
            }
        }
    }
}
