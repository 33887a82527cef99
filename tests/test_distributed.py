"""Sequence-parallel dilated attention (hf_dilated.distributed) against the single-process op, on CPU with gloo.

Each world size forks its ranks once (module fixtures) and runs every case there; the tests compare each rank's
shard of the output and of every gradient with the op run in this process on the gathered sequence.
"""

from __future__ import annotations

import datetime
import io
import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hf_dilated
from hf_dilated.config import DENSE_SEGMENT
from hf_dilated.distributed import dilated_ring_attention, head_offset, set_head_parallel_group
from hf_dilated.distributed.sharding import shard_batch, shard_range, shard_sizes
from naive import rel_err

PG_TIMEOUT_S = 5


# ---- a forked process group ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, queue, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        buffer = io.BytesIO()  # plain bytes: tensors in shared memory would die with this process
        torch.save(fn(rank, world, *args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report every failure to the parent, then exit
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, world: int, *args, timeout: float = 60.0) -> list[tuple[str, object]]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked gloo ranks; ``[(status, value or traceback)]`` by rank."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, queue, args)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            rank, status, value = queue.get(timeout=max(deadline - time.monotonic(), 0.1))
            results[rank] = (status, torch.load(io.BytesIO(value)) if status == "ok" else value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


# ---- cases ---------------------------------------------------------------------------------------------------------
def _packed_positions(n: int, starts: list[int]) -> torch.Tensor:
    pos = torch.empty(n, dtype=torch.long)
    bounds = starts + [n]
    for a, b in zip(bounds, bounds[1:]):
        pos[a:b] = torch.arange(b - a)
    return pos


# name: (B, Hq, Hk, N, branches, causal, packed sequence starts or None, head_offset, left padding per row or None)
CASES = {
    "inside_shards": (2, 4, 2, 32, ((4, 1), (8, 2)), True, None, 0, None),
    "spanning_ragged": (1, 4, 2, 35, ((4, 1), (12, 2), (24, 4)), True, None, 0, None),
    "spanning_bidirectional_gqa": (2, 4, 1, 33, ((4, 1), (12, 2), (24, 4)), False, None, 0, None),
    "whole_sequence": (1, 4, 4, 30, ((8, 1), (64, 4)), False, None, 0, None),
    "packed_head_offset": (1, 4, 2, 37, ((4, 1), (8, 2), (16, 4)), True, [0, 7, 18, 19], 3, None),
    "packed_bidirectional": (1, 4, 2, 37, ((4, 1), (16, 4)), False, [0, 9, 20], 1, None),
    "padded_rows": (2, 4, 2, 30, ((4, 1), (8, 2)), True, None, 0, [5, 0]),
    "dense_layer": (1, 4, 2, 29, ((DENSE_SEGMENT, 1),), True, None, 0, None),
}
# Global tokens (SPEC.md): every query also reads its sequence's first g positions, wherever their owner rank is.
GLOBAL = {"global_spanning": 3, "global_packed_bidirectional": 2, "global_padded": 4}
CASES.update({
    "global_spanning": (1, 4, 2, 35, ((4, 1), (12, 2), (24, 4)), True, None, 0, None),
    "global_packed_bidirectional": (1, 4, 2, 37, ((4, 1), (16, 4)), False, [0, 9, 20], 1, None),
    "global_padded": (2, 4, 2, 30, ((4, 1), (8, 2)), True, None, 0, [5, 0]),
})
WORLD_CASES = {2: list(CASES), 4: ["spanning_ragged", "spanning_bidirectional_gqa", "packed_head_offset", "dense_layer",
                                   "global_spanning", "global_packed_bidirectional"]}


def _inputs(name, gen, dtype=torch.float64, head_dim=8):
    B, Hq, Hk, N, branches, causal, starts, off, pad = CASES[name]
    q = torch.randn(B, Hq, N, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(B, Hk, N, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(B, Hk, N, head_dim, generator=gen, dtype=dtype)
    g = torch.randn(B, Hq, N, head_dim, generator=gen, dtype=dtype)
    pos = None if starts is None else _packed_positions(N, starts)[None].expand(B, N).contiguous()
    mask = None
    if pad is not None:
        mask = torch.ones(B, N, dtype=torch.bool)
        for b, p in enumerate(pad):
            mask[b, :p] = False
    return dict(q=q, k=k, v=v, g=g, pos=pos, mask=mask, branches=branches, causal=causal, head_offset=off,
                global_tokens=GLOBAL.get(name, 0))


def _single(case, backend="torch"):
    q, k, v = (case[n].clone().requires_grad_() for n in "qkv")
    ws, rs = zip(*case["branches"])
    out = hf_dilated.dilated_attention(q, k, v, ws, rs, is_causal=case["causal"], position_ids=case["pos"],
                                       attention_mask=case["mask"], head_offset=case["head_offset"], backend=backend,
                                       global_tokens=case["global_tokens"])
    (out * case["g"]).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _ring_worker(rank, world, cases, backend="torch"):
    results = {}
    for name, case in cases.items():
        N = case["q"].shape[2]
        s, e = shard_range(N, world, rank)
        q, k, v = (case[n][:, :, s:e].clone().requires_grad_() for n in "qkv")
        ws, rs = zip(*case["branches"])
        mask = None if case["mask"] is None else case["mask"][:, s:e]
        mask = None if mask is not None and bool(mask.all()) else mask  # as the mask function: None when all real
        out = dilated_ring_attention(
            q, k, v, ws, rs, is_causal=case["causal"], head_offset=case["head_offset"], backend=backend,
            global_tokens=case["global_tokens"],
            position_ids=None if case["pos"] is None else case["pos"][:, s:e], attention_mask=mask,
        )
        (out * case["g"][:, :, s:e]).sum().backward()
        results[name] = (out.detach(), q.grad, k.grad, v.grad)
    return results


def _ring_results(world, seed):
    gen = torch.Generator().manual_seed(seed + world)
    cases = {name: _inputs(name, gen) for name in WORLD_CASES[world]}
    ranks = launch(_ring_worker, world, cases)
    return cases, ranks


@pytest.fixture(scope="module")
def ring2():
    from conftest import SEED

    return _ring_results(2, SEED)


@pytest.fixture(scope="module")
def ring4():
    from conftest import SEED

    return _ring_results(4, SEED)


def _check(cases, ranks, name, tol=1e-10):
    for status, value in ranks:
        assert status == "ok", value
    want = _single(cases[name])
    for i, what in enumerate(("output", "dq", "dk", "dv")):
        got = torch.cat([value[name][i] for _, value in ranks], 2)
        assert got.shape == want[i].shape
        assert not torch.isnan(got).any()
        assert rel_err(got, want[i]) < tol, f"{name}: {what} differs by {rel_err(got, want[i]):.2e}"


@pytest.mark.parametrize("name", WORLD_CASES[2])
def test_two_ranks_match_single_process(ring2, name):
    _check(*ring2, name)


@pytest.mark.parametrize("name", WORLD_CASES[4])
def test_four_ranks_match_single_process(ring4, name):
    _check(*ring4, name)


def _count_kernel_calls(rank, world, cases):
    from hf_dilated.ops.triton import launch as kernels

    calls = []
    for fn in ("forward", "backward", "decode"):
        original = getattr(kernels, fn)

        def counted(*a, _fn=fn, _orig=original, **kw):
            calls.append(_fn)
            return _orig(*a, **kw)

        setattr(kernels, fn, counted)
    return _ring_worker(rank, world, cases, backend="triton"), calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs scripts/bench_ring.py checks the kernels over NCCL")
def test_triton_backend_on_two_ranks(rng):
    """The kernels (Triton interpreter on CPU) address the key window in place: they run, and match."""
    case = _inputs("packed_head_offset", rng, dtype=torch.float32, head_dim=16)
    ranks = launch(_count_kernel_calls, 2, {"case": case}, timeout=120)
    for status, value in ranks:
        assert status == "ok", value
        assert "backward" in value[1] and ({"forward", "decode"} & set(value[1])), value[1]
    want = _single(case, backend="torch")
    for i in range(4):
        got = torch.cat([value[0]["case"][i] for _, value in ranks], 2)
        assert rel_err(got, want[i]) < 1e-5


# ---- errors: mismatched ranks, a dying peer ------------------------------------------------------------------------
def _mismatch_worker(rank, world, what):
    q = torch.randn(1, 4, 8, 8)
    k = v = torch.randn(1, 2, 8, 8)
    kwargs = dict(is_causal=True)
    ws, rs = [4, 8], [1, 2]
    if rank == 1 and what == "is_causal":
        kwargs["is_causal"] = False
    if rank == 1 and what == "branches":
        ws, rs = [4, 16], [1, 2]
    if rank == 1 and what == "heads":
        q = torch.randn(1, 2, 8, 8)
    try:
        dilated_ring_attention(q, k, v, ws, rs, backend="torch", **kwargs)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("what,named", [("is_causal", "is_causal"), ("branches", "branches"), ("heads", "query heads")])
def test_ranks_that_disagree_raise(what, named):
    ranks = launch(_mismatch_worker, 2, what)
    for status, message in ranks:
        assert status == "ok", message
        assert message is not None and named in message and "rank 1" in message, message


def _dying_worker(rank, world):
    if rank == 1:
        raise RuntimeError("rank 1 fails before attention")
    t0 = time.monotonic()
    q = torch.randn(1, 2, 8, 8)
    try:
        dilated_ring_attention(q, q, q, [4], [1], backend="torch")
    except Exception as err:  # gloo: peer closed, or the process-group timeout
        return time.monotonic() - t0, repr(err)
    return None


def test_a_failing_rank_makes_the_others_fail_within_the_timeout():
    (status0, value0), (status1, value1) = launch(_dying_worker, 2, timeout=30)
    assert status1 == "error" and "rank 1 fails" in value1
    assert status0 == "ok" and value0 is not None, value0
    elapsed, message = value0
    assert elapsed < PG_TIMEOUT_S + 5, (elapsed, message)


# ---- sharding -------------------------------------------------------------------------------------------------------
def test_shard_sizes_are_contiguous_and_even():
    assert shard_sizes(10, 4) == [3, 3, 2, 2]
    assert shard_range(10, 4, 1) == (3, 6) and shard_range(10, 4, 3) == (8, 10)
    with pytest.raises(ValueError, match="3 tokens over 4 ranks"):
        shard_sizes(3, 4)


def test_shard_batch_shifts_labels_before_splitting():
    ids = torch.arange(10)[None]
    labels = ids.clone()
    labels[0, 4] = -100
    parts = [shard_batch({"input_ids": ids, "labels": labels}, rank=r, world_size=3) for r in range(3)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), ids)
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], 1), ids)
    shifted = torch.cat([p["shift_labels"] for p in parts], 1)
    assert shifted[0].tolist() == [1, 2, 3, -100, 5, 6, 7, 8, 9, -100]
    assert torch.equal(parts[1]["labels"], parts[1]["shift_labels"])


# ---- a training step of a tiny Llama -------------------------------------------------------------------------------
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
LLAMA_BRANCHES = {"segment_lengths": [4, 8, 16], "dilation_rates": [1, 2, 4], "layers": [0],  # layer 1 dense
                  "global_tokens": 2}


def _tiny_llama(attn):
    from hf_dilated import assets

    model = assets.tiny_llama(seed=0, **LLAMA).double()
    model.config.dilated_attention = dict(LLAMA_BRANCHES)
    model.set_attn_implementation(attn)
    return model


def _llama_batches(gen):
    """A packed row (position_ids restart, no label across a boundary, as DataCollatorWithFlattening makes it) and a
    right-padded batch of two rows (attention_mask, labels -100 on padding)."""
    N = 31
    ids = torch.randint(0, LLAMA["vocab_size"], (1, N), generator=gen)
    labels = ids.clone()
    labels[0, [0, 12, 20]] = -100
    packed = {"input_ids": ids, "position_ids": _packed_positions(N, [0, 12, 20])[None], "labels": labels}
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 27), generator=gen)
    mask = torch.ones(2, 27, dtype=torch.long)
    mask[1, 20:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"packed": packed, "padded": {"input_ids": ids, "attention_mask": mask, "labels": labels}}


def _llama_worker(rank, world, batches):
    from hf_dilated.integrations import dilated_ring as ring_tf
    from hf_dilated.distributed.sharding import all_reduce_gradients, global_num_items, reduce_loss

    ring_tf.register()
    results = {}
    for name, batch in batches.items():
        model = _tiny_llama("dilated_ring")
        model.train()
        local = shard_batch(batch)
        out = model(**local, num_items_in_batch=global_num_items(local["shift_labels"]), use_cache=False)
        out.loss.backward()
        all_reduce_gradients(model.parameters())
        results[name] = float(reduce_loss(out.loss)), {n: p.grad for n, p in model.named_parameters()}
    return results


def test_llama_training_step_matches_single_process(rng):
    """A packed and a padded batch through a Llama with a dilated and a dense layer: the sharded step's loss and
    every parameter gradient equal the single-process step's."""
    batches = _llama_batches(rng)
    ranks = launch(_llama_worker, 2, batches, timeout=120)
    for status, value in ranks:
        assert status == "ok", value
    for name, batch in batches.items():
        model = _tiny_llama("dilated")
        model.train()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        for _, value in ranks:
            got_loss, grads = value[name]
            # float64 model; Transformers' loss upcasts logits "to float" (float32): float32 tolerances
            assert abs(got_loss - loss.item()) < 1e-6 * abs(loss.item()), name
            for param, p in model.named_parameters():
                assert rel_err(grads[param], p.grad) < 1e-5, (name, param)


# ---- head parallelism (Ulysses): a slice of heads with its global offset ------------------------------------------
def test_head_slices_with_global_offsets_equal_the_full_op(rng):
    q = torch.randn(2, 8, 40, 8, generator=rng, dtype=torch.float64)
    k = torch.randn(2, 4, 40, 8, generator=rng, dtype=torch.float64)
    v = torch.randn(2, 4, 40, 8, generator=rng, dtype=torch.float64)
    ws, rs = [4, 8, 16], [1, 2, 4]
    full = hf_dilated.dilated_attention(q, k, v, ws, rs, backend="torch")
    for parts in (2, 4):
        hq, hk = 8 // parts, 4 // parts
        slices = [
            hf_dilated.dilated_attention(q[:, i * hq : (i + 1) * hq], k[:, i * hk : (i + 1) * hk],
                                         v[:, i * hk : (i + 1) * hk], ws, rs, head_offset=i * hq, backend="torch")
            for i in range(parts)
        ]
        assert rel_err(torch.cat(slices, 1), full) < 1e-12
    # Local indices would be wrong: the offset matters.
    wrong = torch.cat([hf_dilated.dilated_attention(q[:, i * 2 : (i + 1) * 2], k[:, i : i + 1],
                                                    v[:, i : i + 1], ws, rs, backend="torch")
                       for i in range(4)], 1)
    assert rel_err(wrong, full) > 1e-3


def test_head_offset_needs_a_head_parallel_group_when_heads_are_split():
    assert head_offset(8, 8) == 0
    with pytest.raises(ValueError, match="set_head_parallel_group"):
        head_offset(4, 8)


def _deepspeed_worker(rank, world, q, k, v, ws, rs):
    import sys

    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    # DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce (a C++ build) at init; Ulysses only needs
    # all_to_all_single, so skip that build.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    set_head_parallel_group(dist.group.WORLD)

    def local_attention(query, key, value):  # DeepSpeed's layout [N, B, H / P, D]
        to_bhnd = lambda t: t.permute(1, 2, 0, 3)
        off = head_offset(query.shape[2], q.shape[1])
        out = hf_dilated.dilated_attention(to_bhnd(query), to_bhnd(key), to_bhnd(value), ws, rs,
                                           head_offset=off, backend="torch")
        return out.permute(2, 0, 1, 3)

    attn = DistributedAttention(local_attention, dist.group.WORLD, scatter_idx=2, gather_idx=0)
    s, e = shard_range(q.shape[2], world, rank)
    as_snhd = lambda t: t[:, :, s:e].permute(2, 0, 1, 3).contiguous()
    out = attn(as_snhd(q), as_snhd(k), as_snhd(v), 1)
    return out.permute(1, 2, 0, 3)


def test_deepspeed_ulysses_with_dilated(rng):
    """DeepSpeed's Ulysses wrapper hands each rank all tokens of a slice of heads; the global offset keeps it exact."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    q = torch.randn(1, 4, 24, 8, generator=rng, dtype=torch.float64)
    k = torch.randn(1, 2, 24, 8, generator=rng, dtype=torch.float64)
    v = torch.randn(1, 2, 24, 8, generator=rng, dtype=torch.float64)
    ws, rs = [4, 8], [1, 2]
    ranks = launch(_deepspeed_worker, 2, q, k, v, ws, rs, timeout=120)
    for status, value in ranks:
        assert status == "ok", value
    got = torch.cat([value for _, value in ranks], 2)
    assert rel_err(got, hf_dilated.dilated_attention(q, k, v, ws, rs, backend="torch")) < 1e-12


# ---- the cost model counts what the plans exchange ------------------------------------------------------------------
@pytest.mark.parametrize("causal,shift,hq,hk", [(True, 0, 16, 16), (True, 40, 8, 2), (False, 40, 16, 4)])
def test_cost_model_counts_the_rows_the_plans_exchange(causal, shift, hq, hk):
    from hf_dilated.distributed import cost_model
    from hf_dilated.distributed.dilated_ring import build_plan, shard_lengths_and_starts
    from hf_dilated.ops.layout import resolve_layout

    N, P, branches = 999, 3, ((16, 1), (64, 4), (256, 16))
    layout = resolve_layout(1, N, N, "cpu", None, (torch.arange(N) + shift)[None])
    starts = shard_lengths_and_starts(shard_sizes(N, P))
    exchanged = 0
    for rank in range(P):
        plan = build_plan(layout, starts, rank, branches, causal, hq, hk, 0)
        got = {j: n for j, n in enumerate(plan.recv_splits) if n}
        assert got == cost_model.rows_received(N, P, rank, branches, hq, hk, causal, shift)
        assert sum(plan.send_splits) == sum(
            cost_model.rows_received(N, P, j, branches, hq, hk, causal, shift).get(rank, 0) for j in range(P))
        exchanged += sum(plan.recv_splits)
    assert exchanged > 0
    # Each query reaches at most w / r keys per branch.
    pairs = sum(cost_model.pairs_computed(N, P, r, branches, hq, causal, shift) for r in range(P))
    assert 0 < pairs <= N * hq * sum(w // r for w, r in branches)
    assert cost_model.predict(2**20, 8, shift=16384).step_s > 0
