"""The deterministic backward's ordered dbias adds for a broadcast bias, on the CPU (fake_gpu: made-up addresses,
a recording cuLaunchKernel): which biases take them, the counters' allocation and the parameters the dK/dV kernels
read (cuda_src/cuflash/dbias_order.cuh), and the clear refusal of the forms the turns cannot order. The GPU tests
(test_options_gpu.py) check the sums against float64 and their bits across runs."""
import math

import numpy as np
import pytest

pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")

import cupy  # noqa: E402

import cuflash  # noqa: E402
from cuflash import api, launch  # noqa: E402

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
        fields, dbias_d, accum = api._dbias_buffers(opts, shape, None, qd.device, deterministic, False, plan)
    tile = next(l.variant.config for l in plan.launches if l.variant.name in api._DKDV_KERNELS)
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


@pytest.mark.parametrize("bias_shape,options,reason", [
    ((2, 1, 1, 90), {}, "query rows or the keys"),
    ((2, 4, 70, 1), {}, "query rows or the keys"),
    ((1, 4, 70, 90), dict(window=(20, 0)), "window"),
    ((1, 4, 70, 90), dict(segment_ids="ids"), "segment ids"),
])
def test_forms_the_turns_cannot_order_are_refused_by_name(gpu, bias_shape, options, reason):
    q, k, v = _problem(gpu)
    out, lse, dout = gpu.array((2, 70, 4, 64), BF16), gpu.array((2, 4, 70), np.float32), gpu.array((2, 70, 4, 64), BF16)
    if options.get("segment_ids") == "ids":
        options = dict(segment_ids=(gpu.array((2, 70), np.int32), gpu.array((2, 90), np.int32)))
    with pytest.raises(NotImplementedError, match=reason) as info:
        cuflash.attention_backward(dout, q, k, v, out, lse, bias=gpu.array(bias_shape, BF16), deterministic=True,
                                   **options)
    assert "deterministic=True" in str(info.value) and str(bias_shape) in str(info.value)
    assert not gpu.launches
