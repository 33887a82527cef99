"""DilatedAttention and MultiheadDilatedAttention (the drop-in for nn.MultiheadAttention(batch_first=True))."""

import pytest
import torch

import hf_dilated
from hf_dilated import DilatedAttention, MultiheadDilatedAttention
from naive import naive_dilated_attention, rel_err


def test_dilated_attention_module_is_the_op(rng):
    q = torch.randn(2, 4, 33, 8, generator=rng, dtype=torch.float64)
    k = torch.randn(2, 2, 33, 8, generator=rng, dtype=torch.float64)
    v = torch.randn(2, 2, 33, 8, generator=rng, dtype=torch.float64)
    module = DilatedAttention([8, 16], [1, 2], backend="torch")
    want = naive_dilated_attention(q, k, v, [(8, 1), (16, 2)], is_causal=True)
    assert rel_err(module(q, k, v), want) < 1e-10
    want_bi = naive_dilated_attention(q, k, v, [(8, 1), (16, 2)], is_causal=False)
    assert rel_err(module(q, k, v, is_causal=False), want_bi) < 1e-10
    assert "segment_lengths=[8, 16]" in repr(module)
    with pytest.raises(ValueError, match="dilation_rates"):
        DilatedAttention([8, 16], [2, 2])


@pytest.mark.parametrize("causal", [False, True])
def test_multihead_drop_in_matches_torch_with_a_dense_branch(rng, causal):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    E, H, N = 32, 4, 29
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours = MultiheadDilatedAttention(E, H, segment_lengths=[64], dilation_rates=[1], backend="torch").eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, N, E, generator=rng)
    mask = torch.zeros(3, N, dtype=torch.bool)
    mask[1, 20:] = True  # torch convention: True = ignore this key (right padding)
    causal_mask = torch.nn.Transformer.generate_square_subsequent_mask(N) if causal else None
    want, _ = ref(x, x, x, key_padding_mask=mask, need_weights=False, attn_mask=causal_mask, is_causal=causal)
    got, weights = ours(x, x, x, key_padding_mask=mask, is_causal=causal)
    assert weights is None
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, :20], want[1, :20], rtol=1e-5, atol=1e-5)


def test_multihead_dilated_in_half_precision_is_finite_and_close(rng):
    E, H, N = 64, 4, 80
    module = MultiheadDilatedAttention(E, H, segment_lengths=[16, 32], dilation_rates=[1, 2], backend="torch")
    x = torch.randn(2, N, E, generator=rng)
    want, _ = module(x, x, x, is_causal=True)
    got, _ = module.to(torch.bfloat16)(x.bfloat16(), x.bfloat16(), x.bfloat16(), is_causal=True)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_err(got, want) < 2e-2


def test_multihead_rejects_what_it_cannot_do(rng):
    module = MultiheadDilatedAttention(16, 2, segment_lengths=[8], dilation_rates=[1], backend="torch")
    x = torch.randn(1, 8, 16, generator=rng)
    with pytest.raises(ValueError, match="need_weights"):
        module(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match="attn_mask"):
        module(x, x, x, attn_mask=torch.zeros(8, 8))
    with pytest.raises(ValueError, match="query must be"):
        module(x[..., :8], x, x)
    with pytest.raises(ValueError, match="key_padding_mask"):
        module(x, x, x, key_padding_mask=torch.zeros(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_heads"):
        MultiheadDilatedAttention(15, 2, segment_lengths=[8], dilation_rates=[1])
    with pytest.raises(ValueError, match="batch_first"):
        MultiheadDilatedAttention(16, 2, segment_lengths=[8], dilation_rates=[1], batch_first=False)
    with pytest.raises(ValueError, match="dropout"):
        MultiheadDilatedAttention(16, 2, segment_lengths=[8], dilation_rates=[1], dropout=1.0)
    assert hf_dilated.MultiheadDilatedAttention is MultiheadDilatedAttention
