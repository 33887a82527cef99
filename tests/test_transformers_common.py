"""Transformers' common model checks, run against ``attn_implementation="dilated"`` (degenerate config = dense).

The checks of Transformers' ``tests/test_modeling_common.py`` cannot be run from here: the installed wheel ships no
``tests/``, and the PyPI sdist of the same version ships ``tests/test_modeling_common.py`` without the packages it
imports (``tests/generation``, ``tests/exporters``) or the model testers (``tests/models/llama``, ``.../bert``).
These are our equivalents, stricter where the originals are lenient (every real token of every row is compared, not
80% of the batch): eager vs dilated inference with left and right padding and with random masks that have holes,
``output_attentions``, and a training step (dropout in train mode, none in eval), on a tiny Llama (causal, GQA) and
a tiny BERT (bidirectional encoder). Differences on purpose (SPEC.md): padding queries give 0 (eager: an average of
whatever it attends), and attention weights are never returned (``None``, with one warning, as sdpa does).
"""

import inspect

import logging

import pytest
import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

from hf_dilated import ATTENTION_NAME, DilatedAttentionConfig
from hf_dilated.ops.reference import dilated_attention_reference

DEGENERATE = DilatedAttentionConfig(segment_lengths=[512], dilation_rates=[1], backend="torch")
B, N = 3, 19


def tiny_llama(**overrides):
    cfg = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, attention_dropout=0.1)
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def tiny_bert(**overrides):
    cfg = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=512, attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.0)
    cfg.update(overrides)
    return BertModel(BertConfig(**cfg), add_pooling_layer=False)


MODELS = {"llama": tiny_llama, "bert": tiny_bert}


def output_of(model, **inputs):
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def build(name, rng, implementation):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = MODELS[name]().eval()
    DEGENERATE.save_to(model.config)
    model.set_attn_implementation(implementation)
    return model


def masks(kind, rng):
    mask = torch.ones(B, N, dtype=torch.long)
    if kind == "left":
        mask[-1, :2] = 0
    elif kind == "right":
        mask[-1, -2:] = 0
    elif kind == "holes":  # Transformers' random_attention_mask: random zeros, the last column kept
        mask = (torch.rand(B, N, generator=rng) > 0.3).long()
        mask[:, -1] = 1
    return mask


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("kind", ["none", "left", "right", "holes"])
def test_eager_matches_dilated_inference(rng, name, kind):
    model = build(name, rng, "eager")
    ids = torch.randint(3, 99, (B, N), generator=rng)
    mask = masks(kind, rng)
    with torch.no_grad():
        eager = output_of(model, input_ids=ids, attention_mask=mask)
        model.set_attn_implementation(ATTENTION_NAME)
        ours = output_of(model, input_ids=ids, attention_mask=mask)
    real = mask.bool()
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours[real], eager[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_attention_outputs_are_none_with_one_warning(rng, name, caplog):
    """As with sdpa: the call works, no weights come back (Transformers drops the ``None`` per layer), one warning."""
    model = build(name, rng, "sdpa")
    ids = torch.randint(3, 99, (B, N), generator=rng)
    logging.Logger.warning_once.cache_clear()  # Transformers' once-per-process cache
    with torch.no_grad(), caplog.at_level("WARNING"):
        sdpa = model(input_ids=ids, output_attentions=True)
        model.set_attn_implementation(ATTENTION_NAME)
        caplog.clear()
        out = model(input_ids=ids, output_attentions=True)
        model(input_ids=ids, output_attentions=True)
    assert not any(isinstance(a, torch.Tensor) for a in out.attentions)
    assert len(out.attentions) == len(sdpa.attentions)
    torch.testing.assert_close(output_of(model, input_ids=ids), out.last_hidden_state if name == "bert" else out.logits)
    assert sum("output_attentions" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("name", list(MODELS))
def test_eval_mode_drops_nothing(rng, name):
    """The models carry attention dropout 0.1: in eval mode Transformers passes dropout=0.0 and nothing is dropped."""
    model = build(name, rng, "eager")
    ids = torch.randint(3, 99, (B, N), generator=rng)
    with torch.no_grad():
        eager = output_of(model, input_ids=ids)
        model.set_attn_implementation(ATTENTION_NAME)
        torch.testing.assert_close(output_of(model, input_ids=ids), eager, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("dropout_p" not in inspect.signature(dilated_attention_reference).parameters,
                    reason="the reference backend has no dropout yet (owner: ref)")
@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_with_attention_dropout(rng, name):
    model = build(name, rng, ATTENTION_NAME).train()
    ids = torch.randint(3, 99, (B, N), generator=rng)
    mask = masks("left", rng)
    first = output_of(model, input_ids=ids, attention_mask=mask)
    second = output_of(model, input_ids=ids, attention_mask=mask)
    assert (first - second).abs().max() > 1e-5  # dropout active, a fresh draw per step
    loss = first[mask.bool()].float().pow(2).mean()
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "embed" not in n and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
