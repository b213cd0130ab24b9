"""Where the kernel sources and the CUDA headers are, and the hash that names a build of them."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from pathlib import Path

_SOURCE_SUFFIXES = (".cu", ".cuh")


def source_dir() -> Path:
    """The ``cuda_src`` folder: shipped in the wheel as ``cuflash.cuda_src``, or beside the package
    in a source checkout. ``CUFLASH_SOURCE_DIR`` overrides both (used to test rebuild-on-edit)."""
    override = os.environ.get("CUFLASH_SOURCE_DIR")
    if override:
        return Path(override)
    package = Path(__file__).resolve().parent
    for candidate in (package.parent / "cuda_src", package / "cuda_src"):  # checkout, then wheel
        if (candidate / "cuflash" / "params.cuh").is_file():
            return candidate
    spec = importlib.util.find_spec("cuflash.cuda_src")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    raise FileNotFoundError("cuflash cannot find its kernel sources (cuda_src); reinstall the package")


def source_hash(directory: Path | None = None) -> str:
    """SHA-256 over every .cu/.cuh file (path and bytes). Any edit, headers included, changes it."""
    directory = Path(directory) if directory is not None else source_dir()
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.suffix in _SOURCE_SUFFIXES):
        digest.update(path.relative_to(directory).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def _candidate_include_dirs(nvrtc_major: int) -> list:
    candidates = []
    env = os.environ.get("CUFLASH_CUDA_INCLUDE")
    if env:
        candidates.append(Path(env))
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            root = Path(root)
            # CUDA 13 wheels install under nvidia/cu13, CUDA 12 wheels under nvidia/cuda_runtime.
            preferred = [f"cu{nvrtc_major}", "cuda_runtime"] if nvrtc_major >= 13 else ["cuda_runtime"]
            candidates += [root / name / "include" for name in preferred]
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    return candidates


@functools.lru_cache(maxsize=None)
def cuda_include_dir(nvrtc_major: int) -> Path:
    """A folder holding cuda_fp16.h / cuda_bf16.h for this NVRTC's CUDA major version."""
    for candidate in _candidate_include_dirs(nvrtc_major):
        if (candidate / "cuda_bf16.h").is_file():
            return candidate
    raise FileNotFoundError(
        "cuflash needs the CUDA runtime headers (cuda_bf16.h) to compile its kernels: install the "
        "extra matching your CUDA (pip install 'cuflash[cuda12]' or 'cuflash[cuda13]'), or point "
        "CUFLASH_CUDA_INCLUDE at a CUDA include folder"
    )


#: The CUDA headers the kernels include (with the .hpp each pulls in); NVRTC's own built-in
#: headers are covered by its version.
_CUDA_HEADERS = ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp")


@functools.lru_cache(maxsize=None)
def cuda_headers_hash(include_dir: Path) -> str:
    """SHA-256 over the contents of the CUDA fp16/bf16 headers in ``include_dir`` (names and bytes,
    not the folder's path): two installs of the same headers hash alike."""
    digest = hashlib.sha256()
    for name in _CUDA_HEADERS:
        path = Path(include_dir) / name
        if path.is_file():
            digest.update(name.encode())
            digest.update(b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()
