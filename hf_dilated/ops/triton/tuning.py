"""Measure the dilated kernels' launch configurations on the GPU at hand and keep the fastest (``hf-dilated tune``).

Per padded head dim and dtype, on LongNet branches (``w = 2048..32768``, ``r = 1..16``) over ``seq_len`` tokens:
the forward kernel, then the backward's dK/dV and dQ kernels. Each candidate runs once and its result is checked
against the current config's (a candidate that fails to compile, needs more shared memory than the GPU has, or
disagrees is skipped and reported), then it is timed; the fastest per kernel, when it beats the current config, is
stored under this GPU's key (:mod:`.tuned`), where :mod:`.configs` finds it from then on. The candidate lists are the
ones the H100 tables were chosen from (``benchmarks/tune_triton.py`` sweeps the same lists). The configs are the
portable kernels', timed with them also where the Gluon kernels would run (sm_90): they run there for windows,
dropout, holes, float32, other head dims and ``HF_DILATED_GLUON=0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from . import configs, hopper, launch, tuned

LONGNET = ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16))
# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates per kernel, for head dims up to 128 ...
FWD = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3)]
KV = [(64, 64, 8, 2), (32, 128, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3)]
DQ = [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 8, 2), (128, 32, 8, 3)]
# ... and for head dim 256: a tile row is 512 bytes, so shared memory allows only smaller tiles and fewer stages.
FWD_256 = [(64, 32, 8, 2), (64, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 1), (64, 32, 4, 3),
           (32, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 3)]
KV_256 = [(32, 32, 8, 1), (32, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 1), (32, 64, 4, 2), (16, 64, 4, 2),
          (16, 64, 4, 3), (32, 64, 8, 3), (64, 64, 8, 2), (32, 32, 4, 3)]
DQ_256 = [(32, 32, 8, 1), (64, 32, 8, 2), (64, 64, 8, 1), (32, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 1),
          (64, 32, 8, 3), (64, 64, 8, 2), (128, 32, 8, 2), (32, 32, 4, 2), (32, 32, 8, 3)]
HEAD_DIMS = (16, 32, 64, 128, 256)  # the padded head dims the kernels have


def candidates(kernel: str, head_dim: int) -> list[tuple[int, int, int, int]]:
    """The candidate configs of ``kernel`` (``fwd``, ``dkdv``, ``dq``) at padded head dim ``head_dim``."""
    small = {"fwd": FWD, "dkdv": KV, "dq": DQ}
    large = {"fwd": FWD_256, "dkdv": KV_256, "dq": DQ_256}
    return list((large if head_dim > 128 else small)[tuned.check_kernel(kernel)])


@dataclass
class Trial:
    """One measured candidate: ``ms`` (``None`` when it was skipped: ``error`` says why)."""

    kernel: str
    head_dim: int
    dtype: torch.dtype
    config: tuple[int, int, int, int] | None  # None: the config in use before tuning (tables or an earlier tuning)
    ms: float | None = None
    error: str | None = None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _bench(fn: Callable[[], object]) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def tune(
    head_dims: Sequence[int] = (64, 128),
    dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
    seq_len: int = 65536,
    heads: int = 16,
    kernels: Sequence[str] = tuned.KERNELS,
    *,
    device: torch.device | str | None = None,
    key: str | None = None,
    timer: Callable[[Callable[[], object]], float] | None = None,
    candidates_of: Callable[[str, int], list] = candidates,
    save: bool = True,
    progress: bool = True,
) -> list[Trial]:
    """Measure every candidate (see the module docstring) and, with ``save``, store the winners under ``key`` (this
    GPU's :func:`.tuned.device_key` by default). Returns every trial, the current configs' (``config=None``) first
    for each kernel. ``timer(fn) -> ms`` defaults to Triton's ``do_bench`` median."""
    for name, values, allowed in (("head_dims", head_dims, HEAD_DIMS), ("kernels", kernels, tuned.KERNELS)):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise ValueError(f"{name} must be a non-empty list of {', '.join(map(str, allowed))}, got {list(values)}")
    bad = [d for d in dtypes if d not in (torch.float16, torch.bfloat16, torch.float32)]
    if bad or not dtypes:
        raise ValueError(f"dtypes must be a non-empty list of float16, bfloat16, float32, got {list(dtypes)}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 16:
        raise ValueError(f"seq_len must be an int >= 16, got {seq_len!r}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    device = torch.device(device if device is not None else ("cpu" if configs.interpreting() else "cuda"))
    if device.type != "cuda" and not configs.interpreting():
        raise ValueError("tuning runs the Triton kernels: it needs a CUDA GPU (or TRITON_INTERPRET=1, for tests)")
    if key is None:
        key = tuned.device_key(device)
    timer = timer or _bench
    from tqdm.auto import tqdm

    work = [(d, dt, k) for d in head_dims for dt in dtypes for k in tuned.KERNELS if k in kernels]
    bar = tqdm(total=sum(len(candidates_of(k, d)) + 1 for d, _, k in work), desc="tuning", unit="config",
               disable=not progress)
    trials: list[Trial] = []
    for d in head_dims:
        for dtype in dtypes:
            trials += _measure(d, dtype, seq_len, heads, [k for k in tuned.KERNELS if k in kernels], device, timer,
                               candidates_of, bar.update)
    bar.close()
    winners = {}
    for d, dtype, kernel in work:
        rows = [t for t in trials if (t.kernel, t.head_dim, t.dtype) == (kernel, d, dtype) and t.ms is not None]
        best = min(rows, key=lambda t: t.ms)  # the current config's trial comes first: it wins ties
        if best.config is not None:
            winners[tuned.entry_key(kernel, d, dtype)] = best.config
    if save and winners:
        tuned.store(winners, key)
    return trials


def _measure(d, dtype, seq_len, heads, kernels, device, timer, candidates_of, tick) -> list[Trial]:
    """The trials of one padded head dim and dtype: per kernel the current config, then every candidate."""
    from ..layout import resolve_layout
    from .schedule import layout_runs

    layout = resolve_layout(1, seq_len, seq_len, device)
    plan, valid, cache_key = layout_runs(layout), (layout.q_valid, layout.k_valid), ("contiguous", 1, seq_len, seq_len)
    gen = torch.Generator(device=device).manual_seed(d)
    q, k, v, do = (torch.randn(1, heads, seq_len, d, device=device, dtype=dtype, generator=gen) for _ in range(4))
    pb = launch.Problem(LONGNET, True, d ** -0.5, 0)
    tol = 1e-4 if dtype == torch.float32 else 5e-3

    def fwd():
        return launch.forward(q, k, v, pb, plan, valid, cache_key)[:1]

    o, lse = launch.forward(q, k, v, pb, plan, valid, cache_key)

    def bwd():
        return launch.backward(do, q, k, v, o, lse, pb, plan, valid, cache_key)

    trials, wants = [], {}
    for kernel in kernels:
        run = fwd if kernel == "fwd" else bwd
        # Every config is the portable kernels': time those where the Gluon ones would run (sm_90).
        with hopper.portable():
            want = wants[run] = wants.get(run) or run()  # the current config's result (one backward for dK/dV, dQ)
            trials.append(Trial(kernel, d, dtype, None, ms=timer(run)))
            tick()
            for config in candidates_of(kernel, d):
                trial = Trial(kernel, d, dtype, tuple(config))
                try:
                    with configs.forced(kernel, config):
                        err = max(_rel(a, b) for a, b in zip(run(), want))
                        if err > tol:
                            trial.error = f"disagrees with the current config (relative error {err:.1e})"
                        else:
                            trial.ms = timer(run)
                except Exception as exc:  # noqa: BLE001 (does not compile, out of shared memory, ...)
                    trial.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                trials.append(trial)
                tick()
    return trials
