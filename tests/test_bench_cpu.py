"""CPU checks of the bench's report side (table, plot, CLI, exit codes): no GPU, synthetic results.

The bench lives in benchmarks/bench.py; it is loaded here the way ``python -m cuflash bench`` loads it.
"""
import json

import pytest

from cuflash import __main__ as cli

bench = cli.load_bench()


def _cell(name, memory=False, cuflash=None, peers=None):
    results = {"cuflash": dict(cuflash or {})}
    results.update(peers or {})
    return {"name": name, "memory": memory, "results": results, "output_check": {}}


def _report(det=True, via_torch=False):
    cf = {"fwd_tflops": 300.0, "fwd_bwd_tflops": 200.0}
    if via_torch:
        cf.update({"fwd_bwd_torch_tflops": 190.0, "fwd_bwd_torch_ratio": 0.95})
    if det:
        cf.update({"fwd_bwd_det_tflops": 150.0, "fwd_bwd_det_ratio": 0.75, "fwd_bwd_det_grad_difference": 0.004})
    peers = {"torch-cudnn": {"fwd_tflops": 400.0, "fwd_bwd_tflops": 320.0},
             "torch-fa2": {"fwd_tflops": 280.0, "fwd_bwd_tflops": 240.0}}
    mqa = dict(cf, fwd_bwd_peak_mib=10.0)
    if det:
        mqa.pop("fwd_bwd_det_tflops")
        mqa["fwd_bwd_det_note"] = "n/a (deterministic=True): RuntimeError: boom"
    if via_torch:
        mqa.pop("fwd_bwd_torch_tflops")
        mqa.pop("fwd_bwd_torch_ratio")
        mqa["fwd_bwd_torch_note"] = "n/a (via torch): ImportError: no torch adapter"
    return {"meta": {"device": {"name": "Fake GPU"}}, "implementations": ["cuflash", "torch-cudnn", "torch-fa2"],
            "cells": [_cell("D128-S4k-causal", cuflash=cf, peers=peers),
                      _cell("MQA8/1-D256-S1k-B2-full", memory=True, cuflash=mqa, peers=peers)]}


def _section(text, title):
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"cell ({title}, TFLOPS)"))
    end = lines.index("", start) if "" in lines[start:] else len(lines)
    return lines[start:end]


def test_forward_table_unchanged_by_deterministic():
    assert _section(bench.table(_report(True)), "forward") == _section(bench.table(_report(False)), "forward")


def test_fwd_bwd_table_has_det_columns_after_the_existing_ones():
    with_det = _section(bench.table(_report(True)), "forward+backward")
    without = _section(bench.table(_report(False)), "forward+backward")
    head, head0 = with_det[0], without[0]
    prefix = head0.split("  peak MiB")[0]
    assert head.startswith(prefix + f"{'cf-det':>8s}{'det/cf':>9s}")
    assert head.endswith("  peak MiB (cuflash / cuDNN / FA2)")
    row, row0 = with_det[2], without[2]
    assert row.startswith(row0) and row[len(row0):] == "     150    0.75x"
    assert len(row) == len(prefix) + 17  # columns line up with the header
    mqa = with_det[3]
    assert "     n/a        -  10 / n/a / n/a" in mqa  # det failed: n/a, no ratio; memory column still there


def test_no_det_columns_without_det_results():
    text = bench.table(_report(False))
    assert "cf-det" not in text and "det/cf" not in text and "deterministic check" not in text


def test_det_notes_and_check_lines():
    text = bench.table(_report(True))
    assert "cuflash: n/a (deterministic=True): RuntimeError: boom" in text
    assert "deterministic check" in text and "WARNING" not in text
    report = _report(True)
    report["cells"][0]["results"]["cuflash"]["fwd_bwd_det_grad_difference"] = 0.5
    assert "WARNING: cuflash's deterministic gradients" in bench.table(report)


def test_det_flops_equal_fwd_bwd():
    cell = bench.all_cells()[0]
    assert cell.flops(bench.DET_MODE) == cell.flops("fwd_bwd") == 3.5 * cell.flops("fwd")


def test_modes():
    assert bench.modes_of("cuflash") == ("fwd", "fwd_bwd", "fwd_bwd_det")
    assert bench.modes_of("cuflash", deterministic=False) == bench.MODES
    assert bench.modes_of("torch-fa2") == bench.MODES
    assert bench.modes_of("cuflash", via_torch=True) == ("fwd", "fwd_bwd", "fwd_bwd_torch", "fwd_bwd_det")
    assert bench.modes_of("torch-fa2", via_torch=True) == bench.MODES


def test_torch_flops_equal_fwd_bwd():
    cell = bench.all_cells()[0]
    assert cell.flops(bench.TORCH_MODE) == cell.flops("fwd_bwd")


@pytest.mark.parametrize("det", (True, False))
def test_fwd_bwd_table_has_via_torch_columns(det):
    with_torch = _section(bench.table(_report(det, via_torch=True)), "forward+backward")
    without = _section(bench.table(_report(det)), "forward+backward")
    head, head0 = with_torch[0], without[0]
    # cf-torch right after the cuflash column, torch/cf right after cf/best; everything else unchanged
    assert head == head0.replace("cuflash", "cuflash" + f"{'cf-torch':>9s}", 1).replace(
        "cf/best", "cf/best" + f"{'torch/cf':>9s}", 1)
    row, row0 = with_torch[2], without[2]
    cuflash_end = 34 + 8  # the cell name, then one 8-wide column
    best_end = 34 + 8 * 3 + 9 * 3  # cell, cuflash / cuDNN / FA2, then cf/cuDNN, cf/FA2, cf/best
    assert row == row0[:cuflash_end] + "      190" + row0[cuflash_end:best_end] + "    0.95x" + row0[best_end:]
    for line, line0 in zip(with_torch, without, strict=True):
        assert len(line) == len(line0) + 18  # every row and the rule line up with the header
    mqa = with_torch[3]
    assert mqa[cuflash_end:cuflash_end + 9] == "      n/a"  # via torch failed: n/a, no ratio
    assert mqa[best_end + 9:best_end + 18] == "        -"
    forward = _section(bench.table(_report(det, via_torch=True)), "forward")
    assert forward == _section(bench.table(_report(det)), "forward")  # forward table unchanged


def test_via_torch_note_and_absence():
    text = bench.table(_report(True, via_torch=True))
    assert "cuflash: n/a (via torch): ImportError: no torch adapter" in text
    assert "cf-torch" not in bench.table(_report(True)) and "torch/cf" not in bench.table(_report(False))


def test_measured_anything():
    assert bench.measured_anything(_report(True))
    empty = _report(False)
    for cell in empty["cells"]:
        cell["results"]["cuflash"] = {"note": "n/a: RuntimeError: no kernel"}
    assert not bench.measured_anything(empty)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    for det in (True, False):
        path = tmp_path / f"bench{det}.png"
        assert bench.plot(_report(det, via_torch=det), path).startswith("wrote")
        assert path.stat().st_size > 0


def test_report_is_json_serializable():
    json.dumps(_report(True))


def test_cli_quick_list_and_no_gpu(capsys):
    assert bench.main(["--quick", "--list", "--no-deterministic"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(bench.QUICK)


def test_no_gpu_exits_nonzero(capsys, monkeypatch):
    monkeypatch.setattr(bench, "_gpu_problem", lambda: "no CUDA device")  # also on a GPU machine
    assert bench.main(["--quick"]) == 1
    assert "found no usable one (no CUDA device): nothing was measured" in capsys.readouterr().err


def test_python_m_cuflash_bench_runs_the_checkout_script(capsys):
    assert cli.main(["bench", "--quick", "--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(bench.QUICK)


def test_python_m_cuflash_bench_without_a_checkout(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "BENCH_SCRIPT", tmp_path / "benchmarks" / "bench.py")
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "benchmarks/bench.py of a cuflash source checkout" in err and "installed from a wheel?" in err
