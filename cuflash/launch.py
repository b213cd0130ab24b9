"""From validated descriptions and a plan to kernel launches on a stream.

Fills the ``AttnParams`` block (pointers and strides straight from the caller's arrays: no copies)
and launches the plan's kernels in order on the given stream. No host synchronization.
"""
from __future__ import annotations

import functools
import math

from . import build, kernels
from .arrays import TensorDesc
from .kernels import Plan, ProblemShape
from .params import new_params

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


def _set_strided(p, prefix: str, t: TensorDesc, kind: str = "bshd") -> None:
    if kind == "bshd":  # (B, S, H, D)
        p[f"{prefix}_batch_stride"], p[f"{prefix}_row_stride"], p[f"{prefix}_head_stride"] = t.strides[:3]
    else:  # (B, H, S) rows contiguous
        p[f"{prefix}_batch_stride"], p[f"{prefix}_head_stride"] = t.strides[:2]


def make_params(shape: ProblemShape, scale: float, q, k, v, out, lse, *, dout=None, dq=None, dk=None,
                dv=None, dlse=None, scratch=None):
    """The size-1 params array for one call. Every argument is a TensorDesc (or None)."""
    params = new_params()
    p = params[0]
    p["batch"], p["seqlen_q"], p["seqlen_k"] = shape.batch, shape.seqlen_q, shape.seqlen_k
    p["num_heads"], p["num_heads_k"] = shape.num_heads, shape.num_heads_k
    p["head_dim"], p["head_dim_v"] = shape.head_dim, shape.head_dim_v
    p["h_per_kv"] = shape.num_heads // shape.num_heads_k
    p["causal_offset"] = shape.seqlen_k - shape.seqlen_q
    p["scale"], p["scale_log2"] = scale, scale * _LOG2E
    for field, t in (("q", q), ("k", k), ("v", v), ("o", out), ("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
        if t is not None:
            p[field] = t.ptr
            _set_strided(p, "do" if field == "dout" else field, t)
    for field, t in (("lse", lse), ("dlse", dlse)):
        if t is not None:
            p[field] = t.ptr
            _set_strided(p, field, t, kind="bhs")
    for field, ptr in (scratch or {}).items():
        p[field] = ptr
    return params


def run(plan: Plan, params, device_id: int, stream) -> None:
    """Launch every kernel of ``plan`` in order on ``stream`` (a CuPy stream)."""
    cc = compute_capability(device_id)
    for launch in plan.launches:
        kernel = build.get_kernel(launch.variant, device_id, cc)
        kernel.function(launch.grid, (launch.variant.threads, 1, 1), (params,),
                        shared_mem=launch.variant.smem_bytes, stream=stream)


def scratch_bytes(plan: Plan) -> int:
    return sum(4 * math.prod(shape) for _, shape in plan.scratch)
