// The dK/dV mainloop: its load side (DkdvLoads) and its step loop (DkdvMainloop<Cfg, Math>), shared by
// both arches; the arch-specific GEMMs are the Math type (cuflash/dkdv_mainloop_sm80.cuh: mma.sync,
// cuflash/dkdv_mainloop_sm90.cuh: wgmma), which the kernel picks by a trait.
//
// Interface of a dK/dV mainloop (DkdvMainloopSm80<Cfg> and DkdvMainloopSm90<Cfg>):
//   kSmemBytes, check_smem(smem)           its dynamic shared memory (Cfg's layout) and launch checks
//   col0(nt, d_split)                      the head-dim column of n-tile nt of a warp's dK / dV rows
//   run(params, b, h0, heads, n_block, blocks, mask, smem, acc_dk, acc_dv)
//                                          walks every query block that sees key block n_block, for each
//                                          of the query heads [h0, h0 + heads) of one kv head, and leaves
//                                          dK (unscaled) and dV summed over them in the C-fragment layout
//                                          of DkdvRole (rows = the warp's keys)
// and, for the atomic dQ path, adds dS . K of each step into dq_accum.
// The Math type supplies, per step: fence_loaded() (before the barrier that publishes landed tiles),
// scores() (S^T; may also start dP^T), dprobs() (dP^T), accumulate() (dV, dK and the atomic dQ step,
// from P^T in acc_s and dS^T in acc_dp) and step_done(). Between them the loop runs the shared parts:
// P recomputation and dS (cuflash/bwd_probs.cuh).
//
// Pipeline: K, V of the block load once; Q, dO, lse and D of the streamed query blocks are
// double-buffered: the next block's cp.async is issued right after the barrier that opens the current one
// and overlaps a whole step. (A TMA producer warp would replace DkdvLoads with mbarrier-completed bulk
// copies; the Math side is already the consumer.)
#pragma once

#include "cuflash/bwd_config.cuh"
#include "cuflash/bwd_probs.cuh"
#include "cuflash/dbias_order.cuh"
#include "cuflash/seqlen.cuh"

namespace cuflash {

// kRowWalk: copy_tile_flat's row walk (the wgmma mainloops' loads). kThreads: the threads that load (all of
// the CTA's, or the warp-specialized kernel's producer warpgroup).
template <typename Cfg, bool kRowWalk = false, int kThreads = Cfg::kThreads>
struct DkdvLoads {
    using Elem = typename Cfg::Elem;

    // K, V of key block n_block (kv head of seq), into their single buffers.
    static __device__ __forceinline__ void load_kv(const AttnParams& p, const SeqInfo& seq, unsigned smem, int key0,
                                                   int tid) {
        copy_tile_flat<typename Cfg::TileK, kThreads, kRowWalk>(smem + Cfg::kOffK, seq.k<Elem>(p, key0), p.k_row_stride,
                                             seq.seqlen_k - key0, p.head_dim, tid);
        copy_tile_flat<typename Cfg::TileK, kThreads, kRowWalk>(smem + Cfg::kOffV, seq.v<Elem>(p, key0), p.v_row_stride,
                                             seq.seqlen_k - key0, p.head_dim_v, tid);
    }

    // Q, dO, lse, D (and a staged bias tile against keys key0 ..) of query block m into pipeline stage
    // `stage`. Inside the loop it is called with a SeqInfo of opaque (b, h) and an opaque tid: the pointers
    // are rebuilt from the constant-bank params on each call instead of holding registers across the loop.
    // Rows past Sq: zero-filled (lse_log2 0 there; the mask hides those queries).
    // tiles = false: Q and dO come by TMA (the warp-specialized producer's thread 0); lse, D and the bias here.
    // threads: the threads sharing lse and D (fewer than kThreads where the warp-specialized producer gives a warp
    // to its dQ adds).
    static __device__ __forceinline__ void load_queries(const AttnParams& p, const SeqInfo& seq, unsigned smem, int m,
                                                        int stage, int tid, int key0, bool tiles = true,
                                                        int threads = kThreads) {
        const int q0 = m * Cfg::kBlockM;
        if constexpr (Cfg::kBias && !Cfg::kBiasInDs) {  // (kBiasInDs: the producer stages it, in the dS tile)
            if (p.bias_staged) {
                Cfg::BiasTileT::template copy<kThreads>(smem + Cfg::kOffBias + stage * Cfg::BiasTileT::kBytes, p,
                                                             seq.b, seq.h, q0, key0, tid);
            }
        }
        const int rows = seq.seqlen_q - q0;
        if (tiles) {
            copy_tile_flat<typename Cfg::TileQ, kThreads, kRowWalk>(smem + Cfg::kOffQ + stage * Cfg::TileQ::kBytes,
                                                                    seq.q<Elem>(p, q0), p.q_row_stride, rows, p.head_dim, tid);
            copy_tile_flat<typename Cfg::TileQ, kThreads, kRowWalk>(smem + Cfg::kOffDo + stage * Cfg::TileQ::kBytes,
                                                                    seq.dout<Elem>(p, q0), p.do_row_stride, rows,
                                                                    p.head_dim_v, tid);
        }
        const float* lse_ptr = seq.lse_log2(p, q0);  // already the exp2-domain offset (the pre-pass)
        const float* dsum_ptr = seq.softmax_d(p, q0);
        for (int i = tid; i < Cfg::kBlockM; i += threads) {
            const bool valid = i < rows;
            cp_async_4(smem + Cfg::kOffLse + (stage * Cfg::kBlockM + i) * 4, lse_ptr + (valid ? i : 0), valid);
            cp_async_4(smem + Cfg::kOffDsum + (stage * Cfg::kBlockM + i) * 4, dsum_ptr + (valid ? i : 0), valid);
        }
    }
};

// A step's bias in the config's own staged tiles (DkdvMainloop::bias_ref), and the reference type a bias
// source gives.
struct OwnBiasTiles {};
template <typename Source>
struct BiasRefOf {
    using type = Source;
};
template <>
struct BiasRefOf<OwnBiasTiles> {
    using type = BiasTileRef;
};

template <typename Cfg, typename Math>
struct DkdvMainloop {
    using Role = typename Math::Role;
    using Loads = DkdvLoads<Cfg, Math::kRowWalkLoads>;
    using TileQ = typename Cfg::TileQ;
    static constexpr int kSmemBytes = Cfg::kSmemBytes;
    static constexpr int kMTiles = Cfg::kMTiles, kDTiles = Cfg::kDTiles;
    static constexpr bool kPacked = LayoutOf<Cfg::kMask>::value;

    static constexpr bool kWarpSpecialized = false;
    // The thread's index among the threads that run the math (the epilogue's thread numbering).
    static __device__ __forceinline__ int thread_index() { return threadIdx.x; }
    static __device__ __forceinline__ void check_smem(unsigned smem) {
        check_bwd_smem<Cfg::kSmemBytes, Math::kSmemAlign>(smem);
    }
    static __device__ __forceinline__ int col0(int nt, int d_split) { return Math::col0(nt, d_split); }

    // One step's S^T = K . Q^T -> P^T (in acc_s; dropped probabilities marked negative) and dP^T = V . dO^T
    // -> dS^T (in acc_dp), from the landed pipeline stage `stage` (transposed C layout: row = key, column =
    // query). dbias_tile: dbias is stored later from a shared dS^T tile, not here.
    // bias: where the step's bias is staged: OwnBiasTiles (the config's own tiles, or none: read directly), or
    // a BiasTileRef / BiasPanelRef the caller picked (the warp-specialized mainloop, one copy per kind).
    // kFullTile: a block list's full tile (probs_transposed runs no mask code). spans: the mask's per-key-block
    // reads (Mask::key_spans) where the caller made them before its step loop, else NoSpans.
    template <typename BiasSource = OwnBiasTiles, bool kFullTile = false, typename Spans = NoSpans>
    static __device__ __forceinline__ void probs_and_dscores(const AttnParams& params, int b, int step_head,
                                                             const typename Cfg::Mask& mask, bool masked,
                                                             int seqlen_q, int query0, int key0, unsigned smem,
                                                             int stage, unsigned s_q, unsigned s_do, const Role& r,
                                                             bool dbias_tile, float (&acc_s)[kMTiles][4],
                                                             float (&acc_dp)[kMTiles][4],
                                                             const BiasSource& bias = BiasSource{},
                                                             const Spans& spans = Spans{}) {
        float aux[kMTiles][4];  // the score modifier's backward factor (dropped for the identity)
        const typename Cfg::ScoreMod mod(params, b, step_head, mask.causal_offset);
        Math::scores(acc_s, acc_dp, smem, s_q, s_do, r);
        const unsigned s_lse = smem + Cfg::kOffLse + (stage * Cfg::kBlockM + r.q_col0 + 2 * r.t) * 4;
        const unsigned s_dsum = smem + Cfg::kOffDsum + (stage * Cfg::kBlockM + r.q_col0 + 2 * r.t) * 4;
        const auto bias_tile = bias_ref(bias, params, smem, stage, query0, key0);
        probs_transposed<Cfg, kMTiles, typename BiasRefOf<BiasSource>::type, kFullTile>(
            acc_s, aux, mod, mask, masked, seqlen_q, query0, key0, r.key_row0, r.q_col0, r.g, r.t, s_lse,
            Cfg::ScoreMod::exp_factor(params), bias_tile, spans);
        if constexpr (Cfg::Dropout::kEnabled) {  // dropped probabilities marked (dropout.cuh)
            const typename Cfg::Dropout dropout(params, b, step_head);
            dropout.mark_transposed(acc_s, key0 + r.key_row0 + r.g, query0 + r.q_col0 + 2 * r.t);
        }
        Math::dprobs(acc_dp, smem, s_do, r);
        dscores_transposed<Cfg>(acc_dp, acc_s, aux, mod, s_dsum, params, key0 + r.key_row0 + r.g,
                                query0 + r.q_col0 + 2 * r.t, !dbias_tile);
    }
    // The step's bias in the config's own staged tiles (stage `stage`), or none (read directly).
    static __device__ __forceinline__ BiasTileRef bias_ref(const OwnBiasTiles&, const AttnParams& params, unsigned smem,
                                                           int stage, int query0, int key0) {
        return Cfg::kBias && !Cfg::kBiasInDs && params.bias_staged
                   ? BiasTileRef{smem + Cfg::kOffBias + stage * Cfg::BiasTileT::kBytes, query0, key0,
                                 Cfg::BiasTileT::kPitch}
                   : BiasTileRef::none();
    }
    template <typename Ref>
    static __device__ __forceinline__ const Ref& bias_ref(const Ref& ref, const AttnParams&, unsigned, int, int, int) {
        return ref;
    }

    // Query heads [h0, h0 + heads) (one kv head's), each over the query blocks of `blocks`: dK / dV
    // accumulate across all of them.
    static __device__ __forceinline__ void run(const AttnParams& params, int b, int h0, int heads, int n_block,
                                               const typename Cfg::Blocks& blocks, const typename Cfg::Mask& mask,
                                               unsigned smem, float (&acc_dk)[kDTiles][4],
                                               float (&acc_dv)[kDTiles][4]) {
        const int tid = threadIdx.x;
        const int seqlen_q = mask.seqlen_q;  // this sequence's
        const int key0 = n_block * Cfg::kBlockN;
        const int num_m_blocks = blocks.count();
        // The query blocks are visited from step `first` on, wrapping around at the end. The atomic path
        // starts at a different step for each key block, so blocks running side by side add into different
        // dq_accum rows; the deterministic path goes in order.
        const int first = Cfg::kAtomicDq && num_m_blocks > 0 ? n_block % num_m_blocks : 0;
        const int num_steps = heads * num_m_blocks;
        if (num_m_blocks > 0) {
            const SeqInfo seq(params, b, h0, LayoutOf<Cfg::kMask>());
            Loads::load_kv(params, seq, smem, key0, tid);
            Loads::load_queries(params, seq, smem, blocks.block(first), 0, tid, key0);
            sm80::cp_async_commit();
        }

        int i = first, h = h0;
        for (int step = 0; step < num_steps; ++step) {
            const int stage = step & 1;
            const int query0 = blocks.block(i) * Cfg::kBlockM;
            const bool masked = blocks.masked(i);
            const int step_head = h;
            i = i + 1 == num_m_blocks ? 0 : i + 1;  // the next step's block, and head once the blocks wrap around
            if (i == first) ++h;
            const unsigned s_q = smem + Cfg::kOffQ + stage * TileQ::kBytes;
            const unsigned s_do = smem + Cfg::kOffDo + stage * TileQ::kBytes;

            // The deterministic backward's dbias adds into a broadcast bias take turns (dbias_order.cuh): this
            // step's, before the barrier below hands it to the CTA. (That backward runs this mainloop without
            // the dQ adds: ordered dQ adds are the warp-specialized kernel's.)
            if constexpr (dbias_order::orders(Cfg::kBias, !Cfg::kAtomicDq)) {
                if (dbias_order::enabled(params) && tid == 0) {  // (opaque: not hoisted and held across the loop)
                    dbias_order::wait_turn(params, opaque(b), opaque(step_head), query0 / Cfg::kBlockM, n_block);
                }
            }
            // This block's tiles have landed, and every warp is done with step - 1 (so the other stage and
            // the P / dS tiles may be overwritten).
            sm80::cp_async_wait<0>();
            Math::fence_loaded();
            __syncthreads();
            if (step + 1 < num_steps) {
                Loads::load_queries(params, SeqInfo::query_side<kPacked>(params, opaque(b), opaque(h)), smem, blocks.block(i), stage ^ 1,
                                    opaque(tid), key0);
                sm80::cp_async_commit();
            }
            const Role r(opaque(tid));

            float acc_s[kMTiles][4];
            float acc_dp[kMTiles][4];
            // dbias from the shared dS^T tile (coalesced) where the step stages one (bias.cuh, dbias_from_tile).
            const bool dbias_tile = Cfg::kBias && Cfg::kHasDs && dbias_from_tile(params);
            probs_and_dscores(params, b, step_head, mask, masked, seqlen_q, query0, key0, smem, stage, s_q, s_do, r,
                              dbias_tile, acc_s, acc_dp);
            if constexpr (dbias_order::orders(Cfg::kBias, !Cfg::kAtomicDq)) {
                if (dbias_order::enabled(params)) {  // every thread's adds are visible: the next rank's turn
                    __threadfence();
                    __syncthreads();
                    if (tid == 0) {
                        dbias_order::pass_turn(params, opaque(b), opaque(step_head), query0 / Cfg::kBlockM, n_block);
                    }
                }
            }

            // dV += P^T . dO (dropped probabilities as 0), dK += dS^T . Q, and with kAtomicDq dq_accum += dS . K.
            if constexpr (Cfg::Dropout::kEnabled) transform(acc_s, [](float x) { return fmaxf(x, 0.f); });
            float* dq_rows =
                Cfg::kAtomicDq ? SeqInfo::query_side<kPacked>(params, opaque(b), step_head).dq_accum(params, query0, Cfg::kHeadDim)
                               : nullptr;
            Math::accumulate(acc_dv, acc_dk, acc_s, acc_dp, smem, s_q, s_do, r, dq_rows, seqlen_q - query0,
                             params.head_dim);
            if constexpr (Cfg::kBias && Cfg::kHasDs) {
                // accumulate() published the dS^T tile (a barrier); the next step's first barrier guards it.
                if (dbias_tile) {
                    store_dbias_tile<typename Cfg::Elem, typename Cfg::TileP, Cfg::kThreads>(
                        params, b, step_head, query0, key0, smem + Cfg::kOffDs, opaque(tid));
                }
            }
            Math::step_done(acc_dv, acc_dk);
        }
    }
};

}  // namespace cuflash
