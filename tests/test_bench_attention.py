"""scripts/bench_attention.py on the CPU: its head shapes, its case list and its plot (the timing runs on a GPU)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
bench = importlib.import_module("bench_attention")


def test_shapes_parse_and_bad_ones_name_the_option():
    assert bench.parse_shape("9/3/64") == (9, 3, 64)
    for bad in ("16/128", "a/b/c", "16/5/128", "0/1/64"):
        with pytest.raises(ValueError, match="--shapes"):
            bench.parse_shape(bad)


def test_cases_cover_every_mode_shape_and_length_in_order():
    shapes = [(16, 16, 128), (32, 8, 128), (9, 3, 64), (8, 2, 256)]
    cases = bench.bench_cases(["fwd", "fwdbwd"], [16384, 65536], shapes)
    assert len(cases) == 2 * 4 * 2
    assert cases[:3] == [("fwd", 16384, 128, 16, 16), ("fwd", 65536, 128, 16, 16), ("fwd", 16384, 128, 32, 8)]
    assert {(H, Hk, D) for _, _, D, H, Hk in cases} == set(shapes)


def test_plot_draws_one_column_per_mode_that_ran(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(mode=m, N=n, D=64, H=9, Hk=3, method=meth, ms=1.0 * n / 1024, peak_gib=0.1)
            for m in ("fwd", "fwdbwd") for n in (1024, 2048) for meth in ("triton", "sdpa")]
    png = tmp_path / "plot.png"
    bench.plot(rows, "CPU", str(png))
    from matplotlib.image import imread

    height, width = imread(png).shape[:2]
    assert (width, height) == (1210, 990)  # two columns of 5.5 x 9 inches at 110 dpi: no empty decode column


def test_plot_adds_a_row_of_tflop_per_joule_where_power_was_read(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(mode="fwdbwd", N=n, D=64, H=9, Hk=3, method=meth, ms=1.0 * n / 1024, peak_gib=0.1,
                 tflop_per_j=0.4 + 0.1 * (meth == "triton"))
            for n in (1024, 2048) for meth in ("triton", "sdpa")]
    png = tmp_path / "plot.png"
    bench.plot(rows, "CPU", str(png))
    from matplotlib.image import imread

    height, width = imread(png).shape[:2]
    assert (width, height) == (605, 1485)  # one column of 5.5 x 13.5 inches at 110 dpi: three rows


def test_plot_leads_with_a_row_of_useful_rates_and_replot_redraws_a_results_file(tmp_path):
    """Rows with measured rates put a row of useful TFLOP/s first (one panel a mode: 4.5 inches more), and
    ``--replot`` redraws a results JSON's PNG beside it without a GPU; a file that is not one names the option."""
    pytest.importorskip("matplotlib")
    import json
    import subprocess

    from matplotlib.image import imread

    rows = [dict(mode=m, N=n, D=128, H=16, Hk=16, method=meth, ms=1.0 * n / 1024, peak_gib=0.1,
                 tflops=400.0 + 100.0 * (meth == "cudnn"))
            for m in ("fwd", "fwdbwd") for n in (1024, 2048) for meth in ("triton", "cudnn")]
    results = tmp_path / "H200-2026-12-01.json"
    results.write_text(json.dumps(dict(meta=dict(gpu="NVIDIA H200"), rows=rows)))
    script = ROOT / "scripts" / "bench_attention.py"
    run = subprocess.run([sys.executable, str(script), "--replot", str(results)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    height, width = imread(tmp_path / "H200-2026-12-01.png").shape[:2]
    assert (width, height) == (1210, 1485)  # two columns, three rows: rates, time, memory
    bad = tmp_path / "rows.json"
    bad.write_text(json.dumps(dict(rows=rows)))  # no meta: not a results file of this script
    run = subprocess.run([sys.executable, str(script), "--replot", str(bad)], capture_output=True, text=True)
    assert run.returncode == 2 and "--replot" in run.stderr, run.stderr
    bad.write_text(json.dumps(rows))  # a list, not a results file: --markdown names itself too
    run = subprocess.run([sys.executable, str(script), "--markdown", str(bad)], capture_output=True, text=True)
    assert run.returncode == 2 and "--markdown" in run.stderr and "not a results file" in run.stderr, run.stderr
    run = subprocess.run([sys.executable, str(script), "--replot", str(results), "--markdown", str(results)],
                         capture_output=True, text=True)  # one or the other: refused before either runs
    assert run.returncode == 2 and "not allowed with argument" in run.stderr, run.stderr


def test_markdown_table_of_a_run():
    """``markdown_table``: a line per mode and head shape in the run's order, a column per N, the rate with its ratios
    to SDPA-flash / dense cuDNN; a ratio to SDPA taken from a smaller N, or not measured, reads "-", and a cell
    without both ratios is the rate alone."""
    row = lambda mode, N, H, tf, **kw: dict(mode=mode, N=N, D=128, H=H, Hk=H, method="triton", ms=1.0,  # noqa: E731
                                            tflops=tf, **kw)
    rows = [row("fwd", 16384, 16, 494.1, tflops_ratio_vs_sdpa=1.571, tflops_ratio_vs_cudnn=0.894),
            row("fwd", 262144, 16, 523.0, tflops_ratio_vs_sdpa=1.55, sdpa_ratio_from_N=65536,
                tflops_ratio_vs_cudnn=0.986),
            row("fwd", 1048576, 16, 510.2),
            row("fwd", 16384, 8, 300.0),
            dict(row("fwd", 16384, 16, 999.0), method="cudnn"),  # not ours
            row("decode", 16384, 16, 1.0)]
    assert bench.markdown_table(rows).splitlines() == [
        "| mode | heads H / Hk / D | 16K | 256K | 1M |",
        "| --- | --- | --- | --- | --- |",
        "| forward | 16 / 16 / 128 | 494 (1.57 / 0.89) | 523 (- / 0.99) | 510 |",
        "| forward | 8 / 8 / 128 | 300 |  |  |"]


def _readme_kernel_table() -> tuple[str, str, list]:
    """The README's kernel-table section (up to its first sub-heading), the results JSON it links first, and that
    file's rows."""
    import json
    import re

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Kernels against dense attention"):]
    section = section[:section.index("\n#### ")]
    link = re.search(r"\((benchmarks/results/dilated-kernels-[^)]+\.json)\)", section).group(1)
    return section, link, json.loads((ROOT / link).read_text())["rows"]


def test_readme_kernel_table_is_the_one_of_the_results_file_it_links():
    """The README's kernel table is ``--markdown`` of the results JSON its section links first: its cells are the
    file's, not typed in."""
    section, link, rows = _readme_kernel_table()
    table = bench.markdown_table(rows)
    assert table in section, f"README's table is not `bench_attention.py --markdown {link}`:\n{table}"


def test_demo_quotes_the_64k_range_of_the_readme_table():
    """The demo's closing note quotes the 64K ratios to SDPA-flash of the results file the README's table links."""
    import re

    _, _, rows = _readme_kernel_table()
    ratios = [r["tflops_ratio_vs_sdpa"] for r in rows
              if r["method"] == "triton" and r["N"] == 65536 and "tflops_ratio_vs_sdpa" in r]
    quoted = re.search(r"(\d\.\d\d)-(\d\.\d\d)x dense flash attention's rate per useful FLOP at 64K",
                       (ROOT / "scripts" / "demo.py").read_text())
    assert quoted, "scripts/demo.py no longer quotes the 64K range"
    assert quoted.groups() == (f"{min(ratios):.2f}", f"{max(ratios):.2f}"), (quoted.groups(), min(ratios), max(ratios))


def test_graph_max_ms_must_be_positive():
    """``--graph-max-ms`` is checked before any work (no GPU needed), naming the option."""
    import subprocess

    script = ROOT / "scripts" / "bench_attention.py"
    run = subprocess.run([sys.executable, str(script), "--graph-max-ms", "0"], capture_output=True, text=True)
    assert run.returncode == 2 and "--graph-max-ms" in run.stderr, run.stderr


@pytest.mark.parametrize("option,value", [("--warm-s", "-1"), ("--rounds", "0")])
def test_warm_s_and_rounds_are_checked_before_any_work(option, value):
    import subprocess

    script = ROOT / "scripts" / "bench_attention.py"
    run = subprocess.run([sys.executable, str(script), option, value], capture_output=True, text=True)
    assert run.returncode == 2 and option in run.stderr, run.stderr


def test_rounds_alternate_the_methods_and_report_each_ones_median():
    """``retime`` times each method of a case again, in turn (its graph replay after it where it has one), and keeps
    every timing with its clock; ``ms`` and ``graph_ms`` become the medians, from which ``add_rates`` derives the
    TFLOP/s."""
    order, clocks = [], iter([1800.0, 1900.0, 1700.0, 1950.0])
    times = {"triton": iter([3.0, 5.0]), "sdpa": iter([61.0, 59.0])}

    class Monitor:
        def window(self, t0, t1):
            return dict(gpu_clock_mhz=next(clocks), gpu_power_w=690.0)

    def timer_of(name):
        return lambda call: (order.append(name), next(times[name]))[1]

    base = dict(mode="fwdbwd", N=65536, D=64, H=9, Hk=3, B=1)
    rows = {m: dict(base, method=m, ms=ms, gpu_clock_mhz=1850.0, gpu_power_w=680.0)
            for m, ms in (("triton", 3.6), ("sdpa", 60.0))}
    graphs = iter([3.5, 3.7])
    rows["triton"]["graph_ms"] = 3.4
    graph_timer = lambda call: (order.append("triton graph"), next(graphs))[1]  # noqa: E731
    timed = [(rows["triton"], None, timer_of("triton"), graph_timer), (rows["sdpa"], None, timer_of("sdpa"), None)]
    bench.retime(timed, 3, Monitor(), warm_s=0)
    assert order == ["triton", "triton graph", "sdpa", "triton", "triton graph", "sdpa"]
    assert [r["graph_ms"] for r in rows["triton"]["rounds"]] == [3.4, 3.5, 3.7] and rows["triton"]["graph_ms"] == 3.5
    assert "graph_ms" not in rows["sdpa"]
    assert [r["ms"] for r in rows["triton"]["rounds"]] == [3.6, 3.0, 5.0] and rows["triton"]["ms"] == 3.6
    assert [r["ms"] for r in rows["sdpa"]["rounds"]] == [60.0, 61.0, 59.0] and rows["sdpa"]["ms"] == 60.0
    assert [r["gpu_clock_mhz"] for r in rows["triton"]["rounds"]] == [1850.0, 1800.0, 1700.0]
    assert rows["triton"]["gpu_clock_mhz"] == pytest.approx(1783.33, abs=0.01)  # the means over the rounds
    assert rows["sdpa"]["gpu_power_w"] == pytest.approx((680.0 + 690.0 + 690.0) / 3)
    for row in rows.values():
        bench.add_rates(row, bench.LONGNET)
    flops = bench.dilated_flops(65536, bench.LONGNET, 64, 9, 1) * 3.5
    assert rows["triton"]["tflops"] == pytest.approx(flops / 3.6e-3 / 1e12)
    assert rows["sdpa"]["tflops"] == pytest.approx(bench.dense_flops(65536, 64, 9, 1) * 3.5 / 60e-3 / 1e12)
    assert rows["triton"]["tflop_per_j"] == pytest.approx(rows["triton"]["tflops"] / ((680.0 + 690.0 + 690.0) / 3))


def test_gpu_monitor_summarises_the_samples_of_each_window():
    """Samples from a fake reader (clock, power, temperature) land in the window that was open when they were taken;
    a window shorter than the period takes the nearest sample; a failing reader loses samples, not the run."""
    import time

    from gpu_monitor import GpuMonitor, parse_smi_line

    assert parse_smi_line(" 1980, 123.60, 41") == (1980.0, 123.6, 41.0)
    for bad in ("[N/A], 100, 40", "1980, 100"):
        with pytest.raises(ValueError):
            parse_smi_line(bad)
    with pytest.raises(ValueError, match="period_s"):
        GpuMonitor(period_s=0)

    values = iter([(1980.0, 100.0, 40.0), (1770.0, 700.0, 60.0)] + [(1500.0, 650.0, 58.0)] * 10_000)
    with GpuMonitor(period_s=0.01, read=lambda: next(values)) as mon:
        t0 = time.monotonic()
        while len(mon.samples) < 6:
            time.sleep(0.005)
        t1 = time.monotonic()
    w = mon.window(t0 - 1.0, t1)
    assert w["gpu_samples"] == len(mon.samples) >= 6
    assert w["gpu_temp_c"] == 60.0 and 1500.0 < w["gpu_clock_mhz"] < 1980.0
    stamp = mon.samples[1][0]
    assert mon.window(stamp, stamp)["gpu_clock_mhz"] == 1770.0  # nearest sample of an empty window
    assert mon.window(t1 + 5, t1 + 6) == {}  # nothing within a second

    def broken():
        raise RuntimeError("nvml went away")

    with GpuMonitor(period_s=0.01, read=broken) as mon:
        time.sleep(0.05)
    assert mon.errors >= 1 and mon.samples == [] and mon.window(0, time.monotonic()) == {}


def test_timed_on_gpu_reads_the_monitor_over_the_timed_calls_only():
    """The benchmarks' one timing step: the timer's milliseconds, the monitor's window from just before the timer to
    just after it (not the warm-up), the energy of one call from its mean power, and no energy where no power was
    read; the monitor's own summary is not changed."""
    from gpu_monitor import GpuMonitor
    from timing import timed_on_gpu

    windows = []

    class Monitor(GpuMonitor):
        def __init__(self, reading):
            self.reading = reading

        def window(self, start, end):
            windows.append((start, end))
            return self.reading

    calls = []
    reading = {"gpu_clock_mhz": 1500.0, "gpu_power_w": 700.0}
    ms, gpu, warm_calls = timed_on_gpu(lambda: calls.append(1), lambda f: (f(), 2.5)[1], Monitor(reading))
    assert (ms, warm_calls, len(calls)) == (2.5, 0, 1)
    assert gpu == {"gpu_clock_mhz": 1500.0, "gpu_power_w": 700.0, "mj": 1750.0}
    assert reading == {"gpu_clock_mhz": 1500.0, "gpu_power_w": 700.0}  # a copy was extended
    (start, end), = windows
    assert start <= end
    ms, gpu, _ = timed_on_gpu(lambda: None, lambda f: 1.0, Monitor({}))
    assert gpu == {} and ms == 1.0


def test_peak_memory_is_compared_with_the_bytes_a_call_must_hold():
    """``io_bytes``: q, k, v, o and the float32 lse; forward+backward adds dO, dQ, dK, dV (issue 14's memory target:
    1M tokens, H 16, D 128, forward+backward, 32.06 GiB)."""
    gib = 2**30
    assert bench.io_bytes("fwdbwd", 2**20, 128, 16, 16, 1) == 32 * gib + 16 * 2**22
    assert bench.io_bytes("fwd", 2**20, 128, 16, 16, 1) == 16 * gib + 16 * 2**22
    # GQA: the keys and values at their own heads; decode: one query row against the whole cache
    assert bench.io_bytes("fwd", 1024, 64, 32, 8, 2) == 2 * (2 * 4 + 2 * 1) * 2**20 + 2 * 32 * 1024 * 4
    assert bench.io_bytes("decode", 1024, 64, 32, 8, 1, nq=1) == 2 * 32 * 64 * 2 + 2 * 2**20 + 32 * 4
    lse = 4 * 1024 * 4
    assert bench.io_bytes("fwd", 1024, 64, 4, 4, 1, elem=4) == 2 * bench.io_bytes("fwd", 1024, 64, 4, 4, 1) - lse


def test_table_shows_the_clock_power_and_energy_rate_of_each_timing(capsys):
    rows = [dict(mode="fwd", N=1024, D=64, H=9, Hk=3, method="triton", ms=1.0, tflops=100.0, gpu_clock_mhz=1770.4,
                 gpu_power_w=690.0, tflop_per_j=100.0 / 690.0),
            dict(mode="fwd", N=1024, D=64, H=9, Hk=3, method="sdpa", ms=2.0, tflops=50.0)]
    bench.print_table(rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-3:] == ["MHz", "W", "TF/J"]
    assert lines[2].split()[-3:] == ["1770", "690", "0.14"] and lines[3].split()[-3:] == ["-", "-", "-"]
    assert lines[0].split().index("xIO") == lines[0].split().index("GiB") + 1


def test_a_timeout_still_leaves_the_cases_measured():
    """``timing.until_interrupted`` (the benchmark's case loop): a SIGTERM, as ``timeout`` sends, ends the block with
    ``interrupted`` set instead of killing the process, so the results so far are written; the previous handler comes
    back, and a block that runs to its end is not marked."""
    import os
    import signal

    from timing import until_interrupted

    before = signal.getsignal(signal.SIGTERM)
    measured = []
    with until_interrupted() as run:
        measured.append("case 1")
        os.kill(os.getpid(), signal.SIGTERM)
        measured.append("case 2")  # not reached: the signal ends the block
    assert run.interrupted and measured == ["case 1"]
    assert signal.getsignal(signal.SIGTERM) is before
    with until_interrupted() as run:
        measured.append("case 3")
    assert not run.interrupted and measured == ["case 1", "case 3"]


def test_resume_continues_an_earlier_run_on_the_same_gpu(tmp_path, monkeypatch):
    """``--resume``: the rows of the run it continues are kept and their cases skipped (``case_key``), a run from
    another GPU is refused (its ratios would compare two GPUs), and the union is written with every command that
    made it."""
    import argparse
    import json

    pytest.importorskip("triton")
    gpu = "NVIDIA H100 80GB HBM3"
    row = lambda N, method, ms: dict(mode="fwd", N=N, D=128, H=16, Hk=16, B=1, method=method, ms=ms,  # noqa: E731
                                     peak_gib=0.5)
    first = tmp_path / "first.json"
    first.write_text(json.dumps(dict(meta=dict(gpu=gpu, command="python scripts/bench_attention.py --seqlens 16384"),
                                     rows=[row(16384, "triton", 0.8), row(16384, "sdpa", 0.9)])))
    rows, meta = bench.resumed_rows(str(first), gpu)
    assert {bench.case_key(r) for r in rows} == {("fwd", 16384, 128, 16, 16, "triton"),
                                                 ("fwd", 16384, 128, 16, 16, "sdpa")}
    with pytest.raises(ValueError, match="measured on 'NVIDIA H100 80GB HBM3', this GPU is 'NVIDIA H200'"):
        bench.resumed_rows(str(first), "NVIDIA H200")
    args = argparse.Namespace(out=str(tmp_path / "out"), warm_s=1.0, interrupted=False, resume=str(first),
                              resumed_meta=meta)
    for name in [n for n in os.environ if n.startswith("HF_DILATED_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HF_DILATED_PERSISTENT", "0")  # a kernel switch the run was made with is recorded
    bench.write_results(rows + [row(65536, "triton", 3.0)], args, gpu)
    (written,) = (tmp_path / "out").glob("*.json")
    data = json.loads(written.read_text())
    assert [r["N"] for r in data["rows"]] == [16384, 16384, 65536]
    assert data["meta"]["commands"][0] == "python scripts/bench_attention.py --seqlens 16384"
    assert len(data["meta"]["commands"]) == 2 and data["meta"]["resumed_from"] == str(first)
    assert data["meta"]["switches"] == {"HF_DILATED_PERSISTENT": "0"}


def test_ratios_of_a_resumed_run_use_the_baselines_measured_since():
    """``add_ratios``: a Triton row whose SDPA at its N was not measured yet took SDPA's largest N (marked
    ``sdpa_ratio_from_N``); once the resumed run measures SDPA at that N, the row is compared with it and the mark
    goes; cuDNN's ratio is the Triton row's rate over cuDNN's at the same case."""
    row = lambda N, method, tflops: dict(mode="fwdbwd", N=N, D=128, H=16, Hk=16, method=method,  # noqa: E731
                                         ms=1.0, tflops=tflops)
    rows = [row(65536, "sdpa", 300.0), row(262144, "triton", 330.0)]
    bench.add_ratios(rows)  # the first part: no SDPA at 256K yet
    assert rows[1]["sdpa_ratio_from_N"] == 65536 and rows[1]["tflops_ratio_vs_sdpa"] == 1.1
    rows += [row(262144, "sdpa", 275.0), row(262144, "cudnn", 550.0)]  # measured by the resumed run
    bench.add_ratios(rows)
    assert "sdpa_ratio_from_N" not in rows[1]
    assert rows[1]["tflops_ratio_vs_sdpa"] == 1.2 and rows[1]["tflops_ratio_vs_cudnn"] == 0.6
    assert "tflops_ratio_vs_cudnn_segments" not in rows[1]
    rows.append(row(262144, "cudnn-segments", 440.0))  # cuDNN on the same segments: the same useful FLOPs
    bench.add_ratios(rows)
    assert rows[1]["tflops_ratio_vs_cudnn_segments"] == 0.75


def test_methods_are_checked_by_name(capsys):
    """``--methods`` takes the known methods only (an unknown name once ran the PyTorch reference under it)."""
    with pytest.raises(SystemExit):
        with mock.patch.object(sys, "argv", ["bench_attention.py", "--methods", "triton", "flash"]):
            bench.main()
    err = capsys.readouterr().err
    assert "--methods" in err and "cudnn-segments" in err


def test_each_methods_call_keeps_its_own_backend_after_the_loop():
    """The calls kept for ``--rounds`` run after the loop over methods has moved on: each must still call its own
    backend (a lambda reading the loop's ``method`` would time cuDNN in SDPA-flash's row)."""
    ran = []
    with mock.patch.object(bench, "run_sdpa", lambda *a: ran.append(("sdpa", a[-1]))), \
            mock.patch.object(bench, "run_dilated", lambda be, *a: ran.append(("dilated", be))):
        calls = [bench.method_call(m, "fwdbwd", None, None, None, None, bench.LONGNET)
                 for m in ("triton", "sdpa", "cudnn", "reference")]
        for call in calls:
            call()
    assert ran == [("dilated", "triton"), ("sdpa", "flash"), ("sdpa", "cudnn"), ("dilated", "torch")]


@pytest.mark.parametrize("N, branches", [(64, [(8, 1), (16, 2), (32, 4)]), (50, [(4, 1), (8, 2), (8, 4), (24, 8)]),
                                         (40, [(8, 1), (12, 2)])])
def test_computed_flops_count_each_pair_once_where_branches_nest(N, branches):
    """The pairs the kernels compute: for head 0 (offset class 0: ceil(L / r) rows a segment, as the counts assume)
    the union of the branches' pairs where they nest, every branch's where they do not ((8, 1), (12, 2))."""
    from bench_attention import computed_dilated_flops, dilated_flops

    union = {(p, q) for w, r in branches for p in range(0, N, r) for q in range(0, p + 1, r) if p // w == q // w}
    nests = all(w1 % w0 == 0 and r1 % r0 == 0 for (w0, r0), (w1, r1) in zip(branches, branches[1:]))
    want = len(union) if nests else dilated_flops(N, branches, 1, 1, 1) // 4
    assert computed_dilated_flops(N, branches, 1, 1, 1) == 4 * want
    assert (want < dilated_flops(N, branches, 1, 1, 1) // 4) == nests
