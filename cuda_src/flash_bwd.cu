// Tensor-core backward of attention (FlashAttention-2 algorithm), fp16 / bf16, sm_80 and later.
//
// With S = Q.K^T (raw scores), P = exp(scale*S - lse) and D_i = sum_d dO_id*O_id - dlse_i:
//   dV = P^T.dO     dP = dO.V^T     dS = P o (dP - D)     dK = scale * dS^T.Q     dQ = scale * dS.K
// (the -dlse folded into D is the gradient that reaches S through lse: d lse_i / d s_ij = P_ij).
//
// Kernels, in launch order (cuflash/kernels/backward_sm80.py plans them):
//   flash_bwd_preprocess_kernel   softmax_d = rowsum(dO o O) - dlse; zeroes dq_accum on the atomic path.
//   flash_bwd_dkdv_kernel         one block per (key block, QUERY head, batch), so MQA still fills the
//                                 GPU; K_j, V_j stay in shared memory while the block walks every query
//                                 block that sees them. With kAtomicDq it also adds dS.K to dq_accum.
//   flash_bwd_dq_kernel           deterministic dQ: one block per query block, walks its key blocks.
//   flash_bwd_convert_dq_kernel   dq = scale * dq_accum (atomic path).
//   flash_bwd_reduce_dkdv_kernel  GQA: sums the per-query-head dK/dV partials of a group, fixed order.
//
// The dK/dV kernel computes the TRANSPOSED scores S^T = K.Q^T. A warp then owns 16 keys x the block's
// queries in the mma C layout, which is exactly the A-operand layout of dV += P^T.dO and dK += dS^T.Q:
// up to head dim 128, P and dS never go through shared memory for dK/dV, and the per-key accumulators
// stay in registers for the whole kernel. lse and D are per query, i.e. per column of S^T; each thread
// reads the columns it owns from two small shared vectors. dS goes through shared memory only for dS.K
// (atomic dQ), read back transposed by ldmatrix.trans.
// Above head dim 128 one warp cannot hold 16 keys x kHeadDim of both dK and dV, so two warps share a key
// group and split the head dim (kWarpsD = 2); they split the queries of S^T between them and exchange
// P^T and dS^T through shared memory (one barrier per query block).
// The dQ kernel is the mirror image: a warp owns 16 queries, S = Q.K^T, and dS (in registers, or shared
// memory when the head dim is split) is the A operand of dQ += dS.K.
//
// Shared-memory tiles are rows of 16-byte chunks, XOR-swizzled per row (SwizzledTile) so that cp.async
// writes, ldmatrix / ldmatrix.trans reads and 4-byte C-fragment stores are bank-conflict free. The
// streamed operand (Q/dO in the dK/dV kernel, K/V in the dQ kernel) is double-buffered: the next block's
// cp.async is issued right after the barrier that opens the current one and overlaps a whole iteration.
//
// On sm_90a the dK/dV kernel of head dims 64, 128 and 256 runs its GEMMs on wgmma (template argument
// kWgmma; see the kernel's comment): same warp roles, same shared-memory layout, same epilogue. The dQ
// kernel (deterministic mode) and the other head dims stay on mma.sync.
//
// Registers: dK + dV + S^T + dP^T fill ~192 of the 255 registers at head dim 128, so the per-lane
// ldmatrix addresses are rebuilt every iteration from an opaque lane index (SmemCursor: one XOR and an
// immediate offset per ldmatrix) instead of being hoisted out of the loop and spilled.
//
// Numerics: fp32 accumulation everywhere; the exp is one FFMA + ex2. A row with lse = -inf (it sees no
// key) gets P = 0 exactly (its lse is replaced by +inf). Rows / columns past Sq, Sk, D, Dv are
// zero-filled on load, masked before the exp, and never stored, so no NaN or garbage reaches a gradient.
// Global tensors need 16-byte aligned rows (base and strides multiples of 8 elements), as for the forward.

#include "cuflash/params.cuh"
#include "cuflash/mma_sm80.cuh"
#include "cuflash/numeric.cuh"
#include "cuflash/tile.cuh"
#include "cuflash/gemm_sm80.cuh"
#include "cuflash/mask.cuh"
#include "cuflash/wgmma_sm90.cuh"

namespace cuflash {
namespace bwd_sm80 {

// ---------------------------------------------------------------------------------------------------
// PTX helpers used only by this file.

// p[0] += a, p[1] += b in global memory: one vector reduction on sm_90+, two scalar ones before.
__device__ __forceinline__ void atomic_add_pair(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

// Returns x unchanged, but the compiler can no longer see where it came from, so nothing derived from
// it is hoisted out of the loop that calls this (see "Registers" above).
__device__ __forceinline__ int opaque(int x) {
    asm volatile("" : "+r"(x));
    return x;
}

// lse (natural log) -> the log2-domain offset subtracted inside exp2. A row that sees no key has
// lse = -inf; +inf makes all its P exactly 0 (masked scores give -inf - inf = -inf: still 0).
__device__ __forceinline__ float lse_log2_offset(float lse) {
    return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

// ---------------------------------------------------------------------------------------------------
// Warp layout of the atomic dQ step in the dK/dV kernel: dQ (kBlockM x kHeadDim) = dS (kBlockM x kBlockN)
// . K (kBlockN x kHeadDim) over warps_m x warps_d warps, each owning m_tiles 16-row tiles and n_tiles / 2
// 16-column groups, interleaved (m-tile i of warp wm is row tile i*warps_m + wm; group j of warp wd is
// columns (j*warps_d + wd)*16 ..) so every cursor offset composes by XOR. When warps_d does not divide
// the kHeadDim / 16 groups, the last round leaves some warps idle. Per 16-key step a warp loads m_tiles A
// and n_tiles / 2 B fragments: the cheapest split wins.
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
        if (cost <= best_cost) {   // ties: the later (fewer m_tiles) holds fewer A registers
            best_cost = cost;
            best = DqWarpLayout{wm, mt, wd, 2 * pairs};
        }
    }
    return best;
}

// Layout of the dK/dV kernel; cuflash/kernels/backward_sm80.py (dkdv_smem_bytes) mirrors kSmemBytes.
template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kAtomicDq>
struct DkdvTraits {
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kWarpsN = kBlockN / 16;        // key groups of 16 rows
    static constexpr int kWarpsD = kNWarps / kWarpsN;   // warps sharing a key group (head-dim split)
    static constexpr int kMPerWarp = kBlockM / kWarpsD; // queries of S^T per warp
    static constexpr int kDPerWarp = kHeadDim / kWarpsD;
    static_assert(kBlockN % 16 == 0 && kNWarps % kWarpsN == 0, "bad dK/dV warp layout");
    static_assert(kWarpsD == 1 || kWarpsD == 2, "the head dim is split over at most 2 warps");
    static_assert(kMPerWarp % 16 == 0 && kDPerWarp % 16 == 0, "bad dK/dV warp layout");
    // The smallest configurations (99 KB parts, head dim 256) keep P^T and dS^T in one buffer, at the
    // price of two more barriers per query block.
    static constexpr bool kShareP = kWarpsD > 1 && kBlockN <= 32;
    static constexpr bool kHasP = kWarpsD > 1 && !kShareP;
    static constexpr bool kHasDs = kWarpsD > 1 || kAtomicDq;

    using TileK = PanelTile<kBlockN, kHeadDim>;   // K, V
    using TileQ = PanelTile<kBlockM, kHeadDim>;   // Q, dO
    using TileP = PanelTile<kBlockN, kBlockM>;    // P^T, dS^T ([key][query])

    static constexpr int kOffK = 0;
    static constexpr int kOffV = kOffK + TileK::kBytes;
    static constexpr int kOffQ = kOffV + TileK::kBytes;        // 2 stages
    static constexpr int kOffDo = kOffQ + 2 * TileQ::kBytes;   // 2 stages
    static constexpr int kOffP = kOffDo + 2 * TileQ::kBytes;
    static constexpr int kOffDs = kOffP + (kHasP ? TileP::kBytes : 0);
    static constexpr int kOffLse = kOffDs + (kHasDs ? TileP::kBytes : 0);  // 2 stages of kBlockM floats
    static constexpr int kOffDsum = kOffLse + 2 * kBlockM * 4;             // 2 stages of kBlockM floats
    static constexpr int kSmemBytes = kOffDsum + 2 * kBlockM * 4;

    static constexpr DqWarpLayout kDq = choose_dq_layout(kBlockM, kHeadDim, kNWarps);
    static_assert(!kAtomicDq || kDq.warps_m > 0, "no warp layout for the dQ step");
};

// Layout of the dQ kernel; cuflash/kernels/backward_sm80.py (dq_smem_bytes) mirrors kSmemBytes.
template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps>
struct DqTraits {
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kWarpsM = kBlockM / 16;        // query groups of 16 rows
    static constexpr int kWarpsD = kNWarps / kWarpsM;   // warps sharing a query group (head-dim split)
    static constexpr int kNPerWarp = kBlockN / kWarpsD; // keys of S per warp
    static constexpr int kDPerWarp = kHeadDim / kWarpsD;
    static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0 && kNWarps % kWarpsM == 0, "bad dQ warp layout");
    static_assert(kWarpsD == 1 || kWarpsD == 2, "the head dim is split over at most 2 warps");
    static_assert(kNPerWarp % 16 == 0 && kDPerWarp % 16 == 0, "bad dQ warp layout");

    using TileQ = PanelTile<kBlockM, kHeadDim>;   // Q, dO
    using TileK = PanelTile<kBlockN, kHeadDim>;   // K, V
    using TileS = PanelTile<kBlockM, kBlockN>;    // dS ([query][key]) when the head dim is split

    static constexpr int kOffQ = 0;
    static constexpr int kOffDo = kOffQ + TileQ::kBytes;
    static constexpr int kOffK = kOffDo + TileQ::kBytes;      // 2 stages
    static constexpr int kOffV = kOffK + 2 * TileK::kBytes;   // 2 stages
    static constexpr int kOffDs = kOffV + 2 * TileK::kBytes;
    static constexpr int kSmemBytes = kOffDs + (kWarpsD > 1 ? TileS::kBytes : 0);
};

// The atomic dQ step of the dK/dV kernel, for n-tile pairs [kPair0, kPair0 + kPairs) of the warp:
// dq_rows[0 .. rows_valid, :] += dS . K, with dS the block's [key][query] tile read with .trans. Warp
// (wm, wd) owns query tiles mt*warps_m + wm and 16-column groups np*warps_d + wd, so every cursor
// offset composes by XOR (see SmemCursor). Columns >= head_dim (zero-filled K) are skipped.
template <typename Elem, int kBlockN, typename TileP, typename TileK, int kWarpsM, int kMTiles, int kWarpsD,
          int kPairs, int kPair0, typename Role>
__device__ __forceinline__ void dq_step(const Role& r, unsigned s_ds, unsigned s_k, float* dq_rows,
                                        int row_stride, int rows_valid, int head_dim) {
    const int wm = r.warp % kWarpsM, wd = r.warp / kWarpsM;
    const SmemCursor<TileP> ds_cols = cursor_b<TileP>(s_ds, 0, 2 * wm, r.lane);
    const SmemCursor<TileK> k_cols = cursor_a<TileK>(s_k, 0, 2 * wd, r.lane);
    float acc[kMTiles][2 * kPairs][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) clear(acc[mt]);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
        unsigned a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
            sm80::ldmatrix_x4_trans(a[mt], ds_cols.at(16 * kk, 2 * kWarpsM * mt));
        }
#pragma unroll
        for (int np = 0; np < kPairs; ++np) {
            if ((kPair0 + np) * kWarpsD + wd >= TileK::kCols / 16) continue;   // idle in the last round
            unsigned b[4];
            sm80::ldmatrix_x4_trans(b, k_cols.at(16 * kk, 2 * kWarpsD * (kPair0 + np)));
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) mma_pair<Elem>(acc[mt][2 * np], acc[mt][2 * np + 1], a[mt], b);
        }
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
        const int r_lo = (mt * kWarpsM + wm) * 16 + r.g;
#pragma unroll
        for (int nt = 0; nt < 2 * kPairs; ++nt) {
            const int c0 = ((kPair0 + nt / 2) * kWarpsD + wd) * 16 + (nt & 1) * 8;
            if (c0 >= head_dim) continue;
            const int col = c0 + 2 * r.t;
            if (r_lo < rows_valid) atomic_add_pair(dq_rows + r_lo * row_stride + col, acc[mt][nt][0], acc[mt][nt][1]);
            if (r_lo + 8 < rows_valid) {
                atomic_add_pair(dq_rows + (r_lo + 8) * row_stride + col, acc[mt][nt][2], acc[mt][nt][3]);
            }
        }
    }
}

// The atomic dQ step on warpgroups: dq_rows[0 .. rows_valid, :] += dS . K for the block's kBlockM queries,
// with dS read MN-major (transposed) from the [key][query] tile and K MN-major. The kNWarps / 4
// warpgroups split the work three ways, in this order of preference:
//   by queries  when there is one 64-query panel per warpgroup (each sums over all keys, all columns);
//   by columns  when there is one query panel and the head dim has whole 64-column panels per warpgroup;
//   by keys     otherwise (head dim 64): each warpgroup sums over its share of the keys, and both add
//               into the same dq_accum elements.
// issue() starts the GEMM as one wgmma batch; add() waits for it (kLaterBatches = the batches issued
// after it that may stay in flight) and adds the result into dq_accum, so the atomics overlap those.
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps>
struct WgmmaDqStep {
    static constexpr int kGroups = kNWarps / 4;
    static constexpr int kQueryPanels = kBlockM / sm90::kPanelCols;
    static constexpr int kPanels = kHeadDim / sm90::kPanelCols;
    static constexpr bool kSplitQueries = kQueryPanels == kGroups;
    static constexpr bool kSplitColumns = !kSplitQueries && kPanels % kGroups == 0;
    static_assert(kSplitQueries || kQueryPanels == 1, "the dQ step takes one query panel or one per warpgroup");
    static constexpr int kCols = kSplitColumns ? kHeadDim / kGroups : kHeadDim;
    static constexpr int kKeys = kSplitQueries || kSplitColumns ? kBlockN : kBlockN / kGroups;
    static constexpr int kNTiles = kCols / 8;

    static __device__ __forceinline__ int query_panel(int warp) { return kSplitQueries ? warp / 4 : 0; }
    static __device__ __forceinline__ int panel0(int warp) { return kSplitColumns ? warp / 4 * (kPanels / kGroups) : 0; }

    static __device__ __forceinline__ void issue(float (&acc)[kNTiles][4], int warp, unsigned s_ds, unsigned s_k) {
        const int key_row0 = kSplitQueries || kSplitColumns ? 0 : warp / 4 * kKeys;
        sm90::gemm_atb<Elem, kKeys, kBlockN, kBlockN>(acc, s_ds, query_panel(warp), s_k, panel0(warp), key_row0, false);
    }

    template <int kLaterBatches, typename Role>
    static __device__ __forceinline__ void add(float (&acc)[kNTiles][4], const Role& r, float* dq_rows, int rows_valid,
                                               int head_dim) {
        sm90::wait<kLaterBatches>();
        sm90::fence_operand(acc);
        const int row_lo = query_panel(r.warp) * sm90::kPanelCols + (r.warp % 4) * 16 + r.g;
        const int col0 = panel0(r.warp) * sm90::kPanelCols + 2 * r.t;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
            const int col = col0 + nt * 8;
            if (col >= head_dim) continue;
            if (row_lo < rows_valid) atomic_add_pair(dq_rows + row_lo * kHeadDim + col, acc[nt][0], acc[nt][1]);
            if (row_lo + 8 < rows_valid) {
                atomic_add_pair(dq_rows + (row_lo + 8) * kHeadDim + col, acc[nt][2], acc[nt][3]);
            }
        }
    }
};

// Traps unless the launch gave at least kBytes of dynamic shared memory at a kAlign-byte aligned address
// (the cursors' XOR addressing relies on 128 bytes, wgmma's 128-byte swizzle on 1024).
template <int kBytes, unsigned kAlign = 128>
__device__ __forceinline__ void check_smem(unsigned smem) {
    if (sm80::dynamic_smem_bytes() < static_cast<unsigned>(kBytes) || (smem & (kAlign - 1)) != 0) __trap();
}

}  // namespace bwd_sm80

extern __shared__ __align__(1024) unsigned char bwd_sm80_smem[];

// ---------------------------------------------------------------------------------------------------
// Pre-pass: softmax_d[b, h, i] = sum_{d < Dv} dO[b, i, h, d] * O[b, i, h, d] - dlse[b, h, i] (fp32), and
// dq_accum[b, h, i, :] = 0 when the atomic path is planned (scratch arrives uninitialized).
// Grid (ceil(Sq / kBlockM), H, B); 8 consecutive lanes per row, each summing 16-byte chunks c, c+8, ...
template <typename Elem, int kHeadDim, int kBlockM, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32)
flash_bwd_preprocess_kernel(const AttnParams params) {
    constexpr int kThreads = kNWarps * 32;
    constexpr int kThreadsPerRow = 8;
    constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
    constexpr int kChunks = kHeadDim / 8;
    static_assert(kBlockM % kRowsPerPass == 0 && kHeadDim % 32 == 0, "bad pre-pass tiling");

    const int m_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x;
    const int sub = tid % kThreadsPerRow;
    const Elem* o_ptr = static_cast<const Elem*>(params.o) + b * params.o_batch_stride + h * params.o_head_stride;
    const Elem* do_ptr =
        static_cast<const Elem*>(params.dout) + b * params.do_batch_stride + h * params.do_head_stride;
    const long long bh = static_cast<long long>(b) * params.num_heads + h;

#pragma unroll
    for (int pass = 0; pass < kBlockM / kRowsPerPass; ++pass) {
        const int row = m_block * kBlockM + pass * kRowsPerPass + tid / kThreadsPerRow;
        const bool row_ok = row < params.seqlen_q;
        float sum = 0.f;
        if (row_ok) {
#pragma unroll
            for (int c = sub; c < kChunks; c += kThreadsPerRow) {
                if (c * 8 < params.head_dim_v) {
                    const uint4 o4 = *reinterpret_cast<const uint4*>(o_ptr + row * params.o_row_stride + c * 8);
                    const uint4 d4 = *reinterpret_cast<const uint4*>(do_ptr + row * params.do_row_stride + c * 8);
                    const Elem* oe = reinterpret_cast<const Elem*>(&o4);
                    const Elem* de = reinterpret_cast<const Elem*>(&d4);
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        sum += ElemTraits<Elem>::to_float(oe[e]) * ElemTraits<Elem>::to_float(de[e]);
                    }
                }
            }
        }
        // The 8 threads of a row are consecutive lanes of one warp; every lane takes part.
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        if (row_ok) {
            if (sub == 0) {
                float dlse = 0.f;
                if (params.dlse != nullptr) {
                    dlse = params.dlse[b * params.dlse_batch_stride + h * params.dlse_head_stride + row];
                }
                params.softmax_d[bh * params.seqlen_q + row] = sum - dlse;
            }
            if (params.dq_accum != nullptr) {
                float4* dst = reinterpret_cast<float4*>(params.dq_accum + (bh * params.seqlen_q + row) * kHeadDim);
#pragma unroll
                for (int c = sub; c < kHeadDim / 4; c += kThreadsPerRow) dst[c] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// dK, dV (and, with kAtomicDq, dQ += dS.K into dq_accum) for key block blockIdx.x of query head blockIdx.y.
//
// Warp w owns keys key_group*16 .. +16 (key_group = w % kWarpsN). With kWarpsD = 2 the two warps of a key
// group (d_split = w / kWarpsN) take query halves of S^T and interleaved 16-column groups of dK / dV:
// the warp's n-tile pair j is head-dim columns (j*kWarpsD + d_split)*16 .. +16.
//
// kWgmma (sm_90a only) runs the five GEMMs on warpgroup tensor-core instructions instead of mma.sync: the
// warps keep exactly the roles above (warpgroup wg = warps 4wg .. 4wg+3 = keys 64wg .. +64, the 64 rows of
// its wgmma tiles), so the masking, the exp and dS are the same code. S^T / dP^T read K / V and Q / dO
// from shared memory (K-major), dV / dK take P^T / dS^T from registers and dO / Q MN-major, and the
// atomic dQ step reads dS^T and K MN-major. Each operand is read from shared memory once per warpgroup
// instead of once per warp, which is what bounds the mma.sync path (see the file header).
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal, bool kAtomicDq,
          bool kWgmma>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_bwd_dkdv_kernel(const AttnParams params) {
    using namespace bwd_sm80;
    using Traits = DkdvTraits<kHeadDim, kBlockM, kBlockN, kNWarps, kAtomicDq>;
    using TileK = typename Traits::TileK;
    using TileQ = typename Traits::TileQ;
    using TileP = typename Traits::TileP;
    constexpr int kThreads = Traits::kThreads;
    constexpr int kWarpsN = Traits::kWarpsN;
    constexpr int kWarpsD = Traits::kWarpsD;
    constexpr int kMPerWarp = Traits::kMPerWarp;
    constexpr int kMTiles = kMPerWarp / 8;              // n-tiles of the warp's S^T rows
    constexpr int kDTiles = Traits::kDPerWarp / 8;      // n-tiles of the warp's dK / dV rows
    using DqStep = WgmmaDqStep<Elem, kHeadDim, kBlockM, kBlockN, kNWarps>;
    // wgmma: warpgroups are whole groups of 16-key warps (kWarpsD = 1), or with kWarpsD = 2 warpgroup
    // d_split owns a contiguous half of the head-dim panels (instead of interleaved 16-column groups).
    static_assert(!kWgmma || (kNWarps % 4 == 0 && kHeadDim % 64 == 0 && kBlockM % 64 == 0 &&
                              (kWarpsD == 1 || (kWarpsN == 4 && (kHeadDim / 64) % 2 == 0 && !Traits::kShareP))),
                  "no warpgroup layout for this dK/dV tile");
    // Head-dim column of n-tile nt of the warp's dK / dV rows.
    auto dkdv_col0 = [](int nt, int d_split) {
        return kWgmma ? d_split * Traits::kDPerWarp + nt * 8 : ((nt / 2) * kWarpsD + d_split) * 16 + (nt & 1) * 8;
    };

    CUFLASH_CHECK_SMEM_BYTES(Traits::kSmemBytes);
    const unsigned smem = sm80::smem_addr(bwd_sm80_smem);
    check_smem<Traits::kSmemBytes, kWgmma ? 1024u : 128u>(smem);
    const unsigned s_k = smem + Traits::kOffK;
    const unsigned s_v = smem + Traits::kOffV;
    const unsigned s_p = smem + (Traits::kShareP ? Traits::kOffDs : Traits::kOffP);
    const unsigned s_ds = smem + Traits::kOffDs;

    const int n_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x;
    // A thread's role, derived from its index. Rebuilt from an opaque copy of tid in every iteration and in
    // the epilogue, so that only tid (not its dozen derived values) stays live across the loop.
    struct Role {
        int lane, g, t, warp;
        int key_row0;   // the warp's keys within the block
        int d_split;    // the warp's query half of S^T / head-dim group parity of dK, dV
        int q_col0;     // the warp's first query (within the block) of S^T
    };
    auto role_of = [](int thread) {
        const int lane = thread % 32, warp = thread / 32;
        const int d_split = warp / kWarpsN;
        return Role{lane, lane >> 2, lane & 3, warp, (warp % kWarpsN) * 16, d_split, d_split * kMPerWarp};
    };
    const int seqlen_q = params.seqlen_q, seqlen_k = params.seqlen_k;
    const int key0 = n_block * kBlockN;
    const long long bh = static_cast<long long>(b) * params.num_heads + h;

    const AttnMask<kIsCausal> mask{seqlen_q, seqlen_k, params.causal_offset};
    int m_begin, m_end;
    mask.template query_block_range<kBlockM, kBlockN>(n_block, m_begin, m_end);
    const int num_m_blocks = m_end - m_begin;

    float acc_dv[kDTiles][4];
    float acc_dk[kDTiles][4];
    clear(acc_dv);
    clear(acc_dk);

    // The query blocks are visited from m_first on, wrapping around at m_end. The atomic path starts at a
    // different block for each key block, so blocks running side by side add into different dq_accum
    // rows; the deterministic path goes in order.
    const int m_first = kAtomicDq && num_m_blocks > 0 ? m_begin + n_block % num_m_blocks : m_begin;

    // Q, dO, lse, softmax_d of query block m into pipeline stage `stage`. Inside the loop it is called
    // with opaque (b, h, tid): the pointers are rebuilt from the constant-bank params on each call
    // instead of holding registers across the loop.
    auto load_query_block = [&](int m, int stage, int bb, int hh, int tt) {
        const int q0 = m * kBlockM;
        const int rows = seqlen_q - q0;
        const Elem* q_ptr = static_cast<const Elem*>(params.q) + bb * params.q_batch_stride +
                            hh * params.q_head_stride + q0 * params.q_row_stride;
        const Elem* do_ptr = static_cast<const Elem*>(params.dout) + bb * params.do_batch_stride +
                             hh * params.do_head_stride + q0 * params.do_row_stride;
        copy_tile_flat<TileQ, kThreads>(smem + Traits::kOffQ + stage * TileQ::kBytes, q_ptr, params.q_row_stride, rows,
                                   params.head_dim, tt);
        copy_tile_flat<TileQ, kThreads>(smem + Traits::kOffDo + stage * TileQ::kBytes, do_ptr, params.do_row_stride,
                                   rows, params.head_dim_v, tt);
        const float* lse_ptr = params.lse + bb * params.lse_batch_stride + hh * params.lse_head_stride + q0;
        const float* dsum_ptr =
            params.softmax_d + (static_cast<long long>(bb) * params.num_heads + hh) * seqlen_q + q0;
        for (int i = tt; i < kBlockM; i += kThreads) {
            const bool valid = i < rows;
            cp_async_4(smem + Traits::kOffLse + (stage * kBlockM + i) * 4, lse_ptr + (valid ? i : 0), valid);
            cp_async_4(smem + Traits::kOffDsum + (stage * kBlockM + i) * 4, dsum_ptr + (valid ? i : 0), valid);
        }
    };

    if (num_m_blocks > 0) {
        const int hk = h / params.h_per_kv;
        const Elem* k_ptr = static_cast<const Elem*>(params.k) + b * params.k_batch_stride +
                            hk * params.k_head_stride + key0 * params.k_row_stride;
        const Elem* v_ptr = static_cast<const Elem*>(params.v) + b * params.v_batch_stride +
                            hk * params.v_head_stride + key0 * params.v_row_stride;
        copy_tile_flat<TileK, kThreads>(s_k, k_ptr, params.k_row_stride, seqlen_k - key0, params.head_dim, tid);
        copy_tile_flat<TileK, kThreads>(s_v, v_ptr, params.v_row_stride, seqlen_k - key0, params.head_dim_v, tid);
        load_query_block(m_first, 0, b, h, tid);
        sm80::cp_async_commit();
    }

    int m_block = m_first;
    for (int step = 0; step < num_m_blocks; ++step) {
        const int stage = step & 1;
        const int query0 = m_block * kBlockM;
        m_block = m_block + 1 == m_end ? m_begin : m_block + 1;   // the next block
        const unsigned s_q = smem + Traits::kOffQ + stage * TileQ::kBytes;
        const unsigned s_do = smem + Traits::kOffDo + stage * TileQ::kBytes;

        // This block's tiles have landed, and every warp is done with step - 1 (so the other stage and the
        // P / dS tiles may be overwritten). wgmma reads them through the async proxy: fence first.
        sm80::cp_async_wait<0>();
        if constexpr (kWgmma) sm90::fence_proxy_async();
        __syncthreads();
        if (step + 1 < num_m_blocks) {
            load_query_block(m_block, stage ^ 1, opaque(b), opaque(h), opaque(tid));
            sm80::cp_async_commit();
        }
        const Role r = role_of(opaque(tid));
        const int lane = r.lane, g = r.g, t = r.t, key_row0 = r.key_row0, d_split = r.d_split, q_col0 = r.q_col0;

        // S^T = K . Q^T for the warp's 16 keys x kMPerWarp queries (and dP^T = V . dO^T, below). wgmma
        // issues both at once and overlaps dP^T with the exp.
        float acc_s[kMTiles][4];
        float acc_dp[kMTiles][4];
        if constexpr (kWgmma) {
            const int wg_key0 = key_row0 & ~63;
            sm90::gemm_abt<Elem, kHeadDim, kBlockN, kBlockM>(acc_s, s_k, wg_key0, s_q, q_col0, false);
            sm90::gemm_abt<Elem, kHeadDim, kBlockN, kBlockM>(acc_dp, s_v, wg_key0, s_do, q_col0, false);
            sm90::fence_operand(acc_dp);
            sm90::wait<1>();
            sm90::fence_operand(acc_s);
        } else {
            clear(acc_s);
            gemm_abt<Elem, kHeadDim, kMTiles>(acc_s, cursor_a<TileK>(s_k, key_row0, 0, lane),
                                              cursor_b<TileQ>(s_q, q_col0, 0, lane));
        }

        // P^T = exp(scale * S^T - lse): 0 where masked, past Sk, past Sq, or where lse = -inf.
        // Transposed C layout: row = key, column = query.
        if (mask.needs_mask(query0, kBlockM, key0, kBlockN) || query0 + kBlockM > seqlen_q) {
            const int key_lo = key0 + key_row0 + g;
            const int query_base = query0 + q_col0 + 2 * t;
#pragma unroll
            for (int nt = 0; nt < kMTiles; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = key_lo + (e >= 2 ? 8 : 0);
                    const int query = query_base + nt * 8 + (e & 1);
                    const bool visible = (query < seqlen_q) & mask.visible(query, key);
                    acc_s[nt][e] = visible ? acc_s[nt][e] : -INFINITY;
                }
            }
        }
        // lse and D are per query (column): each pair is read where it is used, so neither holds
        // registers across a GEMM.
        const unsigned s_lse = smem + Traits::kOffLse + (stage * kBlockM + q_col0 + 2 * t) * 4;
        const unsigned s_dsum = smem + Traits::kOffDsum + (stage * kBlockM + q_col0 + 2 * t) * 4;
        const float scale_log2 = params.scale_log2;
#pragma unroll
        for (int nt = 0; nt < kMTiles; ++nt) {
            const float2 l = ld_shared_f32x2(s_lse + nt * 8 * 4);
            const float lse2[2] = {lse_log2_offset(l.x), lse_log2_offset(l.y)};
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[nt][e] = fast_exp2(acc_s[nt][e] * scale_log2 - lse2[e & 1]);
        }

        // dP^T = V . dO^T, then dS^T = P^T o (dP^T - D) in place.
        if constexpr (kWgmma) {
            sm90::wait<0>();
            sm90::fence_operand(acc_dp);
        } else {
            clear(acc_dp);
            gemm_abt<Elem, kHeadDim, kMTiles>(acc_dp, cursor_a<TileK>(s_v, key_row0, 0, lane),
                                              cursor_b<TileQ>(s_do, q_col0, 0, lane));
        }
#pragma unroll
        for (int nt = 0; nt < kMTiles; ++nt) {
            const float2 d = ld_shared_f32x2(s_dsum + nt * 8 * 4);
            acc_dp[nt][0] = acc_s[nt][0] * (acc_dp[nt][0] - d.x);
            acc_dp[nt][1] = acc_s[nt][1] * (acc_dp[nt][1] - d.y);
            acc_dp[nt][2] = acc_s[nt][2] * (acc_dp[nt][2] - d.x);
            acc_dp[nt][3] = acc_s[nt][3] * (acc_dp[nt][3] - d.y);
        }

        // dV += P^T . dO and dK += dS^T . Q over all kBlockM queries; B read with .trans at the warp's
        // head-dim columns (chunk 2*d_split, pairs 2*kWarpsD chunks apart).
        const SmemCursor<TileQ> do_cols = cursor_a<TileQ>(s_do, 0, 2 * d_split, lane);
        const SmemCursor<TileQ> q_cols = cursor_a<TileQ>(s_q, 0, 2 * d_split, lane);
        if constexpr (kWarpsD == 1) {
            // The warp holds P^T and dS^T for its keys and ALL queries of the block: packed, they are the
            // A fragments directly (and half the registers of the fp32 tiles).
            unsigned p_frag[kBlockM / 16][4], ds_frag[kBlockM / 16][4];
            pack_a<Elem>(p_frag, acc_s);
            pack_a<Elem>(ds_frag, acc_dp);
            if constexpr (kWgmma) {
                // dQ first (it needs every warp's dS^T), then dV / dK; the dQ atomics overlap dV / dK.
                float acc_dq[DqStep::kNTiles][4];
                if constexpr (kAtomicDq) {
                    store_a_tile<TileP>(s_ds, ds_frag, key_row0, lane);
                    sm90::fence_proxy_async();
                    __syncthreads();   // dS^T of every warp visible to the dQ step's wgmma
                    DqStep::issue(acc_dq, r.warp, s_ds, s_k);
                }
                sm90::fence_operand(acc_dv);
                sm90::fence_operand(acc_dk);
                sm90::gemm_rs<Elem, kBlockM / 16, kBlockM>(acc_dv, p_frag, s_do, 0, 0, true);
                sm90::gemm_rs<Elem, kBlockM / 16, kBlockM>(acc_dk, ds_frag, s_q, 0, 0, true);
                if constexpr (kAtomicDq) {
                    DqStep::template add<2>(acc_dq, r, params.dq_accum + (bh * seqlen_q + query0) * kHeadDim,
                                            seqlen_q - query0, params.head_dim);
                }
            } else {
                if constexpr (kAtomicDq) store_a_tile<TileP>(s_ds, ds_frag, key_row0, lane);
                gemm_ab<Elem, kBlockM / 16, kDTiles, 2 * kWarpsD>(
                    acc_dv, [&](int kk, unsigned (&a)[4]) { for (int i = 0; i < 4; ++i) a[i] = p_frag[kk][i]; },
                    do_cols);
                gemm_ab<Elem, kBlockM / 16, kDTiles, 2 * kWarpsD>(
                    acc_dk, [&](int kk, unsigned (&a)[4]) { for (int i = 0; i < 4; ++i) a[i] = ds_frag[kk][i]; },
                    q_cols);
                if constexpr (kAtomicDq) __syncthreads();   // dS^T of every warp visible to the dQ step
            }
        } else {
            // The warp holds its query half only: P^T and dS^T of the block go through shared memory.
            const SmemCursor<TileP> p_rows = cursor_a<TileP>(s_p, key_row0, 0, lane);
            const SmemCursor<TileP> ds_rows = cursor_a<TileP>(s_ds, key_row0, 0, lane);
            store_c_tile<Elem, TileP>(s_p, acc_s, key_row0, q_col0, lane);
            if constexpr (!Traits::kShareP) store_c_tile<Elem, TileP>(s_ds, acc_dp, key_row0, q_col0, lane);
            if constexpr (kWgmma) sm90::fence_proxy_async();
            __syncthreads();   // P^T (and dS^T) of both query halves visible
            if constexpr (kWgmma) {
                // Warpgroup d_split: dV, dK of all kBlockN keys x its half of the head-dim panels, after
                // dQ, whose atomics overlap them.
                constexpr int kHalfPanels = kHeadDim / sm90::kPanelCols / 2;
                float acc_dq[DqStep::kNTiles][4];
                if constexpr (kAtomicDq) DqStep::issue(acc_dq, r.warp, s_ds, s_k);
                sm90::fence_operand(acc_dv);
                sm90::fence_operand(acc_dk);
                sm90::gemm_ab<Elem, kBlockM, kBlockN, kBlockM>(acc_dv, s_p, 0, s_do, d_split * kHalfPanels, true);
                sm90::gemm_ab<Elem, kBlockM, kBlockN, kBlockM>(acc_dk, s_ds, 0, s_q, d_split * kHalfPanels, true);
                if constexpr (kAtomicDq) {
                    DqStep::template add<2>(acc_dq, r, params.dq_accum + (bh * seqlen_q + query0) * kHeadDim,
                                            seqlen_q - query0, params.head_dim);
                }
            } else {
                gemm_ab<Elem, kBlockM / 16, kDTiles, 2 * kWarpsD>(
                    acc_dv, [&](int kk, unsigned (&a)[4]) { sm80::ldmatrix_x4(a, p_rows.at(0, 2 * kk)); }, do_cols);
                if constexpr (Traits::kShareP) {
                    __syncthreads();   // every warp has read P^T: its buffer now takes dS^T
                    store_c_tile<Elem, TileP>(s_ds, acc_dp, key_row0, q_col0, lane);
                    __syncthreads();
                }
                gemm_ab<Elem, kBlockM / 16, kDTiles, 2 * kWarpsD>(
                    acc_dk, [&](int kk, unsigned (&a)[4]) { sm80::ldmatrix_x4(a, ds_rows.at(0, 2 * kk)); }, q_cols);
            }
        }

        if constexpr (kAtomicDq && !kWgmma) {
            // dq_accum[query0 + .., :] += dS . K (unscaled), in column parts of at most 32 accumulators.
            constexpr DqWarpLayout kL = Traits::kDq;
            constexpr int kParts = kL.m_tiles * kL.n_tiles * 4 > 32 && kL.n_tiles % 4 == 0 ? 2 : 1;
            static_assert(kL.n_tiles % (2 * kParts) == 0, "dQ step parts must hold whole n-tile pairs");
            dq_step<Elem, kBlockN, TileP, TileK, kL.warps_m, kL.m_tiles, kL.warps_d, kL.n_tiles / (2 * kParts), 0>(
                r, s_ds, s_k, params.dq_accum + (bh * seqlen_q + query0) * kHeadDim, kHeadDim, seqlen_q - query0,
                params.head_dim);
            if constexpr (kParts == 2) {
                dq_step<Elem, kBlockN, TileP, TileK, kL.warps_m, kL.m_tiles, kL.warps_d, kL.n_tiles / 4,
                        kL.n_tiles / 4>(
                    r, s_ds, s_k, params.dq_accum + (bh * seqlen_q + query0) * kHeadDim, kHeadDim,
                    seqlen_q - query0, params.head_dim);
            }
        }
        if constexpr (kWgmma) {
            // dV / dK (and dQ) wgmma done: the next barrier frees their shared-memory operands.
            sm90::wait<0>();
            sm90::fence_operand(acc_dv);
            sm90::fence_operand(acc_dk);
        }
    }

    // Epilogue (also when no query sees this key block: the gradients are then 0). Rows past Sk and
    // columns past D / Dv are never stored.
    const Role r = role_of(opaque(tid));
    const int t = r.t, d_split = r.d_split;
    const int hk = opaque(h) / params.h_per_kv;
    const int row_lo = key0 + r.key_row0 + r.g;
    const int row_hi = row_lo + 8;
    const float scale = params.scale;
    if (params.dk_accum == nullptr) {
        Elem* dk_ptr = static_cast<Elem*>(params.dk) + b * params.dk_batch_stride + hk * params.dk_head_stride;
        Elem* dv_ptr = static_cast<Elem*>(params.dv) + b * params.dv_batch_stride + hk * params.dv_head_stride;
#pragma unroll
        for (int nt = 0; nt < kDTiles; ++nt) {
            const int c0 = dkdv_col0(nt, d_split);
            const int col = c0 + 2 * t;
            if (c0 < params.head_dim) {
                if (row_lo < seqlen_k) {
                    *reinterpret_cast<unsigned*>(dk_ptr + row_lo * params.dk_row_stride + col) =
                        ElemTraits<Elem>::pack2(acc_dk[nt][0] * scale, acc_dk[nt][1] * scale);
                }
                if (row_hi < seqlen_k) {
                    *reinterpret_cast<unsigned*>(dk_ptr + row_hi * params.dk_row_stride + col) =
                        ElemTraits<Elem>::pack2(acc_dk[nt][2] * scale, acc_dk[nt][3] * scale);
                }
            }
            if (c0 < params.head_dim_v) {
                if (row_lo < seqlen_k) {
                    *reinterpret_cast<unsigned*>(dv_ptr + row_lo * params.dv_row_stride + col) =
                        ElemTraits<Elem>::pack2(acc_dv[nt][0], acc_dv[nt][1]);
                }
                if (row_hi < seqlen_k) {
                    *reinterpret_cast<unsigned*>(dv_ptr + row_hi * params.dv_row_stride + col) =
                        ElemTraits<Elem>::pack2(acc_dv[nt][2], acc_dv[nt][3]);
                }
            }
        }
    } else {
        // GQA: fp32 partials of this query head, (B, H, Sk, kHeadDim) contiguous; summed per group later.
        float* dk_part = params.dk_accum + bh * seqlen_k * kHeadDim;
        float* dv_part = params.dv_accum + bh * seqlen_k * kHeadDim;
#pragma unroll
        for (int nt = 0; nt < kDTiles; ++nt) {
            const int c0 = dkdv_col0(nt, d_split);
            const int col = c0 + 2 * t;
            if (c0 < params.head_dim) {
                if (row_lo < seqlen_k) {
                    *reinterpret_cast<float2*>(dk_part + static_cast<long long>(row_lo) * kHeadDim + col) =
                        make_float2(acc_dk[nt][0] * scale, acc_dk[nt][1] * scale);
                }
                if (row_hi < seqlen_k) {
                    *reinterpret_cast<float2*>(dk_part + static_cast<long long>(row_hi) * kHeadDim + col) =
                        make_float2(acc_dk[nt][2] * scale, acc_dk[nt][3] * scale);
                }
            }
            if (c0 < params.head_dim_v) {
                if (row_lo < seqlen_k) {
                    *reinterpret_cast<float2*>(dv_part + static_cast<long long>(row_lo) * kHeadDim + col) =
                        make_float2(acc_dv[nt][0], acc_dv[nt][1]);
                }
                if (row_hi < seqlen_k) {
                    *reinterpret_cast<float2*>(dv_part + static_cast<long long>(row_hi) * kHeadDim + col) =
                        make_float2(acc_dv[nt][2], acc_dv[nt][3]);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Deterministic dQ: query block blockIdx.x (longest first when causal) of head blockIdx.y walks its key
// blocks in ascending order and accumulates dQ = dS . K in registers; no atomics.
//
// Warp w owns queries (w % kWarpsM)*16 .. +16. With kWarpsD = 2 the two warps of a query group
// (d_split = w / kWarpsM) take key halves of S and interleaved 16-column groups of dQ.
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_bwd_dq_kernel(const AttnParams params) {
    using namespace bwd_sm80;
    using Traits = DqTraits<kHeadDim, kBlockM, kBlockN, kNWarps>;
    using TileQ = typename Traits::TileQ;
    using TileK = typename Traits::TileK;
    using TileS = typename Traits::TileS;
    constexpr int kThreads = Traits::kThreads;
    constexpr int kWarpsM = Traits::kWarpsM;
    constexpr int kWarpsD = Traits::kWarpsD;
    constexpr int kNTiles = Traits::kNPerWarp / 8;   // n-tiles of the warp's S rows
    constexpr int kDTiles = Traits::kDPerWarp / 8;   // n-tiles of the warp's dQ rows

    CUFLASH_CHECK_SMEM_BYTES(Traits::kSmemBytes);
    const unsigned smem = sm80::smem_addr(bwd_sm80_smem);
    check_smem<Traits::kSmemBytes>(smem);
    const unsigned s_q = smem + Traits::kOffQ;
    const unsigned s_do = smem + Traits::kOffDo;
    const unsigned s_ds = smem + Traits::kOffDs;

    const int m_block = kIsCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / params.h_per_kv;
    const int tid = threadIdx.x, lane_id = tid % 32, warp = tid / 32;
    const int g = lane_id >> 2, t = lane_id & 3;
    const int row0 = (warp % kWarpsM) * 16;             // the warp's queries within the block
    const int d_split = warp / kWarpsM;
    const int key_col0 = d_split * Traits::kNPerWarp;   // the warp's keys of S within the key block
    const int seqlen_q = params.seqlen_q, seqlen_k = params.seqlen_k;
    const int query0 = m_block * kBlockM;
    const long long bh = static_cast<long long>(b) * params.num_heads + h;

    const AttnMask<kIsCausal> mask{seqlen_q, seqlen_k, params.causal_offset};
    int n_begin, n_end;
    mask.template key_block_range<kBlockM, kBlockN>(m_block, n_begin, n_end);

    // lse and D of the thread's two rows; rows past Sq get P = 0 through lse = +inf.
    float lse2[2], dsum[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = query0 + row0 + g + half * 8;
        const bool ok = row < seqlen_q;
        lse2[half] = ok ? lse_log2_offset(params.lse[b * params.lse_batch_stride + h * params.lse_head_stride + row])
                        : INFINITY;
        dsum[half] = ok ? params.softmax_d[bh * seqlen_q + row] : 0.f;
    }

    float acc_dq[kDTiles][4];
    clear(acc_dq);

    // K, V of key block n into pipeline stage `stage` (opaque (b, hk, tid) inside the loop, as in dK/dV).
    auto load_key_block = [&](int n, int stage, int bb, int hh, int tt) {
        const int k0 = n * kBlockN;
        const Elem* k_ptr = static_cast<const Elem*>(params.k) + bb * params.k_batch_stride +
                            hh * params.k_head_stride + k0 * params.k_row_stride;
        const Elem* v_ptr = static_cast<const Elem*>(params.v) + bb * params.v_batch_stride +
                            hh * params.v_head_stride + k0 * params.v_row_stride;
        copy_tile_flat<TileK, kThreads>(smem + Traits::kOffK + stage * TileK::kBytes, k_ptr, params.k_row_stride,
                                   seqlen_k - k0, params.head_dim, tt);
        copy_tile_flat<TileK, kThreads>(smem + Traits::kOffV + stage * TileK::kBytes, v_ptr, params.v_row_stride,
                                   seqlen_k - k0, params.head_dim_v, tt);
    };

    if (n_begin < n_end) {
        const Elem* q_ptr = static_cast<const Elem*>(params.q) + b * params.q_batch_stride +
                            h * params.q_head_stride + query0 * params.q_row_stride;
        const Elem* do_ptr = static_cast<const Elem*>(params.dout) + b * params.do_batch_stride +
                             h * params.do_head_stride + query0 * params.do_row_stride;
        copy_tile_flat<TileQ, kThreads>(s_q, q_ptr, params.q_row_stride, seqlen_q - query0, params.head_dim, tid);
        copy_tile_flat<TileQ, kThreads>(s_do, do_ptr, params.do_row_stride, seqlen_q - query0, params.head_dim_v, tid);
        load_key_block(n_begin, 0, b, hk, tid);
        sm80::cp_async_commit();
    }

    const float scale_log2 = params.scale_log2;
    for (int n_block = n_begin; n_block < n_end; ++n_block) {
        const int stage = (n_block - n_begin) & 1;
        const int key0 = n_block * kBlockN;
        const unsigned s_k = smem + Traits::kOffK + stage * TileK::kBytes;
        const unsigned s_v = smem + Traits::kOffV + stage * TileK::kBytes;

        // This key block has landed and every warp is done with the previous one.
        sm80::cp_async_wait<0>();
        __syncthreads();
        if (n_block + 1 < n_end) {
            load_key_block(n_block + 1, stage ^ 1, opaque(b), opaque(hk), opaque(tid));
            sm80::cp_async_commit();
        }
        const int lane = opaque(lane_id);

        // S = Q . K^T for the warp's 16 queries x kNPerWarp keys, then P.
        float acc_s[1][kNTiles][4];
        clear(acc_s[0]);
        gemm_abt<Elem, kHeadDim, kNTiles>(acc_s[0], cursor_a<TileQ>(s_q, row0, 0, lane),
                                          cursor_b<TileK>(s_k, key_col0, 0, lane));
        if (mask.needs_mask(query0, kBlockM, key0, kBlockN)) {
            mask.template apply<1, kNTiles>(acc_s, query0 + row0, key0 + key_col0);
        }
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[0][nt][e] = fast_exp2(acc_s[0][nt][e] * scale_log2 - lse2[e >> 1]);
        }

        // dP = dO . V^T, dS = P o (dP - D) in place.
        float acc_dp[kNTiles][4];
        clear(acc_dp);
        gemm_abt<Elem, kHeadDim, kNTiles>(acc_dp, cursor_a<TileQ>(s_do, row0, 0, lane),
                                          cursor_b<TileK>(s_v, key_col0, 0, lane));
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dp[nt][e] = acc_s[0][nt][e] * (acc_dp[nt][e] - dsum[e >> 1]);
        }

        // dQ += dS . K (K read with .trans at the warp's interleaved head-dim columns).
        const SmemCursor<TileK> k_cols = cursor_a<TileK>(s_k, 0, 2 * d_split, lane);
        if constexpr (kWarpsD == 1) {
            gemm_ab<Elem, kBlockN / 16, kDTiles, 2 * kWarpsD>(
                acc_dq, [&](int kk, unsigned (&a)[4]) { c_to_a<Elem>(a, acc_dp, kk); }, k_cols);
        } else {
            const SmemCursor<TileS> ds_rows = cursor_a<TileS>(s_ds, row0, 0, lane);
            store_c_tile<Elem, TileS>(s_ds, acc_dp, row0, key_col0, lane);
            __syncthreads();   // dS of both key halves visible; the next step's first barrier guards reuse
            gemm_ab<Elem, kBlockN / 16, kDTiles, 2 * kWarpsD>(
                acc_dq, [&](int kk, unsigned (&a)[4]) { sm80::ldmatrix_x4(a, ds_rows.at(0, 2 * kk)); }, k_cols);
        }
    }

    // dq = scale * dQ; rows past Sq and columns past D are never stored.
    Elem* dq_ptr = static_cast<Elem*>(params.dq) + b * params.dq_batch_stride + h * params.dq_head_stride;
    const float scale = params.scale;
#pragma unroll
    for (int nt = 0; nt < kDTiles; ++nt) {
        const int c0 = ((nt / 2) * kWarpsD + d_split) * 16 + (nt & 1) * 8;
        if (c0 >= params.head_dim) continue;
        const int col = c0 + 2 * t;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = query0 + row0 + g + half * 8;
            if (row < seqlen_q) {
                *reinterpret_cast<unsigned*>(dq_ptr + row * params.dq_row_stride + col) =
                    ElemTraits<Elem>::pack2(acc_dq[nt][2 * half] * scale, acc_dq[nt][2 * half + 1] * scale);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Atomic path epilogue: dq[b, i, h, :D] = scale * dq_accum[b, h, i, :D]. Grid (ceil(Sq / kBlockM), H, B);
// one thread per 8 columns (two float4 loads, one 16-byte store).
template <typename Elem, int kHeadDim, int kBlockM, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32)
flash_bwd_convert_dq_kernel(const AttnParams params) {
    constexpr int kThreads = kNWarps * 32;
    constexpr int kChunks = kHeadDim / 8;
    const int m_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const long long bh = static_cast<long long>(b) * params.num_heads + h;
    const float* acc = params.dq_accum + bh * params.seqlen_q * kHeadDim;
    Elem* dq_ptr = static_cast<Elem*>(params.dq) + b * params.dq_batch_stride + h * params.dq_head_stride;
    const float scale = params.scale;
    for (int i = threadIdx.x; i < kBlockM * kChunks; i += kThreads) {
        const int row = m_block * kBlockM + i / kChunks;
        const int c = i % kChunks;
        if (row >= params.seqlen_q || c * 8 >= params.head_dim) continue;
        const float4* src = reinterpret_cast<const float4*>(acc + static_cast<long long>(row) * kHeadDim + c * 8);
        const float4 x = src[0], y = src[1];
        uint4 out;
        out.x = ElemTraits<Elem>::pack2(x.x * scale, x.y * scale);
        out.y = ElemTraits<Elem>::pack2(x.z * scale, x.w * scale);
        out.z = ElemTraits<Elem>::pack2(y.x * scale, y.y * scale);
        out.w = ElemTraits<Elem>::pack2(y.z * scale, y.w * scale);
        *reinterpret_cast<uint4*>(dq_ptr + row * params.dq_row_stride + c * 8) = out;
    }
}

// ---------------------------------------------------------------------------------------------------
// GQA epilogue: dk[b, j, hk, :D] = sum over the h_per_kv query heads h of group hk, in ascending order, of
// dk_accum[b, h, j, :D] (already scaled); likewise dv with Dv. The fixed order makes dK / dV
// deterministic even when dQ uses atomics. Grid (ceil(Sk / kBlockN), Hkv, B).
template <typename Elem, int kHeadDim, int kBlockN, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32)
flash_bwd_reduce_dkdv_kernel(const AttnParams params) {
    constexpr int kThreads = kNWarps * 32;
    constexpr int kChunks = kHeadDim / 8;
    const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int group = params.h_per_kv;
    const long long head_size = static_cast<long long>(params.seqlen_k) * kHeadDim;   // floats per (b, h)
    const long long first =
        (static_cast<long long>(b) * params.num_heads + static_cast<long long>(hk) * group) * head_size;
    Elem* dk_ptr = static_cast<Elem*>(params.dk) + b * params.dk_batch_stride + hk * params.dk_head_stride;
    Elem* dv_ptr = static_cast<Elem*>(params.dv) + b * params.dv_batch_stride + hk * params.dv_head_stride;

    for (int i = threadIdx.x; i < kBlockN * kChunks; i += kThreads) {
        const int row = n_block * kBlockN + i / kChunks;
        const int c = i % kChunks;
        if (row >= params.seqlen_k) continue;
        const long long offset = first + static_cast<long long>(row) * kHeadDim + c * 8;
#pragma unroll
        for (int which = 0; which < 2; ++which) {
            const int cols = which == 0 ? params.head_dim : params.head_dim_v;
            if (c * 8 >= cols) continue;
            const float* part = (which == 0 ? params.dk_accum : params.dv_accum) + offset;
            float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int j = 0; j < group; ++j) {
                const float4 x = reinterpret_cast<const float4*>(part + j * head_size)[0];
                const float4 y = reinterpret_cast<const float4*>(part + j * head_size)[1];
                sum[0] += x.x; sum[1] += x.y; sum[2] += x.z; sum[3] += x.w;
                sum[4] += y.x; sum[5] += y.y; sum[6] += y.z; sum[7] += y.w;
            }
            uint4 out;
            out.x = ElemTraits<Elem>::pack2(sum[0], sum[1]);
            out.y = ElemTraits<Elem>::pack2(sum[2], sum[3]);
            out.z = ElemTraits<Elem>::pack2(sum[4], sum[5]);
            out.w = ElemTraits<Elem>::pack2(sum[6], sum[7]);
            Elem* dst = (which == 0 ? dk_ptr + row * params.dk_row_stride : dv_ptr + row * params.dv_row_stride) + c * 8;
            *reinterpret_cast<uint4*>(dst) = out;
        }
    }
}

}  // namespace cuflash
