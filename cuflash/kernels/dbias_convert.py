"""Plan piece for a broadcast bias's dbias: ``cuda_src/dbias_convert.cu``.

The dK/dV kernels sum the gradient of a bias that broadcasts over some dims in an fp32 accumulator of the bias's
own shape; this launch, after the backward's, converts the sums to the bias's dtype (fp16 / bf16) into the dbias
output, 8 elements a thread per step of a grid-stride loop. An fp32 bias needs none: its sums go straight into
dbias (cuflash.api._dbias_buffers).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import KernelVariant, Launch

SOURCE = "dbias_convert.cu"
KERNEL_NAME = "cuflash::flash_dbias_convert_kernel"
THREADS = 256
#: CTAs per SM of the grid-stride loop (enough loads in flight to stream at memory speed).
BLOCKS_PER_SM = 8


@dataclass(frozen=True)
class ConvertConfig:
    """The template argument of ``flash_dbias_convert_kernel<Elem>``."""

    dtype: str  # the bias's dtype: float16 or bfloat16


def variant(dtype: str) -> KernelVariant:
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dbias conversion is for float16 / bfloat16 biases, not {dtype}")
    return KernelVariant(SOURCE, KERNEL_NAME, ConvertConfig(dtype), THREADS, 0)


def launch(dtype: str, elements: int, num_sms: int) -> Launch:
    """The launch converting ``elements`` fp32 sums (the kernel's arguments: source, destination, count)."""
    chunks = -(-elements // 8)
    return Launch(variant(dtype), (max(1, min(-(-chunks // THREADS), num_sms * BLOCKS_PER_SM)), 1, 1))


def all_variants(arch: int) -> list:
    del arch
    return [variant(dtype) for dtype in ("float16", "bfloat16")]
