// The sm_90a forward mainloop on warpgroup tensor cores (wgmma), with the interface of
// FwdMainloopSm80 (cuflash/fwd_mainloop_sm80.cuh).
//
// Whole warpgroups: warp w owns rows 16w .. 16w+15, warpgroup g = warps 4g .. 4g+3 owns rows 64g .. +64,
// the M of its m64nNk16 wgmma's, which hand each warp its 16 rows in the mma C layout. S = Q.K^T reads Q
// and K from shared memory (both K-major, sm90::gemm_abt); O += P.V takes P from registers in the mma A
// layout and V from shared memory MN-major (sm90::gemm_rs). Shared memory: the same tiles in wide panels
// (cuflash/tile.cuh: 64 columns = 128-byte rows, each panel 1024-byte aligned: the hardware's 128-byte
// swizzle). Pipeline: a 2-slot K / V ring with K one step ahead of V and one barrier per step. Step j:
//   wait K_j, V_{j-1}; fence.proxy.async; barrier -> issue S_j = Q.K_j^T, then O += P_{j-1}.V_{j-1};
//   issue loads K_{j+1}, V_j; wait S_j -> mask, softmax max / exp of S_j (under P.V_{j-1});
//   wait P.V_{j-1}; rescale O; pack P_j
// (FlashAttention-3's intra-warpgroup overlap), then one last P.V. The barrier at the top of step j finds
// every warp done with S_{j-1} and P.V_{j-2}, whose slots K_{j+1} and V_j then take. wgmma reads shared
// memory through the async proxy: every thread fences its landed cp.async writes (fence.proxy.async)
// before the barrier that publishes them. The barrier ahead of the last P.V also orders every wgmma read
// of Q before the epilogue's stores into Q's shared memory.
#pragma once

#include "cuflash/fwd_mainloop_sm80.cuh"
#include "cuflash/wgmma_sm90.cuh"

namespace cuflash {

// Orders the next wgmma wait after the computation of `value`. ptxas (13.0) schedules a wait
// (WARPGROUP.DEPBAR) as early as the instructions after it allow: without this, the wait for P.V
// moved above the softmax meant to run under it, and the two ran one after the other. It keeps the
// wait below shared-memory stores, though. So: a store of `value` under `never`, a predicate false at
// run time but opaque to the compiler. It never executes (it would write the first 4 bytes of `smem`).
__device__ __forceinline__ void keep_wait_after(float value, bool never, unsigned smem) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p st.shared.f32 [%0], %1;\n}\n" ::"r"(smem), "f"(value),
        "r"(int(never))
        : "memory");
}

// True when every row ratio of this thread is exactly 1 (recomputed after the wgmma wait rather than kept
// live across it: one predicate register fewer in the tightest variants).
template <int kMTiles>
__device__ __forceinline__ bool ratio_is_one(const float (&ratio)[kMTiles][2]) {
    bool ones = true;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) ones = ones && ratio[mt][0] == 1.f && ratio[mt][1] == 1.f;
    return ones;
}

// Step j's softmax while P.V_{j-1} still writes acc_o (both wgmma mainloops), in one of two orders. Both end
// with P_j packed as the next P.V's A operand, which the wait for P.V_{j-1} must precede (it reads the last
// P), as must acc_o's rescale; pv_done() (the warp-specialized mainloop frees V's slot there) follows the wait.
// block: key block n.
//  - kWaitFirst, P.V no longer than S (D <= the key block): the maxima, the wait, then the EX2s with the
//    rescale's multiplies and P's packing scheduled in their shadow, unconditionally (FlashAttention-4's sm90
//    order). H200, session 47, against the order below: D64 S1k causal +5%, documents / window +2%, the other
//    D64 / D128 cells -1% to +2%.
//  - otherwise (D256; the D128 bias tiles of 64 keys): the max and exp steps under P.V_{j-1}, then the wait, a
//    rescale skipped when no maximum moved, and the pack. D256 (P.V twice as long as S) lost 2-3% in the order
//    above: the EX2s would wait for the long P.V.
// Dropout's zeros come after the exponentials in both (the row sums are of the kept and dropped p alike).
template <typename Elem, int kMTiles, int kNTiles, int kDTiles, typename Work, typename PvDone>
__device__ __forceinline__ void softmax_under_pv(const Work& work, float (&acc_s)[kMTiles][kNTiles][4],
                                                 float (&acc_o)[kMTiles][kDTiles][4], OnlineSoftmax<kMTiles>& softmax,
                                                 unsigned (&p_frag)[kNTiles / 2][4], int block, float scale_log2,
                                                 bool never, PvDone&& pv_done) {
    float ratio[kMTiles][2];
    softmax.max_step(acc_s, ratio, scale_log2);
    constexpr bool kWaitFirst = kDTiles <= kNTiles;
    if constexpr (kWaitFirst) {
        keep_wait_after(softmax.row_max[0][0] + softmax.row_max[kMTiles - 1][1], never, work.smem_q);  // the maxima
        sm90::wait<0>();
        sm90::fence_operand(acc_o[0]);
        pv_done();
        // ptxas would hoist the EX2s above the wait (they do not read acc_o): the maxima they use are taken
        // from acc_o under `never` (false at run time), which keeps them below it.
        float m[kMTiles][2];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
            m[mt][0] = never ? acc_o[mt][0][0] : softmax.row_max[mt][0];
            m[mt][1] = never ? acc_o[mt][0][2] : softmax.row_max[mt][1];
        }
        softmax.rescale_all(acc_o, ratio);
        softmax.exp_step(acc_s, scale_log2, m);
        work.drop(acc_s, block);
    } else {
        softmax.exp_step(acc_s, scale_log2);
        work.drop(acc_s, block);
        keep_wait_after(softmax.row_sum[0][0] + softmax.row_sum[0][1], never, work.smem_q);  // sums of all p
        sm90::wait<0>();
        sm90::fence_operand(acc_o[0]);
        pv_done();
        softmax.rescale(acc_o, ratio, ratio_is_one(ratio));
    }
    pack_a<Elem>(p_frag, acc_s[0]);
}

// The launch checks of a wgmma mainloop: its dynamic shared memory, and Q's tile 1024-byte aligned.
template <int kSmemBytes>
__device__ __forceinline__ void check_wgmma_smem(unsigned smem_q) {
    if (sm80::dynamic_smem_bytes() < kSmemBytes) __trap();  // the plan's smem formula drifted
    if ((smem_q & 1023u) != 0) __trap();                    // wgmma would read a differently swizzled tile
}

template <typename Cfg>
struct FwdMainloopSm90 : FwdWork<Cfg, FwdLoads<Cfg, SwizzledTile<Cfg::kBlockN, Cfg::kHeadDim, sm90::kPanelCols>, 2>> {
    using Elem = typename Cfg::Elem;
    using Tile = SwizzledTile<Cfg::kBlockN, Cfg::kHeadDim, sm90::kPanelCols>;
    using Loads = FwdLoads<Cfg, Tile, 2>;
    using QTile = typename Loads::QTile;
    static constexpr int kSmemBytes = Loads::kSmemBytes;
    static constexpr int kMTiles = Cfg::kMTiles, kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles;
    static constexpr int kBlockN = Cfg::kBlockN;
    // Whole warpgroups whose 4 warps own the 16-row slices of one m64 tile; N of S = Q.K^T (kBlockN) and
    // of O += P.V (kHeadDim) are wgmma N sizes, and the head dim is whole 64-column panels.
    static_assert(Cfg::kNWarps % 4 == 0 && Cfg::kWarpRows == 16 && Cfg::kHeadDim % 64 == 0 && kBlockN % 64 == 0 &&
                      kBlockN <= 256 && Cfg::kHeadDim <= 256,
                  "the wgmma mainloop needs warpgroups of 16-row warps, 64-column panels and N <= 256");
    static_assert(Cfg::kStages == 2, "the wgmma mainloop is written for a 2-slot K / V ring");
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(sizeof(Cfg) == 0, "the wgmma mainloop compiles for sm_90a only");
#endif

    static __device__ __forceinline__ void check_smem(unsigned smem_q) { check_wgmma_smem<kSmemBytes>(smem_q); }

    using FwdWork<Cfg, Loads>::FwdWork;

    // The barrier that publishes landed cp.async data (and the sign flip) to all warps. wgmma reads shared
    // memory through the async proxy, so each thread first fences its own writes (cp.async writes count as
    // generic-proxy writes) towards it.
    static __device__ __forceinline__ void publish() {
        sm90::fence_proxy_async();
        __syncthreads();
    }
    static __device__ __forceinline__ unsigned slot(int j) { return unsigned(j % 2) * Tile::kBytes; }

    // Step j's S = Q.K_j^T (one wgmma batch) for the warpgroup's 64 Q rows.
    __device__ __forceinline__ void issue_s(float (&acc_s)[kMTiles][kNTiles][4], int j) const {
        const int wg_row0 = this->warp_row0 / 64 * 64;
        sm90::gemm_abt<Elem, Cfg::kHeadDim, Cfg::kBlockM, kBlockN>(acc_s[0], this->smem_q, wg_row0,
                                                                    this->loads.smem_k + slot(j), 0, false);
    }

    __device__ __forceinline__ void run(const AttnParams& params, const SeqInfo& seq, float (&acc_o)[kMTiles][kDTiles][4],
                                        OnlineSoftmax<kMTiles>& softmax) {
        // Prologue: K0 (with Q) only; the loop waits for everything at each step.
        this->loads.load_q(this->smem_q, seq, this->row_begin);
        this->loads.load_k(0);
        const float scale_log2 = positive_scale_log2<QTile, Cfg::kThreads, 0, typename Cfg::ScoreMod>(params, this->smem_q);

        const bool never = params.seqlen_k < 0;  // validated >= 1 on the host; see keep_wait_after
        // P (A operand, registers, mma.sync A layout) times V (MN-major: rows = keys = K, columns = head
        // dim = N). The A registers are not touched again before the wait (ptxas tracks wgmma's register
        // operands); acc_o is fenced on both sides of the batch.
        unsigned p_frag[kNTiles / 2][4];
        auto issue_pv = [&](int j) {
            sm90::fence_operand(acc_o[0]);
            sm90::gemm_rs<Elem, kBlockN / 16, kBlockN>(acc_o[0], p_frag, this->loads.smem_v + slot(j), 0, 0, true);
        };

        // Step 0: S_0 and its softmax; acc_o is still 0, so the softmax may rescale it directly.
        sm80::cp_async_wait<0>();  // Q and K_0 landed for this thread ...
        publish();                 // ... and for all (with the sign flip)
        {
            float acc_s[kMTiles][kNTiles][4];
            issue_s(acc_s, 0);
            this->loads.load_k(1);
            this->loads.load_v(0);
            sm90::wait<0>();
            sm90::fence_operand(acc_s[0]);
            this->modify_and_mask(acc_s, 0, this->blocks.block(0));
            softmax.update(acc_s, acc_o, scale_log2);
            this->drop(acc_s, this->blocks.block(0));
            pack_a<Elem>(p_frag, acc_s[0]);
        }
        for (int j = 1; j < this->blocks.count(); ++j) {
            sm80::cp_async_wait<0>();  // K_j and V_{j-1} landed for this thread ...
            publish();                 // ... and for all; every warp finished step j-1
            float acc_s[kMTiles][kNTiles][4];
            issue_s(acc_s, j);
            issue_pv(j - 1);
            this->loads.load_k(j + 1);  // into the slot of K_{j-1}
            this->loads.load_v(j);      // into the slot of V_{j-2}
            sm90::wait<1>();      // S_j done; P.V_{j-1} may still run
            sm90::fence_operand(acc_s[0]);
            this->modify_and_mask(acc_s, j, this->blocks.block(j));
            // acc_o is still being written by P.V_{j-1}: the softmax's max and exp steps run now, its
            // rescale of acc_o once P.V_{j-1} is done.
            softmax_under_pv<Elem>(*this, acc_s, acc_o, softmax, p_frag, this->blocks.block(j), scale_log2, never,
                                   [] {});
        }
        // The last P.V. Its barrier also orders every wgmma read of Q before the epilogue's stores.
        sm80::cp_async_wait<0>();  // V_{n_blocks-1} landed for this thread ...
        publish();                 // ... and for all
        issue_pv(this->blocks.count() - 1);
        sm90::wait<0>();
        sm90::fence_operand(acc_o[0]);
        sm80::cp_async_wait<0>();  // only empty groups can remain; keep the invariant explicit
    }
};

}  // namespace cuflash
