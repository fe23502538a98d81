/* Paged attention for the CPU: each query token attends to its sequence's keys and values,
 * read in place from the paged KV cache through the sequence's block table. No gather, no
 * padding, no mask tensor: the causal (and sliding-window) range comes from the query's
 * position. Built and loaded by raycolo/executor/native.py; equal to the torch path in
 * raycolo/executor/model.py (tests/test_executor.py).
 *
 * Layouts (row-major, contiguous):
 *   q, out        (tokens, heads, head_dim)
 *   key, value    (num_blocks, block_size, kv_heads, head_dim)   one layer of the cache
 *   tables        every sequence's block table, concatenated
 *   table_start   (tokens,) offset in `tables` of the token's sequence's table
 *   pos           (tokens,) the token's position: it attends keys at positions
 *                 [max(0, pos - window + 1), pos], or [0, pos] when window <= 0
 *
 * A work item is a (token, kv head) pair: the heads / kv_heads query heads that share a
 * key/value head read each key and value once. Scores first, then softmax, then the
 * weighted sum of values, in the cache's precision. OpenMP shares the items out; the
 * library links against the libgomp torch has already loaded, so it is torch's thread
 * pool. Common head sizes get their own inlined copy (a constant head_dim lets the
 * compiler unroll the dot products: 2x faster at head_dim 32). Returns 0, or 1 when a
 * scratch buffer could not be allocated. */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#if defined(__SSE__)
#include <xmmintrin.h>
/* Flush-to-zero and denormals-are-zero while the kernel runs, in each of its threads, and
 * the caller's mode back afterwards: softmax weights of far-away keys underflow to
 * subnormals, which cost microcode assists. The library never changes the process's mode
 * (it is linked without -ffast-math). */
#define FAST_FP_BEGIN unsigned int saved_csr = _mm_getcsr(); _mm_setcsr(saved_csr | 0x8040);
#define FAST_FP_END _mm_setcsr(saved_csr);
#else
#define FAST_FP_BEGIN
#define FAST_FP_END
#endif

#define DEFINE_PAGED_ATTENTION(NAME, T, EXP)                                                   \
static inline __attribute__((always_inline)) void NAME##_item(                               \
        const T *q, const T *key, const T *value, const int64_t *table, int64_t p,           \
        int64_t window, int64_t h, int64_t heads, int64_t kv_heads, int64_t group,           \
        const int64_t d, int64_t block_size, T scale, T *scores, T *acc, T *out) {           \
    const int64_t lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;              \
    const int64_t len = p - lo + 1;                                                          \
    const T *qh = q + h * group * d;                                                         \
    for (int64_t t = lo; t <= p; t++) {                                                      \
        const T *k = key + ((table[t / block_size] * block_size + t % block_size)            \
                            * kv_heads + h) * d;                                             \
        for (int64_t g = 0; g < group; g++) {                                                \
            const T *qg = qh + g * d;                                                        \
            T s = 0;                                                                         \
            _Pragma("omp simd reduction(+:s)")                                               \
            for (int64_t e = 0; e < d; e++) s += qg[e] * k[e];                               \
            scores[g * len + (t - lo)] = s * scale;                                          \
        }                                                                                    \
    }                                                                                        \
    for (int64_t g = 0; g < group; g++) {                                                    \
        T *sg = scores + g * len, m = sg[0], sum = 0;                                        \
        for (int64_t j = 1; j < len; j++) m = sg[j] > m ? sg[j] : m;                         \
        _Pragma("omp simd reduction(+:sum)")                                                 \
        for (int64_t j = 0; j < len; j++) { sg[j] = EXP(sg[j] - m); sum += sg[j]; }          \
        const T inv = (T)1 / sum;                                                            \
        for (int64_t j = 0; j < len; j++) sg[j] *= inv;                                      \
    }                                                                                        \
    for (int64_t e = 0; e < group * d; e++) acc[e] = 0;                                      \
    for (int64_t t = lo; t <= p; t++) {                                                      \
        const T *v = value + ((table[t / block_size] * block_size + t % block_size)          \
                              * kv_heads + h) * d;                                           \
        for (int64_t g = 0; g < group; g++) {                                                \
            const T w = scores[g * len + (t - lo)];                                          \
            T *a = acc + g * d;                                                              \
            _Pragma("omp simd")                                                              \
            for (int64_t e = 0; e < d; e++) a[e] += w * v[e];                                \
        }                                                                                    \
    }                                                                                        \
    T *o = out + h * group * d;                                                              \
    for (int64_t e = 0; e < group * d; e++) o[e] = acc[e];                                   \
}                                                                                            \
                                                                                             \
int NAME(const T *q, const T *key, const T *value, const int64_t *tables,                    \
         const int64_t *table_start, const int64_t *pos, int64_t window, int64_t tokens,      \
         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,              \
         double scale, T *out, int threads) {                                                \
    const int64_t group = heads / kv_heads;                                                  \
    int failed = 0;                                                                          \
    _Pragma("omp parallel num_threads(threads)")                                             \
    {                                                                                        \
        FAST_FP_BEGIN                                                                        \
        T *buf = NULL;                                                                       \
        int64_t cap = 0;                                                                     \
        _Pragma("omp for schedule(dynamic, 4)")                                              \
        for (int64_t item = 0; item < tokens * kv_heads; item++) {                           \
            const int64_t i = item / kv_heads, h = item % kv_heads, p = pos[i];              \
            const int64_t need = group * (p + 1) + group * head_dim;                         \
            if (need > cap) {                                                                \
                free(buf);                                                                   \
                cap = 2 * need;                                                              \
                buf = (T *)malloc(sizeof(T) * cap);                                          \
                if (buf == NULL) { cap = 0; _Pragma("omp atomic write") failed = 1; continue; } \
            }                                                                                \
            T *scores = buf, *acc = buf + group * (p + 1);                                   \
            const T *qi = q + i * heads * head_dim;                                          \
            T *oi = out + i * heads * head_dim;                                              \
            const int64_t *table = tables + table_start[i];                                  \
            switch (head_dim) {                                                              \
            case 32: NAME##_item(qi, key, value, table, p, window, h, heads, kv_heads, group, \
                                 32, block_size, (T)scale, scores, acc, oi); break;          \
            case 64: NAME##_item(qi, key, value, table, p, window, h, heads, kv_heads, group, \
                                 64, block_size, (T)scale, scores, acc, oi); break;          \
            case 128: NAME##_item(qi, key, value, table, p, window, h, heads, kv_heads, group, \
                                  128, block_size, (T)scale, scores, acc, oi); break;        \
            default: NAME##_item(qi, key, value, table, p, window, h, heads, kv_heads, group, \
                                 head_dim, block_size, (T)scale, scores, acc, oi);           \
            }                                                                                \
        }                                                                                    \
        free(buf);                                                                           \
        FAST_FP_END                                                                          \
    }                                                                                        \
    return failed;                                                                           \
}

DEFINE_PAGED_ATTENTION(paged_attention_f32, float, expf)
DEFINE_PAGED_ATTENTION(paged_attention_f64, double, exp)
