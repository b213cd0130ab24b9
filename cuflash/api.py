"""The public entry points: validate at the boundary, allocate what the caller did not, launch."""
from __future__ import annotations

import contextlib

from . import launch, validation
from .arrays import describe, dtype_name, require_cuda, resolve_stream
from .kernels import ProblemShape


def _enter_device(stack: contextlib.ExitStack, device_id: int, stream, given_stream):
    """Make ``device_id`` current for allocations and launches (a no-op when it already is); with no
    ``stream=`` given, the work goes on that device's current stream. Returns the stream to use."""
    import cupy

    if cupy.cuda.runtime.getDevice() != device_id:
        stack.enter_context(cupy.cuda.Device(device_id))
        if given_stream is None:
            stream = cupy.cuda.get_current_stream()
            stack.enter_context(stream)
    return stream


def _enter_call(stack: contextlib.ExitStack, q, k, v, *, causal, scale, stream, options, arrays=()):
    """The start every entry point shares: refuse planned options and non-GPU arrays (before touching
    CUDA), make the stream current, describe and validate q/k/v, switch to their device.
    Returns ``(qd, kd, vd, shape, scale, stream)``."""
    validation.reject_planned(options)
    for name, x in (("q", q), ("k", k), ("v", v)) + tuple(arrays):
        require_cuda(x, name)
    given_stream, stream = stream, resolve_stream(stream)
    stack.enter_context(stream)
    qd, kd, vd = describe(q, "q"), describe(k, "k"), describe(v, "v")
    shape = validation.check_qkv(qd, kd, vd, causal=causal)
    scale = validation.check_scale(scale, shape.head_dim)
    stream = _enter_device(stack, qd.device, stream, given_stream)
    return qd, kd, vd, shape, scale, stream


def _buffer(given, name: str, shape: tuple, dtype: str, device: int, *, rows_only=False, fill=None):
    """Describe a caller-provided buffer after checking it, or allocate one."""
    import cupy

    if given is None:
        arr = cupy.empty(shape, dtype=_np_dtype(dtype))
        if fill is not None:
            arr.fill(fill)
        return describe(arr, name)
    t = describe(given, name)
    validation.check_buffer(t, shape, dtype, device, rows_contiguous_only=rows_only)
    if fill is not None:
        t.array.fill(fill)
    return t


def _np_dtype(name: str):
    import numpy as np

    from .arrays import BFLOAT16

    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def _has_work(shape: ProblemShape) -> bool:
    return shape.batch * shape.num_heads * shape.seqlen_q > 0


def attention_forward(q, k, v, *, scale=None, causal=False, deterministic=False, out=None, lse=None,
                      stream=None, **options):
    """Exact attention forward. Returns ``(out, lse)`` as CuPy arrays.

    q ``(B, Sq, H, D)``, k ``(B, Sk, Hkv, D)``, v ``(B, Sk, Hkv, Dv)``: any ``__dlpack__`` CUDA arrays
    (float16, bfloat16, float32) whose last dim is contiguous; ``H % Hkv == 0``. ``out`` ``(B, Sq, H, Dv)``
    and ``lse`` ``(B, H, Sq)`` float32 may be given as caller-allocated buffers (written in place).
    ``lse`` is the natural-log sum of exponentials of the scaled scores, ``-inf`` for a row that sees no
    key (whose output is 0). ``deterministic`` is accepted for symmetry: the forward always is.
    """
    with contextlib.ExitStack() as stack:
        qd, kd, vd, shape, scale, stream = _enter_call(stack, q, k, v, causal=causal, scale=scale,
                                                       stream=stream, options=options)
        no_keys = shape.seqlen_k == 0
        out_d = _buffer(out, "out", validation.out_shape(shape), shape.dtype, qd.device,
                        fill=0 if no_keys else None)
        lse_d = _buffer(lse, "lse", validation.lse_shape(shape), "float32", qd.device, rows_only=True,
                        fill=float("-inf") if no_keys else None)
        if _has_work(shape) and not no_keys:
            plan = launch.forward_plan(shape, qd.device)
            params = launch.make_params(shape, scale, qd, kd, vd, out_d, lse_d)
            launch.run(plan, params, qd.device, stream)
    return out_d.array, lse_d.array


def attention(q, k, v, *, scale=None, causal=False, deterministic=False, return_lse=False, out=None,
              lse=None, stream=None, **options):
    """Exact attention ``softmax(scale * q k^T) v`` (see :func:`attention_forward` for the arguments).

    Returns ``out``, or ``(out, lse)`` when ``return_lse=True``. For gradients use the JAX or torch
    adapters (``cuflash.interop``), or :func:`attention_forward` / :func:`attention_backward`.
    """
    out, lse = attention_forward(q, k, v, scale=scale, causal=causal, deterministic=deterministic,
                                 out=out, lse=lse, stream=stream, **options)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, dlse=None, scale=None, causal=False,
                       deterministic=False, dq=None, dk=None, dv=None, workspace=None, stream=None,
                       **options):
    """Gradients of attention. Returns ``(dq, dk, dv)``, each in its input's shape and dtype.

    ``out`` and ``lse`` are :func:`attention_forward`'s results for the same inputs and options.
    ``dlse`` ``(B, H, Sq)`` float32 is the gradient flowing into ``lse`` (ring / context-parallel
    attention). ``deterministic=True`` makes dq/dk/dv bit-identical across runs (no float atomics).
    ``workspace``: a dict of caller-allocated contiguous float32 buffers with the shapes
    :func:`backward_workspace` returns (frameworks pass their own memory; default: CuPy's pool).
    """
    with contextlib.ExitStack() as stack:
        qd, kd, vd, shape, scale, stream = _enter_call(
            stack, q, k, v, causal=causal, scale=scale, stream=stream, options=options,
            arrays=(("dout", dout), ("out", out), ("lse", lse)))
        dev, dtype = qd.device, shape.dtype
        o_shape, l_shape = validation.out_shape(shape), validation.lse_shape(shape)
        out_d, dout_d = describe(out, "out"), describe(dout, "dout")
        validation.check_buffer(out_d, o_shape, dtype, dev)
        validation.check_buffer(dout_d, o_shape, dtype, dev)
        lse_d = describe(lse, "lse")
        validation.check_buffer(lse_d, l_shape, "float32", dev, rows_contiguous_only=True)
        dlse_d = None
        if dlse is not None:
            dlse_d = describe(dlse, "dlse")
            validation.check_buffer(dlse_d, l_shape, "float32", dev, rows_contiguous_only=True)
        no_work = not _has_work(shape) or shape.seqlen_k == 0
        zero = 0 if no_work else None
        dq_d = _buffer(dq, "dq", qd.shape, dtype, dev, fill=zero)
        dk_d = _buffer(dk, "dk", kd.shape, dtype, dev, fill=zero)
        dv_d = _buffer(dv, "dv", vd.shape, dtype, dev, fill=zero)
        if not no_work:
            plan = launch.backward_plan(shape, dev, bool(deterministic))
            # `owners` keeps freshly allocated scratch alive until the launches are enqueued; after
            # that CuPy's stream-ordered pool may reuse it only for work ordered behind them.
            scratch, owners = _scratch(plan, workspace, dev)
            params = launch.make_params(shape, scale, qd, kd, vd, out_d, lse_d, dout=dout_d, dq=dq_d,
                                        dk=dk_d, dv=dv_d, dlse=dlse_d, scratch=scratch)
            launch.run(plan, params, dev, stream)
            del owners
    return dq_d.array, dk_d.array, dv_d.array


def _scratch(plan, workspace, device: int) -> tuple:
    """Pointers of the plan's fp32 scratch buffers, from ``workspace`` or freshly allocated, and the
    arrays that own them (which the caller must keep alive until its launches are enqueued)."""
    import cupy

    pointers, owners = {}, []
    for field, shape in plan.scratch:
        if workspace is None:
            owners.append(cupy.empty(shape, dtype=cupy.float32))
            pointers[field] = owners[-1].data.ptr
            continue
        if field not in workspace:
            raise ValueError(f"workspace lacks the buffer {field!r} (see cuflash.backward_workspace)")
        t = describe(workspace[field], f"workspace[{field!r}]")
        validation.check_buffer(t, shape, "float32", device, rows_contiguous_only=True)
        contiguous = all(s == e for s, e in zip(t.strides, _contiguous_strides(shape)))
        if not contiguous:
            raise ValueError(f"workspace[{field!r}] must be contiguous, got strides {t.strides}")
        pointers[field] = t.ptr
        owners.append(t.array)
    return pointers, owners


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def _shape_from_meta(q, k, v, causal: bool) -> ProblemShape:
    """A ProblemShape from anything with ``.shape`` and ``.dtype`` (tracers, torch tensors, ...)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(t.shape) != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
    b, sq, h, d = (int(x) for x in q.shape)
    _, sk, hk, _ = (int(x) for x in k.shape)
    dv = int(v.shape[3])
    dtype = dtype_name(q.dtype)
    if dtype not in ("float16", "bfloat16", "float32"):
        raise TypeError(f"q has dtype {dtype}; cuflash supports float16, bfloat16, float32")
    if hk < 1 or h % hk:
        raise ValueError(f"k has {hk} heads, which does not divide q's {h} heads")
    return ProblemShape(b, sq, sk, h, hk, d, dv, dtype, bool(causal))


def _current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


def backward_workspace(q, k, v, *, causal=False, deterministic=False, scale=None, **options) -> dict:
    """Shapes of the float32 scratch buffers :func:`attention_backward` needs, by name.

    ``q``/``k``/``v`` may be anything with ``.shape`` and ``.dtype``; the current device's arch is used.
    ``scale`` does not change the plan and is accepted so callers can pass one option set everywhere.
    """
    validation.reject_planned(options)
    shape = _shape_from_meta(q, k, v, causal)
    if not _has_work(shape) or shape.seqlen_k == 0:
        return {}
    return launch.backward_plan(shape, _current_device(), bool(deterministic)).scratch_dict()


def prepare(q, k, v, *, causal=False, deterministic=False, backward=True, scale=None, **options) -> None:
    """Compile and load every kernel a call with these shapes launches (e.g. before a CUDA-graph
    capture, where compiling is not allowed). ``q``/``k``/``v`` need only ``.shape`` and ``.dtype``."""
    from . import build

    validation.reject_planned(options)
    shape = _shape_from_meta(q, k, v, causal)
    device = _current_device()
    plans = [launch.forward_plan(shape, device)]
    if backward:
        plans.append(launch.backward_plan(shape, device, bool(deterministic)))
    cc = launch.compute_capability(device)
    for plan in plans:
        for item in plan.launches:
            build.get_kernel(item.variant, device, cc)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
    """Packed variable-length attention (API.md). Not implemented in this version yet."""
    raise NotImplementedError("varlen_attention is planned but not implemented in this version of cuflash; "
                              "cuflash.reference.varlen_attention_forward is the float64 reference")


def varlen_attention_backward(*args, **options):
    """Backward of :func:`varlen_attention`. Not implemented in this version yet."""
    raise NotImplementedError("varlen_attention_backward is planned but not implemented in this version of cuflash")


def attention_with_kvcache(q, k_cache, v_cache, **options):
    """KV-cache decoding (paged, split-KV). Not implemented in this version yet."""
    raise NotImplementedError("attention_with_kvcache is planned but not implemented in this version of cuflash")
