// Tensor-memory-accelerator loads of sm_90a (cp.async.bulk.tensor): one thread asks for a whole box of a
// tensor, the bytes land in shared memory through the async proxy and count themselves on an mbarrier.
//
// The tensor maps (TmaDescriptor, 128 opaque bytes each) are encoded on the host by the driver
// (cuTensorMapEncodeTiled, cuflash/tma.py) and travel as the second kernel parameter (TmaParams) of the
// kernels that read them, __grid_constant__: a map's address is then a parameter-space address the TMA unit
// can read. (Not inside AttnParams: a 64-byte-aligned member made ptxas spill in kernels that never read it,
// nvcc 13.0: 0 -> 20-56 bytes in sm80-mainloop variants.) Every launch passes both parameters
// (cuflash/launch.py); the kernels with one ignore the second.
//
// Protocol on a stage's full barrier (whose other arrivals stay as they were): before the barrier's phase
// can complete, the issuing thread adds the box bytes it is about to ask for (expect_tx), then issues the
// boxes naming that barrier; the phase completes once every expected arrival came and every byte landed.
// A consumer's mbarrier wait then sees the bytes. Out-of-bounds parts of a box land as zeros and still count.
#pragma once

#include "cuflash/pipeline_sm90.cuh"

namespace cuflash {

struct alignas(64) TmaDescriptor {
    unsigned long long bits[16];
};

// The second parameter of the forward and dK/dV kernels: the maps of the tensors they may load by TMA
// (cuflash/launch.py: TMA_PARAMS_BYTES is this struct's size). bias: valid when AttnParams::bias_tma; q, k, v
// and in the backward dout (the batched "bshd" tensors as 4-d (D, H, S, B) maps, 64 x 64 boxes, K / V boxes of
// kv_box_rows of the forward's key tile): valid when AttnParams::qkv_tma.
struct TmaParams {
    TmaDescriptor bias;
    TmaDescriptor q;
    TmaDescriptor k;
    TmaDescriptor v;
    TmaDescriptor dout;  // the backward's (the warp-specialized dK/dV kernel's dO tiles)
};

namespace sm90 {

// The current phase of `bar` waits for `bytes` more bytes (no arrival).
__device__ __forceinline__ void mbarrier_expect_tx(unsigned bar, unsigned bytes) {
    CUFLASH_SM90A_ASM("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Pulls the descriptor into the TMA unit's cache ahead of its first use.
__device__ __forceinline__ void tma_prefetch_descriptor(const TmaDescriptor* desc) {
    CUFLASH_SM90A_ASM("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(desc)) : "memory");
}

// The box at coordinates (c0 innermost, c1, c2, c3) of the 4-d tensor `desc` into shared memory at dst
// (laid out as the descriptor's swizzle says), its bytes counted on mbarrier `bar`.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaDescriptor* desc, unsigned bar, int c0, int c1,
                                            int c2, int c3) {
    CUFLASH_SM90A_ASM(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(desc)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// The rows of one K / V box of a kRows-row tile: 64, or the whole tile where 64 rows do not divide it (the wide
// key tiles, e.g. D256 80 rows; a box may have up to 256 rows). cuflash/tma.py's kv_box makes the same choice.
__host__ __device__ constexpr int kv_box_rows(int rows) { return rows % 64 == 0 ? 64 : rows; }

// A wide-panel tile (SwizzledTile with 64-column panels, kRows a multiple of kBoxRows) of rows row0 .. + kRows of
// head `head` in batch `batch` of a (D, H, S, B) map whose box is 64 columns x kBoxRows rows, by the calling
// thread alone: a box per kBoxRows rows of each panel (the map's 128-byte swizzle is the tile's when it starts
// 1024-byte aligned; kBoxRows a multiple of 8 keeps every box so). Adds the tile's bytes to `bar` first; columns
// past D and rows past S land as zeros (and count).
template <typename Tile, int kBoxRows = 64>
__device__ __forceinline__ void tma_load_rows(unsigned smem, const TmaDescriptor* map, unsigned bar, int head,
                                              int row0, int batch) {
    static_assert(Tile::kPanelCols == 64 && Tile::kRows % kBoxRows == 0 && kBoxRows % 8 == 0 && kBoxRows <= 256,
                  "64-column panels of whole boxes of 8-row multiples, at most 256 rows");
    mbarrier_expect_tx(bar, Tile::kBytes);
#pragma unroll
    for (int panel = 0; panel < Tile::kPanels; ++panel) {
#pragma unroll
        for (int rows = 0; rows < Tile::kRows; rows += kBoxRows) {
            tma_load_4d(smem + panel * Tile::kPanelBytes + rows * Tile::kRowBytes, map, bar, 64 * panel, head,
                        row0 + rows, batch);
        }
    }
}

}  // namespace sm90
}  // namespace cuflash
