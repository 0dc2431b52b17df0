/* A linear layer's product on the CPU in bfloat16: y = x W^T (+ bias), float32 sums, for CPUs with AVX512-BF16.
 *
 * W is packed once (kernels/cpu_native.py, pack_bf16_weight) into panels of PANEL_BLOCKS blocks of 16 outputs.
 * Within a panel, pair kp of every output is stored together: [K/2][blocks][16][2] bfloat16, so one 64-byte
 * load holds 16 outputs' weights for two inputs, and VDPBF16PS against a broadcast pair of x adds both products
 * to 16 float32 sums. The sums stay in registers for the whole K; nothing is reduced across lanes.
 * A panel (64 outputs by K) is read from memory once per call and stays in L2 while every block of x rows
 * passes it; the next panel is prefetched into L2 while the first rows go through the current one.
 *
 * Shapes (row-major, contiguous):
 *   x       [M, K] bfloat16, K even
 *   packed  panels of [K/2][blocks][16][2] bfloat16, outputs past N zero
 *   bias    [N] bfloat16 or NULL
 *   y       [M, N] bfloat16: the float32 sum plus the bias, rounded to nearest even once
 * Threads split the rows where each gets at least ROW_SPLIT_MIN_ROWS of them (a prompt: each reads every panel,
 * cheap beside its products), else the outputs in half panels (a decode step: each weight is read by one thread).
 * Either way the split is even to 8 rows or 32 outputs, so no thread waits long for the other at the end: panels
 * alone left up to one whole panel between them (9 panels over 2 threads: 5 against 4.5). Every output sums its
 * products in the same order whatever the split, so the bytes do not depend on the thread count.
 */
#include <stdint.h>
#include "cpu_math.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define BLOCK 16                         /* outputs per 512-bit register of sums */
#define PANEL_BLOCKS 4                   /* blocks per panel: the unit of packing, prefetch and threading */
#define MIN_PARALLEL_PRODUCTS (1 << 17)  /* fewer multiply-adds (M * N * K) than this: one thread */
#define ROW_SPLIT_MIN_ROWS 32            /* rows per thread from which threads split the rows */

int pdserve_gemm_bf16_panel_blocks(void) { return PANEL_BLOCKS; }

int pdserve_gemm_bf16_supported(void) { return built_with_avx512_bf16(); }

#if defined(__AVX512BF16__)
typedef struct {
    const uint16_t *x, *packed, *bias;
    uint16_t *y;
    int M, K, N;
} Problem;

/* y rows [m0, m0 + rows), outputs of blocks [b0, b0 + blocks) of the panel at `panel` (panel_blocks wide).
 * With `next` set, this tile is pass `pass` of the `passes` that go through the panel, and it prefetches its share
 * of the next panel into L2: one pair's lines every `passes` pairs, so the stream runs evenly under all of them. */
static inline __attribute__((always_inline)) void tile(const Problem *p, const uint16_t *panel, int panel_blocks,
                                                       int n_panel, int b0, int blocks, int m0, int rows,
                                                       const char *next, int pass, int passes) {
    __m512 acc[BLOCK];
    for (int i = 0; i < blocks * rows; i++) acc[i] = _mm512_setzero_ps();
    const int pairs = p->K / 2, stride = panel_blocks * BLOCK * 2;  /* bfloat16s per pair of inputs */
    const uint32_t *x_pairs = (const uint32_t *)(p->x + (int64_t)m0 * p->K);
    for (int kp = 0; kp < pairs; kp++) {
        const uint16_t *w = panel + (int64_t)kp * stride + b0 * BLOCK * 2;
        int slot = pass * pairs + kp;  /* 0 .. passes * pairs - 1 over the panel's passes */
        if (next && slot % passes == 0)
            for (int line = 0; line < stride * 2; line += 64)
                _mm_prefetch(next + (int64_t)(slot / passes) * stride * 2 + line, _MM_HINT_T1);
        __m512bh wk[BLOCK];
        for (int b = 0; b < blocks; b++) wk[b] = (__m512bh)_mm512_loadu_si512(w + b * BLOCK * 2);
        for (int r = 0; r < rows; r++) {
            __m512bh xk = (__m512bh)_mm512_set1_epi32((int)x_pairs[(int64_t)r * pairs + kp]);
            for (int b = 0; b < blocks; b++) acc[b * rows + r] = _mm512_dpbf16_ps(acc[b * rows + r], xk, wk[b]);
        }
    }
    for (int b = 0; b < blocks; b++) {
        int n = n_panel + (b0 + b) * BLOCK;
        int valid = p->N - n < BLOCK ? p->N - n : BLOCK;
        __mmask16 mask = (__mmask16)((1u << valid) - 1);
        __m512 shift = _mm512_setzero_ps();
        if (p->bias)
            shift = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p->bias + n)), 16));
        for (int r = 0; r < rows; r++) {
            __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[b * rows + r], shift));
            _mm256_mask_storeu_epi16(p->y + (int64_t)(m0 + r) * p->N + n, mask, (__m256i)out);
        }
    }
}

/* every x row against one panel: rows in blocks of 8, 4, 2 and 1, each with the widest tile that fits */
static void panel_product(const Problem *p, int panel_index, int panels) {
    const int64_t panel_size = (int64_t)p->K * PANEL_BLOCKS * BLOCK;  /* bfloat16s in a full panel */
    const uint16_t *panel = p->packed + panel_index * panel_size;
    int n_panel = panel_index * PANEL_BLOCKS * BLOCK;
    int total_blocks = (p->N + BLOCK - 1) / BLOCK;
    int panel_blocks = total_blocks - panel_index * PANEL_BLOCKS;
    if (panel_blocks > PANEL_BLOCKS) panel_blocks = PANEL_BLOCKS;
    /* prefetched while this panel is read: the next one (its own thread's) */
    const char *next = panel_index + 1 < panels ? (const char *)(panel + panel_size) : 0;
    int m = 0, pass = 0;
    if (panel_blocks == PANEL_BLOCKS) {
        int passes = 2 * (p->M / 8) + (p->M % 8 >= 4) + (p->M % 4 >= 2) + p->M % 2;
        for (; m + 8 <= p->M; m += 8, pass += 2) {
            tile(p, panel, PANEL_BLOCKS, n_panel, 0, 2, m, 8, next, pass, passes);
            tile(p, panel, PANEL_BLOCKS, n_panel, 2, 2, m, 8, next, pass + 1, passes);
        }
        for (; m + 4 <= p->M; m += 4) tile(p, panel, PANEL_BLOCKS, n_panel, 0, 4, m, 4, next, pass++, passes);
        for (; m + 2 <= p->M; m += 2) tile(p, panel, PANEL_BLOCKS, n_panel, 0, 4, m, 2, next, pass++, passes);
        for (; m < p->M; m++) tile(p, panel, PANEL_BLOCKS, n_panel, 0, 4, m, 1, next, pass++, passes);
        return;
    }
    for (int b = 0; b < panel_blocks; b++) {  /* the last, narrower panel */
        int r = 0;
        for (; r + 8 <= p->M; r += 8) tile(p, panel, panel_blocks, n_panel, b, 1, r, 8, 0, 0, 1);
        for (; r < p->M; r++) tile(p, panel, panel_blocks, n_panel, b, 1, r, 1, 0, 0, 1);
    }
}

/* every x row against half (`half` 0 or 1: blocks 0-1 or 2-3) of a full panel */
static void half_panel_product(const Problem *p, int panel_index, int half) {
    const uint16_t *panel = p->packed + panel_index * (int64_t)p->K * PANEL_BLOCKS * BLOCK;
    int n_panel = panel_index * PANEL_BLOCKS * BLOCK, b0 = 2 * half, m = 0;
    for (; m + 8 <= p->M; m += 8) tile(p, panel, PANEL_BLOCKS, n_panel, b0, 2, m, 8, 0, 0, 1);
    for (; m + 4 <= p->M; m += 4) tile(p, panel, PANEL_BLOCKS, n_panel, b0, 2, m, 4, 0, 0, 1);
    for (; m < p->M; m++) tile(p, panel, PANEL_BLOCKS, n_panel, b0, 2, m, 1, 0, 0, 1);
}

/* Output units [u0, u1) for every row: unit u < 2 * full is half u % 2 of full panel u / 2; unit 2 * full is the
 * narrow last panel, if any. Whole panels go through panel_product, which prefetches the next one up to `end`. */
static void units_product(const Problem *p, int u0, int u1, int full) {
    if (u0 >= u1) return;
    int end = (u1 - 1 < 2 * full ? (u1 - 1) / 2 : full) + 1;  /* past the last panel this thread touches */
    int u = u0;
    if (u % 2 == 1 && u < 2 * full) half_panel_product(p, u++ / 2, 1);
    for (; u + 1 < u1 && u < 2 * full; u += 2) panel_product(p, u / 2, end);
    if (u < u1 && u < 2 * full) half_panel_product(p, u++ / 2, 0);
    if (u < u1) panel_product(p, full, end);  /* the narrow panel */
}

/* rows [m0, m1) against every panel */
static void rows_product(const Problem *p, int m0, int m1, int panels) {
    Problem part = *p;
    part.x = p->x + (int64_t)m0 * p->K;
    part.y = p->y + (int64_t)m0 * p->N;
    part.M = m1 - m0;
    for (int panel = 0; panel < panels; panel++) panel_product(&part, panel, panels);
}

/* thread `me` of `team`'s share of the product (see the split at the top) */
static void share_product(const Problem *p, int me, int team, int panels) {
    if (team == 1 || p->M >= ROW_SPLIT_MIN_ROWS * team) {  /* bounds on multiples of 8 rows; the last thread to M */
        int m0 = (int)((int64_t)p->M * me / team) & ~7;
        int m1 = me + 1 == team ? p->M : (int)((int64_t)p->M * (me + 1) / team) & ~7;
        rows_product(p, m0, m1, panels);
    } else {
        int full = (p->N + BLOCK - 1) / BLOCK / PANEL_BLOCKS, units = 2 * full + (panels > full);  /* 4-block panels */
        units_product(p, (int)((int64_t)units * me / team), (int)((int64_t)units * (me + 1) / team), full);
    }
}
#endif

/* y = x W^T (+ bias); returns 0, or -1 where this build lacks AVX512-BF16 or K is odd (nothing written) */
int pdserve_gemm_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y, int M, int K,
                      int N, int threads) {
#if defined(__AVX512BF16__)
    if (K % 2 != 0) return -1;
    Problem problem = { x, packed, bias, y, M, K, N };
    int panels = (N + PANEL_BLOCKS * BLOCK - 1) / (PANEL_BLOCKS * BLOCK);
    if ((int64_t)M * N * K < MIN_PARALLEL_PRODUCTS || panels < 2) threads = 1;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int team, me;
        thread_place(&team, &me);
        share_product(&problem, me, team, panels);
    }
    return 0;
#else
    (void)x; (void)packed; (void)bias; (void)y; (void)M; (void)K; (void)N; (void)threads;
    return -1;
#endif
}
