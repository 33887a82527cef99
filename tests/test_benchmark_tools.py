"""The CPU-side benchmark tools run as documented: ``benchmarks/host_overhead.py`` (the launch path's host time with
no-op kernels) measures the Triton launchers, not another path; ``benchmarks/kernel_resources.py`` compiles every
kernel the launch paths use for Hopper and Ampere (what the interpreter never does) and reports their resources;
``benchmarks/kernel_times.py`` (the profile scripts' ``--table`` / ``--launches``) attributes a call's time to its
kernels and lists its launches in order; ``benchmarks/branch_work.py`` counts the pairs each forward schedule computes
against a brute-force count of the pattern; ``benchmarks/ab_summary.py`` turns A/B lines into speeds and a bit-equality
verdict; ``benchmarks/host_profile.py`` summarizes py-spy's samples per thread."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_kernel_times_attributes_time_to_the_kernels_that_ran(capsys):
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from kernel_times import kernel_times, print_times

    a = torch.randn(256, 256)
    times = kernel_times(lambda: torch.mm(a, a).softmax(-1), iters=3, device="cpu")
    assert {"aten::mm", "aten::_softmax"} <= set(times)  # the operators that ran, each with a positive time
    assert all(ms > 0 for ms in times.values()) and list(times.values()) == sorted(times.values(), reverse=True)
    assert "aten::conv2d" not in times
    print_times("mm + softmax", times, rows=2)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mm + softmax: ") and len(out) == 3
    with pytest.raises(ValueError, match="iters must be"):
        kernel_times(lambda: None, iters=0)
    with pytest.raises(ValueError, match="device must be"):
        kernel_times(lambda: None, device="tpu")


def test_launch_times_lists_each_launch_in_order(capsys):
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from kernel_times import launch_times, print_launches

    a = torch.randn(256, 256)
    rows = launch_times(lambda: (torch.mm(a, a), a.softmax(-1), torch.mm(a, a.t())), device="cpu")
    names = [name for _, _, name in rows]
    assert names == ["aten::mm", "aten::softmax", "aten::t", "aten::mm"], names  # top-level operators, in order
    starts = [start for start, _, _ in rows]
    assert starts[0] == 0 and starts == sorted(starts) and all(ms >= 0 for _, ms, _ in rows)
    print_launches("mm, softmax, mm", rows)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mm, softmax, mm: 4 launches, span ") and len(out) == 5 and "aten::softmax" in out[2]
    with pytest.raises(ValueError, match="device must be"):
        launch_times(lambda: None, device="tpu")


@pytest.mark.parametrize("extra", [[], ["--graph-replay"]])
def test_host_overhead_times_the_triton_launchers(extra):
    """It times the launchers' path (with ``--graph-replay``: what a CUDA-graph replay leaves, the replays' steps
    stubbed)."""
    pytest.importorskip("triton")
    env = {"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--n", "32", *extra],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["fwd", "fwdbwd"]
    assert ("replays stubbed" in run.stdout) == bool(extra)
    for line in lines:
        low, median = (float(x) for x in re.findall(r"(\d+) us", line))
        assert 0 < low <= median


KERNELS = {"dilated_fwd_branch_kernel", "delta_kernel", "dilated_bwd_dkdv_kernel", "dilated_bwd_dq_kernel",
           "dilated_decode_kernel", "bs_fwd_kernel", "bs_bwd_dq_kernel", "bs_bwd_dkdv_kernel"}
# sm_90 also runs the dilated and block-sparse forward and dK/dV, and the dilated dQ at head dim 128 / 256, in Gluon,
# at head dim 128 the warp-specialized dilated forward and fused dK/dV, and on 128-blocks the warp-specialized
# block-sparse forward and dQ (the portable ones with HF_DILATED_GLUON=0, the one-warpgroup dilated forward with
# HF_DILATED_WS=0 and the one-program fused dK/dV with HF_DILATED_WS_DKDV=0, driven too).
EXTRA = {90: {"bs_bwd_dkdv_hopper_kernel", "dilated_bwd_dkdv_hopper_kernel", "dilated_fwd_hopper_kernel",
              "bs_fwd_hopper_kernel", "dilated_bwd_dq_hopper_kernel", "bs_fwd_ws_kernel", "bs_bwd_dq_hopper_kernel",
              "dilated_fwd_ws_kernel", "dilated_bwd_dkdv_ws_kernel"},
         80: set(), 89: set(), 120: set()}


def _ptxas_missing() -> str | None:
    try:
        from triton.backends.nvidia import compiler
    except ImportError as e:
        return f"Triton's NVIDIA backend does not import here: {e}"
    import os

    path = compiler.get_ptxas(90).path
    return None if os.path.exists(path) else f"no ptxas in the Triton wheel ({path})"


def _compiled_kernels(tmp_path, *argv: str) -> list[dict]:
    """The kernels of ``benchmarks/kernel_resources.py``'s report for ``argv`` (on a 512-token driving problem), run
    in a clean environment, which must exit 0; skips where this Triton cannot compile for a GPU here."""
    pytest.importorskip("triton")
    reason = _ptxas_missing()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "resources.json"
    env = {"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "0", "HOME": str(tmp_path), "TRITON_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_resources.py"), *argv, "--n", "512",
                          "--json", str(out)], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())["kernels"]


# 89 / 120: ~100 KB of shared memory a program (RTX 40xx, L4, L40S / RTX 50xx: what sm_80 runs, in configs that fit)
@pytest.mark.parametrize("arch", [90, 80, 89, 120])
def test_every_kernel_compiles_for_the_gpu(tmp_path, arch):
    """Every kernel the launch paths use (dilated forward, backward, decode; block-sparse) compiles for sm_90 with
    the Hopper configs and TMA, and for sm_80 / 89 / 120 without, within the GPU's shared memory: a kernel change that
    only the interpreter has run cannot break the GPU build unseen."""
    kernels = _compiled_kernels(tmp_path, "--quick", "--arch", str(arch))
    assert {k["kernel"] for k in kernels} == KERNELS | EXTRA[arch]
    for k in kernels:
        assert k["error"] is None, k
        assert 0 < k["registers"] <= 255 and 0 <= k["spill_stores"] and 0 <= k["shared"], k
        assert 0 < k["warps_per_sm"] <= 64 and k["warps_per_sm"] % k["config"].get("num_warps", 4) == 0, k
        if k["kernel"] != "delta_kernel" and k["spill_instructions"] is not None:  # bf16: tensor-core tile loops
            # the SASS reading finds the loops over tiles that hold the tensor-core instructions
            assert k["tile_loops"] >= 1 and 0 <= k["spill_instructions_in_loops"] <= k["spill_instructions"], k
            assert k["leanest_loop_instructions"] > k["leanest_loop_mma"] >= 1, k
            # per tile loop, the exponentials before its wait for every asynchronous product (Hopper's wgmma), of all
            exp2 = k["loop_exp2_before_wait"]
            assert len(exp2) == k["tile_loops"] and all(e is None or 0 <= e[0] <= e[1] for e in exp2), k
            if arch != 90:  # synchronous mma.sync: no such wait
                assert exp2 == [None] * k["tile_loops"], k
            elif k["kernel"] == "dilated_fwd_ws_kernel":  # each consumer's step: 64 x 128 scores, 64 a thread
                assert all(e is not None and e[1] >= 64 for e in exp2), k
        # ptxas did not serialize the tensor-core products (the block-sparse dQ on two warpgroups once had them so)
        assert k["wgmma_serialized"] is False, k
    tma = {k["config"].get("TMA") for k in kernels if "TMA" in k["config"]}
    assert tma == ({True} if arch == 90 else {False})  # sm_120: Hopper's configs need Hopper's shared memory


def test_head_dim_256_runs_the_gluon_kernels_on_hopper(tmp_path):
    """Gemma-style heads (8 / 2, D 256) on sm_90: the Gluon forward and dQ compile, and the Gluon dK/dV as one
    warp-specialized launch of two roles (a dV and a dK warpgroup on the same 64 keys, 224 KB at 64-query steps: K, V,
    two Q / dO buffers and two float32 ``P^T`` hand-over tiles, within the 227 KB a program may have), under this
    Triton (the GPU image's may differ)."""
    pytest.importorskip("triton")
    from hf_dilated.ops.triton import hopper

    if not hopper.available():
        pytest.skip("this Triton has no Gluon Hopper API (3.6 or newer)")
    kernels = [k for k in _compiled_kernels(tmp_path, "--quick", "--arch", "90", "--shapes", "8/2/256")
               if k["case"].startswith("8/2/256")]
    assert all(k["error"] is None for k in kernels), [k for k in kernels if k["error"]]
    names = {k["kernel"] for k in kernels}
    assert {"dilated_fwd_hopper_kernel", "dilated_bwd_dq_hopper_kernel", "dilated_bwd_dkdv_ws_kernel"} <= names
    dkdv = {k["shared"] // 1024 for k in kernels if k["kernel"] == "dilated_bwd_dkdv_ws_kernel"}
    assert dkdv == {224}, dkdv
    # with HF_DILATED_WS_DKDV=0, a launch per gradient: dV (no V in shared memory, 96 KB) and dK (128 KB)
    per_gradient = {k["shared"] // 1024 for k in kernels if k["kernel"] == "dilated_bwd_dkdv_hopper_kernel"}
    assert per_gradient == {96, 128}, per_gradient
    # the portable block-sparse dK/dV at D 256: 8 warps, no spill, products not serialized (on 4 warps: 2 KB, serial)
    bs = [k for k in kernels if k["kernel"] == "bs_bwd_dkdv_kernel"]
    assert bs and all(k["config"]["num_warps"] == 8 and not k["wgmma_serialized"] for k in bs), bs
    assert not [k for k in kernels if k["wgmma_serialized"]], [k for k in kernels if k["wgmma_serialized"]]


def test_head_dim_256_fits_gpus_with_100_kb_of_shared_memory(tmp_path):
    """On sm_89 (and sm_86 / sm_120, the same ~100 KB a program) every kernel of Gemma-style heads fits: the
    block-sparse dK/dV there once asked for 112 KB (an OutOfResources at its first launch on those GPUs)."""
    kernels = _compiled_kernels(tmp_path, "--quick", "--arch", "89", "--shapes", "8/2/256")
    assert {"bs_bwd_dkdv_kernel", "bs_fwd_kernel", "dilated_bwd_dkdv_kernel"} <= {k["kernel"] for k in kernels}
    assert all(k["error"] is None and k["shared"] <= 99 * 1024 for k in kernels), [
        (k["kernel"], k["config"], k["shared"], k["error"]) for k in kernels if k["error"] or k["shared"] > 99 * 1024]


def test_timeline_splits_wall_time_into_busy_idle_and_overlap(tmp_path):
    """``benchmarks/timeline.py`` reads kernel intervals from a chrome trace: busy is the union over streams, overlap
    the time two kernels run at once, idle the span's rest; other trace events are ignored."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from timeline import busy_idle, kernel_intervals

    events = [
        dict(ph="X", cat="kernel", name="a", ts=0, dur=10, args=dict(stream=7)),
        dict(ph="X", cat="kernel", name="b", ts=5, dur=10, args=dict(stream=8)),  # overlaps a by 5 us
        dict(ph="X", cat="kernel", name="c", ts=20, dur=5, args=dict(stream=7)),  # after 5 us idle
        dict(ph="X", cat="cpu_op", name="aten::mm", ts=0, dur=100),  # host side: not a kernel
        dict(ph="i", cat="kernel", name="marker", ts=3),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(dict(traceEvents=events)))
    iv = kernel_intervals(str(path))
    assert [name for *_, name in iv] == ["a", "b", "c"] and {s for _, _, s, _ in iv} == {7, 8}
    assert busy_idle(iv) == dict(span=25.0, busy=20.0, overlap=5.0, kernel_sum=25.0)
    assert busy_idle([]) == dict(span=0.0, busy=0.0, overlap=0.0, kernel_sum=0.0)


@pytest.mark.parametrize("argv, option", [
    (["--shape", "16/128"], "--shape"), (["--shape", "16/5/128"], "--shape"), (["--iters", "0"], "--iters"),
    (["--cprofile", "-1"], "--cprofile"), (["--scratch-min-gib", "-2"], "--scratch-min-gib"),
    (["--seqlens", "0"], "--seqlens"),
])
def test_timeline_refuses_bad_options_by_name(argv, option):
    """Bad options stop ``benchmarks/timeline.py`` before any work (no GPU needed), naming the option."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "timeline.py"), *argv],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and option in run.stderr, run.stderr


def test_bench_block_sparse_refuses_a_negative_warm_up():
    """``--warm-s`` is checked before any GPU work, naming the option."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_block_sparse.py"
    run = subprocess.run([sys.executable, str(script), "--warm-s", "-0.5"], capture_output=True, text=True)
    assert run.returncode == 2 and "--warm-s" in run.stderr, run.stderr


def test_kernel_resources_compare_names_what_changed():
    """``--compare``: the same launch key and PTX is the same code; a new launch key with the PTX of a vanished key of
    the same kernel is the same code under new launch arguments; other PTX is a change; the rest is new or gone.
    Where both reports have the SASS's fingerprint it decides: other PTX with the same machine code is no change
    (counted apart), other machine code is. (In a process of its own: the tool imports the Gluon kernels, which an
    interpreter-mode process cannot.)"""
    pytest.importorskip("triton")
    script = """
import json, sys
import kernel_resources as kr
def row(kernel, key, sha, sass=None):
    return kr.Resources(kernel=kernel, case="c", config={}, launch_key=key, ptx_sha=sha, registers=100,
                        spill_stores=0, shared=0, sass_sha=sass)
before = {"command": "base", "kernels": [vars(row("a", "k1", "s1")), vars(row("a", "k2", "s2")),
                                         vars(row("b", "k3", "s3")), vars(row("c", "k4", "s4"))]}
rows = [row("a", "k1", "s1"), row("a", "k2x", "s2"), row("b", "k3", "s3-other"), row("d", "k5", "s5")]
machine = {"command": "base", "kernels": [vars(row("a", "k1", "s1", "m1")), vars(row("a", "k2", "s2", "m2"))]}
print(json.dumps([kr.compare(before, rows),
                  kr.compare(before, [row(r["kernel"], r["launch_key"], r["ptx_sha"]) for r in before["kernels"]]),
                  kr.compare(machine, [row("a", "k1", "s1-renumbered", "m1"), row("a", "k2", "s2", "m2-other")]),
                  kr.compare(machine, [row("a", "k1", "s1-renumbered"), row("a", "k2", "s2")])]))
"""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)]))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    text, unchanged, by_sass, ptx_alone = json.loads(run.stdout.strip().splitlines()[-1])
    assert text.startswith("against base: 2 kernels generate the same code (1 of them under new launch arguments)")
    assert "changed  b" in text and "new      d" in text and "gone     c" in text and "gone     a" not in text
    assert unchanged.endswith("4 kernels generate the same code, none differs")
    assert by_sass.startswith("against base: 1 kernels generate the same machine code (1 of them from other PTX)")
    assert "changed  a" in by_sass and by_sass.count("changed") == 1, by_sass
    # a report without the SASS's fingerprint (no cuobjdump): the PTX decides
    assert ptx_alone.startswith("against base: 1 kernels generate the same code\n") and "changed  a" in ptx_alone


@pytest.mark.parametrize("argv, option", [(["--shapes", "8/2"], "--shapes"), (["--rounds", "0"], "--rounds"),
                                          (["--switch", "fused_dq", "--pass", "forward"], "--switch"),
                                          (["--switch", "persistent", "--op", "block_sparse", "--pass", "forward"],
                                           "--switch"),
                                          (["--switch", "parts", "--pass", "backward"], "--switch")])
def test_ab_gluon_refuses_bad_options_by_name(argv, option):
    """``benchmarks/ab_gluon.py`` checks its options before any GPU work, naming the one at fault."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_gluon.py"), *argv], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 2 and option in run.stderr, run.stderr[-2000:]


def test_ab_gluon_holds_unordered_dq_to_the_tolerance_and_the_rest_bit_for_bit():
    """A case's sides agree bit for bit, except dQ where the fused dK/dV launch summed it in no fixed order (the relaunch
    A/B at head dim 128 reported such a run as a failure): that one is held to 1e-2, and a NaN never agrees."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ab_gluon

    def row(q=True, k=True, rel_q=0.0, unordered=()):
        return dict(identical=dict(q=q, k=k, v=True), rel_err=dict(q=rel_q, k=0.0, v=0.0), unordered=list(unordered))

    assert ab_gluon.agree(row(), True)
    assert not ab_gluon.agree(row(q=False, rel_q=1e-6), True)  # dQ of a deterministic launch: bit for bit
    assert ab_gluon.agree(row(q=False, rel_q=1e-6, unordered="q"), True)
    assert not ab_gluon.agree(row(q=False, rel_q=0.5, unordered="q"), True)  # beyond the tolerance
    assert not ab_gluon.agree(row(q=False, rel_q=float("nan"), unordered="q"), True)
    assert not ab_gluon.agree(row(k=False), True)  # dK is summed in order: one bit is a difference
    assert ab_gluon.agree(row(k=False), False)  # a forward-like comparison: within the tolerance is enough


def test_kernel_resources_refuses_a_bad_full_errors_switch():
    """``KERNEL_RESOURCES_FULL_ERRORS`` takes on / off words only: anything else stops the tool before it compiles,
    naming the variable (a typo must not silently pick one of the two)."""
    pytest.importorskip("triton")
    env = dict(os.environ, KERNEL_RESOURCES_FULL_ERRORS="maybe", TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_resources.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 2 and "KERNEL_RESOURCES_FULL_ERRORS must be one of" in run.stderr, run.stderr[-2000:]


def test_kernel_resources_reads_why_ptxas_serialized():
    """ptxas's C7515 message gives its reason after "serialized due to": the report keeps it; a log without the
    message reads as not serialized. (In a process of its own: the tool restarts itself outside the interpreter.)"""
    pytest.importorskip("triton")
    check = r"""
from kernel_resources import serialization_reason
log = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non "
       "wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage "
       "in the function 'bs_bwd_dkdv_hopper_kernel'\nptxas info    : Used 255 registers\n")
assert serialization_reason(log) == ("non wgmma instructions defining accumulator registers of a wgmma between "
                                     "start and end of the pipeline stage"), serialization_reason(log)
assert serialization_reason("ptxas info : wgmma.mma_async instructions are serialized due to insufficient register "
                            "resources for the function 'k'\n") == "insufficient register resources"
assert serialization_reason("ptxas info : wgmma.mma_async instructions are serialized\n") == "no reason given"
assert serialization_reason("ptxas info    : Used 128 registers, used 1 barriers\n") is None
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT / "benchmarks")))
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-2000:]


def test_kernel_resources_counts_the_exponentials_before_the_full_wgmma_wait():
    """A tile loop's ``[exponentials before its first wait for every wgmma, exponentials]`` from its SASS lines:
    the waits for all but some products (``DEPBAR.LE gsb0, 0x1``) do not count, and a loop without a full wait (no
    asynchronous products) has no reading. (In a process of its own: the tool restarts itself outside the
    interpreter.)"""
    pytest.importorskip("triton")
    check = r"""
from kernel_resources import exp2_before_wait
step = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "FMNMX R3, R24, R25, !PT", "MUFU.EX2 R24, R24", "MUFU.EX2 R25, R25", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "BAR.SYNC.DEFER_BLOCKING 0x0, 0x80", "MUFU.EX2 R4, R4", "FMUL R88, R88, R4"]
assert exp2_before_wait(step) == [2, 3], exp2_before_wait(step)
hoisted = [step[0], step[1], step[5], step[2], step[3], step[4], step[7]]
assert exp2_before_wait(hoisted) == [0, 3], exp2_before_wait(hoisted)
assert exp2_before_wait([step[0], step[1], step[3]]) is None
assert exp2_before_wait(["HMMA.16816.F32.BF16 R4, R8, R12, R4", "MUFU.EX2 R4, R4"]) is None
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT / "benchmarks")))
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-2000:]


def test_kernel_resources_compiles_only_the_kernels_asked_for(tmp_path):
    """``--kernels`` compiles the launches of the named kernels alone (a one-kernel change checked in seconds), and a
    name that matches no launched kernel is refused with the names that would; ``--loops`` / ``--sass`` report each
    tile loop's spills and keep the SASS."""
    kernels = _compiled_kernels(tmp_path, "--quick", "--arch", "80", "--kernels", "bs_bwd_dq", "--loops", "--sass",
                                str(tmp_path / "sass"))
    assert kernels and {k["kernel"] for k in kernels} == {"bs_bwd_dq_kernel"}, kernels
    # --sass: each distinct kernel's listing; per innermost tile loop its instructions, tensor-core instructions,
    # spill stores / loads (which add up to the kernel's spill instructions inside loops) and barriers
    for k in kernels:
        listing = tmp_path / "sass" / f"bs_bwd_dq_kernel-{k['launch_key']}.sass"
        text = listing.read_text()
        assert "HMMA" in text, listing
        assert k["loop_spills"] and len(k["loop_spills"]) == k["tile_loops"], k
        assert all(ins > mma >= 1 and st >= 0 and ld >= 0 for ins, mma, st, ld, _ in k["loop_spills"]), k
        assert sum(st + ld for _, _, st, ld, _ in k["loop_spills"]) == k["spill_instructions_in_loops"], k
        # the software-pipelined loop syncs its warps before each refill of its shared-memory buffers (Nsight's top
        # stall of this kernel on the H100: "barrier"), so every tile loop holds a barrier, counted from the listing
        assert all(bars >= 1 for *_, bars in k["loop_spills"]), k
        in_listing = len(re.findall(r"(?<![A-Z.])BAR\.(?:SYNC|RED|ARV)\b", text))
        assert sum(bars for *_, bars in k["loop_spills"]) <= in_listing, (k, in_listing)
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_resources.py"), "--quick", "--n", "512",
                          "--kernels", "no_such_kernel"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TRITON_INTERPRET="0"), cwd=ROOT)
    assert run.returncode == 2 and "--kernels no_such_kernel matched none" in run.stderr, run.stderr[-2000:]
    assert "bs_bwd_dq_kernel" in run.stderr


def _ncu_source_csv(path, rows):
    """A small ``ncu --page source --csv --print-source sass`` export: (source, samples, executed, {reason: n})."""
    reasons = ["stall_barrier", "stall_wait", "stall_long_sb"]
    lines = ['"Kernel Name","toy_kernel",',
             ",".join(f'"{h}"' for h in ["Address", "Source", "# Samples", "Instructions Executed", *reasons,
                                         "stall_wait (Not Issued)"])]
    for n, (src, samples, executed, stalls) in enumerate(rows):
        cells = [hex(0x1000 + 16 * n), src, samples, executed, *(stalls.get(r[6:], 0) for r in reasons), 99]
        lines.append(",".join(f'"{c}"' for c in cells))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_ncu_stall_regions_splits_samples_into_loop_tile_and_rest(tmp_path, capsys):
    import gzip

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ncu_stall_regions as tool

    rows = [("LDC R1, c[0x0][0x28]", 10, 16, {"barrier": 10}),  # entry, once per program: the rest
            ("HGMMA.64x128x16.F32.BF16 R88, gdesc[UR4], RZ", 5, 100, {"wait": 5}),  # peeled first step: per tile
            ("HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], R88", 40, 800, {"wait": 30, "barrier": 10}),  # the loop
            ("FMNMX R1, R2, R3, !PT", 25, 790, {"wait": 25}),  # the loop
            ("STG.E [R2], R4", 20, 120, {"long_sb": 20}),  # the epilogue: per tile
            ("NOP", 50, 8, {"barrier": 50})]  # a parked warp: the rest
    csv_path = _ncu_source_csv(tmp_path / "toy.csv", rows)
    s = tool.summarize(tool.read(csv_path)["toy_kernel"], top=2)
    assert s["samples"] == 150 and s["tensor_core_executed"] == [100, 800]
    loop, tile, rest = (s["regions"][r] for r in tool.REGIONS)
    assert (loop["samples"], tile["samples"], rest["samples"]) == (65, 25, 60)
    assert loop["stalls"] == {"wait": 55, "barrier": 10} and tile["stalls"] == {"long_sb": 20, "wait": 5}
    assert "wait (Not Issued)" not in loop["stalls"]  # only the all-samples reasons are counted
    assert [t["source"] for t in s["top"]] == ["NOP", "HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], R88"]
    # every tensor-core instruction in the loop: no per-tile region
    assert tool.classify([dict(source="HMMA.16816", executed=800), dict(source="MUFU.EX2", executed=100)]) == [
        "step loop", "rest"]
    gz = tmp_path / "toy.csv.gz"
    gz.write_bytes(gzip.compress(csv_path.read_bytes()))
    out = tmp_path / "regions.json"
    assert tool.main([str(gz), "--json", str(out), "--top", "1"]) == 0
    assert "step loop" in capsys.readouterr().out
    assert json.loads(out.read_text())["kernels"]["toy_kernel"]["regions"]["step loop"]["samples"] == 65


def test_ncu_stall_regions_compares_two_builds_by_region_and_opcode(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ncu_stall_regions as tool

    base = [("HGMMA.64x128x16.F32.BF16 R88, gdesc[UR4], RZ", 5, 100, {"wait": 5}),  # per tile
            ("HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], R88", 40, 800, {"barrier": 40}),  # the loop
            ("MUFU.EX2 R4, R4", 30, 800, {"short_sb": 30}),
            ("NOP", 50, 8, {"barrier": 50})]
    # the build under study: the same exponentials waited on longer, a per-tile weight loop, a spill reload
    new = base[:2] + [("MUFU.EX2 R4, R4", 70, 800, {"short_sb": 70}),
                      ("@!P0 VIADD R3, R3, 0x1", 12, 150, {"wait": 12}),
                      ("LDL.LU R7, [R1+0xc]", 8, 100, {"long_sb": 8}),
                      base[3]]
    c = tool.compare(tool.read(_ncu_source_csv(tmp_path / "new.csv", new))["toy_kernel"],
                     tool.read(_ncu_source_csv(tmp_path / "base.csv", base))["toy_kernel"], top=3)
    loop, tile = c["step loop"], c["once per tile"]
    assert (loop["samples"], loop["base_samples"]) == (110, 70)
    assert (loop["executed"], loop["base_executed"]) == (1600, 1600)  # the same work, waited on longer
    assert loop["opcodes"][0] == dict(opcode="MUFU.EX2", executed=800, base_executed=800, samples=70,
                                      base_samples=30)
    assert (tile["executed"], tile["base_executed"]) == (350, 100)  # the predicate is not part of the opcode
    assert [o["opcode"] for o in tile["opcodes"]] == ["VIADD", "LDL.LU", "HGMMA.64x128x16.F32.BF16"]
    assert c["rest"]["samples"] == c["rest"]["base_samples"] == 50
    out = tmp_path / "cmp.json"
    assert tool.main([str(tmp_path / "new.csv"), "--base", str(tmp_path / "base.csv"), "--json", str(out)]) == 0
    assert "+40 samples  MUFU.EX2" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["comparison"]["toy_kernel"]["regions"]["step loop"]["samples"] == 110
    # two exports of different kernels each: refused by name
    other = _ncu_source_csv(tmp_path / "other.csv", [("NOP", 1, 1, {})])
    (tmp_path / "two.csv").write_text(other.read_text().replace("toy_kernel", "first_kernel")
                                      + other.read_text().replace("toy_kernel", "second_kernel"))
    with pytest.raises(SystemExit):
        tool.main([str(tmp_path / "new.csv"), "--base", str(tmp_path / "two.csv")])
    assert "base shares no kernel name" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["missing.csv"], "csv must be an existing file"),
    (["TOY", "--top", "-1"], "--top must be >= 0"),
    (["TOY", "--base", "missing.csv"], "--base must be an existing file"),
])
def test_ncu_stall_regions_refuses_bad_input_by_name(tmp_path, argv, message, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ncu_stall_regions as tool

    toy = _ncu_source_csv(tmp_path / "toy.csv", [("NOP", 1, 1, {})])
    with pytest.raises(SystemExit):
        tool.main([str(toy) if a == "TOY" else str(tmp_path / a) if a.endswith(".csv") else a for a in argv])
    assert message in capsys.readouterr().err
    (tmp_path / "plain.csv").write_text('"Address","Source"\n"0x0","NOP"\n')
    with pytest.raises(ValueError, match="Kernel Name"):
        tool.read(tmp_path / "plain.csv")
    (tmp_path / "nosamples.csv").write_text('"Kernel Name","k",\n"Address","Source"\n"0x0","NOP"\n')
    with pytest.raises(ValueError, match="lacks the columns"):
        tool.read(tmp_path / "nosamples.csv")


def test_gap_by_segment_cases_and_a_cpu_run(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gap_by_segment as tool

    cases = tool.cases(65536)
    single = [b[0][0] for kind, b in cases if kind == "dilated" and len(b) == 1]
    assert single == [2048, 4096, 8192, 16384, 32768, 65536]  # up to w = N: dense causal through the dilated path
    added = [b for kind, b in cases if kind == "dilated" and len(b) == 2]
    assert added == [[(2048, 1), (w, r)] for w, r in tool.LONGNET[1:]]
    assert [b for kind, b in cases if kind == "dilated" and len(b) == 5] == [tool.LONGNET]
    assert [kind for kind, _ in cases[-2:]] == ["cudnn", "flash"]
    # cuDNN on the same segments: each single branch shorter than N, and the LongNet set
    assert [b for kind, b in cases if kind == tool.SEGMENTS] == [[(w, 1)] for w in single[:-1]] + [tool.LONGNET]
    assert [b for kind, b in tool.cases(8192) if kind == "dilated" and len(b) > 1] == [
        [(2048, 1), (4096, 2)], [(2048, 1), (8192, 4)], [(2048, 1), (4096, 2), (8192, 4)]]
    assert tool.cases(512)[0] == ("dilated", [(512, 1)])  # shorter than the smallest LongNet segment
    assert tool.main(["--n", "512", "--heads", "2", "--dim", "64", "--reps", "1", "--warm-s", "0",
                      "--out", str(tmp_path)]) == 0
    (js,) = tmp_path.glob("gap-by-segment-*.json")
    data = json.loads(js.read_text())
    assert data["meta"]["N"] == 512 and data["meta"]["command"].startswith("python benchmarks/gap_by_segment.py")
    assert {(r["kind"], r["mode"]) for r in data["rows"]} == {(k, m) for k in ("dilated", "cudnn", "flash")
                                                           for m in ("fwd", "fwdbwd")}
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in data["rows"])
    assert js.with_suffix(".png").stat().st_size > 0


def test_triton_cache_bundle_is_hit_where_it_is_installed(tmp_path):
    """``benchmarks/triton_cache.py``: a kernel compiled for sm_90 into one cache (as ``kernel_resources.py`` does),
    exported without its IR and installed into another cache, is what ``triton.compile`` loads there: no recompile."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_cache_hit.py"), str(ROOT / "benchmarks"),
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("hit"), run.stdout[-2000:] + run.stderr[-4000:]


def test_triton_cache_refuses_bad_paths_by_name(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import triton_cache as tool

    with pytest.raises(ValueError, match="bundle: .* must end in .tar.xz"):
        tool.export(str(tmp_path), str(tmp_path / "kernels.zip"))
    with pytest.raises(ValueError, match="cache: .* is not a directory"):
        tool.export(str(tmp_path / "missing"), str(tmp_path / "k.tar.xz"))
    assert not (tmp_path / "k.tar.xz").exists()  # refused before the bundle was opened
    with pytest.raises(SystemExit):
        tool.main(["install", str(tmp_path / "missing.tar.xz")])
    assert "bundle: " in capsys.readouterr().err
    assert tool.count(str(tmp_path / "nothing")) == 0
    # a group whose binary is missing (a failed compile) is left out of the bundle
    (tmp_path / "c" / "KEY").mkdir(parents=True)
    meta = tmp_path / "c" / "KEY" / "k.json"
    meta.write_text("{}")
    (tmp_path / "c" / "KEY" / "__grp__k.json").write_text(json.dumps({"child_paths": {"k.json": str(meta)}}))
    assert tool.export(str(tmp_path / "c"), str(tmp_path / "k.tar.xz"))[0] == 0
    # a bundle whose group names a file it does not hold is refused whole: not even its good kernels are installed
    import io
    import tarfile

    broken = tmp_path / "broken.tar.xz"
    with tarfile.open(broken, "w:xz") as tar:
        for arc, data in (("A/a.cubin", b"x"), ("A/__grp__a.json", b'{"child_paths": ["a.cubin"]}'),
                          ("B/__grp__b.json", b'{"child_paths": ["b.cubin"]}')):
            info = tarfile.TarInfo(arc)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError, match="names 'b.cubin' in B/__grp__b.json but does not hold it"):
        tool.install(str(broken), str(tmp_path / "into"))
    assert not (tmp_path / "into").exists()
    # --key-as-wheel: a Triton wheel of the installed version only, checked before anything compiles
    import triton

    with pytest.raises(ValueError, match="is not a Triton wheel file"):
        tool.libtriton_hash(str(tmp_path / "k.tar.xz"))
    other = tmp_path / "triton-0.0.1-cp312-cp312-linux_x86_64.whl"
    other.write_bytes(b"")
    with pytest.raises(ValueError, match=f"is Triton 0.0.1, the installed Triton is {triton.__version__}"):
        tool.libtriton_hash(str(other))
    empty = tmp_path / f"triton-{triton.__version__}-cp312-cp312-linux_x86_64.whl"
    zipfile.ZipFile(empty, "w").close()
    with pytest.raises(ValueError, match="holds 0 triton/_C/libtriton"):
        tool.libtriton_hash(str(empty))


def test_triton_cache_installs_many_kernels_in_one_pass(tmp_path, monkeypatch):
    """``triton_cache.install`` of a bundle of many kernels: every kernel lands with its bytes, its group file points
    at the new paths, kernels already there are kept, and the bundle is read as a stream, front to back (reading a
    kernel's files after its group file by seeking back decompressed the ``.xz`` again from its start for every kernel:
    minutes for 708 kernels on the GPU machine, session 31)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tarfile

    import triton_cache as tool

    rng = random.Random(0)
    src = tmp_path / "src"
    kernels = {}
    for i in range(300):
        key = f"KEY{i:03d}"
        (src / key).mkdir(parents=True)
        files = {f"k{i}.json": json.dumps({"name": f"k{i}"}).encode(),
                 f"k{i}.cubin": rng.randbytes(rng.randint(1, 4096)), f"k{i}.ptx": b"not carried"}
        for name, data in files.items():
            (src / key / name).write_bytes(data)
        (src / key / f"__grp__k{i}.json").write_text(
            json.dumps({"child_paths": {n: str(src / key / n) for n in files}}))
        kernels[key] = files
    bundle = str(tmp_path / "k.tar.xz")
    assert tool.export(str(src), bundle)[0] == 300
    dst = tmp_path / "dst"
    (dst / "KEY007").mkdir(parents=True)  # a kernel this cache already has: left as it is
    (dst / "KEY007" / "__grp__k7.json").write_text("{}")
    modes = []
    real_open = tarfile.open
    monkeypatch.setattr(tool.tarfile, "open",
                        lambda name, mode, **kw: modes.append(mode) or real_open(name, mode, **kw))
    assert tool.install(bundle, str(dst)) == 299
    assert modes == ["r|xz"]
    assert (dst / "KEY007" / "__grp__k7.json").read_text() == "{}"
    for key, files in kernels.items():
        if key == "KEY007":
            continue
        group = json.loads(next((dst / key).glob("__grp__*")).read_text())["child_paths"]
        assert sorted(group) == sorted(n for n in files if not n.endswith(".ptx"))
        for name, path in group.items():
            assert path == str(dst / key / name) and (dst / key / name).read_bytes() == files[name]
    assert tool.install(bundle, str(dst)) == 0
    assert tool.count(str(dst)) == 299


def test_triton_cache_exports_what_is_new_in_parts(tmp_path):
    """``triton_cache.export --skip --max-mib``: a device call's export leaves out the kernels it installed and splits
    the rest into parts under a size limit (the device returns files of at most 16 MiB; session 33's whole cache
    packed to 39 MiB and was lost). Every kernel lands in exactly one part, no part's kernels pass the limit, and the
    parts installed together give the cache back."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tarfile

    import triton_cache as tool

    rng = random.Random(1)
    src = tmp_path / "src"

    def kernel(i):
        key = f"KEY{i:03d}"
        (src / key).mkdir(parents=True)
        files = {f"k{i}.json": b"{}", f"k{i}.cubin": rng.randbytes(rng.randint(1000, 3000))}
        for name, data in files.items():
            (src / key / name).write_bytes(data)
        (src / key / f"__grp__k{i}.json").write_text(
            json.dumps({"child_paths": {n: str(src / key / n) for n in files}}))

    for i in range(40):
        kernel(i)
    installed = str(tmp_path / "installed.tar.xz")
    assert tool.export(str(src), installed)[0] == 40
    for i in range(40, 100):  # what the call compiled after installing the bundle
        kernel(i)
    n, size, parts = tool.export(str(src), str(tmp_path / "new.tar.xz"), skip=[installed], max_bytes=20_000)
    assert n == 60 and len(parts) > 1 and parts[1] == str(tmp_path / "new-2.tar.xz")
    seen = []
    for part in parts:
        with tarfile.open(part, "r|xz") as tar:
            members = [(m.name, m.size) for m in tar]
        assert sum(sz for name, sz in members if not os.path.basename(name).startswith("__grp__")) <= 20_000
        seen += [os.path.dirname(name) for name, _ in members if os.path.basename(name).startswith("__grp__")]
    assert sorted(seen) == [f"KEY{i:03d}" for i in range(40, 100)]
    dst = str(tmp_path / "dst")
    assert sum(tool.install(b, dst) for b in [installed, *parts]) == 100 == tool.count(dst)
    with pytest.raises(ValueError, match=r"max_bytes \(--max-mib\) must be positive"):
        tool.export(str(src), str(tmp_path / "x.tar.xz"), max_bytes=0)
    with pytest.raises(ValueError, match="skip: .* is not a file"):
        tool.export(str(src), str(tmp_path / "x.tar.xz"), skip=[str(tmp_path / "missing.tar.xz")])


def test_cudnn_segments_run_dense_attention_on_exactly_the_dilated_segments():
    """``cudnn-segments`` (``bench_attention.segment_calls``, run by ``gap_by_segment.py`` and the issue-14 benchmark):
    each branch's rows gathered into dense causal sequences of ``w / r`` rows, and SDPA run on each."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_attention as tool
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 32, 8, generator=gen) for _ in range(4))
    rows = tool.segments(q, 16, 4)  # branch (16, 4): segments of 16 positions, every 4th row of each
    assert rows.shape == (2 * 2, 3, 4, 8)
    assert torch.equal(rows[3, 1], q[1, 1, 16:32:4])  # batch row 1, second segment, head 1
    branches = [(8, 1), (16, 4)]
    fwd, step = tool.segment_calls(q, k, v, do, branches, "cudnn")  # SDPA's math backend off the GPU
    outs = fwd()
    assert len(outs) == 2
    for out, (w, r) in zip(outs, branches):
        want = sdpa(*(tool.segments(t, w, r) for t in (q, k, v)), is_causal=True)
        torch.testing.assert_close(out, want)
    grads = step()
    assert [g[0].shape for g in grads] == [(8, 3, 8, 8), (4, 3, 4, 8)]  # out, then dq, dk, dv per branch
    assert all(len(g) == 4 and all(torch.isfinite(t).all() for t in g) for g in grads)


@pytest.mark.parametrize("argv, message", [
    (["--n", "100"], "--n must be >= 256"),
    (["--heads", "6", "--kv-heads", "4"], "--heads must be a positive multiple of --kv-heads"),
    (["--dim", "96"], "--dim must be one of 64, 128, 256"),
    (["--warm-s", "-1"], "--warm-s must be >= 0"),
    (["--reps", "0"], "--reps must be >= 1"),
])
def test_gap_by_segment_refuses_bad_options_by_name(argv, message, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gap_by_segment as tool

    with pytest.raises(SystemExit):
        tool.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--n", "0"], "--n must be >= 1"),
    (["--heads", "6", "--kv-heads", "4"], "--heads must be a positive multiple of --kv-heads"),
    (["--dim", "96"], "--dim must be one of 64, 128, 256"),
    (["--dense", "math"], "invalid choice"),
    (["--branches", "2048"], "--branches takes W:R pairs of positive integers"),
    (["--branches", "2048:1", "4096:0"], "--branches takes W:R pairs of positive integers"),
    (["--branches", "2048:x"], "--branches takes W:R pairs of positive integers"),
])
def test_profile_dilated_refuses_bad_options_by_name(argv, message):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_dilated.py"), *argv],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and message in proc.stderr


def test_run_environment_records_the_kernel_switches(monkeypatch):
    """Results JSONs say which kernels measured them: the ``HF_DILATED_*`` switches set for the run, none where
    none is set."""
    from hf_dilated.environment import run_environment

    for name in [n for n in os.environ if n.startswith("HF_DILATED_")]:
        monkeypatch.delenv(name)
    assert "switches" not in run_environment(device="cpu")
    monkeypatch.setenv("HF_DILATED_WS", "off")
    monkeypatch.setenv("HF_DILATED_PERSISTENT", "0")
    assert run_environment(device="cpu")["switches"] == {"HF_DILATED_PERSISTENT": "0", "HF_DILATED_WS": "off"}


def _pattern_pairs(branches, n):
    """The causal pairs each branch selects at head offset 0, summed over branches, from the positions themselves."""
    total = 0
    for w, r in branches:
        for i in range(0, n, r):
            total += sum(1 for j in range(i // w * w, i + 1, r))
    return total


def test_branch_work_counts_the_pattern_and_the_masked_tiles(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import branch_work

    branches, n = [(64, 1), (128, 2), (256, 4), (1024, 16)], 2048
    needed = _pattern_pairs(branches, n)
    for schedule in (branch_work.per_branch, branch_work.one_pass):
        assert schedule(branches, n, 1, 1) == dict(computed=needed, needed=needed)  # one-pair tiles mask nothing
        for bm, bn in ((16, 16), (32, 8), (8, 32)):
            c = schedule(branches, n, bm, bn)
            assert c["needed"] == needed and c["computed"] > needed
    # one pass: a class's rows span block_m * stride positions, so its lower-rate key tiles are mostly masked
    one, per = branch_work.one_pass(branches, n, 16, 16), branch_work.per_branch(branches, n, 16, 16)
    assert one["computed"] > per["computed"]
    # a segment of one tile: per branch computes the whole square, half of it masked
    assert branch_work.per_branch([(16, 1)], 64, 16, 16) == dict(computed=4 * 256, needed=4 * 136)
    with pytest.raises(ValueError, match="rates and segment lengths must each divide the next"):
        branch_work.one_pass([(64, 1), (96, 3), (128, 2)], 384, 16, 16)
    with pytest.raises(ValueError, match="n: 100 must be a multiple"):
        branch_work.per_branch([(64, 1)], 100, 16, 16)
    with pytest.raises(ValueError, match="n: must be positive"):
        branch_work.one_pass([(64, 1)], 0, 16, 16)
    with pytest.raises(ValueError, match="branches: at least one"):
        branch_work.per_branch([], 64, 16, 16)
    assert branch_work.main(["--n", "32768", "--tiles", "128x128"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["schedule", "tile", "computed", "needed", "extra"] and len(out) == 3
    with pytest.raises(SystemExit):
        branch_work.main(["--tiles", "128by128"])


def _ab_line(label, fwd, fwdbwd, dq_bits, dk_bits=7, N=65536):
    """A compare_checkouts.py JSON line: out / dv always the same, dq / dk as given."""
    cks = [[1.5, 11], [2.0 + dq_bits * 1e-6, dq_bits], [3.0 + dk_bits * 1e-6, dk_bits], [4.0, 44]]
    return json.dumps(dict(label=label, op="dilated", N=N, D=128, heads=16, kv_heads=16, dtype="bfloat16",
                           block=None, fwd_ms=fwd, fwdbwd_ms=fwdbwd, cks=cks))


def test_ab_summary_gives_speed_against_the_base_and_which_results_are_bit_equal(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ab_summary

    log = tmp_path / "ab.jsonl"
    log.write_text("\n".join([
        "NVIDIA H200, 1980 MHz, 700.00 W",  # a log line mixed in: skipped
        _ab_line("main", 2.0, 10.0, dq_bits=5), _ab_line("new", 1.0, 8.0, dq_bits=6),
        _ab_line("main", 2.0, 10.0, dq_bits=5), _ab_line("new", 1.0, 12.0, dq_bits=6, dk_bits=8),
        _ab_line("main", 4.0, 40.0, dq_bits=5, N=262144),  # a shape only the base ran
    ]) + "\n")
    out = tmp_path / "summary.json"
    ab_summary.main([str(log), "--base", "main", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "new x2" in printed and "fwd 2.000x" in printed and "fwdbwd 1.000x" in printed
    summary = json.loads(out.read_text())
    new = next(e for e in summary if e["label"] == "new")
    assert new["rounds"] == 2 and new["fwd_ms"] == 1.0 and new["fwdbwd_ms"] == 10.0
    assert new["speed_fwd"] == 2.0 and new["speed_fwdbwd"] == 1.0
    assert new["results"]["out"] == "bit-equal" and new["results"]["dv"] == "bit-equal"
    assert new["results"]["dq"].startswith("rel diff") and new["results"]["dk"].startswith("rel diff")
    assert [e["label"] for e in summary if e["N"] == 262144] == ["main"]  # no partner there: no ratio invented
    assert "results" not in summary[0]


def test_ab_summary_takes_the_median_round_so_a_cold_first_round_does_not_move_the_speed(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ab_summary

    log = tmp_path / "ab.jsonl"
    log.write_text("\n".join([_ab_line("main", 2.4, 12.0, dq_bits=5), _ab_line("new", 2.0, 10.2, dq_bits=5),
                               _ab_line("main", 2.0, 10.0, dq_bits=5), _ab_line("new", 2.0, 10.1, dq_bits=5),
                               _ab_line("main", 2.0, 10.0, dq_bits=5), _ab_line("new", 2.0, 10.1, dq_bits=5)]) + "\n")
    new = next(e for e in ab_summary.summarize(ab_summary.read_rows(log), "main") if e["label"] == "new")
    assert new["rounds"] == 3 and new["fwdbwd_ms"] == 10.1
    assert new["speed_fwd"] == 1.0 and abs(new["speed_fwdbwd"] - 10.0 / 10.1) < 1e-12  # the mean read 1.04x


def test_ab_summary_names_the_block_of_block_sparse_shapes(tmp_path, capsys):
    """The block size is a shape key: block-sparse A/Bs at 128- and 64-blocks are two shapes, and the printed lines
    and the plot's labels say which is which (they read the same before)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ab_summary

    def line(label, block, fwd):
        return json.dumps(dict(label=label, op="block_sparse", N=65536, D=128, heads=16, kv_heads=16,
                               dtype="bfloat16", block=block, fwd_ms=fwd, fwdbwd_ms=2 * fwd, cks=[[1.0, 1, 1.0]]))

    log = tmp_path / "ab.jsonl"
    log.write_text("\n".join([line("main", 128, 3.4), line("new", 128, 3.45), line("main", 64, 3.2),
                              line("new", 64, 3.2)]) + "\n")
    png = tmp_path / "speed.png"
    ab_summary.main([str(log), "--plot", str(png)])
    printed = capsys.readouterr().out.splitlines()
    new = [p for p in printed if " new " in p]
    assert len(new) == 2 and "block=128" in new[0] and "fwd 0.986x" in new[0], printed
    assert "block=64" in new[1] and "fwd 1.000x" in new[1], printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ab_summary_reads_a_difference_against_the_magnitudes_and_plots_the_speeds(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ab_summary

    def line(label, fwd, dk_sum):  # dK sums to about zero (0.001) over magnitudes of 500: a line with the third value
        cks = [[1.5, 11, 9.0], [2.0, 5, 7.0], [dk_sum, 7 if label == "main" else 8, 500.0], [4.0, 44, 8.0]]
        return json.dumps(dict(label=label, op="dilated", N=65536, D=128, heads=16, kv_heads=16, dtype="bfloat16",
                               block=None, fwd_ms=fwd, fwdbwd_ms=2 * fwd, cks=cks))

    log = tmp_path / "ab.jsonl"
    log.write_text("\n".join([line("main", 2.0, 0.001), line("new", 1.6, 0.0015)]) + "\n")
    png = tmp_path / "speed.png"
    ab_summary.main([str(log), "--plot", str(png), "--title", "one change"])
    printed = capsys.readouterr().out
    assert "dk rel diff 1.0e-06" in printed  # 0.0005 / 500, where against the sum it would read 0.5
    assert "fwd 1.250x" in printed and "out bit-equal" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    log.write_text(line("main", 2.0, 0.001) + "\n")  # the base alone: no speed to draw
    summary = tmp_path / "summary.json"
    with pytest.raises(SystemExit):
        ab_summary.main([str(log), "--plot", str(png), "--json", str(summary)])
    refused = capsys.readouterr()
    assert "--plot: no shape has both 'main' and another checkout" in refused.err
    assert refused.out == "" and not summary.exists()  # refused before printing or writing anything
    with pytest.raises(SystemExit):
        ab_summary.main([str(log), "--title", "no plot"])
    assert "--title: names the plot, so it needs --plot" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["missing.jsonl"], "jsonl: 'missing.jsonl' is not a file"),
    (["EMPTY"], "holds no compare_checkouts.py line"),
    (["LOG", "--base", "other"], "--base: 'other' is not one of the file's labels ['main']"),
])
def test_ab_summary_refuses_bad_input_by_name(tmp_path, monkeypatch, capsys, argv, message):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ab_summary

    monkeypatch.chdir(tmp_path)
    (tmp_path / "EMPTY").write_text("not json\n")
    (tmp_path / "LOG").write_text(_ab_line("main", 1.0, 2.0, dq_bits=1) + "\n")
    with pytest.raises(SystemExit):
        ab_summary.main(argv)
    assert message in capsys.readouterr().err


def test_host_profile_summarizes_py_spy_samples_per_thread(tmp_path, capsys):
    """``host_profile.py summarize`` reads py-spy's raw stacks: shares per thread of the samples in which a frame
    appears (inclusive) and of those it tops (self); the warm-up's compiles and imports are left out, and so are the
    main thread's samples outside the timed loop, also where py-spy did not name the thread on a line."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import host_profile

    sp = "/usr/lib/python3/site-packages/"
    raw = tmp_path / "loop.raw"
    raw.write_text("\n".join([
        f"thread (7): MainThread;<module> (host_profile.py:9);timed_loop (host_profile.py:80);run ({sp}a.py:3) 6",
        "thread (7);<module> (host_profile.py:9);timed_loop (host_profile.py:80);wait (b.py:1) 2",
        "thread (7): MainThread;<module> (host_profile.py:9);setup (c.py:5) 50",  # outside the loop
        f"thread (9);backward (d.py:2);launch ({sp}e.py:4) 3",
        "thread (9);backward (d.py:2) 1",
        f"thread (9);backward (d.py:2);_do_compile ({sp}jit.py:1);x (f.py:1) 40",  # a compile: left out
        "thread (9);_find_and_load (<frozen importlib._bootstrap>:1);y (g.py:1) 30",  # an import: left out
    ]) + "\n")
    result = host_profile.summarize(open(raw))
    assert result["main"]["samples"] == 8 and result["other"]["samples"] == 4
    assert dict(result["main"]["inclusive"])["timed_loop (host_profile.py:80)"] == 1.0
    assert dict(result["main"]["self"]) == {"run (a.py:3)": 0.75, "wait (b.py:1)": 0.25}
    assert dict(result["other"]["inclusive"]) == {"backward (d.py:2)": 1.0, "launch (e.py:4)": 0.75}
    assert dict(result["other"]["self"]) == {"launch (e.py:4)": 0.75, "backward (d.py:2)": 0.25}
    assert host_profile.main(["summarize", str(raw), "--top", "1", "--json", str(tmp_path / "s.json")]) == 0
    assert "75.0%  launch (e.py:4)" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text())["other"]["samples"] == 4
    ms, calls = host_profile.timed_loop(lambda: None, 0.01)
    assert calls >= 10 and calls % 10 == 0 and ms >= 0


@pytest.mark.parametrize("argv, message", [
    (["summarize", "MISSING", "--top", "3"], "raw must be an existing file"),
    (["summarize", "RAW", "--top", "0"], "--top must be >= 1"),
    (["summarize", "RAW"], "not a py-spy raw line"),
    (["run", "--shape", "9/4/64"], "--shape '9/4/64'"),
    (["run", "--n", "0"], "--n must be > 0"),
    (["run", "--seconds", "-1"], "--seconds must be > 0"),
    (["run", "--warmup", "-1"], "--warmup must be >= 0"),
])
def test_host_profile_refuses_bad_input_by_name(tmp_path, capsys, argv, message):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import host_profile

    (tmp_path / "RAW").write_text("no count here\n")
    argv = [str(tmp_path / a) if a in ("RAW", "MISSING") else a for a in argv]
    with pytest.raises(SystemExit):
        host_profile.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, option", [(["--switch", "nope"], "--switch"), (["--shapes", "9/4/64"], "--shapes"),
                                          (["--rounds", "0"], "--rounds"), (["--seqlens", "0"], "--seqlens"),
                                          (["--plot", "x.png"], "--plot-from"), ([], "CUDA")])
def test_host_ab_refuses_bad_options_by_name(argv, option):
    """``benchmarks/host_ab.py`` names the bad option (or that it needs a GPU: host time against GPU time)."""
    import torch

    if not argv and torch.cuda.is_available():
        pytest.skip("a GPU is present: the run would go ahead")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_ab.py"), *argv], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and option in run.stderr, run.stderr


def test_host_ab_draws_its_records(tmp_path):
    """``host_ab.py --plot-from`` draws records' rows without a GPU: one PNG of host and queued ms, off and on."""
    row = dict(switch="graphs", mode="fwdbwd", N=16384, H=9, Hk=3, D=64,
               host_ms_median=dict(off=1.6, on=1.0, speedup=1.6), queued_ms_median=dict(off=1.5, on=1.0, speedup=1.5))
    record = tmp_path / "ab.json"
    record.write_text(json.dumps(dict(meta=dict(device="NVIDIA H200"), rows=[row, dict(row, D=128, H=16, Hk=16)])))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_ab.py"), "--plot-from", str(record),
                          "--plot", str(tmp_path / "ab.png")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
