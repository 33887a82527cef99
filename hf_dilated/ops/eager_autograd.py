"""Eager autograd for the custom ops: the forward op applied through a ``torch.autograd.Function`` that reuses the
``setup_context`` and backward registered for it with ``torch.library.register_autograd``.

Why: torch.library's autograd wrapper rebuilds each call's arguments against the op's schema (``fill_defaults`` lists
the schema's arguments once per argument: 74 us per call of the 20-argument dilated op on this project's CPU, a
quarter of its host time per forward+backward), and it hands the backward zeros for an output nothing used (the lse,
usually), which cost a fill and a ``delta - dlse`` pass. A small problem's GPU waits on the host
(``benchmarks/NOTES_triton.md``, session 18). Traced code (``torch.compile``) uses the op as registered: one
definition of the gradient, two ways in. The Function is of the ``setup_context`` style, which
``torch.func`` transforms accept (an old-style ``forward(ctx, ...)`` would lose them). That style makes
``Function.apply`` bind each call's arguments to ``inspect.signature(forward)``; the forward carries its
``__signature__``, so that is a lookup (computing it cost about 5 us a call here).

Eager calls also skip the dispatcher where nothing needs it (:func:`eager_op`): the Function's forward and backward,
and calls without gradients, run the op's Python implementation itself. Through torch.library each op call spent
about 40 us on this project's CPU (the autograd key's redispatch, the schema's checks, the no-alias check of the
outputs): a forward+backward of SmolLM2's 9 / 3 heads took 425-438 us of host time with it and 334-366 without, a
forward without gradients 115 and 77 (``benchmarks/host_overhead.py``): time a small problem's GPU waits for.
"""

from __future__ import annotations

import inspect
import threading
from typing import Callable

import torch


try:  # PyTorch has no public way to ask; this private helper has existed since 2.1
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode as _dispatch_mode_active
except ImportError:  # pragma: no cover - unknown: every call dispatches the op, as it would without eager_op
    def _dispatch_mode_active() -> bool:
        return True

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def direct(args: tuple) -> bool:
    """Whether eager code may run an op's Python implementation on ``args`` itself instead of dispatching the op: not
    traced, no ``TorchDispatchMode`` active (a mode sees the op as one call: fake tensors, FLOP counters, op
    recorders), every tensor a plain one on a real device (meta and subclass tensors take the registered op: its fake
    implementation, the subclass's own handling), and none that autograd would follow through the call (grad mode on
    and a tensor requiring grad, as in a backward with ``create_graph=True``: through the op, differentiating its
    outputs raises; the implementation's kernels would leave them silently constant)."""
    if torch.compiler.is_compiling() or _dispatch_mode_active():
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN or a.is_meta or (grad and a.requires_grad)):
            return False
    return True


_EAGER = threading.local()


def running_eagerly() -> bool:
    """Whether the calling thread is inside an implementation that :func:`eager_op` called directly: plain eager
    code, not a traced or compiled graph, nor one whose allocations a CUDA-graph tree's warm-up routes to its pool
    (what ``ops/triton/plans.py`` asks before it captures a CUDA graph of its own)."""
    return getattr(_EAGER, "on", False)


def eager_op(op, impl: Callable) -> Callable:
    """``op`` (a ``torch.library.custom_op`` object), except where :func:`direct` allows calling ``impl``, the
    Python function it was made from: the same computation without the dispatcher's per-call work."""

    def run(*args):
        if not direct(args):
            return op(*args)
        outer = getattr(_EAGER, "on", False)
        _EAGER.on = True
        try:
            return impl(*args)
        finally:
            _EAGER.on = outer

    run.__name__ = run.__qualname__ = f"eager_{impl.__name__}"
    return run


def eager_function(name: str, op, setup_context: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` named ``name`` whose forward is ``op`` and whose gradient is ``op``'s registered one;
    gradients of unused outputs arrive as None (the backward must accept None for each output)."""

    def setup(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        setup_context(ctx, inputs, output)

    def forward(*inputs):
        return op(*inputs)

    forward.__signature__ = inspect.signature(forward)  # what Function.apply asks for on every call
    return type(name, (torch.autograd.Function,), dict(
        __doc__=f"``{op}`` under eager autograd ({__name__}).",
        forward=staticmethod(forward),
        setup_context=staticmethod(setup),
        backward=staticmethod(backward),
    ))


def call(function: type[torch.autograd.Function], op, args: tuple, differentiable: tuple):
    """``op(*args)``, through ``function`` when an eager gradient of ``differentiable`` tensors is being recorded."""
    if (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and any(t.requires_grad for t in differentiable)):
        return function.apply(*args)
    return op(*args)


def register(fwd, fwd_impl: Callable, bwd, bwd_impl: Callable, setup_context: Callable, backward_through: Callable,
             name: str) -> tuple[Callable, type[torch.autograd.Function]]:
    """Register ``backward_through(bwd)`` as the autograd of the custom op ``fwd`` (``bwd``: its backward op; both
    ``torch.library.custom_op`` objects, made from ``fwd_impl`` / ``bwd_impl``), and return the eager way in for
    :func:`call`: ``(forward, Function)``, each running the implementations where :func:`direct` allows."""
    torch.library.register_autograd(fwd, backward_through(bwd), setup_context=setup_context)
    forward = eager_op(fwd, fwd_impl)
    return forward, eager_function(name, forward, setup_context, backward_through(eager_op(bwd, bwd_impl)))
