// The one parameter block every cuflash kernel receives, by value.
//
// cuflash/params.py builds its numpy mirror by reading the field list of this struct, so the
// field order here is the single source of truth; CUFLASH_PARAMS_BYTES (the mirror's size,
// passed by the build layer) is checked below so a drifted mirror fails to compile.
//
// Layout conventions (all strides in elements, not bytes):
//   q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), o (B, Sq, H, Dv): "bshd", the last
//   dimension contiguous, every other stride free. dout/dq/dk/dv mirror o/q/k/v.
//   lse, dlse (B, H, Sq) fp32 with rows contiguous; softmax_d and lse_log2 (B, H, Sq) fp32 contiguous.
//   Scratch buffers are contiguous and padded to the variant's head-dim bucket kHeadDim:
//   dq_accum (B, H, Sq, kHeadDim), dk_accum (B, H, Sk, kHeadDim), dv_accum (B, H, Sk, kHeadDim).
//   Packed sequences (cu_seqlens_q / cu_seqlens_k set): q / o / dout / dq (Tq, H, D) and k / v / dk / dv
//   (Tk, Hkv, D), whose batch strides the host sets to their row strides (SeqInfo's batch index is then the
//   sequence's first packed row); lse / dlse (H, Tq) with batch stride 1; the scratch drops the batch dim:
//   softmax_d / lse_log2 (H, Tq), dq_accum (H, Tq, kHeadDim), dk_accum / dv_accum (H or slots, Tk, kHeadDim).
#pragma once

namespace cuflash {


struct AttnParams {
    // Forward operands.
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;
    // Backward operands.
    const void* dout;
    void* dq;
    void* dk;
    void* dv;
    float* dq_accum;    // fp32 dQ accumulator (unscaled), or null
    float* dk_accum;    // fp32 dK partials, one per dkdv_heads query heads, when those are fewer than
                        // a GQA group; else null (dK/dV go straight to dk / dv)
    float* dv_accum;    // fp32 dV partials, the same way
    float* softmax_d;   // rowsum(dO * O) - dlse, written by the backward pre-pass
    float* lse_log2;    // lse in the exp2 domain (lse_log2_offset), written by the pre-pass for the dK/dV kernels
    const float* dlse;  // gradient flowing into lse, or null
    // Score options (null / 0 when off; cuflash/kernels/*.py select the variants that read them).
    const int* q_segment_ids;   // (B, Sq) int32, rows contiguous: query i sees key j only if ids are equal
    const int* k_segment_ids;   // (B, Sk)
    const int* q_block_ids;     // (B, Sq): block-causal, query i sees key j only if k_id <= q_id
    const int* k_block_ids;     // (B, Sk)
    const float* alibi_slopes;  // (H,) or (B, H) fp32: adds -slope * |i + Sk - Sq - j|
    // Per-block visit lists of the general mask (written by flash_block_lists_kernel, block_lists.cu):
    // row (b, outer block) = [count, entries...], entry = (inner block << 1) | partial, ascending.
    int* kv_blocks;             // per query block: the key blocks it visits
    int* q_blocks;              // per key block: the query blocks that visit it (dK / dV kernels)
    // Additive score bias (B|1, H|Hkv|1, Sq|1, Sk|1) in q's dtype, added after the softcap (score-modifier
    // variants with kBias). Its gradient goes to exactly one of: dbias (q's dtype, each element written
    // once: bias has no broadcast dim) or dbias_accum (fp32, atomically summed over the broadcast dims;
    // the host zeroes it and converts it). Both are laid out contiguously in bias's own shape.
    const void* bias;
    void* dbias;
    float* dbias_accum;
    // Boolean mask (B|1, H|Hkv|1, Sq|1, Sk|1), one byte per element, nonzero = attend (the general mask).
    const unsigned char* mask;
    // Variable-length (packed) sequences, or null (the batched layout): int32 (batch + 1,) row offsets into
    // the packed q-side (total_q rows) and k-side (total_k rows) tensors; seqlen_q / seqlen_k are then the
    // longest lengths (the grid's). cuflash/seqlen.cuh turns them into each sequence's rows.
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    // Dropout's seed in device memory (a framework's traced / captured seed), or null: then dropout_seed.
    const unsigned long long* dropout_seed_ptr;
    // KV cache (attention_with_kvcache, cuda_src/flash_kvcache.cu): k / v above are the caches, dense
    // (B, L, Hkv, D) or paged (num_pages, page_size, Hkv, D), whose batch stride is then the page stride.
    const int* cache_seqlens;  // (B,) tokens already cached; batch b attends to its first cache_seqlens[b] +
                               // seqlen_new keys (clamped to kv_capacity)
    const int* block_table;    // (B, max_pages) page ids (paged cache), or null (dense)
    const void* k_new;         // (B, Snew, Hkv, D): written into the cache at cache_seqlens[b] ... by the
    const void* v_new;         //   append kernel (flash_kvcache_append.cu), before the attention kernel
    float* o_accum;            // split-KV partials: (num_splits, B, H, Sq, Dv) normalized fp32 outputs ...
    float* lse_accum;          //   ... and (num_splits, B, H, Sq) their lse, merged by the combine kernel

    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long do_batch_stride, do_row_stride, do_head_stride;
    long long dq_batch_stride, dq_row_stride, dq_head_stride;
    long long dk_batch_stride, dk_row_stride, dk_head_stride;
    long long dv_batch_stride, dv_row_stride, dv_head_stride;
    long long lse_batch_stride, lse_head_stride;
    long long dlse_batch_stride, dlse_head_stride;
    long long q_segment_batch_stride, k_segment_batch_stride, q_block_batch_stride, k_block_batch_stride;
    long long alibi_batch_stride;  // 0 for (H,) slopes
    // bias element (b, h, i, j) = bias[b * batch + (h / bias_head_div) * head + i * row + j * bias_col_stride]
    // (stride 0 along a broadcast dim); the same index with the dbias strides for dbias / dbias_accum.
    long long bias_batch_stride, bias_head_stride, bias_row_stride;
    long long dbias_batch_stride, dbias_head_stride, dbias_row_stride;
    long long mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;  // 0 along broadcast dims
    long long block_table_batch_stride;
    long long knew_batch_stride, knew_row_stride, knew_head_stride;
    long long vnew_batch_stride, vnew_row_stride, vnew_head_stride;

    int batch;
    int seqlen_q;
    int seqlen_k;
    int num_heads;
    int num_heads_k;
    int head_dim;       // runtime D   (<= the variant's kHeadDim bucket)
    int head_dim_v;     // runtime Dv  (<= the variant's kHeadDim bucket)
    int h_per_kv;       // num_heads / num_heads_k
    int dkdv_heads;     // query heads one dK/dV CTA accumulates (a divisor of h_per_kv; the plan picks it)
    int total_q, total_k;  // packed rows of the q-side / k-side tensors (with cu_seqlens; else unused)
    // (causal_offset below: a sequence's seqlen_k - seqlen_q, SeqInfo::causal_offset; query i sees key j
    // under causal iff j <= i + causal_offset)
    int window_left;    // general mask: query i sees key j only if -window_left <= j - i - causal_offset
    int window_right;   //   <= window_right (causal folds in as window_right <= 0; 1 << 30 = unbounded)
    int kv_blocks_rows, kv_blocks_stride;  // query blocks per batch in kv_blocks, ints per list row
    int q_blocks_rows, q_blocks_stride;    // key blocks per batch in q_blocks, ints per list row
    int bias_head_div;  // query heads per bias head: 1 (H heads), h_per_kv (Hkv heads) or any (1 head)
    int bias_col_stride, dbias_col_stride;  // 1, or 0 when bias broadcasts over the keys
    int bias_staged;    // 1: 16-byte bias rows (bias.cuh): the mainloops that can copy its tiles to shared memory
    int mask_heads;     // heads of the bool mask's block lists: 1 (no mask, or one shared by all heads), Hkv or H
    int mask_head_div;  // query heads per mask head (num_heads / mask_heads)
    // The fp32 scratch's rows (SeqInfo::q_scratch_row / k_scratch_row): row r of head (or partial slot) h of the
    // batch index bq / bk is bq * batch + h * head + r: (B, heads, S) batched, (heads, T) packed (the plan
    // sets them: the k side's heads are the query heads or the dK/dV partial slots).
    int q_scratch_batch_stride, q_scratch_head_stride, k_scratch_batch_stride, k_scratch_head_stride;
    // KV cache: appended tokens per batch (0 without k_new), the keys a batch can hold (L, or max_pages *
    // page_size), the page size (0: dense), the pages of the cache (page ids are clamped below it) and the
    // split-KV factor (1: no split; the attention kernel then writes o / lse itself).
    int seqlen_new, kv_capacity, page_size, num_pages, num_splits;
    float scale;        // softmax scale applied to q.k
    float scale_log2;   // scale * log2(e), folded into exp2
    float softcap;      // > 0: s = softcap * tanh(s / softcap) (score-modifier variants); 0 = off
    // Dropout (the mask kinds with dropout, cuflash/dropout.cuh): keep (b, h, i, j) iff its uniform >= threshold;
    // kept probabilities scaled by rp = 1 / (1 - dropout_p); the Philox key is the seed (its 64 bits).
    unsigned dropout_threshold;
    float dropout_rp;
    long long dropout_seed;
    // The dQ adds' counters (cuflash/dq_order.cuh), one per (batch, query head, query block of the dK/dV tile):
    // their offset in floats from dq_accum (0: none), counters per (batch, query head), query rows per counter,
    // and what they count: 1 the deterministic backward's ordered adds, 0 the default backward's claims.
    long long dq_order_offset;
    int dq_order_blocks;
    int dq_order_rows;
    int dq_ordered;
    int bias_tma;  // 1: the launch's TmaParams hold the bias's tensor map (the warp-specialized sm_90a kernels
                   // then load its staged tiles by TMA: cuflash/tma_sm90.cuh)
    int qkv_tma;   // 1: they hold q's, k's and v's (the warp-specialized forward then loads Q / K / V by TMA)
    // The deterministic backward's ordered dbias adds (cuflash/dbias_order.cuh), for a bias broadcast over the
    // batch and / or the heads only: int counters after dbias_accum's elements, one per (bias slice, query block,
    // key block) of the dK/dV tile: their offset in floats from dbias_accum (0: unordered atomics), and the
    // query / key blocks per slice.
    long long dbias_order_offset;
    int dbias_order_qblocks;
    int dbias_order_kblocks;
    // The deterministic backward's sums of a key bias (broadcast over the query rows): dbias_accum then holds
    // partials (B, H, slots, Sk) fp32 (BiasView::add_grad_over_queries / store_grad<true>), each written by one
    // thread, which the host sums in a fixed order. Their strides beyond dbias_head_stride (per bias head): of
    // the query head within its bias head (h % bias_head_div) and of the slot; 0 and 0 otherwise.
    long long dbias_qhead_stride, dbias_slot_stride;
};

// The warp-specialized forward's tile counter under the general mask: the int after the query-block lists
// (cuflash/kernels/block_lists.py), zeroed by their pre-pass.
__device__ __forceinline__ int* fwd_tile_counter(const AttnParams& p) {
    return p.kv_blocks + static_cast<long long>(p.batch) * p.mask_heads * p.kv_blocks_rows * p.kv_blocks_stride;
}

// The id ranges the general mask's pre-pass writes after a list buffer's rows (batched layout only; the
// packed one has no ids): first `batch` ints, one flag per batch (1: the ids the lists' inner blocks index,
// k's for kv_blocks and q's for q_blocks, are nondecreasing in that batch row), then, from the next even int,
// an int2 per outer row (b * S + i, S = seqlen_q for kv_blocks, seqlen_k for q_blocks): the half-open range of
// inner rows whose ids let outer row i see them, written only where the flag is 1 (block_lists.cu,
// cuflash/kernels/block_lists.py sizes the buffer). With sorted ids, "q_seg[i] == k_seg[j]" and "k_blk[j] <=
// q_blk[i]" hold on one interval of j (and of i for a fixed j), so the mask tests two bounds per score
// instead of reading ids (GeneralMaskOf).
struct IdRanges {
    const int* flags;
    const int2* ranges;
};
__device__ __forceinline__ IdRanges id_ranges(const int* lists_end, int batch) {
    const int* flags = lists_end;
    // Even offset from the buffer's start: its lists and counter hold an even or odd count of ints, so
    // align the address itself (the allocation is 256-byte aligned and the host sizes one int of slack).
    const unsigned long long after = reinterpret_cast<unsigned long long>(flags + batch);
    return {flags, reinterpret_cast<const int2*>((after + 7ull) & ~7ull)};
}
// kv_blocks' ranges (per query row: keys), after its rows and the forward's tile counter.
__device__ __forceinline__ IdRanges kv_id_ranges(const AttnParams& p) {
    return id_ranges(fwd_tile_counter(p) + 1, p.batch);
}
// q_blocks' ranges (per key: queries), after its rows.
__device__ __forceinline__ IdRanges q_id_ranges(const AttnParams& p) {
    return id_ranges(p.q_blocks + static_cast<long long>(p.batch) * p.mask_heads * p.q_blocks_rows * p.q_blocks_stride,
                     p.batch);
}

#ifdef CUFLASH_PARAMS_BYTES
static_assert(sizeof(AttnParams) == CUFLASH_PARAMS_BYTES,
              "AttnParams and its numpy mirror in cuflash/params.py disagree");
#endif

}  // namespace cuflash

// CUFLASH_CHECK_SMEM_BYTES(kSmemBytes), in the body of each kernel with dynamic shared memory: the
// build layer compiles every variant with -DCUFLASH_EXPECTED_SMEM_BYTES=<the plan's smem_bytes> (the
// bytes the launch provides, a formula in cuflash/kernels/*.py), so a plan formula that drifted from
// the kernel's layout fails the compile, on the CPU, instead of trapping on a GPU. Each NVRTC program
// instantiates one kernel, so the one define always belongs to the kernel being checked.
#define CUFLASH_STRINGIFY_(x) #x
#define CUFLASH_STRINGIFY(x) CUFLASH_STRINGIFY_(x)
#ifdef CUFLASH_EXPECTED_SMEM_BYTES
#define CUFLASH_CHECK_SMEM_BYTES(expr)                                                             \
    static_assert(static_cast<long long>(expr) ==                                                  \
                      static_cast<long long>(CUFLASH_EXPECTED_SMEM_BYTES),                         \
                  "kSmemBytes differs from the plan's smem_bytes (cuflash/kernels/*.py): "         \
                  "CUFLASH_EXPECTED_SMEM_BYTES=" CUFLASH_STRINGIFY(CUFLASH_EXPECTED_SMEM_BYTES))
#else
#define CUFLASH_CHECK_SMEM_BYTES(expr)
#endif
