// Tensor-core attention forward, FlashAttention-2 algorithm, for __half and __nv_bfloat16 on sm_80+,
// with a warpgroup (wgmma) mainloop for sm_90a.
//
// Idea. One CTA owns kBlockM query rows of one (batch, head); each of its kNWarps warps owns
// kBlockM / kNWarps consecutive rows (kMTiles m16 tiles) for the whole key loop. Per key block:
//   S = Q.K^T     tensor cores; Q stays in shared memory (registers go to the accumulators)
//   mask          only where a warp's tile crosses the causal diagonal or the end of the keys
//   softmax       online, in registers (softmax.cuh): one FFMA + EX2 per score; acc_o rescaled only
//                 when a row's maximum moved
//   O += P.V      P packed to Elem in registers: the C layout of S is the A layout of P
// and at the end O /= l, lse = m*scale + log(l), O staged through shared memory for 16-byte stores.
// Tile sizes per head-dim bucket and arch, and why, live in cuflash/kernels/forward_sm80.py.
// Three mainloops, chosen by the template argument kMainloop; all drive the same mask and softmax, which see
// only the mma C-fragment layout (cuda_src/README.md, "Accumulator contract").
//
// The mainloops live in cuflash/fwd_mainloop_sm80.cuh (mma.sync, narrow 32-column panels, cp.async
// kStages-deep K / V pipeline), cuflash/fwd_mainloop_sm90.cuh (wgmma, wide 128-byte-swizzled panels,
// 2-slot ring with the softmax of S_j under P.V_{j-1}, every thread loading) and
// cuflash/fwd_mainloop_sm90_ws.cuh (the same step in two consumer warpgroups that take turns on the tensor
// cores, fed by a producer warpgroup through mbarriers); each file states its pipeline. The kernel below is
// glue: block index -> sequence info (cuflash/seqlen.cuh) -> key blocks (cuflash/block.cuh) -> mainloop
// (for the warp-specialized one: barriers, then the producer's and the consumers' branches) -> epilogue
// (cuflash/epilogue_fwd.cuh).
//
// Checked without a GPU: all_variants(80) compiles for sm_80 and all_variants(90) (wgmma included) for
// sm_90a, spill-free, and ptxas reports no serialized wgmma. A CPU emulation of the warp collectives
// and of cp.async (with a shared-memory race detector) matched a float64 reference over tails,
// D < bucket, Dv != D, GQA, padded strides and zero / negative scales (mma.sync path); a replay of
// the address formulas found every tile covered exactly once and zero bank conflicts (both panel
// layouts; the cp.async writes of the wide one land exactly on the wgmma layout).
// Measured (H100, bf16, benchmarks/forward_mainloops.py, 2026-11-23 session 7 run 4), TFLOPS at S 4k non-causal:
// D64 mma.sync 335 / warp-specialized 402; D128 mma.sync 373 / 8-warp wgmma 493 / warp-specialized 636;
// D256 294 / 603 / 666 (cuDNN 475 / 616 / 695 in the same process). benchmarks/RESULTS.md has the grid.

#include "cuflash/params.cuh"
#include "cuflash/seqlen.cuh"
#include "cuflash/block.cuh"
#include "cuflash/softmax.cuh"
#include "cuflash/fwd_mainloop_sm80.cuh"
#include "cuflash/fwd_mainloop_sm90.cuh"
#include "cuflash/fwd_mainloop_sm90_ws.cuh"
#include "cuflash/epilogue_fwd.cuh"

namespace cuflash {

// The mainloop of a variant (cuflash/kernels/forward.py: MAINLOOP_*): mma.sync (sm_80 and later), wgmma
// with every thread loading and computing (sm_90a), or wgmma with a producer warpgroup and two consumer
// warpgroups taking turns (sm_90a).
enum FwdMainloopKind { kMainloopSm80 = 0, kMainloopSm90 = 1, kMainloopSm90Ws = 2 };

template <typename Cfg, int kMainloop>
using FwdMainloopOf = conditional_t<kMainloop == kMainloopSm90Ws, FwdMainloopSm90Ws<Cfg>,
                                    conditional_t<kMainloop == kMainloopSm90, FwdMainloopSm90<Cfg>, FwdMainloopSm80<Cfg>>>;

// Threads of a block: kNWarps compute warps, plus the producer warpgroup of the warp-specialized mainloop.
__host__ __device__ constexpr int fwd_threads(int mainloop, int n_warps) { return n_warps * 32 + (mainloop == kMainloopSm90Ws ? 128 : 0); }

// The warp-specialized kernel's body: the persistent tile loop of both roles (fwd_mainloop_sm90_ws.cuh).
// The per-tile steps are the kernel's below: sequence info, key blocks, mainloop, epilogue. (The two roles'
// loop headers repeat each other: folded into one visitor function, ptxas allocated the measured kernel's
// registers differently, ~1000 SASS lines changed at D128; left as measured until a GPU run can check it.)
template <typename Cfg, typename Mainloop, typename Epilogue>
__device__ __forceinline__ void flash_fwd_ws(const AttnParams& params, const TmaParams& tma, unsigned smem_q) {
    constexpr int kMask = Cfg::kMask, kBlockM = Cfg::kBlockM;
    const FwdTiles<kMask == kCausalMask> tiles(params, kBlockM);
    Mainloop::init_barriers(params, smem_q);
    __syncthreads();
    FwdWsRing ring;
    if (threadIdx.x < Mainloop::kProducerThreads) {
        sm90::setmaxnreg_dec<Mainloop::kProducerRegisters>();
        if (int(threadIdx.x) >= Mainloop::producer_threads(params)) return;  // one warp produces (all by TMA)
        FwdUnitWalk<Mainloop> walk(smem_q);
        for (int u = walk.template producer_first<kBlockM>(params, tiles, ring); u < tiles.units;
             u = walk.template producer_next<kBlockM>(params, tiles, ring, u))
        for (int second = 0; second < tiles.tiles_in(u); ++second) {
            int m_block, h, b;
            tiles.at(u, second, kMask != kNoMask, m_block, h, b);
            const SeqInfo seq(params, b, h, LayoutOf<kMask>());
            const int row_begin = m_block * kBlockM;
            if (row_begin >= seq.seqlen_q) {
                Mainloop::pass_q_producer(smem_q, ring);
                continue;
            }
            const typename Cfg::Mask mask(params, seq);
            const typename Cfg::Blocks blocks(mask, m_block);
            if (blocks.empty()) {  // the consumers store it
                Mainloop::pass_q_producer(smem_q, ring);
                continue;
            }
            const Mainloop mainloop(params, seq, blocks, mask, smem_q, row_begin, 0);
            mainloop.produce(params, tma, seq, ring);
        }
        Mainloop::flush(ring);
    } else {
        sm90::setmaxnreg_inc<Mainloop::kConsumerRegisters>();
        const int tid = threadIdx.x - Mainloop::kProducerThreads;
        const int warp_row0 = tid / 32 * Cfg::kWarpRows;
        // The same, warp-uniform (read from lane 0) for the mainloop: its wgmma descriptors of the warpgroup's Q
        // rows then stay in uniform registers (H200, session 47: D64 +4-7%, D128 and D256 within 1%). Not with a
        // bias, whose variants spilled more with it (nvcc 13.0: D128 general mask + bias 84 -> 164 bytes; not timed).
        const int uniform_row0 = Cfg::kBias ? warp_row0 : __shfl_sync(0xffffffffu, tid / 32, 0) * Cfg::kWarpRows;
        Mainloop::start_turns(warp_row0);
        FwdUnitWalk<Mainloop> walk(smem_q);
        for (int u = walk.consumer_first(tiles, ring); u < tiles.units; u = walk.consumer_next(tiles, ring, u))
        for (int second = 0; second < tiles.tiles_in(u); ++second) {
            int m_block, h, b;
            tiles.at(u, second, kMask != kNoMask, m_block, h, b);
            const SeqInfo seq(params, b, h, LayoutOf<kMask>());
            const int row_begin = m_block * kBlockM;
            if (row_begin >= seq.seqlen_q) {
                Mainloop::pass_q_consumer(smem_q, ring);
                continue;
            }
            const typename Cfg::Mask mask(params, seq);
            const typename Cfg::Blocks blocks(mask, m_block);
            if (blocks.empty()) {  // no row of this block sees any key
                Epilogue::template store_empty<kBlockM, Mainloop::kConsumerThreads>(params, seq, row_begin, tid);
                Mainloop::pass_q_consumer(smem_q, ring);
                continue;
            }
            float acc_o[Cfg::kMTiles][Cfg::kDTiles][4];
            clear(acc_o);
            OnlineSoftmax<Cfg::kMTiles> softmax;
            const Mainloop mainloop(params, seq, blocks, mask, smem_q, row_begin, uniform_row0);
            mainloop.run(params, seq, acc_o, softmax, ring);
            float lse[Cfg::kMTiles][2];
            softmax.finalize(acc_o, Cfg::ScoreMod::kScaled ? 1.f : fabsf(params.scale), lse);
            if constexpr (Cfg::Dropout::kEnabled) scale_tile(acc_o, Cfg::Dropout::rp(params));  // kept p / (1 - dropout_p)
            Epilogue::store(params, seq, acc_o, lse, row_begin, warp_row0, mainloop.smem_o());
            mainloop.release_q();
        }
        Mainloop::end_turns(warp_row0);
    }
}

// kMask: a MaskKind (mask.cuh); kScoreMod: a ScoreModKind, the softcap / ALiBi (/ bias) modifier (score_mod.cuh) instead of none.
// kMainloop: a FwdMainloopKind. tma: the tensor maps the warp-specialized mainloop's TMA loads read where they lie,
// in parameter space (__grid_constant__; cuflash/tma_sm90.cuh). The block-per-SM minimum of 1 gives the warp-specialized kernel the register cap
// at entry that setmaxnreg needs (168 for 384 threads); the others keep none (0): with 1, ptxas allocated
// differently and spilled in the 8-warp wgmma kernel with a bool mask and softcap.
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, int kMask, int kScoreMod,
          int kMainloop>
__global__ void __launch_bounds__(fwd_threads(kMainloop, kNWarps), kMainloop == kMainloopSm90Ws ? 1 : 0)
    flash_fwd_kernel(const AttnParams params, const __grid_constant__ TmaParams tma) {
    using Cfg = FwdConfig<Elem, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, kMask, kScoreMod>;
    using Mainloop = FwdMainloopOf<Cfg, kMainloop>;
    constexpr int kThreads = fwd_threads(kMainloop, kNWarps);
    using Epilogue = FwdEpilogue<Elem, typename Mainloop::QTile, kThreads>;
    CUFLASH_CHECK_SMEM_BYTES(Mainloop::kSmemBytes);

    // 1024-byte alignment (the mma.sync path needs 128): wgmma's 128-byte swizzle is anchored at
    // 1024-byte boundaries, so the wgmma mainloops check it.
    extern __shared__ __align__(1024) unsigned char smem[];
    const unsigned smem_q = sm80::smem_addr(smem);
    Mainloop::check_smem(smem_q);

    if constexpr (kMainloop == kMainloopSm90Ws) {
        flash_fwd_ws<Cfg, Mainloop, Epilogue>(params, tma, smem_q);
    } else {
        const int m_block = kMask != kNoMask ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // masks: longest first
        const SeqInfo seq(params, blockIdx.z, blockIdx.y, LayoutOf<kMask>());
        const int row_begin = m_block * kBlockM;
        if (row_begin >= seq.seqlen_q) return;  // past a shorter packed sequence (the grid covers the longest)
        const int warp_row0 = threadIdx.x / 32 * Cfg::kWarpRows;  // this warp's first row within the block

        const typename Cfg::Mask mask(params, seq);
        const typename Cfg::Blocks blocks(mask, m_block);
        if (blocks.empty()) {  // no row of this block sees any key
            Epilogue::template store_empty<kBlockM>(params, seq, row_begin);
            return;
        }

        float acc_o[Cfg::kMTiles][Cfg::kDTiles][4];
        clear(acc_o);
        OnlineSoftmax<Cfg::kMTiles> softmax;
        Mainloop mainloop(params, seq, blocks, mask, smem_q, row_begin, warp_row0);
        mainloop.run(params, seq, acc_o, softmax);

        float lse[Cfg::kMTiles][2];
        softmax.finalize(acc_o, Cfg::ScoreMod::kScaled ? 1.f : fabsf(params.scale), lse);
        if constexpr (Cfg::Dropout::kEnabled) scale_tile(acc_o, Cfg::Dropout::rp(params));  // kept p / (1 - dropout_p)
        Epilogue::store(params, seq, acc_o, lse, row_begin, warp_row0, smem_q);
    }
}

}  // namespace cuflash
