"""Sweep the Triton kernels' launch configurations on the GPU at hand (bf16, causal, LongNet branches) and print every
candidate's time and the fastest per head dim, to choose the built-in tables of ``hf_dilated/ops/triton/configs.py``
(users keep their own GPU's winners with ``hf-dilated tune``, which sweeps the same candidates,
``hf_dilated/ops/triton/tuning.py``). Each candidate's output is checked against a baseline config's before it is timed.

    python benchmarks/tune_triton.py --n 65536 --dims 64 128 256
    python benchmarks/tune_triton.py --dims 128 --kernels dkdv dq --tma on off   # backward, TMA loads against pointers
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hf_dilated.ops import resolve_layout  # noqa: E402
from hf_dilated.ops.triton import configs, hopper, launch, tuned, tuning  # noqa: E402
from hf_dilated.ops.triton.schedule import layout_runs  # noqa: E402

LONGNET = list(tuning.LONGNET)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kernels", nargs="+", default=["fwd", "dkdv", "dq"], choices=["fwd", "dkdv", "dq"])
    ap.add_argument("--tma", nargs="+", default=["on"], choices=["on", "off"],
                    help="backward sweeps with tensor-descriptor loads (where the GPU has them) and / or pointer loads")
    args = ap.parse_args()
    # The baseline is the built-in table this sweep exists to choose, not what `hf-dilated tune` stored on this machine.
    tuned.lookup = lambda *a, **k: None
    use_tma = launch.use_tma
    dev = torch.device("cuda")
    N, H = args.n, args.heads
    layout = resolve_layout(1, N, N, dev)
    plan = layout_runs(layout)
    valid = (layout.q_valid, layout.k_valid)
    key = ("contiguous", 1, N, N)
    for D in args.dims:
        FWD_C, KV_C, DQ_C = (tuning.candidates(kernel, D) for kernel in ("fwd", "dkdv", "dq"))
        q, k, v, do = (torch.randn(1, H, N, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
        scale = D ** -0.5
        fwd = lambda: launch.forward(q, k, v, launch.Problem(LONGNET, True, scale, 0), plan, valid, key)  # noqa: E731
        base_o, lse = fwd()
        best = None
        for c in FWD_C if "fwd" in args.kernels else ():
            try:  # the configs are the portable forward's: time it also where the Gluon one would run (sm_90)
                with configs.forced("fwd", c), hopper.portable():
                    o, _ = fwd()
                    err = rel(o, base_o)
                    ms = triton.testing.do_bench(fwd, warmup=50, rep=300) if err < 5e-3 else float("nan")
            except Exception as e:  # noqa: BLE001 (out of shared memory, say)
                print(f"D={D} fwd {c}: {type(e).__name__}")
                continue
            print(f"D={D} fwd {c}: {ms:.3f} ms (err {err:.1e})")
            if ms == ms and (best is None or ms < best[0]):
                best = (ms, c)
        if best:
            print(f"BEST D={D} fwd {best}")
        o, lse = fwd()
        bwd = lambda: launch.backward(do, q, k, v, o, lse, launch.Problem(LONGNET, True, scale, 0), plan, valid, key)  # noqa: E731
        base = bwd()
        for tma, name, cands in [(t, *x) for t in args.tma for x in (("dkdv", KV_C), ("dq", DQ_C))
                                 if x[0] in args.kernels]:
            # the dK/dV configs are the portable kernel's: time it also where the Gluon one would run (sm_90)
            with hopper.portable() if name == "dkdv" else contextlib.nullcontext():
                launch.use_tma = use_tma if tma == "on" else (lambda *a, **k: False)
                print(f"D={D} tma={tma} default bwd {triton.testing.do_bench(bwd, warmup=50, rep=300):.3f} ms")
                best = None
                for c in cands:
                    try:
                        with configs.forced(name, c):
                            g = bwd()
                            err = max(rel(x, y) for x, y in zip(g, base))
                            ms = triton.testing.do_bench(bwd, warmup=50, rep=300) if err < 5e-3 else float("nan")
                    except Exception as e:  # noqa: BLE001
                        print(f"D={D} {name} {c}: {type(e).__name__}")
                        continue
                    print(f"D={D} tma={tma} bwd {name} {c}: {ms:.3f} ms (err {err:.1e})")
                    if ms == ms and (best is None or ms < best[0]):
                        best = (ms, c)
                print(f"BEST D={D} tma={tma} {name} {best}")
        launch.use_tma = use_tma


if __name__ == "__main__":
    main()
