// Decode attention over a paged KV cache, in place, on one CPU thread (paper §4.1, Fig. 5: vLLM's paged attention
// kernel, written for a CPU). Built and loaded by pagedattn/kernels/cpu.py, which documents the arguments.
//
// For each sequence the kernel walks its block table and reads every K and V row of its context once, where it lies
// in the cache: no gather into a contiguous copy, no padding to the batch's longest context, no mask. Slots past a
// context are never read, so whatever they hold (stale values, NaN) cannot reach the output.
//
// Per sequence and query head: s_t = scale * <q, k_t> for t < context_len, p_t = exp(s_t - max s) / sum exp(...),
// out = sum_t p_t v_t; a context of length 0 gives zeros. Grouped-query attention: query head h reads kv head
// h / (num_heads / num_kv_heads).
//
// Returns 0; 1 when a block id inside a context is outside [0, num_blocks); 2 when a context is longer than its
// block table (max_blocks * block_size). Nothing is read out of bounds in either case.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// The cache slot of a sequence's token t (§4.2: block table entry t / block_size, offset t % block_size).
static inline int64_t slot(const int32_t *table, int64_t t, int64_t block_size) {
    return static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
}

template <typename T>
static int paged_attention(const T *q, const T *key_cache, const T *value_cache, const int32_t *block_tables,
                           const int32_t *context_lens, T *out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                           int64_t max_blocks, int64_t q_stride, double scale) {
    const int64_t D = head_dim, group = num_heads / num_kv_heads, row = num_kv_heads * D;  // row: one token's K
    int64_t longest = 0;
    for (int64_t s = 0; s < num_seqs; s++) longest = context_lens[s] > longest ? context_lens[s] : longest;
    if (longest > max_blocks * block_size) return 2;
    for (int64_t s = 0; s < num_seqs; s++)  // validate every table entry a context uses before reading anything
        for (int64_t b = 0; b < (context_lens[s] + block_size - 1) / block_size; b++)
            if (block_tables[s * max_blocks + b] < 0 || block_tables[s * max_blocks + b] >= num_blocks) return 1;
    std::vector<T> probs(num_heads * (longest > 0 ? longest : 1)), acc(num_heads * D);
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t L = context_lens[s] > 0 ? context_lens[s] : 0;
        const int32_t *table = block_tables + s * max_blocks;
        const T *qs = q + s * q_stride;  // q_stride: elements between sequences (a query may be a view of q|k|v)
        T *P = probs.data(), *A = acc.data();
        // scores: K read once per token and kv head, block by block
        for (int64_t t = 0; t < L; t++) {
            const T *k_row = key_cache + slot(table, t, block_size) * row;
            for (int64_t h = 0; h < num_heads; h++) {
                const T *k = k_row + (h / group) * D, *qh = qs + h * D;
                T dot = 0;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qh[d] * k[d];
                P[h * L + t] = dot * static_cast<T>(scale);
            }
        }
        // softmax per query head
        for (int64_t h = 0; h < num_heads && L > 0; h++) {
            T *p = P + h * L, m = p[0], sum = 0;
            for (int64_t t = 1; t < L; t++) m = p[t] > m ? p[t] : m;
            for (int64_t t = 0; t < L; t++) sum += (p[t] = std::exp(p[t] - m));
            const T inv = static_cast<T>(1) / sum;
            for (int64_t t = 0; t < L; t++) p[t] *= inv;
        }
        // weighted sum of V, read once per token and kv head
        std::memset(A, 0, sizeof(T) * num_heads * D);
        for (int64_t t = 0; t < L; t++) {
            const T *v_row = value_cache + slot(table, t, block_size) * row;
            for (int64_t h = 0; h < num_heads; h++) {
                const T *v = v_row + (h / group) * D, p = P[h * L + t];
                T *a = A + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a[d] += p * v[d];
            }
        }
        std::memcpy(out + s * num_heads * D, A, sizeof(T) * num_heads * D);
    }
    return 0;
}

// The KV-cache write of §4.1 (Fig. 6): token i's K and V rows go to cache slot slots[i]; a negative slot marks a
// padding token and is skipped. key/value rows are key_stride/value_stride elements apart (views of a fused q|k|v).
// Returns 0, or 1 when a slot is past the cache (nothing is written then).
template <typename T>
static int reshape_and_cache(const T *key, const T *value, T *key_cache, T *value_cache, const int64_t *slots,
                             int64_t num_tokens, int64_t row, int64_t num_slots, int64_t key_stride,
                             int64_t value_stride) {
    for (int64_t i = 0; i < num_tokens; i++)
        if (slots[i] >= num_slots) return 1;
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < 0) continue;
        std::memcpy(key_cache + slots[i] * row, key + i * key_stride, sizeof(T) * row);
        std::memcpy(value_cache + slots[i] * row, value + i * value_stride, sizeof(T) * row);
    }
    return 0;
}

#define EXPORT(NAME, T)                                                                                            \
    extern "C" int NAME(const T *q, const T *kc, const T *vc, const int32_t *tables, const int32_t *lens, T *out, \
                        int64_t s, int64_t h, int64_t kvh, int64_t d, int64_t bs, int64_t nb, int64_t mb,          \
                        int64_t q_stride, double scale) {                                                          \
        return paged_attention<T>(q, kc, vc, tables, lens, out, s, h, kvh, d, bs, nb, mb, q_stride, scale);        \
    }
EXPORT(paged_attention_f32, float)
EXPORT(paged_attention_f64, double)

#define EXPORT_WRITE(NAME, T)                                                                                      \
    extern "C" int NAME(const T *k, const T *v, T *kc, T *vc, const int64_t *slots, int64_t n, int64_t row,        \
                        int64_t num_slots, int64_t k_stride, int64_t v_stride) {                                   \
        return reshape_and_cache<T>(k, v, kc, vc, slots, n, row, num_slots, k_stride, v_stride);                   \
    }
EXPORT_WRITE(reshape_and_cache_f32, float)
EXPORT_WRITE(reshape_and_cache_f64, double)
