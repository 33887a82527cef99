"""What the Gluon kernels for Hopper share: the import of Triton's Gluon API (experimental, so it may be missing or
named otherwise), the ``HF_DILATED_GLUON`` switch, when a Gluon kernel may run at all, and the TMA row descriptor.

Gluon (``triton.experimental.gluon``) lets a kernel say where each operand lives, which ``wgmma`` runs
asynchronously and when a buffer may be refilled: the arrangement of the dK/dV kernels in ``block_sparse_hopper.py``
and ``backward_hopper.py`` that Triton's compiler does not choose. Gluon has no interpreter: the CPU tests compile
those kernels for sm_90 (``benchmarks/kernel_resources.py``), the GPU tests run them against the float64 reference.
"""

from __future__ import annotations

import os

import triton

from . import configs

try:  # Gluon is experimental; a Triton without it (or with another API) keeps the portable kernels
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait,
    )

    # The TMA load's name: ``async_copy_global_to_shared`` up to Triton 3.6, ``async_load`` after.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except Exception:  # pragma: no cover - depends on the installed Triton
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_init = None
    warpgroup_mma_wait = tma_load = None


def available() -> bool:
    """Whether this Triton has the Gluon Hopper API the kernels are written against (checked on Triton 3.6 and 3.9;
    earlier Gluon releases named and laid out things differently)."""
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return gluon is not None and (major, minor) >= (3, 6)


_SWITCH = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


def enabled() -> bool:
    """``HF_DILATED_GLUON=0`` (or ``false`` / ``off`` / ``no``) in the environment keeps the portable kernels: for a
    Triton whose Gluon misbehaves, or to compare the two (``benchmarks/ab_gluon_backward.py``). Unset or
    ``1`` / ``true`` / ``on`` / ``yes``: the Gluon kernels where they apply; any other value is refused."""
    value = os.environ.get("HF_DILATED_GLUON", "1").strip().lower()
    if value not in _SWITCH:
        raise ValueError(f"HF_DILATED_GLUON must be one of {sorted(_SWITCH)}, got {os.environ['HF_DILATED_GLUON']!r}")
    return _SWITCH[value]


def runnable(tma_path: bool) -> bool:
    """Whether a Gluon kernel may run on this call's device: :func:`enabled` (read first, so that a bad
    ``HF_DILATED_GLUON`` is refused on any machine), the tensor-descriptor path on (``tma_path``), not under Triton's
    interpreter (Gluon has none), an sm_90 GPU (``wgmma``) and a Triton with the API (:func:`available`)."""
    return enabled() and tma_path and not configs.interpreting() and configs.wgmma() and available()


if gluon is not None:

    @gluon.jit
    def row_desc(base, n, row_stride, BLOCK_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
        """A TMA descriptor over a head's ``n`` rows (``row_stride`` apart: a head's rows, or its dilated rows with
        ``r * stride_n``), read ``BLOCK_ROWS`` at a time into shared memory of ``layout``; rows past ``n`` read as
        zeros (Gluon's ``tiles.row_desc``)."""
        return tma.make_tensor_descriptor(base, shape=[n, HEAD_DIM], strides=[row_stride, 1],
                                          block_shape=[BLOCK_ROWS, HEAD_DIM], layout=layout)
