"""The CPU-side benchmark tools run as documented: ``benchmarks/host_overhead.py`` (the launch path's host time with
no-op kernels) measures the Triton launchers, not another path."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_host_overhead_times_the_triton_launchers():
    pytest.importorskip("triton")
    env = {"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--n", "32"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["fwd", "fwdbwd"]
    for line in lines:
        low, median = (float(x) for x in re.findall(r"(\d+) us", line))
        assert 0 < low <= median
