"""The PyTorch reference against the independent float64 oracle (tests/naive.py), per SPEC.md."""

import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hf_dilated
from hf_dilated.config import DENSE_SEGMENT
from hf_dilated.ops import fused_buckets
from hf_dilated.ops.dropout import keep_mask
from hf_dilated.ops.layout import TokenLayout, resolve_layout
from hf_dilated.ops.reference import dilated_attention_reference, last_path, tiled_attention_reference
from naive import naive_dilated_attention, rel_err

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: one intra-op thread avoids thread start-up and contention costing more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


# ---------------------------------------------------------------------------------------------------------------
# The backend function itself, on layouts built by hand (independent of how resolve_layout reads masks).


def make_layout(B, Nq, Nk, *, k_valid=None, k_pos=None, k_seq=None, q_pos=None, q_seq=None, q_valid=None):
    """A TokenLayout with the given fields; defaults: one sequence per row at positions 0..Nk-1, queries last."""
    k_pos = torch.arange(Nk).expand(B, Nk) if k_pos is None else k_pos
    k_seq = torch.zeros(B, Nk, dtype=torch.long) if k_seq is None else k_seq
    k_valid = torch.ones(B, Nk, dtype=torch.bool) if k_valid is None else k_valid
    q_pos = k_pos[:, Nk - Nq :] if q_pos is None else q_pos
    q_seq = k_seq[:, Nk - Nq :] if q_seq is None else q_seq
    q_valid = k_valid[:, Nk - Nq :] if q_valid is None else q_valid
    return TokenLayout(q_pos.long(), q_seq.long(), k_pos.long(), k_seq.long(), k_valid, q_valid, contiguous=False)


def on_device(layout, device):
    fields = (layout.q_pos, layout.q_seq, layout.k_pos, layout.k_seq, layout.k_valid, layout.q_valid)
    return TokenLayout(*(t.to(device) for t in fields), layout.contiguous)


def check_backend(fn, q, k, v, branches, layout, tol, *, is_causal=True, scale=None, head_offset=0, window=None,
                  global_tokens=0, dropout_p=0.0, seed=None):
    """``fn`` (a backend function) against the float64 oracle: output and lse on valid query rows, and the gradients
    of q, k, v through both the output and the lse. Returns ``(out, lse)``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kwargs = dict(window=window, global_tokens=global_tokens)
    if dropout_p:
        kwargs.update(dropout_p=dropout_p, seed=seed)
    out, lse = fn(q, k, v, branches, layout, is_causal, scale, head_offset, **kwargs)
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    keep = None
    if dropout_p:
        keep = lambda i, b, h, qc, kc: keep_mask(seed, dropout_p, i, b, h, qc, kc)  # noqa: E731  (local head index)
    ref, ref_lse = naive_dilated_attention(
        q64, k64, v64, branches, is_causal=is_causal, scale=scale, head_offset=head_offset, q_pos=layout.q_pos,
        k_pos=layout.k_pos, q_seq=layout.q_seq, k_seq=layout.k_seq, k_valid=layout.k_valid, q_valid=layout.q_valid,
        window=window, global_tokens=global_tokens, dropout_p=dropout_p, keep=keep, return_lse=True,
    )
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    rows = layout.q_valid[:, None, :, None].to(out.device)
    assert torch.isfinite(out).all(), "output not finite"
    assert rel_err(out * rows, ref * rows) < tol, f"output rel err {rel_err(out * rows, ref * rows)}"
    finite = torch.isfinite(ref_lse)
    padding = ~layout.q_valid[:, None].cpu()
    assert torch.equal(torch.isfinite(lse).cpu() | padding, finite.cpu() | padding), "rows reaching no key differ"
    if finite.any():  # a log: its error is the normalizer's relative error, so lse near 0 is measured against 1
        a, b = lse[finite].detach().double().cpu(), ref_lse[finite].detach().cpu()
        err = float((a - b).norm() / max(float(b.norm()), b.numel() ** 0.5))
        assert err < tol, f"lse rel err {err}"
    g = (torch.randn_like(ref) * rows).to(out.dtype).double()  # representable in out's dtype: no rounding of its own
    gl = (torch.randn_like(ref_lse) * finite).to(lse.dtype).double()
    loss = (out * g.to(out.dtype)).sum() + (torch.where(torch.isfinite(lse), lse, 0) * gl.to(lse.dtype)).sum()
    ref_loss = (ref * g).sum() + (torch.where(finite, ref_lse, 0) * gl).sum()
    got = torch.autograd.grad(loss, (q, k, v), allow_unused=True)
    want = torch.autograd.grad(ref_loss, (q64, k64, v64), retain_graph=True, allow_unused=True)
    want = [torch.zeros_like(t) if w is None else w for t, w in zip((q64, k64, v64), want)]
    # The backward's delta = rowsum(dO * O) reads the output as it was returned, rounded to its dtype (as
    # FlashAttention's does). Against the float64 output that moves delta by eps = rowsum(dO * (O - round(O))), and
    # the gradients by exactly the gradient of sum(eps * lse) (dS = P (dP - delta)). With few keys a row's dP - delta
    # cancels (two keys: P_2 (dP_1 - dP_2)), and that shift alone can pass 1e-2 of a small dQ or dK: it is allowed
    # on top of the tolerance.
    eps = torch.where(finite, (g * (ref - ref.to(out.dtype).double())).sum(-1), 0).detach()
    shift = [torch.zeros_like(t) if s is None else s for t, s in zip(
        (q64, k64, v64), torch.autograd.grad((eps * torch.where(finite, ref_lse, 0)).sum(), (q64, k64, v64),
                                             allow_unused=True))]
    # A gradient that is exactly 0 by symmetry (a query with one key, or one key reached by several branches) is 0
    # only up to the rounding of delta = rowsum(dO * O) against dO V^T (and of dS in half precision): a gradient
    # below 5% of the whole (q, k, v) gradient is measured against 5% of the whole.
    floor = 0.05 * float(sum(w.norm() ** 2 for w in want) ** 0.5)
    for name, a, b, d in zip("qkv", got, want, shift):
        a = torch.zeros_like(b) if a is None else a
        assert torch.isfinite(a).all(), f"d{name} not finite"
        err = (float((a.detach().double() - b).norm()) - float(d.norm())) / max(float(b.norm()), floor, 1e-300)
        assert err < tol, f"d{name} rel err {err} (beyond the shift of the output's rounding in delta)"
    return out, lse


def random_call(pyrng: random.Random, rng: torch.Generator):
    """A random configuration: branches (sometimes a dense or windowed layer), heads, GQA, causal, window, globals."""
    kind = pyrng.choice(["dilated", "dilated", "dense", "window"])
    if kind == "dense":
        branches = [(DENSE_SEGMENT, 1)]
    elif kind == "window":
        branches = [(DENSE_SEGMENT, 1)]
    else:
        branches = random_branches(pyrng, 64)
    window = pyrng.randint(1, 12) if kind == "window" or pyrng.random() < 0.15 else None
    global_tokens = pyrng.choice([0, 0, 1, 3]) if kind != "window" else 0
    Hk = pyrng.choice([1, 2])
    Hq = Hk * pyrng.choice([1, 2, 3])
    return dict(branches=branches, window=window, global_tokens=global_tokens, Hq=Hq, Hk=Hk,
                head_offset=pyrng.choice([0, 0, 1, 5]), is_causal=pyrng.random() < 0.7,
                D=pyrng.choice([3, 8, 16]), N=pyrng.randint(1, 48))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_backend_random_configs(rng, dtype):
    """Dilated, dense and sliding-window layers, global tokens, GQA, head offsets, ragged N: out, lse, all grads."""
    pyrng = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    for _ in range(8):
        c = random_call(pyrng, rng)
        B, N = 2, c["N"]
        q, k, v = make_qkv(rng, B, c["Hq"], c["Hk"], N, N, c["D"], dtype)
        for fn in (dilated_attention_reference, tiled_attention_reference):  # plain causal cases: fused and tiled
            check_backend(fn, q, k, v, c["branches"], make_layout(B, N, N), TOL[dtype], is_causal=c["is_causal"],
                          head_offset=c["head_offset"], window=c["window"], global_tokens=c["global_tokens"])


def test_backend_masks_packing_and_decoding(rng):
    """Middle holes (hide that key only), whole rows masked, packed sequences, decoding against a part-filled cache."""
    branches = [(4, 1), (8, 2), (16, 4)]
    B, N = 3, 30
    q, k, v = make_qkv(rng, B, 4, 2, N, N, 8, torch.float64)
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[0, [3, 5, 17]] = False  # holes in the middle: each hides one key, positions keep counting columns
    valid[1, :7] = False  # left padding
    valid[2] = False  # a whole row masked
    pos = torch.arange(N).expand(B, N) - torch.tensor([0, 7, 0])[:, None]
    layout = make_layout(B, N, N, k_valid=valid, k_pos=pos.clamp_min(0))
    for causal in (True, False):
        out, lse = check_backend(dilated_attention_reference, q, k, v, branches, layout, 1e-10, is_causal=causal,
                                 global_tokens=2, window=9)
        assert (out[2] == 0).all() and torch.isinf(lse[2]).all()
    # packed: positions restart, one row
    lengths = [7, 1, 12, 10]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    q, k, v = make_qkv(rng, 1, 6, 3, N, N, 8, torch.float64)
    check_backend(dilated_attention_reference, q, k, v, branches, make_layout(1, N, N, k_pos=pos, k_seq=seq),
                  1e-10, global_tokens=3, head_offset=2)
    # decoding: 3 new queries against a 40-slot cache whose last 5 slots are unfilled
    q, k, v = make_qkv(rng, 2, 4, 4, 3, 40, 8, torch.float64)
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[:, 35:] = False
    layout = make_layout(2, 3, 40, k_valid=valid, q_pos=torch.tensor([[32, 33, 34]] * 2),
                         q_valid=torch.ones(2, 3, dtype=torch.bool), q_seq=torch.zeros(2, 3))
    check_backend(dilated_attention_reference, q, k, v, branches, layout, 1e-10)
    check_backend(dilated_attention_reference, q, k, v, [(DENSE_SEGMENT, 1)], layout, 1e-10, window=6)


@pytest.mark.parametrize("magnitude", [1e2, 1e3])
def test_large_logits_float32(rng, magnitude):
    """Issue 10 item 2: the merge weights sum to one at large logits (max-shifted merge, as the kernels do). The
    tiled path (float64 dP and delta); the fused one holds 1e-5 to |logit| ~ 1e2 (test_large_logits_float32_fused)."""
    branches = [(8, 1), (16, 2), (32, 4)]
    q, k, v = make_qkv(rng, 2, 4, 2, 48, 48, 16, torch.float64)
    q = (q.detach() * magnitude / 4).float().requires_grad_()  # |logit| ~ magnitude
    k, v = k.detach().float().requires_grad_(), v.detach().float().requires_grad_()
    check_backend(tiled_attention_reference, q, k, v, branches, make_layout(2, 48, 48), 1e-5, global_tokens=2)


@pytest.mark.parametrize("magnitude", [1e1, 1e2])
def test_large_logits_float32_fused(rng, magnitude):
    """The fused path at large logits: the lse merge weights sum to one (logaddexp), within float32's tolerance.
    (From |logit| ~ 1e3 the kernels' float32 dS = P (dP - delta) cancels to ~3e-5 of dk, where the tiled path forms
    dP and delta in float64: saturated logits are the tiled path's, see test_saturated_logits_1e4_float32.)"""
    q, k, v = make_qkv(rng, 2, 4, 2, 48, 48, 16, torch.float64)
    q = (q.detach() * magnitude / 4).float().requires_grad_()
    k, v = k.detach().float().requires_grad_(), v.detach().float().requires_grad_()
    check_backend(dilated_attention_reference, q, k, v, ((8, 1), (16, 2), (32, 4)), plain_layout(2, 48), 1e-5)
    assert last_path()[0] == "fused_buckets"


def test_saturated_logits_1e4_float32(rng):
    """The tiled path at |logit| ~ 1e4, each query's own key dominating (issue 10 item 2: dq was 3.7e-2 off where ~0):
    outputs and dv to 1e-5, dq and dk within fp32 rounding of their natural scale (scale |q| |dO| |v|)."""
    branches = [(8, 1), (16, 2), (32, 4)]
    _, k, v = make_qkv(rng, 2, 2, 2, 48, 48, 16, torch.float64)
    q = (k.detach() * 1e4 / 16).float().requires_grad_()
    k, v = k.detach().float().requires_grad_(), v.detach().float().requires_grad_()
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = naive_dilated_attention(q64, k64, v64, branches, global_tokens=2)
    out, _ = tiled_attention_reference(q, k, v, branches, make_layout(2, 48, 48), True, 0.25, global_tokens=2)
    assert rel_err(out, ref) < 1e-5
    g = torch.randn_like(ref)
    got = torch.autograd.grad((out * g.float()).sum(), (q, k, v))
    want = torch.autograd.grad((ref * g).sum(), (q64, k64, v64))
    assert rel_err(got[2], want[2]) < 1e-5
    unit = 0.25 * float(g.abs().max() * v.detach().abs().max())
    assert float((got[0] - want[0]).abs().max()) < 1e-5 * unit * float(k.detach().abs().max())
    assert float((got[1] - want[1]).abs().max()) < 1e-5 * unit * float(q.detach().abs().max())


def test_dense_layer_equals_sdpa_with_gqa_and_window(rng):
    """A dense layer (one branch (DENSE_SEGMENT, 1)) is SDPA, with and without a sliding window (GQA, no repeat)."""
    q, k, v = make_qkv(rng, 2, 8, 2, 70, 70, 16, torch.float32)
    layout = make_layout(2, 70, 70)
    for causal in (True, False):
        out, _ = dilated_attention_reference(q, k, v, ((DENSE_SEGMENT, 1),), layout, causal, 0.25)
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                             is_causal=causal, scale=0.25)
        assert rel_err(out, ref) < 1e-6
        out, _ = dilated_attention_reference(q, k, v, ((DENSE_SEGMENT, 1),), layout, causal, 0.25, window=10)
        dist = torch.arange(70)[:, None] - torch.arange(70)[None]
        band = (dist >= 0) & (dist < 10) if causal else dist.abs() < 10
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                             attn_mask=band, scale=0.25)
        assert rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dropout_is_exact_for_a_fixed_seed(rng, dtype):
    """The dropped forward and its gradients equal the oracle dropping the same draw (keep_mask by tensor column)."""
    pyrng = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    for _ in range(3):
        c = random_call(pyrng, rng)
        B, N = 2, max(c["N"], 8)
        q, k, v = make_qkv(rng, B, c["Hq"], c["Hk"], N, N, c["D"], dtype)
        valid = torch.rand(B, N, generator=rng) > 0.2
        layout = make_layout(B, N, N, k_valid=valid)
        seed = torch.randint(0, 2**62, (), generator=rng)
        check_backend(dilated_attention_reference, q, k, v, c["branches"], layout, TOL[dtype], is_causal=c["is_causal"],
                      window=c["window"], global_tokens=c["global_tokens"], dropout_p=pyrng.choice([0.1, 0.5]),
                      seed=seed)


def test_dropout_mean_over_seeds_is_the_undropped_output(rng):
    """Statistically: the mean of dropped outputs over S seeds approaches the undropped output like 1 / sqrt(S)."""
    q, k, v = [t.detach() for t in make_qkv(rng, 1, 2, 1, 24, 24, 8, torch.float64)]
    branches, layout = ((8, 1), (16, 2)), make_layout(1, 24, 24)
    exact, lse = dilated_attention_reference(q, k, v, branches, layout, True, 0.3, global_tokens=2)
    S = 200
    draws = torch.stack([
        dilated_attention_reference(q, k, v, branches, layout, True, 0.3, global_tokens=2, dropout_p=0.3,
                                    seed=torch.tensor(s))[0]
        for s in torch.randint(0, 2**62, (S,), generator=rng).tolist()
    ])
    one = torch.linalg.vector_norm(draws - exact, dim=(1, 2, 3, 4)).mean() / exact.norm()  # error of one draw
    mean = (draws.mean(0) - exact).norm() / exact.norm()
    assert one > 0.05  # dropout does drop
    assert mean < 3 * one / math.sqrt(S)


def test_dropout_zero_drops_nothing_and_needs_a_seed_otherwise(rng):
    q, k, v = [t.detach() for t in make_qkv(rng, 2, 4, 2, 20, 20, 8, torch.float32)]
    layout = make_layout(2, 20, 20)
    plain = dilated_attention_reference(q, k, v, ((8, 1), (16, 2)), layout, True, 0.3)
    zero = dilated_attention_reference(q, k, v, ((8, 1), (16, 2)), layout, True, 0.3, dropout_p=0.0,
                                       seed=torch.tensor(5))
    assert torch.equal(plain[0], zero[0]) and torch.equal(plain[1], zero[1])
    with pytest.raises(ValueError, match="seed"):
        dilated_attention_reference(q, k, v, ((8, 1),), layout, True, 0.3, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout"):
        dilated_attention_reference(q, k, v, ((8, 1),), layout, True, 0.3, dropout_p=1.0, seed=torch.tensor(1))
    with pytest.raises(ValueError, match="window"):
        dilated_attention_reference(q, k, v, ((8, 1),), layout, True, 0.3, window=0)
    with pytest.raises(ValueError, match="global_tokens"):
        dilated_attention_reference(q, k, v, ((8, 1),), layout, True, 0.3, global_tokens=-1)


class LargestAllocation(TorchDispatchMode):
    """Records the largest numel of any tensor an op returns (every intermediate, forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize(
    "branches, window, causal",
    [(((DENSE_SEGMENT, 1),), None, True), (((DENSE_SEGMENT, 1),), None, False), (((DENSE_SEGMENT, 1),), 64, True),
     (((256, 1), (512, 2), (1024, 4), (2048, 8)), None, True)],
)
def test_no_intermediate_is_quadratic(rng, branches, window, causal):
    """Nothing N x N (nor w x w for all segments at once): every intermediate, forward and backward, stays below
    N^2 / 16 at N = 4096 (the largest is a bounded batch of score tiles or the O(N D) tensors)."""
    N = 4096
    q, k, v = make_qkv(rng, 1, 2, 1, N, N, 16, torch.float32)
    with LargestAllocation() as watch:
        out, lse = dilated_attention_reference(q, k, v, branches, make_layout(1, N, N), causal, 0.25, window=window,
                                               global_tokens=4)
        (out.sum() + lse.sum()).backward()
    assert 0 < watch.largest < N * N // 16, watch.largest


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_matches_oracle(rng, dtype):
    """On CUDA: half inputs run float32-accumulating tensor-core products (bmm out_dtype), within SPEC's tolerance."""
    _cuda()
    from hf_dilated.ops import reference

    B, N = 2, 700
    q, k, v = (t.detach().cuda().requires_grad_() for t in make_qkv(rng, B, 8, 2, N, N, 128, dtype))
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[1, :123] = False
    valid[0, [5, 99, 500]] = False
    pos = (valid.long().cumsum(-1) - 1).clamp_min(0)
    layout = on_device(make_layout(B, N, N, k_valid=valid, k_pos=pos), "cuda")
    for branches, kwargs in ((((64, 1), (128, 2), (512, 8)), dict(global_tokens=4, head_offset=3)),
                             (((64, 1), (256, 4)), dict(global_tokens=2, dropout_p=0.3, seed=torch.tensor(7))),
                             (((DENSE_SEGMENT, 1),), dict(window=100))):
        check_backend(dilated_attention_reference, q, k, v, branches, layout, TOL[dtype], **kwargs)
    if dtype != torch.float32:
        assert reference._BMM_OUT_DTYPE[0], "bmm(out_dtype=float32) unavailable: half tiles were upcast instead"


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["dense", "longnet"])
def test_gpu_peak_memory_is_linear(rng, layer):
    """Peak CUDA memory of forward + backward: a few times the q/k/v/o bytes, and doubling N at most doubles it."""
    _cuda()
    branches = ((DENSE_SEGMENT, 1),) if layer == "dense" else ((2048, 1), (4096, 2), (8192, 4), (16384, 8))
    peaks = []
    for N in (8192, 16384):
        q, k, v = (torch.randn(1, 8, N, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out, lse = dilated_attention_reference(q, k, v, branches, on_device(make_layout(1, N, N), "cuda"), True,
                                               128 ** -0.5)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        qkvo = 4 * q.numel() * q.element_size()
        assert peak < 12 * qkvo, (N, peak / qkvo)
        peaks.append(peak)
        del q, k, v, out, lse
    assert peaks[1] < 2.3 * peaks[0], peaks


def test_plan_is_built_once_per_layout(rng):
    """Layers sharing a layout reuse its plan (no repeated sorts and host syncs); any other argument rebuilds it."""
    from hf_dilated.ops import reference

    q, k, v = [t.detach() for t in make_qkv(rng, 1, 4, 2, 40, 40, 8, torch.float64)]
    layout = make_layout(1, 40, 40)
    first = reference._plan(layout, ((8, 1), (16, 2)), 4, 2, True, 0, None, 0)
    assert reference._plan(layout, ((8, 1), (16, 2)), 4, 2, True, 0, None, 0) is first
    assert reference._plan(layout, ((8, 1), (16, 2)), 4, 2, True, 0, 5, 0) is not first
    assert reference._plan(make_layout(1, 40, 40), ((8, 1), (16, 2)), 4, 2, True, 0, None, 0) is not first
    out1, _ = dilated_attention_reference(q, k, v, ((8, 1), (16, 2)), layout, True, 0.3)
    out2, _ = dilated_attention_reference(q, k, v, ((8, 1), (16, 2)), layout, True, 0.3)
    assert torch.equal(out1, out2)


# ---------------------------------------------------------------------------------------------------------------
# The fused-bucket path (ops/fused_buckets.py): plain layouts on PyTorch's fused attention kernels.


def plain_layout(B, N, device="cpu"):
    """One unpadded sequence per row, as resolve_layout gives without mask or positions (contiguous)."""
    layout = resolve_layout(B, N, N, torch.device(device))
    assert layout.contiguous
    return layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_buckets_match_oracle(rng, dtype):
    """Random branches (ragged last segments, offsets selecting fewer rows there), dense layers, GQA, head offsets,
    causal or not: output, lse and the gradients through both, against the float64 oracle; the fused path ran."""
    pyrng = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    for i in range(6):
        branches = [(DENSE_SEGMENT, 1)] if i == 0 else random_branches(pyrng, 64)
        Hk = pyrng.choice([1, 2])
        Hq = Hk * pyrng.choice([1, 2, 3])
        N = pyrng.randint(1, 70)
        causal = i % 2 == 0 or pyrng.random() < 0.5
        q, k, v = make_qkv(rng, 2, Hq, Hk, N, N, pyrng.choice([8, 16]), dtype)
        check_backend(dilated_attention_reference, q, k, v, branches, plain_layout(2, N), TOL[dtype],
                      is_causal=causal, head_offset=pyrng.choice([0, 1, 5]))
        assert last_path() == ("fused_buckets", ""), last_path()


@pytest.mark.parametrize("through", ["out", "lse"])
def test_fused_buckets_gradient_through_one_output(rng, through):
    """The gradient of the output alone (no lse gradient: no padded column) and of the lse alone (dO = 0)."""
    branches = ((8, 1), (16, 2), (32, 4))
    N = 45  # ragged: the last segment of (32, 4) holds 13 columns, 4 or 3 selected per offset
    q, k, v = make_qkv(rng, 2, 4, 2, N, N, 8, torch.float32)
    out, lse = dilated_attention_reference(q, k, v, branches, plain_layout(2, N), True, 0.3, 1)
    assert last_path()[0] == "fused_buckets"
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = naive_dilated_attention(q64, k64, v64, branches, scale=0.3, head_offset=1, return_lse=True)
    got_y, want_y = (out, ref) if through == "out" else (lse, ref_lse)
    g = torch.randn_like(want_y)
    got = torch.autograd.grad(got_y, (q, k, v), g.to(got_y.dtype))
    want = torch.autograd.grad(want_y, (q64, k64, v64), g, allow_unused=True)
    for name, a, b in zip("qkv", got, want):
        if b is None:  # the lse does not depend on v
            assert torch.equal(a, torch.zeros_like(a)), name
        else:
            assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))


def test_fused_buckets_through_the_public_op(rng):
    """hf_dilated.dilated_attention(backend="torch") on an unpadded batch (an all-ones mask too) takes the fused path
    and equals the tiled path."""
    q, k, v = [t.detach() for t in make_qkv(rng, 2, 4, 4, 50, 50, 16, torch.float32)]
    tiled, tiled_lse = tiled_attention_reference(q, k, v, ((16, 1), (32, 2)), make_layout(2, 50, 50), True, 0.25)
    for mask in (None, torch.ones(2, 50, dtype=torch.bool)):
        out, lse = hf_dilated.dilated_attention(q, k, v, [16, 32], [1, 2], attention_mask=mask, backend="torch",
                                                return_lse=True)
        assert last_path() == ("fused_buckets", "")
        assert rel_err(out, tiled) < 1e-6 and rel_err(lse, tiled_lse) < 1e-6


@pytest.mark.parametrize(
    "case, reason",
    [("float64", "dtype"), ("window", "sliding window"), ("dropout", "dropout"),
     ("padding", "layout"), ("holes", "layout"), ("right_padding_not_causal", "layout"), ("packed", "layout"),
     ("decoding", "decoding")],
)
def test_what_the_fused_path_leaves_to_the_tiled_one(rng, case, reason):
    """Every case the fused kernels cannot do exactly runs tiled, says why, and still matches the oracle."""
    B, N = 2, 24
    dtype = torch.float64 if case == "float64" else torch.float32
    Nq = 3 if case == "decoding" else N
    q, k, v = make_qkv(rng, B, 4, 2, Nq, N, 8, dtype)
    kwargs, layout = {}, resolve_layout(B, Nq, N, torch.device("cpu"))
    if case == "window":
        kwargs["window"] = 5
    elif case == "global":
        kwargs["global_tokens"] = 2
    elif case == "dropout":
        kwargs.update(dropout_p=0.2, seed=torch.tensor(3))
    elif case in ("padding", "holes", "right_padding_not_causal"):
        mask = torch.ones(B, N, dtype=torch.bool)
        mask[1, {"padding": slice(0, 5), "holes": slice(7, 9), "right_padding_not_causal": slice(19, None)}[case]] = 0
        if case == "padding":
            mask[0, -3:] = False  # left and right padding in one batch
        layout = resolve_layout(B, N, N, torch.device("cpu"), attention_mask=mask)
        kwargs["is_causal"] = case != "right_padding_not_causal"
    elif case == "packed":
        pos = torch.cat([torch.arange(10), torch.arange(14)])[None].expand(B, N)
        layout = resolve_layout(B, N, N, torch.device("cpu"), position_ids=pos)
    check_backend(dilated_attention_reference, q, k, v, ((8, 1), (16, 2)), layout, TOL[dtype], **kwargs)
    path, why = last_path()
    assert path == "tiled" and reason in why, (path, why)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_buckets_with_global_tokens(rng, dtype):
    """Global tokens: the fused branches merged by lse with the tiled global branch (unpadded, and right-padded
    causal), exact against the oracle, gradients through out and lse."""
    B, N = 2, 37
    q, k, v = make_qkv(rng, B, 4, 2, N, N, 8, dtype)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 25:] = False
    for causal, m in ((True, None), (False, None), (True, mask), (True, mask.flip(1))):
        layout = resolve_layout(B, N, N, torch.device("cpu"), attention_mask=m)
        check_backend(dilated_attention_reference, q, k, v, ((8, 1), (16, 2)), layout, TOL[dtype],
                      is_causal=causal, global_tokens=3, head_offset=1)
        assert last_path() == ("fused_buckets", ""), last_path()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("side", ["right", "left"])
def test_fused_buckets_padding_causal(rng, dtype, side):
    """A causal right-padded batch (Transformers' default for training) or left-padded one (generation) is exact on
    the fused path: real tokens' outputs, lse and every gradient match the oracle (positions counted from each row's
    first real token); padding rows give 0 and lse -inf, and send no gradient."""
    B, N = 3, 41
    q, k, v = make_qkv(rng, B, 6, 2, N, N, 8, dtype)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 30:] = False
    mask[2, 3:] = False
    if side == "left":
        mask = mask.flip(1)
    layout = resolve_layout(B, N, N, torch.device("cpu"), attention_mask=mask)
    assert not layout.contiguous
    for branches in (((8, 1), (16, 2), (32, 4)), ((DENSE_SEGMENT, 1),)):
        out, lse = check_backend(dilated_attention_reference, q, k, v, branches, layout, TOL[dtype], head_offset=1)
        assert last_path() == ("fused_buckets", ""), last_path()
        assert (out[~mask[:, None, :].expand(-1, 6, -1)] == 0).all()
        assert torch.isneginf(lse[~mask[:, None, :].expand(-1, 6, -1)]).all()


def test_fused_kernel_missing_falls_back_with_the_reason(rng, monkeypatch):
    """A private aten op that is missing or changed fails its probe: the call runs tiled and names the op."""

    def broken(*args, **kwargs):
        raise RuntimeError("aten op changed its signature")

    fake = fused_buckets.Kernel("broken_attention", broken, broken)
    monkeypatch.setattr(fused_buckets, "_candidates", lambda device, dtype, head_dim: [fake])
    q, k, v = make_qkv(rng, 1, 2, 2, 20, 20, 8, torch.float32)
    check_backend(dilated_attention_reference, q, k, v, ((8, 1), (16, 2)), plain_layout(1, 20), 1e-5)
    path, why = last_path()
    assert path == "tiled" and "broken_attention" in why and "signature" in why, why


@pytest.mark.parametrize("branches", [((DENSE_SEGMENT, 1),), ((256, 1), (512, 2), (1024, 4), (2048, 8))])
def test_fused_buckets_no_intermediate_is_quadratic(rng, branches):
    """The fused path, forward and backward, allocates nothing N x N (the buckets are gathered rows, O(N D))."""
    N = 4096
    q, k, v = make_qkv(rng, 1, 2, 1, N, N, 16, torch.float32)
    with LargestAllocation() as watch:
        out, lse = dilated_attention_reference(q, k, v, branches, plain_layout(1, N), True, 0.25)
        (out.sum() + lse.sum()).backward()
    assert last_path()[0] == "fused_buckets"
    assert 0 < watch.largest < N * N // 16, watch.largest


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_fused_buckets_match_oracle(rng, dtype):
    """On CUDA the fused path (flash or memory-efficient kernels) runs and matches the oracle, lse gradient too."""
    _cuda()
    for branches, N, D, causal in ((((64, 1), (128, 2), (512, 8)), 700, 128, True),
                                   (((DENSE_SEGMENT, 1),), 333, 64, False),
                                   (((100, 1), (300, 3)), 650, 256, True)):
        q, k, v = (t.detach().cuda().requires_grad_() for t in make_qkv(rng, 2, 8, 2, N, N, D, dtype))
        check_backend(dilated_attention_reference, q, k, v, branches, plain_layout(2, N, "cuda"), TOL[dtype],
                      is_causal=causal, head_offset=3)
        if D == 256 and dtype != torch.float32:  # the lse-gradient columns make it 264: no trusted half kernel there
            path, why = last_path()
            assert path == "tiled" and "backward through the lse" in why, (path, why)
        else:
            assert last_path() == ("fused_buckets", ""), last_path()


def test_fused_buckets_under_no_grad_and_inference_mode(rng):
    """The kernels' first probe may happen under no_grad / inference_mode (generation): it still decides right."""
    fused_buckets._probe.cache_clear()
    q, k, v = [t.detach() for t in make_qkv(rng, 1, 2, 2, 20, 20, 8, torch.float32)]
    tiled, _ = tiled_attention_reference(q, k, v, ((8, 1), (16, 2)), make_layout(1, 20, 20), True, 0.3)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            out, _ = dilated_attention_reference(q, k, v, ((8, 1), (16, 2)), plain_layout(1, 20), True, 0.3)
        assert last_path() == ("fused_buckets", "") and rel_err(out, tiled) < 1e-6
        fused_buckets._probe.cache_clear()


def test_probe_rejects_a_backward_that_ignores_the_given_lse():
    """The ring-trick backward needs a kernel that uses the merged lse and output it is given: one that keeps its
    own (as SDPA's autograd would) fails the probe."""

    def bwd(do, q, k, v, out, lse, causal, scale):  # recomputes its own output and lse
        own_out, own_lse = fused_buckets._FLASH_CPU.fwd(q, k, v, causal, scale)
        return fused_buckets._FLASH_CPU.bwd(do, q, k, v, own_out, own_lse, causal, scale)

    own = fused_buckets.Kernel("own_lse_attention", fused_buckets._FLASH_CPU.fwd, bwd)
    why = fused_buckets._probe(own, "cpu", torch.float32, 16)
    assert why is not None and "differs" in why, why
    assert fused_buckets._probe(fused_buckets._FLASH_CPU, "cpu", torch.float32, 16) is None


def test_fused_buckets_under_torch_func_vjp(rng):
    """The Triton op's fallback takes the reference's gradient with torch.func.vjp (functorch): the fused path's
    autograd.Function supports it, and gives the gradients of plain autograd."""
    q, k, v = [t.detach() for t in make_qkv(rng, 2, 4, 2, 30, 30, 8, torch.float32)]
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, :4] = False  # left padding: the rotation is inside the transform too
    layout = resolve_layout(2, 30, 30, torch.device("cpu"), attention_mask=mask)
    fn = lambda a, b, c: dilated_attention_reference(a, b, c, ((8, 1), (16, 2)), layout, True, 0.3)  # noqa: E731
    (out, lse), vjp = torch.func.vjp(fn, q, k, v)
    assert last_path() == ("fused_buckets", "")
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse).masked_fill(~mask[:, None], 0)
    got = vjp((g_out, g_lse))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, l = fn(*leaves)
    want = torch.autograd.grad((o * g_out).sum() + (torch.where(torch.isfinite(l), l, 0) * g_lse).sum(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
