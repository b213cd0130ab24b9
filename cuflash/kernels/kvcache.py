"""Plans for KV-cache attention (``cuflash.attention_with_kvcache``): ``cuda_src/flash_kvcache.cu`` and its two
helpers, ``flash_kvcache_append.cu`` (writes k_new / v_new into the cache) and ``flash_kvcache_combine.cu``
(merges split-KV partials).

Launches, in order on one stream: the append (when k_new is given), the attention kernel on grid
``(m_blocks * num_splits, Hkv, B)``, and with ``num_splits > 1`` the combine. ``m_blocks`` covers the
``Sq x G`` query rows of a kv head (G = H / Hkv query heads packed with their tokens, so a group reads the
cache once: cuda_src/cuflash/kvcache.cuh).

Tiles (:func:`tile_kind`). A decoding token's group (up to FEW_ROWS = 16 packed rows: GQA groups of 4 or 8)
takes the few-row tile: 16 rows x 64 keys (128 up to D64), the four warps each taking a quarter of every key
block with its own online softmax, merged once at the end; a dense cache's launch keeps one CTA per SM
(:func:`few_tile`). Up to PREFILL_ROWS packed rows, the 64-row decoding tile (4 warps of 16 rows,
:func:`tile`), which reads each K / V tile once for up to 64 rows. From PREFILL_ROWS rows (chunked prefill) it
takes the mma.sync forward's own tile instead (128 rows of 32-row warps where that tile has them), which reads
each K / V tile for twice the rows (H100, bf16, B4 H32 / Hkv8 D128, 512 new tokens over 8k cached, causal: 213 ->
339 TFLOPS, 0.61x -> 0.97x FlashAttention-2, session 11 run 4). Keys per step and stages shed stages, then keys,
on parts with less shared memory.

float32 runs ``cuda_src/flash_kvcache_simt.cu``: the true-fp32 forward's key loop (FFMA only, as
``cuflash/kernels/simt.py``'s kernels) with the same packed rows, mask, pages, splits and combine. Its decoding
tile is 16 packed rows (one per thread row of the 16 x 16 grid) over 32 keys (64 at D <= 64); from
SIMT_PREFILL_ROWS packed rows it takes the SIMT forward's own tile (:func:`cuflash.kernels.simt.forward_tiles`).

Split-KV (``num_splits``): None picks it with :func:`num_splits_heuristic` (enough CTAs to fill the SMs when
B x Hkv x m_blocks cannot), 1 turns it off; each split takes an equal share of a query block's visible key
blocks. The partials are fp32 ``o_accum (splits, B, H, Sq, Dv)`` and ``lse_accum (splits, B, H, Sq)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..arch import arch_caps
from . import HEAD_DIM_BUCKETS, MOD_NONE, MOD_SOFTCAP_ALIBI, KernelVariant, Launch

SOURCE = "flash_kvcache.cu"
KERNEL_NAME = "cuflash::flash_kvcache_kernel"
SIMT_SOURCE = "flash_kvcache_simt.cu"
SIMT_KERNEL_NAME = "cuflash::flash_kvcache_simt_kernel"
APPEND_SOURCE = "flash_kvcache_append.cu"
APPEND_NAME = "cuflash::flash_kvcache_append_kernel"
COMBINE_SOURCE = "flash_kvcache_combine.cu"
COMBINE_NAME = "cuflash::flash_kvcache_combine_kernel"
DTYPES = ("float16", "bfloat16", "float32")
TENSOR_CORE_DTYPES = ("float16", "bfloat16")
SCORE_MODS = (MOD_NONE, MOD_SOFTCAP_ALIBI)
BLOCK_M, WARPS = 64, 4
#: Tile kinds (:func:`tile_kind`): a token's GQA group (up to FEW_ROWS packed rows, the warps splitting the
#: keys), the 64-row decoding tile, the prefill tile.
FEW, DECODE, PREFILL = "few", "decode", "prefill"
FEW_ROWS = 16
#: Packed query rows per kv head (Sq x H / Hkv) from which a call takes the prefill tile (two of its 128-row
#: blocks): chunked prefill. Below it the 64-row decoding tile, which a single token's group fills better.
PREFILL_ROWS = 256
#: float32: packed query rows per kv head from which a call takes the SIMT forward's tile instead of 16 rows.
SIMT_PREFILL_ROWS = 64
SIMT_DECODE_ROWS = 16
APPEND_THREADS, COMBINE_WARPS = 256, 4
#: At most this many splits (the combine reads each row's lse_accum 32 at a time).
MAX_SPLITS = 128
ELEM_BYTES = 2


@dataclass(frozen=True)
class KvConfig:
    """``flash_kvcache_kernel<Elem, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, kScoreMod, kPanelCols,
    kWarpsN>``."""

    dtype: str
    head_dim: int  # the head-dim bucket
    block_m: int  # packed query rows per CTA
    block_n: int  # keys per mainloop step
    num_warps: int
    stages: int
    score_mod: int  # MOD_NONE or MOD_SOFTCAP_ALIBI
    panel_cols: int  # shared-memory tile panels: 64 (wide) for decoding where D allows, 32; see variant()
    warps_n: int  # warps splitting each key block (the few-row tile), else 1; see variant()


@dataclass(frozen=True)
class KvSimtConfig:
    """``flash_kvcache_simt_kernel<kHeadDim, kBlockM, kBlockN, kScoreMod>`` (float32)."""

    head_dim: int  # the head-dim bucket
    block_m: int  # packed query rows per CTA
    block_n: int  # keys per step
    score_mod: int  # MOD_NONE or MOD_SOFTCAP_ALIBI


@dataclass(frozen=True)
class AppendConfig:
    """``flash_kvcache_append_kernel<kElemBytes>``."""

    elem_bytes: int


@dataclass(frozen=True)
class CombineConfig:
    """``flash_kvcache_combine_kernel<Elem>``."""

    dtype: str


def smem_bytes(head_dim_bucket: int, block_n: int, stages: int, block_m: int = BLOCK_M) -> int:
    """Q (``block_m`` rows), then ``stages`` K and V tiles of ``block_n`` rows (KvLoads::kSmemBytes)."""
    return ELEM_BYTES * head_dim_bucket * (block_m + 2 * stages * block_n)


def tile(arch: int, head_dim_bucket: int) -> tuple:
    """(kBlockN, kStages) for one head-dim bucket on ``arch`` (see the module docstring).

    Decoding streams the cache, so the tile is chosen for bytes in flight per SM: two CTAs per SM (8 warps
    issuing copies, one CTA's loads landing under the other's math) with two or three K / V stages each.
    Measured (H100, session 6 run 1): D128 with 128 keys x 2 stages (147 KB, one CTA per SM) read a B64 L8k
    cache at 2752 GB/s and a B1 L128k one at 2243 (split 16), against cuDNN's 3094 / 2965.
    """
    big = arch_caps(arch).smem_per_block >= 200 * 1024
    if head_dim_bucket <= 64:
        block_n, stages = 128, 2  # D64: 74 KB, three CTAs per SM
    elif head_dim_bucket <= 128 and big:
        block_n, stages = 64, 3  # D96 86 KB, D128 112 KB: two CTAs per SM
    else:
        block_n, stages = 64, 2  # D160 102 KB (two per SM), D256 160 KB (one)
    per_block = arch_caps(arch).smem_per_block
    while smem_bytes(head_dim_bucket, block_n, stages) > per_block:
        if stages > 1:
            stages -= 1
        elif block_n > 32:
            block_n //= 2
        else:
            raise AssertionError(f"no KV-cache tile fits D{head_dim_bucket} on sm_{arch}")
    return block_n, stages


def simt_variant(head_dim_bucket: int, score_mod: int, prefill: bool = False) -> KernelVariant:
    """The float32 kernel: 16 packed rows x 32 keys (64 at D <= 64) for decoding, or with ``prefill`` the SIMT
    forward's tile. Its shared memory is the SIMT forward's layout (Q, K, V at pitch D + 4, P), within the 99 KB
    every arch from sm_80 on grants (:data:`cuflash.kernels.simt.MAX_SMEM_BYTES`)."""
    from . import simt

    if prefill:
        block_m, block_n = simt.forward_tiles(head_dim_bucket)
    else:
        block_m, block_n = SIMT_DECODE_ROWS, 64 if head_dim_bucket <= 64 else 32
    smem = simt.forward_smem_bytes(head_dim_bucket, block_m, block_n)
    if smem > simt.MAX_SMEM_BYTES:
        raise AssertionError(f"the fp32 KV-cache tile D{head_dim_bucket} {block_m}x{block_n} needs {smem} bytes")
    config = KvSimtConfig(head_dim_bucket, block_m, block_n, int(score_mod))
    return KernelVariant(SIMT_SOURCE, SIMT_KERNEL_NAME, config, simt.THREADS, smem)


def few_tile(arch: int, head_dim_bucket: int) -> tuple:
    """(kBlockN, kStages) of the few-row tile (FEW_ROWS packed rows, the four warps splitting each key block:
    at least 64 keys, 16 per warp): 128 keys up to D64, 64 above, two stages (one fewer on parts whose shared
    memory cannot hold them). A dense cache's launch keeps it alone on its SM, a paged cache's two to an SM (:func:`smem_floor`).
    Measured (H100, bf16, H32 / Hkv8 D128, GB/s B64 L8k / B1 L128k at 16 splits, cuDNN 3080-3093 / 2951-2958,
    session 16): 64 x 2 alone 3122 / 2941-2980; 64 x 2 three to an SM 2835-2969 / 2941-2982, two 3077 / 2942;
    64 x 3 two to an SM (the 64-row tile's) 3052-3056 / 2865-2880, alone 3092 / 2864; 128 x 2 (alone by its size)
    3077-3089 / 2888-2900; 64 x 4, 64 x 6, 128 x 1, 128 x 3 all below. Streaming the cache, fewer CTAs with two
    stages in flight each read faster than more CTAs or deeper pipelines; more splits (33, 49, 66: two or more
    waves) read slower at 128k (2831, 2736, 2714)."""
    block_n, stages = (128 if head_dim_bucket <= 64 else 64), 2
    while smem_bytes(head_dim_bucket, block_n, stages, FEW_ROWS) > arch_caps(arch).smem_per_block:
        if stages == 1:
            raise AssertionError(f"no few-row KV-cache tile fits D{head_dim_bucket} on sm_{arch}")
        stages -= 1
    return block_n, stages


def smem_floor(arch: int, ctas: int) -> int:
    """Dynamic shared memory per launch (Launch.smem_floor) that keeps more than ``ctas`` CTAs off an SM: more
    than its share of the SM's, counting the 1 KB each CTA's system reservation takes."""
    return arch_caps(arch).smem_per_sm // (ctas + 1) + 4096


def tile_kind(dtype: str, rows: int) -> str:
    """The tile for ``rows`` packed query rows per kv head (Sq x H / Hkv): FEW up to FEW_ROWS (a decoding
    token's group: the warps split the keys), DECODE below the prefill threshold, PREFILL from it."""
    if rows >= (SIMT_PREFILL_ROWS if dtype == "float32" else PREFILL_ROWS):
        return PREFILL
    return FEW if rows <= FEW_ROWS else DECODE


def variant(dtype: str, head_dim_bucket: int, score_mod: int, arch: int, kind: str = DECODE) -> KernelVariant:
    """The kernel of one tile kind (:func:`tile_kind`).

    - FEW: FEW_ROWS query rows x :func:`few_tile`'s keys, the four warps each taking a quarter of every key
      block with its own online softmax, merged at the end (cuda_src/flash_kvcache.cu). A decoding token's
      group (4 or 8 heads) fills a quarter or half of one warp's 16 rows; with 16 rows per warp (DECODE's
      layout) one warp of four would do all the math and read all of K and V from shared memory alone.
    - DECODE: BLOCK_M rows, 16 per warp, :func:`tile`'s keys and stages.
    - PREFILL: the mma.sync forward's own tile (128 query rows per CTA: :func:`cuflash.kernels.forward.tile_sm80`),
      for calls with at least PREFILL_ROWS packed query rows per kv head, which are bound by the tensor cores
      rather than by reading the cache.
    float32 runs the SIMT kernel (:func:`simt_variant`), whose decoding tile serves FEW and DECODE."""
    if dtype not in DTYPES:
        raise ValueError(f"the KV-cache kernel takes float16, bfloat16 or float32; got {dtype=}")
    if score_mod not in SCORE_MODS:
        raise ValueError(f"the KV-cache kernel takes no bias; got {score_mod=}")
    if not arch_caps(arch).has_cp_async:
        raise ValueError(f"the KV-cache kernel needs sm_80 or later; got {arch=}")
    if kind not in (FEW, DECODE, PREFILL):
        raise ValueError(f"unknown KV-cache tile kind {kind!r}")
    if dtype == "float32":
        return simt_variant(head_dim_bucket, score_mod, kind == PREFILL)
    warps_n = 1
    if kind == PREFILL:
        from .forward import tile_sm80

        block_m, block_n, warps, stages = tile_sm80(arch, head_dim_bucket, True, heavy=score_mod != MOD_NONE)
        if (block_m, block_n, stages) == (128, 64, 1) and score_mod != MOD_NONE:
            # D128 with softcap / ALiBi on sm_90a: the forward's 128 x 64 x 1-stage tile spilled 192 bytes here
            # (NVRTC 13.5; without them 64, as the forward declares); 32 keys x 2 stages keeps acc + S at 160
            # and spills nothing. (sm_80 prefill tiles with softcap / ALiBi spill 16 at D32 and 40 at D96.)
            block_n, stages = 32, 2
    elif kind == FEW:
        (block_n, stages), block_m, warps, warps_n = few_tile(arch, head_dim_bucket), FEW_ROWS, WARPS, WARPS
    else:
        (block_n, stages), block_m, warps = tile(arch, head_dim_bucket), BLOCK_M, WARPS
    # Decoding streams the cache: wide panels (rows of whole 128-byte lines, where D is a multiple of 64) halve
    # the L2 requests of its copies. H100, B64 H32/8 L8k D128: 2929 -> 3053 GB/s, B1 L128k 2730 -> 2834
    # (session 15, run 4). The prefill tiles are bound by the tensor cores and keep narrow panels (the D64
    # 128 x 128 tile spilled 32 bytes wide).
    panel_cols = 64 if kind != PREFILL and head_dim_bucket % 64 == 0 else 32
    config = KvConfig(dtype, head_dim_bucket, block_m, block_n, warps, stages, int(score_mod), panel_cols, warps_n)
    return KernelVariant(SOURCE, KERNEL_NAME, config, warps * 32, smem_bytes(head_dim_bucket, block_n, stages, block_m))


def append_variant(dtype: str) -> KernelVariant:
    return KernelVariant(APPEND_SOURCE, APPEND_NAME, AppendConfig(4 if dtype == "float32" else 2), APPEND_THREADS, 0)


def combine_variant(dtype: str) -> KernelVariant:
    return KernelVariant(COMBINE_SOURCE, COMBINE_NAME, CombineConfig(dtype), COMBINE_WARPS * 32, 0)



def ctas_per_sm(v: KernelVariant, arch: int, floor: int = 0) -> int:
    """How many of the attention kernel's CTAs share an SM (launched with ``floor`` bytes of shared memory at
    least): shared memory bound for the tensor-core kernel (4 warps never hit the register or thread limits
    first at these tiles); the fp32 kernel's 256 threads are also register bound (its launch bounds: two CTAs
    of <= 128 registers, one with softcap / ALiBi)."""
    caps = arch_caps(arch)
    by_smem = max(1, caps.smem_per_sm // (max(v.smem_bytes, floor) + 1024))
    if isinstance(v.config, KvSimtConfig):
        return min(by_smem, 2 if v.config.score_mod == MOD_NONE else 1)
    return by_smem


def num_splits_heuristic(ctas: int, key_blocks: int, slots: int) -> int:
    """Splits of the key blocks so that ``ctas`` CTAs (B x Hkv x m_blocks) fill ``slots`` CTA slots in one
    wave: the SMs for a dense cache (one CTA per SM), the SMs times the CTAs an SM holds for a paged one.

    1 when the CTAs already fill 80% of the SMs. Otherwise, for each split count up to one wave with a
    different number of key blocks per split, the wave efficiency ``w = ctas * splits / slots``; the best
    wins, the smallest count among equals. Measured on an H100 (session 10, run 9), B1 H32 / 8 L128k, GB/s by
    splits: 8: 1493, 16: 2735, 24: 2345, 33: 2534 (two CTAs per SM, the old heuristic's pick), 48: 2116, 66:
    2222, 128: 1901; cuDNN 2951. Fewer, longer CTAs stream a dense cache faster than two per SM, and a partial
    second wave costs most. A paged cache wants the second CTA per SM (the page lookups' latency): run 10, 16-row
    pages at 16 splits 1946 against 2451 at 33 (session 6), 256-row pages 2434 against 2401. The partials and
    the combine cost little against the cache.
    """
    if ctas >= 0.8 * slots or key_blocks <= 1:
        return 1
    limit = min(MAX_SPLITS, key_blocks, max(1, slots // max(ctas, 1)))
    candidates = []
    for splits in range(1, limit + 1):
        if splits > 1 and math.ceil(key_blocks / splits) == math.ceil(key_blocks / (splits - 1)):
            continue
        waves = ctas * splits / slots
        candidates.append((splits, waves / math.ceil(waves)))
    best = max(eff for _, eff in candidates)
    return next(splits for splits, eff in candidates if eff >= best - 1e-9)


@dataclass(frozen=True)
class KvPlan:
    """The launches of one call and the split-KV scratch they need (shapes of float32 buffers)."""

    launches: tuple
    num_splits: int
    o_accum: tuple | None
    lse_accum: tuple | None
    scratch: tuple = ()  # ((field, shape), ...): o_accum and lse_accum when split


def plan(dtype: str, batch: int, seqlen_q: int, num_heads: int, num_heads_k: int, head_dim_bucket: int,
         head_dim_v: int, score_mod: int, longest_keys: int, append: bool, num_splits: int | None, arch: int,
         num_sms: int, paged: bool = False) -> KvPlan:
    """``longest_keys``: the most keys any batch can attend to (the cache's capacity, or the known lengths)."""
    group = num_heads // num_heads_k
    v = variant(dtype, head_dim_bucket, score_mod, arch, tile_kind(dtype, seqlen_q * group))
    m_blocks = -(-(seqlen_q * group) // v.config.block_m)
    key_blocks = max(1, -(-longest_keys // v.config.block_n))
    # The few-row tile reads a dense cache fastest one CTA to an SM (few_tile); a paged cache wants a second
    # CTA per SM for the page lookups' latency (num_splits_heuristic), no more.
    floor = 0
    if isinstance(v.config, KvConfig) and v.config.warps_n > 1:
        floor = smem_floor(arch, 2 if paged else 1)
    if num_splits is None:
        slots = num_sms * (ctas_per_sm(v, arch, floor) if paged else 1)
        num_splits = num_splits_heuristic(batch * num_heads_k * m_blocks, key_blocks, slots)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS, key_blocks))
    launches = []
    if append:
        launches.append(Launch(append_variant(dtype), (2 * num_sms, 1, 1)))
    launches.append(Launch(v, (m_blocks * num_splits, num_heads_k, batch), floor))
    o_accum = lse_accum = None
    if num_splits > 1:
        rows = batch * num_heads * seqlen_q
        launches.append(Launch(combine_variant(dtype), (-(-rows // COMBINE_WARPS), 1, 1)))
        o_accum = (num_splits, batch, num_heads, seqlen_q, head_dim_v)
        lse_accum = (num_splits, batch, num_heads, seqlen_q)
    scratch = () if o_accum is None else (("o_accum", o_accum), ("lse_accum", lse_accum))
    return KvPlan(tuple(launches), num_splits, o_accum, lse_accum, scratch)


def all_variants(arch: int) -> list:
    if not arch_caps(arch).has_cp_async:
        return []
    attention = {variant(dtype, bucket, mod, arch, kind) for dtype in TENSOR_CORE_DTYPES
                 for bucket in HEAD_DIM_BUCKETS for mod in SCORE_MODS for kind in (FEW, DECODE, PREFILL)}
    out = sorted(attention, key=lambda v: (v.config.dtype, v.config.head_dim, v.config.score_mod, v.config.block_m,
                                           v.config.block_n, v.config.stages, v.config.warps_n))
    simt = {simt_variant(bucket, mod, prefill) for bucket in HEAD_DIM_BUCKETS for mod in SCORE_MODS
            for prefill in (False, True)}
    out += sorted(simt, key=lambda v: (v.config.head_dim, v.config.score_mod, v.config.block_m))
    out += [append_variant(dtype) for dtype in ("bfloat16", "float32")]
    out += [combine_variant(dtype) for dtype in DTYPES]
    return out
