// The warp-specialized sm_90a forward mainloop: a producer warpgroup loads, two consumer warpgroups
// compute, and the consumers take turns on the tensor cores (FlashAttention-3's ping-pong). Each CTA walks
// query-block tiles (FwdTiles) and the pipeline runs on across them, so the next tile's Q and first K / V
// tiles load while the consumers finish the current one. The plan's grid decides how many a CTA gets
// (cuflash/kernels/forward.py, grid_for): persistent, min(tiles, SMs) CTAs, for unmasked problems; one CTA
// per tile for masked ones, whose uneven tiles the hardware's scheduling balances better than a stride.
//
// Roles. Warpgroup 0 (threads 0-127) is the producer: it copies Q, then K_j and V_j of every visible key
// block into a kStages-slot ring (cp.async through the shared FwdLoads, so strides, tails, packed
// sequences and staged bias tiles load exactly as in the other mainloops; or by TMA, params.qkv_tma), and
// gives most of its registers to the consumers (setmaxnreg). Where every copy is a TMA and there is no bias,
// its warp 0 alone produces (producer_threads, produce_by_tma). Warpgroups 1 and 2 own query rows 0-63 and
// 64-127 of the tile, each running FwdMainloopSm90's step on its own (S_j = Q.K_j^T and O += P_{j-1}.V_{j-1}
// issued as one turn, the softmax of S_j under P.V_{j-1}), with the accumulator contract of the other
// mainloops, so the mask, score modifiers, dropout, softmax and epilogue are the shared ones.
//
// Synchronization (cuflash/pipeline_sm90.cuh). FwdWsRing counts the tiles and the K / V steps this CTA
// has been through; step r of the ring uses slot r % kStages, and phase parity (r / kStages) & 1:
//   q_full, k_full[s], v_full[s]   producer -> consumers, one arrival per producer thread (128, or 32 when
//                                  one warp produces: producer_threads), each once its own copies of
//                                  the tile landed: cp.async.wait_group, then fence.proxy.async so the
//                                  async proxy (wgmma) sees them, then arrive (the one warp: right after
//                                  the TMA issue, whose bytes the barrier counts);
//   k_empty[s], v_empty[s], q_empty   consumers -> producer, 256 arrivals (every consumer thread, once its
//                                  wgmma reading the slot has completed: K_j after S_j, V_j after P.V_j,
//                                  Q after the tile's last S, or after the epilogue when it stages O in Q's
//                                  shared memory).
// Per tile the producer issues Q, K_0, then K_j, V_{j-1} for j = 1 .. n-1, then V_{n-1}: the order the
// consumers use them, one cp.async group each. It keeps one group in flight while publishing the one before
// (wait_group 1), flushes at a tile's end, and waits on a slot's empty barrier before reusing it. No wait
// depends on a tile not yet published, so the ring cannot deadlock for kStages >= 2.
// Ping-pong: named barrier kSchedBarrier + g is warpgroup g's turn. A turn is the issue of one step's
// wgmma batches; g syncs on its barrier before issuing and arrives on the other's after. Warpgroup 1 gives
// warpgroup 0 the first turn at the start, and warpgroup 0 takes one turn-less sync at the end, which
// absorbs warpgroup 1's last hand-over: both named barriers end balanced whatever the tiles were.
#pragma once

#include "cuflash/fwd_mainloop_sm90.cuh"
#include "cuflash/pipeline_sm90.cuh"
#include "cuflash/tma_sm90.cuh"

namespace cuflash {

// The tiles of a persistent launch: (query block, head, batch), query blocks of one (batch, head) adjacent
// (the order of the one-CTA-per-tile grid, which keeps a head's K / V in L2 while its blocks run); the
// masks' longest-first order within each head. CTA c takes units c, c + gridDim.x, ..., a unit being one
// tile, or when paired two tiles of one head: its j-th longest and j-th shortest query blocks (one where
// they meet). Under causal a tile's key blocks grow linearly with its query block, so the pairs hold about
// equal work and a static stride balances the CTAs; walking single tiles, CTA c would get query blocks
// (c + k * gridDim.x) mod num_m, only long ones for some CTAs (H100, session 7: about 3x the work of others).
// kPairable (causal): paired when the grid is persistent (fewer CTAs than tiles: cuflash/kernels/forward.py
// grid_for); one CTA per tile walks single tiles.
template <bool kPairable>
struct FwdTiles {
    static constexpr bool kPairs = kPairable;
    int num_m, num_heads, count;
    bool paired;
    int per_head, units;  // units of one (batch, head), units in all
    __device__ __forceinline__ FwdTiles(const AttnParams& p, int block_m)
        : num_m((p.seqlen_q + block_m - 1) / block_m),
          num_heads(p.num_heads),
          count(num_m * p.num_heads * p.batch),
          paired(kPairable && int(gridDim.x) < count),
          per_head(paired ? (num_m + 1) / 2 : num_m),
          units(per_head * p.num_heads * p.batch) {}
    // How many tiles unit u holds: 1, or 2 for a pair of distinct query blocks.
    __device__ __forceinline__ int tiles_in(int u) const { return paired && 2 * (u % per_head) + 1 != num_m ? 2 : 1; }
    // Tile `second` (0, or 1 for a pair's short one) of unit u.
    __device__ __forceinline__ void at(int u, int second, bool longest_first, int& m_block, int& h, int& b) const {
        const int j = u % per_head, hb = u / per_head;
        const int m_idx = paired && second ? num_m - 1 - j : j;
        m_block = longest_first ? num_m - 1 - m_idx : m_idx;
        h = hb % num_heads;
        b = hb / num_heads;
    }
};

// Where the pipeline stands: tiles with work and K / V steps so far (the same count on both sides).
struct FwdWsRing {
    int tiles = 0;
    int steps = 0;
    unsigned in_flight = 0;  // producer: the full barrier of the group issued last, not yet published
    bool pending = false;
};

// How a CTA walks the units of FwdTiles. Without a queue: units c, c + gridDim.x, ... (the persistent grid's
// static stride; with one CTA per unit, its own). Under the general mask (Mainloop::kQueue) a unit's work is
// known only from its list, so the CTAs take units from a queue instead (FlashAttention-3's dynamic
// scheduler): producer thread 0 takes the next one with an atomic add on the counter after the lists
// (fwd_tile_counter, zeroed by their pre-pass), writes it to one int of shared memory and arrives on the
// unit_full mbarrier; every consumer thread waits there, reads it and arrives on unit_empty, which thread 0
// waits for before it writes the next. The consumers read a unit when they start it, so the producer takes
// the next one (and loads for it) while they work. A unit past the last ends both loops; the consumers do
// not hand it back. Take k waits for the consumers' reads of unit k - 1. The phase parities come from
// FwdWsRing::tiles, which under the queue counts every unit on both sides: a unit with no work passes Q's
// barriers without loading Q (pass_q; a counter of its own cost the D128 consumers 200 bytes of spill, nvcc
// 13.0). Before it waits the producer publishes its pending loads
// (Mainloop::flush): the consumers may need the last tile's last V to finish it and read the next unit
// (session 11 run 15: a skipped unit, with no loads of its own, left that V pending: a deadlock).
// (Session 12: the first version handed units over on two named barriers, bar.arrive / bar.sync as
// FlashAttention-3 does; racecheck reported the consumers' read against the producer's next write wherever a
// unit had no work, so the hand-over uses mbarriers, whose arrive / wait ordering racecheck models.)
template <typename Mainloop>
struct FwdUnitWalk {
    unsigned smem;

    __device__ __forceinline__ explicit FwdUnitWalk(unsigned smem_) : smem(smem_) {}

    // Producer (every thread of its warpgroup): its first unit, then the one after u. kBlockM: the tiles' query
    // rows (the queue skips the units past their packed sequence: take).
    template <int kBlockM, typename Tiles>
    __device__ __forceinline__ int producer_first(const AttnParams& p, const Tiles& tiles, FwdWsRing& ring) const {
        if constexpr (Mainloop::kQueue) {
            return take<kBlockM>(p, tiles, ring);
        } else {
            return int(blockIdx.x);
        }
    }
    template <int kBlockM, typename Tiles>
    __device__ __forceinline__ int producer_next(const AttnParams& p, const Tiles& tiles, FwdWsRing& ring,
                                                 int u) const {
        if constexpr (Mainloop::kQueue) {
            return take<kBlockM>(p, tiles, ring);
        } else {
            return u + int(gridDim.x);
        }
    }
    // Consumers (every thread): the first unit, then the one after u, as the producer took them.
    template <typename Tiles>
    __device__ __forceinline__ int consumer_first(const Tiles& tiles, FwdWsRing& ring) const {
        if constexpr (Mainloop::kQueue) {
            return receive(tiles.units, ring);
        } else {
            return int(blockIdx.x);
        }
    }
    template <typename Tiles>
    __device__ __forceinline__ int consumer_next(const Tiles& tiles, FwdWsRing& ring, int u) const {
        if constexpr (Mainloop::kQueue) {
            return receive(tiles.units, ring);
        } else {
            return u + int(gridDim.x);
        }
    }

  private:
    template <int kBlockM, typename Tiles>
    __device__ __forceinline__ int take(const AttnParams& p, const Tiles& tiles, FwdWsRing& ring) const {
        Mainloop::flush(ring);
        const unsigned slot = Mainloop::unit_slot(smem);
        const int producers = Mainloop::producer_threads(p);
        sm90::named_barrier_sync(Mainloop::kProducerBarrier, producers);  // every producer thread read the last one
        if (threadIdx.x == 0) {
            if (ring.tiles > 0) sm90::mbarrier_wait(Mainloop::unit_empty(smem), (ring.tiles - 1) & 1);
            st_shared_b32(slot, unsigned(take_unit<kBlockM>(p, tiles)));
            sm90::mbarrier_arrive(Mainloop::unit_full(smem));
        }
        sm90::named_barrier_sync(Mainloop::kProducerBarrier, producers);
        return int(ld_shared_b32(slot));
    }
    // The queue's next unit with work to hand over, by producer thread 0. Packed sequences: the grid covers the
    // longest (params.seqlen_q), so most units of a short sequence lie past its rows; handed over, each cost a
    // round of the unit and Q barriers on both sides (H200, session 52: a varlen forward of 32 documents, 2220
    // rows the longest, 9216 units for 2304 with rows: 0.294 ms, and 0.456 ms with 4x the max_seqlen, i.e. ~6 ns
    // of the whole GPU's time per unit past). Those units are taken and dropped here, while the consumers work
    // on the unit before. A unit of a single tile (the queue's: general masks, unpaired) lies past its sequence
    // when its query block starts at or past the sequence's length. Longest first, a head's units run from its
    // last query block down, so those past the sequence open the head's run, together: once one is seen, the
    // rest of them go at once by a compare-and-swap where the counter still points right after it (else one at
    // a time).
    template <int kBlockM, typename Tiles>
    __device__ __forceinline__ int take_unit(const AttnParams& p, const Tiles& tiles) const {
        constexpr bool kLongestFirst = true;  // the general masks' order (flash_fwd_ws: kMask != kNoMask)
        static_assert(!Tiles::kPairs, "the queue's units are single tiles");
        int* counter = fwd_tile_counter(p);
        int u = atomicAdd(counter, 1);
        if (p.cu_seqlens_q == nullptr) return u;  // batched: every unit has rows
        while (u < tiles.units) {
            int m_block, h, b;
            tiles.at(u, 0, kLongestFirst, m_block, h, b);
            const int rows = SeqInfo::query_side<true>(p, b, h).seqlen_q;
            if (m_block * kBlockM < rows) break;
            // Blocks m_block >= ceil(rows / kBlockM) of this head lie past; longest first they are its units
            // j = 0 .. num_m - 1 - that count, this one being j.
            const int past = tiles.num_m - (rows + kBlockM - 1) / kBlockM;
            const int next = u - u % tiles.per_head + past;  // the head's first unit with rows
            if (next > u + 1) atomicCAS(counter, u + 1, next);
            u = atomicAdd(counter, 1);
        }
        return u;
    }
    __device__ __forceinline__ int receive(int units, FwdWsRing& ring) const {
        sm90::mbarrier_wait(Mainloop::unit_full(smem), ring.tiles & 1);
        const int taken = int(ld_shared_b32(Mainloop::unit_slot(smem)));
        if (taken < units) sm90::mbarrier_arrive(Mainloop::unit_empty(smem));
        return taken;
    }
};

// The staged bias of the warp-specialized forward: the wide-panel swizzle (BiasPanelTile), which TMA writes.
template <typename Cfg>
using FwdWsBiasTile = conditional_t<Cfg::kBias, BiasPanelTile<typename Cfg::Elem, Cfg::kBlockM, Cfg::kBlockN>,
                                    typename Cfg::BiasTileT>;

template <typename Cfg>
struct FwdMainloopSm90Ws
    : FwdWork<Cfg, FwdLoads<Cfg, SwizzledTile<Cfg::kBlockN, Cfg::kHeadDim, sm90::kPanelCols>, Cfg::kStages, 128,
                            FwdWsBiasTile<Cfg>>> {
    static constexpr bool kWarpSpecialized = true;
    static constexpr int kProducerThreads = 128;
    static constexpr int kConsumerThreads = Cfg::kThreads;  // two or three warpgroups of 16-row warps
    static constexpr int kConsumerWarpgroups = Cfg::kNWarps / 4;
    static constexpr int kThreads = kProducerThreads + kConsumerThreads;
    static constexpr int kTurnThreads = 256;  // a turn barrier: the warpgroup taking the turn and the one handing it over
    // Registers per thread after the hand-over: the launch gives every thread 168 (the __launch_bounds__ cap
    // of 384 threads, one block per SM), 64512 in all, which the hand-over splits: 128 x 56 + 256 x 224, or
    // at D256 (acc_o alone is 128 registers) 128 x 40 + 256 x 232. ptxas 13.0: the producer's tile loop spills
    // 16 bytes at 40 (D64), the D256 consumers 12 at 224; 24 / 240 spilled in the producer's copies.
    // With three consumer warpgroups (D64, 192 query rows: FlashAttention-3's tile) 512 threads share 128 each at
    // entry; the hand-over gives 128 x 32 + 384 x 160.
    // With a staged bias the producer also copies a (128 rows x kBlockN keys) bias tile per step, whose row
    // addresses ptxas keeps across the step loop: at 56 registers it spilled 92-476 bytes (nvcc 13.0), so
    // the split is 128 x 72 + 256 x 216 there (4-12 bytes left, the consumers' only outside the key loop).
    static constexpr int kConsumerRegisters =
        kConsumerWarpgroups == 3 ? 160 : Cfg::kHeadDim == 256 ? 232 : Cfg::kBias ? 216 : 224;
    static constexpr int kEntryRegisters = 65536 / kThreads / 8 * 8;  // the launch cap at one block per SM
    // Every exponential runs on MUFU.EX2. D64 is as bound by them as by the GEMMs (per 64 x 128 step 8192 of
    // them, 512 clocks of MUFU at 16 per clock, against 512-554 of wgmma at the tensor pipe's peak), and moving
    // every 8th n-tile's to the FMA pipe (a degree-3 polynomial of 2^(x - round(x)) with round(x) added into the
    // exponent field) won 3-5% on the two-warpgroup tile (H100, session 9). On the three-warpgroup tile that D64
    // takes since, the polynomial's ~9 instructions per exponential cost more issue slots than the MUFU time they
    // save (ncu, H200, session 31: 607M instructions against FlashAttention-4's 459M on D64 S4k), and all-MUFU
    // won: eight rotating A/B rounds, forward medians, S1k / S4k / S16k 1.036x / 1.033x / 1.023x (every 16th
    // n-tile on the FMA pipe, four rounds: 1.020x / 1.023x / 1.026x).
    static constexpr int kProducerRegisters =
        (kEntryRegisters * kThreads - kConsumerRegisters * kConsumerThreads) / kProducerThreads;
    static_assert(kProducerRegisters % 8 == 0 && kProducerRegisters >= 24, "setmaxnreg takes multiples of 8");
    static constexpr int kSchedBarrier = 1;  // named barriers 1 .. G: the consumers' turns
    static constexpr int kWarpgroupBarrier = kSchedBarrier + kConsumerWarpgroups;  // next G: one warpgroup's threads
    static constexpr int kProducerBarrier = kWarpgroupBarrier + kConsumerWarpgroups;  // the producer warpgroup's
    static_assert(kProducerBarrier < 16, "16 named barriers");

    using Elem = typename Cfg::Elem;
    using Tile = SwizzledTile<Cfg::kBlockN, Cfg::kHeadDim, sm90::kPanelCols>;
    using Loads = FwdLoads<Cfg, Tile, Cfg::kStages, kProducerThreads, FwdWsBiasTile<Cfg>>;
    using QTile = typename Loads::QTile;
    static constexpr int kStages = Cfg::kStages;
    static constexpr int kMTiles = Cfg::kMTiles, kNTiles = Cfg::kNTiles, kDTiles = Cfg::kDTiles;
    static constexpr int kBlockN = Cfg::kBlockN;
    // Shared memory: the loads' tiles (Q, the K / V ring, bias slots), then where it fits a tile of its own
    // for staging O (else the epilogue stages O in Q's tile, and Q is released only after it), then the
    // mbarriers: q_full, q_empty, then k_full, v_full, k_empty, v_empty of every slot.
    static constexpr int kMaxSmemBytes = 227 * 1024;  // per block on sm_90
    // Under the general mask the producer takes tiles from a queue (FwdUnitWalk) and hands each to the
    // consumers through two more mbarriers (unit_full, unit_empty) and an int after them.
    static constexpr bool kQueue = is_general_mask(Cfg::kMask);
    static constexpr int kBarriers = 2 + 4 * kStages + (kQueue ? 2 : 0);
    static constexpr int kBarrierBytes = (kBarriers * sm90::kMbarrierBytes + (kQueue ? 8 : 0) + 15) / 16 * 16;
    static constexpr bool kSeparateO = Loads::kSmemBytes + QTile::kBytes + kBarrierBytes <= kMaxSmemBytes;
    static constexpr int kOffO = Loads::kSmemBytes;
    static constexpr int kOffBarriers = Loads::kSmemBytes + (kSeparateO ? QTile::kBytes : 0);
    static constexpr int kSmemBytes = kOffBarriers + kBarrierBytes;
    static_assert(Loads::kSmemBytes % 16 == 0, "the O tile and the mbarriers need 16-byte alignment");
    static_assert((Cfg::kNWarps == 8 || Cfg::kNWarps == 12) && Cfg::kWarpRows == 16 && Cfg::kHeadDim % 64 == 0 && kBlockN % 16 == 0 &&
                      kBlockN <= 256 && Cfg::kHeadDim <= 256,
                  "two or three consumer warpgroups of 16-row warps, 64-column panels, N a multiple of 16 up to 256");
    static_assert(kStages >= 2, "the ring needs two slots (see the deadlock argument above)");
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(sizeof(Cfg) == 0, "the warp-specialized mainloop compiles for sm_90a only");
#endif

    static __device__ __forceinline__ void check_smem(unsigned smem_q) { check_wgmma_smem<kSmemBytes>(smem_q); }

    using FwdWork<Cfg, Loads>::FwdWork;

    static __device__ __forceinline__ unsigned barrier(unsigned smem, int index) {
        return smem + kOffBarriers + index * sm90::kMbarrierBytes;
    }
    __device__ __forceinline__ unsigned q_full() const { return barrier(this->smem_q, 0); }
    __device__ __forceinline__ unsigned q_empty() const { return barrier(this->smem_q, 1); }
    __device__ __forceinline__ unsigned k_full(int r) const { return barrier(this->smem_q, 2 + ring_slot(r)); }
    __device__ __forceinline__ unsigned v_full(int r) const { return barrier(this->smem_q, 2 + kStages + ring_slot(r)); }
    __device__ __forceinline__ unsigned k_empty(int r) const { return barrier(this->smem_q, 2 + 2 * kStages + ring_slot(r)); }
    __device__ __forceinline__ unsigned v_empty(int r) const { return barrier(this->smem_q, 2 + 3 * kStages + ring_slot(r)); }
    // The tile queue's (kQueue): its two mbarriers, then the slot holding the unit the producer took last.
    static __device__ __forceinline__ unsigned unit_full(unsigned smem) { return barrier(smem, 2 + 4 * kStages); }
    static __device__ __forceinline__ unsigned unit_empty(unsigned smem) { return barrier(smem, 3 + 4 * kStages); }
    static __device__ __forceinline__ unsigned unit_slot(unsigned smem) {
        return smem + kOffBarriers + kBarriers * sm90::kMbarrierBytes;
    }
    // Ring step r's slot and the parity of the phase that its use of the slot completes (r >= 0: unsigned
    // arithmetic, a shift and a mask for two slots instead of the signed division's corrections).
    static __device__ __forceinline__ int ring_slot(int r) { return int(unsigned(r) % kStages); }
    static __device__ __forceinline__ int parity(int r) { return int(unsigned(r) / kStages) & 1; }
    static __device__ __forceinline__ unsigned slot(int r) { return unsigned(ring_slot(r)) * Tile::kBytes; }
    // Where the epilogue stages O.
    __device__ __forceinline__ unsigned smem_o() const { return kSeparateO ? this->smem_q + kOffO : this->smem_q; }

    // The producer's threads: one warp where every copy goes by TMA (Q, K and V by their maps, with no sign
    // flip of Q to wait for), all issued by thread 0, so that three more warps would only poll the same
    // barriers and commit empty cp.async groups (ncu, session 47: the four producer warps issued ~17% of the
    // D128 forward's instructions; FlashAttention-3 / 4 produce from one warp). Else the whole warpgroup, whose
    // threads share the cp.async copies. The other warps leave once they gave their registers away
    // (flash_fwd_ws); the one left loads with produce_by_tma. Not with a bias: its variants spilled 8-72 bytes
    // more with the second producer path (NVRTC 13.5; D128 bias + softcap 88 -> 160), and no A/B timed them.
    static __device__ __forceinline__ int producer_threads(const AttnParams& p) {
        if constexpr (Cfg::kBias) {
            return kProducerThreads;
        } else {
            const bool q_tma = p.qkv_tma != 0 && (Cfg::ScoreMod::kScaled || p.scale >= 0.f);
            return q_tma ? 32 : kProducerThreads;
        }
    }

    // Thread 0 sets up the barriers; the kernel's __syncthreads publishes them before the roles split.
    static __device__ __forceinline__ void init_barriers(const AttnParams& p, unsigned smem) {
        if (threadIdx.x == 0) {
            const int producers = producer_threads(p);
            sm90::mbarrier_init(barrier(smem, 0), producers);
            sm90::mbarrier_init(barrier(smem, 1), kConsumerThreads);
            for (int s = 0; s < kStages; ++s) {
                sm90::mbarrier_init(barrier(smem, 2 + s), producers);
                sm90::mbarrier_init(barrier(smem, 2 + kStages + s), producers);
                sm90::mbarrier_init(barrier(smem, 2 + 2 * kStages + s), kConsumerThreads);
                sm90::mbarrier_init(barrier(smem, 2 + 3 * kStages + s), kConsumerThreads);
            }
            if constexpr (kQueue) {
                sm90::mbarrier_init(unit_full(smem), 1);
                sm90::mbarrier_init(unit_empty(smem), kConsumerThreads);
            }
        }
    }

    // Under the queue (kQueue) a unit with no work still takes one phase of Q's barriers, so that
    // FwdWsRing::tiles counts every unit on both sides (FwdUnitWalk's parities): the producer, once the last
    // tile's Q is free, arrives on q_full without loading; the consumers wait for it and hand Q back.
    static __device__ __forceinline__ void pass_q_producer(unsigned smem, FwdWsRing& ring) {
        if constexpr (kQueue) {
            flush(ring);
            if (ring.tiles > 0) sm90::mbarrier_wait(barrier(smem, 1), (ring.tiles - 1) & 1);
            sm90::mbarrier_arrive(barrier(smem, 0));
            ring.tiles += 1;
        }
    }
    static __device__ __forceinline__ void pass_q_consumer(unsigned smem, FwdWsRing& ring) {
        if constexpr (kQueue) {
            sm90::mbarrier_wait(barrier(smem, 0), ring.tiles & 1);
            sm90::mbarrier_arrive(barrier(smem, 1));
            ring.tiles += 1;
        }
    }

    // -------------------------------------------------------------------------------------- producer
    // This thread's copies of the group before the one just issued have landed: show them to the async
    // proxy and count them in; the group just issued becomes the pending one.
    static __device__ __forceinline__ void publish_previous(FwdWsRing& ring, unsigned next_full) {
        if (ring.pending) {
            sm80::cp_async_wait<1>();
            sm90::fence_proxy_async();
            sm90::mbarrier_arrive(ring.in_flight);
        }
        ring.in_flight = next_full;
        ring.pending = true;
    }
    // Publishes the pending group (a tile's last V): before waiting for the consumers, whose progress may
    // need it, and at the end.
    static __device__ __forceinline__ void flush(FwdWsRing& ring) {
        if (ring.pending) {
            sm80::cp_async_wait<0>();
            sm90::fence_proxy_async();
            sm90::mbarrier_arrive(ring.in_flight);
            ring.pending = false;
        }
    }

    // Step j's K (ring step r): with a bias loaded by TMA (params.bias_tma), producer thread 0 first adds the
    // bias tile's bytes to k_full(r) and asks for it (the other threads' copies leave it out, FwdLoads::load_k);
    // the phase then completes once every producer thread arrived and the tile landed.
    // With params.qkv_tma (kv_tma) K comes by TMA the same way, from thread 0, and so does V (load_v).
    __device__ __forceinline__ void load_k(const AttnParams& params, const TmaParams& tma, int j, int r,
                                           bool kv_tma) const {
        if constexpr (Cfg::kBias) {
            if (params.bias_tma && threadIdx.x == 0) this->loads.load_bias_tma(&tma.bias, j, r, k_full(r));
        }
        if (kv_tma && threadIdx.x == 0) this->loads.load_kv_tma(false, &tma.k, j, r, k_full(r));
        this->loads.load_k(j, r, kv_tma);
    }
    __device__ __forceinline__ void load_v(const TmaParams& tma, int j, int r, bool kv_tma) const {
        if (kv_tma && threadIdx.x == 0) this->loads.load_kv_tma(true, &tma.v, j, r, v_full(r));
        this->loads.load_v(j, r, kv_tma);
    }

    // One tile's loads (tma: the kernel's __grid_constant__ maps). Where one warp produces (producer_threads),
    // produce_by_tma. Else with params.qkv_tma (a bias, or Q's sign flip) K / V, and Q where no sign flip waits
    // for it (a negative scale on an unscaled modifier), come by TMA from producer thread 0 (their bytes counted
    // on the full barriers), the other threads' copies (the bias's where it has no map) and the publishing
    // below stay: every producer thread still arrives on each full barrier once its own copies, if any, landed.
    __device__ __forceinline__ void produce(const AttnParams& params, const TmaParams& tma, const SeqInfo& seq,
                                            FwdWsRing& ring) const {
        if constexpr (!Cfg::kBias) {
            if (producer_threads(params) < kProducerThreads) {
                produce_by_tma(tma, ring);
                return;
            }
        }
        const int n = this->blocks.count(), r0 = ring.steps;
        const bool kv_tma = params.qkv_tma != 0;
        const bool q_tma = kv_tma && (Cfg::ScoreMod::kScaled || params.scale >= 0.f);
        flush(ring);
        if (ring.tiles > 0) sm90::mbarrier_wait(q_empty(), (ring.tiles - 1) & 1);  // the last tile's Q is free
        if (q_tma) {
            if (threadIdx.x == 0) this->loads.load_q_tma(this->smem_q, &tma.q, q_full());
        } else {
            this->loads.load_q(this->smem_q, seq, this->row_begin);
        }
        sm80::cp_async_commit();
        if (r0 >= kStages) sm90::mbarrier_wait(k_empty(r0), parity(r0) ^ 1);
        load_k(params, tma, 0, r0, kv_tma);
        // Q: its group is the one before K_0's. A negative scale flips its sign first (every producer thread's
        // copies of Q landed: each waits for its own, then the warpgroup meets).
        sm80::cp_async_wait<1>();
        if (!Cfg::ScoreMod::kScaled && params.scale < 0.f) {
            sm90::named_barrier_sync(kProducerBarrier, kProducerThreads);
            negate_q_if_needed<QTile, kProducerThreads, typename Cfg::ScoreMod>(params, this->smem_q);
        }
        sm90::fence_proxy_async();
        sm90::mbarrier_arrive(q_full());
        ring.in_flight = k_full(r0);
        ring.pending = true;

        for (int j = 1; j <= n; ++j) {
            const int r = r0 + j;
            if (j < n) {
                if (r >= kStages) sm90::mbarrier_wait(k_empty(r), parity(r) ^ 1);  // S of ring step r - kStages done
                load_k(params, tma, j, r, kv_tma);
                publish_previous(ring, k_full(r));
            }
            if (r - 1 >= kStages) sm90::mbarrier_wait(v_empty(r - 1), parity(r - 1) ^ 1);  // its P.V done
            load_v(tma, j - 1, r - 1, kv_tma);
            publish_previous(ring, v_full(r - 1));
        }
        ring.steps += n;
        ring.tiles += 1;
    }

    // One tile's loads from the one-warp producer (producer_threads: every copy is a TMA). Thread 0 issues each
    // one with its bytes counted on the full barrier, so the warp arrives right after the issue: the phase still
    // completes only once the bytes landed, and no cp.async group is waited for or fenced. The same order as
    // produce: Q, K_0, then K_j and V_{j-1}, then the last V.
    __device__ __forceinline__ void produce_by_tma(const TmaParams& tma, FwdWsRing& ring) const {
        static_assert(!Cfg::kBias, "a staged bias keeps the producer warpgroup (producer_threads)");
        const int n = this->blocks.count(), r0 = ring.steps;
        auto load_k_tma = [&](int j) {
            const int r = r0 + j;
            if (r >= kStages) sm90::mbarrier_wait(k_empty(r), parity(r) ^ 1);  // S of ring step r - kStages done
            if (threadIdx.x == 0) this->loads.load_kv_tma(false, &tma.k, j, r, k_full(r));
            sm90::mbarrier_arrive(k_full(r));
        };
        auto load_v_tma = [&](int j) {
            const int r = r0 + j;
            if (r >= kStages) sm90::mbarrier_wait(v_empty(r), parity(r) ^ 1);  // P.V of ring step r - kStages done
            if (threadIdx.x == 0) this->loads.load_kv_tma(true, &tma.v, j, r, v_full(r));
            sm90::mbarrier_arrive(v_full(r));
        };
        if (ring.tiles > 0) sm90::mbarrier_wait(q_empty(), (ring.tiles - 1) & 1);  // the last tile's Q is free
        if (threadIdx.x == 0) this->loads.load_q_tma(this->smem_q, &tma.q, q_full());
        sm90::mbarrier_arrive(q_full());
        load_k_tma(0);
        for (int j = 1; j < n; ++j) {
            load_k_tma(j);
            load_v_tma(j - 1);
        }
        load_v_tma(n - 1);
        ring.steps += n;
        ring.tiles += 1;
    }

    // -------------------------------------------------------------------------------------- consumers
    static __device__ __forceinline__ int warpgroup(int warp_row0) { return warp_row0 / 64; }
    // Turns go round: warpgroup g hands over to g + 1, the last to 0. The last warpgroup gives warpgroup 0 the
    // first turn; warpgroup 0 absorbs the last hand-over. Every warpgroup takes the same turns per tile (the
    // tile's key blocks), so each turn barrier sees its 256 threads per phase.
    static __device__ __forceinline__ void start_turns(int warp_row0) {
        if (warpgroup(warp_row0) == kConsumerWarpgroups - 1) sm90::named_barrier_arrive(kSchedBarrier, kTurnThreads);
    }
    static __device__ __forceinline__ void end_turns(int warp_row0) {
        if (warpgroup(warp_row0) == 0) sm90::named_barrier_sync(kSchedBarrier, kTurnThreads);
    }

    // Ring step r's S = Q.K^T (one wgmma batch) for the warpgroup's 64 Q rows.
    __device__ __forceinline__ void issue_s(float (&acc_s)[kMTiles][kNTiles][4], int r) const {
        const int wg_row0 = this->warp_row0 / 64 * 64;
        sm90::gemm_abt<Elem, Cfg::kHeadDim, Cfg::kBlockM, kBlockN>(acc_s[0], this->smem_q, wg_row0,
                                                                    this->loads.smem_k + slot(r), 0, false);
    }

    // One tile's key loop; leaves acc_o un-normalized. After the epilogue the caller calls release_q.
    __device__ __forceinline__ void run(const AttnParams& params, const SeqInfo& seq, float (&acc_o)[kMTiles][kDTiles][4],
                                        OnlineSoftmax<kMTiles>& softmax, FwdWsRing& ring) const {
        const int wg = warpgroup(this->warp_row0);
        const int my_turn = kSchedBarrier + wg;
        const int other_turn = kSchedBarrier + (kConsumerWarpgroups == 2 ? 1 - wg : (wg + 1) % kConsumerWarpgroups);
        const int n = this->blocks.count(), r0 = ring.steps;
        const float scale_log2 = softmax_scale_log2<typename Cfg::ScoreMod>(params);
        const bool never = params.seqlen_k < 0;  // validated >= 1 on the host; see keep_wait_after
        // The mask's reads for this thread's rows, once for the tile, made under the tile's first S (whose wgmma
        // then runs while they land: read before the Q wait, they stood alone in the way wherever Q was already
        // there, +2.5% on one-tile units). Not with a bias: beside its tiles the held spans cost the D128 consumers
        // 8-16 bytes more spill (ptxas 13.0).
        auto read_spans = [&] {
            if constexpr (Cfg::kBias) {
                return NoSpans{};
            } else {
                return this->mask.row_spans(this->row_begin + this->warp_row0);
            }
        };
        decltype(read_spans()) spans;

        unsigned p_frag[kNTiles / 2][4];
        auto issue_pv = [&](int r) {
            sm90::fence_operand(acc_o[0]);
            sm90::gemm_rs<Elem, kBlockN / 16, kBlockN>(acc_o[0], p_frag, this->loads.smem_v + slot(r), 0, 0, true);
        };
        // After step j's S: K's slot (and its staged bias tile, read by modify_and_mask) goes back to the
        // producer, and after the tile's last S so does Q (when O has a tile of its own).
        auto release_k = [&](int j) {
            sm90::mbarrier_arrive(k_empty(r0 + j));
            if (kSeparateO && j == n - 1) sm90::mbarrier_arrive(q_empty());
        };

        sm90::mbarrier_wait(q_full(), ring.tiles & 1);
        sm90::mbarrier_wait(k_full(r0), parity(r0));
        {
            float acc_s[kMTiles][kNTiles][4];
            sm90::named_barrier_sync(my_turn, kTurnThreads);
            issue_s(acc_s, r0);
            sm90::named_barrier_arrive(other_turn, kTurnThreads);
            spans = read_spans();
            sm90::wait<0>();
            sm90::fence_operand(acc_s[0]);
            if constexpr (!Cfg::kBias) release_k(0);
            this->template modify_and_mask<true>(acc_s, 0, this->blocks.block(0), r0, spans);
            if constexpr (Cfg::kBias) release_k(0);
            softmax.update(acc_s, acc_o, scale_log2);
            this->drop(acc_s, this->blocks.block(0));
            pack_a<Elem>(p_frag, acc_s[0]);
        }
        for (int j = 1; j < n; ++j) {
            const int r = r0 + j;
            sm90::mbarrier_wait(k_full(r), parity(r));
            sm90::mbarrier_wait(v_full(r - 1), parity(r - 1));
            float acc_s[kMTiles][kNTiles][4];
            sm90::named_barrier_sync(my_turn, kTurnThreads);
            issue_s(acc_s, r);
            issue_pv(r - 1);
            sm90::named_barrier_arrive(other_turn, kTurnThreads);
            sm90::wait<1>();  // S_j done; P.V_{j-1} may still run
            sm90::fence_operand(acc_s[0]);
            if constexpr (!Cfg::kBias) release_k(j);
            this->template modify_and_mask<true>(acc_s, j, this->blocks.block(j), r, spans);
            if constexpr (Cfg::kBias) release_k(j);
            softmax_under_pv<Elem>(*this, acc_s, acc_o, softmax, p_frag, this->blocks.block(j), scale_log2, never,
                                   [&] { sm90::mbarrier_arrive(v_empty(r - 1)); });
        }
        const int r_last = r0 + n - 1;
        sm90::mbarrier_wait(v_full(r_last), parity(r_last));
        sm90::named_barrier_sync(my_turn, kTurnThreads);
        issue_pv(r_last);
        sm90::named_barrier_arrive(other_turn, kTurnThreads);
        sm90::wait<0>();
        sm90::fence_operand(acc_o[0]);
        sm90::mbarrier_arrive(v_empty(r_last));
        if constexpr (!kSeparateO) {
            // Every warp of this warpgroup is past its wgmma reads of the warpgroup's Q rows, which the
            // epilogue then overwrites.
            sm90::named_barrier_sync(kWarpgroupBarrier + wg, 128);
        }
        ring.steps += n;
        ring.tiles += 1;
    }

    // After the epilogue: with O staged in Q's tile, this thread is done with Q only now.
    // The epilogue's generic stores into Q's tile come before the async proxy's next writes there (Q by TMA):
    // fence.proxy.async, then the arrive.
    __device__ __forceinline__ void release_q() const {
        if constexpr (!kSeparateO) {
            sm90::fence_proxy_async();
            sm90::mbarrier_arrive(q_empty());
        }
    }
};

}  // namespace cuflash
