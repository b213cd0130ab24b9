"""Test configuration: the ``gpu`` marker skips cleanly on machines without a CUDA GPU, and the session
compiles into a temporary kernel cache (not ``~/.cache/cuflash``) unless ``CUFLASH_CACHE_DIR`` is set."""
import functools
import os
import shutil
import tempfile

import pytest

_TEMPORARY_CACHE = None


def pytest_configure(config):
    """A session-wide temporary CUFLASH_CACHE_DIR, unless the user chose one (set it to reuse
    compiled kernels across runs, as .ci/run does). Subprocesses the tests start inherit it."""
    global _TEMPORARY_CACHE
    if "CUFLASH_CACHE_DIR" not in os.environ:
        _TEMPORARY_CACHE = tempfile.mkdtemp(prefix="cuflash-test-cache-")
        os.environ["CUFLASH_CACHE_DIR"] = _TEMPORARY_CACHE


def pytest_unconfigure(config):
    global _TEMPORARY_CACHE
    if _TEMPORARY_CACHE is not None:
        if os.environ.get("CUFLASH_CACHE_DIR") == _TEMPORARY_CACHE:
            del os.environ["CUFLASH_CACHE_DIR"]
        shutil.rmtree(_TEMPORARY_CACHE, ignore_errors=True)
        _TEMPORARY_CACHE = None


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, or no device
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
