"""Adapters that make cuflash a differentiable op of a framework.

* ``cuflash.interop.jax``: ``attention`` as a ``jax.custom_vjp`` that runs inside ``jax.jit`` on XLA's stream,
  with XLA allocating every output and the backward's scratch; ``attention_sharded`` for ``shard_map``.
* ``cuflash.interop.torch``: ``attention`` as ``torch.library`` custom ops with fake and autograd
  registrations, for eager autograd, ``torch.compile(fullgraph=True)`` and CUDA-graph capture.

Import the one you use; importing this package imports neither framework.
"""
import functools
import warnings


class _StreamHandle:
    """A raw ``cudaStream_t`` wearing the CUDA stream protocol, which ``cupy.cuda.Stream.from_external`` reads."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


@functools.lru_cache(maxsize=64)
def _cupy_stream(device_id: int, stream_ptr: int):
    """CuPy's view of a framework's stream, made once per (device, stream).

    Adapters make it CuPy's current stream around a core call, so that everything CuPy does there, DLPack
    imports included (``cupy.from_dlpack`` hands the producer CuPy's current stream, and torch syncs only
    when that differs from its own), is ordered on the framework's stream with no cross-stream wait, which
    a CUDA-graph capture would not survive.
    """
    import cupy

    if stream_ptr == 0:
        return cupy.cuda.Stream.null
    external = getattr(cupy.cuda, "ExternalStream", None)
    if external is None:
        return cupy.cuda.Stream.from_external(_StreamHandle(stream_ptr))
    # ExternalStream with its device given makes no CUDA call, so it is safe to create even while a CUDA
    # graph is being captured; CuPy 14 deprecates it in favour of Stream.from_external.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return external(stream_ptr, device_id)
