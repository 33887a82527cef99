"""scripts/bench_ring.py's ``torch_context_parallel_sdpa`` (PyTorch's context parallelism, what accelerate runs with
cp_backend="torch") on CPU with gloo: the whole script (check and compare phases) on forked ranks.

PyTorch's ring calls the CUDA SDPA kernels only. With a CPU stand-in for the flash-attention one (aten's CPU flash
kernel behind ``_scaled_dot_product_flash_attention`` and its backward), the ring runs here: its output and gradients
match dense SDPA, on the whole world's mesh and on a sub-group's. Without it, the method is recorded as skipped and
the others still run.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

try:
    from hf_dilated.scripts import bench_ring
except ImportError:  # a source checkout on PYTHONPATH (hf_dilated.scripts exists once the package is installed)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_ring

TINY = ["--device", "cpu", "--tiny", "--phases", "check,compare", "--compare-shard", "128", "--check-shard", "96",
        "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--reps", "1"]


def _cpu_flash_kernel():
    """CPU kernels for aten's (CUDA) flash attention and its backward, and SDPA calling it inside the bench's context
    (``context_parallel`` wraps the F.scaled_dot_product_attention it finds; outside, CPU SDPA is the reference).
    Returns the library (keep it)."""
    aten = torch.ops.aten
    lib = torch.library.Library("aten", "IMPL")

    def forward(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)
        scalar = q.new_zeros(())  # the outputs without a DTensor placement must be scalars
        seed = torch.zeros(2, dtype=torch.int64)
        return out, lse, scalar, scalar, q.shape[2], k.shape[2], seed, torch.zeros((), dtype=torch.int64), q[:0]

    def backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                 scale=None):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, dropout_p,
                                                                         is_causal, scale=scale)

    lib.impl("_scaled_dot_product_flash_attention", forward, "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", backward, "CPU")

    def scaled_dot_product_attention(q, k, v, is_causal=False):  # F's name: context_parallel patches F by it
        return aten._scaled_dot_product_flash_attention(q, k, v, is_causal=is_causal)[0]

    cp_step = bench_ring.Bench.cp_step.__wrapped__

    def flash_cp_step(self, p, buffers):
        sdpa, F.scaled_dot_product_attention = F.scaled_dot_product_attention, scaled_dot_product_attention
        try:
            yield from cp_step(self, p, buffers)
        finally:
            F.scaled_dot_product_attention = sdpa

    bench_ring.Bench.cp_step = contextlib.contextmanager(flash_cp_step)
    return lib


def _rank(rank, world, port, argv, kernel, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        lib = _cpu_flash_kernel() if kernel else None  # its kernels live as long as it does
        sdpa = F.scaled_dot_product_attention
        bench_ring.main(argv)
        del lib
        queue.put((rank, "ok" if F.scaled_dot_product_attention is sdpa else "F.scaled_dot_product_attention left"))
    except BaseException:
        queue.put((rank, traceback.format_exc()))


def _run(world, out, kernel, timeout=300.0):
    """The script on ``world`` forked gloo ranks; its JSON rows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    argv = TINY + ["--out", str(out)]
    procs = [ctx.Process(target=_rank, args=(r, world, port, argv, kernel, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert all(v == "ok" for v in results.values()), results
    (path,) = out.glob("ring-*.json")
    assert path.with_suffix(".png").exists()
    return json.loads(path.read_text())["rows"]


def _rows(rows, phase, method):
    return {r["gpus"]: r for r in rows if r["phase"] == phase and r["method"] == method}


@pytest.mark.timeout(400)
def test_context_parallel_matches_dense_sdpa_on_the_world_and_a_sub_group(tmp_path):
    rows = _run(4, tmp_path, kernel=True)
    check = _rows(rows, "check", bench_ring.TORCH_CP)
    assert sorted(check) == [2, 4]  # 2: a sub-group of the 4 ranks (from_group), 4: the world (init_device_mesh)
    for p, r in check.items():
        assert r["ok"] and r["api"] == "torch.context_parallel" and r["rotate"] == "allgather", r
        assert max(r[f"rel_err_{x}"] for x in ("out", "dq", "dk", "dv")) < 1e-5, r
    compare = _rows(rows, "compare", bench_ring.TORCH_CP)
    assert sorted(compare) == [1, 2, 4] and all(r["ms"] > 0 for r in compare.values()), compare
    for method in bench_ring.METHODS:
        assert _rows(rows, "check", method) and _rows(rows, "compare", method), method


@pytest.mark.timeout(300)
def test_context_parallel_without_a_cpu_kernel_is_skipped_and_the_rest_runs(tmp_path):
    rows = _run(2, tmp_path, kernel=False)
    for phase, sizes in (("check", [2]), ("compare", [1, 2])):
        cp = _rows(rows, phase, bench_ring.TORCH_CP)
        assert sorted(cp) == sizes, cp
        assert all("NotImplementedError" in r["skipped"] and "ms" not in r for r in cp.values()), cp
        dense = _rows(rows, phase, "dense_sdpa_allgather")
        assert sorted(dense) == sizes and all(r.get("ok", True) and r.get("ms", 1) > 0 for r in dense.values())
