"""Eager autograd for the custom ops: the forward op applied through a ``torch.autograd.Function`` that reuses the
``setup_context`` and backward registered for it with ``torch.library.register_autograd``.

Why: torch.library's autograd wrapper rebuilds each call's arguments against the op's schema (``fill_defaults`` lists
the schema's arguments once per argument: 74 us per call of the 20-argument dilated op on this project's CPU, a
quarter of its host time per forward+backward), and it hands the backward zeros for an output nothing used (the lse,
usually), which cost a fill and a ``delta - dlse`` pass. A small problem's GPU waits on the host
(``benchmarks/NOTES_triton.md``, session 18). Traced code (``torch.compile``) and calls without gradients use the
op as registered: one definition of the gradient, two ways in. The Function is of the ``setup_context`` style, which
``torch.func`` transforms accept (an old-style ``forward(ctx, ...)`` would skip ``inspect.signature`` per call, about
20 us here, and lose them).
"""

from __future__ import annotations

from typing import Callable

import torch


def eager_function(name: str, op, setup_context: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` named ``name`` whose forward is ``op`` and whose gradient is ``op``'s registered one;
    gradients of unused outputs arrive as None (the backward must accept None for each output)."""

    def setup(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        setup_context(ctx, inputs, output)

    return type(name, (torch.autograd.Function,), dict(
        __doc__=f"``{op}`` under eager autograd ({__name__}).",
        forward=staticmethod(lambda *inputs: op(*inputs)),
        setup_context=staticmethod(setup),
        backward=staticmethod(backward),
    ))


def call(function: type[torch.autograd.Function], op, args: tuple, differentiable: tuple):
    """``op(*args)``, through ``function`` when an eager gradient of ``differentiable`` tensors is being recorded."""
    if (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and any(t.requires_grad for t in differentiable)):
        return function.apply(*args)
    return op(*args)
