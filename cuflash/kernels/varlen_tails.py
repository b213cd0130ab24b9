"""Plan piece for packed (varlen) calls: ``cuda_src/varlen_tails.cu``.

The attention kernels write only the rows inside a sequence; this launch gives the packed rows no sequence
covers (before ``cu_seqlens[0]`` and from ``cu_seqlens[B]`` on) their defined values: out 0 and lse -inf
after a forward, zero dq / dk / dv after a backward. A fixed grid strides over those rows (the host does not
read the offsets), so with none it costs one launch.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import KernelVariant, Launch

SOURCE = "varlen_tails.cu"
KERNEL_NAME = "cuflash::flash_varlen_tails_kernel"
THREADS = 128
#: Blocks of the grid-stride loop: enough to zero a long tail at memory speed, cheap when there is none.
GRID = 132


@dataclass(frozen=True)
class TailsConfig:
    """The template arguments of ``flash_varlen_tails_kernel<kElemBytes, kBackward>``, in order."""

    elem_bytes: int  # 2 (fp16 / bf16) or 4 (fp32)
    backward: bool  # dq / dk / dv instead of out / lse


def variant(dtype: str, backward: bool) -> KernelVariant:
    return KernelVariant(SOURCE, KERNEL_NAME, TailsConfig(4 if dtype == "float32" else 2, bool(backward)), THREADS, 0)


def launch(dtype: str, backward: bool) -> Launch:
    return Launch(variant(dtype, backward), (GRID, 1, 1))


def all_variants(arch: int) -> list:
    del arch
    return [variant(dtype, backward) for dtype in ("bfloat16", "float32") for backward in (False, True)]
