// Sequence info: where one (batch, head)'s rows live, and how many there are. Every kernel forms its
// q / k / v / o / dout / dq / dk / dv / lse / dlse / softmax_d / fp32-scratch pointers and takes its
// sequence lengths through this struct and nowhere else, so the batched and the packed (varlen) layouts
// differ only here.
//
// It holds only indices and lengths (a few registers); the offsets are formed where a pointer is
// needed. Kernels that keep registers scarce build it from opaque copies of (b, h) inside their loops so
// nothing derived from it is hoisted and kept live (cuflash/dkdv_mainloop.cuh).
//
// Batched layout (cuda_src/cuflash/params.cuh): row r of (b, h) of q is
//   q + b * q_batch_stride + h * q_head_stride + r * q_row_stride,
// k / v / dk / dv use the kv head h_kv = h / h_per_kv (GQA / MQA: never materialized per query head).
// Packed layout (params.cu_seqlens_q / _k set): sequence b is rows [cu[b], cu[b+1]) of the packed tensors.
// The host sets each tensor's batch stride to its row stride, so the same formula holds with the batch
// index bq = cu_seqlens_q[b] (bk = cu_seqlens_k[b] on the key side) in place of b; the lengths are read per
// sequence, and the grid covers the longest (params.seqlen_q / seqlen_k), so a kernel's blocks past its own
// sequence's length return at once. The offsets are clamped into [0, total] and each length to the grid's,
// so offsets that break the contract (checked on the host only when it has them) never address memory
// outside the tensors. Bias, bool masks and id arrays index by b: the host refuses them with packed sequences.
#pragma once

#include "cuflash/params.cuh"

namespace cuflash {

// The layouts a kernel serves. A kernel built for the batched layout alone (LayoutTag<false>: the plain and
// causal mask kinds) takes its lengths and batch indices from the parameter block, constants the compiler
// re-reads where used; a packed-capable one (LayoutTag<true>: the general mask kinds, which packed calls run,
// and the small kernels every call shares) reads the offsets at run time. So packed sequences cost the
// batched-only kernels nothing (held in registers across their loops, the per-sequence lengths slowed the
// dK/dV kernel by 5% and spilled in some variants).
template <bool kPacked>
struct LayoutTag {
    static constexpr bool value = kPacked;
};
using AnyLayout = LayoutTag<true>;

struct SeqInfo {
    int b;         // batch (sequence) index
    int h;         // query head
    int h_kv;      // kv head of this query head
    int bq, bk;    // the batch index of the q-side / k-side tensors: b, or the sequence's first packed row
    int seqlen_q;  // rows of q / o / dout / dq / lse of this sequence
    int seqlen_k;  // rows of k / v / dk / dv of this sequence

    __device__ __forceinline__ SeqInfo(const AttnParams& p, int b_, int h_) : SeqInfo(p, b_, h_, AnyLayout()) {}
    template <bool kPacked>
    __device__ __forceinline__ SeqInfo(const AttnParams& p, int b_, int h_, LayoutTag<kPacked>)
        : b(b_), h(h_), h_kv(h_ / p.h_per_kv) {
        const int2 q_side = side<kPacked>(p.cu_seqlens_q, b_, p.total_q, p.seqlen_q);
        const int2 k_side = side<kPacked>(p.cu_seqlens_k, b_, p.total_k, p.seqlen_k);
        bq = q_side.x, seqlen_q = q_side.y, bk = k_side.x, seqlen_k = k_side.y;
    }

    // One side only, for loops that rebuild their pointers every step from opaque (b, h) (cuflash/
    // dkdv_mainloop.cuh): the query side (q / o / dout / dq / lse / dlse / softmax_d / dq_accum) or the key side
    // (k / v / dk / dv and their scratch). The other side's fields are 0, and its accessors must not be used;
    // the query side skips the h / h_per_kv division, each skips the other side's offsets.
    template <bool kPacked = true>
    static __device__ __forceinline__ SeqInfo query_side(const AttnParams& p, int b_, int h_) {
        SeqInfo s;
        const int2 q_side = side<kPacked>(p.cu_seqlens_q, b_, p.total_q, p.seqlen_q);
        s.b = b_, s.h = h_, s.h_kv = 0, s.bq = q_side.x, s.seqlen_q = q_side.y, s.bk = 0, s.seqlen_k = 0;
        return s;
    }
    template <bool kPacked = true>
    static __device__ __forceinline__ SeqInfo key_side(const AttnParams& p, int b_, int h_) {
        SeqInfo s;
        const int2 k_side = side<kPacked>(p.cu_seqlens_k, b_, p.total_k, p.seqlen_k);
        s.b = b_, s.h = h_, s.h_kv = h_ / p.h_per_kv, s.bq = 0, s.seqlen_q = 0, s.bk = k_side.x, s.seqlen_k = k_side.y;
        return s;
    }

    // The KV-cache kernel's (batch b, kv head h_kv) (cuda_src/flash_kvcache.cu): q / o / lse in the batched layout,
    // h the group's first query head (its query rows pack the group's heads, cuflash/kvcache.cuh); the keys are
    // the first cache_seqlens[b] + seqlen_new rows of the cache, clamped into [0, kv_capacity] (the cache's rows
    // may be paged: KvLoads forms those addresses, not k() / v()).
    static __device__ __forceinline__ SeqInfo kv_cache(const AttnParams& p, int b_, int h_kv_) {
        SeqInfo s;
        const int cached = min(max(__ldg(p.cache_seqlens + b_), 0), p.kv_capacity);
        s.b = b_, s.h = h_kv_ * p.h_per_kv, s.h_kv = h_kv_, s.bq = b_, s.bk = b_, s.seqlen_q = p.seqlen_q;
        s.seqlen_k = min(cached + p.seqlen_new, p.kv_capacity);
        return s;
    }

    // Bottom-right alignment: query i and key j are on the diagonal when j = i + causal_offset.
    __device__ __forceinline__ int causal_offset() const { return seqlen_k - seqlen_q; }

    // Row `row` of this (batch, head) of each bshd tensor (query-side rows for q / o / dout / dq, key-side
    // rows for k / v / dk / dv).
    template <typename Elem>
    __device__ __forceinline__ const Elem* q(const AttnParams& p, int row = 0) const {
        return static_cast<const Elem*>(p.q) + bq * p.q_batch_stride + h * p.q_head_stride + row * p.q_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ const Elem* k(const AttnParams& p, int row = 0) const {
        return static_cast<const Elem*>(p.k) + bk * p.k_batch_stride + h_kv * p.k_head_stride + row * p.k_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ const Elem* v(const AttnParams& p, int row = 0) const {
        return static_cast<const Elem*>(p.v) + bk * p.v_batch_stride + h_kv * p.v_head_stride + row * p.v_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ Elem* o(const AttnParams& p, int row = 0) const {
        return static_cast<Elem*>(p.o) + bq * p.o_batch_stride + h * p.o_head_stride + row * p.o_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ const Elem* dout(const AttnParams& p, int row = 0) const {
        return static_cast<const Elem*>(p.dout) + bq * p.do_batch_stride + h * p.do_head_stride +
               row * p.do_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ Elem* dq(const AttnParams& p, int row = 0) const {
        return static_cast<Elem*>(p.dq) + bq * p.dq_batch_stride + h * p.dq_head_stride + row * p.dq_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ Elem* dk(const AttnParams& p, int row = 0) const {
        return static_cast<Elem*>(p.dk) + bk * p.dk_batch_stride + h_kv * p.dk_head_stride + row * p.dk_row_stride;
    }
    template <typename Elem>
    __device__ __forceinline__ Elem* dv(const AttnParams& p, int row = 0) const {
        return static_cast<Elem*>(p.dv) + bk * p.dv_batch_stride + h_kv * p.dv_head_stride + row * p.dv_row_stride;
    }

    // lse of query row `row` (null when the caller asked for no lse), and the incoming dlse (may be null).
    __device__ __forceinline__ float* lse(const AttnParams& p, int row = 0) const {
        return p.lse == nullptr ? nullptr : p.lse + bq * p.lse_batch_stride + h * p.lse_head_stride + row;
    }
    __device__ __forceinline__ const float* lse_in(const AttnParams& p, int row = 0) const {
        return p.lse + bq * p.lse_batch_stride + h * p.lse_head_stride + row;
    }
    __device__ __forceinline__ const float* dlse(const AttnParams& p, int row = 0) const {
        return p.dlse + bq * p.dlse_batch_stride + h * p.dlse_head_stride + row;
    }

    // Contiguous fp32 scratch with a row per query (key) and `width` floats per row, for head (or partial
    // slot) `head`: (B, heads, S, width) batched, (heads, T, width) packed, through the plan's strides (so the
    // batched loops pay no test of the layout).
    // (32-bit: the host keeps every scratch tensor under 2^31 rows.)
    __device__ __forceinline__ long long q_scratch_row(const AttnParams& p, int head, int row) const {
        return bq * p.q_scratch_batch_stride + head * p.q_scratch_head_stride + row;
    }
    __device__ __forceinline__ long long k_scratch_row(const AttnParams& p, int head, int row) const {
        return bk * p.k_scratch_batch_stride + head * p.k_scratch_head_stride + row;
    }

    __device__ __forceinline__ float* softmax_d(const AttnParams& p, int row = 0) const {
        return p.softmax_d + q_scratch_row(p, h, row);
    }
    __device__ __forceinline__ float* lse_log2(const AttnParams& p, int row = 0) const {
        return p.lse_log2 + q_scratch_row(p, h, row);
    }
    __device__ __forceinline__ float* dq_accum(const AttnParams& p, int row, int width) const {
        return p.dq_accum + q_scratch_row(p, h, row) * width;
    }
    // Query head h's fp32 dK / dV (the SIMT backward's per-head partials).
    __device__ __forceinline__ float* dk_accum(const AttnParams& p, int width) const {
        return p.dk_accum + k_scratch_row(p, h, 0) * width;
    }
    __device__ __forceinline__ float* dv_accum(const AttnParams& p, int width) const {
        return p.dv_accum + k_scratch_row(p, h, 0) * width;
    }
    // Partial `slot` of this sequence: the tensor-core dK/dV kernel writes one per dkdv_heads query heads.
    __device__ __forceinline__ float* dk_accum_slot(const AttnParams& p, int width, int slot) const {
        return p.dk_accum + k_scratch_row(p, slot, 0) * width;
    }
    __device__ __forceinline__ float* dv_accum_slot(const AttnParams& p, int width, int slot) const {
        return p.dv_accum + k_scratch_row(p, slot, 0) * width;
    }

  private:
    __device__ __forceinline__ SeqInfo() {}

    // One side's (batch index, length): (b, the grid's length) batched; from the offsets when packed.
    template <bool kPacked>
    static __device__ __forceinline__ int2 side(const int* cu, int b_, int total, int longest) {
        return !kPacked || cu == nullptr ? make_int2(b_, longest) : span(cu, b_, total, longest);
    }

    // Sequence b's (first packed row, length) from a cu_seqlens array, clamped into [0, total] and to the
    // grid's longest length.
    static __device__ __forceinline__ int2 span(const int* cu, int b, int total, int longest) {
        const int s = min(max(__ldg(cu + b), 0), total);
        const int e = min(max(__ldg(cu + b + 1), s), total);
        return make_int2(s, min(e - s, longest));
    }
};

}  // namespace cuflash
