"""``python -m cuflash compile``: build every kernel variant (or those a pattern names) and print its resources."""
from __future__ import annotations

import os
import re
import sys
import time

from . import build


def program_name(argv0: str | None = None) -> str:
    """How the command line was invoked, for help and messages: ``cuflash`` for the console script
    (its file name), ``python -m cuflash`` for the module (``sys.argv[0]`` is ``.../__main__.py``)."""
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    stem = name[:-4] if name.lower().endswith(".exe") else name
    return stem if stem.startswith("cuflash") else "python -m cuflash"


def run_compile(archs, workers=None, prog=None, match=None) -> int:
    if match is not None:
        try:
            re.compile(match)
        except re.error as exc:
            print(f"--match {match!r} is not a regular expression: {exc}", file=sys.stderr)
            return 2
    if not archs:
        try:
            archs = [build.arch_of_compute_capability(build._current_compute_capability())]
        except Exception:
            print(f"no GPU found: name the targets, e.g. {prog or program_name()} compile --arch sm_80 --arch sm_90a",
                  file=sys.stderr)
            return 2
    workers = workers or max(1, os.cpu_count() or 1)
    failed = 0
    for arch in archs:
        variants = build.variants_matching(arch, match)
        if not variants:
            print(f"{arch}: no variant matches --match {match!r}", file=sys.stderr)
            failed += 1
            continue
        start = time.perf_counter()
        try:
            results = build.precompile(arch, variants, workers=workers)
        except build.CompileError as exc:
            print(exc, file=sys.stderr)
            failed += 1
            continue
        wall = time.perf_counter() - start
        by_variant = {r.variant: r for r in results}
        print(f"\n{arch}: {len(results)} variants, {wall:.1f} s wall on {workers} workers, "
              f"{sum(r.compile_seconds for r in results):.1f} s of compiling "
              f"({sum(r.cached for r in results)} from the cache)")
        print(f"{'kernel':<96} {'regs':>5} {'smem':>7} {'spill':>6} {'stack':>6} {'sec':>5}")
        for variant in variants:
            r = by_variant[variant]
            spill = r.spill_stores + r.spill_loads
            print(f"{build.render_name(variant):<96} {r.registers:>5} {variant.smem_bytes + r.static_smem_bytes:>7} "
                  f"{spill:>6} {r.stack_bytes:>6} {r.compile_seconds:>5.1f}"
                  + ("  wgmma serialized (ptxas advisory)" if r.wgmma_serialized else ""))
        serialized = sum(r.wgmma_serialized for r in results)
        if serialized:
            print(f"{arch}: {serialized} variants with their wgmma serialized (see above)")
    return 1 if failed else 0
