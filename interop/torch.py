"""cuflash attention as PyTorch custom ops.

    import torch
    import cuflash.interop.torch as cft

    # q (batch, seq_q, heads, head_dim), k / v (batch, seq_k, kv_heads, head_dim): bf16, fp16 or fp32 on CUDA
    out = cft.attention(q, k, v, causal=True)
    out.float().square().sum().backward()        # q.grad, k.grad, v.grad

How it runs. ``attention`` calls the op ``torch.ops.cuflash.attention_fwd`` (returns out and lse); its autograd
formula calls ``torch.ops.cuflash.attention_bwd``. Both are ``torch.library.custom_op`` with fake
(meta) implementations, so autograd, ``torch.compile(fullgraph=True)`` and ``torch.library.opcheck`` see
ordinary ops. Inside, torch allocates every output and the backward's scratch (``torch.empty``, the caching
allocator, a CUDA graph's private pool during capture) and cuflash launches on torch's current stream of the
tensors' device, reading the tensors' pointers, shapes and strides directly: no copy, no DLPack, no host
sync, no CuPy allocation. After the first call with given shapes, strides, dtypes and options, a call only
patches pointers into a cached parameter block and launches (see ``cuflash.api``).

CUDA graphs: run the step once (on a side stream, as ``torch.cuda.graphs`` recommends) before capturing it:
that compiles and loads the kernels and caches the per-shape workspace sizes, so the captured call only
allocates from torch and launches.

Options are those of ``cuflash.attention``; they map onto the ops' arguments (``_OPTIONS``), a pair such as
``window=(left, right)`` onto two. ``bias`` gets its gradient where it requires one; a bias with
``requires_grad=False`` (an additive mask, a frozen bias) costs the backward no dbias work (the backward op's
``bias_grad=False``). Other tensor options get none. ``return_lse=True`` also returns ``lse (batch, heads,
seq_q)`` float32, differentiable.

Packed variable-length sequences: ``varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, causal=True)`` (ops ``cuflash::varlen_attention_fwd`` / ``_bwd``, the same structure) with q
``(total_q, heads, head_dim)``, k / v ``(total_k, kv_heads, head_dim)``, int32 CUDA offsets ``(batch + 1,)`` and
the longest lengths as ints.

KV-cache decoding: ``attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, causal=True)``
(op ``cuflash::attention_with_kvcache``, which mutates k_cache / v_cache: the append) with the core's arguments;
cache_seqlens and block_table are int32 CUDA tensors. No host synchronization and every buffer from torch's
allocator, so a decoding step captures in a CUDA graph (run it once first, as above).
"""
from __future__ import annotations

import functools

import cupy
import torch

import cuflash
from cuflash.interop import _cupy_stream

__all__ = ["attention", "attention_with_kvcache", "varlen_attention"]

# The ops' option arguments after the arrays, in schema order: (name, schema type, default).
_OPTIONS = (
    ("scale", "float?", None),
    ("causal", "bool", False),
    ("window_left", "int?", None),
    ("window_right", "int?", None),
    ("softcap", "float?", None),
    ("mask", "Tensor?", None),
    ("bias", "Tensor?", None),
    ("alibi_slopes", "Tensor?", None),
    ("segment_ids_q", "Tensor?", None),
    ("segment_ids_k", "Tensor?", None),
    ("block_ids_q", "Tensor?", None),
    ("block_ids_k", "Tensor?", None),
    ("dropout_p", "float", 0.0),
    ("seed", "int?", None),
    ("deterministic", "bool", False),
)
_OPTION_NAMES = tuple(name for name, _, _ in _OPTIONS)
_DEFAULTS = {name: default for name, _, default in _OPTIONS}
# A user's pair option and the two op arguments it becomes.
_PAIRS = {
    "window": ("window_left", "window_right"),
    "segment_ids": ("segment_ids_q", "segment_ids_k"),
    "block_ids": ("block_ids_q", "block_ids_k"),
}
_PAIR_FORMS = {
    "window": "(left, right) of ints or None",
    "segment_ids": "(q_ids (batch, seq_q), k_ids (batch, seq_k)) of int32 tensors",
    "block_ids": "(q_ids (batch, seq_q), k_ids (batch, seq_k)) of int32 tensors",
}
_PAIRED = {half for pair in _PAIRS.values() for half in pair}
_TENSOR_SLOTS = tuple(i for i, (_, kind, _) in enumerate(_OPTIONS) if kind == "Tensor?")
# The one tensor option with a gradient: when given and wanted (the backward op's bias_grad), attention_bwd
# returns dbias after dq, dk, dv.
_BIAS_SLOT = _OPTION_NAMES.index("bias")

_DEFAULT_OP_OPTIONS = tuple(_DEFAULTS[name] for name in _OPTION_NAMES)

_OPTION_SCHEMA = ", ".join(f"{kind} {name}" for name, kind, _ in _OPTIONS)


def attention(q, k, v, *, return_lse: bool = False, **options):
    """Exact attention ``softmax(scale * q @ k^T) @ v`` with cuflash's kernels, differentiable in torch.

    Args:
      q: ``(batch, seq_q, heads, head_dim)``; k: ``(batch, seq_k, kv_heads, head_dim)``;
        v: ``(batch, seq_k, kv_heads, head_dim_v)``; one dtype among bfloat16, float16, float32, on one
        CUDA device; the last dim contiguous (a ``(batch, heads, seq, dim)`` tensor ``.transpose(1, 2)`` is
        fine, with no copy); ``heads % kv_heads == 0``.
      return_lse: also return ``lse (batch, heads, seq_q)`` float32, differentiable.
      **options: as for ``cuflash.attention`` (``scale``, ``causal``, ``deterministic`` ...):
        ``window=(left, right)`` (ints or None), ``softcap``, and tensors on q's device: ``alibi_slopes``
        ``(heads,)`` or ``(batch, heads)`` float32, ``segment_ids`` / ``block_ids`` pairs
        ``(q_ids (batch, seq_q), k_ids (batch, seq_k))`` int32, which get no gradient.

    Dropout: ``dropout_p`` with ``seed`` (an int in [0, 2**63)); without a seed, an eager call draws one from
    torch's default CPU generator (so ``torch.manual_seed`` reproduces it) and the backward reuses it. Under
    ``torch.compile`` or CUDA-graph capture pass the seed yourself (a captured seed is replayed as is).

    Returns:
      ``out (batch, seq_q, heads, head_dim_v)`` in q's dtype (contiguous), or ``(out, lse)``.
    """
    if options.get("dropout_p") and options.get("seed") is None:
        if not _eager(q):
            raise ValueError("seed= is required with dropout_p > 0 under torch.compile (and for CUDA-graph "
                             "capture): pass an int seed")
        options = {**options, "seed": int(torch.randint(0, 2 ** 63 - 1, (1,)).item())}
    op_options = _op_options(options)
    if not _eager(q):
        out, lse = _FORWARD(q, k, v, *op_options)
    elif _records_grad(q, k, v, op_options):
        if op_options is _DEFAULT_OP_OPTIONS:
            out, lse = _EagerAttention.apply(q, k, v, op_options, ())
        else:  # the tensor options given ride as inputs of their own (the bias's gradient, saved-tensor checks)
            slots = tuple(i for i in _TENSOR_SLOTS if op_options[i] is not None)
            out, lse = _EagerAttention.apply(q, k, v, op_options, slots, *(op_options[i] for i in slots))
    else:  # nothing to differentiate: no autograd node (torch.autograd.Function.apply costs ~10 us)
        out, lse = _attention_fwd(q, k, v, *op_options)
    return (out, lse) if return_lse else out


def _records_grad(q, k, v, op_options) -> bool:
    """Whether autograd would record this call: grad mode on and some input that requires grad."""
    if not torch.is_grad_enabled():
        return False
    if q.requires_grad or k.requires_grad or v.requires_grad:
        return True
    return op_options is not _DEFAULT_OP_OPTIONS and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in op_options)


def _eager(q) -> bool:
    """True for a plain eager call: no torch.compile tracing, no dispatch mode (FakeTensor, opcheck), no
    functorch transform, a plain tensor with data (meta tensors take the ops' fake kernels). Such a call skips the custom op's Python dispatch layer (about
    0.8 ms of host time per forward+backward in torch 2.11: schema defaults filled and aliasing checked
    on every call) and runs the same implementations through a torch.autograd.Function; anything else
    goes through the registered ops, which torch.compile and opcheck see."""
    if type(q) is not torch.Tensor or q.device.type == "meta" or torch.compiler.is_compiling():
        return False
    if _dispatch_depth is not None and _dispatch_depth() != 0:
        return False
    return _functorch_level is None or _functorch_level() is None


_dispatch_depth = getattr(torch._C, "_len_torch_dispatch_stack", None)
_functorch_level = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def _op_options(options: dict) -> tuple:
    """``cuflash.attention``'s keyword options -> the ops' option arguments, in schema order."""
    if not options:
        return _DEFAULT_OP_OPTIONS
    values = dict(_DEFAULTS)
    for name, value in options.items():
        if name in _PAIRS:
            if value is not None:
                try:
                    values[_PAIRS[name][0]], values[_PAIRS[name][1]] = value
                except (TypeError, ValueError):
                    raise TypeError(f"{name} must be a pair {_PAIR_FORMS[name]}, got {value!r}") from None
        elif name in values and name not in _PAIRED:
            values[name] = value
        else:
            known = sorted((set(_DEFAULTS) - _PAIRED) | set(_PAIRS))
            raise TypeError(f"attention() got an unknown option {name!r}; the options are {', '.join(known)}")
    return tuple(values[name] for name in _OPTION_NAMES)


def _core_options(op_options: tuple) -> dict:
    """The ops' option arguments -> keywords for the core, leaving out every default (read-only)."""
    if all(op_options[i] is None for i in _TENSOR_SLOTS):
        return _constant_core_options(tuple(op_options))  # the usual case: once per option set
    return _build_core_options(op_options)


@functools.lru_cache(maxsize=256)
def _constant_core_options(op_options: tuple) -> dict:
    return _build_core_options(op_options)


def _build_core_options(op_options: tuple) -> dict:
    values = dict(zip(_OPTION_NAMES, op_options))
    options = {}
    for pair, (first, second) in _PAIRS.items():
        first, second = values.pop(first), values.pop(second)
        if first is not None or second is not None:
            options[pair] = (first, second)
    options.update((name, value) for name, value in values.items() if not _is_default(value, _DEFAULTS[name]))
    return options


def _is_default(value, default) -> bool:
    if default is None:
        return value is None
    return not isinstance(value, torch.Tensor) and value == default


# ---------------------------------------------------------------------------------------------------------
# The ops. Real and fake implementations allocate their outputs with the same functions, so their
# shapes, dtypes and strides agree (opcheck compares them).


def _forward_outputs(q, v):
    batch, seq_q, heads, head_dim = q.shape
    if v.shape[-1] == head_dim:  # empty_like is the cheapest allocation torch has (~3 us against ~5)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        out = q.new_empty((batch, seq_q, heads, v.shape[-1]))
    lse = q.new_empty((batch, heads, seq_q), dtype=torch.float32)
    return out, lse


def _backward_outputs(q, k, v, op_options, bias_grad: bool) -> list:
    # Gradients are contiguous whatever the inputs' strides (the fake kernels say the same).
    grads = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)]
    bias = op_options[_BIAS_SLOT]
    if bias is not None and bias_grad:
        grads.append(bias.new_empty(bias.shape))
    return grads


def _attention_fwd(q, k, v, *op_options):
    out, lse = _forward_outputs(q, v)
    _launch(cuflash.attention_forward, q, k, v, out=out, lse=lse, **_core_options(op_options))
    return out, lse


def _attention_fwd_fake(q, k, v, *op_options):
    return _forward_outputs(q, v)


def _attention_bwd(dout, q, k, v, out, lse, dlse, *op_options, bias_grad: bool = True):
    options = _core_options(op_options)
    grads = _backward_outputs(q, k, v, op_options, bias_grad)
    named = {"dq": grads[0], "dk": grads[1], "dv": grads[2]}
    if len(grads) > 3:
        named["dbias"] = grads[3]
    elif "bias" in options:
        named["bias_grad"] = False
    workspace = _backward_workspace(q, k, v, op_options, options)
    _launch(
        cuflash.attention_backward, dout, q, k, v, out, lse,
        dlse=dlse, workspace=workspace, **named, **options,
    )
    return grads


def _attention_bwd_fake(dout, q, k, v, out, lse, dlse, *op_options, bias_grad: bool = True):
    return _backward_outputs(q, k, v, op_options, bias_grad)


def _define_ops(name: str, forward, forward_fake, backward, backward_fake, arguments: str,
                backward_arguments: str = ""):
    """The forward op ``cuflash::{name}_fwd`` (q, k, v, arguments -> out, lse) and its backward op
    ``cuflash::{name}_bwd`` (dout, q, k, v, out, lse, dlse, arguments, backward_arguments -> grads), with
    their fake kernels."""
    forward_op = torch.library.custom_op(
        f"cuflash::{name}_fwd", forward, mutates_args=(),
        schema=f"(Tensor q, Tensor k, Tensor v, {arguments}) -> (Tensor, Tensor)",
    )
    forward_op.register_fake(forward_fake)
    backward_op = torch.library.custom_op(
        f"cuflash::{name}_bwd", backward, mutates_args=(),
        schema=f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, {arguments}"
               f"{backward_arguments}) -> Tensor[]",
    )
    backward_op.register_fake(backward_fake)
    return forward_op, backward_op


_forward_op, _backward_op = _define_ops("attention", _attention_fwd, _attention_fwd_fake, _attention_bwd,
                                        _attention_bwd_fake, _OPTION_SCHEMA, ", *, bool bias_grad=True")
_FORWARD = torch.ops.cuflash.attention_fwd.default
_BACKWARD = torch.ops.cuflash.attention_bwd.default


# ---------------------------------------------------------------------------------------------------------
# Autograd: attention_fwd's formula is attention_bwd.


def _setup_context(ctx, inputs, output):
    q, k, v, *op_options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *(op_options[i] for i in _TENSOR_SLOTS))
    ctx.op_options = [None if i in _TENSOR_SLOTS else value for i, value in enumerate(op_options)]
    # An output nobody used (lse, when return_lse=False) then gets None, not a tensor of zeros, and the
    # backward runs without a dlse term.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    return _backward_with(_BACKWARD, ctx, dout, dlse)


def _dense_grads(out, dout, dlse) -> tuple:
    """The incoming gradients as the backward takes them: autograd may hand an expanded (stride 0) or permuted
    gradient, as out.sum() does, or None for an output nobody used (dout then zeros: only lse was used)."""
    return (torch.zeros_like(out) if dout is None else dout.contiguous()), (None if dlse is None else dlse.contiguous())


def _backward_with(backward_fn, ctx, dout, dlse):
    q, k, v, out, lse, *tensor_options = ctx.saved_tensors
    op_options = list(ctx.op_options)
    for slot, tensor in zip(_TENSOR_SLOTS, tensor_options):
        op_options[slot] = tensor
    dout, dlse = _dense_grads(out, dout, dlse)
    # A bias nobody differentiates (requires_grad=False: an additive mask) gets no dbias work at all.
    bias_grad = op_options[_BIAS_SLOT] is not None and ctx.needs_input_grad[3 + _BIAS_SLOT]
    grads = backward_fn(dout, q, k, v, out, lse, dlse, *op_options, bias_grad=bias_grad)
    option_grads = [None] * len(_OPTION_NAMES)
    if bias_grad:
        option_grads[_BIAS_SLOT] = grads[3]
    return (grads[0], grads[1], grads[2], *option_grads)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager path (see ``_eager``): the ops' implementations and autograd formula, without the
    custom-op dispatch layer. Its inputs: q, k, v, the option tuple, the slots of the tensor options given and
    those tensors (usually none: an input costs the engine work per call, so the options' 15 slots do not
    each become one)."""

    @staticmethod
    def forward(ctx, q, k, v, op_options, slots, *tensors):
        out, lse = _attention_fwd(q, k, v, *op_options)
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.op_options, ctx.slots = op_options, slots
        ctx.set_materialize_grads(False)  # see _setup_context
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        op_options = ctx.op_options
        if tensors:
            op_options = list(op_options)
            for slot, tensor in zip(ctx.slots, tensors):
                op_options[slot] = tensor
        dout, dlse = _dense_grads(out, dout, dlse)
        bias_at = ctx.slots.index(_BIAS_SLOT) if _BIAS_SLOT in ctx.slots else None
        bias_grad = bias_at is not None and ctx.needs_input_grad[5 + bias_at]
        grads = _attention_bwd(dout, q, k, v, out, lse, dlse, *op_options, bias_grad=bias_grad)
        tensor_grads = [None] * len(tensors)
        if bias_grad:
            tensor_grads[bias_at] = grads[3]
        return grads[0], grads[1], grads[2], None, None, *tensor_grads


# ---------------------------------------------------------------------------------------------------------
# Launching: per-shape work cached; the core enqueues on torch's current stream.

_WORKSPACE_SHAPES: dict = {}


def _backward_workspace(q, k, v, op_options, options) -> dict:
    """The backward's workspace: ``cuflash.backward_workspace``'s buffers for these shapes and options."""
    if not any(isinstance(x, torch.Tensor) for x in op_options):
        key = (q.shape, k.shape, v.shape, q.dtype, q.device, op_options)
    else:
        key = (
            q.shape, k.shape, v.shape, q.dtype, q.device,
            tuple((x.shape, x.dtype) if isinstance(x, torch.Tensor) else x for x in op_options),
        )
    return _workspace(_WORKSPACE_SHAPES, key, q.device, lambda: cuflash.backward_workspace(q, k, v, **options))


def _workspace(cache: dict, key, device, find) -> dict:
    """float32 buffers from torch's allocator with the shapes ``find()`` gives (a core ``*_workspace`` call,
    run once per ``key``: its shapes follow the architecture of ``device``)."""
    shapes = cache.get(key)
    if shapes is None:
        if device.type == "cuda":
            with cupy.cuda.Device(device.index):
                found = find()
        else:  # tests: a NumPy core on CPU tensors
            found = find()
        shapes = cache[key] = {name: tuple(shape) for name, shape in found.items()}
    return {name: torch.empty(shape, dtype=torch.float32, device=device) for name, shape in shapes.items()}


def _launch(core_fn, *args, **kwargs):
    """Call the core on torch's current stream of the tensors' device, handing it the tensors themselves:
    the core reads their pointers, shapes and strides directly (no DLPack, no CuPy views), and a call
    whose shapes, strides, dtypes and options it has seen before only patches pointers and launches."""
    device = args[0].device  # every tensor shares one device; the core checks
    if device.type != "cuda":  # the core names the problem (tests hand a NumPy core CPU tensors)
        args = [a.detach() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
        kwargs = {n: a.detach() if isinstance(a, torch.Tensor) and a.requires_grad else a
                  for n, a in kwargs.items()}
        core_fn(*args, **kwargs)
        return
    index = device.index
    stream_ptr = _raw_stream(index)
    if _current_device() == index:
        core_fn(*args, stream=stream_ptr, **kwargs)
        return
    with torch.cuda.device(index), cupy.cuda.Device(index), _cupy_stream(index, stream_ptr):
        core_fn(*args, stream=stream_ptr, **kwargs)


def _raw_stream(index: int) -> int:
    """torch's current ``cudaStream_t`` on device ``index`` as an int (what inductor's code reads)."""
    return torch.cuda.current_stream(index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):
    _raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811 (no Stream object per call)


def _current_device() -> int:
    return cupy.cuda.runtime.getDevice()


# ---------------------------------------------------------------------------------------------------------
# Packed variable-length sequences: ops of their own (the offsets are tensors, the longest lengths ints).

_VARLEN_OPTIONS = (
    ("scale", "float?", None),
    ("causal", "bool", False),
    ("window_left", "int?", None),
    ("window_right", "int?", None),
    ("softcap", "float?", None),
    ("alibi_slopes", "Tensor?", None),
    ("deterministic", "bool", False),
)
_VARLEN_NAMES = tuple(name for name, _, _ in _VARLEN_OPTIONS)
_VARLEN_SCHEMA = ", ".join(f"{kind} {name}" for name, kind, _ in _VARLEN_OPTIONS)
_VARLEN_ARGS = "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k"


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     return_lse: bool = False, scale=None, causal: bool = False, window=None, softcap=None,
                     alibi_slopes=None, deterministic: bool = False):
    """Attention over packed variable-length sequences (``cuflash.varlen_attention``), differentiable in torch.

    Args:
      q: ``(total_q, heads, head_dim)``; k, v: ``(total_k, kv_heads, head_dim[_v])``: the sequences back to
        back, on one CUDA device; cu_seqlens_q, cu_seqlens_k: int32 CUDA tensors ``(batch + 1,)`` of row
        offsets; max_seqlen_q, max_seqlen_k: ints >= every sequence's length.
      return_lse: also return ``lse (heads, total_q)`` float32, differentiable.
      scale, causal, window, softcap, alibi_slopes (``(heads,)`` or ``(batch, heads)`` float32, no
        gradient), deterministic: as for ``cuflash.varlen_attention``.

    Returns:
      ``out (total_q, heads, head_dim_v)`` in q's dtype (contiguous), or ``(out, lse)``.
    """
    left, right = (None, None) if window is None else window
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale, bool(causal), left,
            right, softcap, alibi_slopes, bool(deterministic))
    if not _eager(q):
        out, lse = _VARLEN_FORWARD(*args)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _EagerVarlen.apply(*args)  # as attention(): the ops' formula without their dispatch layer
    else:
        out, lse = _varlen_fwd(*args)
    return (out, lse) if return_lse else out


def _varlen_core_options(op_options) -> dict:
    values = dict(zip(_VARLEN_NAMES, op_options))
    left, right = values.pop("window_left"), values.pop("window_right")
    options = {name: value for name, value in values.items() if value is not None and value is not False}
    if left is not None or right is not None:
        options["window"] = (left, right)
    return options


def _varlen_outputs(q, v):
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse


def _varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, *op_options):
    out, lse = _varlen_outputs(q, v)
    _launch(cuflash.varlen_attention_forward, q, k, v, cu_q, cu_k, max_q, max_k, out=out, lse=lse,
            **_varlen_core_options(op_options))
    return out, lse


def _varlen_fwd_fake(q, k, v, cu_q, cu_k, max_q, max_k, *op_options):
    return _varlen_outputs(q, v)


def _varlen_grads(q, k, v) -> list:
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)]


def _varlen_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, *op_options):
    options = _varlen_core_options(op_options)
    dq, dk, dv = _varlen_grads(q, k, v)
    key = (q.shape, k.shape, v.shape, q.dtype, q.device, cu_q.shape, max_q, max_k,
           tuple((x.shape, x.dtype) if isinstance(x, torch.Tensor) else x for x in op_options))
    workspace = _workspace(_WORKSPACE_SHAPES, key, q.device,
                           lambda: cuflash.varlen_backward_workspace(q, k, v, cu_q, cu_k, max_q, max_k, **options))
    _launch(cuflash.varlen_attention_backward, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dlse=dlse,
            dq=dq, dk=dk, dv=dv, workspace=workspace, **options)
    return [dq, dk, dv]


def _varlen_bwd_fake(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, *op_options):
    return _varlen_grads(q, k, v)


_varlen_forward_op, _ = _define_ops("varlen_attention", _varlen_fwd, _varlen_fwd_fake, _varlen_bwd,
                                    _varlen_bwd_fake, f"{_VARLEN_ARGS}, {_VARLEN_SCHEMA}")
_VARLEN_FORWARD = torch.ops.cuflash.varlen_attention_fwd.default
_VARLEN_BACKWARD = torch.ops.cuflash.varlen_attention_bwd.default


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, *op_options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, op_options[_VARLEN_NAMES.index("alibi_slopes")])
    ctx.lengths = (max_q, max_k)
    ctx.op_options = op_options
    ctx.set_materialize_grads(False)


def _varlen_backward(ctx, dout, dlse):
    return _varlen_backward_with(_VARLEN_BACKWARD, ctx, dout, dlse)


def _varlen_backward_with(backward_fn, ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, alibi = ctx.saved_tensors
    op_options = list(ctx.op_options)
    op_options[_VARLEN_NAMES.index("alibi_slopes")] = alibi
    dout, dlse = _dense_grads(out, dout, dlse)
    dq, dk, dv = backward_fn(dout, q, k, v, out, lse, dlse, cu_q, cu_k, *ctx.lengths, *op_options)
    return (dq, dk, dv, None, None, None, None, *(None for _ in op_options))


_varlen_forward_op.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


class _EagerVarlen(torch.autograd.Function):
    """The eager varlen path (see ``_eager``), as ``_EagerAttention`` is for the batched one."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, *op_options):
        out, lse = _varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, *op_options)
        _varlen_setup_context(ctx, (q, k, v, cu_q, cu_k, max_q, max_k, *op_options), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _varlen_backward_with(_varlen_bwd, ctx, dout, dlse)


# ---------------------------------------------------------------------------------------------------------
# KV cache: one op that appends into the caches (declared mutated) and returns out and lse. No gradient.

_KVCACHE_SCHEMA = (
    "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? k_new, Tensor? v_new, "
    "Tensor? block_table, int? num_splits, float? scale, bool causal, int? window_left, int? window_right, "
    "float? softcap, Tensor? alibi_slopes) -> (Tensor, Tensor)"
)


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *, block_table=None,
                           num_splits=None, return_lse: bool = False, scale=None, causal: bool = False, window=None,
                           softcap=None, alibi_slopes=None):
    """``cuflash.attention_with_kvcache`` as a torch op: appends ``k_new`` / ``v_new`` into ``k_cache`` /
    ``v_cache`` in place (at ``cache_seqlens[b]`` onwards), then attends. ``cache_seqlens`` ``(batch,)`` and
    ``block_table`` ``(batch, max_pages)`` are int32 CUDA tensors (an int for cache_seqlens is turned into one).

    Returns ``out (batch, seq_q, heads, head_dim_v)``, or ``(out, lse (batch, heads, seq_q))``.
    """
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32, device=q.device)
    left, right = (None, None) if window is None else window
    args = (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
            None if num_splits is None else int(num_splits), scale, bool(causal), left, right, softcap, alibi_slopes)
    if _eager(q) and not (torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k_cache, v_cache, k_new, v_new))):
        # A decoding step's host time: the op's dispatch layer costs ~3x the call itself. The op declares
        # k_cache / v_cache mutated, and its dispatch bumps their version counters (so autograd notices a
        # saved cache changed): do the same.
        out, lse = _kvcache_op(*args)
        _increment_version((k_cache, v_cache))
    else:
        out, lse = _KVCACHE(*args)
    return (out, lse) if return_lse else out


_increment_version = getattr(getattr(torch.autograd, "graph", None), "increment_version", None) or (
    lambda tensors: [torch._C._increment_version(t) for t in tensors])


_KVCACHE_WORKSPACE: dict = {}


def _kvcache_outputs(q, v_cache):
    out = q.new_empty((*q.shape[:3], v_cache.shape[-1]))
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


def _kvcache_op(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, num_splits, scale, causal,
                window_left, window_right, softcap, alibi_slopes):
    out, lse = _kvcache_outputs(q, v_cache)
    options = {name: value for name, value in (("softcap", softcap), ("alibi_slopes", alibi_slopes))
               if value is not None}
    if window_left is not None or window_right is not None:
        options["window"] = (window_left, window_right)
    key = (q.shape, k_cache.shape, v_cache.shape, q.dtype, q.device, None if block_table is None else block_table.shape,
           num_splits, tuple(sorted(options)))
    workspace = _workspace(_KVCACHE_WORKSPACE, key, q.device, lambda: cuflash.kvcache_workspace(
        q, k_cache, v_cache, block_table=block_table, num_splits=num_splits, **options))
    _launch(cuflash.attention_with_kvcache, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=block_table,
            num_splits=num_splits, scale=scale, causal=causal, out=out, lse=lse, workspace=workspace or None,
            **options)
    return out, lse


def _kvcache_fake(q, k_cache, v_cache, *rest):
    return _kvcache_outputs(q, v_cache)


_kvcache_custom_op = torch.library.custom_op("cuflash::attention_with_kvcache", _kvcache_op,
                                             mutates_args=("k_cache", "v_cache"), schema=_KVCACHE_SCHEMA)
_kvcache_custom_op.register_fake(_kvcache_fake)
_KVCACHE = torch.ops.cuflash.attention_with_kvcache.default
