"""One forward+backward of our block-sparse kernels and one of FlexAttention on the same layout (the benchmark's:
2K local window, the sink block, LongNet-style dilated blocks; 64K tokens, H = 16, D = 128, bf16, causal) inside a
CUDA profiler range, after a warm-up, for Nsight Compute:

    ncu --profile-from-start off -k regex:"bs_|triton_tem" --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats python benchmarks/profile_block_sparse.py

(run from the repository root with ``PYTHONPATH=$PWD`` unless the package is installed). With ``--table``, no Nsight:
GPU time per kernel from ``torch.profiler`` (``kernel_times.py``), ours and FlexAttention's. Our kernels are ``bs_fwd``,
``bs_bwd_dq`` and ``bs_bwd_dkdv``; FlexAttention's are Inductor templates (``triton_tem_*``), its backward one launch
with the dQ and the dK/dV programs side by side. The readings are in ``benchmarks/NOTES_triton.md``."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import bench_block_sparse as bench  # noqa: E402

from hf_dilated.ops.layout import resolve_layout  # noqa: E402

N = int(os.environ.get("PROFILE_N", 65536))
torch.manual_seed(0)
dev = torch.device("cuda")
q, k, v, do = (torch.randn(bench.B, bench.H, N, bench.D, device=dev, dtype=torch.bfloat16) for _ in range(4))
q, k, v = (t.requires_grad_() for t in (q, k, v))
lay = bench.fixed_layout(N, 128, dev)
tokens = resolve_layout(bench.B, N, N, dev)
mask = bench.flex_block_mask(lay, N)
for _ in range(2):  # warm-up (compile) outside the profiled range
    bench.ours(q, k, v, lay, tokens, do)
    bench.flex(q, k, v, mask, do)
torch.cuda.synchronize()
if "--table" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_times import kernel_times, print_times

    print_times(f"ours, forward+backward, N={N}", kernel_times(lambda: bench.ours(q, k, v, lay, tokens, do)))
    print_times(f"FlexAttention, forward+backward, N={N}", kernel_times(lambda: bench.flex(q, k, v, mask, do)))
    sys.exit(0)
torch.cuda.cudart().cudaProfilerStart()
bench.ours(q, k, v, lay, tokens, do)
bench.flex(q, k, v, mask, do)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
