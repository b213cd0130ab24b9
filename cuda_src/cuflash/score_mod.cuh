// Score modifiers: the hook between S = Q.K^T (raw scores, C-fragment layout) and the mask.
//
// A modifier sees a warp's score tile acc[kMTiles][kNTiles][4] with its first row / column (the
// accumulator contract of cuda_src/README.md gives every element's row and column) and rewrites it
// (softcap, additive bias, ALiBi). Its backward counterpart `grad` turns dS with respect to the
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
// Contract: modifiers never produce NaN; a -inf score (a -inf bias entry) is hidden like a masked one.
// The bias modifier also writes dbias (dS with respect to the biased score) from the dK/dV kernels, which
// visit every (query, key) tile exactly once per query head: grad_transposed with coordinates.
#pragma once

#include "cuflash/numeric.cuh"
#include "cuflash/bias.cuh"
#include "cuflash/fragment.cuh"
#include "cuflash/params.cuh"

namespace cuflash {

// The kernels' kScoreMod template argument: none; softcap / ALiBi; a bias with ALiBi (no softcap); a bias
// with softcap and ALiBi.
enum ScoreModKind : int { kNoScoreMod = 0, kSoftcapAlibi = 1, kBiasScoreMod = 2, kBiasSoftcapScoreMod = 3 };
__host__ __device__ constexpr bool has_bias(int kind) { return kind == kBiasScoreMod || kind == kBiasSoftcapScoreMod; }

struct IdentityScoreMod {
    static constexpr bool kScaled = false;
    __device__ __forceinline__ IdentityScoreMod(const AttnParams&, int /*b*/, int /*h*/, int /*causal_offset*/) {}
    static __device__ __forceinline__ float exp_factor(const AttnParams& p) { return p.scale_log2; }

    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply(float (&)[kMTiles][kNTiles][4], int /*row0*/, int /*col0*/,
                                          const BiasTileRef& = BiasTileRef{}) const {}
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply(float (&)[kMTiles][kNTiles][4], float (&)[kMTiles][kNTiles][4], int, int,
                                          const BiasTileRef& = BiasTileRef{}) const {}
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void grad(float (&)[kMTiles][kNTiles][4], const float (&)[kMTiles][kNTiles][4]) const {}
    // Transposed tiles (dK / dV kernels: rows are keys, columns queries; the lane's first key / query).
    template <int kNTiles, typename Ref = BiasTileRef>
    __device__ __forceinline__ void apply_transposed(float (&)[kNTiles][4], float (&)[kNTiles][4], int, int,
                                                     const Ref& = Ref{}) const {}
    template <int kQueryParts, int kNTiles>
    __device__ __forceinline__ void grad_transposed(float (&)[kNTiles][4], const float (&)[kNTiles][4], const AttnParams&,
                                                    int, int, bool = true) const {}
    // One score (SIMT kernels): the modified score, and dS w.r.t. the raw score from dS w.r.t. the
    // modified one (given the raw score, which the backward recomputes).
    __device__ __forceinline__ float apply_one(float s, int /*row*/, int /*col*/) const { return s; }
    __device__ __forceinline__ float grad_one(float ds, float /*raw_s*/, int /*row*/, int /*col*/) const { return ds; }
    // The dK/dV kernels' form: also writes dbias where the modifier has one.
    __device__ __forceinline__ float grad_one_dbias(const AttnParams&, float ds, float, int, int) const { return ds; }
};

// softcap (params.softcap > 0), bias (kBias: params.bias) and ALiBi (params.alibi_slopes), in the order of
// docs/api.md:
//   s = scale * raw;  s = softcap * tanh(s / softcap);  s += bias[i, j] - slope * |i + Sk - Sq - j|.
// d s / d raw = scale * (1 - tanh^2) (the scale is the epilogues'), bias and ALiBi add constants; dbias is
// dS itself (before the softcap factor).
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

// kSoftcap = false: the variant has no softcap at all (a bias without one: the common learnable-bias case),
// so no softcap factor is computed or kept (`aux` is dead and the compiler drops it).
template <typename Elem, bool kBias, bool kSoftcap = true>
struct GeneralScoreMod {
    static constexpr bool kScaled = true;
    // Register copies of the few scalars the per-score math reads (a parameter read inside the loops may be
    // repeated after every barrier or fence), and the head's slope.
    float scale, softcap, inv_softcap, slope;
    int causal_offset;
    int b, h;
    BiasView<Elem, kBias> bias;

    // causal_offset_: the sequence's seqlen_k - seqlen_q (SeqInfo::causal_offset, or the mask's copy).
    __device__ __forceinline__ GeneralScoreMod(const AttnParams& p, int b_, int h_, int causal_offset_)
        : scale(p.scale), softcap(p.softcap), inv_softcap(p.softcap > 0.f ? 1.f / p.softcap : 0.f),
          slope(p.alibi_slopes == nullptr ? 0.f : __ldg(p.alibi_slopes + b_ * p.alibi_batch_stride + h_)),
          causal_offset(causal_offset_), b(b_), h(h_), bias(p, b_, h_) {}
    static __device__ __forceinline__ float exp_factor(const AttnParams&) { return kLog2e; }
    __device__ __forceinline__ bool has_softcap() const { return kSoftcap && softcap > 0.f; }

    // The modified score of raw score `raw` at (row, col), and d mod / d (scale * raw) in `dfactor`.
    // bias_value: the bias at (row, col), read by the caller (in pairs where it can).
    // Every term decided at run time (the one-score forms, and the tile forms of the softcap / ALiBi variant).
    template <bool kPrecise = false>
    __device__ __forceinline__ float one(float raw, int row, int col, float& dfactor, float bias_value) const {
        dfactor = 1.f;
        return has_softcap() ? one_of<kSoftcap, true, kPrecise>(raw, row, col, dfactor, bias_value)
                             : one_of<false, true, kPrecise>(raw, row, col, dfactor, bias_value);
    }

    // The per-score math with the softcap / ALiBi terms known at compile time: the tile forms pick one of
    // four loops by a uniform branch (softcap > 0, slope != 0), so the common cases (a bias alone, ALiBi
    // alone) pay one or two instructions per score instead of every term's. dfactor is written only with
    // the softcap (grad reads aux only then).
    template <bool kCap, bool kAlibi, bool kPrecise = false>
    __device__ __forceinline__ float one_of(float raw, int row, int col, float& dfactor, float bias_value) const {
        float s;
        if constexpr (kCap) {
            const float x = raw * scale * inv_softcap;
            const float t = kPrecise ? tanhf(x) : fast_tanh(x);
            s = softcap * t;
            dfactor = fmaf(-t, t, 1.f);
            if constexpr (kBias) s += bias_value;
        } else {
            s = kBias ? fmaf(raw, scale, bias_value) : raw * scale;
        }
        if constexpr (kAlibi) s = fmaf(-slope, fabsf(static_cast<float>(row + causal_offset - col)), s);
        return s;
    }

    template <int kMTiles, int kNTiles, typename Ref = BiasTileRef>
    // tile: this step's staged bias (BiasTileRef, none = read it directly; or a BiasPanelRef). The bias variants
    // run one of four loops, picked by a uniform branch on the terms this head has (explicit template calls:
    // the GPU machine's NVRTC refused generic lambdas).
    __device__ __forceinline__ void apply(float (&acc)[kMTiles][kNTiles][4], float (&aux)[kMTiles][kNTiles][4], int row0,
                                          int col0, const Ref& tile = Ref{}) const {
        if constexpr (!kBias) {  // softcap / ALiBi: one loop (four copies spilled on the tight tiles, sm_80 D96)
            for_each_score(acc, row0, col0, [&](float& x, int row, int col, int mt, int nt, int e) {
                x = one(x, row, col, aux[mt][nt][e], 0.f);
            });
            return;
        }
        if (has_softcap()) {
            if (slope != 0.f) apply_terms<true, true>(acc, aux, row0, col0, tile);
            else apply_terms<true, false>(acc, aux, row0, col0, tile);
        } else {
            if (slope != 0.f) apply_terms<false, true>(acc, aux, row0, col0, tile);
            else apply_terms<false, false>(acc, aux, row0, col0, tile);
        }
    }
    template <bool kCap, bool kAlibi, int kMTiles, int kNTiles, typename Ref>
    __device__ __forceinline__ void apply_terms(float (&acc)[kMTiles][kNTiles][4], float (&aux)[kMTiles][kNTiles][4],
                                                int row0, int col0, const Ref& tile) const {
        for_each_score_pair(acc, row0, col0, [&](float& x0, float& x1, int row, int col, int mt, int nt, int half) {
            const float2 bv = kBias ? bias.pair_at(row, col, tile) : make_float2(0.f, 0.f);
            x0 = one_of<kCap, kAlibi>(x0, row, col, aux[mt][nt][2 * half], bv.x);
            x1 = one_of<kCap, kAlibi>(x1, row, col + 1, aux[mt][nt][2 * half + 1], bv.y);
        });
    }
    // A BiasPanelTile (the warp-specialized forward's): four pairs per ldmatrix (BiasView::row_pairs).
    template <bool kCap, bool kAlibi, int kMTiles, int kNTiles, int kPanelBytes>
    __device__ __forceinline__ void apply_terms(float (&acc)[kMTiles][kNTiles][4], float (&aux)[kMTiles][kNTiles][4],
                                                int row0, int col0, const BiasPanelRef<kPanelBytes>& tile) const {
        static_assert(kNTiles % 2 == 0, "n-tiles in pairs");
        const int lane = threadIdx.x % 32;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int j = 0; j < kNTiles / 2; ++j) {
                unsigned pairs[4];
                bias.row_pairs(pairs, tile, row0 + mt * 16, col0, j);
#pragma unroll
                for (int sub = 0; sub < 2; ++sub) {
                    const int nt = 2 * j + sub;
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int row = row0 + mt * 16 + lane / 4 + half * 8, col = col0 + nt * 8 + (lane % 4) * 2;
                        const unsigned bits = pairs[2 * sub + half];
                        acc[mt][nt][2 * half] = one_of<kCap, kAlibi>(acc[mt][nt][2 * half], row, col,
                                                                     aux[mt][nt][2 * half],
                                                                     BiasView<Elem, kBias>::pair_half(bits, 0));
                        acc[mt][nt][2 * half + 1] = one_of<kCap, kAlibi>(acc[mt][nt][2 * half + 1], row, col + 1,
                                                                         aux[mt][nt][2 * half + 1],
                                                                         BiasView<Elem, kBias>::pair_half(bits, 1));
                    }
                }
            }
        }
    }
    template <int kMTiles, int kNTiles, typename Ref = BiasTileRef>
    __device__ __forceinline__ void apply(float (&acc)[kMTiles][kNTiles][4], int row0, int col0,
                                          const Ref& tile = Ref{}) const {
        float unused[kMTiles][kNTiles][4];
        apply(acc, unused, row0, col0, tile);
    }
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void grad(float (&ds)[kMTiles][kNTiles][4], const float (&aux)[kMTiles][kNTiles][4]) const {
        if (has_softcap()) transform2(ds, aux);
    }
    // Ref: BiasTileRef, or a BiasPanelRef (the warp-specialized dK/dV mainloop's bias in its dS tile).
    template <int kNTiles, typename Ref = BiasTileRef>
    __device__ __forceinline__ void apply_transposed(float (&acc)[kNTiles][4], float (&aux)[kNTiles][4], int key_row,
                                                     int query_col, const Ref& tile = Ref{}) const {
        // The bias variant specializes its loop (the dK/dV kernels of the softcap / ALiBi one sit at the register
        // limit on wgmma, where four loop copies spilled).
        if constexpr (kBias) {
            if (has_softcap()) {
                if (slope != 0.f) apply_terms_transposed<true, true>(acc, aux, key_row, query_col, tile);
                else apply_terms_transposed<true, false>(acc, aux, key_row, query_col, tile);
            } else {
                if (slope != 0.f) apply_terms_transposed<false, true>(acc, aux, key_row, query_col, tile);
                else apply_terms_transposed<false, false>(acc, aux, key_row, query_col, tile);
            }
        } else {
            for_each_score_transposed(acc, key_row, query_col, [&](float& x, int query, int key, int nt, int e) {
                x = one(x, query, key, aux[nt][e], 0.f);
            });
        }
    }
    template <bool kCap, bool kAlibi, int kNTiles, typename Ref>
    __device__ __forceinline__ void apply_terms_transposed(float (&acc)[kNTiles][4], float (&aux)[kNTiles][4],
                                                           int key_row, int query_col, const Ref& tile) const {
        for_each_score_transposed(acc, key_row, query_col, [&](float& x, int query, int key, int nt, int e) {
            x = one_of<kCap, kAlibi>(x, query, key, aux[nt][e], bias.at(query, key, tile));
        });
    }
    // A BiasPanelTile: two n-tiles' bias per ldmatrix (BiasView::transposed_pairs) instead of a load per score.
    template <bool kCap, bool kAlibi, int kNTiles, int kPanelBytes>
    __device__ __forceinline__ void apply_terms_transposed(float (&acc)[kNTiles][4], float (&aux)[kNTiles][4],
                                                           int key_row, int query_col,
                                                           const BiasPanelRef<kPanelBytes>& tile) const {
        static_assert(kNTiles % 2 == 0, "n-tiles in pairs");
#pragma unroll
        for (int j = 0; j < kNTiles / 2; ++j) {
            unsigned pairs[4];
            bias.transposed_pairs(pairs, tile, key_row, query_col, j);
#pragma unroll
            for (int sub = 0; sub < 2; ++sub) {
                const int nt = 2 * j + sub;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float b = BiasView<Elem, kBias>::pair_half(pairs[2 * sub + (e >> 1)], e & 1);
                    acc[nt][e] = one_of<kCap, kAlibi>(acc[nt][e], query_col + nt * 8 + (e & 1),
                                                      key_row + (e >= 2 ? 8 : 0), aux[nt][e], b);
                }
            }
        }
    }
    // key_row / query_col: the lane's first key / query (for_each_score_transposed); with kBias this is
    // where dbias is written (the dK/dV kernels see each score once per query head).
    // store_dbias = false: the caller writes dbias from a shared-memory tile instead (store_dbias_tile);
    // nothing is written where the backward makes no dbias (BiasView::has_grad). A bias broadcast over the
    // queries gets one add per key and warp (BiasView::add_grad_over_queries), every other one per score.
    // kQueryParts: the warps that share a key within a step (DkdvConfig::kWarpsD).
    template <int kQueryParts, int kNTiles>
    __device__ __forceinline__ void grad_transposed(float (&ds)[kNTiles][4], const float (&aux)[kNTiles][4],
                                                    const AttnParams& p, int key_row, int query_col,
                                                    bool store_dbias = true) const {
        if constexpr (kBias) {
            if (store_dbias && bias.has_grad(p)) {
                if (p.dbias_row_stride == 0 && p.dbias_accum != nullptr) {  // a bias broadcast over the queries
                    bias.template add_grad_over_queries<kQueryParts>(p, b, h, ds, key_row, query_col);
                } else {
                    for_each_score_transposed(ds, key_row, query_col, [&](float& x, int query, int key, int, int) {
                        bias.store_grad(p, b, h, query, key, x);
                    });
                }
            }
        }
        if (has_softcap()) transform2(ds, aux);
    }
    __device__ __forceinline__ float apply_one(float s, int row, int col) const {
        float unused;
        return one<true>(s, row, col, unused, kBias ? bias.at(row, col, BiasTileRef{}) : 0.f);
    }
    __device__ __forceinline__ float grad_one(float ds, float raw_s, int row, int col) const {
        float dfactor = 1.f;
        if (has_softcap()) one<true>(raw_s, row, col, dfactor, 0.f);
        return ds * dfactor;
    }
    __device__ __forceinline__ float grad_one_dbias(const AttnParams& p, float ds, float raw_s, int row, int col) const {
        if constexpr (kBias) {
            if (bias.has_grad(p)) bias.template store_grad<true>(p, b, h, row, col, ds);  // (the SIMT kernels')
        }
        return grad_one(ds, raw_s, row, col);
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

template <int kScoreMod, typename Elem>
using ScoreModOf = conditional_t<kScoreMod == kNoScoreMod, IdentityScoreMod,
                                 GeneralScoreMod<Elem, has_bias(kScoreMod), kScoreMod != kBiasScoreMod>>;

}  // namespace cuflash
