"""CPU tests of the float64 reference (cuflash.reference), the oracle every GPU test trusts.

The backward is checked against central finite differences of the forward, the forward against an
independent per-element loop, and the naive low-precision model against the float64 result.
"""

import math
import warnings

import ml_dtypes
import numpy as np
import pytest

from cuflash import reference

FD_STEP = 1e-5            # central differences in float64: truncation ~1e-10, round-off ~1e-11
FD_RTOL, FD_ATOL = 1e-6, 1e-8
EXACT_RTOL = 1e-12        # two float64 evaluations of the same formula


# ----------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------

def _dims(B=2, Sq=3, Sk=5, H=2, Hkv=1, D=4, Dv=6):
    return dict(B=B, Sq=Sq, Sk=Sk, H=H, Hkv=Hkv, D=D, Dv=Dv)


def _qkv(rng, d):
    q = rng.standard_normal((d["B"], d["Sq"], d["H"], d["D"]))
    k = rng.standard_normal((d["B"], d["Sk"], d["Hkv"], d["D"]))
    v = rng.standard_normal((d["B"], d["Sk"], d["Hkv"], d["Dv"]))
    return q, k, v


def _loss(out, lse, dout, dlse):
    """<out, dout> + <lse, dlse>, with -inf lse rows (no visible key) contributing nothing."""
    loss = np.sum(out * dout)
    if dlse is not None:
        loss += np.sum(np.where(np.isfinite(lse), lse, 0.0) * dlse)
    return loss


def _finite_difference(loss, x):
    """Central-difference gradient of loss() w.r.t. every element of x (perturbed in place)."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        original = x[index]
        x[index] = original + FD_STEP
        plus = loss()
        x[index] = original - FD_STEP
        minus = loss()
        x[index] = original
        grad[index] = (plus - minus) / (2 * FD_STEP)
    return grad


def _operand(x, b, h, i, j, heads):
    """Element of a bias-like operand for score (b, h, i, j), broadcasting by hand."""
    x = np.asarray(x).reshape((1,) * (4 - np.ndim(x)) + np.shape(x))
    nb, nh, nq, nk = x.shape
    head = 0 if nh == 1 else (h if nh == heads else h // (heads // nh))
    return x[b if nb > 1 else 0, head, i if nq > 1 else 0, j if nk > 1 else 0]


def _loop_forward(q, k, v, *, scale=None, causal=False, window=(None, None), softcap=None,
                  mask=None, bias=None, alibi_slopes=None, segment_ids=None, block_ids=None,
                  dropout_p=0.0, dropout_mask=None):
    """Independent oracle: one score at a time, straight from the API contract's wording."""
    B, Sq, H, D = q.shape
    _, Sk, Hkv, Dv = v.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    left, right = window
    out = np.zeros((B, Sq, H, Dv))
    lse = np.full((B, H, Sq), -np.inf)
    for b in range(B):
        for h in range(H):
            kv_head = h // (H // Hkv)
            for i in range(Sq):
                diagonal = i + Sk - Sq
                scores = {}
                for j in range(Sk):
                    if causal and not j <= diagonal:
                        continue
                    if left is not None and j < diagonal - left:
                        continue
                    if right is not None and j > diagonal + right:
                        continue
                    if mask is not None and not _operand(mask, b, h, i, j, H):
                        continue
                    if segment_ids is not None and segment_ids[0][b, i] != segment_ids[1][b, j]:
                        continue
                    if block_ids is not None and not block_ids[1][b, j] <= block_ids[0][b, i]:
                        continue
                    s = scale * math.fsum(q[b, i, h, :] * k[b, j, kv_head, :])
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if bias is not None:
                        s += _operand(bias, b, h, i, j, H)
                    if alibi_slopes is not None:
                        slope = alibi_slopes[h] if np.ndim(alibi_slopes) == 1 else alibi_slopes[b, h]
                        s -= slope * abs(i + Sk - Sq - j)
                    scores[j] = s
                if not scores:
                    continue
                m = max(scores.values())
                total = math.fsum(math.exp(s - m) for s in scores.values())
                lse[b, h, i] = m + math.log(total)
                for j, s in scores.items():
                    p = math.exp(s - m) / total
                    if dropout_mask is not None:
                        p *= _operand(dropout_mask, b, h, i, j, H) / (1 - dropout_p)
                    out[b, i, h, :] += p * v[b, j, kv_head, :]
    return out, lse


def _ids(rng, batch, length, distinct):
    return rng.integers(0, distinct, size=(batch, length)).astype(np.int32)


def _random_mask(rng, shape):
    mask = rng.random(shape) < 0.6
    mask[..., 0, :] = False  # one query row sees nothing
    return mask


# ----------------------------------------------------------------------------------------------------
# Backward vs finite differences
# ----------------------------------------------------------------------------------------------------

# id -> (dims, options(rng, dims)); "dlse" in the options is the gradient flowing into lse
FD_CASES = {
    "plain": (_dims(), lambda rng, d: {}),
    "single_query": (_dims(Sq=1, Sk=5), lambda rng, d: {"causal": True}),
    "single_key": (_dims(Sq=3, Sk=1), lambda rng, d: {}),
    "scale": (_dims(), lambda rng, d: {"scale": 0.37}),
    "causal_sq_lt_sk": (_dims(Sq=3, Sk=5), lambda rng, d: {"causal": True}),
    "causal_sq_gt_sk": (_dims(Sq=5, Sk=3), lambda rng, d: {"causal": True}),
    "window_left": (_dims(Sq=5, Sk=5), lambda rng, d: {"window": (1, None)}),
    "window_right": (_dims(Sq=5, Sk=5), lambda rng, d: {"window": (None, 1)}),
    "window_both": (_dims(Sq=3, Sk=5), lambda rng, d: {"window": (2, 1)}),
    "causal_window": (_dims(Sq=5, Sk=3), lambda rng, d: {"causal": True, "window": (1, None)}),
    "softcap": (_dims(), lambda rng, d: {"softcap": 0.8, "scale": 1.0}),
    "bias_full": (_dims(), lambda rng, d: {"bias": rng.standard_normal((2, 2, 3, 5))}),
    "bias_batch_1": (_dims(), lambda rng, d: {"bias": rng.standard_normal((1, 2, 3, 5))}),
    "bias_head_1": (_dims(), lambda rng, d: {"bias": rng.standard_normal((2, 1, 3, 5))}),
    "bias_kv_heads": (_dims(H=4, Hkv=2),
                      lambda rng, d: {"bias": rng.standard_normal((2, 2, 3, 5))}),
    "bias_2d": (_dims(), lambda rng, d: {"bias": rng.standard_normal((3, 5))}),
    "bias_key_row": (_dims(), lambda rng, d: {"bias": rng.standard_normal((1, 1, 1, 5))}),
    "bias_query_column": (_dims(), lambda rng, d: {"bias": rng.standard_normal((2, 2, 3, 1))}),
    "softcap_bias_causal": (_dims(Sq=5, Sk=3), lambda rng, d: {
        "softcap": 1.3, "bias": rng.standard_normal((2, 1, 5, 3)), "causal": True}),
    "alibi_heads": (_dims(), lambda rng, d: {"alibi_slopes": rng.random(2)}),
    "alibi_batch_heads": (_dims(), lambda rng, d: {"alibi_slopes": rng.random((2, 2))}),
    "mask": (_dims(), lambda rng, d: {"mask": _random_mask(rng, (2, 1, 3, 5))}),
    "mask_kv_heads": (_dims(H=4, Hkv=2), lambda rng, d: {"mask": _random_mask(rng, (2, 2, 3, 5))}),
    "segment_ids": (_dims(), lambda rng, d: {
        "segment_ids": (_ids(rng, 2, 3, 2), _ids(rng, 2, 5, 2))}),
    "block_ids": (_dims(), lambda rng, d: {"block_ids": (_ids(rng, 2, 3, 3), _ids(rng, 2, 5, 3))}),
    "gqa": (_dims(H=4, Hkv=2), lambda rng, d: {}),
    "mqa": (_dims(H=4, Hkv=1), lambda rng, d: {"causal": True}),
    "mha": (_dims(H=2, Hkv=2), lambda rng, d: {}),
    "dlse": (_dims(), lambda rng, d: {"dlse": rng.standard_normal((2, 2, 3))}),
    "dlse_masked_rows": (_dims(Sq=5, Sk=3), lambda rng, d: {
        "causal": True, "dlse": rng.standard_normal((2, 2, 5))}),
    "dropout": (_dims(), lambda rng, d: {
        "dropout_p": 0.25, "dropout_mask": rng.random((2, 2, 3, 5)) > 0.25}),
    "dropout_dlse": (_dims(), lambda rng, d: {
        "dropout_p": 0.5, "dropout_mask": rng.random((1, 2, 3, 5)) > 0.5,
        "dlse": rng.standard_normal((2, 2, 3))}),
    "everything": (_dims(Sq=5, Sk=3, H=4, Hkv=2), lambda rng, d: {
        "scale": 0.6, "causal": True, "window": (2, None), "softcap": 2.0,
        "bias": rng.standard_normal((2, 2, 5, 3)), "alibi_slopes": rng.random(4),
        "mask": rng.random((1, 4, 5, 3)) < 0.8, "segment_ids": (_ids(rng, 2, 5, 2), _ids(rng, 2, 3, 2)),
        "block_ids": (_ids(rng, 2, 5, 3), _ids(rng, 2, 3, 3)), "dropout_p": 0.2,
        "dropout_mask": rng.random((2, 4, 5, 3)) > 0.2, "dlse": rng.standard_normal((2, 4, 5))}),
}


@pytest.mark.parametrize("case", list(FD_CASES))
def test_backward_matches_finite_differences(case):
    dims, make_options = FD_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    q, k, v = _qkv(rng, dims)
    options = make_options(rng, dims)
    dlse = options.pop("dlse", None)
    dout = rng.standard_normal((dims["B"], dims["Sq"], dims["H"], dims["Dv"]))

    def loss():
        return _loss(*reference.attention_forward(q, k, v, **options), dout, dlse)

    grads = reference.attention_backward(dout, q, k, v, dlse=dlse, **options)
    expected_keys = {"dq", "dk", "dv"} | ({"dbias"} if "bias" in options else set())
    assert set(grads) == expected_keys
    wrt = {"dq": q, "dk": k, "dv": v}
    if "bias" in options:
        wrt["dbias"] = options["bias"]
    for name, x in wrt.items():
        assert grads[name].shape == x.shape, name
        np.testing.assert_allclose(grads[name], _finite_difference(loss, x),
                                   rtol=FD_RTOL, atol=FD_ATOL, err_msg=name)


def test_softcap_backward_saturated():
    """Large scores push tanh into saturation, where its derivative matters most."""
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, _dims())
    q *= 4.0
    dout = rng.standard_normal((2, 3, 2, 6))
    options = {"softcap": 0.5, "scale": 1.0}
    grads = reference.attention_backward(dout, q, k, v, **options)
    for name, x in (("dq", q), ("dk", k)):
        expected = _finite_difference(
            lambda: _loss(*reference.attention_forward(q, k, v, **options), dout, None), x)
        np.testing.assert_allclose(grads[name], expected, rtol=FD_RTOL, atol=FD_ATOL)


# ----------------------------------------------------------------------------------------------------
# Forward vs the independent loop
# ----------------------------------------------------------------------------------------------------

# id -> (dims, options(rng, dims))
LOOP_CASES = {
    "causal_window_segments": (_dims(B=2, Sq=6, Sk=7, H=2, Hkv=1, D=8, Dv=8), lambda rng, d: {
        "causal": True, "window": (3, None),
        "segment_ids": (np.array([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]], np.int32),
                        np.array([[0, 0, 0, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1, 1]], np.int32))}),
    "window_sq_gt_sk": (_dims(Sq=7, Sk=4), lambda rng, d: {"window": (1, 2)}),
    "window_right_negative_offset": (_dims(Sq=4, Sk=6), lambda rng, d: {"window": (0, 0)}),
    "softcap_bias_alibi": (_dims(H=4, Hkv=2), lambda rng, d: {
        "softcap": 1.1, "bias": rng.standard_normal((1, 2, 3, 5)),
        "alibi_slopes": rng.random((2, 4))}),
    "mask_block_ids_dropout": (_dims(H=4, Hkv=1), lambda rng, d: {
        "mask": rng.random((2, 4, 1, 5)) < 0.7, "block_ids": (_ids(rng, 2, 3, 3), _ids(rng, 2, 5, 3)),
        "dropout_p": 0.3, "dropout_mask": rng.random((2, 1, 3, 5)) > 0.3}),
    "everything": FD_CASES["everything"],
}


@pytest.mark.parametrize("case", list(LOOP_CASES))
def test_forward_matches_loop(case):
    dims, make_options = LOOP_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    q, k, v = _qkv(rng, dims)
    options = make_options(rng, dims)
    options.pop("dlse", None)
    out, lse = reference.attention_forward(q, k, v, **options)
    expected_out, expected_lse = _loop_forward(q, k, v, **options)
    np.testing.assert_allclose(out, expected_out, rtol=EXACT_RTOL, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    np.testing.assert_allclose(lse, expected_lse, rtol=EXACT_RTOL, atol=1e-13)


def test_low_precision_inputs_are_upcast():
    rng = np.random.default_rng(3)
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in _qkv(rng, _dims()))
    out, lse = reference.attention_forward(q, k, v, causal=True)
    wide = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    expected_out, expected_lse = reference.attention_forward(*wide, causal=True)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    np.testing.assert_array_equal(out, expected_out)
    np.testing.assert_array_equal(lse, expected_lse)


# ----------------------------------------------------------------------------------------------------
# Rows with no visible key
# ----------------------------------------------------------------------------------------------------

def _masked_row_problems(rng):
    """(options, dims, fully masked (b, h, i) rows as a (B, H, Sq) bool)."""
    causal = np.zeros((2, 2, 5), bool)
    causal[:, :, :2] = True
    mask = rng.random((2, 2, 5, 3)) < 0.7
    mask[0, 1, 3] = False
    mask[1, :, 0] = False
    bias = rng.standard_normal((2, 1, 5, 3))
    bias[1, 0, 2] = -np.inf
    bias_rows = np.zeros((2, 2, 5), bool)
    bias_rows[1, :, 2] = True
    return [
        ({"causal": True}, causal),
        ({"mask": mask}, ~mask.any(axis=-1)),
        ({"segment_ids": (np.array([[0, 1, 1, 2, 2]] * 2, np.int32),
                          np.array([[0, 0, 1]] * 2, np.int32))},
         np.broadcast_to(np.array([False, False, False, True, True]), (2, 2, 5))),
        ({"window": (None, -1)}, np.broadcast_to(np.arange(5) < 3, (2, 2, 5))),
        ({"bias": bias, "softcap": 2.0}, bias_rows),
    ]


@pytest.mark.parametrize("index", range(5))
def test_fully_masked_rows(index):
    rng = np.random.default_rng(11)
    options, masked_rows = _masked_row_problems(rng)[index]
    q, k, v = _qkv(rng, _dims(Sq=5, Sk=3))
    dout = rng.standard_normal((2, 5, 2, 6))
    dlse = rng.standard_normal((2, 2, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = reference.attention_forward(q, k, v, **options)
        grads = reference.attention_backward(dout, q, k, v, dlse=dlse, **options)
        # the masked rows' upstream gradients must not matter
        dout_changed = dout + 100.0 * masked_rows.transpose(0, 2, 1)[..., None]
        dlse_changed = dlse + 100.0 * masked_rows
        grads_changed = reference.attention_backward(dout_changed, q, k, v, dlse=dlse_changed,
                                                     **options)
    assert masked_rows.any()
    for name, x in [("out", out), ("lse", lse)] + list(grads.items()):
        assert not np.isnan(x).any(), name
    assert np.all(lse[masked_rows] == -np.inf)
    assert np.all(np.isfinite(lse[~masked_rows]))
    assert np.all(out.transpose(0, 2, 1, 3)[masked_rows] == 0)
    assert np.all(grads["dq"].transpose(0, 2, 1, 3)[masked_rows] == 0)
    for name in grads:
        np.testing.assert_allclose(grads_changed[name], grads[name], rtol=1e-12, atol=1e-12)


def test_no_keys_at_all():
    rng = np.random.default_rng(12)
    q, k, v = _qkv(rng, _dims(Sk=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = reference.attention_forward(q, k, v)
        grads = reference.attention_backward(rng.standard_normal(out.shape), q, k, v)
    assert out.shape == (2, 3, 2, 6) and np.all(out == 0)
    assert np.all(lse == -np.inf)
    assert np.all(grads["dq"] == 0) and grads["dk"].shape == k.shape


# ----------------------------------------------------------------------------------------------------
# Naive low-precision model
# ----------------------------------------------------------------------------------------------------

NAIVE_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
# dtype -> (lowest, highest) plausible relative error vs float64 for N(0, 1) inputs
NAIVE_ERROR_BOUNDS = {"bfloat16": (1e-4, 5e-2), "float16": (1e-5, 1e-2), "float32": (0.0, 1e-5)}


def _naive_problem(dtype, causal, hkv=2):
    rng = np.random.default_rng(21)
    dims = _dims(B=1, Sq=128, Sk=160, H=4, Hkv=hkv, D=64, Dv=64)
    q, k, v = (x.astype(NAIVE_DTYPE[dtype]) for x in _qkv(rng, dims))
    dout = rng.standard_normal((1, 128, 4, 64)).astype(NAIVE_DTYPE[dtype])
    dlse = rng.standard_normal((1, 4, 128)).astype(np.float32)
    return q, k, v, dout, dlse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", list(NAIVE_ERROR_BOUNDS))
def test_naive_error_is_plausible(dtype, causal):
    q, k, v, dout, dlse = _naive_problem(dtype, causal)
    low, high = NAIVE_ERROR_BOUNDS[dtype]
    out, lse = reference.naive_forward(q, k, v, dtype=dtype, causal=causal)
    ref_out, ref_lse = reference.attention_forward(q, k, v, causal=causal)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert low <= reference.relative_error(out, ref_out) < high
    assert reference.relative_error(lse, ref_lse) < 1e-5
    grads = reference.naive_backward(dout, q, k, v, dtype=dtype, causal=causal, dlse=dlse)
    ref_grads = reference.attention_backward(dout, q, k, v, causal=causal, dlse=dlse)
    for name in ("dq", "dk", "dv"):
        assert grads[name].shape == ref_grads[name].shape
        assert low <= reference.relative_error(grads[name], ref_grads[name]) < high, name


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_naive_results_are_representable(dtype):
    q, k, v, dout, _ = _naive_problem(dtype, causal=True)
    out, _ = reference.naive_forward(q, k, v, dtype=dtype, causal=True)
    grads = reference.naive_backward(dout, q, k, v, dtype=dtype, causal=True)
    for x in [out] + list(grads.values()):
        assert x.dtype == np.float32
        np.testing.assert_array_equal(x, np.asarray(x, NAIVE_DTYPE[dtype]).astype(np.float32))


def test_naive_masked_rows_are_zero():
    rng = np.random.default_rng(22)
    q, k, v = (x.astype(np.float32) for x in _qkv(rng, _dims(Sq=5, Sk=3)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = reference.naive_forward(q, k, v, dtype="float32", causal=True)
        grads = reference.naive_backward(rng.standard_normal(out.shape), q, k, v,
                                         dtype="float32", causal=True)
    assert np.all(out[:, :2] == 0) and np.all(lse[:, :, :2] == -np.inf)
    assert np.all(grads["dq"][:, :2] == 0) and not np.isnan(grads["dk"]).any()


def _doc_ids(rng, batch, sq, sk, docs):
    """Sorted document ids, q's being the last Sq positions of the length-max(Sq, Sk) sequence whose
    last Sk positions are k's (the bottom-right alignment causal and window use)."""
    length = max(sq, sk)
    ids = np.sort(rng.integers(0, docs, size=(batch, length)), axis=1).astype(np.int32)
    return np.ascontiguousarray(ids[:, length - sq:]), np.ascontiguousarray(ids[:, length - sk:])


# id -> (dims, options(rng)); every option of the naive model, alone and combined
NAIVE_OPTION_CASES = {
    "window": (_dims(Sq=37, Sk=53, H=4, Hkv=2, D=16, Dv=8), lambda rng: {"window": (5, 3)}),
    "window_left_only": (_dims(Sq=53, Sk=37, H=4, Hkv=2, D=16, Dv=8),
                         lambda rng: {"window": (6, None)}),
    "window_zero_sq_gt_sk": (_dims(Sq=53, Sk=37, H=2, Hkv=1, D=16, Dv=8),
                             lambda rng: {"window": (0, 0)}),
    "causal_window": (_dims(Sq=53, Sk=37, H=4, Hkv=1, D=16, Dv=8),
                      lambda rng: {"causal": True, "window": (7, 4)}),
    "softcap": (_dims(Sq=37, Sk=53, H=4, Hkv=2, D=16, Dv=8),
                lambda rng: {"softcap": 1.5, "scale": 0.8}),
    "alibi_heads": (_dims(Sq=37, Sk=53, H=4, Hkv=2, D=16, Dv=8),
                    lambda rng: {"alibi_slopes": rng.random(4).astype(np.float32)}),
    "alibi_batch_heads": (_dims(Sq=53, Sk=37, H=4, Hkv=4, D=16, Dv=8),
                          lambda rng: {"alibi_slopes": rng.random((2, 4)).astype(np.float32)}),
    "segment_ids": (_dims(Sq=37, Sk=53, H=4, Hkv=2, D=16, Dv=8),
                    lambda rng: {"segment_ids": _doc_ids(rng, 2, 37, 53, 4)}),
    "block_ids": (_dims(Sq=53, Sk=37, H=4, Hkv=2, D=16, Dv=8),
                  lambda rng: {"block_ids": (_ids(rng, 2, 53, 5), _ids(rng, 2, 37, 5))}),
    "softcap_alibi_segments_causal": (_dims(Sq=53, Sk=37, H=4, Hkv=2, D=16, Dv=8), lambda rng: {
        "softcap": 2.0, "alibi_slopes": rng.random(4).astype(np.float32), "causal": True,
        "segment_ids": _doc_ids(rng, 2, 53, 37, 3)}),
    "everything": (_dims(Sq=37, Sk=53, H=6, Hkv=2, D=16, Dv=8), lambda rng: {
        "scale": 0.5, "causal": True, "window": (20, None), "softcap": 3.0,
        "alibi_slopes": rng.random((2, 6)).astype(np.float32),
        "segment_ids": _doc_ids(rng, 2, 37, 53, 2), "block_ids": _doc_ids(rng, 2, 37, 53, 6)}),
}
#: float32 naive vs float64: what fp32 rounding of scores, softmax and matmuls leaves (measured
#: 3e-8 .. 3e-7 on these cases); a wrong option (missing mask, softcap derivative, ALiBi sign or
#: order) is an O(1e-2 .. 1) error.
NAIVE_FP32_LIMIT = 2e-6


def _naive_option_problem(case):
    dims, make_options = NAIVE_OPTION_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    q, k, v = (x.astype(np.float32) for x in _qkv(rng, dims))
    dout = rng.standard_normal((dims["B"], dims["Sq"], dims["H"], dims["Dv"])).astype(np.float32)
    dlse = rng.standard_normal((dims["B"], dims["H"], dims["Sq"])).astype(np.float32)
    return q, k, v, dout, dlse, make_options(rng)


@pytest.mark.parametrize("case", list(NAIVE_OPTION_CASES))
def test_naive_float32_with_options_matches_reference(case):
    """In float32 the naive model is the reference up to fp32 rounding, for every option."""
    q, k, v, dout, dlse, options = _naive_option_problem(case)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = reference.naive_forward(q, k, v, dtype="float32", **options)
        grads = reference.naive_backward(dout, q, k, v, dtype="float32", dlse=dlse, **options)
    ref_out, ref_lse = reference.attention_forward(q, k, v, **options)
    ref_grads = reference.attention_backward(dout, q, k, v, dlse=dlse, **options)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    errors = {"out": reference.relative_error(out, ref_out),
              "lse": reference.relative_error(lse, ref_lse),
              **{n: reference.relative_error(grads[n], ref_grads[n]) for n in ("dq", "dk", "dv")}}
    assert all(err < NAIVE_FP32_LIMIT for err in errors.values()), errors


@pytest.mark.parametrize("case", list(NAIVE_OPTION_CASES))
def test_naive_flash_row_term_follows_the_given_out(case):
    """``naive_backward(out=...)`` takes its row term from ``out`` (FlashAttention's D = rowsum(dO * out)): with
    the exact out it is the plain model up to fp32 rounding; with out moved by e its gradients are the reference's
    with dlse lowered by rowsum(dO * e), what a D off by that much gives; an out of the wrong shape is refused."""
    q, k, v, dout, dlse, options = _naive_option_problem(case)
    ref_out, _ = reference.attention_forward(q, k, v, **options)
    moved = ref_out + 0.05 * np.random.default_rng(3).standard_normal(ref_out.shape)
    shift = np.sum(dout.astype(np.float64) * (moved.astype(np.float32) - ref_out), axis=-1).transpose(0, 2, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact = reference.naive_backward(dout, q, k, v, dtype="float32", dlse=dlse, out=ref_out, **options)
        off = reference.naive_backward(dout, q, k, v, dtype="float32", dlse=dlse, out=moved, **options)
    ref_grads = reference.attention_backward(dout, q, k, v, dlse=dlse, **options)
    ref_off = reference.attention_backward(dout, q, k, v, dlse=dlse - shift, **options)
    for name in ("dq", "dk", "dv"):
        assert reference.relative_error(exact[name], ref_grads[name]) < NAIVE_FP32_LIMIT, name
        assert reference.relative_error(off[name], ref_off[name]) < NAIVE_FP32_LIMIT, name
    assert reference.relative_error(off["dq"], ref_grads["dq"]) > 1e-3  # the moved out did reach dq
    with pytest.raises(ValueError, match="out"):
        reference.naive_backward(dout, q, k, v, dtype="float32", out=ref_out[:, :, :1], **options)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", ["softcap_alibi_segments_causal", "everything"])
def test_naive_low_precision_with_options(case, dtype):
    """In fp16 / bf16 the options keep the naive error in the plain model's range, and its results
    representable in the dtype."""
    q, k, v, dout, dlse, options = _naive_option_problem(case)
    q, k, v, dout = (x.astype(NAIVE_DTYPE[dtype]) for x in (q, k, v, dout))
    low, high = NAIVE_ERROR_BOUNDS[dtype]
    out, lse = reference.naive_forward(q, k, v, dtype=dtype, **options)
    grads = reference.naive_backward(dout, q, k, v, dtype=dtype, dlse=dlse, **options)
    ref_out, ref_lse = reference.attention_forward(q, k, v, **options)
    ref_grads = reference.attention_backward(dout, q, k, v, dlse=dlse, **options)
    assert low <= reference.relative_error(out, ref_out) < high
    assert reference.relative_error(lse, ref_lse) < 1e-5
    for name in ("dq", "dk", "dv"):
        assert low <= reference.relative_error(grads[name], ref_grads[name]) < high, name
    for x in [out] + list(grads.values()):
        np.testing.assert_array_equal(x, np.asarray(x, NAIVE_DTYPE[dtype]).astype(np.float32))


def test_naive_neutral_options_change_nothing():
    """Options that hide nothing and add nothing leave the naive model's bits unchanged."""
    q, k, v, dout, dlse, _ = _naive_option_problem("window")
    B, Sq, H, _ = q.shape
    Sk = k.shape[1]
    neutral = {"window": (Sq + Sk, Sq + Sk), "alibi_slopes": np.zeros(H, np.float32),
               "segment_ids": (np.full((B, Sq), 3, np.int32), np.full((B, Sk), 3, np.int32)),
               "block_ids": (np.full((B, Sq), 2, np.int32), np.arange(B * Sk, dtype=np.int32)
                             .reshape(B, Sk) % 3)}
    for dtype in ("bfloat16", "float32"):
        plain = reference.naive_forward(q, k, v, dtype=dtype)
        plain_grads = reference.naive_backward(dout, q, k, v, dtype=dtype, dlse=dlse)
        for name, value in neutral.items():
            with_option = reference.naive_forward(q, k, v, dtype=dtype, **{name: value})
            grads = reference.naive_backward(dout, q, k, v, dtype=dtype, dlse=dlse, **{name: value})
            for got, expected in zip(list(with_option) + list(grads.values()),
                                     list(plain) + list(plain_grads.values())):
                np.testing.assert_array_equal(got, expected, err_msg=f"{dtype} {name}")


def test_naive_rows_and_keys_nothing_sees():
    """Segment ids found only in q, or only in k: those rows get out 0, lse -inf, dq 0; those keys
    get dk = dv = 0; no NaN and no floating-point warning anywhere."""
    rng = np.random.default_rng(23)
    q, k, v = (x.astype(np.float32) for x in _qkv(rng, _dims(Sq=6, Sk=5, H=2, Hkv=1, D=8, Dv=8)))
    q_ids = np.array([[0, 0, 9, 1, 1, 9], [9, 9, 9, 9, 9, 9]], np.int32)  # 9 is never a key's id
    k_ids = np.array([[0, 0, 1, 7, 7], [0, 1, 1, 2, 2]], np.int32)       # 7 is never a query's id
    dout = rng.standard_normal((2, 6, 2, 8)).astype(np.float32)
    dlse = rng.standard_normal((2, 2, 6)).astype(np.float32)
    for dtype in ("float16", "float32"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, lse = reference.naive_forward(q, k, v, dtype=dtype, softcap=2.0, causal=True,
                                               segment_ids=(q_ids, k_ids))
            grads = reference.naive_backward(dout, q, k, v, dtype=dtype, dlse=dlse, softcap=2.0,
                                             causal=True, segment_ids=(q_ids, k_ids))
        empty = q_ids == 9
        empty[:, 0] = True  # causal with Sq = Sk + 1: query 0 would need key -1
        assert np.all(out[empty] == 0) and np.all(grads["dq"][empty] == 0)
        assert np.all(np.isneginf(lse.transpose(0, 2, 1)[empty]))
        assert np.all(np.isfinite(lse.transpose(0, 2, 1)[~empty]))
        # batch 0: key 1 (id 0) is past the diagonal of both id-0 queries, keys 3, 4 have id 7;
        # batch 1: every query has id 9
        unseen = np.array([[False, True, False, True, True], [True] * 5])
        assert np.all(grads["dk"][unseen] == 0) and np.all(grads["dv"][unseen] == 0)
        assert np.any(grads["dk"][~unseen] != 0)
        for x in [out] + list(grads.values()):
            assert not np.isnan(x).any()


# ----------------------------------------------------------------------------------------------------
# Rounding and error helpers
# ----------------------------------------------------------------------------------------------------

def test_bfloat16_rounding_matches_ml_dtypes():
    rng = np.random.default_rng(31)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, size=20_000, dtype=np.uint32) << 16) | np.uint32(0x8000)
    x = np.concatenate([bits, ties]).view(np.float32)
    x = np.concatenate([x[~np.isnan(x)], rng.standard_normal(10_000).astype(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45], np.float32)])
    expected = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        actual = reference.round_to_bfloat16(x)
    assert actual.dtype == np.float32
    np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


def test_bfloat16_rounding_keeps_nan_and_scalars():
    nan_bits = np.array([0x7F800001, 0xFFC00000, 0x7FFFFFFF], np.uint32).view(np.float32)
    assert np.isnan(reference.round_to_bfloat16(nan_bits)).all()
    assert float(reference.round_to_bfloat16(np.float32(1 + 2**-8))) == 1.0  # tie to even
    assert float(reference.round_to_bfloat16(np.float32(1 + 3 * 2**-8))) == 1 + 2**-6


def test_round_to_dtype():
    rng = np.random.default_rng(32)
    x = (rng.standard_normal(1000) * 1e3).astype(np.float32)
    np.testing.assert_array_equal(reference.round_to_dtype(x, "float16"),
                                  x.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(reference.round_to_dtype(x, np.float32), x)
    np.testing.assert_array_equal(reference.round_to_dtype(x, ml_dtypes.bfloat16),
                                  x.astype(ml_dtypes.bfloat16).astype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reference.round_to_dtype(np.float32(1e6), "float16") == np.inf


def test_relative_error():
    rng = np.random.default_rng(33)
    e = rng.standard_normal((4, 5))
    a = e + 1e-3 * rng.standard_normal((4, 5))
    assert reference.relative_error(e, e) == 0.0
    assert reference.relative_error(a, e) == pytest.approx(np.linalg.norm(a - e) / np.linalg.norm(e))
    assert reference.relative_error(a.astype(ml_dtypes.bfloat16), e) > 0
    with_nan = a.copy()
    with_nan[1, 2] = np.nan
    assert reference.relative_error(with_nan, e) == math.inf
    with_inf = a.copy()
    with_inf[0, 0] = np.inf
    assert reference.relative_error(with_inf, e) == math.inf
    lse, lse_ref = a.copy(), e.copy()
    lse[2], lse_ref[2] = -np.inf, -np.inf  # fully masked rows agree
    assert reference.relative_error(lse, lse_ref) == pytest.approx(
        np.linalg.norm(a[[0, 1, 3]] - e[[0, 1, 3]]) / np.linalg.norm(e[[0, 1, 3]]))
    lse[2, 0] = 0.0
    assert reference.relative_error(lse, lse_ref) == math.inf
    assert reference.relative_error(np.zeros(3), np.zeros(3)) == 0.0
    with pytest.raises(ValueError, match="shape"):
        reference.relative_error(e, e[:2])


# ----------------------------------------------------------------------------------------------------
# Varlen
# ----------------------------------------------------------------------------------------------------

CU_SEQLENS_Q = np.array([0, 3, 3, 8, 9, 11], np.int32)   # an empty query sequence
CU_SEQLENS_K = np.array([0, 4, 6, 6, 11, 14], np.int32)  # an empty key sequence
VARLEN_OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "window_softcap": {"window": (2, 1), "softcap": 1.5, "scale": 0.4},
    "alibi_per_sequence": {"causal": True, "alibi_slopes": np.random.default_rng(41).random((5, 4))},
    "alibi_heads": {"alibi_slopes": np.random.default_rng(42).random(4)},
}


@pytest.mark.parametrize("case", list(VARLEN_OPTIONS))
def test_varlen_equals_per_sequence_dense(case):
    options = VARLEN_OPTIONS[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    total_q, total_k = 12, 14  # q token 11 is outside every sequence
    q = rng.standard_normal((total_q, 4, 8))
    k = rng.standard_normal((total_k, 2, 8))
    v = rng.standard_normal((total_k, 2, 5))
    dout = rng.standard_normal((total_q, 4, 5))
    dlse = rng.standard_normal((4, total_q))
    out, lse = reference.varlen_attention_forward(q, k, v, CU_SEQLENS_Q, CU_SEQLENS_K, **options)
    grads = reference.varlen_attention_backward(dout, q, k, v, CU_SEQLENS_Q, CU_SEQLENS_K,
                                                dlse=dlse, max_seqlen_q=5, max_seqlen_k=5,
                                                **options)
    assert out.shape == (total_q, 4, 5) and lse.shape == (4, total_q)
    expected_dk, expected_dv = np.zeros_like(k), np.zeros_like(v)
    spans = zip(CU_SEQLENS_Q, CU_SEQLENS_Q[1:], CU_SEQLENS_K, CU_SEQLENS_K[1:])
    for b, (qs, qe, ks, ke) in enumerate(spans):
        seq_options = dict(options)
        if np.ndim(options.get("alibi_slopes")) == 2:
            seq_options["alibi_slopes"] = options["alibi_slopes"][b]
        seq = (q[None, qs:qe], k[None, ks:ke], v[None, ks:ke])
        seq_out, seq_lse = _loop_forward(*seq, **seq_options)
        np.testing.assert_allclose(out[qs:qe], seq_out[0], rtol=EXACT_RTOL, atol=1e-13)
        np.testing.assert_allclose(lse[:, qs:qe], seq_lse[0], rtol=EXACT_RTOL, atol=1e-13)
        seq_grads = reference.attention_backward(dout[None, qs:qe], *seq,
                                                 dlse=dlse[None, :, qs:qe], **seq_options)
        np.testing.assert_allclose(grads["dq"][qs:qe], seq_grads["dq"][0], rtol=EXACT_RTOL)
        expected_dk[ks:ke] = seq_grads["dk"][0]
        expected_dv[ks:ke] = seq_grads["dv"][0]
    np.testing.assert_allclose(grads["dk"], expected_dk, rtol=EXACT_RTOL)
    np.testing.assert_allclose(grads["dv"], expected_dv, rtol=EXACT_RTOL)
    assert np.all(out[11] == 0) and np.all(lse[:, 11] == -np.inf) and np.all(grads["dq"][11] == 0)


def test_varlen_rejects_dense_only_options():
    q = np.random.default_rng(43).standard_normal((4, 2, 8))
    cu = np.array([0, 4])
    for name, value in [("bias", np.zeros((1, 2, 4, 4)) + 1.0), ("mask", np.ones((4, 4), bool)),
                        ("segment_ids", (cu, cu)), ("block_ids", (cu, cu)), ("dropout_p", 0.1)]:
        with pytest.raises(ValueError, match=name):
            reference.varlen_attention_forward(q, q, q, cu, cu, **{name: value})
        with pytest.raises(ValueError, match=name):
            reference.varlen_attention_backward(q, q, q, q, cu, cu, **{name: value})
    out, _ = reference.varlen_attention_forward(q, q, q, cu, cu, bias=None, dropout_p=0.0)
    assert out.shape == q.shape
    with pytest.raises(TypeError, match="casual"):
        reference.varlen_attention_forward(q, q, q, cu, cu, casual=True)


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------

def _bad_calls():
    rng = np.random.default_rng(51)
    q = rng.standard_normal((2, 3, 8, 4))
    k = rng.standard_normal((2, 5, 2, 4))
    v = rng.standard_normal((2, 5, 2, 6))
    dout = rng.standard_normal((2, 3, 8, 6))
    fwd, bwd = reference.attention_forward, reference.attention_backward
    packed = rng.standard_normal((6, 2, 4))
    cu = np.array([0, 2, 6])
    vfwd = reference.varlen_attention_forward
    return {
        "q_ndim": (lambda: fwd(q[0], k, v), "q must have 4 dims"),
        "heads": (lambda: fwd(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)),
                  "k has 3 heads, which does not divide q's 8 heads"),
        "k_batch": (lambda: fwd(q, k[:1], v[:1]), "k has batch 1"),
        "v_batch": (lambda: fwd(q, k, v[:1]), "v has batch 1"),
        "v_keys": (lambda: fwd(q, k, v[:, :4]), "v has 4 keys, k has 5"),
        "v_heads": (lambda: fwd(q, k, v[:, :, :1]), "v has 1 heads, k has 2"),
        "head_dim": (lambda: fwd(q, k[..., :2], v), "k has head dim 2, q has head dim 4"),
        "bias_shape": (lambda: fwd(q, k, v, bias=np.ones((2, 8, 3, 4))), "bias has shape"),
        "bias_heads": (lambda: fwd(q, k, v, bias=np.ones((1, 3, 3, 5))), "bias .*H dim is 3"),
        "bias_ndim": (lambda: fwd(q, k, v, bias=np.ones((1, 2, 8, 3, 5))), "bias has shape"),
        "mask_shape": (lambda: fwd(q, k, v, mask=np.ones((3, 3), bool)), "mask has shape"),
        "alibi": (lambda: fwd(q, k, v, alibi_slopes=np.ones(3)), "alibi_slopes has shape"),
        "segment_ids": (lambda: fwd(q, k, v, segment_ids=(np.zeros((2, 3)), np.zeros((2, 3)))),
                        r"segment_ids\[1\]"),
        "segment_ids_pair": (lambda: fwd(q, k, v, segment_ids=np.zeros((2, 3))), "segment_ids"),
        "block_ids": (lambda: fwd(q, k, v, block_ids=(np.zeros((1, 3)), np.zeros((2, 5)))),
                      r"block_ids\[0\]"),
        "dropout_needs_mask": (lambda: fwd(q, k, v, dropout_p=0.1), "dropout_mask"),
        "dropout_p": (lambda: fwd(q, k, v, dropout_p=1.0, dropout_mask=np.ones(1, bool)),
                      "dropout_p"),
        "dropout_mask_shape": (lambda: fwd(q, k, v, dropout_p=0.1,
                                           dropout_mask=np.ones((3, 1, 1, 1), bool)),
                               "dropout_mask has shape"),
        "softcap": (lambda: fwd(q, k, v, softcap=0.0), "softcap"),
        "window": (lambda: fwd(q, k, v, window=3), "window"),
        "window_float": (lambda: fwd(q, k, v, window=(1.5, None)), "window"),
        "dout": (lambda: bwd(dout[..., :4], q, k, v), "dout has shape"),
        "dlse": (lambda: bwd(dout, q, k, v, dlse=np.ones((2, 3, 8))), "dlse has shape"),
        "varlen_q_ndim": (lambda: vfwd(q, packed, packed, cu, cu), "q must have 3 dims"),
        "varlen_count": (lambda: vfwd(packed, packed, packed, cu, cu[:2]),
                         "cu_seqlens_q has 2 sequences, cu_seqlens_k has 1"),
        "varlen_order": (lambda: vfwd(packed, packed, packed, np.array([0, 4, 2]), cu),
                         "cu_seqlens_q must be"),
        "varlen_overrun": (lambda: vfwd(packed, packed, packed, cu, np.array([0, 2, 7])),
                           "cu_seqlens_k ends at 7"),
        "varlen_max_seqlen": (lambda: vfwd(packed, packed, packed, cu, cu, max_seqlen_q=3),
                              "max_seqlen_q"),
        "varlen_alibi": (lambda: vfwd(packed, packed, packed, cu, cu, alibi_slopes=np.ones((3, 2))),
                         "alibi_slopes"),
        "naive_dtype": (lambda: reference.naive_forward(q, k, v, dtype="float64"), "dtype"),
        "naive_heads": (lambda: reference.naive_forward(q, k[:, :, :1].repeat(3, 2),
                                                        v[:, :, :1].repeat(3, 2), dtype="float32"),
                        "k has 3 heads"),
        "naive_softcap": (lambda: reference.naive_forward(q, k, v, dtype="float32", softcap=-1.0),
                          "softcap"),
        "naive_window": (lambda: reference.naive_backward(dout, q, k, v, dtype="float32", window=4),
                         "window"),
        "naive_alibi": (lambda: reference.naive_forward(q, k, v, dtype="float16",
                                                        alibi_slopes=np.ones((2, 3))),
                        "alibi_slopes has shape"),
        "naive_segment_ids": (lambda: reference.naive_forward(
            q, k, v, dtype="float32", segment_ids=(np.zeros((2, 3)), np.zeros((2, 4)))),
            r"segment_ids\[1\]"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_arguments_raise_value_error(case):
    call, message = _bad_calls()[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_non_bool_masks_raise_type_error():
    rng = np.random.default_rng(52)
    q, k, v = _qkv(rng, _dims())
    with pytest.raises(TypeError, match="mask"):
        reference.attention_forward(q, k, v, mask=np.ones((3, 5)))
    with pytest.raises(TypeError, match="dropout_mask"):
        reference.attention_forward(q, k, v, dropout_p=0.1, dropout_mask=np.ones((3, 5)))


# ----------------------------------------------------------------------------------------------------
# Array-module agnosticism
# ----------------------------------------------------------------------------------------------------

class _CupyNamespaceCheck:
    """numpy behind a facade that refuses any function cupy lacks: proves the xp path is portable."""

    def __init__(self, cupy):
        self._cupy = cupy

    def __getattr__(self, name):
        if not hasattr(self._cupy, name):
            raise AssertionError(f"reference uses xp.{name}, which cupy lacks")
        return getattr(np, name)


def test_xp_path_uses_only_functions_cupy_has():
    cupy = pytest.importorskip("cupy")
    xp = _CupyNamespaceCheck(cupy)
    rng = np.random.default_rng(61)
    dims, make_options = FD_CASES["everything"]
    q, k, v = _qkv(rng, dims)
    options = make_options(rng, dims)
    dlse = options.pop("dlse")
    dout = rng.standard_normal((2, 5, 4, 6))
    naive_options = {name: options[name] for name in (
        "scale", "causal", "window", "softcap", "alibi_slopes", "segment_ids", "block_ids")}
    for via, plain in [
        (reference.attention_forward(q, k, v, xp=xp, **options),
         reference.attention_forward(q, k, v, **options)),
        (reference.attention_backward(dout, q, k, v, dlse=dlse, xp=xp, **options),
         reference.attention_backward(dout, q, k, v, dlse=dlse, **options)),
        (reference.naive_backward(dout, q, k, v, dtype="bfloat16", causal=True, xp=xp),
         reference.naive_backward(dout, q, k, v, dtype="bfloat16", causal=True)),
        (reference.naive_backward(dout, q, k, v, dtype="float16", dlse=dlse, xp=xp, **naive_options),
         reference.naive_backward(dout, q, k, v, dtype="float16", dlse=dlse, **naive_options)),
        (reference.varlen_attention_backward(dout[0], q[0], k[0], v[0], [0, 2, 5], [0, 1, 3],
                                             causal=True, xp=xp),
         reference.varlen_attention_backward(dout[0], q[0], k[0], v[0], [0, 2, 5], [0, 1, 3],
                                             causal=True)),
    ]:
        via = via.values() if isinstance(via, dict) else via
        plain = plain.values() if isinstance(plain, dict) else plain
        for a, b in zip(via, plain):
            np.testing.assert_array_equal(a, b)
    assert reference.relative_error(q, q, xp=xp) == 0.0
    assert reference.naive_forward(q, k, v, dtype="float16", xp=xp)[0].shape == (2, 5, 4, 6)
