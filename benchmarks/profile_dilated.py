"""One forward and one forward+backward of the dilated op (64K tokens, H = 16, D = 128, bf16, LongNet branches)
inside a CUDA profiler range, after a warm-up, for Nsight Compute:

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy python benchmarks/profile_dilated.py
    ncu -k regex:dilated_bwd --launch-count 4 --section SpeedOfLight ... python benchmarks/profile_dilated.py

(run from the repository root with ``PYTHONPATH=$PWD`` unless the package is installed). The r = 1 branch's launches
are the last of each pass (``launch._launch_order``): with 5 branches, ``-k regex:dilated_bwd --launch-skip 8
--launch-count 2`` profiles its dK/dV and dq, ``-k regex:dilated_fwd --launch-skip 4 --launch-count 1`` its forward.
The readings are in ``benchmarks/NOTES_triton.md``. With ``--table``, no Nsight: GPU time per kernel from
``torch.profiler`` (``kernel_times.py``)."""

import os
import sys

import torch

from hf_dilated import dilated_attention

torch.manual_seed(0)
N, H, D = 65536, 16, 128
q, k, v = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
w, r = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
for _ in range(2):  # warm-up (compile) outside the profiled range
    out = dilated_attention(q, k, v, w, r, is_causal=True)
    out.sum().backward()
torch.cuda.synchronize()
if "--table" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_times import kernel_times, print_times

    g = torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16)

    def step():  # gradients returned, not accumulated into .grad (an add kernel per leaf per call)
        torch.autograd.grad(dilated_attention(q, k, v, w, r, is_causal=True), (q, k, v), g)

    print_times(f"dilated, forward+backward, N={N}", kernel_times(step))
    sys.exit(0)
torch.cuda.cudart().cudaProfilerStart()
out = dilated_attention(q, k, v, w, r, is_causal=True)
out.sum().backward()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
