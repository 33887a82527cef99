"""The long property run: thousands of random cases of the PyTorch reference backend against the float64 oracle.

Each case is ``tests/test_properties.build_case`` drawn from ``random.Random(seed)`` (configurations, shapes, masks
with holes and whole rows, packing, decoding, GQA ratios, dtypes, head dims 1..256, windows, global tokens, dropout)
and checked as the CI property test checks it: outputs, lse and every gradient. A failure records its seed (replay:
``--replay SEED``). Writes a JSON summary.

    nice -n 19 python scripts/property_check.py --minutes 10 --out benchmarks/results/property_check_reference.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from hf_dilated.ops.reference import dilated_attention_reference  # noqa: E402
from test_properties import TOL, RandomChooser, build_case, check_case  # noqa: E402


def run_one(seed: int) -> tuple[str, str | None]:
    case = build_case(RandomChooser(seed))
    try:
        check_case(dilated_attention_reference, case, TOL)
    except Exception:  # noqa: BLE001 - every failure is recorded with its seed
        return case.description, traceback.format_exc(limit=3)
    return case.description, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="time budget (default 10)")
    parser.add_argument("--max-examples", type=int, default=1_000_000, help="stop after this many cases")
    parser.add_argument("--seed", type=int, default=None, help="first case seed (default: random)")
    parser.add_argument("--replay", type=int, default=None, help="run only the case of this seed, verbosely")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "property_check_reference.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.replay is not None:
        description, error = run_one(args.replay)
        print(description)
        print(error or "passed")
        return 1 if error else 0
    first = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    start = time.monotonic()
    count, failures = 0, []
    kinds = collections.Counter()
    while count < args.max_examples and time.monotonic() - start < args.minutes * 60:
        seed = first + count
        description, error = run_one(seed)
        count += 1
        for field in description.split():
            if field.split("=")[0] in ("dtype", "mask", "layer", "decode", "causal", "window", "global_tokens",
                                         "dropout_p"):
                kinds[field if "=" in field and not field.startswith("window=") or field == "window=None"
                      else "window=int"] += 1
        if error:
            failures.append(dict(seed=seed, case=description, error=error))
            print(f"FAIL seed={seed}: {description}\n{error}", flush=True)
        if count % 200 == 0:
            print(f"{count} cases, {len(failures)} failures, {time.monotonic() - start:.0f} s", flush=True)
    summary = dict(
        backend="torch (ops/reference.py)", examples=count, failures=len(failures), failed_cases=failures[:50],
        first_seed=first, seconds=round(time.monotonic() - start, 1), coverage=dict(sorted(kinds.items())),
        torch=torch.__version__, python=platform.python_version(),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        replay="python scripts/property_check.py --replay SEED",
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{count} cases, {len(failures)} failures -> {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
