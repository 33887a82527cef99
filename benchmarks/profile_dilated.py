"""One forward and one forward+backward of the dilated op (64K tokens, H = 16, D = 128, bf16, LongNet branches)
inside a CUDA profiler range, after a warm-up, for Nsight Compute:

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy python benchmarks/profile_dilated.py
    ncu -k regex:dkdv_hopper --launch-skip 4 --launch-count 1 --section SpeedOfLight ... python benchmarks/profile_dilated.py

(run from the repository root with ``PYTHONPATH=$PWD`` unless the package is installed). The r = 1 branch's launches
are the last of each pass (``launch._launch_order``): with 5 branches, ``-k regex:dilated_fwd --launch-skip 4
--launch-count 1`` profiles its forward, ``-k regex:dkdv_hopper --launch-skip 4 --launch-count 1`` its dK/dV (with
the fused dQ at head dim 128).

``--dense cudnn`` (or ``flash``) runs dense causal SDPA on that backend instead, at the same shape, so the same
Nsight sections read the bar the dilated kernels are held to (issue 14: cuDNN's rate), cycle for cycle under Nsight's
locked clock; ``--dense cudnn-segments`` runs cuDNN on exactly the dilated work (each branch's segments gathered into
a batch of dense causal sequences, r = 1's launches first), the bar for one branch's launch. ``--n``, ``--heads``,
``--kv-heads``, ``--dim`` change the shape, ``--branches`` the branches (``--branches 2048:1``: one, whose launch
neither weights pairs nor merges earlier launches' parts). The readings are in ``benchmarks/NOTES_triton.md``. With
``--table``, no Nsight: GPU time per kernel from ``torch.profiler`` (``kernel_times.py``); with ``--launches``, every
launch of one forward+backward in order (the branch launches of the dilated op: forward and dK/dV, r = 2, 4, 8, 16
then r = 1, per head chunk of the backward)."""

import argparse
import os
import sys

import torch

from hf_dilated import dilated_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--n", type=int, default=65536)
ap.add_argument("--heads", type=int, default=16)
ap.add_argument("--kv-heads", type=int, default=None, help="kv heads (default: --heads)")
ap.add_argument("--dim", type=int, default=128)
ap.add_argument("--dense", choices=["cudnn", "flash", "cudnn-segments"], default=None,
                help="profile dense causal SDPA instead; cudnn-segments: cuDNN on exactly the dilated work, each "
                     "branch's segments as a batch (bench_attention.segment_calls), r = 1's first")
ap.add_argument("--branches", nargs="+", metavar="W:R", default=["2048:1", "4096:2", "8192:4", "16384:8", "32768:16"],
                help="the branches (segment length : dilation rate), LongNet's five by default; e.g. --branches 2048:1 "
                     "for one, whose r = 1 launch neither weights pairs nor merges earlier launches' parts")
ap.add_argument("--table", action="store_true", help="GPU time per kernel from torch.profiler, no Nsight")
ap.add_argument("--launches", action="store_true",
                help="every GPU launch of one forward+backward in order, with its time (torch.profiler, no Nsight)")
args = ap.parse_args()
if args.n < 1:
    ap.error(f"--n must be >= 1, got {args.n}")
if args.heads < 1 or (args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads)):
    ap.error(f"--heads must be a positive multiple of --kv-heads, got {args.heads} and {args.kv_heads}")
if args.dim not in (64, 128, 256):
    ap.error(f"--dim must be one of 64, 128, 256, got {args.dim}")
try:
    branches = [tuple(int(x) for x in b.split(":")) for b in args.branches]
    if any(len(b) != 2 or min(b) < 1 for b in branches):
        raise ValueError
except ValueError:
    ap.error(f"--branches takes W:R pairs of positive integers (segment length : dilation rate), e.g. 2048:1 4096:2, "
             f"got {' '.join(args.branches)}")

torch.manual_seed(0)
N, H, Hk, D = args.n, args.heads, args.kv_heads or args.heads, args.dim
q = torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(1, Hk, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
g = torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16)
w, r = [b[0] for b in branches], [b[1] for b in branches]

if args.dense == "cudnn-segments":
    from bench_attention import segment_calls

    forward, step = segment_calls(q, k, v, g, list(zip(w, r)))
elif args.dense:
    from bench_attention import run_sdpa

    def forward():
        return run_sdpa(q, k, v, None, args.dense)

    def step():
        return run_sdpa(q, k, v, g, args.dense)
else:
    def forward():
        return dilated_attention(q, k, v, w, r, is_causal=True)

    def step():  # gradients returned, not accumulated into .grad (an add kernel per leaf per call)
        return torch.autograd.grad(dilated_attention(q, k, v, w, r, is_causal=True), (q, k, v), g)

for _ in range(2):  # warm-up (compile) outside the profiled range
    forward()
    step()
torch.cuda.synchronize()
if args.table or args.launches:
    from kernel_times import kernel_times, launch_times, print_launches, print_times

    title = f"{args.dense or 'dilated'}, forward+backward, N={N}, {H}/{Hk}/{D}, branches {' '.join(args.branches)}"
    if args.table:
        print_times(title, kernel_times(step))
    if args.launches:
        print_launches(title, launch_times(step))
    sys.exit(0)
torch.cuda.cudart().cudaProfilerStart()
forward()
step()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
