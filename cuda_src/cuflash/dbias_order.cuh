// The order of the dbias adds of the deterministic backward, for a bias that broadcasts over the batch and / or
// the heads only (its rows and keys are the scores'): counters per (bias slice, query block, key block).
//
// Such a bias's gradient is summed in fp32 into dbias_accum (the bias's own shape), one add per score from the
// dK/dV CTAs of every (batch, query head) that maps onto the slice. Float adds give the same bits every run only
// in one fixed order. Each CTA adds into a dbias tile at most once per query head (one step of its walk), so the
// contributors of a tile take turns: the one of rank r adds when the tile's counter reads r, then, once its adds
// are visible, raises it by one. Ranks follow the (batch, head) order of the grid (blockIdx.z = batch slowest,
// then blockIdx.y = the head group; the plan leaves the grid unremapped when the adds are ordered), so a CTA only
// ever waits for one dispatched before it on the same key block, which waits for nothing after it: every wait
// ends. Every contributor visits the same tiles (see orders below), so each counter runs 0 .. contributors - 1.
// A CTA that walks several heads of one bias head (params.dkdv_heads > 1) holds consecutive ranks and adds for
// them in its own program order.
//
// The counters sit after dbias_accum's elements in the same zeroed allocation (params.dbias_order_offset floats
// in); 0 = unordered (the default backward's atomics).
#pragma once

#include "cuflash/mask.cuh"
#include "cuflash/params.cuh"

namespace cuflash {
namespace dbias_order {

// The kernels that carry the turns: the bias variants the deterministic backward runs (`deterministic_runs`, which
// the mainloop knows). Every contributor to a slice visits the same tiles: the masks of positions (none, causal,
// a window, dropout) give every batch row and head the same ones, and under ids or a bool mask the dK / dV lists
// are the union over the contributors (cuda_src/block_lists.cu, union_lists).
__host__ __device__ constexpr bool orders(bool bias, bool deterministic_runs) {
    return bias && deterministic_runs;
}

__device__ __forceinline__ bool enabled(const AttnParams& p) { return p.dbias_order_offset != 0; }

// Whether a slice gathers several batch rows (the bias broadcast over the batch) / several query heads (one bias
// head for a group of them, or for all).
__device__ __forceinline__ bool slice_spans_batch(const AttnParams& p) { return p.dbias_batch_stride == 0; }
__device__ __forceinline__ bool slice_spans_heads(const AttnParams& p) {
    return p.dbias_head_stride == 0 || p.bias_head_div > 1;
}

// The counter of the dbias tile (query block m_block, key block n_block) of the slice that (b, h) adds into.
__device__ __forceinline__ int* counter(const AttnParams& p, int b, int h, int m_block, int n_block) {
    const int slice_heads = p.dbias_head_stride == 0 ? 1 : p.num_heads / p.bias_head_div;
    const int slice =
        (slice_spans_batch(p) ? 0 : b) * slice_heads + (p.dbias_head_stride == 0 ? 0 : h / p.bias_head_div);
    return reinterpret_cast<int*>(p.dbias_accum + p.dbias_order_offset) +
           (static_cast<long long>(slice) * p.dbias_order_qblocks + m_block) * p.dbias_order_kblocks + n_block;
}

// The turn of (b, h) among the (batch, head) pairs that add into its slice, in the grid's order.
__device__ __forceinline__ int rank(const AttnParams& p, int b, int h) {
    const int heads = p.dbias_head_stride == 0 ? p.num_heads : p.bias_head_div;  // per slice
    const int head = p.dbias_head_stride == 0 ? h : h % p.bias_head_div;
    return (slice_spans_batch(p) ? b : 0) * heads + head;
}

// Spins until the counter reads `rank`; the adds its earlier holders released are then visible to this thread
// (and, after the caller's barrier, to its CTA).
__device__ __forceinline__ void wait_turn(const int* counter, int rank) {
    int seen;
    while (true) {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
        if (seen == rank) break;
        __nanosleep(64);
    }
}

// After every adding thread's __threadfence and a barrier: the turn goes to the next rank.
__device__ __forceinline__ void pass_turn(int* counter) {
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}

// The turn of (b, h) at dbias tile (m_block, n_block): one thread waits for it, then a barrier hands it to the
// others; after their adds, each thread's __threadfence, a barrier, and one thread passes it on.
__device__ __forceinline__ void wait_turn(const AttnParams& p, int b, int h, int m_block, int n_block) {
    wait_turn(counter(p, b, h, m_block, n_block), rank(p, b, h));
}
__device__ __forceinline__ void pass_turn(const AttnParams& p, int b, int h, int m_block, int n_block) {
    pass_turn(counter(p, b, h, m_block, n_block));
}

}  // namespace dbias_order
}  // namespace cuflash
