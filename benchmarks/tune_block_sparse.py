"""Sweep the block-sparse kernels' launch configurations on the GPU at hand and print the fastest, to copy into
``hf_dilated/ops/triton/block_sparse.py`` (``_fwd_config`` / ``_bwd_config``). bf16, causal, B = 1, H = 16,
block 128, the layout of ``scripts/bench_block_sparse.py`` (local 2K window, sink block, dilated blocks per head) and
an all-dense layout. Each candidate's output (and gradients) is checked against the default config's before timing.
``--tma on off`` sweeps every config with tensor-descriptor (TMA) loads and with pointer loads; the registers and
spills of each compiled kernel are printed and recorded.

    python benchmarks/tune_block_sparse.py --n 65536 --dims 128 64 --out results/tune_block_sparse.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
from bench_block_sparse import fixed_layout  # noqa: E402
from timing import cuda_median_ms  # noqa: E402

from hf_dilated.ops.block_sparse import dense_blocks  # noqa: E402
from hf_dilated.ops.layout import resolve_layout  # noqa: E402
from hf_dilated.ops.triton import block_sparse as bs  # noqa: E402

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
FWD = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
       (64, 128, 4, 3), (128, 64, 8, 4), (128, 32, 4, 4), (64, 64, 4, 4), (64, 128, 8, 3), (64, 64, 4, 2)]
DQ = [(64, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3),
      (128, 128, 8, 2), (64, 128, 8, 2), (128, 64, 4, 2)]
KV = [(64, 128, 8, 2), (32, 64, 4, 3), (32, 128, 8, 2), (64, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3),
      (64, 64, 8, 2), (128, 128, 8, 2), (16, 128, 4, 3), (32, 64, 4, 4)]


def compiled_stats(fn) -> dict:
    """``{(BLOCK_M, BLOCK_N, warps, stages, TMA): (registers, spills)}`` of the kernels ``fn`` has compiled."""
    out = {}
    for caches in getattr(fn, "device_caches", {}).values():
        for kern in caches[0].values():
            try:
                kern._init_handles()
                c = kern.src.constants if hasattr(kern.src, "constants") else {}
                names = {k if isinstance(k, str) else fn.arg_names[k[0]]: v for k, v in c.items()}
                key = (names.get("BLOCK_M"), names.get("BLOCK_N"), kern.metadata.num_warps, kern.metadata.num_stages,
                       names.get("TMA"))
                out[key] = (kern.n_regs, kern.n_spills)
            except Exception as e:  # noqa: BLE001 (introspection differs between Triton versions)
                out[("?",)] = str(e)[:80]
    return out


def cfg(t):
    m, n, w, s = t
    return dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--dims", type=int, nargs="+", default=[128])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tma", nargs="+", default=["on"], choices=["on", "off"])
    ap.add_argument("--kernels", nargs="*", default=["fwd", "dq", "kv"], choices=["fwd", "dq", "kv"])
    args = ap.parse_args()
    # The sweep times the portable kernels' configs (_fwd_config / _bwd_config); on sm_90 the Gluon dK/dV kernel
    # would otherwise run in place of every dK/dV candidate.
    os.environ["HF_DILATED_GLUON"] = "0"
    use_tma0 = bs.use_tma
    dev, H, blk = torch.device("cuda"), args.heads, 128
    fwd0, bwd0 = bs._fwd_config, bs._bwd_config
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
              "heads": H, "block": blk, "rows": []}
    nd = min(args.n, 16384)  # the dense layout at a smaller N: the same tiles, a quicker sweep
    for D in args.dims:
        scale = D ** -0.5
        for name, N, lay in (("bench_layout", args.n, fixed_layout(args.n, blk, dev)),
                             ("dense", nd, dense_blocks(-(-nd // blk), blk, device=dev))):
            q, k, v, do = (torch.randn(1, H, N, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
            t = resolve_layout(1, N, N, dev)
            tokens = (t.q_pos, t.q_seq, t.q_valid, t.k_pos, t.k_seq, t.k_valid)
            ptr, flat = lay.transposed
            fwd = lambda: bs.forward(q, k, v, lay.kv_count, lay.kv_index, tokens, blk, True, True, scale)  # noqa
            o, lse = fwd()
            bwd = lambda: bs.backward(do, q, k, v, o, lse, lay.kv_count, lay.kv_index, ptr, flat, tokens, blk,  # noqa
                                      True, True, scale)
            ref_o, ref_g = o.clone(), [g.clone() for g in bwd()]
            default_q, default_kv = bwd0(blk, D, q.dtype, True)

            def sweep(kind, cands, run, check, tma):
                best = None
                bs.use_tma = use_tma0 if tma == "on" else (lambda *a, **k: False)
                for c in cands:
                    if blk % c[0] or blk % c[1]:
                        continue
                    try:
                        if kind == "fwd":
                            bs._fwd_config = lambda *a, c=c: cfg(c)
                        elif kind == "dq":
                            bs._bwd_config = lambda *a, c=c: (cfg(c), default_kv)
                        else:
                            bs._bwd_config = lambda *a, c=c: (default_q, cfg(c))
                        err = check(run())
                        ms = cuda_median_ms(run, warmup=2, reps=7) if err < 2e-2 else float("nan")
                    except Exception as e:  # noqa: BLE001 (out of shared memory etc.: skip the config)
                        err, ms = float("nan"), float("nan")
                        print(f"  {kind} {c}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    finally:
                        bs._fwd_config, bs._bwd_config = fwd0, bwd0
                    row = dict(layout=name, N=N, D=D, kernel=kind, tma=tma, config=c, ms=ms, err=err)
                    report["rows"].append(row)
                    print(f"{name} D={D} {kind} tma={tma} {c}: {ms:.3f} ms (err {err:.1e})", flush=True)
                    if ms == ms and (best is None or ms < best[1]):
                        best = (c, ms)
                bs.use_tma = use_tma0
                print(f"BEST {name} D={D} {kind} tma={tma}: {best}", flush=True)
                report["rows"].append(dict(layout=name, D=D, kernel=kind, tma=tma, best=best and best[0],
                                           best_ms=best and best[1]))

            checks = {"fwd": (FWD, fwd, lambda r: rel(r[0], ref_o)), "dq": (DQ, bwd, lambda r: rel(r[0], ref_g[0])),
                      "kv": (KV, bwd, lambda r: max(rel(r[1], ref_g[1]), rel(r[2], ref_g[2])))}
            for tma in args.tma:
                for kind in args.kernels:
                    sweep(kind, *checks[kind], tma)
            # the default pair, and the two kernels' share of the backward
            fwd_ms, bwd_ms = cuda_median_ms(fwd, 7), cuda_median_ms(bwd, 7)
            report["rows"].append(dict(layout=name, N=N, D=D, default=True, fwd_ms=fwd_ms, bwd_ms=bwd_ms))
            print(f"{name} N={N} D={D} default fwd {fwd_ms:.3f} ms, bwd {bwd_ms:.3f} ms", flush=True)
    for fn in (bs.bs_fwd_kernel, bs.bs_bwd_dq_kernel, bs.bs_bwd_dkdv_kernel):
        stats = compiled_stats(fn)
        report.setdefault("registers_spills", {})[fn.__name__] = {str(k): v for k, v in stats.items()}
        for key, val in sorted(stats.items(), key=str):
            print(f"{fn.__name__} (BLOCK_M, BLOCK_N, warps, stages, TMA)={key}: registers, spills = {val}", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
