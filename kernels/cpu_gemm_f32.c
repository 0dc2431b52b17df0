/* A linear layer's product on the CPU in float32: y = x W^T (+ bias), for CPUs with AVX2 and FMA.
 *
 * W is packed once (kernels/cpu_gemm_f32.py, pack_weight) into panels of PANEL_BLOCKS blocks of 8 outputs. Within a
 * panel, input k of every output is stored together: [K][blocks][8] float32, so one aligned 64-byte line holds 16
 * outputs' weights for one input, and an FMA against a broadcast x[r][k] adds that input's products to 8 float32
 * sums. A tile of up to 6 rows by the panel's 16 outputs keeps its 12 sums in registers for the whole K; a panel
 * (16 outputs by K) is read from memory once per ROW_CHUNK rows (once per call in a decode step).
 *
 * Shapes (row-major, contiguous):
 *   x       [M, K] float32
 *   packed  panels of [K][blocks][8] float32, outputs past N zero
 *   bias    [N] float32 or NULL
 *   y       [M, N] float32
 * Threads split the panels (each weight is read by one thread). Every output sums its products in the order of k,
 * then adds the bias, whatever the split and the rows beside it, so the bytes depend neither on the thread count
 * nor on the batch.
 */
#include <stdint.h>
#include "cpu_math.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define BLOCK 8                          /* outputs per 256-bit register of sums */
#define PANEL_BLOCKS 2                   /* blocks per panel (one cache line per k): the unit of packing, threading */
#define TILE_ROWS 6                      /* rows per tile: 6 x 2 sums, 2 weights and a broadcast in 16 registers */
#define ROW_CHUNK 192                    /* rows that pass all of a thread's panels before the next rows do */
#define MIN_PARALLEL_PRODUCTS (1 << 17)  /* fewer multiply-adds (M * N * K) than this: one thread */

int pdserve_gemm_f32_panel_blocks(void) { return PANEL_BLOCKS; }

int pdserve_gemm_f32_supported(void) {  /* 1 where this build runs AVX2 and FMA code (-march=native has them) */
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
typedef struct {
    const float *x, *packed, *bias;
    float *y;
    int M, K, N;
} Problem;

/* one block's 8 sums of row m (outputs from n), plus the bias, into y (the outputs past N dropped) */
static inline void store(const Problem *p, const float *sums, int n, int m) {
    int valid = p->N - n < BLOCK ? p->N - n : BLOCK;
    float *out = p->y + (int64_t)m * p->N + n;
    for (int i = 0; i < valid; i++) out[i] = p->bias ? sums[i] + p->bias[n + i] : sums[i];
}

/* loops over registers unrolled whole: otherwise GCC keeps the sums in memory and stores them on every k */
#define UNROLLED _Pragma("GCC unroll 16")

/* y rows [m0, m0 + ROWS) by NB blocks, from block b0, of the panel at `panel` (`blocks` wide, its outputs from
 * n_panel): NB is 2 (a full panel) or 1 (a block of the narrow last one), fixed so the sums stay in registers */
#define DEFINE_TILE(ROWS, NB)                                                                                   \
static void tile_##ROWS##_##NB(const Problem *p, const float *panel, int blocks, int b0, int n_panel, int m0) { \
    __m256 acc[ROWS * NB];                                                                                      \
    UNROLLED for (int i = 0; i < ROWS * NB; i++) acc[i] = _mm256_setzero_ps();                                  \
    const int K = p->K;                                                                                         \
    const float *x = p->x + (int64_t)m0 * K;                                                                    \
    const float *w = panel + b0 * BLOCK;                                                                        \
    const int stride = blocks * BLOCK;                                                                          \
    for (int k = 0; k < K; k++, w += stride) {                                                                  \
        __m256 wk[NB];                                                                                          \
        UNROLLED for (int b = 0; b < NB; b++) wk[b] = _mm256_loadu_ps(w + b * BLOCK);                           \
        UNROLLED for (int r = 0; r < ROWS; r++) {                                                               \
            __m256 xk = _mm256_broadcast_ss(x + (int64_t)r * K + k);                                            \
            UNROLLED for (int b = 0; b < NB; b++) acc[r * NB + b] = _mm256_fmadd_ps(wk[b], xk, acc[r * NB + b]); \
        }                                                                                                       \
    }                                                                                                           \
    float sums[ROWS * NB][BLOCK];                                                                               \
    UNROLLED for (int i = 0; i < ROWS * NB; i++) _mm256_storeu_ps(sums[i], acc[i]);                             \
    for (int b = 0; b < NB; b++)                                                                                \
        for (int r = 0; r < ROWS; r++) store(p, sums[r * NB + b], n_panel + (b0 + b) * BLOCK, m0 + r);          \
}

DEFINE_TILE(6, 2)
DEFINE_TILE(5, 2)
DEFINE_TILE(4, 2)
DEFINE_TILE(3, 2)
DEFINE_TILE(2, 2)
DEFINE_TILE(1, 2)
DEFINE_TILE(6, 1)
DEFINE_TILE(1, 1)

/* x rows [m0, m1) against panel `index`: 6 rows at a time, then the 5 to 1 left */
static void panel_product(const Problem *p, int index, int m0, int m1) {
    int total_blocks = (p->N + BLOCK - 1) / BLOCK;
    int blocks = total_blocks - index * PANEL_BLOCKS;
    if (blocks > PANEL_BLOCKS) blocks = PANEL_BLOCKS;
    const float *panel = p->packed + (int64_t)index * p->K * PANEL_BLOCKS * BLOCK;
    int n_panel = index * PANEL_BLOCKS * BLOCK, m = m0;
    if (blocks < PANEL_BLOCKS) {  /* the narrow last panel: block by block */
        for (int b = 0; b < blocks; b++) {
            for (m = m0; m + TILE_ROWS <= m1; m += TILE_ROWS) tile_6_1(p, panel, blocks, b, n_panel, m);
            for (; m < m1; m++) tile_1_1(p, panel, blocks, b, n_panel, m);
        }
        return;
    }
    for (; m + TILE_ROWS <= m1; m += TILE_ROWS) tile_6_2(p, panel, blocks, 0, n_panel, m);
    switch (m1 - m) {
        case 5: tile_5_2(p, panel, blocks, 0, n_panel, m); break;
        case 4: tile_4_2(p, panel, blocks, 0, n_panel, m); break;
        case 3: tile_3_2(p, panel, blocks, 0, n_panel, m); break;
        case 2: tile_2_2(p, panel, blocks, 0, n_panel, m); break;
        case 1: tile_1_2(p, panel, blocks, 0, n_panel, m); break;
        default: break;
    }
}
#endif

/* y = x W^T (+ bias); returns 0, or -1 where this build lacks AVX2 or FMA (nothing written) */
int pdserve_gemm_f32(const float *x, const float *packed, const float *bias, float *y, int M, int K, int N,
                     int threads) {
#if defined(__AVX2__) && defined(__FMA__)
    Problem problem = { x, packed, bias, y, M, K, N };
    int panels = (N + PANEL_BLOCKS * BLOCK - 1) / (PANEL_BLOCKS * BLOCK);
    if ((int64_t)M * N * K < MIN_PARALLEL_PRODUCTS || panels < 2) threads = 1;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int team, me;
        thread_place(&team, &me);
        int first = (int)((int64_t)panels * me / team), last = (int)((int64_t)panels * (me + 1) / team);
        for (int m0 = 0; m0 < M; m0 += ROW_CHUNK) {  /* a chunk of x stays in L2 while the panels pass */
            int m1 = m0 + ROW_CHUNK < M ? m0 + ROW_CHUNK : M;
            for (int panel = first; panel < last; panel++) panel_product(&problem, panel, m0, m1);
        }
    }
    return 0;
#else
    (void)x; (void)packed; (void)bias; (void)y; (void)M; (void)K; (void)N; (void)threads;
    return -1;
#endif
}
