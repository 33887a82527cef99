"""Launch configurations tuned on the GPU at hand, kept on disk: ``hf-dilated tune`` measures them
(:mod:`.tuning`), :mod:`.configs` reads them before its built-in tables.

One JSON file, ``$HF_DILATED_CACHE/triton-configs.json`` (default ``~/.cache/hf_dilated``), maps a device key (GPU
name, compute capability, Triton version and hf_dilated version: a config measured with one Triton release may not
even compile with the next, and one measured on other kernel code may no longer be the best) to entries
``"<kernel>|<padded head dim>|<dtype>": [BLOCK_M, BLOCK_N, num_warps, num_stages]`` for the kernels of
:data:`KERNELS`. The file is read once per process; a file, a device table or an entry that cannot be used (not
JSON, not an object, block sizes that are not powers of two...) is ignored with one warning and the built-in tables
apply: never an error in the middle of a forward pass. Writers take a lock and re-read the file, so two processes
tuning at once both keep their results.
"""

from __future__ import annotations

import contextlib
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
    """``"<GPU name>|sm<major><minor>|triton <version>|hf_dilated <version>"`` of a CUDA device (the current one by
    default)."""
    import triton

    from ... import __version__

    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)}|sm{major}{minor}|triton {triton.__version__}|hf_dilated {__version__}"


CONFIG_RULE = ("[BLOCK_M, BLOCK_N, num_warps, num_stages] with power-of-two blocks of 16-256, 1-16 warps (a power of "
               "two) and 1-8 stages")


def valid_config(config) -> bool:
    """Whether ``config`` can be launched (:data:`CONFIG_RULE`; ``tl.arange`` needs power-of-two blocks)."""
    if not (isinstance(config, (list, tuple)) and len(config) == 4):
        return False
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in config):
        return False
    m, n, warps, stages = config
    pow2 = lambda x: x > 0 and x & (x - 1) == 0  # noqa: E731
    return all(pow2(b) and 16 <= b <= 256 for b in (m, n)) and pow2(warps) and warps <= 16 and 1 <= stages <= 8


_WARNED: set = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=4)


def check_kernel(kernel: str) -> str:
    """``kernel`` when it names a tunable kernel, else ``ValueError`` naming the allowed ones."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    return kernel


def entry_key(kernel: str, head_dim: int, dtype: torch.dtype) -> str:
    check_kernel(kernel)
    return f"{kernel}|{int(head_dim)}|{str(dtype).removeprefix('torch.')}"


def _load(p: Path, warn: bool = True) -> dict:
    """The file's device tables (those that are objects); ``{}`` when there is no usable file."""
    if not p.exists():
        return {}
    try:
        data = json.loads(p.read_text())
        if not isinstance(data, dict):
            raise ValueError("the top level is not an object")
    except (OSError, ValueError) as err:
        if warn:
            _warn_once(f"ignoring the tuned Triton configs in {p} ({err}); `hf-dilated tune` rewrites them")
        return {}
    bad = [key for key, table in data.items() if not isinstance(table, dict)]
    if bad and warn:
        _warn_once(f"ignoring the tuned Triton configs of {', '.join(map(repr, bad))} in {p} (not an object); "
                   "`hf-dilated tune` rewrites them")
    return {key: table for key, table in data.items() if isinstance(table, dict)}


@functools.lru_cache(maxsize=None)
def _read(path: str) -> dict:
    return _load(Path(path))


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
    name = entry_key(kernel, head_dim, dtype)
    found = table.get(name)
    if found is None:
        return None
    if not valid_config(found):
        _warn_once(f"ignoring the tuned Triton config {name}: {found!r} in {cache_file()} (not {CONFIG_RULE}); the "
                   "built-in config applies")
        return None
    return tuple(found)


def store(entries: dict[str, tuple[int, int, int, int]], key: str) -> Path:
    """Merge ``entries`` (:func:`entry_key` -> config) into the device ``key``'s table and write the file atomically
    (a temporary file beside it, then a rename: a reader never sees half a file). Under an exclusive lock the file is
    read again just before the merge, so what another process stored meanwhile is kept. Returns the file's path."""
    bad = {k: v for k, v in entries.items() if not valid_config(list(v))}
    if bad:
        raise ValueError(f"configs must be {CONFIG_RULE}, got {bad}")
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(path.name + ".lock")):
        data = _load(path, warn=False)
        data[key] = {**data.get(key, {}), **{k: [int(x) for x in v] for k, v in entries.items()}}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".triton-configs-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    reload()
    return path


@contextlib.contextmanager
def _locked(lock_path: Path):
    """An exclusive advisory lock on ``lock_path`` (``fcntl``; where there is none, no lock)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


GENERATION = 0  # how many times the tables were forgotten: recorded launch plans (``plans``) key on it


def reload() -> None:
    """Forget what was read, so that the next lookup reads the file again (after another process tuned), and warns
    again about what it cannot use."""
    global GENERATION
    GENERATION += 1
    _WARNED.clear()
    _read.cache_clear()
    _device_table.cache_clear()
