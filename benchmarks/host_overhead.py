"""Host time of one dilated-attention (or ``--op block_sparse``) call, its kernel launches replaced by no-ops (runs
on a CPU, no GPU or interpreter needed): the Python and dispatch work a GPU waits on when a problem is small, as
SmolLM2's 9/3/64 heads at 16K are (``benchmarks/NOTES_triton.md``). Triton's own launch cost (binding ~35 arguments
per kernel) is not in these numbers: ``--device cuda`` runs the real kernels on a GPU and splits each call's host time
into Triton's launch path (``JITFunction.run``: binding, specialisation, scratch, the driver's launch), the
launchers' own Python (``launch.forward`` / ``launch.backward`` less their Triton time; the dilated op) and the rest
(autograd, the custom op's dispatch, argument checks), next to the GPU's time for the same calls. cProfile cannot
split it there: it loses the frames below torch's custom-op wrapper (session 37).

    python benchmarks/host_overhead.py                     # forward and forward+backward, microseconds per call
    python benchmarks/host_overhead.py --root /tmp/base    # another checkout (git archive REV hf_dilated | tar -x -C)
    python benchmarks/host_overhead.py --profile tottime   # and a cProfile of forward+backward
    python benchmarks/host_overhead.py --op block_sparse --shape 16/16/128   # the block-sparse op (local + sink blocks)
    python benchmarks/host_overhead.py --device cuda --n 16384 --shape 9/3/64   # on a GPU: where the host time goes
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
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: kernels stubbed (the default); cuda: the real kernels on a GPU, host time split by part")
    args = ap.parse_args()
    if args.device == "cuda" and args.profile:
        ap.error("--profile is for --device cpu: on a GPU cProfile loses the frames below torch's custom-op wrapper")
    sys.path.insert(0, args.root)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU; none is available here (leave --device at cpu)")
    import hf_dilated
    from hf_dilated.ops import triton as triton_backend
    from hf_dilated.ops.triton import block_sparse, launch

    if args.device == "cpu":
        for name in KERNELS:
            setattr(launch, name, _NoLaunch())
        for name in BS_KERNELS:
            setattr(block_sparse, name, _NoLaunch())
        triton_backend.is_available = lambda device: True  # the launchers run on the CPU, their kernels do nothing
    H, Hk, D = (int(x) for x in args.shape.split("/"))
    ws, rs = [w for w, _ in LONGNET], [r for _, r in LONGNET]
    q = torch.randn(1, H, args.n, D, dtype=torch.bfloat16, device=args.device)
    k, v = (torch.randn(1, Hk, args.n, D, dtype=torch.bfloat16, device=args.device) for _ in range(2))
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

    if args.device == "cuda":
        for name, fn in (("fwd", forward), ("fwdbwd", forward_backward)):
            print(split_on_gpu(name, fn, launch, f"{args.op}, {args.shape}, N={args.n}"))
        return
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
              f"({args.op}, {args.shape}, N={args.n}, kernels no-op)")
    if not (launches["forward"] and launches["backward"]):
        raise SystemExit("the Triton launchers did not run: the numbers above are of another path")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            forward_backward()
        prof.disable()
        pstats.Stats(prof).sort_stats(args.profile).print_stats(40)


def split_on_gpu(name: str, fn, launch, what: str, calls: int = 20, rounds: int = 5) -> str:
    """One line: ``fn``'s host time per call on a GPU (the median of ``rounds`` rounds of ``calls`` calls queued back
    to back; few enough that the GPU's launch queue never fills and blocks the host), split into Triton's launch
    path, the dilated launchers' own Python and the rest, and the GPU's time per call over the same calls (CUDA
    events): where the GPU's time is the smaller, the GPU waits on the host."""
    import torch
    from triton.runtime.jit import JITFunction

    spent = {"triton": 0.0, "launcher": 0.0, "launches": 0}

    def timed(fn_, key, count=False):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn_(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t0
                spent["launches"] += count
        return wrapper

    real = JITFunction.run, launch.forward, launch.backward
    JITFunction.run = timed(real[0], "triton", count=True)
    launch.forward, launch.backward = timed(real[1], "launcher"), timed(real[2], "launcher")
    try:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        rows = []
        for _ in range(rounds):
            spent.update(triton=0.0, launcher=0.0, launches=0)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host = time.perf_counter() - t0
            end.record()
            torch.cuda.synchronize()
            rows.append((host, spent["triton"], spent["launcher"], spent["launches"], start.elapsed_time(end) / 1e3))
    finally:
        JITFunction.run, launch.forward, launch.backward = real
    host, triton, launcher, launches, gpu = sorted(rows)[rounds // 2]
    us = 1e6 / calls
    own = launcher - triton if launcher else 0.0
    launchers = f" + launchers' Python {own * us:.0f} us" if launcher else ""  # the block-sparse op: in the rest
    return (f"{name}: host {host * us:.0f} us per call = Triton launches {triton * us:.0f} us "
            f"({launches // calls} a call, {triton * 1e6 / max(launches, 1):.0f} us each){launchers} + the rest "
            f"{(host - triton - own) * us:.0f} us; GPU {gpu * us:.0f} us per call ({what}, real kernels)")


if __name__ == "__main__":
    main()
