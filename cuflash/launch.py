"""From validated descriptions and a plan to kernel launches on a stream.

Fills the ``AttnParams`` block (pointers and strides straight from the caller's arrays: no copies)
and launches the plan's kernels in order on the given stream. No host synchronization.
"""
from __future__ import annotations

import ctypes
import functools
import math

from . import build, kernels
from .arrays import TensorDesc
from .kernels import Plan, ProblemShape
import numpy as np

from .params import params_dtype

_LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=None)
def compute_capability(device_id: int) -> str:
    import cupy

    return cupy.cuda.Device(device_id).compute_capability


@functools.lru_cache(maxsize=4096)
def forward_plan(shape: ProblemShape, device_id: int) -> Plan:
    return kernels.plan_forward(shape, int(compute_capability(device_id)))


@functools.lru_cache(maxsize=4096)
def backward_plan(shape: ProblemShape, device_id: int, deterministic: bool) -> Plan:
    return kernels.plan_backward(shape, int(compute_capability(device_id)), deterministic)


_STRIDED_FIELDS = (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o"), ("dout", "do"), ("dq", "dq"), ("dk", "dk"), ("dv", "dv"))


def make_params(shape: ProblemShape, scale: float, q, k, v, out, lse, *, dout=None, dq=None, dk=None,
                dv=None, dlse=None, scratch=None):
    """The size-1 params array for one call. Every argument is a TensorDesc (or None).

    Values are gathered in a dict and packed in one ``np.array`` call: assigning the ~50 fields of a
    structured scalar one by one cost ~25 µs of host time per call.
    """
    values = {
        "batch": shape.batch, "seqlen_q": shape.seqlen_q, "seqlen_k": shape.seqlen_k,
        "num_heads": shape.num_heads, "num_heads_k": shape.num_heads_k,
        "head_dim": shape.head_dim, "head_dim_v": shape.head_dim_v,
        "h_per_kv": shape.num_heads // shape.num_heads_k,
        "causal_offset": shape.seqlen_k - shape.seqlen_q,
        "scale": scale, "scale_log2": scale * _LOG2E,
    }
    tensors = {"q": q, "k": k, "v": v, "o": out, "dout": dout, "dq": dq, "dk": dk, "dv": dv}
    for field, prefix in _STRIDED_FIELDS:  # (B, S, H, D)
        t = tensors[field]
        if t is not None:
            values[field] = t.ptr
            values[f"{prefix}_batch_stride"], values[f"{prefix}_row_stride"], values[f"{prefix}_head_stride"] = t.strides[:3]
    for field, t in (("lse", lse), ("dlse", dlse)):  # (B, H, S), rows contiguous
        if t is not None:
            values[field] = t.ptr
            values[f"{field}_batch_stride"], values[f"{field}_head_stride"] = t.strides[:2]
    if scratch:
        values.update(scratch)
    dtype = params_dtype()
    return np.array([tuple(values.get(name, 0) for name in dtype.names)], dtype=dtype)


def run(plan: Plan, params, device_id: int, stream) -> None:
    """Launch every kernel of ``plan`` in order on ``stream`` (a CuPy stream).

    Straight through ``cuLaunchKernel`` with a pointer to the params bytes: CuPy's generic argument
    handling re-derives a structured array's description on every call (~40 µs of host time).
    The driver copies the parameter block at launch, so ``params`` need only live until it returns.
    """
    from cupy_backends.cuda.api import driver

    cc = compute_capability(device_id)
    argv = (ctypes.c_void_p * 1)(params.ctypes.data)
    stream_ptr = stream.ptr
    for item in plan.launches:
        kernel = build.get_kernel(item.variant, device_id, cc)
        gx, gy, gz = item.grid
        driver.launchKernel(kernel.function.ptr, gx, gy, gz, item.variant.threads, 1, 1,
                            item.variant.smem_bytes, stream_ptr, ctypes.addressof(argv), 0)


def scratch_bytes(plan: Plan) -> int:
    return sum(4 * math.prod(shape) for _, shape in plan.scratch)
