"""Run by ``test_benchmark_tools.py`` in a process of its own (Triton compiling for sm_90, not interpreting): a kernel
compiled into one Triton cache, exported (metadata and cubin), installed into another, and compiled again there is a
hit on the installed copy (``benchmarks/triton_cache.py``).

    TRITON_INTERPRET=0 python tests/triton_cache_hit.py benchmarks WORKDIR"""

import os
import sys

bench, work = sys.argv[1], sys.argv[2]
sys.path.insert(0, bench)
import torch
import triton
import triton.language as tl


@triton.jit
def double_kernel(X, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + i, tl.load(X + i, mask=i < n) * 2, mask=i < n)


import kernel_resources as kr  # noqa: E402
import triton_cache as tc  # noqa: E402

a, c, bundle = (os.path.join(work, x) for x in ("a", "c", "kernels.tar.xz"))
launch = kr.Launch(double_kernel, (torch.empty(64), 64), dict(BLOCK=64), "test")
os.environ["TRITON_CACHE_DIR"] = a
first = kr.compiled_kernel(launch, 90)
assert "ptx" in first.asm and tc.count(a) == 1
assert tc.export(a, bundle)[0] == 1
os.environ["TRITON_CACHE_DIR"] = c
assert tc.install(bundle) == 1 and tc.count() == 1 and tc.install(bundle) == 0
again = kr.compiled_kernel(launch, 90)  # a hit: the installed kernel, which has no PTX
assert "ptx" not in again.asm and again.asm["cubin"] == first.asm["cubin"], sorted(again.asm)
assert tc.count(c) == 1
print("hit")
