// The warp-specialized sm_90a dK/dV mainloop (DkdvMainloopSm90Ws): a producer warpgroup loads and adds dQ,
// two consumer warpgroups (the 8 warps of DkdvWgmmaSm90's layout: warpgroup g owns keys 64g .. +64) run the
// GEMMs and the P / dS math. Only the dS^T exchange of the atomic dQ step joins the consumers (at D64 the sum of
// their partial dQ instead); nothing joins them with the producer but mbarriers:
//   kv_full          K, V of the block landed (once)
//   q_full[s]        stage s holds the step's Q, dO, lse, D (producer -> consumers)
//   q_empty[s]       both consumer warpgroups are done with stage s (consumers -> producer)
//   dq_full[d]       dQ staging tile d holds the step's dS.K (consumers -> producer; atomic path)
//   dq_empty[d]      the producer's bulk add has read tile d (producer -> consumers)
//   dq_half[d]       tile d holds the first warpgroup's partial dQ (kSplitDq: first -> second warpgroup)
// The producer copies with cp.async (DkdvLoads on its 128 threads) and publishes a stage the way the
// warp-specialized forward does (wait_group, fence.proxy.async, arrive); one producer thread adds each
// step's staged dQ (kBlockM contiguous dq_accum rows, each in dq_accum_chunk's order: bwd_config.cuh) with one
// cp.reduce.async.bulk.
//
// Consumers, per step: wait q_full; S^T and dP^T (wgmma) -> P^T, dS^T (DkdvMainloop::probs_and_dscores,
// shared with the other mainloops); on the atomic path dS^T into the step's shared tile (two, alternating)
// and one named barrier of the 256 consumer threads; dQ, dV, dK batches; dQ into the staging tile; arrive
// q_empty once dV / dK have read the stage. The dS^T tiles alternate by step: a warpgroup writes tile
// (i + 1) & 1 only after the barrier of step i, which the other warpgroup reaches after its dQ GEMM of
// step i - 1 (the last reader of that tile) has completed.
// At 128 queries a step without a bias (D64, kSplitDq) the warpgroups exchange nothing: each computes dQ over its
// own keys from its own dS^T rows (one barrier of its own 128 threads) and dK from those rows in shared memory; the
// first stores its partial into the staging tile, the second adds its own onto it and arrives on dq_full. The
// second warpgroup runs half a step behind the first.
//
// A bias (no softcap) on the atomic path: the producer also copies the step's bias tile into the step's dS
// tile (Cfg::kBiasInDs; by TMA when params.bias_tma, producer thread 0 adding its bytes to the stage's
// q_full before its own arrival there; the tile is free once both warpgroups released the stage two steps back), laid out
// [query][key] like the bias in global memory. The consumers read it while computing P^T, then write dS over
// it in the same layout (stmatrix .trans), each warp over exactly the (key, query) elements it read; the dQ
// step reads dS K-major, and after it each warpgroup copies its keys' dS rows into dbias (16-byte chunks).
// Without the dQ step the bias goes into DkdvConfig's own staged tiles, as on the other mainloops.
//
// Head dim 256 (kExchange: DkdvConfig's kWarpsD = 2, 64 x 64 tile): warpgroup g computes S^T / dP^T of all 64
// keys x query half g and dK / dV of all keys x head-dim half g, so every step exchanges P^T and dS^T through
// two pairs of shared tiles (alternating by step, under the same argument as the dS^T tiles above) with one
// named barrier; its atomic dQ step (if planned) adds from the consumers' registers, since fp32 staging tiles
// do not fit beside the 64 KB of Q / dO stages. The producer only loads there (four rows apart: the row walk of
// copy_tile_flat with two swizzle phases). H100 (session 18, ncu, B4 H8 S4k): without the dQ step 2576 -> 2150
// us against the 8-warp mainloop; with it 5033 -> 4890, the adds setting the pace, which is why the D256 plans
// run the dQ kernel instead (backward.split_dq).
//
// Registers: the launch cap of 384 threads (168) is split 24 / 240 by setmaxnreg (kProducerRegisters).
#pragma once

#include "cuflash/bulk_sm90.cuh"
#include "cuflash/dbias_order.cuh"
#include "cuflash/dkdv_mainloop.cuh"
#include "cuflash/dkdv_mainloop_sm90.cuh"
#include "cuflash/dq_order.cuh"
#include "cuflash/pipeline_sm90.cuh"

namespace cuflash {

// kGeneralOrdered (a general mask only): the dQ adds may be ordered (the deterministic plan's variant, flash_bwd.cu's
// kDkdvMainloopSm90WsOrdered); the default general-mask kernels are built without that path.
template <typename Cfg, bool kGeneralOrdered = false>
struct DkdvMainloopSm90Ws {
    using Elem = typename Cfg::Elem;
    using Math = DkdvWgmmaSm90<Cfg>;
    using Steps = DkdvMainloop<Cfg, Math>;  // probs_and_dscores
    using Role = typename Math::Role;
    using TileQ = typename Cfg::TileQ;
    using DqStep = typename Math::DqStep;
    static constexpr bool kWarpSpecialized = true;
    static constexpr int kProducerThreads = 128;
    static constexpr int kConsumerThreads = Cfg::kThreads;
    static constexpr int kThreads = kProducerThreads + kConsumerThreads;
    static constexpr int kConsumerRegisters = 240;
    static constexpr int kProducerRegisters = (168 * 384 - kConsumerRegisters * 256) / 128;
    static_assert(kProducerRegisters % 8 == 0 && kProducerRegisters >= 24, "setmaxnreg takes multiples of 8");
    static constexpr int kDsBarrier = 1;  // named barrier: the consumers' dS^T tiles of a step written
    static constexpr int kKvFreeBarrier = 2;  // named barrier: the consumers' last reads of K / V done
    static constexpr int kDbiasBarrier = 3;   // named barrier: the consumers' turn of ordered dbias adds
    static constexpr int kMTiles = Cfg::kMTiles, kDTiles = Cfg::kDTiles;
    static constexpr int kStages = 2;  // DkdvConfig's Q / dO / lse / D stages
    static constexpr bool kPacked = LayoutOf<Cfg::kMask>::value;
    using Loads = DkdvLoads<Cfg, true, kProducerThreads>;  // the row walk, on the producer's 128 threads
    static_assert(Cfg::kNWarps == 8 && (Cfg::kWarpsD == 1 || Cfg::kHasP) && !Cfg::Dropout::kEnabled,
                  "the warp-specialized dK/dV mainloop takes the 8-warp wgmma layouts without dropout");
    // kWarpsD = 2 (D256: a warpgroup per query half of S^T and head-dim half of dK / dV): P^T and dS^T are
    // exchanged through two pairs of shared tiles, alternating by step, and the atomic dQ step adds from the
    // consumers' registers (no room for fp32 staging tiles beside the 64 KB of Q / dO stages).
    static constexpr bool kExchange = Cfg::kWarpsD == 2;
    static constexpr bool kStagedDq = Cfg::kAtomicDq && !kExchange;  // dQ staged for the producer's bulk add
    // kSplitDq (128 queries a step, no bias: D64): each warpgroup computes dQ over its own 64 keys only (all 128
    // queries, 64 fp32 accumulators a thread), so neither reads the other's dS^T rows and no barrier of both joins
    // them inside a step. The partials meet in the step's staging tile: the first warpgroup stores its own, the
    // second adds its own onto it (dq_half orders the two) and hands the sum to the producer, one bulk add a step as
    // before. The second warpgroup starts half a step behind the first, so each one's P / dS math, long against the
    // GEMMs at 128 queries, runs under the other's GEMMs (H200, session 49: a probe without the exchange, dQ wrong on
    // purpose, ran the D64 backward 4-9% faster with the offset).
    static constexpr bool kSplitDq = kStagedDq && !Cfg::kBias && Cfg::kBlockM == 128;
    static_assert(!kExchange || !Cfg::kBias, "the exchanged layout takes no bias");
    static_assert(!kGeneralOrdered || (is_general_mask(Cfg::kMask) && kStagedDq),
                  "ordered adds under a general mask: the staged dQ step");
    static_assert(!Cfg::kBias || !Cfg::kAtomicDq || Cfg::kBiasInDs,
                  "a bias on the atomic path is staged in the dS tiles (no room for tiles of its own)");
    using TileDs = typename Cfg::TileDs;
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(sizeof(Cfg) == 0, "the warp-specialized dK/dV mainloop compiles for sm_90a only");
#endif

    // Shared memory: Cfg's layout (its P^T / dS^T tiles are pair 0), then the second P^T tile (kExchange), the
    // second dS^T tile, the two dQ staging tiles (kBlockM rows x kHeadDim fp32, dq_accum's rows in dq_accum_chunk's order;
    // kStagedDq) and the mbarriers.
    static constexpr int kDqTileBytes = Cfg::kBlockM * Cfg::kHeadDim * 4;
    static constexpr int kOffP1 = Cfg::kSmemBytes;
    static constexpr int kOffDs1 = kOffP1 + (kExchange ? Cfg::TileP::kBytes : 0);
    static constexpr int kOffDqStage = kOffDs1 + (Cfg::kAtomicDq || kExchange ? Cfg::TileP::kBytes : 0);
    static constexpr int kOffBarriers = kOffDqStage + (kStagedDq ? 2 * kDqTileBytes : 0);
    static constexpr int kBarriers = 1 + 2 * kStages + 6;
    static constexpr int kSmemBytes = kOffBarriers + (kBarriers * sm90::kMbarrierBytes + 15) / 16 * 16;
    static_assert(kOffDs1 % 1024 == 0 && Cfg::TileP::kBytes % 1024 == 0,
                  "the second dS^T tile needs the 1024-byte alignment of wgmma's 128-byte swizzle");

    static __device__ __forceinline__ void check_smem(unsigned smem) { check_bwd_smem<kSmemBytes, Math::kSmemAlign>(smem); }
    static __device__ __forceinline__ int col0(int nt, int d_split) { return Math::col0(nt, d_split); }
    // The consumers' index (the epilogue's thread numbering).
    static __device__ __forceinline__ int thread_index() { return int(threadIdx.x) - kProducerThreads; }

    static __device__ __forceinline__ unsigned barrier(unsigned smem, int index) {
        return smem + kOffBarriers + index * sm90::kMbarrierBytes;
    }
    static __device__ __forceinline__ unsigned kv_full(unsigned smem) { return barrier(smem, 0); }
    static __device__ __forceinline__ unsigned q_full(unsigned smem, int s) { return barrier(smem, 1 + s); }
    static __device__ __forceinline__ unsigned q_empty(unsigned smem, int s) { return barrier(smem, 1 + kStages + s); }
    static __device__ __forceinline__ unsigned dq_full(unsigned smem, int d) { return barrier(smem, 1 + 2 * kStages + d); }
    static __device__ __forceinline__ unsigned dq_empty(unsigned smem, int d) { return barrier(smem, 3 + 2 * kStages + d); }
    // kSplitDq: staging tile d holds the first warpgroup's partial dQ (first -> second warpgroup).
    static __device__ __forceinline__ unsigned dq_half(unsigned smem, int d) { return barrier(smem, 5 + 2 * kStages + d); }
    static __device__ __forceinline__ unsigned ds_tile(unsigned smem, int step) {
        return smem + ((step & 1) ? kOffDs1 : Cfg::kOffDs);
    }
    static __device__ __forceinline__ unsigned p_tile(unsigned smem, int step) {
        return smem + ((step & 1) ? kOffP1 : Cfg::kOffP);
    }
    static __device__ __forceinline__ unsigned dq_tile(unsigned smem, int step) {
        return smem + kOffDqStage + (step & 1) * kDqTileBytes;
    }

    // Thread 0 sets up the barriers; the kernel's __syncthreads publishes them before the roles split.
    static __device__ __forceinline__ void init_barriers(const AttnParams& params, unsigned smem) {
        if (threadIdx.x == 0) {
            const int loaders = load_threads(params);
            sm90::mbarrier_init(kv_full(smem), loaders);
            for (int s = 0; s < kStages; ++s) {
                sm90::mbarrier_init(q_full(smem, s), loaders);
                sm90::mbarrier_init(q_empty(smem, s), kConsumerThreads);
            }
            for (int d = 0; d < 2; ++d) {
                sm90::mbarrier_init(dq_full(smem, d), kSplitDq ? 128 : kConsumerThreads);
                sm90::mbarrier_init(dq_empty(smem, d), 1);
                sm90::mbarrier_init(dq_half(smem, d), 128);
            }
        }
    }

    // The step order both roles walk: block i of head h, from block `first`, wrapping around to the next
    // head (DkdvMainloop::run's order). With ordered dQ adds (dq_order.cuh) every CTA walks the blocks of a
    // head in one order, from the last one down without a mask and from its diagonal up under causal;
    // otherwise the atomic adds start at a block of their own (n_block modulo the count), spread over the
    // query blocks.
    struct Cursor {
        int i, h, first, num_m_blocks;
        bool descending;
        __device__ __forceinline__ void advance() {
            i = i + 1 == num_m_blocks ? 0 : i + 1;
            if (i == first) ++h;
        }
        __device__ __forceinline__ int index() const { return descending ? num_m_blocks - 1 - i : i; }
    };
    static __device__ __forceinline__ Cursor start(int n_block, int h0, int num_m_blocks, bool ordered) {
        const int first = Cfg::kAtomicDq && !ordered && num_m_blocks > 0 ? n_block % num_m_blocks : 0;
        return Cursor{first, h0, first, num_m_blocks, ordered && !kDescendingRanks};
    }
    // The general masks' kernels serve packed sequences too (kPacked); their kGeneralOrdered variant orders the
    // adds where the plan asks, on the batched layout only (cuflash/kernels/backward.py ordered_dq_fits).
    static __device__ __forceinline__ bool ordered_dq(const AttnParams& params) {
        return kStagedDq && (!kPacked || kGeneralOrdered) && dq_order::enabled(params);
    }
    // The default backward's first stores (dq_order.cuh): unordered adds, each query block's first one a store.
    // Also the general masks' kernels (kPacked: they serve packed sequences too), where the plan asks for them on
    // the batched layout.
    static __device__ __forceinline__ bool claimed_dq(const AttnParams& params) {
        return kStagedDq && dq_order::claimed(params);
    }
    // The deterministic backward runs this kernel without dQ adds, or with ordered ones (none / causal, and the
    // general masks' kGeneralOrdered variant: cuflash/kernels/backward.py ordered_dq_fits); only the variants
    // deterministic plans run carry the dbias turns (dbias_order.cuh), not the general masks' default ones.
    static constexpr bool kDbiasTurns =
        dbias_order::orders(Cfg::kBias, !Cfg::kAtomicDq || !is_general_mask(Cfg::kMask) || kGeneralOrdered);
    // Under causal and the general masks the ordered adds into a query block run from its last visible key block
    // down (dq_order.cuh): each CTA walks its query blocks upwards and the grid hands out the key blocks
    // last-first, so a CTA only ever waits for CTAs dispatched before it (higher key blocks); under causal, and
    // wherever a key block's first query block is the one where it is the last visible key block (causal
    // documents, a causal window), one step ahead of it.
    static constexpr bool kCausalOrder = Cfg::kMask == kCausalMask;
    static constexpr bool kDescendingRanks = kCausalOrder || is_general_mask(Cfg::kMask);
    static __device__ __forceinline__ int key_block(const AttnParams& params, int bx) {
        return kDescendingRanks && ordered_dq(params) ? int(gridDim.x) - 1 - bx : bx;
    }
    // The CTA's (key block, head group, batch) from its grid position: key blocks in chunks of heads
    // (chunked_grid_order, bwd_config.cuh) under causal and the general masks, unless the dQ adds are ordered
    // (those go last-first within a head: key_block); without a mask and with ordered adds, each head's key blocks
    // staggered a chunk apart (why, and what each use measured: chunked_grid_order's comment).
    static __device__ __forceinline__ void grid_position(const AttnParams& params, int heads, int& n_block,
                                                         int& group, int& b) {
        // Ordered dbias adds rank the CTAs in the grid's own (batch, head) order (dbias_order.cuh).
        if ((kDescendingRanks ? !ordered_dq(params) : Cfg::kMask == kNoMask && ordered_dq(params)) &&
            !(kDbiasTurns && dbias_order::enabled(params))) {
            chunked_grid_order<Cfg::kHeadDim>(params.seqlen_q * heads, n_block, group, b);
        }
        n_block = key_block(params, n_block);
    }
    // The turn of key block n_block at query block m_block: without a mask the key blocks add in increasing
    // order; under causal from the block's last visible key block down; under a general mask likewise, its rank
    // the number of key blocks after it in the query block's list (the forward orientation's lists of the dK/dV
    // tile, built beside the transposed ones that this kernel walks: both classify every tile alike).
    static __device__ __forceinline__ int add_rank(const AttnParams& params, int b, int head, int m_block, int n_block) {
        if constexpr (kCausalOrder) {
            const typename Cfg::Mask mask(params, SeqInfo(params, b, head, LayoutOf<Cfg::kMask>()));
            int n_begin, n_end;
            mask.template key_block_range<Cfg::kBlockM, Cfg::kBlockN>(m_block, n_begin, n_end);
            return n_end - 1 - n_block;
        } else if constexpr (is_general_mask(Cfg::kMask)) {
            // The query block's list row on the batched layout (the only one with ordered adds), from the parameter
            // block on each call: a whole Mask here (its SeqInfo) cost the producer's 24 registers more spill.
            const int* list = Cfg::Mask::kv_list_of(params, opaque(b), opaque(head) / params.mask_head_div,
                                                    m_block);  // [count, (block << 1) | partial ascending]
            const int count = __ldg(list);
            int lo = 0, hi = count;  // the first entry at or past n_block (it is n_block)
            while (lo < hi) {
                const int mid = (lo + hi) / 2;
                if ((__ldg(list + 1 + mid) >> 1) < n_block) {
                    lo = mid + 1;
                } else {
                    hi = mid;
                }
            }
            return count - 1 - lo;
        } else {
            return n_block;
        }
    }

    // The ordered dQ adds, and the claimed ones, on a thread of their own (lane 0 of the producer warpgroup's
    // last warp, write_dq) instead of the thread that issues the loads: an ordered add waits for its turn and for
    // its completion before passing the turn on, a claimed one for the first store or its own, and on the load
    // thread those waits held the next steps' loads (H200, session 25: without the waits for the turn the
    // deterministic dK/dV still took 1.23-1.35x the atomic one's time at D128). With Q / dO by TMA and no bias
    // copied by the producer's threads, whose loads assume all 128 (claimed_dq implies both).
    static __device__ __forceinline__ bool dq_writer_warp(const AttnParams& params) {
        if constexpr (!kStagedDq) {
            return false;
        } else {
            return claimed_dq(params) || (ordered_dq(params) && params.qkv_tma != 0 &&
                                          !(Cfg::kBiasInDs && params.bias_staged && !params.bias_tma));
        }
    }
    // The producer threads that issue loads and arrive on kv_full / q_full.
    static __device__ __forceinline__ int load_threads(const AttnParams& params) {
        return dq_writer_warp(params) ? kProducerThreads - 32 : kProducerThreads;
    }

    // -------------------------------------------------------------------------------------- producer
    // Iteration k publishes step k - 1's stage (issued one iteration earlier, while the consumers ran step
    // k - 2), waits for the consumers to free stage k % 2 (step k - 2 done), issues step k's loads, then adds
    // step k - 2's dQ. Nothing the consumers wait for at a step's start sits behind the load issue or a dQ
    // add: a stage is published as soon as its bytes landed, and the add of step k - 2 (whose tile the
    // consumers reuse only at step k's dQ) releases its tile one iteration later, when its read is done (an
    // ordered add: once complete).
    // kEarlyDqRelease (the bias variants): the tile of step k - 3 goes back right after step k - 1 is
    // published instead, before the wait and the load issue (the consumers stage step k - 1's dQ into it).
    // H100, session 17 (ncu): with the bias's copy in the load issue, the consumers spent 9% of their stall
    // samples waiting for the tile, and the early release took the bias dK/dV 535 -> 520 us; without a bias
    // the early wait for the add's read delays the loads instead (D128 S4k 2593 -> 2642 us, causal 1411 ->
    // 1463), so those keep the late release.
    static constexpr bool kEarlyDqRelease = Cfg::kBiasInDs;
    static __device__ __forceinline__ void produce(const AttnParams& params, const TmaParams& tma, int b, int h0,
                                                   int heads, int n_block, const typename Cfg::Blocks& blocks,
                                                   unsigned smem) {
        // Two instantiations rather than a flag carried through the loop in the producer's 24 registers.
        if (dq_writer_warp(params)) {
            produce_as<true>(params, tma, b, h0, heads, n_block, blocks, smem);
        } else {
            produce_as<false>(params, tma, b, h0, heads, n_block, blocks, smem);
        }
    }
    // kWriter (dq_writer_warp): the last warp's lane 0 runs write_dq, the other 96 threads the loads.
    template <bool kWriter>
    static __device__ __forceinline__ void produce_as(const AttnParams& params, const TmaParams& tma, int b, int h0,
                                                      int heads, int n_block, const typename Cfg::Blocks& blocks,
                                                      unsigned smem) {
        constexpr int kLoaders = kWriter ? kProducerThreads - 32 : kProducerThreads;
        const int tid = threadIdx.x;
        const int num_m_blocks = blocks.count();
        const int num_steps = heads * num_m_blocks;
        const int key0 = n_block * Cfg::kBlockN;
        if (num_steps == 0) return;
        const bool ordered = ordered_dq(params);
        if constexpr (kWriter) {
            if (tid >= kLoaders) {
                if (tid == kLoaders) write_dq(params, b, h0, num_m_blocks, num_steps, n_block, blocks, smem);
                return;
            }
        }
        // params.qkv_tma (the batched layout): K, V and each step's Q, dO by TMA from thread 0, their bytes
        // counted on kv_full / the stage's q_full before its own arrival there; lse, D (and a bias without a map)
        // still by cp.async, published as before.
        const bool tma_tiles = params.qkv_tma != 0;
        Cursor c = start(n_block, h0, num_m_blocks, ordered);
        {
            const SeqInfo seq(params, b, h0, LayoutOf<Cfg::kMask>());
            if (!tma_tiles) {
                Loads::load_kv(params, seq, smem, key0, tid);
            } else if (tid == 0) {
                sm90::tma_load_rows<typename Cfg::TileK>(smem + Cfg::kOffK, &tma.k, kv_full(smem), seq.h_kv, key0, b);
                sm90::tma_load_rows<typename Cfg::TileK>(smem + Cfg::kOffV, &tma.v, kv_full(smem), seq.h_kv, key0, b);
            }
            sm80::cp_async_commit();
        }
        // The block and head of steps k - 1 and k - 2 (their dQ is added later).
        int i1 = 0, h1 = 0, i2 = 0, h2 = 0;
        for (int step = 0; step < num_steps; ++step) {
            const int s = step % kStages;
            // Publish the newest group: K, V at step 0, step - 1's stage after.
            sm80::cp_async_wait<0>();
            sm90::fence_proxy_async();
            sm90::mbarrier_arrive(step == 0 ? kv_full(smem) : q_full(smem, (step - 1) % kStages));
            if constexpr (kStagedDq && kEarlyDqRelease && !kWriter) {
                if (step >= 3 && !ordered) release_dq(smem, step - 3);
            }
            if (step >= kStages) sm90::mbarrier_wait(q_empty(smem, s), (step / kStages - 1) & 1);
            // Opaque (b, h, tid): the addresses are rebuilt from the constant bank on each call instead of
            // held across the loop in the producer's few registers.
            if (tma_tiles && tid == 0) {
                const int q0 = blocks.block(c.index()) * Cfg::kBlockM;
                sm90::tma_load_rows<TileQ>(smem + Cfg::kOffQ + s * TileQ::kBytes, &tma.q, q_full(smem, s), c.h, q0, b);
                sm90::tma_load_rows<TileQ>(smem + Cfg::kOffDo + s * TileQ::kBytes, &tma.dout, q_full(smem, s), c.h, q0,
                                           b);
            }
            Loads::load_queries(params, SeqInfo::query_side<kPacked>(params, opaque(b), opaque(c.h)), smem,
                                blocks.block(c.index()), s, opaque(tid), key0, !tma_tiles, kLoaders);
            if constexpr (Cfg::kBiasInDs) {  // into the step's dS tile, free since step - 2 released stage s
                if (params.bias_tma) {  // by TMA, thread 0 alone, its bytes counted on the stage's full barrier
                    if (tid == 0) {
                        Cfg::BiasPanel::load_tma(ds_tile(smem, step), params, &tma.bias, b, c.h,
                                                 blocks.block(c.index()) * Cfg::kBlockM, key0, q_full(smem, s));
                    }
                } else if (params.bias_staged) {
                    Cfg::BiasPanel::template copy<kProducerThreads>(ds_tile(smem, step), params, opaque(b), opaque(c.h),
                                                                    blocks.block(c.index()) * Cfg::kBlockM, key0,
                                                                    opaque(tid));
                }
            }
            sm80::cp_async_commit();
            // The add after the load issue: an ordered add's wait for its turn overlaps the loads in flight.
            if constexpr (kStagedDq) {
                if (step >= 2 && !kWriter) add_dq(params, b, blocks.block(i2), h2, smem, step - 2, n_block, ordered);
            }
            i2 = i1;
            h2 = h1;
            i1 = c.index();
            h1 = c.h;
            c.advance();
        }
        sm80::cp_async_wait<0>();
        sm90::fence_proxy_async();
        sm90::mbarrier_arrive(q_full(smem, (num_steps - 1) % kStages));
        if constexpr (kStagedDq) {
            if (kWriter) return;
            if (kEarlyDqRelease && num_steps >= 3 && !ordered) release_dq(smem, num_steps - 3);
            if (num_steps >= 2) add_dq(params, b, blocks.block(i2), h2, smem, num_steps - 2, n_block, ordered);
            add_dq(params, b, blocks.block(i1), h1, smem, num_steps - 1, n_block, ordered);
            if (tid == 0) sm90::bulk_wait<0>();  // the adds are complete before the CTA (and its tiles) go
        }
    }

    // Step `step`'s staged dQ (dS . K of query block m_block of head `head`, unscaled) added into dq_accum by
    // one thread: kBlockM whole rows, contiguous there. Rows past the sequence carry +-0 (WgmmaDqStep::add).
    // Then the tile of step - 1, whose add was issued one call earlier, goes back to the consumers once read
    // (kEarlyDqRelease: release_dq gives it back earlier). Ordered: add_ordered, on the load thread where no
    // warp writes dQ (dq_writer_warp).
    static __device__ __forceinline__ void add_dq(const AttnParams& params, int b, int m_block, int head, unsigned smem,
                                                  int step, int n_block, bool ordered) {
        if (threadIdx.x != 0) return;
        if (ordered) {
            add_ordered(params, b, m_block, head, smem, step, n_block);
            return;
        }
        sm90::mbarrier_wait(dq_full(smem, step & 1), (step >> 1) & 1);
        float* rows =
            SeqInfo::query_side<kPacked>(params, b, head).dq_accum(params, m_block * Cfg::kBlockM, Cfg::kHeadDim);
        sm90::bulk_reduce_add_f32(rows, dq_tile(smem, step), kDqTileBytes);
        sm90::bulk_commit();
        if (!kEarlyDqRelease && step >= 1) {
            sm90::bulk_wait_read<1>();
            sm90::mbarrier_arrive(dq_empty(smem, (step - 1) & 1));
        }
    }

    // An ordered add of step `step`'s tile (dq_order.cuh), by the calling thread: once staged, after key block
    // n_block's turn at query block m_block; complete, the turn passed on, the tile back to the consumers.
    static __device__ __forceinline__ void add_ordered(const AttnParams& params, int b, int m_block, int head,
                                                       unsigned smem, int step, int n_block) {
        sm90::mbarrier_wait(dq_full(smem, step & 1), (step >> 1) & 1);
        float* rows =
            SeqInfo::query_side<kPacked>(params, b, head).dq_accum(params, m_block * Cfg::kBlockM, Cfg::kHeadDim);
        int* counter = dq_order::counters(params, b, head) + m_block;
        const int rank = add_rank(params, b, head, m_block, n_block);
        dq_order::wait_turn(counter, rank);
        // Only the sequence's rows (the batched layout's seqlen_q): the +-0 of the rows past it would land in the
        // next head's first rows unordered, and could flip the sign of a zero there. Rank 0 stores where the
        // pre-pass left dq_accum unzeroed (dq_order::first_store).
        const int rows_in = min(Cfg::kBlockM, params.seqlen_q - m_block * Cfg::kBlockM);
        if (rank == 0 && dq_order::first_store(params)) {
            sm90::bulk_store_f32(rows, dq_tile(smem, step), rows_in * Cfg::kHeadDim * 4);
        } else {
            sm90::bulk_reduce_add_f32(rows, dq_tile(smem, step), rows_in * Cfg::kHeadDim * 4);
        }
        sm90::bulk_commit();
        sm90::bulk_wait<0>();
        dq_order::pass_turn(counter);
        sm90::mbarrier_arrive(dq_empty(smem, step & 1));
    }

    // A claimed add of step `step`'s tile (dq_order.cuh), by the writer thread: once staged, a ticket of the
    // query block's counter; the first stores, and publishes the store once complete; the others add once it is
    // published. Both only the sequence's rows: past them lie the next head's rows, not yet written, maybe.
    // The tile goes back to the consumers once read.
    static __device__ __forceinline__ void add_claimed(const AttnParams& params, int b, int m_block, int head,
                                                       unsigned smem, int step) {
        sm90::mbarrier_wait(dq_full(smem, step & 1), (step >> 1) & 1);
        const SeqInfo seq = SeqInfo::query_side<kPacked>(params, b, head);
        float* rows = seq.dq_accum(params, m_block * Cfg::kBlockM, Cfg::kHeadDim);
        int* counter = dq_order::counters(params, b, head) + m_block;
        const unsigned bytes = min(Cfg::kBlockM, seq.seqlen_q - m_block * Cfg::kBlockM) * Cfg::kHeadDim * 4;
        if (dq_order::claim(counter)) {
            sm90::bulk_store_f32(rows, dq_tile(smem, step), bytes);
            sm90::bulk_commit();
            sm90::bulk_wait<0>();
            dq_order::publish(counter);
        } else {
            dq_order::wait_ready(counter);
            sm90::bulk_reduce_add_f32(rows, dq_tile(smem, step), bytes);
            sm90::bulk_commit();
            sm90::bulk_wait_read<0>();
        }
        sm90::mbarrier_arrive(dq_empty(smem, step & 1));
    }

    // The writer thread's walk (dq_writer_warp): every step's ordered or claimed add, in the consumers' step
    // order; the claimed adds complete before the CTA (and its tiles) go.
    static __device__ __forceinline__ void write_dq(const AttnParams& params, int b, int h0, int num_m_blocks,
                                                    int num_steps, int n_block, const typename Cfg::Blocks& blocks,
                                                    unsigned smem) {
        const bool ordered = ordered_dq(params);
        Cursor c = start(n_block, h0, num_m_blocks, ordered);
        for (int step = 0; step < num_steps; ++step) {
            if (ordered) {
                add_ordered(params, b, blocks.block(c.index()), c.h, smem, step, n_block);
            } else {
                add_claimed(params, b, blocks.block(c.index()), c.h, smem, step);
            }
            c.advance();
        }
        if (!ordered) sm90::bulk_wait<0>();
    }

    // The dQ tile of step `step` back to the consumers once its add (the one bulk add in flight) has read it
    // (kEarlyDqRelease).
    static __device__ __forceinline__ void release_dq(unsigned smem, int step) {
        if (threadIdx.x != 0) return;
        sm90::bulk_wait_read<0>();
        sm90::mbarrier_arrive(dq_empty(smem, step & 1));
    }

    // -------------------------------------------------------------------------------------- consumers
    static __device__ __forceinline__ void consume(const AttnParams& params, int b, int h0, int heads, int n_block,
                                                   const typename Cfg::Blocks& blocks, const typename Cfg::Mask& mask,
                                                   unsigned smem, float (&acc_dk)[kDTiles][4],
                                                   float (&acc_dv)[kDTiles][4]) {
        const int tid = thread_index();
        const int num_m_blocks = blocks.count();
        const int num_steps = heads * num_m_blocks;
        const int key0 = n_block * Cfg::kBlockN;
        const int seqlen_q = mask.seqlen_q;
        Cursor c = start(n_block, h0, num_m_blocks, ordered_dq(params));
        // The mask's reads for this thread's keys, once for the key block (issued before the wait for K / V).
        // Not with a bias: beside its tiles the held spans cost the consumers 26-128 bytes more spill (ptxas
        // 13.0); those steps read them as before.
        const auto spans = [&] {
            if constexpr (Cfg::kBias) {
                return NoSpans{};
            } else {
                const Role r0(tid);
                return mask.key_spans(key0 + r0.key_row0 + r0.g, seqlen_q);
            }
        }();
        if (num_steps > 0) sm90::mbarrier_wait(kv_full(smem), 0);
        // kSplitDq: the second warpgroup waits for the first's step-0 P / dS (the first arrives below).
        if (kSplitDq && num_steps > 1 && tid >= 128) sm90::named_barrier_sync(kDsBarrier, kConsumerThreads);
        for (int step = 0; step < num_steps; ++step) {
            const int s = step % kStages;
            const int query0 = blocks.block(c.index()) * Cfg::kBlockM;
            const bool masked = blocks.masked(c.index());
            const int step_head = c.h;
            c.advance();
            const unsigned s_q = smem + Cfg::kOffQ + s * TileQ::kBytes;
            const unsigned s_do = smem + Cfg::kOffDo + s * TileQ::kBytes;
            sm90::mbarrier_wait(q_full(smem, s), (step / kStages) & 1);
            // The deterministic backward's dbias adds into a broadcast bias take turns (dbias_order.cuh).
            if constexpr (kDbiasTurns) {
                if (dbias_order::enabled(params)) {
                    if (tid == 0) dbias_order::wait_turn(params, b, step_head, query0 / Cfg::kBlockM, n_block);
                    sm90::named_barrier_sync(kDbiasBarrier, kConsumerThreads);
                }
            }
            const Role r(opaque(tid));

            float acc_s[kMTiles][4];
            float acc_dp[kMTiles][4];
            // dbias from the step's dS tile where it is dS itself (bias.cuh, dbias_from_tile).
            const bool dbias_tile = Cfg::kBiasInDs && dbias_from_tile(params);
            // A staged bias and one read directly take separate copies of the step's score math, each with its
            // reads fixed at compile time (one uniform branch per step instead of one per score).
            if (Cfg::kBias && params.bias_staged) {
                if constexpr (Cfg::kBiasInDs) {
                    Steps::probs_and_dscores(params, b, step_head, mask, masked, seqlen_q, query0, key0, smem, s, s_q,
                                             s_do, r, dbias_tile, acc_s, acc_dp,
                                             Cfg::BiasPanel::ref(ds_tile(smem, step), query0, key0), spans);
                } else {
                    Steps::probs_and_dscores(params, b, step_head, mask, masked, seqlen_q, query0, key0, smem, s, s_q,
                                             s_do, r, dbias_tile, acc_s, acc_dp,
                                             Steps::bias_ref(OwnBiasTiles{}, params, smem, s, query0,
                                                             key0), spans);
                }
            } else if (Cfg::Blocks::kListed && !Cfg::kBias && !masked) {
                // A block list's full tile: a copy of the step without the mask's code, whose registers (ids,
                // addresses) the GPU machine's ptxas (nvcc 13.0) spilled around the masked branch on every
                // step, 22 local loads and stores per warp and step (block-causal 512, session 17).
                Steps::template probs_and_dscores<BiasTileRef, true>(params, b, step_head, mask, masked, seqlen_q,
                                                                     query0, key0, smem, s, s_q, s_do, r, dbias_tile,
                                                                     acc_s, acc_dp, BiasTileRef::none());
            } else {
                Steps::probs_and_dscores(params, b, step_head, mask, masked, seqlen_q, query0, key0, smem, s, s_q, s_do,
                                         r, dbias_tile, acc_s, acc_dp, BiasTileRef::none(), spans);
            }
            if (kSplitDq && num_steps > 1 && step == 0 && tid < 128) {
                sm90::named_barrier_arrive(kDsBarrier, kConsumerThreads);
            }
            if constexpr (kDbiasTurns) {
                if (dbias_order::enabled(params)) {  // every consumer's adds are visible: the next rank's turn
                    __threadfence();
                    sm90::named_barrier_sync(kDbiasBarrier, kConsumerThreads);
                    if (tid == 0) dbias_order::pass_turn(params, b, step_head, query0 / Cfg::kBlockM, n_block);
                }
            }

            if constexpr (kExchange) {
                accumulate_exchanged(params, b, step_head, query0, step, s_q, s_do, smem, r, acc_s, acc_dp, acc_dk,
                                     acc_dv);
            } else if constexpr (kSplitDq) {
                accumulate_split(step, s_q, s_do, smem, r, acc_s, acc_dp, acc_dk, acc_dv);
            } else {
                // dV += P^T . dO, dK += dS^T . Q from registers; with kAtomicDq first dQ = dS . K from the shared
                // dS^T tiles of both warpgroups, staged for the producer's add.
                unsigned p_frag[Cfg::kBlockM / 16][4], ds_frag[Cfg::kBlockM / 16][4];
                pack_a<Elem>(p_frag, acc_s);
                pack_a<Elem>(ds_frag, acc_dp);
                float acc_dq[DqStep::kNTiles][4];
                if constexpr (Cfg::kAtomicDq) {
                    const unsigned s_ds = ds_tile(smem, step);
                    if constexpr (Cfg::kBiasInDs) {
                        // Over the warp's staged bias: stmatrix is warp-wide, so every lane's reads (which its
                        // operands depend on) are done before any lane's store.
                        store_ds_rows(s_ds, ds_frag, r);
                    } else {
                        store_a_tile<typename Cfg::TileP>(s_ds, ds_frag, r.key_row0, r.lane);
                    }
                    sm90::fence_proxy_async();
                    sm90::named_barrier_sync(kDsBarrier, kConsumerThreads);
                    if constexpr (Cfg::kBiasInDs) {
                        DqStep::issue_rows(acc_dq, r.warp, s_ds, smem + Cfg::kOffK);
                    } else {
                        DqStep::issue(acc_dq, r.warp, s_ds, smem + Cfg::kOffK);
                    }
                }
                sm90::fence_operand(acc_dv);
                sm90::fence_operand(acc_dk);
                sm90::gemm_rs<Elem, Cfg::kBlockM / 16, Cfg::kBlockM>(acc_dv, p_frag, s_do, 0, 0, true);
                sm90::gemm_rs<Elem, Cfg::kBlockM / 16, Cfg::kBlockM>(acc_dk, ds_frag, s_q, 0, 0, true);
                if constexpr (Cfg::kAtomicDq) {
                    sm90::wait<2>();
                    sm90::fence_operand(acc_dq);
                    if (step >= 2) sm90::mbarrier_wait(dq_empty(smem, step & 1), ((step >> 1) - 1) & 1);
                    stage_dq(acc_dq, r, dq_tile(smem, step));
                    sm90::mbarrier_arrive(dq_full(smem, step & 1));
                    if constexpr (Cfg::kBiasInDs) {
                        // This warpgroup's keys (its own warps wrote them; the barrier above ordered them).
                        constexpr int kPartChunks = Cfg::kBlockN / 8 / (kConsumerThreads / 128);
                        if (dbias_tile) {
                            // (Opaque: offsets derived from tid would be hoisted out of the loop and spilled.)
                            store_dbias_rows<Elem, TileDs, 128, kPartChunks>(params, b, step_head, query0, key0,
                                                                             ds_tile(smem, step), opaque(tid) % 128,
                                                                             opaque(tid) / 128 * kPartChunks);
                        }
                    }
                }
            }
            sm90::wait<0>();
            sm90::fence_operand(acc_dv);
            sm90::fence_operand(acc_dk);
            sm90::mbarrier_arrive(q_empty(smem, s));  // Q, dO, lse, D of stage s are read
        }
    }

    // kSplitDq, step `step` after its P / dS math: the warpgroup's dS^T rows into the step's tile, one barrier of its
    // own warps, then its partial dQ (all queries, its 64 keys), dV and dK; the partial staged once complete, while
    // dV / dK run.
    static __device__ __forceinline__ void accumulate_split(int step, unsigned s_q, unsigned s_do, unsigned smem,
                                                            const Role& r, const float (&acc_s)[kMTiles][4],
                                                            const float (&acc_dp)[kMTiles][4],
                                                            float (&acc_dk)[kDTiles][4], float (&acc_dv)[kDTiles][4]) {
        constexpr int kQueryPanels = Cfg::kBlockM / sm90::kPanelCols;
        constexpr int kNT = Cfg::kHeadDim / 8;
        unsigned p_frag[Cfg::kBlockM / 16][4];
        pack_a<Elem>(p_frag, acc_s);
        // The tile's rows of this warpgroup were last read by its own dQ and dK of step - 2, complete since.
        const unsigned s_ds = ds_tile(smem, step);
        {
            unsigned ds_frag[Cfg::kBlockM / 16][4];
            pack_a<Elem>(ds_frag, acc_dp);
            store_a_tile<typename Cfg::TileP>(s_ds, ds_frag, r.key_row0, r.lane);
        }
        sm90::fence_proxy_async();
        const int wg = r.warp / 4;
        sm90::named_barrier_sync(4 + wg, 128);
        float acc_dq[kQueryPanels][kNT][4];
#pragma unroll
        for (int p = 0; p < kQueryPanels; ++p) {
            sm90::gemm_atb<Elem, 64, Cfg::kBlockN, Cfg::kBlockN>(acc_dq[p], s_ds, p, smem + Cfg::kOffK, 0, 64 * wg,
                                                                 false);
        }
        sm90::fence_operand(acc_dv);
        sm90::fence_operand(acc_dk);
        sm90::gemm_rs<Elem, Cfg::kBlockM / 16, Cfg::kBlockM>(acc_dv, p_frag, s_do, 0, 0, true);
        // dK from the tile just written (its rows read K-major): dS^T's fragments beside the partial dQ's 64
        // accumulators made ptxas serialize the wgmma.
        sm90::gemm_ab<Elem, Cfg::kBlockM, Cfg::kBlockN, Cfg::kBlockM>(acc_dk, s_ds, 64 * wg, s_q, 0, true);
        sm90::wait<2>();
        const unsigned tile = dq_tile(smem, step);
        if (wg == 0) {
            if (step >= 2) sm90::mbarrier_wait(dq_empty(smem, step & 1), ((step >> 1) - 1) & 1);
        } else {
            sm90::mbarrier_wait(dq_half(smem, step & 1), (step >> 1) & 1);
        }
#pragma unroll
        for (int p = 0; p < kQueryPanels; ++p) {
            sm90::fence_operand(acc_dq[p]);
            const int row = p * sm90::kPanelCols + (r.warp % 4) * 16 + r.g;
            if (wg == 0) {
                stage_dq_at<false>(acc_dq[p], row, 2 * r.t, tile);
            } else {
                stage_dq_at<true>(acc_dq[p], row, 2 * r.t, tile);
            }
        }
        if (wg == 0) {
            sm90::mbarrier_arrive(dq_half(smem, step & 1));  // the second warpgroup reads it (generic proxy)
        } else {
            sm90::fence_proxy_async();  // every element's last writer is this warpgroup: the bulk add reads them
            sm90::mbarrier_arrive(dq_full(smem, step & 1));
        }
    }

    // kWarpsD = 2: each warp's P^T and dS^T (its 16 keys x its warpgroup's query half) into the step's pair of
    // shared tiles, one barrier of the consumers, then from those tiles (with kAtomicDq) dQ of the warpgroup's
    // head-dim half, added from registers into dq_accum while dV / dK of its half run. The pairs alternate by
    // step: a warpgroup writes pair (i + 1) & 1 only after the barrier of step i, which the other warpgroup
    // reaches once its GEMMs of step i - 1 (the last readers of that pair) have completed.
    static __device__ __forceinline__ void accumulate_exchanged(const AttnParams& params, int b, int step_head,
                                                                int query0, int step, unsigned s_q, unsigned s_do,
                                                                unsigned smem, const Role& r,
                                                                const float (&acc_s)[kMTiles][4],
                                                                const float (&acc_dp)[kMTiles][4],
                                                                float (&acc_dk)[kDTiles][4],
                                                                float (&acc_dv)[kDTiles][4]) {
        constexpr int kHalfPanels = Cfg::kHeadDim / sm90::kPanelCols / 2;
        const unsigned s_p = p_tile(smem, step), s_ds = ds_tile(smem, step);
        store_c_tile<Elem, typename Cfg::TileP>(s_p, acc_s, r.key_row0, r.q_col0, r.lane);
        store_c_tile<Elem, typename Cfg::TileP>(s_ds, acc_dp, r.key_row0, r.q_col0, r.lane);
        sm90::fence_proxy_async();
        sm90::named_barrier_sync(kDsBarrier, kConsumerThreads);
        float acc_dq[DqStep::kNTiles][4];
        if constexpr (Cfg::kAtomicDq) DqStep::issue(acc_dq, r.warp, s_ds, smem + Cfg::kOffK);
        sm90::fence_operand(acc_dv);
        sm90::fence_operand(acc_dk);
        sm90::gemm_ab<Elem, Cfg::kBlockM, Cfg::kBlockN, Cfg::kBlockM>(acc_dv, s_p, 0, s_do, r.d_split * kHalfPanels, true);
        sm90::gemm_ab<Elem, Cfg::kBlockM, Cfg::kBlockN, Cfg::kBlockM>(acc_dk, s_ds, 0, s_q, r.d_split * kHalfPanels, true);
        if constexpr (Cfg::kAtomicDq) {
            float* dq_rows =
                SeqInfo::query_side<kPacked>(params, opaque(b), step_head).dq_accum(params, query0, Cfg::kHeadDim);
            DqStep::template add<2>(acc_dq, r, dq_rows);
        }
    }

    // After consume: every consumer is done with K and V (its last GEMMs completed), so the epilogue may
    // stage dK / dV over them (DkdvEpilogue, store_c_rows_staged). The producer never touches them after
    // its first loads.
    static __device__ __forceinline__ void release_kv() { sm90::named_barrier_sync(kKvFreeBarrier, kConsumerThreads); }

    // The warp's dS^T fragments (its 16 keys x kBlockM queries, wgmma's A layout) into the [query][key] dS
    // tile, transposed by stmatrix: per 16 queries, lane l addresses query row l % 8 (+ 8 for l >= 16) of the
    // 8-key chunk (l / 8) % 2 of the warp's two.
    static __device__ __forceinline__ void store_ds_rows(unsigned tile, const unsigned (&ds)[Cfg::kBlockM / 16][4],
                                                         const Role& r) {
        const int i = r.lane / 8;
        const int chunk = r.key_row0 / 8 + (i & 1);
#pragma unroll
        for (int kk = 0; kk < Cfg::kBlockM / 16; ++kk) {
            sm90::stmatrix_x4_trans(tile + TileDs::chunk_offset(kk * 16 + (i >> 1) * 8 + r.lane % 8, chunk), ds[kk]);
        }
    }

    // The warp's part of the step's dQ into the staging tile (kBlockM rows of kHeadDim fp32, dq_accum's rows, so one
    // bulk add moves the whole tile), in dq_accum_chunk's order: per pair of n-tiles a thread's 4 values of row
    // g, then of row g + 8, each one 16-byte store; the generic-proxy stores are fenced for the bulk add.
    // (H100, session 20, ncu source counters of D128 S4k: the row-major staging before this, a shuffle per two
    // floats and selects by lane parity, held ~11% of the kernel's stall samples.)
    template <int kNT>
    static __device__ __forceinline__ void stage_dq(const float (&acc)[kNT][4], const Role& r, unsigned tile) {
        static_assert(DqStep::kSplitQueries || DqStep::kSplitColumns,
                      "each (row, column) of the staged dQ has one writer");
        const int row = DqStep::query_panel(r.warp) * sm90::kPanelCols + (r.warp % 4) * 16 + r.g;
        const int col0 = DqStep::panel0(r.warp) * sm90::kPanelCols + 2 * r.t;  // a multiple of 64, plus 2t
        stage_dq_at<false>(acc, row, col0, tile);
        sm90::fence_proxy_async();
    }
    // A thread's dQ fragment (rows row, row + 8; columns col0 + 8 nt, + 1) into a staging tile; kAdd: onto what the
    // tile holds there (kSplitDq's second partial).
    template <bool kAdd, int kNT>
    static __device__ __forceinline__ void stage_dq_at(const float (&acc)[kNT][4], int row, int col0, unsigned tile) {
        static_assert(kNT % 2 == 0, "the staging pairs adjacent n-tiles");
        // Pair p's chunk: that of pair p % 2 plus 4 (p - p % 2) (the row-parity swap stays inside each 32-column
        // group), so two addresses per thread; rows g + 8 are 8 rows on (the same parity).
        unsigned at[2];
#pragma unroll
        for (int p = 0; p < 2; ++p) at[p] = tile + (row * Cfg::kHeadDim + 4 * dq_accum_chunk(row, col0 + 16 * p)) * 4;
#pragma unroll
        for (int p = 0; p < kNT / 2; ++p) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {  // rows g, g + 8
                const unsigned addr = at[p % 2] + (16 * (p - p % 2) + 8 * half * Cfg::kHeadDim) * 4;
                float x = acc[2 * p][2 * half], y = acc[2 * p][2 * half + 1], z = acc[2 * p + 1][2 * half],
                      w = acc[2 * p + 1][2 * half + 1];
                if constexpr (kAdd) {
                    const uint4 o = ld_shared_b128(addr);
                    x += __uint_as_float(o.x), y += __uint_as_float(o.y), z += __uint_as_float(o.z),
                        w += __uint_as_float(o.w);
                }
                st_shared_f32x4(addr, x, y, z, w);
            }
        }
    }
};

}  // namespace cuflash
