"""Every validation rule of docs/api.md's "Errors" section, on the CPU: each misuse raises a clear error
that names the argument. (tests/test_extremes_gpu.py repeats the table through the public API on a GPU.)"""
import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash import validation
from cuflash.arrays import TensorDesc, resolve_stream
from cuflash.kernels import MOD_BIAS, MOD_BIAS_SOFTCAP, ProblemShape

pytest.importorskip("cupy")


def desc(name, shape, dtype="bfloat16", *, strides=None, ptr=1 << 20, device=0):
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4}[dtype]
    if strides is None:
        strides, acc = [], 1
        for size in reversed(shape):
            strides.append(acc)
            acc *= size
        strides = tuple(reversed(strides))
    return TensorDesc(name, tuple(shape), tuple(strides), dtype, itemsize, ptr, device)


def qkv(b=2, sq=17, sk=33, h=8, hk=2, d=64, dv=None, dtype="bfloat16"):
    return (desc("q", (b, sq, h, d), dtype), desc("k", (b, sk, hk, d), dtype),
            desc("v", (b, sk, hk, dv or d), dtype))


def test_valid_inputs_give_the_problem_shape():
    shape = validation.check_qkv(*qkv(dv=128), causal=True)
    assert (shape.batch, shape.seqlen_q, shape.seqlen_k, shape.num_heads, shape.num_heads_k) == (2, 17, 33, 8, 2)
    assert (shape.head_dim, shape.head_dim_v, shape.dtype, shape.causal) == (64, 128, "bfloat16", True)
    assert shape.head_dim_bucket == 128


def test_bhsd_view_passed_as_bshd_is_accepted():
    b, h, s, d = 2, 4, 10, 64
    # strides of a (B, H, S, D) contiguous array, viewed as (B, S, H, D)
    q = desc("q", (b, s, h, d), strides=(h * s * d, d, s * d, 1))
    k = desc("k", (b, s, h, d), strides=(h * s * d, d, s * d, 1))
    validation.check_qkv(q, k, k, causal=False)


def _replace(t, **changes):
    import dataclasses

    return dataclasses.replace(t, **changes)


BAD_QKV = [
    ("wrong ndim", lambda q, k, v: (desc("q", (2, 17, 64)), k, v), ValueError, "q must have 4 dimensions"),
    ("unsupported dtype", lambda q, k, v: (desc("q", q.shape, "float64"), k, v), TypeError, "q has dtype float64"),
    ("mixed dtypes", lambda q, k, v: (q, desc("k", k.shape, "float16"), v), TypeError, "k has dtype float16 but q has bfloat16"),
    ("two devices", lambda q, k, v: (q, k, _replace(v, device=1)), ValueError, "v is on CUDA device 1"),
    ("batch mismatch", lambda q, k, v: (q, desc("k", (3, 33, 2, 64)), v), ValueError, "batch sizes differ"),
    ("k/v length mismatch", lambda q, k, v: (q, k, desc("v", (2, 34, 2, 64))), ValueError, "v has 34 keys but k has 33"),
    ("k/v heads mismatch", lambda q, k, v: (q, k, desc("v", (2, 33, 4, 64))), ValueError, "v has 4 heads but k has 2"),
    ("q/k head dim mismatch", lambda q, k, v: (q, desc("k", (2, 33, 2, 72)), v), ValueError, "k has head dim 72 but q has 64"),
    ("H not divisible by Hkv", lambda q, k, v: (q, desc("k", (2, 33, 3, 64)), desc("v", (2, 33, 3, 64))),
     ValueError, "k has 3 heads, which does not divide q's 8 heads"),
    ("head dim not multiple of 8", lambda q, k, v: (desc("q", (2, 17, 8, 12)), desc("k", (2, 33, 2, 12)), desc("v", (2, 33, 2, 12))),
     ValueError, "q has head dim 12"),
    ("head dim too large", lambda q, k, v: (desc("q", (2, 17, 8, 264)), desc("k", (2, 33, 2, 264)), desc("v", (2, 33, 2, 264))),
     ValueError, "q has head dim 264"),
    ("Dv unsupported", lambda q, k, v: (q, k, desc("v", (2, 33, 2, 20))), ValueError, r"v has head dim \(Dv\) 20"),
    ("non-contiguous last dim", lambda q, k, v: (_replace(q, strides=(17 * 8 * 128, 8 * 128, 128, 2)), k, v),
     ValueError, "q must be contiguous in its last dimension"),
    ("misaligned base pointer", lambda q, k, v: (q, _replace(k, ptr=(1 << 20) + 2), v), ValueError,
     "k's base pointer is not 16-byte aligned"),
    ("misaligned row stride", lambda q, k, v: (desc("q", (2, 17, 1, 64), strides=(17 * 72, 68, 64, 1)),
                                               desc("k", (2, 33, 1, 64)), desc("v", (2, 33, 1, 64))),
     ValueError, "q's stride along axis 1"),
    ("negative stride", lambda q, k, v: (q, k, _replace(v, strides=(v.strides[0], -v.strides[1], v.strides[2], 1))),
     ValueError, "v has negative strides"),
    ("too many heads for the grid", lambda q, k, v: (desc("q", (1, 4, 70000, 64)), desc("k", (1, 4, 1, 64)), desc("v", (1, 4, 1, 64))),
     ValueError, "at most 65535"),
]


@pytest.mark.parametrize("case,mutate,error,message", BAD_QKV, ids=[c[0] for c in BAD_QKV])
def test_bad_qkv_raise_naming_the_argument(case, mutate, error, message):
    with pytest.raises(error, match=message):
        validation.check_qkv(*mutate(*qkv()), causal=False)


@pytest.mark.parametrize("scale,error,message", [
    (float("nan"), ValueError, "scale must be finite"),
    (float("inf"), ValueError, "scale must be finite"),
    ("0.1", None, None),
    ([1.0], TypeError, "scale must be a number"),
])
def test_scale(scale, error, message):
    if error is None:
        assert validation.check_scale(scale, 64) == pytest.approx(0.1)
    else:
        with pytest.raises(error, match=message):
            validation.check_scale(scale, 64)
    assert validation.check_scale(None, 64) == pytest.approx(0.125)


BAD_BUFFERS = [
    ("out wrong shape", desc("out", (2, 17, 8, 32)), (2, 17, 8, 64), "bfloat16", False, ValueError, r"out must have shape \(2, 17, 8, 64\)"),
    ("out wrong dtype", desc("out", (2, 17, 8, 64), "float32"), (2, 17, 8, 64), "bfloat16", False, TypeError, "out must have dtype bfloat16"),
    ("out other device", _replace(desc("out", (2, 17, 8, 64)), device=1), (2, 17, 8, 64), "bfloat16", False, ValueError, "out is on CUDA device 1"),
    ("out misaligned", _replace(desc("out", (2, 17, 8, 64)), ptr=(1 << 20) + 8), (2, 17, 8, 64), "bfloat16", False, ValueError, "out's base pointer"),
    ("lse wrong shape", desc("lse", (2, 17, 8), "float32"), (2, 8, 17), "float32", True, ValueError, r"lse must have shape \(2, 8, 17\)"),
    ("lse wrong dtype", desc("lse", (2, 8, 17), "bfloat16"), (2, 8, 17), "float32", True, TypeError, "lse must have dtype float32"),
    ("lse rows strided", desc("lse", (2, 8, 17), "float32", strides=(8 * 34, 34, 2)), (2, 8, 17), "float32", True, ValueError, "lse must be contiguous in its last"),
    ("dout wrong shape", desc("dout", (2, 17, 8, 72)), (2, 17, 8, 64), "bfloat16", False, ValueError, "dout must have shape"),
    ("dlse wrong dtype", desc("dlse", (2, 8, 17), "float16"), (2, 8, 17), "float32", True, TypeError, "dlse must have dtype float32"),
]


@pytest.mark.parametrize("case,buffer,shape,dtype,rows_only,error,message", BAD_BUFFERS, ids=[c[0] for c in BAD_BUFFERS])
def test_bad_buffers_raise_naming_the_argument(case, buffer, shape, dtype, rows_only, error, message):
    with pytest.raises(error, match=message):
        validation.check_buffer(buffer, shape, dtype, 0, rows_contiguous_only=rows_only)


def test_unknown_options_are_refused_by_name():
    with pytest.raises(TypeError, match="unexpected keyword argument.*dropout_rate"):
        validation.reject_planned({"dropout_rate": 0.1})
    validation.reject_planned({"window": (None, None), "dropout_p": 0.1, "seed": 3, "softcap": None, "bias": None})


@pytest.mark.parametrize("dropout_p,seed,error,match", [
    (1.0, 3, ValueError, "dropout_p must be in \\[0, 1\\)"),
    (-0.1, 3, ValueError, "dropout_p must be in"),
    (True, 3, TypeError, "dropout_p must be a float"),
    ("0.1", 3, TypeError, "dropout_p must be a float"),
    (0.1, None, ValueError, "seed= is required with dropout_p > 0"),
    (0.1, -1, ValueError, "seed must be in \\[0, 2\\*\\*64\\)"),
    (0.1, 2 ** 64, ValueError, "seed must be in"),
    (0.1, 1.5, TypeError, "seed must be an int or an 8-byte array"),
])
def test_bad_dropout_options_are_refused_by_name(dropout_p, seed, error, match):
    shape = validation.check_qkv(*qkv(), causal=False)
    with pytest.raises(error, match=match):
        validation.check_score_options(shape, {"dropout_p": dropout_p, "seed": seed}, _describe_spec, 0)


def test_seed_arrays_must_hold_eight_bytes_on_q_device():
    shape = validation.check_qkv(*qkv(), causal=False)
    _, opts = validation.check_score_options(shape, {"dropout_p": 0.5, "seed": ((2,), "uint32")}, _describe_spec, 0)
    assert opts.params(False)["dropout_seed_ptr"] == 256 and opts.seed is None
    with pytest.raises(ValueError, match="seed as an array must hold 8 bytes"):
        validation.check_score_options(shape, {"dropout_p": 0.5, "seed": ((3,), "int32")}, _describe_spec, 0)
    with pytest.raises(ValueError, match="seed is on CUDA device 1"):
        validation.check_score_options(shape, {"dropout_p": 0.5, "seed": ((2,), "int32", None, 256, 1)},
                                       _describe_spec, 0)


def test_dropout_sets_the_dropout_kernels_and_their_fields():
    shape = validation.check_qkv(*qkv(), causal=True)
    shape, opts = validation.check_score_options(shape, {"dropout_p": 0.25, "seed": 2 ** 64 - 1}, _describe_spec, 0)
    assert shape.dropout and shape.general_mask and shape.mask_kind == 4
    fields = opts.params(True)
    assert fields["dropout_threshold"] == 2 ** 30 and fields["dropout_rp"] == pytest.approx(4 / 3)
    assert fields["dropout_seed"] == -1  # the 64 seed bits as the int64 field holds them
    assert fields["window_right"] == 0  # causal runs as the general mask's runtime window
    shape0, opts0 = validation.check_score_options(validation.check_qkv(*qkv(), causal=False),
                                                   {"dropout_p": 0.0, "seed": None}, _describe_spec, 0)
    assert not shape0.dropout and opts0.params(False) == {}


# --- score options (window, softcap, alibi_slopes, segment_ids, block_ids) ------------------------------

_SHAPE = ProblemShape(2, 33, 47, 4, 2, 64, 64, "bfloat16", False)


def _opt_desc(shape, dtype, name, strides=None, ptr=256, device=0):
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    itemsize = 4
    return TensorDesc(name, tuple(shape), tuple(strides), dtype, itemsize, ptr, device)


def _describe_spec(x, name):
    """Test stand-in for arrays.describe: options are given as (shape, dtype[, strides, ptr, device])."""
    return _opt_desc(x[0], x[1], name, *x[2:])


def _check_options(**options):
    return validation.check_score_options(_SHAPE, options, _describe_spec, 0)


def test_score_options_select_the_variants_and_fold_causal():
    shape, opts = _check_options(window=(16, None))
    assert shape.general_mask and not shape.score_mod and shape.mask_kind == 2
    params = opts.params(causal=True)
    assert params["window_left"] == 16 and params["window_right"] == 0
    assert opts.params(causal=False)["window_right"] == validation.UNBOUNDED_WINDOW
    shape, opts = _check_options(softcap=30.0, alibi_slopes=((4,), "float32"))
    assert shape.score_mod and not shape.general_mask and opts.params(False)["alibi_batch_stride"] == 0
    shape, opts = _check_options(alibi_slopes=((2, 4), "float32"), segment_ids=(((2, 33), "int32"), ((2, 47), "int32")))
    assert shape.score_mod and shape.general_mask
    assert opts.params(False)["alibi_batch_stride"] == 4 and opts.params(False)["k_segment_batch_stride"] == 47
    shape, opts = _check_options(window=(None, None), softcap=None)
    assert shape == _SHAPE and opts.params(False) == {}


def test_bias_selects_the_bias_variant_and_maps_its_broadcast_dims():
    shape, opts = _check_options(bias=((2, 4, 33, 47), "bfloat16"))
    assert shape.score_mod == MOD_BIAS and not shape.general_mask and opts.bias_is_full(shape)
    params = opts.params(False)
    assert (params["bias_batch_stride"], params["bias_head_stride"], params["bias_row_stride"],
            params["bias_col_stride"], params["bias_head_div"]) == (4 * 33 * 47, 33 * 47, 47, 1, 1)
    # Hkv heads (2 of 4: two query heads per bias head), broadcast over the batch and the rows
    shape, opts = _check_options(bias=((1, 2, 1, 47), "bfloat16"), softcap=5.0)
    assert shape.score_mod == MOD_BIAS_SOFTCAP and not opts.bias_is_full(shape)
    params = opts.params(False)
    assert (params["bias_batch_stride"], params["bias_head_stride"], params["bias_row_stride"],
            params["bias_col_stride"], params["bias_head_div"]) == (0, 47, 0, 1, 2)
    # a bool mask per kv head: the general mask, block lists per mask head
    shape, opts = _check_options(mask=((2, 2, 33, 47), "bool"))
    assert shape.general_mask and shape.mask_heads == 2 and shape.mask_kind == 3
    params = opts.params(False)
    assert (params["mask_heads"], params["mask_head_div"], params["mask_head_stride"], params["mask_col_stride"]) == (
        2, 2, 33 * 47, 1)
    # broadcast over the keys by a stride of 0 (an expanded view), and a single head
    _, opts = _check_options(bias=((2, 1, 33, 47), "bfloat16", (33, 33, 1, 0)))
    params = opts.params(False)
    assert (params["bias_head_stride"], params["bias_row_stride"], params["bias_col_stride"]) == (0, 1, 0)


@pytest.mark.parametrize("keys,staged", [(47, 0), (48, 1)])
def test_a_key_bias_is_staged_only_in_whole_16_byte_chunks(keys, staged):
    """The tensor-core kernels copy a staged bias (params.bias_staged) in 16-byte chunks of keys, so its rows must
    end at a chunk's end: a key bias (one row, row stride 0) of 47 bf16 keys would read past it (memcheck,
    session 41); it is read element by element instead."""
    shape = dataclasses.replace(_SHAPE, seqlen_k=keys)
    spec = lambda x, name: TensorDesc(name, (1, 1, 1, keys), (keys, keys, keys, 1), "bfloat16", 2, 256, 0)
    _, opts = validation.check_score_options(shape, {"bias": "the bias"}, spec, 0)
    assert opts.params(False)["bias_staged"] == staged


@pytest.mark.parametrize("options,error,message", [
    ({"window": 3}, TypeError, "window must be a pair"),
    ({"window": (1, 2, 3)}, TypeError, "window must be a pair"),
    ({"window": (-1, 0)}, ValueError, "window left must be >= 0"),
    ({"window": (0, 1.5)}, TypeError, "window right must be an int"),
    ({"window": (True, 0)}, TypeError, "window left must be an int"),
    ({"softcap": -1.0}, ValueError, "softcap must be a finite number > 0"),
    ({"softcap": float("inf")}, ValueError, "softcap must be a finite number"),
    ({"softcap": "30"}, TypeError, "softcap must be a number"),
    ({"alibi_slopes": ((3,), "float32")}, ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
    ({"alibi_slopes": ((4,), "float16")}, TypeError, "alibi_slopes must have dtype float32"),
    ({"alibi_slopes": ((2, 4), "float32", (1, 2))}, ValueError, "alibi_slopes must be contiguous in its last"),
    ({"alibi_slopes": ((4,), "float32", None, 256, 1)}, ValueError, "alibi_slopes is on CUDA device 1"),
    ({"segment_ids": 5}, TypeError, "segment_ids must be a pair"),
    ({"segment_ids": (((2, 33), "int64"), ((2, 47), "int32"))}, TypeError, r"segment_ids\[0\] \(q_ids\) must have dtype int32"),
    ({"segment_ids": (((2, 33), "int32"), ((2, 46), "int32"))}, ValueError, r"segment_ids\[1\] \(k_ids\) must have shape \(2, 47\)"),
    ({"block_ids": (((2, 47), "int32"), ((2, 47), "int32"))}, ValueError, r"block_ids\[0\] \(q_ids\) must have shape \(2, 33\)"),
    ({"block_ids": (((2, 33), "int32", None, 258), ((2, 47), "int32"))}, ValueError, "base pointer is not aligned"),
    ({"bias": ((4, 33, 47), "bfloat16")}, ValueError, "bias must have 4 dimensions"),
    ({"bias": ((2, 3, 33, 47), "bfloat16")}, ValueError, r"bias has 3 along axis 1 \(heads\)"),
    ({"bias": ((2, 4, 32, 47), "bfloat16")}, ValueError, r"bias has 32 along axis 2 \(seq_q\)"),
    ({"bias": ((2, 4, 33, 47), "float32")}, TypeError, "bias must have q's dtype bfloat16"),
    ({"bias": ((2, 4, 33, 47), "bfloat16", None, 256, 1)}, ValueError, "bias is on CUDA device 1"),
    ({"bias": ((2, 4, 33, 47), "bfloat16", (4 * 33 * 94, 33 * 94, 94, 2))}, ValueError, "bias must be contiguous"),
    ({"bias": ((2, 4, 33, 47), "bfloat16", (-1, 33 * 47, 47, 1))}, ValueError, "bias has negative strides"),
    ({"bias": ((2, 4, 33, 47), "bfloat16", None, 258)}, ValueError, "bias's base pointer is not aligned"),
    ({"mask": ((2, 4, 33, 47), "uint8")}, TypeError, r"mask must have dtype bool \(True = attend\), got uint8"),
    ({"mask": ((2, 3, 33, 47), "bool")}, ValueError, r"mask has 3 along axis 1 \(heads\)"),
    ({"mask": ((2, 33, 47), "bool")}, ValueError, "mask must have 4 dimensions"),
    ({"mask": ((2, 1, 33, 47), "bool", None, 256, 1)}, ValueError, "mask is on CUDA device 1"),
])
def test_bad_score_options_raise_naming_the_argument(options, error, message):
    with pytest.raises(error, match=message):
        _check_options(**options)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument.*causual"):
        validation.reject_planned({"causual": True})


def test_cpu_arrays_are_refused_naming_the_argument():
    q = np.ones((1, 4, 2, 64), np.float32)
    with pytest.raises(ValueError, match="q is on the CPU"):
        cuflash.attention(q, q, q)


def test_non_arrays_are_refused_naming_the_argument():
    with pytest.raises(TypeError, match="q must be a CUDA array supporting DLPack"):
        cuflash.attention([[1.0]], None, None)


def test_bad_stream_is_refused_naming_the_argument():
    with pytest.raises(TypeError, match="stream must be"):
        resolve_stream("default")


def test_kvcache_refuses_non_arrays_before_touching_cuda():
    with pytest.raises(TypeError, match="q must be a CUDA array supporting DLPack"):
        cuflash.attention_with_kvcache(None, None, None, 0)
    with pytest.raises(ValueError, match="bias is not supported by attention_with_kvcache"):
        cuflash.attention_with_kvcache(None, None, None, 0, bias=np.zeros(3))


def test_workspace_shapes_come_from_metadata_only():
    class Meta:
        def __init__(self, shape, dtype):
            self.shape, self.dtype = shape, np.dtype(dtype)

    with pytest.raises(ValueError, match="k has 3 heads"):
        cuflash.backward_workspace(Meta((1, 8, 8, 64), "float16"), Meta((1, 8, 3, 64), "float16"),
                                   Meta((1, 8, 3, 64), "float16"))
    with pytest.raises(TypeError, match="q has dtype float64"):
        cuflash.backward_workspace(Meta((1, 8, 8, 64), "float64"), Meta((1, 8, 8, 64), "float64"),
                                   Meta((1, 8, 8, 64), "float64"))


class _Meta:
    """Metadata only, like a tracer or a fake tensor."""

    def __init__(self, shape, dtype="bfloat16"):
        import ml_dtypes

        self.shape = shape
        self.dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


BAD_META = [
    ("head dim not multiple of 8", ((1, 8, 8, 12), (1, 8, 8, 12), (1, 8, 8, 12)), "q has head dim 12"),
    ("head dim too large", ((1, 8, 8, 264), (1, 8, 8, 264), (1, 8, 8, 264)), "q has head dim 264"),
    ("k head dim differs", ((1, 8, 8, 64), (1, 8, 8, 72), (1, 8, 8, 64)), "k has head dim 72 but q has 64"),
    ("Dv unsupported", ((1, 8, 8, 64), (1, 8, 8, 64), (1, 8, 8, 20)), r"v has head dim \(Dv\) 20"),
    ("k/v keys differ", ((1, 8, 8, 64), (1, 9, 8, 64), (1, 8, 8, 64)), "v has 8 keys but k has 9"),
    ("wrong ndim", ((1, 8, 64), (1, 8, 8, 64), (1, 8, 8, 64)), "q must have 4 dimensions"),
]


@pytest.mark.parametrize("entry", ["backward_workspace", "prepare"])
@pytest.mark.parametrize("case,shapes,message", BAD_META, ids=[c[0] for c in BAD_META])
def test_metadata_entry_points_check_like_a_call(entry, case, shapes, message):
    """backward_workspace / prepare run check_qkv on a metadata-only description: the same errors as a
    call, raised before any device is touched (so on the CPU too)."""
    with pytest.raises(ValueError, match=message):
        getattr(cuflash, entry)(*(_Meta(s) for s in shapes))


def test_no_usable_gpu_is_a_clear_runtime_error(monkeypatch):
    from cupy_backends.cuda.api import runtime

    from cuflash import launch

    def no_driver():
        raise runtime.CUDARuntimeError(35)  # cudaErrorInsufficientDriver

    monkeypatch.setattr(launch, "_get_device", None)
    monkeypatch.setattr(runtime, "getDeviceCount", no_driver)
    meta = [_Meta((1, 8, 8, 64)) for _ in range(3)]
    calls = [lambda: cuflash.backward_workspace(*meta), lambda: cuflash.prepare(*meta)]
    import cupy

    memory = cupy.cuda.UnownedMemory(1 << 20, 1 << 16, None, device_id=0)  # CuPy builds it without CUDA
    q = cupy.ndarray((1, 8, 8, 64), np.float16, cupy.cuda.MemoryPointer(memory, 0))
    calls.append(lambda: cuflash.attention(q, q, q))
    for call in calls:
        with pytest.raises(RuntimeError, match="no usable CUDA GPU") as caught:
            call()
        assert caught.type is RuntimeError  # not CuPy's CUDARuntimeError traceback


@pytest.mark.parametrize("mask_shape,rows", [(None, [0, 0, 0, 0]), ((2, 1, 33, 47), [0, 0, 0, 0]),
                                             ((2, 2, 33, 47), [0, 0, 1, 1]), ((2, 4, 33, 47), [0, 1, 2, 3])])
def test_each_head_reads_its_mask_heads_block_lists(mask_shape, rows):
    """The kernels read block-list row hm = h // mask_head_div of mask_heads rows: 0 for every head without a
    per-head bool mask (the lists hold one row per batch), the head's own mask head otherwise."""
    from cuflash import launch

    options = {"window": (8, None)} if mask_shape is None else {"mask": (mask_shape, "bool")}
    shape, opts = _check_options(**options)
    q, k, v = (desc(n, s) for n, s in (("q", (2, 33, 4, 64)), ("k", (2, 47, 2, 64)), ("v", (2, 47, 2, 64))))
    params = launch.make_params(shape, 0.125, q, k, v, None, None, fields=tuple(opts.params(False).items()))[0]
    assert [h // int(params["mask_head_div"]) for h in range(4)] == rows
    assert max(rows) < int(params["mask_heads"]) == shape.mask_heads


def test_metadata_seed_arrays_have_their_itemsize():
    """A traced seed (a JAX key's two uint32) reaches the metadata-only planning as shape and dtype alone."""
    from cuflash import api

    class Meta:
        def __init__(self, shape, dtype):
            self.shape, self.dtype = shape, np.dtype(dtype)

    q, k = Meta((2, 64, 4, 64), "float16"), Meta((2, 96, 2, 64), "float16")
    for seed in (Meta((2,), "uint32"), Meta((1,), "int64"), Meta((), "uint64")):
        shape = api._shape_from_meta(q, k, k, True, {"dropout_p": 0.2, "seed": seed})
        assert shape.dropout and shape.mask_kind == 4
    with pytest.raises(ValueError, match="8 bytes"):
        api._shape_from_meta(q, k, k, True, {"dropout_p": 0.2, "seed": Meta((4,), "uint32")})
