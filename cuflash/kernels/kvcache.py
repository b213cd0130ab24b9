"""Plans for KV-cache attention (``cuflash.attention_with_kvcache``): ``cuda_src/flash_kvcache.cu`` and its two
helpers, ``flash_kvcache_append.cu`` (writes k_new / v_new into the cache) and ``flash_kvcache_combine.cu``
(merges split-KV partials).

Launches, in order on one stream: the append (when k_new is given), the attention kernel on grid
``(m_blocks * num_splits, Hkv, B)``, and with ``num_splits > 1`` the combine. ``m_blocks`` covers the
``Sq x G`` query rows of a kv head (G = H / Hkv query heads packed with their tokens, so a group reads the
cache once: cuda_src/cuflash/kvcache.cuh).

Tiles. The attention kernel runs the forward's mma.sync mainloop with 4 warps of 16 rows (kBlockM = 64):
decoding is bound by reading the cache, not by the tensor cores, and 64 rows hold a whole group of up to 64
heads for one token. From PREFILL_ROWS packed rows per kv head (chunked prefill) it takes the mma.sync
forward's own tile instead (128 rows of 32-row warps where that tile has them), which reads each K / V tile
for twice the rows (H100, bf16, B4 H32 / Hkv8 D128, 512 new tokens over 8k cached, causal: 213 -> 339 TFLOPS,
0.61x -> 0.97x FlashAttention-2, session 11 run 4). Keys per step and stages: :func:`tile` (bytes in flight per SM), shedding stages, then
keys, on parts with less shared memory.

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
    """``flash_kvcache_kernel<Elem, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, kScoreMod, kPanelCols>``."""

    dtype: str
    head_dim: int  # the head-dim bucket
    block_m: int  # packed query rows per CTA
    block_n: int  # keys per mainloop step
    num_warps: int
    stages: int
    score_mod: int  # MOD_NONE or MOD_SOFTCAP_ALIBI
    panel_cols: int  # shared-memory tile panels: 64 (wide) for decoding where D allows, 32; see variant()


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


def variant(dtype: str, head_dim_bucket: int, score_mod: int, arch: int, prefill: bool = False) -> KernelVariant:
    """The decoding tile (:func:`tile`), or with ``prefill`` the mma.sync forward's own (128 query rows per CTA:
    :func:`cuflash.kernels.forward.tile_sm80`), for calls with at least PREFILL_ROWS packed query rows per kv
    head, which are bound by the tensor cores rather than by reading the cache."""
    if dtype not in DTYPES:
        raise ValueError(f"the KV-cache kernel takes float16, bfloat16 or float32; got {dtype=}")
    if score_mod not in SCORE_MODS:
        raise ValueError(f"the KV-cache kernel takes no bias; got {score_mod=}")
    if not arch_caps(arch).has_cp_async:
        raise ValueError(f"the KV-cache kernel needs sm_80 or later; got {arch=}")
    if dtype == "float32":
        return simt_variant(head_dim_bucket, score_mod, prefill)
    if prefill:
        from .forward import tile_sm80

        block_m, block_n, warps, stages = tile_sm80(arch, head_dim_bucket, True, heavy=score_mod != MOD_NONE)
        if (block_m, block_n, stages) == (128, 64, 1) and score_mod != MOD_NONE:
            # D128 with softcap / ALiBi on sm_90a: the forward's 128 x 64 x 1-stage tile spilled 192 bytes here
            # (NVRTC 13.5; without them 64, as the forward declares); 32 keys x 2 stages keeps acc + S at 160
            # and spills nothing. (sm_80 prefill tiles with softcap / ALiBi spill 16 at D32 and 40 at D96.)
            block_n, stages = 32, 2
    else:
        (block_n, stages), block_m, warps = tile(arch, head_dim_bucket), BLOCK_M, WARPS
    # Decoding streams the cache: wide panels (rows of whole 128-byte lines, where D is a multiple of 64) halve
    # the L2 requests of its copies. H100, B64 H32/8 L8k D128: 2929 -> 3053 GB/s, B1 L128k 2730 -> 2834
    # (session 15, run 4). The prefill tiles are bound by the tensor cores and keep narrow panels (the D64
    # 128 x 128 tile spilled 32 bytes wide).
    panel_cols = 64 if not prefill and head_dim_bucket % 64 == 0 else 32
    config = KvConfig(dtype, head_dim_bucket, block_m, block_n, warps, stages, int(score_mod), panel_cols)
    return KernelVariant(SOURCE, KERNEL_NAME, config, warps * 32, smem_bytes(head_dim_bucket, block_n, stages, block_m))


def append_variant(dtype: str) -> KernelVariant:
    return KernelVariant(APPEND_SOURCE, APPEND_NAME, AppendConfig(4 if dtype == "float32" else 2), APPEND_THREADS, 0)


def combine_variant(dtype: str) -> KernelVariant:
    return KernelVariant(COMBINE_SOURCE, COMBINE_NAME, CombineConfig(dtype), COMBINE_WARPS * 32, 0)



def ctas_per_sm(v: KernelVariant, arch: int) -> int:
    """How many of the attention kernel's CTAs share an SM: shared memory bound for the tensor-core kernel (4
    warps never hit the register or thread limits first at these tiles); the fp32 kernel's 256 threads are
    also register bound (its launch bounds: two CTAs of <= 128 registers, one with softcap / ALiBi)."""
    caps = arch_caps(arch)
    by_smem = max(1, caps.smem_per_sm // (v.smem_bytes + 1024))
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
    prefill_rows = SIMT_PREFILL_ROWS if dtype == "float32" else PREFILL_ROWS
    v = variant(dtype, head_dim_bucket, score_mod, arch, prefill=seqlen_q * group >= prefill_rows)
    m_blocks = -(-(seqlen_q * group) // v.config.block_m)
    key_blocks = max(1, -(-longest_keys // v.config.block_n))
    if num_splits is None:
        slots = num_sms * (ctas_per_sm(v, arch) if paged else 1)
        num_splits = num_splits_heuristic(batch * num_heads_k * m_blocks, key_blocks, slots)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS, key_blocks))
    launches = []
    if append:
        launches.append(Launch(append_variant(dtype), (2 * num_sms, 1, 1)))
    launches.append(Launch(v, (m_blocks * num_splits, num_heads_k, batch)))
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
    attention = {variant(dtype, bucket, mod, arch, prefill) for dtype in TENSOR_CORE_DTYPES
                 for bucket in HEAD_DIM_BUCKETS for mod in SCORE_MODS for prefill in (False, True)}
    out = sorted(attention, key=lambda v: (v.config.dtype, v.config.head_dim, v.config.score_mod, v.config.block_m))
    simt = {simt_variant(bucket, mod, prefill) for bucket in HEAD_DIM_BUCKETS for mod in SCORE_MODS
            for prefill in (False, True)}
    out += sorted(simt, key=lambda v: (v.config.head_dim, v.config.score_mod, v.config.block_m))
    out += [append_variant(dtype) for dtype in ("bfloat16", "float32")]
    out += [combine_variant(dtype) for dtype in DTYPES]
    return out
