// Scalar numerics every kernel family shares: the one INFINITY, log2(e), the fast exp2 (MUFU) and exp2_fma
// (FMA pipe), ceil_div; and opaque (an index the compiler cannot hoist from), conditional_t (a kernel's
// mainloop per arch) and is_same_v.
// NVRTC has no <math.h>, hence no INFINITY macro of its own; this is the only definition.
#pragma once

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace cuflash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__host__ __device__ __forceinline__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// 2^x on the special-function unit (MUFU.EX2), flush-to-zero: 2^-inf = +0, and a p underflowing to 0 is
// what both the softmax and the backward's P recomputation want.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// 2^x on the FMA and integer pipes, for the share of the softmax's exponentials that would otherwise queue
// behind MUFU.EX2 (16 per clock per SM on Hopper, against 128 FFMA): x + 1.5 * 2^23 leaves round(x) in the
// low mantissa bits, 2^(x - round(x)) on [-0.5, 0.5] is a degree-3 polynomial (minimax in relative error,
// at most 7.5e-5: below half an ulp of fp16 or bf16, the type P is rounded to for P.V), and round(x) is added
// into the exponent field. Like fast_exp2 it returns +0 below 2^-126 and for -inf; it takes x <= 64 (the
// softmax's exponents are <= 0 up to rounding).
__device__ __forceinline__ float exp2_fma(float x) {
    const float shifted = x + 12582912.f;
    const float f = x - (shifted - 12582912.f);
    float p = fmaf(0.05517146f, f, 0.24261086f);
    p = fmaf(p, f, 0.69326099f);
    p = fmaf(p, f, 0.99992809f);
    const float y = __int_as_float(__float_as_int(p) + (__float_as_int(shifted) << 23));
    return x < -126.f ? 0.f : y;
}

// Returns x unchanged, but the compiler can no longer see where it came from, so nothing derived from
// it is hoisted out of the loop that calls this. The backward's accumulators fill ~192 of 255 registers
// at head dim 128 (and the SIMT kernels run at a 128-register cap): per-lane addresses and pointers are
// rebuilt each iteration from opaque indices (one XOR and an immediate per ldmatrix, a few IMADs per
// load) instead of being kept live and spilled.
__device__ __forceinline__ int opaque(int x) {
    asm volatile("" : "+r"(x));
    return x;
}

// The mainloop of each arch, by a trait (NVRTC has no <type_traits>).
template <bool kCond, typename IfTrue, typename IfFalse>
struct Conditional {
    using type = IfTrue;
};
template <typename IfTrue, typename IfFalse>
struct Conditional<false, IfTrue, IfFalse> {
    using type = IfFalse;
};
template <bool kCond, typename IfTrue, typename IfFalse>
using conditional_t = typename Conditional<kCond, IfTrue, IfFalse>::type;

template <typename A, typename B>
inline constexpr bool is_same_v = false;
template <typename A>
inline constexpr bool is_same_v<A, A> = true;

}  // namespace cuflash
