"""Sweep the Triton kernels' launch configurations on the GPU at hand (bf16, causal, LongNet branches) and print the
fastest per head dim, to copy into ``hf_dilated/ops/triton/configs.py``. Each candidate's output is checked against a
baseline config's before it is timed.

    python benchmarks/tune_triton.py --n 65536 --dims 64 128 256
    python benchmarks/tune_triton.py --dims 128 --kernels dkdv dq --tma on off   # backward, TMA loads against pointers
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hf_dilated.ops import resolve_layout  # noqa: E402
from hf_dilated.ops.triton import configs, launch  # noqa: E402
from hf_dilated.ops.triton.schedule import layout_runs  # noqa: E402

LONGNET = [(2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)]
FWD = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3)]
KV = [(64, 64, 8, 2), (32, 128, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3)]
DQ = [(128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 8, 2), (128, 32, 8, 3)]
# Head dim 256: a tile row is 512 bytes, so shared memory allows only smaller tiles and fewer stages.
CANDIDATES = {
    256: (
        [(64, 32, 8, 2), (64, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 1), (64, 32, 4, 3), (32, 64, 4, 2),
         (128, 64, 8, 2), (128, 32, 8, 3)],
        [(32, 32, 8, 1), (32, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 1), (32, 64, 4, 2), (16, 64, 4, 2),
         (16, 64, 4, 3), (32, 64, 8, 3), (64, 64, 8, 2), (32, 32, 4, 3)],
        [(32, 32, 8, 1), (64, 32, 8, 2), (64, 64, 8, 1), (32, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 1),
         (64, 32, 8, 3), (64, 64, 8, 2), (128, 32, 8, 2), (32, 32, 4, 2), (32, 32, 8, 3)],
    ),
}


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
    use_tma = launch.use_tma
    dev = torch.device("cuda")
    N, H = args.n, args.heads
    layout = resolve_layout(1, N, N, dev)
    plan = layout_runs(layout)
    valid = (layout.q_valid, layout.k_valid)
    key = ("contiguous", 1, N, N)
    for D in args.dims:
        FWD_C, KV_C, DQ_C = CANDIDATES.get(D, (FWD, KV, DQ))
        q, k, v, do = (torch.randn(1, H, N, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
        scale = D ** -0.5
        fwd = lambda: launch.forward(q, k, v, launch.Problem(LONGNET, True, scale, 0), plan, valid, key)  # noqa: E731
        base_o, lse = fwd()
        best = None
        for c in FWD_C if "fwd" in args.kernels else ():
            configs._FWD_HOPPER[D] = c
            try:
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
            configs._FWD_HOPPER[D] = best[1]
            if long_table:
                long_table[D] = best[1]
        o, lse = fwd()
        bwd = lambda: launch.backward(do, q, k, v, o, lse, launch.Problem(LONGNET, True, scale, 0), plan, valid, key)  # noqa: E731
        base = bwd()
        defaults = dict(configs._BWD_KV_HOPPER), dict(configs._BWD_Q_HOPPER)
        for tma, name, table, cands in [(t, *x) for t in args.tma for x in (
                ("dkdv", configs._BWD_KV_HOPPER, KV_C), ("dq", configs._BWD_Q_HOPPER, DQ_C)) if x[0] in args.kernels]:
            launch.use_tma = use_tma if tma == "on" else (lambda *a, **k: False)
            configs._BWD_KV_HOPPER.update(defaults[0])
            configs._BWD_Q_HOPPER.update(defaults[1])
            print(f"D={D} tma={tma} default bwd {triton.testing.do_bench(bwd, warmup=50, rep=300):.3f} ms")
            best = None
            for c in cands:
                table[D] = c
                try:
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
            table[D] = best[1]
        launch.use_tma = use_tma
        configs._BWD_KV_HOPPER.update(defaults[0])
        configs._BWD_Q_HOPPER.update(defaults[1])


if __name__ == "__main__":
    main()
