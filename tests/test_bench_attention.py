"""scripts/bench_attention.py on the CPU: its head shapes, its case list and its plot (the timing runs on a GPU)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
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


def test_graph_max_ms_must_be_positive():
    """``--graph-max-ms`` is checked before any work (no GPU needed), naming the option."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_attention.py"
    run = subprocess.run([sys.executable, str(script), "--graph-max-ms", "0"], capture_output=True, text=True)
    assert run.returncode == 2 and "--graph-max-ms" in run.stderr, run.stderr
