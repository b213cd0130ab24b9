"""The deterministic backward's ordered dbias adds for a broadcast bias, on the CPU (fake_gpu: made-up addresses,
a recording cuLaunchKernel): which biases take them, the counters' allocation and the parameters the dK/dV kernels
read (cuda_src/cuflash/dbias_order.cuh), and that every mask takes them. The GPU tests
(test_options_gpu.py) check the sums against float64 and their bits across runs."""
import math

import numpy as np
import pytest

pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")

import cupy  # noqa: E402

import cuflash  # noqa: E402
from cuflash import api, dbias, launch  # noqa: E402

from fake_gpu import install_fresh  # noqa: E402

BF16 = ml_dtypes.bfloat16


@pytest.fixture
def gpu(monkeypatch):
    gpu = install_fresh(monkeypatch)
    gpu.zeros = []  # the sizes of the zeroed allocations (the accumulator and its counters)

    def zeros(shape, dtype=float):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        gpu.zeros.append((shape, np.dtype(dtype)))
        return gpu.array(shape, dtype)

    monkeypatch.setattr(cupy, "zeros", zeros)
    return gpu


def _problem(gpu, b=2, sq=70, sk=90, h=4, hk=2, d=64):
    q = gpu.array((b, sq, h, d), BF16)
    k, v = gpu.array((b, sk, hk, d), BF16), gpu.array((b, sk, hk, d), BF16)
    return q, k, v


def _buffers(gpu, q, k, v, bias, *, causal=False, deterministic=True, **options):
    """_dbias_buffers as the backward calls it: the fields, the accumulator, and the plan's dK/dV tile."""
    import contextlib

    with contextlib.ExitStack() as stack:
        qd, kd, vd, shape, scale, opts, stream, switched = api._enter_call(
            stack, q, k, v, causal=causal, scale=None, stream=None, options=dict(bias=bias, **options))
        plan = launch.backward_plan(shape, qd.device, deterministic)
        fields, dbias_d, _, accum = api._dbias_buffers(opts, shape, None, qd.device, deterministic, False, plan)
    tile = next(l.variant.config for l in plan.launches if l.variant.name in dbias.DKDV_KERNELS)
    return dict(fields), accum, tile, shape


@pytest.mark.parametrize("bias_shape,causal", [((1, 4, 70, 90), False), ((2, 2, 70, 90), True),
                                                ((1, 1, 70, 90), True), ((2, 1, 70, 90), False)])
def test_ordered_adds_get_counters_after_the_accumulator(gpu, bias_shape, causal):
    q, k, v = _problem(gpu)
    bias = gpu.array(bias_shape, BF16)
    fields, accum, tile, shape = _buffers(gpu, q, k, v, bias, causal=causal)
    elements = math.prod(bias_shape)
    q_blocks, k_blocks = -(-70 // tile.block_m), -(-90 // tile.block_n)
    assert fields["dbias_order_offset"] == elements
    assert (fields["dbias_order_qblocks"], fields["dbias_order_kblocks"]) == (q_blocks, k_blocks)
    # One zeroed allocation holds the accumulator and a counter per (bias slice, query block, key block).
    assert gpu.zeros == [((elements + bias_shape[0] * bias_shape[1] * q_blocks * k_blocks,), np.dtype(np.float32))]
    assert accum.shape == bias_shape and fields["dbias_accum"] == accum.data.ptr
    # A broadcast dim has stride 0 (the kernels' rank and slice read the batch / head broadcast from it).
    assert (fields["dbias_batch_stride"] == 0) == (bias_shape[0] == 1)
    assert (fields["dbias_head_stride"] == 0) == (bias_shape[1] == 1)


def test_the_default_backward_keeps_its_atomics(gpu):
    q, k, v = _problem(gpu)
    fields, accum, _, _ = _buffers(gpu, q, k, v, gpu.array((1, 4, 70, 90), BF16), deterministic=False)
    assert "dbias_order_offset" not in fields and accum.shape == (1, 4, 70, 90)
    assert gpu.zeros == [((1, 4, 70, 90), np.dtype(np.float32))]


def test_a_full_bias_needs_no_order(gpu):
    q, k, v = _problem(gpu)
    fields, accum, _, _ = _buffers(gpu, q, k, v, gpu.array((2, 4, 70, 90), BF16))
    assert accum is None and "dbias_order_offset" not in fields and fields["dbias"] != 0


@pytest.mark.parametrize("bias_shape,options", [((2, 1, 1, 90), {}), ((1, 2, 1, 90), dict(window=(20, 0))),
                                                 ((1, 1, 1, 90), dict(segment_ids="ids"))])
def test_a_key_bias_sums_in_per_thread_partials(gpu, bias_shape, options):
    """deterministic=True with a key bias (one row, every key), under any mask: zeroed fp32 partials (B, H, slots,
    Sk) per query head, a slot per warp that shares a key in a step (the D64 mma.sync tile: 2), whose strides the
    kernels read (bias.cuh add_grad_over_queries); no turns, no counters."""
    q, k, v = _problem(gpu)
    if options.get("segment_ids") == "ids":
        options = dict(segment_ids=(gpu.array((2, 70), np.int32), gpu.array((2, 90), np.int32)))
    fields, partials, _, _ = _buffers(gpu, q, k, v, gpu.array(bias_shape, BF16), **options)
    slots = partials.shape[2]
    assert gpu.zeros == [((2, 4, slots, 90), np.dtype(np.float32))] and slots in (1, 2)
    assert partials.shape == (2, 4, slots, 90) and fields["dbias_accum"] == partials.data.ptr
    # per query head h: (h // div) * the head stride + (h % div) * the query-head stride, div = 4 / bias heads
    div = 4 // bias_shape[1] if bias_shape[1] > 1 else 1
    assert (fields["dbias_batch_stride"], fields["dbias_head_stride"], fields["dbias_qhead_stride"],
            fields["dbias_slot_stride"]) == (4 * slots * 90, div * slots * 90, slots * 90, 90)
    assert (fields["dbias_row_stride"], fields["dbias_col_stride"]) == (0, 1) and "dbias_order_offset" not in fields


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("bias_shape", [(2, 4, 70, 1), (1, 2, 1, 1)])
def test_a_bias_constant_along_the_keys_takes_no_kernel_adds(gpu, bias_shape, deterministic):
    """A bias constant along the keys gets dbias from dlse (dbias.py): the kernels get no dbias pointer."""
    q, k, v = _problem(gpu)
    fields, accum, _, _ = _buffers(gpu, q, k, v, gpu.array(bias_shape, BF16), deterministic=deterministic,
                                   window=(20, 0))
    assert fields == {} and accum is None and gpu.zeros == []


def test_the_partials_sum_over_slots_and_broadcast_dims_in_the_bias_head_order():
    """_sum_key_slots on the host's numbers (NumPy standing in for CuPy): query head h adds into bias head
    h // (H / Hb), the batch sums where the bias has one row."""
    rng = np.random.default_rng(0)
    partials = rng.standard_normal((3, 6, dbias.SIMT_SLOTS, 5)).astype(np.float32)
    per_head = partials.astype(np.float64).sum(axis=2)
    for bias_shape in ((3, 6, 1, 5), (3, 2, 1, 5), (1, 3, 1, 5), (1, 1, 1, 5)):
        want = np.zeros(bias_shape)
        for b in range(3):
            for h in range(6):
                want[b % bias_shape[0], h // (6 // bias_shape[1]), 0] += per_head[b, h]
        got = dbias._sum_key_slots(partials, bias_shape, xp=np)
        assert got.shape == bias_shape and np.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_row_sums_come_from_dlse_where_the_row_sees_a_key():
    rng = np.random.default_rng(1)
    lse = rng.standard_normal((2, 4, 7)).astype(np.float32)
    lse[1, 2, 3] = lse[0, 0, 6] = -np.inf
    dlse = rng.standard_normal((2, 4, 7)).astype(np.float32)
    seen = np.where(np.isneginf(lse), 0.0, dlse.astype(np.float64))
    by_pairs = seen.reshape(2, 2, 2, 7).sum((0, 2))[None, ..., None]  # heads 0-1 -> bias head 0, 2-3 -> 1
    for bias_shape, want in (((2, 4, 7, 1), seen[..., None]), ((1, 2, 7, 1), by_pairs),
                             ((2, 1, 1, 1), seen.sum((1, 2))[:, None, None, None])):
        got = dbias._row_sums_from_lse(lse, dlse, bias_shape, xp=np)
        assert got.shape == bias_shape and np.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not dbias._row_sums_from_lse(lse, None, (2, 4, 7, 1), xp=np).any()


@pytest.mark.parametrize("bias_shape,options", [
    ((1, 4, 70, 90), dict(window=(20, 0))),
    ((1, 4, 70, 90), dict(segment_ids="ids")),
    ((1, 1, 70, 90), dict(block_ids="ids", dropout_p=0.2, seed=3)),
    ((2, 1, 70, 90), dict(mask="mask", window=(20, 0))),
])
def test_every_mask_takes_the_turns(gpu, bias_shape, options):
    """A window or dropout give every batch row and head the same tiles; under ids or a bool mask the dK / dV
    lists are the union over a slice's contributors (block_lists.cu): a bias broadcast over the batch and / or
    the heads takes the turns under each (counters after the accumulator), as without a mask."""
    q, k, v = _problem(gpu)
    for name in ("segment_ids", "block_ids"):
        if options.get(name) == "ids":
            options = dict(options, **{name: (gpu.array((2, 70), np.int32), gpu.array((2, 90), np.int32))})
    if options.get("mask") == "mask":
        options = dict(options, mask=gpu.array((2, 4, 70, 90), np.bool_))
    fields, accum, _, _ = _buffers(gpu, q, k, v, gpu.array(bias_shape, BF16), **options)
    assert fields["dbias_order_offset"] == math.prod(bias_shape) and accum.shape == bias_shape

