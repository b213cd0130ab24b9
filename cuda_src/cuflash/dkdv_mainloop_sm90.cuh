// The sm_90a dK/dV mainloop on warpgroup tensor cores (DkdvMainloopSm90): the GEMMs of DkdvMainloop's
// steps on wgmma, with the warp roles of the mma.sync one (warpgroup wg = warps 4wg .. 4wg+3 = keys
// 64wg .. +64, the 64 rows of its wgmma tiles), so P recomputation, the mask and dS are the same code.
// S^T / dP^T read K / V and Q / dO from shared memory (K-major) and are issued together, dP^T overlapping
// the exp; dV / dK take P^T / dS^T from registers (or, with the head dim split over two warpgroups, from
// shared memory) and dO / Q MN-major; the atomic dQ step reads dS^T and K MN-major. Each operand is read
// from shared memory once per warpgroup instead of once per warp, which is what bounds the mma.sync path
// (ncu at D128: L1/shared 74% busy, SM 39%).
// With kWarpsD = 2, warpgroup d_split owns a contiguous half of the head-dim panels of dK / dV (col0).
#pragma once

#include "cuflash/dkdv_mainloop.cuh"
#include "cuflash/dkdv_mainloop_sm80.cuh"
#include "cuflash/wgmma_sm90.cuh"

namespace cuflash {

// The atomic dQ step on warpgroups: dq_rows[0 .. kBlockM, :] += dS . K for the block's kBlockM
// queries, with dS read MN-major (transposed) from the [key][query] tile and K MN-major. The kNWarps / 4
// warpgroups split the work three ways, in this order of preference:
//   by queries  when there is one 64-query panel per warpgroup (each sums over all keys, all columns);
//   by columns  when there is one query panel and the head dim has whole 64-column panels per warpgroup;
//   by keys     otherwise (head dim 64): each warpgroup sums over its share of the keys, and both add
//               into the same dq_accum elements.
// issue() starts the GEMM as one wgmma batch; add() waits for it (kLaterBatches = the batches issued
// after it that may stay in flight) and adds the result into dq_accum, so the atomics overlap those.
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps>
struct WgmmaDqStep {
    static constexpr int kGroups = kNWarps / 4;
    static constexpr int kQueryPanels = kBlockM / sm90::kPanelCols;
    static constexpr int kPanels = kHeadDim / sm90::kPanelCols;
    static constexpr bool kSplitQueries = kQueryPanels == kGroups;
    static constexpr bool kSplitColumns = !kSplitQueries && kPanels % kGroups == 0;
    static_assert(kSplitQueries || kQueryPanels == 1, "the dQ step takes one query panel or one per warpgroup");
    static constexpr int kCols = kSplitColumns ? kHeadDim / kGroups : kHeadDim;
    static constexpr int kKeys = kSplitQueries || kSplitColumns ? kBlockN : kBlockN / kGroups;
    static constexpr int kNTiles = kCols / 8;

    static __device__ __forceinline__ int query_panel(int warp) { return kSplitQueries ? warp / 4 : 0; }
    static __device__ __forceinline__ int panel0(int warp) { return kSplitColumns ? warp / 4 * (kPanels / kGroups) : 0; }

    static __device__ __forceinline__ void issue(float (&acc)[kNTiles][4], int warp, unsigned s_ds, unsigned s_k) {
        const int key_row0 = kSplitQueries || kSplitColumns ? 0 : warp / 4 * kKeys;
        sm90::gemm_atb<Elem, kKeys, kBlockN, kBlockN>(acc, s_ds, query_panel(warp), s_k, panel0(warp), key_row0, false);
    }
    // The same GEMM from a dS tile laid out [query][key] (kBlockM rows: dS read K-major), for the splits by
    // queries or by columns.
    static __device__ __forceinline__ void issue_rows(float (&acc)[kNTiles][4], int warp, unsigned s_ds, unsigned s_k) {
        static_assert(kSplitQueries || kSplitColumns, "the [query][key] dS tile takes whole key rows");
        sm90::gemm_ab<Elem, kBlockN, kBlockM, kBlockN>(acc, s_ds, query_panel(warp) * sm90::kPanelCols, s_k,
                                                       panel0(warp), false);
    }

    // No bounds tests: dS is exactly 0 for queries past the sequence (P masked to 0; dO, D zero-filled)
    // and K is zero-filled past head_dim, so the adds past them are +-0. dq_accum has kHeadDim columns and
    // kDqAccumBlockRows rows of slack after its last row (backward.dq_accum_shape), and the pre-pass zeroes
    // each sequence's rows up to a whole such block, so every address of the block is inside the buffer
    // and holds a zero or a sum; rows past a sequence belong to the next head or sequence and get +-0.
    template <int kLaterBatches, typename Role>
    static __device__ __forceinline__ void add(float (&acc)[kNTiles][4], const Role& r, float* dq_rows) {
        sm90::wait<kLaterBatches>();
        sm90::fence_operand(acc);
        const int row_lo = query_panel(r.warp) * sm90::kPanelCols + (r.warp % 4) * 16 + r.g;
        float* dst = dq_rows + row_lo * kHeadDim + panel0(r.warp) * sm90::kPanelCols + 2 * r.t;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
            atomic_add_pair(dst + nt * 8, acc[nt][0], acc[nt][1]);
            atomic_add_pair(dst + 8 * kHeadDim + nt * 8, acc[nt][2], acc[nt][3]);
        }
    }
};

template <typename Cfg>
struct DkdvWgmmaSm90 {
    using Elem = typename Cfg::Elem;
    using Role = DkdvRole<Cfg, true>;  // warp-uniform: the descriptors stay in uniform registers
    static constexpr bool kRowWalkLoads = true;  // copy_tile_flat's row walk
    using DqStep = WgmmaDqStep<Elem, Cfg::kHeadDim, Cfg::kBlockM, Cfg::kBlockN, Cfg::kNWarps>;
    static constexpr int kMTiles = Cfg::kMTiles, kDTiles = Cfg::kDTiles, kWarpsD = Cfg::kWarpsD;
    static constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
    static constexpr unsigned kSmemAlign = 1024;  // the 128-byte swizzle is anchored at 1024-byte boundaries
    // Warpgroups are whole groups of 16-key warps (kWarpsD = 1), or with kWarpsD = 2 warpgroup d_split
    // owns a contiguous half of the head-dim panels (instead of interleaved 16-column groups).
    static_assert(Cfg::kNWarps % 4 == 0 && Cfg::kHeadDim % 64 == 0 && kBlockM % 64 == 0 &&
                      (kWarpsD == 1 || (Cfg::kWarpsN == 4 && (Cfg::kHeadDim / 64) % 2 == 0 && !Cfg::kShareP)),
                  "no warpgroup layout for this dK/dV tile");
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(sizeof(Cfg) == 0, "the wgmma mainloop compiles for sm_90a only");
#endif

    static __device__ __forceinline__ int col0(int nt, int d_split) { return d_split * Cfg::kDPerWarp + nt * 8; }
    // wgmma reads the landed tiles through the async proxy.
    static __device__ __forceinline__ void fence_loaded() { sm90::fence_proxy_async(); }

    // S^T and dP^T issued at once; returns with S^T ready and dP^T in flight (under the exp).
    static __device__ __forceinline__ void scores(float (&acc_s)[kMTiles][4], float (&acc_dp)[kMTiles][4],
                                                  unsigned smem, unsigned s_q, unsigned s_do, const Role& r) {
        const int wg_key0 = r.key_row0 & ~63;
        sm90::gemm_abt<Elem, Cfg::kHeadDim, kBlockN, kBlockM>(acc_s, smem + Cfg::kOffK, wg_key0, s_q, r.q_col0, false);
        sm90::gemm_abt<Elem, Cfg::kHeadDim, kBlockN, kBlockM>(acc_dp, smem + Cfg::kOffV, wg_key0, s_do, r.q_col0,
                                                              false);
        sm90::fence_operand(acc_dp);
        sm90::wait<1>();
        sm90::fence_operand(acc_s);
    }
    static __device__ __forceinline__ void dprobs(float (&acc_dp)[kMTiles][4], unsigned, unsigned, const Role&) {
        sm90::wait<0>();
        sm90::fence_operand(acc_dp);
    }

    // dQ first (it needs every warp's dS^T), then dV / dK; the dQ atomics overlap dV / dK.
    static __device__ __forceinline__ void accumulate(float (&acc_dv)[kDTiles][4], float (&acc_dk)[kDTiles][4],
                                                      const float (&acc_s)[kMTiles][4],
                                                      const float (&acc_dp)[kMTiles][4], unsigned smem, unsigned s_q,
                                                      unsigned s_do, const Role& r, float* dq_rows,
                                                      int /* rows_valid: see DqStep::add */, int /* head_dim */) {
        const unsigned s_ds = smem + Cfg::kOffDs, s_k = smem + Cfg::kOffK;
        float acc_dq[DqStep::kNTiles][4];
        if constexpr (kWarpsD == 1) {
            // P^T and dS^T of the warp's keys x all queries, packed: wgmma's A operands from registers.
            unsigned p_frag[kBlockM / 16][4], ds_frag[kBlockM / 16][4];
            pack_a<Elem>(p_frag, acc_s);
            pack_a<Elem>(ds_frag, acc_dp);
            if constexpr (Cfg::kAtomicDq) {
                store_a_tile<typename Cfg::TileP>(s_ds, ds_frag, r.key_row0, r.lane);
                sm90::fence_proxy_async();
                __syncthreads();  // dS^T of every warp visible to the dQ step's wgmma
                DqStep::issue(acc_dq, r.warp, s_ds, s_k);
            }
            sm90::fence_operand(acc_dv);
            sm90::fence_operand(acc_dk);
            sm90::gemm_rs<Elem, kBlockM / 16, kBlockM>(acc_dv, p_frag, s_do, 0, 0, true);
            sm90::gemm_rs<Elem, kBlockM / 16, kBlockM>(acc_dk, ds_frag, s_q, 0, 0, true);
        } else {
            // Warpgroup d_split: dV, dK of all kBlockN keys x its half of the head-dim panels, from P^T /
            // dS^T of both query halves in shared memory.
            constexpr int kHalfPanels = Cfg::kHeadDim / sm90::kPanelCols / 2;
            stage_probs<Cfg>(acc_s, acc_dp, smem, r);
            sm90::fence_proxy_async();
            __syncthreads();  // P^T and dS^T of both query halves visible
            if constexpr (Cfg::kAtomicDq) DqStep::issue(acc_dq, r.warp, s_ds, s_k);
            sm90::fence_operand(acc_dv);
            sm90::fence_operand(acc_dk);
            sm90::gemm_ab<Elem, kBlockM, kBlockN, kBlockM>(acc_dv, smem + Cfg::kOffP, 0, s_do, r.d_split * kHalfPanels,
                                                           true);
            sm90::gemm_ab<Elem, kBlockM, kBlockN, kBlockM>(acc_dk, s_ds, 0, s_q, r.d_split * kHalfPanels, true);
        }
        if constexpr (Cfg::kAtomicDq) DqStep::template add<2>(acc_dq, r, dq_rows);
    }

    // dV / dK (and dQ) wgmma done: the next barrier frees their shared-memory operands.
    template <int kNT>
    static __device__ __forceinline__ void step_done(float (&acc_dv)[kNT][4], float (&acc_dk)[kNT][4]) {
        sm90::wait<0>();
        sm90::fence_operand(acc_dv);
        sm90::fence_operand(acc_dk);
    }
};

template <typename Cfg>
using DkdvMainloopSm90 = DkdvMainloop<Cfg, DkdvWgmmaSm90<Cfg>>;

}  // namespace cuflash
