// Warpgroup tensor-core primitives of sm_90a (wgmma.mma_async): the Hopper mainloop's GEMMs. Only
// variants planned for sm_90a instantiate these (plain sm_90 and older targets reject wgmma).
//
// Shared-memory operand layout ("panels"): a tile of R rows x C 16-bit columns (C a multiple of 64) is
// stored as C/64 panels of R rows x 128 bytes; 16-byte chunk c of row r of a panel sits at chunk
// c ^ (r % 8). That is the hardware's 128-byte swizzle when each panel starts 1024-byte aligned, and
// it is also conflict-free for ldmatrix / cp.async / 4-byte C-fragment stores (SwizzledTile in
// cuflash/tile.cuh, kGroup 8, is the same layout, so the mma.sync and wgmma paths share one smem layout).
//
// A tile is read two ways:
//   K-major  (rows = M or N, columns = K): S = Q.K^T-style operands. A 16-wide k-step is a 32-byte
//            offset inside a panel row; 8-row groups are 1024 bytes apart (SBO).
//   MN-major (rows = K, columns = M or N): the B of P.V / dS^T.Q and the transposed A of dS.K. A k-step
//            is 16 rows (2048 bytes); 8-row K groups are 1024 bytes apart (SBO) and 64-column panels
//            R*128 bytes apart (LBO).
//
// Register side: the 64 x N accumulator of a warpgroup gives warp (warp % 4) rows 16*(warp % 4) ..
// +16 in the mma.sync C layout, and an A operand from registers uses the mma.sync A layout: the
// accumulator contract of cuda_src/README.md holds unchanged.
//
// Ordering rules (PTX ISA, "asynchronous warpgroup level matrix" section):
//   - wgmma reads shared memory through the async proxy: bytes written by st.shared or cp.async need
//     fence_proxy_async() in the writing threads, then a barrier, before a wgmma reads them;
//   - fence() before the first wgmma of a batch whose accumulator or A registers other instructions
//     touched; commit() closes a batch; wait<N>() blocks until at most N batches are in flight, and only
//     then may the accumulators be read or the smem operands be overwritten.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "cuflash/wgmma_sm90_ops.cuh"

namespace cuflash {
namespace sm90 {

constexpr int kPanelCols = 64;        // 16-bit columns per panel row
constexpr int kPanelRowBytes = 128;   // one swizzle row
constexpr int kSwizzleAtomBytes = 1024;  // 8 rows x 128 bytes: the unit the swizzle repeats over

// Shared-memory matrix descriptor: start address, leading / stride byte offsets (16-byte units, 14 bits
// each) and the layout type in bits 62-63 (1 = 128-byte swizzle).
__device__ __forceinline__ unsigned long long make_desc(unsigned smem_addr, unsigned lbo_bytes, unsigned sbo_bytes) {
    return static_cast<unsigned long long>((smem_addr & 0x3FFFFu) >> 4) |
           (static_cast<unsigned long long>((lbo_bytes >> 4) & 0x3FFFu) << 16) |
           (static_cast<unsigned long long>((sbo_bytes >> 4) & 0x3FFFu) << 32) |
           (1ull << 62);
}

// The descriptor of the same layout `bytes` (a multiple of 16) further on: only the start-address field
// moves. A shared-memory address (< 256 KB) plus an offset inside the tile never carries out of its 14
// bits, so the add stays in the low word. The GEMMs build one descriptor per operand and step it with
// this: one integer add per wgmma instead of rebuilding the masked, shifted fields from the address.
__device__ __forceinline__ unsigned long long desc_advance(unsigned long long desc, unsigned bytes) {
    const unsigned lo = static_cast<unsigned>(desc) + (bytes >> 4);
    return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// K-major panel tile with kRows rows: the byte offset of k-step kt (columns 16*kt ..) from its column 0.
template <int kRows>
__host__ __device__ constexpr unsigned k_major_offset(int kt) {
    return (kt / 4) * kRows * kPanelRowBytes + (kt % 4) * 32;
}
// MN-major tile: the byte offset of k-step kt (K rows 16*kt ..).
__host__ __device__ constexpr unsigned mn_major_offset(int kt) { return 16 * kt * kPanelRowBytes; }

// Descriptor of rows row0.. of a K-major panel tile with kRows rows, at k-step kt (columns 16*kt ..).
template <int kRows>
__device__ __forceinline__ unsigned long long desc_k_major(unsigned tile, int row0, int kt) {
    return desc_advance(make_desc(tile + row0 * kPanelRowBytes, 16 /* unused for swizzled K-major */,
                                  kSwizzleAtomBytes),
                        k_major_offset<kRows>(kt));
}

// Descriptor of an MN-major panel tile with kRows (= K) rows: K rows k_row0 .., MN columns from panel
// panel0 (64 * panel0 ..).
template <int kRows>
__device__ __forceinline__ unsigned long long desc_mn_major(unsigned tile, int k_row0, int panel0) {
    return make_desc(tile + panel0 * kRows * kPanelRowBytes + k_row0 * kPanelRowBytes,
                     kRows * kPanelRowBytes, kSwizzleAtomBytes);
}

// The non-template helpers compile to nothing outside sm_90a (no variant for another target calls them;
// NVRTC would otherwise reject the instructions while compiling this header for sm_80).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CUFLASH_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#else
#define CUFLASH_SM90A_ASM(...) __trap()
#endif

__device__ __forceinline__ void fence() { CUFLASH_SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { CUFLASH_SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wait() {
    CUFLASH_SM90A_ASM("wgmma.wait_group.sync.aligned %0;\n" :: "n"(kPending) : "memory");
}
// Generic-proxy shared-memory writes of this thread become visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async() {
    CUFLASH_SM90A_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Four 8 x 8 16-bit matrices (stmatrix): register i of lane (g, t) holds elements (g, 2t), (g, 2t + 1) of
// matrix i; lane l gives the address of row l % 8 of matrix l / 8 (16 contiguous bytes).
__device__ __forceinline__ void stmatrix_x4(unsigned addr, const unsigned (&r)[4]) {
    CUFLASH_SM90A_ASM("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
                      "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// Four 8 x 8 16-bit matrices stored transposed (stmatrix .trans): register i of lane (g, t) holds elements
// (g, 2t), (g, 2t + 1) of matrix i, which land in row 2t, 2t + 1, column g of the stored matrix; lane l gives
// the address of stored row l % 8 of matrix l / 8 (16 contiguous bytes).
__device__ __forceinline__ void stmatrix_x4_trans(unsigned addr, const unsigned (&r)[4]) {
    CUFLASH_SM90A_ASM("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
                      "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// Keeps the compiler from moving reads or writes of acc across this point (around wait()).
template <int kNTiles>
__device__ __forceinline__ void fence_operand(float (&acc)[kNTiles][4]) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[nt][e]) :: "memory");
    }
}

// The warpgroup GEMMs. Each issues its k-steps as one batch (fence ... commit); the caller waits.
// kN = 8 * kNTiles columns of the accumulator. accumulate = false overwrites acc.

// The one wgmma batch loop: kKSteps k16 steps of acc (64 x kN) (+)= A . B, the k-th step's operands from
// desc_a(k) / desc_b(k) (a descriptor, or for kFromRegs the A fragment from registers), kMajorA / kMajorB
// 0 = K-major, 1 = MN-major.
template <typename Elem, int kKSteps, int kNTiles, int kMajorA, int kMajorB, bool kFromRegs = false, typename DescA,
          typename DescB>
__device__ __forceinline__ void gemm_batch(float (&acc)[kNTiles][4], DescA&& desc_a, DescB&& desc_b,
                                           bool accumulate) {
    fence();
#pragma unroll
    for (int k = 0; k < kKSteps; ++k) {
        if constexpr (kFromRegs) {
            Wgmma<Elem, 8 * kNTiles>::template rs<kMajorB>(acc, desc_a(k), desc_b(k), accumulate || k > 0);
        } else {
            Wgmma<Elem, 8 * kNTiles>::template ss<kMajorA, kMajorB>(acc, desc_a(k), desc_b(k), accumulate || k > 0);
        }
    }
    commit();
}

// acc (64 x kN) (+)= A (64 x kK) . B^T: A rows a_row0 .. +64 of K-major tile A (kRowsA rows), B rows
// b_row0 .. +kN of K-major tile B (kRowsB rows).
template <typename Elem, int kK, int kRowsA, int kRowsB, int kNTiles>
__device__ __forceinline__ void gemm_abt(float (&acc)[kNTiles][4], unsigned tile_a, int a_row0, unsigned tile_b,
                                         int b_row0, bool accumulate) {
    const unsigned long long a0 = desc_k_major<kRowsA>(tile_a, a_row0, 0);
    const unsigned long long b0 = desc_k_major<kRowsB>(tile_b, b_row0, 0);
    gemm_batch<Elem, kK / 16, kNTiles, 0, 0>(
        acc, [&](int k) { return desc_advance(a0, k_major_offset<kRowsA>(k)); },
        [&](int k) { return desc_advance(b0, k_major_offset<kRowsB>(k)); }, accumulate);
}

// acc (64 x kN) (+)= A (64 x 16*kKTiles, registers) . B: B MN-major tile (kRowsB = K rows), K rows
// b_row0 .., columns from panel b_panel0.
template <typename Elem, int kKTiles, int kRowsB, int kNTiles>
__device__ __forceinline__ void gemm_rs(float (&acc)[kNTiles][4], const unsigned (&a)[kKTiles][4], unsigned tile_b,
                                        int b_row0, int b_panel0, bool accumulate) {
    const unsigned long long b0 = desc_mn_major<kRowsB>(tile_b, b_row0, b_panel0);
    gemm_batch<Elem, kKTiles, kNTiles, 0, 1, true>(
        acc, [&](int k) -> const unsigned(&)[4] { return a[k]; },
        [&](int k) { return desc_advance(b0, mn_major_offset(k)); }, accumulate);
}

// acc (64 x kN) (+)= A (64 x kK) . B: A rows a_row0 .. +64 of K-major tile A (kRowsA rows), B MN-major
// tile (kRowsB = K rows) with columns from panel b_panel0.
template <typename Elem, int kK, int kRowsA, int kRowsB, int kNTiles>
__device__ __forceinline__ void gemm_ab(float (&acc)[kNTiles][4], unsigned tile_a, int a_row0, unsigned tile_b,
                                        int b_panel0, bool accumulate) {
    const unsigned long long a0 = desc_k_major<kRowsA>(tile_a, a_row0, 0);
    const unsigned long long b0 = desc_mn_major<kRowsB>(tile_b, 0, b_panel0);
    gemm_batch<Elem, kK / 16, kNTiles, 0, 1>(
        acc, [&](int k) { return desc_advance(a0, k_major_offset<kRowsA>(k)); },
        [&](int k) { return desc_advance(b0, mn_major_offset(k)); }, accumulate);
}

// acc (64 x kN) (+)= A^T . B with both tiles MN-major (rows = K): A columns from panel a_panel0 (64
// M-columns), B columns from panel b_panel0, K rows k_row0 .. +kK of both.
template <typename Elem, int kK, int kRowsA, int kRowsB, int kNTiles>
__device__ __forceinline__ void gemm_atb(float (&acc)[kNTiles][4], unsigned tile_a, int a_panel0, unsigned tile_b,
                                         int b_panel0, int k_row0, bool accumulate) {
    const unsigned long long a0 = desc_mn_major<kRowsA>(tile_a, k_row0, a_panel0);
    const unsigned long long b0 = desc_mn_major<kRowsB>(tile_b, k_row0, b_panel0);
    gemm_batch<Elem, kK / 16, kNTiles, 1, 1>(
        acc, [&](int k) { return desc_advance(a0, mn_major_offset(k)); },
        [&](int k) { return desc_advance(b0, mn_major_offset(k)); }, accumulate);
}

}  // namespace sm90
}  // namespace cuflash
