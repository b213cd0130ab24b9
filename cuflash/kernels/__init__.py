"""Kernel plans: which kernel variants run, in which order, on which grid, for a problem shape.

Each kernel family has one module here, next to its source in ``cuda_src/``:

- ``forward``: tensor-core forward (fp16 / bf16), ``flash_fwd.cu``
- ``backward``: tensor-core backward (fp16 / bf16), ``flash_bwd.cu``
- ``simt``: true-fp32 forward and backward, ``flash_simt.cu``
- ``block_lists``: the general mask's pre-pass (per-block visit lists), ``block_lists.cu``
- ``varlen_tails``: packed calls' last launch (the rows no sequence covers), ``varlen_tails.cu``
- ``dbias_convert``: a broadcast bias's fp32 dbias sums to its dtype, after the backward, ``dbias_convert.cu``
- ``kvcache``: KV-cache attention (``flash_kvcache.cu``) with its append and split-KV combine kernels

A family module exposes ``plan_forward(shape, arch)``, ``plan_backward(shape, arch, deterministic)``
(where it has one) and ``all_variants(arch)``; :func:`plan_forward` / :func:`plan_backward` below pick
the family. Nothing here touches a GPU: plans are plain data, so CPU tests and the ``compile``
command can enumerate them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

#: Head-dim buckets: one compiled variant serves every multiple of 8 up to its bucket.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
#: Multiprocessors assumed by plans made without a device (CPU tests, ``compile``): an H100 SXM's.
DEFAULT_SMS = 132
#: The kernels' kMask template argument (``MaskKind`` in cuda_src/cuflash/mask.cuh).
#: MASK_GENERAL_BOOL is the general mask with a bool mask too (its own variants: the mask term costs registers);
#: the *_DROPOUT kinds add dropout on the probabilities (cuda_src/cuflash/dropout.cuh): a call with dropout runs the
#: general mask (its causal / window at run time), so the plain and causal kernels carry no dropout code.
MASK_NONE, MASK_CAUSAL, MASK_GENERAL, MASK_GENERAL_BOOL, MASK_GENERAL_DROPOUT, MASK_GENERAL_BOOL_DROPOUT = range(6)
MASK_KINDS = (MASK_NONE, MASK_CAUSAL, MASK_GENERAL, MASK_GENERAL_BOOL, MASK_GENERAL_DROPOUT, MASK_GENERAL_BOOL_DROPOUT)


def is_general(mask_kind: int) -> bool:
    """Whether a kMask runs the general mask (block lists from the pre-pass)."""
    return mask_kind >= MASK_GENERAL


def has_dropout(mask_kind: int) -> bool:
    return mask_kind >= MASK_GENERAL_DROPOUT
#: The kernels' kScoreMod template argument (``ScoreModKind`` in cuda_src/cuflash/score_mod.cuh): none,
#: softcap / ALiBi, an additive bias (and its gradient) with ALiBi, or a bias with softcap and ALiBi. A bias
#: without a softcap keeps no softcap factor per score, which its kernels' registers need.
MOD_NONE, MOD_SOFTCAP_ALIBI, MOD_BIAS, MOD_BIAS_SOFTCAP = 0, 1, 2, 3
SCORE_MODS = (MOD_NONE, MOD_SOFTCAP_ALIBI, MOD_BIAS, MOD_BIAS_SOFTCAP)


def has_bias(score_mod: int) -> bool:
    return score_mod in (MOD_BIAS, MOD_BIAS_SOFTCAP)


def head_dim_bucket(head_dim: int) -> int:
    """The smallest bucket holding ``head_dim`` (the kernel zero-fills the columns past it)."""
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head_dim={head_dim} is larger than the largest supported ({MAX_HEAD_DIM})")


@dataclass(frozen=True)
class ProblemShape:
    """What a plan depends on: sizes, dtype name and the layout-changing options."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    num_heads: int
    num_heads_k: int
    head_dim: int
    head_dim_v: int
    dtype: str  # "float16", "bfloat16" or "float32"
    causal: bool
    #: window, segment_ids or block_ids given: the general mask (runtime causal / window / ids, block lists)
    general_mask: bool = False
    #: the score-modifier variant: MOD_SOFTCAP_ALIBI (softcap or alibi_slopes given), MOD_BIAS (bias, maybe
    #: ALiBi), MOD_BIAS_SOFTCAP (bias and softcap), MOD_NONE
    score_mod: int = 0
    #: heads of the bool mask's block lists: 1 (no mask, or one shared by the heads), Hkv or H
    mask_heads: int = 1
    #: a bool mask given (the general mask's MASK_GENERAL_BOOL variants)
    bool_mask: bool = False
    #: dropout_p > 0 (the general mask's *_DROPOUT variants)
    dropout: bool = False
    #: packed variable-length sequences (cu_seqlens): ``batch`` sequences, ``seqlen_q`` / ``seqlen_k`` the
    #: longest lengths (the grid's), ``total_q`` / ``total_k`` the packed rows. The kernels are the batched
    #: ones: the layout is a run-time property of the parameter block (cuda_src/cuflash/seqlen.cuh).
    packed: bool = False
    total_q: int = 0
    total_k: int = 0

    def q_scratch(self, heads: int, *width: int) -> tuple:
        """Shape of an fp32 scratch with a row per query for ``heads`` heads: (B, heads, Sq, ...) batched,
        (heads, Tq, ...) packed (SeqInfo::q_scratch_row)."""
        return (heads, self.total_q, *width) if self.packed else (self.batch, heads, self.seqlen_q, *width)

    def k_scratch(self, heads: int, *width: int) -> tuple:
        """The same with a row per key (SeqInfo::k_scratch_row)."""
        return (heads, self.total_k, *width) if self.packed else (self.batch, heads, self.seqlen_k, *width)

    def scratch_strides(self, k_heads: int) -> tuple:
        """The AttnParams fields that lay out a backward's scratch rows as :meth:`q_scratch` (the query heads)
        and :meth:`k_scratch` (``k_heads`` heads or partial slots) do: (field, rows) pairs."""
        if self.packed:
            q, k = (1, self.total_q), (1, self.total_k)
        else:
            q, k = (self.num_heads * self.seqlen_q, self.seqlen_q), (k_heads * self.seqlen_k, self.seqlen_k)
        rows = max(math.prod(self.q_scratch(self.num_heads)), math.prod(self.k_scratch(k_heads)))
        if rows >= 2**31:  # the kernels index scratch rows in 32 bits (SeqInfo::q_scratch_row)
            raise ValueError(f"the backward's scratch would hold {rows} rows (batch x heads x sequence); at most "
                             f"{2**31 - 1} are supported")
        return (("q_scratch_batch_stride", q[0]), ("q_scratch_head_stride", q[1]),
                ("k_scratch_batch_stride", k[0]), ("k_scratch_head_stride", k[1]))

    @property
    def head_dim_bucket(self) -> int:
        return head_dim_bucket(max(self.head_dim, self.head_dim_v))

    @property
    def mask_kind(self) -> int:
        """The kernels' kMask: one of MASK_KINDS."""
        if self.dropout:
            return MASK_GENERAL_BOOL_DROPOUT if self.bool_mask else MASK_GENERAL_DROPOUT
        if self.bool_mask:
            return MASK_GENERAL_BOOL
        if self.general_mask or self.packed:  # packed sequences run the general kinds (cuda_src/cuflash/seqlen.cuh)
            return MASK_GENERAL
        return MASK_CAUSAL if self.causal else MASK_NONE

    @property
    def skips_blocks(self) -> bool:
        """Whether query / key blocks differ in work (a triangle or a sparse mask), not a full rectangle."""
        return self.mask_kind != MASK_NONE


@dataclass(frozen=True)
class KernelVariant:
    """One compiled kernel: a template instantiation in one source file.

    ``config`` is the kernel family's frozen config dataclass (``FwdConfig``, ``DkdvConfig``, ``DqConfig``,
    ``SmallConfig``, ``SimtConfig``, ``SimtSmallConfig``): its fields, in declaration order, ARE the
    kernel's template arguments, and ``cuflash.build.render_name`` spells them. Plans read tiles from it
    by name (``variant.config.block_m``). ``smem_bytes`` is the plan's formula of the config; every
    compile passes it as ``-DCUFLASH_EXPECTED_SMEM_BYTES`` and the kernel's ``CUFLASH_CHECK_SMEM_BYTES``
    static_assert compares it with the layout's own size, so a drifted formula fails the build.
    """

    source: str  # file under cuda_src/, e.g. "flash_fwd.cu"
    name: str  # qualified template name, e.g. "cuflash::flash_fwd_kernel"
    config: object  # frozen dataclass of dtype names (str), ints and bools: the template arguments in order
    threads: int  # threads per block
    smem_bytes: int  # dynamic shared memory per block


@dataclass(frozen=True)
class Launch:
    variant: KernelVariant
    grid: tuple  # (x, y, z)
    # Dynamic shared memory the launch reserves at least, beyond what the kernel uses (variant.smem_bytes), to
    # keep CTAs off an SM: a streaming kernel whose CTAs read faster alone (the KV cache's few-row decoding
    # tile, cuflash/kernels/kvcache.py). 0: the kernel's own bytes.
    smem_floor: int = 0

    @property
    def smem_bytes(self) -> int:
        """The dynamic shared memory the launch asks for."""
        return max(self.variant.smem_bytes, self.smem_floor)


@dataclass(frozen=True)
class Plan:
    """Launches in order, plus the fp32 scratch buffers they need.

    ``scratch`` maps an ``AttnParams`` pointer field (``"dq_accum"``, ``"dk_accum"``, ``"dv_accum"``,
    ``"softmax_d"``, ``"lse_log2"``, and the general mask's int32 block lists ``"kv_blocks"`` / ``"q_blocks"``) to
    the shape of a contiguous buffer of 4-byte elements (float32 for the CPU-side allocations). Scratch arrives
    uninitialized: the kernels initialize whatever they accumulate into.
    """

    launches: tuple
    scratch: tuple = ()  # ((field, shape), ...)
    fields: tuple = ()  # ((AttnParams scalar field, value), ...) the plan sets, e.g. dkdv_heads

    def scratch_dict(self) -> dict:
        return dict(self.scratch)


def _family(shape: ProblemShape):
    if shape.dtype == "float32":
        from . import simt

        return simt
    from . import forward, backward

    return forward, backward


def _with_tails(plan: Plan, shape: ProblemShape, backward: bool) -> Plan:
    """A packed call's plan ends with the launch that defines the rows no sequence covers."""
    if not shape.packed:
        return plan
    from . import varlen_tails

    return Plan(launches=(*plan.launches, varlen_tails.launch(shape.dtype, backward)), scratch=plan.scratch,
                fields=plan.fields)


def plan_forward(shape: ProblemShape, arch: int, num_sms: int = DEFAULT_SMS) -> Plan:
    family = _family(shape)
    module = family if not isinstance(family, tuple) else family[0]
    return _with_tails(module.plan_forward(shape, arch, num_sms=num_sms), shape, False)


def plan_backward(shape: ProblemShape, arch: int, deterministic: bool, num_sms: int = DEFAULT_SMS) -> Plan:
    family = _family(shape)
    module = family if not isinstance(family, tuple) else family[1]
    return _with_tails(module.plan_backward(shape, arch, deterministic, num_sms=num_sms), shape, True)


def all_variants(arch: int) -> list:
    """Every kernel variant the package can launch on ``arch``, without duplicates."""
    from . import backward, block_lists, dbias_convert, forward, kvcache, simt, varlen_tails

    seen, out = set(), []
    for module in (forward, backward, simt, block_lists, varlen_tails, kvcache, dbias_convert):
        for variant in module.all_variants(arch):
            if variant not in seen:
                seen.add(variant)
                out.append(variant)
    return out
