// The dQ kernel's mainloop on mma.sync (DqMainloopSm80, sm_80 and later; DqMainloopSm90 in
// cuflash/dq_mainloop_sm90.cuh is the wgmma one behind the same interface):
//   kSmemBytes, check_smem(smem)
//   run(params, seq, blocks, mask, smem, query0, acc_dq)   walks the key blocks of query block query0
//                                                           (blocks.count() steps) and leaves dQ
//                                                           (unscaled) in registers, n-tile nt of the
//                                                           warp at head-dim column col0(nt, d_split)
// The mirror image of the dK/dV mainloop: a warp owns 16 queries, S = Q.K^T, and dS (in registers, or in
// shared memory when the head dim is split over two warps) is the A operand of dQ += dS.K. Q and dO load
// once; K and V of the streamed key blocks are double-buffered (the next block's cp.async right after the
// barrier that opens the current one). No atomics: dQ is bit-identical run to run.
#pragma once

#include "cuflash/bwd_config.cuh"
#include "cuflash/bwd_probs.cuh"
#include "cuflash/gemm_sm80.cuh"
#include "cuflash/seqlen.cuh"

namespace cuflash {

template <typename Cfg>
struct DqMainloopSm80 {
    using Elem = typename Cfg::Elem;
    using TileQ = typename Cfg::TileQ;
    using TileK = typename Cfg::TileK;
    using Blocks = typename Cfg::Blocks;
    static constexpr int kSmemBytes = Cfg::kSmemBytes;
    static constexpr int kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles, kWarpsD = Cfg::kWarpsD;

    static __device__ __forceinline__ void check_smem(unsigned smem) { check_bwd_smem<kSmemBytes, 128u>(smem); }
    static __device__ __forceinline__ int col0(int nt, int d_split) {
        return ((nt / 2) * kWarpsD + d_split) * 16 + (nt & 1) * 8;
    }

    // K, V of key block n into pipeline stage `stage` (inside the loop: a SeqInfo of opaque (b, h) and an
    // opaque tid, as in the dK/dV mainloop).
    static __device__ __forceinline__ void load_keys(const AttnParams& p, const SeqInfo& seq, unsigned smem, int n,
                                                     int stage, int tid) {
        const int k0 = n * Cfg::kBlockN;
        copy_tile_flat<TileK, Cfg::kThreads>(smem + Cfg::kOffK + stage * TileK::kBytes, seq.k<Elem>(p, k0),
                                             p.k_row_stride, seq.seqlen_k - k0, p.head_dim, tid);
        copy_tile_flat<TileK, Cfg::kThreads>(smem + Cfg::kOffV + stage * TileK::kBytes, seq.v<Elem>(p, k0),
                                             p.v_row_stride, seq.seqlen_k - k0, p.head_dim_v, tid);
    }

    static __device__ __forceinline__ void run(const AttnParams& params, int b, int h, const Blocks& blocks,
                                               const typename Cfg::Mask& mask, unsigned smem, int query0,
                                               float (&acc_dq)[kDTiles][4]) {
        const int tid = threadIdx.x, warp = tid / 32;
        const int row0 = (warp % Cfg::kWarpsM) * 16;            // the warp's queries within the block
        const int d_split = warp / Cfg::kWarpsM;
        const int key_col0 = d_split * Cfg::kNPerWarp;          // the warp's keys of S within the key block
        const unsigned s_q = smem + Cfg::kOffQ, s_do = smem + Cfg::kOffDo, s_ds = smem + Cfg::kOffDs;
        const SeqInfo seq(params, b, h, LayoutOf<Cfg::kMask>());
        const typename Cfg::ScoreMod mod(params, b, h, seq.causal_offset());
        const typename Cfg::Dropout dropout(params, b, h);

        // lse and D of the thread's two rows; rows past Sq get P = 0 through lse = +inf.
        float lse2[2], dsum[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = query0 + row0 + (tid % 32) / 4 + half * 8;
            const bool ok = row < seq.seqlen_q;
            lse2[half] = ok ? *seq.lse_log2(params, row) : INFINITY;  // the pre-pass's lse_log2_offset(lse)
            dsum[half] = ok ? *seq.softmax_d(params, row) : 0.f;
        }
        clear(acc_dq);

        const int num_blocks = blocks.count();
        if (num_blocks > 0) {
            copy_tile_flat<TileQ, Cfg::kThreads>(s_q, seq.q<Elem>(params, query0), params.q_row_stride,
                                                 seq.seqlen_q - query0, params.head_dim, tid);
            copy_tile_flat<TileQ, Cfg::kThreads>(s_do, seq.dout<Elem>(params, query0), params.do_row_stride,
                                                 seq.seqlen_q - query0, params.head_dim_v, tid);
            load_keys(params, seq, smem, blocks.block(0), 0, tid);
            sm80::cp_async_commit();
        }
        const float scale_log2 = Cfg::ScoreMod::exp_factor(params);
        for (int j = 0; j < num_blocks; ++j) {
            const int stage = j & 1;
            const int key0 = blocks.block(j) * Cfg::kBlockN;
            const unsigned s_k = smem + Cfg::kOffK + stage * TileK::kBytes;
            const unsigned s_v = smem + Cfg::kOffV + stage * TileK::kBytes;

            // This key block has landed and every warp is done with the previous one.
            sm80::cp_async_wait<0>();
            __syncthreads();
            if (j + 1 < num_blocks) {
                load_keys(params, SeqInfo::key_side<LayoutOf<Cfg::kMask>::value>(params, opaque(b), opaque(h)), smem, blocks.block(j + 1), stage ^ 1,
                          opaque(tid));
                sm80::cp_async_commit();
            }
            const int lane = opaque(tid) % 32;

            // S = Q . K^T for the warp's 16 queries x kNPerWarp keys -> P; dP = dO . V^T -> dS.
            float acc_s[1][kNTiles][4], acc_dp[1][kNTiles][4];
            float aux[1][kNTiles][4];  // the score modifier's backward factor (dropped for the identity)
            clear(acc_s[0]);
            gemm_abt<Elem, Cfg::kHeadDim, kNTiles>(acc_s[0], cursor_a<TileQ>(s_q, row0, 0, lane),
                                                   cursor_b<TileK>(s_k, key_col0, 0, lane));
            probs_rows<Cfg>(acc_s, aux, mod, mask, blocks.masked(j), query0, key0, query0 + row0, key0 + key_col0, lse2,
                            scale_log2);
            dropout.mark_rows(acc_s, query0 + row0, key0 + key_col0);
            clear(acc_dp[0]);
            gemm_abt<Elem, Cfg::kHeadDim, kNTiles>(acc_dp[0], cursor_a<TileQ>(s_do, row0, 0, lane),
                                                   cursor_b<TileK>(s_v, key_col0, 0, lane));
            dscores_rows<Cfg>(acc_dp, acc_s, aux, mod, dsum, Cfg::Dropout::rp(params));

            // dQ += dS . K (K read with .trans at the warp's interleaved head-dim columns).
            const SmemCursor<TileK> k_cols = cursor_a<TileK>(s_k, 0, 2 * d_split, lane);
            if constexpr (kWarpsD == 1) {
                gemm_ab<Elem, Cfg::kBlockN / 16, kDTiles, 2 * kWarpsD>(
                    acc_dq, [&](int kk, unsigned (&a)[4]) { c_to_a<Elem>(a, acc_dp[0], kk); }, k_cols);
            } else {
                const auto ds_rows = cursor_a<typename Cfg::TileS>(s_ds, row0, 0, lane);
                store_c_tile<Elem, typename Cfg::TileS>(s_ds, acc_dp[0], row0, key_col0, lane);
                __syncthreads();  // dS of both key halves visible; the next step's first barrier guards reuse
                gemm_ab<Elem, Cfg::kBlockN / 16, kDTiles, 2 * kWarpsD>(
                    acc_dq, [&](int kk, unsigned (&a)[4]) { sm80::ldmatrix_x4(a, ds_rows.at(0, 2 * kk)); }, k_cols);
            }
        }
    }
};

}  // namespace cuflash
