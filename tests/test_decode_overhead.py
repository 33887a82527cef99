"""Per-token decoding work outside the attention kernel does not grow with the cache (issue 9, item 8).

Every aten op of one decoding step of a tiny patched Llama is recorded with the shapes of its tensors, at two cache
lengths. Apart from the attention op itself and the cache's own update, the two recordings must be the same op for op,
shape for shape: no mask, layout, check or work list with the cache's length, and the same number of ops; and no op
reads a value on the host (a device sync per token).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

import hf_dilated
from hf_dilated import ATTENTION_NAME, DilatedAttentionConfig
from hf_dilated.ops.triton import launch

pytest.importorskip("triton")
if not torch.cuda.is_available() and not hf_dilated.ops.dilated.triton_available(torch.device("cpu")):
    pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BRANCHES = dict(segment_lengths=[8, 16, 32], dilation_rates=[1, 2, 4])
ATTENTION_OPS = {"hf_dilated::dilated_attention_decode", "aten::_scaled_dot_product_efficient_attention",
                 "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_cudnn_attention"}
CACHE_OPS = {"static": {"aten::index_copy_"}, "dynamic": {"aten::cat"}}
HOST_READS = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"}  # .item(), bool(), torch.equal: syncs


class Recorder(TorchDispatchMode):
    """Every aten / custom op run, with the shapes of all its tensor inputs and outputs."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = tuple(tuple(t.shape) for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        self.ops.append((func._schema.name, shapes))
        return out


def tiny_llama(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1 << 16)
    model = LlamaForCausalLM(cfg).eval().to(DEVICE)
    if attn == ATTENTION_NAME:
        DilatedAttentionConfig(**BRANCHES, backend="triton").save_to(model.config)
    model.set_attn_implementation(attn)
    return model


def filled_cache(model, kind: str, cache_len: int):
    """A cache holding ``filled`` random keys per layer (static: half of ``cache_len`` slots; dynamic: all)."""
    filled = cache_len // 2 if kind == "static" else cache_len
    cache = StaticCache(config=model.config, max_cache_len=cache_len) if kind == "static" \
        else DynamicCache(config=model.config)
    g = torch.Generator().manual_seed(1)
    for layer in range(model.config.num_hidden_layers):
        k, v = (torch.randn(1, 2, filled, 16, generator=g).to(DEVICE) for _ in range(2))
        cache.update(k, v, layer)
    return cache, filled


def step_ops(attn: str, kind: str, cache_len: int) -> list[tuple[str, tuple]]:
    """The ops of one decoding step (after a first, warm-up step), those of the attention and the cache update
    left out."""
    model = tiny_llama(attn)
    cache, filled = filled_cache(model, kind, cache_len)
    token = torch.tensor([[5]], device=DEVICE)
    with torch.no_grad():
        model(input_ids=token, past_key_values=cache, use_cache=True)
        launch.LAUNCHES.clear()
        with Recorder() as rec:
            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
    assert torch.isfinite(logits).all()
    if attn == ATTENTION_NAME:
        assert launch.LAUNCHES == {"decode": model.config.num_hidden_layers}  # the kernel ran, nothing else
        assert not [op for op in rec.ops if op[0] in HOST_READS]  # no value read on the host (no device sync)
    skip = ATTENTION_OPS | CACHE_OPS[kind]
    return [op for op in rec.ops if op[0] not in skip]


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_decoding_step_work_does_not_grow_with_the_cache(kind):
    short, long = step_ops(ATTENTION_NAME, kind, 2048), step_ops(ATTENTION_NAME, kind, 16384)
    grown = [(a, b) for a, b in zip(short, long) if a != b]
    assert not grown, f"ops whose tensors grow with the cache (2K -> 16K): {grown[:5]}"
    assert len(short) == len(long)


def test_dynamic_cache_step_grows_no_more_than_sdpa():
    """With a dynamic cache only its own appends grow, as for sdpa: no op of ours outside the kernel scales."""
    ours = step_ops(ATTENTION_NAME, "dynamic", 16384)
    sdpa = step_ops("sdpa", "dynamic", 16384)
    scaled = lambda ops: [op for op in ops if any(d >= 8192 for s in op[1] for d in s)]  # noqa: E731
    assert len(scaled(ours)) <= len(scaled(sdpa)) == 0, scaled(ours)[:5]


@pytest.mark.parametrize("form", ["lengths", "left_padded_mask"])
def test_cache_decoding_op_equals_the_float64_statement(rng, form):
    """The decode op on a cache layout (a static cache's filled lengths, or a left-padded 2-D mask with unfilled
    slots) against tests/naive.py, with positions counted as SPEC.md says; the decode kernel is the one launch."""
    from naive import naive_dilated_attention, rel_err

    B, Hq, Hk, D, Nk, Nq = 2, 4, 2, 16, 96, 2
    branches = ((8, 1), (16, 2), (32, 4))
    filled = torch.tensor([70, 81])
    pad = torch.tensor([5, 0]) if form == "left_padded_mask" else torch.zeros(2, dtype=torch.long)
    cols = torch.arange(Nk)
    real = (cols >= pad[:, None]) & (cols < filled[:, None])
    k_pos = (cols - pad[:, None]).clamp_min(0)
    q_pos = torch.stack([k_pos[b, filled[b] - Nq : filled[b]] for b in range(B)])
    q = torch.randn(B, Hq, Nq, D, generator=rng)
    k, v = (torch.randn(B, Hk, Nk, D, generator=rng) for _ in range(2))
    mask = filled if form == "lengths" else real
    launch.LAUNCHES.clear()
    out = hf_dilated.dilated_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), [w for w, _ in branches],
                                       [r for _, r in branches], position_ids=q_pos.to(DEVICE),
                                       attention_mask=mask.to(DEVICE), backend="triton")
    assert launch.LAUNCHES == {"decode": 1}
    want = naive_dilated_attention(q.double(), k.double(), v.double(), branches, q_pos=q_pos, k_pos=k_pos,
                                   k_valid=real, q_valid=torch.ones(B, Nq, dtype=torch.bool))
    assert rel_err(out.cpu().double(), want) < (1e-3 if DEVICE == "cuda" else 1e-5)
