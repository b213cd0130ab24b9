// Online softmax over C-fragment rows (forward), FlashAttention-2 style.
//
// Written against the accumulator contract of mask.cuh only: a warp holds a score tile
// acc_s[kMTiles][kNTiles][4] and the running output acc_o[kMTiles][kDTiles][4] in the mma
// C-fragment layout, so the thread owns rows lane/4 (elements 0,1) and lane/4+8 (elements 2,3) of
// every m-tile, and a row is spread over the 4 lanes of a quad. The sm80 mma.sync mainloop and a
// future sm90 wgmma mainloop (m64nNk16 gives each warp the same layout) both drive this struct.
//
// Per key block and row:  m_new = max(m, rowmax(s));  p = exp2(s*scale_log2 - m_new*scale_log2)
// (one FFMA + one MUFU.EX2);  l = l * exp2((m - m_new)*scale_log2) + rowsum(p);  acc_o *= the same
// ratio, skipped (warp-uniformly) when no row of the warp raised its maximum, the common case once
// the maxima settle. At the end acc_o /= l once and lse = m*scale + log(l) (natural log). The row
// sum stays a per-lane partial during the loop; the quad adds it up once, in finalize.
//
// Fully masked rows: m stays -inf. The exponent offset then uses 0 instead of -inf*scale_log2, so
// p = exp2(-inf) = 0 and finalize sees l == 0: output 0, lse = -inf, no NaN anywhere.
// Requires scale_log2 > 0, so that the max of the raw scores is also the max of the scaled ones
// and -inf * scale_log2 stays -inf; a mainloop maps a negative scale onto -Q and a zero one onto
// the smallest normal float (flash_fwd.cu).
#pragma once

#include "cuflash/numeric.cuh"
#include "cuflash/tile.cuh"

namespace cuflash {

// A running maximum that is still -inf (no visible key yet) is used as 0 in exponent offsets.
__device__ __forceinline__ float finite_or_zero(float m) { return m == -INFINITY ? 0.f : m; }

// Reductions over the 4 lanes of a quad (the lanes sharing one C-fragment row).
__device__ __forceinline__ float quad_allreduce_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    return x;
}

__device__ __forceinline__ float quad_allreduce_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

template <int kMTiles>
struct OnlineSoftmax {
    // Index [mt][half]: half 0 is row lane/4 of m-tile mt, half 1 is row lane/4 + 8.
    float row_max[kMTiles][2];  // m: max raw score seen so far (quad-uniform), -inf before any key
    float row_sum[kMTiles][2];  // this lane's share of l (its 2 columns per n-tile); the quad adds up

    __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                row_max[mt][half] = -INFINITY;
                row_sum[mt][half] = 0.f;
            }
        }
    }

    // The three steps of folding one block of raw (unscaled, masked to -inf) scores into the running
    // statistics. update() chains them; a mainloop whose acc_o is still being written by an asynchronous
    // GEMM (the wgmma forward) runs max_step and exp_step first and rescale once the GEMM is done.

    // 1. New maxima m_new = max(m, rowmax(s)); ratio = exp(scale * (m_old - m_new)) per row, l scaled by
    // it. Returns true when no row of this thread changed its maximum (every ratio exactly 1).
    template <int kNTiles>
    __device__ __forceinline__ bool max_step(const float (&acc_s)[kMTiles][kNTiles][4], float (&ratio)[kMTiles][2],
                                             float scale_log2) {
        bool unchanged = true;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float m_new = row_max[mt][half];
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) {
                    m_new = fmaxf(m_new, fmaxf(acc_s[mt][nt][2 * half], acc_s[mt][nt][2 * half + 1]));
                }
                m_new = quad_allreduce_max(m_new);
                // An unchanged maximum (also -inf twice: a row with no visible key yet) keeps the
                // ratio at exactly 1. From -inf to finite the ratio is exp2(-inf) = 0, which scales
                // an l and an acc_o that are still 0.
                const float m_old = row_max[mt][half];
                ratio[mt][half] = m_new == m_old ? 1.f : fast_exp2((m_old - m_new) * scale_log2);
                unchanged = unchanged && m_new == m_old;
                row_max[mt][half] = m_new;
                row_sum[mt][half] *= ratio[mt][half];
            }
        }
        return unchanged;
    }

    // 2. acc_o *= ratio of its row: rescale_all always (for a mainloop whose multiplies run in the shadow of the
    // EX2s), rescale skipped (warp-uniformly) when no row of the warp changed its maximum, which is most steps
    // once the maxima settle.
    template <int kDTiles>
    static __device__ __forceinline__ void rescale_all(float (&acc_o)[kMTiles][kDTiles][4],
                                                       const float (&ratio)[kMTiles][2]) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] *= ratio[mt][e / 2];
            }
        }
    }
    template <int kDTiles>
    static __device__ __forceinline__ void rescale(float (&acc_o)[kMTiles][kDTiles][4], const float (&ratio)[kMTiles][2],
                                                   bool unchanged) {
        if (!__all_sync(0xffffffffu, unchanged)) rescale_all(acc_o, ratio);  // warp-uniform branch
    }

    // 3. p = exp2(s * scale_log2 - m * scale_log2): one FFMA + one EX2 per score, written over acc_s (fp32,
    // not yet normalized), and l += rowsum(p). Masked scores (-inf) give p = 0; for a row with no visible key
    // the offset is 0, so p = 0 there as well. `m`: the running maxima (row_max's values; a mainloop may pass
    // them through a dependency of its own to place these instructions).
    template <int kNTiles>
    __device__ __forceinline__ void exp_step(float (&acc_s)[kMTiles][kNTiles][4], float scale_log2) {
        exp_step(acc_s, scale_log2, row_max);
    }
    template <int kNTiles>
    __device__ __forceinline__ void exp_step(float (&acc_s)[kMTiles][kNTiles][4], float scale_log2,
                                             const float (&m)[kMTiles][2]) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float m_scaled = finite_or_zero(m[mt][half]) * scale_log2;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
                    for (int e = 2 * half; e < 2 * half + 2; ++e) {
                        const float x = fmaf(acc_s[mt][nt][e], scale_log2, -m_scaled);
                        const float p = fast_exp2(x);
                        acc_s[mt][nt][e] = p;
                        sum += p;
                    }
                }
                row_sum[mt][half] += sum;
            }
        }
    }

    // All three steps, for a mainloop that owns acc_o synchronously.
    template <int kNTiles, int kDTiles>
    __device__ __forceinline__ void update(float (&acc_s)[kMTiles][kNTiles][4],
                                           float (&acc_o)[kMTiles][kDTiles][4], float scale_log2) {
        float ratio[kMTiles][2];
        const bool unchanged = max_step(acc_s, ratio, scale_log2);
        rescale(acc_o, ratio, unchanged);
        exp_step(acc_s, scale_log2);
    }

    // Divides acc_o by l and returns lse = m*scale + log(l) per row (-inf, with acc_o = 0, for a
    // row that saw no key). lse is quad-uniform.
    template <int kDTiles>
    __device__ __forceinline__ void finalize(float (&acc_o)[kMTiles][kDTiles][4], float scale,
                                             float (&lse)[kMTiles][2]) const {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float l = quad_allreduce_sum(row_sum[mt][half]);
                // l >= 1 whenever the row saw a key (its maximum contributes exp2(0) = 1).
                const bool empty = l == 0.f;
                const float inv_l = empty ? 0.f : 1.f / l;
                lse[mt][half] = empty ? -INFINITY : fmaf(row_max[mt][half], scale, logf(l));
#pragma unroll
                for (int dt = 0; dt < kDTiles; ++dt) {
                    acc_o[mt][dt][2 * half] *= inv_l;
                    acc_o[mt][dt][2 * half + 1] *= inv_l;
                }
            }
        }
    }
};

// Key-split warps (FwdConfig::kWarpsN > 1): the kWarpsN warps of a row group ran the online softmax over
// their own keys of every key block. This folds their states into the group's first warp through `scratch`
// (shared memory that no warp reads any more; the caller's barrier before the call makes it so): member w > 0
// of a group stores its acc_o and each row's (m, l), 16-byte vectors in lane order, and after one barrier the
// first warp rescales its own state and each member's to the larger maximum and adds them up, the merge that
// max_step does for a new key block. A row no member saw stays empty (m -inf, l 0). Every thread of the CTA
// calls it; it returns whether this warp holds the merged rows (the group's others are done).
template <int kWarpsM, int kWarpsN, int kMTiles, int kDTiles>
struct KeySplitMerge {
    static constexpr int kVectors = kMTiles * (kDTiles + 1);  // per lane: acc_o, then (m, l) of each m-tile
    static constexpr int kMemberBytes = kVectors * 32 * 16;
    static constexpr int kScratchBytes = kWarpsN > 1 ? kWarpsM * (kWarpsN - 1) * kMemberBytes : 0;

    static __device__ __forceinline__ bool run(OnlineSoftmax<kMTiles>& softmax, float (&acc_o)[kMTiles][kDTiles][4],
                                               unsigned scratch, float scale_log2) {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, member = warp % kWarpsN;
        const unsigned group = scratch + unsigned(warp / kWarpsN * (kWarpsN - 1) * kMemberBytes);
        const auto at = [&](int m, int vector) {
            return group + unsigned((m - 1) * kMemberBytes + (vector * 32 + lane) * 16);
        };
        if (member > 0) {
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
                for (int dt = 0; dt < kDTiles; ++dt) {
                    const float* c = acc_o[mt][dt];
                    st_shared_b128(at(member, mt * kDTiles + dt), make_uint4(__float_as_uint(c[0]), __float_as_uint(c[1]),
                                                                             __float_as_uint(c[2]), __float_as_uint(c[3])));
                }
                st_shared_b128(at(member, kMTiles * kDTiles + mt),
                               make_uint4(__float_as_uint(softmax.row_max[mt][0]), __float_as_uint(softmax.row_max[mt][1]),
                                          __float_as_uint(softmax.row_sum[mt][0]), __float_as_uint(softmax.row_sum[mt][1])));
            }
        }
        __syncthreads();
        if (member > 0) return false;
#pragma unroll 1
        for (int m = 1; m < kWarpsN; ++m) {
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                const uint4 stats = ld_shared_b128(at(m, kMTiles * kDTiles + mt));
                const float other_max[2] = {__uint_as_float(stats.x), __uint_as_float(stats.y)};
                const float other_sum[2] = {__uint_as_float(stats.z), __uint_as_float(stats.w)};
                float own_ratio[2], other_ratio[2];
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const float m_own = softmax.row_max[mt][half];
                    const float m_new = fmaxf(m_own, other_max[half]);
                    // As in max_step: an equal maximum (also -inf twice) keeps exactly 1; -inf against a finite
                    // maximum gives exp2(-inf) = 0 for a state that is still all 0.
                    own_ratio[half] = m_own == m_new ? 1.f : fast_exp2((m_own - m_new) * scale_log2);
                    other_ratio[half] = other_max[half] == m_new ? 1.f : fast_exp2((other_max[half] - m_new) * scale_log2);
                    softmax.row_sum[mt][half] = softmax.row_sum[mt][half] * own_ratio[half] +
                                                other_sum[half] * other_ratio[half];
                    softmax.row_max[mt][half] = m_new;
                }
#pragma unroll
                for (int dt = 0; dt < kDTiles; ++dt) {
                    const uint4 v = ld_shared_b128(at(m, mt * kDTiles + dt));
                    const float other[4] = {__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z),
                                            __uint_as_float(v.w)};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        acc_o[mt][dt][e] = acc_o[mt][dt][e] * own_ratio[e / 2] + other[e] * other_ratio[e / 2];
                    }
                }
            }
        }
        return true;
    }
};

}  // namespace cuflash
