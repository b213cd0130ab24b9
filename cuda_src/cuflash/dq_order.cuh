// The ordered dQ adds of the deterministic backward on sm_90a.
//
// Instead of a dQ kernel of its own, the deterministic backward can run the warp-specialized dK/dV kernel with
// its dQ step: its producer thread adds each query block's staged dQ tile into dq_accum, and fp32 sums are the
// same bits every run only if the adds into one query block come in one fixed order. A counter per (batch,
// query head, query block), in dq_accum's allocation after its rows and slack (params.dq_order_offset floats
// from dq_accum, params.dq_order_blocks per head; zeroed by the pre-pass), holds how many key blocks have added
// into that block. A key block adds when the counter reads its rank, then, once its add is complete, raises it
// by one. The key blocks adding into a query block are 0 .. n_last (none, causal), ranked so that a CTA only
// ever waits for one dispatched before it (a lower blockIdx.x), so every wait ends:
//   - no mask: rank n; every CTA walks the query blocks in one order (last first), key block n one add behind
//     key block n - 1;
//   - causal: rank n_last - n, from the block's diagonal down; the grid hands out the key blocks last-first
//     (DkdvMainloopSm90Ws::key_block) and each CTA walks up from its diagonal, so key block n reaches a query
//     block one step after key block n + 1 did, and no CTA holds its SM waiting behind longer ones.
#pragma once

#include "cuflash/params.cuh"
#include "cuflash/wgmma_sm90.cuh"

namespace cuflash {
namespace dq_order {

__device__ __forceinline__ bool enabled(const AttnParams& p) { return p.dq_order_offset != 0; }

// The counters of (batch b, query head h): dq_order_blocks ints.
__device__ __forceinline__ int* counters(const AttnParams& p, int b, int h) {
    return reinterpret_cast<int*>(p.dq_accum + p.dq_order_offset) +
           (static_cast<long long>(b) * p.num_heads + h) * p.dq_order_blocks;
}

// Spins until the counter reads `rank`; the adds it publishes are then visible to this thread's bulk ops.
__device__ __forceinline__ void wait_turn(const int* counter, int rank) {
    int seen;
    while (true) {
        CUFLASH_SM90A_ASM("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
        if (seen == rank) break;
        __nanosleep(32);
    }
    CUFLASH_SM90A_ASM("fence.proxy.async.global;\n" ::: "memory");
}

// After this thread's bulk adds completed (bulk_wait<0>): publish them and pass the turn on.
__device__ __forceinline__ void pass_turn(int* counter) {
    CUFLASH_SM90A_ASM("fence.proxy.async.global;\n" ::: "memory");
    CUFLASH_SM90A_ASM("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}

}  // namespace dq_order
}  // namespace cuflash
