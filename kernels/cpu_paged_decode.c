/* Paged decode attention for the CPU: one new query token per sequence, reading K and V in place from the
 * paged cache (no gather copy), float32 arithmetic for float32 or bfloat16 caches; and the store of a step's new K
 * and V rows into the cache's slots (pdserve_store_kv). With AVX-512, a full tile's
 * logits come from one lane-reduction tree; with AVX512-BF16, a bfloat16 query's logits against a bfloat16
 * cache are VDPBF16PS products of the rows in place (exact products, float32 sums).
 *
 * Shapes (row-major, contiguous):
 *   query        [S, Hq, D]   float32, or bfloat16 with bf16_io; not yet scaled; query_stride elements from one
 *                             sequence's row to the next (heads and dims contiguous, as q split from one projection)
 *   key/value    [N, B, Hkv, D] float32 or bfloat16 (is_bf16)
 *   block_tables [S, max_blocks] int32
 *   seq_lens     [S] int32, context including the new token
 *   sinks        [Hq] float32 or NULL: one extra logit per head in the softmax denominator, with no value
 *   out          [S, Hq, D]   float32, or bfloat16 with bf16_io (rounded to nearest even)
 * The query at position L - 1 sees positions [0, L), or [L - window, L) with a window (window > 0).
 * soft_cap > 0 caps each scaled logit: cap * tanh(logit / cap). A sequence with L == 0 gets zeros.
 * Work is split over (sequence, KV head) pairs; the query heads that share a KV head are its rows.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_math.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline uint32_t float_bits(float x) {
    union { float f; uint32_t u; } value = { x };
    return value.u;
}


static inline float soft_capped(float logit, float cap) {  /* cap * tanh(logit / cap) */
    float t = 2.0f * logit / cap;
    float a = t < 0 ? t : -t;  /* tanh(|t|/2) = (1 - e^-|t|) / (1 + e^-|t|) */
    float e = exp_nonpositive(a);
    float magnitude = (1.0f - e) / (1.0f + e);
    return cap * (t < 0 ? -magnitude : magnitude);
}

#define MIN_PARALLEL_ELEMENTS (1 << 18) /* K elements a call reads before it splits over threads */
#define TILE 16 /* positions converted and read together; the tile stays in L1 */

/* rows[i] = the element index of position first + i's row of one KV head in a paged cache [N, B, Hkv, D], for
 * the span's positions in order: one division for the whole span (then the block offset counts up). */
static inline void span_rows(const int32_t *restrict table, int first, int span, int block_size, int64_t token_stride,
                             int64_t head_offset, int64_t *restrict rows) {
    int block = first / block_size, offset = first % block_size;
    for (int i = 0; i < span; i++) {
        rows[i] = ((int64_t)table[block] * block_size + offset) * token_stride + head_offset;
        if (++offset == block_size) offset = 0, block++;
    }
}

/* The `count` rows at rows[0..count) of one KV head, as float32 rows [count, D] in `tile`. */
static inline void load_tile(const void *restrict cache, int is_bf16, const int64_t *restrict rows, int count,
                             int head_dim, float *restrict tile) {
    for (int t = 0; t < count; t++) {
        int64_t row = rows[t];
        float *restrict destination = tile + t * head_dim;
        if (is_bf16) {
            const uint16_t *restrict source = (const uint16_t *)cache + row;
            for (int d = 0; d < head_dim; d++) destination[d] = bf16_value(source[d]);
        } else {
            memcpy(destination, (const float *)cache + row, sizeof(float) * head_dim);
        }
    }
}

#if defined(__AVX512F__)
/* lane t of the result = the sum of sums[t]'s 16 lanes */
static inline __m512 lane_sums(const __m512 *sums) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: rows 2i, 2i+1 interleaved, half summed */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(sums[2 * i], sums[2 * i + 1]),
                     _mm512_unpackhi_ps(sums[2 * i], sums[2 * i + 1]));
    for (int j = 0; j < 4; j++) {  /* per 128-bit lane: rows 4j..4j+3, one partial sum each */
        __m512d a = _mm512_castps_pd(pairs[2 * j]), b = _mm512_castps_pd(pairs[2 * j + 1]);
        quads[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                     _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
    __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}
#endif

#if defined(__AVX512BF16__)
/* logits[t] = scale * (q . K[t]) for TILE positions read in place as bfloat16 pairs (VDPBF16PS: exact products,
 * float32 sums); q_pairs: [D] bfloat16 (the query, exactly representable), D a multiple of 32 */
static inline void tile_logits_bf16(const uint16_t *restrict q_pairs, const uint16_t *const *rows, int head_dim,
                                    float scale, float *restrict logits) {
    __m512 sums[TILE];
    for (int t = 0; t < TILE; t++) {
        __m512 sum = _mm512_setzero_ps();
        for (int d = 0; d < head_dim; d += 32)
            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(q_pairs + d),
                                   (__m512bh)_mm512_loadu_si512(rows[t] + d));
        sums[t] = sum;
    }
    _mm512_storeu_ps(logits, _mm512_mul_ps(lane_sums(sums), _mm512_set1_ps(scale)));
}
#endif

/* logits[t] = scale * (q . tile[t]) for the tile's `count` rows [count, D]. */
static inline void tile_logits(const float *restrict q, const float *restrict tile, int count, int head_dim,
                               float scale, float *restrict logits) {
#if defined(__AVX512F__)
    if (count == TILE && head_dim % 16 == 0) {  /* 16 sums at once: each row's 16 lanes, then one lane tree */
        __m512 sums[TILE];
        for (int t = 0; t < TILE; t++) {
            const float *row = tile + t * head_dim;
            __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(row));
            for (int d = 16; d < head_dim; d += 16)
                sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(row + d), sum);
            sums[t] = sum;
        }
        __m512 total = lane_sums(sums);
        _mm512_storeu_ps(logits, _mm512_mul_ps(total, _mm512_set1_ps(scale)));
        return;
    }
#endif
    for (int t = 0; t < count; t++) {
        const float *restrict key = tile + t * head_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < head_dim; d++) dot += q[d] * key[d];
        logits[t] = dot * scale;
    }
}

/* o += sum over the tile's rows t of weights[t] * tile[t]  (o: [D]) */
static inline void tile_accumulate(const float *restrict weights, const float *restrict tile, int count,
                                   int head_dim, float *restrict o) {
#if defined(__AVX512F__)
    if (head_dim % 16 == 0 && head_dim <= 256) {  /* o stays in registers over the tile */
        __m512 acc[16];
        int vectors = head_dim / 16;
        for (int v = 0; v < vectors; v++) acc[v] = _mm512_loadu_ps(o + 16 * v);
        for (int t = 0; t < count; t++) {
            __m512 weight = _mm512_set1_ps(weights[t]);
            for (int v = 0; v < vectors; v++)
                acc[v] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(tile + t * head_dim + 16 * v), acc[v]);
        }
        for (int v = 0; v < vectors; v++) _mm512_storeu_ps(o + 16 * v, acc[v]);
        return;
    }
#endif
    for (int t = 0; t < count; t++) {
        const float *restrict value = tile + t * head_dim;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) o[d] += weights[t] * value[d];
    }
}

/* Rows asked for ahead of their use, into L2 (a T1 hint), far enough ahead that a cold cache (an engine step's,
 * evicted by the other layers' weights) has enough misses in flight; one tile ahead into L1 kept too few. */
#define AHEAD (4 * TILE)
/* Asks for rows [from, to) of an item's stream ahead of their use: the K rows of its positions, then the V rows
 * (index span + i). Blocks lie anywhere, so the hardware's stride prefetchers do not find them. */
static inline void prefetch_stream(const void *key_cache, const void *value_cache, int element_size,
                                   const int64_t *restrict rows, int span, int from, int to, int head_dim) {
    if (to > 2 * span) to = 2 * span;
    for (int i = from; i < to; i++) {
        const char *cache = i < span ? key_cache : value_cache;
        const char *row = cache + rows[i < span ? i : i - span] * element_size;
        for (int byte = 0; byte < head_dim * element_size; byte += 64) __builtin_prefetch(row + byte, 0, 2);
    }
}

static inline void softmax_rows(float *restrict logits, int group, int span, float soft_cap,
                                const float *restrict sinks) {  /* logits [group, span], in place */
    for (int g = 0; g < group; g++) {
        float *restrict row = logits + g * span;
        if (soft_cap > 0) for (int t = 0; t < span; t++) row[t] = soft_capped(row[t], soft_cap);
        float top = sinks ? sinks[g] : -FLT_MAX;
#pragma omp simd reduction(max : top)
        for (int t = 0; t < span; t++) top = row[t] > top ? row[t] : top;
        float total = sinks ? exp_nonpositive(sinks[g] - top) : 0.0f;
#pragma omp simd reduction(+ : total)
        for (int t = 0; t < span; t++) {
            row[t] = exp_nonpositive(row[t] - top);
            total += row[t];
        }
        float inverse = 1.0f / total;
        for (int t = 0; t < span; t++) row[t] *= inverse;
    }
}

#if defined(__AVX512BF16__)
#define VALUE_ACCUMULATORS 24 /* float32 vectors of output the V pass keeps in registers: heads x D / 16 */
/* out[g] += sum_t w[g][t] V[t] for `heads` query heads (w: their weights, [heads, span]), the span's V rows read in
 * place as bfloat16 and widened once for all of them (exact); a constant `heads` keeps the sums in registers. */
static inline __attribute__((always_inline)) void values_pass(
        const void *restrict key_cache, const void *restrict value_cache, const int64_t *restrict rows, int span,
        int head_dim, const float *restrict w, float *restrict out, const int heads, int prefetch) {
    const int vectors = head_dim / 16;
    __m512 acc[VALUE_ACCUMULATORS];
    for (int i = 0; i < heads * vectors; i++) acc[i] = _mm512_setzero_ps();
    for (int t = 0; t < span; t++) {
        if (prefetch && t % TILE == 0)  /* the first pass brings the rows in, a tile ahead */
            prefetch_stream(key_cache, value_cache, 2, rows, span, span + t + AHEAD, span + t + AHEAD + TILE,
                            head_dim);
        const uint16_t *restrict row = (const uint16_t *)value_cache + rows[t];
        for (int v = 0; v < vectors; v++) {
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 16 * v)));
            __m512 value = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
            for (int g = 0; g < heads; g++)
                acc[g * vectors + v] = _mm512_fmadd_ps(_mm512_set1_ps(w[(int64_t)g * span + t]), value,
                                                       acc[g * vectors + v]);
        }
    }
    for (int g = 0; g < heads; g++)
        for (int v = 0; v < vectors; v++) _mm512_storeu_ps(out + g * head_dim + 16 * v, acc[g * vectors + v]);
}

/* out[g] = sum_t weights[g][t] V[t] for every query head, as many heads a pass as their sums fit in registers:
 * the products and the order of tile_accumulate's, so the same float32 results, without a float32 copy of every
 * tile. D a multiple of 16, at most 256. */
static inline __attribute__((always_inline)) void values_bf16(
        const void *restrict key_cache, const void *restrict value_cache, const int64_t *restrict rows, int span,
        int group, int head_dim, const float *restrict weights, float *restrict out) {
    const int heads_per_pass = VALUE_ACCUMULATORS / (head_dim / 16);
    for (int first = 0; first < group; first += heads_per_pass) {
        const float *restrict w = weights + (int64_t)first * span;
        float *restrict o = out + first * head_dim;
        int prefetch = first == 0;
        switch (group - first < heads_per_pass ? group - first : heads_per_pass) {
        case 1: values_pass(key_cache, value_cache, rows, span, head_dim, w, o, 1, prefetch); break;
        case 2: values_pass(key_cache, value_cache, rows, span, head_dim, w, o, 2, prefetch); break;
        case 3: values_pass(key_cache, value_cache, rows, span, head_dim, w, o, 3, prefetch); break;
        case 4: values_pass(key_cache, value_cache, rows, span, head_dim, w, o, 4, prefetch); break;
        case 5: values_pass(key_cache, value_cache, rows, span, head_dim, w, o, 5, prefetch); break;
        default: values_pass(key_cache, value_cache, rows, span, head_dim, w, o, 6, prefetch); break;
        }
    }
}
#endif

static inline __attribute__((always_inline)) void attend_one(
        const float *restrict query, const void *restrict key_cache, const void *restrict value_cache, int is_bf16,
        const int32_t *restrict table, int seq_len, int kv_head, int group, int num_kv_heads, int head_dim,
        int block_size, int window, float scale, float soft_cap, const float *restrict sinks, float *restrict out,
        float *restrict logits, float *restrict tile, int64_t *restrict rows) {
    /* query, out: [group, D] of this KV head; sinks: [group] or NULL; logits: [group, span]; tile: [TILE, D];
     * rows: [span], filled here */
    int first = (window > 0 && seq_len > window) ? seq_len - window : 0;
    int span = seq_len - first;
    memset(out, 0, sizeof(float) * group * head_dim);
    if (span <= 0) return;
    span_rows(table, first, span, block_size, (int64_t)num_kv_heads * head_dim, (int64_t)kv_head * head_dim, rows);
#if defined(__AVX512BF16__)
    uint16_t q_pairs[group * head_dim];
    int in_place = is_bf16 && head_dim % 32 == 0;  /* and a query that bfloat16 holds exactly (a bf16 model's) */
    for (int i = 0; in_place && i < group * head_dim; i++) {
        uint32_t bits = float_bits(query[i]);
        q_pairs[i] = (uint16_t)(bits >> 16);
        in_place = (bits & 0xffffu) == 0;
    }
#endif
    int element_size = is_bf16 ? 2 : 4;
    prefetch_stream(key_cache, value_cache, element_size, rows, span, 0, AHEAD, head_dim);
    for (int begin = 0; begin < span; begin += TILE) {
        int count = span - begin < TILE ? span - begin : TILE;
        prefetch_stream(key_cache, value_cache, element_size, rows, span, begin + AHEAD, begin + AHEAD + TILE,
                        head_dim);
#if defined(__AVX512BF16__)
        if (in_place && count == TILE) {
            const uint16_t *tile_rows[TILE];
            for (int t = 0; t < TILE; t++) tile_rows[t] = (const uint16_t *)key_cache + rows[begin + t];
            for (int g = 0; g < group; g++)
                tile_logits_bf16(q_pairs + g * head_dim, tile_rows, head_dim, scale, logits + g * span + begin);
            continue;
        }
#endif
        load_tile(key_cache, is_bf16, rows + begin, count, head_dim, tile);
        for (int g = 0; g < group; g++)
            tile_logits(query + g * head_dim, tile, count, head_dim, scale, logits + g * span + begin);
    }
    softmax_rows(logits, group, span, soft_cap, sinks);
#if defined(__AVX512BF16__)
    if (is_bf16 && head_dim % 16 == 0 && head_dim <= 256) {
        values_bf16(key_cache, value_cache, rows, span, group, head_dim, logits, out);
        return;
    }
#endif
    for (int begin = 0; begin < span; begin += TILE) {
        int count = span - begin < TILE ? span - begin : TILE;
        prefetch_stream(key_cache, value_cache, element_size, rows, span, span + begin + AHEAD,
                        span + begin + AHEAD + TILE, head_dim);
        load_tile(value_cache, is_bf16, rows + begin, count, head_dim, tile);
        for (int g = 0; g < group; g++)
            tile_accumulate(logits + g * span + begin, tile, count, head_dim, out + g * head_dim);
    }
}

int pdserve_paged_decode(const void *query, const void *key_cache, const void *value_cache, int is_bf16,
                         const int32_t *block_tables, int max_blocks, const int32_t *seq_lens, int num_seqs,
                         int num_heads, int num_kv_heads, int head_dim, int block_size, int window, float scale,
                         float soft_cap, const float *sinks, void *out, int bf16_io, int64_t query_stride,
                         int num_threads) {
    int group = num_heads / num_kv_heads;
    int longest = 0;
    int64_t positions = 0;  /* the call's work: positions read, summed over its sequences */
    for (int s = 0; s < num_seqs; s++) {
        longest = seq_lens[s] > longest ? seq_lens[s] : longest;
        positions += window > 0 && seq_lens[s] > window ? window : seq_lens[s];
    }
    if (window > 0 && longest > window) longest = window;
    /* a call with little work runs on the calling thread: waking the others costs more than they save */
    int threads = positions * num_kv_heads * head_dim >= MIN_PARALLEL_ELEMENTS ? num_threads : 1;
    int failed = 0;
#pragma omp parallel if (threads > 1) num_threads(threads)
    {
        size_t positions_held = longest > 0 ? (size_t)longest : 1;
        /* logits [group, longest], a tile [TILE, D], and (bf16_io) the item's query and output in float32 */
        float *logits = malloc(sizeof(float) * (group * positions_held + (size_t)TILE * head_dim
                                                + (size_t)2 * group * head_dim));
        int64_t *rows = malloc(sizeof(int64_t) * positions_held);
        if (!logits || !rows) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < num_seqs * num_kv_heads; item++) {
            if (!logits || !rows) continue;
            int s = item / num_kv_heads, h = item % num_kv_heads;
            int64_t first_row = ((int64_t)s * num_heads + (int64_t)h * group) * head_dim;  /* in out */
            int64_t query_row = (int64_t)s * query_stride + (int64_t)h * group * head_dim;
            const int32_t *table = block_tables + (int64_t)s * max_blocks;
            const float *sink = sinks ? sinks + h * group : NULL;
            float *tile = logits + group * positions_held, *q = tile + TILE * head_dim, *o = q + group * head_dim;
            if (bf16_io)
                for (int i = 0; i < group * head_dim; i++) q[i] = bf16_value(((const uint16_t *)query)[query_row + i]);
            else
                q = (float *)query + query_row, o = (float *)out + first_row;
            if (head_dim == 64)  /* a constant head_dim lets the compiler unroll the row loops */
                attend_one(q, key_cache, value_cache, is_bf16, table, seq_lens[s], h, group, num_kv_heads, 64,
                           block_size, window, scale, soft_cap, sink, o, logits, tile, rows);
            else if (head_dim == 128)
                attend_one(q, key_cache, value_cache, is_bf16, table, seq_lens[s], h, group, num_kv_heads, 128,
                           block_size, window, scale, soft_cap, sink, o, logits, tile, rows);
            else
                attend_one(q, key_cache, value_cache, is_bf16, table, seq_lens[s], h, group, num_kv_heads, head_dim,
                           block_size, window, scale, soft_cap, sink, o, logits, tile, rows);
            if (bf16_io)
                for (int i = 0; i < group * head_dim; i++) ((uint16_t *)out)[first_row + i] = bf16_round(o[i]);
        }
        free(logits);
        free(rows);
    }
    return failed ? -1 : 0;
}

/* key_cache/value_cache [num_slots, row_bytes]: each token t with slot_mapping[t] >= 0 gets key and value row t
 * (row_bytes each, rows key_stride and value_stride bytes apart) in that slot; negative slots are skipped. Returns
 * -1, having written nothing, when a slot lies past the cache. */
int pdserve_store_kv(const char *key, int64_t key_stride, const char *value, int64_t value_stride, char *key_cache,
                     char *value_cache, const int64_t *slot_mapping, int tokens, int64_t row_bytes,
                     int64_t num_slots) {
    for (int t = 0; t < tokens; t++)
        if (slot_mapping[t] >= num_slots) return -1;
    for (int t = 0; t < tokens; t++) {
        int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy(key_cache + slot * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(value_cache + slot * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}
