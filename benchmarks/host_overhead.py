"""Host time of one dilated-attention (or ``--op block_sparse``) call, its kernel launches replaced by no-ops (runs
on a CPU, no GPU or interpreter needed): the Python and dispatch work a GPU waits on when a problem is small, as
SmolLM2's 9/3/64 heads at 16K are (``benchmarks/NOTES_triton.md``). The launches' own cost is not in these numbers
(Triton's binding of ~35 arguments per kernel, or ``relaunch``'s key and the compiled kernel's launcher; measured on
the GPU by ``benchmarks/timeline.py``).

    python benchmarks/host_overhead.py                     # forward and forward+backward, microseconds per call
    python benchmarks/host_overhead.py --root /tmp/base    # another checkout (git archive REV hf_dilated | tar -x -C)
    python benchmarks/host_overhead.py --profile tottime   # and a cProfile of forward+backward
    python benchmarks/host_overhead.py --op block_sparse --shape 16/16/128   # the block-sparse op (local + sink blocks)
    python benchmarks/host_overhead.py --graph-replay      # what a CUDA-graph replay leaves (no steps replayed)

``--graph-replay`` stands a replayed plan's steps (``plans.Plan._run``: fills, launches, copies, the dQ stream) in
for what one CUDA-graph launch replaces on a GPU (``ops/triton/plans.py``): the host time left around them, a CPU
estimate (the graph launch itself is not in it).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

LONGNET = [(2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)]
KERNELS = ["dilated_fwd_branch_kernel", "dilated_bwd_dkdv_kernel", "dilated_bwd_dq_kernel", "delta_kernel"]
BS_KERNELS = ["bs_fwd_kernel", "bs_bwd_dq_kernel", "bs_bwd_dkdv_kernel"]


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."), help="checkout to measure")
    ap.add_argument("--shape", default="9/3/64", help="H/Hk/D")
    ap.add_argument("--n", type=int, default=64, help="tokens (small: the tensor work stays negligible)")
    ap.add_argument("--profile", choices=["tottime", "cumulative"], help="also print a cProfile of forward+backward")
    ap.add_argument("--op", choices=["dilated", "block_sparse"], default="dilated")
    ap.add_argument("--graph-replay", action="store_true",
                    help="replayed plans run no steps: the host time a CUDA-graph replay leaves (dilated op)")
    args = ap.parse_args()
    if args.graph_replay and args.op != "dilated":
        ap.error("--graph-replay applies to --op dilated (the block-sparse op records no plans)")
    sys.path.insert(0, args.root)
    import torch

    import hf_dilated
    from hf_dilated.ops import triton as triton_backend
    from hf_dilated.ops.triton import block_sparse, launch

    for name in KERNELS:
        setattr(launch, name, _NoLaunch())
    for name in BS_KERNELS:
        setattr(block_sparse, name, _NoLaunch())
    triton_backend.is_available = lambda device: True  # the launchers run on the CPU, their kernels do nothing
    try:  # launches through the stand-ins (a direct relaunch needs compiled kernels)
        from hf_dilated.ops.triton import relaunch
        relaunch.ENABLED = False
    except ImportError:  # a checkout from before round 2's session 38
        pass
    if args.graph_replay:
        from hf_dilated.ops.triton import plans
        plans.Plan._run = lambda self, *a, **k: None
    H, Hk, D = (int(x) for x in args.shape.split("/"))
    ws, rs = [w for w, _ in LONGNET], [r for _, r in LONGNET]
    q = torch.randn(1, H, args.n, D, dtype=torch.bfloat16)
    k, v = (torch.randn(1, Hk, args.n, D, dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))

    if args.op == "dilated":
        def attend(q, k, v):
            return hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton")
        launches = launch.LAUNCHES
    else:  # the op on resolved layouts, as a patched model's layers call it (the layout built once per forward)
        from hf_dilated.ops.block_sparse import global_blocks, local_blocks, union
        from hf_dilated.ops.block_sparse.op import block_sparse_op
        from hf_dilated.ops.layout import resolve_layout

        b = 16
        lay = union(local_blocks(-(-args.n // b), b, 2), global_blocks(-(-args.n // b), b, 1))
        tokens = resolve_layout(1, args.n, args.n, q.device)

        def attend(q, k, v):
            return block_sparse_op(q, k, v, lay, tokens, True, D ** -0.5)[0]
        launches = block_sparse.LAUNCHES

    def forward():
        with torch.no_grad():
            return attend(q, k, v)

    def forward_backward():
        out = attend(qq, kk, vv)
        return torch.autograd.grad(out, (qq, kk, vv), do)

    for name, fn in (("fwd", forward), ("fwdbwd", forward_backward)):
        for _ in range(5):
            fn()
        rounds = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            rounds.append((time.perf_counter() - t0) / 50 * 1e6)
        print(f"{name}: min {min(rounds):.0f} us, median {sorted(rounds)[3]:.0f} us host per call "
              f"({args.op}, {args.shape}, N={args.n}, kernels no-op{', replays stubbed' if args.graph_replay else ''})")
    if not (launches["forward"] and launches["backward"]):
        raise SystemExit("the Triton launchers did not run: the numbers above are of another path")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            forward_backward()
        prof.disable()
        pstats.Stats(prof).sort_stats(args.profile).print_stats(40)


if __name__ == "__main__":
    main()
