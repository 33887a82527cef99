"""Compile every Triton kernel of the package for a GPU on a machine without one, and report what each compiled
kernel needs: registers, spills (and whether they sit in a hot loop), shared memory, the warps an SM can hold, and
whether ptxas serialized its tensor-core products (column ``wgmma``; ptxas's reason in the JSON and the summary).

Why: the interpreter (the CPU tests) runs the kernels' Python, not Triton's compiler, so a kernel change can pass
every CPU test and still fail to compile for a GPU, or ask for more shared memory than the GPU has (an
``OutOfResources`` at the first launch there). And registers, spills and occupancy, which the profiles in
``benchmarks/NOTES_triton.md`` name as the backward's limits, are decided by the compiler: no GPU is needed to read
them. Spill bytes alone overstate the cost: the report counts the local-memory instructions in the SASS and those
inside a tile loop (``in loops``: run per tile, not once per program).

How: the public launch paths (``dilated_attention``, its backward and decoding, ``block_sparse_attention``) run on CPU
tensors while the launchers believe they are on the chosen GPU (its config tables, TMA on Hopper); every kernel
launch is recorded instead of run, specialised by Triton's own binder for that GPU, compiled with ``triton.compile``,
assembled by the ptxas that ships with Triton (``-v``: registers, spills) and disassembled by its cuobjdump.

    python benchmarks/kernel_resources.py                        # H100 (sm_90), bf16, the model-shaped heads
    python benchmarks/kernel_resources.py --arch 80 --dtypes bfloat16 float32 --json out.json
    python benchmarks/kernel_resources.py --quick                # one shape, one dtype: what the CPU test runs
    python benchmarks/kernel_resources.py --quick --json new.json --compare old.json   # did a change alter the code?
    python benchmarks/kernel_resources.py --quick --kernels bs_bwd_dkdv   # one kernel's launches only (seconds)
    python benchmarks/kernel_resources.py --candidates --shapes 8/2/256    # hf-dilated tune's candidates, every path
    python benchmarks/kernel_resources.py --quick --kernels dkdv_ws --loops --sass /tmp/sass  # spills by loop
    TRITON_CACHE_DIR=/tmp/tc python benchmarks/kernel_resources.py --n 16384 --key-as-wheel W.whl  # a GPU's cache

The ``in loops`` column counts spill instructions inside tile loops / in the whole kernel; ``--loops`` lists each
innermost tile loop (instructions, tensor-core instructions, spill stores / loads: a warp-specialized kernel has one
per consumer partition, which the column adds up; and the barriers its warps wait at, ``BAR.SYNC`` / ``BAR.RED`` /
``BAR.ARV``, a CTA's or a partition's named one; on Hopper, how many of the loop's exponentials come before its wait
for every tensor-core product: the softmax under the previous ``P V``), and ``--sass`` keeps each kernel's listing to
read them in.

``--key-as-wheel`` compiles under the cache keys of another build of the installed Triton (the lent GPU image's
Python 3.12 wheel): the cache then holds kernels that machine finds instead of compiling (``triton_cache.py``).

``KERNEL_RESOURCES_FULL_ERRORS=1`` (or ``true`` / ``on`` / ``yes``; unset: off) prints a failed compile's whole
message and what it was raised from, not its first line; any other value than those and ``0`` / ``false`` / ``off`` /
``no`` is refused.
Exits 1 when a kernel fails to compile or needs more shared memory than the target has. The numbers come from the
installed Triton: the GPU image's version may allocate registers differently (the report names the version).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from unittest import mock

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    # The interpreter replaces @triton.jit functions with Python ones that cannot be compiled: start again without.
    env = dict(os.environ, TRITON_INTERPRET="0")
    sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
try:  # Gluon kernels (block_sparse_hopper.py, backward_hopper.py) compile from their own source type
    from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
except ImportError:  # pragma: no cover - a Triton without Gluon launches none
    GluonASTSource = ASTSource
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402
from tqdm import tqdm  # noqa: E402

# Shared memory a block may use (bytes, the opt-in maximum): CUDA programming guide, "Technical Specifications".
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}
# Per SM: shared memory (bytes), resident warps (the same guide's table); every listed GPU has 64K registers per SM,
# allocated per warp in units of 256, and reserves 1 KB of shared memory per block.
SM_SHARED = {80: 164 * 1024, 86: 100 * 1024, 89: 100 * 1024, 90: 228 * 1024, 100: 228 * 1024, 120: 100 * 1024}
SM_WARPS = {80: 64, 86: 48, 89: 48, 90: 64, 100: 64, 120: 48}
LONGNET = ((2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16))
SHAPES = ("16/16/128", "32/8/128", "9/3/64", "8/2/256")


@dataclass
class Launch:
    """One kernel launch as the launchers made it: the kernel and its arguments (tensors, scalars, constexprs)."""

    fn: JITFunction
    args: tuple
    kwargs: dict
    case: str


@dataclass
class Resources:
    """What one distinct compiled kernel needs (``cases``: the driving cases that launched it)."""

    kernel: str
    case: str
    config: dict
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack: int | None = None
    shared: int | None = None
    error: str | None = None
    compile_s: float = 0.0
    specialised: str = ""
    spill_instructions: int | None = None
    spill_instructions_in_loops: int | None = None
    tile_loops: int | None = None
    warps_per_sm: int | None = None
    leanest_loop_instructions: int | None = None
    leanest_loop_mma: int | None = None
    # per innermost tile loop, in address order: [instructions, tensor-core instructions, spill stores, spill loads,
    # barriers] (a warp-specialized kernel has one per consumer partition)
    loop_spills: list | None = None
    # per innermost tile loop, as ``loop_spills``: [exponentials (``MUFU.EX2``) before the loop's first wait for every
    # tensor-core product (``WARPGROUP.DEPBAR.LE gsb0, 0x0``), exponentials in the loop], or None where the loop has no
    # such wait (no asynchronous ``wgmma``). The forward's softmax runs under the previous tile's ``P V`` only as far as
    # its exponentials come before that wait; where ptxas puts the wait is its choice (NOTES_triton, session 64).
    loop_exp2_before_wait: list | None = None
    wgmma_serialized: bool | None = None
    wgmma_reason: str | None = None
    ptx_sha: str | None = None
    sass_sha: str | None = None  # the machine code (sass_summary), where cuobjdump is there
    launch_key: str = ""
    cases: list = field(default_factory=list)


@contextlib.contextmanager
def recorded_launches(arch: int, into: list, case: list):
    """Inside the block, kernel launches are recorded (not run) and the launchers choose what they would choose on a
    GPU of compute capability ``arch // 10``: its config tables, TMA loads from Hopper on."""
    from hf_dilated.ops import triton as triton_backend
    from hf_dilated.ops.triton import configs, launch, relaunch, tuned

    def record(self, *args, grid, warmup, **kwargs):
        into.append(Launch(self, args, kwargs, case[0]))

    patches = [
        (JITFunction, "run", record),
        (configs, "interpreting", lambda: False),
        (configs, "_capability_major", lambda: arch // 10),  # configs._hopper and dot_mode read it
        (configs, "shared_memory_limit", lambda: SHARED_LIMIT[arch]),  # small_shared_memory reads it
        (tuned, "lookup", lambda *a, **k: None),  # the built-in tables, not this machine's tuned configs
        (triton_backend, "is_available", lambda device: True),
        (triton, "set_allocator", lambda alloc: None),
        (launch, "sm_count", lambda device: 132),  # the H100's: the grids (persistent ones included) of a GPU
        (relaunch, "ENABLED", False),  # every launch through JITFunction.run, recorded
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def drive(shape: str, dtype: torch.dtype, n: int, quick: bool, case: list) -> None:
    """Run the launch paths once per feature that changes a kernel's specialisation (each sets ``case[0]``)."""
    import hf_dilated
    from hf_dilated.config import DENSE_SEGMENT
    from hf_dilated.ops.block_sparse import BlockSparseConfig, block_sparse_attention
    from hf_dilated.ops.layout import cache_layout
    from hf_dilated.ops.triton import hopper
    from hf_dilated.ops.triton.op import dilated_attention_triton

    H, Hk, D = (int(x) for x in shape.split("/"))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, n, D, dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(1, Hk, n, D, dtype=dtype, generator=g).requires_grad_() for _ in range(2))
    ws, rs = [w for w, _ in LONGNET], [r for _, r in LONGNET]

    def fwd_bwd(name, fn):
        case[0] = f"{shape} {str(dtype)[6:]} {name}"
        out = fn()
        out.backward(torch.ones_like(out))

    fwd_bwd("longnet causal", lambda: hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton"))
    # A dense sliding-window layer (Gemma's local layers): one launch, which writes the output and gradients alone.
    fwd_bwd("dense window layer", lambda: hf_dilated.dilated_attention(q, k, v, [DENSE_SEGMENT], [1], backend="triton",
                                                                       window=n // 4))
    if not quick:
        mask = torch.ones(1, n, dtype=torch.long)
        mask[0, : n // 8] = 0
        fwd_bwd("padded, window, global, dropout", lambda: hf_dilated.dilated_attention(
            q, k, v, ws, rs, backend="triton", attention_mask=mask, window=n // 2, global_tokens=4, dropout_p=0.1,
            seed=torch.tensor(1)))
        fwd_bwd("bidirectional", lambda: hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton",
                                                                      is_causal=False))
    case[0] = f"{shape} {str(dtype)[6:]} decode"
    with torch.no_grad():
        qd = q[:, :, -1:].detach()
        dilated_attention_triton(qd, k.detach(), v.detach(), LONGNET, cache_layout(1, 1, n, "cpu"), True, D ** -0.5,
                                 strict=True)
    for pattern in ("local", "adaptive") if not quick else ("adaptive",):
        fwd_bwd(f"block-sparse {pattern}", lambda: block_sparse_attention(q, k, v, pattern, backend="triton"))
    # the benchmarks' 128-token blocks (the patterns above use 64): other tiles, other shared memory
    fwd_bwd("block-sparse local, 128-blocks", lambda: block_sparse_attention(
        q, k, v, BlockSparseConfig(pattern="local", block_size=128), backend="triton"))
    # The Gluon dK/dV and dQ launches where one dK/dV launch adds dQ (sm_90, head dim 128): HF_DILATED_FUSED_DQ=0 and
    # torch.use_deterministic_algorithms(True) run them; and the one-warpgroup Gluon forward where the
    # warp-specialized one would run (HF_DILATED_WS=0; head dims 64 and 256 run it).
    with mock.patch.dict(os.environ, {"HF_DILATED_FUSED_DQ": "0", "HF_DILATED_WS": "0"}):
        fwd_bwd("longnet causal, separate dQ, one-warpgroup forward",
                lambda: hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton"))
    # The fused dK/dV of one 8-warp program where the warp-specialized one would run (HF_DILATED_WS_DKDV=0; several
    # query heads a class run it), and at head dim 256 the launch per gradient instead of the two roles.
    with mock.patch.dict(os.environ, {"HF_DILATED_WS_DKDV": "0"}):
        fwd_bwd("longnet causal, one-program fused dK/dV",
                lambda: hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton"))
    # The portable dK/dV where the Gluon one would run (sm_90): what HF_DILATED_GLUON=0, other head dims and
    # other Tritons launch there.
    with hopper.portable():
        fwd_bwd("longnet causal, portable dK/dV",
                lambda: hf_dilated.dilated_attention(q, k, v, ws, rs, backend="triton"))
        fwd_bwd("block-sparse adaptive, portable dK/dV",
                lambda: block_sparse_attention(q, k, v, "adaptive", backend="triton"))


def _ptxas_report(ptx: str, arch: int) -> dict:
    """Registers, spills and stack of the PTX, from the ``-v`` report of the ptxas that Triton itself uses, and
    whether ptxas serialized the kernel's ``wgmma``s (its C75xx "wgmma.mma_async instructions are serialized"
    warnings: each product then waits for the one before, whatever the kernel's pipelining asked for; spills into a
    product's accumulator registers are one cause)."""
    from triton.backends.nvidia import compiler as nvidia

    ptxas = nvidia.get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        gpu = nvidia.sm_arch_from_capability(arch)
        run = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode:
        raise RuntimeError(f"ptxas failed: {log[-2000:]}")
    reason = serialization_reason(log)
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(registers=int(regs.group(1)) if regs else None,
                stack=int(spill.group(1)) if spill else None,
                spill_stores=int(spill.group(2)) if spill else None,
                spill_loads=int(spill.group(3)) if spill else None,
                wgmma_serialized=reason is not None, wgmma_reason=reason)


def serialization_reason(log: str) -> str | None:
    """Why ptxas serialized the ``wgmma``s, from its C75xx message in ``log`` (the words after "serialized due to",
    e.g. "non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline
    stage": spill reloads or other writes into an in-flight product's registers; "insufficient register resources");
    ``None`` where it did not."""
    m = re.search(r"wgmma\.mma_async instructions are serialized(?: due to (.*))?$", log, flags=re.MULTILINE)
    if m is None:
        return None
    reason = re.sub(r"\s*(?:in|for) the function '[^']*'\s*$", "", m.group(1) or "").strip()
    return reason or "no reason given"


def ptx_fingerprint(ptx: str) -> str:
    """A hash of the PTX without its source locations and debug sections: two checkouts whose kernels hash the same
    generate the same code. A refactor can change the PTX (its virtual registers' numbering, say) and not the machine
    code: ``sass_summary``'s ``sass_sha`` tells those apart, and ``compare`` goes by it where both reports have it."""
    body = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    keep = [line for line in body.splitlines()
            if not line.lstrip().startswith((".loc", ".file", "//", "$L__tmp", "$L__func")) and line.strip()]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


def resident_warps(arch: int, registers: int | None, shared: int, warps: int) -> int | None:
    """Warps that can be resident on one SM (occupancy x 64 on Hopper): whole blocks, limited by registers (64K per
    SM, 256 per warp granule), shared memory (plus 1 KB reserved per block) and the SM's warp slots."""
    if registers is None:
        return None
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = 65536 // (per_warp * warps)
    by_smem = SM_SHARED[arch] // (shared + 1024)
    blocks = min(by_regs, by_smem, SM_WARPS[arch] // warps, 32)
    return blocks * warps


# A branch and its target: ``BRA 0x1ab0``, ``@P0 BRA 0x1ab0`` and, from sm_100 / 120 ptxas on, ``BRA.U !UP0, 0x1ab0``
# (a branch on a uniform predicate, given as an operand).
BACK_BRANCH = re.compile(r"\bBRA(?:\.[A-Z0-9]+)*\s+(?:!?U?P[T0-9]+\s*,\s*)?0x([0-9a-f]+)")
# A barrier the warps wait at or arrive on: the CTA's (``BAR.SYNC.DEFER_BLOCKING 0x0``) or a named one of a
# warp-specialized partition (``BAR.SYNC R0, 0x80``, ``BAR.ARV``, ``BAR.RED``); not ``MEMBAR`` or ``DEPBAR`` (fences
# and scoreboard waits). Each layout conversion through shared memory costs a step two (session 50: four of the D 64
# dK/dV step's eight sat ahead of its products).
BARRIER = re.compile(r"(?<![A-Z.])BAR\.(?:SYNC|RED|ARV)\b")
MMA = re.compile(r"\b(HGMMA|HMMA)\b")  # a tensor-core instruction
FULL_WGMMA_WAIT = re.compile(r"\bWARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x0\b")
EXP2 = re.compile(r"\bMUFU\.EX2\b")


def sass_summary(cubin: bytes, sass_path: str | None = None) -> dict:
    """What the kernel's SASS (``cuobjdump -sass``) says about its hot path. A spill in a loop over tiles costs on
    every iteration, one before or after it once per program: ``spill_instructions`` counts the local-memory
    instructions, ``spill_instructions_in_loops`` those inside a tile loop (the spans of backward branches that hold a
    tensor-core instruction and no smaller such span). ``leanest_loop_instructions`` / ``leanest_loop_mma``: the
    instructions and tensor-core instructions of the shortest tile loop (in the dilated kernels the one without masks),
    a static measure of the work around the matrix products. Empty when cuobjdump is missing."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    if sass_path:  # the whole listing, to read what the counts below point at
        with open(sass_path, "w") as f:
            f.write(sass)
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    # ptxas places the wait loops of TMA / mbarrier code after the kernel's last EXIT, branching back into the body:
    # those branches are not loops.
    end = max((at for at, ins in code if re.match(r"EXIT\b", ins.strip())), default=max(at for at, _ in code))
    loops = [(int(t.group(1), 16), at) for at, ins in code
             if at < end and (t := BACK_BRANCH.search(ins)) and int(t.group(1), 16) < at]
    mma = [at for at, ins in code if re.search(MMA, ins)]
    tile_loops = [a for a in loops if any(a[0] <= at <= a[1] for at in mma)]
    innermost = [a for a in tile_loops if not any(b != a and a[0] <= b[0] and b[1] <= a[1] for b in tile_loops)]
    local = [at for at, ins in code if re.search(r"\b(STL|LDL)\b", ins)]
    # No tensor-core instruction (float32 dots in "ieee" mode run on the FMA units): no tile loop to tell apart, so
    # where the spills sit is not known.
    # the machine code, instruction by instruction (addresses and encodings aside): two checkouts whose kernels hash
    # the same run the same instructions, so a refactor that keeps it needs no GPU run to show it changed nothing
    sass_sha = hashlib.sha256("\n".join(" ".join(ins.split()) for _, ins in code).encode()).hexdigest()[:16]
    out = dict(spill_instructions=len(local), tile_loops=len(innermost), sass_sha=sass_sha,
               spill_instructions_in_loops=sum(1 for at in local if any(lo <= at <= hi for lo, hi in innermost))
               if innermost else None)
    if innermost:
        # each innermost tile loop's instructions, in address order, read once for every count below
        bodies = {(lo, hi): [ins for at, ins in code if lo <= at <= hi] for lo, hi in sorted(innermost)}
        count = lambda body, pattern: sum(1 for ins in body if re.search(pattern, ins))  # noqa: E731
        out["loop_spills"] = [[len(body), count(body, MMA), count(body, r"\bSTL\b"), count(body, r"\bLDL\b"),
                               count(body, BARRIER)] for body in bodies.values()]
        out["loop_exp2_before_wait"] = [exp2_before_wait(body) for body in bodies.values()]
        leanest = bodies[min(innermost, key=lambda a: a[1] - a[0])]
        out["leanest_loop_instructions"] = len(leanest)
        out["leanest_loop_mma"] = count(leanest, MMA)
    return out


def exp2_before_wait(body: list[str]) -> list[int] | None:
    """``[exponentials before the first wait for every tensor-core product, exponentials]`` of a loop's instructions
    (``Resources.loop_exp2_before_wait``); None without such a wait."""
    waits = [i for i, ins in enumerate(body) if FULL_WGMMA_WAIT.search(ins)]
    if not waits:
        return None
    exp2 = [i for i, ins in enumerate(body) if EXP2.search(ins)]
    return [sum(1 for i in exp2 if i < waits[0]), len(exp2)]


def _bind(launch: Launch, arch: int):
    """``(target, backend, bound arguments, specialisation, options)``: what Triton's binder makes of ``launch`` on the
    target (dtypes, 16-byte alignment, integers equal to 1 or divisible by 16)."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(launch.fn.signature, launch.fn.params, backend)
    return (target, backend, *binder(*launch.args, **launch.kwargs))


def specialisation(launch: Launch, arch: int) -> tuple[tuple, str]:
    """The key Triton's cache would give ``launch`` on the target, and the integer arguments it turned into the
    constant 1 (``r=1`` compiles a different kernel than ``r=2``) with the flags that tell its variants apart
    (``MERGE``, ``LAST``, the warp-specialized forward's ``PERSISTENT`` and ``PER_UNIT``)."""
    spec = _bind(launch, arch)[3]
    ones = [p.name for p, s in zip(launch.fn.params, spec) if not p.is_constexpr and s[0] == "constexpr"]
    key = (launch.fn.__name__, str(spec), repr(sorted(launch.kwargs.items())))
    flags = [f"{name}=1" for name in ones] + [f"{k}" for k in ("MERGE", "LAST", "PERSISTENT") if launch.kwargs.get(k)]
    flags += [f"PER_UNIT={launch.kwargs['PER_UNIT']}"] if "PER_UNIT" in launch.kwargs else []
    return key, " ".join(flags)


def compiled_kernel(launch: Launch, arch: int):
    """``launch`` compiled as Triton's launcher would on the target, through Triton's cache (``TRITON_CACHE_DIR``):
    the same cache key, so what lands in the cache is what the GPU would look up (``triton_cache.py``)."""
    fn = launch.fn
    target, backend, bound, specialization, options = _bind(launch, arch)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
    return triton.compile(source(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def compile_launch(launch: Launch, arch: int, full_errors: bool = False, sass_path: str | None = None) -> Resources:
    """Compile ``launch`` as Triton would for the target and measure it; a failure's message whole (``full_errors``)
    or its first line; the SASS listing written to ``sass_path`` where given."""
    fn = launch.fn
    config = {name: launch.kwargs[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK", "num_warps", "num_stages", "TMA")
              if name in launch.kwargs}
    res = Resources(fn.__name__, launch.case, config)
    start = time.perf_counter()
    try:
        compiled = compiled_kernel(launch, arch)
        res.shared = int(compiled.metadata.shared)
        res.ptx_sha = ptx_fingerprint(compiled.asm["ptx"])
        for name, value in sass_summary(compiled.asm["cubin"], sass_path).items():
            setattr(res, name, value)
        for name, value in _ptxas_report(compiled.asm["ptx"], arch).items():
            setattr(res, name, value)
        # the compiled count: a warp-specialized kernel adds its partitions' warps to the launch's num_warps
        res.warps_per_sm = resident_warps(arch, res.registers, res.shared, compiled.metadata.num_warps)
        limit = SHARED_LIMIT.get(arch)
        if limit is not None and res.shared > limit:
            res.error = f"needs {res.shared} bytes of shared memory, sm_{arch} has {limit}"
    except Exception as e:  # noqa: BLE001 -- a compile error of any kind is the finding
        text = str(e).strip()
        if full_errors:  # the whole message (a compile error's source excerpt), and what it was raised from
            res.error = f"{type(e).__name__}: {text}"
            cause = e.__cause__ or e.__context__
            while cause is not None:
                res.error += f"\n  from {type(cause).__name__}: {str(cause).strip()}"
                cause = cause.__cause__ or cause.__context__
        else:
            res.error = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:500]
    res.compile_s = round(time.perf_counter() - start, 2)
    return res


def compare(before: dict, rows: list[Resources]) -> str:
    """Which kernels generate other code than in ``before``, matched by kernel, specialisation and config (the launch
    key), the code being the SASS where both reports have it (``sass_sha``), else the PTX; a kernel whose launch key
    is new but whose code is that of a vanished key of the same kernel (a launch argument added, say) counts as the
    same code. Those whose PTX differs and machine code does not are counted apart."""
    by_sass = all(k.get("sass_sha") for k in before["kernels"]) and all(r.sass_sha for r in rows)
    old = {k["launch_key"]: k for k in before["kernels"]}
    code = (lambda k: k.get("sass_sha")) if by_sass else (lambda k: k.get("ptx_sha"))
    same, rekeyed, ptx_only, lines, unmatched = 0, 0, 0, [], []
    for r in rows:
        o = old.pop(r.launch_key, None)
        if o is None:
            unmatched.append(r)
        elif code(o) == code(vars(r)):
            same += 1
            ptx_only += o.get("ptx_sha") != r.ptx_sha
        else:
            lines.append(f"  changed  {r.kernel} {r.config} {r.specialised}: registers {o['registers']} -> "
                         f"{r.registers}, spills {o['spill_stores']} -> {r.spill_stores} bytes, shared "
                         f"{o['shared']} -> {r.shared}")
    gone = {}
    for key, o in old.items():
        gone.setdefault((o["kernel"], code(o)), []).append(key)
    for r in unmatched:
        keys = gone.get((r.kernel, code(vars(r)))) if code(vars(r)) else None
        if keys:
            old.pop(keys.pop())
            rekeyed += 1
        else:
            lines.append(f"  new      {r.kernel} {r.config} {r.specialised}")
    lines += [f"  gone     {o['kernel']} {o['config']} {o['specialised']}" for o in old.values()]
    notes = [f"{rekeyed} of them under new launch arguments"] if rekeyed else []
    notes += [f"{ptx_only} of them from other PTX"] if ptx_only else []
    note = f" ({'; '.join(notes)})" if notes else ""
    what = "machine code" if by_sass else "code"
    return (f"against {before.get('command', 'the other report')}: {same + rekeyed} kernels generate the same {what}"
            + note + ("\n" + "\n".join(lines) if lines else ", none differs"))


TUNED_KERNELS = {"fwd": "dilated_fwd_branch_kernel", "dkdv": "dilated_bwd_dkdv_kernel", "dq": "dilated_bwd_dq_kernel"}


def candidate_launches(arch: int, shape: str, dtype: torch.dtype, n: int) -> list[Launch]:
    """The launches of each tuner candidate's kernel, the candidate forced, over every feature path of ``shape``."""
    from hf_dilated.ops.triton import configs, tuning
    from hf_dilated.ops.triton.launch import head_dim_block

    d = head_dim_block(int(shape.split("/")[2]))
    out: list[Launch] = []
    for kernel, name in TUNED_KERNELS.items():
        for config in tuning.candidates(kernel, d):
            recorded: list[Launch] = []
            case = [""]
            with recorded_launches(arch, recorded, case), configs.forced(kernel, config):
                drive(shape, dtype, n, False, case)
            for launch in recorded:
                if launch.fn.__name__ == name:
                    launch.case = f"candidate {kernel} {tuple(config)}: {launch.case}"
                    out.append(launch)
    return out


def candidate_summary(rows: list[Resources]) -> str:
    """One line per candidate: whether every path compiled within the GPU's shared memory, and its worst spills."""
    by: dict[str, list[Resources]] = {}
    for r in rows:
        for c in r.cases:
            by.setdefault(c.split(":")[0], []).append(r)
    lines = [f"{'candidate':42} {'paths':>5} {'max smem KB':>11} {'max spill B':>11} {'spills in loops':>15}  verdict"]
    for name, rs in by.items():
        errors = [r.error for r in rs if r.error]
        smem = max((r.shared or 0) for r in rs) / 1024
        spill = max((r.spill_stores or 0) for r in rs)
        hot = max((r.spill_instructions_in_loops or 0) for r in rs)
        verdict = f"FAILS: {errors[0]}" if errors else ("spills in a tile loop" if hot else "ok")
        lines.append(f"{name:42} {len(set(map(id, rs))):>5} {smem:>11.0f} {spill:>11} {hot:>15}  {verdict}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10: 90 (H100/H200), 80 (A100)...")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="query heads / kv heads / head dim")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--n", type=int, default=4096, help="tokens of the driving problem (only its specialisation "
                                                         "matters: a multiple of 16, as real lengths mostly are)")
    ap.add_argument("--quick", action="store_true", help="the causal LongNet path, decoding, adaptive block-sparse "
                                                          "and 128-block block-sparse only, one shape")
    ap.add_argument("--candidates", action="store_true",
                    help="instead: every candidate config of `hf-dilated tune` (ops/triton/tuning.py) for the dilated "
                         "forward, dK/dV and dQ, each compiled on every path (padding, window, dropout, "
                         "bidirectional, GQA) of the first shape: the tuner times candidates on one path only")
    ap.add_argument("--kernels", nargs="+", metavar="NAME",
                    help="compile only the launches of kernels whose name contains one of these (the paths still run "
                         "whole; compiling is the slow part): a change to one kernel checked in seconds")
    ap.add_argument("--loops", action="store_true",
                    help="under each kernel, its innermost tile loops: instructions, tensor-core instructions, spill "
                         "stores and loads, barriers (one loop per consumer partition in a warp-specialized kernel)")
    ap.add_argument("--sass", metavar="DIR", help="write each distinct kernel's SASS to DIR/<kernel>-<launch key>.sass")
    ap.add_argument("--key-as-wheel", metavar="WHEEL",
                    help="compile under the cache keys of this Triton wheel (the installed version, built for "
                         "another Python, e.g. the lent GPU image's 3.12): with TRITON_CACHE_DIR set, the cache then "
                         "holds what that machine looks up (triton_cache.py export / install carry it there)")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--compare", help="a report of another checkout (--json, same arguments): list the kernels whose "
                                      "code differs, with their registers and spills before and after")
    args = ap.parse_args(argv)
    if args.arch not in SHARED_LIMIT:
        ap.error(f"--arch must be one of {sorted(SHARED_LIMIT)}, got {args.arch}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from triton_cache import keyed_as, libtriton_hash

    try:  # before the drive: a wrong wheel is refused in seconds, not after the compiles
        their_key = libtriton_hash(args.key_as_wheel) if args.key_as_wheel else None
    except ValueError as err:
        ap.error(f"--key-as-wheel: {err}")
    from hf_dilated.ops.triton.hopper import switch

    try:
        full_errors = switch("KERNEL_RESOURCES_FULL_ERRORS", default=False)
    except ValueError as err:
        ap.error(str(err))
    shapes = args.shapes[:1] if args.quick else args.shapes
    launches: list[Launch] = []
    case = [""]
    if args.candidates:
        launches = candidate_launches(args.arch, args.shapes[0], getattr(torch, args.dtypes[0]), args.n)
    else:
        with recorded_launches(args.arch, launches, case):
            for shape in shapes:
                for dtype in args.dtypes:
                    drive(shape, getattr(torch, dtype), args.n, args.quick, case)
    if args.kernels:
        names = sorted({launch.fn.__name__ for launch in launches})
        launches = [launch for launch in launches if any(k in launch.fn.__name__ for k in args.kernels)]
        if not launches:
            ap.error(f"--kernels {' '.join(args.kernels)} matched none of the kernels launched: {', '.join(names)}")
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
    unique: dict[tuple, Resources] = {}
    with keyed_as(their_key):
        for launch in tqdm(launches, desc=f"compiling for sm_{args.arch}", unit="launch", file=sys.stderr):
            key, flags = specialisation(launch, args.arch)
            if key not in unique:
                launch_key = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
                sass = os.path.join(args.sass, f"{launch.fn.__name__}-{launch_key}.sass") if args.sass else None
                unique[key] = compile_launch(launch, args.arch, full_errors, sass)
                unique[key].specialised = flags
                unique[key].launch_key = launch_key
            unique[key].cases.append(launch.case)
    rows = list(unique.values())
    print(f"Triton {triton.__version__}, sm_{args.arch}, {len(launches)} launches, {len(rows)} distinct kernels")
    print(f"{'kernel':26} {'config':40} {'specialised':30} {'regs':>4} {'spill st/ld':>11} {'in loops':>8} "
          f"{'loop ins/mma':>12} {'smem KB':>7} {'warps/SM':>8} {'wgmma':>6}  first case")
    for r in rows:
        cfg = " ".join(f"{k.replace('BLOCK_', '').replace('num_', '')}={v}" for k, v in r.config.items())
        spill = "" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
        smem = "" if r.shared is None else f"{r.shared / 1024:.0f}"
        hot = "" if r.spill_instructions is None else f"{r.spill_instructions_in_loops}/{r.spill_instructions}".replace(
            "None", "?")
        loop = "" if r.leanest_loop_instructions is None else f"{r.leanest_loop_instructions}/{r.leanest_loop_mma}"
        print(f"{r.kernel:26} {cfg:40} {r.specialised:30} {r.registers or '':>4} {spill:>11} {hot:>8} {loop:>12} "
              f"{smem:>7} {r.warps_per_sm or '':>8} {'serial' if r.wgmma_serialized else '':>6}  {r.cases[0]}"
              + (f"\n    ERROR {r.error}" if r.error else ""))
        if args.loops and r.loop_spills:
            exp2 = r.loop_exp2_before_wait or [None] * len(r.loop_spills)
            print("    tile loops: " + "; ".join(
                f"{ins} ins, {mma} mma, spills {st} st / {ld} ld, {bars} barriers"
                + (f", exp2 before the full wgmma wait {e[0]}/{e[1]}" if e else "")
                for (ins, mma, st, ld, bars), e in zip(r.loop_spills, exp2))
                + (f"  (SASS: {r.launch_key})" if args.sass else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "torch": torch.__version__, "arch": args.arch,
                       "command": "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
                       "kernels": [asdict(r) for r in rows]}, f, indent=1)
    serial = [r for r in rows if r.wgmma_serialized]
    if serial:  # a performance finding, not a failure: the kernel runs, its products one at a time
        print(f"{len(serial)} kernel(s) with wgmma serialized by ptxas (column 'wgmma'): "
              + ", ".join(sorted({f'{r.kernel} {r.config} ({r.wgmma_reason})' for r in serial})))
    if args.candidates:
        print(candidate_summary(rows))
    if args.compare:
        print(compare(json.load(open(args.compare)), rows))
    failed = [r for r in rows if r.error]
    if failed:
        print(f"{len(failed)} kernel(s) failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
