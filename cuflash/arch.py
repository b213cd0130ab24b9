"""What each GPU architecture offers the kernels: one table, read by every plan module.

The tile tables in ``cuflash/kernels/`` size their tiles against these budgets (shared memory per SM and
per block, registers per SM) and pick a mainloop by the instruction sets listed here. Values are the
CUDA C++ Programming Guide's "technical specifications per compute capability"; the per-block figure
is the opt-in maximum (``cudaDevAttrMaxSharedMemoryPerBlockOptin``), which is the per-SM figure less
the 1 KB the driver reserves for each resident block. ``build.get_kernel`` still checks the real
device's attribute before a launch, so a wrong row here fails loudly, never silently.
"""
from __future__ import annotations

from dataclasses import dataclass

KB = 1024


@dataclass(frozen=True)
class ArchCaps:
    """The capabilities of one compute capability (``arch = 10 * major + minor``)."""

    arch: int
    parts: str  # examples of GPUs of this arch, for the reader
    smem_per_sm: int  # bytes of shared memory per SM
    smem_per_block: int  # bytes one block may opt into (dynamic shared memory)
    registers_per_sm: int = 64 * KB  # 32-bit registers; at most 255 per thread on every arch here
    has_cp_async: bool = True  # sm_80's instruction set: cp.async, ldmatrix, bf16 mma.sync
    has_wgmma: bool = False  # warpgroup MMA (wgmma.mma_async), compiled as sm_90a: Hopper only


_TABLE = (
    ArchCaps(80, "A100, A30", 164 * KB, 163 * KB),
    ArchCaps(86, "RTX 30xx, A40, A10", 100 * KB, 99 * KB),
    ArchCaps(87, "Jetson Orin", 164 * KB, 163 * KB),
    ArchCaps(89, "RTX 40xx, L4, L40", 100 * KB, 99 * KB),
    ArchCaps(90, "H100, H200, GH200", 228 * KB, 227 * KB, has_wgmma=True),
    # Blackwell datacenter parts: sm_100 has tcgen05 instead of wgmma (kernels fall back to mma.sync).
    ArchCaps(100, "B200, GB200", 228 * KB, 227 * KB),
    ArchCaps(101, "Thor (CUDA 12.x numbering; 110 from CUDA 13)", 228 * KB, 227 * KB),
    ArchCaps(103, "B300, GB300", 228 * KB, 227 * KB),
    ArchCaps(110, "Thor", 228 * KB, 227 * KB),
    ArchCaps(120, "RTX 50xx, RTX PRO 6000 Blackwell", 100 * KB, 99 * KB),
    ArchCaps(121, "DGX Spark (GB10)", 100 * KB, 99 * KB),
)

ARCHS = {caps.arch: caps for caps in _TABLE}


def arch_caps(arch: int) -> ArchCaps:
    """The capabilities of ``arch`` (e.g. 80, 90). An arch missing from the table gets the smallest
    budgets of the known ones (99 KB per block, no wgmma), so a plan for it is conservative; one below
    sm_80 gets ``has_cp_async=False``, which every plan rejects."""
    caps = ARCHS.get(arch)
    if caps is not None:
        return caps
    smallest = min(_TABLE, key=lambda c: c.smem_per_block)
    return ArchCaps(arch, "unknown", smallest.smem_per_sm, smallest.smem_per_block, has_cp_async=arch >= 80)


def min_smem_per_block() -> int:
    """The least shared memory a block may opt into on any arch the kernels run on (sm_80 and later):
    a tile within it runs everywhere."""
    return min(caps.smem_per_block for caps in _TABLE if caps.has_cp_async)
