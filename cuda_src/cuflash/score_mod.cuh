// Score modifiers: the hook between S = Q.K^T (raw scores, C-fragment layout) and the mask.
//
// A modifier sees a warp's score tile acc[kMTiles][kNTiles][4] with its first row / column (the
// accumulator contract of cuda_src/README.md gives every element's row and column) and rewrites it
// (softcap, ALiBi; later an additive bias). Its backward counterpart `grad` turns dS with respect to the
// modified scores into dS with respect to the raw ones, up to the factor `scale` the backward epilogues
// apply anyway. Every mainloop, the SIMT one included, calls `apply` right after its QK^T GEMM and `grad`
// right after forming dS; the online softmax works on whatever comes out.
//
// Two domains. IdentityScoreMod leaves raw scores, and the softmax folds the scale into its exp2
// (exp_factor = scale * log2 e; a negative scale is handled by the mainloops as |scale| on -Q). A modifier
// with kScaled = true outputs scaled scores s = mod(scale * raw), and the softmax runs with scale 1
// (exp_factor = log2 e, lse_scale = 1): the mainloops ask the modifier for both factors.
//
// Backward forms keep what `grad` needs from `apply` in a caller-provided `aux` tile of the score tile's
// shape (softcap: 1 - tanh^2); for the identity nothing is written and the compiler drops the tile.
// Contract: modifiers keep scores finite (the mask runs after them) and never produce NaN.
#pragma once

#include "cuflash/numeric.cuh"
#include "cuflash/fragment.cuh"
#include "cuflash/params.cuh"

namespace cuflash {

struct IdentityScoreMod {
    static constexpr bool kScaled = false;
    __device__ __forceinline__ IdentityScoreMod(const AttnParams&, int /*b*/, int /*h*/) {}
    static __device__ __forceinline__ float exp_factor(const AttnParams& p) { return p.scale_log2; }

    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply(float (&)[kMTiles][kNTiles][4], int /*row0*/, int /*col0*/) const {}
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply(float (&)[kMTiles][kNTiles][4], float (&)[kMTiles][kNTiles][4], int, int) const {}
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void grad(float (&)[kMTiles][kNTiles][4], const float (&)[kMTiles][kNTiles][4]) const {}
    // Transposed tiles (dK / dV kernels: rows are keys, columns queries; the lane's first key / query).
    template <int kNTiles>
    __device__ __forceinline__ void apply_transposed(float (&)[kNTiles][4], float (&)[kNTiles][4], int, int) const {}
    template <int kNTiles>
    __device__ __forceinline__ void grad_transposed(float (&)[kNTiles][4], const float (&)[kNTiles][4]) const {}
    // One score (SIMT kernels): the modified score, and dS w.r.t. the raw score from dS w.r.t. the
    // modified one (given the raw score, which the backward recomputes).
    __device__ __forceinline__ float apply_one(float s, int /*row*/, int /*col*/) const { return s; }
    __device__ __forceinline__ float grad_one(float ds, float /*raw_s*/, int /*row*/, int /*col*/) const { return ds; }
};

// softcap (params.softcap > 0) and ALiBi (params.alibi_slopes), in the order of docs/api.md:
//   s = scale * raw;  s = softcap * tanh(s / softcap);  s -= slope * |i + Sk - Sq - j|.
// d s / d raw = scale * (1 - tanh^2) (the scale is the epilogues'), ALiBi adds a constant.
// tanh(x) from one ex2 and one reciprocal, with a series near 0 where 1 - 2 / (e^2x + 1) would cancel:
// relative error about 1e-6 (CUDA's tanhf: 2 ulp, at several times the instructions). It serves the fp16 /
// bf16 kernels, whose probabilities are rounded far more coarsely; the fp32 SIMT kernels use tanhf.
__device__ __forceinline__ float fast_tanh(float x) {
    const float a = fabsf(x);
    const float e = fast_exp2(fminf(a, 40.f) * (2.f * kLog2e));
    const float big = 1.f - __fdividef(2.f, e + 1.f);
    const float x2 = a * a;
    const float small = a * fmaf(x2, fmaf(x2, 2.f / 15.f, -1.f / 3.f), 1.f);  // a - a^3/3 + 2a^5/15
    return copysignf(a < 0.125f ? small : big, x);
}

struct GeneralScoreMod {
    static constexpr bool kScaled = true;
    // Register copies of the few scalars the per-score math reads (a parameter read inside the loops may be
    // repeated after every barrier or fence), and the head's slope.
    float scale, softcap, inv_softcap, slope;
    int causal_offset;

    __device__ __forceinline__ GeneralScoreMod(const AttnParams& p, int b, int h)
        : scale(p.scale), softcap(p.softcap), inv_softcap(p.softcap > 0.f ? 1.f / p.softcap : 0.f),
          slope(p.alibi_slopes == nullptr ? 0.f : __ldg(p.alibi_slopes + b * p.alibi_batch_stride + h)),
          causal_offset(p.causal_offset) {}
    static __device__ __forceinline__ float exp_factor(const AttnParams&) { return kLog2e; }

    // The modified score of raw score `raw` at (row, col), and d mod / d (scale * raw) in `dfactor`.
    template <bool kPrecise = false>
    __device__ __forceinline__ float one(float raw, int row, int col, float& dfactor) const {
        float s = raw * scale;
        dfactor = 1.f;
        if (softcap > 0.f) {
            const float x = s * inv_softcap;
            const float t = kPrecise ? tanhf(x) : fast_tanh(x);
            s = softcap * t;
            dfactor = fmaf(-t, t, 1.f);
        }
        return fmaf(-slope, fabsf(static_cast<float>(row + causal_offset - col)), s);
    }

    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply(float (&acc)[kMTiles][kNTiles][4], float (&aux)[kMTiles][kNTiles][4], int row0,
                                          int col0) const {
        for_each_score(acc, row0, col0, [&](float& x, int row, int col, int mt, int nt, int e) {
            x = one(x, row, col, aux[mt][nt][e]);
        });
    }
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply(float (&acc)[kMTiles][kNTiles][4], int row0, int col0) const {
        float unused[kMTiles][kNTiles][4];
        apply(acc, unused, row0, col0);
    }
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void grad(float (&ds)[kMTiles][kNTiles][4], const float (&aux)[kMTiles][kNTiles][4]) const {
        if (softcap > 0.f) transform2(ds, aux);
    }
    template <int kNTiles>
    __device__ __forceinline__ void apply_transposed(float (&acc)[kNTiles][4], float (&aux)[kNTiles][4], int key_row,
                                                     int query_col) const {
        for_each_score_transposed(acc, key_row, query_col, [&](float& x, int query, int key, int nt, int e) {
            x = one(x, query, key, aux[nt][e]);
        });
    }
    template <int kNTiles>
    __device__ __forceinline__ void grad_transposed(float (&ds)[kNTiles][4], const float (&aux)[kNTiles][4]) const {
        if (softcap > 0.f) transform2(ds, aux);
    }
    __device__ __forceinline__ float apply_one(float s, int row, int col) const {
        float unused;
        return one<true>(s, row, col, unused);
    }
    __device__ __forceinline__ float grad_one(float ds, float raw_s, int row, int col) const {
        float dfactor;
        one<true>(raw_s, row, col, dfactor);
        return ds * dfactor;
    }

  private:
    // ds *= aux, elementwise over a tile of any rank.
    template <typename T, int N>
    static __device__ __forceinline__ void transform2(T (&ds)[N], const T (&aux)[N]) {
#pragma unroll
        for (int i = 0; i < N; ++i) transform2(ds[i], aux[i]);
    }
    static __device__ __forceinline__ void transform2(float& ds, const float& aux) { ds *= aux; }
};

template <bool kGeneral>
using ScoreModOf = conditional_t<kGeneral, GeneralScoreMod, IdentityScoreMod>;

}  // namespace cuflash
