"""The array boundary: any ``__dlpack__`` CUDA array in, a small description out, zero-copy.

Shapes, strides (in elements), dtype, base pointer and device are read once into a
:class:`TensorDesc`; validation and the launcher work on those. The CuPy view that
``cupy.from_dlpack`` returns shares memory with the caller's array (JAX, torch, CuPy): nothing is
ever copied here.
"""
from __future__ import annotations

import dataclasses

import numpy as np

try:  # ml_dtypes registers bfloat16 with numpy; CuPy 14 understands it.
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a hard dependency
    BFLOAT16 = None

#: dtypes the kernels take, by canonical name.
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")

# DLPack device types (dlpack.h: DLDeviceType).
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
_DL_DEVICE_NAMES = {1: "the CPU", 2: "CUDA", 3: "CUDA pinned host memory", 4: "OpenCL",
                    7: "Vulkan", 8: "Metal", 10: "ROCm", 13: "CUDA managed memory"}


_dtype_names: dict = {}


def dtype_name(dtype) -> str:
    """Canonical name of a numpy / ml_dtypes / JAX / torch dtype: 'bfloat16', 'float32', ...
    (memoized: numpy's ``dtype.name`` costs microseconds on every call's hot path)."""
    try:
        return _dtype_names[dtype]
    except (KeyError, TypeError):
        pass
    name = str(getattr(dtype, "name", dtype)).removeprefix("torch.")
    try:
        _dtype_names[dtype] = name
    except TypeError:  # unhashable dtype-like object
        pass
    return name


@dataclasses.dataclass(frozen=True)
class TensorDesc:
    """What the launcher needs to know about one array."""

    name: str  # the argument's name, for error messages
    shape: tuple
    strides: tuple  # in elements
    dtype: str  # canonical dtype name
    itemsize: int
    ptr: int
    device: int
    array: object = dataclasses.field(default=None, compare=False, repr=False)  # the CuPy view

    @property
    def ndim(self) -> int:
        return len(self.shape)


def require_cuda(x, name: str) -> None:
    """Reject non-arrays and arrays off the GPU, without touching CUDA (works on any machine)."""
    if type(x).__module__.startswith("cupy"):
        return
    if not hasattr(x, "__dlpack__") or not hasattr(x, "__dlpack_device__"):
        raise TypeError(
            f"{name} must be a CUDA array supporting DLPack (CuPy, JAX, PyTorch, ...), "
            f"got {type(x).__name__}"
        )
    device_type, _ = x.__dlpack_device__()
    if int(device_type) not in (_DL_CUDA, _DL_CUDA_MANAGED):
        where = _DL_DEVICE_NAMES.get(int(device_type), f"DLPack device type {int(device_type)}")
        raise ValueError(f"{name} is on {where}; cuflash needs arrays on a CUDA GPU")


def describe(x, name: str) -> TensorDesc:
    """Describe a CUDA array given to argument ``name``, rejecting anything the kernels cannot read."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return describe_cupy(x, name)
    require_cuda(x, name)
    if _is_torch_tensor(type(x)):
        return describe_torch(x, name)
    return describe_cupy(cupy.from_dlpack(x), name)


def _is_torch_tensor(kind: type) -> bool:
    return kind.__module__.split(".", 1)[0] == "torch" and hasattr(kind, "data_ptr") and hasattr(kind, "stride")


def _numpy_dtype(name: str):
    return {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "float32": np.dtype(np.float32)}.get(name)


def describe_torch(t, name: str) -> TensorDesc:
    """A CUDA tensor read from its own metadata, without DLPack (which refuses tensors that require grad
    and, on another stream, makes torch record an event). ``array`` is a zero-copy CuPy view of the
    tensor's memory (the tensor stays its owner), or None for a dtype the kernels do not take."""
    import cupy

    dtype = dtype_name(t.dtype)
    itemsize, ptr, device = t.element_size(), t.data_ptr(), t.device.index
    shape, strides = tuple(t.shape), tuple(t.stride())
    np_dtype, array = _numpy_dtype(dtype), None
    if np_dtype is not None and t.numel() > 0 and all(s >= 0 for s in strides):
        extent = (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * itemsize
        memory = cupy.cuda.UnownedMemory(ptr, extent, t, device_id=device)
        array = cupy.ndarray(shape, np_dtype, cupy.cuda.MemoryPointer(memory, 0),
                             strides=tuple(s * itemsize for s in strides))
    elif np_dtype is not None and t.numel() == 0:
        array = cupy.ndarray(shape, np_dtype)  # nothing to read or fill: an empty stand-in
    return TensorDesc(name=name, shape=shape, strides=strides, dtype=dtype, itemsize=itemsize, ptr=ptr,
                      device=device, array=array)


# ---------------------------------------------------------------------------------------------------------
# Cache keys: what validation reads about an array, read as cheaply as its type allows.


def array_key(x) -> tuple:
    """``(key, ptr)`` for a CUDA array: ``key`` holds everything the validation of ``x`` depends on (its
    type, shape, strides, dtype, device and whether its base pointer is 16-byte aligned), so that two
    arrays with equal keys pass or fail every check alike; ``ptr`` is its base pointer.

    Raises (anything) for an object it cannot read; callers then take the validating path, which names
    the problem. ``None`` gives ``(None, 0)``.
    """
    if x is None:
        return None, 0
    kind = type(x)
    reader = _key_readers.get(kind)
    if reader is None:
        reader = _key_readers[kind] = _key_reader(kind)
    return reader(x)


def _cupy_key(x) -> tuple:
    data = x.data
    ptr = data.ptr
    return ("cupy", x.shape, x.strides, x.dtype, data.device_id, ptr & 15), ptr


def _torch_key(x) -> tuple:
    ptr = x.data_ptr()
    return (type(x), x.shape, x.stride(), x.dtype, x.device, ptr & 15), ptr


def _interface_key(x) -> tuple:
    """Any ``__cuda_array_interface__`` producer (JAX's buffer_callback buffers, Numba, ...)."""
    interface = x.__cuda_array_interface__
    ptr = interface["data"][0]
    return (type(x), getattr(x, "dtype", None), interface["typestr"], tuple(interface["shape"]),
            interface.get("strides"), x.__dlpack_device__(), ptr & 15), ptr


def _key_reader(kind: type):
    import cupy

    if kind is cupy.ndarray:
        return _cupy_key
    if _is_torch_tensor(kind):
        return _torch_key
    if hasattr(kind, "__cuda_array_interface__") and hasattr(kind, "__dlpack_device__"):
        return _interface_key
    raise TypeError(f"no cache key for {kind.__name__}")


_key_readers: dict = {}


def describe_cupy(arr, name: str) -> TensorDesc:
    itemsize = arr.dtype.itemsize
    for stride in arr.strides:
        if stride % itemsize:
            raise ValueError(f"{name} has a stride of {stride} bytes, not a multiple of its item size {itemsize}")
    return TensorDesc(
        name=name,
        shape=tuple(arr.shape),
        strides=tuple(s // itemsize for s in arr.strides),
        dtype=dtype_name(arr.dtype),
        itemsize=itemsize,
        ptr=int(arr.data.ptr),
        device=int(arr.device.id),
        array=arr,
    )


_external_streams: dict = {}


def resolve_stream(stream):
    """``stream=``: None (CuPy's current stream), a CuPy stream, a raw ``cudaStream_t`` int, or any
    object with an int ``cuda_stream`` attribute (a torch stream). Returns a CuPy stream object."""
    import cupy

    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        return stream
    handle = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, (int, np.integer)) and not isinstance(handle, bool):
        handle = int(handle)
        cached = _external_streams.get(handle)
        if cached is None:
            import warnings

            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream for Stream.from_external
                warnings.simplefilter("ignore", DeprecationWarning)
                cached = cupy.cuda.ExternalStream(handle)
            _external_streams[handle] = cached
        return cached
    raise TypeError(
        f"stream must be a CuPy stream, a raw cudaStream_t int or None, got {type(stream).__name__}"
    )
