"""``cuflash compile [--arch ...]`` and ``cuflash bench [...]`` (or ``python -m cuflash ...``)."""
from __future__ import annotations

import argparse
import sys

from .compile_cli import program_name


def main(argv=None) -> int:
    prog = program_name()
    parser = argparse.ArgumentParser(prog=prog)
    sub = parser.add_subparsers(dest="command", required=True)
    compile_parser = sub.add_parser("compile", help="compile every kernel variant with NVRTC (no GPU needed)")
    compile_parser.add_argument("--arch", action="append",
                                help="target, e.g. sm_80 or sm_90a (repeatable; default: the current GPU's)")
    compile_parser.add_argument("--workers", type=int, default=None, help="parallel compiles (default: cores)")
    sub.add_parser("bench", help="benchmark against every installed peer on this GPU", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "compile":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from .compile_cli import run_compile

        return run_compile(args.arch, args.workers, prog=prog)
    from .bench import main as bench_main

    return bench_main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
