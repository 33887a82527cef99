"""Launch plans: a launcher's work for one call signature, recorded at its first call and replayed after.

A launcher (``launch.forward`` / ``launch.backward``) decides much per call: the kernels and their configs, the
branch order, the grids, the buffers, every argument list. For a contiguous layout, all of it follows from what
:func:`signature` keys (shapes, strides, dtypes, the device, the problem, the switches): the same every layer and
every step of a model. A small problem's GPU waits on that host work (``benchmarks/NOTES_triton.md``: 2 ms a
forward+backward of SmolLM2's heads at 16K on the lent H200's host, against 1.07 ms of GPU time). So the launcher runs
its code once with a :class:`Recorder`, which performs every step as it is asked and notes it in terms of slots (the
call's input tensors, the buffers it allocates, constants that stay the same); later calls with the same signature
:meth:`Plan.replay`: allocate the buffers as recorded and launch each kernel again, directly where ``relaunch`` has
the compiled kernel (its pointers taken once a call, no per-launch key).

A recording becomes a plan only when every tensor a launch reads is a slot or a declared constant, and every output
a slot: anything else (a tensor made for this call alone) leaves the call unrecorded, so a replay cannot launch on
a stale pointer. The first replay is checked by the tests against the recording call, bit for bit, on the CPU
interpreter and on the GPU.

An eager replay goes one step further where its pointers come back (:class:`GraphCache`): a loop hands a call the
same memory every iteration, so the second time a pointer set is seen the replay is captured as a CUDA graph, and
later calls on it launch that graph, one ``cudaGraphLaunch`` for the call's 2-13 kernels, the fills, copies and
the dQ stream's fork and join (16K forward+backward of SmolLM2's heads on the lent H200: 1.4-1.6 ms of host time ->
1.0 ms). Every pointer the graph launches on is in its key, so it runs only on memory this call owns.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import Counter, OrderedDict
from functools import reduce
from operator import or_

import torch

from ..eager_autograd import running_eagerly
from . import relaunch
from .configs import descriptor_scratch
from .hopper import environment_values, switch

# Replayed plans (``HF_DILATED_PLANS=0`` in the environment when this is imported: every call runs the launcher's
# code; tests compare the two).
ENABLED = switch("HF_DILATED_PLANS")
_PLANS: dict = {}
_MAX_PLANS = 256
# Environment switches that change what a launcher does, read at every call (part of the signature).
ENV_SWITCHES = ("HF_DILATED_GLUON", "HF_DILATED_WS", "HF_DILATED_PERSISTENT", "HF_DILATED_FUSED_DQ",
                "HF_DILATED_WS_DKDV")
REPLAYS = 0  # calls replayed: what a test asserts to know this path ran
# Replays of a pointer set seen before launched as one CUDA graph (``HF_DILATED_GRAPHS=0``: launch by launch)
GRAPHS = switch("HF_DILATED_GRAPHS")
GRAPH_REPLAYS = 0


def forget() -> None:
    """Drop every recorded plan (tests call it before each test, since they patch the launchers' helpers)."""
    _PLANS.clear()


def signature(kind: str, tensors, *extra):
    """The key of a call: ``kind``, each tensor's shape, strides and dtype, the device, whether every pointer is
    16-byte aligned (the tensor-descriptor path depends on it), ``extra`` (the problem, the layout's key, the
    launcher's own switches) and the environment's switches."""
    first = tensors[0]
    aligned = not reduce(or_, [t.data_ptr() for t in tensors], 0) & 15
    shapes = tuple((t.shape, t.stride(), t.dtype) for t in tensors)
    env = environment_values(ENV_SWITCHES)
    return kind, shapes, first.device, aligned, extra, env, torch.are_deterministic_algorithms_enabled()


def lookup(key) -> Plan | None:
    """The plan recorded for ``key`` (None: none, or ``key`` is None)."""
    return _PLANS.get(key) if key is not None else None


def call(key, inputs: tuple, launches: Counter, launcher, forked=None) -> tuple:
    """A launcher's outputs for ``inputs``: replayed from the plan recorded for ``key``, or ``launcher(rec, *inputs)``
    run through a :class:`Recorder` (which records it when ``key`` is not None: the launchers pass None where a call
    is not to be replayed). ``forked``: ``launch.forked``, for a plan that forks the dQ stream."""
    recorded = lookup(key)
    if recorded is not None:
        return recorded.replay(inputs, launches, forked)
    rec = Recorder(key, inputs, launches)
    return rec.finish(launcher(rec, *inputs), inputs[0].device)


class _Launch:
    """One kernel launch: the kernel, its grid, where its leading tensors come from (slot indices), its other
    positional arguments and its keyword arguments; ``direct``: the compiled kernel's launcher and argument tail, once
    ``relaunch`` has one (``None``: through :func:`relaunch.run`)."""

    __slots__ = ("kernel", "grid", "grid3", "slots", "rest", "constexprs", "direct")

    def __init__(self, kernel, grid, slots, rest, constexprs):
        self.kernel, self.grid, self.slots, self.rest, self.constexprs = kernel, grid, slots, rest, constexprs
        self.grid3 = tuple(grid) if len(grid) == 3 else (*grid, 1, 1)[:3]
        self.direct = None


class Recorder:
    """Runs a launcher's steps as it asks for them and, if ``key`` is not None, records them as a :class:`Plan`.

    ``inputs``: the call's tensors (slots 0..); :meth:`buffer` registers each tensor the launcher allocates,
    :meth:`constant` each one that is the same object every call (work lists, tables, placeholders); :meth:`run`
    launches a kernel, :meth:`forked` forks the dQ stream (``launch.forked``), :meth:`copy` copies between slots,
    :meth:`count` counts in ``launch.LAUNCHES``."""

    def __init__(self, key, inputs, launches: Counter):
        self.key, self.launches = key, launches
        self.slots = {id(t): i for i, t in enumerate(inputs)}
        self.tensors = list(inputs)  # keeps every slot alive while recording (ids stay unique)
        self.n_inputs = len(inputs)
        self.buffers, self.constants, self.steps = [], [], []
        self.counts = Counter()
        self.arena, self.scratch_device, self.scratch_sizes = {}, None, []
        self.ok = key is not None

    def buffer(self, t: torch.Tensor, fill=None) -> torch.Tensor:
        """``t``, a tensor this call allocated (``fill``: None, or the value it was filled with), as a slot."""
        if self.ok:
            if t.storage_offset():  # a view: a replay's ``empty_strided`` would not lay it out the same
                self._abandon()
                return t
            self.slots[id(t)] = len(self.tensors)
            self.tensors.append(t)
            self.buffers.append((len(self.tensors) - 1, (tuple(t.shape), t.stride(), t.dtype, fill)))
        return t

    def constant(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t``, a tensor every call with this key passes as it is (kept alive by the plan); None passes."""
        if self.ok and t is not None and id(t) not in self.slots:
            self.slots[id(t)] = len(self.tensors)
            self.tensors.append(t)
            self.constants.append(len(self.tensors) - 1)
        return t

    def _abandon(self) -> None:
        """No plan for this call: let go of what the recording held, so that a buffer the launcher drops (a head
        chunk's float32 scratch, before the next chunk's) is freed then, not at the call's end (at 1M tokens the
        backward's chunks are 1.5 GiB each)."""
        self.ok = False
        self.tensors.clear()
        self.slots.clear()
        self.buffers.clear()
        self.constants.clear()
        self.steps.clear()

    def count(self, name: str, n: int = 1) -> None:
        self.launches[name] += n
        self.counts[name] += n

    def scratch(self, device: torch.device) -> None:
        """Tensor-descriptor scratch for the launches that follow (``configs.descriptor_scratch``: a thread's
        setting), shared by a stream's launches for this call; every replay sets it again."""
        descriptor_scratch(device, self.arena)
        self.scratch_device = device
        self.steps.append(("scratch", None))

    def run(self, kernel, grid, *args, **constexprs):
        """``relaunch.run(kernel, grid, *args, **constexprs)``, recorded."""
        relaunch.run(kernel, grid, *args, **constexprs)
        if not self.ok:
            return
        slots = tuple(self.slots.get(id(a), -1) for a in args[:relaunch.leading(kernel, args)])
        if -1 in slots:  # a tensor made for this call alone: no plan
            self._abandon()
            return
        step = _Launch(kernel, tuple(grid), slots, args[len(slots):], constexprs)
        step.direct = relaunch.compiled(kernel, args, constexprs)
        self.steps.append(("launch", step))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        if self.ok:
            ends = self.slots.get(id(dst)), self.slots.get(id(src))
            if None in ends:
                self._abandon()
            else:
                self.steps.append(("copy", ends))

    @contextlib.contextmanager
    def forked(self, fork):
        """``with fork as beside:`` (``launch.forked(device)``), recorded: launches inside ``with beside():`` run
        (and replay) on the second stream."""
        with fork as beside:
            self.steps.append(("fork", None))

            @contextlib.contextmanager
            def side():
                with beside():
                    self.steps.append(("side", True))
                    try:
                        yield
                    finally:
                        self.steps.append(("side", False))

            try:
                yield side
            finally:
                self.steps.append(("join", None))

    def finish(self, outputs: tuple, device: torch.device) -> tuple:
        """Keep the recording as the plan of its key (when it qualifies) and return ``outputs``; the call's scratch
        arena is let go (the allocator back to one allocation a launch)."""
        if self.scratch_device is not None:
            if self.scratch_device.type == "cuda":  # what each stream's launches took, for the replays
                here = torch.cuda.current_stream(self.scratch_device).cuda_stream
                self.scratch_sizes = [(None if stream == here else stream, buf.numel())
                                      for stream, buf in self.arena.items()]
            descriptor_scratch(self.scratch_device)
            self.arena.clear()
        if self.ok:
            slots = tuple(self.slots.get(id(t)) for t in outputs)
            if None not in slots:
                if len(_PLANS) >= _MAX_PLANS:
                    _PLANS.clear()
                _PLANS[self.key] = Plan(self, slots, device)
        return outputs


class GraphCache:
    """The CUDA graphs of one plan, keyed by the pointers its launches read and write (the call's inputs, buffers and
    descriptor scratch; the constants are the plan's own). A pointer set is captured the second time it is seen:
    a training loop or a benchmark hands the same tensors' memory back call after call, but a pointer set seen once
    is not worth a capture. At most ``capacity`` graphs (the least recently used go first); after ``budget`` captures
    no more, since pointer sets that keep changing would cost a capture each (and ``budget`` 0 after a capture
    failed: that plan replays launch by launch)."""

    def __init__(self, capacity: int = 64, budget: int = 256):
        self.graphs: OrderedDict = OrderedDict()
        self.seen: OrderedDict = OrderedDict()
        self.capacity, self.budget, self.captures = capacity, budget, 0
        self.failure = None  # why a capture failed (then ``budget`` is 0)

    def get(self, key):
        """The graph captured for ``key``, or None."""
        graph = self.graphs.get(key)
        if graph is not None:
            with contextlib.suppress(KeyError):  # (dropped meanwhile by another thread: it is still this call's)
                self.graphs.move_to_end(key)
        return graph

    def wants(self, key) -> bool:
        """Whether to capture ``key`` now (seen before, captures left); otherwise note it as seen."""
        if self.captures >= self.budget:
            return False
        if self.seen.pop(key, False) is None:
            return True
        self.seen[key] = None
        if len(self.seen) > 4 * self.capacity:
            self.seen.popitem(last=False)
        return False

    def keep(self, key, graph) -> None:
        """Keep ``graph`` for ``key``; the least recently used goes past ``capacity`` (a graph still running when
        dropped is freed by the driver once it completes: ``cuGraphExecDestroy``)."""
        self.captures += 1
        self.graphs[key] = graph
        if len(self.graphs) > self.capacity:
            self.graphs.popitem(last=False)


def _storage_bytes(shape, stride, dtype) -> int:
    """Bytes of the storage ``torch.empty_strided(shape, stride, dtype=dtype)`` allocates."""
    if 0 in shape:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * dtype.itemsize


def _aligned(n: int) -> int:
    """``n`` rounded up to 256 bytes (what the caching allocator aligns each allocation to)."""
    return -(-n // 256) * 256


def _capture_stream(device: torch.device):
    """A stream to capture on (the legacy default stream cannot be), one per device and thread: a stream being
    captured takes into its graph whatever any thread launches on it. (The dQ stream that a backward's capture forks
    is shared, but autograd runs every backward of a device in that device's one thread.)"""
    key = (device, threading.get_ident())
    stream = _CAPTURE_STREAMS.get(key)
    if stream is None:
        stream = _CAPTURE_STREAMS[key] = torch.cuda.Stream(device)
    return stream


_CAPTURE_STREAMS: dict = {}


class Plan:
    """A recorded call: the buffers to allocate, the steps to run, the output slots, the launch counts to add."""

    def __init__(self, rec: Recorder, outputs: tuple, device: torch.device):
        # A replay lays its slots out as the inputs, then the buffers, then the constants (recording interleaved them)
        order = list(range(rec.n_inputs)) + [i for i, _ in rec.buffers] + rec.constants
        remap = {old: new for new, old in enumerate(order)}
        # The call's buffers: the outputs each a tensor of its own (their lifetimes are the caller's), the others
        # carved from one allocation with the descriptor scratch (they live for the call alone). A replay allocates
        # the outputs, then that block, always in that order, whichever way it runs; so the allocator hands a loop
        # the same pointers call after call (what a CUDA graph of the call needs), and a graph replay makes no view
        # of the block at all (its key is the block's address).
        self.outputs = tuple(remap[i] for i in outputs)
        self.own, self.carved, self.block_bytes = [], [], 0
        for j, (_, (shape, stride, dtype, _)) in enumerate(rec.buffers):
            slot = rec.n_inputs + j
            if slot in self.outputs:
                self.own.append((slot, shape, stride, dtype))
            else:
                self.carved.append((slot, self.block_bytes, shape, stride, dtype))
                self.block_bytes += _aligned(_storage_bytes(shape, stride, dtype))
        self.fills = [(rec.n_inputs + j, spec[3]) for j, (_, spec) in enumerate(rec.buffers) if spec[3] is not None]
        self.n_call = rec.n_inputs + len(rec.buffers)  # the slots that are this call's own tensors
        self.n_inputs = rec.n_inputs
        self.constants = [rec.tensors[i] for i in rec.constants]
        self.constant_ptrs = [t.data_ptr() for t in self.constants]
        self.steps = []
        for kind, step in rec.steps:
            if kind == "launch":
                step.slots = tuple(remap[i] for i in step.slots)
            elif kind == "copy":
                step = tuple(remap[i] for i in step)
            self.steps.append((kind, step))
        self.counts, self.device = rec.counts, device
        # The descriptor scratch of a replay: the block's tail, a part per stream as the recording's launches took it
        # (``scratch``: (None for the calling stream, else the stream's handle; offset in the block; bytes)).
        self.scratch = []
        for stream, n in rec.scratch_sizes:
            self.scratch.append((stream, self.block_bytes, n))
            self.block_bytes += _aligned(n)
        # A CUDA graph needs every launch direct, on one device
        launches = [step for kind, step in self.steps if kind == "launch"]
        self.graph_device = None
        if device.type == "cuda" and launches and all(step.direct is not None for step in launches):
            indices = {step.direct[0] for step in launches}
            self.graph_device = indices.pop() if len(indices) == 1 else None
        self.graphs = GraphCache()

    def replay(self, inputs: tuple, launches: Counter, forked=None) -> tuple:
        """The recorded call on new ``inputs`` (same signature): fresh buffers, the same steps in the same order;
        ``forked`` (``launch.forked``) where the recording forked the dQ stream. In eager code on a GPU, the steps
        of a pointer set seen before launch as one CUDA graph (:meth:`_graph`)."""
        global REPLAYS
        device = self.device
        tensors = list(inputs) + [None] * (self.n_call - self.n_inputs)
        for slot, shape, stride, dtype in self.own:
            tensors[slot] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        block = torch.empty(self.block_bytes, dtype=torch.uint8, device=device) if self.carved or self.scratch else None
        direct = relaunch.ENABLED and device.type == "cuda" and not relaunch.hooked()
        ptrs = index = key = None
        if direct:  # as recorded: this call's tensors 16-byte aligned (the constants are the recording's own)
            ptrs = [0 if t is None else t.data_ptr() for t in tensors]
            base = 0 if block is None else block.data_ptr()
            for slot, offset, *_ in self.carved:
                ptrs[slot] = base + offset
            key = (*ptrs, base)
            direct = not reduce(or_, key, 0) & 15
            index = torch.cuda.current_device()
            ptrs += self.constant_ptrs
        if not (direct and index == self.graph_device and GRAPHS and self._graph(key, tensors, ptrs, forked, block)):
            caller = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
            self._run(tensors, block, ptrs if direct else None, index, forked, self._arena(block, caller))
        launches.update(self.counts)
        REPLAYS += 1
        return tuple(tensors[i] for i in self.outputs)

    def _views(self, tensors: list, block: torch.Tensor | None) -> list:
        """``tensors`` (the inputs and the outputs' buffers) with the carved buffers as views of ``block``, and the
        constants: every slot as a tensor, for the steps that take tensors (fills, copies, launches through
        ``relaunch.run``)."""
        tensors = list(tensors)
        typed = {}
        for slot, offset, shape, stride, dtype in self.carved:
            whole = typed.get(dtype)
            if whole is None:
                whole = typed[dtype] = block.view(dtype)
            tensors[slot] = whole.as_strided(shape, stride, offset // whole.element_size())
        return tensors + self.constants

    def _arena(self, block: torch.Tensor | None, caller) -> dict | None:
        """The descriptor-scratch arena of a call: each stream's part of ``block`` (``caller``: the handle of the
        stream the call runs on); None where the plan takes no scratch."""
        if not self.scratch:
            return None
        return {caller if stream is None else stream: block[start:start + n] for stream, start, n in self.scratch}

    def _run(self, tensors: list, block: torch.Tensor | None, ptrs: list | None, index, forked,
             arena: dict | None = None, grow: bool = True) -> None:
        """The fills and steps on ``tensors`` and the buffers carved from ``block`` (:meth:`_views`): launches direct
        on ``ptrs`` where given (and recorded so), else through ``relaunch.run``. ``arena``: the call's descriptor
        scratch (None: made as the launches ask); ``grow`` False (a capture): the arena is all there is."""
        device = self.device
        tensors = self._views(tensors, block)
        for slot, value in self.fills:
            tensors[slot].fill_(value)
        fork = side = beside = scratch = None
        try:
            for kind, step in self.steps:
                if kind == "launch":
                    hit = step.direct
                    if ptrs is not None and hit is not None and hit[0] == index:
                        hit[1](step.grid3, index, *[ptrs[i] for i in step.slots], *step.rest, *hit[2])
                        relaunch.count_direct()
                    else:
                        relaunch.run(step.kernel, step.grid, *[tensors[i] for i in step.slots], *step.rest,
                                     **step.constexprs)
                elif kind == "side":
                    if step:
                        side = beside()
                        side.__enter__()
                    else:
                        side, done = None, side
                        done.__exit__(None, None, None)
                elif kind == "fork":
                    fork = forked(device)
                    beside = fork.__enter__()
                elif kind == "join":
                    fork, done = None, fork
                    done.__exit__(None, None, None)
                elif kind == "copy":
                    tensors[step[0]].copy_(tensors[step[1]])
                else:  # "scratch"
                    scratch = {} if arena is None else arena
                    descriptor_scratch(device, scratch, grow)
        finally:  # an error inside: leave the streams as they were
            if side is not None:
                side.__exit__(None, None, None)
            if fork is not None:
                fork.__exit__(None, None, None)
            if scratch is not None:
                descriptor_scratch(device)
                scratch.clear()

    def _graph(self, key: tuple, tensors: list, ptrs: list, forked, block: torch.Tensor | None) -> bool:
        """Launch this call as the CUDA graph of its pointer set (captured now if seen before: :class:`GraphCache`);
        False where it runs launch by launch instead. Only in eager code (``eager_autograd.running_eagerly``: a
        compiled graph has its own CUDA graphs, and a CUDA-graph tree's warm-up routes allocations to its pool), and
        not while the stream is being captured. ``key``: the addresses of the inputs, the outputs' buffers and the
        ``block`` of the others and the descriptor scratch, all this call's own: a graph holds no memory of its own
        between calls, and launches only on memory this call owns."""
        global GRAPH_REPLAYS
        if not running_eagerly() or torch.cuda.is_current_stream_capturing():
            return False
        graph = self.graphs.get(key)
        if graph is None:
            if not self.graphs.wants(key):
                return False
            graph = self._capture(tensors, ptrs, forked, block)
            if graph is None:
                return False
            self.graphs.keep(key, graph)
        graph.replay()
        GRAPH_REPLAYS += 1
        return True

    def _capture(self, tensors: list, ptrs: list, forked, block: torch.Tensor | None):
        """The steps captured as a CUDA graph on a stream of this thread's own (nothing runs), or None (and no more
        captures for this plan) where the capture fails."""
        stream = _capture_stream(self.device)
        arena = self._arena(block, stream.cuda_stream)  # the caller's stream: this one
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._run(tensors, block, ptrs, self.graph_device, forked, arena, grow=False)
                finally:
                    graph.capture_end()
        except (RuntimeError, AssertionError, KeyError) as exc:
            self.graphs.budget, self.graphs.failure = 0, f"{type(exc).__name__}: {exc}"
            warnings.warn(f"hf_dilated: a launch plan's CUDA-graph capture failed ({self.graphs.failure}); that plan "
                          "replays launch by launch", stacklevel=2)
            return None
        return graph
