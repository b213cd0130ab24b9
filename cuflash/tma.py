"""Tensor maps for the TMA loads of the sm_90a kernels (``cuda_src/cuflash/tma_sm90.cuh``).

A tensor map (the driver's ``CUtensorMap``, 128 opaque bytes) describes a strided tensor in global memory
and the box a TMA load copies from it into shared memory. The driver encodes it on the host
(``cuTensorMapEncodeTiled``, a pure host function of the driver library that every CUDA process has
loaded: called here through ctypes, so no binding package is needed); the maps travel in ``TmaParams``, the
second, ``__grid_constant__`` parameter of the kernels that read them (``cuflash/launch.py`` writes it).

Loaded this way, by the warp-specialized forward and dK/dV kernels: the bias's (rows x keys) tiles, staged in the
128-byte-swizzled wide panels of ``cuda_src/cuflash/tile.cuh``, and the Q / K / V (and dO) tiles of the batched
layout. Every map has 64 x 64 boxes (64 elements of the innermost dim, 64 rows), but the K / V maps of a forward
whose key tiles 64 rows do not divide (:func:`kv_box`).
"""
from __future__ import annotations

import ctypes
import functools
import os

# cuda.h enums (CUDA 12.0 and later).
_DATA_TYPE_UINT16 = 1         # CU_TENSOR_MAP_DATA_TYPE_UINT16: a plain 16-bit copy, fp16 and bf16 alike
_INTERLEAVE_NONE = 0          # CU_TENSOR_MAP_INTERLEAVE_NONE
_SWIZZLE_128B = 3             # CU_TENSOR_MAP_SWIZZLE_128B: the wgmma / wide-panel layout
_L2_PROMOTION_256B = 3        # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
_OOB_FILL_ZERO = 0            # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements land as zeros

#: The box of every load, innermost dim first: 64 elements (one 128-byte swizzled panel row) x 64 rows. A
#: kernel's tile is a whole number of them (BiasPanelTile::load_tma, sm90::tma_load_rows).
BIAS_BOX = (64, 64, 1, 1)  # (keys, query rows, heads, batch)
BSHD_BOX = (64, 1, 64, 1)  # (head dim, heads, rows, batch)


def kv_box(block_n: int) -> tuple:
    """The box of the K / V maps of a kernel whose key tiles have ``block_n`` rows: BSHD_BOX, or one box of the
    whole tile where 64 rows do not divide it (the warp-specialized D256 forward's 80-key tiles; a box has at
    most 256 rows). ``sm90::kv_box_rows`` in cuda_src/cuflash/tma_sm90.cuh makes the same choice."""
    if block_n % 64 == 0:
        return BSHD_BOX
    if block_n % 8 or not 0 < block_n <= 256:
        raise ValueError(f"no TMA box for key tiles of {block_n} rows")
    return (64, 1, block_n, 1)
#: The maps encoded lately, by (address, dims, strides, box): a training loop passes the same buffers every step
#: (a layer's q / k / v / dout and bias: 4-5 maps per layer; 1024 maps of 128 bytes hold a few hundred layers).
_CACHE_SIZE = 1024


@functools.lru_cache(maxsize=1)
def _encoder():
    """``cuTensorMapEncodeTiled`` of the process's driver library, or None where it cannot be had (or
    ``CUFLASH_TMA=0`` in the environment, read once: the kernels then copy with cp.async, for comparisons)."""
    if os.environ.get("CUFLASH_TMA", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def bias_map_layout(shape, strides, itemsize: int, ptr: int):
    """The bias ``(B|1, H|Hkv|1, Sq, Sk)`` (element strides, 0 along broadcast dims) as the 4-d tensor of the
    map, innermost first: ``(dims, byte strides of dims 1-3)``; None where TMA cannot read it: not 16-bit,
    broadcast over the queries or the keys (the map's rows would repeat), keys not contiguous, or a base or
    stride off the 16 bytes TMA needs. A broadcast batch or head (size 1, or stride 0 as in ``broadcast_to``)
    is a size-1 dim, which the kernels address at 0 (they test the stride); its stride (unused) is the product
    of the ones inside it, as the driver expects of a dense tensor."""
    b, h, sq, sk = (int(n) for n in shape)
    sb, sh, sr, sc = (int(st) for st in strides)
    if itemsize != 2 or sq < 2 or sk < 2 or sc != 1 or sr == 0 or ptr % 16:
        return None
    b, h = (b if sb else 1), (h if sh else 1)
    row_bytes = sr * itemsize
    head_bytes = sh * itemsize if h > 1 else row_bytes * sq
    batch_bytes = sb * itemsize if b > 1 else head_bytes * h
    byte_strides = (row_bytes, -(-head_bytes // 16) * 16, -(-batch_bytes // 16) * 16)
    if any(st % 16 or st <= 0 or st >= 1 << 40 for st in (row_bytes, head_bytes, batch_bytes)):
        return None
    return (sk, sq, h, b), byte_strides


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _encode(ptr: int, dims: tuple, byte_strides: tuple, box: tuple) -> bytes | None:
    fn = _encoder()
    if fn is None:
        return None
    out = ctypes.create_string_buffer(128 + 64)
    address = -(-ctypes.addressof(out) // 64) * 64  # CUtensorMap is 64-byte aligned
    status = fn(address, _DATA_TYPE_UINT16, 4, ptr, (ctypes.c_uint64 * 4)(*dims),
                (ctypes.c_uint64 * 3)(*byte_strides), (ctypes.c_uint32 * 4)(*box),
                (ctypes.c_uint32 * 4)(1, 1, 1, 1), _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B,
                _OOB_FILL_ZERO)
    if status != 0:
        return None
    return ctypes.string_at(address, 128)


def encode(ptr: int, dims: tuple, byte_strides: tuple, box: tuple) -> bytes | None:
    """The 128 bytes of the map of ``dims`` / ``byte_strides`` (a ``*_map_layout``) at ``ptr``, or None where the
    driver would not encode it (remembered: the last _CACHE_SIZE maps)."""
    return _encode(ptr, dims, byte_strides, box)


def bshd_map_layout(shape, strides, itemsize: int, ptr: int):
    """A batched ``(B, S, H, D)`` operand (q, k or v; element strides) as the 4-d tensor ``(D, H, S, B)`` of a
    map, innermost first: ``(dims, byte strides of dims 1-3)``, or None where TMA cannot read it: not
    16-bit, D not contiguous, a base or stride off 16 bytes. A size-1 batch or head takes a dense stride."""
    b, s, h, d = (int(n) for n in shape)
    sb, sr, sh, sd = (int(st) for st in strides)
    if itemsize != 2 or (sd != 1 and d > 1) or ptr % 16 or d % 8:
        return None
    head_bytes = sh * itemsize if h > 1 else d * itemsize
    row_bytes = sr * itemsize if s > 1 else head_bytes * h
    batch_bytes = sb * itemsize if b > 1 else row_bytes * s
    byte_strides = (-(-head_bytes // 16) * 16, -(-row_bytes // 16) * 16, -(-batch_bytes // 16) * 16)
    if any(st % 16 or st <= 0 or st >= 1 << 40 for st in (head_bytes, row_bytes, batch_bytes)):
        return None
    return (d, h, s, b), byte_strides


def bias_map(shape, strides, itemsize: int, ptr: int) -> bytes | None:
    """The bias's tensor map, its 128 bytes (``TmaParams.bias``), or None: TMA cannot read this bias
    (:func:`bias_map_layout`) or the driver would not encode it. The kernels then copy its tiles with
    cp.async as before."""
    layout = bias_map_layout(shape, strides, itemsize, ptr)
    if layout is None:
        return None
    return _encode(int(ptr), *layout, BIAS_BOX)
