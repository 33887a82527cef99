"""Recorded launch plans (``hf_dilated/ops/triton/plans.py``): a launcher call with the signature of an earlier one
replays its recorded launches. A replay must give the recording's bits on new inputs, count the same launches, and
never replay where the recording was the call's own (padded layouts, dropout, a tensor made for one call)."""

from __future__ import annotations

import os
import weakref
from collections import Counter
from unittest import mock

import pytest
import torch

import hf_dilated
from hf_dilated.ops.triton import configs, launch, plans

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu = pytest.mark.skipif(not INTERPRET,
                         reason="CPU kernel tests need TRITON_INTERPRET=1 (set by conftest without CUDA)")
gpu = pytest.mark.gpu


def _fwd_bwd(q, k, v, do, ws, rs, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton", **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _inputs(rng, B, H, Hk, N, D, dtype, device):
    q, do = (torch.randn(B, H, N, D, generator=rng).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(B, Hk, N, D, generator=rng).to(device, dtype) for _ in range(2))
    return q, k, v, do


def _replayed_equals_recorded(rng, B, H, Hk, N, D, dtype, device, ws, rs, **kw):
    """Calls with plans off, then on (recording), then on again on new inputs (replaying), against plans off on
    those: the same bits, the same launch counts, and two replays (forward and backward)."""
    first, second = _inputs(rng, B, H, Hk, N, D, dtype, device), _inputs(rng, B, H, Hk, N, D, dtype, device)
    with mock.patch.object(plans, "ENABLED", False):
        want = [_fwd_bwd(*x, ws, rs, **kw) for x in (first, second)]
    counts = []
    got = []
    for x in (first, second):
        before, replays = Counter(launch.LAUNCHES), plans.REPLAYS
        got.append(_fwd_bwd(*x, ws, rs, **kw))
        counts.append((Counter(launch.LAUNCHES) - before, plans.REPLAYS - replays))
    assert counts[0][1] == 0 and counts[1][1] == 2, f"expected a recording, then two replays: {counts}"
    assert counts[0][0] == counts[1][0], f"a replay counted other launches than its recording: {counts}"
    for w, g in zip(want, got):
        for name, a, b in zip(("out", "dq", "dk", "dv"), w, g):
            assert torch.equal(a, b), f"{name} differs from the launchers' own code"


@cpu
@pytest.mark.parametrize("case", [
    dict(B=1, H=4, Hk=2, N=70, D=16, dtype=torch.float32, ws=[8, 16, 32], rs=[2, 1, 4]),  # r = 1 moved last, GQA
    dict(B=2, H=4, Hk=4, N=48, D=16, dtype=torch.bfloat16, ws=[8, 16], rs=[1, 2], is_causal=False),  # scratch
    dict(B=1, H=2, Hk=1, N=40, D=16, dtype=torch.bfloat16, ws=[16], rs=[1]),  # one launch writes the gradients
    dict(B=1, H=4, Hk=2, N=50, D=16, dtype=torch.bfloat16, ws=[8, 16], rs=[1, 2], global_tokens=3),  # filled + copies
])
def test_replay_gives_the_recordings_bits(rng, case):
    case = dict(case)
    _replayed_equals_recorded(rng, case.pop("B"), case.pop("H"), case.pop("Hk"), case.pop("N"), case.pop("D"),
                              case.pop("dtype"), "cpu", case.pop("ws"), case.pop("rs"), **case)


@cpu
def test_replayed_outputs_own_their_memory(rng):
    """A replay carves the buffers that live for the call alone from one allocation, but every output is a tensor of
    its own: an output kept (the forward's for the backward, the gradients by the optimizer) keeps no other buffer's
    memory alive."""
    q, k, v, do = _inputs(rng, 1, 4, 2, 50, 16, torch.bfloat16, "cpu")
    ws, rs = [8, 16], [1, 2]
    _fwd_bwd(q, k, v, do, ws, rs, global_tokens=3)  # recorded
    replays = plans.REPLAYS
    outputs = _fwd_bwd(q, k, v, do, ws, rs, global_tokens=3)
    assert plans.REPLAYS == replays + 2
    carved = [p for p in plans._PLANS.values() if p.carved]
    assert carved, "no plan carved a buffer: the case no longer covers the block"
    storages = {t.untyped_storage().data_ptr() for t in outputs}
    assert len(storages) == len(outputs), "two outputs share a storage"
    for name, t in zip(("out", "dq", "dk", "dv"), outputs):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), f"{name} holds more memory than its own"


@cpu
def test_calls_of_their_own_are_not_replayed(rng):
    """Padded layouts (their work lists and masks are the call's own) and dropout (streams drawn per call) run the
    launchers' code every call."""
    q, k, v, do = _inputs(rng, 2, 4, 2, 40, 16, torch.float32, "cpu")
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0
    for kw in (dict(attention_mask=mask), dict(dropout_p=0.2, seed=torch.tensor(5))):
        before = plans.REPLAYS
        for _ in range(2):
            _fwd_bwd(q, k, v, do, [8, 16], [1, 2], **kw)
        assert plans.REPLAYS == before, kw


def test_a_recording_with_a_tensor_of_its_own_is_not_kept():
    """The safety net: a launch reading a tensor that is neither an input, a buffer nor a declared constant (made for
    this call alone) leaves the call unrecorded, so no replay can launch on a stale pointer; so does an output that
    is no slot."""

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    x = torch.zeros(4)
    for stray_input in (True, False):
        plans.forget()
        rec = plans.Recorder(("test", stray_input), (x,), Counter())
        buf = rec.buffer(torch.empty(4))
        table = rec.constant(torch.ones(2))
        stray = torch.ones(3)
        with mock.patch.object(configs, "interpreting", lambda: True):  # relaunch.run launches through kernel[grid]
            rec.run(NoLaunch(), (1,), x, buf, table, *((stray,) if stray_input else ()), 3)
        if stray_input:  # the recording let go of the buffers it held: a buffer the launcher drops is freed then
            dropped = weakref.ref(buf)
            assert not rec.tensors and not rec.buffers
            del buf
            assert dropped() is None, "an abandoned recording still holds a buffer"
            buf = torch.empty(4)
        out = rec.finish((buf,) if stray_input else (buf, stray), torch.device("cpu"))
        assert out[0] is buf
        assert plans.lookup(("test", stray_input)) is None
    plans.forget()
    rec = plans.Recorder(("test", "kept"), (x,), Counter())
    buf = rec.buffer(torch.empty(4))
    with mock.patch.object(configs, "interpreting", lambda: True):
        rec.run(NoLaunch(), (1,), x, buf, 3)
    rec.finish((buf,), torch.device("cpu"))
    assert plans.lookup(("test", "kept")) is not None


def test_the_signature_keys_what_changes_the_launches(monkeypatch):
    """Shapes, strides, dtype, alignment, and the environment's kernel switches are in the key: a change of any of
    them records anew."""
    q = torch.zeros(1, 2, 8, 16)
    base = plans.signature("forward", (q,), "extra")
    assert plans.signature("forward", (q,), "extra") == base
    assert plans.signature("forward", (q.transpose(1, 2).contiguous().transpose(1, 2),), "extra") != base
    assert plans.signature("forward", (q.half(),), "extra") != base
    assert plans.signature("forward", (torch.zeros(2 * 8 * 16 + 1)[1:].view(1, 2, 8, 16),), "extra") != base
    assert plans.signature("forward", (q,), "other") != base
    for name in plans.ENV_SWITCHES:
        monkeypatch.setenv(name, "0")
        off = plans.signature("forward", (q,), "extra")
        monkeypatch.setenv(name, "1")
        assert len({off, plans.signature("forward", (q,), "extra"), base}) == 3, name
        monkeypatch.delenv(name)
        assert plans.signature("forward", (q,), "extra") == base, name
    # the switches read where os.environ is a plain mapping (replaced by a test, another Python) as well
    with mock.patch.object(os, "environ", {plans.ENV_SWITCHES[0]: "0"}):
        assert plans.signature("forward", (q,), "extra") != base


@cpu
def test_forced_configs_record_anew(rng):
    """A config forced by the tuner (``configs.forced``) is part of the key: a call inside the block is recorded with
    the forced config, not replayed from a plan recorded outside it."""
    q, k, v, do = _inputs(rng, 1, 2, 2, 40, 16, torch.float32, "cpu")
    _fwd_bwd(q, k, v, do, [8, 16], [1, 2])
    before = plans.REPLAYS
    with configs.forced("fwd", (32, 32, 4, 1)):
        _fwd_bwd(q, k, v, do, [8, 16], [1, 2])
        assert plans.REPLAYS == before  # recorded anew (the key holds every forced config, forward and backward)
        _fwd_bwd(q, k, v, do, [8, 16], [1, 2])
        assert plans.REPLAYS == before + 2


def _assert_launchers_bits(got, want, D: int, call=None) -> None:
    """``(out, dq, dk, dv)`` bit for bit those of the launchers' own code; dQ at head dim 128, summed by the fused dK/dV
    launch's reduce-adds in no fixed order, to 1e-5."""
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        if name == "dq" and D == 128:
            assert ((a.float() - b.float()).norm() / b.float().norm()) < 1e-5, (call, name)
        else:
            assert torch.equal(a, b), (call, name)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 128), (4, 2, 256), (2, 2, 80)])
def test_gpu_replay_launches_directly_and_gives_the_recordings_bits(rng, shape):
    """On the GPU the replay launches every kernel directly, the backward's row deltas included (``relaunch.DIRECT``
    counts each; no launch through Triton) and gives the launchers' bits: Gluon kernels at D 64 / 128 / 256 (the forward's parts, the warp-specialized
    forward, the fused dQ's copy), the portable ones at D 80. dQ summed by the fused dK/dV launch's reduce-adds (D 128)
    lands in no fixed order: held to 1e-5 there."""
    from hf_dilated.ops.triton import relaunch

    H, Hk, D = shape
    N = 4096
    first, second = (_inputs(rng, 1, H, Hk, N, D, torch.bfloat16, "cuda") for _ in range(2))
    ws, rs = [512, 1024, 2048], [1, 2, 4]
    with mock.patch.object(plans, "ENABLED", False):
        want = _fwd_bwd(*second, ws, rs)
    _fwd_bwd(*first, ws, rs)
    direct, replays = relaunch.DIRECT, plans.REPLAYS
    through, kernels = relaunch.run, []

    def spy(kernel, grid, *args, **constexprs):
        kernels.append(kernel.fn.__name__)
        return through(kernel, grid, *args, **constexprs)

    with mock.patch.object(relaunch, "run", spy):
        got = _fwd_bwd(*second, ws, rs)
    torch.cuda.synchronize()
    assert plans.REPLAYS == replays + 2
    assert not kernels, f"replayed launches went through relaunch.run: {kernels}"
    assert relaunch.DIRECT >= direct + 4
    _assert_launchers_bits(got, want, D)


@cpu
def test_only_eager_calls_may_capture_graphs(rng, monkeypatch):
    """``eager_autograd.running_eagerly`` (what a replay asks before it captures a CUDA graph) holds inside the op's
    implementation when eager code calls it directly, forward and backward, and not when the op is dispatched (as
    compiled graphs call it: a CUDA-graph tree's warm-up would give a capture's allocations to its pool)."""
    from hf_dilated.ops import eager_autograd

    seen = []
    forward, backward = launch.forward, launch.backward
    monkeypatch.setattr(launch, "forward", lambda *a: seen.append(("fwd", eager_autograd.running_eagerly()))
                        or forward(*a))
    monkeypatch.setattr(launch, "backward", lambda *a: seen.append(("bwd", eager_autograd.running_eagerly()))
                        or backward(*a))
    q, k, v, do = _inputs(rng, 1, 2, 1, 32, 16, torch.float32, "cpu")
    _fwd_bwd(q, k, v, do, [8, 16], [1, 2])
    assert seen == [("fwd", True), ("bwd", True)] and not eager_autograd.running_eagerly()
    seen.clear()
    lay = hf_dilated.ops.layout.resolve_layout(1, 32, 32, torch.device("cpu"))
    torch.ops.hf_dilated.dilated_attention_fwd(q, k, v, lay.q_pos, lay.q_seq, lay.q_valid, lay.k_pos, lay.k_seq,
                                               lay.k_valid, [8, 16], [1, 2], True, True, 0.25, 0, 0, 0, 0.0, None,
                                               True)
    assert seen == [("fwd", False)], "the dispatched op ran as eager code"


def test_graph_cache_captures_a_pointer_set_seen_twice():
    """A pointer set is captured the second time it is seen, the least recently used graph goes first, and after its
    budget of captures the cache asks for none."""
    cache = plans.GraphCache(capacity=2, budget=3)
    assert not cache.wants("a") and cache.get("a") is None
    assert cache.wants("a")
    cache.keep("a", "graph a")
    assert cache.get("a") == "graph a"
    for key in "bc":
        assert not cache.wants(key) and cache.wants(key)
        cache.keep(key, f"graph {key}")
    assert cache.get("a") is None and cache.get("b") == "graph b" and cache.get("c") == "graph c"
    assert not cache.wants("d") and not cache.wants("d"), "captures past the budget"
    for _ in range(600):  # sightings that never repeat stay bounded
        cache.wants(object())
    assert len(cache.seen) <= 4 * cache.capacity


def _graph_calls(q, k, v, do, ws, rs, D: int, calls: int = 4) -> list:
    """``calls`` forward+backward calls on the same tensors, each against the launch-by-launch bits
    (:func:`_assert_launchers_bits`); for each, how many replays ran as CUDA graphs."""
    with mock.patch.object(plans, "GRAPHS", False):
        want = _fwd_bwd(q, k, v, do, ws, rs)
    replayed = []
    for call in range(calls):
        before = plans.GRAPH_REPLAYS
        got = _fwd_bwd(q, k, v, do, ws, rs)
        replayed.append(plans.GRAPH_REPLAYS - before)
        _assert_launchers_bits(got, want, D, call)
        del got
    return replayed


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 128)])
def test_gpu_graph_replays_give_the_launch_by_launch_bits(rng, shape):
    """Eager calls on the same tensors replay their plans (forward and backward) as CUDA graphs once the pointer set
    comes back (captured at its second sighting), with the bits of launch-by-launch replays; new values in the same
    memory too."""
    H, Hk, D = shape
    ws, rs = [512, 1024, 2048], [1, 2, 4]
    q, k, v, do = _inputs(rng, 1, H, Hk, 4096, D, torch.bfloat16, "cuda")
    first = _graph_calls(q, k, v, do, ws, rs, D)
    assert first[-1] == 2, f"graph replays per call: {first}"
    for t in (q, k, v, do):  # new values, same memory
        t.copy_(torch.randn(t.shape, generator=rng).to(t.device, t.dtype))
    second = _graph_calls(q, k, v, do, ws, rs, D)
    assert 2 in second, f"graph replays per call on new values: {second}"
