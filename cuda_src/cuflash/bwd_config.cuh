// The tensor-core backward's compile-time shapes (one config per kernel family, from the kernel's template
// arguments: cuflash/kernels/backward.py renders the same fields), its shared-memory layouts, the warp
// roles, and the few scalar helpers every backward part uses.
//
// Shared-memory layouts: cuflash/kernels/backward.py (dkdv_smem_bytes, dq_smem_bytes) states the same
// sizes as formulas; the build passes them as CUFLASH_EXPECTED_SMEM_BYTES and each kernel checks its
// config's kSmemBytes against it with CUFLASH_CHECK_SMEM_BYTES, so a drifted formula fails the compile.
#pragma once

#include "cuflash/params.cuh"
#include "cuflash/mma_sm80.cuh"
#include "cuflash/numeric.cuh"
#include "cuflash/tile.cuh"
#include "cuflash/mask.cuh"
#include "cuflash/block.cuh"
#include "cuflash/score_mod.cuh"
#include "cuflash/dropout.cuh"

namespace cuflash {

// The most query rows a dK/dV block adds into dq_accum at once (its kBlockM): the pre-pass zeroes each
// sequence's rows up to a multiple of this, and the plan leaves this many rows of slack after the buffer
// (cuflash/kernels/backward.py: DQ_ACCUM_BLOCK_ROWS).
constexpr int kDqAccumBlockRows = 128;

// The dK/dV grid's order in chunks of heads. The grid is (key blocks, head groups, batch) and the hardware hands
// CTAs out in linear order. This remaps the linear index so that, in chunks of `chunk` (head group, batch) pairs,
// key block n of every pair in the chunk comes before key block n + 1 of any: a chunk holds about 16 MB of Q and
// dO (its heads' shared L2 working set). Three uses on the warp-specialized dK/dV kernel:
//   - causal (atomic dQ): key block n walks about (1 - n / key blocks) of the query blocks, so with n fastest
//     each head's longest CTA is dispatched right after the previous head's shortest, and the last head's longest
//     one starts when the others are nearly done (ncu, H200: D128 S4k causal 1278 us against 1199 for its share
//     of the unmasked kernel's steps; a list-scheduling model of the grid: 6.5% over the ideal makespan). Here
//     key blocks go longest first across the chunk's heads: the model's makespan within 0.3-1.5% of ideal at
//     S1k-S16k.
//   - the general masks (atomic dQ): walks follow the mask (a causal window's last key blocks walk fewer query
//     blocks, documents' walks vary along the row); each head's long walks spread over the grid as under causal
//     (H200, session 54, the features bench's cases: documents 388.8 -> 380.5 us, block-causal 512 1396 -> 1349;
//     the window, whose walks are nearly equal, 656.6 -> 660.1).
//   - no mask, ordered dQ adds (dq_order.cuh): key block n adds into each query block right after key block
//     n - 1, every CTA walking the query blocks in one order. With n fastest a head's key blocks start together
//     and each one's adds queue behind the previous one's, a chain as long as the key blocks (H200, session 26:
//     deterministic / default forward+backward 0.87x at D64 S1k). Here key block n starts a chunk's width of
//     CTAs after key block n - 1 of its head, and it still waits only for CTAs dispatched before it.
// query_rows: the rows of Q / dO one (head group, batch) pair reads, Sq times its query heads.
template <int kHeadDim>
__device__ __forceinline__ void chunked_grid_order(int query_rows, int& n_block, int& group, int& b) {
    const int key_blocks = int(gridDim.x), groups = int(gridDim.y), pairs = groups * int(gridDim.z);
    const long long per_head = static_cast<long long>(query_rows) * kHeadDim * 4;  // Q and dO, 16-bit
    const int chunk = static_cast<int>(max(1ll, min(static_cast<long long>(pairs), (16ll << 20) / max(per_head, 1ll))));
    const int linear = int(blockIdx.x) + key_blocks * (int(blockIdx.y) + groups * int(blockIdx.z));
    const int first = linear / (key_blocks * chunk) * chunk;  // the chunk's first (group, batch) pair
    const int size = min(chunk, pairs - first);
    const int idx = linear - first * key_blocks;
    const int pair = first + idx % size;
    n_block = idx / size;
    group = pair % groups;
    b = pair / groups;
}

// dq_accum's order within a row where the warp-specialized dK/dV kernel stages dQ for its bulk adds
// (DkdvMainloopSm90Ws::kStagedDq; flash_bwd_convert_dq_kernel's kSwizzledDq reads it back). A row keeps its
// own kHeadDim floats, permuted in 16-byte chunks: chunk L = 4 * (col / 16) + (col % 8) / 2 holds columns
// 16c + 2t, +1, 16c + 8 + 2t, +1 (c = col / 16, t = (col % 8) / 2), which is what a thread of the mma C-fragment
// layout holds of one row across two adjacent n-tiles, so the staging stores its registers as they are, one
// 16-byte store per row and n-tile pair with no shuffle or select; and chunk L sits at L ^ (4 * (row % 2)), so
// the quarter-warp of a store (rows g, g + 1 of 128-byte multiples apart, t = 0..3) covers all 32 banks. The
// rows stay whole (the ordered adds add the sequence's rows only) and the tile-relative row's parity is the
// sequence-relative one (query blocks start at even rows).
__device__ __forceinline__ int dq_accum_chunk(int row, int col) {
    return (4 * (col / 16) + (col % 8) / 2) ^ (4 * (row & 1));
}

// lse (natural log) -> the log2-domain offset subtracted inside exp2. A row that sees no key has
// lse = -inf; +inf makes all its P exactly 0 (masked scores give -inf - inf = -inf: still 0).
__device__ __forceinline__ float lse_log2_offset(float lse) {
    return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

// p[0] += a, p[1] += b in global memory: one vector reduction on sm_90+, two scalar ones before.
__device__ __forceinline__ void atomic_add_pair(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

// Traps unless the launch gave at least kBytes of dynamic shared memory at a kAlign-byte aligned address
// (the cursors' XOR addressing relies on 128 bytes, wgmma's 128-byte swizzle on 1024).
template <int kBytes, unsigned kAlign>
__device__ __forceinline__ void check_bwd_smem(unsigned smem) {
    if (sm80::dynamic_smem_bytes() < static_cast<unsigned>(kBytes) || (smem & (kAlign - 1)) != 0) __trap();
}

// ---------------------------------------------------------------------------------------------------
// Warp layout of the atomic dQ step of the mma.sync dK/dV mainloop: dQ (kBlockM x kHeadDim) = dS
// (kBlockM x kBlockN) . K (kBlockN x kHeadDim) over warps_m x warps_d warps, each owning m_tiles 16-row
// tiles and n_tiles / 2 16-column groups, interleaved (m-tile i of warp wm is row tile i*warps_m + wm;
// group j of warp wd is columns (j*warps_d + wd)*16 ..) so every cursor offset composes by XOR. When
// warps_d does not divide the kHeadDim / 16 groups, the last round leaves some warps idle. Per 16-key step
// a warp loads m_tiles A and n_tiles / 2 B fragments: the cheapest split wins.
struct DqWarpLayout {
    int warps_m, m_tiles, warps_d, n_tiles;
};

__host__ __device__ constexpr DqWarpLayout choose_dq_layout(int block_m, int head_dim, int warps) {
    DqWarpLayout best{0, 0, 0, 0};
    int best_cost = 1 << 30;
    for (int wm = 1; wm <= warps; wm *= 2) {
        if (warps % wm != 0 || block_m % (16 * wm) != 0) continue;
        const int wd = warps / wm;
        const int mt = block_m / (16 * wm);
        const int pairs = (head_dim / 16 + wd - 1) / wd;
        const int cost = mt + pairs;
        if (cost <= best_cost) {  // ties: the later (fewer m_tiles) holds fewer A registers
            best_cost = cost;
            best = DqWarpLayout{wm, mt, wd, 2 * pairs};
        }
    }
    return best;
}

// ---------------------------------------------------------------------------------------------------
// dK/dV kernel: one CTA owns kBlockN keys (resident K, V) of one query head and streams the query blocks
// that see them (Q, dO, lse, D double-buffered). Warp w owns keys (w % kWarpsN)*16 .. +16; with
// kWarpsD = 2 the two warps of a key group (d_split = w / kWarpsN) take query halves of S^T and halves of
// the head-dim columns of dK / dV (which halves: the mainloop's dkdv_col0).
// kBiasInDs_: the bias of a step is staged in that step's dS tile (the warp-specialized mainloop's atomic
// path, whose shared memory has no room for tiles of its own), which is then laid out [query][key] (TileDs).
template <typename Elem_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kMask_, int kScoreMod_,
          bool kAtomicDq_, bool kBiasInDs_ = false>
struct DkdvConfig {
    using Elem = Elem_;
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
    static constexpr int kMask = kMask_;  // MaskKind
    static constexpr bool kAtomicDq = kAtomicDq_;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kWarpsN = kBlockN / 16;         // key groups of 16 rows
    static constexpr int kWarpsD = kNWarps / kWarpsN;    // warps sharing a key group (head-dim split)
    static constexpr int kMPerWarp = kBlockM / kWarpsD;  // queries of S^T per warp
    static constexpr int kDPerWarp = kHeadDim / kWarpsD;
    static constexpr int kMTiles = kMPerWarp / 8;        // n-tiles of the warp's S^T rows
    static constexpr int kDTiles = kDPerWarp / 8;        // n-tiles of the warp's dK / dV rows
    static_assert(sizeof(Elem) == 2, "the tensor-core backward takes fp16 or bf16");
    static_assert(kBlockN % 16 == 0 && kNWarps % kWarpsN == 0, "bad dK/dV warp layout");
    static_assert(kWarpsD == 1 || kWarpsD == 2, "the head dim is split over at most 2 warps");
    static_assert(kMPerWarp % 16 == 0 && kDPerWarp % 16 == 0, "bad dK/dV warp layout");
    // The smallest configurations (99 KB parts, head dim 256) keep P^T and dS^T in one buffer, at the
    // price of two more barriers per query block.
    static constexpr bool kShareP = kWarpsD > 1 && kBlockN <= 32;
    static constexpr bool kHasP = kWarpsD > 1 && !kShareP;
    static constexpr bool kHasDs = kWarpsD > 1 || kAtomicDq;

    using Mask = MaskOf<kMask>;
    using Dropout = DropoutOf<mask_has_dropout(kMask)>;
    using Blocks = QueryBlocksOf<kMask, kBlockM, kBlockN>;
    using ScoreMod = ScoreModOf<kScoreMod_, Elem>;
    static constexpr bool kBias = has_bias(kScoreMod_);
    using BiasTileT = BiasTile<Elem, kBlockM, kBlockN>;  // a streamed query block's bias ([query][key])
    static constexpr bool kBiasInDs = kBiasInDs_;
    static_assert(!kBiasInDs || (kBias && kAtomicDq && kWarpsD == 1), "the bias shares the atomic dQ step's dS tile");

    using TileK = PanelTile<kBlockN, kHeadDim>;  // K, V
    using TileQ = PanelTile<kBlockM, kHeadDim>;  // Q, dO
    using TileP = PanelTile<kBlockN, kBlockM>;   // P^T, dS^T ([key][query])
    // The dS tile of the atomic dQ step: dS^T, or with kBiasInDs dS ([query][key], the bias's order: the A
    // operand of dS . K read K-major) and the staged bias before it (BiasPanel).
    using TileDs = conditional_t<kBiasInDs, PanelTile<kBlockM, kBlockN>, TileP>;
    using BiasPanel = BiasPanelTile<Elem, kBlockM, kBlockN>;
    static_assert(TileDs::kBytes == TileP::kBytes, "both dS layouts take one tile's bytes");

    static constexpr int kOffK = 0;
    static constexpr int kOffV = kOffK + TileK::kBytes;
    static constexpr int kOffQ = kOffV + TileK::kBytes;       // 2 stages
    static constexpr int kOffDo = kOffQ + 2 * TileQ::kBytes;  // 2 stages
    static constexpr int kOffP = kOffDo + 2 * TileQ::kBytes;
    static constexpr int kOffDs = kOffP + (kHasP ? TileP::kBytes : 0);
    static constexpr int kOffLse = kOffDs + (kHasDs ? TileP::kBytes : 0);  // 2 stages of kBlockM floats
    static constexpr int kOffDsum = kOffLse + 2 * kBlockM * 4;             // 2 stages of kBlockM floats
    static constexpr int kOffBias = kOffDsum + 2 * kBlockM * 4;            // 2 stages of bias tiles (kBias)
    static constexpr int kSmemBytes = kOffBias + (kBias && !kBiasInDs ? 2 * BiasTileT::kBytes : 0);
    static constexpr int kOffPShared = kShareP ? kOffDs : kOffP;           // where P^T goes

    static_assert(kBlockM <= kDqAccumBlockRows, "dq_accum's zeroed rows and slack cover one query block");
    static constexpr DqWarpLayout kDq = choose_dq_layout(kBlockM, kHeadDim, kNWarps);
    static_assert(!kAtomicDq || kDq.warps_m > 0, "no warp layout for the dQ step");
};

// A dK/dV thread's role, derived from its index. The mainloop rebuilds it from an opaque copy of the
// thread index in every iteration and in the epilogue, so that only tid (not its dozen derived values)
// stays live across the loop. With kUniformWarp (the wgmma mainloop's Role) the warp index is read
// through a shuffle from lane 0: the compiler then knows it, and the key row, split and query column
// derived from it, to be the same in every lane and keeps them in uniform registers, where wgmma wants its
// shared-memory descriptors (ptxas 13.0, D128: 80 R2UR moves per step down to 1). The mma.sync mainloop
// keeps the plain index: the uniform one cost its register allocation 16-64 bytes of spill on sm_80.
template <typename Cfg, bool kUniformWarp = false>
struct DkdvRole {
    int lane, g, t, warp;
    int key_row0;  // the warp's keys within the block
    int d_split;   // the warp's query half of S^T / head-dim half of dK, dV
    int q_col0;    // the warp's first query (within the block) of S^T

    __device__ __forceinline__ explicit DkdvRole(int thread)
        : lane(thread % 32), g(lane >> 2), t(lane & 3),
          warp(kUniformWarp ? __shfl_sync(0xffffffffu, thread / 32, 0) : thread / 32),
          key_row0((warp % Cfg::kWarpsN) * 16),
          d_split(kUniformWarp && Cfg::kWarpsD == 1 ? 0 : warp / Cfg::kWarpsN), q_col0(d_split * Cfg::kMPerWarp) {}
};

// ---------------------------------------------------------------------------------------------------
// Deterministic dQ kernel: one CTA owns kBlockM queries (resident Q, dO) and streams the key blocks they
// see (K, V double-buffered). Warp w owns queries (w % kWarpsM)*16 .. +16; with kWarpsD = 2 the two warps
// of a query group (d_split = w / kWarpsM) take key halves of S and interleaved 16-column groups of dQ.
template <typename Elem_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kMask_, int kScoreMod_>
struct DqConfig {
    using Elem = Elem_;
    static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_;
    static constexpr int kMask = kMask_;  // MaskKind
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kWarpsM = kBlockM / 16;         // query groups of 16 rows
    static constexpr int kWarpsD = kNWarps / kWarpsM;    // warps sharing a query group (head-dim split)
    static constexpr int kNPerWarp = kBlockN / kWarpsD;  // keys of S per warp
    static constexpr int kDPerWarp = kHeadDim / kWarpsD;
    static constexpr int kNTiles = kNPerWarp / 8;        // n-tiles of the warp's S rows
    static constexpr int kDTiles = kDPerWarp / 8;        // n-tiles of the warp's dQ rows
    static_assert(sizeof(Elem) == 2, "the tensor-core backward takes fp16 or bf16");
    static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0 && kNWarps % kWarpsM == 0, "bad dQ warp layout");
    static_assert(kWarpsD == 1 || kWarpsD == 2, "the head dim is split over at most 2 warps");
    static_assert(kNPerWarp % 16 == 0 && kDPerWarp % 16 == 0, "bad dQ warp layout");

    using Mask = MaskOf<kMask>;
    using Dropout = DropoutOf<mask_has_dropout(kMask)>;
    using Blocks = KeyBlocksOf<kMask, kBlockM, kBlockN>;
    using ScoreMod = ScoreModOf<kScoreMod_, Elem>;

    using TileQ = PanelTile<kBlockM, kHeadDim>;  // Q, dO
    using TileK = PanelTile<kBlockN, kHeadDim>;  // K, V
    using TileS = PanelTile<kBlockM, kBlockN>;   // dS ([query][key]) when the head dim is split

    static constexpr int kOffQ = 0;
    static constexpr int kOffDo = kOffQ + TileQ::kBytes;
    static constexpr int kOffK = kOffDo + TileQ::kBytes;     // 2 stages
    static constexpr int kOffV = kOffK + 2 * TileK::kBytes;  // 2 stages
    static constexpr int kOffDs = kOffV + 2 * TileK::kBytes;
    static constexpr int kSmemBytes = kOffDs + (kWarpsD > 1 ? TileS::kBytes : 0);
};

}  // namespace cuflash
