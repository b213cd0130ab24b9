// The additive score bias: where its elements live and how the kernels read them.
//
// params.bias (B|1, H|Hkv|1, Sq|1, Sk|1) in the input dtype, stride 0 along broadcast dims (params.cuh).
// Two ways to read element (row, col) of one (batch, head):
//   staged  the load side of a mainloop copies the (rows x keys) tile of each step into shared memory with
//           cp.async, in the cp.async group of the step's K tile (BiasTile::copy), and the score
//           modifier reads it there (BiasTileRef): the global latency hides behind the pipeline like K's.
//           Needs 16-byte rows: the keys contiguous, every stride a multiple of 8 elements (or 0) and a
//           16-byte aligned base; the host says so in params.bias_staged.
//   direct  an __ldg per element (a 32-bit load per column pair in the C-fragment walk), with indices
//           clamped into the sequence: any strides (a key-broadcast bias has column stride 0), and the
//           kernels that stage nothing (the deterministic dQ kernel, the fp32 SIMT kernels).
// Tiles are row-major [row][key] with a 16-byte pad per row: the C-fragment reads (8 rows x 4 column pairs
// per instruction) and the transposed ones (8 keys x 4 rows) then touch 32 distinct banks. The
// warp-specialized dK/dV mainloop stages its bias in the step's dS tile instead (BiasPanelTile: the same
// [row][key] order in the 128-byte-swizzled panels of cuflash/tile.cuh, no pad), where each warp later
// writes dS over exactly the elements it read.
// dbias: store_grad writes dS for one (row, col): a store where each dbias element has one writer (a bias
// with an element per score), an fp32 atomic add into params.dbias_accum where it broadcasts; neither where
// the caller wants no dbias (has_grad: both pointers null). Where the dK/dV kernels stage the step's dS in
// shared memory and it is dS itself, they write dbias from there instead (dbias_from_tile, DbiasOut below):
// whole 16-byte chunks stored, or added as fp32 (red.v4 on sm_90) for a bias broadcast over batch / heads.
#pragma once

#include "cuflash/mma_sm80.cuh"
#include "cuflash/params.cuh"
#include "cuflash/tile.cuh"
#include "cuflash/tma_sm90.cuh"

namespace cuflash {

// *dst += x in global memory, no result wanted: red.global. (NVRTC 13.0 compiles an atomicAdd(float*) whose
// result is unused to ATOMG with a discarded result, an atomic with a reply, and this to REDG.)
__device__ __forceinline__ void red_add(float* dst, float x) {
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(dst), "f"(x) : "memory");
}

// Two consecutive 16-bit elements (the first in the low half) as floats.
__device__ __forceinline__ float2 unpack_pair(unsigned bits, __half) {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}
__device__ __forceinline__ float2 unpack_pair(unsigned bits, __nv_bfloat16) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}

// Where a staged bias tile of this step sits: its shared-memory address, the (row, col) of its first
// element and its row pitch in bytes; pitch 0 = nothing staged (read the bias directly).
struct BiasTileRef {
    unsigned smem;
    int row0, col0, pitch;
    static __device__ __forceinline__ BiasTileRef none() { return BiasTileRef{0u, 0, 0, 0}; }
};

// A staged BiasPanelTile (below): its address and the (row, col) of its first element; kPanelBytes apart
// per 64 columns. A type of its own, so the reads through it are fixed at compile time.
template <int kPanelBytes>
struct BiasPanelRef {
    unsigned smem;
    int row0, col0;
};

// The shared-memory tile of kRows rows x kCols keys, and its copy from global memory.
template <typename Elem, int kRows, int kCols>
struct BiasTile {
    static constexpr int kPitch = kCols * int(sizeof(Elem)) + 16;
    static constexpr int kBytes = kRows * kPitch;
    static constexpr int kChunks = kCols * int(sizeof(Elem)) / 16;  // 16-byte chunks per row
    static_assert(kCols * sizeof(Elem) % 16 == 0, "bias tile rows are whole 16-byte chunks");
    static constexpr bool kPanels = false;

    static __device__ __forceinline__ BiasTileRef ref(unsigned smem, int row0, int col0) {
        return BiasTileRef{smem, row0, col0, kPitch};
    }

    // The bias of (b, h): rows [row0, row0 + kRows) x keys [col0, col0 + kCols), zero-filled past Sq / Sk.
    // One cp.async per chunk (uniform per thread); the caller commits the group. Only when params.bias_staged.
    template <int kThreads>
    static __device__ __forceinline__ void copy(unsigned smem, const AttnParams& p, int b, int h, int row0, int col0,
                                                int tid) {
        const Elem* base = static_cast<const Elem*>(p.bias) + b * p.bias_batch_stride +
                           (h / p.bias_head_div) * p.bias_head_stride;
        const int rows_valid = p.seqlen_q - row0, cols_valid = p.seqlen_k - col0;
        constexpr int kTotal = kRows * kChunks;
#pragma unroll
        for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
            const int i = tid + it * kThreads;
            if (kTotal % kThreads == 0 || i < kTotal) {
                const int row = i / kChunks, chunk = i % kChunks;
                const int col = chunk * (16 / int(sizeof(Elem)));
                const int bytes = row < rows_valid ? max(0, min(16, (cols_valid - col) * int(sizeof(Elem)))) : 0;
                const Elem* src = bytes > 0 ? base + (row0 + row) * p.bias_row_stride + col0 + col : base;
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem + row * kPitch + chunk * 16),
                             "l"(src), "r"(bytes));
            }
        }
    }
};

// The bias tile of kRows rows x kCols keys in the wide-panel layout of PanelTile<kRows, kCols> (kCols a
// multiple of 64): what the warp-specialized dK/dV mainloop's producer copies into a step's dS tile.
template <typename Elem, int kRows, int kCols>
struct BiasPanelTile {
    using Tile = PanelTile<kRows, kCols>;
    static constexpr int kBytes = Tile::kBytes;
    static_assert(sizeof(Elem) == 2 && Tile::kGroup == 8 && Tile::kPanelCols == 64, "16-bit wide panels");
    static constexpr bool kPanels = true;

    static __device__ __forceinline__ BiasPanelRef<Tile::kPanelBytes> ref(unsigned smem, int row0, int col0) {
        return BiasPanelRef<Tile::kPanelBytes>{smem, row0, col0};
    }

    // The same tile by TMA from the bias's map (when params.bias_tma), issued by one thread: a 64 x 64 box
    // per 64 rows of each panel, whose 128-byte swizzle is this layout's (the tile 1024-byte aligned). Adds
    // the tile's bytes to the current phase of mbarrier `bar` first; zeros past Sq / Sk count as well.
    // A broadcast batch or head (stride 0) is the map's size-1 dim: coordinate 0.
    static __device__ __forceinline__ void load_tma(unsigned smem, const AttnParams& p, const TmaDescriptor* map,
                                                    int b, int h, int row0, int col0, unsigned bar) {
        static_assert(kRows % 64 == 0, "whole 64-row boxes");
        const int head = p.bias_head_stride != 0 ? h / p.bias_head_div : 0;
        const int batch = p.bias_batch_stride != 0 ? b : 0;
        sm90::mbarrier_expect_tx(bar, kBytes);
#pragma unroll
        for (int panel = 0; panel < Tile::kPanels; ++panel) {
#pragma unroll
            for (int rows = 0; rows < kRows; rows += 64) {
                sm90::tma_load_4d(smem + panel * Tile::kPanelBytes + rows * Tile::kRowBytes, map, bar,
                                  col0 + 64 * panel, row0 + rows, head, batch);
            }
        }
    }

    // As BiasTile::copy (zero-filled past Sq / Sk to the element), each thread keeping one 16-byte chunk
    // column and walking rows kThreads / kChunks apart (a multiple of the swizzle period: the shared offset
    // and the source advance by constants).
    template <int kThreads>
    static __device__ __forceinline__ void copy(unsigned smem, const AttnParams& p, int b, int h, int row0, int col0,
                                                int tid) {
        constexpr int kChunks = Tile::kChunks, kRowStep = kThreads / kChunks;
        static_assert(kThreads % kChunks == 0 && kRowStep % 8 == 0 && kRows % kRowStep == 0, "bad bias row walk");
        const Elem* base = static_cast<const Elem*>(p.bias) + b * p.bias_batch_stride +
                           (h / p.bias_head_div) * p.bias_head_stride;
        const int row = tid / kChunks, chunk = tid % kChunks;
        const int rows_left = p.seqlen_q - row0 - row;
        const int bytes = max(0, min(16, (p.seqlen_k - col0 - chunk * 8) * 2));
        const Elem* src = base + (row0 + row) * p.bias_row_stride + col0 + chunk * 8;
        const unsigned dst = smem + Tile::chunk_offset(row, chunk);
#pragma unroll
        for (int it = 0; it < kRows / kRowStep; ++it) {
            const int n = it * kRowStep < rows_left ? bytes : 0;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + it * kRowStep * Tile::kRowBytes),
                         "l"(n > 0 ? src + it * kRowStep * p.bias_row_stride : base), "r"(n));
        }
    }
};

// The bias of one (batch, head), read staged or directly (see the top of the file). Empty without a bias.
template <typename Elem, bool kBias>
struct BiasView {
    __device__ __forceinline__ BiasView(const AttnParams&, int, int) {}
    template <typename Ref>
    __device__ __forceinline__ float at(int, int, const Ref&) const { return 0.f; }
    __device__ __forceinline__ float2 pair_at(int, int, const BiasTileRef&) const { return make_float2(0.f, 0.f); }
    template <bool kOwned = false>
    __device__ __forceinline__ void store_grad(const AttnParams&, int, int, int, int, float) const {}
};

template <typename Elem>
struct BiasView<Elem, true> {
    const Elem* base;
    long long row_stride;
    int col_stride, last_row, last_col;
    bool pairs;  // direct reads: rows contiguous, and every even column 2-element aligned

    __device__ __forceinline__ BiasView(const AttnParams& p, int b, int h)
        : base(static_cast<const Elem*>(p.bias) + b * p.bias_batch_stride + (h / p.bias_head_div) * p.bias_head_stride),
          row_stride(p.bias_row_stride), col_stride(p.bias_col_stride), last_row(p.seqlen_q - 1),
          last_col(p.seqlen_k - 1),
          pairs(col_stride == 1 && (row_stride & 1) == 0 &&
                (reinterpret_cast<unsigned long long>(base) & (2 * sizeof(Elem) - 1)) == 0) {}

    // Element (row, col): from the staged tile, or directly with the indices clamped into the sequence.
    __device__ __forceinline__ float at(int row, int col, const BiasTileRef& tile) const {
        if (tile.pitch != 0) {
            const unsigned addr = tile.smem + (row - tile.row0) * tile.pitch + (col - tile.col0) * int(sizeof(Elem));
            return load_shared(addr, Elem());
        }
        const int r = min(row, last_row), c = min(col, last_col);
        return to_float(base[r * row_stride + c * col_stride]);
    }

    // Columns col (even) and col + 1 of one row: one 32-bit read where it can.
    // The bias of n-tiles 2j, 2j + 1 of a warp's transposed C fragment (rows = 16 keys from key_row - g,
    // columns = queries from query_col - 2t: for_each_score_transposed's lane coordinates) from a staged
    // BiasPanelTile (the 128-byte swizzle of cuflash/tile.cuh's wide panels), by one ldmatrix .trans: pairs[2 * sub + half] holds the bias of (key g + 8 * half,
    // queries 2t, 2t + 1) of n-tile 2j + sub, in its low and high halves. 16-bit elements only.
    template <int kPanelBytes>
    __device__ __forceinline__ void transposed_pairs(unsigned (&pairs)[4], const BiasPanelRef<kPanelBytes>& tile,
                                                     int key_row, int query_col, int j) const {
        static_assert(sizeof(Elem) == 2, "ldmatrix moves 16-bit elements");
        const int lane = threadIdx.x % 32;
        const int key = key_row - (lane >> 2) - tile.col0 + ((lane >> 3) & 1) * 8;  // this lane's 8-key chunk
        const int row = query_col - 2 * (lane & 3) - tile.row0 + (2 * j + (lane >> 4)) * 8 + (lane & 7);
        const int chunk = key >> 3;
        sm80::ldmatrix_x4_trans(pairs, tile.smem + (chunk >> 3) * kPanelBytes + row * 128 + (((chunk ^ row) & 7) << 4));
    }
    // The low (first) or high element of a pair as float.
    static __device__ __forceinline__ float pair_half(unsigned bits, int high) {
        const float2 v = unpack_pair(bits, Elem());
        return high ? v.y : v.x;
    }

    __device__ __forceinline__ float2 pair_at(int row, int col, const BiasTileRef& tile) const {
        if (tile.pitch != 0) {
            const unsigned addr = tile.smem + (row - tile.row0) * tile.pitch + (col - tile.col0) * int(sizeof(Elem));
            return load_shared_pair(addr, Elem());
        }
        const int r = min(row, last_row);
        if (pairs && col < last_col) {
            const Elem* p = base + r * row_stride + col;
            if constexpr (sizeof(Elem) == 2) {
                return unpack_pair(__ldg(reinterpret_cast<const unsigned*>(p)), Elem());
            } else {
                return __ldg(reinterpret_cast<const float2*>(p));
            }
        }
        return make_float2(at(row, col, BiasTileRef::none()), at(row, col + 1, BiasTileRef::none()));
    }

    // The bias of n-tiles 2j, 2j + 1 of a warp's m16 tile of the C fragment (rows row0 .. +16, keys col0 + 16j ..
    // +16: for_each_score_pair's lane coordinates) from a staged BiasPanelTile (the warp-specialized forward's),
    // by one ldmatrix: pairs[2 * sub + half] holds (row g + 8 * half, keys 2t, 2t + 1) of n-tile 2j + sub. Each
    // 8-lane phase reads one chunk column of 8 rows, which the swizzle spreads over all banks.
    template <int kPanelBytes>
    __device__ __forceinline__ void row_pairs(unsigned (&pairs)[4], const BiasPanelRef<kPanelBytes>& tile, int row0,
                                              int col0, int j) const {
        static_assert(sizeof(Elem) == 2, "ldmatrix moves 16-bit elements");
        const int lane = threadIdx.x % 32;
        const int row = row0 - tile.row0 + ((lane >> 3) & 1) * 8 + (lane & 7);
        const int chunk = ((col0 - tile.col0) >> 3) + 2 * j + (lane >> 4);
        sm80::ldmatrix_x4(pairs, tile.smem + (chunk >> 3) * kPanelBytes + row * 128 + (((chunk ^ row) & 7) << 4));
    }

    // Whether this backward makes dbias: attention_backward(bias_grad=False) passes neither buffer. Callers test
    // it once per walk over a step's scores, not per element: store_grad's per-element offsets alone, with the
    // store itself not taken, made a B2 H16 S2k D128 backward 1.09 ms against 0.37 without a bias (H200).
    static __device__ __forceinline__ bool has_grad(const AttnParams& p) {
        return p.dbias != nullptr || p.dbias_accum != nullptr;
    }
    // dbias[b, h, row, col] (+)= ds for row < Sq, col < Sk (the parameters are read here, where used);
    // only where has_grad. kOwned: a deterministic key bias's partials too (add_grad_over_queries says why), at
    // slot row % 16 (the SIMT kernels' calls, per score for every bias; add_grad_over_queries passes its slot
    // as the row).
    template <bool kOwned = false>
    __device__ __forceinline__ void store_grad(const AttnParams& p, int b, int h, int row, int col, float ds) const {
        if (row > last_row || col > last_col) return;
        const int head = h / p.bias_head_div;
        const long long offset = b * p.dbias_batch_stride + head * p.dbias_head_stride + row * p.dbias_row_stride +
                                 col * p.dbias_col_stride +
                                 (kOwned ? (h - head * p.bias_head_div) * p.dbias_qhead_stride +
                                               (row % 16) * p.dbias_slot_stride
                                         : 0);
        if (p.dbias_accum != nullptr) {
            red_add(p.dbias_accum + offset, ds);
        } else {
            static_cast<Elem*>(p.dbias)[offset] = from_float(ds, Elem());
        }
    }

    // A bias broadcast over the query rows (dbias_row_stride 0: (B | 1, H | Hkv | 1, 1, Sk), a learnable key
    // bias): dbias of each key sums dS over every query, so the warp sums its transposed C fragment's queries
    // first (rows = keys key_row, key_row + 8; for_each_score_transposed's coordinates: a lane's quad, lanes
    // 4g .. 4g + 3, holds the same two keys and the step's other queries) and its lanes 4g add one term per key
    // per step, instead of one per score. Queries past Sq are left out (their dS is 0 only where their inputs
    // are). Called by every lane of the warp (shuffles); only where has_grad.
    // The deterministic backward's partials (params.dbias_slot_stride != 0): (B, H, slots, Sk), per query head,
    // where every partial has one writing thread in the whole grid. Its adds then take effect in its program
    // order (the PTX memory model's coherence order follows program order for one thread and one address), so
    // the sums are the same bits on every run. The warps that share a key within a step (kQueryParts of them,
    // DkdvConfig::kWarpsD) take consecutive query parts, and the part's index is the slot; the SIMT kernels'
    // threads (store_grad<true>) each own the queries of one residue modulo 16, which is theirs.
    template <int kQueryParts, int kNTiles>
    __device__ __forceinline__ void add_grad_over_queries(const AttnParams& p, int b, int h,
                                                          const float (&ds)[kNTiles][4], int key_row,
                                                          int query_col) const {
        float sum[2] = {0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (query_col + nt * 8 + (e & 1) <= last_row) sum[e >> 1] += ds[nt][e];
            }
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], 1);
            sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], 2);
        }
        if ((threadIdx.x & 3) == 0) {  // row = the slot (the bias has one row)
            const int slot = kQueryParts == 1 ? 0 : query_col / (kNTiles * 8) % kQueryParts;
            store_grad<true>(p, b, h, slot, key_row, sum[0]);
            store_grad<true>(p, b, h, slot, key_row + 8, sum[1]);
        }
    }

  private:
    template <typename T>
    static __device__ __forceinline__ float load_shared(unsigned addr, T) {
        unsigned short bits;
        asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(bits) : "r"(addr));
        return unpack_pair(bits, T()).x;
    }
    static __device__ __forceinline__ float load_shared(unsigned addr, float) {
        float x;
        asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(addr));
        return x;
    }
    template <typename T>
    static __device__ __forceinline__ float2 load_shared_pair(unsigned addr, T) {
        unsigned bits;
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(bits) : "r"(addr));
        return unpack_pair(bits, T());
    }
    static __device__ __forceinline__ float2 load_shared_pair(unsigned addr, float) {
        float2 x;
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(x.x), "=f"(x.y) : "r"(addr));
        return x;
    }
    static __device__ __forceinline__ float from_float(float x, float) { return x; }
    static __device__ __forceinline__ __half from_float(float x, __half) { return __float2half_rn(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x, __nv_bfloat16) { return __float2bfloat16_rn(x); }
};

// Eight consecutive 16-bit dbias elements from `packed` (element e in the low or high half of word e / 2), the
// tile's keys col .. col + 7 of which those below `cols` lie inside the sequence: one 16-byte store where all do
// and dst is aligned.
template <typename Elem>
__device__ __forceinline__ void store_dbias_chunk(Elem* dst, const uint4& packed, int col, int cols) {
    if (col + 8 <= cols && (reinterpret_cast<unsigned long long>(dst) & 15) == 0) {
        *reinterpret_cast<uint4*>(dst) = packed;
    } else {
        const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            if (col + e < cols) {
                reinterpret_cast<unsigned short*>(dst)[e] = static_cast<unsigned short>(words[e / 2] >> (16 * (e % 2)));
            }
        }
    }
}

// The same eight elements added into an fp32 accumulator: two 16-byte reductions (red.global.add.v4.f32, sm_90)
// where all eight lie inside and dst is aligned, else one red.global.add.f32 per element inside.
template <typename Elem>
__device__ __forceinline__ void add_dbias_chunk(float* dst, const uint4& packed, int col, int cols) {
    const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
    float v[8];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const float2 pair = unpack_pair(words[w], Elem());
        v[2 * w] = pair.x;
        v[2 * w + 1] = pair.y;
    }
#if __CUDA_ARCH__ >= 900
    if (col + 8 <= cols && (reinterpret_cast<unsigned long long>(dst) & 15) == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n"
                         :: "l"(dst + 4 * h), "f"(v[4 * h]), "f"(v[4 * h + 1]), "f"(v[4 * h + 2]), "f"(v[4 * h + 3])
                         : "memory");
        }
        return;
    }
#endif
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        if (col + e < cols) red_add(dst + e, v[e]);
    }
}

// Where the dbias of one (batch, head) goes from a shared dS tile: its slice of params.dbias (stored, the
// bias's dtype) or of params.dbias_accum (added, fp32). `add` is uniform.
template <typename Elem>
struct DbiasOut {
    void* slice;
    long long row_stride;
    bool add;

    static __device__ __forceinline__ DbiasOut of(const AttnParams& p, int b, int h) {
        const long long offset = b * p.dbias_batch_stride + (h / p.bias_head_div) * p.dbias_head_stride;
        if (p.dbias_accum != nullptr) return DbiasOut{p.dbias_accum + offset, p.dbias_row_stride, true};
        return DbiasOut{static_cast<Elem*>(p.dbias) + offset, p.dbias_row_stride, false};
    }
    // Keys col .. col + 7 of a tile starting at key key0 (col = 8 * chunk), query row `row`; `cols`: the tile's
    // keys inside the sequence.
    __device__ __forceinline__ void put(int row, int key0, int col, int cols, const uint4& packed) const {
        const long long offset = row * row_stride + key0 + col;
        if (add) {
            add_dbias_chunk<Elem>(static_cast<float*>(slice) + offset, packed, col, cols);
        } else {
            store_dbias_chunk(static_cast<Elem*>(slice) + offset, packed, col, cols);
        }
    }
};

// Whether the dK/dV kernels write this backward's dbias from the step's shared dS tile (coalesced, after the step's
// GEMMs) instead of score by score from registers (store_grad): the tile holds dS itself (no softcap factor) with
// the keys contiguous, and an accumulated dbias has an element per (query, key) (its rows and keys are the scores';
// the batch / heads broadcast) and no turns to take (deterministic=True orders its adds around the score walk,
// dbias_order.cuh). The tile's adds sum dS rounded to the input dtype, as the dQ / dK GEMMs read it.
__device__ __forceinline__ bool dbias_from_tile(const AttnParams& p) {
    if (p.softcap != 0.f || p.dbias_col_stride != 1) return false;
    if (p.dbias != nullptr) return true;
    return p.dbias_accum != nullptr && p.dbias_row_stride != 0 && p.dbias_order_offset == 0;
}

// Two rows of dbias, queries q and q + 1 against keys [c * 8, c * 8 + 8) of the tile, from w[k] = the dS^T
// word of key c * 8 + k (query q in its low half, q + 1 in its high half): one 16-byte store per row where the
// row allows, else element by element. rows / cols: the tile's rows and keys inside the sequence.
template <typename Elem>
__device__ __forceinline__ void store_dbias_pair(const DbiasOut<Elem>& out, int query0, int key0, int q, int c,
                                                 int rows, int cols, const unsigned (&w)[8]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        if (q + half >= rows) break;
        const unsigned sel = half ? 0x7632u : 0x5410u;  // the high or the low halves of two words
        const uint4 packed = make_uint4(__byte_perm(w[0], w[1], sel), __byte_perm(w[2], w[3], sel),
                                        __byte_perm(w[4], w[5], sel), __byte_perm(w[6], w[7], sel));
        out.put(query0 + q + half, key0, c * 8, cols, packed);
    }
}

// dbias rows [query0, query0 + kQueries) x keys [key0, key0 + kKeys) of (b, h) from the dK/dV kernel's dS^T
// tile in shared memory (TileP: [key][query] of Elem, swizzled, the atomic dQ step's operand), where
// dbias_from_tile (stored, or added into the fp32 accumulator: DbiasOut); the caller has made the tile visible
// (a barrier).
// A lane takes a pair of queries and 8 keys: 8 32-bit reads (a key row each, both queries' halves), then a
// 16-byte store (or two 16-byte fp32 adds) per query row (store_dbias_pair). Which lanes share a read:
//   wide panels (the 128-byte swizzle, f(row) = row % 8): a warp takes 8 queries x 64 keys, lane = (chunk
//     cl = lane / 4, pair lane % 4), and lane cl reads its rows rotated by cl (read e: key cl * 8 + (e + cl)
//     % 8), so each read's 32 lanes see 8 different swizzle terms x 4 words: 32 distinct banks; a register
//     rotation puts the keys back in order, and each store writes 4 query rows x 128 contiguous bytes;
//   narrow panels: a warp takes 32 query pairs of one chunk (the word moves with the query; rows c * 8 + e
//     of different chunks share their swizzle term), at most 2 lanes per bank.
// The first form (a lane per query and chunk, reads element by element) had 16 lanes on one bank in every
// read: 4096 shared-memory wavefronts per 64 x 128 step, against 128 here.
template <typename Elem, typename TileP, int kThreads>
__device__ __forceinline__ void store_dbias_tile(const AttnParams& p, int b, int h, int query0, int key0, unsigned s_ds,
                                                 int tid) {
    constexpr int kKeys = TileP::kRows, kQueries = TileP::kCols, kChunks = kKeys / 8, kPairs = kQueries / 2;
    static_assert(sizeof(Elem) == 2 && kKeys % 8 == 0 && kQueries % 2 == 0, "16-bit tiles of whole 8-key chunks");
    const DbiasOut<Elem> out = DbiasOut<Elem>::of(p, b, h);
    const int rows = p.seqlen_q - query0, cols = p.seqlen_k - key0;
    if constexpr (TileP::kGroup == 8 && kChunks % 8 == 0 && kQueries % 8 == 0) {
        constexpr int kItems = (kQueries / 8) * (kChunks / 8);  // (8 queries x 64 keys) per warp
        const int lane = tid % 32, cl = lane / 4;
#pragma unroll 1
        for (int item = tid / 32; item < kItems; item += kThreads / 32) {
            const int q = item % (kQueries / 8) * 8 + 2 * (lane % 4), c = item / (kQueries / 8) * 8 + cl;
            if (q >= rows || c * 8 >= cols) continue;
            unsigned w[8];  // read e: key c * 8 + (e + cl) % 8
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                asm volatile("ld.shared.b32 %0, [%1];\n"
                             : "=r"(w[e]) : "r"(s_ds + TileP::elem_offset(c * 8 + ((e + cl) & 7), q)));
            }
#pragma unroll
            for (int bit = 1; bit < 8; bit *= 2) {  // rotate by cl: w[k] = key c * 8 + k
                unsigned t[8];
#pragma unroll
                for (int k = 0; k < 8; ++k) t[k] = (cl & bit) ? w[(k - bit) & 7] : w[k];
#pragma unroll
                for (int k = 0; k < 8; ++k) w[k] = t[k];
            }
            store_dbias_pair(out, query0, key0, q, c, rows, cols, w);
        }
    } else {
#pragma unroll 1
        for (int i = tid; i < kPairs * kChunks; i += kThreads) {
            const int q = 2 * (i % kPairs), c = i / kPairs;
            if (q >= rows || c * 8 >= cols) continue;
            unsigned w[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w[e]) : "r"(s_ds + TileP::elem_offset(c * 8 + e, q)));
            }
            store_dbias_pair(out, query0, key0, q, c, rows, cols, w);
        }
    }
}

// dbias rows [query0, query0 + Tile::kRows) x keys [key0 + 8 * chunk0, + 8 * kPartChunks) of (b, h) from a dS
// tile laid out [query][key] (Tile: wide panels, the warp-specialized dK/dV mainloop's dS tile under a bias),
// where dbias_from_tile; the caller has made the tile visible. Each thread moves 16-byte chunks: 8 consecutive
// threads read one 128-byte panel row (its chunks permuted by the swizzle: one wavefront) and store 128
// contiguous bytes of a dbias row (add 256 of the fp32 accumulator's).
template <typename Elem, typename Tile, int kThreads, int kPartChunks>
__device__ __forceinline__ void store_dbias_rows(const AttnParams& p, int b, int h, int query0, int key0, unsigned s_ds,
                                                 int tid, int chunk0) {
    static_assert(sizeof(Elem) == 2 && (kPartChunks * Tile::kRows) % kThreads == 0, "whole passes of 16-bit chunks");
    const DbiasOut<Elem> out = DbiasOut<Elem>::of(p, b, h);
    const int rows = p.seqlen_q - query0, cols = p.seqlen_k - key0;
#pragma unroll
    for (int it = 0; it < kPartChunks * Tile::kRows / kThreads; ++it) {
        const int i = tid + it * kThreads;
        const int q = i / kPartChunks, c = chunk0 + i % kPartChunks;
        if (q >= rows || c * 8 >= cols) continue;
        const uint4 v = ld_shared_b128(s_ds + Tile::chunk_offset(q, c));
        out.put(query0 + q, key0, c * 8, cols, v);
    }
}

}  // namespace cuflash
