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


# Fresh random inputs on every run; the seed is printed in the header, and HF_DILATED_TEST_SEED replays it.
SEED = int(os.environ.get("HF_DILATED_TEST_SEED", int.from_bytes(os.urandom(4), "little")))


def pytest_report_header(config):
    return f"hf_dilated test seed: {SEED} (replay with HF_DILATED_TEST_SEED={SEED})"


@pytest.fixture
def rng(request):
    """A generator per test: the session seed mixed with the test's name (fresh each run, reproducible by seed)."""
    import zlib

    return torch.Generator().manual_seed(SEED ^ zlib.crc32(request.node.nodeid.encode()))
