"""KV-cache calls on the CPU: the split-KV heuristic, the tiles, the checks of the arguments, and what a call
launches (fake_gpu: made-up addresses, a recording cuLaunchKernel).

The parameter block must address the cache the way cuda_src/cuflash/kvcache.cuh reads it: a paged cache's
batch stride is its page stride, the block table's row stride and the page count are set, the window is
always set (unbounded unless given, causal folded into its right side), and the grid is (query blocks x
splits, Hkv, B) with the append first and the combine last.
"""
import numpy as np
import pytest

pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")

import cuflash  # noqa: E402
from cuflash import validation  # noqa: E402
from cuflash.kernels import HEAD_DIM_BUCKETS, kvcache as plans  # noqa: E402
from cuflash.params import params_dtype  # noqa: E402

from fake_gpu import install_fresh  # noqa: E402

BF16 = ml_dtypes.bfloat16


@pytest.fixture
def gpu(monkeypatch):
    return install_fresh(monkeypatch)


def record(block: bytes):
    return np.frombuffer(block, dtype=params_dtype())[0]


def test_split_heuristic_fills_the_gpu_only_when_the_batch_cannot():
    assert plans.num_splits_heuristic(ctas=512, key_blocks=64, slots=132) == 1  # B64 x Hkv8: full waves
    splits = plans.num_splits_heuristic(ctas=8, key_blocks=1024, slots=132)  # B1 x Hkv8 at 128k keys
    assert splits == 16  # one CTA per SM: 128 of 132 (H100, session 10: 2735 GB/s against 2534 at 33 splits)
    assert plans.num_splits_heuristic(ctas=8, key_blocks=1, slots=132) == 1  # nothing to split
    assert plans.num_splits_heuristic(ctas=2, key_blocks=5, slots=132) <= 5


def test_a_paged_cache_splits_for_two_ctas_per_sm():
    """B1 H32 / 8 at 128k keys on 132 SMs: a dense cache splits for one CTA per SM, a paged one for two (the
    page lookups want the second CTA's loads in flight)."""
    dense = plans.plan("bfloat16", 1, 1, 32, 8, 128, 128, 0, 131072, False, None, 90, 132)
    paged = plans.plan("bfloat16", 1, 1, 32, 8, 128, 128, 0, 131072, False, None, 90, 132, paged=True)
    assert (dense.num_splits, paged.num_splits) == (16, 33)


@pytest.mark.parametrize("arch", [80, 86, 90])
def test_every_tile_fits_its_arch(arch):
    from cuflash.arch import arch_caps

    for bucket in HEAD_DIM_BUCKETS:
        v = plans.variant("bfloat16", bucket, 0, arch)
        assert v.smem_bytes <= arch_caps(arch).smem_per_block
        assert v.smem_bytes == plans.smem_bytes(bucket, v.config.block_n, v.config.stages)
        assert v.config.block_m == 64 and v.threads == 128 and v.config.warps_n == 1
        few = plans.variant("bfloat16", bucket, 0, arch, plans.FEW)
        assert few.smem_bytes <= arch_caps(arch).smem_per_block and few.threads == 128
        assert few.smem_bytes == plans.smem_bytes(bucket, few.config.block_n, few.config.stages, plans.FEW_ROWS)
        # 16 rows, the four warps splitting each key block, 16 keys or more each
        assert few.config.block_m == plans.FEW_ROWS and few.config.warps_n == 4 and few.config.block_n >= 64
        for mod in plans.SCORE_MODS:
            p = plans.variant("bfloat16", bucket, mod, arch, plans.PREFILL)
            assert p.smem_bytes <= arch_caps(arch).smem_per_block
            assert p.smem_bytes == plans.smem_bytes(bucket, p.config.block_n, p.config.stages, p.config.block_m)
            assert p.threads == 32 * p.config.num_warps and p.config.block_m % (16 * p.config.num_warps) == 0


def test_plan_orders_append_kernel_combine():
    p = plans.plan("bfloat16", 1, 1, 32, 8, 128, 128, 0, 131072, True, None, 90, 132)
    names = [launch.variant.name for launch in p.launches]
    assert names == [plans.APPEND_NAME, plans.KERNEL_NAME, plans.COMBINE_NAME]
    assert p.num_splits > 1 and p.launches[1].grid == (p.num_splits, 8, 1)
    assert p.o_accum == (p.num_splits, 1, 32, 1, 128) and p.lse_accum == (p.num_splits, 1, 32, 1)
    assert p.launches[1].variant.config.block_m == plans.FEW_ROWS  # one token of 4 heads: the few-row tile
    p1 = plans.plan("bfloat16", 64, 1, 32, 8, 128, 128, 0, 8192, False, None, 90, 132)
    assert [launch.variant.name for launch in p1.launches] == [plans.KERNEL_NAME] and p1.num_splits == 1
    assert p1.launches[0].variant.config.warps_n == 4 and p1.launches[0].grid == (1, 8, 64)
    # 4 tokens x 4 heads = 16 rows: still one few-row block; 17 tokens x 1 head (MHA chunk) too many
    p4 = plans.plan("bfloat16", 2, 4, 8, 2, 128, 128, 0, 640, True, 1, 90, 132)
    assert p4.launches[1].variant.config.block_m == plans.FEW_ROWS and p4.launches[1].grid == (1, 2, 2)
    p5 = plans.plan("bfloat16", 2, 17, 8, 8, 128, 128, 0, 640, True, 1, 90, 132)
    assert p5.launches[1].variant.config.block_m == plans.BLOCK_M
    # 77 tokens x 4 heads per group = 308 packed rows (>= PREFILL_ROWS): the prefill tile, 3 query blocks of 128
    p2 = plans.plan("float16", 2, 77, 8, 2, 96, 96, 1, 640, True, 3, 90, 132)
    assert p2.launches[1].variant.config.block_m == 128 and p2.launches[1].grid == (3 * 3, 2, 2)
    # 50 tokens x 4 = 200 rows: the decoding tile, 4 query blocks of 64
    p3 = plans.plan("float16", 2, 50, 8, 2, 96, 96, 1, 640, True, 3, 90, 132)
    assert p3.launches[1].variant.config.block_m == 64 and p3.launches[1].grid == (4 * 3, 2, 2)


@pytest.mark.parametrize("arch", [80, 86, 90])
def test_prefill_takes_the_forward_tile(arch):
    """From PREFILL_ROWS packed rows per kv head a call takes the mma.sync forward's tile (128 rows where it has
    them), which fits the arch; a decoding call keeps the 64-row tile."""
    from cuflash.arch import arch_caps
    from cuflash.kernels.forward import tile_sm80

    for bucket in (64, 128, 256):
        decode = plans.variant("bfloat16", bucket, 0, arch)
        prefill = plans.variant("bfloat16", bucket, 0, arch, plans.PREFILL)
        assert decode.config.block_m == plans.BLOCK_M
        assert (prefill.config.block_m, prefill.config.block_n, prefill.config.num_warps,
                prefill.config.stages) == tile_sm80(arch, bucket, True)
        # decoding streams the cache through wide panels (whole 128-byte lines); prefill keeps narrow ones
        assert decode.config.panel_cols == 64 and prefill.config.panel_cols == 32
        assert prefill.smem_bytes <= arch_caps(arch).smem_per_block
    rows = plans.PREFILL_ROWS
    big = plans.plan("bfloat16", 1, rows // 4, 32, 8, 128, 128, 0, 4096, True, None, arch, 132)
    small = plans.plan("bfloat16", 1, rows // 4 - 1, 32, 8, 128, 128, 0, 4096, True, None, arch, 132)
    assert big.launches[1].variant.config.block_m == tile_sm80(arch, 128, True)[0]
    assert small.launches[1].variant.config.block_m == plans.BLOCK_M
    for bucket in (32, 96, 160, 224):  # rows of half lines: narrow panels
        assert plans.variant("bfloat16", bucket, 0, arch).config.panel_cols == 32


@pytest.mark.parametrize("arch", [80, 86, 90])
def test_float32_takes_the_simt_kernel(arch):
    """float32 calls run the true-fp32 kernel: 16 packed rows for decoding, the SIMT forward's tile from
    SIMT_PREFILL_ROWS rows, within the SIMT kernels' shared-memory promise; the combine takes float32 too."""
    from cuflash.kernels import simt

    for bucket in HEAD_DIM_BUCKETS:
        for mod in plans.SCORE_MODS:
            decode = plans.variant("float32", bucket, mod, arch)
            prefill = plans.variant("float32", bucket, mod, arch, plans.PREFILL)
            assert plans.variant("float32", bucket, mod, arch, plans.FEW) == decode
            assert decode.source == plans.SIMT_SOURCE and decode.threads == simt.THREADS
            assert decode.config.block_m == plans.SIMT_DECODE_ROWS
            assert (prefill.config.block_m, prefill.config.block_n) == simt.forward_tiles(bucket)
            for v in (decode, prefill):
                assert v.smem_bytes == simt.forward_smem_bytes(bucket, v.config.block_m, v.config.block_n)
                assert v.smem_bytes <= simt.MAX_SMEM_BYTES
    rows = plans.SIMT_PREFILL_ROWS
    p = plans.plan("float32", 2, rows // 4, 32, 8, 128, 128, 0, 4096, True, 3, arch, 132)
    names = [launch.variant.name for launch in p.launches]
    assert names == [plans.APPEND_NAME, plans.SIMT_KERNEL_NAME, plans.COMBINE_NAME]
    assert p.launches[0].variant.config.elem_bytes == 4 and p.launches[2].variant.config.dtype == "float32"
    assert p.launches[1].variant.config.block_m == simt.forward_tiles(128)[0]
    assert p.launches[1].grid == (3, 8, 2)
    small = plans.plan("float32", 2, rows // 4 - 1, 32, 8, 128, 128, 0, 4096, False, 1, arch, 132)
    assert small.launches[0].variant.config.block_m == plans.SIMT_DECODE_ROWS
    assert small.launches[0].grid == (-(-(rows - 4) // plans.SIMT_DECODE_ROWS), 8, 2)
    every = {v for v in plans.all_variants(arch) if v.source == plans.SIMT_SOURCE}
    assert len(every) == len(HEAD_DIM_BUCKETS) * len(plans.SCORE_MODS) * 2


def _cache(gpu, B=3, L=256, Hkv=2, D=64, dtype=BF16, paged=None):
    if paged is None:
        k = gpu.array((B, L, Hkv, D), dtype)
        v = gpu.array((B, L, Hkv, D), dtype)
        return k, v, None
    num_pages, page_size, max_pages = paged
    k = gpu.array((num_pages, page_size, Hkv, D), dtype)
    v = gpu.array((num_pages, page_size, Hkv, D), dtype)
    return k, v, gpu.array((B, max_pages), np.int32)


def test_paged_call_addresses_pages(gpu):
    B, H, Hkv, D = 3, 8, 2, 64
    q = gpu.array((B, 1, H, D), BF16)
    k, v, table = _cache(gpu, B, Hkv=Hkv, D=D, paged=(40, 16, 12))
    lengths = gpu.array((B,), np.int32)
    k_new, v_new = gpu.array((B, 1, Hkv, D), BF16), gpu.array((B, 1, Hkv, D), BF16)
    cuflash.attention_with_kvcache(q, k, v, lengths, k_new, v_new, block_table=table, causal=True, num_splits=1)
    assert len(gpu.launches) == 2  # append, attention
    (_, append_grid, _, _, _, _, _), (_, grid, block, smem, _, params, _) = gpu.launches
    r = record(params)
    assert grid == (1, Hkv, B) and block == (128, 1, 1)
    assert r["k_batch_stride"] == 16 * Hkv * D and r["k_row_stride"] == Hkv * D and r["k_head_stride"] == D
    assert r["block_table"] == table.data.ptr and r["block_table_batch_stride"] == 12
    assert r["page_size"] == 16 and r["num_pages"] == 40 and r["kv_capacity"] == 12 * 16
    assert r["cache_seqlens"] == lengths.data.ptr and r["seqlen_new"] == 1 and r["num_splits"] == 1
    assert r["k_new"] == k_new.data.ptr and r["knew_row_stride"] == Hkv * D
    assert r["window_left"] == validation.UNBOUNDED_WINDOW and r["window_right"] == 0  # causal
    assert r["h_per_kv"] == 4


def test_dense_call_splits_into_scratch(gpu):
    B, H, Hkv, D, L = 1, 32, 8, 128, 8192
    q = gpu.array((B, 1, H, D), BF16)
    k, v, _ = _cache(gpu, B, L, Hkv, D)
    cuflash.attention_with_kvcache(q, k, v, gpu.array((B,), np.int32), window=(100, None))
    assert len(gpu.launches) == 2  # attention, combine
    r = record(gpu.launches[0][5])
    splits = int(r["num_splits"])
    assert splits > 1 and gpu.launches[0][1] == (splits, Hkv, B)
    assert r["o_accum"] != 0 and r["lse_accum"] != 0 and r["block_table"] == 0
    assert r["window_left"] == 100 and r["window_right"] == validation.UNBOUNDED_WINDOW
    assert r["kv_capacity"] == L and r["seqlen_new"] == 0
    assert record(gpu.launches[1][5])["o_accum"] == r["o_accum"]
    # the few-row tile alone on its SM: the launch reserves more shared memory than the kernel uses
    assert gpu.launches[0][3] == plans.smem_floor(90, 1) > plans.smem_bytes(D, 64, 2, plans.FEW_ROWS)
    assert gpu.launches[1][3] == 0  # the combine


@pytest.mark.parametrize("arch", [80, 86, 90])
def test_few_row_tile_runs_alone_on_its_sm_for_a_dense_cache(arch):
    """One decoding token's group: the few-row tile, whose dense-cache launch reserves enough shared memory to
    keep a second CTA off the SM, a paged cache's a third (within what a block may take); the other tiles'
    launches reserve nothing."""
    from cuflash.arch import arch_caps

    caps = arch_caps(arch)
    for ctas in (1, 2):
        floor = plans.smem_floor(arch, ctas)
        assert ctas * (floor + 1024) <= caps.smem_per_sm < (ctas + 1) * (floor + 1024)
        assert floor <= caps.smem_per_block
    for bucket in HEAD_DIM_BUCKETS:
        dense = plans.plan("bfloat16", 2, 1, 32, 8, bucket, bucket, 0, 4096, True, None, arch, 132)
        paged = plans.plan("bfloat16", 2, 1, 32, 8, bucket, bucket, 0, 4096, True, None, arch, 132, paged=True)
        for p, ctas in ((dense, 1), (paged, 2)):
            attention = p.launches[1]
            assert attention.variant.config.warps_n == 4
            assert attention.smem_floor == plans.smem_floor(arch, ctas)
            assert attention.smem_bytes == max(attention.smem_floor, attention.variant.smem_bytes)
            assert plans.ctas_per_sm(attention.variant, arch, attention.smem_floor) <= ctas
        assert dense.launches[0].smem_floor == 0  # the append
    for args in (("bfloat16", 2, 30, 32, 8, 128, 128, 0, 4096, True, 1, arch, 132),  # 120 rows: the 64-row tile
                 ("float32", 2, 1, 32, 8, 128, 128, 0, 4096, True, 1, arch, 132)):  # the SIMT kernel
        assert all(launch.smem_floor == 0 for launch in plans.plan(*args).launches)


@pytest.mark.parametrize("change,error,match", [
    (dict(lengths=(4,)), ValueError, "cache_seqlens must have shape \\(3,\\)"),
    (dict(lengths_dtype=np.int64), TypeError, "cache_seqlens must have dtype int32"),
    (dict(k_new_tokens=2, v_new_tokens=1), ValueError, "v_new has 1 tokens but k_new has 2"),
    (dict(k_new_heads=4), ValueError, "k_new has 4 kv heads"),
    (dict(cache_heads=3), ValueError, "does not divide"),
    (dict(cache_batch=2), ValueError, "k_cache has batch 2"),
    (dict(options={"segment_ids": (1, 2)}), ValueError, "segment_ids is not supported by attention_with_kvcache"),
    (dict(options={"dropout_p": 0.1}), ValueError, "dropout_p"),
    (dict(options={"unknown": 1}), TypeError, "unexpected keyword"),
])
def test_bad_arguments_are_refused_naming_them(gpu, change, error, match):
    B, H, D = 3, 8, 64
    hkv = change.get("cache_heads", 2)
    q = gpu.array((B, 1, H, D), BF16)
    k, v, _ = _cache(gpu, change.get("cache_batch", B), 128, hkv, D)
    lengths = gpu.array(change.get("lengths", (B,)), change.get("lengths_dtype", np.int32))
    k_new = gpu.array((B, change.get("k_new_tokens", 1), change.get("k_new_heads", hkv), D), BF16)
    v_new = gpu.array((B, change.get("v_new_tokens", 1), hkv, D), BF16)
    with pytest.raises(error, match=match):
        cuflash.attention_with_kvcache(q, k, v, lengths, k_new, v_new, **change.get("options", {}))
    assert not gpu.launches


def test_workspace_shapes_come_from_shapes_and_are_used(gpu):
    B, H, Hkv, D, L = 1, 32, 8, 128, 65536
    q = gpu.array((B, 1, H, D), BF16)
    k, v, _ = _cache(gpu, B, L, Hkv, D)
    shapes = cuflash.kvcache_workspace(q, k, v, causal=True, scale=0.1)
    assert set(shapes) == {"o_accum", "lse_accum"} and shapes["o_accum"][1:] == (B, H, 1, D)
    workspace = {name: gpu.array(shape, np.float32) for name, shape in shapes.items()}
    cuflash.attention_with_kvcache(q, k, v, gpu.array((B,), np.int32), causal=True, workspace=workspace)
    r = record(gpu.launches[0][5])
    assert r["o_accum"] == workspace["o_accum"].data.ptr and r["lse_accum"] == workspace["lse_accum"].data.ptr
    assert r["num_splits"] == shapes["o_accum"][0]
    with pytest.raises(ValueError, match="workspace lacks"):
        cuflash.attention_with_kvcache(q, k, v, gpu.array((B,), np.int32), workspace={"o_accum": workspace["o_accum"]})
    assert cuflash.kvcache_workspace(q, k, v, num_splits=1) == {}


def test_a_repeated_call_patches_pointers_into_the_same_block(gpu):
    """The second call with the same key skips validation: its parameter blocks equal the validating path's
    with the new arrays' pointers (and fresh split scratch) patched in."""
    B, H, Hkv, D = 1, 32, 8, 128
    q = gpu.array((B, 1, H, D), BF16)
    k, v, table = _cache(gpu, B, Hkv=Hkv, D=D, paged=(64, 1024, 64))
    args = [gpu.array((B,), np.int32), gpu.array((B, 1, Hkv, D), BF16), gpu.array((B, 1, Hkv, D), BF16)]
    slopes = gpu.array((H,), np.float32)
    cuflash.attention_with_kvcache(q, k, v, *args, block_table=table, causal=True, alibi_slopes=slopes)
    first = [record(launch[5]) for launch in gpu.launches]
    assert len(first) == 3 and int(first[1]["num_splits"]) > 1  # append, attention (split), combine
    gpu.launches.clear()
    args2 = [gpu.array((B,), np.int32), gpu.array((B, 1, Hkv, D), BF16), gpu.array((B, 1, Hkv, D), BF16)]
    q2, slopes2 = gpu.array((B, 1, H, D), BF16), gpu.array((H,), np.float32)
    api_validate = cuflash.kvcache.KvCall
    try:
        cuflash.kvcache.KvCall = None  # a hit must not validate
        cuflash.attention_with_kvcache(q2, k, v, *args2, block_table=table, causal=True, alibi_slopes=slopes2)
    finally:
        cuflash.kvcache.KvCall = api_validate
    second = [record(launch[5]) for launch in gpu.launches]
    assert len(second) == 3
    changed = {"q": q2, "cache_seqlens": args2[0], "k_new": args2[1], "v_new": args2[2], "alibi_slopes": slopes2}
    for a, b in zip(first, second):
        for name in params_dtype().names:
            if name in changed:
                assert b[name] == changed[name].data.ptr, name
            elif name in ("o", "lse", "o_accum", "lse_accum"):
                assert b[name] != 0, name
            else:
                assert a[name] == b[name], name
    o_bytes = 4 * int(np.prod(plans.plan("bfloat16", B, 1, H, Hkv, 128, D, 1, 64 * 1024, True, None, 90, 132,
                                         paged=True).o_accum))
    assert second[1]["lse_accum"] - second[1]["o_accum"] == -(-o_bytes // 256) * 256  # one allocation, carved


def test_host_lengths_are_never_cached(gpu, monkeypatch):
    import cupy

    B, H, Hkv, D = 2, 8, 2, 64
    q = gpu.array((B, 1, H, D), BF16)
    k, v, _ = _cache(gpu, B, 128, Hkv, D)
    copies = []

    def copy_to_fake_gpu(host):  # the same on machines with and without a GPU: the copy lands at a fake address
        copies.append(np.array(host))
        return gpu.array(np.shape(host), np.int32)

    class NoDeviceSwitch:  # the copy's device scope, which a machine without a GPU cannot enter
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(cupy, "asarray", copy_to_fake_gpu)
    monkeypatch.setattr(cupy.cuda, "Device", NoDeviceSwitch)
    cuflash.attention_with_kvcache(q, k, v, [3, 4])
    assert [c.tolist() for c in copies] == [[3, 4]] and len(gpu.launches) >= 1
    assert not cuflash.kvcache._plans
    # The next call with the same shapes validates again: a length past the capacity is caught.
    with pytest.raises(ValueError, match="cache_seqlens"):
        cuflash.attention_with_kvcache(q, k, v, [3, 200])
    assert not cuflash.kvcache._plans


def test_a_repeated_call_with_a_workspace_is_cached(gpu):
    """A decoding step that passes its split-KV buffers (as the torch adapter does) skips validation from the
    second call on: the given buffers' pointers patched in, nothing carved; a workspace missing a buffer, or
    holding one of another shape, is validated (and refused) every call; unknown names are never cached."""
    B, H, Hkv, D, L = 1, 32, 8, 128, 65536
    q = gpu.array((B, 1, H, D), BF16)
    k, v, _ = _cache(gpu, B, L, Hkv, D)
    shapes = cuflash.kvcache_workspace(q, k, v, causal=True)
    make = lambda: {name: gpu.array(shape, np.float32) for name, shape in shapes.items()}  # noqa: E731
    cuflash.attention_with_kvcache(q, k, v, gpu.array((B,), np.int32), causal=True, workspace=make())
    first = [record(launch[5]) for launch in gpu.launches]
    gpu.launches.clear()
    workspace, q2 = make(), gpu.array((B, 1, H, D), BF16)
    validate = cuflash.kvcache.KvCall
    try:
        cuflash.kvcache.KvCall = None  # a hit must not validate
        cuflash.attention_with_kvcache(q2, k, v, gpu.array((B,), np.int32), causal=True, workspace=workspace)
    finally:
        cuflash.kvcache.KvCall = validate
    second = [record(launch[5]) for launch in gpu.launches]
    assert len(second) == len(first) == 2  # attention (split), combine
    for a, b in zip(first, second):
        assert (b["o_accum"], b["lse_accum"]) == (workspace["o_accum"].data.ptr, workspace["lse_accum"].data.ptr)
        assert b["q"] == q2.data.ptr
        for name in params_dtype().names:
            if name not in ("q", "o", "lse", "cache_seqlens", "o_accum", "lse_accum"):
                assert a[name] == b[name], name
    with pytest.raises(ValueError, match="workspace lacks"):
        cuflash.attention_with_kvcache(q, k, v, gpu.array((B,), np.int32), causal=True,
                                       workspace={"o_accum": workspace["o_accum"]})
    bad = dict(workspace, lse_accum=gpu.array((1,) + tuple(shapes["lse_accum"]), np.float32))
    with pytest.raises(ValueError, match="lse_accum"):
        cuflash.attention_with_kvcache(q, k, v, gpu.array((B,), np.int32), causal=True, workspace=bad)
    plans_before = len(cuflash.kvcache._plans)
    cuflash.attention_with_kvcache(q, k, v, gpu.array((B,), np.int32), causal=True, workspace=dict(workspace, extra=q))
    assert len(cuflash.kvcache._plans) == plans_before
