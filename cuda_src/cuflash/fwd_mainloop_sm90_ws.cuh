// The warp-specialized sm_90a forward mainloop: a producer warpgroup loads, two consumer warpgroups
// compute, and the consumers take turns on the tensor cores (FlashAttention-3's ping-pong).
//
// Roles. Warpgroup 0 (threads 0-127) is the producer: it copies Q, then K_j and V_j of every visible key
// block into a kStages-slot ring (cp.async through the shared FwdLoads, so strides, tails, packed
// sequences and staged bias tiles load exactly as in the other mainloops), and gives most of its
// registers to the consumers (setmaxnreg). Warpgroups 1 and 2 own query rows 0-63 and 64-127 of the
// block, each running FwdMainloopSm90's step on its own (S_j = Q.K_j^T and O += P_{j-1}.V_{j-1} issued as
// one turn, the softmax of S_j under P.V_{j-1}), with the accumulator contract of the other mainloops, so
// the mask, score modifiers, dropout, softmax and epilogue are the shared ones.
//
// Synchronization (cuflash/pipeline_sm90.cuh), slot s = j % kStages:
//   q_full, k_full[s], v_full[s]   producer -> consumers, 128 arrivals (every producer thread, once its
//                                  own copies of the tile landed: cp.async.wait_group, then
//                                  fence.proxy.async so the async proxy (wgmma) sees them, then arrive);
//   k_empty[s], v_empty[s]         consumers -> producer, 256 arrivals (every consumer thread, once its
//                                  wgmma reading the slot has completed: K_j after S_j, V_j after P.V_j).
// The producer issues K_0 (with Q), then K_j, V_{j-1} for j = 1 .. n-1, then V_{n-1}: the order the
// consumers use them. It keeps one tile in flight while publishing the one before (wait_group 1), and
// waits on a slot's empty barrier before reusing it; no wait depends on a tile not yet published, so the
// ring cannot deadlock for kStages >= 2.
// Ping-pong: named barrier kSchedBarrier + g is warpgroup g's turn. A turn is the issue of one step's
// wgmma batches; g syncs on its barrier before issuing and arrives on the other's after, and warpgroup 1
// gives warpgroup 0 the first turn, so the two alternate and each one's softmax runs while the other's
// GEMMs occupy the tensor cores. Both see the same n + 1 turns (n = blocks.count()); warpgroup 1 skips its
// last hand-over, which nobody would take, so both named barriers end balanced.
#pragma once

#include "cuflash/fwd_mainloop_sm90.cuh"
#include "cuflash/pipeline_sm90.cuh"

namespace cuflash {

template <typename Cfg>
struct FwdMainloopSm90Ws
    : FwdWork<Cfg, FwdLoads<Cfg, SwizzledTile<Cfg::kBlockN, Cfg::kHeadDim, sm90::kPanelCols>, Cfg::kStages, 128>> {
    static constexpr bool kWarpSpecialized = true;
    static constexpr int kProducerThreads = 128;
    static constexpr int kConsumerThreads = Cfg::kThreads;  // two warpgroups of 16-row warps
    static constexpr int kThreads = kProducerThreads + kConsumerThreads;
    // Registers per thread after the hand-over: 128 x 40 + 256 x 232 = 64512 of the SM's 65536. At entry
    // every thread has 168 (the __launch_bounds__ cap of 384 threads, one block per SM).
    static constexpr int kProducerRegisters = 40;
    static constexpr int kConsumerRegisters = 232;
    static constexpr int kSchedBarrier = 1;      // named barriers 1, 2: the consumers' turns
    static constexpr int kWarpgroupBarrier = 3;  // named barriers 3, 4: one consumer warpgroup's threads

    using Elem = typename Cfg::Elem;
    using Tile = SwizzledTile<Cfg::kBlockN, Cfg::kHeadDim, sm90::kPanelCols>;
    using Loads = FwdLoads<Cfg, Tile, Cfg::kStages, kProducerThreads>;
    using QTile = typename Loads::QTile;
    static constexpr int kStages = Cfg::kStages;
    static constexpr int kMTiles = Cfg::kMTiles, kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles;
    static constexpr int kBlockN = Cfg::kBlockN;
    // The mbarriers after the tiles: q_full, then k_full, v_full, k_empty, v_empty of every slot.
    static constexpr int kBarriers = 1 + 4 * kStages;
    static constexpr int kBarrierBytes = (kBarriers * sm90::kMbarrierBytes + 15) / 16 * 16;
    static constexpr int kSmemBytes = Loads::kSmemBytes + kBarrierBytes;
    static_assert(Loads::kSmemBytes % 8 == 0, "mbarriers are 8-byte aligned");
    static_assert(Cfg::kNWarps == 8 && Cfg::kWarpRows == 16 && Cfg::kHeadDim % 64 == 0 && kBlockN % 64 == 0 &&
                      kBlockN <= 256 && Cfg::kHeadDim <= 256,
                  "two consumer warpgroups of 16-row warps, 64-column panels and N <= 256");
    static_assert(kStages >= 2, "the ring needs two slots (see the deadlock argument above)");
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(sizeof(Cfg) == 0, "the warp-specialized mainloop compiles for sm_90a only");
#endif

    static __device__ __forceinline__ void check_smem(unsigned smem_q) {
        if (sm80::dynamic_smem_bytes() < kSmemBytes) __trap();  // the plan's smem formula drifted
        if ((smem_q & 1023u) != 0) __trap();                    // wgmma would read a differently swizzled tile
    }

    using FwdWork<Cfg, Loads>::FwdWork;

    __device__ __forceinline__ unsigned barrier(int index) const {
        return this->smem_q + Loads::kSmemBytes + index * sm90::kMbarrierBytes;
    }
    __device__ __forceinline__ unsigned q_full() const { return barrier(0); }
    __device__ __forceinline__ unsigned k_full(int j) const { return barrier(1 + j % kStages); }
    __device__ __forceinline__ unsigned v_full(int j) const { return barrier(1 + kStages + j % kStages); }
    __device__ __forceinline__ unsigned k_empty(int j) const { return barrier(1 + 2 * kStages + j % kStages); }
    __device__ __forceinline__ unsigned v_empty(int j) const { return barrier(1 + 3 * kStages + j % kStages); }
    // The parity of the phase that step j's use of its slot completes.
    static __device__ __forceinline__ int parity(int j) { return (j / kStages) & 1; }
    static __device__ __forceinline__ unsigned slot(int j) { return unsigned(j % kStages) * Tile::kBytes; }

    // Thread 0 sets up the barriers; the kernel's __syncthreads publishes them before the roles split.
    __device__ __forceinline__ void init_barriers() const {
        if (threadIdx.x == 0) {
            sm90::mbarrier_init(q_full(), kProducerThreads);
            for (int s = 0; s < kStages; ++s) {
                sm90::mbarrier_init(k_full(s), kProducerThreads);
                sm90::mbarrier_init(v_full(s), kProducerThreads);
                sm90::mbarrier_init(k_empty(s), kConsumerThreads);
                sm90::mbarrier_init(v_empty(s), kConsumerThreads);
            }
        }
    }

    // -------------------------------------------------------------------------------------- producer
    // This thread's copies of the tile before the one just issued have landed: show them to the async
    // proxy and count them in.
    static __device__ __forceinline__ void publish_previous(unsigned full) {
        sm80::cp_async_wait<1>();
        sm90::fence_proxy_async();
        sm90::mbarrier_arrive(full);
    }

    __device__ __forceinline__ void produce(const AttnParams& params, const SeqInfo& seq) const {
        const int n = this->blocks.count();
        this->loads.load_q(this->smem_q, seq, this->row_begin);
        this->loads.load_k(0);  // one group: Q and K_0
        sm80::cp_async_wait<0>();
        if (!Cfg::ScoreMod::kScaled && params.scale < 0.f) {
            sm90::named_barrier_sync(kWarpgroupBarrier + 2, kProducerThreads);  // Q landed for every producer thread
            negate_q_if_needed<QTile, kProducerThreads, typename Cfg::ScoreMod>(params, this->smem_q);
        }
        sm90::fence_proxy_async();
        sm90::mbarrier_arrive(q_full());
        sm90::mbarrier_arrive(k_full(0));

        unsigned in_flight = 0;  // the full barrier of the tile issued last, not yet published
        bool pending = false;
        for (int j = 1; j <= n; ++j) {
            if (j < n) {
                if (j >= kStages) sm90::mbarrier_wait(k_empty(j), parity(j) ^ 1);  // S_{j - kStages} done
                this->loads.load_k(j);
                if (pending) publish_previous(in_flight);
                in_flight = k_full(j);
                pending = true;
            }
            if (j - 1 >= kStages) sm90::mbarrier_wait(v_empty(j - 1), parity(j - 1) ^ 1);  // P.V_{j-1-kStages} done
            this->loads.load_v(j - 1);
            if (pending) publish_previous(in_flight);
            in_flight = v_full(j - 1);
            pending = true;
        }
        sm80::cp_async_wait<0>();
        sm90::fence_proxy_async();
        sm90::mbarrier_arrive(in_flight);
    }

    // -------------------------------------------------------------------------------------- consumers
    // Step j's S = Q.K_j^T (one wgmma batch) for the warpgroup's 64 Q rows.
    __device__ __forceinline__ void issue_s(float (&acc_s)[kMTiles][kNTiles][4], int j) const {
        const int wg_row0 = this->warp_row0 / 64 * 64;
        sm90::gemm_abt<Elem, Cfg::kHeadDim, Cfg::kBlockM, kBlockN>(acc_s[0], this->smem_q, wg_row0,
                                                                    this->loads.smem_k + slot(j), 0, false);
    }

    __device__ __forceinline__ void run(const AttnParams& params, const SeqInfo& seq, float (&acc_o)[kMTiles][kDTiles][4],
                                        OnlineSoftmax<kMTiles>& softmax) const {
        const int wg = this->warp_row0 / 64;  // this consumer warpgroup, 0 or 1
        const int my_turn = kSchedBarrier + wg, other_turn = kSchedBarrier + 1 - wg;
        const int n = this->blocks.count();
        const float scale_log2 = softmax_scale_log2<typename Cfg::ScoreMod>(params);
        const bool never = params.seqlen_k < 0;  // validated >= 1 on the host; see keep_wait_after

        unsigned p_frag[kNTiles / 2][4];
        auto issue_pv = [&](int j) {
            sm90::fence_operand(acc_o[0]);
            sm90::gemm_rs<Elem, kBlockN / 16, kBlockN>(acc_o[0], p_frag, this->loads.smem_v + slot(j), 0, 0, true);
        };
        // K_j's slot (and its staged bias tile, read by modify_and_mask) goes back to the producer.
        auto release_k = [&](int j) { sm90::mbarrier_arrive(k_empty(j)); };

        if (wg == 1) sm90::named_barrier_arrive(kSchedBarrier, kConsumerThreads);  // warpgroup 0 goes first
        sm90::mbarrier_wait(q_full(), 0);
        sm90::mbarrier_wait(k_full(0), 0);
        {
            float acc_s[kMTiles][kNTiles][4];
            sm90::named_barrier_sync(my_turn, kConsumerThreads);
            issue_s(acc_s, 0);
            sm90::named_barrier_arrive(other_turn, kConsumerThreads);
            sm90::wait<0>();
            sm90::fence_operand(acc_s[0]);
            if constexpr (!Cfg::kBias) release_k(0);
            this->modify_and_mask(acc_s, 0, this->blocks.block(0));
            if constexpr (Cfg::kBias) release_k(0);
            softmax.update(acc_s, acc_o, scale_log2);
            this->drop(acc_s, this->blocks.block(0));
            pack_a<Elem>(p_frag, acc_s[0]);
        }
        for (int j = 1; j < n; ++j) {
            sm90::mbarrier_wait(k_full(j), parity(j));
            sm90::mbarrier_wait(v_full(j - 1), parity(j - 1));
            float acc_s[kMTiles][kNTiles][4];
            sm90::named_barrier_sync(my_turn, kConsumerThreads);
            issue_s(acc_s, j);
            issue_pv(j - 1);
            sm90::named_barrier_arrive(other_turn, kConsumerThreads);
            sm90::wait<1>();  // S_j done; P.V_{j-1} may still run
            sm90::fence_operand(acc_s[0]);
            if constexpr (!Cfg::kBias) release_k(j);
            this->modify_and_mask(acc_s, j, this->blocks.block(j));
            if constexpr (Cfg::kBias) release_k(j);
            float ratio[kMTiles][2];
            softmax.max_step(acc_s, ratio, scale_log2);
            softmax.exp_step(acc_s, scale_log2);
            this->drop(acc_s, this->blocks.block(j));
            keep_wait_after(softmax.row_sum[0][0] + softmax.row_sum[0][1], never, this->smem_q);  // sums of all p
            sm90::wait<0>();
            sm90::fence_operand(acc_o[0]);
            sm90::mbarrier_arrive(v_empty(j - 1));
            softmax.rescale(acc_o, ratio, ratio_is_one(ratio));
            pack_a<Elem>(p_frag, acc_s[0]);
        }
        sm90::mbarrier_wait(v_full(n - 1), parity(n - 1));
        sm90::named_barrier_sync(my_turn, kConsumerThreads);
        issue_pv(n - 1);
        if (wg == 0) sm90::named_barrier_arrive(other_turn, kConsumerThreads);
        sm90::wait<0>();
        sm90::fence_operand(acc_o[0]);
        // Every warp of this warpgroup is past its wgmma reads of the warpgroup's Q rows, which the
        // epilogue then overwrites.
        sm90::named_barrier_sync(kWarpgroupBarrier + wg, 128);
    }
};

}  // namespace cuflash
