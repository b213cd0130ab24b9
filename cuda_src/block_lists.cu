// Pre-pass of the general mask (cuda_src/cuflash/mask.cuh, GeneralMask): per-block visit lists, so the
// attention kernels never load a tile no pair of which is visible, and run the per-element test only on
// tiles that may hold a hidden pair (FlexAttention's block mask, built on the GPU per call).
//
// One CTA per (outer block, mask head, batch); without a per-head bool mask the lists do not depend on the
// head (one mask head). Not transposed (forward, dQ):
// outer blocks are query blocks of kOuter rows, inner blocks key blocks of kInner keys, written to
// params.kv_blocks. Transposed (dK / dV): outer = key blocks, inner = query blocks, to params.q_blocks.
// List row (b, outer) = [count, entries ascending], entry = (inner block << 1) | partial; the row is
// params.*_blocks_stride = (inner blocks + 1) ints long, and entries past count are never written or read.
//
// A tile is classified from ranges, conservatively: the window through its first / last row and key,
// segment and block ids through the min / max id of its rows and of its keys; then a bool mask by reading
// the tile's bytes (mask_any_all) where the ranges did not already skip it. "Skip" needs proof that no
// pair is visible; "full" needs proof that every pair is, and a tile crossing the end of the queries or
// keys is never full (the mask then also hides the zero-filled rows past Sq / Sk).
//
// With segment or block ids, the lists' buffer then takes the id ranges (IdRanges, cuflash/params.cuh): the
// scan of the inner ids above also tests that they never decrease (within each inner block and across to the
// next), and in a batch row where they never do, each outer row's range of inner rows its ids let it see comes
// from two binary searches (sorted ids make "equal segment" and "k block <= q block" one interval). The partial tiles then
// compare positions against that range instead of reading ids (GeneralMaskOf's ranged forms).

#include "cuflash/params.cuh"
#include "cuflash/mask.cuh"
#include "cuflash/dbias_order.cuh"

namespace cuflash {

constexpr int kListThreads = 128;
constexpr int kIntMax = 0x7fffffff;

// min / max of ids[r0, r1) (r0 < r1 <= n), one thread; clears `sorted` unless ids[r0, min(r1 + 1, n)) (the
// rows and the step to the next block's first) is nondecreasing.
__device__ __forceinline__ int2 id_range(const int* ids, int r0, int r1, int n, bool& sorted) {
    int2 range = make_int2(kIntMax, -kIntMax - 1);
    int prev = -kIntMax - 1;
    for (int r = r0; r < r1; ++r) {
        const int id = __ldg(ids + r);
        sorted = sorted && id >= prev;
        prev = id;
        range.x = min(range.x, id);
        range.y = max(range.y, id);
    }
    if (r1 < n) sorted = sorted && __ldg(ids + r1) >= prev;
    return range;
}

// The first i in [0, n) with ids[i] >= x (kUpper: > x), or n; ids nondecreasing.
template <bool kUpper>
__device__ __forceinline__ int bound(const int* ids, int n, int x) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        const int id = __ldg(ids + mid);
        if (kUpper ? id <= x : id < x) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// min / max of ids[r0, r1) over the whole CTA (every thread gets the result).
__device__ __forceinline__ int2 block_id_range(const int* ids, int r0, int r1) {
    __shared__ int2 s_warp[kListThreads / 32];
    int2 range = make_int2(kIntMax, -kIntMax - 1);
    for (int r = r0 + static_cast<int>(threadIdx.x); r < r1; r += kListThreads) {
        const int id = __ldg(ids + r);
        range.x = min(range.x, id);
        range.y = max(range.y, id);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        range.x = min(range.x, __shfl_xor_sync(0xffffffffu, range.x, offset));
        range.y = max(range.y, __shfl_xor_sync(0xffffffffu, range.y, offset));
    }
    __syncthreads();  // s_warp may still be read by a previous call
    if (threadIdx.x % 32 == 0) s_warp[threadIdx.x / 32] = range;
    __syncthreads();
    range = s_warp[0];
#pragma unroll
    for (int w = 1; w < kListThreads / 32; ++w) {
        range.x = min(range.x, s_warp[w].x);
        range.y = max(range.y, s_warp[w].y);
    }
    return range;
}

// The tile's id ranges: x = min, y = max, of the query rows (q) and of the keys (k).
struct TileIds {
    int2 q_seg, k_seg, q_blk, k_blk;
};

enum TileClass : int { kSkipTile = 0, kPartialTile = 1, kFullTile = 2 };

// Query rows [r0, r1) x keys [c0, c1) (both non-empty, inside the sequences); `tail`: the tile as the
// kernels see it extends past Sq or Sk.
__device__ __forceinline__ int classify(const GeneralMaskOf<true>& m, int r0, int r1, int c0, int c1, bool tail,
                                        const TileIds& ids) {
    const AttnParams& p = m.p;
    const int d_min = c0 - (r1 - 1) - m.causal_offset;  // smallest j - i - offset in the tile
    const int d_max = (c1 - 1) - r0 - m.causal_offset;  // largest
    bool any = d_min <= p.window_right && d_max >= -p.window_left;
    bool all = d_max <= p.window_right && d_min >= -p.window_left;
    if (p.q_segment_ids != nullptr) {
        any = any && ids.q_seg.y >= ids.k_seg.x && ids.k_seg.y >= ids.q_seg.x;
        all = all && ids.q_seg.x == ids.q_seg.y && ids.k_seg.x == ids.k_seg.y && ids.q_seg.x == ids.k_seg.x;
    }
    if (p.q_block_ids != nullptr) {
        any = any && ids.k_blk.x <= ids.q_blk.y;
        all = all && ids.k_blk.y <= ids.q_blk.x;
    }
    return !any ? kSkipTile : (all && !tail ? kFullTile : kPartialTile);
}

// Whether the bool mask has any / only nonzero bytes over rows [r0, r1) x keys [c0, c1) (inside the
// sequences, non-empty): the whole CTA reads the tile once, a warp per row, lanes along the keys.
__device__ __forceinline__ void mask_any_all(const GeneralMaskOf<true>& m, int r0, int r1, int c0, int c1, bool& any,
                                             bool& all) {
    bool a = false, l = true;
    for (int r = r0 + static_cast<int>(threadIdx.x) / 32; r < r1; r += kListThreads / 32) {
        for (int c = c0 + static_cast<int>(threadIdx.x) % 32; c < c1; c += 32) {
            const bool v = m.bool_mask(r, c);
            a = a || v;
            l = l && v;
        }
    }
    any = __syncthreads_or(a) != 0;
    all = __syncthreads_and(l) != 0;
}

// Batch row b's ids (null where not given), and their outer / inner sides: the rows of an outer block are
// queries, keys when transposed.
template <bool kTransposed>
struct BatchIds {
    const int *q_seg, *k_seg, *q_blk, *k_blk;
    __device__ __forceinline__ BatchIds(const AttnParams& p, int b)
        : q_seg(p.q_segment_ids == nullptr ? nullptr : p.q_segment_ids + b * p.q_segment_batch_stride),
          k_seg(p.k_segment_ids == nullptr ? nullptr : p.k_segment_ids + b * p.k_segment_batch_stride),
          q_blk(p.q_block_ids == nullptr ? nullptr : p.q_block_ids + b * p.q_block_batch_stride),
          k_blk(p.k_block_ids == nullptr ? nullptr : p.k_block_ids + b * p.k_block_batch_stride) {}
    __device__ __forceinline__ const int* outer_seg() const { return kTransposed ? k_seg : q_seg; }
    __device__ __forceinline__ const int* outer_blk() const { return kTransposed ? k_blk : q_blk; }
    __device__ __forceinline__ const int* inner_seg() const { return kTransposed ? q_seg : k_seg; }
    __device__ __forceinline__ const int* inner_blk() const { return kTransposed ? q_blk : k_blk; }
};

// The classes of inner blocks chunk + threadIdx.x (kSkipTile past the last) of outer block `outer` in batch row
// bm under mask head mh: from the ranges, then the bool mask's bytes where those did not skip. CTA-wide (it has
// barriers): every thread calls it with the same arguments. `sorted`: cleared unless this thread's inner ids
// never decrease (IdRanges).
template <int kOuter, int kInner, bool kTransposed>
__device__ __forceinline__ int tile_class(const AttnParams& params, int bm, int mh, int outer, int chunk, int* s_cls,
                                          bool& sorted) {
    constexpr int kQRows = kTransposed ? kInner : kOuter;  // rows of a query block, keys of a key block
    constexpr int kKRows = kTransposed ? kOuter : kInner;
    const SeqInfo seq(params, bm, mh * params.mask_head_div);
    const GeneralMaskOf<true> m(params, seq);
    const int outer_len = kTransposed ? m.seqlen_k : m.seqlen_q;  // this sequence's lengths
    const int inner_len = kTransposed ? m.seqlen_q : m.seqlen_k;
    const int n_inner = ceil_div(inner_len, kInner);
    const int o0 = outer * kOuter, o1 = min(o0 + kOuter, outer_len);
    if (o0 >= outer_len) return kSkipTile;  // past a shorter packed sequence (uniform)
    const BatchIds<kTransposed> batch_ids(params, bm);
    const int* inner_seg = batch_ids.inner_seg();
    const int* inner_blk = batch_ids.inner_blk();
    // The outer block's id ranges, once.
    TileIds ids{};
    if (batch_ids.outer_seg()) (kTransposed ? ids.k_seg : ids.q_seg) = block_id_range(batch_ids.outer_seg(), o0, o1);
    if (batch_ids.outer_blk()) (kTransposed ? ids.k_blk : ids.q_blk) = block_id_range(batch_ids.outer_blk(), o0, o1);
    // Tile i's rows [r0, r1) x keys [c0, c1), inside the sequences.
    auto bounds = [&](int i, int& r0, int& r1, int& c0, int& c1) {
        const int i0 = i * kInner, i1 = min(i0 + kInner, inner_len);
        r0 = kTransposed ? i0 : o0, r1 = kTransposed ? i1 : o1;
        c0 = kTransposed ? o0 : i0, c1 = kTransposed ? o1 : i1;
    };
    const int i = chunk + static_cast<int>(threadIdx.x);
    int cls = kSkipTile;
    if (i < n_inner) {
        const int i0 = i * kInner, i1 = min(i0 + kInner, inner_len);
        TileIds tile = ids;
        if (inner_seg != nullptr) {
            (kTransposed ? tile.q_seg : tile.k_seg) = id_range(inner_seg, i0, i1, inner_len, sorted);
        }
        if (inner_blk != nullptr) {
            (kTransposed ? tile.q_blk : tile.k_blk) = id_range(inner_blk, i0, i1, inner_len, sorted);
        }
        int r0, r1, c0, c1;
        bounds(i, r0, r1, c0, c1);
        const bool tail = r0 + kQRows > m.seqlen_q || c0 + kKRows > m.seqlen_k;
        cls = classify(m, r0, r1, c0, c1, tail, tile);
    }
    if (params.mask != nullptr) {
        // The bool mask refines the tiles the ranges did not skip: none of its bytes set -> skip; full
        // only if every byte is set too. The CTA reads one tile at a time.
        s_cls[threadIdx.x] = cls;
        __syncthreads();
        const int here = min(kListThreads, n_inner - chunk);
        for (int t = 0; t < here; ++t) {
            const int c = s_cls[t];  // uniform
            if (c == kSkipTile) continue;
            int r0, r1, c0, c1;
            bounds(chunk + t, r0, r1, c0, c1);
            bool any, all;
            mask_any_all(m, r0, r1, c0, c1, any, all);  // its barriers order every read of s_cls[t] first
            if (threadIdx.x == 0) s_cls[t] = !any ? kSkipTile : (c == kFullTile && all ? kFullTile : kPartialTile);
        }
        __syncthreads();
        cls = s_cls[threadIdx.x];
    }
    return cls;
}

// Whether the dK / dV lists are unions over the contributors of a dbias slice: the deterministic backward's
// dbias adds into a bias broadcast over the batch and / or the heads take turns (cuflash/dbias_order.cuh), and
// each contributor must visit the same tiles. Ids differ by batch row, a bool mask by batch row and head; the
// union over the batch rows (a bias broadcast over them) and the mask heads (a bias shared by several heads)
// gives every contributor one list, its own skipped tiles in it as partial ones (the mask hides every pair).
// The query blocks' lists (not transposed) are united too where they rank the ordered dQ adds of such a plan
// (dq_order.cuh: a CTA walking a united tile adds its zero dQ there, in its rank); a dQ kernel's own lists are not.
template <bool kTransposed>
__device__ __forceinline__ bool union_lists(const AttnParams& p) {
    return dbias_order::enabled(p) && (kTransposed || (p.dq_order_offset != 0 && p.dq_ordered != 0)) &&
           (p.q_segment_ids != nullptr || p.q_block_ids != nullptr || p.mask != nullptr);
}

// (The minimum of one block per SM lets ptxas use the registers it needs, 80 / 103 (transposed) under NVRTC
// 13.0: without it, its occupancy heuristic held the transposed lists to 40 and spilled 32 bytes once the lengths
// became per sequence.)
template <int kOuter, int kInner, bool kTransposed>
__global__ void __launch_bounds__(kListThreads, 1) flash_block_lists_kernel(const AttnParams params) {
    const int outer = blockIdx.x, b = blockIdx.z;
    if (!kTransposed && outer == 0 && blockIdx.y == 0 && b == 0 && threadIdx.x == 0) {
        *fwd_tile_counter(params) = 0;  // the warp-specialized forward's queue, after every list row
    }
    // grid y: the mask's list heads
    const SeqInfo seq(params, b, blockIdx.y * params.mask_head_div);
    const GeneralMaskOf<true> m(params, seq);
    const int outer_len = kTransposed ? m.seqlen_k : m.seqlen_q;  // this sequence's lengths
    const int inner_len = kTransposed ? m.seqlen_q : m.seqlen_k;
    const int n_inner = ceil_div(inner_len, kInner);
    int* row = const_cast<int*>(kTransposed ? m.q_list(outer) : m.kv_list(outer));
    const int o0 = outer * kOuter, o1 = min(o0 + kOuter, outer_len);
    if (o0 >= outer_len) {  // past a shorter packed sequence: no kernel reads this row, but keep it defined
        if (threadIdx.x == 0) row[0] = 0;
        return;
    }
    // This batch's ids (null when not given), for the id ranges below.
    const BatchIds<kTransposed> batch_ids(params, b);
    const int* outer_seg = batch_ids.outer_seg();
    const int* outer_blk = batch_ids.outer_blk();
    const int* inner_seg = batch_ids.inner_seg();
    const int* inner_blk = batch_ids.inner_blk();
    bool inner_sorted = true;  // this thread's inner blocks' ids nondecreasing (IdRanges)
    // The union's members (union_lists): every batch row where the bias is broadcast over them, every mask
    // head where one bias head serves several query heads.
    const bool unite = union_lists<kTransposed>(params);
    const int batches = unite && dbias_order::slice_spans_batch(params) ? params.batch : 1;
    const int heads = unite && dbias_order::slice_spans_heads(params) ? params.mask_heads : 1;

    __shared__ int s_counts[kListThreads / 32];
    __shared__ int s_cls[kListThreads];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int base = 0;
    for (int chunk = 0; chunk < n_inner; chunk += kListThreads) {  // uniform trip count
        const int i = chunk + static_cast<int>(threadIdx.x);
        int cls = tile_class<kOuter, kInner, kTransposed>(params, b, blockIdx.y, outer, chunk, s_cls, inner_sorted);
        for (int bm = 0; bm < batches; ++bm) {
            for (int mh = 0; mh < heads; ++mh) {
                const int bu = batches > 1 ? bm : b, mu = heads > 1 ? mh : static_cast<int>(blockIdx.y);
                if (bu == b && mu == static_cast<int>(blockIdx.y)) continue;  // this row's own, above
                bool ignored = true;
                const int other = tile_class<kOuter, kInner, kTransposed>(params, bu, mu, outer, chunk, s_cls, ignored);
                cls = cls == other ? cls : kPartialTile;  // skipped only if skipped by all, full only if full for all
            }
        }
        // Compact the visited blocks in ascending order: a warp's ballot, then the warps before it.
        const unsigned visited = __ballot_sync(0xffffffffu, cls != kSkipTile);
        if (lane == 0) s_counts[warp] = __popc(visited);
        __syncthreads();
        int offset = base, total = 0;
#pragma unroll
        for (int w = 0; w < kListThreads / 32; ++w) {
            offset += w < warp ? s_counts[w] : 0;
            total += s_counts[w];
        }
        if (cls != kSkipTile) {
            row[1 + offset + __popc(visited & ((1u << lane) - 1u))] = (i << 1) | (cls == kPartialTile ? 1 : 0);
        }
        base += total;
        __syncthreads();  // s_counts is rewritten by the next chunk
    }
    if (threadIdx.x == 0) row[0] = base;

    // The id ranges (params.cuh, IdRanges): per batch, whether the inner ids are sorted (every CTA of the
    // batch scanned them all above); then each outer row's range of inner rows by its ids, by binary search
    // (the ids are L1-resident after the scan). Ids are per batch, so the first mask head's CTAs write them.
    if ((outer_seg != nullptr || outer_blk != nullptr) && blockIdx.y == 0) {
        const bool sorted = __syncthreads_and(inner_sorted) != 0;
        const IdRanges out = kTransposed ? q_id_ranges(params) : kv_id_ranges(params);
        if (outer == 0 && threadIdx.x == 0) const_cast<int*>(out.flags)[b] = sorted ? 1 : 0;
        if (sorted) {
            const int outer_rows = kTransposed ? params.seqlen_k : params.seqlen_q;  // batched: every batch's
            int2* ranges = const_cast<int2*>(out.ranges) + static_cast<long long>(b) * outer_rows;
            for (int r = o0 + static_cast<int>(threadIdx.x); r < o1; r += kListThreads) {
                int lo = 0, hi = inner_len;
                if (outer_seg != nullptr) {  // the run of inner rows with the same id
                    const int id = __ldg(outer_seg + r);
                    lo = bound<false>(inner_seg, inner_len, id);
                    hi = bound<true>(inner_seg, inner_len, id);
                }
                if (outer_blk != nullptr) {
                    const int id = __ldg(outer_blk + r);
                    if (kTransposed) {
                        lo = max(lo, bound<false>(inner_blk, inner_len, id));  // queries with q_blk >= k_blk
                    } else {
                        hi = min(hi, bound<true>(inner_blk, inner_len, id));  // keys with k_blk <= q_blk
                    }
                }
                ranges[r] = make_int2(lo, max(lo, hi));
            }
        }
    }
}

}  // namespace cuflash
