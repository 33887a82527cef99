"""What produced a result: versions, device and command, recorded in every results JSON (eval, fine-tuning)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any


def kernel_switches() -> dict[str, str]:
    """The ``HF_DILATED_*`` environment variables set for this run (``HF_DILATED_GLUON``, ``HF_DILATED_WS``,
    ``HF_DILATED_PERSISTENT``, ``HF_DILATED_FUSED_DQ``, ...): which kernels a result was measured with, where a
    switch turned one off."""
    return {name: value for name, value in sorted(os.environ.items()) if name.startswith("HF_DILATED_")}


def run_environment(device: Any = None, dtype: Any = None) -> dict[str, Any]:
    """Versions (python, torch, transformers, hf_dilated, and triton / peft where installed), the device by name
    (the GPU's, or ``cpu (N cores)``), the dtype when given, the command line, the date, and the kernel switches set
    (:func:`kernel_switches`, where any is)."""
    import torch
    import transformers

    from . import __version__

    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_dilated": __version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if dtype is not None:
        env["dtype"] = str(dtype).removeprefix("torch.")
    switches = kernel_switches()
    if switches:
        env["switches"] = switches
    for package in ("triton", "peft"):
        try:
            env[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return env
