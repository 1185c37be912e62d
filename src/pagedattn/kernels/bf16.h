// bfloat16 for the CPU kernels (cpu_attention.cpp, cpu_layer_ops.cpp): bf16 is the upper 16 bits of an fp32, so
// widening one is a shift and narrowing rounds to nearest even. Part of the library's build key in cpu.py.
#pragma once
#include <cstdint>

typedef uint16_t bf16;  // the bits of a bfloat16

static inline float widen(float x) { return x; }
static inline double widen(double x) { return x; }
static inline float widen(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

// fp32 -> bf16, round to nearest, ties to even, bit for bit as torch's `.to(torch.bfloat16)` on a CPU tensor
// (its vectorised conversion, which writes every NaN as 0xffff; checked in tests/test_kernels.py).
// A select, not a branch, so that loops of it vectorise.
static inline bf16 to_bf16(float x) {
    const uint32_t u = __builtin_bit_cast(uint32_t, x);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return static_cast<bf16>(x != x ? 0xffffu : r);
}
static inline void narrow(float x, float *o) { *o = x; }
static inline void narrow(double x, double *o) { *o = x; }
static inline void narrow(float x, bf16 *o) { *o = to_bf16(x); }

// x as a torch op with a T result rounds it: unchanged for fp32, to the nearest bf16 (back in fp32) for bf16.
template <typename T> static inline float rounded(float x) {
    if constexpr (sizeof(T) == sizeof(bf16)) return widen(to_bf16(x));
    return x;
}
