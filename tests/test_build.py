"""Build layer on the CPU: name rendering, the params mirror, cache keys, and every variant compiling."""
import shutil
from dataclasses import dataclass

import numpy as np
import pytest

from cuflash import build, kernels, params, sources
from cuflash.kernels import KernelVariant

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="needs CuPy's NVRTC binding (install an extra)")

ARCHS = ("sm_80", "sm_90a")


def _probe_source() -> str:
    """A kernel that writes the byte offset of every AttnParams field (NVRTC has no offsetof, so
    the offsets are checked on a GPU; the size is checked at compile time by params.cuh itself)."""
    dtype = params.params_dtype()
    writes = "\n".join(
        f"  out[{i}] = (long long)((const char*)&p.{name} - (const char*)&p);"
        for i, name in enumerate(dtype.names)
    )
    return (
        '#include "cuflash/params.cuh"\n'
        "namespace cuflash { template <int kUnused> __global__ void probe_kernel(const AttnParams p) {\n"
        "  long long* out = reinterpret_cast<long long*>(p.lse);\n"
        f"{writes}\n"
        "} }\n"
    )


@pytest.fixture
def source_copy(tmp_path, monkeypatch):
    """A private copy of cuda_src/ with the probe kernel, and a private disk cache."""
    src = tmp_path / "cuda_src"
    shutil.copytree(sources.source_dir(), src)
    (src / "probe.cu").write_text(_probe_source())
    monkeypatch.setenv("CUFLASH_SOURCE_DIR", str(src))
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    return src


@dataclass(frozen=True)
class OneInt:
    """The config of a test kernel ``template <int N>``."""

    n: int


PROBE = KernelVariant("probe.cu", "cuflash::probe_kernel", OneInt(3), threads=32, smem_bytes=0)


@dataclass(frozen=True)
class EveryKind:
    elem: str
    head_dim: int
    causal: bool
    other: str
    flag: bool
    acc: str


@dataclass(frozen=True)
class NotRenderable:
    scale: float


def test_render_name_spells_every_argument_kind():
    config = EveryKind("bfloat16", 128, True, "float16", False, "float32")
    variant = KernelVariant("x.cu", "cuflash::k", config, 128, 0)
    assert build.render_name(variant) == "cuflash::k<__nv_bfloat16, 128, true, __half, false, float>"
    with pytest.raises(TypeError, match="template argument scale=1.5"):
        build.render_name(KernelVariant("x.cu", "cuflash::k", NotRenderable(1.5), 32, 0))
    with pytest.raises(TypeError, match="config dataclass"):
        build.render_name(KernelVariant("x.cu", "cuflash::k", (1,), 32, 0))


def test_config_field_order_is_the_template_argument_order():
    """The tile a plan reads by name is the template argument the kernel gets at that position."""
    from cuflash.kernels import backward, forward, simt

    fwd = forward.variant("bfloat16", 128, 1, 80).config
    assert build.render_name(forward.variant("bfloat16", 128, 1, 80)) == (
        f"cuflash::flash_fwd_kernel<__nv_bfloat16, 128, {fwd.block_m}, {fwd.block_n}, {fwd.num_warps}, "
        f"{fwd.stages}, 1, 0, 0>")
    dkdv = backward.dkdv_variant(90, "float16", 64, 0, True, score_mod=1)
    tile = dkdv.config
    assert build.render_name(dkdv) == (
        f"cuflash::flash_bwd_dkdv_kernel<__half, 64, {tile.block_m}, {tile.block_n}, {tile.num_warps}, "
        f"0, 1, true, {tile.mainloop}>")
    dq = simt.dq_variant(96, 2, 3)
    assert build.render_name(dq) == (
        f"cuflash::flash_bwd_dq_simt_kernel<96, {dq.config.block_m}, {dq.config.block_n}, 2, 3>")


def test_params_mirror_has_the_c_struct_size(source_copy):
    compiled = build.compile_variant(PROBE, "sm_80")  # params.cuh static_asserts the size
    assert compiled.lowered_name.startswith("_ZN7cuflash12probe_kernel")


@pytest.mark.gpu
def test_params_mirror_matches_the_c_struct_field_by_field(source_copy):
    import cupy

    dtype = params.params_dtype()
    offsets = cupy.full(len(dtype.names), -1, dtype=cupy.int64)
    block = params.new_params()
    block[0]["lse"] = offsets.data.ptr
    kernel = build.get_kernel(PROBE, cupy.cuda.runtime.getDevice(), cupy.cuda.Device().compute_capability)
    kernel.function((1, 1, 1), (1, 1, 1), (block,))
    expected = [dtype.fields[name][1] for name in dtype.names]
    assert offsets.get().tolist() == expected


def test_params_mirror_drift_fails_the_build(source_copy, monkeypatch):
    header = (source_copy / "cuflash" / "params.cuh").read_text()
    stale = np.dtype(params._fields_of(header) + [("drifted", np.int64)], align=True)
    monkeypatch.setattr(params, "params_dtype", lambda: stale)
    monkeypatch.setattr(build, "_toolchain_cache", {})
    with pytest.raises(build.CompileError, match="disagree"):
        build.compile_variant(PROBE, "sm_80")


def test_header_edit_forces_a_rebuild(source_copy):
    first = build.compile_variant(PROBE, "sm_90a")
    again = build.compile_variant(PROBE, "sm_90a")
    assert not first.cached and again.cached and again.cubin_path == first.cubin_path
    header = source_copy / "cuflash" / "mask.cuh"  # a header the probe does not even include
    header.write_text(header.read_text() + "\n// edited\n")
    rebuilt = build.compile_variant(PROBE, "sm_90a")
    assert not rebuilt.cached and rebuilt.cubin_path != first.cubin_path


def test_cache_key_is_content_only(tmp_path, monkeypatch):
    """Two checkouts (or virtual environments) with identical sources share one cache entry, and
    identical CUDA headers in another folder hash alike: the key holds contents, never paths. An
    edited header still changes the key."""
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    dirs = [tmp_path / "clone_a" / "cuda_src", tmp_path / "clone_b" / "cuda_src"]
    for directory in dirs:
        shutil.copytree(sources.source_dir(), directory)
        (directory / "probe.cu").write_text(_probe_source())
    variant = kernels.all_variants(90)[0]

    def keys(directory):
        monkeypatch.setenv("CUFLASH_SOURCE_DIR", str(directory))
        return build.cache_key(variant, "sm_90a"), build.cache_key(PROBE, "sm_80")

    assert keys(dirs[0]) == keys(dirs[1])
    monkeypatch.setenv("CUFLASH_SOURCE_DIR", str(dirs[0]))
    first = build.compile_variant(PROBE, "sm_80")
    monkeypatch.setenv("CUFLASH_SOURCE_DIR", str(dirs[1]))
    second = build.compile_variant(PROBE, "sm_80")
    assert second.cached and second.cubin_path == first.cubin_path

    header = dirs[1] / "cuflash" / "mask.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    edited = keys(dirs[1])
    assert edited[0] != keys(dirs[0])[0] and edited[1] != keys(dirs[0])[1]

    include = sources.cuda_include_dir(build._toolchain().nvrtc_version[0])
    copy = tmp_path / "include_copy"
    copy.mkdir()
    for name in sources._CUDA_HEADERS:
        if (include / name).is_file():
            shutil.copy(include / name, copy / name)
    assert sources.cuda_headers_hash(copy) == sources.cuda_headers_hash(include)
    (copy / "cuda_bf16.h").write_text((include / "cuda_bf16.h").read_text() + "\n// edited\n")
    sources.cuda_headers_hash.cache_clear()
    assert sources.cuda_headers_hash(copy) != sources.cuda_headers_hash(include)


def test_the_test_session_compiles_into_a_temporary_cache():
    """conftest.py points CUFLASH_CACHE_DIR at a temporary folder unless the user set one."""
    from pathlib import Path

    assert build.cache_dir() != Path.home() / ".cache" / "cuflash"


def test_compile_error_carries_the_log(source_copy):
    (source_copy / "broken.cu").write_text("namespace cuflash { template <int N> __global__ void k() { undefined_name; } }\n")
    with pytest.raises(build.CompileError, match="undefined_name"):
        build.compile_variant(KernelVariant("broken.cu", "cuflash::k", OneInt(1), 32, 0), "sm_80")


def test_smem_formula_drift_fails_the_build(source_copy):
    """build passes the plan's smem_bytes as CUFLASH_EXPECTED_SMEM_BYTES; a kernel's
    CUFLASH_CHECK_SMEM_BYTES(kSmemBytes) static_asserts it (params.cuh), so drift fails on the CPU."""
    (source_copy / "smem_probe.cu").write_text(
        '#include "cuflash/params.cuh"\n'
        "namespace cuflash { template <int kBytes> __global__ void smem_probe_kernel(const AttnParams p) {\n"
        "  constexpr int kSmemBytes = 2 * kBytes;\n"
        "  CUFLASH_CHECK_SMEM_BYTES(kSmemBytes);\n"
        "} }\n")
    build.compile_variant(KernelVariant("smem_probe.cu", "cuflash::smem_probe_kernel", OneInt(100), 32, 200), "sm_80")
    with pytest.raises(build.CompileError, match="kSmemBytes differs from the plan's smem_bytes"):
        build.compile_variant(KernelVariant("smem_probe.cu", "cuflash::smem_probe_kernel", OneInt(100), 32, 192),
                              "sm_80")


def test_every_variant_has_a_sane_launch_shape():
    for arch in (80, 86, 89, 90):
        variants = kernels.all_variants(arch)
        assert variants, arch
        limit = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}[arch]
        for v in variants:
            assert 32 <= v.threads <= 1024 and v.threads % 32 == 0, v
            assert 0 <= v.smem_bytes <= limit, (arch, v)
            build.render_name(v)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_compiles_without_spills_in_hot_kernels(arch):
    """Every variant compiles; the bf16 D64/D128 forward and dK/dV kernels spill nothing beyond the
    allowance the forward tile table declares (with the measurement that justified it)."""
    from cuflash.kernels import backward
    from cuflash.kernels.forward import SPILL_ALLOWANCE

    results = build.precompile(arch, workers=None)
    assert len(results) == len(kernels.all_variants(build.arch_number(arch)))
    hot = [r for r in results
           if r.variant.name in ("cuflash::flash_fwd_kernel", "cuflash::flash_bwd_dkdv_kernel")
           and r.variant.config.dtype == "bfloat16" and r.variant.config.head_dim in (64, 128)]
    assert hot, "no hot kernels found"
    arch_number = build.arch_number(arch)
    over = []
    for r in hot:
        allowed = 0
        if r.variant.name == "cuflash::flash_fwd_kernel":
            allowed = SPILL_ALLOWANCE.get((arch_number, r.variant.config.head_dim, r.variant.config.mask,
                                           r.variant.config.score_mod), 0)
        else:
            allowed = backward.spill_allowance(arch_number, r.variant.config)
        if r.spill_stores + r.spill_loads > allowed:
            over.append((build.render_name(r.variant), r.spill_stores, r.spill_loads, allowed))
    assert not over, over


def _wgmma_variant():
    """The warp-specialized bf16 D128 dK/dV kernel (wgmma on sm_90a) without a mask, with atomic dQ."""
    return next(v for v in kernels.all_variants(90)
                if v.name == "cuflash::flash_bwd_dkdv_kernel" and v.config.mainloop == 2
                and v.config.dtype == "bfloat16" and v.config.head_dim == 128 and v.config.mask == 0
                and v.config.score_mod == 0 and v.config.atomic_dq)


def test_wgmma_serialization_is_reported(source_copy):
    """ptxas serializes a kernel's wgmma when, for one, it lacks the registers to keep them asynchronous (advisory
    C7512), which costs the overlap the warpgroup GEMMs exist for and shows nowhere else. With the consumers of the
    warp-specialized dK/dV kernel capped at 232 registers instead of 240 (session 32: its D128 key loop then went from
    9 to 64 warpgroup waits), the build reports it."""
    header = source_copy / "cuflash" / "dkdv_mainloop_sm90_ws.cuh"
    text = header.read_text()
    assert "kConsumerRegisters = 240;" in text
    header.write_text(text.replace("kConsumerRegisters = 240;", "kConsumerRegisters = 232;"))
    assert build.compile_variant(_wgmma_variant(), "sm_90a").wgmma_serialized


def test_every_wgmma_serialization_advisory_is_read():
    """ptxas words each reason its own way (C7512 registers, C7514 an accumulator read in flight, ...); the build
    reads them all, and nothing else."""
    lines = ["ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
             "to insufficient register resources for the wgmma pipeline in the function 'k'",
             "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
             "to non wgmma instructions reading accumulator registers of  a wgmma between start and end of the "
             "pipeline stage in the function 'k'"]
    for line in lines:
        assert build._ptxas_info("ptxas info    : Used 168 registers\n" + line)["wgmma_serialized"], line
    assert not build._ptxas_info("ptxas info    : Used 168 registers, 60 bytes spill stores")["wgmma_serialized"]


def test_no_variant_serializes_its_wgmma():
    """No sm_90a variant compiles with its wgmma serialized (ptxas's advisories; see the tests above)."""
    results = build.precompile("sm_90a")  # every variant (CI's compile step has them cached)
    assert results
    serialized = sorted(build.render_name(r.variant) for r in results if r.wgmma_serialized)
    assert not serialized, serialized


_HEADER_PROBE = '''
import dataclasses, sys, cupy
from cuflash import build, params
from cuflash.kernels import KernelVariant
OneInt = dataclasses.make_dataclass("OneInt", [("n", int)], frozen=True)
variant = KernelVariant("probe_value.cu", "cuflash::probe_value_kernel", OneInt(1), threads=32, smem_bytes=0)
out = cupy.zeros(1, dtype=cupy.float32)
block = params.new_params()
block[0]["lse"] = out.data.ptr
kernel = build.get_kernel(variant, cupy.cuda.runtime.getDevice(), cupy.cuda.Device().compute_capability)
kernel.function((1, 1, 1), (1, 1, 1), (block,))
print(float(out.get()[0]), build.compile_count)
'''


@pytest.mark.gpu
def test_header_edit_forces_a_rebuild_across_processes_on_the_gpu(source_copy, tmp_path):
    """Two fresh processes share one disk cache; between them a header the kernel includes changes.
    The second must compile again and run the new code (CuPy's own cache would have served the old)."""
    import os
    import subprocess
    import sys

    header = source_copy / "cuflash" / "probe_value.cuh"
    header.write_text("#define CUFLASH_PROBE_VALUE 1.0f\n")
    (source_copy / "probe_value.cu").write_text(
        '#include "cuflash/params.cuh"\n#include "cuflash/probe_value.cuh"\n'
        "namespace cuflash { template <int kUnused> __global__ void probe_value_kernel(const AttnParams p) {\n"
        "  p.lse[0] = CUFLASH_PROBE_VALUE; } }\n")

    def run():
        done = subprocess.run([sys.executable, "-c", _HEADER_PROBE], capture_output=True, text=True,
                              env=dict(os.environ), timeout=300)
        assert done.returncode == 0, done.stderr
        value, compiles = done.stdout.split()
        return float(value), int(compiles)

    assert run() == (1.0, 1)  # compiled
    assert run() == (1.0, 0)  # served from the disk cache
    header.write_text("#define CUFLASH_PROBE_VALUE 2.0f\n")
    assert run() == (2.0, 1)  # the header edit changed the key: rebuilt, new code runs


def test_generated_wgmma_wrappers_are_up_to_date():
    """cuda_src/cuflash/wgmma_sm90_ops.cuh is exactly what tools/gen_wgmma_sm90.py writes."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "tools" / "gen_wgmma_sm90.py"
    spec = importlib.util.spec_from_file_location("gen_wgmma_sm90", script)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    on_disk = (sources.source_dir() / "cuflash" / "wgmma_sm90_ops.cuh").read_text()
    assert on_disk == gen.render(), "run python tools/gen_wgmma_sm90.py"
