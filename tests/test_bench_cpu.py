"""CPU checks of the bench's report side (table, plot, CLI, exit codes): no GPU, synthetic results.

The bench lives in benchmarks/bench.py; it is loaded here the way ``python -m cuflash bench`` loads it.
"""
import dataclasses
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


# --------------------------------------------------------------------------------------------
# The features table (benchmarks/features.py): ids, predicates, fractions, rendering, failure handling
# --------------------------------------------------------------------------------------------

import numpy as np  # noqa: E402

from cuflash import reference  # noqa: E402

features = bench.features


def _case(prefix):
    return next(c for c in features.all_cases() if c.name.startswith(prefix))


def test_features_cases_are_the_issues():
    names = [c.name for c in features.all_cases()]
    assert len(names) == len(set(names)) == 6
    vla = _case("blockcausal-VLA")
    assert (vla.B, vla.S, vla.H, vla.Hkv, vla.D, vla.blocks, vla.causal) == (2, 1024, 8, 1, 256, (256, 512, 768), False)
    doc = _case("doc-causal")
    assert (doc.B, doc.S, doc.H, doc.D, doc.documents, doc.causal) == (4, 4096, 16, 128, 8, True)
    assert _case("window").window == (1024, 0) and _case("window").causal
    assert set(np.diff((0,) + _case("blockcausal512").blocks + (4096,))) == {512}
    assert _case("bias").bias and (_case("bias").B, _case("bias").S) == (2, 2048)
    assert _case("causal-").causal and _case("causal-").target is None
    assert [(c.target_peer, c.target) for c in features.all_cases()[:5]] == [
        ("flex", 3.0), ("flex", 2.0), ("flex", 1.5), ("flex", 1.2), ("sdpa-efficient", 3.0)]


def test_block_ids_of_the_vla_case():
    segment, block = features.host_ids(_case("blockcausal-VLA"))
    assert segment is None and block.dtype == np.int32 and block.shape == (2, 1024)
    for row in block:
        assert row[0] == row[255] == 0 and row[256] == row[511] == 1 and row[512] == 2 and row[1023] == 3


def test_document_ids_are_deterministic_unequal_and_cover_the_row():
    doc = _case("doc-causal")
    lengths = features.document_lengths(doc)
    assert lengths.shape == (4, 8) and (lengths.sum(axis=1) == 4096).all() and lengths.min() >= 128
    assert all(len(set(row)) == 8 for row in lengths.tolist())
    assert (features.document_lengths(doc) == lengths).all()
    segment, block = features.host_ids(doc)
    assert block is None and segment.dtype == np.int32 and segment.shape == (4, 4096)
    assert (np.diff(segment, axis=1) >= 0).all() and (segment[:, -1] == 7).all()
    assert [np.bincount(row).tolist() for row in segment] == lengths.tolist()


def test_vla_fraction_two_ways():
    vla = _case("blockcausal-VLA")
    segment, block = features.host_ids(vla)
    mod = features.mask_mod(vla, segment, block)
    b, q, kv = np.arange(2)[:, None, None], np.arange(1024)[None, :, None], np.arange(1024)[None, None, :]
    dense = mod(b, 0, q, kv)  # (B, S, S) from the predicate Flex gets
    assert dense.shape == (2, 1024, 1024)
    by_blocks = sum(256 * 256 * (i + 1) for i in range(4)) / 1024**2  # block i sees blocks 0..i
    assert dense.mean() == features.visible_fraction(vla) == features.closed_form_fraction(vla) == by_blocks == 0.625


@pytest.mark.parametrize("index", range(6))
def test_visible_fraction_matches_the_closed_form(index):
    case = features.all_cases()[index]
    assert features.visible_fraction(case) == pytest.approx(features.closed_form_fraction(case), rel=0, abs=1e-15)
    assert 0 < features.visible_fraction(case) <= 1


@pytest.mark.parametrize("index", range(6))
def test_mask_mod_matches_cuflash_semantics(index):
    """The predicate given to FlexAttention (and SDPA's bool mask) is cuflash's option semantics, per the
    float64 reference's visibility rule (causal, window, segment_ids, block_ids)."""
    case = features.all_cases()[index]
    segment, block = features.host_ids(case)
    options = features.cuflash_options(case, segment, block, bias="B")
    mod = features.mask_mod(case, segment, block)
    dims = reference._Dims(case.B, case.S, case.S, case.H, case.Hkv, case.D, case.D)
    visible = reference._visible(dims, options["causal"], options.get("window", (None, None)), None,
                                 options.get("segment_ids"), options.get("block_ids"), np)
    if mod is None:
        assert visible is None and case.bias and options["bias"] == "B"
        return
    b = np.arange(case.B)[:, None, None, None]
    q, kv = np.arange(case.S)[None, None, :, None], np.arange(case.S)[None, None, None, :]
    ours = np.broadcast_to(mod(b, 0, q, kv), (case.B, 1, case.S, case.S))
    assert np.array_equal(ours, np.broadcast_to(visible, ours.shape))


def test_window_is_inclusive_like_flex():
    case = _case("window")
    mod = features.mask_mod(case)
    row = np.asarray(mod(0, 0, 2000, np.arange(4096)))
    assert row.sum() == 1025 and row[2000 - 1024] and not row[2000 - 1025] and row[2000] and not row[2001]


def test_cuflash_options():
    assert features.cuflash_options(_case("blockcausal-VLA"), None, "ids") == {"causal": False,
                                                                               "block_ids": ("ids", "ids")}
    assert features.cuflash_options(_case("doc"), "ids", None) == {"causal": True, "segment_ids": ("ids", "ids")}
    assert features.cuflash_options(_case("window")) == {"causal": True, "window": (1024, 0)}
    assert features.cuflash_options(_case("bias"), bias="b") == {"causal": False, "bias": "b"}
    assert features.cuflash_options(_case("causal-")) == {"causal": True}


def test_useful_flops():
    vla = _case("blockcausal-VLA")
    dense = 4.0 * 2 * 8 * 1024 * 1024 * 256
    assert vla.dense_flops("fwd") == dense and vla.flops("fwd_bwd", 0.625) == dense * 0.625 * 3.5


def _features_report():
    cases = []
    for case, fraction in zip(features.all_cases(), (0.625, 0.08, 0.22, 0.5625, 1.0, 0.5), strict=True):
        entry = {**dataclasses.asdict(case), "visible_fraction": fraction, "output_check": {},
                 "results": {"cuflash": {"fwd_tflops": 510.0, "fwd_bwd_tflops": 111.0},
                             "flex": {"fwd_tflops": 170.0, "fwd_bwd_tflops": 37.0},
                             "sdpa-efficient": {"fwd_tflops": 100.0, "fwd_bwd_tflops": 50.0},
                             "sdpa-cudnn": {"fwd_tflops": 120.0, "fwd_bwd_tflops": 40.0}}}
        cases.append(entry)
    bias = cases[4]["results"]
    bias["cuflash"] = {"note": "not implemented: NotImplementedError: bias= is not implemented",
                       "not_implemented": True}
    bias["flex"] = {"note": "n/a: BackendCompilerFailed: boom"}
    bias["sdpa-cudnn"] = {"fwd_tflops": 120.0, "fwd_bwd_note": "n/a: RuntimeError: no kernel"}
    cases[1]["results"]["cuflash"]["fwd_tflops"] = 300.0  # 300 / 170 = 1.76x < 2x: target missed
    cases[0]["output_check"] = {"against": "flex", "relative_difference": 0.004}
    for entry in cases:
        entry["ratios"] = features.ratios(entry)
    return {"meta": features.meta(), "implementations": ["cuflash", "flex", "sdpa-efficient", "sdpa-cudnn"],
            "cases": cases}


def test_features_ratios_and_targets():
    cases = _features_report()["cases"]
    vla = cases[0]["ratios"]
    assert vla["fwd"]["cf_over_flex"] == 3.0 and vla["fwd"]["target_met"] is True
    assert vla["fwd_bwd"]["cf_over_flex"] == 3.0 and vla["fwd_bwd"]["cf_over_sdpa"] == 2.22
    assert vla["fwd_bwd"]["sdpa_best"] == "sdpa-efficient" and vla["fwd"]["sdpa_best"] == "sdpa-cudnn"
    assert cases[1]["ratios"]["fwd"]["target_met"] is False and cases[1]["ratios"]["fwd_bwd"]["target_met"] is True
    assert cases[4]["ratios"]["fwd"] == {"cf_over_flex": None, "cf_over_sdpa": None, "sdpa_best": "sdpa-cudnn",
                                         "cf_over_target_peer": None, "target_met": None}
    assert cases[5]["ratios"]["fwd"]["target_met"] is None  # the reference row has no target


def test_features_table_rendering():
    text = features.table(_features_report())
    lines = text.splitlines()
    fwd_head = next(i for i, line in enumerate(lines) if line.startswith("case (forward, TFLOPS)"))
    bwd_head = next(i for i, line in enumerate(lines) if line.startswith("case (forward+backward, TFLOPS)"))
    for start in (fwd_head, bwd_head):
        block = lines[start:start + 8]
        assert len({len(line) for line in block}) == 1  # header, rule and the six rows line up
        assert block[2].startswith("blockcausal-VLA-B2-S1k-H8/1-D256") and " 62.5" in block[2]
    fwd = lines[fwd_head:fwd_head + 8]
    assert "   3.00x" in fwd[2] and ">=3.0x Flex  yes" in fwd[2] and "Flex 170" in fwd[2]
    assert ">=2.0x Flex   no" in fwd[3]
    bias = fwd[6]
    assert bias.split()[1:5] == ["100.0", "n/i", "n/a", "100"] and ">=3.0x SDPA-eff    -" in bias
    assert "SDPA-eff 124" in bias and "(reference)" in fwd[7] and "Flex 353" in fwd[7]
    bwd_bias = lines[bwd_head + 6]
    assert bwd_bias.split()[1:6] == ["100.0", "n/i", "n/a", "50", "n/a"] and "SDPA-eff 111" in bwd_bias
    assert "bias-grad-B2-S2k-H16-D128 cuflash: not implemented: NotImplementedError" in text
    assert "bias-grad-B2-S2k-H16-D128 flex: n/a: BackendCompilerFailed: boom" in text
    assert "bias-grad-B2-S2k-H16-D128 sdpa-cudnn: n/a: RuntimeError: no kernel" in text
    assert "worst 4.00e-03 in blockcausal-VLA" in text and "WARNING" not in text
    assert "Flex = FlexAttention under torch.compile" in text
    json.dumps(_features_report())
    assert features.measured_anything(_features_report())


class _FakeTimer:
    triton = None

    def __init__(self):
        self.calls = 0

    def cuda(self, fn, long_call=False):
        fn()
        self.calls += 1
        return 2.0


class _FakeProgress:
    def __init__(self):
        self.steps = []

    def step(self, label):
        self.steps.append(label)


def test_measure_case_survives_failing_peers(monkeypatch):
    """A peer failing to build (a Flex compile error), one failing mode, cuflash raising NotImplementedError:
    each marks only its cells; the case is still measured and rendered."""
    def not_implemented(case, data, torch):
        def fwd():
            raise NotImplementedError("block_ids= is not implemented in this version of cuflash yet")

        return {"fwd": fwd, "fwd_bwd": fwd}

    def flex(case, data, torch):
        raise RuntimeError("BackendCompilerFailed: triton compile error")

    def sdpa(case, data, torch):
        def fwd_bwd():
            raise RuntimeError("No available kernel")

        return {"fwd": lambda: None, "fwd_bwd": fwd_bwd, "_note": "k/v repeated"}

    monkeypatch.setattr(features, "MAKERS", {"cuflash": not_implemented, "flex": flex, "sdpa-efficient": sdpa})
    monkeypatch.setattr(features, "_sync", lambda torch: None)
    monkeypatch.setattr(features, "_as_bshd", lambda out, layout: out)
    case = _case("blockcausal-VLA")
    progress, timer = _FakeProgress(), _FakeTimer()
    entry = features.measure_case(case, ["cuflash", "flex", "sdpa-efficient"], timer, None, progress,
                                  make_inputs=lambda c, torch: None, relative_difference=None)
    results = entry["results"]
    assert results["cuflash"]["not_implemented"] and results["cuflash"]["note"].startswith("not implemented:")
    assert results["flex"]["note"] == "n/a: RuntimeError: BackendCompilerFailed: triton compile error"
    eff = results["sdpa-efficient"]
    assert eff["fwd_ms"] == 2.0 and eff["call_note"] == "k/v repeated"
    assert eff["fwd_tflops"] == round(4.0 * 2 * 8 * 1024**2 * 256 * 0.625 / 2e-3 / 1e12, 1)
    assert eff["fwd_bwd_note"] == "n/a: RuntimeError: No available kernel" and "fwd_bwd_tflops" not in eff
    assert len(progress.steps) == 6 and timer.calls == 1
    assert entry["visible_fraction"] == 0.625 and entry["flops_fwd"] == case.flops("fwd", 0.625)
    report = {"implementations": ["cuflash", "flex", "sdpa-efficient"], "cases": [entry]}
    text = features.table(report)
    assert "n/i" in text and "n/a" in text
    json.dumps(report)


def test_a_case_that_fails_entirely_is_recorded(monkeypatch):
    def boom(*args, **kwargs):
        raise MemoryError("out of memory")

    monkeypatch.setattr(features, "measure_case", boom)
    monkeypatch.setattr(bench, "_free", lambda torch: None)
    args = bench._parser().parse_args(["--features-only", "--no-peers"])
    report = bench._measure_features(features.select_cases("VLA,^causal-B4"), None, args, _FakeTimer())
    assert [c["name"] for c in report["cases"]] == ["blockcausal-VLA-B2-S1k-H8/1-D256", "causal-B4-S4k-H16-D128"]
    assert report["cases"][0]["results"]["cuflash"]["note"] == "n/a: MemoryError: out of memory"
    assert not features.measured_anything(report)
    assert "n/a" in features.table(report)


def test_features_peers():
    assert features.installed_peers(None, False, None) == []
    assert features.installed_peers(object(), True, None) == []


def test_cli_features_list(capsys):
    assert bench.main(["--features-only", "--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 6
    assert bench.main(["--features-only", "--cases", "doc,VLA", "--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert bench.main(["--quick", "--features", "--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(bench.QUICK) + 6
    assert cli.main(["bench", "--features-only", "--list"]) == 0
    assert "blockcausal-VLA" in capsys.readouterr().out


def test_features_only_without_gpu(capsys, monkeypatch):
    monkeypatch.setattr(bench, "_gpu_problem", lambda: "no CUDA device")
    assert bench.main(["--features-only"]) == 1
    assert "nothing was measured" in capsys.readouterr().err
