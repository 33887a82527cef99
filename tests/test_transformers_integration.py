"""The "dilated" attention implementation inside Transformers models: masks, padding, packing, caches, switching."""

import logging

import pytest
import torch
from transformers import DataCollatorWithFlattening, DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache
from transformers.masking_utils import create_causal_mask

import hf_dilated
from hf_dilated import ATTENTION_NAME, DilatedAttentionConfig

LONGNET = DilatedAttentionConfig(segment_lengths=[8, 16, 32], dilation_rates=[1, 2, 4], backend="torch")


def tiny_llama(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def switch(model, config):
    config.save_to(model.config)
    model.set_attn_implementation(ATTENTION_NAME)
    return model


def test_registered_in_both_interfaces():
    from transformers import AttentionInterface, AttentionMaskInterface

    assert AttentionInterface._global_mapping[ATTENTION_NAME] is hf_dilated.dilated_attention_forward
    assert AttentionMaskInterface._global_mapping[ATTENTION_NAME] is hf_dilated.dilated_mask


def test_mask_stays_compact():
    model = switch(tiny_llama(), LONGNET)
    emb = torch.randn(2, 40, 64)
    assert create_causal_mask(model.config, emb, None, None) is None
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :5] = 0
    mask[0, 7] = 0
    built = create_causal_mask(model.config, emb, mask, None)
    assert built.shape == (2, 40) and built.dtype == torch.bool  # [B, Nk], never N x N
    assert torch.equal(built, mask.bool())
    # A given mask is passed on even when all ones (one sequence per row: packing is not inferred), as is.
    ones = torch.ones(2, 40, dtype=torch.bool)
    assert create_causal_mask(model.config, emb, ones, None) is ones


def test_static_cache_mask_is_the_filled_length_without_reading_values():
    model = switch(tiny_llama(), LONGNET)
    cache = StaticCache(config=model.config, max_cache_len=64)
    emb = torch.randn(2, 1, 64)
    cache.update(torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16), 0)
    built = create_causal_mask(model.config, emb, None, cache)
    assert built.shape == (2,) and built.tolist() == [31, 31]  # [B] key lengths, not a [B, 64] mask
    layout = hf_dilated.resolve_layout(2, 1, 64, "cpu", attention_mask=built, position_ids=torch.full((2, 1), 30))
    assert layout.k_valid[:, :31].all() and not layout.k_valid[:, 31:].any()
    assert layout.k_pos[0, :31].tolist() == list(range(31))
    # With a 2-D mask the unfilled slots are masked too.
    mask = torch.ones(2, 31, dtype=torch.long)
    mask[0, :4] = 0
    built = create_causal_mask(model.config, emb, mask, cache)
    assert built.shape == (2, 64) and built[1, :31].all() and not built[:, 31:].any() and not built[0, :4].any()


def test_mask_holes_hide_those_keys_only_like_sdpa_and_eager(rng):
    """A 0 in the middle of a row hides that key and nothing else (Transformers' rule): with the degenerate config the
    real tokens' logits equal sdpa's and eager's, and greedy decoding picks the same tokens."""
    ids = torch.randint(3, 128, (2, 24), generator=rng)
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 3] = mask[1, 5] = 0
    real = mask.bool()
    model = tiny_llama(max_position_embeddings=512)
    with torch.no_grad():
        want = {}
        for impl in ("sdpa", "eager"):
            model.set_attn_implementation(impl)
            want[impl] = model(ids, attention_mask=mask).logits
        switch(model, DilatedAttentionConfig(segment_lengths=[512], dilation_rates=[1], backend="torch"))
        got = model(ids, attention_mask=mask).logits
    for impl, logits in want.items():
        torch.testing.assert_close(got[real], logits[real], rtol=1e-5, atol=1e-5, msg=lambda m: f"{impl}: {m}")
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    ours = model.generate(ids, **kw)
    model.set_attn_implementation("sdpa")
    assert torch.equal(ours, model.generate(ids, **kw))


def test_degenerate_config_equals_sdpa_and_switching_back_restores(rng):
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 40), generator=rng)
    with torch.no_grad():
        dense = model(ids).logits
        switch(model, DilatedAttentionConfig(segment_lengths=[64], dilation_rates=[1], backend="torch"))
        torch.testing.assert_close(model(ids).logits, dense, rtol=1e-5, atol=1e-5)
        switch(model, LONGNET)
        sparse = model(ids).logits
        assert (sparse - dense).abs().max() > 1e-3  # dilation really changes something past the first segment
        torch.testing.assert_close(sparse[:, 0], dense[:, 0], rtol=1e-5, atol=1e-5)  # the first token sees itself only
        model.set_attn_implementation("sdpa")
        torch.testing.assert_close(model(ids).logits, dense)


def test_padded_batch_equals_each_sequence_alone(rng):
    model = switch(tiny_llama(), LONGNET)
    ids = torch.randint(0, 128, (3, 45), generator=rng)
    mask = torch.ones(3, 45, dtype=torch.long)
    mask[1, :6] = 0
    mask[2, :21] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, position_ids=pos).logits
        assert torch.isfinite(batched).all()
        for b, pad in enumerate([0, 6, 21]):
            alone = model(ids[b : b + 1, pad:]).logits
            torch.testing.assert_close(batched[b : b + 1, pad:], alone, rtol=1e-4, atol=1e-4)


def test_flattened_packing_equals_each_document_alone(rng):
    model = switch(tiny_llama(), LONGNET)
    docs = [torch.randint(0, 128, (n,), generator=rng).tolist() for n in (17, 30, 9)]
    for kwargs in (dict(), dict(return_flash_attn_kwargs=True)):
        batch = DataCollatorWithFlattening(**kwargs)([{"input_ids": d} for d in docs])
        batch.pop("labels")
        with torch.no_grad():
            packed = model(**batch).logits
            start = 0
            for d in docs:
                alone = model(torch.tensor([d])).logits
                torch.testing.assert_close(packed[:, start : start + len(d)], alone, rtol=1e-4, atol=1e-4)
                start += len(d)


def triton_or_skip():
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and not hf_dilated.ops.dilated.triton_available(torch.device("cpu")):
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_decoding_with_cache_equals_full_forward(rng, cache_kind, backend):
    from hf_dilated.ops.triton import launch

    if backend == "triton":
        triton_or_skip()
    model = switch(tiny_llama(), LONGNET)  # the full forward and the prefill on the reference (fast on CPU)
    ids = torch.randint(0, 128, (2, 44), generator=rng)
    with torch.no_grad():
        full = model(ids).logits
        cache = DynamicCache(config=model.config) if cache_kind == "dynamic" else StaticCache(config=model.config, max_cache_len=64)
        outs = [model(ids[:, :30], past_key_values=cache, use_cache=True).logits]
        switch(model, DilatedAttentionConfig(segment_lengths=[8, 16, 32], dilation_rates=[1, 2, 4], backend=backend))
        launch.LAUNCHES.clear()
        for t in range(30, 35, 2):  # two tokens per step (short query blocks too), then one
            outs.append(model(ids[:, t : min(t + 2, 35)], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(outs, 1), full[:, :35], rtol=1e-4, atol=1e-4)
    if backend == "triton":  # every step ran the decode kernel (2 layers x 3 steps), nothing else
        assert launch.LAUNCHES == {"decode": 6}


def test_generate_with_left_padding_matches_unpadded(rng):
    model = switch(tiny_llama(), LONGNET)
    short = torch.randint(3, 128, (1, 20), generator=rng)
    long = torch.randint(3, 128, (1, 29), generator=rng)
    ids = torch.cat([torch.cat([torch.zeros(1, 9, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    batched = model.generate(ids, attention_mask=mask, **kw)
    alone = model.generate(short, attention_mask=torch.ones_like(short), **kw)
    n = alone.shape[1]  # the lone run stops early if it samples EOS; the batched row is then padded
    assert torch.equal(batched[0, 9 : 9 + n], alone[0])
    assert (batched[0, 9 + n :] == 0).all()


@pytest.mark.parametrize("padded", [False, True])
def test_generate_with_a_static_cache_matches_dynamic(rng, padded):
    """generate() with a static (compileable) cache prepares the mask once per step with the registered mask function
    and passes the result back in as ``attention_mask`` (Transformers >= 5.2x): the ``[B]`` key lengths and the
    ``[B, Nk]`` key mask must both be taken back. Same tokens as with the dynamic cache."""
    model = switch(tiny_llama(), LONGNET)
    ids = torch.randint(3, 128, (2, 24), generator=rng)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    if padded:  # row 0 left-padded by 5
        ids[0, :5] = 0
        kw["attention_mask"] = torch.ones_like(ids)
        kw["attention_mask"][0, :5] = 0
    dynamic = model.generate(ids, **kw)
    static = model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(static, dynamic)


def test_per_layer_choice_leaves_other_layers_dense(rng):
    ids = torch.randint(0, 128, (1, 48), generator=rng)
    model = tiny_llama()
    calls = []
    original = hf_dilated.integrations.transformers.attend

    def spy(*args, **kwargs):
        calls.append(args[4])  # the branches
        return original(*args, **kwargs)

    hf_dilated.integrations.transformers.attend = spy
    try:
        with torch.no_grad():
            dense = model(ids).logits
            cfg = DilatedAttentionConfig(segment_lengths=[8, 16], dilation_rates=[1, 2], layers=[1], backend="torch")
            switch(model, cfg)
            one = model(ids).logits
            assert calls == [hf_dilated.ops.DENSE, ((8, 1), (16, 2))]  # layer 0 dense, layer 1 dilated: one op path
            switch(model, DilatedAttentionConfig(segment_lengths=[8, 16], dilation_rates=[1, 2], layers=[], backend="torch"))
            torch.testing.assert_close(model(ids).logits, dense, rtol=1e-5, atol=1e-5)
            assert calls[2:] == [hf_dilated.ops.DENSE] * 2
    finally:
        hf_dilated.integrations.transformers.attend = original
    assert (one - dense).abs().max() > 1e-4


def test_save_and_reload_keeps_the_config(tmp_path, rng):
    model = switch(tiny_llama(), LONGNET)
    ids = torch.randint(0, 128, (1, 40), generator=rng)
    with torch.no_grad():
        before = model(ids).logits
    model.save_pretrained(tmp_path)
    again = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation=ATTENTION_NAME).eval()
    assert DilatedAttentionConfig.from_model_config(again.config) == LONGNET
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, before)


def test_gradients_reach_every_projection(rng):
    model = switch(tiny_llama(), LONGNET).train()
    ids = torch.randint(0, 128, (2, 40), generator=rng)
    model(ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        if any(s in name for s in ("q_proj", "k_proj", "v_proj", "o_proj")):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_output_attentions_warns_once_and_returns_none(rng, caplog):
    model = switch(tiny_llama(), LONGNET)
    ids = torch.randint(0, 128, (1, 16), generator=rng)
    logging.Logger.warning_once.cache_clear()  # Transformers' once-per-process cache
    with torch.no_grad(), caplog.at_level("WARNING"):
        out = model(ids, output_attentions=True)
        model(ids, output_attentions=True)
        plain = model(ids).logits
    assert out.attentions is not None and not any(isinstance(a, torch.Tensor) for a in out.attentions)
    torch.testing.assert_close(out.logits, plain)
    assert sum("output_attentions" in r.getMessage() for r in caplog.records) == 1  # once, like sdpa


def test_four_d_masks_are_refused_with_the_reason():
    model = switch(tiny_llama(), LONGNET)
    ids = torch.randint(0, 128, (1, 16))
    with pytest.raises(ValueError, match="4-D"):
        model(ids, attention_mask=torch.ones(1, 1, 16, 16, dtype=torch.bool))


def test_model_without_generic_dispatch_is_named():
    class Legacy(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="Legacy"):
        hf_dilated.ensure_supported(Legacy())
    hf_dilated.ensure_supported(LlamaForCausalLM)


@pytest.mark.slow
def test_smollm2_degenerate_equals_sdpa_and_longnet_stays_close(smollm2, shakespeare):
    model, tok = smollm2
    ids = tok(shakespeare[200_000:260_000], return_tensors="pt").input_ids[:, :1024]
    try:
        with torch.no_grad():
            model.set_attn_implementation("sdpa")
            dense = model(ids, labels=ids)
            switch(model, DilatedAttentionConfig(segment_lengths=[2048], dilation_rates=[1], backend="torch"))
            same = model(ids, labels=ids)
            torch.testing.assert_close(same.logits, dense.logits, rtol=1e-4, atol=1e-4)
            switch(model, DilatedAttentionConfig(segment_lengths=[256, 512, 1024], dilation_rates=[1, 2, 4], backend="torch"))
            sparse = model(ids, labels=ids)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.isfinite(sparse.loss)
    # Untrained for dilation, SmolLM2 loses a little: measured 4.61 against 4.10 dense on this text (12%).
    assert abs(sparse.loss.item() - dense.loss.item()) < 0.15 * dense.loss.item(), (sparse.loss.item(), dense.loss.item())


def reference_supports_window():
    import inspect

    return "window" in inspect.signature(hf_dilated.ops.dilated_attention_reference).parameters


@pytest.mark.skipif(not reference_supports_window(), reason="the reference backend has no window= yet (owner: ref)")
def test_sliding_window_layers_left_dense_keep_their_window(rng):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=64)
    model = Gemma3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 40), generator=rng)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        dense = model(ids, attention_mask=mask, position_ids=pos).logits
        full_layers = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
        switch(model, DilatedAttentionConfig(segment_lengths=[64], dilation_rates=[1], layers=full_layers, backend="torch"))
        same = model(ids, attention_mask=mask, position_ids=pos).logits
        torch.testing.assert_close(same[0], dense[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(same[1, 7:], dense[1, 7:], rtol=1e-4, atol=1e-4)
        switch(model, DilatedAttentionConfig(segment_lengths=[64], dilation_rates=[1], backend="torch"))
        with pytest.raises(ValueError, match="sliding-window layer"):
            model(ids)


def test_whole_model_compiles_fullgraph_with_the_triton_backend(rng):
    pytest.importorskip("triton")
    if not hf_dilated.ops.dilated.triton_available(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = switch(tiny_llama(), DilatedAttentionConfig(segment_lengths=[8, 16, 32], dilation_rates=[1, 2, 4], backend="triton"))
    model.to(device)
    ids = torch.randint(0, 128, (1, 40), generator=rng).to(device)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits  # fullgraph: a break raises
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "stored, fragment",
    [({"segment_lengths": [8], "dilation_rates": [1], "layers": [7]}, "layers"), ({}, "segment_lengths"),
     ({"segment_lengths": [8]}, "dilation_rates"), ([8, 16], "must be a dict"), ("8,16", "must be a dict")],
)
def test_malformed_config_json_is_named_before_any_layer_runs(tmp_path, stored, fragment):
    import json

    tiny_llama().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["dilated_attention"] = stored
    path.write_text(json.dumps(data))
    model = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation=ATTENTION_NAME)
    with pytest.raises(ValueError, match=fragment):
        model(torch.randint(0, 128, (1, 8)))


def reference_supports_dropout():
    import inspect

    return "dropout_p" in inspect.signature(hf_dilated.ops.dilated_attention_reference).parameters


def test_attention_dropout_is_zero_in_eval(rng):
    ids = torch.randint(0, 128, (2, 24), generator=rng)
    with torch.no_grad():
        plain = switch(tiny_llama(), LONGNET)(ids).logits
        dropped = switch(tiny_llama(attention_dropout=0.3), LONGNET).eval()(ids).logits
    torch.testing.assert_close(dropped, plain, rtol=0, atol=0)


@pytest.mark.skipif(not reference_supports_dropout(), reason="the reference backend has no dropout yet (owner: ref)")
def test_attention_dropout_trains(rng):
    model = switch(tiny_llama(attention_dropout=0.3), LONGNET).train()
    ids = torch.randint(0, 128, (2, 24), generator=rng)
    a = model(ids, labels=ids)
    b = model(ids, labels=ids)
    assert (a.logits - b.logits).abs().max() > 1e-4  # a fresh draw per step
    a.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.skipif(not reference_supports_window(), reason="the reference backend has no window= yet (owner: ref)")
def test_sliding_window_layers_decode_with_their_cache_like_sdpa(rng):
    """Gemma3's sliding layers keep only recent keys in the cache: their positions count back from the query."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                           layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64)
    model = Gemma3ForCausalLM(cfg).eval()
    ids = torch.randint(3, 128, (1, 12), generator=rng)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    switch(model, DilatedAttentionConfig(segment_lengths=[64], dilation_rates=[1], layers=[1], backend="torch"))
    assert torch.equal(model.generate(ids, **kw), want)


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that read tensor values on the host (a device sync on GPU): .item(), bool(), torch.equal."""

    READS = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._schema.name in self.READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cache_len", [64, 4096])
def test_decoding_step_mask_and_layout_read_nothing_on_the_host(cache_len):
    """Per decoding step the mask function and the layout read no value on the host, whatever the cache length,
    and build nothing of the cache's length (the layout keeps (base, lo, hi) per row)."""
    from hf_dilated.integrations.transformers import dilated_mask
    from hf_dilated.ops.layout import resolve_layout

    filled = cache_len // 2
    for q_offset in (filled, torch.tensor(filled)):  # DynamicCache passes an int, StaticCache a tensor
        with HostReads() as reads:
            mask = dilated_mask(2, 1, cache_len, q_offset=q_offset, kv_offset=0, attention_mask=None)
        assert reads.count == 0 and mask.tolist() == [filled + 1] * 2
        with HostReads() as reads:
            layout = resolve_layout(2, 1, cache_len, "cpu", attention_mask=mask,
                                    position_ids=torch.full((2, 1), filled))
        assert reads.count == 0 and layout.keys.tolist() == [[0, 0, filled + 1]] * 2
    with HostReads() as reads:
        layout = resolve_layout(2, 64, 64, "cpu")
        resolve_layout(2, 1, cache_len, "cpu")
    assert reads.count == 0 and layout.contiguous


def test_block_sparse_reads_the_static_cache_lengths_of_the_shared_mask_function(rng):
    """``"block_sparse"`` shares ``dilated_mask``: a static cache's ``[B]`` filled lengths decode like the full forward."""
    model = tiny_llama()
    model.set_attn_implementation("block_sparse")
    ids = torch.randint(0, 128, (1, 40), generator=rng)
    with torch.no_grad():
        full = model(ids).logits
        cache = StaticCache(config=model.config, max_cache_len=64)
        outs = [model(ids[:, :30], past_key_values=cache, use_cache=True).logits]
        outs += [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(30, 33)]
    torch.testing.assert_close(torch.cat(outs, 1), full[:, :33], rtol=1e-4, atol=1e-4)
