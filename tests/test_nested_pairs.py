"""Nested branches computed once per (query, key) pair (``launch.Problem.nesting``): where every branch's segment
length and rate divide the next one's, the kernels skip a branch's pairs that a lower branch has and weight each pair
by the branches that have it. The result must be SPEC's function exactly: the float64 oracle (tests/naive.py, which
sums every branch apart) for the output and every gradient, and the same as the kernels with nesting off."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("triton")

from hf_dilated.ops import TokenLayout  # noqa: E402
from hf_dilated.ops.triton import launch  # noqa: E402
from hf_dilated.ops.triton.schedule import NEST_COLUMNS  # noqa: E402
from hf_dilated.ops.triton.tuning import LONGNET  # noqa: E402
from naive import rel_err  # noqa: E402
from test_triton_kernels import TOL, _gpu_skip, check_op, cpu, make_qkv  # noqa: E402


def problem(branches, **kw):
    return launch.Problem(tuple(branches), kw.pop("is_causal", True), 0.1, 0, **kw)


def test_nesting_rows_of_longnet():
    rows = problem(LONGNET).nesting()
    pad = (0,) * NEST_COLUMNS
    assert rows == tuple((below, len(hi), *hi) + pad[: NEST_COLUMNS - 2 - len(hi)]
                         for below, hi in [(0, [2, 4, 8, 16]), (2048, [4, 8, 16]), (4096, [8, 16]),
                                           (8192, [16]), (16384, [])])
    assert problem(LONGNET, global_tokens=4).nesting()[-1] == pad  # the global-token branch: plain, weight 1


@pytest.mark.parametrize("branches, kw", [
    (LONGNET, dict(is_causal=False)),  # bidirectional: a query's kept keys would lie on both sides
    (LONGNET, dict(window=100)),
    (LONGNET, dict(dropout_p=0.1)),
    ([(2048, 1)], {}),  # one branch: nothing to share
    ([(8, 2), (16, 1)], {}),  # rates that do not divide
    ([(8, 1), (12, 2)], {}),  # segment lengths that do not divide
])
def test_nesting_off_where_it_does_not_apply(branches, kw):
    assert problem(branches, **kw).nesting() is None


def test_nesting_switch(monkeypatch):
    monkeypatch.setattr(launch, "NESTED_PAIRS", False)
    assert problem(LONGNET).nesting() is None


def _counted(kind):
    return launch.LAUNCHES[kind]


@cpu
@pytest.mark.parametrize("branches, N, global_tokens, head_offset", [
    ([(8, 1), (16, 2), (32, 4)], 70, 0, 1),  # segments cut short at the end
    ([(8, 1), (8, 2), (24, 4), (48, 8)], 53, 3, 2),  # an equal segment length (a branch with no pair of its own), a
    # segment three times the one below, and the global-token branch
    ([(4, 1), (8, 2), (16, 4), (32, 8), (64, 16)], 64, 0, 5),  # LongNet's shape: 1 / 2 / ... / 16
])
def test_nested_against_the_oracle(rng, branches, N, global_tokens, head_offset):
    q, k, v = make_qkv(rng, 1, 4, 2, N, N, 16, torch.float32, "cpu")
    before = Counter(launch.LAUNCHES)
    check_op(q, k, v, branches, TOL[torch.float32], head_offset=head_offset, global_tokens=global_tokens)
    assert _counted("forward_nested") > before["forward_nested"], "the forward did not take the nested pairs"
    assert _counted("backward_nested") > before["backward_nested"], "the backward did not take the nested pairs"


@cpu
def test_nested_padding_half_precision(rng):
    """Left padding (positions counted from each sequence's first real token) in bfloat16."""
    B, N = 2, 40
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, :13] = False
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    seq = torch.zeros(B, N, dtype=torch.long)
    layout = TokenLayout(pos, seq, pos, seq, mask, mask, False)
    q, k, v = make_qkv(rng, B, 4, 4, N, N, 16, torch.bfloat16, "cpu")
    before = Counter(launch.LAUNCHES)
    check_op(q, k, v, [(4, 1), (8, 2), (16, 4)], TOL[torch.bfloat16], layout=layout, head_offset=1)
    assert _counted("forward_nested") > before["forward_nested"]


@cpu
def test_nested_equals_every_pair_per_branch(rng, monkeypatch):
    """The same function with nesting off (every branch all its pairs, merged by log-sum-exp)."""
    import hf_dilated

    branches = [(8, 1), (16, 2), (32, 4)]
    q, k, v = make_qkv(rng, 1, 4, 2, 64, 64, 16, torch.float32, "cpu")
    grad = torch.randn(q.shape, generator=rng)
    outs = []
    for nested in (True, False):
        monkeypatch.setattr(launch, "NESTED_PAIRS", nested)
        before = Counter(launch.LAUNCHES)
        out = hf_dilated.dilated_attention(q, k, v, [w for w, _ in branches], [r for _, r in branches],
                                           backend="triton")
        outs.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
        assert (_counted("forward_nested") > before["forward_nested"]) == nested
    for a, b in zip(*outs):
        assert rel_err(a, b) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_nested_longnet_shape(rng, dtype, D):
    """LongNet's rates 1..16 on segments 256..4096, GQA, a head offset and the global-token branch."""
    _gpu_skip()
    q, k, v = make_qkv(rng, 1, 8, 2, 5000, 5000, D, dtype, "cuda")
    before = Counter(launch.LAUNCHES)
    check_op(q, k, v, [(256, 1), (512, 2), (1024, 4), (2048, 8), (4096, 16)], TOL[dtype], head_offset=3,
             global_tokens=2)
    assert _counted("forward_nested") > before["forward_nested"]
    # the warp-specialized dK/dV that adds dQ (bf16 / fp16 at head dim 128) nests too (launch._nests_dkdv)
    assert _counted("backward_nested") > before["backward_nested"]


@pytest.mark.parametrize("branches, aligned", [
    (LONGNET, True),  # each branch's segments of the branch below: 1024 of its dilated rows
    ([(256, 1), (512, 2), (1024, 4), (2048, 8), (4096, 16)], True),  # 128 rows
    ([(64, 1), (128, 2), (256, 4)], False),  # 32 rows: a Gluon tile would straddle them
    ([(16, 1), (64, 32)], False),  # shorter than the rate: each row of a tile in another segment
])
def test_gluon_takes_nesting_where_tiles_align(branches, aligned):
    """The Gluon kernels nest only where no tile straddles the segments of the branch below (they have no mask for
    it); the portable kernels nest wherever the branches do."""
    pb = problem(branches)
    assert launch._nests(pb, "cpu")[1]
    assert launch._nests(pb, "cpu", gluon=True)[1] == aligned


def test_gluon_takes_nesting_where_items_start_at_segment_starts():
    """A cache's tail of queries (decoding, chunked prefill) starts inside a segment: a Gluon tile of its rows could
    straddle a segment of the branch below, so those kernels take every pair there; the portable ones mask per pair."""
    from hf_dilated.ops.triton.schedule import RunPlan

    pb = problem(LONGNET)
    whole = RunPlan(torch.tensor([[0, 0, 0, 100, 0, 0, 100]]), False)
    tail = RunPlan(torch.tensor([[0, 0, 60, 40, 0, 0, 100]]), False)  # the last 40 of 100 positions query
    assert whole.from_start and not tail.from_start
    assert launch._nests(pb, "cpu", True, whole)[1]
    assert not launch._nests(pb, "cpu", True, tail)[1]
    assert launch._nests(pb, "cpu", False, tail)[1]


def test_which_dkdv_launches_take_nested_pairs(monkeypatch):
    """Every Gluon dK/dV launch takes nested pairs but the one-program launch that adds dQ (``HF_DILATED_WS_DKDV=0``),
    whose wgmma ptxas serializes nested; the warp-specialized one that adds dQ (the default at head dim 128, and 64
    from 64K keys) nests, its weights made before its partitions split (``backward_hopper._nest_rows``)."""
    backward_hopper = pytest.importorskip("hf_dilated.ops.triton.backward_hopper")
    if backward_hopper.gluon is None:
        pytest.skip("this Triton has no Gluon")
    assert launch._nests_dkdv(None)  # dQ has kernels of its own
    assert all(launch._nests_dkdv(cfg) for d in (64, 128, 256) for cfg in backward_hopper.dkdv_launch_configs(d))
    for d in (64, 128):
        ws = backward_hopper.fused_dq_launch_config(d, 65536)
        assert ws["FUSED_DQ"] and launch._nests_dkdv(ws), ws
    monkeypatch.setenv("HF_DILATED_WS_DKDV", "0")
    one = backward_hopper.fused_dq_launch_config(128, 65536)
    assert one["FUSED_DQ"] and not launch._nests_dkdv(one), one


@pytest.mark.parametrize("global_tokens", [0, 4])
def test_keyed_rates_name_the_rows_nested_launches_write(global_tokens):
    """The Gluon forward's nested launches before the last skip their tiles whose rows keep no key of the branch, so
    a later launch resumes only rows an earlier one wrote: ``(r, w, below)`` per launch in launch order, and a row
    ``p`` (of the launch's offset class) is written iff ``below`` is 0 or ``p % w >= below``. Checked against the rule
    itself: some key of the row's class in its segment lies before the row's segment of the branch below."""
    pb = problem(LONGNET, global_tokens=global_tokens)
    branches = pb.kernel_branches()
    order = [(i, r, None) for i, (_, r, _) in enumerate(branches) if i] + [(0, 1, None)]
    table = launch._keyed_rates(pb, order, "cpu").view(-1, 3).tolist()
    assert [(r, w) for r, w, _ in table] == [(branches[i][1], branches[i][0]) for i, _, _ in order]
    for r, w, below in table:
        for p in range(0, 3 * 32768, 97):
            start = p - p % w
            limit = p - p % below if below else p + 1  # tiles.nest_limit
            keeps = start + (p - start) % r < limit  # the first key of p's class in its segment
            assert (below == 0 or p % w >= below) == keeps, (r, w, below, p)


@cpu
def test_nested_queries_from_a_cache_tail(rng):
    """Fewer queries than keys (a prefill chunk after a cache): the queries start inside segments, the portable
    kernels' per-pair rule keeps exactly the nested pairs."""
    q, k, v = make_qkv(rng, 1, 4, 2, 70, 100, 16, torch.float32, "cpu")
    before = Counter(launch.LAUNCHES)
    check_op(q, k, v, [(8, 1), (16, 2), (32, 4)], TOL[torch.float32], head_offset=1)
    assert _counted("forward_nested") > before["forward_nested"]
