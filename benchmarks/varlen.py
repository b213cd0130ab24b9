"""Ragged training batch: cuflash's packed (varlen) attention against peers on the same tokens padded.

    python benchmarks/varlen.py [--out DIR] [--sequences 16] [--min 64] [--max 4096] [--seed 0]

The batch: ``--sequences`` lengths drawn uniformly from [min, max] (seeded), H16 D128 (hidden 2048), causal,
bf16. cuflash runs ``varlen_attention_forward`` / ``varlen_attention_backward`` on the packed tokens (its
default backward and ``deterministic=True``); the peers, which take no packed input, run torch SDPA's cuDNN
and FlashAttention-2 backends (``is_causal=True``) on the same sequences padded to the longest, (B, H, Smax,
D). Useful FLOPs count only the sequences' own causal pairs, with the grid's convention (forward
``2 H D L^2`` per sequence of L tokens, i.e. 4 H L^2 D halved; forward+backward 3.5x), so the padding the
peers compute counts for nothing. Timing: ``benchmarks/bench.py``'s Timer (do_bench median, same process).
Writes ``varlen.json`` under ``--out``; prints a table with cuflash / peer ratios.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np


def _bench_module():
    path = Path(__file__).resolve().parent / "bench.py"
    spec = importlib.util.spec_from_file_location("cuflash_bench_for_varlen", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--min", type=int, default=64)
    parser.add_argument("--max", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cuflash

    bench = _bench_module()
    timer = bench.Timer()
    H, D = args.heads, args.head_dim
    lengths = np.random.default_rng(args.seed).integers(args.min, args.max + 1, size=args.sequences)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, longest = int(cu[-1]), int(lengths.max())
    useful_fwd = float(sum(2.0 * H * D * int(n) * int(n) for n in lengths))
    flops = {"fwd": useful_fwd, "fwd_bwd": 3.5 * useful_fwd}

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    q, k, v, dout = (torch.randn((total, H, D), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    cu_t = torch.from_numpy(cu).cuda()
    stream = torch.cuda.current_stream().cuda_stream

    def cf_fwd():
        return cuflash.varlen_attention_forward(q, k, v, cu_t, cu_t, longest, longest, causal=True, stream=stream)

    out, lse = cf_fwd()

    def cf_fwd_bwd(deterministic=False):
        o, l = cf_fwd()
        return cuflash.varlen_attention_backward(dout, q, k, v, o, l, cu_t, cu_t, longest, longest, causal=True,
                                                 deterministic=deterministic, stream=stream)

    # The peers' padded batch (B, H, Smax, D), built once outside the timed regions.
    def padded(x):
        y = torch.zeros((args.sequences, longest, H, D), device="cuda", dtype=x.dtype)
        for b in range(args.sequences):
            y[b, :lengths[b]] = x[cu[b]:cu[b + 1]]
        return y.transpose(1, 2).contiguous()

    qp, kp, vp, dp = (padded(x) for x in (q, k, v, dout))

    def peer(backend):
        def fwd():
            with sdpa_kernel(backend):
                return sdpa(qp, kp, vp, is_causal=True)

        leaves = [t.detach().requires_grad_() for t in (qp, kp, vp)]

        def fwd_bwd():
            with sdpa_kernel(backend):
                o = sdpa(*leaves, is_causal=True)
            return torch.autograd.grad(o, leaves, dp)

        return {"fwd": fwd, "fwd_bwd": fwd_bwd}

    impls = {
        "cuflash": {"fwd": cf_fwd, "fwd_bwd": cf_fwd_bwd, "fwd_bwd_det": lambda: cf_fwd_bwd(True)},
        "cudnn-padded": peer(SDPBackend.CUDNN_ATTENTION),
        "fa2-padded": peer(SDPBackend.FLASH_ATTENTION),
    }
    results, notes = {}, {}
    for name, fns in impls.items():
        for mode, fn in fns.items():
            try:
                ms = timer.cuda(fn)
            except Exception as exc:  # a peer that cannot run: n/a, and why
                notes[f"{name} {mode}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                continue
            results[(name, mode)] = (ms, flops["fwd" if mode == "fwd" else "fwd_bwd"] / ms / 1e9)

    print(f"ragged batch: {args.sequences} sequences, lengths {sorted(int(n) for n in lengths)}; H{H} D{D} causal "
          f"bf16; {total} tokens, padded to {longest}")
    print(f"{'impl':<14}{'fwd ms':>9}{'TFLOPS':>8}{'f+b ms':>9}{'TFLOPS':>8}{'f+b det':>9}")
    for name in impls:
        row = [f"{name:<14}"]
        for mode in ("fwd", "fwd_bwd", "fwd_bwd_det"):
            if (name, mode) in results:
                ms, tf = results[(name, mode)]
                row.append(f"{ms:9.3f}{tf:8.0f}" if mode != "fwd_bwd_det" else f"{tf:9.0f}")
            elif mode != "fwd_bwd_det" or name == "cuflash":
                row.append(f"{'n/a':>9}{'':>8}" if mode != "fwd_bwd_det" else f"{'n/a':>9}")
        print("".join(row))
    ratios = {}
    for peer_name in ("cudnn-padded", "fa2-padded"):
        for mode in ("fwd", "fwd_bwd"):
            if ("cuflash", mode) in results and (peer_name, mode) in results:
                ratios[f"{mode} vs {peer_name}"] = results[("cuflash", mode)][1] / results[(peer_name, mode)][1]
    for key, value in ratios.items():
        print(f"cuflash / {key}: {value:.2f}x")
    for key, value in notes.items():
        print(f"note: {key}: {value}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "lengths": [int(n) for n in lengths], "heads": H, "head_dim": D, "tokens": total, "padded_to": longest,
        "useful_flops_fwd": useful_fwd, "commit": bench._commit(), "device": bench._device_info(),
        "results": {f"{n} {m}": {"ms": ms, "tflops": tf} for (n, m), (ms, tf) in results.items()},
        "ratios": ratios, "notes": notes,
    }
    (out_dir / "varlen.json").write_text(json.dumps(report, indent=1))
    return 0 if ("cuflash", "fwd_bwd") in results else 1


if __name__ == "__main__":
    sys.exit(main())
