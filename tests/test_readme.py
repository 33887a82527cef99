"""Every ```python block of README.md runs as written (in order, in one fresh interpreter, in a temporary directory),
and its test command tests the oldest Transformers that ``pyproject.toml`` admits."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dilated import assets

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

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
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_readme_test_command_tests_the_oldest_transformers_supported():
    """The README's test command (what CI runs) reruns the Transformers-facing tests at exactly the lower bound of
    ``pyproject.toml``'s ``transformers>=`` requirement: raising or lowering one without the other fails here."""
    if tomllib is None:
        pytest.skip("reading pyproject.toml needs tomllib (Python 3.11+)")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    bounds = [m.group(1) for d in deps if (m := re.fullmatch(r"transformers>=([\w.]+)", d.replace(" ", "")))]
    assert len(bounds) == 1, f"pyproject.toml's transformers requirement is not one lower bound: {deps}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"<!-- test-command[^\n]*\n```bash\n(.*?)\n```", readme, re.S).group(1)
    pins = re.findall(r"transformers==([\w.]+)", command)
    oldest = bounds[0] if bounds[0].count(".") == 2 else bounds[0] + ".0"
    assert pins == [oldest], f"the test command pins transformers {pins}, pyproject.toml's lower bound is {bounds[0]}"
    assert "tests/test_transformers_common.py" in command and "tests/test_transformers_integration.py" in command
