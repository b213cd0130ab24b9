// P recomputation and dS, for every tensor-core backward mainloop (both arches, both kernel families).
//
// With S the raw scores and lse the forward's log-sum-exp (natural log), in the mma C-fragment layout:
//   P  = exp2(f * mod(S) - lse * log2(e))     f = ScoreMod::exp_factor (scale * log2 e for raw scores,
//                                             log2 e for a modifier that applies the scale); the mask hides
//                                             entries of this exponent (-inf), so any scale works
//   dS = P o (dP - D)                         then the score modifier's backward (its factor kept in `aux`)
// `masked`: the block list's word on the tile (ListKeyBlocks / ListQueryBlocks::masked; always true for the
// analytic policies, whose needs_mask decides).
// The dK/dV kernels hold S^T (rows = keys, columns = queries): lse and D are per column and are read in
// pairs from small shared vectors where they are used, so neither holds registers across a GEMM. The dQ
// kernel holds S (rows = queries): lse and D are per row, two per thread, kept in registers.
// A row with lse = -inf (it sees no key) gets P = 0 exactly (lse_log2_offset: +inf; every kernel here reads it
// from the pre-pass's lse_log2), so does every masked score.
#pragma once

#include "cuflash/bwd_config.cuh"
#include "cuflash/gemm_sm80.cuh"

namespace cuflash {

// P^T of the warp's 16 keys (from key_row0 within the block) x kNT*8 queries (from q_col0) of key block
// key0 / query block query0, in place of S^T. s_lse: this thread's first pair of lse_log2 (the pre-pass's
// lse_log2_offset of lse) in shared memory.
// kFullTile: the caller knows every pair of the tile to be visible, inside the sequences (a block list's full
// entry): no mask code at all. spans: what the mask read for this thread's keys once per key block
// (Mask::key_spans), or NoSpans (the mask reads it here).
template <typename Cfg, int kNT, typename BiasRef = BiasTileRef, bool kFullTile = false, typename Spans = NoSpans>
__device__ __forceinline__ void probs_transposed(float (&acc)[kNT][4], float (&aux)[kNT][4],
                                                 const typename Cfg::ScoreMod& mod, const typename Cfg::Mask& mask,
                                                 bool masked, int seqlen_q, int query0, int key0, int key_row0,
                                                 int q_col0, int g, int t, unsigned s_lse, float scale_log2,
                                                 const BiasRef& bias_tile = BiasRef{}, const Spans& spans = Spans{}) {
    const int key_row = key0 + key_row0 + g, query_col = query0 + q_col0 + 2 * t;
    mod.apply_transposed(acc, aux, key_row, query_col, bias_tile);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
        const float2 l = ld_shared_f32x2(s_lse + nt * 8 * 4);  // lse_log2_offset(lse), from the pre-pass
        const float lse2[2] = {l.x, l.y};
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = acc[nt][e] * scale_log2 - lse2[e & 1];
    }
    if constexpr (!kFullTile) {
        if ((masked && mask.needs_mask(query0, Cfg::kBlockM, key0, Cfg::kBlockN)) || query0 + Cfg::kBlockM > seqlen_q) {
            mask.apply_transposed_spans(acc, spans, key_row, query_col, seqlen_q);
        }
    }
    transform(acc, [](float x) { return fast_exp2(x); });  // masked -inf -> exactly 0
}

// dS^T = P^T o (dP^T - D) in place of dP^T; s_dsum: this thread's first D pair in shared memory. The
// modifier's backward writes dbias here (key_row / query_col: the lane's first key / query).
template <typename Cfg, int kNT>
__device__ __forceinline__ void dscores_transposed(float (&acc_dp)[kNT][4], const float (&acc_p)[kNT][4],
                                                   const float (&aux)[kNT][4], const typename Cfg::ScoreMod& mod,
                                                   unsigned s_dsum, const AttnParams& params, int key_row,
                                                   int query_col, bool store_dbias = true) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
        const float2 d = ld_shared_f32x2(s_dsum + nt * 8 * 4);
        if constexpr (Cfg::Dropout::kEnabled) {  // acc_p carries dropout's marks (dropout.cuh)
            const float rp = Cfg::Dropout::rp(params);
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dp[nt][e] = dropout_dscore(acc_p[nt][e], acc_dp[nt][e], e & 1 ? d.y : d.x, rp);
        } else {
            acc_dp[nt][0] = acc_p[nt][0] * (acc_dp[nt][0] - d.x);
            acc_dp[nt][1] = acc_p[nt][1] * (acc_dp[nt][1] - d.y);
            acc_dp[nt][2] = acc_p[nt][2] * (acc_dp[nt][2] - d.x);
            acc_dp[nt][3] = acc_p[nt][3] * (acc_dp[nt][3] - d.y);
        }
    }
    mod.template grad_transposed<Cfg::kWarpsD>(acc_dp, aux, params, key_row, query_col, store_dbias);
}

// P of the warp's 16 queries (from row0 = query0 + the warp's first row) x kNT*8 keys (from col0) of
// query block query0 / key block key0, in place of S. lse2: the log2 offsets of the thread's two rows
// (+inf for rows past Sq, which makes their P 0).
template <typename Cfg, int kNT>
__device__ __forceinline__ void probs_rows(float (&acc)[1][kNT][4], float (&aux)[1][kNT][4],
                                           const typename Cfg::ScoreMod& mod, const typename Cfg::Mask& mask,
                                           bool masked, int query0, int key0, int row0, int col0,
                                           const float (&lse2)[2], float scale_log2) {
    mod.apply(acc, aux, row0, col0);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][nt][e] = acc[0][nt][e] * scale_log2 - lse2[e >> 1];
    }
    if (masked && mask.needs_mask(query0, Cfg::kBlockM, key0, Cfg::kBlockN)) mask.template apply<1, kNT>(acc, row0, col0);
    transform(acc[0], [](float x) { return fast_exp2(x); });
}

// dS = P o (dP - D) in place of dP; dsum: D of the thread's two rows; rp: dropout's 1 / (1 - p) (acc_p
// carries its marks in the dropout variants).
template <typename Cfg, int kNT>
__device__ __forceinline__ void dscores_rows(float (&acc_dp)[1][kNT][4], const float (&acc_p)[1][kNT][4],
                                             const float (&aux)[1][kNT][4], const typename Cfg::ScoreMod& mod,
                                             const float (&dsum)[2], float rp = 1.f) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            acc_dp[0][nt][e] = Cfg::Dropout::kEnabled ? dropout_dscore(acc_p[0][nt][e], acc_dp[0][nt][e], dsum[e >> 1], rp)
                                                      : acc_p[0][nt][e] * (acc_dp[0][nt][e] - dsum[e >> 1]);
        }
    }
    mod.grad(acc_dp, aux);
}

}  // namespace cuflash
