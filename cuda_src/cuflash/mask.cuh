// Which (query, key) pairs are visible, for every mainloop.
//
// Written against the accumulator contract of cuflash/fragment.cuh. Masks are applied only to tiles that
// can contain an invisible pair (see needs_mask), so the common interior tile pays nothing.
//
// The policies, picked by the kernels' kMask template argument (MaskKind):
//   kNoMask           AttnMask<false>: only the end of the keys;
//   kCausalMask       AttnMask<true>: bottom-right causal, with analytic block ranges;
//   kGeneralMask      GeneralMaskOf<false>: causal and window (runtime), segment ids and block ids; the blocks
//                     to visit and whether each needs the per-element test come from per-block lists a
//                     pre-pass builds (block_lists.cu), so tiles no pair of which is visible are never loaded;
//   kGeneralBoolMask  GeneralMaskOf<true>: the same plus a bool mask (params.mask), read per element on the
//                     tiles the lists call partial;
//   kGeneralDropoutMask, kGeneralBoolDropoutMask: the two general kinds with dropout on the probabilities
//                     (cuflash/dropout.cuh picks DropoutOf<mask_has_dropout(kMask)>; the mask itself is the same).
// Every policy has visible(row, col) and the two apply forms (MaskTiles), and
// needs_mask(row0, rows, col0, cols): whether a tile may hold an invisible pair, refined by the block
// lists' partial flag where a policy has lists (the callers ask the lists for the general mask and
// needs_mask for the analytic ones).
#pragma once

#include "cuflash/numeric.cuh"
#include "cuflash/fragment.cuh"
#include "cuflash/params.cuh"
#include "cuflash/seqlen.cuh"

namespace cuflash {

enum MaskKind : int {
    kNoMask = 0,
    kCausalMask = 1,
    kGeneralMask = 2,
    kGeneralBoolMask = 3,
    kGeneralDropoutMask = 4,
    kGeneralBoolDropoutMask = 5,
};
__host__ __device__ constexpr bool is_general_mask(int kind) { return kind >= kGeneralMask; }
__host__ __device__ constexpr bool mask_has_bool(int kind) {
    return kind == kGeneralBoolMask || kind == kGeneralBoolDropoutMask;
}
__host__ __device__ constexpr bool mask_has_dropout(int kind) { return kind >= kGeneralDropoutMask; }

// What a policy reads once per block for its tile forms (key_spans / row_spans): nothing, unless the policy
// has spans (GeneralMaskOf's KeySpans / RowSpans, below).
struct NoSpans {};

// The apply forms every policy shares, written against its visible(row, col).
template <typename Policy>
struct MaskTiles {
    __device__ __forceinline__ const Policy& self() const { return *static_cast<const Policy*>(this); }

    // The per-block state of apply / apply_transposed (the policies without one: none; the forms read as before).
    __device__ __forceinline__ NoSpans key_spans(int, int) const { return {}; }
    __device__ __forceinline__ NoSpans row_spans(int) const { return {}; }
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply_spans(float (&acc)[kMTiles][kNTiles][4], const NoSpans&, int row0,
                                                int col0) const {
        self().apply(acc, row0, col0);
    }
    template <int kNTiles>
    __device__ __forceinline__ void apply_transposed_spans(float (&acc)[kNTiles][4], const NoSpans&, int key_row,
                                                           int query_col, int rows_valid) const {
        self().apply_transposed(acc, key_row, query_col, rows_valid);
    }

    // Sets invisible scores of a C-fragment tile to -inf.
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply(float (&acc)[kMTiles][kNTiles][4], int row0, int col0) const {
        for_each_score(acc, row0, col0, [&](float& x, int row, int col, int, int, int) {
            if (!self().visible(row, col)) x = -INFINITY;
        });
    }

    // The transposed form (the dK/dV kernels' S^T), which also hides queries >= rows_valid (the backward's
    // zero-filled rows past Sq carry no lse to zero them).
    template <int kNTiles>
    __device__ __forceinline__ void apply_transposed(float (&acc)[kNTiles][4], int key_row, int query_col,
                                                     int rows_valid) const {
        for_each_score_transposed(acc, key_row, query_col, [&](float& x, int query, int key, int, int) {
            const bool ok = (query < rows_valid) & self().visible(query, key);
            x = ok ? x : -INFINITY;
        });
    }
};

template <bool kIsCausal>
struct AttnMask : MaskTiles<AttnMask<kIsCausal>> {
    int seqlen_q;
    int seqlen_k;
    int causal_offset;  // seqlen_k - seqlen_q (bottom-right aligned causal)

    __device__ __forceinline__ AttnMask(const AttnParams&, const SeqInfo& seq)
        : seqlen_q(seq.seqlen_q), seqlen_k(seq.seqlen_k), causal_offset(seq.causal_offset()) {}

    __device__ __forceinline__ bool visible(int row, int col) const {
        if (col >= seqlen_k) return false;
        if (kIsCausal && col > row + causal_offset) return false;
        return true;
    }

    // Key blocks [n_begin, n_end) that query block m_block (rows [m_block*kBlockM, +kBlockM)) can see.
    // n_end <= n_begin means every row of the block sees nothing (output 0, lse -inf).
    template <int kBlockM, int kBlockN>
    __device__ __forceinline__ void key_block_range(int m_block, int& n_begin, int& n_end) const {
        n_begin = 0;
        n_end = ceil_div(seqlen_k, kBlockN);
        if (kIsCausal) {
            const int last_row = min((m_block + 1) * kBlockM, seqlen_q) - 1;
            const int last_col = last_row + causal_offset;  // last key the block's last row sees
            n_end = min(n_end, last_col < 0 ? 0 : last_col / kBlockN + 1);
        }
    }

    // Query blocks [m_begin, m_end) that see any key of key block n_block (for the backward).
    template <int kBlockM, int kBlockN>
    __device__ __forceinline__ void query_block_range(int n_block, int& m_begin, int& m_end) const {
        m_begin = 0;
        m_end = ceil_div(seqlen_q, kBlockM);
        if (kIsCausal) {
            const int first_row = n_block * kBlockN - causal_offset;  // first row seeing this block
            m_begin = first_row <= 0 ? 0 : first_row / kBlockM;
        }
    }

    // True when the tile [row0, row0+rows) x [col0, col0+cols) may contain an invisible pair.
    __device__ __forceinline__ bool needs_mask(int row0, int rows, int col0, int cols) const {
        if (col0 + cols > seqlen_k) return true;
        if (kIsCausal && col0 + cols - 1 > row0 + causal_offset) return true;
        return false;
    }
};

// A thread's two keys (key_row, key_row + 8) and the queries each is seen by, [lo, hi): what the transposed
// ranged form reads per key from the pre-pass (IdRanges) and cuts by the window. The keys stay the thread's for
// its whole key block, so a dK/dV mainloop reads them once there (key_spans) instead of at every partial step,
// where its three dependent global loads (the batch row's flag, two ranges) held a quarter of the partial steps'
// stall samples on 8 causal documents (ncu, H200, session 40; the documents' dK/dV kernel 445 -> 392 us).
struct KeySpans {
    int lo[2], hi[2];
    bool ranged;  // false: the ids are not sorted in this batch row; the form tests ids per element
};
// The same for the C-fragment form of a one-m-tile warp (the warp-specialized forward's consumers): a thread's
// two query rows (row0 + lane / 4, + 8) and the keys each sees, read once per query block (row_spans).
using RowSpans = KeySpans;

// Causal and window (runtime), segment ids, block ids and a bool mask. Query row i (< Sq) sees key j (< Sk) iff
//   -window_left <= j - i - causal_offset <= window_right   (causal: window_right <= 0, folded on the host)
//   and q_segment_ids[i] == k_segment_ids[j]   (when given)
//   and k_block_ids[j] <= q_block_ids[i]       (when given)
//   and mask[b, h, i, j] != 0                  (when given; the lists are then per mask head).
// Everything but the bool mask is per batch; with a per-head mask (head dim H or Hkv) the block lists have a
// row per mask head, `hm` (0 otherwise).
// Block ranges come from the pre-pass lists (ListKeyBlocks / ListQueryBlocks in block.cuh), which also
// say which blocks need the per-element test; needs_mask itself answers "maybe" everywhere.
// kBool: the variant that also reads a bool mask (kGeneralBoolMask); without it the per-element test has no
// mask term at all (the dK/dV kernels' registers are tight: an unused runtime branch on it spilled).
// kRanged: the tile forms (apply, apply_transposed) test each row's range of keys (each key's range of
// queries) where the ids are sorted or absent (IdRanges in params.cuh, written by the pre-pass), instead of
// the ids; MaskOf turns it off with a bool mask or dropout, whose variants spilled with it.
template <bool kBool, bool kRanged = !kBool>
struct GeneralMaskOf : MaskTiles<GeneralMaskOf<kBool, kRanged>> {
    // The scalars of the per-element test stay in registers (read once: a parameter read inside the loops
    // may be repeated after every barrier or asm fence); the id and list pointers are read from the
    // parameter block where used, since only the variants with ids need them.
    const AttnParams& p;
    int b, hm, seqlen_q, seqlen_k, causal_offset, window_left, window_right;
    bool has_seg, has_blk, has_bool;

    __device__ __forceinline__ GeneralMaskOf(const AttnParams& params, const SeqInfo& seq)
        : p(params), b(seq.b), hm(seq.h / params.mask_head_div), seqlen_q(seq.seqlen_q), seqlen_k(seq.seqlen_k),
          causal_offset(seq.causal_offset()), window_left(params.window_left), window_right(params.window_right),
          has_seg(params.q_segment_ids != nullptr), has_blk(params.q_block_ids != nullptr),
          has_bool(kBool && params.mask != nullptr) {}

    // The bool mask at (row, col), both inside the sequences (1 without a mask).
    __device__ __forceinline__ bool bool_mask(int row, int col) const {
        return __ldg(p.mask + b * p.mask_batch_stride + hm * p.mask_head_stride + row * p.mask_row_stride +
                     col * p.mask_col_stride) != 0;
    }

    __device__ __forceinline__ bool visible(int row, int col) const {
        return visible_ranges(row, col) && (!has_bool || bool_mask(row, col));
    }
    // Everything but the bool mask (the tile forms test that in a pass of its own, which keeps the
    // registers of the first pass as they were without a bool mask).
    __device__ __forceinline__ bool visible_ranges(int row, int col) const {
        if (row >= seqlen_q || col >= seqlen_k) return false;
        const int d = col - row - causal_offset;
        if (d < -window_left || d > window_right) return false;
        if (has_seg && __ldg(p.q_segment_ids + b * p.q_segment_batch_stride + row) !=
                           __ldg(p.k_segment_ids + b * p.k_segment_batch_stride + col)) {
            return false;
        }
        if (has_blk && __ldg(p.k_block_ids + b * p.k_block_batch_stride + col) >
                           __ldg(p.q_block_ids + b * p.q_block_batch_stride + row)) {
            return false;
        }
        return true;
    }
    __device__ __forceinline__ bool needs_mask(int, int, int, int) const { return true; }

    // The C-fragment form. Sorted ids (and no ids: a window is a range per row too) take the ranged form:
    // each row's [lo, hi) of keys, two compares per score (the ids' form read 32 column ids a thread and
    // tile, tested six ways each: 40% of the warp-specialized forward's consumer samples on 8 causal
    // documents, H200). Unsorted ids are read per element with one m-tile per warp (the wgmma forwards, the
    // dQ kernel; reading them by rows beside the ranged form spilled the dK/dV consumers, ptxas 13.0), and
    // by rows with several (mma.sync: the per-element form's loads, all hoisted ahead of the tests, spilled
    // 412 bytes against 88 at D64 128 x 128, and 28-40 more next to the ranged form).
    // Without kRanged (a bool mask or dropout) the ranged form is left out: beside it those variants spilled
    // 4-12 bytes more (sm_80, ptxas 13.0).
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply(float (&acc)[kMTiles][kNTiles][4], int row0, int col0) const {
        if (kRanged && ranged(kv_id_ranges(p))) {
            apply_ranged(acc, row0, col0);
        } else {
            apply_ids(acc, row0, col0);
        }
        apply_bool(acc, row0, col0);
    }

    // The same with the thread's row spans read beforehand (row_spans(row0), once per query block; one m-tile
    // per warp): per score only the two compares. Without kRanged there are no spans (NoSpans, above).
    __device__ __forceinline__ conditional_t<kRanged, RowSpans, NoSpans> row_spans(int row0) const {
        if constexpr (kRanged) {
            return read_spans(kv_id_ranges(p), row0 + threadIdx.x % 32 / 4,
                              [&](const IdRanges& r, int row) { return row_ids(r, row); },
                              [&](int2 ids, int row) { return row_cut(ids, row); });
        } else {
            return {};
        }
    }
    using MaskTiles<GeneralMaskOf<kBool, kRanged>>::apply_spans;
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply_spans(float (&acc)[kMTiles][kNTiles][4], const RowSpans& spans, int row0,
                                                int col0) const {
        static_assert(kMTiles == 1, "row spans hold one m-tile's two rows");
        if (spans.ranged) {
            const int col_base = col0 + (threadIdx.x % 32 % 4) * 2;
#pragma unroll
            for (int half = 0; half < 2; ++half) keep_span(acc[0], half, spans.lo[half] - col_base, spans.hi[half] - col_base);
        } else {
            apply_ids(acc, row0, col0);
        }
        apply_bool(acc, row0, col0);
    }

    // The transposed form (the dK/dV kernels' S^T: a thread's 2 keys as rows, kNTiles x 2 queries as
    // columns): ranged as above, per key its [lo, hi) of queries, else per element. Queries >= rows_valid
    // are hidden too (MaskTiles::apply_transposed).
    template <int kNTiles>
    __device__ __forceinline__ void apply_transposed(float (&acc)[kNTiles][4], int key_row, int query_col,
                                                     int rows_valid) const {
        if (kRanged && ranged(q_id_ranges(p))) {
            apply_transposed_ranged(acc, key_row, query_col, rows_valid);
        } else {
            MaskTiles<GeneralMaskOf<kBool, kRanged>>::apply_transposed(acc, key_row, query_col, rows_valid);
        }
    }

    // The same with the thread's key spans read beforehand (key_spans(key_row, rows_valid), once per key
    // block): per score only the two compares. Without kRanged there are no spans (NoSpans, above).
    __device__ __forceinline__ conditional_t<kRanged, KeySpans, NoSpans> key_spans(int key_row, int rows_valid) const {
        if constexpr (kRanged) {
            return read_spans(q_id_ranges(p), key_row,
                              [&](const IdRanges& r, int key) { return key_ids(r, key); },
                              [&](int2 ids, int key) { return key_cut(ids, key, rows_valid); });
        } else {
            return {};
        }
    }
    using MaskTiles<GeneralMaskOf<kBool, kRanged>>::apply_transposed_spans;
    template <int kNTiles>
    __device__ __forceinline__ void apply_transposed_spans(float (&acc)[kNTiles][4], const KeySpans& spans, int key_row,
                                                           int query_col, int rows_valid) const {
        if (spans.ranged) {
#pragma unroll
            for (int half = 0; half < 2; ++half) keep_span(acc, half, spans.lo[half] - query_col, spans.hi[half] - query_col);
        } else {
            MaskTiles<GeneralMaskOf<kBool, kRanged>>::apply_transposed(acc, key_row, query_col, rows_valid);
        }
    }

  private:
    // The spans of a thread's two positions (first, first + 8): both ids' ranges read (ids_of(r, position)) after
    // the batch row's flag, none where the row's ids are unsorted (the forms then test ids), then cut
    // (cut_of(ids, position)).
    template <typename IdsOf, typename CutOf>
    __device__ __forceinline__ KeySpans read_spans(const IdRanges& r, int first, IdsOf&& ids_of, CutOf&& cut_of) const {
        KeySpans spans;
        spans.ranged = ranged(r);
        int2 ids[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) ids[half] = spans.ranged ? ids_of(r, first + half * 8) : make_int2(0, 0);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int2 s = cut_of(ids[half], first + half * 8);
            spans.lo[half] = s.x;
            spans.hi[half] = s.y;
        }
        return spans;
    }

    // The ids' form of apply: per element with one m-tile per warp, by rows with several.
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply_ids(float (&acc)[kMTiles][kNTiles][4], int row0, int col0) const {
        if constexpr (kMTiles == 1) {
            for_each_score(acc, row0, col0, [&](float& x, int row, int col, int, int, int) {
                if (!visible_ranges(row, col)) x = -INFINITY;
            });
        } else {
            apply_by_rows(acc, row0, col0);
        }
    }
    // The bool mask's pass: scores still visible, inside the sequences, one mask byte each.
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply_bool(float (&acc)[kMTiles][kNTiles][4], int row0, int col0) const {
        if (has_bool) {
            for_each_score(acc, row0, col0, [&](float& x, int row, int col, int, int, int) {
                if (row < seqlen_q && col < seqlen_k && x != -INFINITY && !bool_mask(row, col)) x = -INFINITY;
            });
        }
    }

    // Whether the tile forms can test ranges instead of ids: always without ids (the window alone is a range
    // per row), and with ids where the pre-pass found them sorted in this batch (IdRanges, params.cuh).
    // Uniform across the CTA.
    __device__ __forceinline__ bool ranged(const IdRanges& r) const {
        return !(has_seg || has_blk) || __ldg(r.flags + b) != 0;
    }

    // The keys query row `row` sees form one range [lo, hi): its ids' range (when given) cut by the window
    // and the end of the keys; empty for a row past Sq. The queries key `key` is seen by, the same way (and
    // below rows_valid). (64-bit window arithmetic: window_left / right may be 1 << 30, "unbounded".)
    __device__ __forceinline__ int2 row_keys(const IdRanges& r, int row) const {
        return row_cut(row_ids(r, row), row);
    }
    __device__ __forceinline__ int2 key_queries(const IdRanges& r, int key, int rows_valid) const {
        return key_cut(key_ids(r, key), key, rows_valid);
    }
    // The two halves of those: the ids' range (a load), then its cut by the window (arithmetic only), so that
    // read_spans can issue a thread's two loads before either cut.
    __device__ __forceinline__ int2 row_ids(const IdRanges& r, int row) const {
        return ids_span(r, row, seqlen_q, p.seqlen_q);
    }
    __device__ __forceinline__ int2 row_cut(int2 ids, int row) const {
        // key j has j - row - offset = 0 on the diagonal
        return cut(ids, seqlen_k, static_cast<long long>(row) + causal_offset, window_left, window_right);
    }
    __device__ __forceinline__ int2 key_ids(const IdRanges& r, int key) const {
        return ids_span(r, key, seqlen_k, p.seqlen_k);
    }
    __device__ __forceinline__ int2 key_cut(int2 ids, int key, int rows_valid) const {
        // query i has key - i - offset = 0 on the diagonal
        return cut(ids, min(seqlen_q, rows_valid), static_cast<long long>(key) - causal_offset, window_right,
                   window_left);
    }
    // Position `pos` of one side (of `count`; the ids' rows `stride` apart per batch) sees [lo, hi) of the other
    // by its ids (everything without ids); nothing past `count` (an empty range, which the cut keeps empty: its
    // hi <= 0). A predicated load and no arithmetic on it, so that a thread's two reads issue together.
    __device__ __forceinline__ int2 ids_span(const IdRanges& r, int pos, int count, int stride) const {
        const bool inside = pos < count;
        if (!(has_seg || has_blk)) return make_int2(0, inside ? 0x7fffffff : 0);
        return inside ? __ldg(r.ranges + static_cast<long long>(b) * stride + pos) : make_int2(0, 0);
    }
    // [lo, hi) cut to the other side's `other` positions and to [diag - before, diag + after].
    static __device__ __forceinline__ int2 cut(int2 ids, int other, long long diag, int before, int after) {
        const int lo = static_cast<int>(max(static_cast<long long>(ids.x), diag - before));
        const int hi = static_cast<int>(min(static_cast<long long>(min(ids.y, other)), diag + after + 1));
        return make_int2(lo, max(lo, hi));
    }

    // The scores of one fragment row pair (`half`: the thread's rows 0-7 / 8-15 of a 16-row tile) outside
    // [lo, hi), counted from the thread's first column, to -inf: two compares against a constant per score.
    template <int kNTiles>
    static __device__ __forceinline__ void keep_span(float (&acc)[kNTiles][4], int half, int lo, int hi) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int k = nt * 8 + c;
                float& x = acc[nt][2 * half + c];
                x = (k >= lo) & (k < hi) ? x : -INFINITY;
            }
        }
    }

    // The ranged C-fragment form: per row its [lo, hi) moved to the thread's first column.
    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply_ranged(float (&acc)[kMTiles][kNTiles][4], int row0, int col0) const {
        const int lane = threadIdx.x % 32;
        const IdRanges r = kv_id_ranges(p);
        const int col_base = col0 + (lane % 4) * 2;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int2 keys = row_keys(r, row0 + mt * 16 + lane / 4 + half * 8);
                keep_span(acc[mt], half, keys.x - col_base, keys.y - col_base);
            }
        }
    }

    // The transposed one: per key its [lo, hi) of queries.
    template <int kNTiles>
    __device__ __forceinline__ void apply_transposed_ranged(float (&acc)[kNTiles][4], int key_row, int query_col,
                                                            int rows_valid) const {
        const IdRanges r = q_id_ranges(p);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int2 queries = key_queries(r, key_row + half * 8, rows_valid);
            keep_span(acc, half, queries.x - query_col, queries.y - query_col);
        }
    }

    template <int kMTiles, int kNTiles>
    __device__ __forceinline__ void apply_by_rows(float (&acc)[kMTiles][kNTiles][4], int row0, int col0) const {
        const int lane = threadIdx.x % 32;
        const bool seg = has_seg, blk = has_blk;
        int row[kMTiles][2], q_seg[kMTiles][2], q_blk[kMTiles][2];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = row0 + mt * 16 + lane / 4 + half * 8;
                const bool ok = r < seqlen_q;
                // A row past Sq is never stored (its Q row is zero-filled), so any answer is harmless there;
                // it skips the id loads and, with a bounded window_right, sees nothing.
                row[mt][half] = ok ? r : -(1 << 30);
                q_seg[mt][half] = seg && ok ? __ldg(p.q_segment_ids + b * p.q_segment_batch_stride + r) : 0;
                q_blk[mt][half] = blk && ok ? __ldg(p.q_block_ids + b * p.q_block_batch_stride + r) : 0;
            }
        }
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int col = col0 + nt * 8 + (lane % 4) * 2 + c;
                const bool col_ok = col < seqlen_k;
                int k_seg = 0, k_blk = 0;  // loaded under branches, so they are not all hoisted ahead
                if (seg && col_ok) k_seg = __ldg(p.k_segment_ids + b * p.k_segment_batch_stride + col);
                if (blk && col_ok) k_blk = __ldg(p.k_block_ids + b * p.k_block_batch_stride + col);
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int d = col - row[mt][half] - causal_offset;
                        const bool ok = col_ok & (d >= -window_left) & (d <= window_right) &
                                        (q_seg[mt][half] == k_seg) & (k_blk <= q_blk[mt][half]);
                        float& x = acc[mt][nt][2 * half + c];
                        x = ok ? x : -INFINITY;
                    }
                }
            }
        }
    }

  public:
    // This batch's list row of query block m (kv_blocks) or key block n (q_blocks).
    __device__ __forceinline__ const int* kv_list(int m) const { return kv_list_of(p, b, hm, m); }
    // The same row without a mask object (batch row b, mask head hm).
    static __device__ __forceinline__ const int* kv_list_of(const AttnParams& p, int b, int hm, int m) {
        return p.kv_blocks + ((static_cast<long long>(b) * p.mask_heads + hm) * p.kv_blocks_rows + m) * p.kv_blocks_stride;
    }
    __device__ __forceinline__ const int* q_list(int n) const {
        return p.q_blocks + ((static_cast<long long>(b) * p.mask_heads + hm) * p.q_blocks_rows + n) * p.q_blocks_stride;
    }
};

using GeneralMask = GeneralMaskOf<false>;

// The layouts a mask kind's kernels serve (seqlen.cuh): packed sequences run the general kinds.
template <int kMask>
using LayoutOf = LayoutTag<is_general_mask(kMask)>;

// kRangedMask: whether the general kinds without a bool mask or dropout take the ranged tile forms
// (GeneralMaskOf's kRanged); a kernel turns it off where it costs registers on every tile (FwdConfig, above D128).
template <int kMask, bool kRangedMask = true>
using MaskOf = conditional_t<is_general_mask(kMask),
                             GeneralMaskOf<mask_has_bool(kMask),
                                           kRangedMask && !mask_has_bool(kMask) && !mask_has_dropout(kMask)>,
                             AttnMask<kMask == kCausalMask>>;

}  // namespace cuflash
