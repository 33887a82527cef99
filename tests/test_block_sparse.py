"""Block-sparse attention against a float64 dense masked softmax written here (the block mask expanded to elements,
SPEC.md's token rules), outputs, log-sum-exp and every gradient; the patterns against their definitions, brute force.

CPU: the Triton kernels run under ``TRITON_INTERPRET=1`` (conftest) at tiny sizes with 16-token blocks, and each
kernel test asserts that the kernels ran. ``-m gpu``: realistic sizes on CUDA. Fresh random inputs (``rng``).
"""

from __future__ import annotations

import math
import os
from unittest import mock

import pytest
import torch

from hf_dilated.ops.block_sparse import (
    BlockSparseConfig,
    adaptive_blocks,
    block_sparse_attention,
    dense_blocks,
    dilated_blocks,
    from_mask,
    global_blocks,
    hierarchical_blocks,
    local_blocks,
    random_blocks,
    union,
)
from hf_dilated.ops import eager_autograd, resolve_layout
from hf_dilated.ops.triton import block_sparse_hopper, hopper

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
kernel = pytest.mark.skipif(not INTERPRET,
                            reason="CPU kernel tests run under TRITON_INTERPRET=1 (set by conftest without CUDA)")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


# ---- the independent statement ---------------------------------------------------------------------------------------


def naive(q, k, v, block_mask, b, *, causal=True, attention_mask=None, position_ids=None, scale=None):
    """Float64 dense softmax over the keys allowed by the block mask ``[L, Hl, n, n]`` expanded to tokens, causal by
    position, no padding key, same sequence (a sequence starts where positions do not step by one). Returns
    ``(out, lse)``; rows with no key give 0 and -inf."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    q, k, v = q.double(), k.double(), v.double()
    scale = D**-0.5 if scale is None else scale
    valid = torch.ones(B, Nk, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if position_ids is None:
        kpos = (valid.long().cumsum(-1) - 1).clamp_min(0)
    else:
        kpos = position_ids.long().expand(B, Nk)
    kseq = torch.zeros(B, Nk, dtype=torch.long)
    for bb in range(B):
        s, prev = 0, None
        for c in range(Nk):
            if not valid[bb, c]:
                kseq[bb, c] = -100 - c
                continue
            if prev is not None and kpos[bb, c] != prev + 1:
                s += 1
            kseq[bb, c], prev = s, int(kpos[bb, c])
    qcol = torch.arange(Nk - Nq, Nk)
    L, Hl = block_mask.shape[:2]
    bm = block_mask.expand(B, -1, -1, -1) if L == 1 else block_mask
    bm = bm[:, torch.arange(H) // (H // Hl)]  # [B, H, n, n]
    el = bm[:, :, qcol // b][:, :, :, torch.arange(Nk) // b]  # [B, H, Nq, Nk]
    allowed = el & valid[:, None, None, :] & valid[:, None, qcol, None]
    allowed &= kseq[:, None, qcol, None] == kseq[:, None, None, :]
    if causal:
        allowed &= kpos[:, None, None, :] <= kpos[:, None, qcol, None]
    kr = k.repeat_interleave(H // k.shape[1], 1)
    vr = v.repeat_interleave(H // k.shape[1], 1)
    s = (scale * q @ kr.transpose(-1, -2)).masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    has = allowed.any(-1, keepdim=True)
    p = torch.softmax(torch.where(has, s, 0.0), -1) * allowed
    return p @ vr, lse


def rel(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def qkv(rng, B, H, Hk, Nq, Nk, D, dtype):
    ts = [torch.randn(B, h, n, D, generator=rng, dtype=torch.float64) for h, n in ((H, Nq), (Hk, Nk), (Hk, Nk))]
    return [t.to(dtype).requires_grad_() for t in ts]


def check(q, k, v, layout, block_mask, rng, backend, *, causal=True, attention_mask=None, position_ids=None,
          valid_rows=None, check_tma=True):
    """Output, lse and dq, dk, dv (loss through out and lse) of the op against :func:`naive`."""
    from hf_dilated.ops.triton.block_sparse import LAUNCHES

    before = dict(LAUNCHES)
    out, lse = block_sparse_attention(q, k, v, layout, is_causal=causal, attention_mask=attention_mask,
                                      position_ids=position_ids, backend=backend, return_lse=True)
    ref_in = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = naive(*ref_in, block_mask, layout.block_size, causal=causal, attention_mask=attention_mask,
                         position_ids=position_ids)
    rows = torch.ones(out.shape[0], out.shape[2], dtype=torch.bool) if valid_rows is None else valid_rows
    tol = TOL[q.dtype]
    assert out.dtype == q.dtype and lse.shape == out.shape[:3]
    assert rel(out.cpu().transpose(1, 2)[rows], ref.transpose(1, 2)[rows]) < tol
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert rel(lse.cpu()[fin], ref_lse[fin]) < max(tol, 1e-6 if q.dtype != torch.float64 else tol)
    g = torch.randn(out.shape, generator=rng, dtype=torch.float64) * rows[:, None, :, None]
    gl = torch.randn(lse.shape, generator=rng, dtype=torch.float64) * fin
    dev = out.device
    ((out.double() * g.to(dev)).sum() + (torch.where(fin.to(dev), lse.double(), 0) * gl.to(dev)).sum()).backward()
    ((ref * g).sum() + (torch.where(fin, ref_lse, 0) * gl).sum()).backward()
    for name, a, r in zip("qkv", (q, k, v), ref_in):
        assert rel(a.grad, r.grad) < tol, name
    if backend == "triton":
        assert LAUNCHES["forward"] > before.get("forward", 0) and LAUNCHES["backward"] > before.get("backward", 0)
        if check_tma and q.shape[2] == k.shape[2] and (q.shape[-1] * q.element_size()) % 16 == 0:  # the tensor-descriptor path ran
            assert LAUNCHES["tma"] >= before.get("tma", 0) + 2  # forward and backward
            if q.is_cuda and block_sparse_hopper.applies(q, layout.block_size, 0, True):
                assert LAUNCHES["dkdv_hopper"] > before.get("dkdv_hopper", 0)  # Hopper: the Gluon dK/dV kernel ran
            elif q.is_cuda:
                assert LAUNCHES["dkdv_hopper"] == before.get("dkdv_hopper", 0)  # the portable kernel ran
            contiguous = attention_mask is None and position_ids is None
            gluon_fwd = q.is_cuda and block_sparse_hopper.forward_applies(q, layout.block_size, 0, True, contiguous)
            ws = q.is_cuda and block_sparse_hopper.ws_applies(q, layout.block_size, 0, True, contiguous)
            # Hopper, contiguous layouts: a Gluon forward ran (warp-specialized at head dim 128 on 128-blocks, with
            # the warp-specialized dQ); elsewhere the portable kernels
            assert (LAUNCHES["forward_hopper"] > before.get("forward_hopper", 0)) == (gluon_fwd and not ws)
            assert (LAUNCHES["forward_ws"] > before.get("forward_ws", 0)) == ws
            assert (LAUNCHES["dq_ws"] > before.get("dq_ws", 0)) == ws


# ---- patterns against their definitions ------------------------------------------------------------------------------


def brute(n, rule):
    return torch.tensor([[bool(rule(i, j)) for j in range(n)] for i in range(n)])


@pytest.mark.parametrize("causal", [True, False])
def test_patterns_match_definitions(causal):
    n, b = 13, 16
    c = (lambda i, j: j <= i) if causal else (lambda i, j: True)
    d = (lambda i, j: i - j) if causal else (lambda i, j: abs(i - j))
    cases = [
        (dense_blocks(n, b, causal=causal), brute(n, c)),
        (local_blocks(n, b, 3, causal=causal), brute(n, lambda i, j: c(i, j) and abs(i - j) < 3)),
        (global_blocks(n, b, 2, causal=causal), brute(n, lambda i, j: c(i, j) and j < 2)),
        (hierarchical_blocks(n, b, [2, 9], [1, 3], causal=causal),
         brute(n, lambda i, j: c(i, j) and (d(i, j) < 2 or (d(i, j) < 9 and d(i, j) % 3 == 0)))),
    ]
    for lay, want in cases:
        assert torch.equal(lay.to_mask()[0, 0], want)
    lay = dilated_blocks(n, b, [4, 8], [1, 2], causal=causal, num_heads=3)
    for h in range(3):
        want = brute(n, lambda i, j: c(i, j) and (j // 4 == i // 4 or (j // 8 == i // 8 and j % 2 == h % 2)))
        assert torch.equal(lay.to_mask()[0, h], want)
    r1 = random_blocks(n, b, 3, seed=5, causal=causal, num_heads=2)
    r2 = random_blocks(n, b, 3, seed=5, causal=causal, num_heads=2)
    assert torch.equal(r1.kv_index, r2.kv_index) and int(r1.kv_count.max()) <= 3 and int(r1.kv_count.min()) >= 1
    assert not torch.equal(r1.kv_index, random_blocks(n, b, 3, seed=6, causal=causal, num_heads=2).kv_index)
    if causal:
        assert not (r1.to_mask() & ~brute(n, c)).any()
    u = union(cases[1][0], cases[2][0], lay)
    assert torch.equal(u.to_mask(), cases[1][1] | cases[2][1] | lay.to_mask())


def test_compact_layout_and_transpose(rng):
    mask = torch.rand(2, 3, 9, 9, generator=rng) < 0.4
    mask[0, 0, 4] = False  # an empty row
    lay = from_mask(mask, 16)
    assert torch.equal(lay.to_mask(), mask)
    assert torch.equal(lay.kv_count.long(), mask.sum(-1))
    idx = lay.kv_index.long()
    ok = idx >= 0
    assert (idx[..., 1:][ok[..., 1:]] > idx[..., :-1][ok[..., 1:]]).all()  # increasing
    ptr, flat = lay.transposed
    back = torch.zeros(2, 3, 9, 9, dtype=torch.bool)
    for li in range(2):
        for h in range(3):
            for j in range(9):
                rows = flat[li, h, ptr[li, h, j]:ptr[li, h, j + 1]].long()
                assert (rows[1:] > rows[:-1]).all()
                back[li, h, rows, j] = True
    assert torch.equal(back, mask)


def test_layout_construction_is_compact_and_fast():
    import time

    n = 262144 // 64
    t = time.perf_counter()
    lay = union(local_blocks(n, 64, 8), global_blocks(n, 64, 1), dilated_blocks(n, 64, [16, 64], [1, 4], num_heads=4))
    elapsed = time.perf_counter() - t
    assert lay.kv_index.numel() <= 4 * n * 40  # per row a few dozen blocks, nothing (N / b)^2
    assert elapsed < 5.0  # generous for a shared CI core; the GPU benchmark records the real time


# ---- kernels and reference against the float64 statement ------------------------------------------------------------

BACKENDS = ["torch", pytest.param("triton", marks=kernel)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_random_block_mask_gqa(rng, backend, causal):
    B, H, Hk, N, D, b = 1, 4, 2, 75, 16, 16
    n = math.ceil(N / b)
    mask = torch.rand(1, Hk, n, n, generator=rng) < 0.5  # per kv head; some rows empty
    q, k, v = qkv(rng, B, H, Hk, N, N, D, torch.float32)
    check(q, k, v, from_mask(mask, b), mask, rng, backend, causal=causal)


def test_gluon_dkdv_coverage_and_switch(monkeypatch):
    """The Gluon kernels (sm_90; compiled on the CPU by test_benchmark_tools, run by the GPU tests) cover bf16 / fp16,
    head dim 64 / 128, layout blocks 64 / 128, queries = keys, the warp-specialized ones head dim 128 on 128-blocks;
    ``HF_DILATED_GLUON=0`` (or ``off``) turns them off, ``HF_DILATED_WS=0`` the warp-specialized ones; never under
    the interpreter or off sm_90."""
    if not block_sparse_hopper.available():
        pytest.skip("this Triton has no Gluon Hopper API (3.6 or newer)")
    q = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
    assert block_sparse_hopper.supported(q, 128, 0) and block_sparse_hopper.supported(q[..., :64].half(), 64, 0)
    assert not block_sparse_hopper.supported(q, 128, 3)  # decoding: fewer queries than keys
    assert not block_sparse_hopper.supported(q.float(), 128, 0)
    assert not block_sparse_hopper.supported(q, 32, 0)
    assert not block_sparse_hopper.supported(q[..., :32], 128, 0)
    from hf_dilated.ops.triton import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(configs, "_capability_major", lambda: 9)
    assert block_sparse_hopper.applies(q, 128, 0, True) and not block_sparse_hopper.applies(q, 128, 0, False)
    # the forward in Gluon: the same, on contiguous layouts only (per-token masks keep the portable kernel)
    assert block_sparse_hopper.forward_applies(q, 128, 0, True, True)
    assert not block_sparse_hopper.forward_applies(q, 128, 0, True, False)
    assert not block_sparse_hopper.forward_applies(q, 128, 3, True, True)  # decoding
    assert not block_sparse_hopper.forward_applies(q, 128, 0, False, True)  # pointer loads
    assert block_sparse_hopper.forward_config(128, 128)["BLOCK_N"] == 128  # 128-key steps: D 128 on 128-blocks
    assert block_sparse_hopper.forward_config(64, 128)["BLOCK_N"] == block_sparse_hopper.forward_config(128, 64)[
        "BLOCK_N"] == 64
    # the warp-specialized forward and dQ: head dim 128 on 128-blocks, contiguous; HF_DILATED_WS=0 turns them off
    assert block_sparse_hopper.ws_applies(q, 128, 0, True, True)
    assert not block_sparse_hopper.ws_applies(q, 64, 0, True, True)  # 64-blocks
    assert not block_sparse_hopper.ws_applies(q[..., :64], 128, 0, True, True)  # head dim 64 ran slower
    assert not block_sparse_hopper.ws_applies(q, 128, 0, True, False)  # per-token masks
    assert not block_sparse_hopper.ws_applies(q, 128, 3, True, True)  # decoding
    monkeypatch.setenv("HF_DILATED_WS", "off")
    assert not block_sparse_hopper.ws_applies(q, 128, 0, True, True)
    assert block_sparse_hopper.forward_applies(q, 128, 0, True, True)  # the one-warpgroup forward instead
    monkeypatch.setenv("HF_DILATED_WS", "sometimes")
    with pytest.raises(ValueError, match="HF_DILATED_WS must be one of"):
        block_sparse_hopper.ws_applies(q, 128, 0, True, True)
    monkeypatch.delenv("HF_DILATED_WS")
    monkeypatch.setattr(configs, "_capability_major", lambda: 10)  # Blackwell: no wgmma
    assert not block_sparse_hopper.applies(q, 128, 0, True)
    monkeypatch.setattr(configs, "_capability_major", lambda: 9)
    monkeypatch.setattr(configs, "interpreting", lambda: True)
    assert not block_sparse_hopper.applies(q, 128, 0, True)
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    for off in ("0", "off", "False"):
        monkeypatch.setenv("HF_DILATED_GLUON", off)
        assert not hopper.enabled() and not block_sparse_hopper.applies(q, 128, 0, True)
    monkeypatch.setenv("HF_DILATED_GLUON", "1")
    assert hopper.enabled() and block_sparse_hopper.applies(q, 128, 0, True)
    monkeypatch.setenv("HF_DILATED_GLUON", "maybe")  # a typo is refused, not read as on, whatever the GPU
    monkeypatch.setattr(configs, "_capability_major", lambda: 8)
    with pytest.raises(ValueError, match="HF_DILATED_GLUON must be one of"):
        block_sparse_hopper.applies(q, 128, 0, True)


@kernel
def test_pointer_loads_without_descriptors(rng, monkeypatch):
    """The kernels' pointer loads (GPUs before Hopper, unaligned strides) on the same problem as the TMA path."""
    from hf_dilated.ops.triton import block_sparse as kernels

    monkeypatch.setattr(kernels, "use_tma", lambda *a, **k: False)
    B, H, Hk, N, D, b = 1, 4, 2, 75, 16, 16
    n = math.ceil(N / b)
    mask = torch.rand(1, Hk, n, n, generator=rng) < 0.5
    q, k, v = qkv(rng, B, H, Hk, N, N, D, torch.float32)
    before = kernels.LAUNCHES["tma"]
    check(q, k, v, from_mask(mask, b), mask, rng, "triton", check_tma=False)
    assert kernels.LAUNCHES["tma"] == before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@kernel
def test_named_patterns_half(rng, dtype):
    B, H, Hk, N, D, b = 1, 2, 1, 64, 32, 32  # 32-token blocks: two 16-row tiles per block under the interpreter
    n = N // b
    lay = union(local_blocks(n, b, 1), dilated_blocks(n, b, [1, 2], [1, 2], num_heads=H))
    q, k, v = qkv(rng, B, H, Hk, N, N, D, dtype)
    check(q, k, v, lay, lay.to_mask(), rng, "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_and_packing(rng, backend):
    B, H, N, D, b = 2, 2, 48, 16, 16
    n = N // b
    lay = union(local_blocks(n, b, 2), hierarchical_blocks(n, b, [3], [2]))
    q, k, v = qkv(rng, B, H, H, N, N, D, torch.float32)
    am = torch.ones(B, N, dtype=torch.long)
    am[0, :5] = 0  # left padding
    am[1, 40:] = 0  # right padding
    check(q, k, v, lay, lay.to_mask(), rng, backend, attention_mask=am, valid_rows=am.bool())
    q, k, v = qkv(rng, 1, H, H, N, N, D, torch.float32)
    pos = torch.cat([torch.arange(20), torch.arange(28)])[None]  # two packed sequences
    check(q, k, v, lay, lay.to_mask(), rng, backend, position_ids=pos)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_equals_full_forward(rng, backend):
    B, H, Hk, N, D, b = 1, 2, 1, 70, 16, 16
    n = math.ceil(N / b)
    lay = union(local_blocks(n, b, 2), global_blocks(n, b, 1))
    q, k, v = qkv(rng, B, H, Hk, N, N, D, torch.float32)
    full = block_sparse_attention(q, k, v, lay, backend=backend)
    for nq in (1, 5):
        part = block_sparse_attention(q[:, :, -nq:], k, v, lay, backend=backend)
        assert rel(part, full[:, :, -nq:]) < 1e-5
    qd = q[:, :, -5:].detach().requires_grad_()
    check(qd, k, v, lay, lay.to_mask(), rng, backend)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=kernel)])
def test_dense_layout_is_dense_attention(rng, backend):
    B, H, N, D, b = 1, 2, 40, 16, 16
    for causal in (True, False):
        q, k, v = qkv(rng, B, H, H, N, N, D, torch.float64 if backend == "torch" else torch.float32)
        out = block_sparse_attention(q, k, v, dense_blocks(math.ceil(N / b), b, causal=causal), is_causal=causal,
                                     backend=backend)
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
        assert rel(out, ref) < TOL[q.dtype]


def test_float64_reference_every_pattern(rng):
    B, H, Hk, N, D, b = 1, 4, 2, 50, 8, 16
    n = math.ceil(N / b)
    q, k, v = qkv(rng, B, H, Hk, N, N, D, torch.float64)
    for lay in (random_blocks(n, b, 2, seed=1, num_heads=H), hierarchical_blocks(n, b, [2, 4], [1, 2]),
                dilated_blocks(n, b, [2, 4], [1, 2], num_heads=Hk)):
        for t in (q, k, v):
            t.grad = None
        check(q, k, v, lay, lay.to_mask(), rng, "torch")


# ---- adaptive selection ----------------------------------------------------------------------------------------------


def test_adaptive_picks_the_blocks_that_match(rng):
    B, H, N, D, b = 1, 1, 128, 8, 16
    e = torch.zeros(D)
    e[0] = 1.0
    k = 0.01 * torch.randn(B, H, N, D, generator=rng)
    q = 0.01 * torch.randn(B, H, N, D, generator=rng)
    k[:, :, 2 * b:3 * b] += 5 * e  # key block 2 points along e
    q[:, :, 6 * b:7 * b] += e  # query block 6 looks along e
    lay = adaptive_blocks(q, k, b, 1, local_blocks=1, global_blocks=1)
    m = lay.to_mask()[0, 0]
    assert m[6].nonzero().flatten().tolist() == [0, 2, 6]  # global, chosen, local
    assert not m[1, 2:].any() and m.tril().eq(m).all()  # causal
    assert lay.kv_index.shape[-1] <= 3


def test_adaptive_selection_ignores_what_padding_holds(rng):
    """Padding never enters the pooled queries and keys, whatever it holds: NaN / inf in the padding tokens (holes
    inside blocks, and a right-padded tail) choose the same blocks as finite padding does. ``0 * NaN`` in a masked
    mean made a block's mean NaN, which ``topk`` ranks first."""
    B, H, Hk, N, D, b = 2, 4, 2, 128, 8, 16
    q, k = torch.randn(B, H, N, D, generator=rng), torch.randn(B, Hk, N, D, generator=rng)
    mask = torch.ones(B, N, dtype=torch.bool)
    pad = torch.cat([torch.arange(5, 100, 9), torch.arange(120, N)])
    mask[1, pad] = False
    tokens = resolve_layout(B, N, N, "cpu", mask)
    chosen = []
    for fill in (None, math.nan, math.inf):
        qq, kk = q.clone(), k.clone()
        if fill is not None:
            qq[1, :, pad] = fill
            kk[1, :, pad] = fill
        lay = adaptive_blocks(qq, kk, b, 2, local_blocks=1, global_blocks=1, tokens=tokens)
        chosen.append(lay.to_mask())
    for got, fill in zip(chosen[1:], ("nan", "inf")):
        assert torch.equal(got, chosen[0]), f"{fill} in padding changed the chosen blocks"


@kernel
def test_eager_block_sparse_skips_the_dispatcher(rng):
    """An eager forward+backward of the block-sparse op runs its implementations, not the dispatcher (host time a
    small problem's GPU waits for), with the gradients of the registered op's autograd, bit for bit."""
    q, k, v = (torch.randn(1, 2, 64, 16, generator=rng).requires_grad_() for _ in range(3))
    lay = local_blocks(4, 16, 1)

    def grads():
        return torch.autograd.grad(block_sparse_attention(q, k, v, lay, backend="triton").sum(), (q, k, v))

    with torch.profiler.profile() as prof:
        eager = grads()
    assert not [e.name for e in prof.events() if e.name.startswith("hf_dilated::")]
    assert "aten::new_zeros" not in {e.name for e in prof.events()}  # no zero lse gradient made (a fill launch)
    with mock.patch.object(eager_autograd, "direct", lambda args: False):  # every call through the ops
        with torch.profiler.profile() as prof:
            dispatched = grads()
        assert {"hf_dilated::block_sparse_fwd", "hf_dilated::block_sparse_bwd"} <= {e.name for e in prof.events()}
    for name, a, b in zip("qkv", eager, dispatched):
        assert torch.equal(a, b), f"d{name} differs between the implementation and the op"


@pytest.mark.parametrize("backend", BACKENDS)
def test_adaptive_gradients_through_selected_blocks(rng, backend):
    B, H, Hk, N, D, b = 2, 2, 1, 64, 16, 16
    q, k, v = qkv(rng, B, H, Hk, N, N, D, torch.float32)
    cfg = BlockSparseConfig(pattern="adaptive", block_size=b, top_k=1, local_blocks=1, global_blocks=0)
    lay = adaptive_blocks(q, k, b, 1, local_blocks=1, global_blocks=0)
    assert lay.layout_batch == B and lay.layout_heads == Hk
    check(q, k, v, cfg, lay.to_mask(), rng, backend)


@kernel
def test_custom_op_traces_as_one_node(rng):
    from hf_dilated.ops.block_sparse import block_sparse_op
    from hf_dilated.ops.layout import resolve_layout

    B, H, N, D, b = 1, 2, 48, 16, 16
    lay = union(local_blocks(3, b, 2), global_blocks(3, b, 1))
    q, k, v = qkv(rng, B, H, H, N, N, D, torch.float32)
    tokens = resolve_layout(B, N, N, q.device)
    fn = torch.compile(lambda q, k, v: block_sparse_op(q, k, v, lay, tokens, True, D**-0.5)[0], fullgraph=True,
                       backend="aot_eager")
    g = torch.randn(B, H, N, D, generator=rng)
    (fn(q, k, v) * g).sum().backward()
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = naive(*ref_in, lay.to_mask(), b)
    (ref * g).sum().backward()
    for a, r in zip((q, k, v), ref_in):
        assert rel(a.grad, r.grad) < 1e-5


# ---- budget: attended keys per query, counted by brute force -----------------------------------------------------------


def brute_dilated_keys(ws, rs, n, causal, g=0):
    """Mean over positions and head offsets (0 .. lcm(r) - 1) of the size of the union of the key sets SPEC.md gives
    a query in its selecting branches (and the global branch)."""
    period = math.lcm(*rs)
    total = 0
    for h in range(period):
        for p in range(n):
            keys = set()
            for w, r in zip(ws, rs):
                if p % r != h % r:
                    continue
                keys |= {q for q in range(n) if q // w == p // w and q % r == h % r and (q <= p or not causal)}
            keys |= {q for q in range(min(g, n)) if q <= p or not causal}
            total += len(keys)
    return total / (n * period)


@pytest.mark.parametrize("causal", [True, False])
def test_dilated_keys_per_query_is_the_union_of_branches(causal):
    from hf_dilated.ops.block_sparse.budget import dilated_keys_per_query

    for ws, rs, n, g in [([4, 8, 16], [1, 2, 4], 37, 0), ([6, 12], [1, 3], 29, 3), ([8], [1], 8, 0),
                         ([4, 12, 24], [1, 2, 6], 50, 5), ([6, 8], [1, 2], 31, 2), ([4, 6, 8], [1, 2, 4], 23, 9)]:
        assert dilated_keys_per_query(ws, rs, n, causal=causal, global_tokens=g) == pytest.approx(
            brute_dilated_keys(ws, rs, n, causal, g), rel=1e-12), (ws, rs, n, g)
    # one branch covering the sequence is dense attention: (n + 1) / 2 keys causal, n otherwise
    assert dilated_keys_per_query([64], [1], 40, causal=causal) == (20.5 if causal else 40)
    with pytest.raises(ValueError, match="seq_len"):
        dilated_keys_per_query([4], [1], 0)
    with pytest.raises(ValueError, match="dilation_rates"):
        dilated_keys_per_query([4], [2], 8)


def test_layout_and_adaptive_keys_per_query_count_the_attended_keys(rng):
    from hf_dilated.ops.block_sparse.budget import (adaptive_blocks_per_query_block, adaptive_keys_per_query,
                                                     layout_keys_per_query)

    N, b = 75, 16
    n = math.ceil(N / b)
    for causal in (True, False):
        mask = torch.rand(2, 3, n, n, generator=rng) < 0.5
        el = mask[..., torch.arange(N) // b, :][..., torch.arange(N) // b]  # [2, 3, N, N] tokens
        if causal:
            el = el & torch.ones(N, N, dtype=torch.bool).tril()
        assert layout_keys_per_query(from_mask(mask, b), N, causal=causal) == pytest.approx(
            el.sum().item() / (N * 6), rel=1e-12)
    # adaptive: the block counts do not depend on the content, and the budget is exact (causal, local >= 1)
    B, H, Hk, D = 2, 4, 2, 8
    q = torch.randn(B, H, N, D, generator=rng)
    k = torch.randn(B, Hk, N, D, generator=rng)
    for top_k, local, sink in [(1, 1, 1), (2, 2, 1), (3, 1, 0), (2, 3, 2)]:
        lay = adaptive_blocks(q, k, b, top_k, local_blocks=local, global_blocks=sink)
        want = adaptive_blocks_per_query_block(n, top_k, local, sink)
        assert torch.equal(lay.kv_count.long(), want.expand_as(lay.kv_count))
        assert adaptive_keys_per_query(N, b, top_k, local, sink) == pytest.approx(layout_keys_per_query(lay, N))
        lay = adaptive_blocks(q, k, b, top_k, local_blocks=local, global_blocks=sink, causal=False)
        assert torch.equal(lay.kv_count.long(), adaptive_blocks_per_query_block(n, top_k, local, sink, causal=False)
                           .expand_as(lay.kv_count))


def test_matching_budget_attends_to_as_many_keys_as_dilated():
    from hf_dilated import DilatedAttentionConfig
    from hf_dilated.ops.block_sparse.budget import dilated_keys_per_query

    smollm2 = DilatedAttentionConfig(segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 4], layers=[1, 3],
                                     backend="torch")
    for n, causal in [(8192, True), (2048, True), (16384, True), (4096, False)]:
        target = dilated_keys_per_query(smollm2.segment_lengths, smollm2.dilation_rates, n, causal=causal)
        cfg = BlockSparseConfig.matching_budget(smollm2, n, causal=causal)
        assert (cfg.pattern, cfg.block_size, cfg.local_blocks, cfg.global_blocks) == ("adaptive", 64, 16, 1)
        assert cfg.layers == [1, 3] and cfg.backend == "torch"  # the dilated config's
        got = cfg.keys_per_query(n, causal=causal)
        for other in (cfg.top_k - 1, cfg.top_k + 1):  # no top_k comes closer
            if other >= 1:
                alt = BlockSparseConfig(pattern="adaptive", block_size=64, local_blocks=16, top_k=other)
                assert abs(got - target) <= abs(alt.keys_per_query(n, causal=causal) - target)
        assert abs(got - target) <= 64  # within one block of keys
    assert BlockSparseConfig.matching_budget(smollm2, 8192).top_k == 8  # the docstring's example
    # at 2048 tokens dilated attention is dense (every branch covers the sequence): so is the match
    assert BlockSparseConfig.matching_budget(smollm2, 2048).keys_per_query(2048) == 1024.5
    tiny = BlockSparseConfig.matching_budget({"segment_lengths": [64], "dilation_rates": [1]}, 4096, block_size=16,
                                             local_blocks=4, global_blocks=0)
    assert tiny.top_k == 1  # the window alone is above the budget: the least top_k
    with pytest.raises(ValueError, match="dilated must be a DilatedAttentionConfig"):
        BlockSparseConfig.matching_budget([2048], 8192)
    with pytest.raises(ValueError, match="seq_len"):
        BlockSparseConfig.matching_budget(smollm2, 0)
    with pytest.raises(ValueError, match="block_size"):
        BlockSparseConfig.matching_budget(smollm2, 8192, block_size=48)
    # fixed patterns count from their layout
    assert BlockSparseConfig(pattern="dense", block_size=16).keys_per_query(40) == 20.5
    assert BlockSparseConfig(pattern="local", block_size=16, local_blocks=1, global_blocks=0).keys_per_query(32) == 8.5


# ---- config, inputs, Transformers -------------------------------------------------------------------------------------


def test_config_roundtrip_and_validation():
    cfg = BlockSparseConfig(pattern="dilated", block_size=128, segment_blocks=[4, 16], dilation_rates=[1, 4])
    assert BlockSparseConfig.from_dict(cfg.to_dict()) == cfg

    class C:
        pass

    mc = C()
    cfg.save_to(mc)
    assert BlockSparseConfig.from_model_config(mc) == cfg
    for kwargs, field in [({"pattern": "star"}, "pattern"), ({"block_size": 48}, "block_size"),
                          ({"top_k": 0}, "top_k"), ({"windows": [2], "strides": [1, 2]}, "windows"),
                          ({"dilation_rates": [2, 4]}, "dilation_rates"), ({"backend": "cuda"}, "backend"),
                          ({"layers": "all"}, "layers")]:
        with pytest.raises(ValueError, match=field):
            BlockSparseConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown"):
        BlockSparseConfig.from_dict({"patern": "local"})


def test_bad_inputs_raise(rng):
    q, k, v = qkv(rng, 1, 2, 2, 32, 32, 16, torch.float32)
    lay = local_blocks(2, 16, 1)
    with pytest.raises(ValueError, match="n_blocks"):
        block_sparse_attention(q, k, v, local_blocks(3, 16, 1), backend="torch")
    with pytest.raises(ValueError, match="layout heads"):
        block_sparse_attention(q, k, v, from_mask(torch.ones(3, 2, 2, dtype=torch.bool), 16), backend="torch")
    with pytest.raises(ValueError, match="layout_or_pattern"):
        block_sparse_attention(q, k, v, torch.ones(2, 2), backend="torch")
    with pytest.raises(ValueError, match="layout_or_pattern"):
        block_sparse_attention(q, k, v, torch.ones(5, 5, dtype=torch.bool), backend="torch")
    with pytest.raises(ValueError, match="layout_or_pattern"):
        block_sparse_attention(q, k, v, 3, backend="torch")
    with pytest.raises(ValueError, match="pattern"):
        block_sparse_attention(q, k, v, "stripes", backend="torch")
    with pytest.raises(ValueError, match="backend"):
        block_sparse_attention(q, k, v, lay, backend="cuda")
    for scale in (-1.0, 1e-46):  # a scale that rounds to 0 in float32 would make masked scores NaN in the kernels
        with pytest.raises(ValueError, match="scale must be a finite positive number"):
            block_sparse_attention(q, k, v, lay, scale=scale, backend="torch")
    with pytest.raises(ValueError, match="query"):
        block_sparse_attention(q[0], k, v, lay, backend="torch")
    with pytest.raises(ValueError, match="key/value heads"):
        block_sparse_attention(q[:, :1].repeat(1, 3, 1, 1), k, v, lay, backend="torch")
    with pytest.raises(ValueError, match="block_size"):
        local_blocks(4, 24, 1)
    with pytest.raises(ValueError, match="window"):
        local_blocks(4, 16, 0)
    with pytest.raises(ValueError, match="attention_mask"):
        block_sparse_attention(q, k, v, lay, attention_mask=torch.ones(2, 32), backend="torch")


def test_pattern_names_and_bool_masks_resolve(rng):
    q, k, v = qkv(rng, 1, 2, 2, 64, 64, 16, torch.float64)
    for name in ("local", "dilated", "hierarchical", "random", "adaptive", "dense"):
        cfg = BlockSparseConfig(pattern=name, block_size=16, local_blocks=1, top_k=1, segment_blocks=[2, 4],
                                dilation_rates=[1, 2], windows=[2, 4], strides=[1, 2], random_blocks=1)
        out = block_sparse_attention(q, k, v, cfg, backend="torch")
        assert torch.isfinite(out).all()
    mask = torch.ones(4, 4, dtype=torch.bool)
    out = block_sparse_attention(q, k, v, mask, backend="torch")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel(out, ref) < 1e-10


def test_transformers_attention_function(rng):
    transformers = pytest.importorskip("transformers")
    from hf_dilated.integrations.block_sparse import register

    register()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 48), generator=rng)
    am = torch.ones_like(ids)
    am[1, :7] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=am).logits
        model.config._attn_implementation = "block_sparse"
        BlockSparseConfig(pattern="dense", block_size=16, backend="torch").save_to(model.config)
        out = model(ids, attention_mask=am).logits
        assert rel(out[am.bool()], ref[am.bool()]) < 1e-4
        BlockSparseConfig(pattern="local", block_size=16, local_blocks=1, global_blocks=0,
                          backend="torch").save_to(model.config)
        assert rel(model(ids[:1]).logits, ref[:1]) > 1e-3  # a sparse layout changes the result
        cached = model.generate(ids[:1], max_new_tokens=17, do_sample=False, use_cache=True)
        full = model.generate(ids[:1], max_new_tokens=17, do_sample=False, use_cache=False)
        assert torch.equal(cached, full)  # decoding against the cache = the full forward, across a block boundary
    assert model.config.to_dict()["block_sparse_attention"]["pattern"] == "local"


# ---- GPU: realistic sizes ---------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_custom_op_compiles_to_one_node(rng):
    from hf_dilated.ops.block_sparse import block_sparse_op
    from hf_dilated.ops.layout import resolve_layout

    B, H, N, D, b = 1, 4, 1024, 64, 64
    lay = union(local_blocks(N // b, b, 2), global_blocks(N // b, b, 1)).to("cuda")
    q, k, v = (t.detach().cuda().requires_grad_() for t in qkv(rng, B, H, H, N, N, D, torch.bfloat16))
    tokens = resolve_layout(B, N, N, q.device)
    lay.transposed  # noqa: B018 (built outside the graph)
    torch.library.opcheck(torch.ops.hf_dilated.block_sparse_fwd.default,
                          (q, k, v, lay.kv_count, lay.kv_index, tokens.q_pos, tokens.q_seq, tokens.q_valid,
                           tokens.k_pos, tokens.k_seq, tokens.k_valid, b, True, True, D**-0.5),
                          test_utils=("test_schema", "test_faketensor"))
    fn = torch.compile(lambda q, k, v: block_sparse_op(q, k, v, lay, tokens, True, D**-0.5)[0], fullgraph=True)
    out = fn(q, k, v)
    ref = block_sparse_attention(q, k, v, lay, backend="triton")
    assert rel(out.float(), ref.float()) < 1e-3
    out.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [128, 256])
def test_gpu_kernels_realistic(rng, b, dtype, D):
    """A union of every named pattern against float64, every dtype and layout block, head dims 128 and 256 (Gemma's:
    the backward's configs there are their own; float32 at 256 once asked for more shared memory than an H100 has)."""
    B, H, Hk, N = 1, 8, 2, 2048 + 77
    n = math.ceil(N / b)
    lay = union(local_blocks(n, b, 3), global_blocks(n, b, 1), dilated_blocks(n, b, [4, 16], [1, 4], num_heads=H),
                random_blocks(n, b, 2, seed=3)).to("cuda")
    q, k, v = (t.detach().cuda().requires_grad_() for t in qkv(rng, B, H, Hk, N, N, D, dtype))
    check(q, k, v, lay, lay.to_mask().cpu(), rng, "triton")


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gluon", ["1", "0"])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_dkdv_kernels_on_hopper(rng, monkeypatch, gluon, D):
    """On sm_90 the Gluon kernels are there and run (``check`` asserts which: at D 128 the warp-specialized forward
    and dQ too), and with ``HF_DILATED_GLUON=0`` the portable ones do, all against float64: non-causal, two batch
    rows, a last 64-row step wholly past the queries."""
    from hf_dilated.ops.triton.configs import wgmma

    if not wgmma():
        pytest.skip("the Gluon kernel is for sm_90")
    assert block_sparse_hopper.available(), "sm_90 with a Triton whose Gluon API the kernel does not know"
    monkeypatch.setenv("HF_DILATED_GLUON", gluon)
    B, H, Hk, N, b = 2, 4, 2, 2048 + 40, 128
    n = math.ceil(N / b)
    lay = union(local_blocks(n, b, 3), global_blocks(n, b, 1), random_blocks(n, b, 2, seed=5)).to("cuda")
    q, k, v = (t.detach().cuda().requires_grad_() for t in qkv(rng, B, H, Hk, N, N, D, torch.bfloat16))
    check(q, k, v, lay, lay.to_mask().cpu(), rng, "triton", causal=False)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_backward_on_two_streams(rng, monkeypatch):
    """The dQ kernel runs on a second stream beside the dK / dV kernel (``launch.forked``): bit for bit the gradients
    of one stream, and the second stream did run."""
    from hf_dilated.ops.triton import launch
    from hf_dilated.ops.triton.block_sparse import LAUNCHES

    B, H, Hk, N, D, b = 1, 8, 2, 4096 + 77, 128, 128
    n = math.ceil(N / b)
    lay = union(local_blocks(n, b, 3), global_blocks(n, b, 1), random_blocks(n, b, 2, seed=7)).to("cuda")
    q, k, v = (t.detach().cuda().requires_grad_() for t in qkv(rng, B, H, Hk, N, N, D, torch.bfloat16))
    do = torch.randn(q.shape, generator=rng, dtype=torch.float64).to("cuda", torch.bfloat16)

    def grads(concurrent: bool):
        monkeypatch.setattr(launch, "CONCURRENT_BACKWARD", concurrent)
        before = LAUNCHES["backward"]
        out = block_sparse_attention(q, k, v, lay, backend="triton")
        got = torch.autograd.grad(out, (q, k, v), do)
        assert LAUNCHES["backward"] == before + 1, "the backward kernels did not run"
        return got

    launch._SIDE_STREAMS.clear()
    one = grads(False)
    assert not launch._SIDE_STREAMS, "one stream was asked for, a second one was made"
    two = grads(True)
    assert launch._SIDE_STREAMS, "the backward did not fork a second stream"
    for name, a, b_ in zip("qkv", one, two):
        assert torch.equal(a, b_), f"d{name} differs between one stream and two"


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_replay(rng):
    """Forward and backward captured in a CUDA graph replay what eager computes on fresh inputs, bit for bit (the
    layout's transpose is built before the capture and reused)."""
    from cuda_graphs import assert_graph_replays_eager
    from hf_dilated.ops.triton.block_sparse import LAUNCHES

    B, H, Hk, N, D, b = 1, 8, 2, 4096 + 77, 128, 128
    n = math.ceil(N / b)
    lay = union(local_blocks(n, b, 3), global_blocks(n, b, 1), random_blocks(n, b, 2, seed=7)).to("cuda")
    q, k, v = (t.detach().cuda().requires_grad_() for t in qkv(rng, B, H, Hk, N, N, D, torch.bfloat16))
    do = torch.randn(q.shape, generator=rng, dtype=torch.float64).to("cuda", torch.bfloat16)

    def step(q, k, v, do):
        out = block_sparse_attention(q, k, v, lay, backend="triton")
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    before = LAUNCHES["backward"]
    assert_graph_replays_eager(step, (q, k, v, do))
    assert LAUNCHES["backward"] > before, "the backward kernels did not run"


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_and_padding(rng):
    B, H, Hk, N, D, b = 2, 8, 2, 1500, 64, 64
    n = math.ceil(N / b)
    lay = union(local_blocks(n, b, 4), global_blocks(n, b, 1)).to("cuda")
    q, k, v = (t.detach().cuda() for t in qkv(rng, B, H, Hk, N, N, D, torch.bfloat16))
    am = torch.ones(B, N, dtype=torch.long, device="cuda")
    am[1, :100] = 0
    full = block_sparse_attention(q, k, v, lay, attention_mask=am, backend="triton")
    part = block_sparse_attention(q[:, :, -3:], k, v, lay, attention_mask=am, backend="triton")
    assert rel(part.float(), full[:, :, -3:].float()) < 1e-2
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    check(qg, kg, vg, lay, lay.to_mask().cpu(), rng, "triton", attention_mask=am.cpu(), valid_rows=am.bool().cpu())


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_adaptive(rng):
    B, H, Hk, N, D, b = 2, 8, 2, 4096, 128, 64
    q, k, v = (t.detach().cuda().requires_grad_() for t in qkv(rng, B, H, Hk, N, N, D, torch.bfloat16))
    cfg = BlockSparseConfig(pattern="adaptive", block_size=b, top_k=4, local_blocks=2, global_blocks=1)
    lay = adaptive_blocks(q, k, b, 4, local_blocks=2, global_blocks=1)
    check(q, k, v, cfg, lay.to_mask().cpu(), rng, "triton")
