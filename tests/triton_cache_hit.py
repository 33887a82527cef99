"""Run by ``test_benchmark_tools.py`` in a process of its own (Triton compiling for sm_90, not interpreting): a kernel
compiled into one Triton cache, exported (metadata and cubin), installed into another, and compiled again there is a
hit on the installed copy (``benchmarks/triton_cache.py``); compiled under another build's key (``keyed_as``: a wheel
whose ``libtriton`` differs) it lands under another key, that build's, and the own key is back after the block.

    TRITON_INTERPRET=0 python tests/triton_cache_hit.py benchmarks WORKDIR"""

import hashlib
import os
import sys
import zipfile

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
wheel = os.path.join(work, f"triton-{triton.__version__}-cp399-cp399-manylinux_2_28_x86_64.whl")
with zipfile.ZipFile(wheel, "w") as z:
    z.writestr("triton/_C/libtriton.so", b"another build")
theirs = tc.libtriton_hash(wheel)
assert theirs == hashlib.sha256(b"another build").hexdigest()
import triton.runtime.cache as cache  # noqa: E402

own = cache.triton_key()
d = os.path.join(work, "d")
os.environ["TRITON_CACHE_DIR"] = d
with tc.keyed_as(theirs):
    assert theirs in cache.triton_key() and cache.triton_key() != own
    kr.compiled_kernel(launch, 90)
assert cache.triton_key() == own
assert tc.count(d) == 1 and not set(os.listdir(d)) & set(os.listdir(a)), "the same key as the own build's"
print("hit")
