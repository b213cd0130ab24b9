"""The command line on the CPU: the program name follows how it was invoked."""
import subprocess
import sys

import pytest

from cuflash import __main__ as cli
from cuflash.compile_cli import program_name


def test_program_name_follows_the_invocation():
    assert program_name("/venv/bin/cuflash") == "cuflash"
    assert program_name("cuflash.exe") == "cuflash"
    assert program_name("/src/cuflash/cuflash/__main__.py") == "python -m cuflash"


def test_help_names_the_console_script(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/cuflash", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: cuflash ")


def test_help_names_python_dash_m():
    done = subprocess.run([sys.executable, "-m", "cuflash", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m cuflash ")


def test_compile_match_builds_only_the_variants_it_names(capsys):
    """``compile --match REGEX`` compiles and lists only the variants whose rendered name the pattern finds."""
    from cuflash import build, kernels

    prefix = "cuflash::flash_bwd_convert_dq_kernel<__half, 64, "
    assert cli.main(["compile", "--arch", "sm_90a", "--match", r"convert_dq_kernel<__half, 64, ", "--workers", "2"]) == 0
    listed = [line[:96].rstrip() for line in capsys.readouterr().out.splitlines() if line.startswith("cuflash::")]
    expected = [build.render_name(v) for v in kernels.all_variants(90) if build.render_name(v).startswith(prefix)]
    assert len(expected) == 2 and listed == expected


def test_compile_match_rejects_a_bad_or_empty_pattern(capsys):
    assert cli.main(["compile", "--arch", "sm_90a", "--match", "("]) == 2
    assert "--match '(' is not a regular expression" in capsys.readouterr().err
    assert cli.main(["compile", "--arch", "sm_90a", "--match", "no_such_kernel"]) == 1
    assert "no variant matches" in capsys.readouterr().err


def test_gpu_tests_precompile_only_what_a_pattern_names(monkeypatch):
    """CUFLASH_TEST_PRECOMPILE: 1 (default) compiles every variant before the GPU tests, 0 none, and any other value
    is a pattern: only the variants whose rendered name it matches (tests/gpu_utils.py precompile_once)."""
    import gpu_utils as gu
    from cuflash import build, kernels

    seen = []
    monkeypatch.setattr(build, "_current_compute_capability", lambda: 90)
    monkeypatch.setattr(build, "precompile",
                        lambda arch, variants: seen.append((arch, [build.render_name(v) for v in variants])) or [])
    monkeypatch.setenv("CUFLASH_TEST_PRECOMPILE", r"preprocess_kernel<__half, 128,")
    assert gu.precompile_once.__wrapped__().startswith("precompiled 0 kernel variants")
    assert seen == [("sm_90a", ["cuflash::flash_bwd_preprocess_kernel<__half, 128, 64, 4>"])]
    monkeypatch.setenv("CUFLASH_TEST_PRECOMPILE", "1")
    gu.precompile_once.__wrapped__()
    assert len(seen[-1][1]) == len(kernels.all_variants(90))
    monkeypatch.setenv("CUFLASH_TEST_PRECOMPILE", "0")
    assert gu.precompile_once.__wrapped__() == "precompile skipped (CUFLASH_TEST_PRECOMPILE=0)"
    assert len(seen) == 2
