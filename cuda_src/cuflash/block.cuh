// Which key blocks a query block visits (and, transposed, which query blocks a key block visits), in the
// order the mainloops walk them, split into two phases:
//   masked   blocks that may hold an invisible (query, key) pair: the mask policy runs on them (the
//            forward mainloops test per warp tile with AttnMask::needs_mask, which for today's policies is
//            exactly this phase, refined to the warp's rows; `masked(j)` is the block-level answer for
//            policies whose per-element test is costly);
//   interior blocks every pair of which is visible: no per-element test at all.
// Blocks outside the range are skipped: never loaded, never computed.
//
// Today's policies (no mask, causal) give contiguous ranges, and the forward visits them from the last
// block down, so the masked phase comes first (the blocks crossing the diagonal or the end of the keys).
// A policy with non-contiguous visible blocks (window, bool mask with tile skipping, segment / block ids)
// replaces `block(j)` by a lookup into per-query-block lists built by a small pre-pass (FlexAttention's
// kv_num_blocks / kv_indices, full_kv_* for the interior phase, q_* mirrors for the transposed view); the
// loops already only ask `count()`, `block(j)` and `masked(j)`.
#pragma once

#include "cuflash/mask.cuh"

namespace cuflash {

// Key blocks of query block m_block, visited last-first: step j is key block n_end - 1 - j.
template <int kBlockM, int kBlockN>
struct KeyBlocks {
    int n_begin, n_end;  // visible key blocks [n_begin, n_end)
    int n_interior_end;  // key blocks below this index are fully visible to every row of the query block

    template <typename Mask>
    __device__ __forceinline__ KeyBlocks(const Mask& mask, int m_block) {
        mask.template key_block_range<kBlockM, kBlockN>(m_block, n_begin, n_end);
        n_interior_end = mask.template key_interior_end<kBlockM, kBlockN>(m_block);
    }
    __device__ __forceinline__ bool empty() const { return n_end <= n_begin; }
    __device__ __forceinline__ int count() const { return n_end - n_begin; }
    __device__ __forceinline__ int block(int j) const { return n_end - 1 - j; }
    // Whether step j is in the masked phase (the first steps, given the last-first order).
    __device__ __forceinline__ bool masked(int j) const { return block(j) >= n_interior_end; }
};

// The transposed view, for the dK / dV kernels: the query blocks that see key block n_block, visited from
// m_first on, wrapping around at m_end (m_first spreads concurrent atomic dQ adds over different rows).
template <int kBlockM, int kBlockN>
struct QueryBlocks {
    int m_begin, m_end;

    template <typename Mask>
    __device__ __forceinline__ QueryBlocks(const Mask& mask, int n_block) {
        mask.template query_block_range<kBlockM, kBlockN>(n_block, m_begin, m_end);
    }
    __device__ __forceinline__ int count() const { return m_end - m_begin; }
    __device__ __forceinline__ int next(int m) const { return m + 1 == m_end ? m_begin : m + 1; }
};

}  // namespace cuflash
