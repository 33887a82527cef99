"""Launch configurations tuned on the GPU at hand, kept on disk: ``hf-dilated tune`` measures them
(:mod:`.tuning`), :mod:`.configs` reads them before its built-in tables.

One JSON file, ``$HF_DILATED_CACHE/triton-configs.json`` (default ``~/.cache/hf_dilated``), maps a device key (GPU
name, compute capability, Triton version: a config measured with one Triton release may not even compile with the
next) to entries ``"<kernel>|<padded head dim>|<dtype>": [BLOCK_M, BLOCK_N, num_warps, num_stages]`` for the kernels
of :data:`KERNELS`. The file is read once per process; a file that cannot be read or parsed is ignored with one
warning (the built-in tables apply), never an error in the middle of a forward pass.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

KERNELS = ("fwd", "dkdv", "dq")
FILE_NAME = "triton-configs.json"


def cache_file() -> Path:
    """Where tuned configs live: ``$HF_DILATED_CACHE/triton-configs.json``, else ``~/.cache/hf_dilated/``."""
    root = os.environ.get("HF_DILATED_CACHE") or Path.home() / ".cache" / "hf_dilated"
    return Path(root).expanduser() / FILE_NAME


def device_key(device: torch.device | int | None = None) -> str:
    """``"<GPU name>|sm<major><minor>|triton <version>"`` of a CUDA device (the current one by default)."""
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)}|sm{major}{minor}|triton {triton.__version__}"


def check_kernel(kernel: str) -> str:
    """``kernel`` when it names a tunable kernel, else ``ValueError`` naming the allowed ones."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    return kernel


def entry_key(kernel: str, head_dim: int, dtype: torch.dtype) -> str:
    check_kernel(kernel)
    return f"{kernel}|{int(head_dim)}|{str(dtype).removeprefix('torch.')}"


@functools.lru_cache(maxsize=None)
def _read(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        return {}
    try:
        data = json.loads(p.read_text())
        if not isinstance(data, dict):
            raise ValueError("the top level is not an object")
        return data
    except (OSError, ValueError) as err:
        warnings.warn(f"ignoring the tuned Triton configs in {p} ({err}); `hf-dilated tune` rewrites them",
                      stacklevel=3)
        return {}


@functools.lru_cache(maxsize=None)
def _device_table(index: int) -> dict:
    """The tuned table of CUDA device ``index`` (looked up once: launches ask for it on every call); empty, with one
    warning, when the cache cannot even be located (no home directory, say)."""
    try:
        return _read(str(cache_file())).get(device_key(index), {})
    except (OSError, RuntimeError) as err:
        warnings.warn(f"not reading tuned Triton configs ({err}); the built-in ones apply", stacklevel=3)
        return {}


def lookup(kernel: str, head_dim: int, dtype: torch.dtype, key: str | None = None) -> tuple[int, int, int, int] | None:
    """The tuned ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for this kernel, padded head dim and dtype on the
    device ``key`` (the current CUDA device by default), or ``None`` when none was tuned."""
    if key is None:
        if not torch.cuda.is_available():
            return None
        table = _device_table(torch.cuda.current_device())
    else:
        table = _read(str(cache_file())).get(key, {})
    found = table.get(entry_key(kernel, head_dim, dtype))
    if not (isinstance(found, list) and len(found) == 4 and all(isinstance(x, int) and x > 0 for x in found)):
        return None
    return tuple(found)


def store(entries: dict[str, tuple[int, int, int, int]], key: str) -> Path:
    """Merge ``entries`` (:func:`entry_key` -> config) into the device ``key``'s table and write the file atomically
    (a temporary file beside it, then a rename: a reader never sees half a file). Returns the file's path."""
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(_read(str(path)))
    data[key] = {**data.get(key, {}), **{k: [int(x) for x in v] for k, v in entries.items()}}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".triton-configs-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    reload()
    return path


def reload() -> None:
    """Forget what was read, so that the next lookup reads the file again (after another process tuned)."""
    _read.cache_clear()
    _device_table.cache_clear()
