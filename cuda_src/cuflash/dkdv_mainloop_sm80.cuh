// The sm_80+ dK/dV mainloop on mma.sync (DkdvMainloopSm80): the GEMMs of DkdvMainloop's steps.
//
// The warp computes the TRANSPOSED scores S^T = K.Q^T: it owns 16 keys x its queries in the mma C layout,
// which is exactly the A-operand layout of dV += P^T.dO and dK += dS^T.Q. With kWarpsD = 1 (head dim up
// to 128) P and dS never go through shared memory for dK/dV, and the per-key accumulators stay in
// registers for the whole kernel. With kWarpsD = 2 the two warps of a key group split the queries of S^T
// and exchange P^T and dS^T through shared memory (one barrier per query block; two more when they share
// one buffer). dS goes through shared memory for the atomic dQ step, read back transposed by
// ldmatrix.trans. B operands are read with .trans at the warp's head-dim columns: 16-column group pairs
// interleaved between the kWarpsD warps of a key group (col0).
#pragma once

#include "cuflash/dkdv_mainloop.cuh"
#include "cuflash/gemm_sm80.cuh"

namespace cuflash {

// The atomic dQ step, for n-tile pairs [kPair0, kPair0 + kPairs) of the warp: dq_rows[0 .. rows_valid, :]
// += dS . K, with dS the block's [key][query] tile read with .trans. Warp (wm, wd) owns query tiles
// mt*warps_m + wm and 16-column groups np*warps_d + wd (DqWarpLayout), so every cursor offset composes by
// XOR (see SmemCursor). Columns >= head_dim (zero-filled K) are skipped.
template <typename Elem, int kBlockN, typename TileP, typename TileK, int kWarpsM, int kMTiles, int kWarpsD,
          int kPairs, int kPair0, typename Role>
__device__ __forceinline__ void dq_step(const Role& r, unsigned s_ds, unsigned s_k, float* dq_rows, int row_stride,
                                        int rows_valid, int head_dim) {
    const int wm = r.warp % kWarpsM, wd = r.warp / kWarpsM;
    const SmemCursor<TileP> ds_cols = cursor_b<TileP>(s_ds, 0, 2 * wm, r.lane);
    const SmemCursor<TileK> k_cols = cursor_a<TileK>(s_k, 0, 2 * wd, r.lane);
    float acc[kMTiles][2 * kPairs][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) clear(acc[mt]);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
        unsigned a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) sm80::ldmatrix_x4_trans(a[mt], ds_cols.at(16 * kk, 2 * kWarpsM * mt));
#pragma unroll
        for (int np = 0; np < kPairs; ++np) {
            if ((kPair0 + np) * kWarpsD + wd >= TileK::kCols / 16) continue;  // idle in the last round
            unsigned b[4];
            sm80::ldmatrix_x4_trans(b, k_cols.at(16 * kk, 2 * kWarpsD * (kPair0 + np)));
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) mma_pair<Elem>(acc[mt][2 * np], acc[mt][2 * np + 1], a[mt], b);
        }
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
        const int r_lo = (mt * kWarpsM + wm) * 16 + r.g;
#pragma unroll
        for (int nt = 0; nt < 2 * kPairs; ++nt) {
            const int c0 = ((kPair0 + nt / 2) * kWarpsD + wd) * 16 + (nt & 1) * 8;
            if (c0 >= head_dim) continue;
            const int col = c0 + 2 * r.t;
            if (r_lo < rows_valid) atomic_add_pair(dq_rows + r_lo * row_stride + col, acc[mt][nt][0], acc[mt][nt][1]);
            if (r_lo + 8 < rows_valid) {
                atomic_add_pair(dq_rows + (r_lo + 8) * row_stride + col, acc[mt][nt][2], acc[mt][nt][3]);
            }
        }
    }
}

// P^T and dS^T of the warp's query half into shared memory, for a key group split over two warps (both
// arches; the wgmma path fences them for its async-proxy reads). The caller's barrier publishes them.
template <typename Cfg, int kNT, typename Role>
__device__ __forceinline__ void stage_probs(const float (&acc_p)[kNT][4], const float (&acc_ds)[kNT][4], unsigned smem,
                                            const Role& r) {
    store_c_tile<typename Cfg::Elem, typename Cfg::TileP>(smem + Cfg::kOffPShared, acc_p, r.key_row0, r.q_col0,
                                                          r.lane);
    if constexpr (!Cfg::kShareP) {
        store_c_tile<typename Cfg::Elem, typename Cfg::TileP>(smem + Cfg::kOffDs, acc_ds, r.key_row0, r.q_col0,
                                                              r.lane);
    }
}

template <typename Cfg>
struct DkdvMmaSm80 {
    using Elem = typename Cfg::Elem;
    using TileK = typename Cfg::TileK;
    using TileQ = typename Cfg::TileQ;
    using TileP = typename Cfg::TileP;
    using Role = DkdvRole<Cfg>;
    static constexpr bool kRowWalkLoads = false;  // see copy_tile_flat
    static constexpr int kMTiles = Cfg::kMTiles, kDTiles = Cfg::kDTiles, kWarpsD = Cfg::kWarpsD;
    static constexpr unsigned kSmemAlign = 128;

    static __device__ __forceinline__ int col0(int nt, int d_split) {
        return ((nt / 2) * kWarpsD + d_split) * 16 + (nt & 1) * 8;
    }
    static __device__ __forceinline__ void fence_loaded() {}

    static __device__ __forceinline__ void scores(float (&acc_s)[kMTiles][4], float (&)[kMTiles][4], unsigned smem,
                                                  unsigned s_q, unsigned, const Role& r) {
        clear(acc_s);
        gemm_abt<Elem, Cfg::kHeadDim, kMTiles>(acc_s, cursor_a<TileK>(smem + Cfg::kOffK, r.key_row0, 0, r.lane),
                                               cursor_b<TileQ>(s_q, r.q_col0, 0, r.lane));
    }
    static __device__ __forceinline__ void dprobs(float (&acc_dp)[kMTiles][4], unsigned smem, unsigned s_do,
                                                  const Role& r) {
        clear(acc_dp);
        gemm_abt<Elem, Cfg::kHeadDim, kMTiles>(acc_dp, cursor_a<TileK>(smem + Cfg::kOffV, r.key_row0, 0, r.lane),
                                               cursor_b<TileQ>(s_do, r.q_col0, 0, r.lane));
    }

    // dV += P^T . dO and dK += dS^T . Q over all kBlockM queries, then the atomic dQ step.
    static __device__ __forceinline__ void accumulate(float (&acc_dv)[kDTiles][4], float (&acc_dk)[kDTiles][4],
                                                      const float (&acc_s)[kMTiles][4],
                                                      const float (&acc_dp)[kMTiles][4], unsigned smem, unsigned s_q,
                                                      unsigned s_do, const Role& r, float* dq_rows, int rows_valid,
                                                      int head_dim) {
        const unsigned s_ds = smem + Cfg::kOffDs;
        const SmemCursor<TileQ> do_cols = cursor_a<TileQ>(s_do, 0, 2 * r.d_split, r.lane);
        const SmemCursor<TileQ> q_cols = cursor_a<TileQ>(s_q, 0, 2 * r.d_split, r.lane);
        if constexpr (kWarpsD == 1) {
            // The warp holds P^T and dS^T for its keys and ALL queries of the block: packed, they are the
            // A fragments directly (and half the registers of the fp32 tiles).
            unsigned p_frag[Cfg::kBlockM / 16][4], ds_frag[Cfg::kBlockM / 16][4];
            pack_a<Elem>(p_frag, acc_s);
            pack_a<Elem>(ds_frag, acc_dp);
            if constexpr (Cfg::kAtomicDq) store_a_tile<TileP>(s_ds, ds_frag, r.key_row0, r.lane);
            gemm_ab<Elem, Cfg::kBlockM / 16, kDTiles, 2 * kWarpsD>(
                acc_dv, [&](int kk, unsigned (&a)[4]) { for (int i = 0; i < 4; ++i) a[i] = p_frag[kk][i]; }, do_cols);
            gemm_ab<Elem, Cfg::kBlockM / 16, kDTiles, 2 * kWarpsD>(
                acc_dk, [&](int kk, unsigned (&a)[4]) { for (int i = 0; i < 4; ++i) a[i] = ds_frag[kk][i]; }, q_cols);
            if constexpr (Cfg::kAtomicDq) __syncthreads();  // dS^T of every warp visible to the dQ step
        } else {
            // The warp holds its query half only: P^T and dS^T of the block go through shared memory.
            const SmemCursor<TileP> p_rows = cursor_a<TileP>(smem + Cfg::kOffPShared, r.key_row0, 0, r.lane);
            const SmemCursor<TileP> ds_rows = cursor_a<TileP>(s_ds, r.key_row0, 0, r.lane);
            stage_probs<Cfg>(acc_s, acc_dp, smem, r);
            __syncthreads();  // P^T (and dS^T) of both query halves visible
            gemm_ab<Elem, Cfg::kBlockM / 16, kDTiles, 2 * kWarpsD>(
                acc_dv, [&](int kk, unsigned (&a)[4]) { sm80::ldmatrix_x4(a, p_rows.at(0, 2 * kk)); }, do_cols);
            if constexpr (Cfg::kShareP) {
                __syncthreads();  // every warp has read P^T: its buffer now takes dS^T
                store_c_tile<Elem, TileP>(s_ds, acc_dp, r.key_row0, r.q_col0, r.lane);
                __syncthreads();
            }
            gemm_ab<Elem, Cfg::kBlockM / 16, kDTiles, 2 * kWarpsD>(
                acc_dk, [&](int kk, unsigned (&a)[4]) { sm80::ldmatrix_x4(a, ds_rows.at(0, 2 * kk)); }, q_cols);
        }
        if constexpr (Cfg::kAtomicDq) {
            // dq_accum[query0 + .., :] += dS . K (unscaled), in column parts of at most 32 accumulators.
            constexpr DqWarpLayout kL = Cfg::kDq;
            constexpr int kParts = kL.m_tiles * kL.n_tiles * 4 > 32 && kL.n_tiles % 4 == 0 ? 2 : 1;
            constexpr int kPairs = kL.n_tiles / (2 * kParts);
            static_assert(kL.n_tiles % (2 * kParts) == 0, "dQ step parts must hold whole n-tile pairs");
            const unsigned s_k = smem + Cfg::kOffK;
            dq_step<Elem, Cfg::kBlockN, TileP, TileK, kL.warps_m, kL.m_tiles, kL.warps_d, kPairs, 0>(
                r, s_ds, s_k, dq_rows, Cfg::kHeadDim, rows_valid, head_dim);
            if constexpr (kParts == 2) {
                dq_step<Elem, Cfg::kBlockN, TileP, TileK, kL.warps_m, kL.m_tiles, kL.warps_d, kPairs, kPairs>(
                    r, s_ds, s_k, dq_rows, Cfg::kHeadDim, rows_valid, head_dim);
            }
        }
    }
    template <int kNT>
    static __device__ __forceinline__ void step_done(float (&)[kNT][4], float (&)[kNT][4]) {}
};

template <typename Cfg>
using DkdvMainloopSm80 = DkdvMainloop<Cfg, DkdvMmaSm80<Cfg>>;

}  // namespace cuflash
