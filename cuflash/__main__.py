"""``cuflash compile [--arch ...]`` and ``cuflash bench [...]`` (or ``python -m cuflash ...``).

The benchmark's body lives in the source checkout (``benchmarks/bench.py``: it imports torch, JAX,
flash_attn and matplotlib, none of which the package needs); ``bench`` here only finds and runs it.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from .compile_cli import program_name

#: Where ``python -m cuflash bench`` looks for the benchmark: beside the package, in its checkout.
BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def load_bench(path: Path | None = None):
    """The benchmark module of the source checkout, or None when the package was installed without it
    (from a wheel)."""
    path = Path(path or BENCH_SCRIPT)
    if not path.is_file():
        return None
    module = sys.modules.get("cuflash_bench")
    if module is not None and getattr(module, "__file__", None) == str(path):
        return module
    spec = importlib.util.spec_from_file_location("cuflash_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["cuflash_bench"] = module  # dataclasses resolve their module while the file executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["cuflash_bench"]
        raise
    return module


def main(argv=None) -> int:
    prog = program_name()
    parser = argparse.ArgumentParser(prog=prog)
    sub = parser.add_subparsers(dest="command", required=True)
    compile_parser = sub.add_parser("compile", help="compile every kernel variant with NVRTC (no GPU needed)")
    compile_parser.add_argument("--arch", action="append",
                                help="target, e.g. sm_80 or sm_90a (repeatable; default: the current GPU's)")
    compile_parser.add_argument("--workers", type=int, default=None, help="parallel compiles (default: cores)")
    compile_parser.add_argument("--match", default=None, metavar="REGEX",
                                help="only the variants whose kernel name (template arguments included, as printed) "
                                     "this regular expression matches, e.g. '__nv_bfloat16, 128,'")
    sub.add_parser("bench", help="benchmark against every installed peer on this GPU", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "compile":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from .compile_cli import run_compile

        return run_compile(args.arch, args.workers, prog=prog, match=args.match)
    bench = load_bench()
    if bench is None:
        print(f"{prog} bench runs benchmarks/bench.py of a cuflash source checkout, and there is "
              f"none beside this package ({BENCH_SCRIPT} does not exist; installed from a wheel?). Clone the "
              f"repository and run it there: pip install -e . && {prog} bench", file=sys.stderr)
        return 2
    return bench.main(rest)


if __name__ == "__main__":
    sys.exit(main())
