"""A stand-in GPU for CPU tests and host-time profiling of cuflash's Python path.

CuPy arrays over made-up device addresses (CuPy builds them without touching CUDA), a fake current
device and stream, fake loaded kernels, and a ``cuLaunchKernel`` that records each launch and copies
its parameter block. Nothing is ever dereferenced: the addresses only travel into params.
"""
from __future__ import annotations

import ctypes
import math

import cupy
import numpy as np

from cuflash import arrays, build, launch, tma
from cuflash.kernels import dbias_convert
from cuflash.params import params_dtype


class FakeStream:
    def __init__(self, ptr: int):
        self.ptr = ptr

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeExternalStream(FakeStream):
    def __init__(self, ptr: int, device_id: int = -1):
        super().__init__(ptr)


class FakeFunction:
    def __init__(self, ptr: int):
        self.ptr = ptr


class FakeKernel:
    def __init__(self, variant):
        self.variant = variant
        self.function = FakeFunction(0x7000_0000 + (hash(variant) & 0xFFFF_FFF0))


class FakeGPU:
    """``install(setattr)`` swaps in the fakes (``monkeypatch.setattr`` or a plain setter)."""

    def __init__(self, arch: str = "90", stream_ptr: int = 0x5000):
        self.arch = arch
        self.stream = FakeStream(stream_ptr)
        self.launches = []  # (function ptr, grid, block, smem, stream ptr, params bytes or plain args, maps)
        self.record = True
        self._next = 1 << 32
        self._plain_argument_kernels = set()  # function pointers launched with plain arguments

    # Memory ---------------------------------------------------------------------------------------------

    def address(self, nbytes: int) -> int:
        ptr = self._next
        self._next += max(256, -(-nbytes // 256) * 256)
        return ptr

    def array(self, shape, dtype, *, strides=None, offset_bytes=0):
        """A CuPy array at a fresh fake address; ``strides`` in elements (default contiguous)."""
        dtype = np.dtype(dtype)
        shape = tuple(shape)
        if strides is None:
            nbytes = math.prod(shape) * dtype.itemsize
            byte_strides = None
        else:
            byte_strides = tuple(s * dtype.itemsize for s in strides)
            nbytes = (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * dtype.itemsize
        memory = cupy.cuda.UnownedMemory(self.address(nbytes + offset_bytes), nbytes + offset_bytes, None,
                                         device_id=0)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, offset_bytes), strides=byte_strides)

    def empty(self, shape, dtype=float, order="C"):
        if isinstance(shape, int):
            shape = (shape,)
        return self.array(shape, dtype)

    # Launch ---------------------------------------------------------------------------------------------

    def launch_kernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, argv_address, extra):
        if self.record and function in self._plain_argument_kernels:
            # A kernel of plain arguments (the dbias conversion: source, destination pointers and a count), in
            # place of the parameter block; no TmaParams.
            words = (ctypes.c_void_p * 3).from_address(argv_address)
            args = (ctypes.c_void_p.from_address(words[0]).value, ctypes.c_void_p.from_address(words[1]).value,
                    ctypes.c_longlong.from_address(words[2]).value)
            self.launches.append((function, (gx, gy, gz), (bx, by, bz), smem, stream, args, None))
        elif self.record:
            params_address = ctypes.c_void_p.from_address(argv_address).value
            block = ctypes.string_at(params_address, params_dtype().itemsize)
            # The second parameter, the kernels' TmaParams (launch.TMA_PARAMS_BYTES, 64-byte aligned).
            maps_address = ctypes.c_void_p.from_address(argv_address + ctypes.sizeof(ctypes.c_void_p)).value
            assert maps_address % 64 == 0, "TmaParams must be 64-byte aligned"
            maps = ctypes.string_at(maps_address, launch.TMA_PARAMS_BYTES)
            self.launches.append((function, (gx, gy, gz), (bx, by, bz), smem, stream, block, maps))

    def get_kernel(self, variant, device_id, compute_capability, launch_smem_bytes=0):
        kernel = FakeKernel(variant)
        if variant.name == dbias_convert.KERNEL_NAME:
            self._plain_argument_kernels.add(kernel.function.ptr)
        return kernel

    def install(self, setattr):
        setattr(launch, "current_device", lambda: 0)
        setattr(launch, "compute_capability", lambda device_id: self.arch)
        setattr(launch, "multiprocessor_count", lambda device_id: 132)
        setattr(launch, "_launch_kernel", self.launch_kernel)
        setattr(build, "get_kernel", self.get_kernel)
        setattr(cupy, "empty", self.empty)
        setattr(cupy.cuda, "get_current_stream", lambda *args: self.stream)
        setattr(cupy.cuda, "ExternalStream", FakeExternalStream)
        setattr(arrays, "_external_streams", {})
        # No tensor maps: on a machine with a driver, tma._encode would encode maps of the fake addresses, and
        # params would differ from the machine without one (session 22: test_call_cache failed on the GPU
        # machine only). Tests of the maps patch it again.
        setattr(tma, "_encode", lambda *args, **kwargs: None)
        launch.forward_plan.cache_clear()
        launch.backward_plan.cache_clear()
        return self


def pointers_of(block: bytes) -> dict:
    """The pointer fields of a parameter block, by name."""
    record = np.frombuffer(block, dtype=params_dtype())[0]
    return {name: int(record[name]) for name in launch.POINTER_FIELDS}


def install_fresh(monkeypatch) -> FakeGPU:
    """A FakeGPU installed for one test, with the core's call-plan caches emptied (the ``gpu`` fixtures)."""
    from cuflash import api, kvcache

    monkeypatch.setattr(api, "_forward_plans", {})
    monkeypatch.setattr(api, "_backward_plans", {})
    monkeypatch.setattr(kvcache, "_plans", {})
    return FakeGPU().install(monkeypatch.setattr)
