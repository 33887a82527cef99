"""Benchmark sequence-parallel dilated attention ("dilated_ring") on 1..W GPUs of one host, launched by torchrun.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 scripts/bench_ring.py --out $OUT

For each group size P = 1, 2, 4, ... W (sub-groups of the launched ranks), bf16, H = 16, D = 128, LongNet branches,
causal, one long document whose shards cut every segment (positions start at 16384: the misaligned, costly case):
- check: the ring's output and every gradient against the single-device op on the gathered sequence (before timing);
- weak scaling: forward+backward time at a fixed shard per GPU; efficiency = time(1 GPU) / time(P GPUs);
- bytes: the rows each rank received (the plan's) against the cost model (hf_dilated.distributed.cost_model);
- against Ulysses (all-to-all to a slice of heads, "dilated" with the global head offset), a dense SDPA
  context-parallel baseline (all-gather of K/V, flash attention on the local queries) and PyTorch's own context
  parallelism on dense causal SDPA, the one accelerate runs with ``ParallelismConfig(cp_size=P, cp_backend="torch")``
  (``torch_context_parallel_sdpa``, checked against dense SDPA too), at a smaller shard;
- the largest N that runs forward+backward on 1, 2, 4, ... GPUs: the shard doubles from --largest-start until a
  step runs out of memory (caught, memory released) or the linear fit of peak memory predicts > 95% of the GPU.
Writes ``<out>/ring-<gpu>-<date>.json`` (rows, GPU, versions, command) and a PNG beside it after every phase.
``--device cpu`` (gloo, the reference backend, tiny sizes) checks the script itself.

``torch_context_parallel_sdpa`` calls what accelerate's ``maybe_context_parallel`` calls: ``set_rotate_method`` (the
rotate method of ``$PARALLELISM_CONFIG_CP_COMM_STRATEGY``, accelerate's default "allgather"), then
``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2] * 4,
no_restore_buffers=...)`` on whole-sequence buffers, which it shards in place (load balanced for causal attention:
rank r keeps chunks r and 2P-1-r of 2P) while it swaps ``F.scaled_dot_product_attention`` for its ring attention.
It calls torch's API for every P (rows say ``"api": "torch.context_parallel"``), not accelerate's: an ``Accelerator``
with ``cp_size`` > 1 wants an FSDP2 plugin and the whole world (no P < W), ``maybe_context_parallel`` needs a
``prepare()`` first, and its state is a process-wide singleton that the trainer phase's Trainer would inherit. The
mesh is accelerate's ``init_device_mesh(device, (P,), mesh_dim_names=("cp",))`` for the whole world, and the existing
sub-group (``DeviceMesh.from_group``, no collective) for P < W. Its ring has kernels for the CUDA SDPA backends only:
on CPU (no sharding rule for CPU SDPA) its rows say ``skipped`` with torch's reason.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hf_dilated  # noqa: E402
from hf_dilated.distributed import cost_model  # noqa: E402
from hf_dilated.distributed.collectives import all_to_all  # noqa: E402
from hf_dilated.distributed.dilated_ring import _PLANS, dilated_ring_attention  # noqa: E402
from hf_dilated.distributed.sharding import shard_range  # noqa: E402

LONGNET = [(2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)]
SHIFT = 16384  # positions start here: every shard boundary cuts a segment of every branch
TORCH_CP = "torch_context_parallel_sdpa"
METHODS = ("dilated_ring", "ulysses_dilated", "dense_sdpa_allgather", TORCH_CP)
LABELS = {TORCH_CP: 'torch context_parallel (accelerate cp_backend="torch")'}


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather_sequence(x, p, group):
    """``[1, H, S, D]`` shards of ``p`` ranks -> ``[1, H, p S, D]``, differentiable (the gradient of each copy returns
    to its owner and the copies' gradients add up). (torch.distributed.nn.functional.all_gather's backward gave wrong
    key gradients in a sub-group here.)"""
    if p == 1:
        return x
    _, h, n, d = x.shape
    rows = x.permute(2, 0, 1, 3).reshape(n, h * d)
    got = all_to_all(rows.repeat(p, 1), [n] * p, [n] * p, group)
    return got.view(p * n, 1, h, d).permute(1, 2, 0, 3)


class Bench:
    def __init__(self, args):
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cuda = args.device == "cuda"
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        self.dtype = torch.bfloat16 if cuda else torch.float32
        self.backend = "auto" if cuda else "torch"
        self.H, self.Hk, self.D = args.heads, args.kv_heads, args.head_dim
        self.branches = LONGNET if not args.tiny else [(16, 1), (32, 2), (64, 4)]
        self.shift = SHIFT if not args.tiny else 24
        self.sizes = [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= self.world]
        self.groups = {p: dist.new_group(list(range(p))) for p in self.sizes}
        self.meshes = {}  # P -> DeviceMesh of ranks 0..P-1 for torch_context_parallel_sdpa, made on first use
        self.cp_rotate = os.environ.get("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "allgather")  # as accelerate
        self.rows, self.t0 = [], time.monotonic()
        self.out = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "benchmarks",
                                                                    "results")
        gpu = torch.cuda.get_device_name(self.device) if cuda else platform.processor() or "cpu"
        self.meta = {
            "gpu": gpu, "gpus": self.world, "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": _version("triton"), "transformers": _version("transformers"), "python": platform.python_version(),
            "accelerate": _version("accelerate"),
            "command": "%s %d %s" % ("accelerate launch --multi_gpu --num_processes" if any(
                k.startswith("ACCELERATE_") for k in os.environ) else "torchrun --nproc-per-node", self.world,
                " ".join(sys.argv)),
            "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"), "dtype": str(self.dtype), "heads": self.H,
            "kv_heads": self.Hk, "head_dim": self.D, "branches": self.branches, "causal": True,
            "positions_start": self.shift, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "flops": "useful (query, key) pairs x 4 D, forward+backward = 3.5 x forward (as bench_attention.py)",
        }
        self.stamp = f"ring-{gpu.replace(' ', '-')}-{datetime.date.today()}"

    # ---- helpers -------------------------------------------------------------------------------------------------
    def over_budget(self) -> bool:
        """The same decision on every rank (rank 0's clock)."""
        flag = torch.tensor([time.monotonic() - self.t0 > self.args.budget_s], dtype=torch.int32,
                            device=self.device)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    def tensors(self, n, seed):
        """q, k, v, dout of a whole sequence of ``n`` tokens (identical on every rank: one seed)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        mk = lambda h: torch.randn(1, h, n, self.D, generator=g, device=self.device, dtype=self.dtype)
        return mk(self.H), mk(self.Hk), mk(self.Hk), mk(self.H)

    def shard(self, full, p, n):
        s, e = shard_range(n, p, self.rank)
        return tuple(t[:, :, s:e].detach().clone().requires_grad_(i < 3) for i, t in enumerate(full))

    def local(self, p, n, seed):
        """This rank's shard of random q, k, v, dout (no whole sequence is ever allocated)."""
        s, e = shard_range(n, p, self.rank)
        g = torch.Generator(device=self.device).manual_seed(seed * 1000 + self.rank)
        mk = lambda h, grad: torch.randn(1, h, e - s, self.D, generator=g, device=self.device, dtype=self.dtype,
                                         requires_grad=grad)
        return mk(self.H, True), mk(self.Hk, True), mk(self.Hk, True), mk(self.H, False)

    def positions(self, n):
        return (torch.arange(n, device=self.device) + self.shift)[None]

    def ws_rs(self):
        return [w for w, _ in self.branches], [r for _, r in self.branches]

    def timed(self, fn, group, reps):
        fn()  # warm-up (compiles, plans)
        sync(self.device)
        dist.barrier(group=group)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(self.device)
        elapsed = torch.tensor([(time.perf_counter() - t) / reps], device=self.device, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        return float(elapsed) * 1e3

    def record(self, **row):
        if self.rank == 0:
            row["elapsed_s"] = round(time.monotonic() - self.t0, 1)
            print(json.dumps(row), flush=True)
            self.rows.append(row)
            self.save(plot=False)

    # ---- the three methods, on the local shard ----------------------------------------------------------------------
    # Each returns a step closure over this rank's shard (q, k, v, dout); a step returns (out, dq, dk, dv).
    def ring_step(self, p, n, shard):
        s, e = shard_range(n, p, self.rank)
        q, k, v, do = shard
        pos = self.positions(n)[:, s:e]
        ws, rs = self.ws_rs()

        def step():
            for t in (q, k, v):
                t.grad = None
            out = dilated_ring_attention(q, k, v, ws, rs, position_ids=pos, group=self.groups[p], backend=self.backend)
            out.backward(do)
            return out.detach(), q.grad, k.grad, v.grad

        return step

    def ulysses_step(self, p, n, shard):
        """Head parallelism: all-to-all from a shard of tokens to all tokens of H / p heads, "dilated" with the
        global head offset, and back (DeepSpeed-Ulysses' scheme with this library's differentiable all-to-all)."""
        group = self.groups[p]
        q, k, v, do = shard
        pos = self.positions(n)
        ws, rs = self.ws_rs()

        def to_heads(x):  # [1, H, n/p, D] -> [1, H/p, n, D]
            h = x.shape[1] // p
            send = x.view(1, p, h, -1, self.D).transpose(0, 1).reshape(-1, self.D)
            split = [send.shape[0] // p] * p
            got = all_to_all(send, split, split, group).view(p, h, -1, self.D)
            return got.permute(1, 0, 2, 3).reshape(1, h, -1, self.D)

        def to_tokens(x):  # [1, H/p, n, D] -> [1, H, n/p, D]
            h = x.shape[1]
            send = x.view(h, p, -1, self.D).permute(1, 0, 2, 3).reshape(-1, self.D)
            split = [send.shape[0] // p] * p
            got = all_to_all(send, split, split, group).view(p, h, -1, self.D)
            return got.reshape(1, p * h, -1, self.D)

        def step():
            for t in (q, k, v):
                t.grad = None
            qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
            rank = dist.get_rank(group)
            out = hf_dilated.dilated_attention(qh, kh, vh, ws, rs, position_ids=pos, head_offset=rank * qh.shape[1],
                                               backend=self.backend)
            out = to_tokens(out)
            out.backward(do)
            return out.detach(), q.grad, k.grad, v.grad

        return step

    def dense_step(self, p, n, shard):
        """Dense causal attention with the keys and values all-gathered (Llama-3-style context parallelism without
        load balancing): SDPA (flash) on the local queries against every earlier key."""
        from torch.nn.attention.bias import causal_lower_right

        s, e = shard_range(n, p, self.rank)
        group = self.groups[p]
        q, k, v, do = shard

        def step():
            for t in (q, k, v):
                t.grad = None
            kk, vv = (gather_sequence(t, p, group)[:, :, :e] for t in (k, v))
            rep = self.H // self.Hk
            kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
            out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=causal_lower_right(e - s, e))
            out.backward(do)
            return out.detach(), q.grad, k.grad, v.grad

        return step

    def cp_mesh(self, p):
        """The DeviceMesh of ranks 0..p-1: for the whole world accelerate's (``init_device_mesh``, which every rank
        calls: here every rank is in it), else the existing sub-group's (``from_group`` creates no process group, so
        the ranks outside need not call anything)."""
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if p not in self.meshes:
            self.meshes[p] = (init_device_mesh(self.device.type, (p,), mesh_dim_names=("cp",))["cp"]
                              if p == self.world else
                              DeviceMesh.from_group(self.groups[p], self.device.type, mesh_dim_names=("cp",)))
        return self.meshes[p]

    @contextlib.contextmanager
    def cp_step(self, p, buffers):
        """PyTorch's context parallelism as accelerate's ``maybe_context_parallel`` runs it (module docstring) on
        ``buffers`` = whole-sequence q, k, v, dout and any more tensors to shard alike, which it shards in place (they
        are the caller's, not needed after, none requiring grad: ``resize_`` refuses those). Yields a step on this
        rank's shard, and the further buffers' shards."""
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        q, k, v, do = buffers[:4]
        rep = self.H // self.Hk
        sdpa = F.scaled_dot_product_attention
        set_rotate_method(self.cp_rotate)
        try:
            with context_parallel(self.cp_mesh(p), buffers=buffers, buffer_seq_dims=[2] * len(buffers),
                                  no_restore_buffers=set(buffers)):
                for t in (q, k, v):
                    t.requires_grad_()

                def step():
                    for t in (q, k, v):
                        t.grad = None
                    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                         is_causal=True)
                    out.backward(do)
                    return out.detach(), q.grad, k.grad, v.grad

                yield step, buffers[4:]
        finally:
            F.scaled_dot_product_attention = sdpa  # torch 2.11's context leaves its ring in place after an exception

    def agreed(self, p, err):
        """``{}``, or the failure of this rank or another of the group (the same verdict on all): ``skipped`` where
        torch has no context-parallel kernel (NotImplementedError: CPU), ``error`` otherwise (out of memory, ...)."""
        code = 0 if err is None else 2 if isinstance(err, NotImplementedError) else 1
        flag = torch.tensor([code], device=self.device, dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.groups[p])
        if not flag.item():
            return {}
        message = f"{type(err).__name__}: {err}"[:400] if err is not None else "failed on another rank"
        return {"skipped" if flag.item() == 2 else "error": message}

    def cp_check(self, p, full, want):
        """The relative errors of this rank's shard of the output and gradients against ``want`` (the single-device
        ones, sharded alike by the context), and the agreed failure."""
        errs, failure = [float("nan")] * 4, None
        try:
            with self.cp_step(p, [*full, *(t.detach().clone() for t in want)]) as (step, shards):
                errs = [rel_err(a, b) for a, b in zip(step(), shards)]
        except Exception as err:  # recorded (a rank that fails inside a collective leaves the others waiting)
            failure = err
        return errs, self.agreed(p, failure)

    def cp_timed(self, p, n):
        """``{"ms", "peak_gib"}`` of forward+backward, or the agreed failure (memory released). The peak counts from
        the sharded buffers on: ``resize_`` keeps each one's whole-sequence storage (as under accelerate)."""
        cuda = self.device.type == "cuda"
        row, failure = {}, None
        try:
            with self.cp_step(p, list(self.tensors(n, seed=3))) as (step, _):
                if cuda:
                    torch.cuda.reset_peak_memory_stats(self.device)
                row["ms"] = self.timed(step, self.groups[p], 1)
                row["peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else None
        except Exception as err:  # out of memory or no kernel: recorded, the other methods go on
            failure = err
        if cuda:
            torch.cuda.empty_cache()
        return self.agreed(p, failure) or row

    # ---- phases --------------------------------------------------------------------------------------------------
    def check(self):
        """Every timed method against its single-device computation on the gathered sequence: output and every
        gradient (the ring and Ulysses against the dilated op, the dense baseline and torch's context parallelism
        against causal SDPA)."""
        for p in self.sizes[1:]:
            if self.rank < p:
                for method in METHODS:
                    ragged = method == "dilated_ring"
                    if method == "ulysses_dilated" and (self.H % p or self.Hk % p):
                        continue
                    n = self.args.check_shard * p + (3 if ragged else 0)
                    full = self.tensors(n, seed=1)
                    q, k, v, do = (t.detach().clone().requires_grad_(i < 3) for i, t in enumerate(full))
                    if method in ("dense_sdpa_allgather", TORCH_CP):
                        rep = self.H // self.Hk
                        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                                             v.repeat_interleave(rep, 1), is_causal=True)
                    else:
                        ws, rs = self.ws_rs()
                        ref = hf_dilated.dilated_attention(q, k, v, ws, rs, position_ids=self.positions(n),
                                                           backend=self.backend)
                    ref.backward(do)
                    want, failed = (ref, q.grad, k.grad, v.grad), {}
                    if method == TORCH_CP:  # its shards are load balanced: the context shards ``want`` alike
                        errs, failed = self.cp_check(p, full, want)
                    else:
                        got = self.step_of(method)(p, n, self.shard(full, p, n))()
                        s, e = shard_range(n, p, self.rank)
                        errs = [rel_err(a, b[:, :, s:e]) for a, b in zip(got, want)]
                        del got
                    errs = torch.tensor(errs, device=self.device, dtype=torch.float64)
                    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=self.groups[p])
                    api = {"api": "torch.context_parallel", "rotate": self.cp_rotate} if method == TORCH_CP else {}
                    if failed:
                        self.record(phase="check", method=method, gpus=p, N=n, **api, **failed)
                    else:
                        self.record(phase="check", method=method, gpus=p, N=n, rel_err_out=float(errs[0]),
                                    rel_err_dq=float(errs[1]), rel_err_dk=float(errs[2]), rel_err_dv=float(errs[3]),
                                    ok=bool(errs.max() < 1e-2), **api)
                    del full, q, k, v, do, ref, want
            dist.barrier()

    def step_of(self, method):
        """The step builder of a method on a contiguous shard (all but TORCH_CP, whose context shards for itself)."""
        return {"dilated_ring": self.ring_step, "ulysses_dilated": self.ulysses_step,
                "dense_sdpa_allgather": self.dense_step}[method]

    def alone_on_every_gpu(self, S):
        """Every rank runs the one-GPU step on its own ``S`` tokens at the same time, without communicating: the
        slowest GPU's time, which separates the spread of the GPUs (clocks, the node's shared power) from the ring's
        own cost in the weak-scaling efficiency (measured on GPU 0 alone)."""
        g = torch.Generator(device=self.device).manual_seed(7 + self.rank)
        mk = lambda h, grad: torch.randn(1, h, S, self.D, generator=g, device=self.device, dtype=self.dtype,  # noqa
                                         requires_grad=grad)
        q, k, v, do = mk(self.H, True), mk(self.Hk, True), mk(self.Hk, True), mk(self.H, False)
        pos, (ws, rs) = self.positions(S), self.ws_rs()

        def step():
            for t in (q, k, v):
                t.grad = None
            hf_dilated.dilated_attention(q, k, v, ws, rs, position_ids=pos, backend=self.backend).backward(do)

        ms = self.timed(step, None, self.args.reps)
        self.record(phase="weak_scaling", method="one_gpu_step_on_every_gpu_at_once", gpus=self.world, N=S, shard=S,
                    ms=ms)
        del q, k, v, do

    def weak_scaling(self):
        S = self.args.shard
        base = rate = None
        if self.world > 1 and not self.over_budget():
            self.alone_on_every_gpu(S)
        for p in self.sizes:
            if self.over_budget():
                return
            if self.rank < p:
                n = S * p
                shard = self.local(p, n, seed=2)
                if self.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(self.device)
                ms = self.timed(self.ring_step(p, n, shard), self.groups[p], self.args.reps)
                peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
                plan = _PLANS.entries[0][2] if p > 1 and _PLANS.entries else None
                rows = torch.tensor([sum(plan.recv_splits) if plan else 0], device=self.device, dtype=torch.float64)
                dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=self.groups[p])
                row_bytes = 2 * self.D * (2 if self.dtype == torch.bfloat16 else 4)
                predicted_rows = max(
                    sum(cost_model.rows_received(n, p, r, self.branches, self.H, self.Hk, True, self.shift).values())
                    for r in range(p))
                flops = 3.5 * 4 * self.D * cost_model.pairs_computed(n, p, p - 1, self.branches, self.H, True, self.shift)
                if base is None:
                    base, rate = ms, flops / ms * 1e3  # the cost model's compute rate: measured on one GPU
                hw = cost_model.Hardware(flops=rate)
                model = cost_model.predict(n, p, self.branches, self.H, self.Hk, self.D, 2, True, self.shift, hw)
                self.record(phase="weak_scaling", method="dilated_ring", gpus=p, N=n, shard=S, ms=ms,
                            predicted_ms=model.step_s * 1e3, predicted_comm_ms=model.comm_s * 1e3,
                            efficiency=base / ms, tflops_per_gpu=flops / ms / 1e9, peak_gib=peak,
                            bytes_per_rank_measured=2 * float(rows) * row_bytes,
                            bytes_per_rank_predicted=2 * predicted_rows * row_bytes)
            dist.barrier()

    def compare(self):
        S = self.args.compare_shard
        for p in self.sizes:
            for method in METHODS:
                if self.over_budget():
                    return
                if method == "ulysses_dilated" and (self.H % p or self.Hk % p):
                    continue
                if self.rank < p:
                    n = S * p
                    if method == TORCH_CP:  # dense, like the all-gather baseline: one timed step
                        row = {"api": "torch.context_parallel", "rotate": self.cp_rotate, **self.cp_timed(p, n)}
                    else:
                        cuda = self.device.type == "cuda"
                        shard = self.local(p, n, seed=3)
                        if cuda:
                            torch.cuda.reset_peak_memory_stats(self.device)
                        reps = 1 if method == "dense_sdpa_allgather" else self.args.reps
                        ms = self.timed(self.step_of(method)(p, n, shard), self.groups[p], reps)
                        del shard
                        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else None
                        row = {"ms": ms, "peak_gib": peak}
                    self.record(phase="compare", method=method, gpus=p, N=n, shard=S, **row)
                dist.barrier()

    def _probe_step(self, p, S):
        """One ring forward+backward at ``S`` tokens per GPU: ``(ran, ms, peak GiB)``, the same verdict on every rank
        of the group (a rank out of memory makes all report it). Memory is released either way."""
        n = S * p
        cuda = self.device.type == "cuda"
        _PLANS.entries.clear()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        ran, ms = 1, float("nan")
        shard = step = None
        try:
            shard = self.local(p, n, seed=5)
            step = self.ring_step(p, n, shard)
            t = time.perf_counter()
            step()
            sync(self.device)
            ms = (time.perf_counter() - t) * 1e3
        except torch.cuda.OutOfMemoryError:
            ran = 0
        del shard, step
        _PLANS.entries.clear()
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else None
        if cuda:
            torch.cuda.empty_cache()
        flag = torch.tensor([ran], device=self.device, dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.groups[p])
        return bool(flag.item()), ms, peak

    def largest(self):
        """The largest N whose ring forward+backward runs on 1, 2, 4, ... GPUs: from ``--largest-start`` tokens per
        GPU, double until a step runs out of memory (``torch.cuda.OutOfMemoryError``, caught, memory released), or
        until the peak memory fitted linearly on the last two runs predicts more than 95% of the GPU (a run that
        would certainly fail is not tried: an out-of-memory error inside a collective can leave peers waiting), or
        ``--largest-max``."""
        cuda = self.device.type == "cuda"
        total = torch.cuda.get_device_properties(self.device).total_memory / 2**30 if cuda else float("inf")
        for p in self.sizes:
            if self.over_budget():
                return
            if self.rank < p:
                S, best, runs = self.args.largest_start, None, []
                while S <= self.args.largest_max:
                    if len(runs) >= 2 and cuda:  # linear in S: predict before trying
                        (s0, m0), (s1, m1) = runs[-2:]
                        guess = torch.tensor([m1 + (m1 - m0) / (s1 - s0) * (S - s1)], device=self.device)
                        dist.all_reduce(guess, op=dist.ReduceOp.MAX, group=self.groups[p])
                        if float(guess) > 0.95 * total:
                            self.record(phase="largest_probe", gpus=p, N=S * p, shard=S, ran=False,
                                        skipped=f"predicted peak {float(guess):.1f} GiB > 95% of {total:.1f} GiB")
                            break
                    ran, ms, peak = self._probe_step(p, S)
                    self.record(phase="largest_probe", gpus=p, N=S * p, shard=S, ran=ran, first_step_ms=ms,
                                peak_gib=peak)
                    if not ran:
                        break
                    best = (S, ms, peak)
                    runs.append((S, peak or 0.0))
                    S *= 2
                if best is not None:
                    self.record(phase="largest", gpus=p, N=best[0] * p, shard=best[0], first_step_ms=best[1],
                                peak_gib=best[2], gpu_gib=total if cuda else None)
            dist.barrier()

    def trainer(self):
        """A Trainer step of a random Llama under sequence parallelism (``hf_dilated.distributed.trainer``): groups of
        2 ranks (data parallel over the rest), one ``--trainer-tokens`` row per rank, bf16 autocast on CUDA. Checks the
        step's loss and gradients against rank 0 running the same rows on one device (``"dilated"``), then times
        ``--reps`` more steps. Needs no datasets (random tokens)."""
        import copy
        import tempfile

        from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

        from hf_dilated.distributed import enable_sequence_parallel
        from hf_dilated.distributed.trainer import SequenceParallelTrainer, loss_sum
        from hf_dilated.distributed.sharding import shard_batch

        if self.world < 2 or self.world % 2:
            return
        cuda = self.device.type == "cuda"
        n = self.args.trainer_tokens
        tiny = self.args.tiny
        cfg = LlamaConfig(vocab_size=512 if tiny else 16384, hidden_size=64 if tiny else 1024,
                          intermediate_size=128 if tiny else 2816, num_hidden_layers=2 if tiny else 4,
                          num_attention_heads=4 if tiny else self.H, num_key_value_heads=2 if tiny else self.Hk,
                          head_dim=16 if tiny else self.D, max_position_embeddings=max(n, 4096), use_cache=False)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        model.config.dilated_attention = {"segment_lengths": [w for w, _ in self.branches],
                                          "dilation_rates": [r for _, r in self.branches],
                                          "backend": self.backend}
        model.set_attn_implementation("dilated")
        reference = copy.deepcopy(model).to(self.device) if self.rank == 0 else None
        gen = torch.Generator().manual_seed(7)
        ids = torch.randint(0, cfg.vocab_size, (self.world, n), generator=gen)
        rows = [{"input_ids": row, "labels": row} for row in ids]
        grads = {}

        class Grads(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
                if not grads:
                    grads.update({k: p.grad.detach().float().clone() for k, p in model.named_parameters()})

        enable_sequence_parallel(model, 2)
        with tempfile.TemporaryDirectory() as scratch:
            args = TrainingArguments(output_dir=scratch, per_device_train_batch_size=1, max_steps=1 + self.args.reps,
                                     learning_rate=0.0, max_grad_norm=0.0, bf16=cuda, use_cpu=not cuda,
                                     report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
                                     dataloader_num_workers=0, seed=0)
            data = _InOrder(rows * (1 + self.args.reps))
            trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=data, callbacks=[Grads()])
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            t = time.perf_counter()
            trainer.train()
            sync(self.device)
            seconds = time.perf_counter() - t
            first = trainer.state.log_history[0]["loss"]
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else None
        if self.rank == 0:  # the same rows (all of step 1: one per rank), one at a time, on one device
            total = sum(int((r["labels"][1:] != -100).sum()) for r in rows)
            ref_loss = 0.0
            for r in rows:
                batch = shard_batch({k: v[None].to(self.device) for k, v in r.items()}, rank=0, world_size=1)
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cuda):
                    loss = loss_sum(reference, batch) / total
                loss.backward()
                ref_loss += float(loss)
            errs = {k: rel_err(grads[k], p.grad.float()) for k, p in reference.named_parameters()}
            worst = max(errs, key=errs.get)
            self.record(phase="trainer", gpus=self.world, sequence_parallel=2, N=n, shard=n // 2,
                        loss=first, loss_single_device=ref_loss, loss_rel_err=abs(first - ref_loss) / abs(ref_loss),
                        grad_rel_err_max=errs[worst], grad_worst=worst, ok=errs[worst] < 5e-2,
                        step_s=seconds / (1 + self.args.reps), peak_gib=peak,
                        params=sum(p.numel() for p in model.parameters()))
            del reference
        dist.barrier()

    # ---- output --------------------------------------------------------------------------------------------------
    def save(self, plot=True):
        os.makedirs(self.out, exist_ok=True)
        path = os.path.join(self.out, self.stamp + ".json")
        with open(path, "w") as f:
            json.dump({"meta": self.meta, "rows": self.rows}, f, indent=1)
        if not plot:
            return
        try:
            self.plot(path[:-5] + ".png")
        except Exception as err:  # a plot must not lose the numbers
            print(f"plot failed: {err!r}", flush=True)

    def plot(self, path):
        """Weak scaling, bytes per rank, the methods compared and the largest N; nothing for phases without a panel
        (check, trainer: their numbers are in the JSON)."""
        if not any(r["phase"] in ("weak_scaling", "compare", "largest") for r in self.rows):
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        weak = [r for r in self.rows if r["phase"] == "weak_scaling" and r["method"] == "dilated_ring"]
        alone = [r for r in self.rows if r["phase"] == "weak_scaling" and r["method"] != "dilated_ring"]
        if weak:
            ax = axes[0]
            ax.plot([r["gpus"] for r in weak], [r["ms"] for r in weak], "o-", label="dilated_ring")
            for r in alone:
                ax.axhline(r["ms"], color="gray", ls="--", label=f"1-GPU step on all {r['gpus']} GPUs at once (slowest)")
            ax.legend(fontsize="small")
            ax.set_xlabel("GPUs")
            ax.set_ylabel("fwd+bwd ms")
            ax.set_title(f"weak scaling, {weak[0]['shard'] // 1024}K tokens per GPU")
            for r in weak:
                ax.annotate(f"eff {r['efficiency']:.2f}", (r["gpus"], r["ms"]), textcoords="offset points",
                            xytext=(0, -14), ha="center")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)  # from zero: the efficiency is a ratio of times
            ax = axes[1]
            ax.bar([str(r["gpus"]) for r in weak], [r["bytes_per_rank_measured"] / 1e6 for r in weak], alpha=0.6,
                   label="measured (plan)")
            ax.plot([str(r["gpus"]) for r in weak], [r["bytes_per_rank_predicted"] / 1e6 for r in weak], "kx",
                    label="cost model")
            ax.set_ylabel("MB received per rank per step")
            ax.set_xlabel("GPUs")
            ax.legend()
        comp = [r for r in self.rows if r["phase"] == "compare"]
        if comp:
            ax = axes[2]
            for method in METHODS:
                rs = [r for r in comp if r["method"] == method and r.get("ms") is not None]  # not skipped or failed
                if rs:
                    ax.plot([r["gpus"] for r in rs], [r["ms"] for r in rs], "o-", label=LABELS.get(method, method))
            ax.set_xlabel("GPUs")
            ax.set_ylabel("fwd+bwd ms")
            ax.set_yscale("log")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{comp[0]['shard'] // 1024}K tokens per GPU")
            ax.legend(fontsize="small")
        big = [r for r in self.rows if r["phase"] == "largest"]
        largest = ("; largest N (fwd+bwd): " + ", ".join(f"{r['gpus']} GPU {r['N'] / 2**20:g}M" for r in big)
                   if big else "")
        fig.suptitle(f"{self.meta['gpu']}, {self.meta['dtype']}, H={self.H}, D={self.D}, LongNet branches, causal"
                     + largest)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


class _InOrder(torch.utils.data.IterableDataset):
    """Rows in order (no shuffling): Trainer's step 1 then gives rank i row i, all rows of the reference."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def _version(name):
    try:
        import importlib.metadata as md

        return md.version(name)
    except Exception:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shard", type=int, default=262144, help="tokens per GPU for weak scaling")
    ap.add_argument("--compare-shard", type=int, default=65536, help="tokens per GPU for ring / Ulysses / dense")
    ap.add_argument("--check-shard", type=int, default=40000, help="tokens per GPU for the correctness check")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=300, help="skip later phases past this many seconds")
    ap.add_argument("--phases", default="check,weak,compare,largest")
    ap.add_argument("--trainer-tokens", type=int, default=131072, help="trainer phase: tokens per row (sequence)")
    ap.add_argument("--largest-start", type=int, default=262144, help="largest-N probe: first tokens per GPU")
    ap.add_argument("--largest-max", type=int, default=2**24, help="largest-N probe: stop doubling past this")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (CPU self-check)")
    ap.add_argument("--out", default=None, help="directory for JSON + PNG (default $OUT, else benchmarks/results)")
    args = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=180))
    bench = Bench(args)
    phases = {"check": bench.check, "weak": bench.weak_scaling, "compare": bench.compare, "largest": bench.largest,
              "trainer": bench.trainer}
    for name in args.phases.split(","):
        phases[name]()
        if bench.rank == 0:
            bench.save()  # JSON and plot after every phase: a later failure keeps these
    dist.barrier()
    if bench.rank == 0:
        bench.save()
        print("wrote", os.path.join(bench.out, bench.stamp + ".json"), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
