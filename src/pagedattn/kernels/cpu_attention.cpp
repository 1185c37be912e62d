// Decode attention over a paged KV cache, in place, on one CPU thread (paper §4.1, Fig. 5: vLLM's paged attention
// kernel, written for a CPU). Built and loaded by pagedattn/kernels/cpu.py, which documents the arguments.
//
// For each sequence and KV head the kernel walks the block table and reads the context's K and V where they lie in
// the cache, once from memory (the other query heads of a GQA group read them again from the core's cache): no
// gather into a contiguous copy, no padding to the batch's longest context, no mask. Slots past a context are never
// read, so whatever they hold (stale values, NaN) cannot reach the output. At batch 64 with ~130-token contexts on
// the 2-core VM it streams K/V at about the machine's measured copy bandwidth (0.59 ms per layer for 8.4 MB of K/V,
// against 0.93 ms for the previous version with a scalar exp and scalar-order sums).
//
// Per sequence and query head: s_t = scale * <q, k_t> for t < context_len, p_t = exp(s_t - max s) / sum exp(...),
// out = sum_t p_t v_t; a context of length 0 gives zeros. Grouped-query attention: query head h reads kv head
// h / (num_heads / num_kv_heads).
//
// Returns 0; 1 when a block id inside a context is outside [0, num_blocks); 2 when a context is longer than its
// block table (max_blocks * block_size). Nothing is read out of bounds in either case.
//
// bf16 (K/V cache, query and output in bf16, arithmetic in fp32): bf16 is the upper 16 bits of an fp32, so reading
// one is a shift (portable, vectorised by the compiler); writing one rounds to nearest even, as torch's
// `.to(torch.bfloat16)`. Where the compiler targets AVX512_BF16 (cpu.py builds with -march=native, per CPU), the
// q.k dot products use VDPBF16PS (__AVX512BF16__ below); elsewhere the portable path runs.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "bf16.h"

// The type the kernel computes in for a storage type: fp32 and fp64 their own, bf16 in fp32.
template <typename T> struct acc_of { typedef T type; };
template <> struct acc_of<bf16> { typedef float type; };

// Calls f(t, row_t) for each token t < L of a sequence, row_t pointing at its row in `cache` (one head's slice when
// `cache` is offset to that head), block by block through the block table (§4.2: token t lies in block
// table[t / block_size] at offset t % block_size).
template <typename T, typename F>
static inline void for_each_row(const T *cache, const int32_t *table, int64_t L, int64_t row, int64_t block_size,
                                F f) {
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const T *block = cache + static_cast<int64_t>(table[t0 / block_size]) * block_size * row;
        const int64_t n = L - t0 < block_size ? L - t0 : block_size;
        for (int64_t i = 0; i < n; i++) f(t0 + i, block + i * row);
    }
}

// exp(x) for x <= 0 in fp32, vectorisable (std::exp is a scalar library call: it was a third of the kernel's time).
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-7 Taylor polynomial for e^r (truncation error below
// 6e-9 relative) and 2^n built in the exponent bits. Measured against float64 over 2.1 million points, built with
// cpu.py's flags: within 1.4 fp32 ulp for x in [-10, 0], 4.5 ulp down to -87 (the flags let the compiler fold the
// two-part ln2). Below -87.33, where e^x < 2^-126 is a denormal, it gives 0: the softmax's largest term is e^0 = 1,
// so such a term is far below the sum's resolution.
static inline float exp_nonpositive(float x) {
    const bool tiny = x < -87.33f;
    x = tiny ? 0.0f : x;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f;  // ln2 split in a high part exact in fp32 and a low part
    r = r - n * 1.428606765330187045e-06f;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return tiny ? 0.0f : p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}
static inline float exp_nonpositive_t(float x) { return exp_nonpositive(x); }
static inline double exp_nonpositive_t(double x) { return std::exp(x); }  // fp64: the library's, for the reference tests

// out = inv * sum_t p[t] v_t for one head, with head_dim D known at compile time: the accumulator is a handful of
// vector registers of the compute type A (GCC/clang vector extensions; lowered to narrower vectors where the CPU has
// no 64-byte ones). bf16 rows are widened a vector at a time (zero-extend, shift).
template <typename T, typename A, int64_t D>
static inline void accumulate_v(const T *value_cache, const int32_t *table, const A *p, int64_t L, int64_t row,
                                int64_t block_size, A inv, T *out) {
    typedef A vec __attribute__((vector_size(64)));
    constexpr int64_t W = 64 / sizeof(A), N = D / W;  // lanes per vector, vectors per head
    static_assert(D % W == 0, "head_dim must be a multiple of the vector width");
    vec acc[N] = {};
    for_each_row(value_cache, table, L, row, block_size, [&](int64_t t, const T *v) {
        for (int64_t j = 0; j < N; j++) {
            vec x;
            if constexpr (sizeof(T) == sizeof(A)) {
                __builtin_memcpy(&x, v + j * W, sizeof x);
            } else {
                typedef bf16 half __attribute__((vector_size(32)));
                typedef uint32_t wide __attribute__((vector_size(64)));
                half h;
                __builtin_memcpy(&h, v + j * W, sizeof h);
                const wide u = __builtin_convertvector(h, wide) << 16;
                __builtin_memcpy(&x, &u, sizeof x);
            }
            acc[j] += p[t] * x;
        }
    });
    for (int64_t j = 0; j < N; j++) {
        const vec r = acc[j] * inv;
        for (int64_t i = 0; i < W; i++) narrow(r[i], out + j * W + i);
    }
}

// <q, k> over d_len elements in the compute type. bf16 with AVX512_BF16 and D a multiple of 32: VDPBF16PS (pairs of
// bf16 products, exact in fp32, summed into fp32 lanes; the instruction treats denormal inputs as zero).
template <typename T, int64_t D>
static inline typename acc_of<T>::type dot_qk(const T *q, const T *k, int64_t d_len) {
#ifdef __AVX512BF16__
    if constexpr (sizeof(T) == 2 && D > 0 && D % 32 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
        return _mm512_reduce_add_ps(acc);
    }
#endif
    typename acc_of<T>::type dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < d_len; d++) dot += widen(q[d]) * widen(k[d]);
    return dot;
}

// One sequence and one KV head: the `group` query heads that share it (GQA), with head_dim D known at compile time
// when D > 0 (the common 32/64/128: the dot products and accumulators stay in registers), else `dim` at run time.
// T is the storage type, A = acc_of<T> the compute type (scores, softmax, sums).
template <typename T, int64_t D, typename A = typename acc_of<T>::type>
static void attend_kv_head(const T *qg, const T *key_cache, const T *value_cache, const int32_t *table, int64_t L,
                           int64_t group, int64_t dim, int64_t row, int64_t block_size, A scale, A *P, T *out) {
    const int64_t d_len = D > 0 ? D : dim;
    for (int64_t h = 0; h < group; h++) {  // scores: K read once per token, block by block
        const T *qh = qg + h * d_len;
        A *p = P + h * L;
        for_each_row(key_cache, table, L, row, block_size,
                     [&](int64_t t, const T *k) { p[t] = dot_qk<T, D>(qh, k, d_len) * scale; });
        A m = p[0], sum = 0;  // softmax
#pragma omp simd reduction(max : m)
        for (int64_t t = 1; t < L; t++) m = p[t] > m ? p[t] : m;
#pragma omp simd
        for (int64_t t = 0; t < L; t++) p[t] = exp_nonpositive_t(p[t] - m);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; t++) sum += p[t];
        const A inv = static_cast<A>(1) / sum;
        T *o = out + h * d_len;
        if constexpr (D > 0) {
            accumulate_v<T, A, D>(value_cache, table, p, L, row, block_size, inv, o);
        } else {
            std::vector<A> acc(d_len, 0);
            for_each_row(value_cache, table, L, row, block_size, [&](int64_t t, const T *v) {  // weighted sum of V
#pragma omp simd
                for (int64_t d = 0; d < d_len; d++) acc[d] += p[t] * widen(v[d]);
            });
            for (int64_t d = 0; d < d_len; d++) narrow(acc[d] * inv, o + d);
        }
    }
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
    typedef typename acc_of<T>::type A;
    std::vector<A> probs(group * (longest > 0 ? longest : 1));
    auto attend = D == 32 ? attend_kv_head<T, 32> : D == 64 ? attend_kv_head<T, 64>
                : D == 128 ? attend_kv_head<T, 128> : attend_kv_head<T, 0>;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t L = context_lens[s] > 0 ? context_lens[s] : 0;
        T *o = out + s * num_heads * D;
        if (L == 0) {
            std::memset(o, 0, sizeof(T) * num_heads * D);
            continue;
        }
        for (int64_t g = 0; g < num_kv_heads; g++)  // q_stride: elements between sequences (q may be a view of q|k|v)
            attend(q + s * q_stride + g * group * D, key_cache + g * D, value_cache + g * D, block_tables + s * max_blocks,
                   L, group, D, row, block_size, static_cast<A>(scale), probs.data(), o + g * group * D);
    }
    return 0;
}

// The KV-cache write of §4.1 (Fig. 6): token i's K and V rows go to cache slot slots[i]; a negative slot marks a
// padding token and is skipped. key/value rows are key_stride/value_stride elements apart (views of a fused q|k|v).
// S is the rows' type, T the cache's: the same (a copy), or fp32 rows into a bf16 cache (rounded to nearest even).
// Returns 0, or 1 when a slot is past the cache (nothing is written then).
template <typename S, typename T>
static int reshape_and_cache(const S *key, const S *value, T *key_cache, T *value_cache, const int64_t *slots,
                             int64_t num_tokens, int64_t row, int64_t num_slots, int64_t key_stride,
                             int64_t value_stride) {
    for (int64_t i = 0; i < num_tokens; i++)
        if (slots[i] >= num_slots) return 1;
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < 0) continue;
        if constexpr (sizeof(S) == sizeof(T)) {
            std::memcpy(key_cache + slots[i] * row, key + i * key_stride, sizeof(T) * row);
            std::memcpy(value_cache + slots[i] * row, value + i * value_stride, sizeof(T) * row);
        } else {
            for (int64_t d = 0; d < row; d++) narrow(key[i * key_stride + d], key_cache + slots[i] * row + d);
            for (int64_t d = 0; d < row; d++) narrow(value[i * value_stride + d], value_cache + slots[i] * row + d);
        }
    }
    return 0;
}

// The exported functions' signatures, as a version: bump it with any change to an exported name, argument or return
// type, here or in cpu_layer_ops.cpp, and set the same number as ABI_VERSION in cpu.py, which declares the ctypes
// signatures and refuses a library whose version differs.
extern "C" int pagedattn_abi_version() { return 3; }

#define EXPORT(NAME, T)                                                                                            \
    extern "C" int NAME(const T *q, const T *kc, const T *vc, const int32_t *tables, const int32_t *lens, T *out, \
                        int64_t s, int64_t h, int64_t kvh, int64_t d, int64_t bs, int64_t nb, int64_t mb,          \
                        int64_t q_stride, double scale) {                                                          \
        return paged_attention<T>(q, kc, vc, tables, lens, out, s, h, kvh, d, bs, nb, mb, q_stride, scale);        \
    }
EXPORT(paged_attention_f32, float)
EXPORT(paged_attention_f64, double)
EXPORT(paged_attention_bf16, bf16)

#define EXPORT_WRITE(NAME, S, T)                                                                                   \
    extern "C" int NAME(const S *k, const S *v, T *kc, T *vc, const int64_t *slots, int64_t n, int64_t row,        \
                        int64_t num_slots, int64_t k_stride, int64_t v_stride) {                                   \
        return reshape_and_cache<S, T>(k, v, kc, vc, slots, n, row, num_slots, k_stride, v_stride);                \
    }
EXPORT_WRITE(reshape_and_cache_f32, float, float)
EXPORT_WRITE(reshape_and_cache_f64, double, double)
EXPORT_WRITE(reshape_and_cache_bf16, bf16, bf16)
EXPORT_WRITE(reshape_and_cache_f32_bf16, float, bf16)
