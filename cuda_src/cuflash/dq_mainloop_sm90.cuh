// The dQ mainloop on warpgroup tensor cores (DqMainloopSm90, sm_90a), behind DqMainloopSm80's interface:
//   kSmemBytes, check_smem(smem), col0(nt, d_split)
//   run(params, b, h, blocks, mask, smem, query0, acc_dq)
// A warpgroup owns 64 of the block's kBlockM queries (warp w: rows 16w .. +16, the mma.sync C layout, so
// probs_rows / dscores_rows and the epilogue are shared), all kHeadDim columns of their dQ. Per streamed key
// block: S = Q.K^T and dP = dO.V^T (Q / dO and K / V K-major from shared memory, issued together, dP under the
// exp) -> P, dS in registers -> dQ += dS.K with dS as wgmma's A operand from registers and K MN-major. Q and dO
// load once; K and V are double-buffered (the next block's cp.async right after the barrier that opens the
// current one). No atomics: dQ is bit-identical run to run.
//
// Why it exists: at head dim 256 the dK/dV kernel's atomic dQ step (64 queries x 256 fp32 columns added into
// dq_accum per 64-key step, twice the bytes per FLOP of D128's 128-key tile) took more than half of that
// kernel's time (H100, session 18: 4890 us with the step, 2167 without, B4 H8 S4k); recomputing S and dP here
// costs less than those adds.
#pragma once

#include "cuflash/bwd_config.cuh"
#include "cuflash/bwd_probs.cuh"
#include "cuflash/seqlen.cuh"
#include "cuflash/wgmma_sm90.cuh"

namespace cuflash {

template <typename Cfg>
struct DqMainloopSm90 {
    using Elem = typename Cfg::Elem;
    using TileQ = typename Cfg::TileQ;
    using TileK = typename Cfg::TileK;
    using Blocks = typename Cfg::Blocks;
    static constexpr int kSmemBytes = Cfg::kSmemBytes;
    static constexpr int kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles;
    static constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
    static_assert(Cfg::kWarpsD == 1 && Cfg::kNWarps % 4 == 0 && kBlockM == 16 * Cfg::kNWarps && kBlockN % 16 == 0 &&
                      Cfg::kHeadDim % 64 == 0,
                  "the wgmma dQ tile: a warpgroup per 64 queries, whole key blocks, whole 64-column panels");
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(sizeof(Cfg) == 0, "the wgmma dQ mainloop compiles for sm_90a only");
#endif

    static __device__ __forceinline__ void check_smem(unsigned smem) {
        check_bwd_smem<kSmemBytes, 1024u>(smem);  // the 128-byte swizzle is anchored at 1024-byte boundaries
    }
    static __device__ __forceinline__ int col0(int nt, int /* d_split */) { return nt * 8; }

    // K, V of key block n into pipeline stage `stage` (copy_tile_flat's row walk).
    static __device__ __forceinline__ void load_keys(const AttnParams& p, const SeqInfo& seq, unsigned smem, int n,
                                                     int stage, int tid) {
        const int k0 = n * kBlockN;
        copy_tile_flat<TileK, Cfg::kThreads, true>(smem + Cfg::kOffK + stage * TileK::kBytes, seq.k<Elem>(p, k0),
                                                   p.k_row_stride, seq.seqlen_k - k0, p.head_dim, tid);
        copy_tile_flat<TileK, Cfg::kThreads, true>(smem + Cfg::kOffV + stage * TileK::kBytes, seq.v<Elem>(p, k0),
                                                   p.v_row_stride, seq.seqlen_k - k0, p.head_dim_v, tid);
    }

    static __device__ __forceinline__ void run(const AttnParams& params, int b, int h, const Blocks& blocks,
                                               const typename Cfg::Mask& mask, unsigned smem, int query0,
                                               float (&acc_dq)[kDTiles][4]) {
        const int tid = threadIdx.x;
        // Warp-uniform (read from lane 0): the descriptors below stay in uniform registers.
        const int warp = __shfl_sync(0xffffffffu, tid / 32, 0);
        const int row0 = warp * 16;             // the warp's queries within the block
        const int wg_row0 = (warp / 4) * 64;    // its warpgroup's
        const unsigned s_q = smem + Cfg::kOffQ, s_do = smem + Cfg::kOffDo;
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
            copy_tile_flat<TileQ, Cfg::kThreads, true>(s_q, seq.q<Elem>(params, query0), params.q_row_stride,
                                                       seq.seqlen_q - query0, params.head_dim, tid);
            copy_tile_flat<TileQ, Cfg::kThreads, true>(s_do, seq.dout<Elem>(params, query0), params.do_row_stride,
                                                       seq.seqlen_q - query0, params.head_dim_v, tid);
            load_keys(params, seq, smem, blocks.block(0), 0, tid);
            sm80::cp_async_commit();
        }
        const float scale_log2 = Cfg::ScoreMod::exp_factor(params);
        for (int j = 0; j < num_blocks; ++j) {
            const int stage = j & 1;
            const int key0 = blocks.block(j) * kBlockN;
            const unsigned s_k = smem + Cfg::kOffK + stage * TileK::kBytes;
            const unsigned s_v = smem + Cfg::kOffV + stage * TileK::kBytes;

            // This key block has landed (visible to wgmma's async proxy) and every warp is done with the
            // previous one (its dQ GEMM completed below), so the other stage may be overwritten.
            sm80::cp_async_wait<0>();
            sm90::fence_proxy_async();
            __syncthreads();
            if (j + 1 < num_blocks) {
                load_keys(params, SeqInfo::key_side<LayoutOf<Cfg::kMask>::value>(params, opaque(b), opaque(h)), smem,
                          blocks.block(j + 1), stage ^ 1, opaque(tid));
                sm80::cp_async_commit();
            }

            // S = Q . K^T and dP = dO . V^T of the warpgroup's 64 queries x kBlockN keys, one batch each.
            float acc_s[1][kNTiles][4], acc_dp[1][kNTiles][4];
            float aux[1][kNTiles][4];  // the score modifier's backward factor (dropped for the identity)
            sm90::gemm_abt<Elem, Cfg::kHeadDim, kBlockM, kBlockN>(acc_s[0], s_q, wg_row0, s_k, 0, false);
            sm90::gemm_abt<Elem, Cfg::kHeadDim, kBlockM, kBlockN>(acc_dp[0], s_do, wg_row0, s_v, 0, false);
            sm90::fence_operand(acc_dp[0]);
            sm90::wait<1>();
            sm90::fence_operand(acc_s[0]);
            probs_rows<Cfg>(acc_s, aux, mod, mask, blocks.masked(j), query0, key0, query0 + row0, key0, lse2,
                            scale_log2);
            dropout.mark_rows(acc_s, query0 + row0, key0);
            sm90::wait<0>();
            sm90::fence_operand(acc_dp[0]);
            dscores_rows<Cfg>(acc_dp, acc_s, aux, mod, dsum, Cfg::Dropout::rp(params));

            // dQ += dS . K: dS from registers (the C layout packed into wgmma's A layout), K MN-major.
            unsigned ds_frag[kNTiles / 2][4];
            pack_a<Elem>(ds_frag, acc_dp[0]);
            sm90::fence_operand(acc_dq);
            sm90::gemm_rs<Elem, kNTiles / 2, kBlockN>(acc_dq, ds_frag, s_k, 0, 0, true);
            sm90::wait<0>();  // K of this stage is read before the next barrier lets it be overwritten
            sm90::fence_operand(acc_dq);
        }
    }
};

}  // namespace cuflash
