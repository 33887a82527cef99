"""What the Gluon kernels for Hopper share: the import of Triton's Gluon API (experimental, so it may be missing or
named otherwise), the ``HF_DILATED_GLUON`` switch, when a Gluon kernel may run at all, the TMA row descriptor, and
the dK/dV step.

Gluon (``triton.experimental.gluon``) lets a kernel say where each operand lives, which ``wgmma`` runs
asynchronously and when a buffer may be refilled: the arrangement of the dK/dV kernels in ``block_sparse_hopper.py``
and ``backward_hopper.py`` that Triton's compiler does not choose. Their step (the products of one key tile with one
query tile) and its buffers are here (:func:`dkdv_buffers`, :func:`dkdv_scores`, :func:`dkdv_products`); what a
kernel walks and masks is its own. Gluon has no interpreter: the CPU tests compile those kernels for sm_90
(``benchmarks/kernel_resources.py``), the GPU tests run them against the float64 reference.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

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


@contextlib.contextmanager
def portable():
    """Inside the block the portable kernels run where a Gluon one would (``HF_DILATED_GLUON=0``): what the tuners
    time when they choose the portable dK/dV kernel's config."""
    with mock.patch.dict(os.environ, {"HF_DILATED_GLUON": "0"}):
        yield


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

    @gluon.jit
    def dkdv_buffers(dtype: gl.constexpr, kv_layout: gl.constexpr, q_layout: gl.constexpr, p_layout: gl.constexpr,
                     BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr, HEAD_DIM: gl.constexpr):
        """The shared memory of a dK/dV program: ``(K, V, Q[2], dO[2], P^T, dS^T, the K/V copy's barrier, a barrier
        per Q/dO buffer)``, barriers initialised: K and V read once, Q and dO double-buffered."""
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_layout)
        q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_Q, HEAD_DIM], q_layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_Q, HEAD_DIM], q_layout)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_Q], p_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_Q], p_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        mbarrier.init(ready.index(0), count=1)
        mbarrier.init(ready.index(1), count=1)
        fence_async_shared()
        return k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem, kv_bar, ready

    @gluon.jit
    def dkdv_scores(k_smem, v_smem, qs, dos, s_zero, dk, dv):
        """A dK/dV step's transposed products, ``S^T = K Q^T`` and ``dP^T = V dO^T`` (K, V, Q, dO in shared memory),
        issued asynchronously: ``(S^T, dP^T in flight, dk, dv)``. In flight before them are the last step's dV / dK
        products; leaving only dP^T outstanding also retires those, whose buffers the next tile's copy overwrites."""
        sT = warpgroup_mma(k_smem, qs.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v_smem, dos.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sT, dk, dv = warpgroup_mma_wait(num_outstanding=1, deps=(sT, dk, dv))
        return sT, dpT, dk, dv

    @gluon.jit
    def dkdv_products(pT, dpT, delta, qs, dos, p_smem, ds_smem, dk, dv, dtype: gl.constexpr):
        """The rest of a dK/dV step: ``dV += P^T dO`` issued while ``dS^T = P^T (dP^T - delta)`` is computed, then
        ``dK += dS^T Q``, both left in flight. ``P^T`` and ``dS^T`` go to the products through shared memory, so that
        no register stays locked under an in-flight product."""
        p_smem.store(pT.to(dtype))
        fence_async_shared()
        dv = warpgroup_mma(p_smem, dos, dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT,))
        dsT = pT * (dpT - delta[None, :])
        ds_smem.store(dsT.to(dtype))
        fence_async_shared()
        dk = warpgroup_mma(ds_smem, qs, dk, is_async=True)
        return dk, dv

else:  # pragma: no cover - a Triton without Gluon: the kernel modules import these names and define no kernel
    row_desc = dkdv_buffers = dkdv_scores = dkdv_products = None
