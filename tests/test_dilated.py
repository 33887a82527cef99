"""The op's one assembly (ops/dilated.py: attend, dilated_attention) and its layout rules (ops/layout.py)."""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from hf_dilated import attend, block_sparse_attention, dilated_attention, resolve_layout
from hf_dilated.ops import DENSE
from hf_dilated.ops.reference import dilated_attention_reference
from naive import naive_dilated_attention, naive_positions, rel_err

BRANCHES = [(8, 1), (16, 2)]


def qkv(rng, B=2, Hq=4, Hk=2, N=33, D=8, dtype=torch.float64):
    return tuple(torch.randn(B, h, N, D, generator=rng, dtype=dtype) for h in (Hq, Hk, Hk))


def reference_supports(name):
    return name in inspect.signature(dilated_attention_reference).parameters


def test_a_hole_in_a_row_hides_that_key_only(rng):
    q, k, v = qkv(rng)
    mask = torch.ones(2, 33, dtype=torch.bool)
    mask[1, [3, 5, 20]] = False
    got = dilated_attention(q, k, v, [8, 16], [1, 2], attention_mask=mask, backend="torch")
    qpos, kpos, valid = naive_positions(2, 33, 33, attention_mask=mask)
    want = naive_dilated_attention(q, k, v, BRANCHES, q_pos=qpos, k_pos=kpos, k_valid=valid)
    real = mask[:, None, :, None].expand_as(got)
    assert rel_err(got[real], want[real]) < 1e-10
    layout = resolve_layout(2, 33, 33, "cpu", attention_mask=mask, position_ids=torch.arange(33)[None])
    assert (layout.k_seq == 0).all() and (layout.q_seq == 0).all()  # one sequence per row, holes or not


def test_packing_comes_from_restarting_positions_only_without_a_mask():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    packed = resolve_layout(1, 6, 6, "cpu", position_ids=pos)
    assert packed.k_seq.tolist() == [[0, 0, 0, 1, 1, 2]] and not packed.contiguous
    masked = resolve_layout(1, 6, 6, "cpu", attention_mask=torch.ones(1, 6, dtype=torch.bool), position_ids=pos)
    assert masked.k_seq.tolist() == [[0] * 6]  # Transformers: a 2-D mask means one sequence per row
    plain = resolve_layout(1, 6, 6, "cpu", attention_mask=torch.ones(1, 6, dtype=torch.long))
    assert plain.contiguous and plain.k_pos.tolist() == [list(range(6))]


def test_the_layout_is_resolved_once_per_mask_until_the_mask_changes():
    """Every layer of a forward passes the same mask object: its layout is resolved once. A mask changed in place
    (its version moves) is resolved again, and an inference tensor (no version counter) every time."""
    mask = torch.ones(1, 6, dtype=torch.bool)
    first = resolve_layout(1, 6, 6, "cpu", attention_mask=mask)
    assert resolve_layout(1, 6, 6, "cpu", attention_mask=mask) is first
    mask[0, 2] = False
    again = resolve_layout(1, 6, 6, "cpu", attention_mask=mask)
    assert again is not first and not again.k_valid[0, 2] and not again.contiguous
    with torch.inference_mode():
        frozen = torch.ones(1, 6, dtype=torch.bool)
    one, two = (resolve_layout(1, 6, 6, "cpu", attention_mask=frozen) for _ in range(2))
    assert one is not two and one.contiguous and two.contiguous


def test_decoding_positions_count_back_from_the_query():
    """Keys of a cache end at the last query: a cache holding only recent keys (sliding window) gets true positions."""
    layout = resolve_layout(1, 1, 4, "cpu", position_ids=torch.tensor([[9]]))
    assert layout.k_pos.tolist() == [[6, 7, 8, 9]] and layout.q_pos.tolist() == [[9]]
    filled = torch.tensor([[False, True, True, True, True, False]])  # left padding and an unfilled static-cache slot
    layout = resolve_layout(1, 1, 6, "cpu", attention_mask=filled, position_ids=torch.tensor([[3]]))
    assert layout.k_pos[0, 1:5].tolist() == [0, 1, 2, 3] and not layout.contiguous
    assert resolve_layout(1, 1, 4, "cpu", position_ids=torch.tensor([[3]])).contiguous


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32, torch.uint8])
def test_boolean_and_integer_masks_agree(rng, dtype):
    q, k, v = qkv(rng)
    mask = torch.rand(2, 33, generator=rng) > 0.3
    mask[:, -1] = True
    want = dilated_attention(q, k, v, [8, 16], [1, 2], attention_mask=mask, backend="torch")
    got = dilated_attention(q, k, v, [8, 16], [1, 2], attention_mask=mask.to(dtype), backend="torch")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_float_and_non_binary_masks_are_refused_not_inverted(rng):
    q, k, v = qkv(rng)
    additive = torch.zeros(2, 33)
    additive[1, :4] = float("-inf")
    with pytest.raises(ValueError, match="attention_mask.*boolean or 0/1 integer.*mask == 0"):
        dilated_attention(q, k, v, [8, 16], [1, 2], attention_mask=additive, backend="torch")
    with pytest.raises(ValueError, match="attention_mask.*other than 0 and 1"):
        dilated_attention(q, k, v, [8, 16], [1, 2], attention_mask=torch.full((2, 33), 2), backend="torch")
    with pytest.raises(ValueError, match=r"attention_mask must be a 2-D key mask"):
        dilated_attention(q, k, v, [8, 16], [1, 2], attention_mask=torch.ones(2, 1, 33, 33, dtype=torch.bool))


@pytest.mark.parametrize("scale", [math.inf, 1e300, math.nan, 0.0, -0.5, 1e-46, "0.1", True])
def test_scale_must_be_finite_and_positive(rng, scale):
    q, k, v = qkv(rng)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        dilated_attention(q, k, v, [8, 16], [1, 2], scale=scale, backend="torch")


def test_attend_checks_its_options(rng):
    q, k, v = qkv(rng)
    layout = resolve_layout(2, 33, 33, "cpu")
    for kwargs, name in [
        (dict(window=0), "window"), (dict(window=2.5), "window"), (dict(global_tokens=-1), "global_tokens"),
        (dict(dropout_p=1.0), "dropout_p"), (dict(dropout_p=0.1, seed=3), "seed"), (dict(backend="cuda"), "backend"),
        (dict(head_offset=-1), "head_offset"),
    ]:
        with pytest.raises(ValueError, match=name):
            attend(q, k, v, layout, BRANCHES, is_causal=True, scale=None, **kwargs)
    with pytest.raises(ValueError, match="layout covers"):
        attend(q, k, v, resolve_layout(2, 5, 5, "cpu"), BRANCHES, is_causal=True, scale=None, backend="torch")
    with pytest.raises(ValueError, match="at least one head"):
        attend(q[:, :0], k[:, :0], v[:, :0], layout, BRANCHES, is_causal=True, scale=None, backend="torch")


@pytest.mark.parametrize("causal", [True, False])
def test_dense_branch_is_sdpa_with_gqa(rng, causal):
    q, k, v = qkv(rng, N=21)
    out, lse = attend(q, k, v, resolve_layout(2, 21, 21, "cpu"), DENSE, is_causal=causal, scale=None, backend="torch")
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=causal)
    assert rel_err(out, want) < 1e-12 and lse.shape == (2, 4, 21)


@pytest.mark.skipif(not reference_supports("window"), reason="the reference backend has no window= yet (owner: ref)")
@pytest.mark.parametrize("causal", [True, False])
def test_window_reaches_the_backend(rng, causal):
    q, k, v = qkv(rng, N=30)
    got, _ = attend(q, k, v, resolve_layout(2, 30, 30, "cpu"), DENSE, is_causal=causal, scale=None, window=5,
                    backend="torch")
    want = naive_dilated_attention(q, k, v, [(64, 1)], is_causal=causal, window=5)
    assert rel_err(got, want) < 1e-10


@pytest.mark.skipif(not reference_supports("dropout_p"), reason="the reference backend has no dropout yet (owner: ref)")
def test_dropout_draws_a_seed_and_drops_something(rng):
    q, k, v = qkv(rng)
    plain = dilated_attention(q, k, v, [8, 16], [1, 2], backend="torch")
    a = dilated_attention(q, k, v, [8, 16], [1, 2], dropout_p=0.3, backend="torch")
    b = dilated_attention(q, k, v, [8, 16], [1, 2], dropout_p=0.3, backend="torch")
    assert (a - plain).abs().max() > 1e-3 and (a - b).abs().max() > 1e-3  # a fresh draw each call
    seed = torch.tensor(1234)
    c = dilated_attention(q, k, v, [8, 16], [1, 2], dropout_p=0.3, seed=seed, backend="torch")
    torch.testing.assert_close(c, dilated_attention(q, k, v, [8, 16], [1, 2], dropout_p=0.3, seed=seed, backend="torch"))


def test_transposed_layout_gets_a_hint():
    """[B, N, H, D] passed for [B, H, N, D] (GQA): the error says which layout is expected."""
    q = torch.randn(1, 16, 4, 8)
    k = v = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match=r"\[B, H, N, D\].*transpose"):
        dilated_attention(q, k, v, [8], [1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("where", ["query", "key", "value"])
def test_a_nan_in_the_inputs_reaches_the_outputs_that_read_it(rng, backend, where):
    """A NaN in one entry of q or k comes out NaN in exactly the outputs that read it: the query's row and its lse, or
    every row that attends the key. A NaN in v reaches every row that attends its key, in its column only; rows of the
    same tile that do not attend it may read NaN too (``0 * NaN`` in ``P V``, as in SDPA's kernels). float32 on short
    segments: PyTorch's CPU flash kernel, which the reference runs, returned 0 and lse 0 for a NaN query row under 16
    rows, and the Triton kernels an lse of -inf. The rows that attend key ``j``: the float64 oracle's output with ``v``
    one-hot at ``j``."""
    B, Hq, Hk, N, D = 1, 4, 2, 32, 16
    q, k, v = (t.float() for t in qkv(rng, B, Hq, Hk, N, D))
    h, j, d = (int(torch.randint(0, n, (), generator=rng)) for n in ({"query": Hq}.get(where, Hk), N, D))
    (q if where == "query" else k if where == "key" else v)[0, h, j, d] = math.nan
    out, lse = attend(q, k, v, resolve_layout(B, N, N, "cpu"), tuple(BRANCHES), is_causal=True, scale=None,
                      backend=backend)
    if where == "query":
        rows = torch.zeros(B, Hq, N, dtype=torch.bool)
        rows[0, h, j] = True
    else:
        onehot = torch.zeros(B, Hk, N, D, dtype=torch.float64)
        onehot[0, h, j] = 1
        rows = naive_dilated_attention(q.double(), k.double().nan_to_num(), onehot, BRANCHES)[..., 0] != 0
    assert rows.any() and not rows.all()
    if where == "value":
        column = torch.arange(D) == d
        assert out[..., column][rows].isnan().all(), "a row that attends the key does not show its value's NaN"
        assert not out[..., ~column].isnan().any() and not lse.isnan().any()
        heads = torch.arange(Hq) // (Hq // Hk) == h
        assert not out[:, ~heads].isnan().any(), "the NaN reached another kv head's query heads"
    else:
        nan = out.isnan()
        assert torch.equal(nan, rows[..., None].expand_as(nan)), (
            f"NaN in {int(nan.sum())} outputs, {int(rows.sum())} rows read it")
        assert torch.equal(lse.isnan(), rows)


ATTENTIONS = {
    "dilated": lambda q, k, v, **kw: dilated_attention(q, k, v, [8, 16], [1, 2], **kw),
    "block_sparse": lambda q, k, v, **kw: block_sparse_attention(q, k, v, torch.ones(2, 2, dtype=torch.bool).tril(),
                                                                 **kw),
}


@pytest.mark.parametrize("attention", list(ATTENTIONS))
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("side", ["right", "left", "holes"])
def test_nan_in_padding_reaches_no_output(rng, attention, backend, side):
    """Padding tokens are never attended (SPEC), so NaN in their q, k and v changes nothing: every real row's output
    and gradients equal those of the run with finite padding, and nothing is NaN. Kernels multiply padding rows by 0
    inside their tiles (``P V``, and ``dS K`` / ``dS^T Q`` in the backward), NaN for a NaN there: the reference's fused
    path and both block-sparse backends let it into real rows until the padding rows of q, k and v were zeroed."""
    B, Hq, Hk, N, D = 2, 4, 2, 32, 16
    q, k, v = (t.float() for t in qkv(rng, B, Hq, Hk, N, D))
    do = torch.randn(B, Hq, N, D, generator=rng)
    mask = torch.ones(B, N, dtype=torch.bool)
    pad = {"right": torch.arange(N - 7, N), "left": torch.arange(7), "holes": torch.tensor([3, 10, 17, 20])}[side]
    mask[1, pad] = False
    runs = []
    for poison in (False, True):
        qq, kk, vv = (t.clone() for t in (q, k, v))
        if poison:
            for t in (qq, kk, vv):
                t[1, :, pad] = math.nan
        qq, kk, vv = (t.requires_grad_() for t in (qq, kk, vv))
        out = ATTENTIONS[attention](qq, kk, vv, attention_mask=mask, backend=backend)
        runs.append((out, *torch.autograd.grad(out, (qq, kk, vv), do)))
    for name, clean, got in zip(("out", "dq", "dk", "dv"), *runs):
        assert not got.isnan().any(), f"{name}: NaN from the padding"
        real = mask[:, None, :, None].expand_as(got)
        assert torch.equal(got[real], clean[real]), f"{name} of a real token changed with the padding's values"
