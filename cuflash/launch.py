"""From validated descriptions and a plan to kernel launches on a stream.

Fills the ``AttnParams`` block (pointers and strides straight from the caller's arrays: no copies)
and launches the plan's kernels in order on the given stream. No host synchronization.
"""
from __future__ import annotations

import ctypes
import functools
import math
import struct
import threading

import numpy as np

from . import build, kernels, tma
from .kernels import Plan, ProblemShape
from .kernels import backward as _backward_kernels
from .kernels import forward as _forward_kernels
from .params import params_dtype

_LOG2E = 1.4426950408889634


_get_device = None  # cudaGetDevice, once a usable GPU has been found


def current_device() -> int:
    """The current CUDA device, or a clear RuntimeError where there is no usable GPU / driver (instead
    of CuPy's ``cudaErrorInsufficientDriver`` traceback). The first place a call touches the device."""
    global _get_device
    if _get_device is not None:
        return _get_device()
    from cupy_backends.cuda.api import runtime

    try:
        count = runtime.getDeviceCount()
        device = runtime.getDevice() if count else None
    except runtime.CUDARuntimeError as exc:
        raise RuntimeError(
            f"cuflash found no usable CUDA GPU: the CUDA runtime says {exc}. cuflash needs an NVIDIA GPU "
            f"(sm_80 or later) and a driver at least as new as the CUDA runtime CuPy was built for"
        ) from None
    if device is None:
        raise RuntimeError("cuflash found no usable CUDA GPU: the CUDA driver reports no devices")
    _get_device = runtime.getDevice
    return device


@functools.lru_cache(maxsize=None)
def compute_capability(device_id: int) -> str:
    import cupy

    return cupy.cuda.Device(device_id).compute_capability


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.lru_cache(maxsize=4096)
def forward_plan(shape: ProblemShape, device_id: int) -> Plan:
    return kernels.plan_forward(shape, int(compute_capability(device_id)), num_sms=multiprocessor_count(device_id))


@functools.lru_cache(maxsize=4096)
def backward_plan(shape: ProblemShape, device_id: int, deterministic: bool) -> Plan:
    return kernels.plan_backward(shape, int(compute_capability(device_id)), deterministic,
                                 num_sms=multiprocessor_count(device_id))


_STRIDED_FIELDS = (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o"), ("dout", "do"), ("dq", "dq"), ("dk", "dk"), ("dv", "dv"))


def make_params(shape: ProblemShape, scale: float, q, k, v, out, lse, *, dout=None, dq=None, dk=None,
                dv=None, dlse=None, scratch=None, fields=()):
    """The size-1 params array for one call. Every argument is a TensorDesc (or None).

    Values are gathered in a dict and packed in one ``np.array`` call: assigning the ~50 fields of a
    structured scalar one by one cost ~25 µs of host time per call.
    """
    values = {
        "batch": shape.batch, "seqlen_q": shape.seqlen_q, "seqlen_k": shape.seqlen_k,
        "num_heads": shape.num_heads, "num_heads_k": shape.num_heads_k,
        "head_dim": shape.head_dim, "head_dim_v": shape.head_dim_v,
        "h_per_kv": shape.num_heads // shape.num_heads_k, "dkdv_heads": 1,
        # divisors, never 0; options override them. Without a per-head mask every head uses list row 0.
        "bias_head_div": 1, "mask_heads": 1, "mask_head_div": max(1, shape.num_heads),
        "scale": scale, "scale_log2": scale * _LOG2E,
    }
    tensors = {"q": q, "k": k, "v": v, "o": out, "dout": dout, "dq": dq, "dk": dk, "dv": dv}
    for field, prefix in _STRIDED_FIELDS:  # (B, S, H, D); packed (T, H, D) with the batch stride = the row stride
        t = tensors[field]
        if t is not None:
            values[field] = t.ptr
            strides = (t.strides[0], *t.strides[:2]) if shape.packed else t.strides[:3]
            values[f"{prefix}_batch_stride"], values[f"{prefix}_row_stride"], values[f"{prefix}_head_stride"] = strides
    for field, t in (("lse", lse), ("dlse", dlse)):  # (B, H, S), rows contiguous; packed (H, T), batch stride 1
        if t is not None:
            values[field] = t.ptr
            strides = (1, t.strides[0]) if shape.packed else t.strides[:2]
            values[f"{field}_batch_stride"], values[f"{field}_head_stride"] = strides
    if shape.packed:
        values["total_q"], values["total_k"] = shape.total_q, shape.total_k
    if scratch:
        values.update(scratch)
    values.update(fields)  # scalar fields the plan sets (e.g. dkdv_heads)
    dtype = params_dtype()
    return np.array([tuple(values.get(name, 0) for name in dtype.names)], dtype=dtype)


def run(plan: Plan, params, device_id: int, stream) -> None:
    """Launch every kernel of ``plan`` in order on ``stream`` (a CuPy stream).

    Straight through ``cuLaunchKernel`` with a pointer to the params bytes: CuPy's generic argument
    handling re-derives a structured array's description on every call (~40 µs of host time).
    The driver copies the parameter block at launch, so ``params`` need only live until it returns.
    The second parameter (the forward and dK/dV kernels' TmaParams) holds no map here: ``params`` must not
    set bias_tma (CallPlan passes the maps).
    """
    cc = compute_capability(device_id)
    argv = (ctypes.c_void_p * 2)(params.ctypes.data, _NO_TMA_ADDRESS)
    stream_ptr = stream.ptr
    for item in plan.launches:
        kernel = build.get_kernel(item.variant, device_id, cc, item.smem_bytes)
        gx, gy, gz = item.grid
        launch_kernel(device_id, kernel.function.ptr, gx, gy, gz, item.variant.threads, 1, 1,
                      item.smem_bytes, stream_ptr, ctypes.addressof(argv), 0)


def convert_dbias(accum, dbias_ptr: int, dtype: str, device_id: int, stream_ptr: int) -> None:
    """Enqueue the conversion of a broadcast bias's fp32 dbias sums (``accum``, a contiguous CuPy array) into
    the contiguous, 16-byte aligned dbias at ``dbias_ptr`` (``dtype``: float16 / bfloat16) on ``stream_ptr``:
    kernels.dbias_convert."""
    from .kernels import dbias_convert

    item = dbias_convert.launch(dtype, accum.size, multiprocessor_count(device_id))
    kernel = build.get_kernel(item.variant, device_id, compute_capability(device_id))
    args = (ctypes.c_void_p(accum.data.ptr), ctypes.c_void_p(dbias_ptr), ctypes.c_longlong(accum.size))
    argv = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
    launch_kernel(device_id, kernel.function.ptr, *item.grid, item.variant.threads, 1, 1, 0, stream_ptr,
                  ctypes.addressof(argv), 0)


def scratch_bytes(plan: Plan) -> int:
    return sum(4 * math.prod(shape) for _, shape in plan.scratch)


#: Offsets of scratch buffers carved from one allocation are rounded up to this (CuPy's own granule).
_SCRATCH_ALIGNMENT = 256
#: The pointer fields lead AttnParams, in this order (checked against the header by ``_pointer_prefix``):
#: the operands, the fp32 scratch, dlse, then the score options' arrays and the general mask's lists.
POINTER_FIELDS = ("q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv", "dq_accum", "dk_accum", "dv_accum",
                  "softmax_d", "lse_log2", "dlse", "q_segment_ids", "k_segment_ids", "q_block_ids", "k_block_ids",
                  "alibi_slopes", "kv_blocks", "q_blocks", "bias", "dbias", "dbias_accum", "mask", "cu_seqlens_q",
                  "cu_seqlens_k", "dropout_seed_ptr", "cache_seqlens", "block_table", "k_new", "v_new", "o_accum",
                  "lse_accum")
#: How many of them a call without score options patches (the rest stay null).
PLAIN_POINTERS = 15
#: How many a cached call with score options patches; a call with a bias or a bool mask packs BIAS_MASK_POINTERS
#: (through ``mask``), a varlen call PACKED_POINTERS (through the packed sequences' offsets).
OPTION_POINTERS = 22
BIAS_MASK_POINTERS = 26
PACKED_POINTERS = 28
#: The bias's index among the pointer fields.
_BIAS_POINTER = POINTER_FIELDS.index("bias")
#: Every launch passes two parameters: the AttnParams block and the kernels' TmaParams (cuda_src/cuflash/
#: tma_sm90.cuh: 64-byte-aligned tensor maps, the bias's, q's, k's and v's), which kernels with one parameter
#: ignore.
TMA_PARAMS_BYTES = 640
_MAP_OFFSETS = {"bias": 0, "q": 128, "k": 256, "v": 384, "dout": 512}
#: The operands a plan may load by TMA, with their pointers' index in the pointer block (POINTER_FIELDS).
_MAPPED = (("q", 0), ("k", 1), ("v", 2), ("dout", 5))
_NO_TMA = ctypes.create_string_buffer(TMA_PARAMS_BYTES + 64)
_NO_TMA_ADDRESS = -(-ctypes.addressof(_NO_TMA) // 64) * 64
#: The scratch buffers a call may carve from one allocation, by pointer field.
SCRATCH_FIELDS = ("dq_accum", "dk_accum", "dv_accum", "softmax_d", "lse_log2", "kv_blocks", "q_blocks")


@functools.lru_cache(maxsize=None)
def _pointer_prefix(count: int) -> struct.Struct:
    """A packer of the first ``count`` pointer fields, which AttnParams lays out back to back from offset 0."""
    dtype = params_dtype()
    for i, name in enumerate(POINTER_FIELDS[:count]):
        if dtype.names[i] != name or dtype.fields[name][1] != 8 * i or dtype[name] != np.uint64:
            raise AssertionError(f"AttnParams field {i} is not the pointer {name!r} at offset {8 * i}")
    return struct.Struct(f"<{count}Q")


class CallPlan:
    """Everything a repeated call with one key needs, so that it only patches pointers and launches.

    ``params`` is the AttnParams block of the call that built it (sizes, strides, scale: all fixed by
    the key); a call writes its pointers (the first ``num_pointers`` fields, in ``POINTER_FIELDS``
    order) into a per-thread copy and launches each kernel with the function pointer, grid, block and
    shared memory resolved here once. The driver copies the parameter block at launch, so the copy
    may be rewritten by the thread's next call.

    ``scratch``: ``((field, shape), ...)`` of the plan, and ``scratch_offsets`` / ``scratch_bytes`` the
    layout of one CuPy allocation holding all of them (used when the caller gives no workspace).
    """

    __slots__ = ("device", "launches", "params", "num_pointers", "_pack", "_buffers", "scratch",
                 "scratch_offsets", "scratch_bytes", "scratch_slots", "outputs", "_kernels", "_bias_map", "dbias",
                 "dbias_sums", "_qkv_maps", "_maps", "_map_pointers", "_maps_at")

    def __init__(self, plan: Plan, device_id: int, params: np.ndarray, num_pointers: int, outputs=(), bias=None,
                 qkv=None):
        cc = compute_capability(device_id)
        loaded = [build.get_kernel(item.variant, device_id, cc, item.smem_bytes) for item in plan.launches]
        self._kernels = tuple(loaded)  # keeps the modules (and so the function pointers) alive
        self.device = device_id
        self.launches = tuple(
            (kernel.function.ptr, *item.grid, item.variant.threads, item.smem_bytes)
            for kernel, item in zip(loaded, plan.launches)
        )
        # Q / K / V (and the backward's dO) by TMA where the plan runs a warp-specialized kernel that reads them on
        # the batched layout and the driver encodes every map (``qkv``: (shape, element strides, itemsize) of q, k,
        # v and, in the backward, dout, from the call that builds the plan; the cache key holds them and their
        # pointers' 16-byte alignment, so every hit encodes alike). The maps' layouts are fixed here; a launch
        # only encodes them at its pointers (tma_bytes).
        maps = []  # (pointer index, TmaParams offset, dims, byte strides, box, name) of each map a launch writes
        if qkv is not None and _reads_qkv_maps(plan) and not int(params[0]["cu_seqlens_q"]):
            ptrs = [int(params[0][name]) for name, _ in _MAPPED[:len(qkv)]]
            layouts = [tma.bshd_map_layout(*operand, ptr) for operand, ptr in zip(qkv, ptrs)]
            boxes = _qkv_boxes(plan)
            if all(layout is not None and tma.encode(ptr, *layout, boxes[name]) is not None
                   for (name, _), layout, ptr in zip(_MAPPED, layouts, ptrs)):
                maps += [(index, _MAP_OFFSETS[name], *layout, boxes[name], name)
                         for (name, index), layout in zip(_MAPPED, layouts)]
                params = params.copy()
                params[0]["qkv_tma"] = 1
        self._qkv_maps = tuple(qkv) if maps else None
        self.params = params.tobytes()
        self.num_pointers = num_pointers
        self._pack = _pointer_prefix(num_pointers).pack_into
        self._buffers = {}
        self.scratch = tuple(plan.scratch)
        offsets, total = [], 0
        for _, shape in plan.scratch:
            offsets.append(total)
            total += -(-4 * math.prod(shape) // _SCRATCH_ALIGNMENT) * _SCRATCH_ALIGNMENT
        self.scratch_offsets, self.scratch_bytes = tuple(offsets), total
        fields = [field for field, _ in plan.scratch]
        # Per scratch pointer field (SCRATCH_FIELDS): its index in plan.scratch, or None where this plan
        # leaves it null.
        self.scratch_slots = tuple(fields.index(f) if f in fields else None for f in SCRATCH_FIELDS)
        self.outputs = tuple(outputs)  # ((shape, numpy dtype) or None, ...): what a hit allocates
        self.dbias = None  # a backward with a bias: (shape, numpy dtype, zero it first) of the dbias a hit makes
        # a broadcast bias's sums (cuflash.dbias.Sums); None for a full-shape bias (each element stored once) or none
        self.dbias_sums = None
        # A bias loaded by TMA (params.bias_tma): its tensor map names the bias's address, so a call with
        # another bias buffer (same shape and strides: the key) launches with that buffer's map.
        # (shape, element strides, itemsize) of the bias, or None.
        self._bias_map = bias if bias is not None and int(params[0]["bias_tma"]) else None
        if self._bias_map is not None:
            if num_pointers <= _BIAS_POINTER:
                raise AssertionError("a plan loading the bias by TMA must patch the bias pointer")
            shape, strides, itemsize = self._bias_map
            layout = tma.bias_map_layout(shape, strides, itemsize, int(params[0]["bias"]))
            maps.insert(0, (_BIAS_POINTER, _MAP_OFFSETS["bias"], *layout, tma.BIAS_BOX, "bias"))
        self._maps = tuple(maps)
        self._map_pointers = tuple(entry[0] for entry in maps)
        self._maps_at = None  # (the pointers, TmaParams bytes) of the last tma_bytes: a loop passes the same buffers

    def params_bytes(self, pointers) -> bytes:
        """The parameter block a call with these pointers launches with (for tests and debugging)."""
        block = bytearray(self.params)
        self._pack(block, 0, *pointers)
        return bytes(block)

    def tma_bytes(self, pointers) -> bytes:
        """The TmaParams a call with these pointers launches with: the maps of the bias and of q / k / v (/ dout)
        where the plan loads them by TMA, zeros elsewhere."""
        at = tuple(pointers[index] for index in self._map_pointers)
        last = self._maps_at
        if last is not None and last[0] == at:
            return last[1]
        out = bytearray(TMA_PARAMS_BYTES)
        for (_, offset, dims, byte_strides, box, name), ptr in zip(self._maps, at):
            encoded = tma.encode(ptr, dims, byte_strides, box) if ptr % 16 == 0 else None
            if encoded is None:  # a cached call's operand off the 16-byte alignment its plan's first call had
                raise ValueError(f"{name} must be 16-byte aligned like the first call's with this shape (TMA loads)")
            out[offset:offset + 128] = encoded
        self._maps_at = (at, bytes(out))
        return self._maps_at[1]

    def _thread_buffer(self):
        ident = threading.get_ident()
        entry = self._buffers.get(ident)
        if entry is None:
            block = ctypes.create_string_buffer(self.params, len(self.params))
            maps = ctypes.create_string_buffer(TMA_PARAMS_BYTES + 64)
            maps_address = -(-ctypes.addressof(maps) // 64) * 64
            argv = (ctypes.c_void_p * 2)(ctypes.addressof(block), maps_address)
            entry = self._buffers[ident] = (block, ctypes.addressof(argv), (argv, maps), maps_address)
        return entry

    def launch(self, pointers, stream_ptr: int) -> None:
        """Write ``pointers`` into the parameter block (and the bias's tensor map into the TmaParams, where the
        plan loads it by TMA) and launch every kernel on ``stream_ptr``."""
        block, argv_address, _, maps_address = self._thread_buffer()
        self._pack(block, 0, *pointers)
        if self._maps:
            ctypes.memmove(maps_address, self.tma_bytes(pointers), TMA_PARAMS_BYTES)
        for function, gx, gy, gz, threads, smem in self.launches:
            launch_kernel(self.device, function, gx, gy, gz, threads, 1, 1, smem, stream_ptr, argv_address, 0)


def _qkv_boxes(plan: Plan) -> dict:
    """The box of each q / k / v / dout map of ``plan``: 64 x 64 (tma.BSHD_BOX), but K / V boxes of a whole key tile
    where the plan's warp-specialized forward has tiles 64 rows do not divide (tma.kv_box; the kernel's
    sm90::kv_box_rows). One box per map: a plan whose kernels would read K / V with two boxes is a planning bug."""
    kv = {tma.kv_box(item.variant.config.block_n) for item in plan.launches
          if item.variant.name == "cuflash::flash_fwd_kernel"
          and item.variant.config.mainloop == _forward_kernels.MAINLOOP_SM90_WS}
    if any(item.variant.name == "cuflash::flash_bwd_dkdv_kernel" for item in plan.launches):
        kv.add(tma.BSHD_BOX)
    if len(kv) > 1:
        raise AssertionError(f"one plan reads K / V by TMA with boxes {sorted(kv)}")
    box = kv.pop() if kv else tma.BSHD_BOX
    return {"q": tma.BSHD_BOX, "k": box, "v": box, "dout": tma.BSHD_BOX}


def _reads_qkv_maps(plan: Plan) -> bool:
    """Whether ``plan`` launches a kernel that reads the q / k / v (/ dout) maps: the warp-specialized forward
    or dK/dV kernel (mainloop 2 of either, or the dK/dV kernel's ordered 3)."""
    ws = {"cuflash::flash_fwd_kernel": (_forward_kernels.MAINLOOP_SM90_WS,),
          "cuflash::flash_bwd_dkdv_kernel": _backward_kernels.WS_MAINLOOPS}
    return any(item.variant.name in ws and item.variant.config.mainloop in ws[item.variant.name]
               for item in plan.launches)


#: CUresult CUDA_ERROR_INVALID_CONTEXT: no context is current on the calling thread.
_CUDA_ERROR_INVALID_CONTEXT = 201


def launch_kernel(device_id: int, *args) -> None:
    """``cuLaunchKernel(*args)`` on device ``device_id``, binding the device's primary context to this
    thread first where the driver finds none current (:func:`ensure_context`), then launching again."""
    try:
        _launch_kernel(*args)
    except Exception as exc:  # noqa: BLE001 - CuPy's CUDADriverError, imported lazily
        if getattr(exc, "status", None) != _CUDA_ERROR_INVALID_CONTEXT:
            raise
        ensure_context(device_id)
        _launch_kernel(*args)


def ensure_context(device_id: int) -> None:
    """Make ``device_id``'s primary context (the one CuPy and torch share) current on this thread, if no
    context is. The driver calls cuflash makes itself (cuLaunchKernel; cuModuleLoadData through CuPy)
    need one, and a thread whose CUDA runtime calls so far needed none has none: torch's autograd worker
    thread, which torch binds to a device only where ``cudaGetDevice`` names another, runs a backward whose
    buffers all come from torch's cache without a runtime call that would bind it (H100, session 19: the
    adapter's backward failed with CUDA_ERROR_INVALID_CONTEXT after no-autograd calls of the same shapes
    had filled the cache). ``cudaSetDevice`` binds the primary context (CUDA 12 and later)."""
    from cupy_backends.cuda.api import driver, runtime

    if driver.ctxGetCurrent() != 0:
        return
    runtime.setDevice(device_id)
    if driver.ctxGetCurrent() == 0:
        raise RuntimeError(f"cuflash could not make device {device_id}'s CUDA context current on this thread")


def _launch_kernel(*args):
    """``cuLaunchKernel`` (resolved on first use, so importing cuflash needs no CUDA)."""
    global _launch_kernel
    from cupy_backends.cuda.api import driver

    _launch_kernel = driver.launchKernel
    return driver.launchKernel(*args)
