"""Plans (no GPU): how many query heads a dK/dV block accumulates, and the scratch and launches that follow
from it; the forward's mainloop and grid."""
import pytest

from cuflash import kernels
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
    (reduce,) = _launch(plan, "flash_bwd_reduce_dkdv_kernel")
    assert reduce.variant.config.block_rows == 4 and reduce.grid == (256, 1, 2)  # one 8-column chunk per thread


@pytest.mark.parametrize("bucket", [32, 64, 96, 128, 160, 192, 224, 256])
def test_reduce_blocks_cover_the_keys_with_a_chunk_per_thread(bucket):
    """The GQA reduce: each of its threads sums one 8-column chunk of dK and of dV (at most one per thread, all
    of them but for the buckets that do not divide 1024), and its blocks cover every key row (odd Sk too)."""
    v = backward.reduce_dkdv_variant("bfloat16", bucket)
    rows, chunks = v.config.block_rows, bucket // 8
    assert rows * chunks <= v.threads and (rows + 1) * chunks > v.threads
    shape = ProblemShape(1, 999, 777, 6, 2, bucket, bucket, "bfloat16", False)
    plan = backward.plan_backward(shape, 90, False, num_sms=132)
    (item,) = _launch(plan, "flash_bwd_reduce_dkdv_kernel")  # one query head per block: partials, reduced
    assert item.grid[0] * rows >= 777 > (item.grid[0] - 1) * rows and item.grid[1:] == (2, 1)


@pytest.mark.parametrize("deterministic", [False, True])
def test_causal_merges_heads_only_where_blocks_go_longest_first(deterministic):
    # The causal triangle: merged heads lengthen the longest blocks. The warp-specialized kernel dispatches them
    # longest first (chunked_grid_order), so GQA 32/8 at S4k takes its whole group (the longest block, 4 x 64
    # steps, stays under an SM's share, 1024); its ordered dQ adds (deterministic) keep the grid's order: one head.
    plan = backward.plan_backward(_shape(4, 4096, 32, 8, 128, causal=True), 90, deterministic, num_sms=132)
    assert dict(plan.fields)["dkdv_heads"] == (1 if deterministic else 4)
    assert bool(_launch(plan, "flash_bwd_reduce_dkdv_kernel")) == deterministic
    # The MQA shape: 16 key blocks of 16 steps at most, 2 x 8 heads; two heads would double the longest block
    # (32 steps) past an SM's share (~16.5).
    plan = backward.plan_backward(_shape(2, 1024, 8, 1, 256, causal=True), 90, deterministic, num_sms=132)
    assert dict(plan.fields)["dkdv_heads"] == 1
    # Without the warp-specialized kernel (sm_80): one head per block.
    plan = backward.plan_backward(_shape(4, 4096, 32, 8, 128, causal=True), 80, deterministic, num_sms=108)
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


# --- the forward's mainloop choice and grid (cuflash/kernels/forward.py) -------------------------------------

@pytest.mark.parametrize("seqlen, causal, block_m", [(1024, True, 128), (1000, True, 128), (1025, True, 192),
                                                     (4096, True, 192), (1024, False, 192)])
def test_d64_short_causal_heads_take_the_128_row_tile(seqlen, causal, block_m):
    """D64 on sm_90a: causal heads of at most SHORT_CAUSAL_MAX_QUERIES queries run the 128-row warp-specialized
    tile (eight full blocks at 1024 instead of six 192-row ones, the last a third full); longer, unmasked or
    packed heads keep 192 rows, and other head dims their own tile."""
    from cuflash.kernels import forward

    def fwd(shape):
        return [launch for launch in kernels.plan_forward(shape, 90, num_sms=132).launches
                if launch.variant.name == forward.KERNEL_NAME][0].variant.config

    config = fwd(kernels.ProblemShape(16, seqlen, seqlen, 16, 16, 64, 64, "bfloat16", causal))
    assert config.mainloop == forward.MAINLOOP_SM90_WS and config.block_m == block_m
    assert config.num_warps == block_m // 16
    assert fwd(kernels.ProblemShape(16, seqlen, seqlen, 8, 8, 128, 128, "bfloat16", causal)).block_m == 128
    packed = kernels.ProblemShape(4, 1024, 1024, 16, 16, 64, 64, "bfloat16", True, packed=True, total_q=4096,
                                  total_k=4096)
    assert fwd(packed).block_m == 128 and fwd(packed).mask != kernels.MASK_CAUSAL  # packed: the general mask's tile


@pytest.mark.parametrize("bucket", (64, 128, 256))
@pytest.mark.parametrize("mask", kernels.MASK_KINDS)
@pytest.mark.parametrize("score_mod", kernels.SCORE_MODS)
def test_warp_specialized_mainloop_where_it_fits(bucket, mask, score_mod):
    """sm_90a picks the warp-specialized mainloop exactly where ws_fits says; it runs a producer warpgroup on
    top of 8 compute warps (12 and 192 query rows for D64 without a general mask or score modifier) and never
    exceeds the block's shared memory."""
    from cuflash.kernels import forward

    v = forward.variant("bfloat16", bucket, mask, 90, score_mod)
    ws = forward.ws_fits(bucket, mask, score_mod)
    assert (v.config.mainloop == forward.MAINLOOP_SM90_WS) == ws
    if ws:
        three = bucket == 64 and mask in (kernels.MASK_NONE, kernels.MASK_CAUSAL) and score_mod == kernels.MOD_NONE
        warps = 12 if three else 8
        assert v.threads == 32 * warps + 128 and v.config.num_warps == warps and v.config.block_m == 16 * warps
        assert v.smem_bytes <= forward.WS_SMEM_LIMIT
    # Never on an arch without wgmma.
    assert forward.variant("bfloat16", bucket, mask, 80, score_mod).config.mainloop == forward.MAINLOOP_SM80


@pytest.mark.parametrize("seqlen_k, causal, block_n", [(8192, False, 80), (16384, False, 80), (8191, False, 64),
                                                      (1024, False, 64), (16384, True, 80), (8192, True, 80),
                                                      (8191, True, 64)])
def test_long_d256_heads_take_the_80_key_tile(seqlen_k, causal, block_n):
    """forward.D256_WIDE_MIN_KEYS: unmasked and causal D256 heads of at least 8192 keys take 128 x 80
    (FlashAttention-3's tile); shorter heads keep 64 keys, and other head dims never change. The tile fits the block
    with O in Q's tile, and its K / V boxes are whole tiles (80 rows: 64 do not divide it)."""
    from cuflash import tma
    from cuflash.kernels import forward

    shape = kernels.ProblemShape(1, 300, seqlen_k, 8, 8, 256, 256, "bfloat16", causal)
    (launch,) = kernels.plan_forward(shape, 90, num_sms=132).launches
    assert launch.variant.config.block_n == block_n and launch.variant.config.mainloop == forward.MAINLOOP_SM90_WS
    assert launch.variant.smem_bytes <= forward.WS_SMEM_LIMIT
    assert tma.kv_box(block_n) == ((64, 1, 80, 1) if block_n == 80 else tma.BSHD_BOX)
    for bucket in (64, 128):
        other = kernels.ProblemShape(1, 300, seqlen_k, 8, 8, bucket, bucket, "bfloat16", causal)
        assert kernels.plan_forward(other, 90).launches[-1].variant.config.block_n % 64 == 0
    assert kernels.plan_forward(shape, 80).launches[-1].variant.config.block_n % 16 == 0


@pytest.mark.parametrize("dims", [(1, 190, 8269, 2, 1, 256, "bfloat16", False), (2, 70, 8192, 2, 2, 232, "float16", False),
                                  (1, 300, 8269, 2, 1, 256, "bfloat16", True)])
def test_long_key_tma_test_problems_plan_the_80_key_tile(dims):
    """The long-key problems of test_tma_gpu's Q / K / V test take the warp-specialized 80-key tile, whose K / V
    boxes they are there to check (session 30: a D200 problem there planned the 224 bucket's cp.async kernel)."""
    from cuflash import launch
    from cuflash.kernels import forward

    b, sq, sk, h, hkv, d, dtype, causal = dims
    plan = kernels.plan_forward(kernels.ProblemShape(b, sq, sk, h, hkv, d, d, dtype, causal), 90, num_sms=132)
    (only,) = plan.launches
    assert only.variant.config.block_n == 80 and only.variant.config.mainloop == forward.MAINLOOP_SM90_WS
    assert launch._reads_qkv_maps(plan) and launch._qkv_boxes(plan)["k"] == (64, 1, 80, 1)


def test_forward_grid_is_persistent_for_equal_tiles_and_causal_pairs():
    """Unmasked: min(tiles, SMs) CTAs walk the tiles; causal: where the tiles fit one wave, one CTA per tile,
    else min(pairs, SMs) CTAs walk pairs of a head's j-th longest and j-th shortest query blocks (equal work);
    causal heads of more than PAIRED_MAX_QUERY_BLOCKS query blocks: one CTA per tile in a one-dimensional grid;
    the general mask (uneven tiles, packed sequences too): min(tiles, SMs) CTAs taking tiles from a queue; other
    mainloops keep the (query blocks, H, B) grid."""
    from cuflash.kernels import forward

    def grid(causal, seqlen=1024, batch=16, heads=16, head_dim=128, arch=90, num_sms=132):
        shape = kernels.ProblemShape(batch, seqlen, seqlen, heads, heads, head_dim, head_dim, "bfloat16", causal)
        return kernels.plan_forward(shape, arch, num_sms=num_sms).launches[-1].grid

    assert grid(False) == (132, 1, 1)
    assert grid(False, num_sms=114) == (114, 1, 1)
    assert grid(False, seqlen=100, batch=1, heads=2) == (2, 1, 1)  # fewer tiles than SMs
    assert grid(True) == (132, 1, 1)  # 4 pairs x 256 heads
    assert grid(True, seqlen=300, batch=1, heads=2) == (6, 1, 1)  # 6 tiles, one wave: one CTA per tile
    assert grid(True, seqlen=300, batch=1, heads=2, num_sms=4) == (4, 1, 1)  # a pair and a middle one a head
    assert grid(True, seqlen=128, batch=1, heads=2) == (2, 1, 1)  # one query block: single tiles
    # MQA 8/1 D256 S1k B2 (the grid's cell): 128 tiles fit one wave, where 64 pairs would idle half the SMs
    assert grid(True, batch=2, heads=8, head_dim=256) == (128, 1, 1)
    assert grid(True, batch=4, heads=8, head_dim=256) == (128, 1, 1)  # 256 tiles, two waves: 128 pairs
    assert grid(True, batch=5, heads=8, head_dim=256) == (132, 1, 1)  # 160 pairs: persistent over pairs
    assert grid(True, seqlen=64 * 128, batch=1, heads=16) == (132, 1, 1)  # 64 query blocks a head: pairs
    assert grid(True, seqlen=65 * 128, batch=1, heads=16) == (65 * 16, 1, 1)  # longer: one CTA per tile
    packed = kernels.ProblemShape(4, 1024, 1024, 16, 16, 128, 128, "bfloat16", True, packed=True, total_q=4096,
                                  total_k=4096)
    fwd = [launch for launch in kernels.plan_forward(packed, 90, num_sms=132).launches
           if launch.variant.name == "cuflash::flash_fwd_kernel"]
    assert [launch.grid for launch in fwd] == [(132, 1, 1)]  # packed: the general mask's queue
    few = kernels.ProblemShape(1, 300, 300, 2, 2, 128, 128, "bfloat16", False, general_mask=True)
    assert kernels.plan_forward(few, 90, num_sms=132).launches[-1].grid == (6, 1, 1)  # 3 x 2 tiles
    assert grid(False, head_dim=96) == (8, 16, 16)  # mma.sync: no warp-specialized tile at D96
    assert grid(True, arch=80) == (8, 16, 16)


@pytest.mark.parametrize("bucket", (64, 128, 256))
@pytest.mark.parametrize("mask", kernels.MASK_KINDS)
@pytest.mark.parametrize("score_mod", kernels.SCORE_MODS)
@pytest.mark.parametrize("atomic", (True, False))
def test_warp_specialized_dkdv_mainloop_where_it_fits(bucket, mask, score_mod, atomic):
    """sm_90a's dK/dV kernel takes the warp-specialized mainloop exactly where ws_fits says (D64 / D128 / D256
    without a bool mask, dropout or modifier, and D128 with a bias alone); its shared memory fits. With a bias on the
    atomic path the bias tiles live in the dS tiles: the same bytes as the variant without a bias."""
    v = backward.dkdv_variant(90, "bfloat16", bucket, mask, atomic, score_mod)
    ws = backward.ws_fits(bucket, mask, score_mod) and backward.uses_wgmma(90, bucket, score_mod)
    assert (v.config.mainloop == backward.MAINLOOP_SM90_WS) == ws
    assert v.smem_bytes <= 227 * 1024
    if ws:
        assert v.threads == 8 * 32 + backward.PRODUCER_THREADS
        plain = backward.dkdv_variant(90, "bfloat16", bucket, mask, atomic, kernels.MOD_NONE)
        if kernels.has_bias(score_mod) and not atomic:  # DkdvConfig's own two staged tiles, padded rows
            assert v.smem_bytes == plain.smem_bytes + 2 * v.config.block_m * (v.config.block_n * 2 + 16)
        else:
            assert v.smem_bytes == plain.smem_bytes
    assert (score_mod != kernels.MOD_BIAS or bucket != 128 or mask not in (0, 1, 2)) or ws
    assert backward.dkdv_variant(80, "bfloat16", bucket, mask, atomic, score_mod).config.mainloop == backward.MAINLOOP_SM80


def test_deterministic_bias_backward_orders_the_dq_adds_on_sm90():
    """A D128 bias (no softcap) without a mask, causal, or under a window / ids: the deterministic backward runs the
    warp-specialized dK/dV kernel with its ordered dQ adds, as without the bias (under a general mask its ordered
    variant, with the block lists of both orientations); with a softcap too (mma.sync) or a bool mask (the 8-warp
    wgmma tile) it keeps the dQ kernel."""
    shape = ProblemShape(2, 1000, 777, 8, 2, 128, 128, "bfloat16", True, score_mod=kernels.MOD_BIAS)
    names = [launch.variant.name for launch in kernels.plan_backward(shape, 90, True).launches]
    assert "cuflash::flash_bwd_dq_kernel" not in names
    general = ProblemShape(2, 1000, 777, 8, 2, 128, 128, "bfloat16", True, score_mod=kernels.MOD_BIAS,
                           general_mask=True)
    plan = kernels.plan_backward(general, 90, True)
    names = [launch.variant.name for launch in plan.launches]
    assert "cuflash::flash_bwd_dq_kernel" not in names and names.count("cuflash::flash_block_lists_kernel") == 2
    dkdv = next(launch.variant for launch in plan.launches if launch.variant.name == "cuflash::flash_bwd_dkdv_kernel")
    assert dkdv.config.mainloop == backward.MAINLOOP_SM90_WS_ORDERED
    for other in (dict(score_mod=kernels.MOD_BIAS_SOFTCAP), dict(score_mod=kernels.MOD_BIAS, bool_mask=True)):
        shape = ProblemShape(2, 1000, 777, 8, 2, 128, 128, "bfloat16", True, general_mask=True, **other)
        names = [launch.variant.name for launch in kernels.plan_backward(shape, 90, True).launches]
        assert "cuflash::flash_bwd_dq_kernel" in names, other


@pytest.mark.parametrize("arch", (80, 86, 90))
def test_dq_accum_slack_covers_every_dkdv_query_block(arch):
    """The wgmma dQ step adds whole query blocks with no bounds test, into rows the pre-pass zeroed up to a
    multiple of DQ_ACCUM_BLOCK_ROWS and into the buffer's slack of that many rows: every dK/dV block must fit
    (the C++ side static_asserts the same against kDqAccumBlockRows)."""
    blocks = {v.config.block_m for v in backward.all_variants(arch) if v.name == "cuflash::flash_bwd_dkdv_kernel"}
    assert blocks and all(backward.DQ_ACCUM_BLOCK_ROWS % m == 0 for m in blocks), blocks
    shape = ProblemShape(2, 100, 90, 8, 2, 128, 128, "bfloat16", True)
    plan = backward.plan_backward(shape, arch, deterministic=False)
    scratch = dict(plan.scratch)
    rows = 2 * 8 * 100 + backward.DQ_ACCUM_BLOCK_ROWS
    counter_rows = 0 if arch != 90 else 1  # sm_90a: the first stores' 2 x 8 x 2 counters, one more row
    assert scratch["dq_accum"] == (rows + counter_rows, 128)
    if not backward.ordered_dq_fits(arch, 128, shape.mask_kind, 0):  # else its ordered adds use dq_accum too
        assert "dq_accum" not in dict(backward.plan_backward(shape, arch, deterministic=True).scratch)


@pytest.mark.parametrize("bucket", (64, 128))
@pytest.mark.parametrize("mask", ("none", "causal", "general"))
def test_deterministic_backward_orders_the_dq_adds_on_sm90(bucket, mask):
    """sm_90a, no mask, causal or a general mask (no bias), D64 / D128: the deterministic backward runs the
    warp-specialized dK/dV kernel with its dQ step (ordered adds) and the convert kernel, no dQ kernel; the
    counters follow dq_accum's rows and slack in the same buffer, one per (batch, head, query block), and fit
    it. Under a general mask the block lists come in both orientations of the dK/dV tile: the transposed ones it
    walks, and the query blocks' ones that rank its adds."""
    shape = ProblemShape(3, 1000, 777, 8, 2, bucket, bucket, "bfloat16", mask == "causal",
                         general_mask=mask == "general")
    plan = kernels.plan_backward(shape, 90, True)
    lists = [launch for launch in plan.launches if launch.variant.name.endswith("flash_block_lists_kernel")]
    dkdv = next(launch.variant for launch in plan.launches if launch.variant.name == "cuflash::flash_bwd_dkdv_kernel")
    block_m, block_n = dkdv.config.block_m, dkdv.config.block_n
    if mask == "general":
        tiles = {(v.config.outer, v.config.inner, v.config.transposed) for v in (l.variant for l in lists)}
        assert tiles == {(block_m, block_n, False), (block_n, block_m, True)} and len(lists) == 2
        assert dict(plan.fields)["kv_blocks_rows"] == -(-1000 // block_m)
    else:
        assert not lists
    names = [launch.variant.name for launch in plan.launches]
    assert "cuflash::flash_bwd_dq_kernel" not in names and "cuflash::flash_bwd_convert_dq_kernel" in names
    ordered_kind = backward.MAINLOOP_SM90_WS_ORDERED if mask == "general" else backward.MAINLOOP_SM90_WS
    assert dkdv.config.atomic_dq and dkdv.config.mainloop == ordered_kind
    fields = dict(plan.fields)
    rows, width = backward.dq_accum_shape(shape, bucket)
    blocks = -(-shape.seqlen_q // dkdv.config.block_m)
    assert fields["dq_order_offset"] == rows * width and fields["dq_order_blocks"] == blocks
    total_rows, total_width = dict(plan.scratch)["dq_accum"]
    assert total_width == width and (total_rows - rows) * width >= shape.batch * shape.num_heads * blocks
    assert fields["dq_ordered"] == 1 and fields["dq_order_rows"] == dkdv.config.block_m
    # The atomic backward: the same counters, for its first stores (unordered adds); under a general mask the
    # kernel without the ordered path.
    default_plan = kernels.plan_backward(shape, 90, False)
    default = dict(default_plan.fields)
    default_dkdv = next(launch.variant for launch in default_plan.launches
                        if launch.variant.name == "cuflash::flash_bwd_dkdv_kernel")
    assert default_dkdv.config.mainloop == backward.MAINLOOP_SM90_WS
    assert default["dq_ordered"] == 0 and default["dq_order_offset"] == rows * width


@pytest.mark.parametrize("arch", (80, 90))
@pytest.mark.parametrize("bucket", (64, 128, 256))
@pytest.mark.parametrize("mask", ("none", "causal", "general", "packed"))
@pytest.mark.parametrize("bias", (False, True))
def test_default_backward_plans_first_stores_where_the_dq_is_staged(arch, bucket, mask, bias):
    """The default backward's counters (dq_order.cuh's first stores: the pre-pass then leaves dq_accum unzeroed)
    come exactly with a dK/dV kernel that stages its dQ tiles for the producer's bulk adds, on the batched layout:
    a kernel that adds from registers (sm_80, the 8-warp wgmma one, D256's) needs a zeroed dq_accum. Their
    blocks are whole blocks of the convert's rows, and the buffer holds them after dq_accum's rows and slack."""
    shape = ProblemShape(2, 300, 277, 4, 2, bucket, bucket, "bfloat16", mask == "causal",
                         general_mask=mask in ("general", "packed"), packed=mask == "packed", total_q=600,
                         total_k=554, score_mod=kernels.MOD_BIAS if bias else 0)
    try:
        plan = kernels.plan_backward(shape, arch, False)
    except ValueError:  # a bias this arch / head dim has no kernel for
        return
    dkdv = next(launch.variant for launch in plan.launches if launch.variant.name == "cuflash::flash_bwd_dkdv_kernel")
    fields = dict(plan.fields)
    staged = backward.stages_dq(dkdv) and mask != "packed"
    assert ("dq_order_offset" in fields) == staged
    if staged:
        assert arch == 90 and fields["dq_ordered"] == 0
        assert fields["dq_order_rows"] == dkdv.config.block_m and dkdv.config.block_m % backward.SMALL_BLOCK_ROWS == 0
        rows, width = backward.dq_accum_shape(shape, bucket)
        total_rows, _ = dict(plan.scratch)["dq_accum"]
        assert fields["dq_order_offset"] == rows * width
        assert (total_rows - rows) * width >= 2 * 4 * fields["dq_order_blocks"]


@pytest.mark.parametrize("arch, bucket, general, packed", [(80, 128, False, False), (90, 256, False, False),
                                                           (90, 64, False, True)])
def test_deterministic_backward_keeps_the_dq_kernel_elsewhere(arch, bucket, general, packed):
    """sm_80, D256 and packed sequences: the dQ kernel of its own, no counters."""
    shape = ProblemShape(2, 300, 300, 4, 4, bucket, bucket, "bfloat16", True, general_mask=general, packed=packed,
                         total_q=600, total_k=600)
    plan = kernels.plan_backward(shape, arch, True)
    assert "cuflash::flash_bwd_dq_kernel" in [launch.variant.name for launch in plan.launches]
    assert "dq_order_offset" not in dict(plan.fields)


def test_forward_lists_carry_the_tile_queue_counter():
    """The query-block lists (forward, dQ) end with one more int, the warp-specialized forward's tile counter
    that their pre-pass zeroes (params.cuh fwd_tile_counter: after B x mask heads x rows x stride ints); the
    key-block lists (dK / dV) do not."""
    from cuflash.kernels import block_lists

    _, (field, shape), fields = block_lists.lists_for(3, 300, 500, 128, 128, False, heads=2, id_ranges=False)
    rows, stride = dict(fields)["kv_blocks_rows"], dict(fields)["kv_blocks_stride"]
    assert field == "kv_blocks" and (rows, stride) == (3, 5)
    assert shape == (3 * 2 * rows * stride + 1,)
    _, (field, shape), fields = block_lists.lists_for(3, 300, 500, 64, 128, True, heads=2, id_ranges=False)
    assert field == "q_blocks" and shape == (3 * 2 * dict(fields)["q_blocks_rows"] * dict(fields)["q_blocks_stride"],)


def test_batched_lists_carry_the_id_ranges():
    """In the batched layout each list buffer ends with the id ranges (params.cuh IdRanges): B flags, one int of
    alignment slack, then an int pair per outer row (query rows for kv_blocks, keys for q_blocks). Packed
    sequences (no ids) carry none."""
    from cuflash.kernels import block_lists

    _, (_, shape), fields = block_lists.lists_for(3, 300, 500, 128, 128, False, heads=2)
    lists = 3 * 2 * dict(fields)["kv_blocks_rows"] * dict(fields)["kv_blocks_stride"]
    assert shape == (lists + 1 + 3 + 1 + 2 * 3 * 300,)
    _, (_, shape), fields = block_lists.lists_for(3, 300, 500, 64, 128, True, heads=2)
    lists = 3 * 2 * dict(fields)["q_blocks_rows"] * dict(fields)["q_blocks_stride"]
    assert shape == (lists + 3 + 1 + 2 * 3 * 500,)
    for packed, extra in ((False, 3 + 1 + 2 * 3 * 300), (True, 0)):
        shape = ProblemShape(3, 300, 500, 4, 4, 128, 128, "bfloat16", False, general_mask=True, packed=packed,
                             total_q=900, total_k=1500)
        plan = kernels.plan_forward(shape, 90)
        size = dict(plan.scratch)["kv_blocks"][0]
        rows, stride = dict(plan.fields)["kv_blocks_rows"], dict(plan.fields)["kv_blocks_stride"]
        assert size == 3 * rows * stride + 1 + extra, packed


@pytest.mark.parametrize("mask_kw", ({}, {"general_mask": True}), ids=("analytic", "general"))
@pytest.mark.parametrize("causal", (False, True))
def test_d256_backward_splits_dq_on_sm90(causal, mask_kw):
    """sm_90a, D256 without a modifier: both backward modes run one plan, the warp-specialized dK/dV kernel without
    a dQ step and then the wgmma dQ kernel (no dq_accum, no convert); sm_80 keeps the atomic dQ step; a softcap
    keeps it on sm_90a too (its dQ kernel is the mma.sync one)."""
    shape = ProblemShape(2, 1000, 777, 8, 2, 256, 256, "bfloat16", causal, **mask_kw)
    default = kernels.plan_backward(shape, 90, False)
    assert default == kernels.plan_backward(shape, 90, True)
    by_name = {launch.variant.name: launch.variant for launch in default.launches}
    assert by_name["cuflash::flash_bwd_dkdv_kernel"].config.mainloop == backward.MAINLOOP_SM90_WS
    assert not by_name["cuflash::flash_bwd_dkdv_kernel"].config.atomic_dq
    dq = by_name["cuflash::flash_bwd_dq_kernel"]
    assert dq.config.mainloop == backward.DQ_MAINLOOP_SM90 and (dq.config.block_m, dq.config.block_n) == (128, 32)
    assert "cuflash::flash_bwd_convert_dq_kernel" not in by_name and "dq_accum" not in dict(default.scratch)
    ampere = {launch.variant.name: launch.variant for launch in kernels.plan_backward(shape, 80, False).launches}
    assert ampere["cuflash::flash_bwd_dkdv_kernel"].config.atomic_dq and "cuflash::flash_bwd_dq_kernel" not in ampere
    softcap = ProblemShape(2, 1000, 777, 8, 2, 256, 256, "bfloat16", causal, score_mod=kernels.MOD_SOFTCAP_ALIBI,
                           **mask_kw)
    names = [launch.variant.name for launch in kernels.plan_backward(softcap, 90, False).launches]
    assert "cuflash::flash_bwd_dq_kernel" not in names and "cuflash::flash_bwd_convert_dq_kernel" in names


@pytest.mark.parametrize("arch, bucket, kw, swizzled", [
    (90, 128, {}, True), (90, 64, dict(causal=True), True), (90, 128, dict(deterministic=True), True),
    (90, 128, dict(score_mod=kernels.MOD_BIAS), True),  # the bias staged in the dS tiles: the same dQ staging
    (90, 128, dict(score_mod=kernels.MOD_SOFTCAP_ALIBI), False),  # the 8-warp wgmma mainloop: atomics, row-major
    (90, 96, {}, False), (80, 128, {}, False), (80, 64, dict(deterministic=True), None)])
def test_dq_convert_reads_the_order_its_dkdv_kernel_wrote(arch, bucket, kw, swizzled):
    """The warp-specialized dK/dV kernel stages dQ in dq_accum_chunk's order; the convert after it reads that
    order (kSwizzledDq), every other dQ writer's convert reads row-major; a plan with a dQ kernel has none."""
    deterministic = kw.get("deterministic", False)
    shape = ProblemShape(2, 1000, 1000, 4, 2, bucket, bucket, "bfloat16", kw.get("causal", False),
                         score_mod=kw.get("score_mod", 0))
    plan = backward.plan_backward(shape, arch, deterministic, num_sms=132)
    (dkdv,) = _launch(plan, "flash_bwd_dkdv_kernel")
    converts = _launch(plan, "flash_bwd_convert_dq_kernel")
    if swizzled is None:
        assert not converts and _launch(plan, "flash_bwd_dq_kernel")
        return
    (convert,) = converts
    assert convert.variant.config.swizzled is swizzled is backward.stages_dq(dkdv.variant)
    assert (dkdv.variant.config.mainloop == backward.MAINLOOP_SM90_WS) is swizzled
