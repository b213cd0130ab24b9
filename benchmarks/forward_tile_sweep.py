"""Forward tile sweep: times alternative (kBlockM, kBlockN, warps, stages) per head dim on this GPU.

The tile table in cuflash/kernels/forward.py cites this sweep (H200, bf16, 2026-11-21):
D64 128x128x2 beat 128x64x2 by 13-15%; D128 128x64x1 beat 128x32x2 by 10-16%; D256 kept 64x64x1.

    python benchmarks/forward_tile_sweep.py 4096      # sequence length (B = 16384 / S, H = 2048 / D)
"""
import itertools
import sys

import cupy as cp
import ml_dtypes
import numpy as np

from cuflash import build, launch
from cuflash.arrays import describe_cupy
from cuflash.kernels import KernelVariant, Launch, Plan, ProblemShape
from cuflash.kernels import forward as fwd

# (kBlockM, kBlockN, kNWarps, kStages) candidates per head-dim bucket; the first is the old default.
TILES = {
    64: [(128, 64, 4, 2), (128, 128, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2)],
    128: [(128, 32, 4, 2), (128, 64, 4, 2), (128, 64, 4, 1), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 4, 3)],
    256: [(64, 64, 4, 1), (128, 64, 8, 1), (64, 64, 4, 2)],
}


def variant(head_dim: int, tile: tuple, causal: bool) -> KernelVariant:
    block_m, block_n, warps, stages = tile
    config = fwd.FwdConfig("bfloat16", head_dim, block_m, block_n, warps, stages, causal, wgmma=False)
    return KernelVariant(fwd.SOURCE, fwd.KERNEL_NAME, config, warps * 32, fwd.smem_bytes(head_dim, block_m, block_n, stages))


def median_ms(fn, reps: int = 30) -> float:
    fn()
    cp.cuda.Device().synchronize()
    start, end, times = cp.cuda.Event(), cp.cuda.Event(), []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def main(seqlen: int) -> None:
    build.precompile("sm_90a", [variant(d, t, c) for d, tiles in TILES.items()
                                for t, c in itertools.product(tiles, (False, True))])
    device = cp.cuda.runtime.getDevice()
    stream = cp.cuda.get_current_stream()
    for head_dim, tiles in TILES.items():
        batch, heads = 16384 // seqlen, 2048 // head_dim
        make = lambda shape: cp.random.standard_normal(shape, dtype=cp.float32).astype(ml_dtypes.bfloat16)
        q, k, v = (make((batch, seqlen, heads, head_dim)) for _ in range(3))
        out, lse = cp.empty_like(q), cp.empty((batch, heads, seqlen), cp.float32)
        descs = [describe_cupy(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"))]
        for causal in (False, True):
            shape = ProblemShape(batch, seqlen, seqlen, heads, heads, head_dim, head_dim, "bfloat16", causal)
            params = launch.make_params(shape, head_dim ** -0.5, *descs)
            flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1)
            cells = []
            for tile in tiles:
                plan = Plan((Launch(variant(head_dim, tile, causal), (-(-seqlen // tile[0]), heads, batch)),))
                ms = median_ms(lambda: launch.run(plan, params, device, stream))
                cells.append("{}x{}w{}s{}: {:.0f}".format(*tile, flops / ms / 1e9))
            print(f"S{seqlen} D{head_dim} causal={causal}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
