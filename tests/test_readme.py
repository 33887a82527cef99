"""Every ```python block of README.md runs as written (in order, in one fresh interpreter, in a temporary directory)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_dilated import assets

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def readme_blocks() -> list[str]:
    return BLOCK.findall((ROOT / "README.md").read_text(encoding="utf-8"))


def test_readme_has_python_blocks():
    blocks = readme_blocks()
    assert len(blocks) >= 2 and all(b.strip() for b in blocks)


def test_readme_python_blocks_run_as_written(tmp_path):
    if not assets.smollm2_available():
        pytest.skip(f"the README's blocks load the bundled SmolLM2: {assets.SMOLLM2_MISSING}")
    assets.smollm2_checkpoint()  # written once per cache (the README's first call does it; not part of the timing)
    script = "\n\n".join(readme_blocks())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert seconds < 60, f"the README's Python took {seconds:.0f} s"
