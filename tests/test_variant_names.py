"""The rendered kernel names (template-argument lists) of every variant, pinned.

``tests/data/variant_names_sm{80,90}.txt`` hold the sorted names that ``all_variants`` rendered before
the plans moved to named configs and one arch table (generated from fa794ad; regenerated when kIsCausal became
kMask and kScoreMod joined the template arguments, and again when kScoreMod became a kind (bias, bias +
softcap) and kMask gained the bool-mask kind with the bias / mask tiles, both 2026-11-23; the varlen tails kernel joined, and the two mask kinds with dropout, same day; the KV-cache kernels joined, and their D96 / D128 tile became 64 keys x 3 stages, session 6; the forward's last template argument became the
mainloop kind (0 / 1 / 2) when the warp-specialized mainloop joined, session 7; the dK/dV kernel's too, session 9, the warp-specialized one for the deterministic backward; session 10, for the atomic one too; the KV-cache prefill tiles joined, branch kv-prefill-tile; session 13, the bias on the warp-specialized forward: D64 / D128 bias variants on sm_90a moved to it, D64 128 x 64 x 3 stages, D128 128 x 64 x 3; session 15, the float32 KV-cache kernel and the float32 combine
joined, and the KV-cache kernel took its panel width as a template argument: 64 for the decoding tiles; session 16,
the KV-cache kernel took kWarpsN, and the few-row decoding tiles joined: 16 rows, four warps splitting the keys;
session 17, the D128 bias (no softcap) dK/dV variants on sm_90a moved to the warp-specialized mainloop; session 18, the
dQ kernel took its mainloop kind as its last template argument, the sm_90a D256 dQ variants without a modifier, bool
mask or dropout moved to the wgmma tile 128 x 32, and their dK/dV variants to the warp-specialized mainloop; session 20, the dQ
convert took kSwizzledDq, and its swizzled variants joined on sm_90a; session 27, the D64 causal forward's 128-row
warp-specialized tile joined for heads of at most 1024 queries, forward.SHORT_CAUSAL_MAX_QUERIES; session 29, the
unmasked D256 forward's 80-key tile for heads of at least 8192 keys, forward.D256_WIDE_MIN_KEYS; session 30, the
causal one's; session 39, the D64 bias (no softcap) dK/dV variants on
sm_90a moved to the warp-specialized mainloop, but beside a bool mask or dropout, and the dbias conversion kernel
joined; session 43, the general mask's warp-specialized dK/dV variants with ordered dQ adds, mainloop kind 3, and
the forward-orientation block lists of their tile, 64 x 128, which rank those adds; then their bias variants). A
change of
any tile, warp count, stage count or wgmma choice on sm_80 or sm_90a changes this set: regenerate the
file only for a deliberate, measured tile change, and say so in the commit.
"""
from pathlib import Path

import pytest

from cuflash import build, kernels

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("arch", (80, 90))
def test_rendered_names_are_unchanged(arch):
    expected = set((DATA / f"variant_names_sm{arch}.txt").read_text().split("\n")) - {""}
    variants = kernels.all_variants(arch)
    rendered = [build.render_name(v) for v in variants]
    assert len(rendered) == len(set(rendered)) == len(variants)
    assert set(rendered) == expected
