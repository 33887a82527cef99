"""The Triton kernels against the float64 oracle (tests/naive.py) and the PyTorch reference, forward and every gradient.

CPU (CI): the kernels run under ``TRITON_INTERPRET=1`` (set by conftest.py before triton is imported) at tiny sizes,
with small blocks so that every loop runs several blocks. ``-m gpu``: the same checks at real sizes on a CUDA device
(``python -m pytest -m gpu tests/test_triton_kernels.py`` on the H100). Fresh random inputs each run (conftest seed).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")

import hf_dilated  # noqa: E402
from hf_dilated.ops import resolve_layout  # noqa: E402
from hf_dilated.ops.triton import is_available  # noqa: E402
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


def check(q, k, v, branches, tol, naive_kwargs=None, use_naive=True, grad_mask=None, **op_kwargs):
    """Output and dq, dk, dv of the Triton backend against the float64 oracle and the float64 reference."""
    ws, rs = [w for w, _ in branches], [r for _, r in branches]
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
    grad = torch.randn(ref.shape, dtype=torch.float64, device=ref.device)
    got = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    for name, a in zip("qkv", got):
        assert torch.isfinite(a).all(), f"d{name} has NaN / inf"
    for oracle, o in want.items():
        err = rel_err(out, o)
        assert err < tol, f"output vs {oracle}: rel err {err}"
        gw = torch.autograd.grad(o, (q64, k64, v64), grad)
        for name, a, b in zip("qkv", got, gw):
            err = rel_err(a, b)
            assert err < tol, f"d{name} vs {oracle}: rel err {err}"
    return out


# ---------------------------------------------------------------------------------------------------------------
# CPU, interpreter, tiny sizes


@cpu
def test_available_under_interpreter():
    assert is_available(torch.device("cpu"))


@cpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("gqa", [False, True])
def test_random_configs_contiguous(rng, causal, gqa):
    pyrng = pyrng_of(rng)
    for _ in range(2):
        branches = random_branches(pyrng)
        Hk = pyrng.choice([1, 2])
        Hq = Hk * (pyrng.choice([2, 3, 4]) if gqa else 1)
        N = pyrng.randint(20, 80)  # ragged: rarely a multiple of the segments
        D = pyrng.choice([16, 32])
        q, k, v = make_qkv(rng, 2, Hq, Hk, N, N, D, torch.float32, "cpu")
        check(q, k, v, branches, TOL[torch.float32], is_causal=causal, head_offset=pyrng.randint(0, 5))


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
    check(q, k, v, branches, TOL[torch.float32], is_causal=True, head_offset=3)


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
    dec = check(q[:, :, -nq:], k, v, branches, TOL[torch.float32], attention_mask=mask,
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


@cpu
def test_layout_runs():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    runs = resolve_layout(2, 4, 4, torch.device("cpu"), attention_mask=mask).runs()
    assert runs.tolist() == [[0, 1, 0, 3, 1, 0, 3], [1, 0, 0, 2, 0, 0, 2]]
    packed = resolve_layout(1, 5, 5, torch.device("cpu"), position_ids=torch.tensor([[0, 1, 2, 0, 1]])).runs()
    assert packed.tolist() == [[0, 0, 0, 3, 0, 0, 3], [0, 3, 0, 2, 3, 0, 2]]
    # A cache with a hole in the middle of the sequence is not one run: no runs, the op falls back.
    hole = torch.tensor([[1, 1, 0, 1, 1]], dtype=torch.bool)
    assert resolve_layout(1, 1, 5, torch.device("cpu"), attention_mask=hole).runs() is None


@cpu
def test_fallback_layout_matches_reference(rng):
    """A sequence split by a hole in the cache (no in-place runs): the op runs the reference, still exact."""
    mask = torch.ones(1, 30, dtype=torch.bool)
    mask[0, 10:14] = False
    q, k, v = make_qkv(rng, 1, 2, 2, 2, 30, 16, torch.float32, "cpu")
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    check(q, k, v, [(8, 1), (16, 2)], TOL[torch.float32], attention_mask=mask,
          naive_kwargs=dict(q_pos=pos[:, -2:], k_pos=pos, k_valid=mask))


@cpu
def test_compile_fullgraph_no_graph_break(rng):
    """The custom op traces as one node: torch.compile(fullgraph=True) forward and backward, same numbers."""
    from hf_dilated.ops.triton.op import dilated_attention_op

    q, k, v = make_qkv(rng, 1, 2, 1, 24, 24, 16, torch.float32, "cpu")
    layout = resolve_layout(1, 24, 24, torch.device("cpu"))

    def f(q, k, v):
        return dilated_attention_op(q, k, v, ((8, 1), (16, 2)), layout, True, 0.25)[0]

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
    from hf_dilated.ops.triton.op import dilated_attention_fwd  # noqa: F401

    q, k, v = make_qkv(rng, 1, 2, 1, 20, 20, 16, torch.float32, "cpu")
    lay = resolve_layout(1, 20, 20, torch.device("cpu"))
    args = (q, k, v, lay.q_pos, lay.q_seq, lay.q_valid, lay.k_pos, lay.k_seq, lay.k_valid, [8, 16], [1, 2],
            True, True, 0.25, 0)
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
    check(q, k, v, LONGNET_SMALL + [(4096, 16)], TOL[torch.bfloat16], use_naive=False)
