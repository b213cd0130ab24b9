// The order of the dQ adds into dq_accum on sm_90a: counters per query block, for two uses.
//
// Ordered adds (the deterministic backward). Instead of a dQ kernel of its own, the deterministic backward can
// run the warp-specialized dK/dV kernel with its dQ step: its producer adds each query block's staged dQ tile into
// dq_accum, and fp32 sums are the same bits every run only if the adds into one query block come in one fixed
// order. A counter per (batch, query head, query block), in dq_accum's allocation after its rows and slack
// (params.dq_order_offset floats from dq_accum, params.dq_order_blocks per head; zeroed by the pre-pass), holds how
// many key blocks have added into that block. A key block adds when the counter reads its rank, then, once its add
// is complete, raises it by one. The key blocks adding into a query block (0 .. n_last without a mask and under
// causal, the block's list under a general mask) are ranked so that a CTA only ever waits for CTAs dispatched
// before it (lower blockIdx.x), so every wait ends:
//   - no mask: rank n; every CTA walks the query blocks in one order (last first), key block n one add behind
//     key block n - 1;
//   - causal: rank n_last - n, from the block's diagonal down; the grid hands out the key blocks last-first
//     (DkdvMainloopSm90Ws::key_block) and each CTA walks up from its diagonal, so key block n reaches a query
//     block one step after key block n + 1 did, and no CTA holds its SM waiting behind longer ones;
//   - a general mask (window, segment / block ids; the batched layout, no bias): as under causal, from the query
//     block's last listed key block down, the rank being the number of key blocks after it in the query block's
//     list (the forward orientation's lists of the dK/dV tile, built beside the transposed ones the CTAs walk; both
//     classify every tile alike). A causal window or causal documents pipeline as causal does; a key block whose
//     first query block lists key blocks after it (a two-sided window, bidirectional documents) waits for them as
//     key block n waits for n - 1 without a mask, a step behind each.
//
// First stores (both backwards, where the producer has a warp that writes dQ: first_store). The pre-pass then
// leaves dq_accum as it is (zeroing it wrote the whole buffer once more, beside the pre-pass's reads of O and dO);
// the first add into a query block stores its tile instead, every add covers its sequence's rows only (past them
// lie the next head's rows, maybe not yet written), and the convert writes zeros for a block nobody added into
// (its counter still 0). Ordered, rank 0 is first. Unordered (the default backward, params.dq_ordered 0), the
// counter counts claims: a key block takes a ticket; ticket 0 stores, waits for the store to complete and sets
// kReady; the others wait for kReady before their add. A ticket-0 holder is running and waits for nobody before
// kReady, so every wait ends.
#pragma once

#include "cuflash/params.cuh"
#include "cuflash/wgmma_sm90.cuh"

namespace cuflash {
namespace dq_order {

// The deterministic backward's ordered adds.
__device__ __forceinline__ bool enabled(const AttnParams& p) { return p.dq_order_offset != 0 && p.dq_ordered != 0; }

// The first add into each query block stores (dq_accum unzeroed): the counters are planned (a warp-specialized
// dK/dV kernel with staged dQ tiles, the batched layout) and that kernel's producer has its writer warp
// (DkdvMainloopSm90Ws::dq_writer_warp: Q / dO by TMA, no bias copied by its threads). The pre-pass, the dK/dV
// kernel and the convert each decide it from the same parameters.
__device__ __forceinline__ bool first_store(const AttnParams& p) {
    return p.dq_order_offset != 0 && p.qkv_tma != 0 && !(p.bias_staged != 0 && p.bias_tma == 0);
}

// The default backward's claimed first stores.
__device__ __forceinline__ bool claimed(const AttnParams& p) { return first_store(p) && p.dq_ordered == 0; }

// The claims' flag: set once the first store is complete (the tickets count below it).
constexpr int kReady = 1 << 30;

// The counters of (batch b, query head h): dq_order_blocks ints.
__device__ __forceinline__ int* counters(const AttnParams& p, int b, int h) {
    return reinterpret_cast<int*>(p.dq_accum + p.dq_order_offset) +
           (static_cast<long long>(b) * p.num_heads + h) * p.dq_order_blocks;
}

// Spins until `done(counter's value)`; what the counter's releases published is then visible to this thread's
// bulk ops.
template <typename Done>
__device__ __forceinline__ void wait_until(const int* counter, Done done) {
    int seen;
    while (true) {
        CUFLASH_SM90A_ASM("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
        if (done(seen)) break;
        __nanosleep(32);
    }
    CUFLASH_SM90A_ASM("fence.proxy.async.global;\n" ::: "memory");
}

// After this thread's bulk ops completed (bulk_wait<0>): make them visible, then raise the counter by kAmount.
template <int kAmount>
__device__ __forceinline__ void release_add(int* counter) {
    CUFLASH_SM90A_ASM("fence.proxy.async.global;\n" ::: "memory");
    CUFLASH_SM90A_ASM("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(counter), "n"(kAmount) : "memory");
}

// Ordered: wait for the counter to read `rank`; once the add is complete, pass the turn on.
__device__ __forceinline__ void wait_turn(const int* counter, int rank) {
    wait_until(counter, [rank](int seen) { return seen == rank; });
}
__device__ __forceinline__ void pass_turn(int* counter) { release_add<1>(counter); }

// Claimed: a ticket of the counter, true for the first (which then stores); once its store is complete it sets
// kReady, which the others wait for.
__device__ __forceinline__ bool claim(int* counter) {
    int old;
    CUFLASH_SM90A_ASM("atom.relaxed.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
    return old == 0;
}
__device__ __forceinline__ void publish(int* counter) { release_add<kReady>(counter); }
__device__ __forceinline__ void wait_ready(const int* counter) {
    wait_until(counter, [](int seen) { return (seen & kReady) != 0; });
}

// Whether no key block added into the query block of `row` (batch b, query head h): its dq is 0.
__device__ __forceinline__ bool untouched(const AttnParams& p, int b, int h, int row) {
    return first_store(p) && counters(p, b, h)[row / p.dq_order_rows] == 0;
}

}  // namespace dq_order
}  // namespace cuflash
