"""Launching a compiled Triton kernel again without Triton's per-call argument binding.

``kernel[grid](*args, **constexprs)`` (Triton's ``JITFunction.run``) binds every argument to the kernel's signature,
specialises each one, builds its cache key, reads its knobs and checks the kernel's globals before the driver launch:
about 75 us a launch on the H200 machine's host, of which the driver launch (scratch allocation, argument packing,
``cuLaunchKernelEx``) is 19 (``benchmarks/NOTES_triton.md``, round 2, session 38). The dilated forward+backward makes
11-17 launches, so a 16K problem's GPU waits on the host.

:func:`run` keys each launch on what Triton specialises a kernel on (:func:`key`: the leading tensors' dtypes and
16-byte alignment, the other arguments' values, the keyword arguments' values, the current device) and launches the
kernel that the same key compiled before through the compiled kernel's driver launcher, as Triton's ``compiled[grid]``
calls it but with no launch hooks to call (when none is registered) and the tensors passed as pointers. Everything else
goes through ``kernel[grid]``: the first launch of each key, the interpreter, a registered launch hook, and any kernel
or Triton release whose compiled kernels this cannot launch directly.
"""

from __future__ import annotations

import inspect
from functools import reduce
from operator import attrgetter, or_

import torch

from .configs import interpreting
from .hopper import switch

# False (``HF_DILATED_RELAUNCH=0`` in the environment when this is imported): every launch through ``kernel[grid]``,
# for a Triton release whose specialisation this does not model (tests compare both ways: the same bits).
ENABLED = switch("HF_DILATED_RELAUNCH")
# Launches made directly: what a test asserts to know that this path ran.
DIRECT = 0
_COMPILED: dict = {}  # exact key -> (launcher, the constexprs' tail)
_CLASSES: dict = {}  # class key -> the same
_NOT_DIRECT: set = set()
_LEADING: dict = {}  # kernel -> how many of its arguments lead as tensors (learned at its first launch)
_INTS: dict = {}
_I32, _I64 = 2**31, 2**63
_DATA_PTR, _DTYPE = torch.Tensor.data_ptr, attrgetter("dtype")


class Unkeyed(TypeError):
    """An argument of a type whose specialisation :func:`spec` does not model (the launch goes through Triton)."""


def spec(arg):
    """A hashable value that tells apart at least every two non-tensor arguments that Triton's specialisation tells
    apart: an int's range (int32, int64, uint64), whether it is 1 and whether 16 divides it; the type of a float, a
    bool or None (Triton does not specialise on their values). An int's is remembered (strides and sizes repeat from
    launch to launch: a lookup costs a third of working it out)."""
    if type(arg) is int:
        hit = _INTS.get(arg)
        if hit is None:
            if len(_INTS) >= 65536:
                _INTS.clear()
            hit = _INTS[arg] = (arg == 1, arg % 16 == 0, 0 if -_I32 <= arg < _I32 else 1 if -_I64 <= arg < _I64 else 2)
        return hit
    if arg is None or type(arg) in (float, bool):
        return type(arg)
    raise Unkeyed(f"no specialisation model for a {type(arg).__name__} argument")


def key(args, n: int):
    """``(key, pointers)`` of a launch's positional ``args`` whose first ``n`` are tensors: the key tells apart at
    least every two launches that Triton's specialisation tells apart. For the tensors: their dtypes and whether each
    pointer is 16-byte aligned (their pointers come back as ints, to launch with: the driver launcher then neither
    calls ``data_ptr`` nor asks the driver about each one). For the other arguments (ints, floats, bools, None): their
    types and values, a finer split than Triton's (an int's range, whether it is 1 and whether 16 divides it; a
    float's or a bool's type). Raises ``TypeError`` when one of the first ``n`` is not a tensor; the key cannot
    be hashed when an argument cannot (:func:`run` then launches through Triton)."""
    lead, rest = args[:n], args[n:]
    ptrs = list(map(_DATA_PTR, lead))
    aligned = tuple(p & 15 == 0 for p in ptrs) if reduce(or_, ptrs, 0) & 15 else True
    return ((tuple(map(_DTYPE, lead)), aligned), rest, tuple(map(type, rest))), ptrs


def class_key(exact: tuple) -> tuple:
    """A :func:`key` with the other arguments' values replaced by Triton's classes of them (:func:`spec`): the same
    compiled kernel for every int of a class, as when a decoding loop's cache grows by a token a step. Raises
    :class:`Unkeyed` for an argument of another type."""
    tensors, rest, _ = exact
    return tensors, tuple(map(spec, rest))


def leading(kernel, args) -> int:
    """How many of ``kernel``'s positional arguments lead as tensors (learned at its first launch: every launch site
    passes its tensors first, ``test_every_launch_site_launches_directly``)."""
    n = _LEADING.get(kernel)
    if n is None:
        n = _LEADING[kernel] = next((i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)), len(args))
    return n


def _find(kernel, args, constexprs: dict):
    """``(exact key, class key, the remembered launch or None, the leading tensors' pointers, the device)`` of a
    launch. Raises ``TypeError`` / ``AssertionError`` / ``RuntimeError`` where it cannot be keyed: a leading argument
    that is not a tensor, a value that cannot be hashed or has no class (Unkeyed), no CUDA."""
    launch_key, ptrs = key(args, leading(kernel, args))
    device = torch.cuda.current_device()
    options = tuple(constexprs.items())
    launch_key = (kernel, device, launch_key, options)
    hit = _COMPILED.get(launch_key)
    wide_key = None
    if hit is None:  # new values: perhaps of classes Triton compiled for before
        wide_key = (kernel, device, class_key(launch_key[2]), options)
        hit = _CLASSES.get(wide_key)
        if hit is not None:
            _keep(_COMPILED, launch_key, hit)
    return launch_key, wide_key, hit, ptrs, device


def run(kernel, grid, *args, **constexprs):
    """``kernel[grid](*args, **constexprs)``; a launch whose :func:`key` (with ``constexprs``' values and the current
    device) compiled before runs that compiled kernel through its driver launcher (:func:`direct_launcher`).
    ``grid``: a tuple of 1-3 ints; ``args``: the kernel's runtime arguments by position, its tensors first;
    constexprs and launch options go by keyword."""
    global DIRECT
    if not ENABLED or kernel in _NOT_DIRECT or interpreting():
        return kernel[grid](*args, **constexprs)
    try:
        launch_key, wide_key, hit, ptrs, device = _find(kernel, args, constexprs)
    except (TypeError, AssertionError, RuntimeError):
        return kernel[grid](*args, **constexprs)
    if hit is not None and not hooked():
        launcher, tail = hit
        launcher(grid if len(grid) == 3 else (*grid, 1, 1)[:3], device, *ptrs, *args[len(ptrs):], *tail)
        DIRECT += 1
        return None
    compiled_kernel = kernel[grid](*args, **constexprs)
    if hit is None:
        _learn(kernel, (launch_key, wide_key), compiled_kernel, len(args), constexprs)
    return compiled_kernel


def compiled(kernel, args, constexprs: dict):
    """``(device index, launch, tail)``: how :func:`run` launches these arguments directly now (``launch(grid3,
    device, *pointers, *other args, *tail)``), or None where it would go through Triton (switched off, the
    interpreter, a kernel or argument it cannot key, nothing compiled yet). What a recorded plan
    (:mod:`.plans`) replays with."""
    if not ENABLED or kernel in _NOT_DIRECT or interpreting():
        return None
    try:
        _, _, hit, _, device = _find(kernel, args, constexprs)
    except (TypeError, AssertionError, RuntimeError):
        return None
    return None if hit is None else (device, *hit)


def count_direct() -> None:
    """Count a launch made directly elsewhere (a replayed plan) in ``DIRECT``."""
    global DIRECT
    DIRECT += 1


def _keep(cache: dict, key_, value):
    """``cache[key_] = value``, the cache emptied first when it holds 4096 entries."""
    if len(cache) >= 4096:
        cache.clear()
    cache[key_] = value


def _learn(kernel, keys: tuple, compiled, n_args: int, constexprs: dict):
    """After Triton's launch of a new key: remember how to launch it directly (under its exact and its class key), or
    that this kernel cannot be."""
    params, signature = getattr(kernel, "params", None), getattr(kernel, "signature", None)
    tail = launcher = None
    if params is not None and signature is not None:
        tail = launch_tail(signature, [p.is_constexpr for p in params], n_args, constexprs)
        launcher = direct_launcher(compiled)
    if tail is None or launcher is None:
        _NOT_DIRECT.add(kernel)
    else:  # (class_key refused any argument but an int, float, bool or None: no tensor is kept alive here)
        for cache, key_ in zip((_COMPILED, _CLASSES), keys):
            _keep(cache, key_, (launcher, tail))


def direct_launcher(compiled):
    """``launch(grid3, device, *args)`` for a compiled kernel. On the Triton releases whose convention this was checked
    against (3.6 to 3.9): its driver launcher (``compiled.run``), called as Triton's own ``compiled[grid]`` calls it
    but without the launch hooks and their metadata (:func:`run` uses it only when no hook is registered). On others:
    ``compiled[grid]``. None when the compiled kernel has neither."""
    try:
        import triton
        from triton.runtime import driver
        checked = (3, 6) <= tuple(int(x) for x in triton.__version__.split(".")[:2]) <= (3, 9)
        launcher, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        stream = driver.active.get_current_stream
    except (AttributeError, ImportError, ValueError):
        checked = False
    if not checked:
        if not hasattr(type(compiled), "__getitem__"):
            return None
        return lambda grid, device, *args: compiled[grid](*args)
    if not callable(launcher) or function is None:
        return None

    def launch(grid, device, *args):
        launcher(grid[0], grid[1], grid[2], stream(device), function, packed, None, None, None, *args)

    return launch


def hooked() -> bool:
    """Whether Triton has a launch hook registered (a profiler such as proton): then launches go through
    ``kernel[grid]``, which calls the hooks with their metadata."""
    global _RUNTIME_KNOBS
    if _RUNTIME_KNOBS is None:
        try:
            from triton import knobs
            _RUNTIME_KNOBS = knobs.runtime
        except (ImportError, AttributeError):
            _RUNTIME_KNOBS = False
    if _RUNTIME_KNOBS is False:
        return False
    hooks = (getattr(_RUNTIME_KNOBS, "launch_enter_hook", None), getattr(_RUNTIME_KNOBS, "launch_exit_hook", None))
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


_RUNTIME_KNOBS = None


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
