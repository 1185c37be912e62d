// Decode attention over a paged KV cache, in place, on one CPU thread per call (paper §4.1, Fig. 5: vLLM's paged
// attention kernel, written for a CPU; cpu.py may run shares of a batch on several threads). Built and loaded by
// pagedattn/kernels/cpu.py, which documents the arguments.
//
// For each sequence the kernel walks the block table and reads the context's K, then V, where they lie in the cache,
// block by block and each block once for all KV heads (a block's rows are contiguous, so it is read front to back;
// the next block is prefetched, as the hardware cannot guess where it lies): no gather into a contiguous copy, no
// padding to the batch's longest context, no mask. Slots past a context are never read, so whatever they hold (stale
// values, NaN) cannot reach the output. Against the previous version, which walked the context once per KV head and
// summed one row at a time, on the 2-core Intel VM with AMX (2026-12-02; batch 64, contexts 4-240, block 16, caches
// cold, both builds interleaved in one process, medians of 40 calls): 1.14x faster in fp32 and 1.59x in bf16 for 8
// heads of 32 (4 KV heads), 1.56x and 1.68x for 8 heads of 64, 2.42x and 1.57x for 32 heads of 128 (8 KV heads).
//
// Per sequence and query head: s_t = scale * <q, k_t> for t < context_len, p_t = exp(s_t - max s) / sum exp(...),
// out = sum_t p_t v_t; a context of length 0 gives zeros. Grouped-query attention: query head h reads kv head
// h / (num_heads / num_kv_heads).
//
// Returns 0; 1 when a block id inside a context is outside [0, num_blocks); 2 when a context is longer than its
// block table (max_blocks * block_size). Nothing is read out of bounds in either case.
//
// bf16 (K/V cache, query and output in bf16, arithmetic in fp32): bf16 is the upper 16 bits of an fp32, so reading
// one is a shift or a mask (portable, vectorised by the compiler: ``even_odd``); writing one rounds to nearest even,
// as torch's `.to(torch.bfloat16)`. Where the compiler targets AVX512_BF16 (cpu.py builds with -march=native, per
// CPU), the q.k dot products use VDPBF16PS (__AVX512BF16__ below); elsewhere the portable path runs.
#include <algorithm>
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

// bf16 rows as fp32 vectors without moving a lane: a 64-byte vector of 32 bf16 read as 16 32-bit lanes holds
// element 2i in the low half of lane i and element 2i+1 in the high half, so a shift gives the even elements and a
// mask the odd ones, each exactly widened (bf16 is the upper half of an fp32). Sums over all elements (a dot
// product) can take them in that order; a weighted sum of rows keeps even and odd accumulators and interleaves them
// once at the end.
typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u16x32 __attribute__((vector_size(64)));

static inline void even_odd(const bf16 *x, v16 *even, v16 *odd) {
    u16x32 u;
    __builtin_memcpy(&u, x, sizeof u);
    const u16x32 e = u << 16, o = u & 0xffff0000u;
    __builtin_memcpy(even, &e, sizeof e);
    __builtin_memcpy(odd, &o, sizeof o);
}

// acc += sum_i p[i] v_i over one block's n rows of one head (rows `row` elements apart), acc being the head's sums
// in the compute type A (in memory, D of them; `dim` where D = 0, head_dim at run time). With D known at compile
// time the block is summed in vector registers (GCC/clang vector extensions; lowered to narrower vectors where the
// CPU has no 64-byte ones), U rows at a time into U separate sums, so that U fused multiply-adds are in flight
// instead of one chain of dependent ones, then added to acc. bf16 rows are read as even and odd elements
// (``even_odd``): acc then holds, per 32 elements, the 16 even ones and then the 16 odd ones (``finish_head``).
template <typename T, typename A, int64_t D>
static inline void block_accumulate(const T *v, const A *p, int64_t n, int64_t row, int64_t dim, A *acc) {
    if constexpr (D == 0) {
        for (int64_t i = 0; i < n; i++) {
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) acc[d] += p[i] * widen(v[i * row + d]);
        }
    } else {
        typedef A vec __attribute__((vector_size(64)));
        constexpr int64_t W = 64 / sizeof(A), N = D / W;  // lanes per vector, vectors per head
        constexpr int64_t U = N >= 8 ? 1 : 8 / N;         // rows in flight: at most 8 vector registers of sums
        static_assert(D % W == 0 && (sizeof(T) == sizeof(A) || D % 32 == 0), "head_dim must fill whole vectors");
        auto add = [](vec *sum, A w, const T *x) {
            if constexpr (sizeof(T) == sizeof(A)) {
                for (int64_t j = 0; j < N; j++) {
                    vec y;
                    __builtin_memcpy(&y, x + j * W, sizeof y);
                    sum[j] += w * y;
                }
            } else {
                for (int64_t c = 0; c < N / 2; c++) {
                    v16 e, o;
                    even_odd(x + 32 * c, &e, &o);
                    sum[2 * c] += w * e;
                    sum[2 * c + 1] += w * o;
                }
            }
        };
        vec sum[U][N] = {};
        int64_t i = 0;
        for (; i + U <= n; i += U)
            for (int64_t u = 0; u < U; u++) add(sum[u], p[i + u], v + (i + u) * row);
        for (; i < n; i++) add(sum[0], p[i], v + i * row);
        for (int64_t j = 0; j < N; j++) {
            vec r;
            __builtin_memcpy(&r, acc + j * W, sizeof r);
            for (int64_t u = 0; u < U; u++) r += sum[u][j];
            __builtin_memcpy(acc + j * W, &r, sizeof r);
        }
    }
}

// out = acc * inv in the storage type, acc laid out as block_accumulate leaves it.
template <typename T, typename A, int64_t D>
static inline void finish_head(const A *acc, A inv, int64_t dim, T *out) {
    if constexpr (D > 0 && sizeof(T) != sizeof(A)) {
        for (int64_t d = 0; d < D; d++) narrow(acc[32 * (d / 32) + 16 * (d % 2) + (d % 32) / 2] * inv, out + d);
    } else {
        for (int64_t d = 0; d < (D > 0 ? D : dim); d++) narrow(acc[d] * inv, out + d);
    }
}

// Scores of 16 tokens at once (fp32 compute type, head_dim D known at compile time), for the rows of a block:
// each token's products land in one vector of 16 fp32 partial sums (fused multiply-adds, or VDPBF16PS for bf16
// where the CPU has AVX512_BF16), and the 16 vectors are then summed lane-wise together by a tree of two-source
// shuffles and adds (15 vector adds for 16 tokens, in place of one horizontal sum per token).
template <typename T, int64_t D> static inline v16 partial_qk(const T *q, const T *k) {
#ifdef __AVX512BF16__
    if constexpr (sizeof(T) == 2 && D % 32 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
        return (v16)acc;
    }
#endif
    v16 acc = {};
    if constexpr (sizeof(T) == sizeof(float)) {
        for (int64_t d = 0; d < D; d += 16) {
            v16 a, b;
            __builtin_memcpy(&a, q + d, sizeof a);
            __builtin_memcpy(&b, k + d, sizeof b);
            acc += a * b;
        }
    } else {  // every product is summed: even and odd elements in any order
        for (int64_t d = 0; d < D; d += 32) {
            v16 qe, qo, ke, ko;
            even_odd(q + d, &qe, &qo);
            even_odd(k + d, &ke, &ko);
            acc += qe * ke + qo * ko;
        }
    }
    return acc;
}

// <q, k> over d_len elements in the compute type. bf16 with AVX512_BF16 and D a multiple of 32: partial_qk's
// VDPBF16PS (pairs of bf16 products, exact in fp32, summed into fp32 lanes; the instruction treats denormal inputs as
// zero), then one horizontal sum.
template <typename T, int64_t D>
static inline typename acc_of<T>::type dot_qk(const T *q, const T *k, int64_t d_len) {
#ifdef __AVX512BF16__
    if constexpr (sizeof(T) == 2 && D > 0 && D % 32 == 0) return _mm512_reduce_add_ps((__m512)partial_qk<T, D>(q, k));
#endif
    typename acc_of<T>::type dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < d_len; d++) dot += widen(q[d]) * widen(k[d]);
    return dot;
}

// r[i] = the sum of v[i]'s 16 lanes: each level halves the lanes per token and doubles the tokens per vector.
static inline v16 reduce16(const v16 *v) {
    v16 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// p[i] = scale * <q, k_i> for one head over one block's n rows: 16 rows at a time (``partial_qk``, ``reduce16``)
// where the compute type is fp32 and D fills whole vectors, one at a time otherwise.
template <typename T, int64_t D, typename A>
static inline void block_scores(const T *q, const T *k, int64_t n, int64_t row, int64_t dim, A scale, A *p) {
    int64_t i = 0;
    if constexpr (sizeof(A) == sizeof(float) && D > 0 && D % (sizeof(T) == sizeof(A) ? 16 : 32) == 0) {
        for (; i + 16 <= n; i += 16) {
            v16 v[16];
            for (int u = 0; u < 16; u++) v[u] = partial_qk<T, D>(q, k + (i + u) * row);
            const v16 r = reduce16(v) * scale;
            __builtin_memcpy(p + i, &r, sizeof r);
        }
    }
    for (; i < n; i++) p[i] = dot_qk<T, D>(q, k + i * row, D > 0 ? D : dim) * scale;
}

// p = exp(p - max p) over L scores; returns 1 / their sum.
template <typename A> static inline A softmax_unnormalised(A *p, int64_t L) {
    A m = p[0], sum = 0;
#pragma omp simd reduction(max : m)
    for (int64_t t = 1; t < L; t++) m = p[t] > m ? p[t] : m;
#pragma omp simd
    for (int64_t t = 0; t < L; t++) p[t] = exp_nonpositive_t(p[t] - m);
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; t++) sum += p[t];
    return static_cast<A>(1) / sum;
}

// Asks the memory system for the n rows starting at `rows` ahead of their use, up to PREFETCH_BYTES of them: the
// blocks of a context lie anywhere in the cache (§4.2), so the hardware prefetchers, which follow sequential
// streams, cannot guess the next one. A small model's block (16 rows of 512 bytes) is asked for whole; of a large
// one, only the start, which sets the prefetchers on its rows (asking for all 64 KB of a block of 4 KB rows made
// the kernel up to 1.7x slower; on the 2-core VM, 2026-12-02, cold caches, interleaved builds).
constexpr int64_t PREFETCH_BYTES = 8192;
template <typename T> static inline void prefetch_rows(const T *rows, int64_t n, int64_t row) {
    const char *x = reinterpret_cast<const char *>(rows);
    const int64_t bytes = n * row * static_cast<int64_t>(sizeof(T));
    for (int64_t b = 0; b < (bytes < PREFETCH_BYTES ? bytes : PREFETCH_BYTES); b += 64) __builtin_prefetch(x + b);
}

// One sequence of context L > 0, every query head, with head_dim D known at compile time when D > 0 (the common
// 32/64/128: dot products and block sums in vector registers), else `dim` at run time. T is the storage type,
// A = acc_of<T> the compute type (scores, softmax, sums). K, then V, is read block by block and each block once for
// every KV head: a block's rows (one token's K, or V, for all KV heads) lie together in the cache, so the kernel
// reads them front to back; query head h uses KV head h / group (GQA). Scratch: P [num_heads][L] scores,
// acc [num_heads][D] sums, inv [num_heads].
template <typename T, int64_t D, typename A = typename acc_of<T>::type>
static void attend_sequence(const T *q, const T *key_cache, const T *value_cache, const int32_t *table, int64_t L,
                            int64_t num_heads, int64_t group, int64_t dim, int64_t row, int64_t block_size, A scale,
                            A *P, A *acc, A *inv, T *out) {
    const int64_t d_len = D > 0 ? D : dim;
    // the cache offset of the block holding token t0, and how many of its rows the context uses
    auto at = [&](int64_t t0) { return static_cast<int64_t>(table[t0 / block_size]) * block_size * row; };
    auto rows = [&](int64_t t0) { return L - t0 < block_size ? L - t0 : block_size; };
    prefetch_rows(key_cache + at(0), rows(0), row);
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {  // scores
        const int64_t n = rows(t0);
        if (t0 + block_size < L) prefetch_rows(key_cache + at(t0 + block_size), rows(t0 + block_size), row);
        else prefetch_rows(value_cache + at(0), rows(0), row);
        const T *k = key_cache + at(t0);
        for (int64_t h = 0; h < num_heads; h++)
            block_scores<T, D>(q + h * d_len, k + (h / group) * d_len, n, row, d_len, scale, P + h * L + t0);
    }
    for (int64_t h = 0; h < num_heads; h++) inv[h] = softmax_unnormalised(P + h * L, L);
    std::fill(acc, acc + num_heads * d_len, static_cast<A>(0));
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {  // weighted sums of V
        const int64_t n = rows(t0);
        if (t0 + block_size < L) prefetch_rows(value_cache + at(t0 + block_size), rows(t0 + block_size), row);
        const T *v = value_cache + at(t0);
        for (int64_t h = 0; h < num_heads; h++)
            block_accumulate<T, A, D>(v + (h / group) * d_len, P + h * L + t0, n, row, d_len, acc + h * d_len);
    }
    for (int64_t h = 0; h < num_heads; h++) finish_head<T, A, D>(acc + h * d_len, inv[h], d_len, out + h * d_len);
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
    std::vector<A> P(num_heads * (longest > 0 ? longest : 1)), acc(num_heads * D), inv(num_heads);
    auto attend = D == 32 ? attend_sequence<T, 32> : D == 64 ? attend_sequence<T, 64>
                : D == 128 ? attend_sequence<T, 128> : attend_sequence<T, 0>;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t L = context_lens[s] > 0 ? context_lens[s] : 0;
        T *o = out + s * num_heads * D;
        if (L == 0) {
            std::memset(o, 0, sizeof(T) * num_heads * D);
            continue;
        }  // q_stride: elements between sequences (q may be a view of q|k|v)
        attend(q + s * q_stride, key_cache, value_cache, block_tables + s * max_blocks, L, num_heads, group, D, row,
               block_size, static_cast<A>(scale), P.data(), acc.data(), inv.data(), o);
    }
    return 0;
}

// paged_attention over `shares` ranges of consecutive sequences (bounds[i] .. bounds[i + 1] - 1), one OpenMP thread
// each: the result is paged_attention's, bit for bit (each sequence is computed alone); the return value is the
// largest of the ranges'. Built with -fopenmp, the library takes libgomp.so.1 by its soname, which in a process that
// has imported torch is torch's own: the threads are torch's intra-op threads, which stay awake (spinning) between
// torch's parallel operations and so start at once, instead of fighting them for the cores as threads of our own did.
template <typename T>
static int paged_attention_shares(const T *q, const T *key_cache, const T *value_cache, const int32_t *block_tables,
                                  const int32_t *context_lens, T *out, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t max_blocks,
                                  int64_t q_stride, double scale, const int64_t *bounds, int64_t shares) {
    int rc = 0;
#pragma omp parallel for num_threads(shares) schedule(static, 1) reduction(max : rc)
    for (int64_t i = 0; i < shares; i++) {
        const int64_t first = bounds[i];
        const int r = paged_attention<T>(q + first * q_stride, key_cache, value_cache, block_tables + first * max_blocks,
                                         context_lens + first, out + first * num_heads * head_dim, bounds[i + 1] - first,
                                         num_heads, num_kv_heads, head_dim, block_size, num_blocks, max_blocks, q_stride,
                                         scale);
        rc = r > rc ? r : rc;
    }
    return rc;
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
extern "C" int pagedattn_abi_version() { return 5; }

#define EXPORT(NAME, T)                                                                                            \
    extern "C" int NAME(const T *q, const T *kc, const T *vc, const int32_t *tables, const int32_t *lens, T *out, \
                        int64_t s, int64_t h, int64_t kvh, int64_t d, int64_t bs, int64_t nb, int64_t mb,          \
                        int64_t q_stride, double scale) {                                                          \
        return paged_attention<T>(q, kc, vc, tables, lens, out, s, h, kvh, d, bs, nb, mb, q_stride, scale);        \
    }
EXPORT(paged_attention_f32, float)
EXPORT(paged_attention_f64, double)
EXPORT(paged_attention_bf16, bf16)

#define EXPORT_SHARES(NAME, T)                                                                                     \
    extern "C" int NAME(const T *q, const T *kc, const T *vc, const int32_t *tables, const int32_t *lens, T *out, \
                        int64_t h, int64_t kvh, int64_t d, int64_t bs, int64_t nb, int64_t mb, int64_t q_stride,   \
                        double scale, const int64_t *bounds, int64_t shares) {                                     \
        return paged_attention_shares<T>(q, kc, vc, tables, lens, out, h, kvh, d, bs, nb, mb, q_stride, scale,     \
                                         bounds, shares);                                                          \
    }
EXPORT_SHARES(paged_attention_shares_f32, float)
EXPORT_SHARES(paged_attention_shares_f64, double)
EXPORT_SHARES(paged_attention_shares_bf16, bf16)

#define EXPORT_WRITE(NAME, S, T)                                                                                   \
    extern "C" int NAME(const S *k, const S *v, T *kc, T *vc, const int64_t *slots, int64_t n, int64_t row,        \
                        int64_t num_slots, int64_t k_stride, int64_t v_stride) {                                   \
        return reshape_and_cache<S, T>(k, v, kc, vc, slots, n, row, num_slots, k_stride, v_stride);                \
    }
EXPORT_WRITE(reshape_and_cache_f32, float, float)
EXPORT_WRITE(reshape_and_cache_f64, double, double)
EXPORT_WRITE(reshape_and_cache_bf16, bf16, bf16)
EXPORT_WRITE(reshape_and_cache_f32_bf16, float, bf16)
