/* Paged attention for the CPU: each query token attends to its sequence's keys and values,
 * read in place from the paged KV cache through the sequence's block table. No gather, no
 * padding, no mask tensor: the causal (and sliding-window) range comes from the query's
 * position. Built and loaded by raycolo/executor/native.py; equal to the torch path in
 * raycolo/engine/executor/model.py (tests/engine/test_executor.py).
 *
 * Layouts (row-major, contiguous):
 *   q, out        (tokens, heads, head_dim); q's tokens q_row elements apart (a column
 *                 slice of a fused q/k/v product), out contiguous
 *   key           (num_blocks, kv_heads, head_dim, block_size)   one layer of the cache:
 *                 a block holds each head's keys transposed, so the scores of a block's
 *                 keys are one vector per head_dim element (no horizontal sums)
 *   value         (num_blocks, kv_heads, block_size, head_dim)
 *   tables        every sequence's block table, concatenated
 *   table_start   (tokens,) offset in `tables` of the token's sequence's table
 *   pos           (tokens,) the token's position: it attends keys at positions
 *                 [max(0, pos - window + 1), pos], or [0, pos] when window <= 0
 *
 * A work item is a (token, kv head) pair: the heads / kv_heads query heads that share a
 * key/value head read each key and value block once, while it is in L1. Scores first, a
 * block at a time; then softmax; then the weighted sum of values, a block at a time, in the
 * cache's precision. OpenMP shares the items out; the library links against the libgomp
 * torch has already loaded, so it is torch's thread pool.
 *
 * Two bodies: float32 with 16-slot blocks and a head_dim that is a multiple of 16 (32, 64,
 * 128) uses 16-wide vectors (GCC/Clang vector extensions: AVX-512 where the CPU has it,
 * narrower registers otherwise; 2.5x faster than the scalar loops at head_dim 64); any
 * other case runs the plain loops. Returns 0, or 1 when a scratch buffer could not be
 * allocated. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

/* Blocks are scattered over the cache, and each head's part of a block is a page of its
 * own, where the hardware prefetcher stops: fetch this many blocks ahead in software
 * (1.1-1.2x at 256 sequences of about 200 tokens, head_dim 64). */
#define PREFETCH_BLOCKS 2
typedef float v16 __attribute__((vector_size(64), aligned(4)));   /* unaligned loads/stores */

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* In place: softmax over s[0, len), per query head of the group (rows of `stride`). */
#define SOFTMAX_ROWS(T, EXP, s, group, stride, first, len)                                 \
    for (int64_t g = 0; g < (group); g++) {                                                \
        T *sg = (s) + g * (stride) + (first), m = sg[0], sum = 0;                          \
        for (int64_t j = 1; j < (len); j++) m = sg[j] > m ? sg[j] : m;                     \
        _Pragma("omp simd reduction(+:sum)")                                               \
        for (int64_t j = 0; j < (len); j++) { sg[j] = EXP(sg[j] - m); sum += sg[j]; }      \
        const T inv = (T)1 / sum;                                                          \
        for (int64_t j = 0; j < (len); j++) sg[j] *= inv;                                  \
    }

/* float32, 16-slot blocks, head_dim D (a multiple of 16, a constant where inlined). */
static inline __attribute__((always_inline)) void item_f32x16(
        const float *q, const float *key, const float *value, const int64_t *table, int64_t p,
        int64_t window, int64_t h, int64_t kv_heads, int64_t group, const int64_t D,
        float scale, float *scores, float *acc, float *out) {
    enum { BS = 16 };
    const int64_t lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
    const int64_t b0 = lo / BS, b1 = p / BS, span = (b1 - b0 + 1) * BS;
    const float *qh = q + h * group * D;
    for (int64_t b = b0; b <= b1; b++) {             /* scores of a whole block of keys */
        const float *kb = key + (table[b] * kv_heads + h) * D * BS;
        /* prefetch the keys PREFETCH_BLOCKS ahead; past the last block, the first values */
        const int64_t ahead = b + PREFETCH_BLOCKS, vahead = b0 + ahead - b1 - 1;
        if (ahead <= b1 || vahead <= b1) {
            const float *next = ahead <= b1 ? key + (table[ahead] * kv_heads + h) * D * BS
                                            : value + (table[vahead] * kv_heads + h) * BS * D;
            for (int64_t e = 0; e < D * BS; e += 16) __builtin_prefetch(next + e);
        }
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qh + g * D;
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};   /* four chains hide FMA latency */
            for (int64_t e = 0; e < D; e += 4) {
                a0 += qg[e] * load16(kb + e * BS);
                a1 += qg[e + 1] * load16(kb + (e + 1) * BS);
                a2 += qg[e + 2] * load16(kb + (e + 2) * BS);
                a3 += qg[e + 3] * load16(kb + (e + 3) * BS);
            }
            store16(scores + g * span + (b - b0) * BS, ((a0 + a1) + (a2 + a3)) * scale);
        }
    }
    SOFTMAX_ROWS(float, expf, scores, group, span, lo - b0 * BS, p - lo + 1)
    memset(acc, 0, sizeof(float) * group * D);
    for (int64_t b = b0; b <= b1; b++) {             /* weighted values, a block at a time */
        const float *vb = value + (table[b] * kv_heads + h) * BS * D;
        if (b + PREFETCH_BLOCKS <= b1) {
            const float *next = value + (table[b + PREFETCH_BLOCKS] * kv_heads + h) * BS * D;
            for (int64_t e = 0; e < BS * D; e += 16) __builtin_prefetch(next + e);
        }
        const int64_t t0 = b * BS > lo ? b * BS : lo, t1 = b * BS + BS - 1 < p ? b * BS + BS - 1 : p;
        for (int64_t g = 0; g < group; g++) {
            const float *w = scores + g * span - b0 * BS;
            float *a = acc + g * D;
            v16 s[D / 16];             /* D / 16 independent chains, kept in registers */
            for (int64_t c = 0; c < D / 16; c++) s[c] = load16(a + 16 * c);
            for (int64_t t = t0; t <= t1; t++) {
                const float wt = w[t], *vt = vb + (t - b * BS) * D;
                for (int64_t c = 0; c < D / 16; c++) s[c] += wt * load16(vt + 16 * c);
            }
            for (int64_t c = 0; c < D / 16; c++) store16(a + 16 * c, s[c]);
        }
    }
    memcpy(out + h * group * D, acc, sizeof(float) * group * D);
}

/* Any dtype, block size and head_dim: the same computation in plain loops. */
#define DEFINE_ITEM_GENERIC(NAME, T, EXP)                                                    \
static void NAME(const T *q, const T *key, const T *value, const int64_t *table, int64_t p, \
                 int64_t window, int64_t h, int64_t kv_heads, int64_t group, int64_t d,      \
                 int64_t bs, T scale, T *scores, T *acc, T *out) {                           \
    const int64_t lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;              \
    const int64_t len = p - lo + 1;                                                          \
    const T *qh = q + h * group * d;                                                         \
    for (int64_t t = lo; t <= p; t++) {                                                      \
        const T *kb = key + (table[t / bs] * kv_heads + h) * d * bs + t % bs;                \
        for (int64_t g = 0; g < group; g++) {                                                \
            const T *qg = qh + g * d;                                                        \
            T s = 0;                                                                         \
            for (int64_t e = 0; e < d; e++) s += qg[e] * kb[e * bs];                         \
            scores[g * len + (t - lo)] = s * scale;                                          \
        }                                                                                    \
    }                                                                                        \
    SOFTMAX_ROWS(T, EXP, scores, group, len, 0, len)                                         \
    for (int64_t e = 0; e < group * d; e++) acc[e] = 0;                                      \
    for (int64_t t = lo; t <= p; t++) {                                                      \
        const T *v = value + ((table[t / bs] * kv_heads + h) * bs + t % bs) * d;             \
        for (int64_t g = 0; g < group; g++) {                                                \
            const T w = scores[g * len + (t - lo)];                                          \
            T *a = acc + g * d;                                                              \
            _Pragma("omp simd")                                                              \
            for (int64_t e = 0; e < d; e++) a[e] += w * v[e];                                \
        }                                                                                    \
    }                                                                                        \
    memcpy(out + h * group * d, acc, sizeof(T) * group * d);                                 \
}

DEFINE_ITEM_GENERIC(item_generic_f32, float, expf)
DEFINE_ITEM_GENERIC(item_generic_f64, double, exp)

/* The float32 item: the vector body where the shape allows it. */
static inline void item_f32(const float *q, const float *key, const float *value,
                            const int64_t *table, int64_t p, int64_t window, int64_t h,
                            int64_t kv_heads, int64_t group, int64_t d, int64_t bs, float scale,
                            float *scores, float *acc, float *out) {
    if (bs == 16) {
        switch (d) {
        case 32: item_f32x16(q, key, value, table, p, window, h, kv_heads, group, 32, scale,
                             scores, acc, out); return;
        case 64: item_f32x16(q, key, value, table, p, window, h, kv_heads, group, 64, scale,
                             scores, acc, out); return;
        case 128: item_f32x16(q, key, value, table, p, window, h, kv_heads, group, 128, scale,
                              scores, acc, out); return;
        }
    }
    item_generic_f32(q, key, value, table, p, window, h, kv_heads, group, d, bs, scale,
                     scores, acc, out);
}

#define DEFINE_PAGED_ATTENTION(NAME, T, ITEM)                                                \
int NAME(const T *q, const T *key, const T *value, const int64_t *tables,                    \
         const int64_t *table_start, const int64_t *pos, int64_t window, int64_t tokens,      \
         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,              \
         int64_t q_row, double scale, T *out, int threads) {                                 \
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
            /* scores: whole blocks from the window's first block to p's; then the sums */   \
            const int64_t need = group * (p / block_size + 1) * block_size + group * head_dim; \
            if (need > cap) {                                                                \
                free(buf);                                                                   \
                cap = 2 * need;                                                              \
                buf = (T *)malloc(sizeof(T) * cap);                                          \
                if (buf == NULL) { cap = 0; _Pragma("omp atomic write") failed = 1; continue; } \
            }                                                                                \
            ITEM(q + i * q_row, key, value, tables + table_start[i], p, window, h, \
                 kv_heads, group, head_dim, block_size, (T)scale, buf,                        \
                 buf + need - group * head_dim, out + i * heads * head_dim);                 \
        }                                                                                    \
        free(buf);                                                                           \
        FAST_FP_END                                                                          \
    }                                                                                        \
    return failed;                                                                           \
}

DEFINE_PAGED_ATTENTION(paged_attention_f32, float, item_f32)
DEFINE_PAGED_ATTENTION(paged_attention_f64, double, item_generic_f64)
