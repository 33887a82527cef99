"""The PyTorch reference against the independent float64 oracle (tests/naive.py), per SPEC.md."""

import random

import pytest
import torch
import torch.nn.functional as F

import hf_dilated
from naive import naive_dilated_attention, rel_err

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}


def random_branches(pyrng: random.Random, n: int):
    """Random valid branches: increasing w, w % r == 0, one r == 1."""
    k = pyrng.randint(1, 3)
    ws, rs = [], []
    w = pyrng.choice([4, 6, 8, 12, 16])
    for i in range(k):
        r = 1 if i == 0 else pyrng.choice([d for d in (1, 2, 3, 4) if w % d == 0])
        ws.append(w)
        rs.append(r)
        w = w * pyrng.choice([1, 2, 3])
    return list(zip(ws, rs))


def make_qkv(rng, B, Hq, Hk, Nq, Nk, D, dtype):
    q = torch.randn(B, Hq, Nq, D, generator=rng, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hk, Nk, D, generator=rng, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hk, Nk, D, generator=rng, dtype=torch.float64).to(dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def check_against_naive(q, k, v, branches, tol, naive_kwargs=None, **op_kwargs):
    out = hf_dilated.dilated_attention(
        q, k, v, [w for w, _ in branches], [r for _, r in branches], backend="torch", **op_kwargs
    )
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = naive_dilated_attention(
        q64, k64, v64, branches, is_causal=op_kwargs.get("is_causal", True),
        head_offset=op_kwargs.get("head_offset", 0), **(naive_kwargs or {})
    )
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tol, f"output rel err {rel_err(out, ref)}"
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    want = torch.autograd.grad(ref, (q64, k64, v64), grad)
    for name, a, b in zip("qkv", got, want):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        assert rel_err(a, b) < tol, f"d{name} rel err {rel_err(a, b)}"
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_random_configs_match_oracle(rng, dtype):
    pyrng = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    for _ in range(6):
        branches = random_branches(pyrng, 64)
        Hk = pyrng.choice([1, 2, 3])
        Hq = Hk * pyrng.choice([1, 2, 3])
        N = pyrng.randint(5, 70)  # ragged: rarely a multiple of the segments
        D = pyrng.choice([4, 8, 16])
        causal = pyrng.random() < 0.7
        q, k, v = make_qkv(rng, 2, Hq, Hk, N, N, D, dtype)
        check_against_naive(q, k, v, branches, TOL[dtype], is_causal=causal)


def test_head_offset_uses_global_head_index(rng):
    branches = [(8, 1), (16, 4)]
    q, k, v = make_qkv(rng, 1, 4, 2, 40, 40, 8, torch.float64)
    check_against_naive(q, k, v, branches, 1e-10, head_offset=3)
    full_q, full_k, full_v = make_qkv(rng, 1, 8, 4, 40, 40, 8, torch.float64)
    whole = hf_dilated.dilated_attention(full_q, full_k, full_v, [8, 16], [1, 4], backend="torch")
    shard = hf_dilated.dilated_attention(
        full_q[:, 4:], full_k[:, 2:], full_v[:, 2:], [8, 16], [1, 4], backend="torch", head_offset=4
    )
    torch.testing.assert_close(shard, whole[:, 4:])


@pytest.mark.parametrize("causal", [True, False])
def test_single_dense_branch_equals_sdpa(rng, causal):
    q, k, v = make_qkv(rng, 2, 6, 2, 37, 37, 16, torch.float32)
    out = hf_dilated.dilated_attention(q, k, v, [64], [1], is_causal=causal, backend="torch")
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=causal)
    assert rel_err(out, ref) < 1e-6


def test_padded_batch_equals_per_sequence(rng):
    branches = [(8, 1), (16, 2), (32, 4)]
    B, N = 3, 45
    q, k, v = make_qkv(rng, B, 4, 2, N, N, 8, torch.float32)
    pads = [0, 7, 20]
    mask = torch.ones(B, N, dtype=torch.bool)
    for b, p in enumerate(pads):
        mask[b, :p] = False  # left padding
    mask[0, 40:] = False  # right padding on row 0
    out = hf_dilated.dilated_attention(q, k, v, [8, 16, 32], [1, 2, 4], attention_mask=mask, backend="torch")
    assert torch.isfinite(out).all()
    for b in range(B):
        real = mask[b].nonzero().flatten()
        lo, hi = int(real[0]), int(real[-1]) + 1
        alone = hf_dilated.dilated_attention(
            q[b : b + 1, :, lo:hi], k[b : b + 1, :, lo:hi], v[b : b + 1, :, lo:hi], [8, 16, 32], [1, 2, 4], backend="torch"
        )
        torch.testing.assert_close(out[b : b + 1, :, lo:hi], alone, rtol=1e-5, atol=1e-5)
        assert (out[b, :, ~mask[b]] == 0).all()
    # and against the oracle, with positions counted from the first real token
    kpos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    check_against_naive(q, k, v, branches, 1e-5, attention_mask=mask,
                        naive_kwargs=dict(k_pos=kpos, q_pos=kpos, k_valid=mask, q_valid=mask))


def test_packed_sequences_equal_per_sequence(rng):
    lengths = [13, 30, 5, 22]
    N = sum(lengths)
    q, k, v = make_qkv(rng, 1, 4, 4, N, N, 8, torch.float32)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0] + lengths).cumsum(0)
    by_pos = hf_dilated.dilated_attention(q, k, v, [8, 16], [1, 2], position_ids=pos, backend="torch")
    by_cu = hf_dilated.dilated_attention(q, k, v, [8, 16], [1, 2], cu_seqlens_q=cu, cu_seqlens_k=cu, backend="torch")
    torch.testing.assert_close(by_pos, by_cu)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        alone = hf_dilated.dilated_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], [8, 16], [1, 2], backend="torch")
        torch.testing.assert_close(by_pos[:, :, sl], alone, rtol=1e-5, atol=1e-5)
        start += n


def test_decode_matches_full_forward(rng):
    N = 50
    q, k, v = make_qkv(rng, 2, 6, 3, N, N, 8, torch.float32)
    full = hf_dilated.dilated_attention(q, k, v, [8, 16, 32], [1, 2, 4], backend="torch")
    for n_new in (1, 4):
        for t in (20, 37, N - n_new):
            step = hf_dilated.dilated_attention(
                q[:, :, t : t + n_new], k[:, :, : t + n_new], v[:, :, : t + n_new], [8, 16, 32], [1, 2, 4], backend="torch"
            )
            torch.testing.assert_close(step, full[:, :, t : t + n_new], rtol=1e-5, atol=1e-5)
    # queries placed by position_ids inside a longer (static) cache whose tail is unfilled
    t = 30
    mask = torch.zeros(2, 64, dtype=torch.bool)
    mask[:, : t + 1] = True
    kk = torch.cat([k[:, :, : t + 1], torch.randn(2, 3, 64 - t - 1, 8)], 2)
    vv = torch.cat([v[:, :, : t + 1], torch.randn(2, 3, 64 - t - 1, 8)], 2)
    step = hf_dilated.dilated_attention(
        q[:, :, t : t + 1], kk, vv, [8, 16, 32], [1, 2, 4], attention_mask=mask,
        position_ids=torch.full((2, 1), t), backend="torch",
    )
    torch.testing.assert_close(step, full[:, :, t : t + 1], rtol=1e-5, atol=1e-5)


def test_lse_is_the_merged_logsumexp(rng):
    q, k, v = make_qkv(rng, 1, 2, 2, 24, 24, 8, torch.float64)
    out, lse = hf_dilated.dilated_attention(q, k, v, [8, 16], [1, 2], backend="torch", return_lse=True)
    # one softmax over the multiset of keys: lse = log sum_j m_j exp(s_j)
    s = (q @ k.transpose(-1, -2)) * 8 ** -0.5
    pos = torch.arange(24)
    mult = torch.zeros(1, 2, 24, 24, dtype=torch.float64)
    for w, r in [(8, 1), (16, 2)]:
        for h in range(2):
            sel = pos % r == h % r
            same = (pos[:, None] // w == pos[None] // w) & (pos[None] <= pos[:, None])
            mult[0, h] += (sel[:, None] & sel[None] & same).double()
    want = torch.logsumexp(torch.where(mult > 0, s + mult.clamp_min(1e-300).log(), -torch.inf), -1)
    torch.testing.assert_close(lse, want)


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda q, k, v: (q[0], k, v), "query must be a 4-D"),
        (lambda q, k, v: (q.long(), k.long(), v.long()), "floating-point"),
        (lambda q, k, v: (q, k.half(), v), "share a dtype"),
        (lambda q, k, v: (q[:, :3], k, v), "multiple of key/value heads"),
        (lambda q, k, v: (q, k[..., :4], v), "head dims"),
        (lambda q, k, v: (q, k[:, :, :5], v[:, :, :5]), "must not exceed"),
        (lambda q, k, v: (q, k, v[:1]), "batch sizes"),
    ],
)
def test_invalid_tensors_raise(rng, mutate, fragment):
    q, k, v = [t.detach() for t in make_qkv(rng, 2, 4, 2, 8, 8, 8, torch.float32)]
    with pytest.raises(ValueError, match=fragment):
        hf_dilated.dilated_attention(*mutate(q, k, v), [8], [1], backend="torch")


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(backend="cuda"), "backend"),
        (dict(scale=-1.0), "scale"),
        (dict(head_offset=-1), "head_offset"),
        (dict(attention_mask=torch.ones(2, 5, dtype=torch.bool)), "attention_mask"),
        (dict(position_ids=torch.zeros(2, 3, dtype=torch.long)), "position_ids"),
        (dict(cu_seqlens_q=torch.tensor([0, 3, 8])), "batch size 1"),
    ],
)
def test_invalid_arguments_raise(rng, kwargs, fragment):
    q, k, v = [t.detach() for t in make_qkv(rng, 2, 4, 2, 8, 8, 8, torch.float32)]
    with pytest.raises(ValueError, match=fragment):
        hf_dilated.dilated_attention(q, k, v, [8], [1], **kwargs)
    with pytest.raises(ValueError, match="dilation_rates"):
        hf_dilated.dilated_attention(q, k, v, [8, 16], [2, 4])
