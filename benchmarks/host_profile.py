"""Where a small problem's host time goes, frame by frame and thread by thread: a loop of dilated-attention calls to
sample with py-spy, and a summary of what py-spy wrote.

``timeline.py`` splits a call's host time into a few timed buckets (launchers, launches, driver); this names the
frames. The backward runs on autograd's own thread while the main thread waits in ``_engine_run_backward``, which
cProfile mixes up (``NOTES_triton.md``, session 38) and py-spy's ``--threads`` keeps apart. At 16K, SmolLM2's
9 / 3 / 64 forward+backward spent 2.2 ms of host time against 1.07 ms of GPU time on the H200's machine (session 40).

    pip install -e ".[bench]"           # py-spy is among the benchmarks' extras
    py-spy record --format raw -o loop.raw -r 250 --threads --nonblocking -- \\
        python benchmarks/host_profile.py run --shape 9/3/64 --n 16384 --seconds 10
    python benchmarks/host_profile.py summarize loop.raw --top 25

``run`` times the loop (calls synchronised every 10) and prints the host+GPU ms a call. ``summarize`` counts, per
thread, the samples in which each frame appears (inclusive) and the frame at the top of each sample (self), as shares
of that thread's samples. Left out: samples that compile kernels or import modules (the warm-up's), and the main
thread's samples outside ``timed_loop``. ``--nonblocking`` keeps py-spy from pausing the process (it loses some
samples instead: the summary is of shares, not counts). A CPU run (``TRITON_INTERPRET=1``, small ``--n``) times the
interpreter, not the host's work.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from bench_attention import parse_shape  # noqa: E402

WARM_UP = re.compile(r"_do_compile|importlib|<frozen importlib")
LOOP = "timed_loop"
THREAD_ID = re.compile(r"\((\d+)\)")
SITE = re.compile(r"\(/\S*?/(?:site-packages|dist-packages)/")


def frame_name(frame: str) -> str:
    """A frame as py-spy writes it (``function (path:line)``), with site-packages' directories dropped."""
    return SITE.sub("(", frame)


def summarize(lines, top: int = 25) -> dict:
    """``{thread: dict(samples, inclusive=[(frame, share)], self=[(frame, share)])}`` from py-spy's raw format (one
    ``thread;frame;frame... count`` line per distinct stack, outermost frame first); threads are ``main`` (the thread
    id py-spy names ``MainThread`` on any line: it does not name it on every one) and ``other``."""
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total: collections.Counter = collections.Counter()
    rows = []
    for line in lines:
        line = line.rstrip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            raise ValueError(f"not a py-spy raw line (`thread;frame;... count`): {line[:80]!r}")
        thread, *frames = stack.split(";")
        rows.append((THREAD_ID.search(thread), "MainThread" in thread, frames, int(count)))
    main_ids = {tid.group(1) for tid, named, _, _ in rows if tid and named}
    for tid, named, frames, n in rows:
        if not frames or any(WARM_UP.search(f) for f in frames):
            continue
        thread = "main" if named or (tid and tid.group(1) in main_ids) else "other"
        if thread == "main" and not any(f.startswith(LOOP + " ") for f in frames):
            continue
        total[thread] += n
        for name in {frame_name(f) for f in frames}:
            inclusive[thread][name] += n
        own[thread][frame_name(frames[-1])] += n
    return {t: dict(samples=total[t],
                    inclusive=[(f, round(c / total[t], 4)) for f, c in inclusive[t].most_common(top)],
                    self=[(f, round(c / total[t], 4)) for f, c in own[t].most_common(top)])
            for t in sorted(total)}


def timed_loop(call, seconds: float) -> tuple[float, int]:
    """``call()`` over and over for ``seconds``, synchronised every 10 calls: ``(ms a call, calls)``."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            call()
        n += 10
        sync()
    return (time.perf_counter() - t0) / n * 1e3, n


def run(args) -> None:
    import torch

    from bench_attention import LONGNET, run_dilated

    H, Hk, D = args.heads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, H, args.n, D, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(1, Hk, args.n, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    do = torch.randn_like(q) if args.mode == "fwdbwd" else None

    def call():
        return run_dilated("triton", q, k, v, LONGNET, do)

    for _ in range(args.warmup):
        call()
    ms, n = timed_loop(call, args.seconds)
    print(f"{args.mode} {H}/{Hk}/{D} N={args.n} on {device}: {ms:.3f} ms a call over {n} calls")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="a loop of dilated-attention calls to sample with py-spy")
    r.add_argument("--shape", default="9/3/64", help="H/Hk/D")
    r.add_argument("--n", type=int, default=16384, help="tokens")
    r.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwdbwd")
    r.add_argument("--seconds", type=float, default=10.0, help="how long the timed loop runs")
    r.add_argument("--warmup", type=int, default=10, help="calls before the loop (compiles kernels)")
    s = sub.add_parser("summarize", help="inclusive and self shares per thread from `py-spy record --format raw`")
    s.add_argument("raw", help="the file py-spy wrote")
    s.add_argument("--top", type=int, default=25, help="frames to list per thread and kind")
    s.add_argument("--json", help="also write the summary here")
    args = ap.parse_args(argv)
    if args.command == "summarize":
        if args.top < 1:
            ap.error(f"--top must be >= 1, got {args.top}")
        if not os.path.isfile(args.raw):
            ap.error(f"raw must be an existing file written by `py-spy record --format raw`, got {args.raw!r}")
        try:
            result = summarize(open(args.raw), args.top)
        except ValueError as e:
            ap.error(str(e))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        for thread, s in result.items():
            print(f"{thread} thread: {s['samples']} samples")
            for kind in ("inclusive", "self"):
                print(f"  {kind}:")
                for frame, share in s[kind]:
                    print(f"    {share:6.1%}  {frame[:110]}")
        return 0
    try:
        args.heads = parse_shape(args.shape, "--shape")
    except ValueError as e:
        ap.error(str(e))
    for name in ("n", "seconds"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
