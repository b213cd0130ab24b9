"""The cached launch plans of the core (cuflash.api / cuflash.launch.CallPlan), on the CPU.

``fake_gpu.FakeGPU`` stands in for the device: CuPy arrays over made-up addresses, a recording
cuLaunchKernel that copies each parameter block. A repeated call must skip validation and planning,
launch the same kernels with byte-identical parameters (pointers aside) as a validating call on the same
arrays, and any change a check could see must miss the cache and be checked again.
"""
import math

import numpy as np
import pytest

pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")

import cupy  # noqa: E402

import cuflash  # noqa: E402
from cuflash import api, launch, validation  # noqa: E402
from cuflash.arrays import describe  # noqa: E402

from fake_gpu import FakeGPU, install_fresh, pointers_of  # noqa: E402,F401

BF16 = ml_dtypes.bfloat16


@pytest.fixture
def gpu(monkeypatch):
    return install_fresh(monkeypatch)


@pytest.fixture
def checks(monkeypatch):
    """Counts calls of validation.check_qkv (the first thing the validating path does after describing)."""
    count = {"check_qkv": 0}
    original = validation.check_qkv

    def counting(*args, **kwargs):
        count["check_qkv"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(validation, "check_qkv", counting)
    return count


def qkv(gpu, b=2, sq=33, sk=47, h=4, hk=2, d=64, dtype=BF16):
    return (gpu.array((b, sq, h, d), dtype), gpu.array((b, sk, hk, d), dtype), gpu.array((b, sk, hk, d), dtype))


def expected_forward_params(q, k, v, out, lse, *, scale=None, causal=False) -> bytes:
    """The parameter block the validating path packs for these arrays (launch.make_params)."""
    qd, kd, vd = describe(q, "q"), describe(k, "k"), describe(v, "v")
    shape = validation.check_qkv(qd, kd, vd, causal=causal)
    params = launch.make_params(shape, validation.check_scale(scale, shape.head_dim), qd, kd, vd,
                                describe(out, "out"), describe(lse, "lse"))
    return params.tobytes()


def test_second_call_skips_validation_and_launches_the_same(gpu, checks):
    q, k, v = qkv(gpu)
    out1, lse1 = cuflash.attention_forward(q, k, v, causal=True)
    assert checks["check_qkv"] == 1 and len(gpu.launches) == 1
    q2, k2, v2 = qkv(gpu)  # same key, other memory
    out2, lse2 = cuflash.attention_forward(q2, k2, v2, causal=True)
    assert checks["check_qkv"] == 1, "a cache hit validated again"
    assert len(gpu.launches) == 2
    first, second = gpu.launches
    assert first[:5] == second[:5]  # function, grid, block, smem, stream
    assert second[5] == expected_forward_params(q2, k2, v2, out2, lse2, causal=True)
    assert first[5] == expected_forward_params(q, k, v, out1, lse1, causal=True)
    assert (out2.shape, out2.dtype, lse2.shape, lse2.dtype) == ((2, 33, 4, 64), np.dtype(BF16), (2, 4, 33), np.float32)
    assert pointers_of(second[5])["o"] == out2.data.ptr != out1.data.ptr


def test_given_outputs_are_written_and_returned(gpu, checks):
    q, k, v = qkv(gpu)
    out, lse = gpu.array((2, 33, 4, 64), BF16), gpu.array((2, 4, 33), np.float32)
    for _ in range(3):
        o, row_lse = cuflash.attention_forward(q, k, v, out=out, lse=lse, scale=0.3, stream=0x1234)
        assert o is out and row_lse is lse
    assert checks["check_qkv"] == 1
    assert [launch[4] for launch in gpu.launches] == [0x1234] * 3
    assert all(launch[5] == expected_forward_params(q, k, v, out, lse, scale=0.3) for launch in gpu.launches)


@pytest.mark.parametrize("change", ["scale", "causal", "dtype", "stride", "shape", "out given"])
def test_a_different_key_is_validated_again(gpu, checks, change):
    q, k, v = qkv(gpu)
    cuflash.attention_forward(q, k, v)
    options = {}
    if change == "scale":
        options["scale"] = 0.5
    elif change == "causal":
        options["causal"] = True
    elif change == "dtype":
        q, k, v = qkv(gpu, dtype=np.float16)
    elif change == "stride":  # (B, H, S, D) memory viewed as bshd
        q = gpu.array((2, 33, 4, 64), BF16, strides=(4 * 33 * 64, 64, 33 * 64, 1))
    elif change == "shape":
        q, k, v = qkv(gpu, sq=34)
    elif change == "out given":
        options["out"] = gpu.array((2, 33, 4, 64), BF16)
    cuflash.attention_forward(q, k, v, **options)
    assert checks["check_qkv"] == 2
    cuflash.attention_forward(q, k, v, **options)
    assert checks["check_qkv"] == 2  # and now that key is cached too


def test_misaligned_pointer_is_refused_after_an_aligned_call_was_cached(gpu):
    q, k, v = qkv(gpu)
    cuflash.attention_forward(q, k, v)
    cuflash.attention_forward(q, k, v)
    odd = gpu.array((2, 33, 4, 64), BF16, offset_bytes=8)  # same shape, strides, dtype; address % 16 = 8
    for _ in range(2):
        with pytest.raises(ValueError, match="q's base pointer is not 16-byte aligned"):
            cuflash.attention_forward(odd, k, v)
    out_odd = gpu.array((2, 33, 4, 64), BF16, offset_bytes=2)
    with pytest.raises(ValueError, match="out's base pointer"):
        cuflash.attention_forward(q, k, v, out=out_odd)


def test_cpu_arrays_and_bad_arguments_still_refused_after_caching(gpu):
    q, k, v = qkv(gpu)
    cuflash.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="q is on the CPU"):
        cuflash.attention_forward(np.zeros((2, 33, 4, 64), np.float32), k, v)
    with pytest.raises(TypeError, match="stream must be"):
        cuflash.attention_forward(q, k, v, stream="default")
    with pytest.raises(TypeError, match="scale must be a number"):
        cuflash.attention_forward(q, k, v, scale=[1.0])
    with pytest.raises(ValueError, match="seed= is required with dropout_p > 0"):
        cuflash.attention_forward(q, k, v, dropout_p=0.1)
    with pytest.raises(TypeError, match="mask must have dtype bool"):
        cuflash.attention_forward(q, k, v, mask=gpu.array((2, 4, 33, 47), np.float32))
    with pytest.raises(TypeError, match="bias must have q's dtype"):
        cuflash.attention_forward(q, k, v, bias=gpu.array((2, 4, 33, 47), np.float32))
    with pytest.raises(ValueError, match="softcap must be a finite number"):
        cuflash.attention_forward(q, k, v, softcap=-30.0)


def test_backward_hit_matches_the_validating_path(gpu, checks):
    q, k, v = qkv(gpu)
    out, lse = gpu.array((2, 33, 4, 64), BF16), gpu.array((2, 4, 33), np.float32)
    dout = gpu.array((2, 33, 4, 64), BF16)
    cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    first = list(gpu.launches)
    gpu.launches.clear()
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert checks["check_qkv"] == 1
    assert [l[:5] for l in gpu.launches] == [l[:5] for l in first]
    assert len({l[5] for l in gpu.launches}) == 1  # every kernel of one call gets one parameter block
    block, before = gpu.launches[0][5], first[0][5]
    pointers = pointers_of(block)
    assert (pointers["dq"], pointers["dk"], pointers["dv"]) == (dq.data.ptr, dk.data.ptr, dv.data.ptr)
    assert pointers["dlse"] == 0
    assert block[8 * len(launch.POINTER_FIELDS):] == before[8 * len(launch.POINTER_FIELDS):]
    # Scratch carved from one allocation: each buffer at its own 256-byte-aligned offset, none overlapping.
    plan = launch.backward_plan(validation.check_qkv(describe(q, "q"), describe(k, "k"), describe(v, "v"),
                                                     causal=True), 0, False)
    spans = sorted((pointers[field], 4 * int(np.prod(shape))) for field, shape in plan.scratch)
    assert all(start % 256 == 0 for start, _ in spans)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    unused = set(launch.POINTER_FIELDS[9:13]) - {field for field, _ in plan.scratch}
    assert all(pointers[field] == 0 for field in unused)


def test_backward_with_workspace_and_dlse(gpu, checks):
    q, k, v = qkv(gpu)
    out, lse = gpu.array((2, 33, 4, 64), BF16), gpu.array((2, 4, 33), np.float32)
    dout, dlse = gpu.array((2, 33, 4, 64), BF16), gpu.array((2, 4, 33), np.float32)
    shapes = cuflash.backward_workspace(q, k, v)
    workspace = {name: gpu.array(shape, np.float32) for name, shape in shapes.items()}
    grads = [gpu.array(x.shape, BF16) for x in (q, k, v)]
    checks["check_qkv"] = 0  # backward_workspace checked the metadata
    for _ in range(2):
        result = cuflash.attention_backward(dout, q, k, v, out, lse, dlse=dlse, dq=grads[0], dk=grads[1],
                                            dv=grads[2], workspace=workspace)
        assert all(r is g for r, g in zip(result, grads))
    assert checks["check_qkv"] == 1
    n = len(gpu.launches) // 2
    assert gpu.launches[:n] == gpu.launches[n:]  # same arrays: byte-identical launches
    pointers = pointers_of(gpu.launches[-1][5])
    assert pointers["dlse"] == dlse.data.ptr
    assert {field: pointers[field] for field in shapes} == {f: w.data.ptr for f, w in workspace.items()}
    # A workspace buffer of the wrong shape is a new key: validated and refused.
    name = next(iter(shapes))
    bad = dict(workspace, **{name: gpu.array((1,) + tuple(shapes[name]), np.float32)})
    with pytest.raises(ValueError, match=f"workspace\\['{name}'\\] must have shape"):
        cuflash.attention_backward(dout, q, k, v, out, lse, dlse=dlse, workspace=bad)


@pytest.mark.parametrize("name", ["lse_log2", "softmax_d", "dq_accum"])
def test_workspace_buffers_must_be_16_byte_aligned(gpu, name):
    """A workspace buffer 4 bytes off a 16-byte boundary is refused by name, before any launch: the dK/dV kernels
    add whole dq_accum rows by 16-byte bulk copies, which fault on such an address."""
    q, k, v = qkv(gpu)
    out, lse = gpu.array((2, 33, 4, 64), BF16), gpu.array((2, 4, 33), np.float32)
    dout = gpu.array((2, 33, 4, 64), BF16)
    shapes = cuflash.backward_workspace(q, k, v)
    workspace = {field: gpu.array(shape, np.float32, offset_bytes=4 if field == name else 0)
                 for field, shape in shapes.items()}
    with pytest.raises(ValueError, match=f"workspace\\['{name}'\\]'s base pointer is not 16-byte aligned"):
        cuflash.attention_backward(dout, q, k, v, out, lse, workspace=workspace)
    assert not gpu.launches


def test_call_plan_params_bytes_equal_make_params(gpu):
    """CallPlan.params_bytes (pointers patched into the cached block) == make_params on other arrays."""
    q, k, v = qkv(gpu)
    out, lse = gpu.array((2, 33, 4, 64), BF16), gpu.array((2, 4, 33), np.float32)
    descs = [describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"))]
    shape = validation.check_qkv(*descs[:3], causal=False)
    plan = launch.CallPlan(launch.forward_plan(shape, 0), 0, launch.make_params(shape, 0.125, *descs), 5)
    others = [gpu.array(x.shape, x.dtype) for x in (q, k, v, out, lse)]
    other_descs = [describe(x, n) for x, n in zip(others, ("q", "k", "v", "out", "lse"))]
    assert plan.params_bytes([d.ptr for d in other_descs]) == \
        launch.make_params(shape, 0.125, *other_descs).tobytes()


def test_plan_cache_is_bounded(gpu, monkeypatch):
    monkeypatch.setattr(api, "MAX_CACHED_PLANS", 3)
    for sq in range(1, 8):
        cuflash.attention_forward(*qkv(gpu, sq=sq))
    assert 1 <= len(api._forward_plans) <= 3


def _option_arrays(gpu, b=2, sq=33, sk=47, h=4):
    return {"window": (16, None), "softcap": 20.0,
            "segment_ids": (gpu.array((b, sq), np.int32), gpu.array((b, sk), np.int32)),
            "block_ids": (gpu.array((b, sq), np.int32), gpu.array((b, sk), np.int32)),
            "alibi_slopes": gpu.array((b, h), np.float32)}


def _non_pointer_bytes(block: bytes) -> bytes:
    return block[8 * len(launch.POINTER_FIELDS):]


@pytest.mark.parametrize("entry", ["forward", "backward"])
def test_calls_with_score_options_are_cached_and_patch_every_pointer(gpu, checks, entry):
    q, k, v = qkv(gpu)
    opts = _option_arrays(gpu)

    def call(q, k, v, opts):
        if entry == "forward":
            return cuflash.attention_forward(q, k, v, causal=True, **opts)
        out, lse = gpu.array((2, 33, 4, 64), BF16), gpu.array((2, 4, 33), np.float32)
        return cuflash.attention_backward(gpu.array((2, 33, 4, 64), BF16), q, k, v, out, lse, causal=True, **opts)

    call(q, k, v, opts)
    first = list(gpu.launches)
    validated = checks["check_qkv"]
    q2, k2, v2 = qkv(gpu)
    opts2 = _option_arrays(gpu)  # same keys, other memory
    call(q2, k2, v2, opts2)
    assert checks["check_qkv"] == validated, "a cache hit validated again"
    second = gpu.launches[len(first):]
    assert len(second) == len(first) >= 2  # the lists pre-pass, then the kernels
    for a, b in zip(first, second):
        assert a[:5] == b[:5]
        assert _non_pointer_bytes(a[5]) == _non_pointer_bytes(b[5])
    ptrs = pointers_of(second[-1][5])
    assert ptrs["q"] == q2.data.ptr
    assert ptrs["q_segment_ids"] == opts2["segment_ids"][0].data.ptr
    assert ptrs["k_segment_ids"] == opts2["segment_ids"][1].data.ptr
    assert ptrs["q_block_ids"] == opts2["block_ids"][0].data.ptr
    assert ptrs["k_block_ids"] == opts2["block_ids"][1].data.ptr
    assert ptrs["alibi_slopes"] == opts2["alibi_slopes"].data.ptr
    lists = "kv_blocks" if entry == "forward" else "q_blocks"
    assert ptrs[lists] != 0 and pointers_of(first[-1][5])[lists] != 0
    # Every launch of the call (the list pre-pass included) sees the same option pointers.
    assert all(pointers_of(l[5])["q_segment_ids"] == ptrs["q_segment_ids"] for l in second)
    # A changed option misses the cache and is validated again.
    call(q2, k2, v2, dict(opts2, window=(17, None)))
    assert checks["check_qkv"] == validated + 1
    with pytest.raises(ValueError, match="window left must be >= 0"):
        call(q2, k2, v2, dict(opts2, window=(-1, None)))


@pytest.mark.parametrize("entry", ["forward", "backward"])
def test_calls_with_a_bool_mask_or_a_bias_are_cached(gpu, checks, entry):
    """A bool mask (forward and backward) and a bias (forward; the backward's below) take the cached path:
    the hit patches their pointers after the lists."""
    q, k, v = qkv(gpu)

    def opts_for():
        opts = {"mask": gpu.array((2, 2, 33, 47), np.bool_)}
        if entry == "forward":
            opts["bias"] = gpu.array((1, 4, 33, 47), BF16)
        return opts

    def call(q, k, v, opts):
        if entry == "forward":
            return cuflash.attention_forward(q, k, v, causal=True, **opts)
        out, lse = gpu.array((2, 33, 4, 64), BF16), gpu.array((2, 4, 33), np.float32)
        return cuflash.attention_backward(gpu.array((2, 33, 4, 64), BF16), q, k, v, out, lse, causal=True, **opts)

    opts = opts_for()
    call(q, k, v, opts)
    first = list(gpu.launches)
    validated = checks["check_qkv"]
    q2, k2, v2 = qkv(gpu)
    opts2 = opts_for()
    call(q2, k2, v2, opts2)
    assert checks["check_qkv"] == validated, "a cache hit validated again"
    second = gpu.launches[len(first):]
    assert len(second) == len(first) >= 2
    for a, b in zip(first, second):
        assert a[:5] == b[:5]
        assert _non_pointer_bytes(a[5]) == _non_pointer_bytes(b[5])
    for launch_ in second:
        ptrs = pointers_of(launch_[5])
        assert ptrs["mask"] == opts2["mask"].data.ptr and ptrs["q"] == q2.data.ptr
        assert ptrs["bias"] == (opts2["bias"].data.ptr if entry == "forward" else 0)
        assert ptrs["dbias"] == ptrs["dbias_accum"] == 0


def test_a_backward_with_a_full_bias_is_cached(gpu, checks):
    """A full-shape bias: the hit allocates dbias (or takes dbias=) and patches bias and dbias, launching what
    the validating call launched."""
    q, k, v = qkv(gpu)

    def call(q, k, v, bias, dbias=None):
        out, lse = gpu.array((2, 33, 4, 64), BF16), gpu.array((2, 4, 33), np.float32)
        return cuflash.attention_backward(gpu.array((2, 33, 4, 64), BF16), q, k, v, out, lse, bias=bias,
                                          dbias=dbias)

    grads = call(q, k, v, gpu.array((2, 4, 33, 47), BF16))
    assert len(grads) == 4 and grads[3].shape == (2, 4, 33, 47)
    first, validated = list(gpu.launches), checks["check_qkv"]
    bias2 = gpu.array((2, 4, 33, 47), BF16)
    grads2 = call(q, k, v, bias2)
    assert checks["check_qkv"] == validated, "a cache hit validated again"
    second = gpu.launches[len(first):]
    assert len(second) == len(first) >= 2
    for a, b in zip(first, second):
        assert a[:5] == b[:5] and _non_pointer_bytes(a[5]) == _non_pointer_bytes(b[5])
    assert len(grads2) == 4 and grads2[3].shape == (2, 4, 33, 47) and grads2[3].dtype == BF16
    assert grads2[3].data.ptr != grads[3].data.ptr
    for launch_ in second:
        ptrs = pointers_of(launch_[5])
        assert ptrs["bias"] == bias2.data.ptr and ptrs["dbias"] == grads2[3].data.ptr and ptrs["dbias_accum"] == 0
    # dbias= given: its own key (strides go into the parameters), then hits patch its pointer.
    given = gpu.array((2, 4, 33, 47), BF16)
    call(q, k, v, bias2, dbias=given)
    validated = checks["check_qkv"]
    given2 = gpu.array((2, 4, 33, 47), BF16)
    before = len(gpu.launches)
    assert call(q, k, v, bias2, dbias=given2)[3] is given2
    assert checks["check_qkv"] == validated
    assert all(pointers_of(l[5])["dbias"] == given2.data.ptr for l in gpu.launches[before:])
    # (A broadcast bias: test_a_broadcast_bias_converts_its_sums_into_dbias below.)


def test_a_bias_loaded_by_tma_launches_with_its_own_map(gpu, monkeypatch):
    """Where the driver encodes the bias's tensor map (tma.bias_map), the params set bias_tma and every launch's
    second parameter holds the map of that call's bias: a cache hit with another bias buffer (same key) gets
    that buffer's map, not the first call's. A stand-in encoder records what it was asked."""
    from cuflash import tma

    asked = []

    def fake_encode(ptr, dims, byte_strides, box=tma.BIAS_BOX):
        if box != tma.BIAS_BOX:  # q / k / v maps: none here
            return None
        asked.append((ptr, dims, byte_strides))
        return ptr.to_bytes(8, "little") + bytes(120)

    monkeypatch.setattr(tma, "_encode", fake_encode)
    q, k, v = qkv(gpu, sq=64, sk=80)
    bias1 = gpu.array((2, 4, 64, 80), BF16)
    cuflash.attention_forward(q, k, v, bias=bias1)
    first = list(gpu.launches)
    assert asked[-1] == (bias1.data.ptr, (80, 64, 4, 2), (160, 64 * 160, 4 * 64 * 160))
    assert all(pointers_of(l[5])["bias"] == bias1.data.ptr for l in first)
    assert all(l[6][:8] == bias1.data.ptr.to_bytes(8, "little") for l in first)
    bias2 = gpu.array((2, 4, 64, 80), BF16)
    cuflash.attention_forward(q, k, v, bias=bias2)
    second = gpu.launches[len(first):]
    assert second and all(l[6][:8] == bias2.data.ptr.to_bytes(8, "little") for l in second)
    # The flag in the parameter block; without a map (a key-broadcast bias) neither is set.
    flag = launch.params_dtype().fields["bias_tma"][1]
    assert all(int.from_bytes(l[5][flag:flag + 4], "little") == 1 for l in second)
    gpu.launches.clear()
    cuflash.attention_forward(q, k, v, bias=gpu.array((2, 4, 64, 1), BF16))
    assert gpu.launches and all(int.from_bytes(l[5][flag:flag + 4], "little") == 0 for l in gpu.launches)
    assert all(l[6] == bytes(launch.TMA_PARAMS_BYTES) for l in gpu.launches)


def test_the_warp_specialized_forward_gets_q_k_v_maps(gpu, monkeypatch):
    """Where the plan runs the warp-specialized forward (D128 bf16 on sm_90) and the driver encodes all three
    maps, the params set qkv_tma and each launch's TmaParams hold the maps of that call's q, k, v (a hit with
    other arrays re-encodes them), and the backward's dout's too; where an encode fails (the driver refuses),
    neither."""
    from cuflash import tma

    def fake_encode(ptr, dims, byte_strides, box=tma.BIAS_BOX):
        return ptr.to_bytes(8, "little") + bytes(box) + bytes(116)

    monkeypatch.setattr(tma, "_encode", fake_encode)
    flag = launch.params_dtype().fields["qkv_tma"][1]
    for attempt in range(2):
        q, k, v = qkv(gpu, sq=256, sk=256, h=4, hk=2, d=128)
        cuflash.attention_forward(q, k, v, causal=True)
        (launch_,) = gpu.launches[-1:]
        assert int.from_bytes(launch_[5][flag:flag + 4], "little") == 1
        for offset, x in ((128, q), (256, k), (384, v)):
            assert launch_[6][offset:offset + 8] == x.data.ptr.to_bytes(8, "little")
            assert launch_[6][offset + 8:offset + 12] == bytes(tma.BSHD_BOX)
    # Long unmasked D256 heads (forward.D256_WIDE_MIN_KEYS) take 80-key tiles: K / V boxes of a whole tile; Q keeps
    # 64 x 64; a shorter head keeps 64 x 64 boxes everywhere.
    from cuflash.kernels import forward as fwd
    for sk, rows in ((fwd.D256_WIDE_MIN_KEYS + 77, 80), (453, 64)):
        q2, k2, v2 = qkv(gpu, b=1, sq=300, sk=sk, h=4, hk=2, d=256)
        cuflash.attention_forward(q2, k2, v2)
        maps = gpu.launches[-1][6]
        kv_box = bytes((64, 1, rows, 1))
        assert kv_box == bytes(tma.kv_box(rows))
        assert [maps[offset + 8:offset + 12] for offset in (128, 256, 384)] == [bytes(tma.BSHD_BOX), kv_box, kv_box]
    assert tma.kv_box(128) == tma.BSHD_BOX and tma.kv_box(64) == tma.BSHD_BOX and tma.kv_box(176) == (64, 1, 176, 1)
    with pytest.raises(ValueError):
        tma.kv_box(260)
    # The backward's warp-specialized dK/dV kernel reads q, k, v and dout maps.
    out, lse, dout = gpu.array((2, 256, 4, 128), BF16), gpu.array((2, 4, 256), np.float32), gpu.array((2, 256, 4, 128), BF16)
    before = len(gpu.launches)
    cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    for launch_ in gpu.launches[before:]:
        assert int.from_bytes(launch_[5][flag:flag + 4], "little") == 1
        for offset, x in ((128, q), (256, k), (384, v), (512, dout)):
            assert launch_[6][offset:offset + 8] == x.data.ptr.to_bytes(8, "little")
            assert launch_[6][offset + 8:offset + 12] == bytes(tma.BSHD_BOX)
    assert tma.bshd_map_layout((2, 256, 4, 128), (256 * 512, 512, 128, 1), 2, 256) == (
        (128, 4, 256, 2), (256, 1024, 256 * 1024))
    monkeypatch.setattr(tma, "_encode", lambda *args: None)
    api._forward_plans.clear()
    q, k, v = qkv(gpu, sq=256, sk=256, h=4, hk=2, d=128)
    cuflash.attention_forward(q, k, v, causal=True)
    assert int.from_bytes(gpu.launches[-1][5][flag:flag + 4], "little") == 0
    assert gpu.launches[-1][6] == bytes(launch.TMA_PARAMS_BYTES)


def test_bias_map_layout_takes_only_what_tma_can_read():
    """cuflash.tma.bias_map_layout: the 4-d view (keys innermost) and its byte strides, or None."""
    from cuflash.tma import bias_map_layout

    assert bias_map_layout((2, 4, 64, 80), (4 * 64 * 80, 64 * 80, 80, 1), 2, 256) == (
        (80, 64, 4, 2), (160, 64 * 160, 4 * 64 * 160))
    # Broadcast batch and head: size-1 dims, dense strides.
    assert bias_map_layout((1, 1, 64, 80), (0, 0, 80, 1), 2, 256) == ((80, 64, 1, 1), (160, 64 * 160, 64 * 160))
    # broadcast_to over the batch (stride 0 along a dim of 2): a size-1 dim as well.
    assert bias_map_layout((2, 4, 64, 80), (0, 64 * 80, 80, 1), 2, 256) == (
        (80, 64, 4, 1), (160, 64 * 160, 4 * 64 * 160))
    assert bias_map_layout((2, 4, 64, 80), (4 * 64 * 80, 64 * 80, 80, 1), 4, 256) is None  # fp32
    assert bias_map_layout((2, 4, 1, 80), (4 * 80, 80, 0, 1), 2, 256) is None  # broadcast over queries
    assert bias_map_layout((2, 4, 64, 1), (4 * 64, 64, 1, 0), 2, 256) is None  # broadcast over keys
    assert bias_map_layout((2, 4, 64, 80), (4 * 64 * 80, 64 * 80, 80, 1), 2, 258) is None  # base off 16 bytes
    assert bias_map_layout((2, 4, 64, 84), (4 * 64 * 84, 64 * 84, 84, 1), 2, 256) is None  # rows of 168 bytes


class _NoContext(Exception):
    """Stands in for CuPy's CUDADriverError where the thread has no current context."""

    status = 201  # CUDA_ERROR_INVALID_CONTEXT


def test_launch_binds_the_context_where_the_thread_has_none(gpu, monkeypatch):
    """A launch the driver refuses for want of a current context binds the device's context and launches
    again (torch's autograd thread can have none: cuflash.launch.ensure_context); other errors propagate."""
    bound = []
    monkeypatch.setattr(launch, "ensure_context", bound.append)
    recorded = gpu.launch_kernel
    refusals = {"left": 1}

    def refusing(*args):
        if refusals["left"]:
            refusals["left"] -= 1
            raise _NoContext()
        return recorded(*args)

    monkeypatch.setattr(launch, "_launch_kernel", refusing)
    q, k, v = (gpu.array((1, 33, 2, 64), BF16) for _ in range(3))
    cuflash.attention_forward(q, k, v)
    assert bound == [0] and len(gpu.launches) == 1

    class Other(Exception):
        status = 1  # CUDA_ERROR_INVALID_VALUE

    def failing(*args):
        raise Other()

    monkeypatch.setattr(launch, "_launch_kernel", failing)
    with pytest.raises(Other):
        cuflash.attention_forward(q, k, v)
    assert bound == [0]


@pytest.mark.parametrize("bias_shape", [(2, 4, 33, 47), (1, 4, 33, 47), (2, 1, 1, 47)])
def test_a_backward_without_dbias_stores_none_and_is_cached(gpu, checks, monkeypatch, bias_shape):
    """bias_grad=False (a bias that is a constant): three gradients, both dbias pointers null in every launch, no
    fp32 accumulator, and a cached plan even for a broadcast bias; deterministic=True takes a keys-broadcast
    bias (an additive padding mask), whose dbias it could not order. Asking for dbias= as well is an error."""
    q, k, v = qkv(gpu)
    zeroed = []
    monkeypatch.setattr(cupy, "zeros", lambda shape, dtype=float: zeroed.append(shape) or gpu.array(shape, dtype))

    def call(bias, **kwargs):
        out, lse = gpu.array((2, 33, 4, 64), BF16), gpu.array((2, 4, 33), np.float32)
        return cuflash.attention_backward(gpu.array((2, 33, 4, 64), BF16), q, k, v, out, lse, bias=bias,
                                          deterministic=True, bias_grad=False, **kwargs)

    bias = gpu.array(bias_shape, BF16)
    grads = call(bias)
    assert len(grads) == 3 and not zeroed
    validated = checks["check_qkv"]
    assert len(call(gpu.array(bias_shape, BF16))) == 3
    assert checks["check_qkv"] == validated, "a backward without dbias validated again"
    assert gpu.launches
    for launch_ in gpu.launches:
        ptrs = pointers_of(launch_[5])
        assert ptrs["dbias"] == ptrs["dbias_accum"] == 0
    with pytest.raises(ValueError, match="bias_grad=False"):
        call(bias, dbias=gpu.array(bias_shape, BF16))


@pytest.mark.parametrize("bias_shape,deterministic", [((1, 4, 33, 47), False), ((2, 1, 1, 47), False),
                                                       ((1, 4, 33, 47), True)])
def test_a_broadcast_bias_converts_its_sums_into_dbias(gpu, checks, monkeypatch, bias_shape, deterministic):
    """A broadcast bf16 bias: the dK/dV kernel adds into a zeroed fp32 accumulator of the bias's shape (dbias
    pointer 0), and the backward's last launch converts exactly those sums into the dbias it returns (its count,
    a grid that covers it in 8-element chunks, capped at 8 CTAs per SM); dbias= contiguous and 16-byte aligned
    is converted into. A repeated call hits the cache: no validation, the same launches (pointers aside), a
    fresh accumulator of its own (deterministic: with its ordered adds' counters after it, zeroed with it)."""
    from cuflash.kernels import dbias_convert

    q, k, v = qkv(gpu)
    zeroed = []
    def zeros(shape, dtype=float):
        shape = tuple(shape) if isinstance(shape, tuple) else (shape,)
        zeroed.append(shape)
        return gpu.array(shape, dtype)

    monkeypatch.setattr(cupy, "zeros", zeros)

    def call(**kwargs):
        out, lse = gpu.array((2, 33, 4, 64), BF16), gpu.array((2, 4, 33), np.float32)
        return cuflash.attention_backward(gpu.array((2, 33, 4, 64), BF16), q, k, v, out, lse,
                                          bias=gpu.array(bias_shape, BF16), deterministic=deterministic, **kwargs)

    elements = math.prod(bias_shape)
    for buffers in ((None, None), (gpu.array(bias_shape, BF16), gpu.array(bias_shape, BF16))):
        launches, accums, sizes = [], [], []
        for n, given in enumerate(buffers):
            before, validated = len(gpu.launches), checks["check_qkv"]
            grads = call(dbias=given)
            assert (checks["check_qkv"] == validated) == (n == 1), "the second call must hit the cache"
            sizes.append(zeroed.pop())
            assert not zeroed and sizes[-1] == sizes[0]
            assert sizes[-1] == bias_shape if not deterministic else sizes[-1][0] > elements
            mine = gpu.launches[before:]
            blocks = [pointers_of(l[5]) for l in mine[:-1]]  # every launch but the last gets the parameter block
            assert all(b["dbias"] == 0 and b["dbias_accum"] == blocks[0]["dbias_accum"] != 0 for b in blocks)
            accums.append(blocks[0]["dbias_accum"])
            convert = mine[-1]
            assert convert[5] == (accums[-1], grads[3].data.ptr, elements)
            assert given is None or grads[3] is given
            assert convert[1][0] * dbias_convert.THREADS * 8 >= elements
            assert convert[2] == (dbias_convert.THREADS, 1, 1)
            assert (convert[1][0] - 1) * dbias_convert.THREADS * 8 < elements  # no CTA without a chunk
            launches.append(mine)
        assert accums[0] != accums[1]
        assert [l[:5] for l in launches[0]] == [l[:5] for l in launches[1]]
        for a, b in zip(launches[0][:-1], launches[1][:-1]):
            assert _non_pointer_bytes(a[5]) == _non_pointer_bytes(b[5])
    # A large bias: the grid-stride loop on at most 8 CTAs per SM.
    assert dbias_convert.launch("float16", 16 * 2048 * 2048, 132).grid == (132 * dbias_convert.BLOCKS_PER_SM, 1, 1)
    with pytest.raises(ValueError, match="float16 / bfloat16"):
        dbias_convert.variant("float32")
