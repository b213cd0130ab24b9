// Which key blocks a query block visits (and, transposed, which query blocks a key block visits), in the
// order the mainloops walk them, split into two phases:
//   masked   blocks that may hold an invisible (query, key) pair: the mask policy runs on them (the
//            analytic policies answer per warp tile with needs_mask; the general mask's lists answer per
//            block with `masked(j)`; callers test both);
//   interior blocks every pair of which is visible: no per-element test at all.
// Blocks outside the range are skipped: never loaded, never computed.
//
// The analytic policies (no mask, causal) give contiguous ranges (KeyBlocks, QueryBlocks), and the
// forward visits them from the last block down, so the masked phase comes first (the blocks crossing the
// diagonal or the end of the keys). The general mask (window, segment / block ids) looks its blocks up in
// per-block lists a pre-pass builds (block_lists.cu; FlexAttention's kv_num_blocks / kv_indices with a
// partial bit per entry instead of a separate full list): ListKeyBlocks, ListQueryBlocks. The loops only ask
// `count()`, `block(j)` and `masked(j)`; KeyBlocksOf / QueryBlocksOf pick the type for a MaskKind.
#pragma once

#include "cuflash/mask.cuh"

namespace cuflash {

// Key blocks of query block m_block, visited last-first: step j is key block n_end - 1 - j. The analytic
// policies' needs_mask says which warp tiles need the per-element test, so `masked` is always true here.
template <int kBlockM, int kBlockN>
struct KeyBlocks {
    static constexpr bool kListed = false;  // no per-block partial bit (the mask's needs_mask decides)
    int n_begin, n_end;  // visible key blocks [n_begin, n_end)

    template <typename Mask>
    __device__ __forceinline__ KeyBlocks(const Mask& mask, int m_block) {
        mask.template key_block_range<kBlockM, kBlockN>(m_block, n_begin, n_end);
    }
    __device__ __forceinline__ bool empty() const { return n_end <= n_begin; }
    __device__ __forceinline__ int count() const { return n_end - n_begin; }
    __device__ __forceinline__ int block(int j) const { return n_end - 1 - j; }
    __device__ __forceinline__ bool masked(int) const { return true; }
};

// The general mask's key blocks of query block m_block: list row [count, entries ascending], visited
// last-first like KeyBlocks. Entries are read where used (L1-resident), not held in registers.
template <int kBlockM, int kBlockN>
struct ListKeyBlocks {
    static constexpr bool kListed = true;
    const int* list;  // this query block's row: list[0] = count, list[1 + i] = (block << 1) | partial
    int n;

    template <typename Mask>
    __device__ __forceinline__ ListKeyBlocks(const Mask& mask, int m_block)
        : list(mask.kv_list(m_block)), n(__ldg(list)) {}
    __device__ __forceinline__ bool empty() const { return n <= 0; }
    __device__ __forceinline__ int count() const { return n; }
    __device__ __forceinline__ int block(int j) const { return __ldg(list + n - j) >> 1; }
    __device__ __forceinline__ bool masked(int j) const { return (__ldg(list + n - j) & 1) != 0; }
};

// The transposed view, for the dK / dV kernels: the query blocks that see key block n_block (the dK/dV
// mainloop starts at a different step per key block and wraps around, to spread concurrent atomic dQ adds).
template <int kBlockM, int kBlockN>
struct QueryBlocks {
    static constexpr bool kListed = false;
    int m_begin, m_end;

    template <typename Mask>
    __device__ __forceinline__ QueryBlocks(const Mask& mask, int n_block) {
        mask.template query_block_range<kBlockM, kBlockN>(n_block, m_begin, m_end);
    }
    __device__ __forceinline__ int count() const { return m_end - m_begin; }
    __device__ __forceinline__ int block(int i) const { return m_begin + i; }  // step i, 0 <= i < count()
    __device__ __forceinline__ bool masked(int) const { return true; }       // the mask's needs_mask decides
};

// The general mask's query blocks of key block n_block, in ascending order.
template <int kBlockM, int kBlockN>
struct ListQueryBlocks {
    static constexpr bool kListed = true;
    const int* list;
    int n;

    template <typename Mask>
    __device__ __forceinline__ ListQueryBlocks(const Mask& mask, int n_block)
        : list(mask.q_list(n_block)), n(__ldg(list)) {}
    __device__ __forceinline__ int count() const { return n; }
    __device__ __forceinline__ int block(int i) const { return __ldg(list + 1 + i) >> 1; }
    __device__ __forceinline__ bool masked(int i) const { return (__ldg(list + 1 + i) & 1) != 0; }
};

template <int kMask, int kBlockM, int kBlockN>
using KeyBlocksOf = conditional_t<is_general_mask(kMask), ListKeyBlocks<kBlockM, kBlockN>, KeyBlocks<kBlockM, kBlockN>>;
template <int kMask, int kBlockM, int kBlockN>
using QueryBlocksOf =
    conditional_t<is_general_mask(kMask), ListQueryBlocks<kBlockM, kBlockN>, QueryBlocks<kBlockM, kBlockN>>;

}  // namespace cuflash
