"""The README's main job, scripts/demo.py, runs end to end on the bundled SmolLM2 (short windows on the CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hf_dilated import assets

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_demo_runs_and_reads_its_tables():
    if not assets.smollm2_available() or assets.shakespeare_text() is None:
        pytest.skip(f"the demo needs the bundled assets: {assets.SMOLLM2_MISSING}; {assets.SHAKESPEARE_MISSING}")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--contexts", "128", "256"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "1. Measured now" in out and "Measured now: from 128 to 256 tokens" in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("128 |", "256 |"))]
    assert len(rows) == 2 and all("nan" not in row for row in rows)
