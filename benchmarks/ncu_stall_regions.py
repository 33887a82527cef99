"""Where a kernel's warps wait, by region of its code, from Nsight Compute's per-instruction (SASS) export: how much
of the time is the key-tile loop, how much the once-per-tile prologue and epilogue around it, how much the rest
(the program's entry, a producer warp's copies and waits, warps parked at a barrier).

    ncu --profile-from-start off -k regex:dilated_fwd_ws --launch-skip 4 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o fwd python benchmarks/profile_dilated.py
    ncu -i fwd.ncu-rep --page source --csv --print-source sass > fwd.csv
    python benchmarks/ncu_stall_regions.py fwd.csv --json fwd-regions.json   # or fwd.csv.gz
    python benchmarks/ncu_stall_regions.py fwd.csv --base probe.csv   # what this kernel runs and waits on more

Regions, by how often an instruction ran relative to the tensor-core instructions (``HGMMA`` / ``HMMA``): the **step
loop** ran at least half as often as the most frequent of them; **once per tile** between half and twice as often as
the least frequent (a peeled first or last step, and the epilogue beside it; where every tensor-core instruction is in
the loop this region is empty); the **rest** is everything else. Warp-stall samples are counted per region (their
share of all samples) with their stall reasons, and the instructions with the most samples are listed. Samples are
taken over all resident warps, idle ones included: a warp parked at a barrier for the whole kernel shows as
``barrier`` samples in the rest, not as lost issue slots of the warps that work.

``--base`` compares with another export of the same kernel (another build of it: a probe without one feature, the
code before a change), region by region: the instructions executed (warp level) and the samples on each side, and
the opcodes whose samples differ most, with their executions. Where both sides run under Nsight's locked clock the
sample difference is the time difference, and the opcodes say whether it is more work (executions up) or the same
work waiting longer (executions equal, samples up)."""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import re
import sys
from pathlib import Path

REGIONS = ("step loop", "once per tile", "rest")
TENSOR_CORE = re.compile(r"\b(HGMMA|HMMA)\b")


def read(path: str | Path, name: str = "csv") -> dict[str, list[dict]]:
    """``{kernel name: [instruction]}`` from ``ncu -i REPORT --page source --csv --print-source sass``; each instruction
    is ``dict(address, source, samples, executed, stalls={reason: samples})`` (``name``: the argument that gave the
    path, for the error)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{name} must be an existing file written by `ncu -i REPORT --page source --csv "
                         f"--print-source sass`, got {str(path)!r}")
    kernels: dict[str, list[dict]] = {}
    header = None
    name = None
    with (gzip.open(path, "rt", newline="") if path.suffix == ".gz" else open(path, newline="")) as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                name, header = row[1], None
                kernels[name] = []
                continue
            if name is None:
                raise ValueError(f"{path} does not start with a 'Kernel Name' row: not an ncu source-page export")
            if header is None:
                header = {h: i for i, h in enumerate(row)}
                missing = {"Source", "# Samples", "Instructions Executed"} - set(header)
                if missing:
                    raise ValueError(f"{path} lacks the columns {sorted(missing)}: export it with `ncu -i REPORT "
                                     f"--page source --csv --print-source sass` from a report that has the "
                                     f"SourceCounters section")
                reasons = [h for h in row if h.startswith("stall_") and "Not Issued" not in h]
                continue

            def number(column):
                cell = row[header[column]].replace(",", "").strip() if column in header else ""
                return int(float(cell)) if cell else 0

            kernels[name].append(dict(
                address=row[header["Address"]] if "Address" in header else "",
                source=row[header["Source"]].strip(), samples=number("# Samples"),
                executed=number("Instructions Executed"),
                stalls={r[len("stall_"):]: number(r) for r in reasons if number(r)},
            ))
    if not kernels:
        raise ValueError(f"{path} holds no kernel: not an ncu source-page export")
    return kernels


def tensor_core_counts(instructions: list[dict]) -> list[int]:
    """The distinct execution counts of the tensor-core instructions that ran, ascending."""
    return sorted({i["executed"] for i in instructions if TENSOR_CORE.search(i["source"]) and i["executed"]})


def classify(instructions: list[dict]) -> list[str]:
    """The region of each instruction (``REGIONS``), by its execution count against the tensor-core instructions'."""
    counts = tensor_core_counts(instructions)
    if not counts:
        return ["rest"] * len(instructions)
    most, least = max(counts), min(counts)
    regions = []
    for i in instructions:
        n = i["executed"]
        if n >= most / 2:
            regions.append("step loop")
        elif least < most / 2 and least / 2 <= n < 2 * least:
            regions.append("once per tile")
        else:
            regions.append("rest")
    return regions


def summarize(instructions: list[dict], top: int = 12) -> dict:
    """Samples per region (count, share, stall reasons), the tensor-core execution counts the regions were cut at,
    and the ``top`` instructions by samples."""
    regions = classify(instructions)
    total = sum(i["samples"] for i in instructions) or 1
    out = {}
    for region in REGIONS:
        members = [i for i, r in zip(instructions, regions) if r == region]
        samples = sum(i["samples"] for i in members)
        stalls: dict[str, int] = {}
        for i in members:
            for reason, n in i["stalls"].items():
                stalls[reason] = stalls.get(reason, 0) + n
        out[region] = dict(instructions=len(members), samples=samples, share=samples / total,
                           stalls=dict(sorted(stalls.items(), key=lambda kv: -kv[1])))
    ranked = sorted(range(len(instructions)), key=lambda n: -instructions[n]["samples"])[:top]
    return dict(samples=total, tensor_core_executed=tensor_core_counts(instructions), regions=out,
                top=[dict(index=n, source=instructions[n]["source"], samples=instructions[n]["samples"],
                          executed=instructions[n]["executed"], region=regions[n], stalls=instructions[n]["stalls"])
                     for n in ranked])


PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


def opcode(source: str) -> str:
    """An instruction's opcode with its modifiers (``MUFU.EX2``, ``WARPGROUP.DEPBAR.LE``), its predicate dropped."""
    return (PREDICATE.sub("", source).split() or ["?"])[0]


def compare(instructions: list[dict], base: list[dict], top: int = 12) -> dict:
    """Per region, this kernel against ``base`` (another build of it): instructions executed and samples on each
    side, and the ``top`` opcodes by the size of their sample difference, with their executions on each side."""
    out = {}
    sides = [(instructions, classify(instructions)), (base, classify(base))]
    for region in REGIONS:
        ops: dict[str, list[int]] = {}  # opcode -> [executed, base executed, samples, base samples]
        for side, (instrs, regions) in enumerate(sides):
            for i, r in zip(instrs, regions):
                if r == region:
                    o = ops.setdefault(opcode(i["source"]), [0, 0, 0, 0])
                    o[side] += i["executed"]
                    o[2 + side] += i["samples"]
        totals = [sum(o[k] for o in ops.values()) for k in range(4)]
        ranked = sorted(ops.items(), key=lambda kv: -abs(kv[1][2] - kv[1][3]))[:top]
        out[region] = dict(executed=totals[0], base_executed=totals[1], samples=totals[2], base_samples=totals[3],
                           opcodes=[dict(opcode=k, executed=v[0], base_executed=v[1], samples=v[2], base_samples=v[3])
                                    for k, v in ranked])
    return out


def pair_kernels(kernels: dict[str, list[dict]], base: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """The (kernel, base kernel) pairs to compare: the names both exports hold, or their only kernels."""
    common = [name for name in kernels if name in base]
    if common:
        return [(name, name) for name in common]
    if len(kernels) == 1 and len(base) == 1:
        return [(next(iter(kernels)), next(iter(base)))]
    raise ValueError(f"base shares no kernel name with csv (csv: {sorted(kernels)}, base: {sorted(base)}) and they "
                     f"do not hold one kernel each: export the same kernel from both reports")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass > this file")
    ap.add_argument("--top", type=int, default=12, help="instructions with the most samples to list")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--base", help="another export of the same kernel to compare with, region by region")
    args = ap.parse_args(argv)
    if args.top < 0:
        ap.error(f"--top must be >= 0, got {args.top}")
    try:
        kernels = read(args.csv)
        base = read(args.base, "--base") if args.base else {}
        pairs = pair_kernels(kernels, base) if args.base else []
    except ValueError as e:
        ap.error(str(e))
    result = {name: summarize(instructions, args.top) for name, instructions in kernels.items()}
    comparison = {name: dict(base_kernel=b, regions=compare(kernels[name], base[b], args.top)) for name, b in pairs}
    if args.json:  # before the text: a reader that stops early (``| head``) must not cost the summary
        summary = dict(csv=str(args.csv), kernels=result)
        if args.base:
            summary.update(base=str(args.base), comparison=comparison)
        Path(args.json).write_text(json.dumps(summary, indent=1))
    for name, instructions in kernels.items():
        s = result[name]
        print(f"{name}: {s['samples']} warp-stall samples over {len(instructions)} instructions; tensor-core "
              f"instructions ran {s['tensor_core_executed']} times")
        for region, r in s["regions"].items():
            reasons = ", ".join(f"{k} {v / max(r['samples'], 1):.0%}" for k, v in list(r["stalls"].items())[:5])
            print(f"  {region:14s} {r['share']:6.1%} of samples ({r['instructions']} instructions): {reasons}")
        for t in s["top"]:
            print(f"    {t['samples']:7d}  ran {t['executed']:>9d}  {t['region']:13s} {t['source'][:60]}")
    for name, c in comparison.items():
        print(f"{name} against {args.base} ({c['base_kernel']}): executed / samples, this build (base)")
        for region, r in c["regions"].items():
            print(f"  {region:14s} executed {r['executed']} ({r['base_executed']}), samples {r['samples']} "
                  f"({r['base_samples']}, {r['samples'] - r['base_samples']:+d})")
            for o in r["opcodes"]:
                print(f"    {o['samples'] - o['base_samples']:+7d} samples  {o['opcode'][:32]:32s} executed "
                      f"{o['executed']} ({o['base_executed']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
