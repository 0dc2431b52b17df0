/* Paged prefill attention for the CPU in bfloat16 (AVX512-BF16): each sequence's new query rows against its
 * context in the paged cache (a cached prefix and the new tokens, already stored), causal, with an optional
 * sliding window. Products are VDPBF16PS (exact products, float32 sums); the softmax runs online in float32 over
 * blocks of 64 keys, and its weights are rounded to bfloat16 for the value product, as torch's CPU flash
 * attention rounds them.
 *
 * Shapes (row-major, contiguous):
 *   query        [T, Hq, D]      bfloat16, the new tokens of all sequences; query_stride elements from one token's
 *                                row to the next (heads and dims contiguous, as q split from one projection)
 *   key/value    [N, B, Hkv, D]  bfloat16
 *   block_tables [S, max_blocks] int32
 *   query_start  [S + 1]         int32: sequence s's query rows are [query_start[s], query_start[s + 1])
 *   seq_lens     [S]             int32: its context length (prefix + new tokens)
 *   out          [T, Hq, D]      bfloat16
 * Query row j of a sequence with q new tokens and context L sits at position p = L - q + j and sees the keys
 * at [0, p], or (p - window, p] with window > 0. D is a multiple of 32, at most 256.
 *
 * First every (sequence, KV head)'s visible keys and values are copied out of the paged cache into the
 * products' layouts (K: each pair of dimensions of 64 keys together; V: each pair of keys together per
 * dimension). Then the work is split over (sequence, KV head, 16 query positions) items; an item's rows are its
 * positions times the query heads that share the KV head, taken 6 rows at a time.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_math.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

int pdserve_prefill_bf16_supported(void) { return built_with_avx512_bf16(); }

#if defined(__AVX512BF16__)

#define KEYS 64          /* keys per block: four vectors of 16 */
#define ROWS 6           /* query rows per register block */
#define POSITIONS 16     /* query positions per work item */
#define PV_VECTORS 24    /* value accumulators a row block keeps in registers: rows x (D / 16) */
#define MIN_PARALLEL_FLOPS (1 << 22)  /* below this a call runs on the calling thread */

typedef struct {
    int seq, kv_head, first;  /* a work item: query positions [first, first + POSITIONS) of one sequence's KV head */
} Item;

typedef struct {
    int begin, count;     /* query rows [begin, begin + count) of [T] */
    int prefix;           /* context positions before the first new token */
    int first_key;        /* the earliest position any row sees */
    int span, padded;     /* keys from first_key; that rounded up to a whole block */
    int64_t packed;       /* element offset of head 0's packed keys (and values) */
} Sequence;

static inline float exp_scalar(float x) {  /* exp(x) for x <= 0 through the vector code */
    return _mm512_cvtss_f32(exp_nonpositive_16(_mm512_set1_ps(x)));
}

/* Position `position`'s row of one KV head in the paged cache, as 32-bit pairs of bfloat16. */
static inline const uint32_t *cache_row(const uint16_t *cache, const int32_t *table, int position, int block_size,
                                        int num_kv_heads, int kv_head, int head_dim) {
    int64_t slot = (int64_t)table[position / block_size] * block_size + position % block_size;
    return (const uint32_t *)(cache + (slot * num_kv_heads + kv_head) * head_dim);
}

/* One (sequence, KV head)'s keys [first_key, first_key + padded) into [padded / 64][D / 2][64] pairs and its values
 * into [padded / 2][D] pairs of keys; positions past the span are zeros. */
static void pack_head(const uint16_t *key_cache, const uint16_t *value_cache, const int32_t *table,
                      const Sequence *seq, int kv_head, int num_kv_heads, int head_dim, int block_size,
                      uint32_t *keys, uint32_t *values) {
    const int pairs = head_dim / 2;
    for (int k = 0; k < seq->padded; k++) {
        uint32_t *key_column = keys + (int64_t)(k / KEYS) * pairs * KEYS + k % KEYS;
        uint16_t *value_pairs = (uint16_t *)(values + (int64_t)(k / 2) * head_dim) + k % 2;
        if (k >= seq->span) {
            for (int p = 0; p < pairs; p++) key_column[p * KEYS] = 0;
            for (int d = 0; d < head_dim; d++) value_pairs[2 * d] = 0;
            continue;
        }
        int position = seq->first_key + k;
        const uint32_t *key = cache_row(key_cache, table, position, block_size, num_kv_heads, kv_head, head_dim);
        const uint16_t *value = (const uint16_t *)cache_row(value_cache, table, position, block_size, num_kv_heads,
                                                            kv_head, head_dim);
        for (int p = 0; p < pairs; p++) key_column[p * KEYS] = key[p];
        for (int d = 0; d < head_dim; d++) value_pairs[2 * d] = value[d];
    }
}

/* The row block's logits against `vectors` x 16 keys from `block`, scaled, masked outside each row's
 * [low, high] (key indices), into logits[ROWS][KEYS]. */
static inline __attribute__((always_inline)) void block_logits(
        const uint32_t *const *query_rows, const uint32_t *keys, int key_index, int vectors, int pairs,
        float scale, const int *low, const int *high, float *logits) {
    __m512 acc[ROWS][KEYS / 16];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < vectors; v++) acc[r][v] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        __m512bh k[KEYS / 16];
        for (int v = 0; v < vectors; v++) k[v] = (__m512bh)_mm512_loadu_si512(keys + p * KEYS + 16 * v);
        for (int r = 0; r < ROWS; r++) {
            __m512bh q = (__m512bh)_mm512_set1_epi32((int)query_rows[r][p]);
            for (int v = 0; v < vectors; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], q, k[v]);
        }
    }
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < vectors; v++) {
            __m512i index = _mm512_add_epi32(lanes, _mm512_set1_epi32(key_index + 16 * v));
            __mmask16 seen = _mm512_cmp_epi32_mask(index, _mm512_set1_epi32(high[r]), _MM_CMPINT_LE)
                             & _mm512_cmp_epi32_mask(index, _mm512_set1_epi32(low[r]), _MM_CMPINT_NLT);
            __m512 scaled = _mm512_mul_ps(acc[r][v], _mm512_set1_ps(scale));
            _mm512_storeu_ps(logits + r * KEYS + 16 * v, _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), scaled));
        }
}

/* Online softmax over one block: each row's running maximum and sum move on, its weights (bfloat16 pairs) go to
 * weights[ROWS][KEYS / 2], and correction[r] is what the row's earlier value sums must be multiplied by. */
static inline void block_softmax(const float *logits, int vectors, float *maximum, float *sum, float *correction,
                                 uint32_t *weights) {
    for (int r = 0; r < ROWS; r++) {
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int v = 0; v < vectors; v++) top = _mm512_max_ps(top, _mm512_loadu_ps(logits + r * KEYS + 16 * v));
        float block_max = _mm512_reduce_max_ps(top);
        float new_max = block_max > maximum[r] ? block_max : maximum[r];
        correction[r] = new_max == -INFINITY ? 1.0f : exp_scalar(maximum[r] - new_max);
        __m512 total = _mm512_setzero_ps(), shift = _mm512_set1_ps(new_max);
        for (int v = 0; v < vectors; v++) {
            __m512 e = exp_nonpositive_16(_mm512_sub_ps(_mm512_loadu_ps(logits + r * KEYS + 16 * v), shift));
            total = _mm512_add_ps(total, e);
            _mm256_storeu_si256((__m256i *)(weights + r * (KEYS / 2) + 8 * v), (__m256i)_mm512_cvtneps_pbh(e));
        }
        sum[r] = sum[r] * correction[r] + _mm512_reduce_add_ps(total);
        maximum[r] = new_max;
    }
}

/* out[r] = out[r] * correction[r] + weights[r] . V for `rows` rows and `vectors` x 16 keys of the block
 * (values: the block's first pair of keys); D = 16 * dims vectors. */
static inline __attribute__((always_inline)) void block_values(
        const uint32_t *weights, const uint32_t *values, int vectors, const float *correction, float *out,
        int rows, int dims, int head_dim) {
    __m512 acc[PV_VECTORS];
    for (int r = 0; r < rows; r++)
        for (int d = 0; d < dims; d++)
            acc[r * dims + d] = _mm512_mul_ps(_mm512_loadu_ps(out + r * head_dim + 16 * d),
                                              _mm512_set1_ps(correction[r]));
    for (int j = 0; j < vectors * 8; j++) {
        for (int d = 0; d < dims; d++) {
            __m512bh v = (__m512bh)_mm512_loadu_si512(values + (int64_t)j * head_dim + 16 * d);
            for (int r = 0; r < rows; r++)
                acc[r * dims + d] = _mm512_dpbf16_ps(acc[r * dims + d],
                                                     (__m512bh)_mm512_set1_epi32((int)weights[r * (KEYS / 2) + j]), v);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int d = 0; d < dims; d++) _mm512_storeu_ps(out + r * head_dim + 16 * d, acc[r * dims + d]);
}

/* One block of ROWS query rows through every key block they see; their outputs (bfloat16) to out_rows. */
static inline __attribute__((always_inline)) void attend_rows(
        const uint32_t *const *query_rows, uint16_t *const *out_rows, int valid_rows, const int *low,
        const int *high, const uint32_t *keys, const uint32_t *values, float scale, int head_dim) {
    const int pairs = head_dim / 2, dims = head_dim / 16;
    const int rows_per_pass = PV_VECTORS / dims < ROWS ? PV_VECTORS / dims : ROWS;
    float logits[ROWS * KEYS], out[ROWS * head_dim];
    float maximum[ROWS], sum[ROWS], correction[ROWS];
    uint32_t weights[ROWS * KEYS / 2];
    int first = INT32_MAX, last = 0;
    for (int r = 0; r < ROWS; r++) {
        maximum[r] = -INFINITY, sum[r] = 0.0f;
        first = low[r] < first ? low[r] : first;
        last = high[r] > last ? high[r] : last;
    }
    memset(out, 0, sizeof(out));
    for (int block = first / KEYS * KEYS; block <= last; block += KEYS) {
        int vectors = (last - block) / 16 + 1;  /* the diagonal block reads only the vectors a row sees */
        vectors = vectors > KEYS / 16 ? KEYS / 16 : vectors;
        const uint32_t *block_keys = keys + (int64_t)(block / KEYS) * pairs * KEYS;
        switch (vectors) {  /* a constant count keeps the accumulators in registers */
        case 4: block_logits(query_rows, block_keys, block, 4, pairs, scale, low, high, logits); break;
        case 3: block_logits(query_rows, block_keys, block, 3, pairs, scale, low, high, logits); break;
        case 2: block_logits(query_rows, block_keys, block, 2, pairs, scale, low, high, logits); break;
        default: block_logits(query_rows, block_keys, block, 1, pairs, scale, low, high, logits); break;
        }
        block_softmax(logits, vectors, maximum, sum, correction, weights);
        const uint32_t *block_values_start = values + (int64_t)(block / 2) * head_dim;
        for (int r = 0; r < ROWS; r += rows_per_pass) {
            int rows = ROWS - r < rows_per_pass ? ROWS - r : rows_per_pass;
            if (head_dim == 64)
                block_values(weights + r * (KEYS / 2), block_values_start, vectors, correction + r, out + r * 64,
                             rows, 4, 64);
            else if (head_dim == 128)
                block_values(weights + r * (KEYS / 2), block_values_start, vectors, correction + r, out + r * 128,
                             rows, 8, 128);
            else
                block_values(weights + r * (KEYS / 2), block_values_start, vectors, correction + r,
                             out + r * head_dim, rows, dims, head_dim);
        }
    }
    for (int r = 0; r < valid_rows; r++) {
        __m512 inverse = _mm512_set1_ps(sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f);
        for (int d = 0; d < dims; d++)
            _mm256_storeu_si256((__m256i *)(out_rows[r] + 16 * d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(out + r * head_dim + 16 * d),
                                                                          inverse)));
    }
}

/* Work item: query positions [first, first + POSITIONS) of one sequence and KV head, ROWS rows at a time. */
static void attend_item(const uint16_t *query, int64_t query_stride, uint16_t *out, const Sequence *seq, int kv_head,
                        int first, int num_heads, int group, int head_dim, int window, float scale,
                        const uint32_t *keys, const uint32_t *values) {
    int positions = seq->count - first < POSITIONS ? seq->count - first : POSITIONS;
    int rows = positions * group;
    for (int row = 0; row < rows; row += ROWS) {
        const uint32_t *query_rows[ROWS];
        uint16_t *out_rows[ROWS];
        int low[ROWS], high[ROWS];
        for (int r = 0; r < ROWS; r++) {
            int index = row + r < rows ? row + r : rows - 1;  /* past the item: the last row again, not stored */
            int token = seq->begin + first + index / group, head = kv_head * group + index % group;
            int position = seq->prefix + first + index / group;
            query_rows[r] = (const uint32_t *)(query + token * query_stride + (int64_t)head * head_dim);
            out_rows[r] = out + ((int64_t)token * num_heads + head) * head_dim;
            high[r] = position - seq->first_key;
            low[r] = window > 0 && position - window + 1 > seq->first_key ? position - window + 1 - seq->first_key : 0;
        }
        int valid = rows - row < ROWS ? rows - row : ROWS;
        if (head_dim == 64)
            attend_rows(query_rows, out_rows, valid, low, high, keys, values, scale, 64);
        else if (head_dim == 128)
            attend_rows(query_rows, out_rows, valid, low, high, keys, values, scale, 128);
        else
            attend_rows(query_rows, out_rows, valid, low, high, keys, values, scale, head_dim);
    }
}

/* Each sequence's span and packed offset; returns the packed elements (keys or values) of all of them. */
static int64_t plan_sequences(const int32_t *query_start, const int32_t *seq_lens, int num_seqs, int num_kv_heads,
                              int head_dim, int window, Sequence *seqs, int64_t *flops) {
    int64_t offset = 0;
    *flops = 0;
    for (int s = 0; s < num_seqs; s++) {
        Sequence *seq = seqs + s;
        seq->begin = query_start[s];
        seq->count = query_start[s + 1] - query_start[s];
        seq->prefix = seq_lens[s] - seq->count;
        int earliest = window > 0 ? seq->prefix - window + 1 : 0;
        seq->first_key = earliest > 0 ? earliest : 0;
        seq->span = seq->count > 0 ? seq_lens[s] - seq->first_key : 0;
        seq->padded = (seq->span + KEYS - 1) / KEYS * KEYS;
        seq->packed = offset;
        offset += (int64_t)num_kv_heads * seq->padded * head_dim / 2;
        *flops += (int64_t)seq->count * seq->span * head_dim * 2;  /* per query head, causal: about half */
    }
    return offset;
}

int pdserve_prefill_bf16(const uint16_t *query, int64_t query_stride, const uint16_t *key_cache,
                         const uint16_t *value_cache,
                         const int32_t *block_tables, int max_blocks, const int32_t *query_start,
                         const int32_t *seq_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                         int block_size, int window, float scale, uint16_t *out, int num_threads) {
    int group = num_heads / num_kv_heads;
    Sequence *seqs = malloc(sizeof(Sequence) * (num_seqs > 0 ? num_seqs : 1));
    if (!seqs) return -1;
    int64_t flops, packed = plan_sequences(query_start, seq_lens, num_seqs, num_kv_heads, head_dim, window, seqs,
                                           &flops);
    uint32_t *keys = malloc(sizeof(uint32_t) * (packed > 0 ? packed : 1));
    uint32_t *values = malloc(sizeof(uint32_t) * (packed > 0 ? packed : 1));
    int items = 0;
    for (int s = 0; s < num_seqs; s++) items += (seqs[s].count + POSITIONS - 1) / POSITIONS * num_kv_heads;
    Item *work = malloc(sizeof(Item) * (items > 0 ? items : 1));
    if (!keys || !values || !work) {
        free(seqs), free(keys), free(values), free(work);
        return -1;
    }
    for (int s = 0, i = 0; s < num_seqs; s++)
        for (int first = 0; first < seqs[s].count; first += POSITIONS)
            for (int h = 0; h < num_kv_heads; h++) work[i++] = (Item){s, h, first};
    int threads = flops * num_heads >= MIN_PARALLEL_FLOPS ? num_threads : 1;
#pragma omp parallel if (threads > 1) num_threads(threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int pair = 0; pair < num_seqs * num_kv_heads; pair++) {
            const Sequence *seq = seqs + pair / num_kv_heads;
            int kv_head = pair % num_kv_heads;
            int64_t offset = seq->packed + (int64_t)kv_head * seq->padded * head_dim / 2;
            pack_head(key_cache, value_cache, block_tables + (int64_t)(pair / num_kv_heads) * max_blocks, seq,
                      kv_head, num_kv_heads, head_dim, block_size, keys + offset, values + offset);
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = items - 1; i >= 0; i--) {  /* a sequence's last positions see the most keys: first */
            const Sequence *seq = seqs + work[i].seq;
            int64_t offset = seq->packed + (int64_t)work[i].kv_head * seq->padded * head_dim / 2;
            attend_item(query, query_stride, out, seq, work[i].kv_head, work[i].first, num_heads, group, head_dim,
                        window, scale, keys + offset, values + offset);
        }
    }
    free(seqs), free(keys), free(values), free(work);
    return 0;
}

#else

int pdserve_prefill_bf16(void) { return -2; }  /* never called: pdserve_prefill_bf16_supported() is 0 */

#endif
