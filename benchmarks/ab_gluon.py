"""A/B of a Gluon kernel on one Hopper GPU against the portable Triton one, in one process, interleaved over rounds
(``HF_DILATED_GLUON=0`` selects the portable kernels; everything else is the same code). ``--switch fused_dq``: the
dilated backward's dK/dV launch that adds dQ (``HF_DILATED_FUSED_DQ=1``) against the Gluon dK/dV and dQ kernels.
``--switch ws``: the warp-specialized kernels (``HF_DILATED_WS=1``: the forward at head dim 128, the block-sparse dQ)
against the one-warpgroup Gluon forward and the portable block-sparse dq. ``--switch ws_dkdv``: the warp-specialized
fused dK/dV (``HF_DILATED_WS_DKDV=1``, head dim 128) against the fused dK/dV of one 8-warp program.
``--switch persistent``: the warp-specialized forward's persistent programs (``HF_DILATED_PERSISTENT=1``, one per SM)
against one segment item a program (bit-identical: the same tiles). ``--switch relaunch``: the kernels relaunched
directly (``ops/triton/relaunch.py``) against Triton's own launch of every call (the same kernels, bit for bit; a host
time change, so it shows where the host sets the pace: small heads, 16K). ``--switch parts``: the forward's branch
launches but the last as one launch over the parts (``launch.Parts``, ``HF_DILATED_PARTS=1``) against a launch per
branch (the merges in another order: held to 1e-2). ``--switch nested``: nested branches computed once per (query,
key) pair (``launch.Problem.nesting``, ``HF_DILATED_NESTED=1``) against every branch's pairs (held to 1e-2).
Interleaved in one process, as here, is
how to measure a host-time change: the lent host's speed drifts between runs by more than such a change.

- ``--op dilated``: ``launch.forward`` / ``launch.backward`` (``ops/triton/forward_hopper.py``,
  ``backward_hopper.py``), LongNet branches w = 2048..32768, r = 1..16 (the attention benchmark's), causal.
- ``--op block_sparse``: ``block_sparse.forward`` / ``backward`` (``ops/triton/block_sparse_hopper.py``) on
  ``scripts/bench_block_sparse.py``'s layout (a 2K local window, the sink block, LongNet-style dilated blocks).
- ``--pass forward`` or ``backward`` (the backward's Gluon kernels: dK/dV, and for the dilated op dQ too; at head
  dim 256 the dilated backward has the Gluon dQ alone).

bf16; cases cover the benchmarks' H 16 / D 128 shape, GQA 32 / 8 and SmolLM2's 9 / 3 heads at D 64, or
``--shapes H/Hk/D ...`` at ``--seqlens`` (default 16K and 64K), e.g. ``--shapes 8/2/256`` for Gemma-style heads.

    python benchmarks/ab_gluon.py --op dilated --pass forward --out benchmarks/results

Each case first compares the two kernels' results: the backward's gradients must be bit-identical (the Gluon dK/dV
and dQ sum the same products in the same order; a dQ that the fused dK/dV launch summed, in no fixed order, is held to
SPEC's 1e-2 under every switch: ``agree``); the forward's outputs agree to the last bf16 bit (the Gluon forward's
128-key steps move the running maximum less often; with 64-key steps they are bit-identical) and are checked at
SPEC's 1e-2. Then it times the pass with ``triton.testing.do_bench`` (median) for each kernel in every round. Writes
``ab_<switch>_<pass>-<op>-<GPU>-<date>.json``; exits 1 if results differ."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_dilated.environment import run_environment  # noqa: E402
from hf_dilated.ops.triton import launch, relaunch  # noqa: E402
from hf_dilated.ops.layout import resolve_layout  # noqa: E402

CASES = ((16384, 16, 16, 128), (65536, 16, 16, 128), (262144, 16, 16, 128), (65536, 32, 8, 128), (65536, 9, 3, 64))
LONGNET = ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16))


def block_sparse_backward(q, k, v, do, block: int):
    """``(backward, launch counter)`` of the block-sparse op on the benchmark's layout."""
    import bench_block_sparse as bench

    from hf_dilated.ops.triton import block_sparse

    N, H, D = q.shape[2], q.shape[1], q.shape[3]
    lay = bench.fixed_layout(N, block, q.device, num_heads=H)
    q_ptr, q_flat = lay.transposed
    t = resolve_layout(1, N, N, q.device)
    tokens = (t.q_pos, t.q_seq, t.q_valid, t.k_pos, t.k_seq, t.k_valid)
    out, lse = block_sparse.forward(q, k, v, lay.kv_count, lay.kv_index, tokens, block, True, True, D ** -0.5)
    return (lambda: block_sparse.backward(do, q, k, v, out, lse, lay.kv_count, lay.kv_index, q_ptr, q_flat, tokens,
                                          block, True, True, D ** -0.5)), block_sparse.LAUNCHES


def dilated_backward(q, k, v, do, block: int):
    """``(backward, launch counter)`` of the dilated kernels (LongNet branches, causal, contiguous)."""
    from hf_dilated.ops.triton import launch
    from hf_dilated.ops.triton.schedule import layout_runs

    N, D = q.shape[2], q.shape[3]
    layout = resolve_layout(1, N, N, q.device)
    plan, key = layout_runs(layout), ("ab", N)
    pb = launch.Problem(LONGNET, True, D ** -0.5, 0)
    valid = (layout.q_valid, layout.k_valid)
    out, lse = launch.forward(q, k, v, pb, plan, valid, key)
    return (lambda: launch.backward(do, q, k, v, out, lse, pb, plan, valid, key)), launch.LAUNCHES


def block_sparse_forward(q, k, v, do, block: int):
    """``(forward, launch counter)`` of the block-sparse op on the benchmark's layout."""
    import bench_block_sparse as bench

    from hf_dilated.ops.triton import block_sparse

    N, H, D = q.shape[2], q.shape[1], q.shape[3]
    lay = bench.fixed_layout(N, block, q.device, num_heads=H)
    t = resolve_layout(1, N, N, q.device)
    tokens = (t.q_pos, t.q_seq, t.q_valid, t.k_pos, t.k_seq, t.k_valid)
    return (lambda: block_sparse.forward(q, k, v, lay.kv_count, lay.kv_index, tokens, block, True, True,
                                         D ** -0.5)), block_sparse.LAUNCHES


def dilated_forward(q, k, v, do, block: int):
    """``(forward, launch counter)`` of the dilated kernels (LongNet branches, causal, contiguous)."""
    from hf_dilated.ops.triton import launch
    from hf_dilated.ops.triton.schedule import layout_runs

    N, D = q.shape[2], q.shape[3]
    layout = resolve_layout(1, N, N, q.device)
    plan, key = layout_runs(layout), ("ab", N)
    pb = launch.Problem(LONGNET, True, D ** -0.5, 0)
    return (lambda: launch.forward(q, k, v, pb, plan, (layout.q_valid, layout.k_valid), key)), launch.LAUNCHES


OPS = {("dilated", "backward"): dilated_backward, ("block_sparse", "backward"): block_sparse_backward,
       ("dilated", "forward"): dilated_forward, ("block_sparse", "forward"): block_sparse_forward}
# What is switched: the environment variable, the names of its "0" and "1" sides, the launch counters that show the
# "1" side ran (per pass), and whether the two sides must agree bit for bit in the backward.
SWITCHES = {
    "gluon": ("HF_DILATED_GLUON", ("portable", "gluon"),
              {"forward": ("forward_hopper", "forward_ws"), "backward": ("dkdv_hopper", "dq_hopper")}, True),
    # the warp-specialized kernels (forward; block-sparse dQ) against the one-warpgroup Gluon forward (and the
    # portable block-sparse dq): the same products in the same order
    "ws": ("HF_DILATED_WS", ("one_warpgroup", "warp_specialized"), {"forward": ("forward_ws",), "backward": ("dq_ws",)},
           True),
    # the warp-specialized forward's persistent programs (grid = SMs) against one item a program: the same tiles
    "persistent": ("HF_DILATED_PERSISTENT", ("one_item_a_program", "persistent"), {"forward": ("forward_persistent",)},
                   True),
    # dQ summed by reduce-adds in no fixed order: equal to SPEC's tolerance, not bit for bit (dK, dV are)
    "fused_dq": ("HF_DILATED_FUSED_DQ", ("separate_dq", "fused_dq"), {"backward": ("dq_fused",)}, False),
    # the warp-specialized fused dK/dV against the one-program fused dK/dV: the same products (dK, dV bit for bit),
    # dQ by reduce-adds in no fixed order
    "ws_dkdv": ("HF_DILATED_WS_DKDV", ("fused_dkdv", "warp_specialized"), {"backward": ("dkdv_ws",)}, False),
    # the compiled kernels relaunched directly against Triton's launch of every call: the same kernels; read at
    # import, so switched as relaunch.ENABLED (the "1" side counted by relaunch.DIRECT)
    "relaunch": ("HF_DILATED_RELAUNCH", ("triton_launch", "direct"), {"forward": (), "backward": ()}, True),
    # the forward's branch launches but the last as one launch over the parts against a launch per branch: float32
    # merges in another order; read at import, so switched as launch.COMPACT_PARTS
    "parts": ("HF_DILATED_PARTS", ("per_branch", "parts"), {"forward": ("forward_parts",)}, False),
    # nested branches, each (query, key) pair computed once and weighted (``launch.Problem.nesting``) against every
    # branch's pairs: other sums, held to 1e-2; read at import, so switched as launch.NESTED_PAIRS
    "nested": ("HF_DILATED_NESTED", ("every_pair", "nested"),
               {"forward": ("forward_nested",), "backward": ("backward_nested",)}, False),
}


def agree(row: dict, bitwise: bool) -> bool:
    """Whether a case's two sides agree: every result within 1e-2 of the other (relative; a NaN is a difference: the
    forward may differ in its last bf16 bits) and, ``bitwise``, bit for bit, but for the ``unordered`` ones (dQ where
    the fused dK/dV launch summed it by reduce-adds in no fixed order)."""
    close = all(math.isfinite(x) and x <= 1e-2 for x in row["rel_err"].values())
    return close and (not bitwise or all(same for n, same in row["identical"].items() if n not in row["unordered"]))


def set_switch(switch: str, flag: str) -> None:
    """Select one side (``"0"`` / ``"1"``) of ``switch`` for the launches that follow."""
    if switch == "relaunch":
        relaunch.ENABLED = flag == "1"
    elif switch == "parts":
        launch.COMPACT_PARTS = flag == "1"
    elif switch == "nested":
        launch.NESTED_PAIRS = flag == "1"
    else:
        os.environ[SWITCHES[switch][0]] = flag


def run_case(op: str, which: str, N: int, H: int, Hk: int, D: int, block: int, rounds: int,
             switch: str = "gluon") -> dict:
    from triton.testing import do_bench

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(N)
    q, do = (torch.randn(1, H, N, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, Hk, N, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    run, launches = OPS[op, which](q, k, v, do, block)
    _, (off, on), counters, _ = SWITCHES[switch]
    if switch == "relaunch":
        run()  # the first launch of each key goes through Triton on either side
        counted = lambda: relaunch.DIRECT  # noqa: E731
    else:
        counted = lambda: sum(launches[c] for c in counters[which])  # noqa: E731
    kernels = {off: "0", on: "1"}
    grads, ran = {}, {}
    fused_before = launches["dq_fused"]
    # set per call below, restored on the way out
    with (mock.patch.dict(os.environ), mock.patch.object(relaunch, "ENABLED", relaunch.ENABLED),
          mock.patch.object(launch, "COMPACT_PARTS", launch.COMPACT_PARTS),
          mock.patch.object(launch, "NESTED_PAIRS", launch.NESTED_PAIRS)):
        for name, flag in kernels.items():
            set_switch(switch, flag)
            before = counted()
            grads[name] = run()
            ran[name] = counted() > before
        if not ran[on] or ran[off]:
            raise RuntimeError(f"the kernels did not run as asked: {ran} (needs an sm_90 GPU and Gluon)")
        names = "qkv" if which == "backward" else ("out", "lse")
        pairs = list(zip(names, grads[off], grads[on]))
        row = dict(op=op, which=which, switch=switch, N=N, H=H, Hk=Hk, D=D,
                   block=block if op == "block_sparse" else None,
                   identical={n: bool(torch.equal(a, b)) for n, a, b in pairs},
                   max_abs_diff={n: float((a.float() - b.float()).abs().max()) for n, a, b in pairs},
                   rel_err={n: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                            for n, a, b in pairs},
                   ms={name: [] for name in kernels},
                   # dQ summed by the fused dK/dV launch's reduce-adds, in no fixed order: held to the tolerance, not
                   # bit for bit, whatever the switch
                   unordered=["q"] if launches["dq_fused"] > fused_before else [])
        for _ in range(rounds):
            for name, flag in kernels.items():
                set_switch(switch, flag)
                row["ms"][name].append(round(do_bench(run, warmup=25, rep=150, return_mode="median"), 4))
    med = {name: sorted(v)[len(v) // 2] for name, v in row["ms"].items()}
    row["speedup_median"] = round(med[off] / med[on], 3)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=("dilated", "block_sparse"), default="dilated")
    ap.add_argument("--pass", dest="which", choices=("forward", "backward"), default="backward")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=128, help="block-sparse layout block")
    ap.add_argument("--seqlens", type=int, nargs="*", help="only the cases of these lengths")
    ap.add_argument("--shapes", nargs="+", metavar="H/Hk/D", help="head shapes to run at --seqlens instead of the cases")
    ap.add_argument("--switch", choices=tuple(SWITCHES), default="gluon",
                    help="gluon: Gluon against portable kernels; fused_dq: the dK/dV launch that adds dQ against the "
                         "Gluon dK/dV and dQ kernels (dilated backward); ws: the warp-specialized kernels (forward "
                         "at head dim 128, block-sparse dQ) against the one-warpgroup ones; persistent: the "
                         "warp-specialized forward's persistent programs against one item a program; ws_dkdv: the "
                         "warp-specialized fused dK/dV against the one-program one (dilated backward, head dim 128); "
                         "relaunch: the kernels relaunched directly against Triton's launch of every call; parts: "
                         "the forward's branch launches but the last as one launch against a launch per branch; "
                         "nested: each (query, key) pair of nested branches once, weighted, against every branch's")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    dilated_only = ("fused_dq", "ws_dkdv", "persistent", "parts", "nested")
    if args.which not in SWITCHES[args.switch][2] or (args.switch in dilated_only and args.op != "dilated") or (
            args.switch == "ws" and args.op == "dilated" and args.which == "backward"):
        ap.error(f"--switch {args.switch} has no --op {args.op} --pass {args.which}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    cases = CASES
    if args.shapes:
        from bench_attention import parse_shape

        try:
            shapes = [parse_shape(x) for x in args.shapes]
        except ValueError as err:
            ap.error(str(err))
        cases = [(N, H, Hk, D) for N in (args.seqlens or (16384, 65536)) for H, Hk, D in shapes]
    gpu = torch.cuda.get_device_name()
    rows = []
    for N, H, Hk, D in cases:
        if args.seqlens and N not in args.seqlens:
            continue
        rows.append(run_case(args.op, args.which, N, H, Hk, D, args.block_size, args.rounds, args.switch))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    name = f"ab_{args.switch}_{args.which}-{args.op}-{gpu.replace(' ', '_')}-{datetime.date.today()}.json"
    path = os.path.join(args.out, name)
    meta = run_environment(dtype=torch.bfloat16)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, command=" ".join(sys.argv), rows=rows), f, indent=1)
    print("wrote", path)
    # same products in the same order: bit for bit
    bitwise = (args.which == "backward" or args.switch in ("ws", "persistent", "relaunch")) and SWITCHES[args.switch][3]
    differ = [(r["N"], r["H"], r["Hk"], r["D"]) for r in rows if not agree(r, bitwise)]
    if differ:
        print(f"results differ between the kernels for (N, H, Hk, D) = {differ}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
