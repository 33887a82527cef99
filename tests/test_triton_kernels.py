"""The Triton kernels against the float64 oracle (tests/naive.py) and the PyTorch reference, forward and every gradient.

CPU (CI): the kernels run under ``TRITON_INTERPRET=1`` (set by conftest.py before triton is imported) at tiny sizes,
with small blocks so that every loop runs several blocks. ``-m gpu``: the same checks at real sizes on a CUDA device
(``python -m pytest -m gpu tests/test_triton_kernels.py`` on the H100). Fresh random inputs each run (conftest seed).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
from collections import Counter

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import hf_dilated  # noqa: E402
from hf_dilated.config import DENSE_SEGMENT  # noqa: E402
from hf_dilated.ops import TokenLayout, resolve_layout  # noqa: E402
from hf_dilated.ops.dropout import keep_mask  # noqa: E402
from hf_dilated.ops.triton import dilated_attention_triton, fallback_reason, is_available  # noqa: E402
from hf_dilated.ops.triton import launch, op  # noqa: E402
from hf_dilated.ops.triton.schedule import branch_items, layout_runs  # noqa: E402
from hf_dilated.ops.triton.tiles import item_tile, rounded  # noqa: E402
from hf_dilated.ops.triton.tuning import LONGNET  # noqa: E402
from cuda_graphs import assert_graph_replays_eager  # noqa: E402
from naive import naive_dilated_attention, rel_err  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
cpu = pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (set by conftest without CUDA)")

# SPEC tolerances (the kernels' float32 dots are full float32, not tf32).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def pyrng_of(rng: torch.Generator) -> random.Random:
    return random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))


def random_branches(pyrng: random.Random, w0_choices=(8, 12, 16)):
    """Random valid branches: increasing w, w % r == 0, one r == 1 (not always the first)."""
    n = pyrng.randint(1, 3)
    w = pyrng.choice(w0_choices)
    ws, rs = [], []
    for _ in range(n):
        ws.append(w)
        rs.append(pyrng.choice([d for d in (1, 2, 3, 4) if w % d == 0]))
        w *= pyrng.choice([1, 2])
    if 1 not in rs:
        rs[pyrng.randrange(n)] = 1
    return list(zip(ws, rs))


def make_qkv(rng, B, Hq, Hk, Nq, Nk, D, dtype, device):
    q = torch.randn(B, Hq, Nq, D, generator=rng, dtype=torch.float64)
    k = torch.randn(B, Hk, Nk, D, generator=rng, dtype=torch.float64)
    v = torch.randn(B, Hk, Nk, D, generator=rng, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]


@contextlib.contextmanager
def kernels_run(*kinds):
    """Assert that the named launchers (``forward``, ``backward``, ``decode``) ran inside the block, and the
    reference fallback did not: the test fails if the kernels are switched off."""
    before = Counter(launch.LAUNCHES)
    yield
    for kind in kinds:
        assert launch.LAUNCHES[kind] > before[kind], f"the Triton {kind} kernel did not run"
    assert launch.LAUNCHES["reference"] == before["reference"], "the op fell back to the reference"


def check_grads(got, want, tol, what=""):
    """dq, dk, dv against float64 ones: finite, and relative error below ``tol``. A gradient that is zero by symmetry
    (a query that sees one key has dq = 0 exactly) is measured against 5% of the whole q, k, v gradient, as in
    test_reference.check_backend: the relative error of rounding noise against an exact zero means nothing."""
    whole = float(sum(b.norm() ** 2 for b in want) ** 0.5)
    for name, a, b in zip("qkv", got, want):
        assert torch.isfinite(a).all(), f"d{name} has NaN / inf"
        err = float((a.detach().double() - b).norm()) / max(float(b.norm()), 0.05 * whole, 1e-300)
        assert err < tol, f"d{name}{what}: rel err {err}"


def check(q, k, v, branches, tol, naive_kwargs=None, use_naive=True, decode=False, **op_kwargs):
    """Output and dq, dk, dv of the Triton backend against the float64 oracle and the float64 reference."""
    ws, rs = [w for w, _ in branches], [r for _, r in branches]
    with kernels_run("decode" if decode else "forward"):
        out, lse = hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton", return_lse=True, **op_kwargs)
    assert out.dtype == q.dtype and out.shape == q.shape[:3] + (v.shape[-1],)
    assert lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "output has NaN / inf"
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = {}
    ref, ref_lse = hf_dilated.dilated_attention(q64, k64, v64, ws, rs, backend="torch", return_lse=True, **op_kwargs)
    want["reference"] = ref
    if use_naive:
        nk = dict(naive_kwargs or {})
        want["naive"] = naive_dilated_attention(
            q64, k64, v64, branches, is_causal=op_kwargs.get("is_causal", True),
            head_offset=op_kwargs.get("head_offset", 0), **nk
        )
    reached = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), reached), "lse -inf pattern differs from the reference"
    assert rel_err(lse[reached], ref_lse[reached]) < tol
    # dO rounded to the kernel's dtype for the oracle too: the kernel never sees the unrounded one.
    grad = torch.randn(ref.shape, dtype=torch.float64, device=ref.device).to(q.dtype).double()
    with kernels_run("backward"):
        got = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    for name, a in zip("qkv", got):
        assert torch.isfinite(a).all(), f"d{name} has NaN / inf"
    for oracle, o in want.items():
        err = rel_err(out, o)
        assert err < tol, f"output vs {oracle}: rel err {err}"
        check_grads(got, torch.autograd.grad(o, (q64, k64, v64), grad), tol, f" vs {oracle}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# CPU, interpreter, tiny sizes


@cpu
@pytest.mark.parametrize("major, mode", [(9, 2), (8, 2), (7, 3)])
def test_float32_dot_mode_by_gpu(monkeypatch, major, mode):
    """float32 dots: tf32x3 (mode 2) from Ampere on, ieee (3) before it; bf16 / fp16 plain (0); under the interpreter
    bfloat16 is upcast (1) and float32 plain."""
    from hf_dilated.ops.triton import configs

    assert configs.dot_mode(torch.bfloat16) == int(configs.interpreting())
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "_capability_major", lambda: major)
    assert configs.dot_mode(torch.float32) == mode
    assert configs.dot_mode(torch.bfloat16) == configs.dot_mode(torch.float16) == 0


def test_available_under_interpreter():
    assert is_available(torch.device("cpu"))


@cpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gqa", [False, True])
def test_random_configs_contiguous(rng, causal, gqa):
    pyrng = pyrng_of(rng)
    branches = random_branches(pyrng)
    Hk = pyrng.choice([1, 2])
    Hq = Hk * (pyrng.choice([2, 3, 4]) if gqa else 1)
    N = pyrng.randint(20, 80)  # ragged: rarely a multiple of the segments
    D = pyrng.choice([16, 32])
    q, k, v = make_qkv(rng, 2, Hq, Hk, N, N, D, torch.float32, "cpu")
    check(q, k, v, branches, TOL[torch.float32], is_causal=causal, head_offset=pyrng.randint(0, 5))


@cpu
@pytest.mark.parametrize("tma", [True, False])
def test_tensor_descriptors_and_pointers(rng, tma, monkeypatch):
    """The forward (Q/K/V) and the backward (Q/dO in dK/dV, K/V in dQ) read through TMA tensor descriptors (strided
    by r rows) where they may, else through pointers; both paths against the oracle, outputs and gradients, and the
    counters prove which one ran."""
    if not tma:
        monkeypatch.setattr(launch, "use_tma", lambda *a, **k: False)
    pyrng = pyrng_of(rng)
    branches = random_branches(pyrng)
    q, k, v = make_qkv(rng, 2, 4, 2, pyrng.randint(30, 70), pyrng.randint(70, 90), 16, torch.float32, "cpu")
    before = launch.LAUNCHES["forward_tma"], launch.LAUNCHES["backward_tma"]
    check(q, k[:, :, -q.shape[2]:], v[:, :, -q.shape[2]:], branches, TOL[torch.float32], is_causal=True)
    assert (launch.LAUNCHES["forward_tma"] > before[0]) == tma
    assert (launch.LAUNCHES["backward_tma"] > before[1]) == tma


@cpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunked", [False, True])
def test_half_precision(rng, dtype, chunked, monkeypatch):
    if chunked:  # the backward's float32 scratch one kv head at a time (as for long sequences)
        from hf_dilated.ops.triton import launch

        monkeypatch.setattr(launch, "SCRATCH_MIN_BYTES", 0)
        monkeypatch.setattr(launch, "SCRATCH_FRACTION", 1e-9)
    q, k, v = make_qkv(rng, 1, 4, 2, 53, 53, 32, dtype, "cpu")
    check(q, k, v, [(8, 1), (16, 2), (32, 4)], TOL[dtype], is_causal=True, head_offset=1)


@cpu
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding(rng, side):
    pyrng = pyrng_of(rng)
    B, N = 3, 45
    lengths = [N, pyrng.randint(5, N - 5), pyrng.randint(1, 10)]
    mask = torch.zeros(B, N, dtype=torch.bool)
    for b, n in enumerate(lengths):
        if side == "left":
            mask[b, N - n :] = True
        else:
            mask[b, :n] = True
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    q, k, v = make_qkv(rng, B, 4, 2, N, N, 16, torch.float32, "cpu")
    out = check(q, k, v, [(8, 1), (16, 2)], TOL[torch.float32], attention_mask=mask, head_offset=1,
                naive_kwargs=dict(q_pos=pos, k_pos=pos, k_valid=mask, q_valid=mask))
    assert (out[~mask[:, None, :].expand_as(out[..., 0])] == 0).all(), "padding rows must be zero"
    # Each sequence alone gives the same outputs on its real tokens.
    b = 1
    cols = mask[b].nonzero().flatten()
    alone = hf_dilated.dilated_attention(q[b:b + 1, :, cols], k[b:b + 1, :, cols], v[b:b + 1, :, cols], [8, 16],
                                         [1, 2], backend="triton", head_offset=1)
    assert rel_err(alone[0], out[b][:, cols]) < TOL[torch.float32]


@cpu
@pytest.mark.parametrize("how", ["cu_seqlens", "position_ids"])
def test_packed_sequences(rng, how):
    pyrng = pyrng_of(rng)
    lengths = [pyrng.randint(3, 30) for _ in range(3)]
    N = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu) if how == "cu_seqlens" else dict(position_ids=pos)
    q, k, v = make_qkv(rng, 1, 4, 2, N, N, 16, torch.float32, "cpu")
    branches = random_branches(pyrng)
    check(q, k, v, branches, TOL[torch.float32], is_causal=pyrng.random() < 0.7, head_offset=2,
          naive_kwargs=dict(q_pos=pos, k_pos=pos, q_seq=seq, k_seq=seq), **kw)


@cpu
@pytest.mark.parametrize("nq", [1, 5, 17])
def test_decode_against_cache(rng, nq):
    pyrng = pyrng_of(rng)
    Nk = pyrng.randint(40, 90)
    branches = random_branches(pyrng)
    q, k, v = make_qkv(rng, 2, 4, 2, nq, Nk, 32, torch.float32, "cpu")
    check(q, k, v, branches, TOL[torch.float32], is_causal=True, head_offset=3, decode=True)


@cpu
def test_decode_left_padded_cache_matches_full_forward(rng):
    """A left-padded cache (row 1 shorter): decoding the last tokens gives the full forward's rows."""
    B, N, nq = 2, 50, 3
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, :13] = False
    branches = [(8, 1), (16, 2), (32, 4)]
    ws, rs = [w for w, _ in branches], [r for _, r in branches]
    q, k, v = make_qkv(rng, B, 4, 4, N, N, 16, torch.float32, "cpu")
    full = hf_dilated.dilated_attention(q, k, v, ws, rs, attention_mask=mask, backend="triton")
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    dec = check(q[:, :, -nq:], k, v, branches, TOL[torch.float32], attention_mask=mask, decode=True,
                naive_kwargs=dict(q_pos=pos[:, -nq:], k_pos=pos, k_valid=mask))
    assert rel_err(dec, full[:, :, -nq:]) < TOL[torch.float32]


@cpu
def test_lse_gradient(rng):
    """Gradients flow through the returned lse too (ring attention merges by lse)."""
    q, k, v = make_qkv(rng, 1, 2, 1, 37, 37, 16, torch.float32, "cpu")
    outs = []
    for backend in ("triton", "torch"):
        o, l = hf_dilated.dilated_attention(q, k, v, [8, 16], [1, 2], backend=backend, return_lse=True)
        outs.append(torch.autograd.grad((o * 0.5).sum() + l.sum(), (q, k, v)))
    for a, b in zip(*outs):
        assert torch.isfinite(a).all() and rel_err(a, b) < TOL[torch.float32]


def test_eager_autograd_equals_the_registered_op(rng, monkeypatch):
    """Eager training calls apply the op through ``op._EagerAutograd`` (the registered ``setup_context`` and backward
    without torch.library's per-call argument rebuild): gradients bit for bit those of the op's registered autograd,
    whether the loss uses the output, the lse or both; an unused lse sends no gradient (no zeros, no extra pass)."""
    q, k, v = make_qkv(rng, 1, 4, 2, 45, 45, 16, torch.float32, "cpu")
    lay = resolve_layout(1, 45, 45, torch.device("cpu"))
    args = (q, k, v, lay.q_pos, lay.q_seq, lay.q_valid, lay.k_pos, lay.k_seq, lay.k_valid, [8, 16], [1, 2],
            True, True, 0.25, 0, 0, 0, 0.0, None, True)
    dlses = []
    deltas = launch.row_deltas
    monkeypatch.setattr(launch, "row_deltas",
                        lambda o, do, dlse=None, rec=None: dlses.append(dlse) or deltas(o, do, dlse, rec))
    applied = []
    eager_apply = op._EagerAutograd.apply
    monkeypatch.setattr(op._EagerAutograd, "apply", lambda *a: applied.append(1) or eager_apply(*a))
    for loss in (lambda o, l: (o * o).sum(), lambda o, l: l.sum(), lambda o, l: (o * 0.5).sum() + l.sum()):
        registered = torch.autograd.grad(loss(*torch.ops.hf_dilated.dilated_attention_fwd(*args)), (q, k, v))
        out, lse = dilated_attention_triton(q, k, v, [(8, 1), (16, 2)], lay, True, 0.25, strict=True)
        eager = torch.autograd.grad(loss(out, lse), (q, k, v))
        for name, a, b in zip("qkv", registered, eager):
            assert torch.equal(a, b), f"d{name} differs between the registered autograd and the eager Function"
    assert len(applied) == 3
    assert dlses[1] is None and all(d is not None for d in dlses[2:])  # out-only loss, eager: no lse gradient
    # torch.func transforms take the Function too (it is of the setup_context style)
    def attend(q, k, v):
        return dilated_attention_triton(q, k, v, [(8, 1), (16, 2)], lay, True, 0.25, strict=True)[0]

    out, vjp = torch.func.vjp(attend, *(t.detach() for t in (q, k, v)))
    for name, a, b in zip("qkv", vjp(out), torch.autograd.grad(attend(q, k, v), (q, k, v), out)):
        assert torch.equal(a, b), f"d{name} differs under torch.func.vjp"
    # Function.apply binds every call's arguments to inspect.signature(forward): the forward's stored __signature__,
    # not worked out again per call
    stored = op._EagerAutograd.forward.__signature__
    assert inspect.signature(op._EagerAutograd.forward) is stored and str(stored) == "(*inputs)"


def dispatched_ops(fn) -> set:
    """The hf_dilated custom ops the dispatcher ran during ``fn()`` (as the profiler records them)."""
    with torch.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("hf_dilated::")}


def test_eager_calls_skip_the_dispatcher_where_nothing_needs_it(rng):
    """Eager forward+backward and calls without gradients run the ops' Python implementations themselves: the
    dispatcher's per-call work is host time a small problem's GPU waits for; a backward whose loss ignores the lse makes
    no zero lse gradient for it (an allocation and a fill launch a call). A backward with ``create_graph=True``
    keeps the backward op, whose second derivative raises instead of being silently zero; meta and subclass tensors,
    and tensors autograd follows, take the op (``eager_autograd.direct``)."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_dilated.ops import eager_autograd

    q, k, v = make_qkv(rng, 1, 4, 2, 40, 40, 16, torch.float32, "cpu")

    def attend():
        return hf_dilated.dilated_attention(q, k, v, [8, 16], [1, 2], backend="triton")

    assert dispatched_ops(lambda: torch.autograd.grad(attend().sum(), (q, k, v))) == set()
    with torch.profiler.profile() as prof:  # an out-only loss: no zero lse gradient is made (a fill launch a call)
        torch.autograd.grad(attend().sum(), (q, k, v))
    assert not {"aten::new_zeros", "aten::zeros", "aten::zero_"} & {e.name for e in prof.events()}
    with torch.no_grad():
        assert dispatched_ops(attend) == set()
    grads = []
    assert dispatched_ops(lambda: grads.append(torch.autograd.grad(attend().sum(), q, create_graph=True)[0])) == {
        "hf_dilated::dilated_attention_bwd"}
    with pytest.raises(RuntimeError, match="no autograd formula"):
        grads[0].sum().backward()

    class Marked(torch.Tensor):
        pass

    plain = q.detach()
    assert eager_autograd.direct((plain, 1, [2, 4], None))
    assert not eager_autograd.direct((q,))  # grad mode on, a tensor autograd follows
    with torch.no_grad():
        assert eager_autograd.direct((q,))
    assert not eager_autograd.direct((torch.empty(2, device="meta"),))
    assert not eager_autograd.direct((plain.as_subclass(Marked),))
    with FlopCounterMode(display=False):  # a dispatch mode sees the op as one call
        assert not eager_autograd.direct((plain,))


def layout_of(q_pos, k_pos, k_valid=None, q_valid=None, q_seq=None, k_seq=None):
    """A TokenLayout written out by hand (the kernels' reading of a layout, independent of how callers build it)."""
    B, Nq = q_pos.shape
    Nk = k_pos.shape[1]
    dev = q_pos.device
    k_valid = torch.ones(B, Nk, dtype=torch.bool, device=dev) if k_valid is None else k_valid
    q_valid = k_valid[:, Nk - Nq:] if q_valid is None else q_valid
    q_seq = torch.zeros(B, Nq, dtype=torch.long, device=dev) if q_seq is None else q_seq
    k_seq = torch.zeros(B, Nk, dtype=torch.long, device=dev) if k_seq is None else k_seq
    return TokenLayout(q_pos, q_seq, k_pos, k_seq, k_valid, q_valid, contiguous=False)


def check_op(q, k, v, branches, tol, layout=None, decode=False, is_causal=True, head_offset=0, window=None,
             global_tokens=0, dropout_p=0.0, seed=None):
    """``dilated_attention_triton`` (strict: no fallback) against tests/naive.py on the layout's own positions:
    the output and dq, dk, dv, with the same dropout draw (``keep_mask``) when ``dropout_p`` > 0."""
    B, _, Nq, D = q.shape
    Nk = k.shape[2]
    layout = resolve_layout(B, Nq, Nk, q.device) if layout is None else layout
    kw = dict(window=window, global_tokens=global_tokens, dropout_p=dropout_p, seed=seed)
    with kernels_run("decode" if decode else "forward"):
        out, lse = dilated_attention_triton(q, k, v, branches, layout, is_causal, D ** -0.5, head_offset, strict=True,
                                            **kw)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32
    assert torch.isfinite(out).all(), "output has NaN / inf"
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    keep = (lambda i, b, h, qc, kc: keep_mask(seed, dropout_p, i, b, h, qc, kc)) if dropout_p else None
    want = naive_dilated_attention(
        q64, k64, v64, branches, is_causal=is_causal, head_offset=head_offset, window=window,
        global_tokens=global_tokens, dropout_p=dropout_p, keep=keep, q_pos=layout.q_pos, k_pos=layout.k_pos,
        q_seq=layout.q_seq, k_seq=layout.k_seq, k_valid=layout.k_valid, q_valid=layout.q_valid,
    )
    err = rel_err(out, want)
    assert err < tol, f"output: rel err {err}"
    # dO rounded to the kernel's dtype for the oracle too: the kernel never sees the unrounded one.
    grad = torch.randn(want.shape, dtype=torch.float64, device=want.device).to(q.dtype).double()
    with kernels_run("backward"):
        got = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    check_grads(got, torch.autograd.grad(want, (q64, k64, v64), grad), tol)
    return out, lse


def seed_of(rng):
    return torch.randint(-2**62, 2**62, (), generator=rng, dtype=torch.int64)


@cpu
@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window(rng, causal):
    """A window on every branch; a dense layer is one branch (DENSE_SEGMENT, 1), a sliding-window layer the same
    with a window: no N x N anywhere, exact against the oracle."""
    pyrng = pyrng_of(rng)
    N = pyrng.randint(24, 40)
    q, k, v = make_qkv(rng, 1, 2, 1, N, N, 16, torch.float32, "cpu")
    check_op(q, k, v, [(DENSE_SEGMENT, 1)], TOL[torch.float32], is_causal=causal, window=pyrng.randint(1, N // 2))
    check_op(q, k, v, random_branches(pyrng), TOL[torch.float32], is_causal=causal, head_offset=pyrng.randint(0, 3),
             window=pyrng.randint(1, N // 2))


@cpu
def test_global_tokens(rng):
    """SPEC's global-token branch (keys at positions < g): causal; bidirectional with a window and g beyond N."""
    pyrng = pyrng_of(rng)
    N = pyrng.randint(24, 36)
    q, k, v = make_qkv(rng, 1, 2, 1, N, N, 16, torch.float32, "cpu")
    branches = random_branches(pyrng)
    check_op(q, k, v, branches, TOL[torch.float32], head_offset=1, global_tokens=pyrng.randint(1, 4))
    check_op(q, k, v, branches, TOL[torch.float32], is_causal=False, global_tokens=N + 3, window=pyrng.randint(2, 9))


@cpu
@pytest.mark.parametrize("causal", [True, False])
def test_dropout_exact(rng, causal):
    """Dropout with a fixed seed: output and every gradient equal the oracle dropped by the same draw."""
    pyrng = pyrng_of(rng)
    q, k, v = make_qkv(rng, 2, 2, 1, 29, 29, 16, torch.float32, "cpu")
    check_op(q, k, v, random_branches(pyrng), TOL[torch.float32], is_causal=causal, head_offset=2,
             global_tokens=pyrng.choice([0, 2]), dropout_p=pyrng.choice([0.1, 0.5]), seed=seed_of(rng))


@cpu
def test_dropout_half_precision_chunked(rng, monkeypatch):
    """The float32-scratch backward one kv head at a time keeps each head's own draw. p = 0.1: the neighbour head's
    draw is a 39-45% output error, while bf16 rounding at p = 0.3 measured 0.6-1.1% on dq / dk over 30 seeds (FA2's
    delta from the rounded O), too near SPEC's 1e-2 for a test on fresh inputs; at p = 0.1 it measured 0.4-0.6%."""
    monkeypatch.setattr(launch, "SCRATCH_MIN_BYTES", 0)
    monkeypatch.setattr(launch, "SCRATCH_FRACTION", 1e-9)
    q, k, v = make_qkv(rng, 1, 4, 2, 29, 29, 16, torch.bfloat16, "cpu")
    check_op(q, k, v, [(8, 1), (16, 2)], TOL[torch.bfloat16], head_offset=1, dropout_p=0.1, seed=seed_of(rng))


@cpu
def test_dropout_statistics_and_zero(rng):
    """Each batch row draws its own mask: over 64 identical rows the mean output lies within 6 standard errors of the
    undropped output everywhere, one row alone does not match it; the lse is undropped; a probability whose
    threshold rounds to zero drops nothing. The standard error is the exact one of a Bernoulli(1 - p) keep mask,
    sqrt(sum_j P_ij^2 v_j^2 p / (1 - p) / B), not the sample's: 32 draws' sample std failed CI once at 5.6 "errors"."""
    B, N, p = 64, 16, 0.3
    q, k, v = (t[:1].expand(B, -1, -1, -1).contiguous() for t in make_qkv(rng, 1, 1, 1, N, N, 16, torch.float32, "cpu"))
    lay = resolve_layout(B, N, N, q.device)
    with torch.no_grad(), kernels_run("forward"):
        plain, lse = dilated_attention_triton(q, k, v, ((16, 1),), lay, False, 0.25)
        dropped, lse_d = dilated_attention_triton(q, k, v, ((16, 1),), lay, False, 0.25, dropout_p=p,
                                                  seed=seed_of(rng))
        nothing, _ = dilated_attention_triton(q, k, v, ((16, 1),), lay, False, 0.25, dropout_p=1e-12, seed=seed_of(rng))
    assert torch.equal(lse_d, lse), "the lse is not dropped"
    assert torch.equal(nothing, plain)
    assert rel_err(dropped[0], plain[0]) > 0.1
    q64, k64, v64 = (t[0].detach().double() for t in (q, k, v))  # [H, N, D]
    probs = torch.softmax(torch.einsum("hqd,hkd->hqk", q64, k64) * 0.25, dim=-1)
    var = torch.einsum("hqk,hkd->hqd", probs ** 2, v64 ** 2) * p / (1 - p)
    z = (dropped.double().mean(0) - plain[0].double()).abs() / (var / B).sqrt()
    assert z.max() < 6, f"mean over draws is {z.max():.1f} standard errors from the undropped output"


@cpu
@pytest.mark.parametrize("D", [8, 24, 40])
def test_head_dims_padded_in_kernel(rng, D):
    """Head dims that are not a power of two (or below 16) run in the kernels, padded inside them."""
    q, k, v = make_qkv(rng, 1, 2, 1, 25, 25, D, torch.float32, "cpu")
    if D == 24:
        check_op(q[:, :, -3:], k, v, [(8, 1), (16, 2)], TOL[torch.float32], decode=True, global_tokens=2)
    else:
        check_op(q, k, v, [(8, 1), (16, 2)], TOL[torch.float32], head_offset=1, window=9 if D == 40 else None)


def _holes(rng, B, N):
    """A mask with left padding and holes inside each row; positions step with columns from the first real token
    (Transformers' ``position_ids``), so a 0 hides only its key."""
    pyrng = pyrng_of(rng)
    valid = torch.ones(B, N, dtype=torch.bool)
    pos = torch.arange(N).expand(B, N).clone()
    for b in range(B):
        start = pyrng.randint(0, 6)
        valid[b, :start] = False
        pos[b] = (pos[b] - start).clamp_min(0)
        for c in pyrng.sample(range(start + 1, N - 1), 4):
            valid[b, c] = False
    return pos, valid


@cpu
@pytest.mark.parametrize("causal", [True, False])
def test_mask_holes(rng, causal):
    """A 0 in the middle of a mask row hides that key only: the kernels read per-token validity inside a run."""
    pyrng = pyrng_of(rng)
    B, N = 2, 32
    pos, valid = _holes(rng, B, N)
    lay = layout_of(pos, pos, valid, valid)
    assert layout_runs(lay).holes
    q, k, v = make_qkv(rng, B, 2, 1, N, N, 16, torch.float32, "cpu")
    out, lse = check_op(q, k, v, random_branches(pyrng), TOL[torch.float32], layout=lay, is_causal=causal,
                        head_offset=1, window=pyrng.choice([None, 7]), global_tokens=pyrng.choice([0, 2]),
                        dropout_p=pyrng.choice([0.0, 0.2]), seed=seed_of(rng))
    assert (out.transpose(1, 2)[~valid] == 0).all() and torch.isinf(lse.transpose(1, 2)[~valid]).all()


@cpu
def test_decode_holes_window_global_dropout(rng):
    """The decode kernel with holes in the cache, a window, global tokens and dropout (backward: general kernels)."""
    B, N, nq = 2, 45, 4
    pos, valid = _holes(rng, B, N)
    valid[:, -nq:] = True
    lay = layout_of(pos[:, -nq:], pos, valid, torch.ones(B, nq, dtype=torch.bool))
    q, k, v = make_qkv(rng, B, 4, 2, nq, N, 16, torch.float32, "cpu")
    branches = [(8, 1), (16, 2), (32, 4)]
    check_op(q, k, v, branches, TOL[torch.float32], layout=lay, decode=True, head_offset=3, global_tokens=3)
    check_op(q, k, v, branches, TOL[torch.float32], layout=lay, decode=True, window=11, dropout_p=0.25,
             seed=seed_of(rng))


@cpu
def test_dense_segment_far_positions(rng):
    """DENSE_SEGMENT (2^30) segments at positions near 2^30: no int32 overflow in the schedule or the kernels."""
    N = 24
    pos = (2**30 - 40 + torch.arange(N))[None]
    lay = layout_of(pos, pos)
    q, k, v = make_qkv(rng, 1, 2, 1, N, N, 16, torch.float32, "cpu")
    check_op(q, k, v, [(DENSE_SEGMENT, 1)], TOL[torch.float32], layout=lay, window=10)
    check_op(q[:, :, -2:], k, v, [(16, 1), (DENSE_SEGMENT, 2)], TOL[torch.float32], decode=True,
             layout=layout_of(pos[:, -2:], pos, q_valid=torch.ones(1, 2, dtype=torch.bool)))


@cpu
def test_layout_runs():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    plan = layout_runs(resolve_layout(2, 4, 4, torch.device("cpu"), attention_mask=mask))
    assert plan.runs.tolist() == [[0, 1, 0, 3, 1, 0, 3], [1, 0, 0, 2, 0, 0, 2]] and not plan.holes
    packed = layout_runs(resolve_layout(1, 5, 5, torch.device("cpu"), position_ids=torch.tensor([[0, 1, 2, 0, 1]])))
    assert packed.runs.tolist() == [[0, 0, 0, 3, 0, 0, 3], [0, 3, 0, 2, 3, 0, 2]]
    # A hole whose positions step with the columns: one run with a hole inside.
    hole = torch.tensor([[1, 1, 0, 1, 1]], dtype=torch.bool)
    pos = torch.arange(5)[None]
    plan = layout_runs(layout_of(pos[:, -1:], pos, hole, torch.ones(1, 1, dtype=torch.bool)))
    assert plan.runs.tolist() == [[0, 0, 4, 1, 0, 0, 5]] and plan.holes
    # Positions counted across the hole: not expressible in place.
    counted = torch.tensor([[0, 1, 1, 2, 3]])
    assert layout_runs(layout_of(counted[:, -1:], counted, hole, torch.ones(1, 1, dtype=torch.bool))) is None


@cpu
def test_items_per_group():
    """The persistent warp-specialized forward's descriptors span a group of items that share a batch row and column
    bases: a contiguous layout gives one group per batch row, packed sequences of unequal item counts none."""
    cpu_dev = torch.device("cpu")
    plan = layout_runs(resolve_layout(2, 4096, 4096, cpu_dev))
    assert branch_items(plan.runs, 2048, 1, True, cpu_dev).items_per_group == 2
    assert branch_items(plan.runs, 8192, 4, True, cpu_dev).items_per_group == 1
    pos = torch.cat([torch.arange(3000), torch.arange(1000)])[None]
    packed = layout_runs(resolve_layout(1, 4000, 4000, cpu_dev, position_ids=pos))
    assert branch_items(packed.runs, 2048, 1, True, cpu_dev).items_per_group == 0  # 2 items, then 1
    assert branch_items(packed.runs, 4096, 1, True, cpu_dev).items_per_group == 1  # one item each


@triton.jit
def _record_item_tile(OUT, n_tiles, HEAVIEST_LAST: tl.constexpr):
    item, tile = item_tile(n_tiles, HEAVIEST_LAST)
    pid = tl.program_id(0)
    tl.store(OUT + 2 * pid, item)
    tl.store(OUT + 2 * pid + 1, tile)


@cpu
@pytest.mark.parametrize("heaviest_last", [False, True])
def test_item_tile_order(heaviest_last):
    """The launch order of a branch: every (item, tile) exactly once, an item's tiles as consecutive programs, and
    last-first when asked (longest first under causal attention)."""
    (programs, heads), n_tiles = launch.items_grid(3, 70, 16, 2)
    assert (programs, heads, n_tiles) == (15, 2, 5)
    out = torch.full((programs, 2), -1, dtype=torch.int32)
    _record_item_tile[(programs,)](out, n_tiles, HEAVIEST_LAST=heaviest_last)
    tiles = list(range(n_tiles))[::-1] if heaviest_last else list(range(n_tiles))
    assert out.tolist() == [[item, tile] for item in range(3) for tile in tiles]
    with pytest.raises(ValueError, match="too many work items"):
        launch.items_grid(2**20, 2**24, 16, 2)


@cpu
@pytest.mark.parametrize("decode", [False, True])
def test_counted_positions_across_holes_gathered(rng, decode):
    """Positions counted across holes (as generate() computes them) do not step with the columns: the kernels run on
    the gathered valid tokens and scatter back, exact; invalid queries give 0 and an lse of -inf."""
    B, N = 2, 30
    _, valid = _holes(rng, B, N)
    counted = (valid.long().cumsum(-1) - 1).clamp_min(0)
    nq = 3 if decode else N
    if decode:
        valid[:, -nq:] = True
        counted = (valid.long().cumsum(-1) - 1).clamp_min(0)
    lay = layout_of(counted[:, -nq:], counted, valid, valid[:, -nq:])
    assert layout_runs(lay) is None
    q, k, v = make_qkv(rng, B, 2, 1, nq, N, 16, torch.float32, "cpu")
    out, lse = check_op(q, k, v, [(8, 1), (16, 2)], TOL[torch.float32], layout=lay, decode=decode, head_offset=1,
                        global_tokens=2)
    hidden = ~valid[:, -nq:]
    assert (out.transpose(1, 2)[hidden] == 0).all() and torch.isinf(lse.transpose(1, 2)[hidden]).all()


@cpu
def test_fallbacks_warn_once_and_strict_raises(rng, monkeypatch):
    """What the kernels cannot run goes to the reference with one warning per reason, still exact; strict raises."""
    monkeypatch.setattr(op, "_WARNED", set())
    pos = torch.tensor([[0, 1, 2, 5, 6, 7, 8, 9, 12, 13]])  # one sequence whose positions jump
    lay = layout_of(pos, pos)
    q, k, v = make_qkv(rng, 1, 2, 2, 10, 10, 16, torch.float32, "cpu")
    assert "positions" in fallback_reason(q, k, v, lay)
    want = naive_dilated_attention(*(t.double() for t in (q, k, v)), [(8, 1), (16, 2)], q_pos=pos, k_pos=pos)
    before = launch.LAUNCHES["reference"]
    with pytest.warns(UserWarning, match="do not cover") as caught:
        for _ in range(2):
            out, _ = dilated_attention_triton(q, k, v, ((8, 1), (16, 2)), lay, True, 0.25)
    assert len(caught) == 1 and launch.LAUNCHES["reference"] == before + 2
    assert rel_err(out, want) < TOL[torch.float32]
    with pytest.raises(ValueError, match="do not cover"):
        dilated_attention_triton(q, k, v, ((8, 1), (16, 2)), lay, True, 0.25, strict=True)
    # Dropout where the kernels would have to gather the tokens (columns change): refused under strict.
    valid = torch.ones(1, 10, dtype=torch.bool)
    valid[0, 4] = False
    counted = (valid.long().cumsum(-1) - 1).clamp_min(0)
    holes = layout_of(counted, counted, valid)
    assert fallback_reason(q, k, v, holes) is None and "dropout" in fallback_reason(q, k, v, holes, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout"):
        dilated_attention_triton(q, k, v, ((8, 1),), holes, True, 0.25, dropout_p=0.1, seed=seed_of(rng), strict=True)
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    assert "float64" in fallback_reason(q64, k64, v64, resolve_layout(1, 10, 10, q.device))
    with pytest.raises(ValueError, match="float64"):
        dilated_attention_triton(q64, k64, v64, ((8, 1),), resolve_layout(1, 10, 10, q.device), True, 0.25,
                                 strict=True)
    big = torch.zeros(1, 1, 2, 264)
    assert "head dim 264" in fallback_reason(big, big, big, resolve_layout(1, 2, 2, q.device))
    assert "dilation rates" in fallback_reason(q, k, v, resolve_layout(1, 10, 10, q.device), branches=((2**23, 2**23),))
    assert fallback_reason(q, k, v, resolve_layout(1, 10, 10, q.device)) is None


@cpu
def test_compile_fullgraph_no_graph_break(rng):
    """The custom op traces as one node, the dropout seed a tensor: torch.compile(fullgraph=True) forward and
    backward give the same numbers."""
    q, k, v = make_qkv(rng, 1, 2, 1, 24, 24, 16, torch.float32, "cpu")
    layout = resolve_layout(1, 24, 24, torch.device("cpu"))
    seed = seed_of(rng)

    def f(q, k, v):
        return dilated_attention_triton(q, k, v, ((8, 1), (16, 2)), layout, True, 0.25, window=9, global_tokens=1,
                                        dropout_p=0.2, seed=seed)[0]

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    a = compiled(q, k, v)
    b = f(q, k, v)
    assert rel_err(a, b) < 1e-6
    ga = torch.autograd.grad(a.sum(), (q, k, v))
    gb = torch.autograd.grad(b.sum(), (q, k, v))
    for x, y in zip(ga, gb):
        assert rel_err(x, y) < 1e-6


@cpu
def test_opcheck(rng):
    q, k, v = make_qkv(rng, 1, 2, 1, 20, 20, 16, torch.float32, "cpu")
    lay = resolve_layout(1, 20, 20, torch.device("cpu"))
    args = (q, k, v, lay.q_pos, lay.q_seq, lay.q_valid, lay.k_pos, lay.k_seq, lay.k_valid, [8, 16], [1, 2],
            True, True, 0.25, 0, 6, 1, 0.1, seed_of(rng), True)
    torch.library.opcheck(torch.ops.hf_dilated.dilated_attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))

# ---------------------------------------------------------------------------------------------------------------
# GPU, real sizes (python -m pytest -m gpu tests/test_triton_kernels.py)

LONGNET_SMALL = [(256, 1), (512, 2), (1024, 4), (2048, 8)]


def _gpu_skip():
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("needs a CUDA GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_contiguous(rng, dtype, D, causal):
    _gpu_skip()
    N = 3000  # ragged against every segment
    q, k, v = make_qkv(rng, 2, 8, 2, N, N, D, dtype, "cuda")
    check(q, k, v, LONGNET_SMALL, TOL[dtype], is_causal=causal, head_offset=3, use_naive=N <= 2048)


@pytest.mark.gpu
def test_gpu_float32_ieee_before_ampere(rng, monkeypatch):
    """The float32 dots GPUs before Ampere get (``ieee``, no tf32 tensor cores), compiled and checked here."""
    _gpu_skip()
    from hf_dilated.ops.triton import configs

    monkeypatch.setattr(configs, "_capability_major", lambda: 7)
    assert configs.dot_mode(torch.float32) == 3
    q, k, v = make_qkv(rng, 1, 8, 2, 1500, 1500, 64, torch.float32, "cuda")
    check(q, k, v, LONGNET_SMALL, TOL[torch.float32], head_offset=1, use_naive=False)


@pytest.mark.gpu
def test_gpu_naive_oracle(rng):
    _gpu_skip()
    q, k, v = make_qkv(rng, 1, 8, 2, 1500, 1500, 128, torch.bfloat16, "cuda")
    check(q, k, v, LONGNET_SMALL, TOL[torch.bfloat16], is_causal=True, head_offset=1)


@pytest.mark.gpu
def test_gpu_padding_and_packing(rng):
    _gpu_skip()
    B, N = 2, 4096
    mask = torch.ones(B, N, dtype=torch.bool, device="cuda")
    mask[1, :1234] = False
    q, k, v = make_qkv(rng, B, 8, 4, N, N, 128, torch.bfloat16, "cuda")
    check(q, k, v, LONGNET_SMALL, TOL[torch.bfloat16], attention_mask=mask, use_naive=False)
    lengths = [1000, 2500, 596]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    q, k, v = make_qkv(rng, 1, 8, 4, sum(lengths), sum(lengths), 128, torch.bfloat16, "cuda")
    check(q, k, v, LONGNET_SMALL, TOL[torch.bfloat16], cu_seqlens_q=cu, cu_seqlens_k=cu, use_naive=False)


@pytest.mark.gpu
@pytest.mark.parametrize("nq", [1, 16, 64])
def test_gpu_decode(rng, nq):
    _gpu_skip()
    q, k, v = make_qkv(rng, 2, 16, 4, nq, 20000, 128, torch.bfloat16, "cuda")
    check(q, k, v, LONGNET_SMALL + [(4096, 16)], TOL[torch.bfloat16], use_naive=False, decode=True)


GPU_BRANCHES = [(256, 1), (512, 2), (1024, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
def test_gpu_window_global_dropout(rng, dtype, D):
    """Every head dim (padded in the kernel), window + global tokens + dropout at once, against the float64 oracle."""
    _gpu_skip()
    q, k, v = make_qkv(rng, 1, 8, 2, 1500, 1500, D, dtype, "cuda")
    check_op(q, k, v, GPU_BRANCHES, TOL[dtype], head_offset=1, window=300, global_tokens=4, dropout_p=0.1,
             seed=seed_of(rng))
    check_op(q, k, v, GPU_BRANCHES, TOL[dtype], is_causal=False, window=200)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_dense_sliding_window_layer(rng, causal):
    """A Gemma-style local layer (dense segment, window 512, 4:1 GQA, D=256) exact, then at 64K tokens forward and
    backward within a few times the q/k/v bytes (no N x N)."""
    _gpu_skip()
    q, k, v = make_qkv(rng, 1, 8, 2, 2500, 2500, 256, torch.bfloat16, "cuda")
    check_op(q, k, v, [(DENSE_SEGMENT, 1)], TOL[torch.bfloat16], is_causal=causal, window=512)
    N = 65536
    q, k, v = make_qkv(rng, 1, 8, 2, N, N, 256, torch.bfloat16, "cuda")
    lay = resolve_layout(1, N, N, q.device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with kernels_run("forward", "backward"):
        out, _ = dilated_attention_triton(q, k, v, ((DENSE_SEGMENT, 1),), lay, causal, 256 ** -0.5, window=512,
                                          strict=True)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
    qkv = q.nbytes + k.nbytes + v.nbytes
    assert torch.cuda.max_memory_allocated() - base < 10 * qkv, "dense sliding-window layer is not memory-linear"


@pytest.mark.gpu
def test_gpu_chunked_backward_holds_one_chunk_of_scratch(rng, monkeypatch):
    """A half-precision backward sums in float32 scratch a chunk of kv heads at a time (at 1M tokens, 16 chunks of 1.5
    GiB): its peak holds the gradients, the row deltas and one chunk's scratch, not two. The launcher's recording,
    abandoned at the first chunk (a head slice is a tensor of the call alone), held the first chunk's scratch to the
    call's end (sessions 43-44: 1M forward+backward at 1.10x its bytes instead of 1.05x)."""
    _gpu_skip()
    monkeypatch.setattr(launch, "SCRATCH_MIN_BYTES", 0)  # one kv head a chunk
    monkeypatch.setattr(launch, "SCRATCH_FRACTION", 1e-9)
    B, H, Hk, N, D = 1, 8, 4, 16384, 128
    q, k, v = (t.requires_grad_() for t in make_qkv(rng, B, H, Hk, N, N, D, torch.bfloat16, "cuda"))
    lay = resolve_layout(B, N, N, q.device)
    out, _ = dilated_attention_triton(q, k, v, ((2048, 1), (4096, 2)), lay, True, D ** -0.5, strict=True)
    do = torch.randn_like(out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with kernels_run("backward"):
        torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize()
    grads, deltas = q.nbytes + k.nbytes + v.nbytes, 4 * B * H * N
    chunk = 4 * B * N * D * (H // Hk + 2)  # float32 sums of one kv head's queries, keys and values
    extra = torch.cuda.max_memory_allocated() - base - grads - deltas
    assert chunk <= extra < 1.5 * chunk, f"backward peak beyond its gradients: {extra / chunk:.2f} chunks of scratch"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_mask_holes(rng, dtype):
    """Left padding and holes inside the rows (positions step with columns), with global tokens and dropout."""
    _gpu_skip()
    B, N = 2, 2048
    valid = torch.rand(B, N, generator=rng) > 0.05
    valid[1, :300] = False
    pos = torch.arange(N).expand(B, N).clone()
    pos[1] = (pos[1] - 300).clamp_min(0)
    lay = layout_of(pos.cuda(), pos.cuda(), valid.cuda(), valid.cuda())
    q, k, v = make_qkv(rng, B, 8, 4, N, N, 128, dtype, "cuda")
    check_op(q, k, v, GPU_BRANCHES, TOL[dtype], layout=lay, global_tokens=2, dropout_p=0.1, seed=seed_of(rng))


@pytest.mark.gpu
@pytest.mark.parametrize("nq", [1, 16])
def test_gpu_decode_features(rng, nq):
    """Decode against an 8K cache with holes, a window, global tokens and dropout."""
    _gpu_skip()
    B, N = 2, 8192
    valid = torch.rand(B, N, generator=rng) > 0.02
    valid[:, -nq:] = True
    pos = torch.arange(N).expand(B, N)
    lay = layout_of(pos[:, -nq:].cuda(), pos.cuda(), valid.cuda(), torch.ones(B, nq, dtype=torch.bool).cuda())
    q, k, v = make_qkv(rng, B, 16, 4, nq, N, 128, torch.bfloat16, "cuda")
    branches = [(1024, 1), (2048, 2), (4096, 4), (8192, 8)]
    check_op(q, k, v, branches, TOL[torch.bfloat16], layout=lay, decode=True, window=3000, global_tokens=4,
             dropout_p=0.1, seed=seed_of(rng))


@pytest.mark.gpu
def test_gpu_counted_positions_across_holes(rng):
    """Positions counted across holes (generate()'s position ids): the kernels on the gathered valid tokens."""
    _gpu_skip()
    B, N = 2, 2048
    valid = torch.rand(B, N, generator=rng) > 0.05
    valid[0, :100] = False
    counted = (valid.long().cumsum(-1) - 1).clamp_min(0)
    lay = layout_of(counted.cuda(), counted.cuda(), valid.cuda(), valid.cuda())
    q, k, v = make_qkv(rng, B, 8, 2, N, N, 96, torch.bfloat16, "cuda")
    check_op(q, k, v, GPU_BRANCHES, TOL[torch.bfloat16], layout=lay, global_tokens=1, window=700)


@cpu
@pytest.mark.parametrize("which", ["forward_hopper", "backward_hopper"])
def test_gluon_kernels_coverage(monkeypatch, which):
    """The dilated forward and backward kernels in Gluon (``forward_hopper.py``, ``backward_hopper.py``; compiled on the
    CPU by test_benchmark_tools, run by the GPU tests) cover bf16 / fp16 at head dim 64 / 128 / 256 on the descriptor
    path without window, dropout or holes (the backward's dQ at 128 / 256, from the dK/dV launch at 128; dK/dV at 256
    as two roles of one launch); never under the interpreter, off sm_90, or with ``HF_DILATED_GLUON=0``."""
    import importlib

    from hf_dilated.ops.triton import configs, hopper

    kernel = importlib.import_module(f"hf_dilated.ops.triton.{which}")
    if not hopper.available():
        pytest.skip("this Triton has no Gluon Hopper API (3.6 or newer)")
    q = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
    plain = dict(IS_CAUSAL=True, WINDOW=False, HOLES=False, DROPOUT=False)
    assert not kernel.applies(q, plain, True)  # the interpreter: Gluon has none
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "_capability_major", lambda: 9)
    assert kernel.applies(q, plain, True) and kernel.applies(q[..., :64].half(), plain, True)
    assert kernel.applies(torch.empty(1, 2, 256, 256, dtype=torch.bfloat16), plain, True)  # Gemma's head dim
    if which == "backward_hopper":  # which of its two kernels runs at each head dim
        assert [[c["PART"] for c in kernel.dkdv_launch_configs(d)] for d in (64, 128, 256)] == [[0], [0], [0]]
        # head dim 256: one warp-specialized launch of two roles (a dV and a dK warpgroup), unless HF_DILATED_WS_DKDV
        # is off: then a launch per gradient (PART 1: dV, 2: dK)
        roles = kernel.dkdv_launch_configs(256)
        assert roles == [dict(BLOCK_N=64, BLOCK_Q=64, PART=0, FUSED_DQ=False, **hopper.WS_LAUNCH)], roles
        assert kernel.dkdv_kernel(roles[0]) is kernel.dilated_bwd_dkdv_ws_kernel
        monkeypatch.setenv("HF_DILATED_WS_DKDV", "0")
        assert [c["PART"] for c in kernel.dkdv_launch_configs(256)] == [1, 2]
        assert kernel.dkdv_kernel(kernel.dkdv_launch_configs(256)[0]) is kernel.dilated_bwd_dkdv_hopper_kernel
        monkeypatch.delenv("HF_DILATED_WS_DKDV")
        assert kernel.dkdv_launch_configs(96) is None
        assert [d for d in (64, 128, 256) if kernel.dq_launch_config(d)] == [128, 256]
        # at head dim 128 one dK/dV launch adds dQ too (two warpgroups, 128 keys), unless switched off or
        # deterministic algorithms are asked for (its reduce-adds land in no fixed order)
        # (head dim 64 only from 64K keys)
        assert [d for d in (64, 128, 256) if kernel.fused_dq_launch_config(d, (1 << 16) - 16)] == [128]
        assert [d for d in (64, 128, 256) if kernel.fused_dq_launch_config(d, 1 << 16)] == [64, 128]
        # warp-specialized (a producer warp, two consumer warpgroups) at any number of query heads a class, unless
        # HF_DILATED_WS_DKDV is off: then one program of 8 warps
        ws = kernel.fused_dq_launch_config(128, 4096)
        assert ws == dict(BLOCK_N=128, BLOCK_Q=64, PART=0, FUSED_DQ=True, **hopper.WS_LAUNCH)
        one = dict(BLOCK_N=128, BLOCK_Q=64, PART=0, FUSED_DQ=True, num_warps=8)
        assert kernel.dkdv_kernel(ws) is kernel.dilated_bwd_dkdv_ws_kernel
        monkeypatch.setenv("HF_DILATED_WS_DKDV", "off")
        assert kernel.fused_dq_launch_config(128, 4096) == one
        assert kernel.dkdv_kernel(one) is kernel.dilated_bwd_dkdv_hopper_kernel
        monkeypatch.setenv("HF_DILATED_WS_DKDV", "sometimes")
        with pytest.raises(ValueError, match="HF_DILATED_WS_DKDV must be one of"):
            kernel.fused_dq_launch_config(128, 4096)
        monkeypatch.delenv("HF_DILATED_WS_DKDV")
        monkeypatch.setenv("HF_DILATED_FUSED_DQ", "off")
        assert kernel.fused_dq_launch_config(128, 4096) is None
        monkeypatch.setenv("HF_DILATED_FUSED_DQ", "sometimes")
        with pytest.raises(ValueError, match="HF_DILATED_FUSED_DQ must be one of"):
            kernel.fused_dq_launch_config(128, 4096)
        monkeypatch.delenv("HF_DILATED_FUSED_DQ")
        deterministic = torch.are_deterministic_algorithms_enabled()
        try:
            torch.use_deterministic_algorithms(True)
            assert kernel.fused_dq_launch_config(128, 4096) is None
        finally:
            torch.use_deterministic_algorithms(deterministic)
    if which == "forward_hopper":  # at head dim 128 the warp-specialized kernel, unless HF_DILATED_WS is off
        assert kernel.ws_applies(q, plain, True) and kernel.ws_applies(q.half(), plain, True)
        assert not kernel.ws_applies(q[..., :64], plain, True)  # at 64 only by the call's launches' balance:
        q64 = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16).expand(1, 16, 65536, 64)  # (the shape is all it reads)
        assert kernel.ws_applies(q64, plain, True, _longnet_launches(16, 65536), 132)
        assert not kernel.ws_applies(q64[:, :9], plain, True, _longnet_launches(9, 65536), 132)  # (0.914)
        assert not kernel.ws_applies(q64[:, :, :16384], plain, True, _longnet_launches(16, 16384), 132)  # (rows)
        q64 = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16).expand(1, 9, 262144, 64)
        assert kernel.ws_applies(q64, plain, True, _longnet_launches(9, 262144), 132)
        assert not kernel.ws_applies(torch.empty(1, 2, 256, 256, dtype=torch.bfloat16), plain, True)
        assert not kernel.ws_applies(q, dict(plain, WINDOW=True), True)
        assert kernel.ws_launch_config()["BLOCK_M"] == 128 and kernel.ws_launch_config()["maxnreg"] == 168
        # persistent where the items come in groups (a contiguous layout): the SMs' programs dealt to the launch's
        # offset classes (heads c, c + r, ...) in proportion to their heads, one an SM, each walking every G_c-th pair
        # of its class's items' tiles (tiles T-1-j and j: equal causal work), head by head
        grid, sched = kernel.ws_schedule(128, 128, 2048, 16, 16, 132)  # 256K, w 2048, r 16: a head a class
        assert grid == (9, 16, 1) and sched == dict(G=132, n_tiles=16, n_units=8, n_items=128, PER_UNIT=2,
                                                    PERSISTENT=True, per_class=[8, 8, 8, 9] * 4, sizes=[1] * 16)
        assert kernel.ws_schedule(128, 128, 2048, 16, 1, 132)[0] == (132, 1, 1)  # r 1: one class of 16 heads
        assert kernel.ws_class_sizes(9, 2) == [5, 4] and kernel.ws_class_sizes(3, 8) == [1, 1, 1]
        assert kernel.ws_schedule(128, 128, 2048, 9, 2, 132)[1]["per_class"] == [73, 59]  # every SM: 132 programs
        grid, sched = kernel.ws_schedule(64, 32, 2048, 16, 16, 132)  # two batch rows: 66 programs each
        assert grid == (5, 16, 2) and sum(sched["per_class"]) == 66
        # too few pairs to fill the SMs: single tiles (16K, r 16: one item of 8 tiles a head)
        assert kernel.ws_schedule(1, 1, 1024, 16, 16, 132)[1]["PER_UNIT"] == 1
        assert kernel.ws_schedule(32, 32, 2048, 14, 16, 132)[0] == (10, 14, 1)  # 132 programs: 9 or 10 a head
        # too little work to fill the SMs (2 heads of 16 tiles): one item a program, one tile each, or a pair where
        # there is work for WS_WAVES programs per SM (more would overflow L2 with the K / V of the items in flight)
        grid, sched = kernel.ws_schedule(2, 2, 2048, 2, 16, 132)
        assert grid == (2 * 16, 2, 1) and not sched["PERSISTENT"] and sched["PER_UNIT"] == 1
        assert kernel.ws_schedule(32, 0, 2048, 16, 1, 132)[0] == (32 * 8, 16, 1)  # packed: no groups, pairs
        assert kernel.ws_schedule(1, 0, 1024, 16, 1, 132)[0] == (8, 16, 1)  # one item of 8 tiles: one tile a program
        with monkeypatch.context() as patch:
            patch.setattr(kernel, "WS_FILL", 1.01)
            assert not kernel.ws_schedule(128, 128, 2048, 16, 1, 132)[1]["PERSISTENT"]
        monkeypatch.setenv("HF_DILATED_PERSISTENT", "off")  # one item a program, also where groups allow
        assert kernel.ws_schedule(128, 128, 2048, 16, 16, 132)[0] == (128 * 8, 16, 1)
        monkeypatch.setenv("HF_DILATED_PERSISTENT", "sometimes")
        with pytest.raises(ValueError, match="HF_DILATED_PERSISTENT must be one of"):
            kernel.ws_schedule(128, 128, 2048, 16, 16, 132)
        monkeypatch.delenv("HF_DILATED_PERSISTENT")
        monkeypatch.setenv("HF_DILATED_WS", "off")
        assert not kernel.ws_applies(q, plain, True) and kernel.applies(q, plain, True)
        monkeypatch.setenv("HF_DILATED_WS", "sometimes")
        with pytest.raises(ValueError, match="HF_DILATED_WS must be one of"):
            kernel.ws_applies(q, plain, True)
        monkeypatch.delenv("HF_DILATED_WS")
    assert not kernel.applies(q, plain, False)  # pointer loads (unaligned strides, padded head dim)
    for flag in ("WINDOW", "HOLES", "DROPOUT"):
        assert not kernel.applies(q, dict(plain, **{flag: True}), True), flag
    assert not kernel.applies(q.float(), plain, True)
    assert not kernel.applies(q[..., :32], plain, True)
    monkeypatch.setattr(configs, "_capability_major", lambda: 10)  # Blackwell: no wgmma
    assert not kernel.applies(q, plain, True)
    monkeypatch.setattr(configs, "_capability_major", lambda: 9)
    monkeypatch.setenv("HF_DILATED_GLUON", "off")
    assert not kernel.applies(q, plain, True)


def _gluon_parts():
    """The cases of ``test_gpu_gluon_kernels_on_hopper`` in parts of about equal compile work, so that xdist runs them
    side by side: a cold GPU machine compiled the whole list in one test for over 230 s (session 31), longer than a
    device call could wait for it."""
    bf16, fp16 = torch.bfloat16, torch.float16

    def head_dims(rng, run, monkeypatch):
        run(*make_qkv(rng, 2, 16, 4, 3000, 3000, 128, bf16, "cuda"), head_offset=3)
        run(*make_qkv(rng, 1, 8, 8, 2500, 2500, 64, fp16, "cuda"), is_causal=False, head_offset=1)
        run(*make_qkv(rng, 1, 9, 3, 1700, 1700, 64, bf16, "cuda"))

    def gemma(rng, run, monkeypatch):  # Gemma-style heads
        run(*make_qkv(rng, 1, 8, 2, 2300, 2300, 256, bf16, "cuda"), head_offset=1)
        run(*make_qkv(rng, 1, 4, 4, 1100, 1100, 256, fp16, "cuda"), is_causal=False)

    def layouts(rng, run, monkeypatch):
        run(*make_qkv(rng, 1, 8, 2, 700, 2000, 128, bf16, "cuda"), head_offset=2)
        mask = torch.ones(2, 2048, dtype=torch.bool, device="cuda")
        mask[1, :777] = False
        run(*make_qkv(rng, 2, 8, 4, 2048, 2048, 128, bf16, "cuda"), attention_mask=mask)
        lengths = [1000, 2500, 596]
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
        run(*make_qkv(rng, 1, 8, 4, sum(lengths), sum(lengths), 128, fp16, "cuda"), cu_seqlens_q=cu, cu_seqlens_k=cu)
        run(*make_qkv(rng, 1, 8, 2, 2000, 2000, 128, bf16, "cuda"), global_tokens=5, head_offset=1)  # keys below g

    def one_launch_and_chunks(rng, run, monkeypatch):
        run(*make_qkv(rng, 1, 4, 4, 1500, 1500, 128, bf16, "cuda"), branches=[(DENSE_SEGMENT, 1)])  # one launch
        monkeypatch.setattr(launch, "SCRATCH_MIN_BYTES", 0)  # one kv head at a time: heads from h0 > 0 in kernels
        monkeypatch.setattr(launch, "SCRATCH_FRACTION", 1e-9)
        run(*make_qkv(rng, 1, 8, 4, 2100, 2100, 64, bf16, "cuda"), head_offset=2)
        run(*make_qkv(rng, 1, 8, 4, 2100, 2100, 128, bf16, "cuda"), head_offset=2)  # dQ sums per head chunk (fused)

    return dict(head_dims=head_dims, gemma=gemma, layouts=layouts, one_launch_and_chunks=one_launch_and_chunks,
                ws_schedules=lambda rng, run, monkeypatch: _ws_schedules(rng, monkeypatch, run))


GLUON_PARTS = _gluon_parts()
# (HF_DILATED_GLUON, HF_DILATED_FUSED_DQ, HF_DILATED_WS) x the parts; the forward's schedules where it runs
GLUON_CASES = [pytest.param(*switches, part, id=f"{part}-{''.join(switches)}")
               for switches in (("1", "1", "1"), ("1", "0", "0"), ("0", "1", "1")) for part in GLUON_PARTS
               if part != "ws_schedules" or switches == ("1", "1", "1")]


@pytest.mark.gpu
@pytest.mark.parametrize("gluon, fused_dq, ws, part", GLUON_CASES)
def test_gpu_gluon_kernels_on_hopper(rng, monkeypatch, gluon, fused_dq, ws, part):
    """On sm_90 the dilated forward, dK/dV (head dim 64 / 128 in one launch, 256 as two roles of one launch) and dQ (128
    / 256) run in Gluon where they apply, at head dim 128 dQ from the dK/dV launch unless ``HF_DILATED_FUSED_DQ=0`` and
    the warp-specialized forward unless ``HF_DILATED_WS=0``, and the portable kernels with ``HF_DILATED_GLUON=0``; all
    against the float64 oracle (``GLUON_PARTS``): GQA with several offset classes, ragged segments, bidirectional,
    padding, packed sequences, fewer queries than keys (queries and keys of a segment at different rows), global tokens,
    a dense layer (one launch, which writes the gradients with no float32 buffer), the backward's head chunks,
    Gemma-style head dim 256, and the warp-specialized forward's schedules (with it on)."""
    _gpu_skip()
    from hf_dilated.ops.triton import backward_hopper, configs, forward_hopper, hopper

    if not configs.wgmma():
        pytest.skip("the Gluon kernel is for sm_90")
    assert hopper.available(), "sm_90 with a Triton whose Gluon API the kernel does not know"
    monkeypatch.setenv("HF_DILATED_GLUON", gluon)
    monkeypatch.setenv("HF_DILATED_FUSED_DQ", fused_dq)
    monkeypatch.setenv("HF_DILATED_WS", ws)

    def run(q, k, v, branches=LONGNET_SMALL, **kw):
        before = dict(launch.LAUNCHES)
        check(q, k, v, branches, TOL[q.dtype], use_naive=False, **kw)
        kinds = ("dkdv_hopper", "dq_hopper", "dq_fused", "forward_hopper", "forward_ws")
        ran = {kind: launch.LAUNCHES[kind] > before.get(kind, 0) for kind in kinds}
        on = gluon == "1"
        d = q.shape[-1]
        fused = (on and fused_dq == "1" and d in backward_hopper.FUSED_DQ_STEPS
                 and k.shape[2] >= backward_hopper.FUSED_DQ_MIN_KEYS.get(d, 0))
        specialized = on and ws == "1" and d in forward_hopper.WS_HEAD_DIMS
        if on and ws == "1" and d in forward_hopper.WS_BALANCED_HEAD_DIMS:  # by the launches' balance: either, once
            specialized = ran["forward_ws"]
        dq_kernel = on and d in backward_hopper.DQ_STEPS and not fused
        assert ran == {"dkdv_hopper": on, "dq_hopper": dq_kernel, "dq_fused": fused,
                       "forward_hopper": on and not specialized, "forward_ws": specialized}, ran

    GLUON_PARTS[part](rng, run, monkeypatch)


def _longnet_launches(H: int, N: int):
    """The forward's branch launches of LongNet's branches on one contiguous row of ``N`` tokens, as
    ``forward_hopper.ws_balance`` takes them."""
    lay = resolve_layout(1, N, N, torch.device("cpu"))
    pb = launch.Problem(tuple(LONGNET), True, 0.125, 0)
    order, _, _ = launch._launch_order(pb, layout_runs(lay), ("contiguous", 1, N, N), torch.device("cpu"), True)
    return [(it.n_items, it.items_per_group, it.max_q_rows, r) for _, r, it in order]


def test_ws_class_schedule_walks_every_unit_of_every_head_once():
    """The persistent warp-specialized forward's programs (``dilated_fwd_ws_kernel``, which the CPU cannot run):
    program ``k`` of class ``h0`` takes ``G_c`` from the kernel's closed form, then units ``k, k + G_c, ...`` of its
    class, head ``h0 + r (unit // per_head)``. Transcribed here, for many head counts, rates and SM counts: every
    (head, unit) is walked exactly once, ``G_c`` is ``ws_class_programs``' and, where ``ws_schedule`` would take the
    schedule (every class has programs), no more programs run than it was given."""
    from hf_dilated.ops.triton import forward_hopper as fh

    for heads in (1, 2, 3, 5, 8, 9, 14, 16, 24, 28, 40):
        for r in (1, 2, 3, 4, 8, 16, 32):
            for programs, per_head in ((132, 16), (132, 1), (66, 8), (7, 3)):
                sizes = fh.ws_class_sizes(heads, r)
                per_class = fh.ws_class_programs(sizes, heads, programs, per_head)
                assert sum(sizes) == heads and sum(per_class) <= programs
                seen, running = Counter(), 0
                for h0, n_c in enumerate(sizes):
                    before = (heads // r) * h0 + min(heads % r, h0)  # as the kernel computes them
                    G = max(min(programs * (before + n_c) // heads - programs * before // heads, n_c * per_head), 1)
                    assert G == max(per_class[h0], 1)
                    for k in range(max(per_class)):
                        n_slots = max(n_c * per_head - k + G - 1, 0) // G if k < G else 0
                        running += k < G
                        for i in range(n_slots):
                            unit = k + i * G
                            seen[h0 + (unit // per_head) * r, unit % per_head] += 1
                assert seen == Counter({(h, u): 1 for h in range(heads) for u in range(per_head)}), (heads, r)
                assert running <= programs or min(per_class) == 0  # (a class without programs: not persistent)


def test_ws_balance_takes_head_dim_64_where_programs_divide_evenly():
    """At head dim 64 the warp-specialized forward runs where its persistent programs keep ``WS_BALANCE`` of the SMs'
    time busy (132 SMs): 16 heads (every launch's units divide evenly) and 9 heads at 256K, not 9 heads at 64K.
    Session 46's A/Bs (benchmarks/results/session46-ws-d64-by-heads-*.json) measured it against the kernel with parts
    at these cases: with programs dealt to offset classes 14 heads at 64K 1.04x (balance 0.956), 9 heads at 64K 0.99x
    (0.914); with programs of one head each, every case named below won."""
    from hf_dilated.ops.triton import forward_hopper as fh

    balance = {(H, N): fh.ws_balance(_longnet_launches(H, N), H, 132) for H, N in
               ((9, 65536), (9, 262144), (16, 65536), (16, 16384))}
    assert balance[9, 65536] < fh.WS_BALANCE <= balance[9, 262144], balance
    assert balance[16, 65536] >= fh.WS_BALANCE and balance[16, 16384] >= fh.WS_BALANCE, balance
    won = [(6, 65536), (10, 65536), (12, 65536), (14, 65536), (18, 65536), (7, 262144), (14, 262144)]
    assert all(fh.ws_balance(_longnet_launches(H, N), H, 132) >= fh.WS_BALANCE for H, N in won)
    assert fh.ws_balance(_longnet_launches(24, 65536), 24, 132) >= fh.WS_BALANCE  # (one item a program before)
    assert fh.ws_balance(_longnet_launches(2, 65536), 2, 132) == 0.0  # one item a program: not taken at 64
    assert fh.ws_balance([], 9, 132) == 0.0


@pytest.mark.gpu
def test_gpu_forward_at_head_dim_64_by_balance(rng):
    """On sm_90 the head-dim-64 forward runs warp-specialized where ``ws_balance`` says (16 / 16 heads at 64K) and
    the one-warpgroup kernel with parts where not (9 / 3 at 64K)."""
    _gpu_skip()
    from hf_dilated.ops.triton import configs

    if not configs.wgmma():
        pytest.skip("the Gluon kernels are for sm_90")
    N = 65536
    for H, Hk, kind in ((16, 16, "forward_ws"), (9, 3, "forward_hopper")):
        q, k, v = (t.detach() for t in make_qkv(rng, 1, H, Hk, N, N, 64, torch.bfloat16, "cuda"))
        before = dict(launch.LAUNCHES)
        with torch.no_grad():
            dilated_attention_triton(q, k, v, tuple(LONGNET), resolve_layout(1, N, N, q.device), True, 0.125,
                                     strict=True)
        ran = {key: launch.LAUNCHES[key] - before.get(key, 0) for key in ("forward_ws", "forward_hopper")}
        assert ran[kind] and not ran[({"forward_ws", "forward_hopper"} - {kind}).pop()], (H, Hk, ran)


@pytest.mark.gpu
@pytest.mark.parametrize("gluon", ["0", "1"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_nan_query_row_is_nan_in_every_forward_kernel(rng, monkeypatch, gluon, D):
    """A NaN in one query entry gives that row a NaN output and a NaN lse (not -inf, "saw no key"), and leaves every
    other row finite, in the portable forward and, on sm_90, the Gluon ones (the warp-specialized one at D 128): the
    ``l != 0`` of ``tiles.finish`` / ``hopper.fwd_last`` and of the branch merges."""
    _gpu_skip()
    from hf_dilated.ops.triton import configs, forward_hopper

    if gluon == "1" and not configs.wgmma():
        pytest.skip("the Gluon kernels are for sm_90")
    monkeypatch.setenv("HF_DILATED_GLUON", gluon)
    q, k, v = (t.detach() for t in make_qkv(rng, 1, 4, 2, 3000, 3000, D, torch.bfloat16, "cuda"))
    h, row = int(torch.randint(0, 4, (), generator=rng)), int(torch.randint(0, 3000, (), generator=rng))
    q[0, h, row, D // 2] = float("nan")
    before = dict(launch.LAUNCHES)
    with torch.no_grad(), kernels_run("forward"):
        out, lse = dilated_attention_triton(q, k, v, tuple(LONGNET_SMALL), resolve_layout(1, 3000, 3000, q.device),
                                            True, D ** -0.5)
    if gluon == "1":
        kinds = ("forward_ws",) if D in forward_hopper.WS_HEAD_DIMS else ("forward_hopper",)
        if D in forward_hopper.WS_BALANCED_HEAD_DIMS:  # by the launches' balance
            kinds = ("forward_ws", "forward_hopper")
        assert any(launch.LAUNCHES[kind] > before.get(kind, 0) for kind in kinds), f"no Gluon {kinds} kernel ran"
    want = torch.zeros(1, 4, 3000, dtype=torch.bool, device="cuda")
    want[0, h, row] = True
    assert torch.equal(out.isnan().any(-1), want) and bool(out[0, h, row].isnan().all())
    assert torch.equal(lse.isnan(), want), "the NaN row's lse is not NaN, or another row's is"


@pytest.mark.gpu
@pytest.mark.parametrize("gluon", ["0", "1"])
@pytest.mark.parametrize("side", ["right", "tail", "left", "holes"])
def test_gpu_nan_in_padding_reaches_no_output(rng, monkeypatch, gluon, side):
    """NaN in the padding tokens' q, k and v (SPEC: never attended) leaves every real row's output and gradients
    equal to a run with finite padding, and the padding rows finite, in the portable and Gluon kernels (D 128, GQA):
    the tensor descriptors and masked loads must not bring a padding row's value into ``P V`` as ``0 * NaN``.
    ``tail`` (100 tokens) leaves both rows as many segments of the r = 1 branch, and ``holes`` runs the kernels on
    the gathered valid tokens (padding at the end): there the warp-specialized forward runs persistent, its
    descriptors spanning a batch row's items (seen to run on 132-SM GPUs, where the schedule takes it)."""
    _gpu_skip()
    from hf_dilated.ops.triton import configs

    if gluon == "1" and not configs.wgmma():
        pytest.skip("the Gluon kernels are for sm_90")
    monkeypatch.setenv("HF_DILATED_GLUON", gluon)
    N = 3000
    mask = torch.ones(2, N, dtype=torch.bool, device="cuda")
    pad = {"right": torch.arange(N - 700, N), "tail": torch.arange(N - 100, N), "left": torch.arange(700),
           "holes": torch.arange(100, 3000, 7)}[side]
    mask[1, pad.cuda()] = False
    q, k, v = make_qkv(rng, 2, 8, 2, N, N, 128, torch.bfloat16, "cuda")
    do = torch.randn(q.shape, generator=rng, dtype=torch.float64).to("cuda", q.dtype)
    ws, rs = [w for w, _ in LONGNET_SMALL], [r for _, r in LONGNET_SMALL]
    runs = []
    persistent = launch.LAUNCHES["forward_persistent"]
    for poison in (False, True):
        qq, kk, vv = (t.detach().clone() for t in (q, k, v))
        if poison:
            for t in (qq, kk, vv):
                t[1, :, pad.cuda()] = float("nan")
        qq, kk, vv = (t.requires_grad_() for t in (qq, kk, vv))
        with kernels_run("forward", "backward"):
            out = hf_dilated.dilated_attention(qq, kk, vv, ws, rs, attention_mask=mask, backend="triton")
            grads = torch.autograd.grad(out, (qq, kk, vv), do)
        runs.append((out, *grads))
    if gluon == "1" and side in ("tail", "holes") and configs.sm_count(q.device) == 132:
        assert launch.LAUNCHES["forward_persistent"] > persistent, "the persistent forward did not run"
    real = mask[:, None, :, None]
    for name, clean, poisoned in zip(("out", "dq", "dk", "dv"), *runs):
        assert not poisoned.isnan().any(), f"{name}: NaN from the padding"
        rows = real.expand_as(clean)
        assert torch.equal(poisoned[rows], clean[rows]), f"{name} of a real row changed with the padding's values"


# test_gpu_warp_specialized_dkdv's cases: (B, H, Hk, N, dtype, keyword arguments); "head_dim" (128 unless given),
# "branches" replaces LONGNET_SMALL, "mask" pads the second batch row's first 777 keys, "chunked" runs one kv head at a
# time (heads from h0 > 0 in the kernel)
WS_DKDV_CASES = {
    "causal": (2, 8, 8, 3000, torch.bfloat16, dict(head_offset=3)),
    "bidirectional": (1, 8, 8, 2500, torch.float16, dict(is_causal=False, head_offset=1)),
    "gqa-4-heads-a-class": (1, 16, 4, 2200, torch.bfloat16, dict(head_offset=1)),  # 4 a class at r 1, 1 at r 4
    # 6 / 3 / 2 heads a class at r 1 / 2 / 4 (at r 4 two classes of 2 and two of 1)
    "gqa-6-heads-a-class": (2, 24, 4, 1800, torch.bfloat16, dict(head_offset=2)),
    "gqa-uneven": (1, 12, 4, 1700, torch.float16, dict(is_causal=False)),  # 3 / 2 (uneven) / 1 at r 1 / 2 / 4
    "padding": (2, 8, 8, 2048, torch.bfloat16, dict(mask=True)),
    "one-launch": (1, 4, 4, 1500, torch.bfloat16, dict(branches=[(DENSE_SEGMENT, 1)])),
    "head-chunks": (1, 4, 4, 2100, torch.bfloat16, dict(head_offset=2, chunked=True)),
    "head-chunks-gqa": (1, 8, 2, 2100, torch.bfloat16, dict(head_offset=2, chunked=True)),  # 4 / 2 a class at r 1 / 2
    "d64-gqa": (2, 9, 3, 2300, torch.bfloat16, dict(head_dim=64, head_offset=1)),  # SmolLM2's heads
    "d64-bidirectional": (1, 6, 6, 1900, torch.float16, dict(head_dim=64, is_causal=False)),
    "d64-padding": (2, 8, 8, 2048, torch.bfloat16, dict(head_dim=64, mask=True)),
    "d64-head-chunks-gqa": (1, 8, 2, 2100, torch.bfloat16, dict(head_dim=64, head_offset=2, chunked=True)),
    # head dim 256: the two roles (a dV and a dK warpgroup on the same keys), not fused with dQ
    "d256-gqa": (1, 8, 2, 2300, torch.bfloat16, dict(head_dim=256, head_offset=1)),  # 4 / 2 / 1 a class at r 1 / 2 / 4
    "d256-bidirectional": (1, 4, 4, 1100, torch.float16, dict(head_dim=256, is_causal=False)),
    "d256-padding": (2, 4, 2, 2048, torch.bfloat16, dict(head_dim=256, mask=True)),
    "d256-head-chunks": (1, 4, 4, 2100, torch.bfloat16, dict(head_dim=256, head_offset=2, chunked=True)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(WS_DKDV_CASES))
def test_gpu_warp_specialized_dkdv(rng, monkeypatch, case):
    """By default (``HF_DILATED_WS_DKDV``) at head dim 128, and 64 from 64K keys (here at any length), the fused dK/dV
    runs warp-specialized (a producer warp, two consumer warpgroups of 64 keys: at 128 they meet once a step for dQ,
    at 64 each adds dQ of its own keys) at any number of query heads a class, and at head dim 256 dK/dV runs as its
    two roles (a dV and a dK warpgroup on the same 64 keys, ``P^T`` handed over in shared memory); against the float64
    oracle (causal and bidirectional, ragged segments, GQA with one and several heads a class, padding, head chunks:
    ``WS_DKDV_CASES``; nested pairs where they apply), and on every pair dK and dV bit for bit those of the
    one-program kernel (fused) or of its launch per gradient (256: the same products in the same order), dQ to
    rounding (reduce-adds in no fixed order), and the warp-specialized kernel seen to run."""
    _gpu_skip()
    from hf_dilated.ops.triton import backward_hopper, configs

    if not configs.wgmma():
        pytest.skip("the Gluon kernel is for sm_90")
    monkeypatch.setenv("HF_DILATED_WS_DKDV", "1")
    B, H, Hk, N, dtype, kw = WS_DKDV_CASES[case]
    kw = dict(kw)
    D = kw.pop("head_dim", 128)
    monkeypatch.setattr(backward_hopper, "FUSED_DQ_MIN_KEYS", {})  # head dim 64 at these lengths too
    cfg = backward_hopper.fused_dq_launch_config(D, N) or backward_hopper.dkdv_launch_configs(D)[0]
    assert "CONSUMER_REGS" in cfg and cfg["FUSED_DQ"] == (D not in backward_hopper.ROLES_STEPS), cfg
    branches = kw.pop("branches", LONGNET_SMALL)
    if kw.pop("mask", False):
        kw["attention_mask"] = torch.ones(B, N, dtype=torch.bool, device="cuda")
        kw["attention_mask"][1, :777] = False
    if kw.pop("chunked", False):
        monkeypatch.setattr(launch, "SCRATCH_MIN_BYTES", 0)
        monkeypatch.setattr(launch, "SCRATCH_FRACTION", 1e-9)
    q, k, v = make_qkv(rng, B, H, Hk, N, N, D, dtype, "cuda")
    before = launch.LAUNCHES["dkdv_ws"]
    check(q, k, v, branches, TOL[q.dtype], use_naive=False, **kw)
    assert launch.LAUNCHES["dkdv_ws"] > before, "the warp-specialized dK/dV did not run"
    do = torch.randn(q.shape, generator=rng, dtype=torch.float64).to("cuda", q.dtype)
    ws, rs = [w for w, _ in branches], [r for _, r in branches]
    grads = {}
    monkeypatch.setattr(launch, "NESTED_PAIRS", False)  # the one-program kernel takes every pair (launch._nests_dkdv)
    for flag in ("0", "1"):
        monkeypatch.setenv("HF_DILATED_WS_DKDV", flag)
        out = hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton", **kw)
        grads[flag] = torch.autograd.grad(out, (q, k, v), do)
    for name, a, b in zip("kv", grads["0"][1:], grads["1"][1:]):
        assert torch.equal(a, b), f"d{name} differs from the one-program fused dK/dV"
    assert rel_err(grads["1"][0], grads["0"][0]) < 1e-2


def _ws_schedules(rng, monkeypatch, run):
    """The warp-specialized forward under each of its schedules (``forward_hopper.ws_schedule``): persistent over
    pairs of tiles or over single tiles, and one item a program over pairs or single tiles; each against the float64
    oracle (``run``), all bit for bit the same output (a tile's arithmetic does not depend on the program that walks
    it), and each schedule seen to run."""
    from hf_dilated.ops.triton import forward_hopper

    q, k, v = make_qkv(rng, 2, 8, 4, 4500, 4500, 128, torch.bfloat16, "cuda")
    branches = [(1024, 1), (4096, 2)]  # 5 items of 8 tiles (the last 4) a batch row; 2 of 16 (the last 2)
    chosen, outs = [], []
    real = forward_hopper.ws_schedule

    def spy(*args):
        grid, sched = real(*args)
        chosen[-1].add((sched["PERSISTENT"], sched["PER_UNIT"]))
        return grid, sched

    # (WS_FILL, WS_WAVES, SMs): no fill asked takes pairs persistent; on 640 "SMs" pairs fill under 90% but single
    # tiles fill them at w 1024 (at w 4096 neither: one item a program); an unreachable fill gives one item a program,
    # over pairs where a tiny WS_WAVES finds work enough, else over single tiles
    from hf_dilated.ops.triton import plans

    for fill, waves, sms in ((0.0, 4, 132), (0.9, 4, 640), (2.0, 1e-3, 132), (2.0, 4, 132)):
        chosen.append(set())
        plans.forget()  # the schedule's constants are patched below: no plan recorded under other ones
        with monkeypatch.context() as patch:
            patch.setattr(forward_hopper, "ws_schedule", spy)
            patch.setattr(forward_hopper, "WS_FILL", fill)
            patch.setattr(forward_hopper, "WS_WAVES", waves)
            patch.setattr(launch, "sm_count", lambda device: sms)
            run(q, k, v, branches=branches, head_offset=1)
            outs.append(hf_dilated.dilated_attention(q, k, v, *zip(*branches), backend="triton", head_offset=1))
    assert chosen == [{(True, 2)}, {(True, 1), (False, 1)}, {(False, 2)}, {(False, 1)}], chosen
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("caller_stream", [False, True])
def test_gpu_backward_on_two_streams(rng, monkeypatch, caller_stream):
    """The backward's dQ launches run on a second stream beside the dK / dV ones (``launch.forked``): the gradients
    are bit for bit those of one stream (the same kernels), also when the caller works on a stream of its own and
    over several head chunks (float32 scratch freed between chunks), and the second stream did run."""
    _gpu_skip()
    monkeypatch.setenv("HF_DILATED_FUSED_DQ", "0")  # dQ launches of their own, on the second stream, bit for bit
    q, k, v = make_qkv(rng, 1, 8, 4, 3000, 3000, 128, torch.bfloat16, "cuda")
    do = torch.randn(q.shape, generator=rng, dtype=torch.float64).to("cuda", torch.bfloat16)
    ws, rs = [w for w, _ in LONGNET_SMALL], [r for _, r in LONGNET_SMALL]

    def grads(concurrent: bool):
        monkeypatch.setattr(launch, "CONCURRENT_BACKWARD", concurrent)
        stream = torch.cuda.Stream() if caller_stream else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton")
            got = torch.autograd.grad(out, (q, k, v), do)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        return got

    for chunks in (False, True):
        if chunks:  # one kv head at a time
            monkeypatch.setattr(launch, "SCRATCH_MIN_BYTES", 0)
            monkeypatch.setattr(launch, "SCRATCH_FRACTION", 1e-9)
        launch._SIDE_STREAMS.clear()
        one = grads(False)
        assert not launch._SIDE_STREAMS, "one stream was asked for, a second one was made"
        for _ in range(3):  # a race would show as a difference in some repeat
            with kernels_run("backward"):
                two = grads(True)
            assert launch._SIDE_STREAMS, "the backward did not fork a second stream"
            for name, a, b in zip("qkv", one, two):
                assert torch.equal(a, b), f"d{name} differs between one stream and two (head chunks: {chunks})"


@pytest.mark.gpu
@pytest.mark.parametrize("fused_dq", ["0", "1"])
def test_gpu_cuda_graph_replay(rng, monkeypatch, fused_dq):
    """Forward and backward (GQA, several branches, both streams, the Gluon kernels on Hopper) captured in a CUDA
    graph replay what eager computes on fresh inputs, bit for bit (dQ summed by the dK/dV launches' reduce-adds: to
    rounding); the kernels ran during the capture."""
    _gpu_skip()
    monkeypatch.setenv("HF_DILATED_FUSED_DQ", fused_dq)
    q, k, v = make_qkv(rng, 1, 8, 4, 3000, 3000, 128, torch.bfloat16, "cuda")
    do = torch.randn(q.shape, generator=rng, dtype=torch.float64).to("cuda", torch.bfloat16)
    ws, rs = [w for w, _ in LONGNET_SMALL], [r for _, r in LONGNET_SMALL]

    def step(q, k, v, do):
        out = hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton")
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    with kernels_run("forward", "backward"):
        assert_graph_replays_eager(step, (q, k, v, do), summed_in_any_order=(1,) if fused_dq == "1" else ())


@cpu
def test_unfilled_buffers_and_last_launch(rng, monkeypatch):
    """On a contiguous layout with an ``r = 1`` branch the launches merge into unfilled buffers (NaN under the
    interpreter: a row that no launch wrote, or one read before it was written, would show) and the ``r = 1`` branch,
    launched last, writes the output and the gradients in their dtype (alone, it writes them with no float32 buffer
    at all); a padded layout keeps filled buffers, and so do the gradients with a global-token branch (it stops at
    position g, so some key rows get no dK from it) or with fewer queries than keys (keys before them see none)."""
    made, phase = [], []
    real = {name: getattr(launch, name) for name in ("_buffer", "forward", "backward")}

    def buffer(rec, shape, device, filled, dtype=torch.float32, **kw):
        made.append((phase[-1], filled, dtype))
        return real["_buffer"](rec, shape, device, filled, dtype, **kw)

    def in_phase(name):
        def run(*a, **kw):
            phase.append(name)
            return real[name](*a, **kw)
        return run

    monkeypatch.setattr(launch, "_buffer", buffer)
    monkeypatch.setattr(launch, "forward", in_phase("forward"))
    monkeypatch.setattr(launch, "backward", in_phase("backward"))

    def filled(name):
        return {f for p, f, _ in made if p == name}

    q, k, v = make_qkv(rng, 1, 4, 2, 50, 50, 16, torch.bfloat16, "cpu")
    branches = [(8, 2), (16, 1), (32, 4)]  # r = 1 not first: it is moved to the end
    check(q, k, v, branches, TOL[torch.bfloat16], head_offset=1)
    assert filled("forward") == {False} and filled("backward") == {False}
    made.clear()
    check(q, k, v, [(64, 1)], TOL[torch.bfloat16])  # one launch: the output and gradients only, in bf16
    assert [d for p, _, d in made if p == "forward"] == [torch.float32, torch.bfloat16]  # lse, output
    assert {d for p, _, d in made if p == "backward"} == {torch.bfloat16}
    made.clear()
    mask = torch.ones(1, 50, dtype=torch.bool)
    mask[0, :7] = False
    check(q, k, v, branches, TOL[torch.bfloat16], attention_mask=mask, use_naive=False)
    assert filled("forward") == {True} and filled("backward") == {True}
    made.clear()
    check(q, k, v, branches, TOL[torch.bfloat16], global_tokens=3, use_naive=False)
    assert filled("forward") == {False} and filled("backward") == {True}
    made.clear()
    q, k, v = make_qkv(rng, 1, 4, 2, 70, 90, 16, torch.bfloat16, "cpu")  # keys before the queries see no query
    check(q, k, v, branches, TOL[torch.bfloat16], use_naive=False)
    assert filled("forward") == {False} and filled("backward") == {True}


@cpu
@pytest.mark.parametrize("causal", [True, False])
def test_forward_parts_in_one_launch(rng, monkeypatch, causal):
    """Every forward branch launch but the last runs as one launch over the parts, each part writing its rows once,
    compact; the last (r = 1) launch merges them in: two forward launches whatever the branches (GQA, head offset,
    a partial last segment), the float64 oracle's answer, and the per-branch merge's up to float32 rounding."""
    from hf_dilated.ops.triton import relaunch

    q, k, v = make_qkv(rng, 2, 4, 2, 70, 70, 16, torch.float32, "cpu")
    branches = [(8, 2), (16, 1), (32, 4), (64, 8)]
    ws, rs = [w for w, _ in branches], [r for _, r in branches]
    runs = []
    through = relaunch.run

    def record(kernel, grid, *args, **constexprs):
        runs.append((kernel.fn.__name__, constexprs.get("PARTS"), constexprs.get("LAST")))
        return through(kernel, grid, *args, **constexprs)

    monkeypatch.setattr(relaunch, "run", record)
    before = launch.LAUNCHES["forward_parts"]
    check(q, k, v, branches, TOL[torch.float32], is_causal=causal, head_offset=1)
    assert launch.LAUNCHES["forward_parts"] == before + 1
    assert [x for x in runs if x[0] == "dilated_fwd_branch_kernel"] == [
        ("dilated_fwd_branch_kernel", True, False), ("dilated_fwd_branch_kernel", True, True)]
    got = hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton", is_causal=causal, head_offset=1,
                                       return_lse=True)
    monkeypatch.setattr(launch, "COMPACT_PARTS", False)
    runs.clear()
    want = hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton", is_causal=causal, head_offset=1,
                                        return_lse=True)
    assert len([x for x in runs if x[0] == "dilated_fwd_branch_kernel"]) == len(branches)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-6


def test_gluon_forward_takes_parts_only_where_its_merge_is_unrolled():
    """The Gluon forward runs the parts where its last launch merges them unrolled (head dim 64, at most 4 parts:
    LongNet's 5 branches); more parts, or another head dim, take a launch per branch (``launch.forward`` asks
    ``parts_merge_config``), so no untested merge runs."""
    from hf_dilated.ops.triton import forward_hopper

    assert forward_hopper.parts_merge_config(64, 4) == dict(MAX_PARTS=4, maxnreg=128)
    assert forward_hopper.parts_merge_config(64, 2)["MAX_PARTS"] == 4
    assert forward_hopper.parts_merge_config(64, 5) is None
    assert forward_hopper.parts_merge_config(128, 4) is None


@triton.jit
def _round_kernel(X, Y, N: tl.constexpr, UPCAST: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, rounded(tl.load(X + i), Y.dtype.element_ty, UPCAST))


@cpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_final_stores_round_to_nearest_even(dtype):
    """The launches that write outputs and gradients in their dtype round as the GPU does (to nearest even), also
    under the interpreter, which truncates float32 to bfloat16 on its own (a doubled rounding error)."""
    from hf_dilated.ops.triton.configs import dot_mode

    x = torch.randn(4096, dtype=torch.float64).float()
    y = torch.empty(4096, dtype=dtype)
    _round_kernel[(1,)](x, y, N=4096, UPCAST=dot_mode(dtype))
    assert torch.equal(y, x.to(dtype))


def test_contiguity_under_cuda_graph_capture_reuses_the_eager_answer(monkeypatch):
    """Under ``torch.compile`` a layout arrives flagged not contiguous and the op reads whether it is; while a CUDA
    graph is captured no value may be read, so the op takes the answer read outside the capture for a layout of
    the same shape (the eager warm-up every graph capture runs first), and says what to do when there was none."""
    def layout(n, shift=0):  # new tensors on each call: nothing is memoized on their identity
        pos = torch.tensor([list(range(shift, shift + n))])
        zeros, ones = torch.zeros(1, n, dtype=torch.long), torch.ones(1, n, dtype=torch.bool)
        return TokenLayout(pos, zeros, pos.clone(), zeros.clone(), ones, ones.clone(), contiguous=False)

    op._CONTIGUOUS_SEEN.clear()
    assert op._really_contiguous(layout(40)) and not op._really_contiguous(layout(41, shift=3))
    monkeypatch.setattr(op, "_capturing", lambda device: True)
    monkeypatch.setattr(torch, "arange", lambda *a, **k: pytest.fail("read the layout during a capture"))
    assert op._really_contiguous(layout(40))
    assert not op._really_contiguous(layout(41))  # the answer read for this shape outside the capture
    with pytest.raises(ValueError, match="CUDA graph is captured"):
        op._really_contiguous(layout(42))
