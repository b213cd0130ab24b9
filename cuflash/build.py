"""Build layer: kernel variants -> CUBINs through NVRTC -> loaded functions, per device.

- One NVRTC program per variant: ``#include "<source>"`` plus one name expression rendered by
  :func:`render_name` (the only place a template-argument list is spelled).
- Compiling needs no GPU (``cupy_backends``' NVRTC binding), so ``python -m cuflash compile`` and
  CI build every variant on CPU-only machines.
- CUBINs are cached on disk under a key that covers the hash of all of ``cuda_src/`` (headers
  included), the options, the arch, the NVRTC version, a hash of the CUDA fp16/bf16 headers and the
  name expression: an edited header can never be served a stale binary. The key holds contents
  only, no paths, so a new clone or virtual environment reuses the cache. ``CUFLASH_CACHE_DIR``
  moves the cache (default ``~/.cache/cuflash``).
- Loaded functions are memoized per (device, variant) behind a lock, so concurrent first calls
  compile once. NVRTC releases the GIL, so :func:`precompile` compiles in parallel threads.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path

from . import params as _params
from . import sources
from .kernels import KernelVariant

log = logging.getLogger("cuflash.build")

_CPP_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}


def render_name(variant: KernelVariant) -> str:
    """The name expression of a variant, e.g. ``cuflash::flash_fwd_kernel<__nv_bfloat16, 128, ...>``.

    The template-argument list is ``variant.config``'s fields in declaration order (the config
    dataclasses document the kernel signature they mirror): dtype names as ``__half`` /
    ``__nv_bfloat16`` / ``float``, bools as ``true`` / ``false``, ints as decimals.
    """
    config = variant.config
    if not (dataclasses.is_dataclass(config) and not isinstance(config, type)):
        raise TypeError(f"{variant.name}: config must be a config dataclass instance; got {config!r}")
    rendered = []
    for field in dataclasses.fields(config):
        arg = getattr(config, field.name)
        if isinstance(arg, bool):
            rendered.append("true" if arg else "false")
        elif isinstance(arg, int):
            rendered.append(str(arg))
        elif isinstance(arg, str) and arg in _CPP_TYPE:
            rendered.append(_CPP_TYPE[arg])
        else:
            raise TypeError(f"cannot render template argument {field.name}={arg!r} of {variant.name}")
    return f"{variant.name}<{', '.join(rendered)}>"


def arch_of_compute_capability(cc: str | int) -> str:
    """NVRTC target for a compute capability: Hopper gets sm_90a (plain sm_90 rejects wgmma)."""
    cc = str(cc)
    return "sm_90a" if cc == "90" else f"sm_{cc}"


def arch_number(arch: str) -> int:
    """``"sm_90a"`` -> 90."""
    match = re.fullmatch(r"sm_(\d+)a?", arch)
    if not match:
        raise ValueError(f"arch={arch!r} must look like 'sm_80' or 'sm_90a'")
    return int(match.group(1))


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    variant: KernelVariant
    arch: str
    cubin_path: str
    lowered_name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    static_smem_bytes: int
    compile_seconds: float  # 0.0 when served from the disk cache
    cached: bool
    # ptxas serialized the kernel's wgmma (its "Potential Performance Loss" advisories: C7512, too few registers to
    # keep them asynchronous; C7514, other instructions reading an accumulator in flight; ...): on sm_90a every
    # warpgroup GEMM then waits for the one before it, a silent loss of its overlap.
    wgmma_serialized: bool


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc


@dataclasses.dataclass(frozen=True)
class _Toolchain:
    nvrtc_version: tuple
    options: tuple  # everything but -arch
    key_options: tuple  # options without the -I paths: the cache key holds contents, not locations
    cuda_headers_hash: str  # what the -I of the CUDA headers contributes, by content


_toolchain_lock = threading.Lock()
_toolchain_cache: dict = {}


def _toolchain() -> _Toolchain:
    """Compile options shared by every variant; recomputed when the source hash changes."""
    src_dir = sources.source_dir()
    src_hash = sources.source_hash(src_dir)
    with _toolchain_lock:
        cached = _toolchain_cache.get(str(src_dir))
        if cached is not None and cached[0] == src_hash:
            return cached[1]
        version = tuple(_nvrtc().getVersion())
        options = (
            "-std=c++17",
            "-lineinfo",
            "-Xptxas=-v",
            f"-I{src_dir}",
            f"-I{sources.cuda_include_dir(version[0])}",
            f"-DCUFLASH_SRC_HASH=0x{src_hash[:16]}",
            f"-DCUFLASH_PARAMS_BYTES={_params.params_dtype().itemsize}",
        )
        key_options = tuple(option for option in options if not option.startswith("-I"))
        headers = sources.cuda_headers_hash(sources.cuda_include_dir(version[0]))
        toolchain = _Toolchain(version, options, key_options, headers)
        _toolchain_cache[str(src_dir)] = (src_hash, toolchain)
        return toolchain


def cache_dir() -> Path:
    path = Path(os.environ.get("CUFLASH_CACHE_DIR", Path.home() / ".cache" / "cuflash"))
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:
        fallback = Path(tempfile.gettempdir()) / "cuflash-cache"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


#: The version of what _ptxas_info reads from the compiler log; cache entries of another version are rebuilt.
_PTXAS_RULES = 2


def _ptxas_info(log_text: str) -> dict:
    def grab(pattern):
        match = re.search(pattern, log_text)
        return int(match.group(1)) if match else 0

    return {
        "registers": grab(r"Used (\d+) registers"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "stack_bytes": grab(r"(\d+) bytes stack frame"),
        "static_smem_bytes": grab(r"(\d+) bytes smem"),
        "wgmma_serialized": re.search(r"wgmma\S* instructions are serialized", log_text) is not None,
    }


class CompileError(RuntimeError):
    """NVRTC rejected a kernel variant; the message carries the compiler log."""


#: Counts real NVRTC compiles in this process (tests use it to prove cache hits and misses).
compile_count = 0


def _variant_options(variant: KernelVariant, arch: str) -> tuple:
    """Options of one variant's compile: its arch, and the plan's shared-memory bytes, which the
    kernel's ``CUFLASH_CHECK_SMEM_BYTES`` holds its own layout to (a drifted formula fails here)."""
    return (f"-arch={arch}", f"-DCUFLASH_EXPECTED_SMEM_BYTES={variant.smem_bytes}")


def cache_key(variant: KernelVariant, arch: str) -> str:
    """The disk-cache key of a variant: contents only (the source hash is in the options as
    ``-DCUFLASH_SRC_HASH``), never a path, so identical sources anywhere share one binary."""
    toolchain = _toolchain()
    return hashlib.sha256(json.dumps([
        render_name(variant), variant.source, toolchain.key_options + _variant_options(variant, arch),
        toolchain.nvrtc_version, toolchain.cuda_headers_hash,
    ]).encode()).hexdigest()[:32]


def compile_variant(variant: KernelVariant, arch: str) -> CompiledKernel:
    """Compile one variant to a CUBIN (or take it from the disk cache). Needs no GPU."""
    global compile_count
    toolchain = _toolchain()
    name = render_name(variant)
    options = toolchain.options + _variant_options(variant, arch)
    key = cache_key(variant, arch)
    directory = cache_dir()
    cubin_path, meta_path = directory / f"{key}.cubin", directory / f"{key}.json"
    meta = json.loads(meta_path.read_text()) if cubin_path.is_file() and meta_path.is_file() else None
    if meta is not None and meta.get("ptxas_rules") == _PTXAS_RULES:  # (entries parsed by older rules: rebuilt)
        return CompiledKernel(variant, arch, str(cubin_path), meta["lowered_name"],
                              compile_seconds=0.0, cached=True, **meta["ptxas"])

    nvrtc = _nvrtc()
    start = time.perf_counter()
    program = nvrtc.createProgram(f'#include "{variant.source}"\n', f"{variant.source}.program", [], [])
    try:
        nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, list(options))
        except Exception as exc:
            raise CompileError(
                f"NVRTC failed on {name} for {arch}:\n{nvrtc.getProgramLog(program)}"
            ) from exc
        lowered = nvrtc.getLoweredName(program, name)
        cubin = nvrtc.getCUBIN(program)
        info = _ptxas_info(nvrtc.getProgramLog(program))
    finally:
        nvrtc.destroyProgram(program)
    seconds = time.perf_counter() - start
    compile_count += 1
    log.debug("compiled %s for %s in %.2f s", name, arch, seconds)

    # Write atomically: concurrent processes may build the same key.
    meta_text = json.dumps({"lowered_name": lowered, "ptxas": info, "ptxas_rules": _PTXAS_RULES})
    for path, data in ((cubin_path, cubin), (meta_path, meta_text.encode())):
        fd, tmp = tempfile.mkstemp(dir=directory)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    return CompiledKernel(variant, arch, str(cubin_path), lowered, compile_seconds=seconds, cached=False, **info)


def variants_matching(arch: str, match: str | None = None) -> list:
    """Every variant the package can launch on ``arch``, or those whose rendered name ``match`` (a regular
    expression, searched) finds: what ``cuflash compile --match`` and the GPU tests' CUFLASH_TEST_PRECOMPILE
    pattern compile."""
    from . import kernels

    variants = kernels.all_variants(arch_number(arch))
    if match is None:
        return variants
    pattern = re.compile(match)
    return [v for v in variants if pattern.search(render_name(v))]


def precompile(arch: str | None = None, variants=None, workers: int | None = None) -> list:
    """Compile many variants in parallel threads (all the package can launch on ``arch`` by default).

    ``arch`` defaults to the current device's. Returns the CompiledKernel list; raises CompileError
    after all finished if any failed.
    """
    if arch is None:
        arch = arch_of_compute_capability(_current_compute_capability())
    if variants is None:
        variants = variants_matching(arch)
    workers = workers or max(1, os.cpu_count() or 1)
    results, failures = [], []
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(compile_variant, v, arch): v for v in variants}
        for future in concurrent.futures.as_completed(futures):
            try:
                results.append(future.result())
            except CompileError as exc:
                failures.append(str(exc))
    if failures:
        raise CompileError(f"{len(failures)} of {len(variants)} variants failed:\n" + "\n".join(failures))
    return results


# ----------------------------------------------------------------------------------------------
# Loading on a device
# ----------------------------------------------------------------------------------------------

_functions: dict = {}
_smem_opted: dict = {}  # (device, variant) -> the dynamic shared memory its function may take
_function_locks: dict = {}
_functions_lock = threading.Lock()


def _current_compute_capability() -> str:
    import cupy

    return cupy.cuda.Device().compute_capability


@dataclasses.dataclass(frozen=True)
class LoadedKernel:
    function: object  # cupy.cuda.function.Function, launched directly (lowest host overhead)
    raw: object  # the cupy.RawKernel that owns the function's module
    variant: KernelVariant
    registers: int


def get_kernel(variant: KernelVariant, device_id: int, compute_capability: str,
               launch_smem_bytes: int = 0) -> LoadedKernel:
    """The loaded function for ``variant`` on a device, compiling it on first use. ``launch_smem_bytes``: a
    launch's dynamic shared memory when it reserves more than the kernel uses (Launch.smem_floor); the
    function's opt-in limit is raised to it once."""
    key = (device_id, variant)
    loaded = _functions.get(key)
    if loaded is not None and launch_smem_bytes <= _smem_opted.get(key, 0):
        return loaded
    if loaded is not None:
        return _opt_in_smem(key, loaded, launch_smem_bytes)
    with _functions_lock:
        lock = _function_locks.setdefault(key, threading.Lock())
    with lock:
        loaded = _functions.get(key)
        if loaded is not None:
            return loaded
        import cupy

        arch = arch_of_compute_capability(compute_capability)
        compiled = compile_variant(variant, arch)
        from .launch import ensure_context

        ensure_context(device_id)  # CuPy's Device() binds none where the device is already the current one
        with cupy.cuda.Device(device_id):
            limit = cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"]
            if variant.smem_bytes > limit:
                raise RuntimeError(
                    f"{render_name(variant)} needs {variant.smem_bytes} bytes of shared memory per "
                    f"block, but this GPU (sm_{compute_capability}) allows at most {limit}"
                )
            module = cupy.RawModule(path=compiled.cubin_path)
            raw = module.get_function(compiled.lowered_name)
            if variant.smem_bytes > 48 * 1024:
                raw.max_dynamic_shared_size_bytes = variant.smem_bytes
            loaded = LoadedKernel(raw.kernel, raw, variant, compiled.registers)
        _smem_opted[key] = max(variant.smem_bytes, 48 * 1024)
        _functions[key] = loaded
    return _opt_in_smem(key, loaded, launch_smem_bytes)


def _opt_in_smem(key, loaded: LoadedKernel, nbytes: int) -> LoadedKernel:
    """Raises the function's dynamic shared-memory limit to ``nbytes`` (a launch's reservation) if below."""
    if nbytes > _smem_opted.get(key, 0):
        import cupy

        with _functions_lock, cupy.cuda.Device(key[0]):
            limit = cupy.cuda.Device(key[0]).attributes["MaxSharedMemoryPerBlockOptin"]
            if nbytes > limit:
                raise RuntimeError(f"{render_name(loaded.variant)}: a launch reserves {nbytes} bytes of shared "
                                   f"memory, but this GPU allows at most {limit} per block")
            loaded.raw.max_dynamic_shared_size_bytes = nbytes
            _smem_opted[key] = nbytes
    return loaded
