"""Packed (varlen) calls on the CPU: the offsets' checks, the refused options, and what a packed call
launches (fake_gpu: made-up addresses, a recording cuLaunchKernel).

The parameter block of a packed call must address the packed rows the way cuda_src/cuflash/seqlen.cuh
reads them: each tensor's batch stride equal to its row stride, lse / dlse (H, Tq) with batch stride 1,
the offsets' pointers and the packed row counts set, the grid over the longest sequence; and the plan must
end with the launch that defines the rows no sequence covers.
"""
import numpy as np
import pytest

pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")

import cuflash  # noqa: E402
from cuflash import api, kernels, varlen  # noqa: E402
from cuflash.params import params_dtype  # noqa: E402

from fake_gpu import FakeGPU, install_fresh  # noqa: E402,F401

BF16 = ml_dtypes.bfloat16


@pytest.fixture
def gpu(monkeypatch):
    return install_fresh(monkeypatch)


def packed(gpu, tq=50, tk=70, h=4, hk=2, d=64, dtype=BF16, batch=3):
    q, k, v = gpu.array((tq, h, d), dtype), gpu.array((tk, hk, d), dtype), gpu.array((tk, hk, d), dtype)
    cu_q, cu_k = gpu.array((batch + 1,), np.int32), gpu.array((batch + 1,), np.int32)
    return q, k, v, cu_q, cu_k


def record(block: bytes):
    return np.frombuffer(block, dtype=params_dtype())[0]


# ------------------------------------------------------------------------------------------------
# Offsets given as host data: every rule


@pytest.mark.parametrize("values,match", [
    ([0, 5, 3, 9], "non-decreasing"),
    ([-1, 5, 9], "start at 0"),
    ([0, 5, 11], "past q's 10 packed rows"),
    ([0], "batch \\+ 1 >= 2"),
    ([[0, 1], [1, 2]], "1-D"),
])
def test_bad_host_offsets_are_refused_naming_the_argument(values, match):
    with pytest.raises(ValueError, match=match):
        varlen.check_offsets(values, "cu_seqlens_q", 10, None, "q")


def test_host_offsets_longer_than_max_seqlen_are_refused():
    with pytest.raises(ValueError, match="cu_seqlens_k has a sequence of 7 tokens, more than max_seqlen_k = 6"):
        varlen.check_offsets([0, 2, 9], "cu_seqlens_k", 9, 6, "k")
    with pytest.raises(TypeError, match="integers"):
        varlen.check_offsets(np.array([0.0, 2.0]), "cu_seqlens_q", 9, None, "q")
    assert varlen.check_offsets([0, 0, 4, 4, 9], "cu_seqlens_q", 12, None, "q") == 5


@pytest.mark.parametrize("value,error", [(-1, ValueError), (True, TypeError), (3.0, TypeError)])
def test_bad_max_seqlen_is_refused(gpu, value, error):
    q, k, v, cu_q, cu_k = packed(gpu)
    with pytest.raises(error, match="max_seqlen_q"):
        cuflash.varlen_attention(q, k, v, cu_q, cu_k, value, 10)


# ------------------------------------------------------------------------------------------------
# Arrays and options


@pytest.mark.parametrize("option", varlen.UNSUPPORTED_OPTIONS)
def test_batch_indexed_options_are_refused(gpu, option):
    q, k, v, cu_q, cu_k = packed(gpu)
    with pytest.raises(ValueError, match=f"{option} is not supported with packed"):
        cuflash.varlen_attention(q, k, v, cu_q, cu_k, 20, 20, **{option: object()})


def test_wrong_layouts_and_offsets_are_refused(gpu):
    q, k, v, cu_q, cu_k = packed(gpu)
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        cuflash.varlen_attention(q[None], k, v, cu_q, cu_k, 20, 20)
    with pytest.raises(TypeError, match="cu_seqlens_k must have dtype int32"):
        cuflash.varlen_attention(q, k, v, cu_q, gpu.array((4,), np.int64), 20, 20)
    with pytest.raises(ValueError, match="cu_seqlens_q has 3 sequences but cu_seqlens_k has 4"):
        cuflash.varlen_attention(q, k, v, cu_q, gpu.array((5,), np.int32), 20, 20)
    with pytest.raises(ValueError, match="k has 3 heads, which does not divide"):
        cuflash.varlen_attention(q, gpu.array((70, 3, 64), BF16), gpu.array((70, 3, 64), BF16), cu_q, cu_k, 20, 20)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32 array"):
        cuflash.varlen_attention(q, k, v, None, cu_k, 20, 20)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        cuflash.varlen_attention(q, k, v, cu_q, cu_k, 20, 20, dropout_p=1.5, seed=1)


# ------------------------------------------------------------------------------------------------
# What a packed call launches


def test_packed_forward_addresses_packed_rows(gpu):
    q, k, v, cu_q, cu_k = packed(gpu, tq=50, tk=70, h=4, hk=2, d=64)
    out, lse = cuflash.varlen_attention_forward(q, k, v, cu_q, cu_k, 30, 41, causal=True)
    assert out.shape == (50, 4, 64) and lse.shape == (4, 50)
    (lists, fwd, tails) = gpu.launches  # packed calls run the general mask: its block lists first
    p = record(fwd[5])
    # ceil(30 / 128) query blocks of the longest sequence, H, B: as a grid, or on the fake GPU's sm_90 (384 threads:
    # the warp-specialized kernel) as that many tiles of a one-dimensional grid
    assert fwd[1] == ((12, 1, 1) if fwd[2] == (384, 1, 1) else (1, 4, 3))
    assert lists[1] == (1, 1, 3) and p["window_right"] == 0 and p["window_left"] == 1 << 30  # causal at run time
    assert tails[1] == (kernels.varlen_tails.GRID, 1, 1)
    assert record(tails[5]).tobytes() == p.tobytes()  # the same block: the tails kernel reads the offsets too
    # the grid's rows: the longest rounded up to varlen.LENGTH_GRANULE, at most the packed total
    assert (p["seqlen_q"], p["seqlen_k"], p["batch"], p["total_q"], p["total_k"]) == (50, 70, 3, 50, 70)
    assert p["cu_seqlens_q"] == cu_q.data.ptr and p["cu_seqlens_k"] == cu_k.data.ptr
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        assert p[f"{name}_batch_stride"] == p[f"{name}_row_stride"] == t.strides[0] // t.itemsize
        assert p[f"{name}_head_stride"] == t.strides[1] // t.itemsize
    assert (p["lse_batch_stride"], p["lse_head_stride"]) == (1, 50)


def test_packed_backward_scratch_drops_the_batch_dim(gpu):
    q, k, v, cu_q, cu_k = packed(gpu, tq=50, tk=70, h=8, hk=2, d=128)
    shapes = cuflash.varlen_backward_workspace(q, k, v, cu_q, cu_k, 30, 41, causal=False)
    assert shapes["softmax_d"] == shapes["lse_log2"] == (8, 50)
    # a row per (head, packed token), then one whole dK/dV query block of slack (backward.dq_accum_shape)
    assert shapes["dq_accum"] == (8 * 50 + 128, 128)
    for name in ("dk_accum", "dv_accum"):  # per-slot partials, when the plan keeps some
        if name in shapes:
            assert shapes[name][1:] == (70, 128)
    out, lse = gpu.array((50, 8, 128), BF16), gpu.array((8, 50), np.float32)
    gpu.launches.clear()
    grads = cuflash.varlen_attention_backward(out, q, k, v, out, lse, cu_q, cu_k, 30, 41)
    assert [g.shape for g in grads] == [(50, 8, 128), (70, 2, 128), (70, 2, 128)]
    last = gpu.launches[-1]
    assert last[1] == (kernels.varlen_tails.GRID, 1, 1)
    p = record(last[5])
    assert (p["dlse_batch_stride"], p["total_q"], p["total_k"]) == (0, 50, 70)  # no dlse given


# ------------------------------------------------------------------------------------------------
# Repeated packed calls: cached like batched ones (offsets on the GPU, both longest lengths given)


@pytest.fixture
def packed_checks(monkeypatch):
    """Counts the validating path's checks of the packed arguments."""
    count = [0]
    original = varlen.PackedSequences.check

    def counting(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(varlen.PackedSequences, "check", counting)
    return count


def _packed_call(gpu, entry, arrays, **options):
    q, k, v, cu_q, cu_k = arrays
    if entry == "forward":
        return cuflash.varlen_attention_forward(q, k, v, cu_q, cu_k, 30, 41, causal=True, **options)
    out, lse = gpu.array((50, 4, 64), BF16), gpu.array((4, 50), np.float32)
    return cuflash.varlen_attention_backward(gpu.array((50, 4, 64), BF16), q, k, v, out, lse, cu_q, cu_k, 30, 41,
                                             causal=True, **options)


@pytest.mark.parametrize("options", [{}, {"window": (7, None), "softcap": 5.0, "alibi": True}],
                         ids=["causal", "window-softcap-alibi"])
@pytest.mark.parametrize("entry", ["forward", "backward"])
def test_repeated_packed_calls_skip_validation_and_patch_every_pointer(gpu, packed_checks, entry, options):
    """The second call with the same key (other memory, offsets included) is not validated again: every kernel
    launches as the first call's did, with the new arrays' pointers, the new offsets and freshly carved block
    lists; a call that changes what a check reads (a longest length, an option) is validated again."""
    from fake_gpu import pointers_of

    def opts():
        made = {n: v for n, v in options.items() if n != "alibi"}
        if options.get("alibi"):
            made["alibi_slopes"] = gpu.array((4,), np.float32)
        return made

    first_arrays, first_opts = packed(gpu), opts()
    _packed_call(gpu, entry, first_arrays, **first_opts)
    first = list(gpu.launches)
    assert packed_checks[0] == 1
    arrays, again_opts = packed(gpu), opts()  # the same key, other memory
    _packed_call(gpu, entry, arrays, **again_opts)
    assert packed_checks[0] == 1, "a cache hit validated again"
    second = gpu.launches[len(first):]
    assert [l[:5] for l in second] == [l[:5] for l in first]
    names = params_dtype().names
    for a, b in zip(first, second):
        ra, rb = record(a[5]), record(b[5])
        assert [n for n in names if ra[n] != rb[n]] and all(
            ra[n] == rb[n] for n in names if n not in launch_pointer_fields()), "only pointers differ"
    ptrs = pointers_of(second[-1][5])
    q, k, v, cu_q, cu_k = arrays
    assert (ptrs["q"], ptrs["k"], ptrs["v"]) == (q.data.ptr, k.data.ptr, v.data.ptr)
    assert (ptrs["cu_seqlens_q"], ptrs["cu_seqlens_k"]) == (cu_q.data.ptr, cu_k.data.ptr)
    if "alibi_slopes" in again_opts:
        assert ptrs["alibi_slopes"] == again_opts["alibi_slopes"].data.ptr
    lists = "kv_blocks" if entry == "forward" else "q_blocks"
    assert ptrs[lists] not in (0, pointers_of(first[-1][5])[lists])  # carved for this call
    for launch_ in second:  # every kernel of the call reads the same block
        assert pointers_of(launch_[5])["cu_seqlens_q"] == cu_q.data.ptr

    # What a check reads misses the cache: a longest length in another granule, another option.
    q, k, v, cu_q, cu_k = arrays
    if entry == "forward":
        cuflash.varlen_attention_forward(q, k, v, cu_q, cu_k, 30 + varlen.LENGTH_GRANULE, 41, causal=True,
                                         **again_opts)
    else:
        _packed_call(gpu, entry, arrays, **dict(again_opts, softcap=6.0))
    assert packed_checks[0] == 2
    with pytest.raises(ValueError, match="max_seqlen_q must be >= 0"):
        cuflash.varlen_attention_forward(q, k, v, cu_q, cu_k, -1, 41, causal=True, **again_opts)


def launch_pointer_fields():
    from cuflash import launch

    return launch.POINTER_FIELDS


def test_packed_calls_without_longest_lengths_or_with_host_offsets_are_validated_every_call(gpu, packed_checks,
                                                                                          monkeypatch):
    import cupy

    q, k, v, _, _ = packed(gpu, tq=10, tk=12, batch=2)
    monkeypatch.setattr(cupy, "asarray", lambda host: gpu.array(np.shape(host), np.int32))

    class NoDeviceSwitch:  # the host offsets' copy enters a device scope a machine without a GPU lacks
        def __init__(self, device):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(cupy.cuda, "Device", NoDeviceSwitch)
    for _ in range(2):
        cuflash.varlen_attention_forward(q, k, v, np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32),
                                         8, 8, causal=True)
    assert packed_checks[0] == 2
    with pytest.raises(ValueError, match="non-decreasing"):
        cuflash.varlen_attention_forward(q, k, v, np.array([0, 6, 4], np.int32), np.array([0, 5, 12], np.int32),
                                         8, 8, causal=True)


def test_longest_lengths_in_one_granule_share_a_plan(gpu, packed_checks):
    """Packed training passes each batch's longest lengths: those that round up to the same multiple of
    varlen.LENGTH_GRANULE (the grid's rows) hit one cached plan; the next multiple is a new plan."""
    q, k, v, cu_q, cu_k = packed(gpu, tq=1000, tk=1000)
    g = varlen.LENGTH_GRANULE
    for longest in (2 * g + 1, 3 * g, 2 * g + 77):
        cuflash.varlen_attention_forward(q, k, v, cu_q, cu_k, longest, longest, causal=True)
    assert packed_checks[0] == 1
    p = record(gpu.launches[-1][5]) if gpu.launches[-1][1] != (kernels.varlen_tails.GRID, 1, 1) else \
        record(gpu.launches[-2][5])
    assert (p["seqlen_q"], p["seqlen_k"]) == (3 * g, 3 * g)
    cuflash.varlen_attention_forward(q, k, v, cu_q, cu_k, 3 * g + 1, 3 * g, causal=True)
    assert packed_checks[0] == 2
    assert cuflash.varlen_backward_workspace(q, k, v, cu_q, cu_k, 2 * g + 1, 2 * g + 1) == \
        cuflash.varlen_backward_workspace(q, k, v, cu_q, cu_k, 3 * g, 3 * g)
