"""Launch configurations (block sizes, warps, pipeline stages) per head dim, measured on an H100 with
``benchmarks/tune_triton.py`` (N = 64K, bf16, causal, LongNet branches; see ``benchmarks/NOTES_triton.md``), with
conservative fallbacks for other GPUs; configs tuned on the GPU at hand (``hf-dilated tune``, :mod:`.tuned`) come
first. Under ``TRITON_INTERPRET=1`` the blocks are small so that tiny test problems still run several blocks per loop
(and the masked and unmasked paths)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from . import tuned


@functools.lru_cache(maxsize=1)
def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), read once: Triton itself decides when
    its kernels are defined, and the launchers ask on every call."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _capability_major() -> int:
    """Compute capability major of the current CUDA device (0 without one), read once."""
    return torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0


def _hopper() -> bool:
    """Hopper-class kernels and configs (tensor-descriptor loads, tiles sized for 227 KB of shared memory): compute
    capability 9 or newer with that memory (H100 / H200, B200). sm_120 (RTX 50 series: ~100 KB) runs what the other
    GPUs run; with the Hopper configs 55 of its kernels needed more shared memory than it has
    (``kernel_resources.py --arch 120``)."""
    return _capability_major() >= 9 and not small_shared_memory()


@functools.lru_cache(maxsize=None)
def shared_memory_limit() -> int:
    """Shared memory one program may use on the current CUDA device (bytes, the opt-in maximum: the number Triton
    checks at launch), read once; unbounded without a GPU, or where this Triton's driver does not say (then the
    configs are those of the large-memory GPUs, as before this was read)."""
    if not torch.cuda.is_available():
        return 1 << 30
    try:
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(torch.cuda.current_device())["max_shared_mem"])
    except Exception:  # pragma: no cover - another Triton's driver API
        return 1 << 30


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on the H100 SXM), read once per device; 1 elsewhere."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def small_shared_memory() -> bool:
    """A GPU with about 100 KB of shared memory per program (sm_86 / 89 / 120: RTX 30 / 40 / 50 series, L4, L40S),
    where configs sized for the A100 (163 KB) or Hopper (227 KB) can fail to launch (``OutOfResources``)."""
    return shared_memory_limit() < 128 * 1024


def wgmma() -> bool:
    """Whether the GPU has Hopper's warpgroup MMA (sm_90 only: Blackwell's tensor cores take other instructions),
    which the Gluon kernels (``hopper.py``, ``backward_hopper.py``, ``block_sparse_hopper.py``) are written for."""
    return _capability_major() == 9


def dot_mode(dtype: torch.dtype) -> int:
    """``UPCAST`` of ``tiles.mm``: 1 for bfloat16 under the interpreter; float32 on a GPU: 2 (tf32x3) from Ampere on,
    3 (ieee) before it; else 0."""
    if interpreting():
        return int(dtype == torch.bfloat16)
    if dtype != torch.float32:
        return 0
    return 2 if _capability_major() >= 8 else 3


# (BLOCK_M, BLOCK_N, num_warps, num_stages) by head dim. Re-measured 2026-11-22 (H100, N = 32K, tune_triton.py):
# D=256 forward 8.67 -> 4.70 ms, D=256 dk/dv 47.1 -> 34.9 ms, D=128 dk/dv 7.24 -> 6.72 ms; the rest were already best.
# D=128 forward with TMA loads (N = 64K, LongNet branches): (64, 64, 4, 3) 3.56 ms against (128, 64, 8, 3) 3.77 ms.
_FWD_HOPPER = {64: (64, 64, 4, 3), 128: (64, 64, 4, 3), 256: (128, 64, 8, 2)}
# Until 2026-11-24 long inputs (from 128K query rows) took 128-row tiles: with the programs in item-major order every
# segment of a long input was in flight at once and 64-row tiles re-streamed K/V from DRAM (256K: 21.5 against
# 16.4 ms). The kernels now run an item's tiles as consecutive programs (tiles.item_tile) and 64-row tiles are the
# faster ones at 256K too: 13.0 against 13.8 ms forward (H100, D=128, benchmarks/NOTES_triton.md).
_FWD_OTHER = {64: (64, 64, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 1)}
# dk/dv kernel (BLOCK_M queries streamed, BLOCK_N keys held) and dq kernel (BLOCK_M queries held, BLOCK_N keys
# streamed).
_BWD_KV_HOPPER = {64: (32, 64, 4, 3), 128: (32, 64, 4, 3), 256: (32, 64, 8, 2)}
# D=128 dq: 3 stages, 13.19 ms against 13.84 backward at 64K (2026-11-22, session 5; dk/dv stays: 8-warp configs
# that end its register spills ran 35-60% slower).
_BWD_Q_HOPPER = {64: (64, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 4, 2)}
_BWD_OTHER = {64: (32, 64, 4, 2), 128: (32, 32, 4, 1), 256: (16, 32, 4, 1)}


def _cfg(t):
    m, n, w, s = t
    return {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}


def _pick(table: dict, d: int):
    return table[d] if d in table else table[max(k for k in table if k <= max(d, 64))]


# Configs forced by the tuner while it measures a candidate (kernel -> (BLOCK_M, BLOCK_N, num_warps, num_stages)).
_FORCED: dict[str, tuple[int, int, int, int]] = {}


@contextlib.contextmanager
def forced(kernel: str, config: tuple[int, int, int, int]):
    """Launch ``kernel`` (``"fwd"``, ``"dkdv"`` or ``"dq"``) with ``config`` inside the block, whatever the GPU and
    the tables say (also under the interpreter): how :mod:`.tuning` runs a candidate."""
    tuned.check_kernel(kernel)
    before = _FORCED.get(kernel)
    _FORCED[kernel] = tuple(config)
    try:
        yield
    finally:
        if before is None:
            _FORCED.pop(kernel, None)
        else:
            _FORCED[kernel] = before


def state() -> tuple:
    """What the configs depend on besides the head dim and dtype: the forced ones and the tuned tables' generation
    (part of a recorded launch plan's key, :mod:`.plans`)."""
    return tuned.GENERATION, tuple(_FORCED.items())


def _chosen(kernel: str, d: int, dtype: torch.dtype, table: dict) -> tuple:
    """A forced config, else one tuned on this GPU (``hf-dilated tune``), else the built-in table's, tiles halved
    for float32 (twice the bytes per element)."""
    if kernel in _FORCED:
        return _FORCED[kernel]
    t = tuned.lookup(kernel, d, dtype)
    if t is not None:
        return t
    t = _pick(table, d)
    if dtype == torch.float32:
        t = (max(t[0] // 2, 16), max(t[1] // 2, 16), t[2], max(t[3] - 1, 1) if kernel == "fwd" else 1)
    return t


def fwd_config(d: int, dtype: torch.dtype) -> dict:
    """Forward launch config for padded head dim ``d``."""
    if interpreting():
        return _cfg(_FORCED.get("fwd", (16, 16, 4, 1)))
    return _cfg(_chosen("fwd", d, dtype, _FWD_HOPPER if _hopper() else _FWD_OTHER))


def bwd_config(d: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """``(dK/dV config, dQ config)`` for padded head dim ``d``."""
    if interpreting():
        return _cfg(_FORCED.get("dkdv", (16, 16, 4, 1))), _cfg(_FORCED.get("dq", (16, 16, 4, 1)))
    hopper = _hopper()
    return (_cfg(_chosen("dkdv", d, dtype, _BWD_KV_HOPPER if hopper else _BWD_OTHER)),
            _cfg(_chosen("dq", d, dtype, _BWD_Q_HOPPER if hopper else _BWD_OTHER)))


def decode_config(d: int, dtype: torch.dtype) -> dict:
    if interpreting():
        return _cfg((16, 16, 4, 1))
    # float32 at head dim 256 needs 100 KB with two stages: one on ~100 KB GPUs (kernel_resources.py --arch 89)
    stages = 1 if dtype == torch.float32 and d > 128 and small_shared_memory() else 2
    return _cfg((16, 64 if d <= 128 else 32, 4, stages))


def use_tma(tensors, padded_head_dim: bool, holes: bool) -> bool:
    """Whether the forward reads Q/K/V through tensor descriptors (TMA): on Hopper or newer (and under the interpreter,
    so that the CPU tests run this path), for an unpadded head dim, without holes (a hole's row would be read as it
    is rather than as zeros), with 16-byte aligned base pointers and batch, head and row strides (the copy engine's
    rule). Measured on the H100: 1.10x forward at D=128, equal at D=64 (2026-11-22)."""
    if not (interpreting() or _hopper()) or holes or padded_head_dim:
        return False
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or t.stride(-1) != 1 or any((s * size) % 16 for s in t.stride()[:3]):
            return False
    return True


def descriptor_scratch(device: torch.device, arena: dict | None = None, grow: bool = True):
    """Give Triton an allocator for the tensor descriptors that kernels build on the device (a few hundred bytes per
    program). Set before each launch: the setting is a context variable, and the backward runs in autograd's thread.

    Without ``arena``, each launch gets its own allocation, freed when the launch returns (the caching allocator hands
    the block to the next launch on the stream). With ``arena`` (a dict the caller holds for one op call and empties
    at its end, :mod:`.plans`), the launches on a stream share one buffer, made anew only when a launch asks for more:
    a launch reads its descriptors only while it runs, and the next launch on the stream starts after it ends. That is
    one allocation a stream instead of one a launch (11 in a forward+backward: about 7 us each on the lent H200's
    host). A buffer kept per stream across calls broke ``torch.compile(mode="reduce-overhead")``: made during a
    CUDA-graph tree's warm-up, it lived in the graph's pool untracked (``benchmarks/NOTES_triton.md``, session 41);
    an arena lives for one call. ``grow`` False: the arena's buffers are all there is (a CUDA graph's capture,
    :mod:`.plans`), a request they do not cover raises ``RuntimeError``."""
    import triton

    if arena is None:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
        return

    def shared(size, alignment, stream):
        buf = arena.get(stream)
        if buf is None or buf.numel() < size:
            if not grow:
                raise RuntimeError(f"descriptor scratch: {size} bytes asked on stream {stream}, not in the arena")
            buf = arena[stream] = torch.empty(size, dtype=torch.int8, device=device)
        return buf

    triton.set_allocator(shared)
