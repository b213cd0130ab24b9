// Scalar numerics every kernel family shares: the one INFINITY, log2(e), the fast exp2 (MUFU), ceil_div; and
// opaque (an index the compiler cannot hoist from), conditional_t (a kernel's mainloop per arch) and is_same_v.
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
