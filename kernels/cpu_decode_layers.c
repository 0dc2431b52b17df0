/* A decode step's decoder layers (Llama family, bfloat16) in one call: the sequence of native kernels that the
 * Python layers call one by one (engine/models/llama.py's DecoderLayer with the CPU backend's kernels), run here in
 * the same order, with the same arguments and thread counts, so the result is bit-for-bit the same. What it saves is
 * the Python between the kernels: about ten module calls, tensor allocations and ctypes conversions per layer.
 *
 * The kernels are the ones the other sources build (cpu_gemm_bf16.c, cpu_norm_rotary.c, cpu_paged_decode.c); the
 * caller passes their addresses, so each stays in its own library.
 *
 * Shapes (row-major, T tokens, one per sequence; D = head_dim, H / Hkv = query / KV heads, I = intermediate):
 *   hidden [T, hidden]            in: the embeddings; used afterwards as a residual buffer
 *   out, out_residual [T, hidden] the last layer's output and the residual beside it (the final norm's inputs)
 *   scratch                       qkv [T, (H + 2 Hkv) D] | rotated [T, (H + Hkv) D] | attended [T, H D] |
 *                                 normed [T, hidden] | residual [T, hidden] | gate_up [T, 2 I] | act [T, I] |
 *                                 heads [T, (H + Hkv) D] | normed heads [T, (H + Hkv) D] (q/k norms only)
 *   cos_sin [T, D]                the step's rotary table (cos | sin); slots [T] int64; block_tables [T, max_blocks]
 *                                 and seq_lens [T] int32
 *   kernels                       addresses: gemm, add_rms_norm, rotary, silu_mul, paged_decode, store_kv
 *   layers [num_layers, 14]       addresses: input norm, post-attention norm weights; qkv, qkv bias, o, o bias,
 *                                 gate_up, gate_up bias, down, down bias (packed panels; a bias may be 0); K and V
 *                                 caches [num_blocks, block_size, Hkv, D]; q and k norm weights [D] (Qwen3; 0: none)
 *   shape                         hidden, H, Hkv, D, I, block_size, num_slots
 * Returns 0; -1 where a product refused its shape, -2 where the attention could not allocate, -3 where a slot lies
 * past the cache (nothing of that layer stored).
 */
#include <stdint.h>
#include <string.h>

typedef int (*GemmFn)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int, int, int, int);
typedef void (*NormFn)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, uint16_t *, int, int, float,
                       int);
typedef void (*RotaryFn)(const uint16_t *, int64_t, const uint16_t *, uint16_t *, int, int, int, int);
typedef void (*SiluFn)(const uint16_t *, uint16_t *, int, int, int);
typedef int (*DecodeFn)(const void *, const void *, const void *, int, const int32_t *, int, const int32_t *, int,
                        int, int, int, int, int, float, float, const float *, void *, int, int64_t, int);
typedef int (*StoreFn)(const char *, int64_t, const char *, int64_t, char *, char *, const int64_t *, int, int64_t,
                       int64_t);

enum { INPUT_NORM, POST_NORM, QKV, QKV_BIAS, O, O_BIAS, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, KEY_CACHE,
       VALUE_CACHE, Q_NORM, K_NORM, LAYER_FIELDS };

#define AT(type, address) ((type)(intptr_t)(address))

int pdserve_decode_layers_bf16_fields(void) { return LAYER_FIELDS; }

/* Qwen3's q and k norms, then rotary, as the layer runs them: q's heads copied out of qkv and normalised as rows of
 * head_dim with q_norm, k's with k_norm, each rotated on its own; out: q [T, H, D], then k [T, Hkv, D] */
static void rotate_normed_heads(NormFn norm, RotaryFn rotary, const uint16_t *qkv, int qkv_width,
                                const uint16_t *q_norm, const uint16_t *k_norm, const uint16_t *cos_sin,
                                uint16_t *heads_in, uint16_t *heads_normed, uint16_t *out, int tokens, int heads,
                                int kv_heads, int head_dim, float eps, int threads) {
    int64_t t = tokens, q_width = (int64_t)heads * head_dim, k_width = (int64_t)kv_heads * head_dim;
    uint16_t *k_in = heads_in + t * q_width, *k_normed = heads_normed + t * q_width;
    for (int64_t i = 0; i < t; i++) {
        memcpy(heads_in + i * q_width, qkv + i * qkv_width, (size_t)q_width * 2);
        memcpy(k_in + i * k_width, qkv + i * qkv_width + q_width, (size_t)k_width * 2);
    }
    norm(heads_in, 0, q_norm, heads_normed, 0, tokens * heads, head_dim, eps, threads);
    norm(k_in, 0, k_norm, k_normed, 0, tokens * kv_heads, head_dim, eps, threads);
    rotary(heads_normed, q_width, cos_sin, out, tokens, heads, head_dim, threads);
    rotary(k_normed, k_width, cos_sin, out + t * q_width, tokens, kv_heads, head_dim, threads);
}

int pdserve_decode_layers_bf16(const int64_t *kernels, const int64_t *layers, int num_layers, const int64_t *shape,
                               float eps, float scale, uint16_t *hidden, uint16_t *out, uint16_t *out_residual,
                               uint16_t *scratch, const uint16_t *cos_sin, const int64_t *slots,
                               const int32_t *block_tables, int max_blocks, const int32_t *seq_lens, int tokens,
                               int threads) {
    GemmFn gemm = AT(GemmFn, kernels[0]);
    NormFn norm = AT(NormFn, kernels[1]);
    RotaryFn rotary = AT(RotaryFn, kernels[2]);
    SiluFn silu_mul = AT(SiluFn, kernels[3]);
    DecodeFn decode = AT(DecodeFn, kernels[4]);
    StoreFn store = AT(StoreFn, kernels[5]);
    int size = (int)shape[0], heads = (int)shape[1], kv_heads = (int)shape[2], head_dim = (int)shape[3];
    int intermediate = (int)shape[4], block_size = (int)shape[5];
    int64_t num_slots = shape[6];
    int qkv_width = (heads + 2 * kv_heads) * head_dim, rotated_width = (heads + kv_heads) * head_dim;
    int64_t t = tokens, kv_row_bytes = (int64_t)kv_heads * head_dim * 2;
    uint16_t *qkv = scratch, *rotated = qkv + t * qkv_width, *attended = rotated + t * rotated_width;
    uint16_t *normed = attended + t * heads * head_dim, *spare = normed + t * size;
    uint16_t *gate_up = spare + t * size, *act = gate_up + t * 2 * intermediate;
    uint16_t *heads_in = act + t * intermediate, *heads_normed = heads_in + t * rotated_width;
    /* the residual stream: the embeddings, then each sum in the buffer the one before did not use */
    uint16_t *residual = hidden, *next_residual = spare;
    const uint16_t *layer_input = hidden;
    for (int i = 0; i < num_layers; i++) {
        const int64_t *layer = layers + (int64_t)i * LAYER_FIELDS;
        if (i == 0)  /* no residual yet: the norm of the embeddings, which are the residual */
            norm(hidden, 0, AT(const uint16_t *, layer[INPUT_NORM]), normed, 0, tokens, size, eps, threads);
        else {
            norm(layer_input, residual, AT(const uint16_t *, layer[INPUT_NORM]), normed, next_residual, tokens, size,
                 eps, threads);
            uint16_t *summed = next_residual;
            next_residual = residual, residual = summed;
        }
        if (gemm(normed, AT(const uint16_t *, layer[QKV]), AT(const uint16_t *, layer[QKV_BIAS]), qkv, tokens, size,
                 qkv_width, threads)) return -1;
        /* rotated q and k: side by side per token (q_stride rotated_width), or, after q/k norms, all of q's
         * heads then all of k's (q_stride heads * head_dim), as the layers' separate q and k tensors lie */
        const uint16_t *rotated_k;
        int64_t q_stride, k_stride;
        if (layer[Q_NORM]) {
            rotate_normed_heads(norm, rotary, qkv, qkv_width, AT(const uint16_t *, layer[Q_NORM]),
                                AT(const uint16_t *, layer[K_NORM]), cos_sin, heads_in, heads_normed, rotated, tokens,
                                heads, kv_heads, head_dim, eps, threads);
            rotated_k = rotated + t * heads * head_dim;
            q_stride = (int64_t)heads * head_dim, k_stride = (int64_t)kv_heads * head_dim;
        } else {  /* rotated in one pass over both */
            rotary(qkv, qkv_width, cos_sin, rotated, tokens, heads + kv_heads, head_dim, threads);
            rotated_k = rotated + heads * head_dim;
            q_stride = k_stride = rotated_width;
        }
        if (store((const char *)rotated_k, k_stride * 2, (const char *)(qkv + rotated_width), (int64_t)qkv_width * 2,
                  AT(char *, layer[KEY_CACHE]), AT(char *, layer[VALUE_CACHE]), slots, tokens, kv_row_bytes,
                  num_slots)) return -3;
        if (decode(rotated, AT(const void *, layer[KEY_CACHE]), AT(const void *, layer[VALUE_CACHE]), 1, block_tables,
                   max_blocks, seq_lens, tokens, heads, kv_heads, head_dim, block_size, 0, scale, 0.0f, 0, attended, 1,
                   q_stride, threads)) return -2;
        if (gemm(attended, AT(const uint16_t *, layer[O]), AT(const uint16_t *, layer[O_BIAS]), out, tokens,
                 heads * head_dim, size, threads)) return -1;
        norm(out, residual, AT(const uint16_t *, layer[POST_NORM]), normed, next_residual, tokens, size, eps, threads);
        uint16_t *summed = next_residual;
        next_residual = residual, residual = summed;
        if (gemm(normed, AT(const uint16_t *, layer[GATE_UP]), AT(const uint16_t *, layer[GATE_UP_BIAS]), gate_up,
                 tokens, size, 2 * intermediate, threads)) return -1;
        silu_mul(gate_up, act, tokens, intermediate, threads);
        if (gemm(act, AT(const uint16_t *, layer[DOWN]), AT(const uint16_t *, layer[DOWN_BIAS]), out, tokens,
                 intermediate, size, threads)) return -1;
        layer_input = out;
    }
    memcpy(out_residual, residual, (size_t)t * size * 2);
    return 0;
}
