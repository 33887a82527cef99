"""Direct relaunch of compiled kernels (``hf_dilated.ops.triton.relaunch``): its key tells apart everything Triton's
specialisation does, every launch site passes arguments that it can launch directly, and on a GPU a direct launch
computes what Triton's own launch does, bit for bit, and did run."""

from __future__ import annotations

import inspect
import itertools
import os

import pytest
import torch

triton = pytest.importorskip("triton")

import hf_dilated  # noqa: E402
from hf_dilated.ops.block_sparse import block_sparse_attention, from_mask  # noqa: E402
from hf_dilated.ops.triton import relaunch  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_specialisation():
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        pytest.skip("this Triton release has no native_specialize_impl to compare against")
    return lambda arg: native_specialize_impl(BaseBackend, arg, False, True, True)


def test_key_tells_apart_what_triton_does():
    """Two launches with the same ``key``, or the same ``class_key``, have the same Triton specialisation of every
    argument (so a direct launch reuses the right compiled kernel); the key hands back the tensors' pointers, and an
    argument it cannot key raises instead of being guessed."""
    triton_spec = _triton_specialisation()
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32)]
    others = [1, 0, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, -2**31, -2**31 - 1, -2**31 - 16,
              2**40, 2**40 + 1, 2**63 - 16, 2**63, 2**63 + 16, -2**63, 0.5, 1.0, 16.0, True, False, None]
    for values, n in ((tensors, 1), (others, 0)):
        for a, b in itertools.combinations(values, 2):
            if relaunch.key((a,), n)[0] == relaunch.key((b,), n)[0]:
                assert triton_spec(a) == triton_spec(b), (a, b)
    # the class key (a decoding loop's growing lengths): values replaced by Triton's classes of them
    for a, b in itertools.combinations(others, 2):
        if relaunch.spec(a) == relaunch.spec(b):
            assert triton_spec(a) == triton_spec(b), (a, b)
    assert relaunch.class_key(relaunch.key((base, 97), 1)[0]) == relaunch.class_key(relaunch.key((base, 99), 1)[0])
    assert relaunch.class_key(relaunch.key((base, 97), 1)[0]) != relaunch.class_key(relaunch.key((base, 96), 1)[0])
    for other in ("s", (1, 2), torch.float32, base):
        with pytest.raises(relaunch.Unkeyed):
            relaunch.spec(other)
    same = relaunch.key((base, base[4:], 3, 1.5), 2)
    assert same[1] == [base.data_ptr(), base[4:].data_ptr()]
    assert same[0] == relaunch.key((base.clone(), base.clone()[4:], 3, 1.5), 2)[0]
    assert same[0] != relaunch.key((base, base[1:], 3, 1.5), 2)[0], "alignment"
    assert same[0] != relaunch.key((base, base[4:], 3.0, 1.5), 2)[0], "an int and a float of the same value"
    assert relaunch.key((base, 1), 1)[0] != relaunch.key((base, True), 1)[0], "an int and a bool"
    with pytest.raises(TypeError):
        relaunch.key((base, None, 3), 2)
    with pytest.raises(TypeError):
        hash(relaunch.key((base, [3]), 1)[0])


def test_launch_tail_orders_every_parameter():
    P = inspect.Parameter
    sig = inspect.Signature([P("A", P.POSITIONAL_OR_KEYWORD), P("n", P.POSITIONAL_OR_KEYWORD),
                             P("BLOCK", P.POSITIONAL_OR_KEYWORD), P("FLAG", P.POSITIONAL_OR_KEYWORD, default=False),
                             P("num", P.POSITIONAL_OR_KEYWORD, default=3)])
    flags = [False, False, True, True, True]
    assert relaunch.launch_tail(sig, flags, 2, dict(FLAG=True, BLOCK=64, num_warps=4)) == (64, True, 3)
    assert relaunch.launch_tail(sig, flags, 3, dict()) is None, "a constexpr passed by position is not keyed"
    assert relaunch.launch_tail(sig, flags, 2, dict(FLAG=True)) is None, "BLOCK has no value"


def _is_constexpr(param: inspect.Parameter) -> bool:
    return "constexpr" in str(param.annotation)


@pytest.mark.skipif(not INTERPRET, reason="runs the kernels under TRITON_INTERPRET=1 (set by conftest without CUDA)")
def test_every_launch_site_launches_directly(rng, monkeypatch):
    """Every kernel launch the dilated op (forward, backward, decode; with a window, dropout and holes) and the
    block-sparse op make passes its runtime arguments by position, its tensors first and then only ints, floats,
    bools or None (what ``relaunch.key`` keys), and everything else by keyword, so that a compiled kernel can be
    launched again directly (``relaunch.launch_tail`` finds every parameter's value)."""
    seen = []
    through = relaunch.run

    def record(kernel, grid, *args, **constexprs):
        seen.append((kernel, args, constexprs))
        return through(kernel, grid, *args, **constexprs)

    monkeypatch.setattr(relaunch, "run", record)
    q, k, v = (torch.randn(1, 4, 40, 16, generator=rng, requires_grad=True) for _ in range(3))
    k2, v2 = (t.detach()[:, :2].requires_grad_() for t in (k, v))
    mask = torch.ones(1, 40, dtype=torch.long)
    mask[0, 25:30] = 0
    for kwargs in (dict(), dict(attention_mask=mask, window=12),
                   dict(dropout_p=0.25, seed=torch.tensor(3), global_tokens=2)):
        out = hf_dilated.dilated_attention(q, k2, v2, [8, 16], [1, 2], backend="triton", **kwargs)
        out.sum().backward()
    keys = torch.tensor([[0, 0, 40]], dtype=torch.int32)
    torch.ops.hf_dilated.dilated_attention_decode(q[:, :, -2:].detach(), k.detach(), v.detach(),
                                                  torch.tensor([[38, 39]]), keys, [8, 16], [1, 2], True, 0.25, 0,
                                                  0, 0)
    layout = from_mask(torch.rand(1, 4, 3, 3, generator=rng) < 0.6, 16)
    block_sparse_attention(q, k, v, layout, is_causal=True, backend="triton").sum().backward()
    kinds = {kernel.fn.__name__ for kernel, _, _ in seen}
    assert {"dilated_fwd_branch_kernel", "delta_kernel", "dilated_bwd_dkdv_kernel", "dilated_bwd_dq_kernel",
            "dilated_decode_kernel", "bs_fwd_kernel", "bs_bwd_dkdv_kernel", "bs_bwd_dq_kernel"} <= kinds, kinds
    for kernel, args, constexprs in seen:
        sig = inspect.signature(kernel.fn)
        flags = [_is_constexpr(p) for p in sig.parameters.values()]
        assert relaunch.launch_tail(sig, flags, len(args), constexprs) is not None, kernel.fn.__name__
        n = sum(isinstance(a, torch.Tensor) for a in args)
        assert all(isinstance(a, torch.Tensor) for a in args[:n]), f"{kernel.fn.__name__}: tensors do not lead"
        assert all(type(a) in (int, float, bool, type(None)) for a in args[n:]), kernel.fn.__name__


def _launches_through_triton(monkeypatch) -> list:
    """A list that gets every kernel launched through Triton's own ``JITFunction.run`` from now on."""
    from triton.runtime.jit import JITFunction

    through_triton = []
    triton_run = JITFunction.run

    def counted(self, *args, **kwargs):
        through_triton.append(self)
        return triton_run(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counted)
    return through_triton


@pytest.mark.gpu
def test_gpu_direct_launches_match_triton_launches(rng, monkeypatch):
    """The dilated op's forward and backward (the Gluon kernels on Hopper, GQA, LongNet-style branches) and the
    block-sparse op's, launched directly from the second call on, give the bits of Triton's own launches; an argument
    that Triton specialises differently (a tensor 16-byte aligned or not) compiles and launches its own kernel."""
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("needs a CUDA GPU")
    q, k, v = (torch.randn(1, h, 3000, 128, generator=rng).to("cuda", torch.bfloat16).requires_grad_()
               for h in (8, 4, 4))
    do = torch.randn(q.shape, generator=rng).to("cuda", torch.bfloat16)
    layout = from_mask(torch.rand(1, 4, 24, 24, generator=rng) < 0.5, 128)

    def run(qq):
        out = hf_dilated.dilated_attention(qq, k, v, [256, 512, 1024], [1, 2, 4], backend="triton")
        bs = block_sparse_attention(qq, k, v, layout, is_causal=True, backend="triton")
        return (out, bs) + torch.autograd.grad((out, bs), (qq, k, v), (do, do))

    through_triton = _launches_through_triton(monkeypatch)
    for qq in (q, torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view_as(q).copy_(q)):
        # the second: a query tensor 2 bytes off 16-byte alignment, its own specialisation, the same values
        qq = qq.detach().requires_grad_()
        monkeypatch.setattr(relaunch, "ENABLED", False)
        want = run(qq)
        monkeypatch.setattr(relaunch, "ENABLED", True)
        for _ in range(3):
            through_triton.clear()
            before = relaunch.DIRECT
            got = run(qq)
            for a, b in zip(got, want):
                assert torch.equal(a, b)
        assert not through_triton, f"launched through Triton on a repeat: {through_triton}"
        assert relaunch.DIRECT - before >= 8, "the kernels were not launched directly"


@pytest.mark.gpu
def test_gpu_decoding_with_a_growing_cache_launches_directly(rng, monkeypatch):
    """Decoding steps whose cache grows by a token (new lengths and strides, of classes Triton compiled for before)
    launch the compiled decode kernel directly: the class key finds it, and the outputs are those of Triton's own
    launch."""
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("needs a CUDA GPU")
    from hf_dilated.ops.triton import op

    q, k, v = (torch.randn(1, h, 120, 64, generator=rng).to("cuda", torch.bfloat16) for h in (4, 2, 2))

    def step(n):  # one query at position n - 1 against the first n keys (the cache as decoding holds it)
        keys = torch.tensor([[0, 0, n]], dtype=torch.int32, device="cuda")
        kc, vc = k[:, :, :n].contiguous(), v[:, :, :n].contiguous()
        return op.dilated_attention_decode(q[:, :, n - 1:n], kc, vc, torch.tensor([[n - 1]], device="cuda"), keys,
                                           [32, 64], [1, 2], True, 0.125, 0, 0, 0)[0]

    through_triton = _launches_through_triton(monkeypatch)
    lengths = [97, 98, 99, 101, 102, 103, 105, 107, 109, 111]  # none a multiple of 16: one class of ints
    monkeypatch.setattr(relaunch, "ENABLED", False)
    want = [step(n) for n in lengths]
    monkeypatch.setattr(relaunch, "ENABLED", True)
    step(lengths[0])
    through_triton.clear()
    before = relaunch.DIRECT
    got = [step(n) for n in lengths[1:]]
    assert not through_triton, f"launched through Triton: {len(through_triton)} of {len(lengths) - 1} steps"
    assert relaunch.DIRECT - before == len(lengths) - 1
    for a, b in zip(got, want[1:]):
        assert torch.equal(a, b)
