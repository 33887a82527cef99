"""Launching a compiled Triton kernel again without Triton's per-call argument binding.

``kernel[grid](*args, **constexprs)`` (Triton's ``JITFunction.run``) binds every argument to the kernel's signature,
specialises each one, builds its cache key, reads its knobs and checks the kernel's globals before the driver launch:
about 75 us a launch on the H200 machine's host, of which the driver launch (scratch allocation, argument packing,
``cuLaunchKernelEx``) is 19 (``benchmarks/NOTES_triton.md``, round 2, session 38). The dilated forward+backward makes
11-17 launches, so a 16K problem's GPU waits on the host.

:func:`run` keys each launch on what Triton specialises a kernel on (:func:`spec` of every positional argument, the
keyword arguments' values, the current device) and launches the kernel that the same key compiled before through the
compiled kernel's own ``[grid]`` launcher (the driver launch, Triton's launch hooks and scratch allocator, nothing
else). Everything else goes through ``kernel[grid]``: the first launch of each key, the interpreter, and any kernel
or Triton release whose compiled kernels this cannot launch directly.
"""

from __future__ import annotations

import inspect

import torch

from .configs import interpreting
from .hopper import switch

# False (``HF_DILATED_RELAUNCH=0`` in the environment when this is imported): every launch through ``kernel[grid]``,
# for a Triton release whose specialisation this does not model (tests compare both ways: the same bits).
ENABLED = switch("HF_DILATED_RELAUNCH")
# Launches made directly: what a test asserts to know that this path ran.
DIRECT = 0
_COMPILED: dict = {}
_NOT_DIRECT: set = set()
_INTS: dict = {}
_I32, _I64 = 2**31, 2**63


class Unkeyed(TypeError):
    """An argument of a type whose specialisation :func:`spec` does not model (the launch goes through Triton)."""


def spec(arg):
    """A hashable value that tells apart at least every two arguments that Triton's specialisation tells apart:
    a tensor's dtype and 16-byte alignment; an int's range (int32, int64, uint64), whether it is 1 and whether 16
    divides it; the type of a float, a bool or None (Triton does not specialise on their values). An int's is
    remembered (strides and sizes repeat from launch to launch: a lookup costs a third of working it out)."""
    if type(arg) is int:
        hit = _INTS.get(arg)
        if hit is None:
            if len(_INTS) >= 65536:
                _INTS.clear()
            hit = _INTS[arg] = (arg == 1, arg % 16 == 0, 0 if -_I32 <= arg < _I32 else 1 if -_I64 <= arg < _I64 else 2)
        return hit
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if arg is None or type(arg) in (float, bool):
        return type(arg)
    raise Unkeyed(f"no specialisation model for a {type(arg).__name__} argument")


def run(kernel, grid, *args, **constexprs):
    """``kernel[grid](*args, **constexprs)``; a launch whose key (:func:`spec` of each of ``args``, ``constexprs``'
    values, the current device) compiled before runs that compiled kernel directly. ``grid``: a tuple of 1-3 ints;
    ``args``: the kernel's runtime arguments by position; constexprs and launch options go by keyword."""
    global DIRECT
    if not ENABLED or kernel in _NOT_DIRECT or interpreting():
        return kernel[grid](*args, **constexprs)
    try:
        key = (kernel, torch.cuda.current_device(), tuple(map(spec, args)), tuple(constexprs.items()))
        hit = _COMPILED.get(key)
    except (TypeError, AssertionError, RuntimeError):  # Unkeyed, a keyword value that is not hashable, no CUDA
        return kernel[grid](*args, **constexprs)
    if hit is not None:
        compiled, tail = hit
        compiled[grid if len(grid) == 3 else (*grid, 1, 1)[:3]](*args, *tail)
        DIRECT += 1
        return compiled
    compiled = kernel[grid](*args, **constexprs)
    tail = None
    params, signature = getattr(kernel, "params", None), getattr(kernel, "signature", None)
    if params is not None and signature is not None and hasattr(type(compiled), "__getitem__"):
        tail = launch_tail(signature, [p.is_constexpr for p in params], len(args), constexprs)
    if tail is None:
        _NOT_DIRECT.add(kernel)
    else:
        if len(_COMPILED) >= 4096:
            _COMPILED.clear()
        _COMPILED[key] = (compiled, tail)
    return compiled


def launch_tail(signature: inspect.Signature, is_constexpr: list, n_args: int, constexprs: dict) -> tuple | None:
    """The values of a kernel's parameters after its first ``n_args``, in signature order (a compiled kernel's
    launcher takes every parameter, constexprs included), or None when a launch with these arguments cannot go
    direct: a constexpr parameter passed by position (its value is not in the key) or a parameter with no value."""
    if any(is_constexpr[:n_args]):
        return None
    tail = []
    for name, param in list(signature.parameters.items())[n_args:]:
        if name in constexprs:
            tail.append(constexprs[name])
        elif param.default is not inspect.Parameter.empty:
            tail.append(param.default)
        else:
            return None
    return tuple(tail)
