// The small per-layer operations of a decode step around the matmuls and the attention kernel (§4.1), one call each
// on one CPU thread, for fp32 and bf16. Built into the same library as cpu_attention.cpp by pagedattn/kernels/cpu.py,
// which documents the arguments. Built without FMA contraction or reassociation (cpu.py's flags for this file): every
// product and sum rounds where the torch code it replaces rounds. In bf16, each torch op computes in fp32 and rounds
// its result to bf16 once (`rounded<T>` below marks where), and so do these loops.
//
// A decode step at batch 64 multiplies [64, 256] activations: torch's own RMSNorm took 35-80 us per call there (about
// 1 ms of a 12 ms step over 9 calls), an order of magnitude more than its arithmetic; these loops take a few.
#include <cmath>
#include <cstdint>

#include "bf16.h"

// mean(h^2) over a row of n floats, summed in the order of torch's CPU sum kernel (ATen's cascade sum over 8-float
// vectors, 4 of them interleaved, in levels of at least 16 steps; a row's tail of n % 8 first, then the 8 lanes;
// rows shorter than 8 as vectors of one float),
// so that the result is bit for bit `h.pow(2).mean(-1)`: checked against torch for row lengths 64 to 8192 in
// tests/test_models.py, which fails if a torch version sums otherwise.
template <typename T>
static float mean_of_squares(const T *h, int64_t n) {
    constexpr int64_t rows = 4, levels = 4;
    const int64_t lanes = n < 8 ? 1 : 8, nvec = n / lanes, size = nvec / rows;
    int64_t log2 = 0;
    while ((int64_t{1} << log2) < size) log2++;
    const int64_t power = log2 / levels > 4 ? log2 / levels : 4, step = int64_t{1} << power, mask = step - 1;
    float acc[levels][rows][8] = {};
    auto add_vec = [&](float *a, int64_t vec) {
        for (int64_t l = 0; l < lanes; l++) a[l] += widen(h[vec * lanes + l]) * widen(h[vec * lanes + l]);
    };
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int64_t k = 0; k < rows; k++) add_vec(acc[0][k], i * rows + k);
        for (int64_t j = 1; j < levels; j++) {
            for (int64_t k = 0; k < rows; k++)
                for (int64_t l = 0; l < lanes; l++) acc[j][k][l] += acc[j - 1][k][l], acc[j - 1][k][l] = 0;
            if (i & (mask << (j * power))) break;
        }
    }
    for (; i < size; i++)
        for (int64_t k = 0; k < rows; k++) add_vec(acc[0][k], i * rows + k);
    for (int64_t j = 1; j < levels; j++)
        for (int64_t k = 0; k < rows; k++)
            for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t vec = size * rows; vec < nvec; vec++) add_vec(acc[0][0], vec);
    for (int64_t k = 1; k < rows; k++)
        for (int64_t l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float sum = 0;
    for (int64_t t = nvec * lanes; t < n; t++) sum += widen(h[t]) * widen(h[t]);
    for (int64_t l = 0; l < lanes; l++) sum += acc[0][0][l];
    return sum / static_cast<float>(n);
}

// RMSNorm as transformers' LlamaRMSNorm computes it, bit for bit: out = w * T(h * (1 / sqrt(mean(h^2) + eps))), the
// statistics in fp32 (h widened), T(...) the rounding to the input's type. With `residual` non-null,
// h = T(x + residual) is written back into `residual` first (the decoder layer's residual add, fused: h is read
// once). x, residual and out are [rows, dim], contiguous; out may alias x.
template <typename T>
static void rms_norm(const T *x, T *residual, const T *w, T *out, int64_t rows, int64_t dim, double eps) {
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * dim;
        T *o = out + r * dim;
        const T *h = xr;
        if (residual) {
            T *res = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) narrow(widen(res[i]) + widen(xr[i]), res + i);
            h = res;
        }
        const float inv = 1.0f / std::sqrt(mean_of_squares(h, dim) + static_cast<float>(eps));
        for (int64_t i = 0; i < dim; i++) narrow(widen(w[i]) * rounded<T>(widen(h[i]) * inv), o + i);
    }
}

// RoPE in place (rotate-half layout), with the same roundings as pagedattn.model.llama.apply_rope:
// x = x * cos + roll(x, D/2) * sin_rot, one product and one sum per element, each rounded to T, never fused into an
// FMA. x is [tokens, heads, D] with `stride` elements between tokens (a view of a fused q|k|v); cos and sin_rot are
// [tokens, D], contiguous.
template <typename T>
static void rope(T *x, const T *cos, const T *sin_rot, int64_t tokens, int64_t heads, int64_t head_dim,
                 int64_t stride) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const T *__restrict c = cos + t * head_dim, *__restrict s = sin_rot + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            T *__restrict v = x + t * stride + h * head_dim;  // (restrict: lets the loop vectorise)
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = widen(v[i]), b = widen(v[i + half]);
                const float lo_cos = rounded<T>(a * widen(c[i])), lo_sin = rounded<T>(b * widen(s[i]));
                const float hi_cos = rounded<T>(b * widen(c[i + half])), hi_sin = rounded<T>(a * widen(s[i + half]));
                narrow(lo_cos + lo_sin, v + i);
                narrow(hi_cos + hi_sin, v + i + half);
            }
        }
    }
}

#define EXPORT_LAYER_OPS(SUFFIX, T)                                                                                \
    extern "C" void rms_norm_##SUFFIX(const T *x, T *residual, const T *w, T *out, int64_t rows, int64_t dim,     \
                                      double eps) {                                                                \
        rms_norm<T>(x, residual, w, out, rows, dim, eps);                                                          \
    }                                                                                                              \
    extern "C" void rope_##SUFFIX(T *x, const T *cos, const T *sin_rot, int64_t tokens, int64_t heads,            \
                                  int64_t head_dim, int64_t stride) {                                              \
        rope<T>(x, cos, sin_rot, tokens, heads, head_dim, stride);                                                 \
    }
EXPORT_LAYER_OPS(f32, float)
EXPORT_LAYER_OPS(bf16, bf16)

// Greedy decoding's argmax per row of logits [rows, cols] (contiguous, fp32 or bf16, compared as their exact fp32
// values): the first maximum, as torch.max(dim).indices; a NaN counts as the maximum (the first NaN wins), as in
// torch. Vectorised: the maximum of each chunk of 64, then the first index of the maximum within the first chunk that
// holds it.
template <typename T>
static void argmax_rows(const T *x, int64_t rows, int64_t cols, int64_t *out) {
    const int64_t chunk = 64;
    for (int64_t r = 0; r < rows; r++) {
        const T *v = x + r * cols;
        float m = -INFINITY;
        int64_t best = 0, nan_chunk = -1;
        for (int64_t c0 = 0; c0 < cols; c0 += chunk) {
            const int64_t n = cols - c0 < chunk ? cols - c0 : chunk;
            float cm = -INFINITY;
            int nans = 0;
#pragma omp simd reduction(max : cm) reduction(+ : nans)
            for (int64_t i = 0; i < n; i++) {
                const float a = widen(v[c0 + i]);
                cm = a > cm ? a : cm;
                nans += a != a;
            }
            if (nans) {
                nan_chunk = c0;
                break;
            }
            if (cm > m) m = cm, best = c0;
        }
        if (nan_chunk >= 0) {
            best = nan_chunk;
            while (widen(v[best]) == widen(v[best])) best++;
        } else {
            while (best < cols - 1 && widen(v[best]) != m) best++;
        }
        out[r] = best;
    }
}

extern "C" void argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t *out) {
    argmax_rows<float>(x, rows, cols, out);
}
extern "C" void argmax_rows_bf16(const bf16 *x, int64_t rows, int64_t cols, int64_t *out) {
    argmax_rows<bf16>(x, rows, cols, out);
}
