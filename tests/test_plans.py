"""Backward plans (no GPU): how many query heads a dK/dV block accumulates, and the scratch and launches
that follow from it."""
import pytest

from cuflash.kernels import ProblemShape, backward


def _shape(b, s, h, hk, d, causal=False):
    return ProblemShape(b, s, s, h, hk, d, d, "bfloat16", causal)


def _launch(plan, kernel):
    return [item for item in plan.launches if item.variant.name.endswith(kernel)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_mqa_block_takes_two_heads_and_halves_the_partials(deterministic):
    # The vision-language-action MQA shape: 16 key blocks x 2 batches x 8 heads = 256 blocks on 132 SMs
    # (two waves), or 128 blocks of 2 heads (one wave, same work per SM, half the fp32 partials).
    shape = _shape(2, 1024, 8, 1, 256)
    plan = backward.plan_backward(shape, 90, deterministic, num_sms=132)
    assert dict(plan.fields)["dkdv_heads"] == 2
    (dkdv,) = _launch(plan, "flash_bwd_dkdv_kernel")
    assert dkdv.grid == (16, 4, 2)
    scratch = plan.scratch_dict()
    assert scratch["dk_accum"] == scratch["dv_accum"] == (2, 4, 1024, 256)
    assert len(_launch(plan, "flash_bwd_reduce_dkdv_kernel")) == 1


@pytest.mark.parametrize("shape", [_shape(2, 1024, 8, 1, 256, causal=True), _shape(4, 4096, 32, 8, 128, causal=True)])
def test_causal_keeps_one_head_per_block(shape):
    # The causal triangle: merging heads lengthens the longest blocks (measured slower on the H100).
    plan = backward.plan_backward(shape, 90, False, num_sms=132)
    assert dict(plan.fields)["dkdv_heads"] == 1


def test_gqa_block_takes_its_whole_group_and_skips_the_reduce():
    shape = _shape(4, 4096, 32, 8, 128)
    plan = backward.plan_backward(shape, 90, False, num_sms=132)
    assert dict(plan.fields)["dkdv_heads"] == 4
    (dkdv,) = _launch(plan, "flash_bwd_dkdv_kernel")
    assert dkdv.grid[1] == 8
    assert "dk_accum" not in plan.scratch_dict() and "dv_accum" not in plan.scratch_dict()
    assert not _launch(plan, "flash_bwd_reduce_dkdv_kernel")


def test_small_grids_keep_one_head_per_block():
    # 2 key blocks x 1 batch x 8 heads = 16 blocks: fewer than the SMs, so no head is merged.
    plan = backward.plan_backward(_shape(1, 128, 8, 2, 64), 90, False, num_sms=132)
    assert dict(plan.fields)["dkdv_heads"] == 1
    assert plan.scratch_dict()["dk_accum"] == (1, 8, 128, 64)


@pytest.mark.parametrize("h,hk", [(1, 1), (6, 6), (12, 3), (9, 1)])
@pytest.mark.parametrize("num_sms", [1, 7, 132])
def test_heads_divide_the_group_and_mha_never_merges(h, hk, num_sms):
    shape = _shape(3, 700, h, hk, 96)
    plan = backward.plan_backward(shape, 80, False, num_sms=num_sms)
    heads = dict(plan.fields)["dkdv_heads"]
    group = h // hk
    assert group % heads == 0
    if group == 1:
        assert heads == 1
    (dkdv,) = _launch(plan, "flash_bwd_dkdv_kernel")
    assert dkdv.grid[1] * heads == h
    partial = heads != group
    assert ("dk_accum" in plan.scratch_dict()) == partial
    assert bool(_launch(plan, "flash_bwd_reduce_dkdv_kernel")) == partial
