"""``torch.compile(fullgraph=True)`` of a training step with dilated attention (issue 9, item 7).

The compiled step must trace to one graph without breaks, compile once (no recompilation per layer or per step with
the same shapes), match eager (loss and every gradient) and, once compiled, do no per-call host work that eager does
not: the layout's contiguity is decided while tracing (where values cannot be read), so the op must recognise a
contiguous layout at run time instead of rebuilding its work lists per layer and per call.
"""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

import hf_dilated
from hf_dilated import ATTENTION_NAME, DilatedAttentionConfig
from hf_dilated.ops.triton import launch, schedule

pytest.importorskip("triton")
if not torch.cuda.is_available() and not hf_dilated.ops.dilated.triton_available(torch.device("cpu")):
    pytest.skip("Triton backend needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_llama(layers=2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).to(DEVICE).train()
    DilatedAttentionConfig(segment_lengths=[8, 16, 32], dilation_rates=[1, 2, 4], backend="triton").save_to(model.config)
    model.set_attn_implementation(ATTENTION_NAME)
    return model


def train_step(model, fn, ids):
    model.zero_grad(set_to_none=True)
    loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


class WorkListBuilds:
    """Counts the work lists the Triton op builds on the host (per-item tables, and runs of non-contiguous layouts)."""

    def __init__(self, monkeypatch):
        self.count = 0
        build = schedule._build

        def counted(*args, **kwargs):
            self.count += 1
            return build(*args, **kwargs)

        monkeypatch.setattr(schedule, "_build", counted)


def test_compiled_training_step_is_one_graph_matches_eager_and_builds_nothing_per_call(rng, monkeypatch):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 40), generator=rng).to(DEVICE)
    builds = WorkListBuilds(monkeypatch)
    eager_loss, eager_grads = train_step(model, model, ids)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    train_step(model, compiled, ids)
    builds.count = 0
    launch.LAUNCHES.clear()
    loss, grads = train_step(model, compiled, ids)  # a second step with the same shapes: no recompilation
    assert builds.count == 0, "the compiled step rebuilt work lists on the host"
    ran = {k: launch.LAUNCHES[k] for k in ("forward", "backward", "reference")}
    assert ran == {"forward": 2, "backward": 2, "reference": 0}  # the kernels ran (2 layers), no fallback
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert counters["aot_autograd"]["total"] == 1 and not counters["recompiles"]
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_layers_compiled_one_by_one_share_one_graph(rng):
    """Compiling each decoder layer (the usual per-block compile) gives one graph for all layers: nothing in the
    attention function specialises on the layer index when every layer is dilated."""
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 32), generator=rng).to(DEVICE)
    torch._dynamo.reset()
    counters.clear()
    for layer in model.model.layers:
        layer.compile(fullgraph=True, backend="eager")
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["dilated", "block_sparse"])
def test_gpu_training_step_in_cuda_graphs_matches_eager(rng, kind):
    """``torch.compile(backend="cudagraphs")`` (CUDA-graph trees, what ``mode="reduce-overhead"`` adds) records a
    training step with the Triton op (bf16, head dim 128: the Gluon kernels on Hopper, the backward on two streams;
    block-sparse with the adaptive, content-chosen pattern) and replays it: no graph is skipped, the replayed step
    launches nothing from the host, and loss and gradients match eager. For small models the host, not the GPU, sets
    eager's pace (``benchmarks/NOTES_triton.md``, session 18): replaying graphs removes it."""
    from hf_dilated.ops.block_sparse import BlockSparseConfig
    from hf_dilated.ops.triton import block_sparse

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
    if kind == "dilated":
        DilatedAttentionConfig(segment_lengths=[64, 128, 256], dilation_rates=[1, 2, 4],
                               backend="triton").save_to(model.config)
        model.set_attn_implementation(ATTENTION_NAME)
        launches = launch.LAUNCHES
    else:
        BlockSparseConfig(pattern="adaptive", block_size=64, top_k=1, local_blocks=1,
                          backend="triton").save_to(model.config)
        model.set_attn_implementation("block_sparse")
        launches = block_sparse.LAUNCHES
    ids = torch.randint(0, 128, (1, 300), generator=rng).to("cuda")
    eager_loss, eager_grads = train_step(model, model, ids)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="cudagraphs")
    launches.clear()
    for _ in range(3):  # warm-up, record, replay
        train_step(model, compiled, ids)
    assert launches["forward"] and launches["backward"] and not launches["reference"]
    launches.clear()
    loss, grads = train_step(model, compiled, ids)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert not launches["forward"] and not launches["backward"], "the step launched kernels from the host: it " \
        "did not replay a graph"
    torch.testing.assert_close(loss.float(), eager_loss.float(), rtol=2e-2, atol=2e-2)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name].float(), grad.float(), rtol=5e-2, atol=5e-2,
                                   msg=lambda m: f"{name}: {m}")
