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
