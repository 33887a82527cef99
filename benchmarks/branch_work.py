"""How many (query, key) pairs the dilated forward's tensor cores compute per head, against the pairs the pattern
needs, under two schedules of the same branches, at given tile sizes. No GPU: it counts tiles.

- ``per-branch``: each branch ``(w, r)`` its own launch (the landed kernels): a segment's ``w / r`` dilated rows in
  query tiles of ``block_m``, each against the key tiles of ``block_n`` up to its last row (causal), a branch's output
  merged into the earlier ones' (a float32 read-modify-write per launch but the first).
- ``one-pass``: issue 14's "all branches of a query tile in one pass with one online softmax" (no merge). With nested
  rates (each divides the next) a row that a rate-``r_j`` branch selects is selected by every lower-rate branch too,
  so the rows split into classes by the highest branch that selects them; a class's rows are evenly strided
  (``r_{j+1}`` apart), a query tile holds ``block_m`` of them, and runs the key tiles of every branch up to ``j``. Its
  rows then span ``block_m * r_{j+1}`` positions, so against a lower-rate branch the causal boundary crosses many key
  tiles at once: the tensor cores compute the masked part of every one.

    python benchmarks/branch_work.py                       # LongNet's branches at 64K, 128 x 128 and 64 x 64 tiles
    python benchmarks/branch_work.py --n 262144 --tiles 64x64 128x128 --json out.json

Head offsets (LongNet's ``h % r``) move which rows a branch selects, not how many pairs: the count is for offset 0.
Session 30's reading (``benchmarks/NOTES_triton.md``): at LongNet's branches the one-pass schedule computes 13-26%
more pairs than the pattern needs, against 3-6% per branch, more than the merge it removes (8.3-8.5% of the forward,
session 28)."""

from __future__ import annotations

import argparse
import json
import sys

LONGNET = [(2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(branches: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The branches sorted by rate; ``ValueError`` unless every segment length is a multiple of its rate and of the
    lower rates' segment lengths, each rate divides the next, and ``n`` is a positive multiple of every segment
    length."""
    if not branches:
        raise ValueError("branches: at least one (w, r) is needed")
    if n <= 0:
        raise ValueError(f"n: must be positive, got {n}")
    out = sorted(branches, key=lambda b: b[1])
    for i, (w, r) in enumerate(out):
        if w <= 0 or r <= 0 or w % r:
            raise ValueError(f"branches: segment length {w} must be a positive multiple of its rate {r}")
        if n % w:
            raise ValueError(f"n: {n} must be a multiple of every segment length ({w})")
        if i and (r % out[i - 1][1] or w % out[i - 1][0]):
            raise ValueError(f"branches: rates and segment lengths must each divide the next "
                             f"({out[i - 1]} -> {(w, r)})")
    return out


def per_branch(branches, n: int, block_m: int, block_n: int) -> dict:
    """Computed and needed pairs per head with one launch per branch (causal)."""
    computed = needed = 0
    for w, r in _check(branches, n):
        m = w // r  # dilated rows (and keys) of a segment
        seg_computed = 0
        for t in range(_cdiv(m, block_m)):
            last = min((t + 1) * block_m, m)  # keys up to the tile's last row
            seg_computed += block_m * _cdiv(last, block_n) * block_n
        computed += (n // w) * seg_computed
        needed += (n // w) * m * (m + 1) // 2
    return dict(computed=computed, needed=needed)


def one_pass(branches, n: int, block_m: int, block_n: int) -> dict:
    """Computed and needed pairs per head with one pass over every branch per query tile of a row class (causal).
    A tile whose rows fall in two segments of a branch counts each part against its own segment's keys."""
    br = _check(branches, n)
    computed = needed = 0
    for j, (_, r) in enumerate(br):
        top = j == len(br) - 1
        stride = r if top else br[j + 1][1]
        for off in ([0] if top else range(r, stride, r)):  # the class's rows: p = off (mod stride)
            rows = list(range(off, n, stride))
            for t in range(0, len(rows), block_m):
                tile = rows[t:t + block_m]
                for w_b, r_b in br[:j + 1]:
                    parts: dict[int, list[int]] = {}
                    for p in tile:
                        parts.setdefault(p // w_b, []).append(p)
                    for seg, ps in parts.items():
                        keys = [(p - seg * w_b) // r_b + 1 for p in ps]  # dilated keys of the segment up to p
                        computed += block_m * _cdiv(max(keys), block_n) * block_n
                        needed += sum(keys)
    return dict(computed=computed, needed=needed)


def table(branches, n: int, tiles: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for bm, bn in tiles:
        for name, fn in (("per-branch", per_branch), ("one-pass", one_pass)):
            c = fn(branches, n, bm, bn)
            rows.append(dict(schedule=name, n=n, block_m=bm, block_n=bn, **c, extra=c["computed"] / c["needed"] - 1))
    return rows


def _tiles(s: str) -> tuple[int, int]:
    try:
        m, k = (int(x) for x in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"tiles: {s!r} is not BLOCK_MxBLOCK_N, e.g. 128x128") from None
    if m <= 0 or k <= 0:
        raise argparse.ArgumentTypeError(f"tiles: {s!r} needs positive sizes")
    return m, k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=65536, help="sequence length (a multiple of every segment length)")
    ap.add_argument("--branches", nargs="+", default=[f"{w}/{r}" for w, r in LONGNET],
                    help="segment length / rate of each branch, e.g. 2048/1 4096/2")
    ap.add_argument("--tiles", nargs="+", type=_tiles, default=[(128, 128), (64, 64)], help="BLOCK_MxBLOCK_N ...")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    try:
        branches = [tuple(int(x) for x in b.split("/")) for b in args.branches]
        if any(len(b) != 2 for b in branches):
            raise ValueError
    except ValueError:
        ap.error(f"--branches: each must be W/R with integers, got {args.branches}")
    try:
        rows = table(branches, args.n, args.tiles)
    except ValueError as e:
        ap.error(str(e))
    print(f"{'schedule':<11} {'tile':>8} {'computed':>14} {'needed':>14} {'extra':>7}")
    for r in rows:
        print(f"{r['schedule']:<11} {r['block_m']:>4}x{r['block_n']:<3} {r['computed']:>14,} {r['needed']:>14,} "
              f"{r['extra']:>6.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(branches=branches, command="python " + " ".join(sys.argv), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
