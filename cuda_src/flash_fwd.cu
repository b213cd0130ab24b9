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
// Two mainloops, chosen by the template argument kWgmma; both drive the same mask and softmax,
// which see only the mma C-fragment layout (cuda_src/README.md, "Accumulator contract").
//
// mma.sync (kWgmma = false; sm_80 and later). mma.sync m16n8k16 with Q / K / V fragments by ldmatrix.
// Shared memory: Q (kBlockM x kHeadDim), then kStages K tiles, then kStages V tiles (kBlockN x
// kHeadDim each). Every tile is cut into 32-column panels whose rows are 64 bytes = four 16-byte
// chunks; chunk c of row r sits at chunk slot c ^ ((r >> 1) & 3). Two panel rows fill one 128-byte
// bank line, so the 8 rows of any 8-row-aligned ldmatrix phase land in 8 different 16-byte bank
// groups, and the 8 cp.async of 8 consecutive threads (two panel rows) do too: no bank conflicts
// on either side, for every head-dim bucket (all are multiples of 32, also 96 / 160 / 224).
// Pipeline (cp.async groups, committed in the order K0 V0 K1 V1 ...; every thread commits every
// group, empty past the last block, so the counts stay uniform). Step j handles key block
// n_end-1-j (boundary blocks first) in slot j % kStages:
//   wait K_j; barrier (everyone done with P.V of step j-1) -> issue V_{j+kStages-1};  S = Q.K_j^T
//   wait V_j; barrier (everyone done with Q.K_j^T)          -> issue K_{j+kStages};   softmax; P.V_j
// With kStages = 1 this is FlashAttention-2's overlap: V_j loads under Q.K_j^T, K_{j+1} under the
// softmax and P.V_j. With kStages >= 2 each load has a whole step or more to land.
//
// wgmma (kWgmma = true; sm_90a, head-dim buckets 64 / 128 / 256). Whole warpgroups: warp w owns rows
// 16w .. 16w+15, warpgroup g = warps 4g .. 4g+3 owns rows 64g .. +64, the M of its m64nNk16 wgmma's,
// which hand each warp its 16 rows in the mma C layout. S = Q.K^T reads Q and K from shared memory
// (both K-major, sm90::gemm_abt); O += P.V takes P from registers in the mma A layout and V from
// shared memory MN-major (sm90::gemm_rs). Each operand is read from shared memory once per warpgroup
// instead of once per warp, and no ldmatrix is issued. Shared memory: the same tiles in the panels of
// cuflash/wgmma_sm90.cuh (64 columns = 128-byte rows, chunk c of row r at c ^ (r % 8), each panel
// 1024-byte aligned: the hardware's 128-byte swizzle), also conflict-free for the cp.async writes and
// the epilogue's C-fragment stores. Pipeline: a 2-slot K / V ring with K one step ahead of V and one
// barrier per step. Step j:
//   wait K_j, V_{j-1}; fence.proxy.async; barrier -> issue S_j = Q.K_j^T, then O += P_{j-1}.V_{j-1};
//   issue loads K_{j+1}, V_j; wait S_j -> mask, softmax of S_j (under P.V_{j-1}); wait P.V_{j-1};
//   rescale O; pack P_j
// (FlashAttention-3's intra-warpgroup overlap), then one last P.V. The barrier at the top of step j
// finds every warp done with S_{j-1} and P.V_{j-2}, whose slots K_{j+1} and V_j then take. wgmma
// reads shared memory through the async proxy: every thread fences its landed cp.async writes
// (fence.proxy.async) before the barrier that publishes them. Each load has one step to land.
//
// Checked without a GPU: all_variants(80) compiles for sm_80 and all_variants(90) (wgmma included) for
// sm_90a, spill-free, and ptxas reports no serialized wgmma. A CPU emulation of the warp collectives
// and of cp.async (with a shared-memory race detector) matched a float64 reference over tails,
// D < bucket, Dv != D, GQA, padded strides and zero / negative scales (mma.sync path); a replay of
// the address formulas found every tile covered exactly once and zero bank conflicts (both panel
// layouts; the cp.async writes of the wide one land exactly on the wgmma layout).
// Measured (H200, bf16, tile sweep of 2026-11-21, see forward_sm80.tile_sm80), mma.sync: D64 128 x
// 128 x 2 stages 332 TFLOPS at S=4k; D128 128 x 64 x 1 stage 346 (causal 314). The wgmma mainloop
// is not measured yet (2026-11-21). Target: >= FlashAttention-2 (H100: 335 TFLOPS fwd at D128,
// S=4k) on mma.sync, well above it on wgmma.

#include "cuflash/params.cuh"
#include "cuflash/mma_sm80.cuh"
#include "cuflash/mask.cuh"
#include "cuflash/softmax.cuh"
#include "cuflash/wgmma_sm90.cuh"

namespace cuflash {
namespace fwd_sm80 {

constexpr int kChunkBytes = 16;   // one cp.async, one ldmatrix row
constexpr int kChunkElems = 8;    // 2-byte elements per chunk
// The mma.sync path's narrow panels (see the file header); the wgmma path's 128-byte panels are
// SwizzledTile<..., true>.
constexpr int kPanelChunks = 4;   // chunks per panel row
constexpr int kPanelCols = kPanelChunks * kChunkElems;       // 32 columns
constexpr int kPanelRowBytes = kPanelChunks * kChunkBytes;   // 64 bytes

constexpr unsigned kSignBits2 = 0x80008000u;      // the sign bits of two packed fp16 / bf16
constexpr float kMinScaleLog2 = 1.17549435e-38f;  // smallest normal float

// Where chunk `chunk` (0..3) of a narrow panel row `row` is stored within that row.
__device__ __forceinline__ int swizzle_chunk(int row, int chunk) { return chunk ^ ((row >> 1) & 3); }

// A kRows x kHeadDim tile of 2-byte elements cut into panels of kPanelCols columns (see the file
// header). kWide = false: the narrow panels of the mma.sync path (64-byte rows, chunk c at
// c ^ ((r >> 1) & 3)). kWide = true: the wgmma panels of cuflash/wgmma_sm90.cuh (128-byte rows, chunk c
// at c ^ (r % 8)), which are the hardware's 128-byte swizzle when each panel starts 1024-byte aligned.
// In both, the 16-byte chunk at one logical column of 8 consecutive rows starting at a multiple of 8
// lands in 8 different bank groups.
template <int kRows, int kHeadDim, bool kWide = false>
struct SwizzledTile {
    static constexpr int kPanelChunks = kWide ? 8 : 4;
    static constexpr int kPanelCols = kPanelChunks * kChunkElems;      // 64 or 32 columns
    static constexpr int kPanelRowBytes = kPanelChunks * kChunkBytes;  // 128 or 64 bytes
    static_assert(kHeadDim % kPanelCols == 0, "head-dim buckets are multiples of the panel width");
    static_assert(kRows % 16 == 0, "tiles start ldmatrix phases at 8-row boundaries");
    static constexpr int kPanels = kHeadDim / kPanelCols;
    // A multiple of 128 bytes (narrow) / of 1024 bytes (wide, kRows % 8 == 0): panels stay aligned.
    static constexpr int kPanelBytes = kRows * kPanelRowBytes;
    static constexpr int kBytes = kPanels * kPanelBytes;

    static __device__ __forceinline__ int swizzle(int row, int chunk) {
        return kWide ? chunk ^ (row & 7) : swizzle_chunk(row, chunk);
    }
    // Byte offset of the 16-byte chunk holding columns [8*chunk, 8*chunk + 8) of row `row`.
    static __device__ __forceinline__ int offset(int row, int chunk) {
        return (chunk / kPanelChunks) * kPanelBytes + row * kPanelRowBytes +
               swizzle(row, chunk % kPanelChunks) * kChunkBytes;
    }
};

// Copies rows [tile_row0, tile_row0 + kRows) x columns [0, kHeadDim) of a row-major (seqlen, head
// dim) slice whose row 0 starts at `base` into a SwizzledTile<kRows, kHeadDim, kWide> with cp.async.
// With kChecked, rows >= seqlen and columns >= cols_valid are zero-filled (reading nothing;
// `fallback`, the tensor's base, stands in as the address); without, the caller guarantees the tile
// is entirely in bounds. The kPanelChunks lanes of a group copy the chunks of one panel row (a quad
// for narrow panels, 8 lanes for wide ones), so 8 consecutive threads fill one 128-byte bank line and
// each group reads 64 / 128 contiguous bytes of global memory. A thread's rows differ by multiples of 8
// between passes, so its swizzle term, and hence everything but compile-time offsets, is fixed per
// tile.
template <typename Elem, int kRows, int kHeadDim, bool kWide, int kThreads, bool kChecked>
__device__ __forceinline__ void copy_tile(unsigned smem_tile, const Elem* base, long long row_stride,
                                          int tile_row0, int seqlen, int cols_valid, const void* fallback) {
    using Tile = SwizzledTile<kRows, kHeadDim, kWide>;
    constexpr int kGroupLanes = Tile::kPanelChunks;
    constexpr int kSlotsPerPass = kThreads / kGroupLanes;  // panel rows copied per pass, one per group
    // Both are powers of two: a pass covers part of one panel (kRowPasses passes per panel), or
    // whole panels (kPanelsPerPass of them).
    static_assert(kSlotsPerPass % kRows == 0 || kRows % kSlotsPerPass == 0, "rows and threads mismatch");
    static_assert(kSlotsPerPass % 8 == 0, "rows of one thread must share their swizzle term");
    constexpr bool kPartPanel = kRows % kSlotsPerPass == 0;
    constexpr int kRowPasses = kPartPanel ? kRows / kSlotsPerPass : 1;
    constexpr int kPanelsPerPass = kPartPanel ? 1 : kSlotsPerPass / kRows;
    constexpr int kPasses = kRowPasses * ((Tile::kPanels + kPanelsPerPass - 1) / kPanelsPerPass);

    const int group = threadIdx.x / kGroupLanes;
    const int chunk = threadIdx.x % kGroupLanes;
    const int row0 = kPartPanel ? group : group % kRows;
    const int panel0 = kPartPanel ? 0 : group / kRows;
    // The row index stays a 32-bit int until one widening multiply by the stride.
    const int thread_row = tile_row0 + row0;
    const Elem* thread_src = base + thread_row * row_stride + panel0 * Tile::kPanelCols + chunk * kChunkElems;
    const unsigned thread_dst = smem_tile + Tile::offset(row0, panel0 * kGroupLanes + chunk);
    const long long pass_row_stride = kSlotsPerPass * row_stride;
    // Validity as "compile-time offset < thread-fixed bound": no per-pass row or column registers.
    const int rows_left = seqlen - thread_row;
    const int cols_left = cols_valid - (panel0 * Tile::kPanelCols + chunk * kChunkElems);
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
        const int row_pass = pass % kRowPasses;                     // rows advance by kSlotsPerPass ...
        const int panel_step = pass / kRowPasses * kPanelsPerPass;  // ... then panels
        if (!kPartPanel && Tile::kPanels % kPanelsPerPass != 0 && panel0 + panel_step >= Tile::kPanels) break;
        const bool valid =
            !kChecked || (row_pass * kSlotsPerPass < rows_left && panel_step * Tile::kPanelCols < cols_left);
        const Elem* gmem = thread_src + row_pass * pass_row_stride + panel_step * Tile::kPanelCols;
        sm80::cp_async_16(
            thread_dst + row_pass * kSlotsPerPass * Tile::kPanelRowBytes + panel_step * Tile::kPanelBytes,
            valid ? static_cast<const void*>(gmem) : fallback, valid);
    }
}

// copy_tile for any tile. With kInteriorFastPath, a tile entirely in bounds (all rows < seqlen,
// cols_valid = kHeadDim: the common case) skips the per-copy test and its address select: one
// uniform branch per tile instead of ~5 instructions per copy. The kernel turns it off for the
// variants whose accumulators already take 192 registers: there the second copy of the pass loop
// made ptxas spill (sm_90a, D128 128 x 64).
template <typename Elem, int kRows, int kHeadDim, bool kWide, int kThreads, bool kInteriorFastPath>
__device__ __forceinline__ void load_tile(unsigned smem_tile, const Elem* base, long long row_stride,
                                          int tile_row0, int seqlen, int cols_valid, const void* fallback) {
    if (kInteriorFastPath && tile_row0 + kRows <= seqlen && cols_valid >= kHeadDim) {
        copy_tile<Elem, kRows, kHeadDim, kWide, kThreads, false>(smem_tile, base, row_stride, tile_row0, seqlen,
                                                                 cols_valid, fallback);
    } else {
        copy_tile<Elem, kRows, kHeadDim, kWide, kThreads, true>(smem_tile, base, row_stride, tile_row0, seqlen,
                                                                cols_valid, fallback);
    }
}

__device__ __forceinline__ void st_shared_b32(unsigned addr, unsigned value) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value));
}

__device__ __forceinline__ void st_shared_b128(unsigned addr, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w));
}

__device__ __forceinline__ uint4 ld_shared_b128(unsigned addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr));
    return v;
}

// The per-lane part of every ldmatrix address, by parity of the 16-column k-step (a 32-column panel
// holds two). Every ldmatrix tile starts on a 16-row boundary, so the swizzle term (row >> 1) & 3
// depends on the lane only.
struct LdmatrixLanes {
    // A pattern, x4 as rows 0-7|8-15 x cols 0-7|8-15 of a 16x16 tile: Q as the A operand, and V
    // (with .trans) as the B operand of two n8 tiles: row lane % 16, chunk lane / 16.
    unsigned a[2];
    // B pattern, x4 as keys 0-7 x k 0-7|8-15, keys 8-15 x k 0-7|8-15: K as the B operand of two n8
    // tiles: row (lane / 16) * 8 + lane % 8, chunk (lane / 8) % 2.
    unsigned b[2];

    __device__ __forceinline__ explicit LdmatrixLanes(int lane) {
        const int a_row = lane % 16;
        const int b_row = lane / 16 * 8 + lane % 8;
#pragma unroll
        for (int parity = 0; parity < 2; ++parity) {
            a[parity] = a_row * kPanelRowBytes + swizzle_chunk(a_row, 2 * parity + lane / 16) * kChunkBytes;
            b[parity] = b_row * kPanelRowBytes + swizzle_chunk(b_row, 2 * parity + lane / 8 % 2) * kChunkBytes;
        }
    }
};

template <int kMTiles, int kNTiles>
__device__ __forceinline__ void clear(float (&acc)[kMTiles][kNTiles][4]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
        }
    }
}

// acc_s = Q . K^T for this warp's kMTiles x 16 query rows (q_warp: its first row in the Q tile) and
// the kNTiles x 8 keys of a K tile. Each K fragment (two n8 tiles) feeds kMTiles x 2 mma's.
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kMTiles, int kNTiles>
__device__ __forceinline__ void gemm_qk(float (&acc_s)[kMTiles][kNTiles][4], unsigned q_warp, unsigned k_tile,
                                        const LdmatrixLanes& lanes) {
    using QTile = SwizzledTile<kBlockM, kHeadDim>;
    using KTile = SwizzledTile<kBlockN, kHeadDim>;
    clear(acc_s);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        unsigned qa[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
            sm80::ldmatrix_x4(qa[mt], q_warp + lanes.a[kk % 2] + kk / 2 * QTile::kPanelBytes +
                                          mt * 16 * kPanelRowBytes);
        }
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
            unsigned kb[4];
            sm80::ldmatrix_x4(kb, k_tile + lanes.b[kk % 2] + kk / 2 * KTile::kPanelBytes +
                                      np * 16 * kPanelRowBytes);
            const unsigned kb_lo[2] = {kb[0], kb[1]};  // keys np*16 + 0..7
            const unsigned kb_hi[2] = {kb[2], kb[3]};  // keys np*16 + 8..15
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                sm80::mma_16816<Elem>(acc_s[mt][2 * np], qa[mt], kb_lo);
                sm80::mma_16816<Elem>(acc_s[mt][2 * np + 1], qa[mt], kb_hi);
            }
        }
    }
}

// P of k16 step kk as an A fragment (mma.sync m16n8k16 layout, which wgmma's register A operand
// shares): the C fragment of n8 tiles 2kk and 2kk+1 of the probabilities, packed to Elem.
template <typename Elem, int kNTiles>
__device__ __forceinline__ void pack_p(unsigned (&pa)[4], const float (&acc_s)[kNTiles][4], int kk) {
    using Traits = ElemTraits<Elem>;
    pa[0] = Traits::pack2(acc_s[2 * kk][0], acc_s[2 * kk][1]);          // row g,   k 0-7
    pa[1] = Traits::pack2(acc_s[2 * kk][2], acc_s[2 * kk][3]);          // row g+8, k 0-7
    pa[2] = Traits::pack2(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]);  // row g,   k 8-15
    pa[3] = Traits::pack2(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3]);  // row g+8, k 8-15
}

// acc_o += P . V with P = acc_s (fp32 probabilities) packed to Elem in registers: the C fragment of
// n8 tiles 2kk and 2kk+1 is exactly the A fragment of k16 step kk. Each V fragment (.trans, two n8
// output tiles) feeds kMTiles x 2 mma's.
template <typename Elem, int kHeadDim, int kBlockN, int kMTiles, int kNTiles, int kDTiles>
__device__ __forceinline__ void gemm_pv(float (&acc_o)[kMTiles][kDTiles][4],
                                        const float (&acc_s)[kMTiles][kNTiles][4], unsigned v_tile,
                                        const LdmatrixLanes& lanes) {
    using VTile = SwizzledTile<kBlockN, kHeadDim>;
#pragma unroll
    for (int kk = 0; kk < kNTiles / 2; ++kk) {
        unsigned pa[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) pack_p<Elem>(pa[mt], acc_s[mt], kk);
#pragma unroll
        for (int dp = 0; dp < kDTiles / 2; ++dp) {
            unsigned vb[4];
            sm80::ldmatrix_x4_trans(vb, v_tile + lanes.a[dp % 2] + dp / 2 * VTile::kPanelBytes +
                                            kk * 16 * kPanelRowBytes);
            const unsigned vb_lo[2] = {vb[0], vb[1]};  // output columns dp*16 + 0..7
            const unsigned vb_hi[2] = {vb[2], vb[3]};  // output columns dp*16 + 8..15
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                sm80::mma_16816<Elem>(acc_o[mt][2 * dp], pa[mt], vb_lo);
                sm80::mma_16816<Elem>(acc_o[mt][2 * dp + 1], pa[mt], vb_hi);
            }
        }
    }
}

// All of P as A fragments (the wgmma path keeps P_{j-1} in registers while S_j is computed).
template <typename Elem, int kNTiles>
__device__ __forceinline__ void pack_p(unsigned (&pa)[kNTiles / 2][4], const float (&acc_s)[kNTiles][4]) {
#pragma unroll
    for (int kk = 0; kk < kNTiles / 2; ++kk) pack_p<Elem>(pa[kk], acc_s, kk);
}

// acc *= ratio per C-fragment element position (ratio[e]: the factor of the rows of elements e),
// skipped warp-uniformly when every factor of the warp is 1 (no row changed its maximum).
template <int kDTiles>
__device__ __forceinline__ void rescale_rows(float (&acc)[kDTiles][4], const float (&ratio)[4]) {
    const bool ones = ratio[0] == 1.f && ratio[1] == 1.f && ratio[2] == 1.f && ratio[3] == 1.f;
    if (__all_sync(0xffffffffu, ones)) return;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[dt][e] *= ratio[e];
    }
}

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

// Flips the sign of every element of a tile (bytes a multiple of 16), all threads sharing the work.
template <int kBytes, int kThreads>
__device__ __forceinline__ void negate_tile(unsigned tile) {
    for (int idx = threadIdx.x; idx < kBytes / kChunkBytes; idx += kThreads) {
        const unsigned addr = tile + idx * kChunkBytes;
        uint4 v = ld_shared_b128(addr);
        v.x ^= kSignBits2;
        v.y ^= kSignBits2;
        v.z ^= kSignBits2;
        v.w ^= kSignBits2;
        st_shared_b128(addr, v);
    }
}

// Row `row_begin` of this (batch, head)'s output and lse (null when the caller wants no lse).
// Recomputed where needed rather than kept live across the key loop: registers are the scarce part.
template <typename Elem>
__device__ __forceinline__ Elem* output_rows(const AttnParams& params, int b, int h, int row_begin) {
    return static_cast<Elem*>(params.o) + b * params.o_batch_stride + h * params.o_head_stride +
           row_begin * params.o_row_stride;
}

__device__ __forceinline__ float* lse_rows(const AttnParams& params, int b, int h, int row_begin) {
    return params.lse == nullptr
               ? nullptr
               : params.lse + b * params.lse_batch_stride + h * params.lse_head_stride + row_begin;
}

// Epilogue of one warp: lse of its rows, then O (already normalized) packed to Elem into its own
// rows of the Q tile (st.shared.b32 in the C layout: the 8 rows of a store land in 8 different
// 16-byte bank groups, conflict-free) and read back as 16-byte chunks (8 lanes = one 128-byte line)
// for 16-byte global stores. Rows >= Sq and columns >= Dv are never stored.
// Reusing the Q tile is safe: every warp's last ldmatrix of Q precedes the key loop's last
// __syncthreads (in the wgmma path: every wgmma read of Q completes before the barrier ahead of the
// last P.V), so no CTA-wide barrier is needed, and each warp touches only its own rows here.
// kWide: the Q tile's panel layout.
template <typename Elem, int kHeadDim, int kBlockM, bool kWide, int kMTiles, int kDTiles>
__device__ __forceinline__ void store_output(const AttnParams& params, const float (&acc_o)[kMTiles][kDTiles][4],
                                             const float (&lse)[kMTiles][2], int b, int h, int row_begin,
                                             int warp_row0, unsigned smem_q) {
    using QTile = SwizzledTile<kBlockM, kHeadDim, kWide>;
    using Traits = ElemTraits<Elem>;
    constexpr int kWarpRows = kMTiles * 16;
    constexpr int kPassRows = 32 / QTile::kPanelChunks;  // rows of one panel a warp reads per pass
    const int lane = threadIdx.x % 32;
    const int rows_valid = params.seqlen_q - row_begin;

    float* lse_out = lse_rows(params, b, h, row_begin);
    if (lse_out != nullptr && lane % 4 == 0) {  // a quad shares its rows' lse
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = warp_row0 + mt * 16 + half * 8 + lane / 4;
                if (row < rows_valid) lse_out[row] = lse[mt][half];
            }
        }
    }

#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = warp_row0 + mt * 16 + half * 8 + lane / 4;
#pragma unroll
            for (int dt = 0; dt < kDTiles; ++dt) {
                st_shared_b32(smem_q + QTile::offset(row, dt) + lane % 4 * 4,
                              Traits::pack2(acc_o[mt][dt][2 * half], acc_o[mt][dt][2 * half + 1]));
            }
        }
    }
    __syncwarp();  // the warp's fragments are in shared memory before any lane reads a whole chunk

    Elem* o_rows = output_rows<Elem>(params, b, h, row_begin);
    // Each pass: kPassRows rows x one panel (8 rows x 4 chunks, or 4 rows x 8 chunks); 8 consecutive
    // lanes read one 128-byte bank line.
#pragma unroll
    for (int pass = 0; pass < QTile::kPanels * kWarpRows / kPassRows; ++pass) {
        const int panel = pass * kPassRows / kWarpRows;
        const int row = warp_row0 + pass * kPassRows % kWarpRows + lane / QTile::kPanelChunks;
        const int chunk = panel * QTile::kPanelChunks + lane % QTile::kPanelChunks;
        const uint4 v = ld_shared_b128(smem_q + QTile::offset(row, chunk));
        const int col = chunk * kChunkElems;
        if (row < rows_valid && col < params.head_dim_v) {
            *reinterpret_cast<uint4*>(o_rows + row * params.o_row_stride + col) = v;
        }
    }
}

// A query block that sees no key at all: O = 0 (16-byte stores) and lse = -inf for its valid rows.
template <typename Elem, int kHeadDim, int kBlockM, int kThreads>
__device__ __forceinline__ void store_empty_block(const AttnParams& params, int b, int h, int row_begin) {
    constexpr int kChunksPerRow = kHeadDim / kChunkElems;
    const int rows_valid = params.seqlen_q - row_begin;
    Elem* o = output_rows<Elem>(params, b, h, row_begin);
    for (int idx = threadIdx.x; idx < kBlockM * kChunksPerRow; idx += kThreads) {
        const int row = idx / kChunksPerRow;
        const int col = idx % kChunksPerRow * kChunkElems;
        if (row < rows_valid && col < params.head_dim_v) {
            *reinterpret_cast<uint4*>(o + row * params.o_row_stride + col) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    float* lse = lse_rows(params, b, h, row_begin);
    if (lse != nullptr) {
        for (int row = threadIdx.x; row < kBlockM; row += kThreads) {
            if (row < rows_valid) lse[row] = -INFINITY;
        }
    }
}

}  // namespace fwd_sm80

// kWgmma = false: the mma.sync mainloop (sm_80 and later). kWgmma = true: the warpgroup mainloop of
// sm_90a (see the file header); its default keeps older 7-argument names meaning mma.sync.
template <typename Elem, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, bool kIsCausal,
          bool kWgmma = false>
__global__ void __launch_bounds__(kNWarps * 32) flash_fwd_kernel(const AttnParams params) {
    using namespace fwd_sm80;
    constexpr int kThreads = kNWarps * 32;
    constexpr int kWarpRows = kBlockM / kNWarps;  // query rows a warp owns
    constexpr int kMTiles = kWarpRows / 16;
    constexpr int kNTiles = kBlockN / 8;          // score columns, in mma n8 tiles
    constexpr int kDTiles = kHeadDim / 8;         // output columns, in mma n8 tiles
    using QTile = SwizzledTile<kBlockM, kHeadDim, kWgmma>;
    using KVTile = SwizzledTile<kBlockN, kHeadDim, kWgmma>;
    constexpr int kSmemBytes = QTile::kBytes + 2 * kStages * KVTile::kBytes;
    constexpr int kAccRegisters = kMTiles * (kDTiles + kNTiles) * 4;  // fp32 acc_o + acc_s per thread
    constexpr bool kFastLoads = kAccRegisters <= 160;                 // see load_tile
    static_assert(sizeof(Elem) == 2, "the tensor-core forward takes fp16 or bf16");
    static_assert(kWarpRows % 16 == 0 && kMTiles >= 1, "each warp owns whole m16 tiles");
    static_assert(kBlockN % 16 == 0, "P.V steps over 16 keys");
    static_assert(kStages >= 1, "at least one K and one V buffer");
    static_assert((kBlockM & (kBlockM - 1)) == 0 && (kBlockN & (kBlockN - 1)) == 0, "power-of-two tiles");
    // wgmma: whole warpgroups whose 4 warps own the 16-row slices of one m64 tile; N of S = Q.K^T
    // (kBlockN) and of O += P.V (kHeadDim) are wgmma N sizes, and the head dim is whole 64-column panels.
    static_assert(!kWgmma || (kNWarps % 4 == 0 && kWarpRows == 16 && kHeadDim % 64 == 0 && kBlockN % 64 == 0 &&
                              kBlockN <= 256 && kHeadDim <= 256),
                  "the wgmma mainloop needs warpgroups of 16-row warps, 64-column panels and N <= 256");
    static_assert(!kWgmma || kStages == 2, "the wgmma mainloop is written for a 2-slot K / V ring");
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(!kWgmma, "the wgmma mainloop compiles for sm_90a only");
#endif

    // 1024-byte alignment (the mma.sync path needs 128): wgmma's 128-byte swizzle is anchored at
    // 1024-byte boundaries, so the wgmma path checks it below.
    extern __shared__ __align__(1024) unsigned char smem[];
    const unsigned smem_q = sm80::smem_addr(smem);
    if (sm80::dynamic_smem_bytes() < kSmemBytes) __trap();  // the plan's smem formula drifted
    if (kWgmma && (smem_q & 1023u) != 0) __trap();          // wgmma would read a differently swizzled tile

    const int m_block = kIsCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // causal: longest first
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int h_kv = h / params.h_per_kv;  // GQA / MQA: K and V are shared, never materialized
    const int row_begin = m_block * kBlockM;
    const int warp_row0 = threadIdx.x / 32 * kWarpRows;  // this warp's first row within the block

    const AttnMask<kIsCausal> mask{params.seqlen_q, params.seqlen_k, params.causal_offset};
    int n_begin, n_end;
    mask.template key_block_range<kBlockM, kBlockN>(m_block, n_begin, n_end);
    if (n_end <= n_begin) {  // no row of this block sees any key
        store_empty_block<Elem, kHeadDim, kBlockM, kThreads>(params, b, h, row_begin);
        return;
    }
    const int n_blocks = n_end - n_begin;

    const unsigned smem_k = smem_q + QTile::kBytes;
    const unsigned smem_v = smem_k + kStages * KVTile::kBytes;
    const Elem* q_src =
        static_cast<const Elem*>(params.q) + b * params.q_batch_stride + h * params.q_head_stride;
    const Elem* k_src =
        static_cast<const Elem*>(params.k) + b * params.k_batch_stride + h_kv * params.k_head_stride;
    const Elem* v_src =
        static_cast<const Elem*>(params.v) + b * params.v_batch_stride + h_kv * params.v_head_stride;

    // Step j visits key block n_end-1-j (boundary blocks first); its K and V live in slot
    // j % kStages. Each call commits one group, empty when step j does not exist, so the
    // wait counts below hold for every step.
    auto load_k = [&](int j) {
        if (j < n_blocks) {
            load_tile<Elem, kBlockN, kHeadDim, kWgmma, kThreads, kFastLoads>(
                smem_k + (j % kStages) * KVTile::kBytes, k_src, params.k_row_stride, (n_end - 1 - j) * kBlockN,
                params.seqlen_k, params.head_dim, params.k);
        }
        sm80::cp_async_commit();
    };
    auto load_v = [&](int j) {
        if (j < n_blocks) {
            load_tile<Elem, kBlockN, kHeadDim, kWgmma, kThreads, kFastLoads>(
                smem_v + (j % kStages) * KVTile::kBytes, v_src, params.v_row_stride, (n_end - 1 - j) * kBlockN,
                params.seqlen_k, params.head_dim_v, params.v);
        }
        sm80::cp_async_commit();
    };

    // Prologue. mma.sync: groups K0 (with Q), V0, K1, V1, ..., V_{kStages-2}, K_{kStages-1}:
    // 2*kStages-1 groups. Later steps commit V_{j+kStages-1} and K_{j+kStages}, keeping the order
    // K0 V0 K1 V1 ...: when step j waits for K_j (group 2j) or V_j (group 2j+1), exactly 2*kStages-2
    // younger groups exist. wgmma: K0 (with Q) only; its loop waits for everything at each step.
    constexpr int kYoungerGroups = kWgmma ? 0 : 2 * kStages - 2;
    load_tile<Elem, kBlockM, kHeadDim, kWgmma, kThreads, kFastLoads>(smem_q, q_src, params.q_row_stride, row_begin,
                                                                     params.seqlen_q, params.head_dim, params.q);
    load_k(0);
    if constexpr (!kWgmma) {
#pragma unroll
        for (int s = 0; s + 1 < kStages; ++s) {
            load_v(s);
            load_k(s + 1);
        }
    }

    // The online softmax wants scale > 0 (softmax.cuh). A negative scale is |scale| applied to -Q:
    // flip Q's sign bits once, in shared memory, as soon as Q has landed (the loop's first barrier
    // publishes the flip). A zero scale becomes the smallest normal float, which keeps every finite
    // exponent at 0 while masked scores stay -inf (0 * -inf would be NaN); lse still uses 0.
    const float scale_log2 = fmaxf(fabsf(params.scale_log2), kMinScaleLog2);
    if (params.scale < 0.f) {
        sm80::cp_async_wait<kYoungerGroups>();  // the group of Q (and K0) landed for this thread ...
        __syncthreads();                        // ... and for all
        negate_tile<QTile::kBytes, kThreads>(smem_q);
    }

    const LdmatrixLanes lanes(threadIdx.x % 32);  // mma.sync path only
    const unsigned q_warp = smem_q + warp_row0 * kPanelRowBytes;
    float acc_o[kMTiles][kDTiles][4];
    clear(acc_o);
    OnlineSoftmax<kMTiles> softmax;

    if constexpr (kWgmma) {
        // Warpgroup mainloop (see the file header). Step j issues S_j = Q.K_j^T and then
        // O += P_{j-1}.V_{j-1}, waits for S_j only, and runs the mask and softmax of S_j while the
        // tensor cores still work on P.V; O's rescale waits for P.V. One barrier per step, at its
        // top: K_j and V_{j-1} have landed, and every warp has finished step j-1, so the slots of
        // K_{j-1} (read by S_{j-1}) and V_{j-2} (read by P.V_{j-2}) are free for K_{j+1} and V_j.
        const int warp_row_begin = row_begin + warp_row0;
        // Scores of key block n (this warp's rows): -inf where invisible, only on tiles that can need it.
        auto apply_mask = [&](float (&acc_s)[kMTiles][kNTiles][4], int n) {
            if (mask.needs_mask(warp_row_begin, kWarpRows, n * kBlockN, kBlockN)) {
                mask.apply(acc_s, warp_row_begin, n * kBlockN);
            }
        };
        const int wg_row0 = warp_row0 / 64 * 64;  // the warpgroup's first Q row: its wgmma's 64 rows
        // The barrier that publishes landed cp.async data (and the sign flip) to all warps. wgmma reads
        // shared memory through the async proxy, so each thread first fences its own writes (cp.async
        // writes count as generic-proxy writes) towards it.
        auto publish = []() {
            sm90::fence_proxy_async();
            __syncthreads();
        };
        auto slot = [](int j) { return unsigned(j % 2) * KVTile::kBytes; };
        const bool never = params.seqlen_k < 0;  // validated >= 1 on the host; see keep_wait_after
        auto issue_s = [&](float (&acc_s)[kMTiles][kNTiles][4], int j) {
            sm90::gemm_abt<Elem, kHeadDim, kBlockM, kBlockN>(acc_s[0], smem_q, wg_row0, smem_k + slot(j), 0, false);
        };
        // P (A operand, registers, mma.sync A layout) times V (MN-major: rows = keys = K, columns = head
        // dim = N). The A registers are not touched again before the wait (ptxas tracks wgmma's
        // register operands); acc_o is fenced on both sides of the batch.
        unsigned p_frag[kNTiles / 2][4];
        auto issue_pv = [&](int j) {
            sm90::fence_operand(acc_o[0]);
            sm90::gemm_rs<Elem, kBlockN / 16, kBlockN>(acc_o[0], p_frag, smem_v + slot(j), 0, 0, true);
        };

        // Step 0: S_0 and its softmax; acc_o is still 0, so the softmax may rescale it directly.
        sm80::cp_async_wait<0>();  // Q and K_0 landed for this thread ...
        publish();                 // ... and for all (with the sign flip)
        {
            float acc_s[kMTiles][kNTiles][4];
            issue_s(acc_s, 0);
            load_k(1);
            load_v(0);
            sm90::wait<0>();
            sm90::fence_operand(acc_s[0]);
            apply_mask(acc_s, n_end - 1);
            softmax.update(acc_s, acc_o, scale_log2);
            pack_p<Elem>(p_frag, acc_s[0]);
        }
        for (int j = 1; j < n_blocks; ++j) {
            sm80::cp_async_wait<0>();  // K_j and V_{j-1} landed for this thread ...
            publish();                 // ... and for all; every warp finished step j-1
            float acc_s[kMTiles][kNTiles][4];
            issue_s(acc_s, j);
            issue_pv(j - 1);
            load_k(j + 1);  // into the slot of K_{j-1}
            load_v(j);      // into the slot of V_{j-2}
            sm90::wait<1>();  // S_j done; P.V_{j-1} may still run
            sm90::fence_operand(acc_s[0]);
            apply_mask(acc_s, n_end - 1 - j);
            // The softmax would rescale acc_o, which P.V_{j-1} is still writing: hand it a tile of
            // ones instead (it multiplies every element of its acc_o argument by its row's ratio, or
            // leaves all alone when no row of the warp changed its maximum), and apply the ratios
            // to acc_o once P.V_{j-1} is done.
            float ratio[kMTiles][1][4] = {{{1.f, 1.f, 1.f, 1.f}}};
            softmax.update(acc_s, ratio, scale_log2);
            keep_wait_after(softmax.row_sum[0][0] + softmax.row_sum[0][1], never, smem_q);  // sums of all p
            sm90::wait<0>();
            sm90::fence_operand(acc_o[0]);
            rescale_rows(acc_o[0], ratio[0][0]);
            pack_p<Elem>(p_frag, acc_s[0]);
        }
        // The last P.V. Its barrier also orders every wgmma read of Q before the epilogue's stores.
        sm80::cp_async_wait<0>();  // V_{n_blocks-1} landed for this thread ...
        publish();                 // ... and for all
        issue_pv(n_blocks - 1);
        sm90::wait<0>();
        sm90::fence_operand(acc_o[0]);
    } else {
        for (int j = 0; j < n_blocks; ++j) {
            const int n = n_end - 1 - j;
            const unsigned slot = kStages == 1 ? 0u : unsigned(j % kStages) * KVTile::kBytes;

            sm80::cp_async_wait<2 * kStages - 2>();  // K_j (and Q) landed for this thread ...
            __syncthreads();                         // ... and for all; everyone finished P.V_{j-1}
            load_v(j + kStages - 1);                 // into the V slot P.V_{j-1} just released

            float acc_s[kMTiles][kNTiles][4];
            gemm_qk<Elem, kHeadDim, kBlockM, kBlockN>(acc_s, q_warp, smem_k + slot, lanes);
            const int warp_row_begin = row_begin + warp_row0;
            if (mask.needs_mask(warp_row_begin, kWarpRows, n * kBlockN, kBlockN)) {
                mask.apply(acc_s, warp_row_begin, n * kBlockN);
            }

            sm80::cp_async_wait<2 * kStages - 2>();  // V_j landed for this thread ...
            __syncthreads();                         // ... and for all; everyone finished Q.K_j^T
            load_k(j + kStages);                     // into the K slot Q.K_j^T just released

            softmax.update(acc_s, acc_o, scale_log2);
            gemm_pv<Elem, kHeadDim, kBlockN>(acc_o, acc_s, smem_v + slot, lanes);
        }
    }
    sm80::cp_async_wait<0>();  // only empty groups can remain; keep the invariant explicit

    float lse[kMTiles][2];
    softmax.finalize(acc_o, fabsf(params.scale), lse);
    store_output<Elem, kHeadDim, kBlockM, kWgmma>(params, acc_o, lse, b, h, row_begin, warp_row0, smem_q);
}

}  // namespace cuflash
